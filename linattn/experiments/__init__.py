"""Declarative, resumable studies (grid x seeds x lrs) writing runs/<study>/<stamp>/ with a report."""

from linattn.experiments.cli import add_run_arguments, cli_list, cli_run
from linattn.experiments.lra import lra_report, lra_study, lra_study_from_args
from linattn.experiments.lra_run import LRABatches, train_lra_from_config
from linattn.experiments.registry import get_study, list_studies
from linattn.experiments.report import Cell, aggregate, write_report
from linattn.experiments.runner import StudyOutcome, run_study
from linattn.experiments.shortconv import shortconv_study
from linattn.experiments.study import RunSpec, Study

__all__ = [
    "add_run_arguments", "cli_list", "cli_run", "get_study", "list_studies", "Cell", "aggregate", "write_report",
    "StudyOutcome", "run_study", "shortconv_study", "RunSpec", "Study", "lra_report", "lra_study",
    "lra_study_from_args", "LRABatches", "train_lra_from_config",
]
