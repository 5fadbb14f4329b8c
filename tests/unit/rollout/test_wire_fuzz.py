"""An engine's response is outside data: whatever bytes come back, ``samples_from_body`` gives samples that hold
the contract or r3rl's own error naming the engine, the sample and the request (``EngineError``,
``RoutedExpertsError``), never another exception (issue 59). Routes payloads of any shape, dtype, base64 and .npy
header (a pickle included: never unpickled), log-prob lists, token lists, weight-version labels. Reproductions
first, then Hypothesis with a fixed example budget, derandomised."""

from __future__ import annotations

import base64
import io
import json
import math
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3rl.rollout.errors import EngineError
from r3rl.rollout.routed_experts import RoutedExpertsError, RouteSpec, b64_to_npy_array, encode_routed_experts
from r3rl.rollout.wire import samples_from_body

FUZZ = settings(max_examples=200, derandomize=True, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SPEC = RouteSpec(num_layers=2, topk=2, num_experts=4)
PROMPT = [11, 12, 13]
OURS = (EngineError, RoutedExpertsError)


def good_routes(rows: int) -> str:
    return encode_routed_experts(np.tile(np.array([[0, 1], [2, 3]], np.uint8), (rows, 1, 1)))


def choice(**over):
    tokens = over.pop("token_ids", [5, 6])
    out = {"index": 0, "finish_reason": "length", "token_ids": tokens,
           "routed_experts": good_routes(len(PROMPT) + 2 - 1),
           "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}]},
           "weight_versions": [{"version": "default", "start": 0, "end": 2}]}
    out.update(over)
    return out


def parse(raw: bytes):
    return samples_from_body(raw, url="http://e:1", first_index=3, count=1, request_id="rid-3", group=1,
                             prompt=PROMPT, routes=SPEC)


def check(raw: bytes) -> None:
    """The one outcome allowed."""
    try:
        samples = parse(raw)
    except OURS as err:
        assert "rid-3" in str(err) or "http://e:1" in str(err), err
        return
    (s,) = samples
    assert s.response_ids.dtype == np.int32 and len(s.rollout_logprobs) == len(s.response_ids)
    assert np.isfinite(s.rollout_logprobs).all()
    assert s.routed_experts.shape == (len(PROMPT) + len(s.response_ids) - 1, 2, 2)


@pytest.mark.parametrize("over", [
    {"token_ids": [5, 2 ** 40]},  # past int32: OverflowError from NumPy
    {"token_ids": [5, "6"]},  # NumPy parsed the string into a token id
    {"token_ids": [5, 6.7]},  # truncated to 6
    {"token_ids": [5, [6]]},
    {"token_ids": [5, -1]},
    {"token_ids": "56"},
    {"logprobs": {"content": [{"logprob": -0.5}, {"logprob": -10 ** 400}]}},  # OverflowError in float32
    {"weight_versions": [{"version": "9" * 5000, "start": 0, "end": 2}]},  # int() past the int-string limit
    {"weight_versions": [{"version": "\u00b2", "start": 0, "end": 2}]},  # isdigit() but not int()
])
def test_responses_that_raised_another_exception_name_the_sample(over):
    """Each raised NumPy's or Python's own exception (or, for "6" and 6.7, was silently taken as a token id).
    Fails if one gets out of ``samples_from_body`` as anything but EngineError."""
    with pytest.raises(EngineError, match="sample 3 \\(request rid-3\\)"):
        parse(json.dumps({"choices": [choice(**over)]}).encode())


def test_a_body_nested_past_the_recursion_limit_is_an_engine_error():
    with pytest.raises(EngineError, match="rid-3.*not JSON"):
        parse(b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def npy(arr: np.ndarray, allow_pickle: bool = False) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return base64.b64encode(buf.getvalue()).decode()


class Boom:
    def __reduce__(self):  # what unpickling would run
        return (exec, ("raise SystemExit('unpickled')",))


def test_a_pickled_payload_is_refused_unread():
    """Fails if the decoder ever unpickles (Boom would run)."""
    with pytest.raises(RoutedExpertsError, match="Python objects"):
        b64_to_npy_array(npy(np.array([Boom()], dtype=object), allow_pickle=True), sample_index=3, request_id="r")


def test_a_header_with_a_negative_or_impossible_dim_is_refused():
    """Found by the fuzz: shapes ``(0, -1)`` and ``(0, 5318, 5318, 326131734965)`` hold 0 elements, so the size check
    passed and ``reshape`` raised. Fails if such dims pass the header check."""
    for shape in ((0, -1), (0, 5318, 5318, 326131734965)):  # the second: no array that big (numpy's own error)
        header = {"descr": "|u1", "fortran_order": False, "shape": shape}
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, header)
        with pytest.raises(RoutedExpertsError, match="malformed .npy header"):
            b64_to_npy_array(base64.b64encode(buf.getvalue()).decode(), sample_index=3, request_id="r")


def test_a_header_whose_shape_overflows_int64_is_refused():
    """A crafted header: the product of its dims wraps around int64 (np.prod) to the bytes that follow. Fails if
    the size check multiplies in int64."""
    header = {"descr": "|u1", "fortran_order": False, "shape": (2 ** 62, 4)}  # 2**64 wraps to 0 bytes
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    raw = buf.getvalue()
    with pytest.raises(RoutedExpertsError, match="malformed .npy header|size does not match"):
        b64_to_npy_array(base64.b64encode(raw).decode(), sample_index=3, request_id="r")


DTYPES = st.sampled_from(["|u1", "<u2", ">u2", "<i4", "<i8", "<f4", "<f2", "|b1", "<U3", "|S2", "<c8"])
SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@st.composite
def npy_payloads(draw):
    kind = draw(st.sampled_from(["array", "header", "bytes", "text", "pickle", "good", "other"]))
    if kind == "array":
        shape = draw(SHAPES)
        n = math.prod(shape)
        arr = np.array(draw(st.lists(st.integers(-3, 300), min_size=n, max_size=n)), dtype=np.int64).reshape(shape)
        return npy(arr.astype(np.dtype(draw(DTYPES))))
    if kind == "header":  # any header numpy writes, then any bytes: a lying shape, a truncated body
        header = {"descr": draw(DTYPES), "fortran_order": draw(st.booleans()),
                  "shape": tuple(draw(st.lists(st.integers(-2, 2 ** 40), max_size=4)))}
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, header)
        return base64.b64encode(buf.getvalue() + draw(st.binary(max_size=64))).decode()
    if kind == "bytes":
        return base64.b64encode(b"\x93NUMPY" + draw(st.binary(max_size=200))).decode()
    if kind == "text":
        return draw(st.text(max_size=60))
    if kind == "pickle":
        return base64.b64encode(pickle.dumps(draw(st.lists(st.integers(), max_size=3)))).decode()
    if kind == "good":
        return good_routes(draw(st.integers(0, 6)))
    return draw(st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=3)))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=3), max_leaves=8)
