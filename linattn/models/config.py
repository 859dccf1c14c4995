"""ModelConfig: everything needed to build a model, checked strictly when built, with a YAML round trip."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from linattn.config_files import parse_yaml, read_yaml
from linattn.errors import ConfigError, bad_value, located
from linattn.layers.registry import build_mixer, mixer_class, mixer_kwarg_names
from linattn.validation import check_bool, check_float, check_int


@dataclass
class ModelConfig:
    """Model hyper-parameters.

    mixer: a name from ``list_mixers()``; d_model, n_layers, n_heads, vocab_size; mlp: a SwiGLU MLP
    after each mixer (False: mixer-only blocks); mlp_hidden: its width (None: 8/3 d_model rounded up
    to a multiple of 8); mixer_kwargs: passed to the layer (e.g. short_conv, conv_mode, tie_kv,
    head_dim, backend); tie_embeddings: the LM head reuses the embedding; norm_eps: RMSNorm epsilon.
    """

    mixer: str = "gated_delta_rule"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 256
    mlp: bool = True
    mlp_hidden: int | None = None
    mixer_kwargs: dict[str, Any] = field(default_factory=dict)
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        try:
            mixer_class(self.mixer)
        except ValueError as exc:  # the registry's message lists the valid names
            raise ConfigError(str(exc), field="mixer") from None
        for name in ("d_model", "n_layers", "n_heads", "vocab_size"):
            check_int(name, getattr(self, name), 1)
        check_bool("mlp", self.mlp)
        if self.mlp_hidden is not None:
            check_int("mlp_hidden", self.mlp_hidden, 1)
        check_bool("tie_embeddings", self.tie_embeddings)
        self.norm_eps = check_float("norm_eps", self.norm_eps, 0, low_open=True)
        if not isinstance(self.mixer_kwargs, dict):
            raise bad_value("mixer_kwargs", self.mixer_kwargs, "a mapping of the mixer's keyword arguments")
        self.mixer_kwargs = dict(self.mixer_kwargs)
        valid = mixer_kwarg_names(mixer_class(self.mixer))
        bad = sorted(set(self.mixer_kwargs) - set(valid))
        if bad:
            raise ConfigError(f"mixer_kwargs of mixer {self.mixer!r} has unknown key(s) {', '.join(bad)}; "
                              f"valid: {', '.join(valid)}", field="mixer_kwargs")
        if "head_dim" not in self.mixer_kwargs and self.d_model % self.n_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            raise ConfigError(f"n_heads={self.n_heads} must divide d_model={self.d_model} "
                              f"(valid n_heads: {divisors}), or set mixer_kwargs['head_dim']", field="n_heads")

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_hidden or -(-(8 * self.d_model // 3) // 8) * 8

    def build_mixer(self):
        """One mixer layer of this config (unknown mixer_kwargs raise ValueError listing valid ones)."""
        return build_mixer(self.mixer, self.d_model, self.n_heads, **self.mixer_kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a ModelConfig must be read from a mapping, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        bad = sorted(set(data) - set(valid))
        if bad:
            raise ConfigError(f"unknown ModelConfig field(s) {', '.join(bad)}; valid: {', '.join(valid)}")
        return cls(**data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The config as YAML text; also written to ``path`` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, source: str | Path) -> ModelConfig:
        """Read a config from a ``.yaml``/``.yml`` file path or from YAML text."""
        is_file = isinstance(source, Path) or str(source).endswith((".yaml", ".yml")) or (
            "\n" not in str(source) and Path(str(source)).is_file())
        if not is_file:
            return cls.from_dict(parse_yaml(source))
        with located(source=source):
            return cls.from_dict(read_yaml(source))
