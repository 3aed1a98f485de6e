"""Conversions: Hugging Face GPT-2, Llama and Qwen3 in and out, GGUF out, LoRA merges."""
