"""What the benchmarks share: a LLaMA of a chosen size on the demo data, a local Ray, a worker group that runs one
function, and memory readings."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

MiB = 2**20
BENCH_DIR = Path(__file__).resolve().parent


def add_model_args(parser: argparse.ArgumentParser, workers: int) -> None:
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width; 0: 8/3 × hidden, rounded to 64")
    parser.add_argument("--vocab", type=int, default=0, help="embedding rows; 0: the tokenizer's size")
    parser.add_argument("--data", default="builtin:demo", help="conversation file(s), comma-separated")
    parser.add_argument("--gpu", action="store_true")


class Setup:
    """A scratch directory holding the model config (hidden, layers from args) and the tokenized demo data; `work`
    names the directory instead (bench/gpu/check.py's steps share one across processes)."""

    def __init__(self, args: argparse.Namespace, name: str, work: Path | None = None):
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from raysft.config import load_config
        from raysft.data import prepare_store
        from raysft.data.tokenizer import load_tokenizer

        self.args = args
        self.work = work or Path(tempfile.mkdtemp(prefix=f"raysft-bench-{name}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        model_dir = self.work / "model"
        paths = [p if p.startswith("builtin:") else str(Path(p).resolve()) for p in args.data.split(",")]
        self.common = [f"model.config={model_dir}", f"data.max_seq_len={args.seq_len}",
                       f"data.paths=[{','.join(paths)}]",
                       f"scaling.use_gpu={str(args.gpu).lower()}",
                       f"run.storage_path={self.work}", f"scaling.num_workers={args.workers}",
                       f"train.micro_batch_size={args.micro_batch}",
                       f"train.global_batch_size={args.micro_batch * args.workers}"]
        base = load_config(None, self.common)
        tokenizer = load_tokenizer(base.model, base.data.chat_template)
        self.model_config = model_config = LlamaConfig(
            hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 8 // 3 // 64 * 64,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
            num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab or len(tokenizer),
            tie_word_embeddings=False, max_position_embeddings=max(2048, args.seq_len),
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        model_config.save_pretrained(model_dir)
        with torch.device("meta"):
            self.params = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())
        self.store = prepare_store(base.data, tokenizer, base.store_dir).path

    def config(self, *sets: str):
        from raysft.config import load_config

        return load_config(None, [*self.common, *sets])

    def run(self, fn, name: str, loop: dict) -> list[dict]:
        """Run fn(loop) on a fresh worker group; each rank writes its results to <out>/<name>.rank<r>.json."""
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        if not ray.is_initialized():  # workers import the bench modules, and raysft from this checkout
            ray.init(num_cpus=self.args.workers, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(BENCH_DIR.parent)])}})
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        TorchTrainer(fn, train_loop_config={"store": str(self.store), "out": str(self.work), "name": name, **loop},
                     torch_config=TorchConfig(backend="nccl" if self.args.gpu else "gloo"),
                     scaling_config=ScalingConfig(num_workers=self.args.workers, use_gpu=self.args.gpu,
                                                  resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(name=f"bench-{name}", storage_path=str(self.work / "ray"))).fit()
        return [json.loads((self.work / f"{name}.rank{r}.json").read_text()) for r in range(self.args.workers)]


def write_rank_result(loop: dict, rank: int, result: dict) -> None:
    """Each rank writes its own numbers (a Ray report keeps only rank 0's)."""
    (Path(loop["out"]) / f"{loop['name']}.rank{rank}.json").write_text(json.dumps({"rank": rank, **result}))


def median_span(runs: list[dict], key: str, digits: int = 2) -> str:
    """"median (min-max)" of one measurement over repeated runs."""
    values = [run[key] for run in runs]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def save_results(path: str, args: argparse.Namespace, results: list[dict], table: str) -> None:
    """Print the table; write it as markdown beside the JSON of every number, with the command and versions."""
    print(table)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", *sys.argv])
    env = environment()
    out.write_text(json.dumps({"command": command, "environment": env, "args": vars(args), "results": results},
                              indent=1))
    out.with_suffix(".md").write_text(f"```\n{command}\n```\n\n{json.dumps(env)}\n\n{table}\n")
    print(f"bench: wrote {out}", file=sys.stderr)


class PeakSampler:
    """Samples a memory reading in a background thread and keeps the largest value seen."""

    def __init__(self, read, interval_s: float = 0.005):
        self.read, self.interval_s, self.peak = read, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc), so that the next allocations show up in the RSS again."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def installed(name: str) -> str | None:
    """A package's version, None where it is not installed (the GPU machine has no Ray: runs there are torchrun's)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    """The machine and versions a result was measured with."""
    import platform

    import torch

    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
           **{name: installed(name) for name in ("torch", "ray", "transformers")}}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def disk_write_gbps(directory: Path, size_mib: int) -> float:
    """dd of size_mib MiB into `directory`, flushed to disk before dd exits (conv=fdatasync): the disk's own write
    bandwidth, in the same run as what is compared with it."""
    target = directory / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={size_mib}", "conv=fdatasync"],
                         capture_output=True, text=True, check=True).stderr
    target.unlink()
    seconds = float(re.search(r"copied, ([0-9.]+) s", out).group(1))
    return size_mib * MiB / seconds / 1e9


def train_worker_pids(root_pid: int | None = None, among: list[int] | None = None) -> list[int]:
    """Ray Train's worker processes (Ray's process title `ray::RayTrainWorker`) among the descendants of root_pid
    (default: this process, the driver of a local Ray), or among the given pids (a namespace node's)."""
    import psutil

    pids = []
    for pid in among if among is not None else [p.pid for p in psutil.Process(root_pid).children(recursive=True)]:
        try:
            if " ".join(psutil.Process(pid).cmdline()).startswith("ray::RayTrainWorker"):
                pids.append(pid)
        except psutil.Error:
            pass
    return pids
