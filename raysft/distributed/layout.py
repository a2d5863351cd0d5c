"""Where every rank sits: one object (ParallelDims, after torchtitan's) built from the configuration and the nodes the
workers are on, validated once, that builds the device mesh and the sequence groups and answers every "where am I"
question. It is the one authority on the layout: the configuration's checks, `raysft plan`, the CLI and the driver,
the trainer, FSDP, sequence parallelism, the data loader, evaluation, the DPO reference pass and the memory tier ask
it, and none of them does rank arithmetic of its own.

The layout has three dimensions, outermost first: "replicate" (HSDP's replicas, or NO_SHARD's workers), "shard"
(FSDP's shard group, inside a node) and "sequence" (parallel.sequence_parallel consecutive ranks, carved out of
"shard", out of "replicate" for NO_SHARD). PyTorch's FSDP1 names map onto it as follows:
  FULL_SHARD     (1, workers / N, N): one shard group of every worker, params resharded after forward
  SHARD_GRAD_OP  the same, params kept unsharded between forward and backward
  HYBRID_SHARD   (nodes, workers per node / N, N): shard inside a node (or hsdp_shard_size workers), replicate across
  NO_SHARD       (workers / N, 1, N): every worker holds everything, gradients are all-reduced (data parallel)
FSDP's mesh folds "sequence" back into "shard", so every worker's partial gradient is summed in the reduce-scatter;
the N workers of a sequence group take the same samples (one data-parallel rank) and each its slice of every row.

Everything but `build_mesh`, `sequence_group` and `gather_nodes` is plain arithmetic, so the layout is built and
checked before any process group exists: `check_config` refuses, while a configuration loads, a layout that no
placement on nodes makes work (for every worker count it allows); `from_config` adds what comes from the nodes
(HYBRID_SHARD's sizes without hsdp_shard_size); `check_hsdp_shard_size_fits_nodes` checks an explicit shard group
against the cluster's nodes on the driver. The module reads the three parallel.* values it needs by name and imports
nothing of raysft.config, which asks it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from raysft.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a mesh or a group is made: the config's checks run without it
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


class ParallelSettings(Protocol):
    """The parallel.* values the layout depends on (raysft.config's ParallelConfig has them)."""

    sharding: str
    hsdp_shard_size: int
    sequence_parallel: int


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
    """(replicate, shard, sequence) sizes of a validated layout and the node of every rank: `from_config` is the way
    in from a configuration, `spread` the planner's."""

    replicate: int
    shard: int
    sequence: int = 1
    nodes: tuple[Hashable, ...] = field(default=(), compare=False, repr=False)
    """Every rank's node, in world-rank order, as the host memory is kept apart (the memory tier's snapshots, its
    copies to another node); empty: every rank on one node."""

    def __post_init__(self) -> None:
        if min(self.replicate, self.shard, self.sequence) < 1:
            raise ValueError(f"every size of a layout is at least 1, got {self}")
        if not self.nodes:
            object.__setattr__(self, "nodes", (0,) * self.world_size)
        if len(self.nodes) != self.world_size:
            raise ValueError(f"{len(self.nodes)} nodes given for the {self.world_size} ranks of {self}")

    @classmethod
    def from_config(cls, cfg: ParallelSettings, node_ranks: Sequence[int],
                    nodes: Sequence[Hashable] = ()) -> ParallelDims:
        """The layout for `cfg` over workers on nodes `node_ranks` (every worker's node rank, in world-rank order: Ray
        numbers nodes by IP and groups each node's workers under consecutive ranks; HYBRID_SHARD's shard groups stay
        inside one). `nodes`: every worker's node as its host memory is kept apart (Ray's node id, which tells
        logical nodes on one IP apart; default: `node_ranks`). Raises ConfigError, naming the key, before any
        process group or model exists."""
        fixed = _config_sizes(cfg, len(node_ranks))
        sizes = fixed or _sequence_sizes(cfg, *_replicas_and_workers_per_node(node_ranks))
        return cls(*sizes, nodes=tuple(nodes or node_ranks))

    @classmethod
    def spread(cls, cfg: ParallelSettings, workers: int, nodes: int) -> ParallelDims:
        """The layout of `workers` spread evenly over `nodes` nodes, each node's on consecutive ranks: what `raysft
        plan` lays out without a cluster to place them."""
        if cfg.sharding == "HYBRID_SHARD" and not cfg.hsdp_shard_size and (nodes < 2 or workers % nodes):
            raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD over {workers} workers on "
                              f"{nodes} node(s) has no shard group: give --nodes (2 or more, dividing the "
                              "workers) or set parallel.hsdp_shard_size")
        return cls.from_config(cfg, spread_evenly(workers, nodes))

    @staticmethod
    def check_config(cfg: ParallelSettings, workers: int) -> int:
        """The layout's rules that need no nodes, checked for `workers` workers (ConfigError naming the key): loading
        a configuration runs them for every worker count it allows. Returns the data-parallel size, which every
        placement on nodes shares: a step's samples are dealt over workers / parallel.sequence_parallel groups."""
        _config_sizes(cfg, workers)
        return workers // cfg.sequence_parallel

    @staticmethod
    def nodes_for(cfg: ParallelSettings, workers: int) -> int:
        """The nodes `raysft plan` assumes where no cluster says how many there are: a node per shard group of an
        explicit HYBRID_SHARD size (each group lies inside one), else one."""
        shard = cfg.hsdp_shard_size
        return workers // shard if shard and not workers % shard else 1

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

    @property
    def ranks_by_node(self) -> dict[Hashable, list[int]]:
        """Each node's ranks, the nodes in the order of their first rank."""
        return ranks_by_node(self.nodes)

    @property
    def replicated(self) -> bool:
        """Whether the layout spans nodes and every rank's shards are also held by a replica on another node (then a
        lost node's shards survive elsewhere: the memory tier sends no copies)."""
        nodes_of_place: dict[int, set[Hashable]] = {}
        for rank, node in enumerate(self.nodes):
            nodes_of_place.setdefault(self.shard_place(rank), set()).add(node)
        return all(len(nodes) > 1 for nodes in nodes_of_place.values())

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
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.mesh_dims, mesh_dim_names=self.mesh_names)

    def sequence_group(self) -> dist.ProcessGroup | None:
        """Collective: this worker's sequence group, the layout's innermost dimension (`sequence` consecutive
        ranks); None without sequence parallelism."""
        import torch.distributed as dist

        if self.sequence == 1:
            return None
        n = self.sequence
        groups = [dist.new_group(list(range(first, first + n))) for first in range(0, dist.get_world_size(), n)]
        return groups[dist.get_rank() // n]


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {message}")


def _config_sizes(p: ParallelSettings, num_workers: int) -> tuple[int, int, int] | None:
    """The (replicate, shard, sequence) sizes that the configuration fixes for `num_workers` workers, checked. None:
    HYBRID_SHARD without hsdp_shard_size, whose sizes come from the nodes."""
    shard, n = p.hsdp_shard_size, p.sequence_parallel
    _require(shard >= 0, "parallel.hsdp_shard_size", f"must be >= 0, got {shard}")
    _require(num_workers % n == 0, "parallel.sequence_parallel",
             f"{n} does not divide {num_workers} workers: each sequence group is N workers")
    if p.sharding != "HYBRID_SHARD":
        _require(shard == 0, "parallel.hsdp_shard_size", f"applies to HYBRID_SHARD only (sharding is {p.sharding})")
        return _sequence_sizes(p, *((num_workers, 1) if p.sharding == "NO_SHARD" else (1, num_workers)))
    _require(num_workers >= 4, "parallel.sharding",
             f"HYBRID_SHARD needs at least 4 workers (2 replicas of a shard group of 2 or more), got "
             f"scaling.num_workers={num_workers}; use FULL_SHARD")
    if not shard:
        return None
    _require(num_workers % shard == 0, "parallel.hsdp_shard_size",
             f"shard-group size {shard} does not divide scaling.num_workers={num_workers}")
    _require(1 < shard < num_workers, "parallel.hsdp_shard_size",
             f"shard-group size {shard} of {num_workers} workers leaves "
             f"{'nothing to shard (use NO_SHARD)' if shard == 1 else 'nothing to replicate (use FULL_SHARD)'}")
    return _sequence_sizes(p, num_workers // shard, shard)


def _sequence_sizes(p: ParallelSettings, replicate: int, shard: int) -> tuple[int, int, int]:
    """(replicate, shard, sequence): the sequence groups of parallel.sequence_parallel consecutive workers carved
    out of the shard group, which lies inside a node (out of the replicas for NO_SHARD, whose shard group is one
    worker)."""
    n = p.sequence_parallel
    if p.sharding == "NO_SHARD":
        _require(replicate % n == 0, "parallel.sequence_parallel", f"{n} does not divide {replicate} workers")
        return replicate // n, 1, n
    _require(shard % n == 0, "parallel.sequence_parallel",
             f"{n} does not divide the shard group of {shard} workers ({p.sharding}; a sequence group stays inside a "
             "shard group, inside a node)")
    return replicate, shard // n, n


def _replicas_and_workers_per_node(node_ranks: Sequence[int]) -> tuple[int, int]:
    """HYBRID_SHARD without hsdp_shard_size: a replica per node, a shard group of its workers."""
    per_node = Counter(node_ranks)
    placed = ", ".join(f"node {n}: {c}" for n, c in sorted(per_node.items()))
    hint = "set parallel.hsdp_shard_size to the shard-group size"
    if list(node_ranks) != sorted(node_ranks):
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD needs each node's workers on consecutive "
                          f"ranks, got node ranks {list(node_ranks)}; {hint}")
    if len(set(per_node.values())) > 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD needs the same number of workers on every "
                          f"node, Ray placed {placed}; {hint} or place the workers evenly")
    nodes, shard = len(per_node), len(node_ranks) // len(per_node)
    if nodes == 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD on one node ({placed}) has nothing to "
                          f"replicate across nodes (logical nodes on one host share an IP and count as one); "
                          f"{hint} or use FULL_SHARD")
    if shard == 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD with one worker per node ({placed}) has "
                          f"nothing to shard inside a node; {hint} or use NO_SHARD")
    return nodes, shard


