"""The validation pass over routes (layer maxima + distinct ids): the Numba and NumPy builds against a plain
sort-based reference, and Numba failing for real in a fresh process (decodes must still work, after one warning)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from r3rl.rollout import route_scan


def reference(routes: np.ndarray) -> tuple[list[int], bool]:
    s = np.sort(routes, axis=-1)
    return routes.max(axis=(0, 2)).tolist(), bool((s[..., 1:] == s[..., :-1]).any())


def distinct_routes(rows: int, layers: int, k: int, experts: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :k].astype(dtype)


@pytest.mark.parametrize("use_numba", [True, False])
@pytest.mark.parametrize("dtype,k,experts", [(np.uint8, 8, 128), (np.uint16, 4, 300), (np.uint8, 2, 8),
                                             (np.uint8, 3, 16), (np.uint16, 8, 1000)])
def test_matches_reference_with_duplicates_planted_anywhere(use_numba, dtype, k, experts):
    if use_numba:
        pytest.importorskip("numba")
    routes = distinct_routes(5_000, 6, k, experts, dtype, seed=k)
    layer_max, dup = route_scan.scan_routes(routes, use_numba=use_numba)
    assert (layer_max.tolist(), dup) == reference(routes)
    rng = np.random.default_rng(1)
    for _ in range(12):
        bad = routes.copy()
        r, layer = int(rng.integers(len(routes))), int(rng.integers(6))
        i, j = rng.choice(k, size=2, replace=False)
        bad[r, layer, j] = bad[r, layer, i]
        assert reference(bad)[1]
        assert route_scan.scan_routes(bad, use_numba=use_numba)[1]
        assert route_scan.first_duplicate_row(bad.reshape(-1, k)) == r * 6 + layer


@pytest.mark.parametrize("use_numba", [True, False])
def test_layer_maxima_see_every_row_and_lane(use_numba):
    routes = distinct_routes(1_000, 4, 8, 64, np.uint8, seed=5)
    routes[:, 2] = np.arange(8, dtype=np.uint8)  # layer 2: ids 0..7 only
    routes[-1, 2, 7] = 100  # one large id in the last row's last lane
    layer_max, _ = route_scan.scan_routes(routes, use_numba=use_numba)
    assert layer_max.tolist() == reference(routes)[0] and layer_max[2] == 100


def test_chunk_boundaries_and_expert_zero():
    rows = distinct_routes(3 * route_scan._CHUNK_WORDS + 5, 1, 8, 64, np.uint8, seed=3)[:, 0]
    rows[-1] = [0, 1, 2, 3, 4, 5, 6, 7]  # id 0 is a valid id, not a padding artefact
    assert not route_scan.has_duplicate_rows(rows)
    rows[-1, 7] = 0
    assert route_scan.has_duplicate_rows(rows)
    assert route_scan.first_duplicate_row(rows) == len(rows) - 1


_DECODE = """
import warnings
import numpy as np
from r3rl.rollout import route_scan
from r3rl.rollout.routed_experts import RouteSpec, RoutedExpertsError, decode_routed_experts, encode_routed_experts
spec = RouteSpec(num_layers=4, topk=8, num_experts=128)
rng = np.random.default_rng(0)
arr = np.argsort(rng.random((99, 4, 128)), axis=-1)[..., :8].astype(np.uint8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        assert np.array_equal(decode_routed_experts(encode_routed_experts(arr), 100, spec), arr)
    arr[50, 3, 7] = arr[50, 3, 2]
    try:
        decode_routed_experts(encode_routed_experts(arr), 100, spec)
        raise SystemExit("duplicate not found")
    except RoutedExpertsError as err:
        assert "token row 50, layer 3" in str(err), err
print("kernel:", "numba" if route_scan._compiled else "numpy")
print("warnings:", len(caught))
for w in caught:
    print("warning:", w.message)
"""


def run_decode(env_extra: dict[str, str], tmp_path) -> str:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", _DECODE], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_numba_without_a_writable_cache_folder_still_decodes(tmp_path):
    """The real failure: Numba restricted to a cache folder it cannot create (a path below a plain file, which
    even root cannot write) raises "cannot cache function ...: no locator available" when the kernel is set up."""
    pytest.importorskip("numba")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    text = run_decode({"NUMBA_CACHE_DIR": str(blocker / "cache"),
                       "NUMBA_CACHE_LOCATOR_CLASSES": "UserProvidedCacheLocator"}, tmp_path)
    assert "kernel: numba" in text and "warnings: 1" in text, text
    assert "no locator available" in text and "compiling it in memory" in text, text


def test_numba_that_fails_to_import_falls_back_to_numpy(tmp_path):
    """An install whose import raises something other than ImportError (as a broken llvmlite does: OSError). This
    fault cannot be caused for real without breaking the venv, so a stand-in ``numba`` package shadows it."""
    fake = tmp_path / "shadow" / "numba"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise OSError('could not load libllvmlite.so (stand-in)')\n")
    text = run_decode({"PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])},
                      tmp_path)
    assert "kernel: numpy" in text and "warnings: 1" in text, text
    assert "OSError: could not load libllvmlite.so" in text and "NumPy path" in text, text


def test_numba_with_jit_disabled_uses_numpy_not_a_python_loop(tmp_path):
    pytest.importorskip("numba")
    text = run_decode({"NUMBA_DISABLE_JIT": "1"}, tmp_path)
    assert "kernel: numpy" in text and "warnings: 1" in text and "NUMBA_DISABLE_JIT" in text, text
