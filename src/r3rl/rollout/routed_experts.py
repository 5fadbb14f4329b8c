"""Routed experts on the wire (base64 of a ``.npy``) -> validated ``uint8/uint16 [T-1, L, K]`` arrays.

The contract (docs: r3-contract.md §1): an engine returns one row per token it forwarded, i.e. exactly
``len(tokens) - 1`` rows (vLLM documents and cuts there); any other count is an error, a surplus row included. The
payload is never unpickled and never widened: the array returned is a zero-copy view of the decoded bytes when the
wire dtype is already the narrow dtype of ``num_experts`` (read-only, like everything the engine reported).

Every error is a ``RoutedExpertsError`` naming the sample index, the request id and expected vs got, because the
batch it comes from may hold thousands of samples and the request id is what the engine log knows.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import threading
from dataclasses import dataclass

import numpy as np
import pybase64

from r3rl.rollout import route_scan
from r3rl.sample import routes_dtype

_NPY_MAGIC = b"\x93NUMPY"
# Header dicts are tiny; anything beyond this is not a payload vLLM wrote.
_MAX_HEADER_BYTES = 65536


class RoutedExpertsError(ValueError):
    """Routed experts that break the contract; the message says which sample, which request, expected vs got."""

    def __init__(self, sample_index: int | None, request_id: str | None, what: str,
                 expected: object = None, got: object = None, hint: str | None = None) -> None:
        self.sample_index = sample_index
        self.request_id = request_id
        self.what = what
        self.expected = expected
        self.got = got
        where = f"sample {sample_index} (request {request_id})"
        msg = f"{where}: routed experts {what}"
        if expected is not None or got is not None:
            msg += f": expected {expected}, got {got}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


@dataclass(frozen=True)
class RouteSpec:
    """What the trainer's model needs: layers (HF num_hidden_layers, what the engine returns), top-k, the number of
    routed experts, and the decoder layers with a dense MLP (GLM-4.5's and DeepSeek-V3's leading layers). vLLM
    returns a row for every decoder layer and leaves a dense layer's at 0; those rows are checked to be 0 and
    dropped, so a sample's routes hold the MoE layers only, in order (Megatron's routers)."""

    num_layers: int
    topk: int
    num_experts: int
    dense_layers: tuple[int, ...] = ()

    @functools.cached_property
    def moe_layers(self) -> list[int]:
        """Computed once per spec: ``check_routes`` reads it for every sample."""
        return [i for i in range(self.num_layers) if i not in self.dense_layers]

    @property
    def dtype(self) -> np.dtype:
        return routes_dtype(self.num_experts)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's routes on the wire: layers x top-k ids of ``dtype``."""
        return self.num_layers * self.topk * self.dtype.itemsize


_HEADER_PARSE_LOCK = threading.Lock()


