"""Compare runs with R3 on and off: a W&B report (wandb-workspaces) and a local PNG/HTML of the same panels.

``python -m r3rl.dashboard --runs outputs/<r3 run> outputs/<no-r3 run> --out outputs/compare``
"""

from r3rl.dashboard.cli import load_runs, main
from r3rl.dashboard.local import write_comparison
from r3rl.dashboard.panels import PANELS, Panel
from r3rl.dashboard.report import build_report, report_spec

__all__ = ["PANELS", "Panel", "build_report", "load_runs", "main", "report_spec", "write_comparison"]
