"""The model: its config and presets, the GPT, its weights, KV cache, LoRA, int8, parameter and memory counts."""
