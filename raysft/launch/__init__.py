"""The launchers: Ray Train (driver and workers) and torchrun, and what both need on the way in and out.

Modules, by role:
  paths       what a relative path in the config means (where the command runs), resolved once on the driver
  prelaunch   on the driver before any worker: the stores, the checks every worker would fail, the run claimed
  ray_driver  the Ray edge on the driver: a Ray to join or start, TorchTrainer, the stop flag (`raysft.train`)
  ray_worker  the Ray edge on the workers: Ray's context, reports, checkpoints, preemption notices
  ray_live    the Ray edge of live fault tolerance: Ray's torchft backend on the driver, a replica group per worker
  ray_train   Ray Train imported in one place, after the installed Ray's version is checked (RAY_FLOOR)
  ray_controller  what Ray Train's controller imports of raysft (kept light): the callback that ends a run on a
              recorded error, the validation function's entry
  torchrun    the worker run under torchrun, no Ray (`torchrun -m raysft.run`)
  lease       one launch at a time per run: a lease file in the run directory
  signals     how a launch ends on SIGTERM or Ctrl-C
"""
