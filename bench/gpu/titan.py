"""The torchtitan leg of bench/gpu/check.py: `python bench/gpu/titan.py WORK` runs torchtitan 0.3.0's Llama-3 trainer
(`python -m torchtitan.train`, under torchrun, with bench/gpu/titan_config.py's config) on the throughput step's
shape, dtype and about its tokens per step, and writes WORK/titan.json: its tokens/s and MFU beside raysft's.

torchtitan's trainer needs an accelerator: without a GPU (tools/utils.py takes "cuda" when torch finds no device,
then the trainer calls torch.cuda.set_device), so on the CPU this leg stops after the part that runs there: the
data, the command, and torchtitan's own config parsed and its tokenizer and data loader built from it, one batch
drawn (`dry`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent
REPO = GPU_DIR.parent.parent
sys.path[:0] = [str(GPU_DIR), str(REPO)]

from steps import Results, setup  # noqa: E402

TOKENIZER = REPO / "raysft" / "assets" / "demo" / "tokenizer"  # the check's tokenizer (the demo's: no model.path)
# What differs from raysft's `compiled` recipe, besides the framework: said in the JSON.
DIFFERENCES = [
    "data: the same samples (raysft's tokenized store decoded to text, in store order), which torchtitan's text "
    "loader tokenizes again (adding BOS/EOS) and packs into full rows of seq_len tokens, cutting samples at row "
    "ends; raysft packs whole samples into a token budget",
    "loss: torchtitan's on every token; raysft's on assistant tokens only (the same forward and backward work)",
    "tokens per step: local_batch_size x seq_len, the nearest whole number of rows to raysft's global batch of "
    "samples (both counted in the JSON)",
    "precision: one GPU, so torchtitan trains under torch.autocast(bf16) with fp32 parameters; raysft's one worker "
    "under FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 parameters and gradient reduction)",
    "attention: torchtitan's varlen backend (one attention per packed document), as raysft's flash varlen",
    "compile: torchtitan compiles its model and loss (compile.components); raysft compiles each decoder layer",
    "optimizer: AdamW (betas 0.9/0.95, weight decay 0.1, torchtitan's defaults) against raysft's AdamW settings",
]
LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?"
                  r"mfu:\s*([\d.]+|N/A)")


def write_text_dataset(plan: dict, work: Path) -> dict:
    """The throughput step's samples as torchtitan's text dataset: one JSON line per sample, its tokens decoded."""
    from transformers import AutoTokenizer

    from raysft.data import read_store

    s = setup(plan, "model", work)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    samples = read_store(s.store, columns=["input_ids"]).column("input_ids").to_pylist()
    path = work / "titan" / "data.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for ids in samples:
            f.write(json.dumps({"text": tokenizer.decode(ids)}) + "\n")
    tokenizer_dir = path.parent / "tokenizer"  # the tokenizer without its chat template: torchtitan's jinja
    tokenizer_dir.mkdir(exist_ok=True)           # environment has no {% generation %} tag, and the text loader
    for name in ("tokenizer.json", "tokenizer_config.json"):  # uses no template
        shutil.copy2(TOKENIZER / name, tokenizer_dir / name)
    real_per_step = plan["global_batch"] * sum(map(len, samples)) / len(samples)
    rows = max(1, round(real_per_step / plan["seq_len"]))
    return {"path": str(path), "tokenizer": str(tokenizer_dir), "samples": len(samples),
            "raysft_real_tokens_per_step": real_per_step, "local_batch_size": rows,
            "tokens_per_step": rows * plan["seq_len"]}


def flags(plan: dict, data: dict, steps: int) -> list[str]:
    gpu = plan["gpu"]
    return ["--module", "titan_config", "--config", "raysft_1b" if gpu else "raysft_toy",
            "--hf_assets_path", data["tokenizer"], "--dataloader.dataset_path", data["path"],
            "--training.steps", str(steps), "--training.seq_len", str(plan["seq_len"]),
            "--training.local_batch_size", str(data["local_batch_size"]),
            "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            "--dump_folder", str(Path(data["path"]).parent / "out"), *(["--compile.enable"] if gpu else [])]


def dry(plan: dict, data: dict, steps: int) -> dict:
    """What runs without a GPU: torchtitan's ConfigManager parses the flags, and its tokenizer and data loader,
    built from the parsed config as its trainer builds them, give one step's batch."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(flags(plan, data, steps))
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=config.training.seq_len,
                                     local_batch_size=config.training.local_batch_size, snapshot_every_n_steps=None)
    inputs, labels = next(iter(loader))
    return {"batch_shape": list(inputs["input"].shape), "label_shape": list(labels.shape),
            "model": f"{config.model_spec.name} {config.model_spec.flavor}", "dim": config.model_spec.model.dim,
            "weight_tying": config.model_spec.model.enable_weight_tying, "compile": config.compile.enable}


