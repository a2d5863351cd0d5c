"""The Trainer's batch, loss and kernel modes under plain torch.distributed (two gloo processes, no Ray): padded
with the full-logits loss (the reference), the chunked loss, packed rows with SDPA, packed rows with varlen
attention cut to a token budget, compiled decoder layers. All train the same samples to the same loss curve
within float tolerance, and a run stopped and resumed (deterministic kernels on) equals the uninterrupted one bit
for bit."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_config
from safetensors.torch import load_file

from raysft.checkpoint import DirectorySink
from raysft.config import TrainConfig, config_from_dict
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.training.metrics import read_metrics

STEPS = 6
BASE = {"train.max_steps": STEPS, "checkpoint.every_n_steps": 3, "checkpoint.mode": "full",
        "train.log_every_n_steps": 2, "train.global_batch_size": 8, "train.micro_batch_size": 2}
PACKED = {"data.packing": True, "model.attn_implementation": "varlen", "train.micro_batch_tokens": 192}
VARIANTS = {
    "padded-full-logits": {"train.loss_chunk_tokens": 0},
    "chunked-loss": {"train.loss_chunk_tokens": 16},
    "packed-sdpa": {"data.packing": True},  # a block-causal mask from the restarting position_ids
    "packed-varlen-budget": {**PACKED, "train.deterministic": True},
    "compiled": {"parallel.compile": True},
}


def _run(rank: int, world_size: int, init: str, runs: list[tuple[str, dict, str | None]], store: str) -> None:
    from raysft.training.trainer import Trainer, WorkerContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        for _, cfg_dict, resume in runs:
            cfg = config_from_dict(cfg_dict)
            trainer = Trainer(cfg, Path(store), Path(resume) if resume else None, DirectorySink(cfg.run_dir, rank),
                              WorkerContext(rank, world_size, torch.device("cpu")))
            if cfg.parallel.compile:
                from torch._dynamo.utils import counters

                graphs = counters["stats"]["unique_graphs"]
                trainer.train()
                layers = trainer.model.model.layers
                assert all(layer._compiled_call_impl is not None for layer in layers)
                assert counters["stats"]["unique_graphs"] > graphs  # Dynamo did compile the layers' code
            else:
                trainer.train()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def steps(cfg: TrainConfig) -> list[dict]:
    return [m for m in read_metrics(cfg.run_dir) if "loss" in m]


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_modes_train_alike_and_resume_bit_for_bit(tmp_path):
    configs = {name: tiny_config(tmp_path, **{**BASE, **sets, "run.name": name}) for name, sets in VARIANTS.items()}
    stopped = tiny_config(tmp_path, **{**BASE, **VARIANTS["packed-varlen-budget"], "run.name": "resumed",
                                       "train.stop_at_step": 3})
    resumed = tiny_config(tmp_path, **{**BASE, **VARIANTS["packed-varlen-budget"], "run.name": "resumed"})
    base = configs["padded-full-logits"]
    store = prepare_store(base.data, load_tokenizer(base.model, base.data.chat_template), base.store_dir).path
    runs = [(name, cfg.to_dict(), None) for name, cfg in configs.items()]
    runs += [("stopped", stopped.to_dict(), None),
             ("resumed", resumed.to_dict(), str(resumed.run_dir / "checkpoint_00000003"))]
    mp.spawn(_run, args=(2, f"file://{tmp_path / 'pg'}", runs, str(store)), nprocs=2, join=True)

    ref = steps(base)
    assert [m["step"] for m in ref] == list(range(1, STEPS + 1))
    for name, cfg in configs.items():
        rows = steps(cfg)
        assert [m["tokens"] for m in rows] == [m["tokens"] for m in ref], name  # the same samples every step
        torch.testing.assert_close([m["loss"] for m in rows], [m["loss"] for m in ref], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close([m["grad_norm"] for m in rows], [m["grad_norm"] for m in ref], rtol=1e-3,
                                   atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    packed = steps(configs["packed-varlen-budget"])
    assert all(m["computed_tokens"] == m["tokens"] for m in packed + steps(configs["packed-sdpa"]))  # no padding
    assert all(m["computed_tokens"] > m["tokens"] for m in ref)  # padded to each micro-batch's longest sample

    # stopped at 3 and resumed: the same floats as the uninterrupted run, steps 1..6 each once
    rows = [(m["step"], m["loss"], m["grad_norm"]) for m in steps(resumed)]
    assert rows == [(m["step"], m["loss"], m["grad_norm"]) for m in packed]
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(resumed.run_dir / "checkpoint_00000006" / name)
        b = load_file(configs["packed-varlen-budget"].run_dir / "checkpoint_00000006" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    state = json.loads((resumed.run_dir / "checkpoint_00000006" / "trainer_state.json").read_text())
    assert state["step"] == STEPS


@pytest.mark.parametrize("sets, key", [
    ({"train.micro_batch_tokens": 256}, "train.micro_batch_tokens"),  # without packing
    ({"data.packing": True, "train.micro_batch_tokens": 64}, "train.micro_batch_tokens"),  # < max_seq_len (96)
    ({"model.attn_implementation": "varlen"}, "model.attn_implementation"),
    ({"data.packing": True, "train.micro_batch_tokens": 128, "train.global_batch_size": 3},
     "train.global_batch_size"),
])
def test_token_budget_and_varlen_config_errors(tmp_path, sets, key):
    from raysft.config import ConfigError

    with pytest.raises(ConfigError, match=f"'{key}'"):
        tiny_config(tmp_path, **sets)


def preemption_decisions(tmp_path, monkeypatch, deadline_at, stop_from: int = 10**9, steps: int = 14,
                         step_s: float = 0.25, save_s: float = 0.0, events: list | None = None
                         ) -> tuple[list, list[int]]:
    """The Checkpointer's Due at each of `steps` steps of `step_s` seconds on a fake clock (rank 0 of 1, the
    notice's save measured at `save_s` seconds; the clock does not move for it), with Ray announcing the deadline
    `deadline_at(step, now)` (None: no notice) and a stop requested from step `stop_from`; and the steps at which
    Ray was asked. The events logged are appended to `events`."""
    from types import SimpleNamespace

    import raysft.checkpoint.checkpointer
    from raysft.checkpoint.checkpointer import Checkpointer

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(raysft.checkpoint.checkpointer, "time",
                        SimpleNamespace(perf_counter=lambda: clock.now, time=lambda: clock.now))
    asked, step = [], 0
    checkpointer = Checkpointer.__new__(Checkpointer)  # only the preemption state: no model or data
    checkpointer.rank, checkpointer.device = 0, torch.device("cpu")
    checkpointer.cfg = SimpleNamespace(every_n_steps=5)
    checkpointer.log = SimpleNamespace(event=lambda kind, **k: events is not None and events.append((kind, k)))
    checkpointer.preemption_deadline = lambda: asked.append(step) or deadline_at(step, clock.now)
    checkpointer.deadline, checkpointer.last_chance_taken, checkpointer.save_s = None, False, save_s
    checkpointer.stop_requested = lambda: step >= stop_from
    checkpointer.next_notice_check, checkpointer.checked_at = 0, (0, 0.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        decisions = []
        for step in range(1, steps + 1):
            clock.now = step_s * step
            decisions.append(checkpointer.due(step, steps, step_s))
    finally:
        dist.destroy_process_group()
    return decisions, asked


def test_ray_is_asked_for_preemption_about_once_a_second_at_steps_every_rank_agrees_on(tmp_path, monkeypatch):
    """Steps of 0.25 s: Ray is asked at step 1, then every 4 steps (rank 0's measure, all-reduced), and a notice
    is acted on at the step it is heard; a stop request raised at step 10 is acted on at the next check, step 13.
    The Checkpointer alone decides: each step's Due joins these to the cadence (every 5 steps and the last)."""
    from raysft.checkpoint.checkpointer import NOTICE_CHECK_S

    decisions, asked = preemption_decisions(tmp_path, monkeypatch, lambda step, now: now + 600 if step >= 9 else None,
                                            stop_from=10)
    due, stops = [d.preempted for d in decisions], [d.stop for d in decisions]
    assert [d.scheduled for d in decisions] == [step % 5 == 0 or step == 14 for step in range(1, 15)]
    assert [step for step, d in enumerate(decisions, 1) if d.save] == [5, 9, 10, 13, 14]
    assert [step for step, d in enumerate(decisions, 1) if d.urgent] == [9, 13]  # committed before going on
    every = int(NOTICE_CHECK_S / 0.25)
    assert asked == [1, 1 + every, 1 + 2 * every] == [1, 5, 9]  # not asked again once a notice came
    assert due == [step == 9 for step in range(1, 15)]  # the notice: checkpoint now
    assert stops == [step == 13 for step in range(1, 15)]


def test_a_preemption_deadline_gets_one_last_checkpoint_once_it_is_nearer_than_two_steps_and_a_save(tmp_path,
                                                                                                   monkeypatch):
    """A notice at step 9 (t 2.25 s) of a node drained at t 3.25 s: checkpoint at once, then once more at the
    first step after which two more steps (0.5 s) would reach the deadline, step 11 (t 2.75 s), and no more.
    The faulted cluster's run checks the same on a real drain; there the steps it loses depend on its clock."""
    decisions, _ = preemption_decisions(tmp_path, monkeypatch, lambda step, now: 3.25 if step >= 9 else None)
    assert [step for step, d in enumerate(decisions, 1) if d.preempted] == [9, 11]
    assert [step for step, d in enumerate(decisions, 1) if d.urgent] == [9, 11]


def test_a_last_checkpoint_that_could_not_land_before_the_deadline_is_not_begun(tmp_path, monkeypatch):
    """The same notice, but the notice's save took 1 s: at step 10 (t 2.5 s) two steps and a save reach past the
    deadline, and a save begun then would end at t 3.5 s, after the node went. None is begun (the notice's
    checkpoint stays the newest), and the log says why."""
    events = []
    decisions, _ = preemption_decisions(tmp_path, monkeypatch, lambda step, now: 3.25 if step >= 9 else None,
                                        save_s=1.0, events=events)
    assert [step for step, d in enumerate(decisions, 1) if d.preempted] == [9]
    assert [(kind, k["step"]) for kind, k in events] == [("preemption_notice", 9), ("preemption_too_late_to_save", 10)]
    assert events[1][1]["save_s"] == 1.0 and events[1][1]["seconds_left"] == 0.8
