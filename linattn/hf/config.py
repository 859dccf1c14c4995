"""LinAttnConfig: a transformers config holding a linattn ModelConfig (and the classifier's options)."""

from __future__ import annotations

from typing import Any

from linattn.models.config import ModelConfig

from .deps import require

PretrainedConfig = require("transformers").PretrainedConfig

# the ModelConfig fields stored in config.json under their own names (tie_embeddings is HF's tie_word_embeddings)
MODEL_FIELDS = ("mixer", "d_model", "n_layers", "n_heads", "vocab_size", "mlp", "mlp_hidden", "mixer_kwargs",
                "norm_eps")


class LinAttnConfig(PretrainedConfig):
    """A linattn model for transformers (``model_type = "linattn"``).

    The fields of :class:`~linattn.models.ModelConfig` (mixer, d_model, n_layers, n_heads, vocab_size, mlp,
    mlp_hidden, mixer_kwargs, norm_eps; tie_embeddings as transformers' ``tie_word_embeddings``), plus the
    sequence classifier's ``pooling`` ("mean", "last") and ``bidirectional`` (its number of classes is
    transformers' ``num_labels``). The model config is checked when the config is built, so a bad mixer or
    keyword fails here, naming the field.
    """

    model_type = "linattn"

    def __init__(self, mixer: str = "gated_delta_rule", d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 vocab_size: int = 256, mlp: bool = True, mlp_hidden: int | None = None,
                 mixer_kwargs: dict[str, Any] | None = None, norm_eps: float = 1e-5, tie_word_embeddings: bool = True,
                 pooling: str = "mean", bidirectional: bool = False, **kwargs: Any) -> None:
        self.mixer, self.d_model, self.n_layers, self.n_heads = mixer, d_model, n_layers, n_heads
        self.vocab_size, self.mlp, self.mlp_hidden, self.norm_eps = vocab_size, mlp, mlp_hidden, norm_eps
        self.mixer_kwargs = dict(mixer_kwargs or {})
        self.pooling, self.bidirectional = pooling, bidirectional
        # transformers reads these generic names (hidden size, layer count) in a few of its utilities
        kwargs.setdefault("hidden_size", d_model)
        kwargs.setdefault("num_hidden_layers", n_layers)
        kwargs.setdefault("num_attention_heads", n_heads)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.model_config()  # validate now: errors name the field

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` this config describes."""
        return ModelConfig(**{f: getattr(self, f) for f in MODEL_FIELDS}, tie_embeddings=bool(self.tie_word_embeddings))

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> LinAttnConfig:
        """The transformers config of a linattn ``config`` (kwargs: pooling, bidirectional, num_labels, token ids)."""
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        return cls(**{f: getattr(config, f) for f in MODEL_FIELDS}, tie_word_embeddings=config.tie_embeddings,
                   **kwargs)
