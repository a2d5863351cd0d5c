"""raysft.training.live: replica groups of one worker each train the run in a torchft quorum (a real Lighthouse in
this process, each group a process of its own with a gloo process group of world size 1). One group dies in the
middle of a step; the other redoes that step alone on the whole global batch and goes on without a restart; a
replacement heals from it and rejoins. No step is lost or applied twice, and the run is the uninterrupted run's (the
same samples in every step: only the summation order differs)."""

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from conftest import (
    STEPS,
    assert_close_but_for_rare_elements,
    final_weights,
    lighthouse_heartbeats,
    run_config,
    step_losses,
)

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow  # three processes that import torch and train

FAULT_STEP = 4  # replica group 1 dies after the quorum of step 5 (4 steps applied)


def wait_for_heartbeats(lighthouse: str, groups: int, timeout_s: float = 120) -> None:
    """Wait until the Lighthouse hears `groups` groups: a group that asks for a quorum before it hears the other
    forms one alone (and would end the run before the replacement rejoins)."""
    deadline = time.monotonic() + timeout_s
    while lighthouse_heartbeats(lighthouse) < groups:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Lighthouse did not hear {groups} replica groups in {timeout_s} s")
        time.sleep(0.1)


def replica(replica_id: int, cfg, stores, lighthouse: str, out: Path, fault: str = "mid_step") -> None:
    """One replica group: a process group of one, the trainer with LiveReplicas, trained to the end; what it did
    goes to out/replica-<id>-<pid>.json."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from raysft.checkpoint import DirectorySink, existing_checkpoint_names
    from raysft.launch.prelaunch import with_max_steps
    from raysft.training.live import LiveReplicas
    from raysft.training.trainer import WorkerContext, resume_trainer

    torch.set_num_threads(1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    class Faulty(LiveReplicas):
        """Group 1 dies once, just after it joined the quorum of step FAULT_STEP + 1; group 0, alone, waits until
        the Lighthouse hears the replacement before its next step, so that it rejoins before the run ends."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            start_quorum = self.manager.start_quorum

            def quorum_then_fault():
                start_quorum()
                if fault == "mid_step" and replica_id == 1 and self.manager.current_step() == FAULT_STEP and \
                        not (out / "died").exists():
                    (out / "died").write_text(str(os.getpid()))
                    os._exit(1)

            self.manager.start_quorum = quorum_then_fault

        def step(self, trainer, backward):
            result = super().step(trainer, backward)
            if fault == "writer_after_last" and replica_id == 0 and result is not None and \
                    trainer.state.step == STEPS - 1 and not (out / "died").exists():
                (out / "died").write_text(str(os.getpid()))  # the last step committed, not applied, not saved
                os._exit(1)
            if fault == "mid_step" and replica_id == 0 and self.participants[-1][1] == 1:
                wait_for_heartbeats(lighthouse, 2)  # the lost group's heartbeat expired before this step's quorum
            return result

    config = with_max_steps(cfg, stores)
    # the first quorum waits until the Lighthouse hears both groups (LiveReplicas, up to join_timeout_s)
    live = Faulty(replica_id, 2, lighthouse, torch.device("cpu"), store_addr="localhost", store_port=store.port,
                  join_timeout_s=120)
    sink = DirectorySink(config.run_dir, 0, keep=config.checkpoint.keep,
                         taken=existing_checkpoint_names(config.run_dir))
    trainer = resume_trainer(config, stores.train, WorkerContext(0, 1, torch.device("cpu")), sink, live=live)
    trainer.train()
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    save_file(get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
              out / f"weights-{replica_id}-{os.getpid()}.safetensors")
    (out / f"replica-{replica_id}-{os.getpid()}.json").write_text(json.dumps(
        {"step": trainer.state.step, "participants": live.participants}))
    live.shutdown()
    dist.destroy_process_group()


