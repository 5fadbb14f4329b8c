"""Decode and validation of routed experts with hand-made payloads: every rejection of the contract, each error
naming the sample index, the request id and expected vs got."""

from __future__ import annotations

import base64
import io
import pathlib

import numpy as np
import pytest

from r3rl.rollout.routed_experts import (
    RoutedExpertsError, RouteSpec, b64_to_npy_array, decode_routed_experts, encode_routed_experts, routes_for_sample,
)

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=8)


def valid(rows: int, layers: int = 3, topk: int = 2, experts: int = 8, dtype=np.uint8, seed: int = 0) -> np.ndarray:
    """Random routes with K distinct ids per row."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :topk]
    return ids.astype(dtype)


def decode(arr_or_payload, num_tokens: int, spec: RouteSpec = SPEC):
    payload = arr_or_payload if isinstance(arr_or_payload, (str, bytes)) else encode_routed_experts(arr_or_payload)
    return decode_routed_experts(payload, num_tokens, spec, sample_index=7, request_id="req-7")


def assert_names_sample(err: RoutedExpertsError, expected: str | None = None, got: str | None = None):
    text = str(err)
    assert "sample 7" in text and "req-7" in text
    if expected is not None:
        assert f"expected {expected}" in text, text
    if got is not None:
        assert f"got {got}" in text, text


def test_valid_payload_round_trips_without_copy_or_widening():
    arr = valid(9)
    out = decode(arr, num_tokens=10)
    assert out.dtype == np.uint8 and out.shape == (9, 3, 2)
    np.testing.assert_array_equal(out, arr)
    assert not out.flags.writeable  # a view of the decoded bytes, not a copy


def test_exactly_len_tokens_minus_one_rows_are_accepted():
    arr = valid(9)
    assert decode(arr, num_tokens=10).shape == (9, 3, 2)


@pytest.mark.parametrize("case", ["extra row at the back", "extra row at the front", "two extra", "one short",
                                  "two short"])
def test_any_other_row_count_is_refused_naming_request_sample_and_both_counts(case):
    arr = valid(12, seed=3)
    rows = {"extra row at the back": arr[:10], "extra row at the front": arr[2:12], "two extra": arr[:11],
            "one short": arr[:8], "two short": arr[:7]}[case]
    with pytest.raises(RoutedExpertsError, match="wrong number of tokens") as info:
        decode(rows, num_tokens=10)
    assert_names_sample(info.value, expected="9 rows (len(tokens) - 1 = 10 - 1)", got=f"{len(rows)} rows")


@pytest.mark.parametrize("layers,topk", [(4, 2), (3, 3)])
def test_layers_and_topk_must_match_the_model(layers, topk):
    with pytest.raises(RoutedExpertsError) as info:
        decode(valid(4, layers=layers, topk=topk), num_tokens=5)
    assert_names_sample(info.value, expected="(3, 2)", got=f"({layers}, {topk})")


def test_ids_must_be_below_num_experts():
    arr = valid(4)
    arr[2, 1, 0] = 8
    with pytest.raises(RoutedExpertsError) as info:
        decode(arr, num_tokens=5)
    assert_names_sample(info.value, expected="ids < num_experts = 8", got="id 8")
    assert "token row 2, layer 1" in str(info.value)


def test_rows_must_hold_k_distinct_ids():
    arr = valid(6)
    arr[4, 2] = [3, 3]
    with pytest.raises(RoutedExpertsError) as info:
        decode(arr, num_tokens=7)
    assert_names_sample(info.value, expected="2 distinct ids per (token, layer)", got="[3, 3] at token row 4, layer 2")


def test_duplicates_found_with_eight_lanes_in_every_position():
    spec = RouteSpec(num_layers=2, topk=8, num_experts=128)
    base = valid(5, layers=2, topk=8, experts=128)
    decode(base, 6, spec)
    for i in range(8):
        for j in range(i + 1, 8):
            arr = base.copy()
            arr[3, 1, j] = arr[3, 1, i]
            with pytest.raises(RoutedExpertsError, match="token row 3, layer 1"):
                decode(arr, 6, spec)


def test_an_all_zero_moe_layer_is_refused_before_replaying_expert_zero():
    arr = valid(5, layers=3)
    arr[:, 1, :] = 0
    with pytest.raises(RoutedExpertsError) as info:
        decode(arr, num_tokens=6)
    assert_names_sample(info.value, got="layers [1] all zero")


def test_wider_integer_payloads_are_narrowed_not_widened():
    wide = valid(4).astype(np.int32)
    out = decode(wide, num_tokens=5)
    assert out.dtype == np.uint8
    neg = wide.copy()
    neg[0, 0, 0] = -1
    with pytest.raises(RoutedExpertsError) as info:
        decode(neg, num_tokens=5)
    assert_names_sample(info.value, expected=">= 0", got="-1")


def test_more_than_256_experts_are_uint16():
    spec = RouteSpec(num_layers=2, topk=4, num_experts=300)
    arr = valid(3, layers=2, topk=4, experts=300, dtype=np.uint16)
    out = decode(arr, 4, spec)
    assert out.dtype == np.uint16
    arr[1, 1] = [299, 5, 299, 7]
    with pytest.raises(RoutedExpertsError, match="distinct"):
        decode(arr, 4, spec)


def test_float_and_wrong_rank_arrays_are_refused():
    with pytest.raises(RoutedExpertsError) as info:
        decode(valid(4).astype(np.float32), num_tokens=5)
    assert_names_sample(info.value, got="float32")
    with pytest.raises(RoutedExpertsError) as info:
        decode(valid(4).reshape(4, 6), num_tokens=5)
    assert_names_sample(info.value, expected="3 (tokens-1, layers, top-k)", got="2 (4, 6)")


def test_bad_base64_is_a_clear_error():
    payload = encode_routed_experts(valid(4))
    for broken in (payload[:-3] + "!!!", payload[:-1], "not base64 at all"):
        with pytest.raises(RoutedExpertsError, match="not valid base64") as info:
            decode(broken, num_tokens=5)
        assert_names_sample(info.value)


def test_non_npy_and_truncated_payloads_are_refused():
    with pytest.raises(RoutedExpertsError, match="not an .npy file"):
        decode(base64.b64encode(b"hello world!").decode(), num_tokens=5)
    raw = base64.b64decode(encode_routed_experts(valid(4)))
    with pytest.raises(RoutedExpertsError, match="size does not match") as info:
        decode(base64.b64encode(raw[:-5]).decode(), num_tokens=5)
    assert_names_sample(info.value, expected="24 data bytes", got="19")
    with pytest.raises(RoutedExpertsError, match="malformed .npy header"):
        decode(base64.b64encode(raw[:12] + b"{garbage" + raw[20:]).decode(), num_tokens=5)


def npy_with_header(header: bytes) -> bytes:
    """A version 1.0 .npy whose header dict is ``header`` (padded as NumPy pads it), followed by 4 data bytes."""
    header += b" " * ((64 - (10 + len(header) + 1) % 64) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(4)


@pytest.mark.parametrize("header", [b"{'descr': '|u1', 'shape': ((", b"{'descr': '''", b"{garbage",
                                    b"{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2), 'x': }"])
def test_any_error_of_the_npy_header_parser_is_a_malformed_header(header):
    # NumPy's parser raises ValueError, SyntaxError or tokenize.TokenError (any unbalanced header on 3.12, some
    # on 3.11 too): each must become the same clear error naming the sample, not escape as a tokenizer error
    with pytest.raises(RoutedExpertsError, match="malformed .npy header") as info:
        decode(base64.b64encode(npy_with_header(header)).decode(), num_tokens=5)
    assert_names_sample(info.value)


class _Armed:
    """Unpickling this touches a file: proof of whether a payload was ever unpickled."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_object_npy_is_refused_without_unpickling(tmp_path):
    marker = tmp_path / "unpickled"
    objects = np.empty(2, dtype=object)
    objects[:] = [_Armed(marker), _Armed(marker)]
    buf = io.BytesIO()
    np.save(buf, objects, allow_pickle=True)
    np.load(io.BytesIO(buf.getvalue()), allow_pickle=True)  # the payload is armed: loading it runs code
    assert marker.exists()
    marker.unlink()
    with pytest.raises(RoutedExpertsError, match="Python objects") as info:
        decode(base64.b64encode(buf.getvalue()).decode(), num_tokens=3)
    assert_names_sample(info.value, expected="an integer dtype", got="object")
    assert not marker.exists()


