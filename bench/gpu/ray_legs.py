"""The Ray Train legs of bench/gpu/check.py, one per process: `python bench/gpu/ray_legs.py LEG WORK`. Each runs
`raysft train` (Ray Train's TorchTrainer, one worker, `scaling.use_gpu` on a GPU: NCCL and Ray's device
assignment) as a user would, in its own local Ray, and writes WORK/LEG.json as it goes (steps.Results).

    ray_throughput  the same config under Ray and under torchrun (`torchrun -m raysft.run`), one after the other:
                    tokens/s, MFU and peak memory of the same measured steps; Ray's per-step cost is the ratio
    ray_recovery    a deterministic run with checkpoints; its RayTrainWorker is SIGKILLed mid-run and Ray restarts
                    the worker group from the last checkpoint; every step's loss against the uninterrupted run
    ray_sigterm     SIGTERM to the `raysft train` driver mid-run: a checkpoint of the step it stopped at, exit 143
    ray_lora        LoRA (rank 16) trained and checkpointed under Ray

On a machine without Ray the bundle (bench/gpu/bundle.py) provides it: check.py installs it before these legs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from steps import VARIANTS, Results, common_sets, setup

from raysft.checkpoint import checkpoint_dirs
from raysft.launch.signals import EXIT_SIGTERM

REPO = Path(__file__).resolve().parent.parent.parent


def sets_args(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


class Launch:
    """One `raysft train` (or `torchrun -m raysft.run`) in its own session, its output in WORK/<name>.log, its Ray
    in a temp dir of its own (RAY_TMPDIR; Ray's socket paths must stay short)."""

    started: list[Launch] = []  # every launch of this process: main() stops any still running when a leg ends

    def __init__(self, work: Path, name: str, command: list[str]):
        Launch.started.append(self)
        self.ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
        env = {**os.environ, "RAY_TMPDIR": self.ray_tmp, "TOKENIZERS_PARALLELISM": "false"}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "RAY_ADDRESS"):
            env.pop(key, None)  # a launch of its own, not a worker of this process's group
        self.log = (work / f"{name}.log").open("w")
        self.proc = subprocess.Popen(command, cwd=work, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # this launch's own session: its driver, Ray and workers
            self.proc.wait()
            return None
        finally:
            self.log.close()
            shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def stop(self) -> None:
        """SIGKILL to the launch's session (its driver, its Ray, its workers), if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.wait(timeout=30)

    def train_workers(self) -> list[int]:
        """Ray's train worker processes of this launch (descendants of its driver)."""
        from common import train_worker_pids  # bench/, on the path once steps is imported

        return train_worker_pids(self.proc.pid)


def raysft_train(work: Path, name: str, sets: list[str]) -> Launch:
    return Launch(work, name, [sys.executable, "-m", "raysft", "train", *sets_args([*sets, f"run.name={name}"])])


def torchrun(work: Path, name: str, sets: list[str]) -> Launch:
    return Launch(work, name, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                               "-m", "raysft.run", *sets_args([*sets, f"run.name={name}"])])


def wait_until(condition: Callable[[], bool], launch: Launch, timeout: float) -> bool:
    """Poll `condition` until it holds; False when the launch ended or the time ran out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launch.proc.poll() is None:
        if condition():
            return True
        time.sleep(0.02)
    return False


def metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl while it is written: none before the file exists, a last line not yet whole left
    out."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def last_step(run_dir: Path) -> int:
    return max((m["step"] for m in metrics(run_dir) if "loss" in m), default=0)


def losses(run_dir: Path) -> dict[int, list[float]]:
    """Every loss logged for each step, in order (a step trained again after a restart appears twice)."""
    out: dict[int, list[float]] = {}
    for m in metrics(run_dir):
        if "loss" in m:
            out.setdefault(m["step"], []).append(m["loss"])
    return out


def small_sets(plan: dict, work: Path) -> list[str]:
    """The determinism leg's recipe on the small model: varlen, packed, deterministic kernels."""
    s = setup(plan, "small", work)
    return [*s.common, *common_sets(plan), "train.deterministic=true", "data.packing=true",
            "model.attn_implementation=varlen", f"train.micro_batch_tokens={plan['seq_len'] * 2}",
            "train.log_every_n_steps=1"]


