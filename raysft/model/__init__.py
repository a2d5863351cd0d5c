"""The model: a LLaMA-style causal LM from transformers, built on the meta device and given each rank's weights.

Modules, by role:
  build        the model from `model.path` or `model.config`, sharded before it holds memory, then each rank's
               weights (its slices of the safetensors files, or a seeded init)
  seeded_init  a from-scratch model's values, per rank, the same on any topology
  attention    padding-free attention over packed rows (`model.attn_implementation: varlen`)
  lora         peft adapters injected before sharding, the base frozen
  loss         next-token cross-entropy over the assistant tokens, a chunk of label tokens at a time
  preference_loss  each answer's log-probability (per sequence, chunked), DPO's and IPO's loss per pair
"""
