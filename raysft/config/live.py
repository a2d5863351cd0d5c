"""The `live` section: live fault tolerance under Ray (raysft.training.live, docs/RELIABILITY.md).

A section of its own module, composed into TrainConfig by raysft.config.sections like the others; its docstrings
are part of the configuration reference (sections.reference_markdown reads them here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LiveConfig:
    enabled: bool = False
    """Live fault tolerance (Ray only; the liveft extra and Ray 2.60): every worker is a replica group of one that
    trains in a torchft quorum with the others. A lost worker costs the others about live.heartbeat_timeout_ms,
    not a restart: they redo the step it failed in on the whole global batch and go on; Ray replaces only the lost
    one, which heals from a live worker. Each worker holds the whole model (no sharding across workers), so it
    suits LoRA or a model that fits one device; no elastic widths, memory tier or generation evaluation with it.
    Checkpoints are registered with Ray when the launch ends, with every worker present."""
    heartbeat_timeout_ms: int = 1000
    """How long the quorum's Lighthouse waits for a silent worker before the others go on without it: the
    survivors' pause after a fault."""
    join_timeout_ms: int = 10000
    """How long a launch's first quorum waits for every worker to be heard, and a quorum for workers that are alive
    but have not asked to join it yet."""
    timeout_s: float = 60.0
    """How long a worker waits for a quorum's collective (an all-reduce of the step) before it fails (and Ray
    replaces it)."""
    quorum_timeout_s: float = 600.0
    """How long a worker waits for a quorum before it fails: it covers the writer's save of a checkpoint, a group's
    slow start, and, if the Lighthouse is gone, how long the workers wait before Ray restarts the run."""
