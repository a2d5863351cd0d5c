"""Rank 0's per-step metrics: one JSON line per step in the run directory, and a progress line in the log.

ray.train.report is a slow barrier, so per-step numbers are written here and Ray only sees checkpoint-time ones.
Model FLOPs utilization (MFU) counts 6 FLOPs per matmul parameter per token plus 12 · layers · hidden · n for
attention over a sample of n tokens (PaLM's formula; embedding lookups are free), against the device's dense
peak for the compute dtype where it is known.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from raysft.checkpoint.discovery import LAUNCH_CONFIG_FILE
from raysft.config import TrainConfig
from raysft.distributed.collectives import any_rank
from raysft.storage import Location, scratch_file
from raysft.training import METRICS_FILE
from raysft.training.trackers import Trackers

# Dense tensor-core peaks per GPU (vendor datasheets, SXM parts), TFLOP/s, by compute dtype; fp32 matmuls do not
# use TF32 in PyTorch by default, so no fp32 entry.
PEAK_TFLOPS = {"H200": {"bf16": 989.4, "fp16": 989.4}, "H100": {"bf16": 989.4, "fp16": 989.4},
               "A100": {"bf16": 312.0, "fp16": 312.0}, "L40S": {"bf16": 362.0, "fp16": 362.0}}
ETA_WINDOW = 20  # steps whose mean duration predicts the rest
UPLOAD_EVERY_S = 60.0  # on remote storage, the longest a step's record stays only on rank 0's node


class MetricsLogger:
    def __init__(self, run_dir: Path | Location | None, max_steps: int, log_every: int):
        """run_dir None: this rank logs nothing (every rank but 0). On remote storage (a Location), which cannot
        append, records go to a local copy of the run's metrics.jsonl that is uploaded whole after every event
        (start, resume, each checkpoint, stop) and at least every UPLOAD_EVERY_S."""
        self.path = run_dir / METRICS_FILE if run_dir else None
        self.max_steps, self.log_every = max_steps, log_every
        self.step_times: list[float] = []  # end of each step of this launch, for the ETA
        self.trackers: Trackers | None = None
        self.remote: Location | None = None
        if isinstance(self.path, Location):
            self.remote, self.path = self.path, scratch_file("raysft-metrics-", ".jsonl")
            if self.remote.is_file():  # earlier launches' records: this launch appends to them
                self.remote.download(self.path)
            self.uploaded_at = time.monotonic()
        elif self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def open_trackers(self, cfg: TrainConfig, resume_step: int | None) -> None:
        """Collective: rank 0 (the one with a path) opens metrics.trackers; a failure there is raised on every rank,
        not left to hang the others in their next collective."""
        if not cfg.metrics.trackers:
            return
        error = None
        if self.path:
            try:
                self.trackers = Trackers(cfg, resume_step)
            except Exception as e:  # noqa: BLE001 - raised below on every rank
                error = e
        if any_rank(error is not None):
            raise RuntimeError(f"rank 0 could not open metrics.trackers {cfg.metrics.trackers}: "
                               f"{type(error).__name__ if error else ''} {error or ''}".rstrip()) from error

    def close(self) -> None:
        """End this launch's tracker runs (a resumed launch reopens them)."""
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def event(self, kind: str, line: str | None = None, **fields) -> None:
        """A non-step record (start, resume, checkpoint), so a reader can tell repeated steps after a resume; on the
        terminal, `line` if given (what a user reads of it), else its fields."""
        self._write({"event": kind, "time": time.time(), **fields})
        if self.path:
            self._print(f"raysft: {kind} " + (line or " ".join(f"{k}={v}" for k, v in fields.items())))

    def step(self, step: int, metrics: dict, at: float | None = None) -> None:
        """The record of a step that ended at time `at` (default: now)."""
        now = time.time() if at is None else at
        self.step_times = [*self.step_times[-ETA_WINDOW:], now]
        eta = None
        if len(self.step_times) > 1:
            eta = (self.step_times[-1] - self.step_times[0]) / (len(self.step_times) - 1) * (self.max_steps - step)
        self._write({"step": step, "time": now, **metrics, **({"eta_s": round(eta, 1)} if eta is not None else {})})
        if self.trackers is not None:
            self.trackers.log(step, metrics)
        if self.path and (step % self.log_every == 0 or step == self.max_steps or "eval_loss" in metrics):
            self._print(progress_line(step, self.max_steps, metrics, eta))

    @staticmethod
    def _print(line: str) -> None:
        # sys.stdout, not print: Ray Train patches print in workers and would show every line twice
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def _write(self, record: dict) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.remote is not None and ("event" in record or time.monotonic() - self.uploaded_at > UPLOAD_EVERY_S):
            try:
                self.remote.upload(self.path)
                self.uploaded_at = time.monotonic()
            except OSError as e:  # a storage hiccup must not stop training; the next upload carries everything
                self._print(f"raysft: warning: cannot upload {self.remote}: {e}")


