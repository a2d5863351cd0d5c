"""The seeded per-module initialization (raysft.model.seeded_init) against transformers' own from_config, in one process
and one model, twice: every rank of a run does the former at once, where rank 0 alone did the latter.

    python bench/init_time.py [--hidden 1024 --layers 12 --vocab 32000]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from raysft.model.build import build_meta_model, init_from_seed, materialize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                         vocab_size=args.vocab)
    for _ in range(2):
        start = time.perf_counter()
        torch.manual_seed(0)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config, dtype=torch.float32).parameters())
        from_config = time.perf_counter() - start
        model = build_meta_model(config, "sdpa")
        materialize(model, torch.device("cpu"))
        start = time.perf_counter()
        init_from_seed(model, 0)
        print(f"{params / 1e6:.0f}M parameters, {torch.get_num_threads()} threads: from_config {from_config:.1f} s, "
              f"init_from_seed {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
