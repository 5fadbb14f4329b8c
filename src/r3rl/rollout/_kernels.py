"""The one hot loop of route validation: "are the K ids of every (token, layer) row distinct?".

For a 32K-token sample of Qwen3-30B-A3B that is 1.5M rows of 8 ids; done naively (sort, or 28 pairwise compares)
it costs more than decoding the base64 payload. When a row is exactly 8 bytes (uint8 x 8, uint16 x 4) it is one
uint64 word, and "two lanes are equal" is "the word XOR a lane-rotation of itself has a zero lane", a
branch-free SWAR test: rotations by 1..K/2 lanes cover every pair. Numba (a vLLM dependency, so present next to
any engine) compiles it to one pass; without Numba a chunked NumPy version of the same test runs instead.
Other row widths use plain pairwise compares (small K: few compares).
"""

from __future__ import annotations

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


_compiled: dict[int, object] | None = None


def _get_swar_compiled(itemsize: int = 1):
    """The Numba kernel for lanes of ``itemsize`` bytes, compiled on first use (cached on disk by Numba); None
    when Numba is unavailable. One kernel per lane width, with the rotations as literals: constant shifts let
    LLVM vectorise the loop (variable ones made it ~8x slower)."""
    global _compiled
    if _compiled is None:
        try:
            import numba
        except ImportError:
            _compiled = {}
            return None

        @numba.njit(cache=True, nogil=True)
        def lanes8(words):  # pragma: no cover - compiled
            lo = np.uint64(0x0101010101010101)
            acc = np.uint64(0)
            for i in range(words.shape[0]):
                v = words[i]
                for sh in (8, 16, 24, 32):
                    x = v ^ ((v >> np.uint64(sh)) | (v << np.uint64(64 - sh)))
                    acc |= (x - lo) & ~x
            return (acc & np.uint64(0x8080808080808080)) != np.uint64(0)

        @numba.njit(cache=True, nogil=True)
        def lanes16(words):  # pragma: no cover - compiled
            lo = np.uint64(0x0001000100010001)
            acc = np.uint64(0)
            for i in range(words.shape[0]):
                v = words[i]
                for sh in (16, 32):
                    x = v ^ ((v >> np.uint64(sh)) | (v << np.uint64(64 - sh)))
                    acc |= (x - lo) & ~x
            return (acc & np.uint64(0x8000800080008000)) != np.uint64(0)

        _compiled = {1: lanes8, 2: lanes16}
    return _compiled.get(itemsize)


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


def has_duplicate_rows(rows: np.ndarray, *, use_numba: bool | None = None) -> bool:
    """True when some row of ``rows`` (2-D, unsigned ints, C-contiguous rows) repeats an id."""
    n, k = rows.shape
    if n == 0 or k < 2:
        return False
    if rows.dtype.itemsize * k == 8 and rows.dtype.kind == "u" and rows.flags.c_contiguous:
        words = rows.view(np.uint64).reshape(n)
        lo, hi, bits = _lane_constants(rows.dtype.itemsize)
        kernel = _get_swar_compiled(rows.dtype.itemsize) if use_numba is not False else None
        if kernel is not None:
            return bool(kernel(words))
        if use_numba:
            raise RuntimeError("numba requested but not importable")
        return _swar_numpy(words, lo, hi, bits, k)
    return _pairwise_any_equal(rows)


def first_duplicate_row(rows: np.ndarray) -> int:
    """Index of the first row that repeats an id (error path only: clarity over speed); -1 when none."""
    ordered = np.sort(rows, axis=1)
    bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    return int(bad[0]) if bad.size else -1
