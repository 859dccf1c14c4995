"""Parameter names and shapes of FLA's DeltaNet, Gated DeltaNet, GLA and Mamba2 models against linattn's CausalLM.

Both ways are exact copies (and, for Mamba2, splits and joins): FLA's ShortConvolution and linattn's ShortConv
both store a depthwise kernel [D, 1, W] applied as a causal cross-correlation (tap W-1 reads the current token),
FLA's RMSNorm / FusedRMSNormGated weights per head channel are linattn's o_norm weights, and FLA's
GatedMLP(gate_proj, up_proj, down_proj) is linattn's SwiGLU(gate, up, down).

Mamba2 stores z, x, B, C and dt in one ``in_proj`` and x, B, C in one ``conv1d``; linattn has one projection and
one ShortConv per stream (g_proj = z, v = x, k = B, q = C, decay.a_proj = dt) and one B, C per head, so each
group's B and C rows (and conv channels) are repeated for its heads; writing back takes one head per group and
checks that the heads of a group agree.
"""

from __future__ import annotations

from typing import Any

import torch

from linattn.models.config import ModelConfig

Tensor = torch.Tensor

# linattn mixer name <- FLA layer name, per family (names under the layer's attention module)
_MIXER_NAMES = {
    "delta_net": {"q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
                  "b_proj.weight": "b_proj.weight", "convs.q.weight": "q_conv1d.weight",
                  "convs.k.weight": "k_conv1d.weight", "convs.v.weight": "v_conv1d.weight",
                  "g_proj.weight": "g_proj.weight", "o_norm.weight": "o_norm.weight", "o_proj.weight": "o_proj.weight"},
    "gla": {"q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
            "convs.q.weight": "q_conv1d.weight", "convs.k.weight": "k_conv1d.weight",
            "convs.v.weight": "v_conv1d.weight", "g_proj.weight": "g_proj.weight",
            "gate.down.weight": "gk_proj.0.weight", "gate.up.weight": "gk_proj.1.weight",
            "gate.up.bias": "gk_proj.1.bias", "o_norm.weight": "g_norm_swish_gate.weight",
            "o_proj.weight": "o_proj.weight"},
}
_MIXER_NAMES["gated_deltanet"] = {**_MIXER_NAMES["delta_net"], "decay.a_proj.weight": "a_proj.weight",
                                  "decay.A_log": "A_log", "decay.dt_bias": "dt_bias"}
# GLA's output norm is "g_norm" when FLA does not fuse it with the gate (fuse_norm=False, no output gate)
_GLA_UNFUSED_NORM = "g_norm.weight"
_MLP_NAMES = {"mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
              "mlp.down.weight": "mlp.down_proj.weight", "norm1.weight": "attn_norm.weight",
              "norm2.weight": "mlp_norm.weight"}


def _take(state: dict[str, Tensor], key: str, used: set[str]) -> Tensor:
    if key not in state:
        raise KeyError(f"the FLA checkpoint has no parameter {key!r}")
    used.add(key)
    return state[key]