def parse_log(text: str) -> list[dict]:
    return [{"step": int(m[1]), "loss": float(m[2]), "memory_gib": float(m[3]), "tps": float(m[4].replace(",", "")),
             "mfu_pct": None if m[5] == "N/A" else float(m[5])} for m in LINE.finditer(text)]


def train(plan: dict, work: Path, data: dict, steps: int, timeout_s: float) -> dict:
    """torchtitan's trainer under torchrun, as its users run it; the log lines of every step."""
    log = work / "titan" / "train.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(GPU_DIR), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                               "-m", "torchtitan.train", *flags(plan, data, steps)], cwd=work / "titan", env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - start,
            "steps": parse_log(log.read_text(errors="replace"))}


def compare(plan: dict, work: Path, run: dict) -> dict:
    """The measured steps (after the warm-up) of torchtitan against the throughput step's `compiled` recipe (or its
    fastest), MFU both as torchtitan counts it and with raysft's count of FLOPs per token of the same samples."""
    from raysft.training.metrics import PEAK_TFLOPS

    warm = plan["warmup"] + plan["compile_warmup"]
    measured = [r for r in run["steps"] if r["step"] > warm]
    if not measured:
        return {}
    tps = sum(r["tps"] for r in measured) / len(measured)
    gflop = json.loads((work / "prepare.json").read_text())["model"]["gflop_per_token"]
    env = json.loads((work / "environment.json").read_text()) if (work / "environment.json").is_file() else {}
    name = env.get("gpu", {}).get("name", "")
    peak = next((p["bf16"] for key, p in PEAK_TFLOPS.items() if key in name), None)
    variants = json.loads((work / "throughput.json").read_text()).get("variants", {})
    ok = {v: r for v, r in variants.items() if r.get("status") == "ok"}
    ours = ok.get("compiled") or max(ok.values(), key=lambda r: r["tokens_per_s"], default={})
    return {"torchtitan_tokens_per_s": tps, "torchtitan_mfu_own": measured[-1]["mfu_pct"] and
            sum(r["mfu_pct"] for r in measured) / len(measured) / 100,
            "torchtitan_mfu_raysft_count": tps * gflop * 1e9 / (peak * 1e12) if peak else None,
            "torchtitan_peak_reserved_gib": max(r["memory_gib"] for r in measured),
            "raysft_recipe": "compiled" if "compiled" in ok else None, "raysft_tokens_per_s": ours.get("tokens_per_s"),
            "raysft_mfu": ours.get("mfu"),
            "raysft_over_torchtitan": ours["tokens_per_s"] / tps if ours.get("tokens_per_s") else None}


def main() -> int:
    work = Path(sys.argv[1])
    plan = json.loads((work / "plan.json").read_text())
    out = Results(work / "titan.json")
    out["differences"] = DIFFERENCES
    data = write_text_dataset(plan, work)
    steps = plan["warmup"] + plan["compile_warmup"] + plan["steps"]
    out["data"], out["command"] = data, ["python", "-m", "torchtitan.train", *flags(plan, data, steps)]
    import torch

    gpu = torch.cuda.is_available()
    try:
        import torchtitan  # noqa: F401 - from the bundle on the GPU machine
    except ImportError as e:  # the CPU smoke without the bundle: nothing of torchtitan can run
        out["dry"] = f"not run: {type(e).__name__}: {e}"
        return 1 if gpu else 0
    out["dry"] = dry(plan, data, steps)
    if not gpu:
        out["trained"] = "no: torchtitan's trainer needs an accelerator"
        return 0
    out["run"] = train(plan, work, data, steps, plan["titan_timeout_s"])
    out["comparison"] = compare(plan, work, out.data["run"])
    return 0 if out.data["run"]["returncode"] == 0 and out.data["comparison"] else 1


if __name__ == "__main__":
    sys.exit(main())