TOKEN_LISTS = st.one_of(st.lists(st.integers(-2, 2 ** 33), max_size=4), st.lists(JSON, max_size=3), JSON)
LOGPROB_LISTS = st.one_of(
    st.lists(st.fixed_dictionaries({"logprob": st.one_of(st.floats(), st.integers(), JSON)}), max_size=4),
    JSON)
VERSIONS = st.one_of(st.lists(st.fixed_dictionaries({"version": st.one_of(
    st.just("default"), st.integers(0, 9).map(str), st.text(max_size=6), JSON)}), max_size=3), JSON)


@FUZZ
@given(routed=npy_payloads(), tokens=TOKEN_LISTS, logprobs=LOGPROB_LISTS, versions=VERSIONS,
       finish=st.sampled_from(["stop", "length", "abort", "error", None, 7]), index=st.sampled_from([0, 1, "0"]))
def test_any_response_parses_or_names_the_sample(routed, tokens, logprobs, versions, finish, index):
    check(json.dumps({"choices": [{"index": index, "finish_reason": finish, "token_ids": tokens,
                                   "routed_experts": routed, "logprobs": {"content": logprobs},
                                   "weight_versions": versions}]}).encode())


@FUZZ
@given(routed=npy_payloads(), rows=st.integers(0, 4))
def test_any_routes_payload_decodes_or_names_the_sample(routed, rows):
    """The routes alone, beside a well-formed rest of the response."""
    tokens = list(range(5, 5 + max(rows - len(PROMPT) + 1, 1)))
    check(json.dumps({"choices": [choice(routed_experts=routed, token_ids=tokens,
                                         logprobs={"content": [{"logprob": -0.5}] * len(tokens)},
                                         weight_versions=[{"version": "default", "start": 0,
                                                           "end": len(tokens)}])]}).encode())


@FUZZ
@given(raw=st.binary(max_size=300))
def test_any_bytes_as_a_response(raw):
    check(raw)
