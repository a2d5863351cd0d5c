"""Checkpoints of the whole training state, and the one object that takes them (`Checkpointer`).

Modules, by role:
  checkpointer  the one entry to the training state across tiers: when to save (cadence, preemption notices, stop
                requests: Checkpointer.due), layout choice, one save at a time in the background, commit through
                a Sink; the memory tier's snapshots; at a launch, the newest whole state (snapshot or stored
                checkpoint) and its restore; the snapshots removed when the run ends; no save of NaN or inf
  layouts       save/load of either layout; PendingSave: background write, then the manifest, on every rank
  full          an HF model directory plus the optimizer state, gathered a tensor at a time onto rank 0 and
                written by it in files as HF writes a large model (raysft.hf.shards); resumed from each rank's slices
  sharded       every rank writes its own DCP shards; loads reshard to any topology
  manifest      every file's size and sha256, written last: what makes a checkpoint complete
  state         trainer state (step, data cursor, schedule, loss scale, step guard), RNG, the training objects
                (the errors a checkpoint raises are raysft.errors', re-exported here)
  trainable     what is saved of a model with frozen parameters (LoRA): only what trains, its names checked
  memory/       the memory tier: snapshots in node-local memory as often as every step, a copy on another node,
                resumed from when newer than the stored checkpoint (its own modules, by role)
  dcp_read      DCP directories read without running code from them (a safe unpickler for the index)
  sinks         where parts are written and how a finished checkpoint is committed (run dir, upload, Ray)
  discovery     names, the checkpoint to resume from
  retention     which checkpoints are kept (keep, keep_best) and which one `latest`, `best` or a step means
  gen_record    a checkpoint's generation-evaluation record beside it (eval/): scores, per-sample table, failures
"""

from raysft.checkpoint.checkpointer import Checkpointer, auto_mode, choose_mode, remove_snapshots
from raysft.checkpoint.discovery import (
    CHECKPOINT_PREFIX,
    checkpoint_dirs,
    checkpoint_name,
    existing_checkpoint_names,
    find_resume_dir,
)
from raysft.checkpoint.full import local_copy
from raysft.checkpoint.layouts import TRAINING_FILES, load, save, start_save
from raysft.checkpoint.manifest import MANIFEST_FILE, incomplete_reason, is_payload, read_manifest
from raysft.checkpoint.sharded import read_index
from raysft.checkpoint.sinks import (
    STAGING_DIR,
    DirectorySink,
    ScratchSink,
    Sink,
    UploadSink,
    clear_scratch,
    scratch_root,
)
from raysft.checkpoint.state import STATE_FILE, CheckpointError, TrainingObjects, TrainState, read_trainer_state
from raysft.errors import CheckpointSaveError, NonFiniteStateError

__all__ = [
    "CHECKPOINT_PREFIX", "MANIFEST_FILE", "STAGING_DIR", "STATE_FILE", "TRAINING_FILES",
    "CheckpointError", "CheckpointSaveError", "Checkpointer", "DirectorySink", "NonFiniteStateError", "ScratchSink",
    "Sink", "TrainState", "TrainingObjects", "UploadSink", "auto_mode", "checkpoint_dirs", "checkpoint_name",
    "choose_mode", "clear_scratch", "existing_checkpoint_names", "find_resume_dir", "incomplete_reason", "is_payload",
    "load", "local_copy", "read_index", "read_manifest", "read_trainer_state", "remove_snapshots", "save",
    "scratch_root", "start_save",
]