def ranks_by_node(nodes: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Each node's ranks, given every rank's node; the nodes in the order of their first rank."""
    ranks: dict[Hashable, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    return ranks


def spread_evenly(workers: int, nodes: int) -> list[int]:
    """Every worker's node rank, `workers` spread as evenly as they go over `nodes` nodes, each node's on
    consecutive ranks (as Ray groups them)."""
    return [rank * nodes // workers for rank in range(workers)]


def node_sizes(node_ranks: Sequence[Hashable]) -> list[int]:
    """How many workers each node holds, the fullest first (as Ray fills each node before the next)."""
    return sorted((len(ranks) for ranks in ranks_by_node(node_ranks).values()), reverse=True)


def gather_nodes(node_rank: int, node: str) -> tuple[list[int], list[str]]:
    """Collective: every worker's node rank and node (what `ParallelDims.from_config` takes), in world-rank order."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (node_rank, node))
    return [r for r, _ in everyone], [n for _, n in everyone]


def check_hsdp_shard_size_fits_nodes(p: ParallelSettings, num_workers: int, workers_per_node: list[int]) -> None:
    """An explicit HYBRID_SHARD shard group must lie inside one node, or its all-gathers and reduce-scatters, the
    traffic HSDP keeps off the network, cross it: checked on the driver against the cluster's nodes (one entry per
    node IP: how many workers it holds when idle; logical nodes sharing an IP count as one). Ray packs the workers
    onto as few nodes as it can, filling each, so a node whose capacity is not a multiple of the group size would
    split a group with the next node."""
    shard, nodes = p.hsdp_shard_size, [n for n in workers_per_node if n > 0]
    if p.sharding != "HYBRID_SHARD" or not shard or len(nodes) < 2 or num_workers <= max(nodes):
        return
    sizes = ", ".join(f"{n}" for n in nodes)
    key = "config key 'parallel.hsdp_shard_size'"
    if shard > max(nodes):
        raise ConfigError(f"{key}: a shard group of {shard} workers is larger than any node of this cluster (workers "
                          f"per node: {sizes}), so it would shard across the network; use the workers per node or "
                          "a divisor of it")
    if any(n % shard for n in nodes):
        raise ConfigError(f"{key}: shard groups of {shard} workers would straddle nodes that hold {sizes} workers "
                          "each; use a divisor of every node's workers (or 0: the workers per node, from Ray)")
