"""Seeded initialization of a from-scratch model, per rank, with the same values on any topology.

No rank builds the whole model: each module's parameters are initialized at full size, one module at a time, on
the CPU, from a seed derived from the run seed and the module's name, and each rank keeps only its slice of them
(the local shard of an FSDP2 DTensor, even or uneven, replicated or not). The values of a parameter depend on its
name, shape and the run seed only, never on the world size, the sharding strategy or the order in which other
modules were initialized, so 1, 2, 4 or 8 workers under any strategy start from the same weights, bit for bit,
and the one-process model (raysft.model.build.build_full_model) is that same initialization with one rank.

The largest allocation on top of a rank's shards is one module's parameters in full (the embedding or the LM
head: vocab x hidden, 4.2 GB in fp32 for Llama-3-70B), instead of a full copy of the model.

INIT_SCHEME names this scheme. Weights initialized another way are other weights: a run whose frozen base is
rebuilt from the seed on every launch (LoRA from scratch) records it in its identity and its checkpoints, and a
launch or an export under another scheme is refused (raysft.launch.prelaunch, raysft.products.adapters).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from raysft.hf.weights import copy_local_slice

INIT_SCHEME = "per-module-seed-1"  # bump when the values a (seed, name, shape) gives change


def clean_name(name: str) -> str:
    """A parameter's state-dict name: without the wrappers that activation checkpointing and compile add. Seeds and
    checkpoints go by it, so neither depends on how the model was wrapped."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a module's name: stable across processes and Python versions (the
    built-in hash of a str is salted per process)."""
    digest = hashlib.sha256(f"{INIT_SCHEME}:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_parameters(model: nn.Module, seed: int, init_module: Callable[[str, nn.Module], None],
                    name_of: Callable[[str], str] = lambda name: name,
                    select: Callable[[str], bool] = lambda name: True) -> None:
    """Initialize every parameter of `model` in place, module by module: `init_module(name, module)` runs on the
    module with its own parameters swapped for full-size CPU tensors, under a torch RNG seeded from `seed` and the
    module's name (`name_of` maps a module path to the name that seeds it: without wrapper prefixes), and each
    parameter keeps its local slice of the result. Only the modules whose name `select` accepts are touched. A
    parameter shared by two modules (tied weights) is initialized once, by the first. Not collective: every rank
    computes the same full values and keeps its own slice."""
    done: set[int] = set()
    for path, module in model.named_modules():
        name = name_of(path)
        params = {n: p for n, p in module.named_parameters(recurse=False) if id(p) not in done}
        if not params or not select(name):
            continue
        full = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False) for n, p in params.items()}
        try:
            module._parameters.update(full)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(module_seed(seed, name))
                init_module(name, module)
        finally:
            module._parameters.update(params)
        with torch.no_grad():
            for n, p in params.items():
                copy_local_slice(p, full[n].data)
                done.add(id(p))
