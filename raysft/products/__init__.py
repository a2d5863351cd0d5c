"""What a run makes, in the forms used outside training: built on the checkpoint, the model and the file format
(raysft.hf), so above all three, and below the evaluation and the commands that use them.

Modules, by role:
  export      a checkpoint (full or sharded) -> a model directory `from_pretrained` loads (`raysft export`)
  adapters    a LoRA checkpoint -> a peft adapter directory, or merged into its base; loading what that writes
  chat_model  any model directory or checkpoint loaded to answer, greedy, with its chat template (`raysft chat`,
              the evaluation's hf engine)
  directories what kind of directory a path is (checkpoint, adapters, model...): the one answer all of these act on
"""