@dataclass
class StepResult:
    """What one step's forward and backward leave on this worker for the clip-and-step and StepTotals, whichever
    the objective (raysft.training.objective): its share of the step's loss, summed over the workers and divided by
    `loss_tokens` (the global batch's assistant tokens for SFT; 1 for DPO, whose shares are of the step's means),
    the token counts of its micro-batches, and the objective's own metrics: `means` (DPO's PAIR_METRICS: this
    worker's shares, summed over the workers) and `host` values kept as they are (DPO's pairs per step)."""

    loss: torch.Tensor
    loss_tokens: int
    lengths: list[int]
    computed_tokens: int
    means: dict[str, torch.Tensor] | None = None
    host: dict = field(default_factory=dict)


class StepTotals:
    """Each step's numbers, held back until a log line, checkpoint or report needs them: the loss and gradient
    norm stay on the device, token and FLOP counts on the host. Then one all_gather brings every rank's values and
    one read ends the host's wait for the device. Reading them every step would make the host wait for the device
    at every step, and the device wait for the host in turn.

    Each returned row holds what metrics.jsonl documents, reduced over the ranks. `tokens_per_s` and `mfu` are
    those of the steps since the previous reduction, since a step that does not wait for the device has no duration
    of its own; so is each row's `time` but the last one's, which is when the reduction ended.
    """

    DEVICE, HOST = ("loss_sum", "grad_norm"), ("tokens", "computed_tokens", "flops", "peak_mem_gb")

    def __init__(self, device: torch.device, peak_tflops: float | None):
        self.device, self.peak_tflops = device, peak_tflops
        self.rows: list[tuple[float, dict, torch.Tensor]] = []

    def hold(self, rows: list[list], values: list[list[list[float]]], rank: int, world_size: int,
             same_world: bool) -> None:
        """Take back the rows a memory-tier snapshot held for every old rank, not yet logged (regroup_rows), so that
        they are logged with the next ones as the old ranks would have logged them."""
        self.rows = [(start, host, v.to(self.device)) for start, host, v in
                     regroup_rows(rows, values, rank, world_size, same_world)]

    def add(self, step_start: float, on_device: dict[str, torch.Tensor], on_host: dict,
            pair_means: dict[str, torch.Tensor] | None = None) -> None:
        """on_device: DEVICE values as 0-d tensors; on_host: HOST values plus the fields that need no reduction
        (step, loss_tokens, lr, epoch, ...). pair_means (train.objective dpo): this rank's shares of the step's
        means (its sums divided by the whole step's pairs or tokens), reported summed over the ranks (every step of
        a run has the same names)."""
        means = pair_means or {}
        values = torch.stack([on_device[k].detach().reshape(()).to(torch.float64) for k in self.DEVICE]
                             + [v.detach().reshape(()).to(torch.float64) for v in means.values()])
        self.rows.append((step_start, {**on_host, "time": time.time(), "pair_means": list(means)}, values))

    def reduce(self) -> list[dict]:
        """Collective, at the same steps on every rank: the rows since the last call, reduced over the ranks."""
        if not self.rows:
            return []
        rows, self.rows = self.rows, []
        local = torch.cat([torch.stack([v for _, _, v in rows]),
                           torch.tensor([[h[k] for k in self.HOST] for _, h, _ in rows], dtype=torch.float64,
                                        device=self.device)], dim=1)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        ranks = torch.stack(gathered).cpu()  # (ranks, steps, values): the one wait for the device
        end = time.time()
        sums, maxima = ranks.sum(0).tolist(), ranks.max(0).values.tolist()
        means = rows[0][1]["pair_means"]
        names = (*self.DEVICE, *means, *self.HOST)
        window_s = end - rows[0][0]
        tokens = sum(s[names.index("tokens")] for s in sums)
        flops = sum(s[names.index("flops")] for s in sums)
        out = []
        for (_, host, _), total, peak, first_rank in zip(rows, sums, maxima, ranks[0].tolist(), strict=True):
            get = dict(zip(names, total, strict=True))
            row = {k: v for k, v in host.items() if k not in (*self.HOST, "loss_tokens", "pair_means")}
            row.update({name: get[name] for name in means})
            row.update(loss=get["loss_sum"] / host["loss_tokens"], grad_norm=first_rank[names.index("grad_norm")],
                       tokens=int(get["tokens"]), computed_tokens=int(get["computed_tokens"]),
                       tokens_per_s=tokens / window_s,
                       mfu=(flops / window_s / dist.get_world_size() / (self.peak_tflops * 1e12)
                            if self.peak_tflops else None),
                       peak_mem_gb=round(peak[names.index("peak_mem_gb")], 4))
            out.append(row)
        out[-1]["time"] = end
        return out


