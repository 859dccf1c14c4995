"""Named studies and their report writers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from linattn.errors import ConfigError
from linattn.experiments.lra import lra_report, lra_study
from linattn.experiments.report import write_report
from linattn.experiments.shortconv import shortconv_report, shortconv_study
from linattn.experiments.study import Study

ReportFn = Callable[[Study, Path, list[dict]], None]
STUDIES: dict[str, tuple[Callable[[str], Study], ReportFn]] = {
    "shortconv": (shortconv_study, shortconv_report),
    "lra": (lra_study, lra_report),
}


def list_studies() -> list[str]:
    return sorted(STUDIES)


def get_study(name: str, preset: str = "smoke") -> tuple[Study, ReportFn]:
    """The study ``name`` at ``preset``, or a study read from the YAML file ``name``; with its report writer.
    ConfigError for an unknown name, MissingFileError for a study file that does not exist."""
    if name in STUDIES:
        make, report = STUDIES[name]
        return make(preset), report
    if name.endswith((".yaml", ".yml")) or Path(name).is_file():
        # a name that looks like a file is read as one: a missing file is named as such (MissingFileError)
        return Study.from_yaml(name), write_report
    raise ConfigError(f"study must be one of {list_studies()} or a study .yaml file, got {name!r}")
