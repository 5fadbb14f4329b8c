"""The comparison dashboard from two real offline runs, R3 on and R3 off (no network: the report is not saved)."""

from __future__ import annotations

import html
import json

import matplotlib.colors
import matplotlib.image
import pytest

from r3rl.config import compose
from r3rl.dashboard import PANELS, build_report, load_runs, main, report_spec
from r3rl.plan import wandb_naming
from r3rl.tracking import WandbLogger

STEPS = 5
EVAL_AT = {0: {True: 0.25, False: 0.25}, STEPS - 1: {True: 0.5, False: 0.375}}


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory, make_step_metrics):
    dirs = {}
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
            mp.delenv(var, raising=False)
        for rollout, r3, replay in (("vllm_r3", True, "auto"), ("vllm", False, "auto"), ("vllm", "r2", "r2")):
            cfg = compose(["model=tiny_moe", "parallelism=cpu", f"rollout={rollout}", f"replay={replay}"])
            run_dir = tmp_path_factory.mktemp(f"{rollout}-{replay}")
            logger = WandbLogger(cfg, wandb_naming(cfg), run_dir)
            for step in range(STEPS):
                metrics = make_step_metrics(step, r3=r3 is True, seed=int(r3 is True))
                if step in EVAL_AT and r3 != "r2":  # eval points at the start and the end, R3 on ends a little better
                    metrics.update({"eval/arithmetic/avg@4": EVAL_AT[step][r3], "eval/arithmetic/pass@4": 0.75})
                logger.log(metrics, step=step)
            logger.finish()
            dirs[r3] = run_dir
    return dirs


def test_cli_writes_png_html_and_report_spec(run_dirs, tmp_path):
    """Fails if a panel no compared run logged were drawn (an empty "not logged" panel), if the policy-lag note were
    put on runs trained in turn, or if a panel, the runs table or the side-by-side table went missing."""
    out = tmp_path / "compare"
    assert main(["--runs", str(run_dirs[True]), str(run_dirs[False]), "--out", str(out), "--entity", "e"]) == 0
    png = out / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 400 and pixels.std() > 0.05  # drawn, not blank
    page = (out / "comparison.html").read_text()
    # the panels these single-turn, in-turn runs logged: every one but the multi-turn panel, titles without the
    # policy-lag note (they have no sample of older weights) and no empty panel
    shown = [p for p in PANELS if "per turn" not in p.title]
    assert len(shown) == len(PANELS) - 1
    for panel in shown:
        assert f"<h2>{html.escape(panel.title)}</h2>" in page
    assert page.count("<svg") == len(shown)
    assert "policy lag" not in page.split("<h2>Mismatch and eval")[0] and "not logged by these runs" not in page
    assert "R3 on: tiny_moe-cpu-vllm_r3" in page and "R3 off: tiny_moe-cpu-vllm" in page  # the runs table
    assert "r3/routing_flip_rate/layer_03" in page  # the per-layer lines of the R3 run are drawn
    # mismatch and eval accuracy side by side: one column per run, first and last eval point
    table = page[page.index("Mismatch and eval accuracy side by side"):]
    last = table[table.index("eval/arithmetic/avg@4 last"):].split("</tr>")[0]
    assert last.index("0.500 (step 4)") < last.index("0.375 (step 4)")  # R3 on's column, then R3 off's
    assert "eval/arithmetic/avg@4 first</td><td>0.250 (step 0)</td><td>0.250 (step 0)" in table
    assert "train/logprob_abs_diff (mean over steps)" in table
    spec = json.loads((out / "report.json").read_text())
    assert "Routing flip rate per layer" in json.dumps(spec)


def test_headline_says_what_replay_removes_with_its_paired_error(run_dirs, tmp_path):
    """The page opens with the paired figure of the R3 run only, its value minus the mean of the logged
    ``train/logprob_abs_diff_paired_delta``. Fails if ``replay_removes`` drops the sign (a negative "removes"), takes
    the unpaired difference, or if the headline or its table row is dropped from the HTML or the W&B report."""
    runs = load_runs([run_dirs[True], run_dirs[False]])
    r3 = next(r for r in runs if r.replay == "r3")
    deltas = [row["train/logprob_abs_diff_paired_delta"] for row in r3.history
              if "train/logprob_abs_diff_paired_delta" in row]
    assert len(deltas) == STEPS and max(deltas) < 0  # the synthetic replayed mismatch is the smaller one
    out = tmp_path / "compare"
    assert main(["--runs", str(run_dirs[True]), str(run_dirs[False]), "--out", str(out), "--entity", "e"]) == 0
    page = (out / "comparison.html").read_text()
    heads = [line for line in page.splitlines() if "replay removes" in line and line.startswith("<p>")]
    assert len(heads) == 1 and "R3 on: tiny_moe-cpu-vllm_r3: replay removes " in heads[0]
    shown = float(heads[0].split("replay removes ")[1].split(" ")[0])
    assert shown == pytest.approx(-sum(deltas) / STEPS, rel=1e-3)
    assert "standard error clustered by prompt" in heads[0]
    row = page[page.index("replay removes, paired"):].split("</tr>")[0]
    assert row.count(" ± ") == 1  # the R3 run's cell; the R3-off run has no paired pass
    assert "policy lag" not in row  # in turn: the paired figure is R3's own
    assert "replay removes" in json.dumps(report_spec(build_report(runs, entity="e", project="r3rl")))


