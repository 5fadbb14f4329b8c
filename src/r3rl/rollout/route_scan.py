"""The one hot loop of route validation: one pass over a sample's ``[rows, L, K]`` routes that gives each layer's
largest id (ids < E, and no MoE layer all zero) and whether some (token, layer) row repeats an id.

For a 32K-token sample of Qwen3-30B-A3B that is 1.5M rows of 8 ids; done naively (sort, or 28 pairwise compares)
it costs far more than decoding the base64 payload. When a row is exactly 8 bytes (uint8 x 8, uint16 x 4) it is one
uint64 word, and "two lanes are equal" is "the word XOR a lane-rotation of itself has a zero lane", a
branch-free SWAR test: rotations by 1..K/2 lanes cover every pair. Numba (a vLLM dependency, so present next to
any engine) compiles the whole pass into one loop. Without Numba, or when Numba fails in any way (an install that
does not import, no writable cache folder, a compile error), a chunked NumPy version of the same test runs instead,
after one warning: same answers, about 12 ms more per 32K-token sample. Other row widths use NumPy: the layer
maxima, then plain pairwise compares (small K: few compares).
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

_CHUNK_WORDS = 1 << 14  # NumPy path: keep the temporaries in L2


def _lane_constants(itemsize: int) -> tuple[int, int, int]:
    """(lowest bit of each lane, highest bit of each lane, lane bits) for lanes of ``itemsize`` bytes in a word."""
    bits = 8 * itemsize
    lo = 0
    for lane in range(64 // bits):
        lo |= 1 << (lane * bits)
    return lo, lo << (bits - 1), bits


def _swar_numpy(words: np.ndarray, lo: int, hi: int, bits: int, lanes: int) -> bool:
    lo_, mask = np.uint64(lo), np.uint64(hi)
    n = words.shape[0]
    size = min(n, _CHUNK_WORDS)
    rot, x, y, acc = (np.empty(size, np.uint64) for _ in range(4))
    for start in range(0, n, size):
        w = words[start:start + size]
        m = w.shape[0]
        r, xx, yy, a = rot[:m], x[:m], y[:m], acc[:m]
        a.fill(0)
        for s in range(1, lanes // 2 + 1):
            sh = s * bits
            np.right_shift(w, np.uint64(sh), out=r)
            np.left_shift(w, np.uint64(64 - sh), out=yy)
            np.bitwise_or(r, yy, out=r)
            np.bitwise_xor(w, r, out=xx)
            # classic "has a zero lane": (x - lo) & ~x & hi, exact as a yes/no per word
            np.subtract(xx, lo_, out=yy)
            np.invert(xx, out=xx)
            np.bitwise_and(yy, xx, out=yy)
            np.bitwise_or(a, yy, out=a)
        np.bitwise_and(a, mask, out=a)
        if a.any():
            return True
    return False


# The Numba kernels, as plain functions compiled on first use. One per lane width, with the rotations as literals:
# constant shifts let LLVM vectorise the loop (variable ones made it ~8x slower). ``flat`` is ``[rows, L*K]`` (for
# the column maxima), ``words`` the same memory as ``[rows, L]`` uint64 (one word per (token, layer) row).

def _scan_lanes8(flat, words):  # pragma: no cover - compiled
    col_max = np.zeros(flat.shape[1], flat.dtype)
    lo = np.uint64(0x0101010101010101)
    acc = np.uint64(0)
    for i in range(flat.shape[0]):
        for j in range(flat.shape[1]):
            col_max[j] = max(col_max[j], flat[i, j])
        for j in range(words.shape[1]):
            v = words[i, j]
            for sh in (8, 16, 24, 32):
                x = v ^ ((v >> np.uint64(sh)) | (v << np.uint64(64 - sh)))
                acc |= (x - lo) & ~x
    return col_max, (acc & np.uint64(0x8080808080808080)) != np.uint64(0)


def _scan_lanes16(flat, words):  # pragma: no cover - compiled
    col_max = np.zeros(flat.shape[1], flat.dtype)
    lo = np.uint64(0x0001000100010001)
    acc = np.uint64(0)
    for i in range(flat.shape[0]):
        for j in range(flat.shape[1]):
            col_max[j] = max(col_max[j], flat[i, j])
        for j in range(words.shape[1]):
            v = words[i, j]
            for sh in (16, 32):
                x = v ^ ((v >> np.uint64(sh)) | (v << np.uint64(64 - sh)))
                acc |= (x - lo) & ~x
    return col_max, (acc & np.uint64(0x8000800080008000)) != np.uint64(0)


_compiled: dict[int, object] | None = None  # lane bytes -> kernel; {} once Numba is given up
_setup = threading.RLock()  # responses are decoded in worker threads: set Numba up (and warn) once


def _give_up_numba(reason: str) -> dict:
    global _compiled
    with _setup:
        if _compiled == {}:
            return _compiled  # another thread gave up first and warned
        _compiled = {}
    warnings.warn(f"routed-experts validation runs without Numba ({reason}); the NumPy path gives the same "
                  "answers, about 12 ms slower per 32K-token sample", RuntimeWarning, stacklevel=3)
    return _compiled


def _numba_kernels() -> dict:
    """The compiled kernels, or ``{}`` when Numba is unavailable (warned once). Cached on disk by Numba when it has
    a writable cache folder; compiled in memory (about a second per process) when it has none."""
    if _compiled is not None:
        return _compiled
    with _setup:
        return _compiled if _compiled is not None else _set_up_numba()


def _set_up_numba() -> dict:
    global _compiled
    try:
        import numba
    except Exception as err:  # not installed, or an install that fails to import (e.g. llvmlite's library)
        return _give_up_numba(f"import failed: {type(err).__name__}: {err}")
    if numba.config.DISABLE_JIT:
        return _give_up_numba("NUMBA_DISABLE_JIT is set: the kernel would run as a Python loop")
    try:
        kernels = {1: numba.njit(cache=True, nogil=True)(_scan_lanes8),
                   2: numba.njit(cache=True, nogil=True)(_scan_lanes16)}
    except Exception as err:  # "cannot cache function ...: no locator available": no writable cache folder
        warnings.warn(f"Numba cannot cache the routed-experts kernel ({err}); compiling it in memory in every "
                      "process (set NUMBA_CACHE_DIR to a writable folder to keep it)", RuntimeWarning, stacklevel=2)
        kernels = {1: numba.njit(nogil=True)(_scan_lanes8), 2: numba.njit(nogil=True)(_scan_lanes16)}
    _compiled = kernels
    return _compiled


def _pairwise_any_equal(rows: np.ndarray) -> bool:
    k = rows.shape[1]
    step = max(1, (1 << 20) // max(1, k))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        for i in range(k):
            for j in range(i + 1, k):
                if np.any(chunk[:, i] == chunk[:, j]):
                    return True
    return False


def scan_routes(routes: np.ndarray, *, use_numba: bool = True) -> tuple[np.ndarray, bool]:
    """``(layer_max [L], has_duplicate)`` of ``routes [rows, L, K]`` (unsigned ints): each layer's largest id, and
    whether some (token, layer) row repeats an id. ``use_numba=False`` forces the NumPy path (tests)."""
    rows, layers, k = routes.shape
    flat = routes.reshape(rows, layers * k)
    if rows == 0:
        return np.zeros(layers, routes.dtype), False
    word_rows = routes.dtype.kind == "u" and routes.dtype.itemsize * k == 8 and routes.flags.c_contiguous
    kernel = _numba_kernels().get(routes.dtype.itemsize) if word_rows and use_numba else None
    if kernel is not None:
        try:
            col_max, dup = kernel(flat, routes.view(np.uint64).reshape(rows, layers))
            return col_max.reshape(layers, k).max(axis=1), bool(dup)
        except Exception as err:  # a compile error at first use: same answers from NumPy from now on
            _give_up_numba(f"{type(err).__name__}: {err}")
    layer_max = flat.max(axis=0).reshape(layers, k).max(axis=1)
    return layer_max, has_duplicate_rows(routes.reshape(-1, k))


def has_duplicate_rows(rows: np.ndarray) -> bool:
    """True when some row of ``rows`` (2-D ints, one row per (token, layer)) repeats an id; NumPy only."""
    n, k = rows.shape
    if n == 0 or k < 2:
        return False
    if rows.dtype.itemsize * k == 8 and rows.dtype.kind == "u" and rows.flags.c_contiguous:
        lo, hi, bits = _lane_constants(rows.dtype.itemsize)
        return _swar_numpy(rows.view(np.uint64).reshape(n), lo, hi, bits, k)
    return _pairwise_any_equal(rows)


def first_duplicate_row(rows: np.ndarray) -> int:
    """Index of the first row that repeats an id (error path only: clarity over speed); -1 when none."""
    ordered = np.sort(rows, axis=1)
    bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    return int(bad[0]) if bad.size else -1