def test_payload_of_wrong_type_is_refused():
    with pytest.raises(RoutedExpertsError) as info:
        routes_for_sample([[1, 2]], aborted=False, prompt_len=2, response_len=1, spec=SPEC, sample_index=7,
                          request_id="req-7")
    assert_names_sample(info.value, expected="a base64 string", got="list")


def test_none_only_for_an_abort_before_any_token():
    assert routes_for_sample(None, aborted=True, prompt_len=5, response_len=0, spec=SPEC) is None
    with pytest.raises(RoutedExpertsError, match="--enable-return-routed-experts") as info:
        routes_for_sample(None, aborted=False, prompt_len=5, response_len=3, spec=SPEC, sample_index=7,
                          request_id="req-7")
    assert_names_sample(info.value, got="None")
    with pytest.raises(RoutedExpertsError, match="aborted after 2 tokens"):
        routes_for_sample(None, aborted=True, prompt_len=5, response_len=2, spec=SPEC, sample_index=7,
                          request_id="req-7")


def test_aborted_with_tokens_is_validated_like_any_sample():
    out = routes_for_sample(encode_routed_experts(valid(6)), aborted=True, prompt_len=5, response_len=2, spec=SPEC)
    assert out.shape == (6, 3, 2)


def test_fortran_order_npy_is_read_correctly():
    arr = valid(4)
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(arr))
    out = b64_to_npy_array(base64.b64encode(buf.getvalue()).decode())
    np.testing.assert_array_equal(out, arr)


