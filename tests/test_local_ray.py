"""The local Ray a launch without RAY_ADDRESS starts is its own: it never joins another Ray on this machine."""

import os
import shutil
import tempfile

import pytest
import ray

from raysft.config import ScalingConfig
from raysft.distributed import local_ray
from raysft.distributed.local_ray import without_noise
from raysft.launch import ray_driver as launch


def test_without_ray_address_a_private_local_ray_is_started_not_another_one_joined(monkeypatch):
    calls = []
    tmp_path = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short enough for Ray's socket paths under it
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(local_ray.ray, "init", lambda **kw: calls.append(
        {**kw, **{k: os.environ[k] for k in ("RAY_TMPDIR", "RAY_ADDRESS", "RAY_GCS_SERVER_PORT")}}))
    launch.connect_ray(ScalingConfig(num_workers=3, cpus_per_worker=0.5))
    launch.connect_ray(ScalingConfig(num_workers=1))
    (first, second) = calls
    assert first["address"] == "local" and first["num_cpus"] == 2  # "local": start one, never join
    temp = first["RAY_TMPDIR"]  # what the processes of this Ray inherit as their RAY_TMPDIR
    assert temp.startswith(f"{tmp_path}/raysft-ray-") and "/" not in temp[len(str(tmp_path)) + 1:]
    # ... and RAY_ADDRESS: its own GCS, where Ray's state API looks before any other Ray on the machine
    assert first["RAY_ADDRESS"] == f"127.0.0.1:{first['RAY_GCS_SERVER_PORT']}"
    assert first["_node_ip_address"] == "127.0.0.1"
    assert second["RAY_TMPDIR"] != temp  # two launches on one machine do not share one either
    assert os.environ["RAY_TMPDIR"] == str(tmp_path) and "RAY_ADDRESS" not in os.environ  # the driver's, as it was
    shutil.rmtree(tmp_path)


def test_under_a_long_ray_tmpdir_the_local_ray_goes_to_a_short_directory_linked_from_there(tmp_path):
    """Ray's socket paths (<temp>/ray/session_<time>_<pid>/sockets/...) must stay under 108 bytes."""
    long = tmp_path / ("x" * 60)
    long.mkdir()
    os.environ["RAY_TMPDIR"], before = str(long), os.environ.get("RAY_TMPDIR")
    try:
        local = local_ray.private_temp_dir()
    finally:
        os.environ.pop("RAY_TMPDIR") if before is None else os.environ.update(RAY_TMPDIR=before)
    try:
        assert len(local.temp_dir) + local_ray.SOCKET_TAIL <= local_ray.SOCKET_PATH_MAX
        assert os.path.realpath(local.linked_from) == os.path.realpath(local.temp_dir)
        assert os.path.dirname(local.linked_from) == str(long)
    finally:
        os.rmdir(local.temp_dir)


def test_with_ray_address_the_cluster_named_there_is_joined(monkeypatch):
    calls = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setattr(local_ray, "check_reachable", lambda: None)  # nobody answers at head:10001 here
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    launch.connect_ray(ScalingConfig())
    assert calls == [{}]


def test_ray_s_transient_errors_and_their_tracebacks_stay_off_the_terminal_and_the_run_s_lines_do_not():
    """What Ray Train's controller printed on a loaded machine, in two batches, between raysft's own lines."""
    first = ["raysft: step 3", "Failed to send resource request for train-a94. If this only happens transiently "
             "during network partition or CPU being overloaded, it's safe to ignore this error. If this error "
             "persists, file a GitHub issue.", "Traceback (most recent call last):",
             '  File "ray/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_client.py", line 58',
             "    ray.get("]
    second = ["           ^^^^^^^^^", "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
              "raysft: step 4", "[2026-11-26 07:00:00,123 E 6116 6200] core_worker.cc:2465: gone"]
    kept, inside = without_noise(first)
    assert kept == ["raysft: step 3"] and inside
    kept, inside = without_noise(second, inside)
    assert kept == ["raysft: step 4"] and not inside
    traceback = ["Traceback (most recent call last):", '  File "train.py", line 1', "ValueError: a real one"]
    assert without_noise(traceback) == (traceback, False)  # not after a transient error: printed


def test_an_older_ray_is_refused_by_name_where_raysft_imports_ray_train(monkeypatch):
    """Ray Train's validation API raysft uses is Ray 2.60's: an older Ray is a RayVersionError naming the installed
    and the needed version when the launch is imported, not an ImportError of some name; pyproject's floor is the
    same."""
    import importlib
    import re
    import sys
    from pathlib import Path

    from raysft.errors import RayVersionError
    from raysft.launch.ray_train import RAY_FLOOR, check_ray_version

    monkeypatch.setattr(ray, "__version__", "2.55.1")
    for name in ("raysft.launch.ray_train", "raysft.launch.ray_controller", "raysft.launch.ray_worker",
                 "raysft.launch.ray_driver"):
        monkeypatch.delitem(sys.modules, name)  # imported again below; monkeypatch puts them back
    with pytest.raises(RayVersionError, match=r"raysft needs Ray 2\.60 or newer .* but Ray 2\.55\.1 is installed: "
                                              r"pip install 'ray\[default,train\]>=2\.60'"):
        importlib.import_module("raysft.launch.ray_driver")
    for newer in ("2.60.0", "2.61.0rc1", "3.0.0.dev0", "unknown"):
        check_ray_version(newer)
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    floors = re.findall(r'"ray\[[\w,]+\]>=([\d.]+)"', pyproject)
    assert floors == [".".join(map(str, RAY_FLOOR))], f"pyproject's Ray floor {floors} is not RAY_FLOOR {RAY_FLOOR}"
