"""Parallelism: FSDP2 applied in one place (where each rank sits: raysft.distributed.layout), sequence parallelism, FP8.

Modules, by role:
  fsdp         the dtype policy (its names: raysft.hf.dtypes), and FSDP2 (`fully_shard`) for each sharding
               strategy, compile, activation checkpointing: applied in one fixed order
  sequence     Ulysses sequence parallelism: each rank's part of every packed row, attention over the whole row
  fp8          FP8 training (parallel.fp8): the linear layers swapped for torchao's Float8Linear before sharding,
               their weights all-gathered in float8; refused where it cannot run
"""
