"""The training loop and what it needs beside the model: the optimizer, the step guard, evaluation, metrics.

Modules, by role:
  trainer      the loop: batch -> forward -> backward -> clip -> step -> log -> maybe checkpoint
  objective    train.objective as an object, chosen once: SFT or DPO's loss, step, reference pass, validation
  sft          one SFT step's forward and backward over a global batch of samples
  live         a replica group of one worker in a torchft quorum: the quorum's step, redone where a group failed,
               and the heal of a group that joins (torchft: the liveft extra)
  optim        AdamW, the learning-rate schedule, the fp16 loss scaler
  step_guard   whether a step may change the model (non-finite or spiking loss or gradient norm)
  evaluation   the loss over the eval store, on every worker, without gradients
  preference_eval  a DPO run's validation: the objective and implicit rewards on held-out pairs
  gen_log      the generation evaluations recorded beside the checkpoints, into metrics.jsonl and the trackers
  preference   one DPO step's forward and backward over a global batch of pairs (train.objective dpo)
  reference    the DPO reference log-probabilities: one pass of the starting model, stored beside the store
  metrics      rank 0's per-step metrics.jsonl and progress line
  trackers     TensorBoard, MLflow, W&B beside metrics.jsonl (optional extras)
"""

# rank 0's per-step records in the run directory; here, so that reading them needs no torch
METRICS_FILE = "metrics.jsonl"
