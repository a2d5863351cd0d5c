"""The device check: one command that measures on a lent GPU everything raysft has built for GPUs, inside the few
minutes a lease gives. Each step runs in its own process with its own time limit, so that a step that fails or
hangs costs only its own minutes and the next one still runs:

    environment   versions, the GPU, its bf16 matmul rate, flash varlen attention, safetensors' slice reader
    tests         tests/test_gpu.py and the other test files that mention CUDA, with the CPU references they use
    prepare       the models' seeded weights (written once, loaded by every later launch) and the tokenized data
    throughput    the "Fast on GPUs" recipes at the Llama-3.2-1B shape, torchrun path: MFU, real tokens/s, computed
                  over real tokens, peak memory; the varlen recipe's token budget tuned first, the others use it
    profile       torch.profiler over a few steps of the fastest recipe: the GPU's busy fraction, the top kernels
    determinism   train.deterministic: a run stopped and resumed against the same run in one go, bit for bit
    checkpoint    how long an async sharded save blocks training against a sync one, full fine-tuning and LoRA
    save_memory   each rank's peak device and host memory during a full save, against a sharded one
    fp8           parallel.fp8 against bf16 on the throughput shape: tokens/s, and the loss over a few hundred steps
                  within a stated tolerance of bf16's (step_legs.py)
    memory_tier   the memory tier every step and every 10 steps against none: step time, the time its snapshot call
                  holds the step, its page-locked host memory against `raysft plan` (step_legs.py)
    titan         torchtitan's Llama-3 trainer on the throughput shape, dtype and tokens per step (titan.py)
    ray_*         Ray Train: throughput against torchrun, a killed worker restarted bit-exact, SIGTERM to the
                  driver, LoRA (ray_legs.py)

    python3 bench/gpu/check.py --out "$OUT"              # on the GPU machine (docs/dev/DEVICE-CALLS.md)
    .venv/bin/python bench/gpu/check.py --smoke --out D  # the same steps on CPU at toy size (tests/test_gpu_check.py)

The GPU machine has no Ray, torchtitan or torchao: a first step, `bundle`, installs them from the carried bundle
(bench/gpu/bundle.py) into WORK/site, which every later step has first on its PYTHONPATH; without a bundle it is
skipped, and the steps before the Ray and torchtitan legs need neither (the torchrun path imports no Ray). Under --out:
summary.json (every step's status, time, results and the end of its log, rewritten after each step), summary.md
(the table printed at the end), logs.tar.gz (each step's log and files, every run's metrics.jsonl) and
profile-trace.json.gz (the Chrome trace, when it fits the 16 MiB a file may have to come back).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent
REPO = GPU_DIR.parent.parent
FASTCHAT = [REPO / ".benchdata" / "dummy_conversation.json",  # carried to the GPU machine (docs/dev/DEVICE-CALLS.md)
            REPO.parent / "shared" / "datasets" / "fastchat" / "dummy_conversation.json"]
MAX_RETURNED_BYTES = 15 * 2**20  # the device tool brings back files of up to 16 MiB

LLAMA_1B = {"hidden": 2048, "layers": 16, "intermediate": 8192, "vocab": 128256}  # Llama-3.2-1B's shape, untied
PLANS = {
    # 64 samples per step as in the first H100 run (docs/BENCHMARKS.md), which measured 35.2 GiB at this batch
    "gpu": {"gpu": True, "mixed_precision": "bf16", "seq_len": 2048, "global_batch": 64, "micro_batch": 16,
            "model": LLAMA_1B, "small": {"hidden": 1024, "layers": 8, "intermediate": 4096, "vocab": 32768},
            "warmup": 3, "steps": 8, "compile_warmup": 3, "tune_warmup": 2, "tune_steps": 5, "max_budgets": 4,
            "profile_steps": 3, "det_steps": 8, "saves": 2, "recovery_steps": 40, "launch_timeout_s": 150,
            "titan_timeout_s": 150, "variants": ["varlen", "full-logits", "lora", "padded", "packed", "compiled"],
            # memory_tier: the small model (its state 2.3 GB), 3 + 40 steps a run, 2 rounds of none / every 10 / every 1
            "tier_model": "small", "tier_steps": 40, "tier_every": [10, 1], "tier_rounds": 2,
            # fp8: the compiled recipe at the budget the H100's tuning chose, 200 steps from the prepared weights
            "fp8_recipe": "compiled", "fp8_tokens": 16384, "fp8_steps": 200, "fp8_window": 50, "fp8_lr": 3e-4},
    "smoke": {"gpu": False, "mixed_precision": "bf16", "seq_len": 128, "global_batch": 8, "micro_batch": 2,
              "model": {"hidden": 128, "layers": 2, "intermediate": 0, "vocab": 0},
              "small": {"hidden": 128, "layers": 2, "intermediate": 0, "vocab": 0},
              "warmup": 1, "steps": 1, "compile_warmup": 0, "tune_warmup": 1, "tune_steps": 1, "max_budgets": 2,
              "profile_steps": 1, "det_steps": 2, "saves": 1, "recovery_steps": 12, "launch_timeout_s": 240,
              "titan_timeout_s": 60, "variants": ["varlen", "full-logits", "lora", "padded", "packed"],
              "tier_model": "small", "tier_steps": 4, "tier_every": [2, 1], "tier_rounds": 1,
              "fp8_recipe": "varlen", "fp8_tokens": 256, "fp8_steps": 4, "fp8_window": 2, "fp8_lr": 3e-4},
}
# The issue-30 targets (H100, 1B shape, bf16, FastChat data) that the summary checks the results against.
TARGET_MFU, TARGET_PEAK_GIB, TARGET_ASYNC_BLOCKING = 0.40, 0.6 * 35.2, 0.05
# issue 17's and 39's: raysft under Ray at least 0.97 of the same trainer under torchrun, at least torchtitan's
TARGET_RAY_OVER_TORCHRUN, TARGET_OVER_TORCHTITAN = 0.97, 1.0
TARGET_TIER_EVERY_STEP = 1.05  # issue 47's: the memory tier every step costs at most 5% of the step


TRAINING = ("throughput", "profile", "determinism", "checkpoint", "save_memory", "memory_tier", "fp8")
RAY_LEGS = ("ray_throughput", "ray_recovery", "ray_sigterm", "ray_lora")


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: float
    reserve_s: float
    """Kept free for this step by the steps before it: it runs only with at least this much time left."""
    distributed: bool = False
    """Trains: runs as torchrun's one worker (torchrun_env)."""
    env: dict[str, str] = field(default_factory=dict)