def b64_to_npy_array(payload: object, *, sample_index: int | None = None,
                     request_id: str | None = None) -> np.ndarray:
    """base64(``.npy``) -> ndarray, refusing object arrays before anything is unpickled; zero-copy over the bytes."""

    def fail(what: str, expected: object = None, got: object = None, hint: str | None = None) -> RoutedExpertsError:
        return RoutedExpertsError(sample_index, request_id, what, expected, got, hint)

    if not isinstance(payload, (str, bytes)):
        raise fail("payload has the wrong type", "a base64 string", type(payload).__name__)
    try:
        # pybase64: SIMD decoding at memory-copy speed (the standard library's is ~40x slower on a 16 MB payload);
        # validate=True: a stray character is an error here, not silently skipped into a shifted decode
        raw = pybase64.b64decode(payload, validate=True)
    except ValueError as err:  # binascii.Error, and non-ASCII characters in a str
        raise fail("payload is not valid base64", hint=str(err)) from None
    if not raw.startswith(_NPY_MAGIC):
        raise fail("payload is not an .npy file", f"magic {_NPY_MAGIC!r}", repr(raw[:6]))
    head = io.BytesIO(raw[: _MAX_HEADER_BYTES + 16])
    try:
        # numpy parses the header with ast.literal_eval, which CPython 3.11 does not make safe across threads
        # ("AST constructor recursion depth mismatch" under concurrent decodes in the client's worker threads)
        with _HEADER_PARSE_LOCK:
            version = np.lib.format.read_magic(head)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(
                    head, max_header_size=_MAX_HEADER_BYTES)
            elif version in ((2, 0), (3, 0)):
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(
                    head, max_header_size=_MAX_HEADER_BYTES)
            else:
                raise ValueError(f"unsupported .npy version {version}")
    except Exception as err:  # NumPy's header parser raises ValueError, SyntaxError or (Python 3.12)
        # tokenize.TokenError for the same kind of garbage: each of them is a malformed header
        raise fail("payload has a malformed .npy header", hint=f"{type(err).__name__}: {err}") from None
    # numpy's parser takes negative dims, and dims whose product no array can have (beside a 0 dim the size check
    # passes): a reshape would fail past every check below
    if any(d < 0 for d in shape) or math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2 ** 62:
        raise fail("payload has a malformed .npy header", "dims >= 0 of a size an array can have",
                   f"shape {shape}"[:200])
    if dtype.hasobject:
        raise fail("payload holds Python objects (refused: it would need unpickling)", "an integer dtype", str(dtype))
    offset = head.tell()
    count = math.prod(shape)  # exact: np.prod wraps around int64 for a crafted header, to a size that matches
    if len(raw) - offset != count * dtype.itemsize:
        raise fail("payload size does not match its .npy header", f"{count * dtype.itemsize} data bytes",
                   f"{len(raw) - offset}", hint=f"shape {shape}, dtype {dtype}")
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    if fortran_order:
        return np.ascontiguousarray(flat.reshape(shape[::-1]).T)
    return flat.reshape(shape)


def check_routes(arr: np.ndarray, num_tokens: int, spec: RouteSpec, *, sample_index: int | None = None,
                 request_id: str | None = None, first_row: int = 0) -> np.ndarray:
    """Validate a decoded ``[rows, L, K]`` array against a sample of ``num_tokens`` tokens whose rows from
    ``first_row`` on were asked for; returns it narrow, over the MoE layers only (``spec.dense_layers`` dropped).

    Checks, in the order that gives the most telling message first: integer dtype, 3 dims, rows == T-1-first_row,
    (L, K), dense layers all zero, no MoE layer all zero (K > 1), ids < E, K distinct ids per row.
    """

    def fail(what: str, expected: object = None, got: object = None, hint: str | None = None) -> RoutedExpertsError:
        return RoutedExpertsError(sample_index, request_id, what, expected, got, hint)

    if arr.dtype.kind not in "iu":
        raise fail("have a non-integer dtype", "uint8/uint16 (or another integer dtype)", str(arr.dtype))
    if arr.ndim != 3:
        raise fail("have the wrong number of dimensions", "3 (tokens-1, layers, top-k)", f"{arr.ndim} {arr.shape}")
    rows, layers, topk = arr.shape
    expected_rows = num_tokens - 1 - first_row
    if rows != expected_rows:
        # a surplus row is refused too: at the front it would shift every row by one token and still fit
        counted = f"len(tokens) - 1 = {num_tokens} - 1" if not first_row else \
            f"len(tokens) - 1 - routed_experts_prompt_start = {num_tokens} - 1 - {first_row}"
        raise fail("cover the wrong number of tokens", f"{expected_rows} rows ({counted})",
                   f"{rows} rows", hint="engine/client token bookkeeping disagree")
    if (layers, topk) != (spec.num_layers, spec.topk):
        raise fail("have the wrong (layers, top-k)", (spec.num_layers, spec.topk), (layers, topk),
                   hint="is the engine serving the model the trainer is configured for?")
    if spec.dense_layers:
        dense = list(spec.dense_layers)
        if rows and arr[:, dense].any():
            routed = [layer for layer in dense if arr[:, layer].any()]
            raise fail("route tokens in layers the model config makes dense", f"all-zero rows in dense layers {dense}",
                       f"experts in layers {routed}", hint="the engine's model has MoE blocks where model."
                       "first_k_dense says dense: every replayed layer would be off by one (verl #5037)")
        arr = np.ascontiguousarray(arr[:, spec.moe_layers])
        layers = arr.shape[1]
    if arr.dtype != spec.dtype:
        # a wider (or signed) wire dtype than vLLM's: range-check it before it is narrowed (rare, NumPy is enough)
        if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise fail("contain negative expert ids", ">= 0", int(arr.min()))
        if arr.size and int(arr.max()) >= spec.num_experts:
            _raise_out_of_range(arr, spec, fail)
        arr = arr.astype(spec.dtype)
    if rows == 0:
        return arr
    layer_max, has_duplicate = route_scan.scan_routes(arr)
    if topk > 1:
        # K > 1 distinct ids cannot all be 0: an all-zero layer means the capture never ran for it
        zero_layers = [spec.moe_layers[i] for i in np.flatnonzero(layer_max == 0)] if spec.dense_layers \
            else np.flatnonzero(layer_max == 0).tolist()
        if zero_layers:
            raise fail("are all zero for MoE layers", "at least one non-zero id per MoE layer",
                       f"layers {zero_layers} all zero", hint="capture not bound, or engine stages not aggregated; "
                       "refusing to replay expert 0 everywhere")
    if int(layer_max.max()) >= spec.num_experts:
        _raise_out_of_range(arr, spec, fail)
    if has_duplicate:
        flat_row = route_scan.first_duplicate_row(arr.reshape(-1, topk))
        row, layer = divmod(flat_row, layers)
        raise fail("repeat an expert within a row", f"{topk} distinct ids per (token, layer)",
                   f"{arr[row, layer].tolist()} at token row {row}, layer {layer}")
    return arr


