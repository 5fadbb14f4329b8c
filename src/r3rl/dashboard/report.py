"""The W&B report comparing R3 on and off, built with wandb-workspaces (pydantic objects: bad fields raise).

Building needs no network as long as ``entity`` is given (the default entity is looked up online). Saving does:
``Report.save()`` resolves every runset's project id and uploads the spec. ``report_spec`` renders the spec that
``save()`` would upload, without the project lookups, so the report can be checked offline.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import wandb_workspaces.reports.v2 as wr
from wandb_workspaces import expr

from r3rl.dashboard.panels import PANELS, Panel
from r3rl.tracking.offline_reader import OfflineRun
from r3rl.tracking.summary import replay_removes_text

# by replay mode (OfflineRun.replay); R3 on / off keep the names and tags they had before R2 existed
RUNSET_NAMES = {"r3": "R3 on", "r2": "R2", "none": "R3 off", None: "replay unknown"}
_RUNSET_TAGS = {"r3": "r3:on", "r2": "replay:r2", "none": "r3:off"}


def _runsets(runs: Sequence[OfflineRun], entity: str, project: str) -> list[wr.Runset]:
    """One runset per replay mode, each holding the given runs of that mode (by tag and id)."""
    out = []
    for mode, name in RUNSET_NAMES.items():
        ids = [r.run_id for r in runs if r.replay == mode]
        if not ids:
            continue
        by_id = expr.Metric("ID").isin(ids)  # "ID" is the run id in W&B's filter language
        filters = expr.And(by_id) if mode is None else expr.And(expr.Tags().isin([_RUNSET_TAGS[mode]]), by_id)
        out.append(wr.Runset(entity=entity, project=project, name=name, filters=filters))
    return out


def _line_plot(panel: Panel, runs: Sequence[OfflineRun]) -> wr.LinePlot:
    keys: dict[str, None] = {}
    for run in runs:
        keys.update(dict.fromkeys(panel.select(run.metric_keys())))
    if keys:
        return wr.LinePlot(title=panel.title_for(runs), x=panel.x, y=list(keys), title_x=panel.x,
                           title_y=panel.y_label)
    # no run has logged it yet: let W&B pick the family by name
    pattern = panel.pattern or "|".join(panel.keys)
    return wr.LinePlot(title=panel.title_for(runs), x=panel.x, metric_regex=pattern, title_x=panel.x,
                       title_y=panel.y_label)


def build_report(runs: Sequence[OfflineRun], *, entity: str, project: str,
                 title: str = "R3: rollout routing replay on vs off") -> wr.Report:
    """A report with one panel grid: one runset per replay mode (R3 on, R2, R3 off), and the comparison panels."""
    if not runs:
        raise ValueError("build_report: no runs to compare")
    names = ", ".join(f"{r.name} ({r.run_id}, {RUNSET_NAMES[r.replay]})" for r in runs)
    groups = sorted({r.group for r in runs if r.group})
    description = f"Runs: {names}." + (f" Group: {', '.join(groups)}." if groups else "")
    # the paired figure of each R3 run, as measured when the report is built (the panels keep updating)
    removed = [f"{r.name or r.run_id}: {text}." for r in runs if (text := replay_removes_text(r.history))]
    grid = wr.PanelGrid(runsets=_runsets(runs, entity, project), panels=[_line_plot(p, runs) for p in PANELS])
    return wr.Report(
        project=project, entity=entity, title=title, description=description,
        blocks=[
            wr.H1(text=title),
            wr.P(text="Train-rollout log-prob mismatch with Rollout Routing Replay (R3) and without it, the "
                      "routing flip rate per MoE layer, reward and step timings. " + description),
            *([wr.P(text=" ".join(removed))] if removed else []),
            grid,
        ],
    )


def report_spec(report: wr.Report) -> dict[str, Any]:
    """The spec ``report.save()`` would upload, rendered offline (runset project ids left out): this runs every
    block and panel through wandb-workspaces' internal models, so an invalid report raises here."""
    offline = copy.deepcopy(report)
    for block in offline.blocks:
        if isinstance(block, wr.PanelGrid):
            for rs in block.runsets:
                # an entity/project pair makes Runset._to_model look the project up online
                object.__setattr__(rs, "entity", "")
                object.__setattr__(rs, "project", "")
    return offline._to_model().spec.model_dump(by_alias=True, exclude_none=True, mode="json")
