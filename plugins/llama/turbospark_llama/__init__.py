"""turbospark family plugin for Llama-style decoders (Llama, Qwen2/3, Qwen3-MoE, MiniMax-M2, Qwen3-VL text)."""

from __future__ import annotations

FAMILY = "llama"
DISTRIBUTION = "turbospark-llama"
MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "minimax_m2", "qwen3_vl")
GGUF_ARCHITECTURES = ("llama",)
