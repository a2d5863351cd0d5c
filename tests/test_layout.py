"""ParallelDims (raysft.distributed.layout): the one object that says where every rank sits. Sizes, every rank's
data-parallel and sequence coordinates, and the refusals, as pure functions; the mesh and the sequence groups it
builds, in one gloo group of four processes."""

import pytest
import torch.distributed as dist

from raysft.config import ConfigError, ParallelConfig
from raysft.data.dataloader import rank_micro_batches
from raysft.distributed.layout import ParallelDims, SequenceShard


@pytest.mark.parametrize("sharding, n, node_ranks, sizes, dp_size, shard_group", [
    ("FULL_SHARD", 1, [0] * 4, (1, 4, 1), 4, 4),
    ("FULL_SHARD", 2, [0] * 4, (1, 2, 2), 2, 4),
    ("SHARD_GRAD_OP", 4, [0] * 8, (1, 2, 4), 2, 8),
    ("NO_SHARD", 1, [0, 0, 1, 1], (4, 1, 1), 4, 1),
    ("NO_SHARD", 2, [0] * 8, (4, 1, 2), 4, 2),
    ("HYBRID_SHARD", 2, [0] * 4 + [1] * 4, (2, 2, 2), 4, 4),
])
def test_sizes_of_every_layout(sharding, n, node_ranks, sizes, dp_size, shard_group):
    dims = ParallelDims.from_config(ParallelConfig(sharding=sharding, sequence_parallel=n), node_ranks)
    assert (dims.replicate, dims.shard, dims.sequence) == sizes
    assert dims.world_size == len(node_ranks)
    assert (dims.dp_size, dims.shard_group_size) == (dp_size, shard_group)
    assert dims.mesh_dims == ((shard_group,) if sizes[0] == 1 else (sizes[0], shard_group))


def test_each_rank_has_one_place_and_a_sequence_group_is_consecutive_ranks():
    """World 8 in sequence groups of 4 (HSDP: 2 nodes of 4): ranks 0-3 are data-parallel rank 0, slices 0-3."""
    dims = ParallelDims.from_config(ParallelConfig(sharding="HYBRID_SHARD", sequence_parallel=4,
                                                   hsdp_shard_size=4), [0] * 8)
    places = [dims.place(rank) for rank in range(8)]
    assert places[5] == SequenceShard(dp_rank=1, dp_size=2, sp_rank=1, sp_size=4)
    assert [(p.dp_rank, p.sp_rank) for p in places] == [(r // 4, r % 4) for r in range(8)]
    assert len({(p.dp_rank, p.sp_rank) for p in places}) == 8  # no two ranks in one place
    assert ParallelDims(2, 2).place(3) == SequenceShard(3, 4)  # without sequence parallelism: the rank itself


def test_the_data_parallel_ranks_take_the_global_batch_between_them():
    """The samples a step deals are shared out over dp_size groups: every sample once per step."""
    dims = ParallelDims(1, 2, 2)
    batch = list(range(8))
    taken = {dims.place(r).dp_rank: rank_micro_batches(batch, dims.place(r).dp_rank, dims.dp_size, 2)
             for r in range(dims.world_size)}
    assert sorted(int(i) for parts in taken.values() for part in parts for i in part) == batch


@pytest.mark.parametrize("cfg, node_ranks, key, message", [
    (dict(sequence_parallel=3), [0] * 4, "parallel.sequence_parallel", "3 does not divide 4 workers"),
    (dict(sharding="NO_SHARD", hsdp_shard_size=2), [0] * 4, "parallel.hsdp_shard_size", "applies to HYBRID_SHARD"),
    (dict(sharding="HYBRID_SHARD"), [0, 0], "parallel.sharding", "at least 4 workers"),
    (dict(sharding="HYBRID_SHARD", hsdp_shard_size=3), [0] * 4, "parallel.hsdp_shard_size", "does not divide"),
    (dict(sharding="HYBRID_SHARD"), [0] * 4, "parallel.sharding", "nothing to replicate"),
    (dict(sharding="HYBRID_SHARD", sequence_parallel=4), [0, 0, 1, 1], "parallel.sequence_parallel",
     "4 does not divide the shard group of 2"),
])
def test_a_layout_that_cannot_work_is_refused_naming_the_key(cfg, node_ranks, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        ParallelDims.from_config(ParallelConfig(**cfg), node_ranks)
    assert f"config key '{key}'" in str(e.value)


def _groups(ctx, sharding: str, n: int) -> dict:
    dims = ParallelDims.from_config(ParallelConfig(sharding=sharding, sequence_parallel=n), [0] * ctx.world_size)
    mesh, group = dims.build_mesh("cpu"), dims.sequence_group()
    return {"mesh": (tuple(mesh.mesh.shape), mesh.mesh_dim_names),
            "sequence": None if group is None else dist.get_process_group_ranks(group)}


@pytest.mark.slow  # starts four processes of torch: make test-fast leaves it out
def test_the_mesh_and_the_sequence_groups_it_builds(gloo_pool4):
    four = gloo_pool4.run(_groups, "FULL_SHARD", 2)
    assert [r["mesh"] for r in four] == [((4,), ("shard",))] * 4
    assert [r["sequence"] for r in four] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    no_shard = gloo_pool4.run(_groups, "NO_SHARD", 1)
    assert [r["mesh"] for r in no_shard] == [((4, 1), ("replicate", "shard"))] * 4
    assert [r["sequence"] for r in no_shard] == [None] * 4
