"""Where every rank sits: one object (ParallelDims, after torchtitan's) built from the configuration and the
cluster's topology, validated once, that builds the device mesh and the sequence groups and answers every "which
group am I in" question (the FSDP code, sequence parallelism, the data loader, evaluation and `raysft plan` ask it).

The layout has three dimensions, outermost first: "replicate" (HSDP's replicas, or NO_SHARD's workers), "shard"
(FSDP's shard group, inside a node) and "sequence" (parallel.sequence_parallel consecutive ranks, carved out of
"shard", out of "replicate" for NO_SHARD). PyTorch's FSDP1 names map onto it as follows:
  FULL_SHARD     (1, workers / N, N): one shard group of every worker, params resharded after forward
  SHARD_GRAD_OP  the same, params kept unsharded between forward and backward
  HYBRID_SHARD   (nodes, workers per node / N, N): shard inside a node (or hsdp_shard_size workers), replicate across
  NO_SHARD       (workers / N, 1, N): every worker holds everything, gradients are all-reduced (data parallel)
FSDP's mesh folds "sequence" back into "shard", so every worker's partial gradient is summed in the reduce-scatter;
the N workers of a sequence group take the same samples (one data-parallel rank) and each its slice of every row.

What the configuration fixes for a worker count (every size but HYBRID_SHARD's from the nodes) is checked by
raysft.config's parallel_layout, so that loading a configuration refuses it with the key's name before any
worker starts; what comes from the cluster (Ray's node ranks, the nodes' sizes) is checked here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raysft.config import ParallelConfig, parallel_layout, sequence_layout
from raysft.errors import ConfigError


@dataclass(frozen=True)
class SequenceShard:
    """A rank's place (`ParallelDims.place`): its data-parallel group (which samples it trains on) and its slice of
    every row within its sequence group."""

    dp_rank: int
    dp_size: int
    sp_rank: int = 0
    sp_size: int = 1


@dataclass(frozen=True)
class ParallelDims:
    """(replicate, shard, sequence) sizes of a validated layout: `from_config` is the way in."""

    replicate: int
    shard: int
    sequence: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, node_ranks: Sequence[int]) -> ParallelDims:
        """The layout for `cfg` over workers on nodes `node_ranks` (every worker's node rank, in world-rank order:
        Ray groups each node's workers under consecutive ranks). Raises ConfigError, naming the key, before any
        process group or model exists."""
        fixed = parallel_layout(cfg, len(node_ranks))
        return cls(*(fixed or sequence_layout(cfg, *_replicas_and_workers_per_node(node_ranks))))

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.sequence

    @property
    def dp_size(self) -> int:
        """The data-parallel groups a step's samples are dealt over: one per sequence group."""
        return self.replicate * self.shard

    @property
    def shard_group_size(self) -> int:
        """FSDP's shard group: every worker of a replica, its sequence groups included."""
        return self.shard * self.sequence

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        """FSDP's mesh: the sequence dimension folded into "shard"."""
        return (self.shard_group_size,) if self.replicate == 1 else (self.replicate, self.shard_group_size)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return ("shard",) if self.replicate == 1 else ("replicate", "shard")

    def shard_place(self, rank: int) -> int:
        """Rank `rank`'s place in its shard group: its replicas (HYBRID_SHARD, NO_SHARD) share it and hold the same
        shards of every parameter."""
        return rank % self.shard_group_size

    def place(self, rank: int) -> SequenceShard:
        """Rank `rank`'s data-parallel and sequence coordinates ("sequence" is innermost: consecutive ranks)."""
        return SequenceShard(rank // self.sequence, self.dp_size, rank % self.sequence, self.sequence)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Collective: FSDP's mesh (`mesh_dims`): every worker of a replica, sequence groups included, shards the
        parameters and sums its partial gradient in the reduce-scatter."""
        return init_device_mesh(device_type, self.mesh_dims, mesh_dim_names=self.mesh_names)

    def sequence_group(self) -> dist.ProcessGroup | None:
        """Collective: this worker's sequence group, the layout's innermost dimension (`sequence` consecutive
        ranks); None without sequence parallelism."""
        if self.sequence == 1:
            return None
        n = self.sequence
        groups = [dist.new_group(list(range(first, first + n))) for first in range(0, dist.get_world_size(), n)]
        return groups[dist.get_rank() // n]


def _replicas_and_workers_per_node(node_ranks: Sequence[int]) -> tuple[int, int]:
    """HYBRID_SHARD without hsdp_shard_size: a replica per node, a shard group of its workers."""
    per_node = Counter(node_ranks)
    layout = ", ".join(f"node {n}: {c}" for n, c in sorted(per_node.items()))
    hint = "set parallel.hsdp_shard_size to the shard-group size"
    if list(node_ranks) != sorted(node_ranks):
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD needs each node's workers on consecutive "
                          f"ranks, got node ranks {list(node_ranks)}; {hint}")
    if len(set(per_node.values())) > 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD needs the same number of workers on every "
                          f"node, Ray placed {layout}; {hint} or place the workers evenly")
    nodes, shard = len(per_node), len(node_ranks) // len(per_node)
    if nodes == 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD on one node ({layout}) has nothing to "
                          f"replicate across nodes (logical nodes on one host share an IP and count as one); "
                          f"{hint} or use FULL_SHARD")
    if shard == 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD with one worker per node ({layout}) has "
                          f"nothing to shard inside a node; {hint} or use NO_SHARD")
    return nodes, shard


def gather_node_ranks(node_rank: int, device: torch.device) -> list[int]:
    """Collective: every worker's node rank, in world-rank order (what `ParallelDims.from_config` takes)."""
    ranks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, torch.tensor([node_rank], dtype=torch.int64, device=device))
    return [int(r.item()) for r in ranks]


def check_hsdp_shard_size_fits_nodes(p: ParallelConfig, num_workers: int, workers_per_node: list[int]) -> None:
    """An explicit HYBRID_SHARD shard group must lie inside one node, or its all-gathers and reduce-scatters, the
    traffic HSDP keeps off the network, cross it: checked on the driver against the cluster's nodes (one entry per
    node IP: how many workers it holds when idle; logical nodes sharing an IP count as one). Ray packs the workers
    onto as few nodes as it can, filling each, so a node whose capacity is not a multiple of the group size would
    split a group with the next node."""
    shard, nodes = p.hsdp_shard_size, [n for n in workers_per_node if n > 0]
    if p.sharding != "HYBRID_SHARD" or not shard or len(nodes) < 2 or num_workers <= max(nodes):
        return
    layout = ", ".join(f"{n}" for n in nodes)
    key = "config key 'parallel.hsdp_shard_size'"
    if shard > max(nodes):
        raise ConfigError(f"{key}: a shard group of {shard} workers is larger than any node of this cluster (workers "
                          f"per node: {layout}), so it would shard across the network; use the workers per node or "
                          "a divisor of it")
    if any(n % shard for n in nodes):
        raise ConfigError(f"{key}: shard groups of {shard} workers would straddle nodes that hold {layout} workers "
                          "each; use a divisor of every node's workers (or 0: the workers per node, from Ray)")
