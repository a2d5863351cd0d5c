"""The commands around a run: what it will need before it starts, and what it left.

Modules, by role:
  plan           memory per worker and host, checkpoint sizes, from the config alone (`raysft plan`)
  architectures  the architecture plan counts: a known name, a config.json, or the config's, without weights
                 or a tokenizer
  known          the well-known architectures' shapes, as plain data (the CLI's help names them)
  chat           one answer or a REPL from a checkpoint or export, with the training chat template (`raysft chat`;
                 the model is loaded by raysft.products.chat_model)
  report         loss and throughput curves from metrics.jsonl (`raysft report`)
"""
