"""Rank 0's per-step metrics: one JSON line per step in the run directory, and a progress line in the log.

ray.train.report is a slow barrier, so per-step numbers are written here and Ray only sees checkpoint-time ones.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: Path | None, max_steps: int, log_every: int):
        """run_dir None: this rank logs nothing (every rank but 0)."""
        self.path = run_dir / METRICS_FILE if run_dir else None
        self.max_steps, self.log_every = max_steps, log_every
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def event(self, kind: str, **fields) -> None:
        """A non-step record (start, resume, checkpoint), so a reader can tell repeated steps after a resume."""
        self._write({"event": kind, "time": time.time(), **fields})
        if self.path:
            self._print(f"raysft: {kind} " + " ".join(f"{k}={v}" for k, v in fields.items()))

    def step(self, step: int, metrics: dict) -> None:
        self._write({"step": step, "time": time.time(), **metrics})
        if self.path and (step % self.log_every == 0 or step == self.max_steps):
            self._print(f"step {step}/{self.max_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
                        f"grad_norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:.0f} tok/s | "
                        f"peak mem {metrics['peak_mem_gb']:.2f} GiB"
                        + (f" | loss scale {metrics['loss_scale']:g}" if "loss_scale" in metrics else ""))

    @staticmethod
    def _print(line: str) -> None:
        # sys.stdout, not print: Ray Train patches print in workers and would show every line twice
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def _write(self, record: dict) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this worker: the CUDA caching allocator's peak, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
