"""How the processes of a run reach each other, below everything that runs in them: the model's weight loading,
the data's tokenizing on Ray, the checkpoint and the loop all use these, so they sit under all of them.

Modules, by role:
  collectives  the process group's backend (NCCL, gloo, or both with CPU offload); all/any/count over ranks, a
               value computed on rank 0 and shared
  local_ray    a Ray of raysft's own on this machine, for a launch or a tokenizing without RAY_ADDRESS (Ray is
               imported by this module alone, not by the package)
"""
