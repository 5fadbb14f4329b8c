"""The same comparison panels drawn locally from the runs' offline files: ``comparison.png`` and a self-contained
``comparison.html`` (one inline SVG per panel, the runs, and a table of the key metrics per run)."""

from __future__ import annotations

import html
import io
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training nodes or in CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from r3rl import metrics as M  # noqa: E402
from r3rl.dashboard.eval_table import mismatch_and_eval  # noqa: E402
from r3rl.dashboard.stabilisers import COLUMNS, grid_rows  # noqa: E402
from r3rl.dashboard.stabilisers import cells as stabiliser_cells  # noqa: E402
from r3rl.dashboard.panels import PANELS, Panel  # noqa: E402
from r3rl.dashboard.report import RUNSET_NAMES  # noqa: E402
from r3rl.tracking.offline_reader import OfflineRun  # noqa: E402
from r3rl.tracking.summary import fmt_cell, replay_removes_text, summarize  # noqa: E402

# Each run keeps its colour in every panel (two R3 runs are told apart), and its replay mode its line style (R3 on
# solid, off dashed); a family (one line per layer) and a panel's several keys take shades of the run's colour.
_COLOURS = (("tab:blue", "Blues"), ("tab:orange", "Oranges"), ("tab:green", "Greens"), ("tab:purple", "Purples"),
            ("tab:red", "Reds"), ("tab:brown", "YlOrBr"), ("tab:gray", "Greys"))
_REPLAY_STYLES = {"r3": "-", "none": "--", "r2": "-.", None: ":"}
_MARKERS = (".", "x", "^", "s", "v", "d")
# a panel title's characters per line: wider than its 7-inch panel at 10 pt, a title runs into its neighbour's
TITLE_CHARS = 72


def run_label(run: OfflineRun) -> str:
    return f"{RUNSET_NAMES[run.replay]}: {run.name or run.run_id}"


def _short_label(run: OfflineRun, runs: Sequence[OfflineRun]) -> str:
    """"R3 on" (the replay mode) when it names one run of the comparison, else with the run's name."""
    alone = sum(1 for r in runs if r.replay == run.replay) == 1
    return RUNSET_NAMES[run.replay] if alone else run_label(run)


def _stderr_band(ax: Axes, run: OfflineRun, key: str, steps: list[int], ys: list[float], colour) -> None:
    """+-1 standard error (clustered: by prompt, by problem for eval) around a figure that logs one
    (``metrics.stderr_of``)."""
    se_key = M.stderr_of(key)
    if se_key is None:
        return
    se_by_step = dict(zip(*run.series(se_key)))
    if not se_by_step:
        return
    se = [math.nan if se_by_step.get(s) is None else se_by_step[s] for s in steps]
    ax.fill_between(steps, [y - e for y, e in zip(ys, se)], [y + e for y, e in zip(ys, se)], color=colour,
                    alpha=0.15, linewidth=0)


def draw_panel(ax: Axes, panel: Panel, runs: Sequence[OfflineRun]) -> int:
    """Draw ``panel`` for every run on ``ax``; returns the number of lines drawn."""
    lines = 0
    for run_index, run in enumerate(runs):
        keys = panel.select(run.metric_keys())
        colour, cmap_name = _COLOURS[run_index % len(_COLOURS)]
        style = _REPLAY_STYLES.get(run.replay, ":")
        cmap = plt.get_cmap(cmap_name)
        for i, key in enumerate(keys):
            steps, values = run.series(key)
            shade = colour if len(keys) == 1 else cmap(0.35 + 0.6 * i / (len(keys) - 1))
            marker = "." if len(keys) > len(_MARKERS) else _MARKERS[i]  # a family: shades alone
            ys = [math.nan if v is None else v for v in values]
            ax.plot(steps, ys, style, color=shade, marker=marker, label=f"{_short_label(run, runs)}: {key}")
            _stderr_band(ax, run, key, steps, ys, shade)
            lines += 1
    ax.set_title(textwrap.fill(panel.title_for(runs), TITLE_CHARS), fontsize=10)
    ax.set_xlabel(panel.x)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.y_label)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=6, ncol=2 if lines > 6 else 1)
    else:
        ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    return lines


def headlines(runs: Sequence[OfflineRun]) -> list[str]:
    """``<run>: replay removes X ± se ...`` for every run with R3's paired pass: the figure the comparison is for."""
    return [f"{run_label(r)}: {text}" for r in runs if (text := replay_removes_text(r.history)) is not None]


