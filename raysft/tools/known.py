"""The well-known architectures `raysft plan --model NAME` counts, as plain data: the CLI names them in its help
without importing torch or transformers (raysft.tools.architectures builds their configs)."""

from __future__ import annotations

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
_QWEN25 = dict(model_type="qwen2", rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False)
# Well-known shapes, each from the config.json of the model's repository on the Hugging Face Hub (named on its line);
# the parameter count `raysft plan` prints for each matches its model card's (tests/test_plan.py).
KNOWN: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B (Meta-Llama-3-8B has the same shape); jobs/configs/models/llama-3.1-8b.json
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B (Meta-Llama-3-70B has the same shape); jobs/configs/models/llama-3.1-70b.json
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    # meta-llama/Llama-3.2-3B
    "llama3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Qwen/Qwen2.5-1.5B
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen/Qwen2.5-3B
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
