"""Per-step metrics: FLOP counting for MFU, the ETA, and the driver's progress bar (tests/test_cli.py draws it on a
real terminal)."""

import io
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raysft.training.metrics import (
    METRICS_FILE,
    MetricsLogger,
    ProgressBar,
    format_duration,
    matmul_parameters,
    peak_tflops,
    progress_line,
    training_flops,
)

ROW = {"loss": 1.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "peak_mem_gb": 1.0}


def tiny_llama(tied: bool):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_matmul_parameters_leave_out_the_input_embedding_unless_it_is_the_output_layer():
    untied, tied = tiny_llama(False), tiny_llama(True)
    total = sum(p.numel() for p in untied.parameters())
    assert matmul_parameters(untied) == total - 100 * 64
    assert matmul_parameters(tied) == sum(p.numel() for p in tied.parameters())  # shared: counted once, as lm_head


def test_training_flops_follow_palms_count_per_sample():
    # 6 per parameter per token, plus 12 · layers · hidden · n for each of a sample's n tokens
    assert training_flops([3, 5], matmul_params=1000, layers=2, hidden=8) == \
        3 * (6000 + 12 * 2 * 8 * 3) + 5 * (6000 + 12 * 2 * 8 * 5)
    assert peak_tflops(torch.device("cpu"), "bf16") is None  # no MFU without a known peak


def test_progress_line_and_eta(tmp_path):
    assert format_duration(59.6) == "1m00s" and format_duration(3725) == "1h02m"
    line = progress_line(30, 300, {**ROW, "mfu": 0.412}, eta_s=125)
    assert line.startswith("step 30/300 | loss 1.5000") and "MFU 41.2%" in line and line.endswith("eta 2m05s")
    assert progress_line(30, 300, {**ROW, "eval_loss": 1.23456, "eval_s": 3.21}, None).endswith(
        "| peak mem 1.00 GiB | eval_loss 1.2346 (3.2s)")
    log = MetricsLogger(tmp_path, max_steps=10, log_every=100)
    for step in range(1, 4):
        log.step(step, ROW)
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert "eta_s" not in rows[0] and rows[2]["eta_s"] >= 0


def test_progress_bar_follows_this_launchs_rows_only(tmp_path):
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 99, "time": 0, **ROW}) + "\n")  # an earlier launch
    out = io.StringIO()
    bar = ProgressBar(tmp_path, max_steps=8, out=out)
    bar.poll()
    assert out.getvalue() == ""
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write(json.dumps({"step": 2, "time": 1, **ROW, "eta_s": 30}) + "\n" + '{"step": 3, "ti')  # torn last line
    bar.poll()
    assert out.getvalue() == "\r\033[K" + "██████" + "·" * 18 + "  25% " + progress_line(2, 8, ROW, 30)



def test_progress_bar_counts_to_the_steps_this_launch_derived_from_num_epochs(tmp_path):
    """With train.num_epochs the config's max_steps is not the run's length: the driver derives it from the data's
    size and records the launch (LAUNCH_CONFIG_FILE) before the first step; the bar counts to that, and to the
    config's where no launch was recorded."""
    from raysft.checkpoint.discovery import LAUNCH_CONFIG_FILE

    (tmp_path / LAUNCH_CONFIG_FILE).write_text(json.dumps({"train": {"max_steps": 40, "num_epochs": 2}}))
    out = io.StringIO()
    bar = ProgressBar(tmp_path, max_steps=300, out=out)  # the config's default max_steps
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 10, "time": 1, **ROW, "eta_s": 30}) + "\n")
    bar.poll()
    assert out.getvalue() == "\r\033[K" + "██████" + "·" * 18 + "  25% " + progress_line(10, 40, ROW, 30)
    unrecorded = ProgressBar(tmp_path / "none", max_steps=300, out=io.StringIO())
    assert unrecorded._launched_steps() == 300

def test_step_totals_wait_for_the_device_once_per_reduction(tmp_path):
    """Three steps held back, then one reduction (a gloo group of one): each row's loss is its own, throughput is
    that of the window since the first step began, and the last row's time is when the reduction ended."""
    import time

    import torch.distributed as dist

    from raysft.training.metrics import StepTotals

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        totals = StepTotals(torch.device("cpu"), peak_tflops=None)
        start = time.time() - 2.0
        for step in (1, 2, 3):
            totals.add(start, {"loss_sum": torch.tensor(6.0 * step), "grad_norm": torch.tensor(0.5)},
                       {"step": step, "loss_tokens": 3, "lr": 1e-3, "epoch": 0, "tokens": 100, "computed_tokens": 120,
                        "flops": 1e9, "peak_mem_gb": 0.25 * step})
        rows = totals.reduce()
        assert totals.reduce() == []  # nothing held back any more
    finally:
        dist.destroy_process_group()
    assert [r["loss"] for r in rows] == [2.0, 4.0, 6.0] and [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["tokens"] == 100 and r["computed_tokens"] == 120 and r["grad_norm"] == 0.5 for r in rows)
    assert [r["peak_mem_gb"] for r in rows] == [0.25, 0.5, 0.75] and rows[0]["mfu"] is None
    window = rows[-1]["time"] - start
    assert rows[0]["tokens_per_s"] == rows[-1]["tokens_per_s"] == pytest.approx(300 / window, rel=1e-3)
    assert rows[-1]["time"] >= rows[1]["time"] >= rows[0]["time"]
