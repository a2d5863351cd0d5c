import pytest

from raysft.config import ConfigError, ParallelConfig
from raysft.parallelize import MeshShape, mesh_shape


@pytest.mark.parametrize("sharding, world, local, shard_size, expected", [
    ("FULL_SHARD", 4, 4, 0, MeshShape(1, 4)),
    ("SHARD_GRAD_OP", 2, 2, 0, MeshShape(1, 2)),
    ("NO_SHARD", 4, 4, 0, MeshShape(4, 1)),
    ("HYBRID_SHARD", 8, 4, 0, MeshShape(2, 4)),   # nodes × workers per node, from Ray
    ("HYBRID_SHARD", 4, 4, 2, MeshShape(2, 2)),   # logical nodes on one IP: explicit shard size
])
def test_mesh_shapes(sharding, world, local, shard_size, expected):
    assert mesh_shape(ParallelConfig(sharding=sharding, hsdp_shard_size=shard_size), world, local) == expected


@pytest.mark.parametrize("world, local, shard_size, message", [
    (6, 6, 4, "does not divide"),
    (4, 4, 0, "nothing to replicate"),
    (4, 4, 1, "nothing to shard"),
])
def test_hybrid_shard_mesh_errors_name_the_key(world, local, shard_size, message):
    with pytest.raises(ConfigError, match=message) as e:
        mesh_shape(ParallelConfig(sharding="HYBRID_SHARD", hsdp_shard_size=shard_size), world, local)
    assert "parallel." in str(e.value)


def test_mesh_dimension_names():
    assert MeshShape(1, 4).names == ("shard",) and MeshShape(2, 2).names == ("replicate", "shard")
