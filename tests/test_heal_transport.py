"""raysft.distributed.heal_transport: a replica group that joins a live torchft run fetches the training state from a
live peer as safetensors and JSON, never unpickling what the peer sent. Real torchft: a Lighthouse and two Managers
(replica groups of one worker, as threads of this process, as torchft's own tests run them) over gloo."""

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
from conftest import lighthouse_status

torchft = pytest.importorskip("torchft")
from raysft.distributed.heal_transport import SafeHTTPTransport, decode, encode  # noqa: E402


def training_state(seed: int) -> dict:
    """What a trainer's heal carries: a model's tensors, an optimizer's state (int keys, lists, tuples), a scheduler's
    numbers, a data cursor, and a None."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": {"last_epoch": 7, "_last_lr": [1e-3]}, "cursor": {"epoch": 1, "consumed": 16},
            "scaler": None, "loss": float("nan"), "bf16": torch.ones(2, dtype=torch.bfloat16)}


def assert_same(actual, expected, path="state"):
    kind = dict if isinstance(expected, dict) else type(expected)  # an OrderedDict comes back a dict, in its order
    assert type(actual) is kind, f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, path
    else:
        assert actual == expected, path


def test_a_training_state_comes_back_equal_with_its_key_types_and_dtypes():
    state = training_state(0)
    assert_same(decode(*encode(state)), state)
    assert 0 in decode(*encode(state))["optimizer"]["state"]  # int keys stay ints


def test_a_state_holding_anything_but_data_is_refused_naming_its_key():
    with pytest.raises(TypeError, match=r"state\['optimizer'\]\['hook'\]: a function"):
        encode({"optimizer": {"hook": lambda: None}})
    with pytest.raises(TypeError, match=r"state\['cursor'\]: a key of type tuple"):
        encode({"cursor": {(1, 2): 0}})


def test_the_structure_is_json_and_nothing_but_data_comes_back():
    structure, _ = encode({"a": [1, (2.5, "x")], "t": torch.zeros(1)})
    assert json.loads(structure) == {"dict": [["a", {"list": [{"value": 1}, {"tuple": [{"value": 2.5},
                                                                                        {"value": "x"}]}]}],
                                              ["t", {"tensor": "0"}]]}
    with pytest.raises(ValueError, match="unknown node 'pickle'"):
        decode(json.dumps({"pickle": "cos\nsystem\n"}), encode({})[1])


def test_a_joiner_fetches_the_step_served_and_nothing_after_it_is_disallowed():
    sender, joiner = SafeHTTPTransport(timedelta(seconds=0.5)), SafeHTTPTransport(timedelta(seconds=0.5))
    try:
        state = training_state(1)
        sender.send_checkpoint([1], step=5, state_dict=state, timeout=timedelta(seconds=10))
        assert_same(joiner.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=10)), state)
        with pytest.raises(OSError, match="404"):  # another step than the one served
            joiner.recv_checkpoint(0, sender.metadata(), 4, timedelta(seconds=10))
        sender.disallow_checkpoint()
        with pytest.raises(OSError, match="404"):
            joiner.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=10))
    finally:
        sender.shutdown()
        joiner.shutdown()


def test_a_replica_group_that_joins_late_heals_from_the_live_one_through_torchft():
    """Replica group 0 commits 3 steps alone; group 1 joins, torchft finds it behind and heals it through
    SafeHTTPTransport: from then on both hold the same weights, optimizer state and step."""
    from torch.distributed import ReduceOp, TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    received: dict[int, list[int]] = {0: [], 1: []}

    class Recorded(SafeHTTPTransport):
        def __init__(self, rid: int):
            super().__init__(timedelta(seconds=10))
            self.rid = rid

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            received[self.rid].append(step)
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    results, errors = {}, []
    group0_trained = threading.Event()

    def replica(rid: int, steps: int) -> None:
        try:
            if rid == 1:  # a Manager heartbeats from its start: the Lighthouse then waits for it to join a quorum
                assert group0_trained.wait(60), "group 0 never trained"
            torch.manual_seed(rid)  # different starting weights: only a heal makes them equal
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

            def load_state_dict(state: dict) -> None:
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])

            manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                              load_state_dict=load_state_dict,
                              state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                              replica_id=f"rg{rid}", rank=0, world_size=1, store_addr="localhost",
                              store_port=store.port, lighthouse_addr=lighthouse.address(), use_async_quorum=False,
                              timeout=timedelta(seconds=10), checkpoint_transport=Recorded(rid))
            try:
                while manager.current_step() < steps:
                    manager.start_quorum()
                    optimizer.zero_grad()
                    model(torch.full((2, 4), float(manager.current_step()))).sum().backward()
                    for p in model.parameters():
                        manager.allreduce(p.grad, reduce_op=ReduceOp.SUM).wait()
                    if manager.should_commit():
                        optimizer.step()
                    if rid == 0 and manager.current_step() == 3:
                        group0_trained.set()
                        # until group 1 asks for a quorum: the Lighthouse would otherwise reform group 0's quorum
                        # of one at once (its fast path) for as long as group 1 has not asked
                        deadline = time.monotonic() + 60
                        while lighthouse_status(lighthouse.address())[0] < 1 and time.monotonic() < deadline:
                            time.sleep(0.05)
                results[rid] = manager.current_step(), {k: v.clone() for k, v in model.state_dict().items()}, \
                    optimizer.state_dict()["state"][0]["exp_avg"].clone()
            finally:
                manager.shutdown(wait=False)
        except BaseException as e:  # noqa: BLE001 - the test raises it
            errors.append(e)
            group0_trained.set()

    threads = [threading.Thread(target=replica, args=(rid, 8)) for rid in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        lighthouse.shutdown()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    (step0, weights0, moment0), (step1, weights1, moment1) = results[0], results[1]
    assert step0 == step1 == 8
    assert received[0] == [] and len(received[1]) == 1 and received[1][0] >= 3, received  # one heal, of group 1
    for key in weights0:
        assert torch.equal(weights0[key], weights1[key]), key
    assert torch.equal(moment0, moment1)