def test_a_group_lost_mid_step_costs_the_other_no_restart_and_the_run_no_step(tmp_path, uninterrupted):
    from safetensors.torch import load_file

    from raysft.launch.prelaunch import prepare_launch

    cfg = run_config(tmp_path, "live", **{"checkpoint.mode": "full"})
    stores = prepare_launch(cfg, False)
    out = tmp_path / "out"
    out.mkdir()
    procs = run_groups(replica, cfg, stores, out, victim=1)
    replacement = procs[-1]

    survivor = json.loads((out / f"replica-0-{procs[0].pid}.json").read_text())
    joined = json.loads((out / f"replica-1-{replacement.pid}.json").read_text())
    counts = [count for _, count in survivor["participants"]]
    assert survivor["step"] == joined["step"] == STEPS
    # every step applied once by the survivor, the one it failed in redone alone, then with the replacement
    assert len(counts) == STEPS and counts[:FAULT_STEP] == [2] * FAULT_STEP and counts[FAULT_STEP] == 1, counts
    assert counts[-1] == 2 and len(joined["participants"]) < STEPS - FAULT_STEP, (counts, joined)
    mine, theirs = (load_file(out / f"weights-{i}-{p.pid}.safetensors") for i, p in ((0, procs[0]), (1, replacement)))
    assert all(mine[k].equal(theirs[k]) for k in mine), "the rejoined group's weights differ from the survivor's"

    assert_equals_uninterrupted(cfg, tmp_path, uninterrupted)


def stopping_replica(replica_id: int, cfg, stores, lighthouse: str, out: Path, stop_after: int | None = 5) -> None:
    """A replica group of a run that group 1 is asked to stop once it has applied `stop_after` steps (None: never)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from raysft.checkpoint import DirectorySink, existing_checkpoint_names
    from raysft.launch.prelaunch import with_max_steps
    from raysft.training.live import LiveReplicas
    from raysft.training.trainer import WorkerContext, resume_trainer

    torch.set_num_threads(1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    config = with_max_steps(cfg, stores)
    held: dict = {}
    live = LiveReplicas(replica_id, 2, lighthouse, torch.device("cpu"), store_addr="localhost", store_port=store.port,
                        join_timeout_s=120,
                        stop_requested=lambda: replica_id == 1 and stop_after is not None and
                        len(held["live"].participants) >= stop_after)
    held["live"] = live
    sink = DirectorySink(config.run_dir, 0, keep=0, taken=existing_checkpoint_names(config.run_dir),
                         single_writer=True)
    trainer = resume_trainer(config, stores.train, WorkerContext(0, 1, torch.device("cpu")), sink, live=live)
    trainer.train()
    (out / f"stopping-{replica_id}.json").write_text(json.dumps({"step": trainer.state.step,
                                                                 "stopped": trainer.stopped}))
    live.shutdown()
    dist.destroy_process_group()


def run_groups(target, cfg, stores, out: Path, *args, victim: int | None = None) -> list:
    """Both replica groups of one launch, each a process running `target`, with a Lighthouse of their own. With
    `victim`, that group must die (exit 1, having written out/died), and a replacement of it is started: the
    processes are returned with the replacement last."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")

    def group(i: int):
        return ctx.Process(target=target, args=(i, cfg, stores, lighthouse.address(), out, *args))

    procs = [group(0), group(1)]
    try:
        for p in procs:
            p.start()
        if victim is not None:
            procs[victim].join(timeout=300)
            assert procs[victim].exitcode == 1 and (out / "died").exists(), f"group {victim} did not die"
            procs.append(group(victim))
            procs[-1].start()
        for i, p in enumerate(procs):
            p.join(timeout=300)
            assert i == victim or p.exitcode == 0, f"a replica group ended with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return procs


def assert_equals_uninterrupted(cfg, tmp_path, uninterrupted) -> None:
    """Every step logged once, its loss the uninterrupted run's within 1e-4 (only the summation order differs),
    and the exported weights the uninterrupted run's to the same tolerance."""
    losses, weights = uninterrupted
    run_losses = step_losses(cfg.run_dir)
    assert [s for s, _ in run_losses] == list(range(1, STEPS + 1)), f"a step logged twice or not at all: {run_losses}"
    side_by_side = "\n".join(f"{a} {b}" for a, b in zip(run_losses, losses, strict=True))
    for (_, live_loss), (_, loss) in zip(run_losses, losses, strict=True):
        assert abs(live_loss - loss) <= 1e-4 * abs(loss), side_by_side
    exported = final_weights(cfg.run_dir, tmp_path / "hf")
    for key, expected in weights.items():
        assert_close_but_for_rare_elements(exported[key], expected, rtol=1e-4, atol=1e-6, bound=1e-3, what=key)


