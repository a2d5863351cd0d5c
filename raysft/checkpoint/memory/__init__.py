"""The memory tier: the whole training state in host memory as often as every step, where a restarted worker group
finds it, with each rank's part also on another node, so that a fault costs the steps since the last snapshot
rather than those since the last stored checkpoint (docs/RELIABILITY.md).

Modules, by role:
  tier       MemoryTier: when to snapshot, what a part holds; at a resume, the steps in order (find, then restore)
  staging    the copy of a rank's shards into one exact-size host buffer, beside the step on a GPU
  files      a part as a safetensors file: written aside and renamed, 0600, its header checked before use
  transport  each part's copy to another node, and parts sent at a resume, over the tier's own gloo group
  directory  the node's directory: this user's alone (0700), runs reclaimed when no process holds them
  discovery  which step a resume can use (one attempt's, every old place held) and which parts each rank reads
  reshard    a rank's new shards cut from the old parts' rows, for a resume on another width
  restore    each rank's parts read and checked, then applied once every rank's passed
"""

from raysft.checkpoint.memory.directory import STEP_PREFIX, remove_run, resolve_memory_dir
from raysft.checkpoint.memory.tier import MemoryTier
from raysft.checkpoint.memory.transport import partners

__all__ = ["STEP_PREFIX", "MemoryTier", "partners", "remove_run", "resolve_memory_dir"]
