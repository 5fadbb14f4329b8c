"""The distinct-ids check: the SWAR kernel (Numba and NumPy builds) against a plain sort-based reference."""

from __future__ import annotations

import numpy as np
import pytest

from r3rl.rollout import _kernels


def reference(rows: np.ndarray) -> bool:
    s = np.sort(rows, axis=1)
    return bool((s[:, 1:] == s[:, :-1]).any())


def distinct_rows(n: int, k: int, experts: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n, experts)), axis=1)[:, :k].astype(dtype)


@pytest.mark.parametrize("use_numba", [True, False])
@pytest.mark.parametrize("dtype,k,experts", [(np.uint8, 8, 128), (np.uint16, 4, 300), (np.uint8, 2, 8),
                                             (np.uint8, 3, 16), (np.uint16, 8, 1000)])
def test_matches_reference_with_duplicates_planted_anywhere(use_numba, dtype, k, experts):
    if use_numba:
        pytest.importorskip("numba")
    rows = distinct_rows(40_000, k, experts, dtype, seed=k)
    assert not _kernels.has_duplicate_rows(rows, use_numba=use_numba)
    rng = np.random.default_rng(1)
    for _ in range(12):
        bad = rows.copy()
        r = int(rng.integers(len(rows)))
        i, j = rng.choice(k, size=2, replace=False)
        bad[r, j] = bad[r, i]
        assert reference(bad)
        assert _kernels.has_duplicate_rows(bad, use_numba=use_numba)
        assert _kernels.first_duplicate_row(bad) == r


def test_chunk_boundaries_and_expert_zero():
    rows = distinct_rows(3 * _kernels._CHUNK_WORDS + 5, 8, 64, np.uint8, seed=3)
    rows[-1] = [0, 1, 2, 3, 4, 5, 6, 7]  # id 0 is a valid id, not a padding artefact
    assert not _kernels.has_duplicate_rows(rows, use_numba=False)
    rows[-1, 7] = 0
    assert _kernels.has_duplicate_rows(rows, use_numba=False)
    assert _kernels.first_duplicate_row(rows) == len(rows) - 1
