"""Which checkpoints of a run are kept, and which one a user means by `latest`, `best` or a step.

Retention is checkpoint.keep (the newest N) or, with checkpoint.keep_best, the N best by checkpoint.best_metric
(lowest eval loss by default) plus the newest: Ray's own rule for `CheckpointConfig(num_to_keep=N,
checkpoint_score_attribute=best_metric, checkpoint_score_order=min|max)`, which prunes the checkpoints it
registers. Without Ray raysft prunes by the same rule (`prune`, called by the sinks), so a run's directory looks
the same either way. A checkpoint's value is the one recorded with it (its trainer_state.json, or for a gen/ score
its generation-evaluation record, raysft.checkpoint.gen_record); one without ranks last.

Under Ray, Ray alone deletes: its snapshot of the checkpoints it tracks must name only directories that exist, or
the next launch of the run fails. A report dies with a worker killed before Ray collected it, and Ray never tracks
(so never deletes) that checkpoint; raysft resumes from it all the same. `unregistered` names those for the
relaunch to register, so Ray's retention covers every complete checkpoint of the run and the directory converges
to what checkpoint.keep (or keep_best) keeps.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from raysft.checkpoint.discovery import LAUNCH_CONFIG_FILE, checkpoint_dirs
from raysft.checkpoint.gen_record import recorded_metric
from raysft.checkpoint.manifest import MANIFEST_FILE, incomplete_reason
from raysft.checkpoint.state import STATE_FILE, CheckpointError
from raysft.config import CheckpointConfig, best_mode
from raysft.storage import Location, location, native


def eval_loss(ckpt) -> float | None:
    """The eval loss recorded with a checkpoint; None when it was not validated or its state is unreadable."""
    try:
        value = json.loads((location(ckpt) / STATE_FILE).read_text()).get("eval_loss")
    except (OSError, ValueError, AttributeError):
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


LOWEST_EVAL_LOSS = ("eval_loss", "min")  # checkpoint.best_metric and its mode (min or max) by default


def run_best(run_dir, metric: str | None = None) -> tuple[str, str]:
    """What `--checkpoint best` ranks a run's checkpoints by, and whether lower or higher is better: `metric` (the
    CLI's --metric) when given, else the checkpoint.best_metric and best_mode of the run's latest launch, which it
    recorded in LAUNCH_CONFIG_FILE; a run without that record (an older raysft's), eval_loss. The mode is the
    recorded best_mode for the recorded metric, else the rule of best_mode "auto" (min for ...loss, else max)."""
    try:
        recorded = json.loads((location(run_dir) / LAUNCH_CONFIG_FILE).read_text())["checkpoint"]
        mode = recorded.get("best_mode")
        ranking = CheckpointConfig(best_metric=str(recorded["best_metric"]),
                                   best_mode=mode if mode in ("min", "max") else "auto")
    except (OSError, ValueError, KeyError, TypeError):
        ranking = CheckpointConfig()
    if metric is not None and metric != ranking.best_metric:
        ranking = CheckpointConfig(best_metric=metric)
    return ranking.best_metric, best_mode(ranking)


def best_first(checkpoints: list, best: tuple[str, str] = LOWEST_EVAL_LOSS) -> list:
    """The checkpoints that recorded the metric best[0], best first (mode best[1]: "min" or "max"; of equal ones,
    the newer); `checkpoints` oldest first. Its value is what the checkpoint recorded (gen_record.recorded_metric:
    the trainer state's validation metrics, or the generation evaluation's record)."""
    metric, mode = best
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * value, -i, c) for i, c in enumerate(checkpoints)
              if (value := recorded_metric(c, metric)) is not None]
    return [c for _, _, c in sorted(scored, key=lambda s: s[:2])]


def to_prune(complete: list, keep: int, keep_best: int = 0, best: tuple[str, str] = LOWEST_EVAL_LOSS) -> list:
    """The complete checkpoints (oldest first) that retention deletes; never the newest."""
    if not complete:
        return []
    if keep_best:
        kept = {str(c) for c in best_first(complete, best)[:keep_best]} | {str(complete[-1])}
        return [c for c in complete if str(c) not in kept]
    return complete[: -keep] if keep else []


def complete_checkpoints(run_dir) -> list:
    """The run's checkpoints that have a manifest, oldest first."""
    return [d for d in checkpoint_dirs(run_dir) if (location(d) / MANIFEST_FILE).is_file()]


def prune(run_dir: Path | Location, keep: int, keep_best: int = 0, best: tuple[str, str] = LOWEST_EVAL_LOSS) -> None:
    """Delete what retention does not keep, local or on remote storage. Best effort: a checkpoint that could not
    be deleted is only one more kept."""
    for old in to_prune(complete_checkpoints(run_dir), keep, keep_best, best):
        with contextlib.suppress(OSError):
            location(old).fs.delete_dir(location(old).path)


def unregistered(run_dir: Path | Location, resume_dir: Path | Location | None,
                 registered_latest: str | None) -> list:
    """The complete checkpoints, oldest first, that are newer (by name, which sorts by step) than
    `registered_latest`, the name of the latest checkpoint Ray registered (None: none), up to and including
    `resume_dir`, the one a launch resumes from. Ray registers in the order of the saves, so these were never
    registered: their reports died with a worker. None when Ray's latest is the one resumed from or newer (a newer
    one that is incomplete is Ray's to prune)."""
    if resume_dir is None or (registered_latest is not None and registered_latest >= resume_dir.name):
        return []
    return [c for c in complete_checkpoints(run_dir)
            if (registered_latest is None or c.name > registered_latest) and c.name <= resume_dir.name]


def select_checkpoint(path: str | object, which: str = "latest",
                      best: tuple[str, str] = LOWEST_EVAL_LOSS) -> Location | object:
    """A checkpoint directory as it is, or in a run directory the checkpoint `which` names: "latest", "best" (the
    best recorded value of the metric best[0], lowest eval loss by default) or a step number. CheckpointError
    naming the run and what it holds otherwise."""
    where = location(path)
    if (where / STATE_FILE).is_file():
        if which != "latest":
            raise CheckpointError(f"{path} is a checkpoint; --checkpoint {which} picks one in a run directory")
        return native(where)
    candidates = [c for c in complete_checkpoints(where) if incomplete_reason(c, checksums=False) is None]
    if not candidates:
        raise CheckpointError(f"{path}: neither a checkpoint (no {STATE_FILE}) nor a run directory with a complete "
                              "checkpoint")
    if which == "latest":
        return candidates[-1]
    if which == "best":
        ranked = best_first(candidates, best)
        if not ranked:
            raise CheckpointError(f"{path}: no checkpoint of the run has recorded {best[0]}, the metric --checkpoint "
                                  "best ranks by (eval_loss needs data.eval_paths or data.eval_fraction, a gen/ "
                                  "score the eval section): pick another with --metric, or latest or a step")
        return ranked[0]
    if not which.isdigit():
        raise CheckpointError(f"--checkpoint {which!r}: expected latest, best or a step number")
    steps = {json.loads((location(c) / STATE_FILE).read_text())["step"]: c for c in candidates}
    if int(which) not in steps:
        raise CheckpointError(f"{path}: no complete checkpoint of step {which} (there are: {sorted(steps)})")
    return steps[int(which)]
