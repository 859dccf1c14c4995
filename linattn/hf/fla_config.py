"""FLA model configs (config.json of DeltaNet, Gated DeltaNet, GLA, Mamba2) to linattn ModelConfigs and back.

transformers writes a config.json without the values equal to its class's defaults, so each family's defaults
(those of FLA 0.6.0's config classes) are filled in first. Options of FLA's layers that linattn has no exact
equivalent for are refused with an error naming the field, never approximated.
"""

from __future__ import annotations

import math
from typing import Any

from linattn.errors import ConfigError
from linattn.models.config import ModelConfig

# FLA 0.6.0's config defaults of the fields the conversion reads
_LM_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
                "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish", "attn": None,
                "attnres_block_size": None, "tie_word_embeddings": False, "vocab_size": 32000}
FLA_DEFAULTS: dict[str, dict[str, Any]] = {
    "delta_net": {**_LM_DEFAULTS, "hidden_size": 2048, "expand_k": 1.0, "expand_v": 1.0, "use_gate": False,
                  "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "use_beta": True,
                  "num_heads": 16, "qk_norm": "l2", "qk_activation": "silu", "num_hidden_layers": 24,
                  "norm_eps": 1e-6},
    "gated_deltanet": {**_LM_DEFAULTS, "hidden_size": 2048, "expand_v": 2.0, "use_gate": True,
                       "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "head_dim": 256,
                       "num_heads": 6, "num_v_heads": None, "num_hidden_layers": 21, "norm_eps": 1e-6,
                       "output_gate_activation": "swish"},
    "gla": {**_LM_DEFAULTS, "hidden_size": 2048, "expand_k": 0.5, "expand_v": 1.0, "num_hidden_layers": 24,
            "num_heads": 4, "num_kv_heads": None, "feature_map": None, "use_short_conv": False, "conv_size": 4,
            "use_output_gate": True, "clamp_min": None, "elementwise_affine": True, "norm_eps": 1e-6},
    "mamba2": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
               "head_dim": 64, "vocab_size": 32000, "hidden_size": 2048, "state_size": 128, "num_hidden_layers": 48,
               "norm_eps": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 1, "use_bias": False,
               "use_conv_bias": True, "D_has_hdim": False, "hidden_act": "silu", "dt_limit": [0.0, math.inf],
               "rmsnorm": True, "norm_before_gate": False, "tie_word_embeddings": False},
}
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
FLA_MIXERS = {"delta_net": "delta_rule", "gated_deltanet": "gated_delta_rule", "gla": "gla", "mamba2": "mamba2"}
FLA_ARCHITECTURES = {"delta_net": "DeltaNetForCausalLM", "gated_deltanet": "GatedDeltaNetForCausalLM",
                     "gla": "GLAForCausalLM", "mamba2": "Mamba2ForCausalLM"}
# the low-rank gate of FLA's GLA layer, fixed there (not in its config)
GLA_GATE_RANK, GLA_GATE_NORMALISER = 16, 16


class UnsupportedFLAConfig(ConfigError):
    """An FLA config option with no exact linattn equivalent."""


def _need(cfg: dict[str, Any], field: str, allowed: tuple, why: str = "") -> None:
    if cfg[field] not in allowed:
        raise UnsupportedFLAConfig(f"FLA config field {field}={cfg[field]!r} is not supported (supported: "
                                   f"{', '.join(map(repr, allowed))}){': ' + why if why else ''}")


def _per_head(total: float, heads: int, field: str) -> int:
    width = total / heads
    if width != int(width) or width < 1:
        raise UnsupportedFLAConfig(f"{field}: {total} channels do not split into {heads} heads")
    return int(width)


