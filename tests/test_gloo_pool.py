"""The suite's reused gloo processes (conftest.GlooPool): a worker that dies fails only the task it was running,
at once and naming it, and the next task runs on fresh processes."""

import os
import signal

import pytest


def _segfault_on_rank_1(ctx) -> int:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as torch's gloo thread did once in a long suite
    return ctx.rank


def _sum_of_ranks(ctx) -> int:
    import torch
    import torch.distributed as dist

    value = torch.tensor([ctx.rank])
    dist.all_reduce(value)
    return int(value.item())


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_worker_that_dies_fails_its_task_by_name_and_the_next_runs_on_fresh_processes(gloo_pool):
    with pytest.raises(RuntimeError, match=r"worker\(s\) died .*\{1: -11\}"):
        gloo_pool.run(_segfault_on_rank_1, timeout=60)
    assert gloo_pool.run(_sum_of_ranks, timeout=60) == [1, 1]  # a collective across the new processes