def regroup_rows(rows: list[list], values: list[list[list[float]]], rank: int, world_size: int,
                 same_world: bool) -> list[tuple[float, dict, torch.Tensor]]:
    """StepTotals rows for `rank` from every old rank's held rows (`rows`: [start, host] per step; `values`: the
    device values per step), as a memory-tier snapshot carries them. On the same world size each rank takes its own.
    On another, rank 0 takes rows holding what the old ranks' rows reduce to (their sums, summed as `reduce` sums
    them; the first rank's gradient norm; the largest peak memory), and the others zeros, so that `reduce` over the
    new ranks logs those steps as the old ranks would have."""
    if same_world:
        return [(start, host, torch.tensor(v, dtype=torch.float64)) for (start, host), v in
                zip(rows[rank], values[rank], strict=True)]
    if not rows or not rows[0]:
        return []
    host_names = StepTotals.HOST
    ranks = torch.tensor([[v + [float(h[k]) for k in host_names] for (_, h), v in zip(r, vs, strict=True)]
                          for r, vs in zip(rows, values, strict=True)], dtype=torch.float64)
    sums, maxima = ranks.sum(0), ranks.max(0).values
    n, norm, peak = len(values[0][0]), StepTotals.DEVICE.index("grad_norm"), host_names.index("peak_mem_gb")
    out = []
    for i, (start, host) in enumerate(rows[0]):
        if rank == 0:
            device = sums[i, :n].clone()
            device[norm] = ranks[0, i, norm]
            totals = {k: sums[i, n + j].item() for j, k in enumerate(host_names)}
            totals["peak_mem_gb"] = maxima[i, n + peak].item()
        else:
            device, totals = torch.zeros(n, dtype=torch.float64), dict.fromkeys(host_names, 0)
        out.append((start, {**host, **totals}, device))
    return out