def linattn_state_from_fla(fla_state: dict[str, Tensor], cfg: dict[str, Any], config: ModelConfig,
                           expected: dict[str, Tensor]) -> dict[str, Tensor]:
    """linattn CausalLM state dict from an FLA model's ``fla_state`` (FLA config ``cfg`` with defaults filled in).
    ``expected``: the target model's own state dict (for names and shapes). Every FLA tensor must be used."""
    family, used = cfg["model_type"], set()
    out: dict[str, Tensor] = {}
    root = "backbone" if family == "mamba2" else "model"
    out["embed.weight"] = _take(fla_state, f"{root}.embeddings.weight", used)
    out["norm.weight"] = _take(fla_state, f"{root}.{'norm_f' if family == 'mamba2' else 'norm'}.weight", used)
    if not config.tie_embeddings:
        out["lm_head.weight"] = _take(fla_state, "lm_head.weight", used)
    elif "lm_head.weight" in fla_state:
        used.add("lm_head.weight")  # a tied head saved anyway: the same tensor as the embedding
    for i in range(config.n_layers):
        src, dst = f"{root}.layers.{i}.", f"blocks.{i}."
        if family == "mamba2":
            out[dst + "norm1.weight"] = _take(fla_state, src + "norm.weight", used)
            mixer = _mamba2_from_fla(fla_state, src + "mixer.", config, int(cfg["n_groups"]), used)
            out.update({dst + "mixer." + k: v for k, v in mixer.items()})
            continue
        for ours, theirs in _MLP_NAMES.items():
            out[dst + ours] = _take(fla_state, src + theirs, used)
        for ours, theirs in _MIXER_NAMES[family].items():
            key = src + "attn." + theirs
            if dst + "mixer." + ours not in expected:
                continue  # a stream this configuration does not have (no conv, no output gate)
            if family == "gla" and ours == "o_norm.weight" and key not in fla_state:
                key = src + "attn." + _GLA_UNFUSED_NORM
                if key not in fla_state and cfg["elementwise_affine"] is False:  # a norm without a weight
                    out[dst + "mixer." + ours] = torch.ones_like(expected[dst + "mixer." + ours])
                    continue
            out[dst + "mixer." + ours] = _take(fla_state, key, used)
    unused = sorted(set(fla_state) - used)
    if unused:
        raise ValueError(f"the FLA checkpoint has parameters this conversion does not map (unsupported options?): "
                         f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")
    _check_shapes(out, expected)
    return out


def _check_shapes(state: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"the converted state lacks {', '.join(missing[:8])}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"parameter {k}: the FLA checkpoint gives shape {list(v.shape)}, the model described "
                             f"by its config.json expects {list(expected[k].shape)}")


def _mamba2_dims(config: ModelConfig) -> tuple[int, int, int, int]:
    kw = config.mixer_kwargs
    H, N, P = config.n_heads, kw["head_dim"], kw["head_dim_v"]
    return H, N, P, H * P


def _mamba2_from_fla(state: dict[str, Tensor], src: str, config: ModelConfig, G: int, used: set[str]
                     ) -> dict[str, Tensor]:
    H, N, P, inner = _mamba2_dims(config)
    in_proj = _take(state, src + "in_proj.weight", used)
    if in_proj.shape[0] != 2 * inner + 2 * G * N + H:
        raise ValueError(f"{src}in_proj.weight has {in_proj.shape[0]} rows; FLA's Mamba2 layout has "
                         f"z, x, B, C, dt = {2 * inner + 2 * G * N + H}")
    z, x, B, C, dt = in_proj.split([inner, inner, G * N, G * N, H])
    conv = _take(state, src + "conv1d.weight", used)
    cx, cB, cC = conv.split([inner, G * N, G * N])

    def per_head(t: Tensor) -> Tensor:  # [G*N, ...] -> [H*N, ...]: group g's rows for each of its H/G heads
        return t.unflatten(0, (G, N)).repeat_interleave(H // G, dim=0).flatten(0, 1)

    out = {"g_proj.weight": z, "v_proj.weight": x, "k_proj.weight": per_head(B), "q_proj.weight": per_head(C),
           "decay.a_proj.weight": dt, "convs.v.weight": cx, "convs.k.weight": per_head(cB),
           "convs.q.weight": per_head(cC), "decay.A_log": _take(state, src + "A_log", used),
           "decay.dt_bias": _take(state, src + "dt_bias", used), "D": _take(state, src + "D", used),
           "o_proj.weight": _take(state, src + "out_proj.weight", used)}
    if config.mixer_kwargs.get("conv_bias"):
        bx, bB, bC = _take(state, src + "conv1d.bias", used).split([inner, G * N, G * N])
        out.update({"convs.v.bias": bx, "convs.k.bias": per_head(bB), "convs.q.bias": per_head(bC)})
    if config.mixer_kwargs.get("output_norm", True) is not False:
        out["o_norm.weight"] = _take(state, src + "norm.weight", used)
    return {k: v.contiguous() for k, v in out.items()}


def fla_state_from_linattn(state: dict[str, Tensor], fla_cfg: dict[str, Any], config: ModelConfig
                           ) -> dict[str, Tensor]:
    """An FLA model's state dict from a linattn CausalLM ``state`` (the inverse of :func:`linattn_state_from_fla`)."""
    family = fla_cfg["model_type"]
    root = "backbone" if family == "mamba2" else "model"
    out = {f"{root}.embeddings.weight": state["embed.weight"],
           f"{root}.{'norm_f' if family == 'mamba2' else 'norm'}.weight": state["norm.weight"]}
    out["lm_head.weight"] = state["embed.weight"] if config.tie_embeddings else state["lm_head.weight"]
    for i in range(config.n_layers):
        src, dst = f"blocks.{i}.", f"{root}.layers.{i}."
        if family == "mamba2":
            out[dst + "norm.weight"] = state[src + "norm1.weight"]
            mixer = {k[len(src + "mixer."):]: v for k, v in state.items() if k.startswith(src + "mixer.")}
            out.update({dst + "mixer." + k: v for k, v in _mamba2_to_fla(mixer, config, fla_cfg["n_groups"]).items()})
            continue
        for ours, theirs in _MLP_NAMES.items():
            out[dst + theirs] = state[src + ours]
        for ours, theirs in _MIXER_NAMES[family].items():
            if src + "mixer." + ours in state:
                if family == "gla" and ours == "o_norm.weight" and src + "mixer.g_proj.weight" not in state:
                    theirs = _GLA_UNFUSED_NORM  # FLA fuses the norm with the gate only when there is a gate
                out[dst + "attn." + theirs] = state[src + "mixer." + ours]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _mamba2_to_fla(m: dict[str, Tensor], config: ModelConfig, G: int) -> dict[str, Tensor]:
    H, N, P, inner = _mamba2_dims(config)

    def per_group(t: Tensor, name: str) -> Tensor:  # [H*N, ...] -> [G*N, ...], the heads of a group must agree
        heads = t.unflatten(0, (G, H // G, N))
        if not torch.equal(heads, heads[:, :1].expand_as(heads)):
            raise ValueError(f"{name}: the heads of each of the {G} groups have different B/C parameters; FLA's "
                             "Mamba2 shares them within a group (n_groups)")
        return heads[:, 0].flatten(0, 1)

    out = {"in_proj.weight": torch.cat([m["g_proj.weight"], m["v_proj.weight"], per_group(m["k_proj.weight"], "k_proj"),
                                        per_group(m["q_proj.weight"], "q_proj"), m["decay.a_proj.weight"]]),
           "conv1d.weight": torch.cat([m["convs.v.weight"], per_group(m["convs.k.weight"], "convs.k"),
                                       per_group(m["convs.q.weight"], "convs.q")]),
           "A_log": m["decay.A_log"], "dt_bias": m["decay.dt_bias"], "D": m["D"], "out_proj.weight": m["o_proj.weight"]}
    if "convs.v.bias" in m:
        out["conv1d.bias"] = torch.cat([m["convs.v.bias"], per_group(m["convs.k.bias"], "convs.k.bias"),
                                        per_group(m["convs.q.bias"], "convs.q.bias")])
    if "o_norm.weight" in m:
        out["norm.weight"] = m["o_norm.weight"]
    return out
