"""What the memory tier's tests share (tests/test_memory_tier*.py): configs, launches on a gloo pool whose ranks
stand in for nodes (WorkerContext.node) with the snapshots in tmp_path rather than /dev/shm, the tier's functions
replaced inside the pool's processes, and parts rewritten as a fault or another user would leave them. A worker
killed mid-run is a real process death (the pool starts fresh processes); a lost node is its directory gone."""

import contextlib
import errno
import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_config, step_losses
from safetensors import safe_open
from safetensors.torch import save_file

from raysft.checkpoint.discovery import read_run_id
from raysft.launch.torchrun import launch

FAULT_AT = 8  # persistent checkpoints at 3, 6, 9, 12: a fault after step 8 loses 2 steps without the tier


def memory_config(tmp_path: Path, name: str, **sets):
    return run_config(tmp_path, name, **{"checkpoint.mode": "full", "checkpoint.memory_every_n_steps": 1,
                                         "checkpoint.memory_dir": str(tmp_path / "shm"), **sets})


def launch_on_nodes(ctx, cfg, nodes: list[str] | None = None, fresh: bool = False, die_after: int = 0,
                    dying: tuple[int, ...] = (1,)) -> dict:
    """A launch with rank r on node nodes[r] (default: a node each); with die_after, the processes of the `dying`
    ranks die as step die_after + 1 begins, once the snapshot of step die_after is written and copied (the others
    then wait in the step's collective until the pool ends them)."""
    from raysft.training.trainer import Trainer

    nodes = nodes or [f"node{r}" for r in range(ctx.world_size)]
    saved = ctx.node, ctx.node_rank
    ctx.node, ctx.node_rank = nodes[ctx.rank], list(dict.fromkeys(nodes)).index(nodes[ctx.rank])
    real_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if die_after and self.state.step == die_after:
            self.checkpointer.memory.finish()
            if ctx.rank in dying:
                os._exit(9)
        return real_step(self, *args, **kwargs)

    Trainer.train_step = train_step
    try:
        return launch(ctx, cfg, fresh)
    finally:
        Trainer.train_step = real_step
        ctx.node, ctx.node_rank = saved


def launch_on_own_node(ctx, cfg, fresh: bool = False, die_after: int = 0) -> dict:
    return launch_on_nodes(ctx, cfg, None, fresh, die_after)


# where each function of the tier a test replaces is looked up
TIER_FUNCTIONS = {"write_part": "raysft.checkpoint.memory.tier", "map_new": "raysft.checkpoint.memory.transport",
                  "map_file": "raysft.checkpoint.memory.transport",
                  "write_bytes": "raysft.checkpoint.memory.files"}


def faulted_run(pool, tmp_path: Path, **sets):
    """A run with a snapshot every step, each rank on a node of its own, whose rank 1 died after step FAULT_AT: its
    config, its run directory and snapshots as the fault left them (the pool's processes started anew)."""
    cfg = memory_config(tmp_path, "faulted", **sets)
    with pytest.raises(RuntimeError, match=r"died .*\{1: 9\}"):
        pool.run(launch_on_own_node, cfg, False, FAULT_AT)
    return cfg


@contextlib.contextmanager
def tier_patched(every_snapshot: bool = True, **replacements):
    """In a pool process: the tier's functions named in `replacements` (TIER_FUNCTIONS) replaced, each replacement
    called with the real one first; with every_snapshot, each step first waits for the snapshot before it is
    written, so that every snapshot due is taken and a fault lands at the step the test names."""
    import importlib

    from raysft.training.trainer import Trainer

    modules = {name: importlib.import_module(TIER_FUNCTIONS[name]) for name in replacements}
    real = {name: getattr(modules[name], name) for name in replacements}
    real_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.checkpointer.memory is not None:
            self.checkpointer.memory.finish()
        return real_step(self, *args, **kwargs)

    for name, replacement in replacements.items():
        setattr(modules[name], name, functools.partial(replacement, real[name]))
    if every_snapshot:
        Trainer.train_step = train_step
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(modules[name], name, function)
        Trainer.train_step = real_step


def launch_two_a_node(ctx, cfg, die_at: int = 0) -> dict:
    """A launch of 4 ranks, 2 a node (they share the node's directory), every snapshot taken; with die_at, node
    1's ranks die as they begin to write their parts of the snapshot of step die_at (node 0's then wait for their
    partners' copies, or their gathers, until the pool ends them)."""
    def write(real, path, buffer, slots, extra, header):
        if ctx.rank >= 2 and header["step"] == die_at:
            os._exit(9)
        real(path, buffer, slots, extra, header)

    with tier_patched(write_part=write):
        return launch_on_nodes(ctx, cfg, [f"node{r // 2}" for r in range(4)])


def no_room(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def node_dir(cfg, node: str) -> Path:
    return Path(cfg.checkpoint.memory_dir) / read_run_id(cfg.run_dir) / node


def part(cfg, node: str, step: int, rank: int) -> Path:
    return node_dir(cfg, node) / f"step_{step:08d}" / f"rank_{rank}.safetensors"


def rewrite_part(path: Path, header=None, tensors=None) -> None:
    """A part rewritten in place with its header and tensors changed by the functions given (as a bug or another
    user of the directory could leave it): still a whole safetensors file of this user's, its checksum that of its
    new bytes (what the checks after the checksum's see)."""
    from raysft.checkpoint.memory.files import HEADER_KEY, data_checksum

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        values = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    if header is not None:
        meta = {HEADER_KEY: json.dumps(header(json.loads(meta[HEADER_KEY])))}
    if tensors is not None:
        values = tensors(values)
    save_file(values, path, metadata=meta)
    written = json.loads(meta[HEADER_KEY])["checksum"].encode()  # as long as the new one: the data stays put
    raw = bytearray(path.read_bytes())
    at = raw.rindex(written, 8, 8 + int.from_bytes(raw[:8], "little"))
    raw[at:at + len(written)] = data_checksum(path).encode()
    path.write_bytes(bytes(raw))


def flip_a_byte(path: Path, offset_in_data: int = 1000) -> None:
    """One bit of a part's tensor data flipped in place, the header left as it was (a fault of node memory, or of a
    copy sent over the network)."""
    raw = bytearray(path.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + offset_in_data] ^= 0x10
    path.write_bytes(bytes(raw))


def continue_copy(faulted, tmp_path: Path, **sets):
    """The faulted run and its snapshots copied under tmp_path, with the config that continues it."""
    cfg = memory_config(tmp_path, "continued", **sets)
    shutil.copytree(faulted.run_dir, cfg.run_dir)
    shutil.copytree(faulted.checkpoint.memory_dir, cfg.checkpoint.memory_dir)
    return cfg


def assert_same_run(cfg, uninterrupted, out: Path) -> None:
    from conftest import final_weights

    ref_losses, ref_weights = uninterrupted
    last = dict(step_losses(cfg.run_dir))  # a step trained twice (before the fault and after) counts once
    assert sorted(last.items()) == ref_losses
    weights = final_weights(cfg.run_dir, out)
    assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)