def read_metrics(run_dir: Path | Location) -> list[dict]:
    path = run_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this worker: the CUDA caching allocator's peak, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def progress_line(step: int, max_steps: int, metrics: dict, eta_s: float | None) -> str:
    """The one-line summary of a step, for logs and the driver's progress bar alike."""
    parts = [f"step {step}/{max_steps}", f"loss {metrics['loss']:.4f}", f"lr {metrics['lr']:.2e}",
             f"grad_norm {metrics['grad_norm']:.3f}", f"{metrics['tokens_per_s']:.0f} tok/s"]
    if metrics.get("mfu") is not None:
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    parts.append(f"peak mem {metrics['peak_mem_gb']:.2f} GiB")
    if "rewards/accuracies" in metrics:
        parts.append(f"reward acc {metrics['rewards/accuracies']:.2f} margin {metrics['rewards/margins']:.3f}")
    if metrics.get("eval_loss") is not None:
        parts.append(f"eval_loss {metrics['eval_loss']:.4f} ({metrics['eval_s']:.1f}s)")
    if metrics.get("skipped_steps"):
        parts.append(f"skipped {metrics['skipped_steps']}")
    if "loss_scale" in metrics:
        parts.append(f"loss scale {metrics['loss_scale']:g}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def peak_tflops(device: torch.device, compute_dtype: str) -> float | None:
    """The device's dense peak for the compute dtype, if known (MFU is left out otherwise, e.g. on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks.get(compute_dtype) for gpu, peaks in PEAK_TFLOPS.items() if gpu in name), None)


def training_flops(sample_lengths: list[int], matmul_params: int, layers: int, hidden: int) -> float:
    """Model FLOPs of forward + backward over these samples (PaLM's count, without the causal discount)."""
    return sum(n * (6 * matmul_params + 12 * layers * hidden * n) for n in sample_lengths)


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but the input embedding (a lookup), unless it is tied to the
    output layer. Works on a meta-device model."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    tied = any(p is embedding for p in model.get_output_embeddings().parameters())
    return total if tied else total - embedding.numel()


class ProgressBar:
    """The driver's view of a run on an interactive terminal: a bar with ETA redrawn in place from the run's
    metrics.jsonl (the workers' own stdout is a log file, never a terminal). Use as a context manager.

    `max_steps` is the config's; the run's length is what this launch's driver recorded in LAUNCH_CONFIG_FILE
    before its first step (train.num_epochs derived into steps from the data's size), read at this launch's first
    row, as the workers' own progress lines count it."""

    def __init__(self, run_dir: Path, max_steps: int, out=sys.stderr, interval_s: float = 0.5, width: int = 24):
        self.path, self.max_steps, self.out = run_dir / METRICS_FILE, max_steps, out
        self.launch_file = run_dir / LAUNCH_CONFIG_FILE
        self.interval_s, self.width = interval_s, width
        self._offset = self._end_of_file()
        self._last: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProgressBar:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        if self._last:
            self.out.write("\n")
            self.out.flush()

    def _end_of_file(self) -> int:
        try:
            return self.path.stat().st_size  # earlier launches' rows are not this launch's progress
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        try:
            with self.path.open() as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind("\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete.encode())
        rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
        steps = [r for r in rows if "loss" in r]
        if steps:
            if self._last is None:  # this launch's first row: its driver has recorded the launch
                self.max_steps = self._launched_steps()
            self._last = steps[-1]
            self.out.write("\r\033[K" + self.render(self._last))
            self.out.flush()

    def _launched_steps(self) -> int:
        try:
            return int(json.loads(self.launch_file.read_text())["train"]["max_steps"])
        except (OSError, ValueError, KeyError, TypeError):  # no record (a launch that wrote none): the config's
            return self.max_steps

    def render(self, row: dict) -> str:
        done = min(1.0, row["step"] / self.max_steps)
        filled = int(done * self.width)
        bar = "█" * filled + "·" * (self.width - filled)
        return f"{bar} {100 * done:3.0f}% " + progress_line(row["step"], self.max_steps, row, row.get("eta_s"))
