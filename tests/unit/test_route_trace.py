"""The route trace's digests and its reader (``r3rl.route_trace``, ``python doctor.py --trace``); the real
stack's trace is checked in tests/integration/recipe/test_multiturn_recipe.py and test_doctor.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from r3rl import route_trace as T

DOCTOR = str(Path(__file__).resolve().parents[2] / "doctor.py")


def routes_and_tokens(rows: int = 12, layers: int = 3, k: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    routes = np.argsort(rng.random((rows, layers, 8)), axis=-1)[..., :k].astype(np.uint8)
    return rng.integers(0, 1000, rows + 1).astype(np.int32), routes


def test_digests_add_up_over_split_rows_and_see_a_shift_a_token_or_a_layer_swap():
    """Fails if the digest of rows split over ranks (any split, any order) did not add up to the whole sample's, if
    the order of experts within a row mattered, or if a one-row shift, a changed token or two layers swapped left
    it unchanged."""
    tokens, routes = routes_and_tokens()
    whole = T.sample_digest(tokens, routes)
    rows, layers, k = routes.shape
    pos, layer = np.repeat(np.arange(rows), layers), np.tile(np.arange(layers), rows)
    hashes = T.row_hashes(pos, tokens[pos], layer, routes.reshape(-1, k))
    split = np.random.default_rng(1).permutation(len(hashes))
    assert (T.wrapping_sum(hashes[split[:7]]) + T.wrapping_sum(hashes[split[7:]])) % 2**64 == whole
    assert T.sample_digest(tokens, routes[..., ::-1]) == whole
    shifted = np.concatenate([routes[:1], routes[:-1]])
    other_token = tokens.copy()
    other_token[4] += 1
    swapped = routes[:, [1, 0, 2]]
    assert len({whole, T.sample_digest(tokens, shifted), T.sample_digest(other_token, routes),
                T.sample_digest(tokens, swapped)}) == 4
    assert T.sample_digest(tokens, None) is None


def test_the_reader_names_the_first_boundary_where_a_sample_changed(tmp_path):
    """Fails if a sample whose routes changed between the batch and the trainer were reported at another boundary,
    a sample identical throughout were reported, or ``--trace`` exited 0 on a break (2 on a folder without one)."""
    same = {b: "00ff" for b in T.BOUNDARIES}
    T.write_step(tmp_path, 1, [{"request_id": "a", "index": 0, "digests": same}])
    T.write_step(tmp_path, 2, [{"request_id": "b", "index": 0, "digests": same},
                               {"request_id": "c", "index": 1, "digests": {**same, "trainer input": "0100",
                                                                             "router": "0100"}}])
    report = T.check(tmp_path)
    assert (report.steps, report.samples, report.boundaries) == (2, 3, T.BOUNDARIES)
    (found,) = report.breaks
    assert (found.step, found.request_id, found.before, found.boundary) == (2, "c", "batch", "trainer input")
    out = subprocess.run([sys.executable, DOCTOR, "--trace", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "sample c" in out.stdout and "'batch' and 'trainer input'" in out.stdout, out
    empty = subprocess.run([sys.executable, DOCTOR, "--trace", str(tmp_path / "none")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "no trace" in empty.stderr
