"""The named studies: one :class:`StudyEntry` each (presets, grid, run kind through its run configs, report,
its own flags)."""

from __future__ import annotations

from pathlib import Path

from linattn.errors import ConfigError
from linattn.experiments.lm import LM_STUDY
from linattn.experiments.lra import LRA_STUDY
from linattn.experiments.report import write_report
from linattn.experiments.shortconv import SHORTCONV_STUDY
from linattn.experiments.study import ReportFn, Study, StudyEntry

STUDIES: dict[str, StudyEntry] = {entry.name: entry for entry in (SHORTCONV_STUDY, LRA_STUDY, LM_STUDY)}


def list_studies() -> list[str]:
    return sorted(STUDIES)


def is_study_file(name: str) -> bool:
    """Whether ``name`` is read as a study YAML file rather than a study name."""
    return name not in STUDIES and (name.endswith((".yaml", ".yml")) or Path(name).is_file())


def get_entry(name: str) -> StudyEntry:
    """The named study ``name``; ConfigError listing the names otherwise."""
    if name not in STUDIES:
        raise ConfigError(f"study must be one of {list_studies()} or a study .yaml file, got {name!r}")
    return STUDIES[name]


def get_study(name: str, preset: str | None = None) -> tuple[Study, ReportFn]:
    """The study ``name`` at ``preset`` (default: its first), or a study read from the YAML file ``name``;
    with its report writer. ConfigError for an unknown name or preset, MissingFileError for a study file that
    does not exist."""
    if is_study_file(name):
        # a name that looks like a file is read as one: a missing file is named as such (MissingFileError)
        return Study.from_yaml(name), write_report
    entry = get_entry(name)
    return entry.make(preset or entry.presets[0]), entry.report