def steps(work: Path, tests: list[str], smoke: bool, bundle: Path) -> list[Step]:
    py, script = sys.executable, str(GPU_DIR / "steps.py")
    scale = 2.5 if smoke else 1.0  # CPU steps at toy size still import as much, on fewer cores
    # on CPU one thread per process, as Ray and bench/throughput.py give their workers: torch's threads wait for
    # each other spinning, which makes a step many times slower on a machine whose cores are busy
    env = {"OMP_NUM_THREADS": "1"} if smoke else {}

    def step(name: str, command: list[str], timeout_s: float, reserve_s: float) -> Step:
        return Step(name, command, timeout_s * scale, reserve_s * scale, name in TRAINING, env)

    return [step("bundle", [py, str(GPU_DIR / "bundle.py"), "install", str(bundle), str(work / "site")], 60, 10),
            step("environment", [py, str(GPU_DIR / "environment.py"), str(work)], 60, 20),
            step("tests", [py, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider",
                           f"--junitxml={work / 'tests.xml'}"], 120, 30),
            step("prepare", [py, script, "prepare", str(work)], 90, 30),
            step("throughput", [py, script, "throughput", str(work)], 270, 60),
            step("profile", [py, script, "profile", str(work)], 75, 30),
            step("determinism", [py, script, "determinism", str(work)], 75, 30),
            step("checkpoint", [py, script, "checkpoint", str(work)], 75, 30),
            step("save_memory", [py, script, "save_memory", str(work)], 60, 20),
            *(step(leg, [py, str(GPU_DIR / "step_legs.py"), leg, str(work)], limit, reserve)
              for leg, limit, reserve in (("fp8", 300, 60), ("memory_tier", 150, 40))),
            step("titan", [py, str(GPU_DIR / "titan.py"), str(work)], 180, 40),
            *(step(leg, [py, str(GPU_DIR / "ray_legs.py"), leg, str(work)], 240, 40) for leg in RAY_LEGS)]