def test_the_comparison_table_says_an_async_runs_paired_figure_is_mixed():
    """A run with samples of older weights (staleness > 0) gets its "replay removes" cell marked as mixed with policy
    lag. Fails if the dashboard presents the async paired delta as a clean measure of R3."""
    from r3rl.dashboard.eval_table import mismatch_and_eval
    from r3rl.tracking.offline_reader import OfflineRun

    key = "train/logprob_abs_diff_paired_delta"

    def run(staleness: float) -> OfflineRun:
        history = [{"_step": s, key: -0.01, f"{key}_stderr": 0.002, "rollout/staleness_mean": staleness}
                   for s in (1, 2)]
        return OfflineRun("id", "n", "g", (), "p", "e", {}, history, {})

    (row,) = [cells for name, cells in mismatch_and_eval([run(1.0), run(0.0)]) if name.startswith("replay removes")]
    assert "(mixed with policy lag)" in row[0] and "policy lag" not in row[1]


def test_the_policy_lag_note_is_on_the_mismatch_panels_only_when_a_run_trained_on_older_samples():
    """Fails if the note were dropped for a run with samples of older weights (its mismatch and flip figures would
    pass for the engine's alone), put on in-turn runs, or put on panels the lag does not touch (reward, perf)."""
    from r3rl.dashboard.local import shown_panels
    from r3rl.tracking.offline_reader import OfflineRun

    def run(staleness: float) -> OfflineRun:
        history = [{"_step": s, "train/step": s, "train/logprob_abs_diff": 0.01, "rollout/reward_mean": 0.5,
                    "rollout/staleness_mean": staleness} for s in (1, 2)]
        return OfflineRun("id", "n", "g", (), "p", "e", {}, history, {})

    mixed = {p.title for p in PANELS if p.title_for([run(0.0), run(1.0)]) != p.title}
    assert mixed == {PANELS[0].title, PANELS[1].title}
    assert all(p.title_for([run(0.0)]) == p.title for p in PANELS)
    assert PANELS[0].title_for([run(1.0)]).endswith("(max_staleness >= 1: mixed with policy lag)")
    # only the panels with a metric of these runs: the mismatch and the reward
    assert [p.title for p in shown_panels([run(1.0)])] == [PANELS[0].title, "Reward"]


def test_report_object_validates_offline(run_dirs):
    runs = load_runs([run_dirs[True], run_dirs[False]])
    assert sorted(r.r3 for r in runs) == [False, True]
    report = build_report(runs, entity="test-entity", project="r3rl")
    assert report.entity == "test-entity" and report.project == "r3rl"
    spec = report_spec(report)
    (grid,) = [b for b in spec["blocks"] if b.get("type") == "panel-grid"]
    runsets = grid["metadata"]["runSets"]
    assert [rs["name"] for rs in runsets] == ["R3 on", "R3 off"]
    on_filters = runsets[0]["filters"]["filters"]
    assert {"key": {"section": "run", "name": "tags"}, "op": "IN", "value": ["r3:on"]}.items() <= on_filters[0].items()
    assert on_filters[1]["value"] == [r.run_id for r in runs if r.r3]
    panels = grid["metadata"]["panelBankSectionConfig"]["panels"]
    titles = [p["config"]["chartTitle"] for p in panels]
    assert titles == [p.title for p in PANELS]
    flip = panels[1]["config"]
    assert flip["xAxis"] == "r3/step"
    assert [f"r3/routing_flip_rate/layer_{i:02d}" for i in range(4)] == flip["metrics"][1:]
    assert panels[0]["config"]["metrics"] == ["train/logprob_abs_diff", "train/logprob_abs_diff_no_replay"]


