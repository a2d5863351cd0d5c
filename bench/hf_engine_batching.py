"""The hf evaluation engine's batching, side by side in one process on one model and one eval set of real length
variety: prompts of neighbouring lengths padded on the left (raysft.evals.engines.length_sorted_batches, what the
engine does) against batches of prompts of one length only (no padding: what it did), both greedy.

    python bench/hf_engine_batching.py [--prompts 128] [--batch-size 16] [--new-tokens 32] [--hidden 512 --layers 8]

The eval set: the first human turn of FastChat's dummy_conversation.json (../shared/datasets; the demo's 40 eval
questions where it is absent), each expecting its gpt answer. The model: a LLaMA of --hidden and --layers with
random weights and the demo tokenizer (what it answers does not change what a batch costs). Reported: prompts/s of
each (median of --repeats, alternating), the batches each made and their mean size, the padding the left-padded
one added, and how many greedy answers the two agree on (a padded row computes what it computes alone up to
floating-point order: a near tie may go the other way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import BENCH_DIR, save_results

FASTCHAT = BENCH_DIR.parent.parent / "shared" / "datasets" / "fastchat" / "dummy_conversation.json"


def eval_set(n: int) -> list:
    from raysft.evals.evalset import EvalSample, read_eval_set

    if not FASTCHAT.is_file():
        return read_eval_set("builtin:demo-eval", ["exact_match"])[:n]
    records = json.loads(FASTCHAT.read_text())
    samples = []
    for record in records:
        turns = record["conversations"]
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            samples.append(EvalSample(f"record {len(samples) + 1}", [{"role": "user", "content": turns[0]["value"]}],
                                      turns[1]["value"]))
        if len(samples) == n:
            break
    return samples


def equal_length_batches(prompts: list[list[int]], size: int) -> list[list[int]]:
    """The baseline: batches of prompts of one length only (no padding)."""
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    return [group[j : j + size] for group in by_length.values() for j in range(0, len(group), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(BENCH_DIR.parent / "runs" / "bench" / "hf_engine_batching.json"))
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raysft.config import GenEvalConfig, ModelConfig
    from raysft.data.tokenizer import load_tokenizer
    from raysft.evals.engines import HfEngine, length_sorted_batches

    tok = load_tokenizer(ModelConfig(), "auto")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), vocab_size=len(tok),
                         max_position_embeddings=4096, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with tempfile.TemporaryDirectory(prefix="raysft-bench-batching-") as tmp:
        LlamaForCausalLM(config).save_pretrained(Path(tmp) / "model")
        tok.save_pretrained(Path(tmp) / "model")
        engine = HfEngine(Path(tmp) / "model", GenEvalConfig(path="x", max_new_tokens=args.new_tokens,
                                                             batch_size=args.batch_size))
    samples = eval_set(args.prompts * 4)
    prompts = [p for p in (engine.prompt_ids(s) for s in samples) if len(p) <= args.max_prompt_tokens][: args.prompts]
    plans = {"left-padded, neighbouring lengths": length_sorted_batches(prompts, args.batch_size),
             "one length per batch (no padding)": equal_length_batches(prompts, args.batch_size)}
    seconds: dict[str, list[float]] = {name: [] for name in plans}
    answers: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, batches in plans.items():
            start = time.perf_counter()
            answers[name] = engine.generate_ids(prompts, batches)
            seconds[name].append(time.perf_counter() - start)
    lengths = [len(p) for p in prompts]
    base = "one length per batch (no padding)"
    rows, results = [], []
    for name, batches in plans.items():
        padded = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)
        rate = len(prompts) / statistics.median(seconds[name])
        result = {"batching": name, "prompts_per_s": round(rate, 2), "batches": len(batches),
                  "mean_batch": round(len(prompts) / len(batches), 2), "padding_tokens": padded,
                  "prompt_tokens": sum(lengths), "seconds": [round(x, 2) for x in seconds[name]]}
        results.append(result)
        ratio = rate / (len(prompts) / statistics.median(seconds[base]))
        rows.append(f"| {name} | {rate:.2f} | {ratio:.2f} | {len(batches)} | {len(prompts) / len(batches):.1f} | "
                    f"{padded} of {sum(lengths) + padded} |")
    agree = sum(a.text == b.text for a, b in zip(*answers.values(), strict=True))
    table = "\n".join([
        f"{len(prompts)} prompts of {min(lengths)} to {max(lengths)} tokens (median {statistics.median(lengths):.0f}),"
        f" batch size {args.batch_size}, {args.new_tokens} new tokens, {args.hidden}x{args.layers} LLaMA on "
        f"{torch.get_num_threads()} threads; greedy answers the same in both: {agree} of {len(prompts)}",
        "", "| batching | prompts/s | vs no padding | batches | mean batch | padding tokens |",
        "|---|---:|---:|---:|---:|---:|", *rows])
    save_results(args.out, args, results, table)


if __name__ == "__main__":
    main()