def ray_throughput(plan: dict, work: Path, out: Results) -> None:
    """The throughput step's fastest recipe at its tuned token budget, the same settings under both launchers:
    the metrics row of the last log (its window: the measured steps, after as many warm-up steps) of each."""
    measured = json.loads((work / "throughput.json").read_text())
    ok = {v: r for v, r in measured["variants"].items() if r.get("status") == "ok"}
    variant = "compiled" if "compiled" in ok else max(ok, key=lambda v: ok[v]["tokens_per_s"])
    tokens = measured["micro_batch_tokens"]
    n = plan["steps"] + (plan["compile_warmup"] if variant == "compiled" else 0)
    s = setup(plan, "model", work)
    sets = [*s.common, *common_sets(plan), f"train.micro_batch_size={plan['micro_batch']}",
            *(x.format(tokens=tokens) for x in VARIANTS[variant]),
            f"train.max_steps={2 * n}", f"train.log_every_n_steps={n}", f"checkpoint.every_n_steps={4 * n}"]
    out["variant"], out["micro_batch_tokens"], out["steps"] = variant, tokens, [n + 1, 2 * n]
    for name, start in (("ray", raysft_train), ("torchrun", torchrun)):
        t0 = time.perf_counter()
        code = start(s.work, f"launcher-{name}", sets).wait(timeout=plan["launch_timeout_s"])
        rows = [m for m in metrics(s.work / f"launcher-{name}") if "tokens_per_s" in m]
        last = rows[-1] if rows and rows[-1]["step"] == 2 * n else {}
        out[name] = {"returncode": code, "seconds": time.perf_counter() - t0,
                     **{k: last.get(k) for k in ("tokens_per_s", "mfu", "peak_mem_gb", "loss")}}
    if out.data["ray"]["tokens_per_s"] and out.data["torchrun"]["tokens_per_s"]:
        out["ray_over_torchrun"] = out.data["ray"]["tokens_per_s"] / out.data["torchrun"]["tokens_per_s"]


def ray_recovery(plan: dict, work: Path, out: Results) -> None:
    """An uninterrupted run (under torchrun: the same training, as ray_throughput shows, at less start-up cost),
    then the same run under Ray whose train worker is SIGKILLed after its first checkpoint: Ray restarts the worker
    group (scaling.max_failures), which resumes from that checkpoint. Bit-exact: every loss of every step, before
    the kill and after the resume, equals the uninterrupted run's."""
    n, every = plan["recovery_steps"], plan["recovery_steps"] // 4
    sets = [*small_sets(plan, work), f"train.max_steps={n}", f"checkpoint.every_n_steps={every}",
            "scaling.max_failures=1"]
    run_root = work / "small"
    ref = torchrun(run_root, "recovery-ref", sets).wait(timeout=plan["launch_timeout_s"])
    out["reference"] = {"returncode": ref, "steps": last_step(run_root / "recovery-ref")}
    launch = raysft_train(run_root, "recovery", sets)
    run_dir = run_root / "recovery"
    killed = None
    if wait_until(lambda: last_step(run_dir) >= every + 2, launch, plan["launch_timeout_s"]):
        workers = launch.train_workers()
        if workers:
            killed = {"pid": workers[0], "after_step": last_step(run_dir), "time": time.time()}
            os.kill(workers[0], signal.SIGKILL)
    out["killed"] = killed
    code = launch.wait(timeout=plan["launch_timeout_s"])
    ref_losses, got = losses(run_root / "recovery-ref"), losses(run_dir)
    resumes = [m for m in metrics(run_dir) if m.get("event") == "resume"]
    differ = [step for step in sorted(ref_losses) if any(x != ref_losses[step][0] for x in got.get(step, [None]))]
    out["returncode"] = code
    out["resumed_from"] = [m["step"] for m in resumes]
    out["steps_trained_twice"] = sorted(step for step, xs in got.items() if len(xs) > 1)
    out["first_difference"] = differ[0] if differ else None
    out["bit_exact"] = bool(killed) and code == 0 and not differ and len(ref_losses) == n and bool(resumes)