def _raise_out_of_range(arr: np.ndarray, spec: RouteSpec, fail) -> None:
    row, layer = (int(v) for v in np.argwhere(arr >= spec.num_experts)[0][:2])
    raise fail("contain an expert id out of range", f"ids < num_experts = {spec.num_experts}",
               f"id {int(arr.max())} (first bad: token row {row}, layer {layer}: {arr[row, layer].tolist()})")


def decode_routed_experts(payload: object, num_tokens: int, spec: RouteSpec, *, sample_index: int | None = None,
                          request_id: str | None = None, first_row: int = 0) -> np.ndarray:
    """Wire payload -> validated narrow ``[num_tokens - 1 - first_row, L, K]`` array (see ``check_routes``)."""
    arr = b64_to_npy_array(payload, sample_index=sample_index, request_id=request_id)
    return check_routes(arr, num_tokens, spec, sample_index=sample_index, request_id=request_id, first_row=first_row)


def routes_for_sample(payload: object, *, aborted: bool, prompt_len: int, response_len: int, spec: RouteSpec,
                      sample_index: int | None = None, request_id: str | None = None,
                      first_row: int = 0) -> np.ndarray | None:
    """The per-sample rule, with status already taken from ``finish_reason``: ``None`` is legal only for an
    aborted request that produced no token (the engine never forwarded it). ``first_row``: the request asked for the
    rows from that one on (``routed_experts_prompt_start``)."""
    if payload is None:
        if aborted and response_len == 0:
            return None
        raise RoutedExpertsError(
            sample_index, request_id, "are missing", "a base64 .npy payload", "None",
            hint=("engine launched without --enable-return-routed-experts?" if not aborted else
                  f"aborted after {response_len} tokens, which must carry routes"))
    return decode_routed_experts(payload, prompt_len + response_len, spec, sample_index=sample_index,
                                 request_id=request_id, first_row=first_row)


def encode_routed_experts(arr: np.ndarray) -> str:
    """ndarray -> base64(``.npy``), the wire format vLLM uses (tests and benchmarks build payloads with it)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")