def test_a_stop_asked_of_one_group_ends_every_group_at_the_same_saved_step(tmp_path):
    from raysft.checkpoint import checkpoint_dirs
    from raysft.launch.prelaunch import prepare_launch
    from raysft.training.metrics import read_metrics

    cfg = run_config(tmp_path, "live-stop", **{"checkpoint.mode": "full", "checkpoint.every_n_steps": 100,
                                                 "train.max_steps": 200})
    stores = prepare_launch(cfg, False)
    out = tmp_path / "out"
    out.mkdir()
    run_groups(stopping_replica, cfg, stores, out)
    ends = [json.loads((out / f"stopping-{i}.json").read_text()) for i in (0, 1)]
    step = ends[0]["step"]
    assert ends == [{"step": step, "stopped": True}] * 2 and 5 <= step < 200, ends
    assert [d.name for d in checkpoint_dirs(cfg.run_dir)] == [f"checkpoint_{step:08d}"]  # the writer saved it, once
    events = [m for m in read_metrics(cfg.run_dir) if m.get("event") in ("stopped", "stop")]
    assert [(m["event"], m["step"]) for m in events] == [("stopped", step)], events


def test_a_writer_lost_after_the_last_step_leaves_it_saved_by_its_replacement(tmp_path, uninterrupted):
    """Group 0, the writer, dies once it has the last step's gradients, before it applies or saves the step; group 1
    applies it and waits at the run's end (not the writer of that step, it saved nothing); the replacement heals to
    the end and, the writer of the round that holds both, saves the last step."""
    from safetensors.torch import load_file

    from raysft.checkpoint import checkpoint_dirs
    from raysft.launch.prelaunch import prepare_launch

    cfg = run_config(tmp_path, "live-last", **{"checkpoint.mode": "full"})
    stores = prepare_launch(cfg, False)
    out = tmp_path / "out"
    out.mkdir()
    procs = run_groups(replica, cfg, stores, out, "writer_after_last", victim=0)
    assert checkpoint_dirs(cfg.run_dir)[-1].name == f"checkpoint_{STEPS:08d}"
    survivor, joined = (load_file(out / f"weights-{i}-{procs[p].pid}.safetensors") for i, p in ((1, 1), (0, 2)))
    assert all(survivor[k].equal(joined[k]) for k in survivor), "the replacement's weights differ from the survivor's"
    _, weights = uninterrupted
    exported = final_weights(cfg.run_dir, tmp_path / "hf")
    for key, expected in weights.items():
        assert_close_but_for_rare_elements(exported[key], expected, rtol=1e-4, atol=1e-6, bound=1e-3, what=key)


def test_a_live_run_stopped_and_launched_again_equals_the_uninterrupted_one(tmp_path, uninterrupted):
    """train.stop_at_step ends the first launch at step 5 (saved, not a checkpoint step), the next goes on from that
    stored checkpoint: the losses and weights are the uninterrupted run's (to summation order, as above)."""
    from raysft.launch.prelaunch import prepare_launch

    sets = {"checkpoint.mode": "full"}
    stores = prepare_launch(run_config(tmp_path, "live-resume", **sets), False)
    for launch, extra in enumerate(({"train.stop_at_step": 5}, {})):
        out = tmp_path / f"out-{launch}"
        out.mkdir()
        run_groups(stopping_replica, run_config(tmp_path, "live-resume", **sets, **extra), stores, out, None)
        ends = [json.loads((out / f"stopping-{i}.json").read_text()) for i in (0, 1)]
        assert ends == [{"step": 5 if extra else STEPS, "stopped": False}] * 2, ends
    assert_equals_uninterrupted(run_config(tmp_path, "live-resume", **sets), tmp_path, uninterrupted)

