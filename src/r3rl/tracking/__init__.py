"""Experiment tracking: the W&B logger, the reader of W&B offline files, and the end-of-run summary table."""

from r3rl.tracking.offline_reader import OfflineRun, WandbFileError, find_run_files, read_run, read_runs
from r3rl.tracking.summary import print_summary, summarize
from r3rl.tracking.wandb_logger import WandbLogger

__all__ = [
    "OfflineRun", "WandbFileError", "WandbLogger", "find_run_files", "print_summary", "read_run", "read_runs",
    "summarize",
]
