"""``python -m r3rl.dashboard --runs <run folders or .wandb files> --out <folder> [--entity E --project P
--save-report]``: the local comparison always (``comparison.png`` and ``.html``, every panel; ``headline.png``, the
held-out score and the mismatch), ``report.json`` (the W&B report spec) always, and the W&B report saved only with
``--save-report`` and W&B online."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from r3rl.dashboard.headline import write_headline
from r3rl.dashboard.local import write_comparison
from r3rl.dashboard.report import build_report, report_spec
from r3rl.dashboard.stabilisers import grid_rows, render_table
from r3rl.tracking.offline_reader import OfflineRun, read_runs


def load_runs(paths: Sequence[str | Path]) -> list[OfflineRun]:
    """Every run found in ``paths`` (run output folders, ``offline-run-*`` folders or ``.wandb`` files)."""
    runs: dict[str, OfflineRun] = {}
    for p in paths:
        found = read_runs(p)
        if not found:
            raise FileNotFoundError(f"{p}: no run-*.wandb file there (was the run logged with logger.wandb.mode="
                                    f"disabled, or online without offline files?)")
        for run in found:
            if run.run_id in runs:
                raise ValueError(f"run {run.run_id} is given twice ({runs[run.run_id].files[0]} and {run.files[0]})")
            runs[run.run_id] = run
    return list(runs.values())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m r3rl.dashboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True,
                    help="run output folders, offline-run-* folders or .wandb files")
    ap.add_argument("--out", required=True,
                    help="folder for comparison.png, headline.png, comparison.html and report.json")
    ap.add_argument("--entity", default=None, help="W&B entity of the report (required to save it)")
    ap.add_argument("--project", default=None, help="W&B project of the report (default: the runs' project)")
    ap.add_argument("--title", default="R3: rollout routing replay on vs off", help="report title")
    ap.add_argument("--save-report", action="store_true", help="save the report to W&B (needs W&B online)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    runs = load_runs(args.runs)
    out = Path(args.out)
    png, page = write_comparison(runs, out)
    headline = write_headline(runs, out / "headline.png")
    print(render_table(grid_rows(runs)))
    print(f"wrote {png}, {headline} and {page}")

    project = args.project or next((r.project for r in runs if r.project), "r3rl")
    entity = args.entity or next((r.entity for r in runs if r.entity), "")
    report = build_report(runs, entity=entity, project=project, title=args.title)
    spec_path = out / "report.json"
    spec_path.write_text(json.dumps(report_spec(report), indent=1))
    print(f"wrote {spec_path} (the W&B report spec)")

    if not args.save_report:
        return 0
    mode = os.environ.get("WANDB_MODE", "online")
    if mode in ("offline", "disabled", "dryrun"):
        print(f"report not saved: WANDB_MODE={mode}. Upload the runs (`wandb sync <run folder>/wandb/offline-run-*`)"
              f" and rerun with W&B online.")
        return 1
    if not entity:
        print("report not saved: pass --entity (the W&B team or user that owns the project)")
        return 2
    report.save()
    print(f"saved the report: {report.url}")
    return 0