def test_save_report_needs_wandb_online(run_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    code = main(["--runs", str(run_dirs[True]), str(run_dirs[False]), "--out", str(tmp_path), "--entity", "e",
                 "--save-report"])
    assert code == 1
    assert "report not saved: WANDB_MODE=offline" in capsys.readouterr().out
    assert (tmp_path / "comparison.png").is_file()  # the local comparison is written regardless


def test_runs_given_twice_are_refused(run_dirs, tmp_path):
    with pytest.raises(ValueError, match="is given twice"):
        load_runs([run_dirs[True], run_dirs[True]])
    with pytest.raises(FileNotFoundError, match="no run-\\*.wandb file"):
        load_runs([tmp_path])


def test_each_replay_mode_has_its_runset_colour_and_label(run_dirs, tmp_path):
    from matplotlib import pyplot as plt

    from r3rl.dashboard.local import draw_panel

    runs = load_runs([run_dirs[True], run_dirs["r2"], run_dirs[False]])
    assert [r.replay for r in runs] == ["r3", "r2", "none"]
    spec = report_spec(build_report(runs, entity="e", project="r3rl"))
    (grid,) = [b for b in spec["blocks"] if b.get("type") == "panel-grid"]
    runsets = grid["metadata"]["runSets"]
    assert [rs["name"] for rs in runsets] == ["R3 on", "R2", "R3 off"]
    assert runsets[1]["filters"]["filters"][0]["value"] == ["replay:r2"]
    assert runsets[1]["filters"]["filters"][1]["value"] == [runs[1].run_id]
    fig, ax = plt.subplots()
    draw_panel(ax, PANELS[0], runs)  # the mismatch: one colour per run, one line style per replay mode
    styles = {line.get_label().split(":")[0]: (line.get_color(), line.get_linestyle()) for line in ax.get_lines()}
    plt.close(fig)
    assert set(styles) == {"R3 on", "R2", "R3 off"} and len({c for c, _ in styles.values()}) == 3
    assert styles["R3 on"][1] == "-" and styles["R3 off"][1] == "--"


def test_two_runs_of_one_replay_mode_get_their_own_colours(run_dirs):
    """``--runs A B`` on two R3 runs drew both in R3's one blue (issue 60). Fails if colour follows the replay mode
    again instead of the run; the replay mode keeps the line style."""
    import dataclasses

    from matplotlib import pyplot as plt

    from r3rl.dashboard.local import draw_panel

    runs = load_runs([run_dirs[True]])
    twin = dataclasses.replace(runs[0], name="another R3 run")
    fig, ax = plt.subplots()
    draw_panel(ax, PANELS[0], [runs[0], twin])
    lines = ax.get_lines()
    plt.close(fig)
    by_run: dict[str, set] = {}
    for line in lines:  # one colour (shades of it, one per key) per run
        colour = tuple(matplotlib.colors.to_rgba(line.get_color()))
        by_run.setdefault(line.get_label().rsplit(": ", 1)[0], set()).add(colour)
    (first, second) = by_run.values()
    assert not first & second and {line.get_linestyle() for line in lines} == {"-"}


def test_stabiliser_table_has_one_row_per_run_with_its_setup_and_figures(run_dirs, tmp_path, make_step_metrics):
    """A grid run (soft replay, GSPO, frozen router, 4 mini-batches) logged for real beside the R3 and no-replay runs:
    the dashboard's stabiliser table has one row per run, each with its own setup, its later-mini-batch mismatch,
    replace rate, gradient spikes and held-out gain (last eval point minus the first). Fails if the setup were read
    from the run name instead of its config, if a spike under ``SPIKE_FACTOR`` x the median were counted (or one
    over it missed), or if the gain took other eval points."""
    from r3rl.dashboard.stabilisers import grid_rows

    overrides = ["model=tiny_moe", "parallelism=cpu", "rollout=vllm_r3", "replay=soft", "replay.soft_ratio=0.25",
                 "algorithm.loss=gspo", "trainer.freeze_router=true", "algorithm.global_batch_size=64"]
    cfg = compose(overrides)
    grid_dir = tmp_path / "grid"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
            mp.delenv(var, raising=False)
        logger = WandbLogger(cfg, wandb_naming(cfg), grid_dir)
        peaks = [1.0, 1.1, 2.9, 3.5, 1.0]  # median step norm 1.0: only 3.5 is a spike
        for step in range(STEPS):
            metrics = make_step_metrics(step, r3=True, seed=3)
            metrics.update({"train/grad_norm": 1.0, "train/grad_norm_max": peaks[step],
                            "train/later_minibatch_logprob_abs_diff": 0.02 * (step + 1),
                            "train/router_replay_replace_rate": 0.1})
            if step in (0, 2, STEPS - 1):
                metrics["eval/arithmetic/avg@4"] = {0: 0.2, 2: 0.9, STEPS - 1: 0.45}[step]
            logger.log(metrics, step=step)
        logger.finish()
    runs = load_runs([run_dirs[True], run_dirs[False], grid_dir])
    rows = {r.setup: r for r in grid_rows(runs)}
    assert set(rows) == {"r3, grpo", "none, grpo", "soft 0.25, gspo, frozen router"}
    grid = rows["soft 0.25, gspo, frozen router"]
    assert grid.mini_batches == 4 and grid.spikes == 1 and grid.grad_norm_max == 3.5
    assert grid.later == pytest.approx(0.06) and grid.replace_rate == pytest.approx(0.1)
    assert grid.gain == pytest.approx(0.25)
    assert rows["r3, grpo"].gain == pytest.approx(0.25) and rows["r3, grpo"].mini_batches == 1
    out = tmp_path / "compare"
    assert main(["--runs", str(run_dirs[True]), str(run_dirs[False]), str(grid_dir), "--out", str(out)]) == 0
    table = (out / "comparison.html").read_text().split("Stabilisers, one row per run")[1].split("</table>")[0]
    assert table.count("<tr>") == 4  # the header and one row per run
    assert "soft 0.25, gspo, frozen router" in table and "10%" in table and "1 (3.5)" in table


def title_collisions(fig) -> list[tuple[str, str]]:
    """The figure title and the visible panels' titles, rendered: every pair whose boxes intersect, and every title
    that leaves the figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in (fig._suptitle, *(ax.title for ax in fig.axes if ax.get_visible())) if t and t.get_text()]
    boxes = [(t.get_text().split("\n")[0][:40], t.get_window_extent(renderer)) for t in texts]
    out = [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:] if box_a.overlaps(box_b)]
    edge = fig.bbox
    return out + [(a, "figure edge") for a, box in boxes
                  if box.x0 < edge.x0 or box.x1 > edge.x1 or box.y1 > edge.y1]


def test_rendered_comparison_has_no_overlapping_title_and_no_empty_panel(run_dirs, monkeypatch):
    """The docs' first picture had the run names over the first row's titles, titles running into each other and a
    panel saying "not logged by these runs" (issue 60). Rendered with every policy-lag note on (the longest titles):
    fails if two titles' boxes intersect, a title leaves the figure, or a visible panel has no line. The control:
    the same figure with titles unwrapped collides."""
    from matplotlib import pyplot as plt

    from r3rl.dashboard import local
    from r3rl.dashboard.panels import LAG_NOTE, Panel

    monkeypatch.setattr(Panel, "title_for", lambda self, runs: self.title + LAG_NOTE)
    runs = load_runs([run_dirs[True], run_dirs[False], run_dirs["r2"]])
    fig = local.comparison_figure(runs)
    try:
        assert title_collisions(fig) == []
        visible = [ax for ax in fig.axes if ax.get_visible()]
        assert visible and all(ax.get_lines() for ax in visible)
    finally:
        plt.close(fig)
    monkeypatch.setattr(local, "TITLE_CHARS", 10_000)
    fig = local.comparison_figure(runs)
    try:
        assert title_collisions(fig)
    finally:
        plt.close(fig)


def test_headline_figure_shows_held_out_score_and_mismatch_of_each_run(run_dirs, tmp_path):
    """The docs' home figure: two panels, each with a line per run (R3 on solid, off dashed), titles apart. Fails if
    a run's held-out score or mismatch is missing, if the two runs share a style, or if the titles collide."""
    from matplotlib import pyplot as plt

    from r3rl.dashboard import headline

    runs = load_runs([run_dirs[True], run_dirs[False]])
    drawn = []
    real_close = plt.close
    try:
        plt.close = lambda fig: drawn.append(fig)  # keep the figure to look at what was rendered
        path = headline.write_headline(runs, tmp_path / "headline.png")
    finally:
        plt.close = real_close
    (fig,) = drawn
    try:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and title_collisions(fig) == []
        score, mismatch = fig.axes
        for ax in (score, mismatch):
            labelled = {line.get_label(): line.get_linestyle() for line in ax.get_lines()
                        if not line.get_label().startswith("_")}
            assert set(labelled.values()) == {"-", "--"}, labelled
        assert [round(y, 3) for y in score.get_lines()[0].get_ydata()] == [0.25, 0.5]
    finally:
        real_close(fig)


def test_running_mean_averages_each_point_with_the_ones_before():
    """Fails if the window reached ahead (a step would show later steps' noise) or the start divided by the full
    window."""
    from r3rl.dashboard.headline import running_mean

    assert running_mean([1.0, 3.0, 5.0, 7.0], 2).tolist() == [1.0, 2.0, 4.0, 6.0]
