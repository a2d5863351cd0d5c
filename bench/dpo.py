"""DPO against SFT on the same pairs, the reference pass's share of a run, and TRL's DPOTrainer on the same CPU, the
same tiny model and the same pairs, side by side in one invocation:

    python bench/dpo.py                    # demo-tiny's shape, the 400 bundled demo pairs, 2 torchrun workers

- raysft SFT: both answers of every pair as conversations (prompt + chosen, prompt + rejected), global batch 2 x
  --pairs sequences: the same tokens per step as DPO.
- raysft DPO: --pairs pairs per step; its reference pass runs first (its time is logged as an event).
- TRL DPOTrainer: one process (TRL's own CPU path), the whole batch of --pairs pairs, the reference model beside
  the policy (TRL's default), on raysft's token ids, in fp32 as raysft runs here (`bf16=False`: DPOConfig's default
  bf16 would run TRL's forward under CPU autocast, which is not like for like).
Throughput is real tokens per second over the steps after --warmup (raysft: from metrics.jsonl; TRL: from its
step times); pairs/s is pairs per step over the mean step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from common import BENCH_DIR, environment, save_results

REPO = BENCH_DIR.parent


def build(work: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raysft.config import ModelConfig
    from raysft.data.demo import make_demo_preferences
    from raysft.data.tokenizer import load_tokenizer
    from raysft.model.build import PRESETS

    tok = load_tokenizer(ModelConfig(), "auto")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PRESETS["demo-tiny"], vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False))
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    pairs = make_demo_preferences()
    (work / "pairs.json").write_text(json.dumps(pairs))
    sft = [{"messages": [*p["prompt"], *p[side]]} for p in pairs for side in ("chosen", "rejected")]
    (work / "sft.json").write_text(json.dumps(sft))
    return tok


def raysft_run(work: Path, name: str, args, *sets: str) -> tuple[list[dict], float]:
    common = [f"model.path={work / 'model'}", f"model.tokenizer={work / 'model'}", f"run.storage_path={work}",
              f"run.name={name}", f"train.max_steps={args.steps}", "train.log_every_n_steps=1",
              f"checkpoint.every_n_steps={args.steps}", "data.max_seq_len=256", "train.warmup_steps=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.workers), "-m", "raysft.run",
           "jobs/configs/demo.yaml", *[a for s in [*common, *sets] for a in ("--set", s)]]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()], wall


def trl_run(work: Path, tok, args) -> tuple[float, float]:
    """(tokens/s, pairs/s) of TRL's DPOTrainer on raysft's token ids, after --warmup steps."""
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from raysft.config import DataConfig
    from raysft.data import IGNORE_INDEX, prepare_store, read_store

    store = prepare_store(DataConfig(paths=[str(work / "pairs.json")], max_seq_len=256), tok, work / "datasets",
                          objective="dpo").path
    rows = read_store(store, ["input_ids", "labels"]).to_pylist()
    pairs = []
    for c, r in zip(rows[0::2], rows[1::2], strict=True):
        spans = [[i for i, t in enumerate(x["labels"]) if t != IGNORE_INDEX] for x in (c, r)]
        pairs.append({"prompt_ids": c["input_ids"][: spans[0][0]], "chosen_ids": c["input_ids"][spans[0][0]:],
                      "rejected_ids": r["input_ids"][spans[1][0]:]})

    class SameTokens(DPOTrainer):
        def _prepare_dataset(self, dataset, *a, **k):
            return dataset

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    torch.set_num_threads(args.workers)
    config = DPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=args.pairs, max_steps=args.steps,
                       learning_rate=5e-4, bf16=False, report_to=[], use_cpu=True, save_strategy="no", max_length=None,
                       logging_steps=args.steps, gradient_checkpointing=False)
    trainer = SameTokens(model=LlamaForCausalLM.from_pretrained(work / "model"), args=config,
                         train_dataset=Dataset.from_list(pairs), processing_class=tok, callbacks=[Clock()])
    trainer.train()
    step_s = (marks[-1] - marks[args.warmup - 1]) / (len(marks) - args.warmup)
    tokens = statistics.mean(len(p["prompt_ids"]) * 2 + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    return tokens * args.pairs / step_s, args.pairs / step_s


def after_warmup(records: list[dict], warmup: int) -> dict:
    steps = [m for m in records if "loss" in m and m["step"] > warmup]
    span = steps[-1]["time"] - steps[0]["time"]
    return {"tokens_per_s": sum(m["tokens"] for m in steps[1:]) / span, "step_s": span / (len(steps) - 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=16, help="pairs per step (SFT: twice as many sequences)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="", help="results JSON")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="raysft-bench-dpo-"))
    tok = build(work)
    micro = args.pairs // args.workers // 2
    load = []  # the machine's 1-minute load average after each variant: on a shared machine, what it competed with
    sft, sft_wall = raysft_run(work, "sft", args, f"data.paths=[{work / 'sft.json'}]",
                               f"train.global_batch_size={2 * args.pairs}", f"train.micro_batch_size={2 * micro}")
    load.append(os.getloadavg()[0])
    dpo, dpo_wall = raysft_run(work, "dpo", args, f"data.paths=[{work / 'pairs.json'}]", "train.objective=dpo",
                               f"train.global_batch_size={args.pairs}", f"train.micro_batch_size={micro}")
    load.append(os.getloadavg()[0])
    reference = next(m for m in dpo if m.get("event") == "reference_logps")
    trl_tokens, trl_pairs = trl_run(work, tok, args)
    load.append(os.getloadavg()[0])
    s, d = after_warmup(sft, args.warmup), after_warmup(dpo, args.warmup)
    results = [
        {"variant": "raysft SFT (both answers)", "tokens_per_s": s["tokens_per_s"], "wall_s": sft_wall},
        {"variant": "raysft DPO", "tokens_per_s": d["tokens_per_s"], "pairs_per_s": args.pairs / d["step_s"],
         "wall_s": dpo_wall, "reference_s": reference["seconds"],
         "reference_share": reference["seconds"] / dpo_wall},
        {"variant": "TRL DPOTrainer (1 process, fp32)", "tokens_per_s": trl_tokens, "pairs_per_s": trl_pairs,
         "trl": version("trl")},
    ]
    for row, value in zip(results, load, strict=True):
        row["load_average_after"] = value
    table = "\n".join(["| variant | tokens/s | pairs/s | reference pass |", "|---|---:|---:|---:|"] + [
        f"| {r['variant']} | {r['tokens_per_s']:.0f} | "
        + (f"{r['pairs_per_s']:.1f} | " if "pairs_per_s" in r else "— | ")
        + (f"{r['reference_s']:.1f} s = {100 * r['reference_share']:.0f}% of the run's {r['wall_s']:.0f} s |"
           if "reference_s" in r else "|") for r in results])
    print(table)
    if args.out:
        save_results(args.out, args, results, table)
    print(json.dumps({"environment": environment()}, default=str)[:400])


if __name__ == "__main__":
    main()