def shown_panels(runs: Sequence[OfflineRun], panels: Sequence[Panel] = PANELS) -> list[Panel]:
    """The panels at least one of ``runs`` logged a metric of (an empty panel says nothing about the comparison)."""
    return [p for p in panels if p.has_data(runs)]


def comparison_figure(runs: Sequence[OfflineRun], panels: Sequence[Panel] = PANELS):
    """The panels ``runs`` logged, two a row, under the runs' names and what replay removes (the caller closes it)."""
    panels = shown_panels(runs, panels)
    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    # constrained layout makes room for the figure title above the first row (tight_layout ignores it)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4 * rows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, panel, runs)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    # wrapped to the figure's width: a headline wider than the figure is cut at both edges
    lines = [" vs ".join(run_label(r) for r in runs), *headlines(runs)]
    fig.suptitle("\n".join(textwrap.fill(line, 11 * 7 * cols) for line in lines), fontsize=11)
    return fig


def write_png(runs: Sequence[OfflineRun], path: Path, panels: Sequence[Panel] = PANELS) -> Path:
    fig = comparison_figure(runs, panels)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _panel_svg(panel: Panel, runs: Sequence[OfflineRun]) -> str:
    # text as text (no per-SVG glyph definitions whose ids would repeat across the page), stable ids
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": panel.title}):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        try:
            draw_panel(ax, panel, runs)
            fig.tight_layout()
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
        finally:
            plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog: the SVG sits inside HTML


def write_html(runs: Sequence[OfflineRun], path: Path, panels: Sequence[Panel] = PANELS) -> Path:
    e = html.escape
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset='utf-8'><title>R3 comparison</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}</style>",
        "</head><body>", "<h1>R3 comparison</h1>", *(f"<p><b>{e(h)}</b></p>" for h in headlines(runs)),
        "<h2>Runs</h2>",
        "<table><tr><th>run</th><th>id</th><th>R3</th><th>group</th><th>tags</th><th>steps</th><th>files</th></tr>",
    ]
    for r in runs:
        parts.append(
            f"<tr><td>{e(r.name)}</td><td>{e(r.run_id)}</td><td>{e(RUNSET_NAMES[r.replay])}</td><td>{e(r.group)}</td>"
            f"<td>{e(', '.join(r.tags))}</td><td>{len(r.history)}</td>"
            f"<td>{e(', '.join(str(f) for f in r.files))}</td></tr>"
        )
    parts.append("</table>")
    rows = mismatch_and_eval(runs)
    if rows:
        parts += ["<h2>Mismatch and eval accuracy side by side</h2>", "<table><tr><th>figure</th>"]
        parts += [f"<th>{e(run_label(r))}</th>" for r in runs] + ["</tr>"]
        parts += [f"<tr><td>{e(label)}</td>{''.join(f'<td>{e(c)}</td>' for c in cells)}</tr>" for label, cells in rows]
        parts.append("</table>")
    for panel in shown_panels(runs, panels):
        parts += [f"<h2>{e(panel.title_for(runs))}</h2>", _panel_svg(panel, runs)]
    parts += ["<h2>Stabilisers, one row per run</h2>", "<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in COLUMNS)
              + "</tr>"]
    parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
              for row in stabiliser_cells(grid_rows(runs, [run_label(r) for r in runs]))]
    parts.append("</table>")
    stats = [summarize(r.history) for r in runs]
    keys = list(dict.fromkeys(k for s in stats for k in s))
    parts += ["<h2>Key metrics (mean over steps)</h2>", "<table><tr><th>metric</th>"]
    parts += [f"<th>{e(run_label(r))}</th>" for r in runs] + ["</tr>"]
    for key in keys:
        cells = "".join(f"<td>{e(fmt_cell(s[key], 'mean')) if key in s else ''}</td>" for s in stats)
        parts.append(f"<tr><td>{e(key)}</td>{cells}</tr>")
    parts += ["</table>", "</body></html>"]
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_comparison(runs: Sequence[OfflineRun], out_dir: str | Path,
                     panels: Sequence[Panel] = PANELS) -> tuple[Path, Path]:
    """``<out_dir>/comparison.png`` and ``<out_dir>/comparison.html`` of ``runs`` (``panels``: GRPO's by default,
    ``SFT_PANELS`` for an SFT run)."""
    if not runs:
        raise ValueError("write_comparison: no runs to compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_png(runs, out / "comparison.png", panels), write_html(runs, out / "comparison.html", panels)