def fla_mlp_hidden(cfg: dict[str, Any]) -> int:
    """The width of FLA's GatedMLP: intermediate_size, else 2/3 hidden_ratio hidden_size rounded up to 256."""
    if cfg["intermediate_size"] is not None:
        return int(cfg["intermediate_size"])
    ratio = 4 if cfg["hidden_ratio"] is None else cfg["hidden_ratio"]
    return 256 * -(-int(cfg["hidden_size"] * ratio * 2 / 3) // 256)


def _decode_floats(value: Any) -> Any:
    """transformers 5 writes infinities and NaN into config.json as {"__float__": "Infinity"} (JSON has none)."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_decode_floats(v) for v in value]
    return value


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a parsed FLA config.json) completed with its family's defaults; the family is model_type."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    family = config.get("model_type")
    if family not in FLA_DEFAULTS:
        raise UnsupportedFLAConfig(f"FLA model_type {family!r} is not supported; supported: "
                                   f"{', '.join(sorted(FLA_DEFAULTS))}")
    return {**FLA_DEFAULTS[family], **_decode_floats(config)}


def model_config_from_fla(config: dict[str, Any]) -> ModelConfig:
    """The linattn ModelConfig computing what the FLA model of ``config`` (a parsed config.json) computes."""
    cfg = with_defaults(config)
    if isinstance(cfg["tie_word_embeddings"], str):  # never; guards the bool() below against "false"
        raise UnsupportedFLAConfig(f"tie_word_embeddings must be a bool, got {cfg['tie_word_embeddings']!r}")
    family, d = cfg["model_type"], int(cfg["hidden_size"])
    common = dict(mixer=FLA_MIXERS[family], d_model=d, n_layers=int(cfg["num_hidden_layers"]),
                  vocab_size=int(cfg["vocab_size"]), norm_eps=float(cfg["norm_eps"]),
                  tie_embeddings=bool(cfg["tie_word_embeddings"]))
    if family == "mamba2":
        return ModelConfig(**common, **_mamba2(cfg, d))
    for field in ("attn", "attnres_block_size"):
        _need(cfg, field, (None,), "hybrid attention layers and attention residuals have no linattn equivalent")
    _need(cfg, "hidden_act", ("swish",), "linattn's MLP is SwiGLU")
    mixer = {"delta_net": _delta_net, "gated_deltanet": _gated_deltanet, "gla": _gla}[family](cfg, d)
    return ModelConfig(**common, n_heads=int(cfg["num_heads"]), mlp=True, mlp_hidden=fla_mlp_hidden(cfg),
                       mixer_kwargs={**mixer, "norm_eps": float(cfg["norm_eps"])})


def _short_conv(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    # without its ShortConvs, FLA's delta rules still apply SiLU to q, k, v: the "identity" conv mode is exactly that
    if cfg["use_short_conv"]:
        return {"short_conv": "qkv", "conv_kernel": int(cfg[key])}
    return {"short_conv": "qkv", "conv_mode": "identity"}


def _delta_net(cfg: dict[str, Any], d: int) -> dict[str, Any]:
    _need(cfg, "qk_activation", ("silu",))
    _need(cfg, "qk_norm", ("l2",))
    _need(cfg, "use_beta", (True,))
    H = int(cfg["num_heads"])
    return {"head_dim": _per_head(d * cfg["expand_k"], H, "expand_k"),
            "head_dim_v": _per_head(d * cfg["expand_v"], H, "expand_v"), **_short_conv(cfg, "conv_size"),
            "output_gate": bool(cfg["use_gate"]), "allow_neg_eigval": bool(cfg["allow_neg_eigval"])}


def _gated_deltanet(cfg: dict[str, Any], d: int) -> dict[str, Any]:
    if cfg["num_v_heads"] not in (None, cfg["num_heads"]):
        raise UnsupportedFLAConfig(f"FLA config field num_v_heads={cfg['num_v_heads']!r} is not supported: linattn's "
                                   f"Gated DeltaNet has as many value heads as heads (num_heads={cfg['num_heads']})")
    if cfg["use_gate"]:
        _need(cfg, "output_gate_activation", ("swish", "silu"))
    K = int(cfg["head_dim"])
    V = K * cfg["expand_v"]
    if V != int(V):
        raise UnsupportedFLAConfig(f"expand_v={cfg['expand_v']} times head_dim={K} is not an integer")
    return {"head_dim": K, "head_dim_v": int(V), **_short_conv(cfg, "conv_size"),
            "output_gate": bool(cfg["use_gate"]), "allow_neg_eigval": bool(cfg["allow_neg_eigval"])}


def _gla(cfg: dict[str, Any], d: int) -> dict[str, Any]:
    if cfg["num_kv_heads"] not in (None, cfg["num_heads"]):
        raise UnsupportedFLAConfig(f"FLA config field num_kv_heads={cfg['num_kv_heads']!r} is not supported: "
                                   "linattn's GLA has as many key/value heads as heads")
    _need(cfg, "feature_map", (None,))
    _need(cfg, "clamp_min", (None,))
    H = int(cfg["num_heads"])
    conv = {"short_conv": "qkv", "conv_kernel": int(cfg["conv_size"])} if cfg["use_short_conv"] else \
        {"short_conv": ""}
    return {"head_dim": _per_head(d * cfg["expand_k"], H, "expand_k"),
            "head_dim_v": _per_head(d * cfg["expand_v"], H, "expand_v"), **conv,
            "output_gate": bool(cfg["use_output_gate"]), "gate_rank": GLA_GATE_RANK,
            "gate_normaliser": float(GLA_GATE_NORMALISER)}


def _mamba2(cfg: dict[str, Any], d: int) -> dict[str, Any]:
    _need(cfg, "hidden_act", ("silu",))
    _need(cfg, "use_bias", (False,), "linattn's Mamba2 projections have no bias")
    _need(cfg, "D_has_hdim", (False,), "linattn's Mamba2 has one D per head")
    if list(cfg["dt_limit"]) != [0.0, math.inf]:
        raise UnsupportedFLAConfig(f"FLA config field dt_limit={cfg['dt_limit']!r} is not supported (only no limit)")
    inner = cfg["expand"] * d
    P = int(cfg["head_dim"])
    if inner != int(inner) or int(inner) % P:
        raise UnsupportedFLAConfig(f"expand * hidden_size = {inner} is not a multiple of head_dim={P}")
    H, G = int(inner) // P, int(cfg["n_groups"])
    if H % G:
        raise UnsupportedFLAConfig(f"n_groups={G} does not divide the {H} heads")
    mixer: dict[str, Any] = {"head_dim": int(cfg["state_size"]), "head_dim_v": P, "short_conv": "qkv",
                             "conv_kernel": int(cfg["conv_kernel"]), "conv_bias": bool(cfg["use_conv_bias"]),
                             "norm_eps": float(cfg["norm_eps"])}
    if cfg["rmsnorm"]:
        _need(cfg, "norm_before_gate", (False,), "linattn's Mamba2 group norm applies the gate first, as Mamba2 does")
        mixer["norm_groups"] = G
    else:
        mixer["output_norm"] = False
    return {"n_heads": H, "mlp": False, "mixer_kwargs": mixer}


def fla_config_from_model(config: ModelConfig, n_groups: int | None = None) -> dict[str, Any]:
    """The FLA config.json (as a dict) of a linattn model of ``config`` that FLA's layers can express exactly
    (the inverse of :func:`model_config_from_fla`); ``n_groups``: Mamba2's B/C groups (its norm groups)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    family = {v: k for k, v in FLA_MIXERS.items()}.get(config.mixer)
    if family is None:
        raise UnsupportedFLAConfig(f"mixer {config.mixer!r} has no FLA layout here; supported: "
                                   f"{', '.join(sorted(FLA_MIXERS.values()))}")
    kw = {"short_conv": None, "conv_mode": "learned", "conv_kernel": 4, "conv_bias": False, "head_dim": None,
          "head_dim_v": None, "output_gate": None, "allow_neg_eigval": False, "norm_eps": 1e-5,
          "conv_activation": "silu", "tie_kv": False, "output_norm": None, "norm_groups": None, **config.mixer_kwargs}
    d, H = config.d_model, config.n_heads
    K = kw["head_dim"] or d // H
    out: dict[str, Any] = {"model_type": family, "architectures": [FLA_ARCHITECTURES[family]], "hidden_size": d,
                           "num_hidden_layers": config.n_layers, "vocab_size": config.vocab_size,
                           "norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings}
    if kw["conv_activation"] != "silu" or kw["tie_kv"] or kw["output_norm"] is False and family != "mamba2":
        raise UnsupportedFLAConfig("FLA's layers need conv_activation='silu', tie_kv=False and the output norm")
    if family == "mamba2":
        return {**out, **_mamba2_out(config, kw, K, n_groups)}
    if not config.mlp:
        raise UnsupportedFLAConfig("FLA's DeltaNet, Gated DeltaNet and GLA blocks have an MLP: mlp must be True")
    if kw["norm_eps"] != config.norm_eps:
        raise UnsupportedFLAConfig(f"FLA uses one norm_eps for blocks and mixers; got {config.norm_eps} and "
                                   f"mixer_kwargs norm_eps={kw['norm_eps']}")
    V = kw["head_dim_v"] or K
    out.update(num_heads=H, intermediate_size=config.ffn_hidden, hidden_act="swish", fuse_norm=True,
               fuse_swiglu=True)
    conv = kw["short_conv"]
    if family in ("delta_net", "gated_deltanet"):
        conv = "qkv" if conv is None else conv
        if conv != "qkv" or kw["conv_mode"] not in ("learned", "identity"):
            raise UnsupportedFLAConfig("FLA's delta rules take short_conv='qkv' with conv_mode 'learned' or "
                                       "'identity' (use_short_conv=False)")
        out.update(use_short_conv=kw["conv_mode"] == "learned", conv_size=kw["conv_kernel"],
                   allow_neg_eigval=kw["allow_neg_eigval"])
    if family == "delta_net":
        out.update(expand_k=H * K / d, expand_v=H * V / d, use_gate=bool(kw["output_gate"]))
    elif family == "gated_deltanet":
        out.update(head_dim=K, expand_v=V / K, use_gate=kw["output_gate"] is not False)
    else:
        conv = "" if conv is None else conv
        if conv not in ("", "qkv") or kw["conv_mode"] != "learned":
            raise UnsupportedFLAConfig("FLA's GLA takes short_conv '' or 'qkv' (learned)")
        if kw.get("gate_rank", 16) != GLA_GATE_RANK or kw.get("gate_normaliser", 16.0) != GLA_GATE_NORMALISER:
            raise UnsupportedFLAConfig(f"FLA's GLA gate has rank {GLA_GATE_RANK} and normaliser "
                                       f"{GLA_GATE_NORMALISER}")
        out.update(expand_k=H * K / d, expand_v=H * V / d, use_short_conv=conv == "qkv", conv_size=kw["conv_kernel"],
                   use_output_gate=kw["output_gate"] is not False)
    if kw["conv_bias"]:
        raise UnsupportedFLAConfig("FLA's DeltaNet, Gated DeltaNet and GLA models have no ShortConv bias")
    return out


def _mamba2_out(config: ModelConfig, kw: dict[str, Any], K: int, n_groups: int | None) -> dict[str, Any]:
    H = config.n_heads
    P = kw["head_dim_v"] or K
    if config.mlp or kw["short_conv"] not in (None, "qkv") or kw["conv_mode"] != "learned":
        raise UnsupportedFLAConfig("FLA's Mamba2 has no MLP and a learned ShortConv on x, B, C: need mlp=False, "
                                   "short_conv='qkv', conv_mode='learned'")
    if kw["norm_groups"] is None and kw["output_norm"] is not False:
        raise UnsupportedFLAConfig("FLA's Mamba2 applies the gate before a group RMSNorm: the model needs "
                                   "mixer_kwargs norm_groups (or output_norm=False)")
    if kw["output_gate"] is False:
        raise UnsupportedFLAConfig("FLA's Mamba2 always has its output gate z")
    if H * P % config.d_model:
        raise UnsupportedFLAConfig(f"n_heads * head_dim_v = {H * P} must be a multiple of d_model={config.d_model} "
                                   "(FLA's expand is an integer)")
    if kw["norm_eps"] != config.norm_eps:
        raise UnsupportedFLAConfig(f"FLA's Mamba2 uses one norm_eps for blocks and mixers; got {config.norm_eps} and "
                                   f"mixer_kwargs norm_eps={kw['norm_eps']}")
    G = kw["norm_groups"] or n_groups or H
    return {"num_heads": H, "head_dim": P, "state_size": K, "expand": H * P // config.d_model, "n_groups": G,
            "conv_kernel": kw["conv_kernel"], "use_conv_bias": kw["conv_bias"], "rmsnorm": kw["output_norm"]
            is not False, "norm_before_gate": False, "norm_eps": kw["norm_eps"], "residual_in_fp32": True,
            "fuse_norm": True}
