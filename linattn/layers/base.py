"""The shared frame of every op-backed mixer layer.

One layer = projections q, k, v (``tie_kv``: v reuses k's projection) -> optional ShortConv on any
of the streams (``short_conv`` letters, ``conv_mode``) -> per-head reshape -> the subclass's
feature maps and gates (:meth:`MixerLayer.mix_inputs`) -> the op (full sequence, or its step
function for a single token with a cache) -> per-head output RMSNorm, optionally gated by
SiLU(W_g x) -> output projection. A subclass states its paper's parameterisation and fills in
:meth:`mix_inputs` (and at most a few class attributes).

``forward(x, cache=None) -> (y, cache)``: the returned :class:`LayerCache` holds the ShortConv
caches and the op state, so prefill then single-token steps equals one full forward.

Packed sequences: ``forward(x, cu_seqlens=offsets)`` with x [1, T, d_model] holding N sequences
(linattn/ops/common/varlen.py) gives each sequence the output it has alone: the projections and norms
act per token on the packed input, the ShortConvs and the op take ``cu_seqlens``, and positions (RoPE,
``mix_inputs``'s ``offset``) restart at 0 in every sequence. A packed call starts from zero states and
returns no cache (training and scoring; decoding continues unpacked rows).

Static decoding (static_cache.py): :meth:`MixerLayer.allocate_static_cache` makes a layer's buffers,
:meth:`MixerLayer.load_static_cache` copies a prefill's :class:`LayerCache` into some of their rows, and
``forward(x, static_cache)`` with one token x runs :meth:`MixerLayer.static_step`, which overwrites the
buffers in place (the same projections, ShortConvs, gates and norms as the cached path; the op's step on
the state buffers, or a subclass's :meth:`MixerLayer.static_op_step`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from linattn import switches
from linattn.ops.common.checks import check_choice, check_chunk_size
from linattn.ops.common.registry import BACKENDS
from linattn.ops.common.values import value_checks
from linattn.ops.common.varlen import check_cu_seqlens, check_packed_batch, sequence_positions

from .cache import LayerCache
from .checks import check_conv_cache, check_layer_input, check_short_conv, check_static_step_input, head_dims
from .norms import l2norm_pair, norm_gate_project
from .shortconv import CONV_MODES, ShortConv, last_inputs, packed_last_inputs
from .static_cache import StaticLayerCache, copy_rows_, copy_state_, state_dtype

TokenArgs = dict[str, torch.Tensor | None]  # the op's inputs that vary over time ([B, T, ...]) by the op's names
Streams = dict[str, torch.Tensor]  # projected streams by name ("q", "k", "v", ...), or their conv caches
MixOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, TokenArgs, dict[str, Any]]  # q, k, v, args, kwargs


class Projections(NamedTuple):
    """The projections of a layer's input before the ShortConvs: every stream by name, and the output of the one
    matmul whose column ranges the :meth:`MixerLayer.x_projections` streams are, in that order (None when they
    are fewer than two: no joint matmul)."""

    streams: Streams
    joint: torch.Tensor | None


class MixerLayer(nn.Module):
    """Base of the op-backed layers. Subclasses set ``op`` / ``op_step`` (the op's public functions),
    ``default_short_conv``, ``default_output_norm``, ``default_output_gate``, ``scale`` (None: the
    op's K^-1/2), and override :meth:`mix_inputs`.

    Args: d_model; n_heads; head_dim (key width per head, default d_model / n_heads); head_dim_v
    (value width, default head_dim); short_conv (letters of "qkv", "" for none; None: the paper's
    default); conv_mode ("learned", "shift", "identity"); conv_kernel (4); conv_activation ("silu"
    or None); conv_bias (a learned bias per channel in each learned ShortConv, as in Mamba2's conv;
    default False); tie_kv (True: v uses k's projection, before k's conv and feature map; "exact": v is the
    key fed to the op, after k's conv, feature map and normalisation, so K = V exactly and a conv on v is
    refused; both need head_dim_v == head_dim); output_norm / output_gate (None: the paper's default);
    recompute_output_gate (True: the output gate's projection W_g x is recomputed in the backward pass instead of
    kept, one matmul more for H * V values per token less until the backward pass; default False); backend
    ("auto", ...); chunk_size; norm_eps.
    """

    op: Callable | None = None
    op_step: Callable | None = None
    graph_capturable: bool = True  # whether a static decoding step can be captured in a CUDA graph
    default_short_conv: str = ""
    default_output_norm: bool = True
    default_output_gate: bool = False
    scale: float | None = None
    conv_letters: str = "qkv"
    step_inplace: bool = False  # op_step takes inplace=True (writes the new state into the state it is given)
    # what mix_inputs does to q and k when that does not depend on the token arguments: "l2" (L2-normalised, v as
    # it is) or "identity" (all three as they are); None: only mix_inputs knows. The backward's rebuild of q, k, v
    # (ConvOutputs) reads it to skip the arguments it would drop (tests check it against mix_inputs). It counts only
    # in the class body that defines mix_inputs (declared_qk_feature_map): a subclass with a mix_inputs of its own
    # says again what it does, or gets the full rebuild.
    qk_feature_map: str | None = None

    def __init__(self, d_model: int, n_heads: int, *, head_dim: int | None = None, head_dim_v: int | None = None,
                 short_conv: str | None = None, conv_mode: str = "learned", conv_kernel: int = 4,
                 conv_activation: str | None = "silu", conv_bias: bool = False, tie_kv: bool | str = False,
                 output_norm: bool | None = None, output_gate: bool | None = None,
                 recompute_output_gate: bool = False, backend: str = "auto", chunk_size: int = 64,
                 norm_eps: float = 1e-5) -> None:
        super().__init__()
        K = head_dims(d_model, n_heads, head_dim)
        V = K if head_dim_v is None else head_dims(d_model, n_heads, head_dim_v)
        short_conv = self.default_short_conv if short_conv is None else short_conv
        self.short_conv = check_short_conv(short_conv, self.conv_letters)
        if not isinstance(tie_kv, bool) and tie_kv != "exact":
            raise TypeError(f"tie_kv must be a bool or 'exact', got {tie_kv!r}")
        if tie_kv and V != K:
            raise ValueError(f"tie_kv={tie_kv!r} needs head_dim_v == head_dim, got head_dim_v={V}, head_dim={K}")
        # exact K = V replaces v by the op's key, so a conv on v would act on nothing
        self.exact_kv = tie_kv == "exact"
        if self.exact_kv and "v" in self.short_conv:
            raise ValueError("tie_kv='exact' makes v the key fed to the op: a ShortConv on v would be unused; "
                             f"got short_conv={self.short_conv!r}")
        self.d_model, self.n_heads, self.head_dim, self.head_dim_v = d_model, n_heads, K, V
        # checked here as the ops check them, so that a typo fails at construction and not at the first forward
        check_choice("backend", backend, ("auto", *BACKENDS))
        check_chunk_size(chunk_size)
        self.tie_kv, self.backend, self.chunk_size = tie_kv, backend, chunk_size
        if conv_mode not in CONV_MODES:
            raise ValueError(f"conv_mode must be one of {', '.join(map(repr, CONV_MODES))}; got {conv_mode!r}")
        self.conv_mode = conv_mode
        H = n_heads
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        if not isinstance(conv_bias, bool):
            raise TypeError(f"conv_bias must be a bool, got {conv_bias!r}")
        self._conv_args = dict(kernel_size=conv_kernel, activation=conv_activation, mode=conv_mode, bias=conv_bias)
        self.convs = nn.ModuleDict({c: ShortConv(self.q_proj.out_features, **self._conv_args) for c in self.short_conv})
        self.set_kv_heads(H)
        self.output_norm = self.default_output_norm if output_norm is None else bool(output_norm)
        self.output_gate = self.default_output_gate if output_gate is None else bool(output_gate)
        self.o_norm = nn.RMSNorm(V, eps=norm_eps) if self.output_norm else None
        self.g_proj = nn.Linear(d_model, H * V, bias=False) if self.output_gate else None
        self.o_proj = nn.Linear(H * V, d_model, bias=False)
        if not isinstance(recompute_output_gate, bool):
            raise TypeError(f"recompute_output_gate must be a bool, got {recompute_output_gate!r}")
        self.recompute_output_gate = recompute_output_gate

    def set_kv_heads(self, n: int) -> None:
        """(Re)build the k and v projections (and their ShortConvs) for ``n`` key/value heads
        (grouped-query attention: n < n_heads; Gated DeltaProduct: n_heads * num_householder)."""
        K, V = self.head_dim, self.head_dim_v
        self.k_proj = nn.Linear(self.d_model, n * K, bias=False)
        self.v_proj = None if self.tie_kv else nn.Linear(self.d_model, n * V, bias=False)
        for c, width in (("k", n * K), ("v", n * V)):
            if c in self.convs:
                self.convs[c] = ShortConv(width, **self._conv_args)

    # --- hooks for subclasses -------------------------------------------------------------------
    def mix_inputs(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   offset: int | torch.Tensor, streams: dict[str, torch.Tensor]) -> MixOut:
        """Feature maps and gates: q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V] after the
        ShortConvs; ``offset`` is the position of x's first token (an int, or per row a [B] tensor in a
        static step), or with packed sequences every token's position in its sequence ([1, T] tensor);
        ``streams`` every projected stream (flat, after its ShortConv; subclasses may add their own in
        :meth:`streams`). Returns (q, k, v, the op's inputs that vary over time [B, T, ...] by the op's argument
        names (e.g. {"g": g, "beta": beta}; None for an optional input left out), keyword args for the op and its
        step (options, and constant tensors by name, e.g. mesa_net's lamb)). Steps get each time-varying input
        cut to its token."""
        return q, k, v, {}, {}

    def skip(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Added to the op output before the output norm (e.g. Mamba2's D skip); default none."""
        return o

    def op_kwargs(self) -> dict[str, Any]:
        """Keyword args of the full-sequence op call only (not of its step)."""
        return {"backend": self.backend, "chunk_size": self.chunk_size}

    # --- the frame --------------------------------------------------------------------------------
    def x_projections(self) -> dict[str, nn.Linear]:
        """The bias-free projections of the layer input that :meth:`streams` computes as one matmul, by stream name:
        q, k and v where a ShortConv follows (it reads its slice of the joint output in place, so the joint output
        costs no memory beyond the slices it keeps; on Triton all of them run as one op over the joint output,
        :meth:`joint_conv_streams`), and a subclass's small per-head projections (e.g. beta's).
        One matmul instead of several saves the host time of each projection and of its weight's cast, forward and
        backward. Streams without a ShortConv keep their own matmul: their consumers would keep a slice, and so the
        whole joint output, for the backward pass."""
        mods = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}
        return {name: m for name, m in mods.items() if m is not None and name in self.convs}

    def streams(self, x: torch.Tensor, cache: LayerCache | StaticLayerCache | None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """Projections q, k, v (flat [B, T, H*D]) after their ShortConvs (each packed sequence convolved alone
        given ``cu_seqlens``), the other :meth:`x_projections` by name, and the new conv caches."""
        if isinstance(cache, LayerCache):
            check_conv_cache(cache, self.conv_modules())
        return self.convolve(self.projected_streams(x), cache, cu_seqlens)

    def projected_streams(self, x: torch.Tensor) -> Projections:
        """The projections of x, before the ShortConvs (see :meth:`streams`)."""
        joint, out = project_jointly(x, self.x_projections())
        if "q" not in out:
            out["q"] = self.q_proj(x)
        if "k" not in out:
            out["k"] = self.k_proj(x)
        if "v" not in out:
            out["v"] = out["k"] if self.v_proj is None else self.v_proj(x)
        return Projections(out, joint)

    def convolve(self, pre: Projections, cache: LayerCache | StaticLayerCache | None,
                 cu_seqlens: torch.Tensor | None, caches: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """The streams with each ShortConv applied to its own (a new dict), and the new conv caches (``caches``
        False: none where the ShortConvs run jointly, for a caller that keeps no cache: training)."""
        joint = self.joint_conv_streams(pre, cache)
        if joint:
            return self.convolve_jointly(pre, joint, cu_seqlens, caches)
        out, new_conv = dict(pre.streams), {}
        for name, conv in self.convs.items():
            out[name], new_conv[name] = run_conv(conv, name, pre.streams[name], cache, cu_seqlens)
        return out, new_conv

    def joint_conv_streams(self, pre: Projections, cache: object) -> list[str]:
        """The names of the joint projection's streams when its ShortConvs run as one op over it
        (shortconv_joint.py), else []: every ShortConv reads a leading stream of the joint projection, all with the
        same kernel size, activation and bias or none, each on the Triton backend, over whole sequences (no cache;
        packed sequences included)."""
        if pre.joint is None or cache is not None or len(self.convs) == 0:
            return []
        names = list(self.x_projections())
        n = len(self.convs)
        if len(names) < n or any(name not in self.convs for name in names[:n]):
            return []
        first = self.convs[names[0]]
        for name in names[:n]:
            conv = self.convs[name]
            if (conv.kernel_size != first.kernel_size or conv.activation != first.activation
                    or (conv.bias is None) != (first.bias is None)
                    or conv._resolved_backend(pre.streams[name]) != "triton"):
                return []
        return names

    def convolve_jointly(self, pre: Projections, names: list[str], cu_seqlens: torch.Tensor | None = None,
                         caches: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """:meth:`convolve` as one op over the joint projection (its streams ``names``, the convolved ones first):
        the convolved streams and the other streams of the joint projection as new tensors, whose gradients the
        op's backward writes into the joint projection's gradient in place (shortconv_joint.py). ``cu_seqlens``:
        packed sequences, each convolved alone (the kernels read each token's position inside its sequence);
        ``caches`` False: no new conv caches (an empty dict)."""
        from .shortconv_joint import conv_streams

        convs = [self.convs[name] for name in names[:len(self.convs)]]
        widths = [pre.streams[name].shape[-1] for name in names]
        weights = [c.weight for c in convs]  # joined inside the op (no autograd nodes for the slicing)
        bias = None if convs[0].bias is None else torch.cat([c.bias for c in convs])
        W, conv_names = convs[0].kernel_size, names[:len(convs)]
        new_caches = {}
        if cu_seqlens is None:
            pos = None
            if caches:
                new_caches = {name: last_inputs(pre.streams[name], None, W) for name in conv_names}
        else:
            offsets = check_cu_seqlens(cu_seqlens, pre.joint.shape[1], pre.joint.device)
            pos = sequence_positions(offsets, pre.joint.device, cu_seqlens)
            if caches:
                new_caches = {name: packed_last_inputs(pre.streams[name], offsets, cu_seqlens, W)
                              for name in conv_names}
        streams = conv_streams(pre.joint, weights, bias, widths[:len(convs)], widths[len(convs):],
                               convs[0].activation == "silu", pos)
        out = dict(pre.streams)
        out.update(zip(names, streams))
        return out, new_caches

    def op_inputs(self, x: torch.Tensor, s: dict[str, torch.Tensor], offset: int | torch.Tensor,
                  cu_seqlens: torch.Tensor | None) -> MixOut:
        """The streams after their ShortConvs -> what the op takes: (q, k, v, args, kwargs), as :meth:`forward`
        passes them (q and k in v's dtype)."""
        q, k, v, args, kwargs = self.mix_inputs(x, *self.head_views(x, s), offset, s)
        if cu_seqlens is not None:  # the op runs each packed sequence alone (step calls never see it)
            kwargs = {**kwargs, "cu_seqlens": cu_seqlens}
        return *self.op_dtypes(q, k, v), args, kwargs

    def head_views(self, x: torch.Tensor, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """q, k, v streams [B, T, H*D] viewed per head, [B, T, H, D]."""
        B, T, _ = x.shape
        return (s["q"].view(B, T, -1, self.head_dim), s["k"].view(B, T, -1, self.head_dim),
                s["v"].view(B, T, -1, self.head_dim_v))

    def op_dtypes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as the op takes them after the feature maps: v = k where keys are values (``exact_kv``), and q
        and k in v's dtype (bf16 under autocast: feature maps or norms that came out in float32 would otherwise put
        the kernels on their exact-float32, slow, path)."""
        v = k if self.exact_kv else v
        return q.to(v.dtype), k.to(v.dtype), v

    def rebuilt_qkv(self, x: torch.Tensor, s: dict[str, torch.Tensor], offset: int | torch.Tensor,
                    cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """q, k, v of :meth:`op_inputs`, for the backward pass's rebuild (:class:`ConvOutputs`), which keeps
        nothing else: where ``qk_feature_map`` says what q and k go through, the token arguments (a gate's
        kernel, a projection's matmul) are not computed again only to be dropped."""
        feature_map = declared_qk_feature_map(type(self))
        if feature_map is None:
            return self.op_inputs(x, s, offset, cu_seqlens)[:3]
        q, k, v = self.head_views(x, s)
        if feature_map == "l2":
            q, k = l2norm_pair(q, k)
        return self.op_dtypes(q, k, v)

    def recomputes_conv_outputs(self, cache: object) -> bool:
        """Whether this call keeps the ShortConvs' outputs and what is made of them (q, k, v: conv outputs after
        the feature maps and norms) out of the backward pass's saved tensors (:class:`ConvOutputs`): in training
        (gradients wanted, no cache, eager), for layers with ShortConvs and the base class's streams. Compiling is
        asked first: Dynamo in torch 2.11 breaks the graph on ``bool(ModuleDict)``, once per layer."""
        if torch.compiler.is_compiling() or cache is not None or len(self.convs) == 0:
            return False
        return (torch.is_grad_enabled() and type(self).streams is MixerLayer.streams
                and any(p.requires_grad for p in self.parameters()))

    def forward(self, x: torch.Tensor, cache: LayerCache | StaticLayerCache | None = None, *, use_cache: bool = True,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerCache | StaticLayerCache | None]:
        """x [B, T, d_model] -> (y [B, T, d_model], the new cache or None); ``cu_seqlens``: x [1, T, d_model]
        packs sequences at these offsets (module docstring), no cache in or out."""
        if isinstance(cache, StaticLayerCache) and cu_seqlens is None:
            return self.static_step(x, cache), cache
        check_layer_input(x, self.d_model, None if isinstance(cache, StaticLayerCache) else cache)
        B, T, _ = x.shape
        if cu_seqlens is not None:
            offset = packed_positions(x, cache, cu_seqlens)
            use_cache = False
        else:
            offset = 0 if cache is None else cache.offset
        state0 = None if cache is None else cache.state
        if self.recomputes_conv_outputs(cache):
            pre = self.projected_streams(x)
            s, new_conv = self.convolve(pre, None, cu_seqlens, caches=use_cache)
            saved = ConvOutputs(self, x, pre, offset, cu_seqlens)
            saved.add(s[name] for name in self.convs)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                q, k, v, args, kwargs = self.op_inputs(x, s, offset, cu_seqlens)
                saved.add((q, k, v))
                o, state = unchecked(self.run_op, q, k, v, args, kwargs, state0, use_cache)
                o = self.skip(o, v)
            saved.seal()
            del s, q, k
        else:
            s, new_conv = self.streams(x, cache, cu_seqlens)
            q, k, v, args, kwargs = self.op_inputs(x, s, offset, cu_seqlens)
            # the layer makes its gates and strengths in range by construction: no host-syncing range checks
            o, state = unchecked(self.run_op, q, k, v, args, kwargs, state0, use_cache)
            o = self.skip(o, v)
        y = self.finish(o, x)
        return y, (LayerCache(new_conv, state, offset + T) if use_cache else None)

    def run_op(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: TokenArgs, kwargs: dict[str, Any],
               state: Any, use_cache: bool) -> tuple[torch.Tensor, Any]:
        """The op over the whole input, or its step function for one token continuing a state."""
        if state is not None and q.shape[1] == 1:
            return self.step(q, k, v, args, kwargs, state)
        return self.op(q, k, v, **args, scale=self.scale, initial_state=state, output_final_state=use_cache,
                       **kwargs, **self.op_kwargs())

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: TokenArgs, kwargs: dict[str, Any],
             state: Any) -> tuple[torch.Tensor, Any]:
        """One token (T == 1) through the op's step function; returns (o [B, 1, H, V], state)."""
        step_args = {name: None if a is None else a[:, 0] for name, a in args.items()}
        o, state = self.op_step(q[:, 0], k[:, 0], v[:, 0], **step_args, state=state, scale=self.scale, **kwargs)
        return o[:, None], state

    # --- static decoding ------------------------------------------------------------------------
    def conv_modules(self) -> dict[str, ShortConv]:
        """The ShortConvs with a decoding cache, by stream name (subclasses with their own add them)."""
        return dict(self.convs.items())

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device) -> Any:
        """Zero state buffers of the op's state shape (default [B, H, K, V]) in ``dtype`` (see static_cache.py)."""
        return torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim_v, dtype=dtype, device=device)

    def allocate_static_cache(self, batch_size: int, max_length: int, *, dtype: torch.dtype, device: torch.device,
                              pos: torch.Tensor) -> StaticLayerCache:
        """Zeroed buffers for ``batch_size`` rows of up to ``max_length`` tokens: ShortConv caches in the
        activation ``dtype``, the state in float32 (float64 for float64); ``pos`` [B] is the model's shared
        position tensor."""
        conv = {name: torch.zeros(batch_size, c.kernel_size - 1, c.dim, dtype=dtype, device=device)
                for name, c in self.conv_modules().items()}
        state = self.static_state(batch_size, max_length, state_dtype(dtype), device)
        return StaticLayerCache(conv, state, pos)

    def load_static_cache(self, static: StaticLayerCache, cache: LayerCache, rows: torch.Tensor) -> None:
        """Copy ``cache`` (of len(rows) sequences, e.g. a prefill's) into rows ``rows`` of the static buffers."""
        check_conv_cache(cache, static.conv)
        for name, buf in static.conv.items():
            buf.index_copy_(0, rows, cache.conv[name].to(buf.dtype))
        self.load_static_state(static.state, cache.state, rows)

    def load_static_state(self, buffers: Any, state: Any, rows: torch.Tensor) -> None:
        """buffers[rows] = state (the op's state as the cached path returns it)."""
        copy_rows_(buffers, state, rows)

    def static_step(self, x: torch.Tensor, cache: StaticLayerCache) -> torch.Tensor:
        """One token x [B, 1, d_model] continuing the static buffers, which are overwritten in place; returns
        y [B, 1, d_model]. No host synchronisation, no shape that changes between steps."""
        check_static_step_input(x, self.d_model, cache)
        s, _ = self.streams(x, cache)  # the ShortConv caches are shifted in place
        q, k, v, args, kwargs = self.mix_inputs(x, *self.head_views(x, s), cache.pos, s)
        q, k, v = self.op_dtypes(q, k, v)
        o = unchecked(self.static_op_step, q, k, v, args, kwargs, cache)
        return self.finish(self.skip(o, v), x)

    def static_op_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: TokenArgs,
                       kwargs: dict[str, Any], cache: StaticLayerCache) -> torch.Tensor:
        """The op's step on the state buffers; returns o [B, 1, H, V]. Ops whose step can write its new state
        into the state it reads (``step_inplace``: the fused Triton kernels) do so; otherwise the new state is
        copied into the buffers."""
        if self.step_inplace:
            o, _ = self.step(q, k, v, args, {**kwargs, "inplace": True}, cache.state)
            return o
        o, state = self.step(q, k, v, args, kwargs, cache.state)
        copy_state_(cache.state, state)
        return o

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output norm per head, SiLU gate, output projection: o [B, T, H, V] -> [B, T, d_model]; with
        ``recompute_output_gate`` under a checkpoint, which keeps o and x: the norm's backward keeps o either way,
        and the input projections' backward keeps x."""
        o = o.to(x.dtype)
        if self.recompute_output_gate and self.g_proj is not None and torch.is_grad_enabled():
            return checkpoint(self._gated_output, o, x, use_reentrant=False)
        return self._gated_output(o, x)

    def _gated_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T = o.shape[:2]
        gate = None if self.g_proj is None else self.g_proj(x)
        if self.o_norm is not None:  # one fused kernel on CUDA; the norm's output is not kept (norms.py)
            return norm_gate_project(o, self.o_norm, None if gate is None else gate.view(o.shape), self.o_proj,
                                     (B, T, o.shape[2] * o.shape[3]))
        else:
            o = o.reshape(B, T, -1)
            if gate is not None:
                o = o * torch.nn.functional.silu(gate)
        return self.o_proj(o)


# Called with every tensor that ConvOutputs' hooks are given to save: saved-tensor hooks of an outer context do not
# see those (the innermost hooks take them), so tools that audit what a forward saves (bench/saved_tensors.py)
# register a function here as well.
SAVED_TENSOR_OBSERVERS: list[Callable[[torch.Tensor], object]] = []


class ConvOutputs:
    """Saved-tensor hooks that keep a layer's ShortConv outputs, and q, k, v made of them, out of the backward
    pass's saved tensors, recomputing them when the backward pass reads them.

    Kept as autograd would keep them, a layer with ShortConvs holds both each conv's input (the projection, which
    the conv's backward reads) and what the op and the feature maps save of its output (q, k, v, and e.g. Mamba2's
    k beside k dt): two copies of every stream, where a Transformer layer holds one. Here the second copy is
    rebuilt from the first in the backward pass: the ShortConvs and :meth:`MixerLayer.rebuilt_qkv` (the feature
    maps and norms of q, k, v; the token arguments too where the layer does not declare its feature maps) run again
    once per layer, under the forward's autocast state. They are
    elementwise and per-channel kernels, cheap beside the op's backward; the values are the forward's, bit for bit
    (the same kernels on the same inputs). The backends' choices depend on the grad mode (ShortConv's "auto" takes
    conv1d for small CUDA inputs that need gradients, the joint Triton conv otherwise), and another choice lays the
    same values out in other storage, where the saved views would read the wrong elements: where the forward
    convolved jointly (which gradients do not change: every conv on Triton) the recomputation runs without
    gradients (no autograd nodes to build and drop), otherwise with them as the forward did, and the results are
    detached. The settings that choose backends (``shortconv_backend``, ``fused_backend``) are the forward's, also
    when the backward pass runs after the forward's ``linattn.settings`` block. Each recomputed tensor's layout is
    checked against the forward's before any view is taken of it.

    ``pack`` wraps every tensor saved while the hooks are on; ``seal`` (after the op) drops the wrapped tensor of
    each one that is a conv output or q, k, v (same storage), keeping where it lies in that tensor; ``unpack``
    gives either the tensor or the recomputed one's same view."""

    def __init__(self, layer: MixerLayer, x: torch.Tensor, pre: Projections, offset: Any,
                 cu_seqlens: torch.Tensor | None) -> None:
        self.layer, self.x, self.pre, self.offset, self.cu_seqlens = layer, x, pre, offset, cu_seqlens
        dev = x.device.type
        self.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self.settings = switches.current()  # the backends the forward chose by
        self.targets: dict[int, int] = {}  # storage address -> index in the recomputed list
        self.layouts: list[tuple] = []  # the forward's layout of each added tensor, in order
        self.held: list[list] = []
        self.cache: list[torch.Tensor] | None = None
        self.n = 0

    def add(self, tensors) -> None:
        for t in tensors:
            self.targets.setdefault(t.untyped_storage().data_ptr(), self.n)
            self.layouts.append(storage_layout(t))
            self.n += 1

    def pack(self, t: torch.Tensor) -> list:
        for observe in SAVED_TENSOR_OBSERVERS:
            observe(t)
        box = [t, None]
        self.held.append(box)
        return box

    def seal(self) -> None:
        for box in self.held:
            t = box[0]
            i = self.targets.get(t.untyped_storage().data_ptr())
            if i is not None:
                box[0], box[1] = None, (i, t.shape, t.stride(), t.storage_offset())
        self.held = []
        self.targets = {}

    def unpack(self, box: list) -> torch.Tensor:
        if box[0] is not None:
            return box[0]
        i, shape, stride, offset = box[1]
        if self.cache is None:
            self.cache = self.recompute()
        return self.cache[i].as_strided(shape, stride, offset)

    def recompute(self) -> list[torch.Tensor]:
        with self.forward_settings():
            return self.rebuild()

    def forward_settings(self) -> contextlib.AbstractContextManager:
        """A context with the backend settings the forward ran under, where they have changed since (a backward
        pass run after the ``linattn.settings`` block of its forward): the rebuild must make the forward's
        choices."""
        now, then = switches.current(), self.settings
        if now is then or (now.shortconv_backend, now.fused_backend) == (then.shortconv_backend, then.fused_backend):
            return contextlib.nullcontext()
        return switches.settings(shortconv_backend=then.shortconv_backend, fused_backend=then.fused_backend)

    def rebuild(self) -> list[torch.Tensor]:
        layer = self.layer
        dev, enabled, dtype = self.autocast
        with torch.enable_grad():  # the forward's choice, made under its grad mode
            joint = layer.joint_conv_streams(self.pre, None)
        with torch.set_grad_enabled(not joint), torch.autocast(dev, dtype=dtype, enabled=enabled):
            if joint:
                s, _ = layer.convolve_jointly(self.pre, joint, self.cu_seqlens, caches=False)
            else:
                s, _ = layer.convolve(self.pre, None, self.cu_seqlens, caches=False)
            q, k, v = layer.rebuilt_qkv(self.x, s, self.offset, self.cu_seqlens)
        tensors = [t.detach() for t in (*(s[name] for name in layer.convs), q, k, v)]
        for i, (t, layout) in enumerate(zip(tensors, self.layouts)):
            if storage_layout(t) != layout:
                raise RuntimeError(
                    f"{type(layer).__name__}: recomputed tensor {i} of the backward pass has layout {storage_layout(t)}"
                    f" (shape, stride, storage offset, storage bytes), the forward's had {layout}; its saved views "
                    "would read the wrong elements")
        return tensors


@functools.cache
def declared_qk_feature_map(cls: type) -> str | None:
    """``qk_feature_map`` as the class defining ``cls``'s mix_inputs declares it in its own body, else None."""
    for klass in cls.__mro__:
        if "mix_inputs" in vars(klass):
            return vars(klass).get("qk_feature_map")
    return None


def storage_layout(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements lie in its storage: (shape, stride, storage offset, storage bytes, dtype)."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype


def unchecked(fn: Callable, *args: Any) -> Any:
    """fn(*args) with value checks off. Under torch.compile, where they never run, the context manager is not
    entered at all: Dynamo in torch 2.11 breaks the graph on it."""
    if torch.compiler.is_compiling():
        return fn(*args)
    with value_checks(False):
        return fn(*args)


def project_jointly(x: torch.Tensor, linears: dict[str, nn.Linear]
                    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(y, {name: linear(x)}) for bias-free Linears over x's last dim, computed as one matmul y with their weights
    concatenated; the results are slices of y along the last dim (unit stride within a row). With fewer than two
    Linears, no joint matmul: y is None."""
    if len(linears) <= 1:
        return None, {name: m(x) for name, m in linears.items()}
    weight = torch.cat([m.weight for m in linears.values()])
    y = torch.nn.functional.linear(x, weight)
    return y, dict(zip(linears, y.split([m.out_features for m in linears.values()], dim=-1)))


def run_conv(conv: ShortConv, name: str, x: torch.Tensor, cache: LayerCache | StaticLayerCache | None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ShortConv ``conv`` of stream ``name`` over x: (y, its new cache). With a static cache the cache buffer is
    shifted in place (and returned); with ``cu_seqlens`` (no cache) each packed sequence is convolved alone."""
    if isinstance(cache, StaticLayerCache):
        return conv.static_step(x, cache.conv[name]), cache.conv[name]
    return conv(x, None if cache is None else cache.conv.get(name), cu_seqlens)


def packed_positions(x: torch.Tensor, cache: object, cu_seqlens: object) -> torch.Tensor:
    """Check a packed layer call (x [1, T, d_model], no cache, valid offsets) and return every token's position
    in its own sequence, [1, T]."""
    if cache is not None:
        raise ValueError("cache must be None with cu_seqlens: a packed call starts every sequence from zero "
                         f"states, got {type(cache).__name__}")
    check_packed_batch("x", x)
    return sequence_positions(check_cu_seqlens(cu_seqlens, x.shape[1], x.device), x.device, cu_seqlens)
