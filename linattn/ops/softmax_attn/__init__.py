"""softmax_attn: softmax attention (causal / sliding window / RoPE / ALiBi / GQA) with a KV cache."""

from .api import softmax_attn, softmax_attn_step

__all__ = ["softmax_attn", "softmax_attn_step"]
