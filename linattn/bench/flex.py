"""FlexAttention rows for ``linattn bench ops``: torch's ``flex_attention`` running an op's math, as a yardstick.

FlexAttention compiles a flash-attention kernel (Triton templates, by inductor) around a ``score_mod`` that edits each
logit. For forgetting_attn (FoX) the bias G_t - G_s (G = cumsum(g)) is written as -G_s alone: the row term G_t is a
constant of the softmax row, so o and the gradients (of g too) are unchanged, and FlexAttention cannot differentiate
a captured tensor that the ``score_mod`` indexes twice. The causal mask is a block mask, built once per length. The
bench rows run on CUDA, compiled with ``torch.compile`` (FlexAttention's speed); uncompiled it runs its reference
math (T x T memory, and on the CPU no backward), which the tests check against the recurrence. Inputs are the op's
``example_inputs`` ([B, T, H, *], one key/value head per query head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FLEX_OPS = ("forgetting_attn",)


def _flex_api():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:  # torch before 2.5
        return None
    return create_block_mask, flex_attention


def forgetting_attn_flex(attend: Callable | None = None) -> Callable[[dict], torch.Tensor]:
    """forgetting_attn's output o [B, T, H, V] from its example inputs through FlexAttention: ``attend`` is
    ``flex_attention`` or a compiled form of it (None: the plain function, which runs its reference math eagerly;
    on the CPU, forward only)."""
    create_block_mask, flex_attention = _flex_api()
    attend = flex_attention if attend is None else attend
    masks: dict[int, object] = {}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def call(x: dict) -> torch.Tensor:
        # [B, H, T, D] copies: FlexAttention reads them faster than strided views of [B, T, H, D] (the copies are
        # timed with it)
        q, k, v = (x[name].transpose(1, 2).contiguous() for name in ("q", "k", "v"))
        T = q.shape[2]
        if T not in masks:
            masks[T] = create_block_mask(causal, None, None, T, T, device=q.device)
        G = torch.cumsum(x["g"].float(), dim=1).transpose(1, 2).contiguous()  # [B, H, T], read once per logit

        def forget_bias(score, b, h, q_idx, kv_idx):
            return score - G[b, h, kv_idx]

        return attend(q, k, v, score_mod=forget_bias, block_mask=masks[T]).transpose(1, 2)

    return call


def flex_call(op: str, device: torch.device) -> Callable[[dict], torch.Tensor] | None:
    """``op``'s FlexAttention form compiled for a bench row on CUDA, or None: no such form, no FlexAttention in
    this torch, or not CUDA (FlexAttention has no backward on the CPU)."""
    api = _flex_api()
    if op not in FLEX_OPS or api is None or device.type != "cuda":
        return None
    return forgetting_attn_flex(torch.compile(api[1], dynamic=False))
