"""bench/inflight_updates.py's replay / no-replay figures pair the steps both were logged on."""

from __future__ import annotations

import importlib.util
import math

from r3rl.config import CONF_DIR

REPO = CONF_DIR.parent


def load():
    spec = importlib.util.spec_from_file_location("inflight_updates", REPO / "bench" / "inflight_updates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_and_no_replay_are_averaged_over_the_same_steps():
    """With ``replay.no_replay_every=2`` the unreplayed figure is logged on even steps only, and the replayed one
    is large on the odd steps it skipped; the ratio over the shared steps is 0.5, as on every step it can be read,
    where a ratio of each figure's own mean (steps 2-6 against 2, 4, 6) reads 1.3. Fails if ``q`` went back to dividing
    means over different steps (issue 70, item 1)."""
    bench = load()
    replayed = {2: 0.2, 3: 1.0, 4: 0.2, 5: 1.0, 6: 0.2}
    rows = [{"step": 1, "a": 9.0, "b": 9.0}]
    for step, value in replayed.items():
        rows.append({"step": step, "a": value, **({"b": 2 * value} if step % 2 == 0 else {"b": math.nan})})
    a, b = bench.paired(rows, "a", "b")
    assert a / b == 0.5
    unpaired = bench.mean(rows, "a") / bench.mean(rows, "b")
    assert abs(unpaired - 1.3) < 1e-9
    assert all(math.isnan(x) for x in bench.paired(rows, "a", "missing"))
