"""Starting a Ray of raysft's own on this machine, for a launch without RAY_ADDRESS.

`ray.init()` without an address joins whatever Ray its temp dir says was started last on this machine (`ray start`,
another user's cluster, a test suite's), and then fails because num_cpus may not be given when joining. raysft's
local Ray is never meant to join anything: it is started with address="local" (never join) and its own temp
directory (its sockets, session files and logs apart from any other Ray's; the logs stay there after the run).
"""

from __future__ import annotations

import os
import tempfile

import ray


def local_ray_args() -> dict:
    """ray.init arguments for a private local Ray. The temp dir is short: Ray's socket paths must stay under 108
    bytes. It goes under RAY_TMPDIR when that is set, else the system's temp dir."""
    base = os.environ.get("RAY_TMPDIR") or ("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir())
    return {"address": "local", "_temp_dir": tempfile.mkdtemp(prefix="raysft-ray-", dir=base)}


def start_local_ray(**kwargs) -> None:
    ray.init(**local_ray_args(), **kwargs)
