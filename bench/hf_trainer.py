"""The FastChat-style baseline: Hugging Face Trainer with FSDP (full_shard, auto-wrapped decoder layers), every
sequence padded to the maximum length, as FastChat's train.py does. Started by torchrun; reads the same tokenized
store and model config as raysft, so only the training stack differs.

    torchrun --nproc-per-node N bench/hf_trainer.py ARGS.json

ARGS.json: model_dir, store, out, max_len, micro_batch, grad_accum, steps, lr, warmup, seed, mixed_precision
("fp32"/"bf16"), gpu. Rank r writes <out>/hf.rank<r>.json: the time after each optimizer step and the real
(non-padding) tokens this rank had consumed by then, counted at the model's forward.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from raysft.data import IGNORE_INDEX
from raysft.data.dataloader import TokenizedDataset


class PaddedToMax(torch.utils.data.Dataset):
    def __init__(self, store: Path, max_len: int, pad_id: int):
        self.data, self.max_len, self.pad_id = TokenizedDataset(store), max_len, pad_id

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.data.input_ids[i], self.data.labels[i]
        pad = self.max_len - len(ids)
        return {"input_ids": torch.tensor(ids + [self.pad_id] * pad),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad)}


class StepClock(TrainerCallback):
    def __init__(self, counter: list[int]):
        self.counter, self.rows = counter, []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.rows.append({"step": state.global_step, "time": time.time(), "tokens": self.counter[0]})


def main() -> None:
    a = json.loads(Path(sys.argv[1]).read_text())
    config = AutoConfig.from_pretrained(a["model_dir"])
    torch.manual_seed(a["seed"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    tokens = [0]

    def count_real_tokens(module, args, kwargs):
        tokens[0] += int(kwargs["attention_mask"].sum())

    model.register_forward_pre_hook(count_real_tokens, with_kwargs=True)
    layer = model.model.layers[0].__class__.__name__
    bf16 = a["mixed_precision"] == "bf16"
    args = TrainingArguments(
        output_dir=str(Path(a["out"]) / "hf-trainer"), max_steps=a["steps"], learning_rate=a["lr"],
        per_device_train_batch_size=a["micro_batch"], gradient_accumulation_steps=a["grad_accum"],
        warmup_steps=a["warmup"], lr_scheduler_type="cosine", weight_decay=0.0, logging_steps=10**9,
        save_strategy="no", report_to=[], seed=a["seed"], bf16=bf16, use_cpu=not a["gpu"],
        ddp_backend="nccl" if a["gpu"] else "gloo", dataloader_num_workers=0, disable_tqdm=True,
        fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": [layer]})
    clock = StepClock(tokens)
    trainer = Trainer(model=model, args=args, callbacks=[clock],
                      train_dataset=PaddedToMax(Path(a["store"]), a["max_len"], config.pad_token_id or 0))
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    (Path(a["out"]) / f"hf.rank{rank}.json").write_text(json.dumps(clock.rows))


if __name__ == "__main__":
    main()
