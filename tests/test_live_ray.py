"""live.enabled under Ray Train, on the suite's Ray: two replica groups of one worker, Ray's torchft backend and its
Lighthouse. A worker killed between steps is replaced alone: the other keeps its process and trains on alone, the
replacement heals from it and rejoins; every step is logged once with the groups that took it; the checkpoints are
registered with Ray when the run ends. (The quorum's arithmetic against an uninterrupted run: tests/test_live.py.)"""

import os
import signal
import threading
import time

import pytest
from conftest import lighthouse_heartbeats, lighthouse_status, ray_connection, tiny_config
from fault_injection import FAULTS_ENV, arm

import raysft
from raysft.checkpoint import checkpoint_dirs
from raysft.config import ConfigError
from raysft.training.metrics import read_metrics

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow  # Ray Train workers


@pytest.fixture(scope="module")
def faults(ray_head, tmp_path_factory):
    """The suite's Ray, connected for this module as a job whose workers take tests/fault_injection's faults."""
    faults = tmp_path_factory.mktemp("faults")
    with ray_connection(ray_head.address, {FAULTS_ENV: str(faults)}, setup_hook="fault_injection.install"):
        yield faults


def wait_for(predicate, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout} s for {what}")


def held(faults, step: int) -> list[int]:
    """The pids of the workers held before the step after `step`."""
    return sorted(int(p.name.split("-")[1]) for p in faults.glob(f"held-*-{step}"))


def test_a_killed_worker_is_replaced_alone_and_the_run_loses_no_step(tmp_path, faults):
    cfg = tiny_config(tmp_path, **{"live.enabled": True, "train.max_steps": 12, "checkpoint.every_n_steps": 3,
                                   "checkpoint.keep": 2, "train.log_every_n_steps": 1, "scaling.num_workers": 2})
    arm(faults, "hold_at_step", step=4)
    outcome: dict = {}
    run = threading.Thread(target=lambda: outcome.update(result=raysft.train(cfg)), daemon=True)
    run.start()
    victim, survivor = wait_for(lambda: len(held(faults, 4)) == 2 and held(faults, 4), "both groups at step 4")
    lighthouse = (faults / "lighthouse").read_text()
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: lighthouse_heartbeats(lighthouse) == 1, "the Lighthouse to drop the killed group")
    arm(faults, "hold_at_step", step=8)  # the survivor trains steps 5-8 alone, then waits for the replacement
    # the same process trained on (Ray replaced only the killed group), and the replacement asks for a quorum
    wait_for(lambda: held(faults, 8) == [survivor] and lighthouse_status(lighthouse) == (1, 2),
             "the survivor at step 8 and the replacement asking for a quorum")
    (faults / "hold_at_step.json").unlink()
    run.join(300)
    assert not run.is_alive() and "result" in outcome, "the run did not finish"

    rows = [m for m in read_metrics(cfg.run_dir) if "loss" in m]
    with_groups = [(m["step"], m["live_groups"]) for m in rows]
    assert [s for s, _ in with_groups] == list(range(1, 13)), f"a step logged twice or not at all: {with_groups}"
    # Ray's replica-group index is the group's: the survivor's index is the one in the steps it trained alone
    alone = [groups for s, groups in with_groups if 5 <= s <= 8]
    assert all(len(g) == 1 for g in alone) and len(set(map(tuple, alone))) == 1, with_groups
    assert all(g == [0, 1] for s, g in with_groups if s <= 4 or s > 8), with_groups
    starts = [m for m in read_metrics(cfg.run_dir) if m.get("event") in ("start", "resume")]
    assert len(starts) == 3, f"one start per group, and one for the replacement alone: {starts}"
    # the replacement resumed from the stored checkpoint of step 6 and healed to the survivor's step 8
    healed = [(m["from_step"], m["step"]) for m in read_metrics(cfg.run_dir) if m.get("event") == "healed"]
    assert healed == [(6, 8)], healed
    names = [d.name for d in checkpoint_dirs(cfg.run_dir)]
    assert names == ["checkpoint_00000009", "checkpoint_00000012"], names  # checkpoint.keep, pruned while training
    result = outcome["result"]
    assert result.checkpoint is not None and os.path.basename(result.checkpoint.path) == "checkpoint_00000012"
    assert not (cfg.run_dir / ".staging").exists() or not any((cfg.run_dir / ".staging").iterdir())


def test_what_live_cannot_do_is_refused_by_name(tmp_path):
    for key, value in (("scaling.min_workers", 1), ("eval.path", "builtin:demo-eval"),
                       ("checkpoint.memory_every_n_steps", 1), ("parallel.sharding", "HYBRID_SHARD")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tiny_config(tmp_path, **{"live.enabled": True, key: value})
