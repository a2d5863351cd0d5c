"""Parallelism: where each rank sits (one layout object), FSDP2 applied in one place, sequence parallelism, and the
one-value collectives the ranks agree through.

Modules, by role:
  layout       ParallelDims, the one authority on where each rank sits: the config and the workers' nodes -> the
               (replicate, shard, sequence) sizes and every rank's node, validated once; builds the device mesh and
               the sequence groups and answers every "which group am I in" (a rank's SequenceShard, its place in
               the shard group, each node's ranks); the checks of a configuration's layout (below raysft.config,
               which asks them) and the driver's of an explicit HYBRID_SHARD shard group against the nodes
  fsdp         the dtype table and policy, and FSDP2 (`fully_shard`) for each sharding strategy, compile, activation
               checkpointing: applied in one fixed order
  sequence     Ulysses sequence parallelism: each rank's part of every packed row, attention over the whole row
  fp8          FP8 training (parallel.fp8): the linear layers swapped for torchao's Float8Linear before sharding,
               their weights all-gathered in float8; refused where it cannot run
  collectives  the process group's backend (NCCL, gloo, or both with CPU offload); all/any/count over ranks, a
               value computed on rank 0 and shared
"""
