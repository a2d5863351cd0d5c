"""How the processes of a run reach each other, below everything that runs in them: the model's weight loading, the
data's tokenizing on Ray, the configuration's checks, the checkpoint and the loop all use these, so they sit under
all of them.

Modules, by role:
  layout       ParallelDims, the one authority on where each rank sits: the config's parallel values and the
               workers' nodes -> the (replicate, shard, sequence) sizes and every rank's node, validated once (plain
               arithmetic, asked by raysft.config's checks); builds the device mesh and the sequence groups and
               answers every "which group am I in" (a rank's SequenceShard, its place in the shard group, each node's
               ranks), and the driver's check of an explicit HYBRID_SHARD shard group against the nodes
  collectives  the process group's backend (NCCL, gloo, or both with CPU offload); all/any/count over ranks, a
               value computed on rank 0 and shared
  local_ray    a Ray of raysft's own on this machine, for a launch or a tokenizing without RAY_ADDRESS (Ray is
               imported by this module alone, not by the package)
  heal_transport  how a replica group that joins a live run (torchft's quorum) fetches the training state from a
               live peer: tensors as safetensors, the structure as JSON, nothing unpickled (torchft is imported by
               this module alone)
"""
