"""The DPO reference: every answer's log-probability under the frozen starting model, computed once by a pass over
the store before the first step, and kept beside the store.

The file is `<store>/reference/<key>.safetensors` (one float64 per row of the store), where the store's directory
name is its fingerprint and the key is a hash of the reference model's content (`reference_identity`). A restart,
a resume, or another run on the same data and model finds it and computes nothing; no second model is ever held in
memory. The pass shares the rows over the workers, each computes its share without gradients, and one all-reduce
gives every worker every row; rank 0 writes the file aside and renames it into place.

A LoRA run needs no pass: its reference is the base with the adapters off (raysft.model.lora.adapters_disabled),
computed beside each step's forward.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from raysft.config import TrainConfig
from raysft.data.dataloader import TokenizedDataset, collate, lockstep_micro_batches, pair_rows, to_device
from raysft.data.store import pairs_in
from raysft.distributed.layout import SequenceShard
from raysft.errors import CheckpointError
from raysft.hf.fingerprint import weights_fingerprint
from raysft.model.build import PRESETS
from raysft.model.preference_loss import sequence_logps
from raysft.model.seeded_init import INIT_SCHEME
from raysft.training.metrics import MetricsLogger
from raysft.training.preference import pair_batch

REFERENCE_DIR = "reference"


def reference_identity(cfg: TrainConfig) -> dict:
    """What the reference log-probabilities depend on besides the store, by content: the starting weights (the
    fingerprint of model.path's config.json, index and weight files, raysft.hf.fingerprint; a from-scratch model's
    architecture, seed and initialization scheme) and the compute dtype. Names, sizes and mtimes would not do:
    other weights copied in with `cp -p` or `rsync -a` keep them, and the same weights copied elsewhere are the
    same reference."""
    identity: dict = {"mixed_precision": cfg.parallel.mixed_precision}
    if cfg.model.path:
        identity["weights"] = weights_fingerprint(Path(cfg.model.path).expanduser())
    else:
        identity.update(architecture=architecture_identity(cfg.model.config), seed=cfg.train.seed, init=INIT_SCHEME)
    return identity


def architecture_identity(config: str) -> dict:
    """model.config by content: a preset's values, or the sha256 of the config.json it names (a file, or a
    directory holding one), so that an edited file is another reference."""
    if config in PRESETS:
        return {"preset": config, **PRESETS[config]}
    path = Path(config).expanduser()
    file = path if path.is_file() else path / "config.json"
    return {"config.json": hashlib.sha256(file.read_bytes()).hexdigest()}


def reference_file(store: Path, cfg: TrainConfig) -> Path:
    key = hashlib.sha256(json.dumps(reference_identity(cfg), sort_keys=True).encode()).hexdigest()[:20]
    return store / REFERENCE_DIR / f"{key}.safetensors"


def read_reference(path: Path, rows: int) -> torch.Tensor:
    """The stored log-probabilities, one per row of the store (float64)."""
    try:
        logps = load_file(path)["logps"]
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise CheckpointError(f"{path}: cannot read the reference log-probabilities: {e}; delete it to compute "
                              "them again") from e
    if logps.shape != (rows,):
        raise CheckpointError(f"{path}: {tuple(logps.shape)} reference log-probabilities for a store of {rows} "
                              "rows; delete it to compute them again")
    return logps


def compute_reference(model: nn.Module, dataset: TokenizedDataset, cfg: TrainConfig, shard: SequenceShard,
                      device: torch.device, pad_id: int) -> torch.Tensor:
    """Collective: every row's answer log-probability under `model` as it is now, without gradients, the model
    in eval mode and the RNG states put back afterwards. `shard`: this rank's place in the layout
    (ParallelDims.place; DPO runs without sequence parallelism, so every rank is a data-parallel group of its own).
    Each rank takes pairs d, d + D, ... (d of D data-parallel ranks) in micro-batches of train.micro_batch_size
    pairs, as many as every other rank runs (lockstep_micro_batches)."""
    pairs = np.arange(pairs_in(len(dataset)))
    logps = torch.zeros(len(dataset), dtype=torch.float64, device=device)
    cpu_rng = torch.get_rng_state()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for part, real in lockstep_micro_batches(pairs, None, shard.dp_rank, shard.dp_size,
                                                     cfg.train.micro_batch_size):
                rows = pair_rows(part)
                batch = pair_batch(collate(dataset, rows, pad_id, cfg.data.packing))
                values, _ = sequence_logps(model, to_device(batch, device), len(rows))
                if real:
                    logps[torch.as_tensor(rows, device=device)] = values.double()
        dist.all_reduce(logps)
    finally:
        model.train(was_training)
        torch.set_rng_state(cpu_rng)
    return logps.cpu()


def reference_logps(path: Path, missing: bool, model: nn.Module, dataset: TokenizedDataset, cfg: TrainConfig,
                    shard: SequenceShard, device: torch.device, pad_id: int, log: MetricsLogger) -> torch.Tensor:
    """Collective when `missing` (on some rank): the reference log-probabilities of every row of `dataset`'s store,
    computed by a pass of the model as it is now (the starting weights) and written to `path` beside the store;
    else read from there. Either way an event in the run's log says which."""
    if missing:
        start = time.perf_counter()
        logps = compute_reference(model, dataset, cfg, shard, device, pad_id)
        if shard.dp_rank == 0:
            write_reference(path, logps, path.parent.parent, cfg)
        dist.barrier()
        log.event("reference_logps", file=str(path), rows=len(logps), seconds=round(time.perf_counter() - start, 3))
        return logps
    log.event("reference_logps", file=str(path), reused=True)
    return read_reference(path, len(dataset))


def write_reference(path: Path, logps: torch.Tensor, store: Path, cfg: TrainConfig) -> None:
    """Rank 0: the file, written aside and renamed, with what it was computed from in its metadata."""
    path.parent.mkdir(exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    save_file({"logps": logps.contiguous()}, part, metadata={"store": store.name,
                                                              "model": json.dumps(reference_identity(cfg))})
    os.replace(part, path)
