"""raysft's DPO against the reference implementation, TRL's DPOTrainer: the same tiny random LLaMA, the same pairs,
the same tokens (TRL is given raysft's token ids: the prompt up to the first answer label, the answer through the
last), the same optimizer (AdamW, constant learning rate, no weight decay) and gradient clipping (max norm 1.0, which
the IPO and sft_weight runs' gradients exceed). raysft trains on 2 gloo workers with micro-batches of 2 pairs, TRL
on one process with the whole batch, in fp32 (`bf16=False`: DPOConfig turns bf16 on by default, and accelerate then
runs TRL's forward under CPU autocast). The loss, the gradient norm and TRL's reward and logit metrics agree at
every step, and so does plain PyTorch autograd of the same loss.

Tolerance: everything is fp32 on the CPU. The three compute the same sums in other orders (raysft's chunked
cross-entropy at the label positions, its reference from a pass before training and its gradient reduced over two
workers; TRL's fused LM head and a reference model beside the policy), so they differ by float rounding only
(measured: at most 4e-5 relative, on a reward of 0.005; 9e-9 on a mean logit of 3e-5, hence 1e-7 absolute for
values near 0): relative 1e-4 is far below any real difference. A wrong
normalization or a label off by one token moves them by percents, and a gradient off by a constant factor moves
`grad_norm` by that factor (AdamW's update hardly depends on its scale, so the later steps alone would not show it)."""

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

from raysft.data import IGNORE_INDEX, prepare_store, read_store
from raysft.data.demo import make_demo_preferences
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics

trl = pytest.importorskip("trl")

PAIRS, STEPS, LR, CLIP = 8, 3, 1e-3, 1.0
METRICS = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]


def tiny_llama(tmp_path):
    """A random 2-layer LLaMA with the demo tokenizer, saved as a model directory both trainers load."""
    from raysft.config import ModelConfig

    tok = load_tokenizer(ModelConfig(), "auto")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def raysft_config(tmp_path, model_dir, data, loss, sft_weight):
    return tiny_config(tmp_path, **{
        "model.path": str(model_dir), "model.tokenizer": str(model_dir), "data.paths": f"[{data}]",
        "train.objective": "dpo", "dpo.beta": 0.1, "dpo.loss": loss, "dpo.sft_weight": sft_weight,
        "train.max_steps": STEPS, "train.global_batch_size": PAIRS, "train.micro_batch_size": 2,
        "train.lr": LR, "train.warmup_steps": 0, "train.min_lr_ratio": 1.0, "train.weight_decay": 0.0,
        "train.betas": "[0.9,0.999]", "train.grad_clip": CLIP, "train.log_every_n_steps": 1,
        "checkpoint.every_n_steps": 100, "run.name": f"dpo-{loss}-{sft_weight}"})


def trl_pairs(store) -> list[dict]:
    """raysft's rows as TRL's tokenized pairs: the prompt is every token before the first answer label, the answer
    every token from there through the last label (the tokens after it change no log-probability)."""
    rows = read_store(store, ["input_ids", "labels"]).to_pylist()
    pairs = []
    for chosen, rejected in zip(rows[0::2], rows[1::2], strict=True):
        spans = []
        for row in (chosen, rejected):
            labelled = [i for i, t in enumerate(row["labels"]) if t != IGNORE_INDEX]
            spans.append((labelled[0], labelled[-1] + 1))
        assert chosen["input_ids"][: spans[0][0]] == rejected["input_ids"][: spans[1][0]]
        pairs.append({"prompt_ids": chosen["input_ids"][: spans[0][0]],
                      "chosen_ids": chosen["input_ids"][slice(*spans[0])],
                      "rejected_ids": rejected["input_ids"][slice(*spans[1])]})
    return pairs


def trl_history(tmp_path, model_dir, tok, pairs, loss, sft_weight) -> list[dict]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    class SameTokens(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # raysft's token ids, as they are
            return dataset

    losses = ["sigmoid" if loss == "sigmoid" else "ipo"] + (["sft"] if sft_weight else [])
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PAIRS, max_steps=STEPS,
                     learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=CLIP, bf16=False, logging_steps=1, report_to=[],
                     beta=0.1, loss_type=losses, loss_weights=[1.0, sft_weight] if sft_weight else None,
                     use_cpu=True, seed=0, save_strategy="no", max_length=None, dataloader_num_workers=0)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SameTokens(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok)
        trainer.train()
    return [h for h in trainer.state.log_history if "rewards/chosen" in h]


