"""The Hugging Face format, read and written in one place: model directories, safetensors files and their index,
each rank's slices of them. What is built on it with the checkpoint and the model (exports, peft adapters) is
raysft.products.

Modules, by role:
  files     checks on a model or tokenizer directory before transformers reads it (no code, sound headers)
  shards    a model's tensors over files of SHARD_BYTES (HF's default), the names of a checkpoint's tensor files
            (DCP's too): the one reader and writer of `*.safetensors.index.json`
  weights   each rank's slices of named tensors, read from safetensors files into sharded parameters
  tensors   the one check of weights against the model reading them: every tensor, its shape, a dtype read right
  dtypes    the one table of dtype names (the configuration's fp32/bf16/fp16, safetensors' F32/BF16/...) and sizes
  fingerprint  a cheap fingerprint of a model directory's weights (the base a run started from, in its identity)
"""