def gpu_tests() -> tuple[list[str], list[str]]:
    """tests/test_gpu.py and every test file that mentions CUDA, with test_loss.py and test_attention.py (the CPU
    references the GPU tests compare against); without Ray installed, the files that import it at module level are
    left out (returned second)."""
    names = {p.name for p in (REPO / "tests").glob("test_*.py") if "cuda" in p.read_text()}
    names = (names | {"test_gpu.py", "test_loss.py", "test_attention.py"}) - {"test_gpu_check.py"}  # not itself
    has_ray = importlib.util.find_spec("ray") is not None
    needs_ray = {n for n in names if re.search(r"^(import|from) ray\b", (REPO / "tests" / n).read_text(), re.M)}
    kept = sorted(names if has_ray else names - needs_ray)
    return [f"tests/{n}" for n in kept], sorted(needs_ray - set(kept))


def torchrun_env() -> dict[str, str]:
    """What `torchrun --standalone --nproc-per-node 1` gives its one worker, for
    raysft.launch.torchrun.init_distributed: the steps train as torchrun's worker would, without a launcher process
    importing torch once more per step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}


def run_step(step: Step, timeout_s: float, work: Path) -> dict:
    """Run one step in its own process group; on its time limit the whole group is stopped (SIGTERM, then
    SIGKILL), with any process the step started."""
    log = work / f"{step.name}.log"
    env = {**os.environ, **step.env, **(torchrun_env() if step.distributed else {}), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",  # nothing is downloaded; don't try
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start, cpu = time.perf_counter(), children_cpu_s()
    with log.open("w") as f:
        proc = subprocess.Popen(step.command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            code, status = None, "timeout"
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    record = {"name": step.name, "status": status, "returncode": code, "seconds": round(time.perf_counter() - start, 1),
              "cpu_s": round(children_cpu_s() - cpu, 1), "timeout_s": round(timeout_s, 1), "log": log.name}
    result = work / f"{step.name}.json"
    if result.is_file():  # what the step wrote, also when it failed or was stopped part way
        record["result"] = json.loads(result.read_text())
    if step.name == "tests" and (work / "tests.xml").is_file():
        record["result"] = test_counts(work / "tests.xml")
    if status != "ok":
        record["log_tail"] = log.read_text(errors="replace")[-3000:]
    return record


def children_cpu_s() -> float:
    """CPU time of the finished steps' processes (the steps' own cost, whatever else shares the machine)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_counts(junit: Path) -> dict:
    suites = ET.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**{k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}, "failed": failed}


