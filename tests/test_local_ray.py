"""The local Ray a launch without RAY_ADDRESS starts is its own: it never joins another Ray on this machine."""

import os
import types

import ray

from raysft import launch, local_ray
from raysft.config import ScalingConfig


def test_without_ray_address_a_private_local_ray_is_started_not_another_one_joined(tmp_path, monkeypatch):
    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(local_ray.ray, "init", lambda **kw: calls.append({**kw, "env": os.environ["RAY_TMPDIR"]}))
    monkeypatch.setattr(local_ray.ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(gcs_address=f"127.0.0.1:{6000 + len(calls)}"))
    launch.connect_ray(ScalingConfig(num_workers=3, cpus_per_worker=0.5))
    launch.connect_ray(ScalingConfig(num_workers=1))
    (first, second) = calls
    assert first["address"] == "local" and first["num_cpus"] == 2  # "local": start one, never join
    temp = first["env"]  # what the processes of this Ray inherit as their RAY_TMPDIR
    assert temp.startswith(f"{tmp_path}/raysft-ray-") and "/" not in temp[len(str(tmp_path)) + 1:]  # short
    assert open(f"{temp}/ray/ray_current_cluster").read().strip() == "127.0.0.1:6001"  # where they look first
    assert second["env"] != temp  # two launches on one machine do not share one either
    assert os.environ["RAY_TMPDIR"] == str(tmp_path)  # the driver's own environment is as it was


def test_with_ray_address_the_cluster_named_there_is_joined(monkeypatch):
    calls = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    launch.connect_ray(ScalingConfig())
    assert calls == [{}]