DENSE_FIRST = RouteSpec(num_layers=4, topk=2, num_experts=8, dense_layers=(0,))


def test_dense_prefix_rows_are_checked_zero_and_dropped():
    """vLLM returns a row for every decoder layer and leaves a dense layer's at 0 (GLM-4.5, DeepSeek-V3): the sample
    keeps the MoE layers only, in order (Megatron's routers); fails if the dense rows were kept (every layer would
    be replayed one off, verl #5037) or dropped at the wrong end."""
    moe = valid(5, layers=3)
    engine = np.concatenate([np.zeros((5, 1, 2), np.uint8), moe], axis=1)
    got = decode(engine, 6, DENSE_FIRST)
    assert got.shape == (5, 3, 2) and np.array_equal(got, moe) and got.flags.c_contiguous


def test_dense_layer_with_experts_is_refused_naming_the_layers():
    """The engine's model routes a layer the model config makes dense: its layer map and the trainer's disagree."""
    engine = valid(5, layers=4)
    with pytest.raises(RoutedExpertsError, match=r"sample 7 \(request req-7\).*dense.*experts in layers \[0\]"):
        decode(engine, 6, DENSE_FIRST)


def test_all_zero_moe_layer_is_named_by_its_decoder_layer():
    """A MoE layer whose capture never ran is reported by its decoder layer (2), not its position among the MoE
    layers (1)."""
    engine = np.concatenate([np.zeros((5, 1, 2), np.uint8), valid(5, layers=3)], axis=1)
    engine[:, 2] = 0
    with pytest.raises(RoutedExpertsError, match=r"layers \[2\] all zero"):
        decode(engine, 6, DENSE_FIRST)
