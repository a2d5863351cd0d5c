"""Parallelism: where each rank sits (one layout object), FSDP2 applied in one place, sequence parallelism, FP8.

Modules, by role:
  layout       ParallelDims: the config and the cluster's topology -> the (replicate, shard, sequence) sizes,
               validated once; builds the device mesh and the sequence groups and answers every "which group am
               I in" (a rank's SequenceShard: data-parallel and sequence rank and size); the driver's check of an
               explicit HYBRID_SHARD shard group against the cluster's nodes
  fsdp         the dtype policy (its names: raysft.hf.dtypes), and FSDP2 (`fully_shard`) for each sharding
               strategy, compile, activation checkpointing: applied in one fixed order
  sequence     Ulysses sequence parallelism: each rank's part of every packed row, attention over the whole row
  fp8          FP8 training (parallel.fp8): the linear layers swapped for torchao's Float8Linear before sharding,
               their weights all-gathered in float8; refused where it cannot run
"""