def plain_pytorch_history(model_dir, pairs, loss, sft_weight) -> list[dict]:
    """The same steps in a few lines of PyTorch: each sequence alone through the model, the loss over the whole
    batch by autograd, torch's gradient clipping and AdamW."""
    import torch.nn.functional as F

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = torch.tensor([[len(p["chosen_ids"]), len(p["rejected_ids"])] for p in pairs], dtype=torch.float32)

    def logps() -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """The chosen and the rejected answers' log-probabilities, and the mean logit over each side's tokens."""
        out, logit_means = [], []
        for key in ("chosen_ids", "rejected_ids"):
            logit_sum = 0.0
            for p in pairs:
                ids, n = torch.tensor([p["prompt_ids"] + p[key]]), len(p["prompt_ids"])
                logits = model(ids).logits[0, n - 1 : -1].float()
                out.append(F.log_softmax(logits, -1).gather(1, ids[0, n:, None]).sum())
                logit_sum += logits.detach().mean(-1).sum().item()
            logit_means.append(logit_sum / sum(len(p[key]) for p in pairs))
        return torch.stack(out[: len(pairs)]), torch.stack(out[len(pairs) :]), logit_means

    with torch.no_grad():
        ref_chosen, ref_rejected, _ = logps()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    history = []
    for _ in range(STEPS):
        chosen, rejected, (chosen_logits, rejected_logits) = logps()
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if loss == "ipo":
            value = ((chosen_ratio / tokens[:, 0] - rejected_ratio / tokens[:, 1] - 1 / 0.2) ** 2).mean()
        else:
            value = -F.logsigmoid(0.1 * (chosen_ratio - rejected_ratio)).mean()
        value = value - sft_weight * chosen.sum() / tokens[:, 0].sum()
        optimizer.zero_grad()
        value.backward()
        cr, rr = 0.1 * chosen_ratio.detach(), 0.1 * rejected_ratio.detach()
        history.append({"loss": value.item(), "rewards/chosen": cr.mean().item(),
                        "rewards/rejected": rr.mean().item(),
                        "rewards/accuracies": (cr > rr).float().mean().item(),
                        "rewards/margins": (cr - rr).mean().item(),
                        "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item(),
                        "logits/chosen": chosen_logits, "logits/rejected": rejected_logits,
                        "grad_norm": torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()})
        optimizer.step()
    return history


@pytest.mark.parametrize(("loss", "sft_weight"), [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.5)])
def test_dpo_metrics_and_gradient_norms_equal_trl_dpotrainer_in_fp32_on_every_step(tmp_path, gloo_pool, loss,
                                                                                   sft_weight):
    model_dir, tok = tiny_llama(tmp_path)
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(make_demo_preferences(PAIRS, seed=3)))
    cfg = raysft_config(tmp_path, model_dir, data, loss, sft_weight)
    store = prepare_store(cfg.data, tok, cfg.store_dir, objective="dpo").path
    gloo_pool.run(launch, cfg)
    ours = [m for m in read_metrics(cfg.run_dir) if "loss" in m]
    theirs = trl_history(tmp_path, model_dir, tok, trl_pairs(store), loss, sft_weight)
    plain = plain_pytorch_history(model_dir, trl_pairs(store), loss, sft_weight)
    assert [m["step"] for m in ours] == [h["step"] for h in theirs] == list(range(1, STEPS + 1))
    for mine, trl_row, plain_row in zip(ours, theirs, plain, strict=True):
        for name in METRICS:
            assert mine[name] == pytest.approx(trl_row[name], rel=1e-4, abs=1e-7), ("TRL", mine["step"], name)
            assert mine[name] == pytest.approx(plain_row[name], rel=1e-4, abs=1e-7), ("plain", mine["step"], name)
    # the steps train, and the clipping is real where the gradient norm is above 1
    assert not np.isclose(ours[0]["loss"], ours[-1]["loss"], rtol=1e-3)
    if loss == "ipo" or sft_weight:
        assert ours[0]["grad_norm"] > CLIP
