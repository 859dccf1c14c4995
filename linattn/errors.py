"""The errors a user can fix: bad configs, arguments and files (see docs/errors.md).

Every such error derives from :class:`UserError`. The command line prints a ``UserError`` as one line and
exits with code 2; anything else is a bug and keeps its traceback (``linattn --debug`` shows the traceback
for user errors too). Each subclass also derives from the built-in exception it replaces, so code that
catches ``ValueError``, ``TypeError``, ``FileNotFoundError`` or ``RuntimeError`` keeps working.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


class UserError(Exception):
    """Base of every error caused by what the user gave (config, argument, file), not by a bug."""


class ConfigError(UserError, ValueError, TypeError):
    """A config value of the wrong type or out of range, or a config file that cannot be parsed.

    ``field`` is the dotted name of the value (``train.lr``), ``source`` the file it was read from; both are
    filled in on the way up by :func:`located`, so the message names the file and the field wherever the
    check ran. It is both a ValueError and a TypeError: a wrong value and a wrong type are one kind of
    mistake for the user."""

    def __init__(self, detail: str, *, field: str | None = None, source: str | Path | None = None) -> None:
        self.detail, self.field, self.source = detail, field, source
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.source}: " if self.source is not None else ""
        name = f"{self.field}: " if self.field else ""
        return f"{where}{name}{self.detail}"

    def relocate(self, prefix: str | None = None, source: str | Path | None = None) -> None:
        """Prefix the field with ``prefix`` (a config section) and set the file, unless already set."""
        if prefix:
            self.field = f"{prefix}.{self.field}" if self.field else prefix
        if source is not None and self.source is None:
            self.source = source
        self.args = (self._message(),)


def describe(value: object) -> str:
    """``value`` for an error message: its repr and, where the type is not obvious from it, the type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    plain_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return text if plain_number else f"{text} ({type(value).__name__})"


def bad_value(field: str, value: object, expected: str) -> ConfigError:
    """The standard error for one field: ``<field>: expected <expected>, got <value> (<type>)``."""
    return ConfigError(f"expected {expected}, got {describe(value)}", field=field)


@contextlib.contextmanager
def located(prefix: str | None = None, source: str | Path | None = None) -> Iterator[None]:
    """Inside the block, a :class:`ConfigError` gets ``prefix`` before its field and ``source`` as its file."""
    try:
        yield
    except ConfigError as exc:
        exc.relocate(prefix, source)
        raise


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named (or that a data set needs) does not exist."""


class DataError(UserError, ValueError):
    """A data file's content is wrong (bad label, no examples, unreadable batch); the message names the
    file and, for text files, the line."""


class GenerationError(UserError, RuntimeError):
    """A data generator cannot make what its settings ask for (e.g. too few distinct items within the bounds)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint file is unreadable, truncated, fails its checksum, or does not match the run."""


class ResumeError(UserError, ValueError):
    """Resuming is refused: nothing to resume, or the run was started with a different config."""
