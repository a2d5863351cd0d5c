"""Starting a Ray of raysft's own on this machine, for a launch without RAY_ADDRESS.

`ray.init()` without an address joins whatever Ray its temp dir says was started last on this machine (`ray start`,
another user's cluster, a test suite's), and then fails because num_cpus may not be given when joining. raysft's
local Ray is never meant to join anything: it is started with address="local" (never join) and a temp directory
of its own (its sockets, session files and logs apart from any other Ray's; the logs stay there after the run).

Ray's own processes look for "the local cluster" too: Ray Train's placement-group cleaner asks the state API,
which, with several Rays on the machine, fails with "Found multiple active Ray instances" and stops cleaning up
after a dead driver. So the temp directory is handed to them as RAY_TMPDIR (they inherit the environment the
local Ray starts with) and this cluster's address is recorded in it, where that lookup reads first.
"""

from __future__ import annotations

import os
import tempfile

import ray


def private_temp_dir() -> str:
    """A new directory for one local Ray. Short: Ray's socket paths must stay under 108 bytes. It goes under
    RAY_TMPDIR when that is set, else the system's temp dir."""
    base = os.environ.get("RAY_TMPDIR") or ("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir())
    return tempfile.mkdtemp(prefix="raysft-ray-", dir=base)


def connect(**local_options) -> str | None:
    """The Ray this process already uses, the cluster in RAY_ADDRESS, or else a new local Ray of our own (never
    another one found on this machine; local_options go to ray.init): returns the new one's temp dir when one was
    started here, which the caller shuts down, else None."""
    if ray.is_initialized():
        return None
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return None
    return start_local_ray(**local_options)


def start_local_ray(**kwargs) -> str:
    """ray.init a new local Ray with its own temp dir (returned); kwargs go to ray.init."""
    temp = private_temp_dir()
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp  # inherited by the processes ray.init starts, and only by them
    try:
        ray.init(address="local", **kwargs)
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
    from ray._private.utils import write_ray_address  # where Ray's own processes look first (see above)

    os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
    write_ray_address(ray.get_runtime_context().gcs_address, os.path.join(temp, "ray"))
    return temp