def targets(records: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets against what was measured; `met` is None where the value is missing."""
    def check(value, target: float, below: bool) -> dict:
        met = None if value is None else (value <= target if below else value >= target)
        return {"value": value, "target": target, "met": met}

    variants = records.get("throughput", {}).get("result", {}).get("variants", {})
    ok = [r for r in variants.values() if r.get("status") == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"], default={})
    det = records.get("determinism", {}).get("result", {})
    ckpt = records.get("checkpoint", {}).get("result", {}).get("full", {})
    def result(name: str) -> dict:
        return records.get(name, {}).get("result", {})

    def holds(value) -> dict:
        return {"value": value, "target": True, "met": value}

    fp8 = result("fp8").get("comparison") or {}
    return {"mfu": check(best.get("mfu"), TARGET_MFU, below=False),
            "ray_over_torchrun": check(result("ray_throughput").get("ray_over_torchrun"), TARGET_RAY_OVER_TORCHRUN,
                                       below=False),
            "raysft_over_torchtitan": check(result("titan").get("comparison", {}).get("raysft_over_torchtitan"),
                                            TARGET_OVER_TORCHTITAN, below=False),
            "ray_worker_restart_bit_exact": holds(result("ray_recovery").get("bit_exact")),
            "ray_sigterm_checkpoint_and_143": holds(result("ray_sigterm").get("checkpointed_and_143")),
            "peak_mem_gib": check(best.get("peak_mem_gib"), TARGET_PEAK_GIB, below=True),
            "resume_bit_identical": {"value": det.get("resume_bit_identical"), "target": True,
                                     "met": det.get("resume_bit_identical")},
            "async_blocking_over_sync_save": check(ckpt.get("async_blocking_over_sync_save"), TARGET_ASYNC_BLOCKING,
                                                   below=True),
            "tier_every_step_over_none": check(result("memory_tier").get("over_none", {}).get("every_1"),
                                               TARGET_TIER_EVERY_STEP, below=True),
            "fp8_loss_within_tolerance": holds(fp8.get("loss_within_tolerance"))}


def table(summary: dict) -> str:
    lines = ["| step | status | s | key results |", "|---|---|---:|---|"]
    for r in summary["steps"]:
        lines.append(f"| {r['name']} | {r['status']} | {r.get('seconds', 0):.0f} | {key_results(r)} |")
    variants = next((r["result"].get("variants", {}) for r in summary["steps"] if r["name"] == "throughput"
                     and "result" in r), {})
    if variants:
        lines += ["", "| recipe | status | real tokens/s | MFU | computed / real | peak GiB | micro_batch_tokens |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for name, v in variants.items():
            mfu = f"{100 * v['mfu']:.1f}%" if v.get("mfu") else "-"
            lines.append(f"| {name} | {v['status']} | {number(v.get('tokens_per_s'), '.0f')} | {mfu} "
                         f"| {number(v.get('computed_per_real_token'), '.2f')} "
                         f"| {number(v.get('peak_mem_gib'), '.2f')} | {v.get('micro_batch_tokens')} |")
    lines += ["", "targets: " + ", ".join(f"{k} {v['value']!r} (target {v['target']}): {v['met']}"
                                          for k, v in summary["targets"].items())]
    return "\n".join(lines)


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def key_results(record: dict) -> str:
    r = record.get("result", {})
    if record["name"] == "environment":
        return f"{r.get('gpu', {}).get('name', 'no GPU')}, torch {r.get('packages', {}).get('torch')}, " \
               f"flash varlen {r.get('flash_varlen')}"
    if record["name"] == "tests":
        return f"{r.get('tests')} tests, {r.get('failures')} failed, {r.get('errors')} errors, {r.get('skipped')} " \
               f"skipped {r.get('failed') or ''}"
    if record["name"] == "prepare":
        return ", ".join(f"{k}: {v['params'] / 1e6:.1f}M parameters" for k, v in r.items() if isinstance(v, dict)) + \
            (f"; {r['model']['samples']} samples of {r['model']['mean_tokens']:.0f} tokens on average" if "model" in r
             else "")
    if record["name"] == "throughput":
        return f"token budget {r.get('micro_batch_tokens')}; failed: {r.get('failed_variants', [])}"
    if record["name"] == "profile":
        s = r.get("summary", {})
        return f"{r.get('variant')}: busy {number(s.get('busy_fraction'), '.3f')}, " \
               f"top {[t['name'] for t in s.get('top', [])[:3]]}"
    if record["name"] == "determinism":
        return f"resume bit-identical {r.get('resume_bit_identical')}, first difference {r.get('first_difference')}"
    if record["name"] == "checkpoint":
        return ", ".join(f"{k}: async blocks {number(v['async_blocking_over_sync_save'], '.3f')} of a sync save"
                         for k, v in r.items() if isinstance(v, dict) and "async_blocking_over_sync_save" in v)
    if record["name"] == "save_memory":
        return ", ".join(f"{k}: device +{number(v['device_peak_over_training_gib'], '.2f')} GiB, host "
                         f"+{number(v['host_peak_over_training_gib'], '.2f')} GiB" for k, v in r.items()
                         if isinstance(v, dict) and "device_peak_gib" in v)
    if record["name"] == "titan":
        c = r.get("comparison", {})
        return f"torchtitan {number(c.get('torchtitan_tokens_per_s'), '.0f')} tokens/s, raysft over torchtitan " \
               f"{number(c.get('raysft_over_torchtitan'), '.3f')}" if c else str(r.get("trained", ""))
    if record["name"] == "ray_throughput":
        return f"{r.get('variant')}: Ray over torchrun {number(r.get('ray_over_torchrun'), '.3f')}"
    if record["name"] == "ray_recovery":
        killed = (r.get("killed") or {}).get("after_step")
        return f"killed after step {killed}, resumed from {r.get('resumed_from')}, bit-exact {r.get('bit_exact')}"
    if record["name"] == "ray_sigterm":
        return f"exit {r.get('returncode')}, checkpoints {r.get('checkpoint_steps')}, last step {r.get('last_step')}"
    if record["name"] == "ray_lora":
        return f"ok {r.get('ok')}, {number(r.get('tokens_per_s'), '.0f')} tokens/s"
    if record["name"] == "memory_tier":
        return f"step over none {r.get('over_none')}, snapshot call {number(r.get('snapshot_call_median_s'), '.4f')} " \
               f"s, staging over plan {number(r.get('staging_over_plan'), '.3f')}"
    if record["name"] == "fp8":
        c, refused = r.get("comparison") or {}, r.get("variants", {}).get("fp8", {}).get("reason")
        return f"FP8 refused: {refused}" if refused else \
            f"FP8 over bf16 {number(c.get('fp8_over_bf16_tokens_per_s'), '.3f')} tokens/s, last-{c.get('window')} " \
            f"loss {number(c.get('relative_difference'), '.4f')} apart (within {c.get('tolerance')}: " \
            f"{c.get('loss_within_tolerance')})"
    return ""


def pack(work: Path, out: Path) -> None:
    """Everything of the work directory that is text (logs, results, metrics.jsonl) into logs.tar.gz; the profile's
    trace beside it, compressed, when it fits what the device tool brings back."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in (".log", ".json", ".jsonl", ".xml", ".md") and \
                    path.name != "profile-trace.json" and path.stat().st_size < 2**24:
                tar.add(path, arcname=str(path.relative_to(work)))
    trace = work / "profile-trace.json"
    if trace.is_file() and not (out / "profile-trace.json.gz").is_file():
        buffer = io.BytesIO()
        with trace.open("rb") as src, gzip.GzipFile(fileobj=buffer, mode="wb") as dst:
            shutil.copyfileobj(src, dst)
        if buffer.tell() <= MAX_RETURNED_BYTES:
            (out / "profile-trace.json.gz").write_bytes(buffer.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where summary.json and the logs go ($OUT)")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy shapes: that the check itself works")
    parser.add_argument("--budget-s", type=float, default=0, help="time for all steps (default 500 s; smoke 1200)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a new one under TMPDIR)")
    parser.add_argument("--data", default="", help="conversations to train on (default: FastChat's dummy data)")
    parser.add_argument("--tests", nargs="*", help="test files or ids for the tests step (default: gpu_tests())")
    parser.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    parser.add_argument("--variants", default="", help="comma-separated throughput recipes (default: the plan's)")
    parser.add_argument("--plan", action="append", default=[], metavar="KEY=JSON",
                        help="a value of the plan replaced, e.g. fp8_steps=300 or fp8_recipe='\"varlen\"'")
    parser.add_argument("--bundle", type=Path, default=REPO / ".gpubundle",
                        help="what bench/gpu/bundle.py built: Ray, torchtitan, torchao for a machine without them")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="raysft-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = dict(PLANS["smoke" if args.smoke else "gpu"])
    if args.variants:
        plan["variants"] = [v for v in plan["variants"] if v in args.variants.split(",")]
    for item in args.plan:
        key, _, value = item.partition("=")
        if key not in plan:
            parser.error(f"--plan {item}: the plan has no {key!r} (it has {', '.join(sorted(plan))})")
        plan[key] = json.loads(value)
    plan["data"] = args.data or ("builtin:demo" if args.smoke else
                                 str(next((p for p in FASTCHAT if p.is_file()), "builtin:demo")))
    (work / "plan.json").write_text(json.dumps(plan, indent=1))
    tests, excluded = (args.tests, []) if args.tests is not None else gpu_tests()
    budget = args.budget_s or (1200 if args.smoke else 500)
    todo = [s for s in steps(work, tests, args.smoke, args.bundle) if not args.only or s.name in args.only.split(",")]
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "smoke": args.smoke, "budget_s": budget,
               "work": str(work), "plan": plan, "tests": tests, "tests_excluded_need_ray": excluded, "steps": []}
    start = time.perf_counter()
    for i, step in enumerate(todo):
        left = budget - (time.perf_counter() - start) - sum(s.reserve_s for s in todo[i + 1:])
        if left < step.reserve_s:
            record = {"name": step.name, "status": "skipped", "reason": f"{left:.0f} s left of the budget"}
        elif step.name == "bundle" and not (args.bundle / "manifest.json").is_file():
            record = {"name": step.name, "status": "skipped",
                      "reason": f"no bundle at {args.bundle} (bench/gpu/bundle.py build): Ray and torchtitan as "
                                "installed, if they are"}
        else:
            print(f"check: {step.name} (up to {min(step.timeout_s, left):.0f} s) ...", flush=True)
            record = run_step(step, min(step.timeout_s, left), work)
        summary["steps"].append(record)
        if step.name == "bundle" and record["status"] == "ok":  # the later steps import Ray and torchtitan from it
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"), os.environ.get("PYTHONPATH")]))
        records = {r["name"]: r for r in summary["steps"]}
        summary.update(seconds=round(time.perf_counter() - start, 1), targets=targets(records))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        pack(work, args.out)
        print(f"check: {step.name}: {record['status']} {record.get('seconds', '')}", flush=True)
    report = table(summary)
    (args.out / "summary.md").write_text(report + "\n")
    print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
