"""The local Ray a launch without RAY_ADDRESS starts is its own: it never joins another Ray on this machine."""

import ray

from raysft import launch, local_ray
from raysft.config import ScalingConfig


def test_without_ray_address_a_private_local_ray_is_started_not_another_one_joined(tmp_path, monkeypatch):
    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(local_ray.ray, "init", lambda **kw: calls.append(kw))
    launch.connect_ray(ScalingConfig(num_workers=3, cpus_per_worker=0.5))
    launch.connect_ray(ScalingConfig(num_workers=1))
    (first, second) = calls
    assert first["address"] == "local" and first["num_cpus"] == 2  # "local": start one, never join
    temp = first["_temp_dir"]
    assert temp.startswith(f"{tmp_path}/raysft-ray-") and "/" not in temp[len(str(tmp_path)) + 1:]  # short
    assert second["_temp_dir"] != temp  # two launches on one machine do not share one either


def test_with_ray_address_the_cluster_named_there_is_joined(monkeypatch):
    calls = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    launch.connect_ray(ScalingConfig())
    assert calls == [{}]
