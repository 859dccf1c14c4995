"""Reading YAML configs: a missing file or a syntax error names the file (and the line)."""

from __future__ import annotations

from pathlib import Path

import yaml

from linattn.errors import ConfigError, MissingFileError


def read_yaml(path: str | Path, what: str = "config file") -> object:
    """The parsed content of YAML file ``path``; MissingFileError or ConfigError naming it otherwise."""
    path = Path(path)
    if not path.is_file():
        state = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise MissingFileError(f"{what} {path} {state}")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(_syntax_problem(exc), source=path) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not a UTF-8 text file ({exc.reason} at byte {exc.start})", source=path) from None


def parse_yaml(text: str) -> object:
    """The parsed content of YAML ``text``; a syntax error is a ConfigError saying where (no file to name)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_syntax_problem(exc)) from None


def _syntax_problem(exc: yaml.YAMLError) -> str:
    """One line out of PyYAML's multi-line message: where, and what is wrong."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"invalid YAML{where}: {problem}" + (f" ({context})" if context else "")
