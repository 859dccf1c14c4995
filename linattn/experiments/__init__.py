"""Declarative, resumable studies (grid x seeds x lrs) writing runs/<study>/<stamp>/ with a report; run kinds
(what a run config is, how it trains)."""

from linattn.experiments.cli import add_run_arguments, cli_list, cli_run
from linattn.experiments.lra import LRA_STUDY, lra_report, lra_study, lra_study_from_args
from linattn.experiments.lra_run import train_lra_from_config
from linattn.experiments.registry import STUDIES, get_entry, get_study, list_studies
from linattn.experiments.report import Cell, aggregate, write_report
from linattn.experiments.runner import StudyOutcome, run_study
from linattn.experiments.runs import RUN_KINDS, RunKind, check_config, cli_train, run_kind, train_run
from linattn.experiments.shortconv import SHORTCONV_STUDY, shortconv_study
from linattn.experiments.study import RunSpec, Study, StudyEntry

__all__ = [
    "add_run_arguments", "cli_list", "cli_run", "get_entry", "get_study", "list_studies", "STUDIES", "Cell",
    "aggregate", "write_report", "StudyOutcome", "run_study", "shortconv_study", "SHORTCONV_STUDY", "RunSpec",
    "Study", "StudyEntry", "lra_report", "lra_study", "lra_study_from_args", "LRA_STUDY",
    "train_lra_from_config", "RUN_KINDS", "RunKind", "check_config", "cli_train", "run_kind", "train_run",
]
