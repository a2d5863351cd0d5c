"""Mesh shapes and the layout errors raised before any model is built (pure functions: no processes)."""

import pytest

from raysft.config import ConfigError, ParallelConfig, load_config
from raysft.distributed.layout import ParallelDims, check_hsdp_shard_size_fits_nodes


@pytest.mark.parametrize("sharding, node_ranks, shard_size, expected", [
    ("FULL_SHARD", [0, 0, 1, 1], 0, ParallelDims(1, 4)),
    ("SHARD_GRAD_OP", [0, 0], 0, ParallelDims(1, 2)),
    ("NO_SHARD", [0, 0, 1, 1], 0, ParallelDims(4, 1)),
    ("HYBRID_SHARD", [0, 0, 0, 0, 1, 1, 1, 1], 0, ParallelDims(2, 4)),  # nodes × workers per node, from Ray
    ("HYBRID_SHARD", [0, 0, 1, 1, 2, 2], 0, ParallelDims(3, 2)),
    ("HYBRID_SHARD", [0, 0, 0, 0], 2, ParallelDims(2, 2)),              # logical nodes on one IP: explicit size
    ("HYBRID_SHARD", [0, 0, 0, 0, 1, 1, 1, 1], 2, ParallelDims(4, 2)),  # explicit size beats the node layout
])
def test_mesh_shapes(sharding, node_ranks, shard_size, expected):
    config = ParallelConfig(sharding=sharding, hsdp_shard_size=shard_size)
    assert ParallelDims.from_config(config, node_ranks) == expected


@pytest.mark.parametrize("node_ranks, message", [
    ([0, 0, 0, 0], "nothing to replicate"),
    ([0, 1, 2, 3], "nothing to shard"),
    ([0, 0, 0, 1, 1, 1, 1, 1], "same number of workers on every node, Ray placed node 0: 3, node 1: 5"),
    ([0, 1, 0, 1], "consecutive ranks"),
])
def test_hybrid_shard_layout_errors_name_the_key_and_the_fix(node_ranks, message):
    with pytest.raises(ConfigError, match=message) as e:
        ParallelDims.from_config(ParallelConfig(sharding="HYBRID_SHARD"), node_ranks)
    assert "parallel.sharding" in str(e.value) and "parallel.hsdp_shard_size" in str(e.value)


@pytest.mark.parametrize("overrides, key, message", [
    ({"parallel.hsdp_shard_size": 4, "scaling.num_workers": 6}, "parallel.hsdp_shard_size", "does not divide"),
    ({"parallel.hsdp_shard_size": 4}, "parallel.hsdp_shard_size", "nothing to replicate"),
    ({"parallel.hsdp_shard_size": 1}, "parallel.hsdp_shard_size", "nothing to shard"),
    ({"scaling.num_workers": 2}, "parallel.sharding", "at least 4 workers"),
])
def test_hybrid_shard_config_errors_on_the_driver(overrides, key, message):
    sets = {"parallel.sharding": "HYBRID_SHARD", "scaling.num_workers": 4, "train.global_batch_size": 24,
            "train.micro_batch_size": 1, **overrides}
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [f"{k}={v}" for k, v in sets.items()])
    assert f"'{key}'" in str(e.value)


@pytest.mark.parametrize("shard, workers, per_node, message", [
    (3, 6, [4, 4], "would straddle nodes that hold 4, 4 workers each"),  # Ray packs 4 + 2: group 2 spans both
    (4, 8, [2, 2, 2, 2], "larger than any node"),
    (2, 4, [2, 2], None),           # one group per node
    (2, 8, [4, 4], None),           # two groups per node
    (3, 6, [12], None),             # one IP: logical nodes, the explicit size is the point
    (3, 3 * 2, [8, 8], None),       # all on one node: nothing crosses the network
])
def test_an_explicit_shard_group_must_fit_inside_the_nodes_of_the_cluster(shard, workers, per_node, message):
    p = ParallelConfig(sharding="HYBRID_SHARD", hsdp_shard_size=shard)
    if message is None:
        check_hsdp_shard_size_fits_nodes(p, workers, per_node)
    else:
        with pytest.raises(ConfigError, match=message) as e:
            check_hsdp_shard_size_fits_nodes(p, workers, per_node)
        assert "'parallel.hsdp_shard_size'" in str(e.value)


def test_shard_size_for_another_strategy_is_an_error():
    with pytest.raises(ConfigError, match="applies to HYBRID_SHARD only"):
        load_config(None, ["parallel.hsdp_shard_size=2"])


def test_activation_checkpointing_accepts_an_integer_from_yaml():
    assert load_config(None, ["parallel.activation_checkpointing=2"]).parallel.activation_checkpointing == "2"


def test_mesh_dimension_names():
    assert ParallelDims(1, 4).mesh_names == ("shard",) and ParallelDims(2, 2).mesh_names == ("replicate", "shard")
