"""The process group's backend, chosen in one place for both launchers: NCCL on GPUs, gloo on the CPU, and with
parallel.cpu_offload a group that maps each device to its backend, so the CPU tensors FSDP offloads (gradients,
their norms) have gloo beside NCCL. The CUDA run of it is tests/test_gpu.py's."""

import multiprocessing as mp
import os
import socket

import pytest
import torch.distributed as dist

from raysft.distributed import collectives
from raysft.distributed.collectives import process_group_backend


@pytest.mark.parametrize(("device_type", "cpu_offload", "backend"), [
    ("cuda", False, "nccl"),
    ("cuda", True, "cuda:nccl,cpu:gloo"),
    ("cpu", False, "gloo"),
    ("cpu", True, "cpu:gloo"),
])
def test_the_backend_for_each_device_and_offload(device_type, cpu_offload, backend):
    assert process_group_backend(device_type, cpu_offload) == backend


@pytest.mark.parametrize(("backend", "nccl"), [("nccl", True), ("cuda:nccl,cpu:gloo", True),
                                               ("cpu:gloo,cuda:nccl", True), ("gloo", False), ("cpu:gloo", False)])
def test_nccl_is_found_in_a_device_mapped_backend(monkeypatch, backend, nccl):
    # collectives.default_device and the checkpoint's RNG gather ask this: with offload on a GPU the one-value
    # agreements stay on the GPU and the CUDA RNG state is saved, as under NCCL alone
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert collectives.uses_nccl() is nccl


def _offloaded_run(rank: int, port: int, storage: str, results) -> None:
    """One rank of `torchrun -m raysft.run` (its main) with parallel.cpu_offload, recording the backend that
    init_distributed gave the process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    from raysft.launch import torchrun

    real, seen = torchrun.init_distributed, {}

    def recording(**kwargs):
        ctx = real(**kwargs)
        seen.update(backend=str(dist.get_backend()), collective_device=str(collectives.default_device()))
        return ctx

    torchrun.init_distributed = recording
    sets = ["parallel.cpu_offload=true", "data.max_seq_len=64", "train.max_steps=2", "train.warmup_steps=1",
            "checkpoint.every_n_steps=2", f"run.storage_path={storage}", "run.name=offload"]
    code = torchrun.main([arg for s in sets for arg in ("--set", s)])
    results.put((rank, code, seen))


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_an_offloaded_run_trains_on_a_device_mapped_gloo_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_offloaded_run, args=(r, port, str(tmp_path / "runs"), results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = sorted(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [(rank, code) for rank, code, _ in out] == [(0, 0), (1, 0)], out
    assert all(seen == {"backend": "cpu:gloo", "collective_device": "cpu"} for _, _, seen in out), out
    assert (tmp_path / "runs" / "offload" / "checkpoint_00000002").is_dir()
