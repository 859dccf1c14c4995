"""Mixer names -> layer classes, and building a layer from a name with checked keyword args."""

from __future__ import annotations

import inspect

from torch import nn

_MIXERS: dict[str, type[nn.Module]] = {}


def register_mixer(name: str, cls: type[nn.Module]) -> type[nn.Module]:
    """Make layer class ``cls`` available as mixer ``name``."""
    _MIXERS[name] = cls
    return cls


def list_mixers() -> list[str]:
    """Names of every mixer layer, sorted."""
    return sorted(_MIXERS)


def mixer_class(name: object) -> type[nn.Module]:
    """The layer class of mixer ``name``; ValueError listing the valid names otherwise."""
    if name not in _MIXERS:
        raise ValueError(f"unknown mixer {name!r}; valid mixers: {', '.join(list_mixers())}")
    return _MIXERS[name]


def mixer_kwarg_names(cls: type[nn.Module]) -> list[str]:
    """Keyword arguments accepted by layer ``cls``: those of its ``__init__`` and, while an ``__init__``
    forwards ``**kwargs``, those of the next base class's ``__init__``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind == p.VAR_KEYWORD for p in params) or klass is nn.Module:
            break
    return sorted(names - {"self", "d_model", "n_heads"})


def build_mixer(name: str, d_model: int, n_heads: int, **kwargs) -> nn.Module:
    """Layer ``name`` of width ``d_model`` with ``n_heads`` heads; unknown keyword args raise
    ValueError listing the valid ones."""
    cls = mixer_class(name)
    valid = mixer_kwarg_names(cls)
    bad = sorted(set(kwargs) - set(valid))
    if bad:
        raise ValueError(f"mixer {name!r} got unknown argument(s) {', '.join(bad)}; valid: {', '.join(valid)}")
    return cls(d_model, n_heads, **kwargs)