def ray_sigterm(plan: dict, work: Path, out: Results) -> None:
    """SIGTERM to the driver once training is under way: every worker checkpoints the step it is at, and the driver
    exits 143."""
    sets = [*small_sets(plan, work), "train.max_steps=100000", "checkpoint.every_n_steps=100000"]
    run_root = work / "small"
    launch = raysft_train(run_root, "sigterm", sets)
    run_dir = run_root / "sigterm"
    started = wait_until(lambda: last_step(run_dir) >= 3, launch, plan["launch_timeout_s"])
    sent = time.perf_counter()
    if started:
        launch.proc.send_signal(signal.SIGTERM)
    code = launch.wait(timeout=plan["launch_timeout_s"])
    checkpoints = [int(d.name.rsplit("_", 1)[1]) for d in checkpoint_dirs(run_dir)]
    out["returncode"], out["seconds_to_exit"] = code, time.perf_counter() - sent if started else None
    out["last_step"], out["checkpoint_steps"] = last_step(run_dir), checkpoints
    out["checkpointed_and_143"] = started and code == EXIT_SIGTERM and checkpoints[-1:] == [last_step(run_dir)]


def ray_lora(plan: dict, work: Path, out: Results) -> None:
    """LoRA under Ray: trained to a checkpoint of the adapters (the checkpoint step loads one back)."""
    sets = [*small_sets(plan, work), "model.lora.r=16", "checkpoint.every_n_steps=3", "train.max_steps=3"]
    run_root = work / "small"
    t0 = time.perf_counter()
    code = raysft_train(run_root, "lora", sets).wait(plan["launch_timeout_s"])
    rows = metrics(run_root / "lora")
    last = next((m for m in reversed(rows) if "tokens_per_s" in m), {})
    checkpoints = checkpoint_dirs(run_root / "lora")
    out.data.update(returncode=code, seconds=time.perf_counter() - t0, last_step=last_step(run_root / "lora"),
                    tokens_per_s=last.get("tokens_per_s"), mfu=last.get("mfu"), peak_mem_gb=last.get("peak_mem_gb"),
                    checkpoint_bytes=sum(f.stat().st_size for f in checkpoints[-1].rglob("*") if f.is_file())
                    if checkpoints else 0)
    out["ok"] = code == 0 and out.data["last_step"] == 3 and bool(checkpoints)


LEGS = {"ray_throughput": ray_throughput, "ray_recovery": ray_recovery, "ray_sigterm": ray_sigterm,
        "ray_lora": ray_lora}


def main() -> int:
    leg, work = sys.argv[1], Path(sys.argv[2])
    plan = json.loads((work / "plan.json").read_text())
    out = Results(work / f"{leg}.json")
    import ray

    out["ray_package"] = {"version": ray.__version__, "file": ray.__file__}  # the bundle's, on the GPU machine
    try:
        LEGS[leg](plan, work, out)
    finally:
        for launch in Launch.started:
            launch.stop()
    verdict = {"ray_throughput": lambda d: d.get("ray_over_torchrun") is not None,
               "ray_recovery": lambda d: d.get("bit_exact"), "ray_sigterm": lambda d: d.get("checkpointed_and_143"),
               "ray_lora": lambda d: d.get("ok")}[leg]
    return 0 if verdict(out.data) else 1


if __name__ == "__main__":
    sys.exit(main())
