"""Route validation, packing into router rows, and the context/sequence-parallel layout (pure numpy, no Megatron)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rl.train.layout import TokenLayout
from r3rl.train.routes import RouteError, check_routes, filler, pack_routes

L, K, E = 3, 2, 8


def routes_for(num_tokens: int, seed: int = 0, dtype=np.uint8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(num_tokens - 1)]
    return np.asarray(rows, dtype=dtype)


def check(routes, num_tokens, sample=0):
    return check_routes(routes, sample=sample, num_tokens=num_tokens, num_layers=L, topk=K, num_experts=E)


def test_valid_routes_pass_unchanged_and_stay_narrow():
    r = routes_for(6)
    out = check(r, 6)
    assert out.dtype == np.uint8 and np.array_equal(out, r)


@pytest.mark.parametrize("rows", ["extra row at the back", "extra row at the front", "two extra", "one short"])
def test_only_len_tokens_minus_one_rows_are_accepted(rows):
    r = routes_for(8, seed=2)
    bad = {"extra row at the back": r[:6], "extra row at the front": r[1:7], "two extra": r, "one short": r[:4]}[rows]
    with pytest.raises(RouteError) as err:
        check_routes(bad, sample=4, num_tokens=6, num_layers=L, topk=K, num_experts=E, request_id="req-4")
    assert (f"sample 4: routed experts of request req-4 have {len(bad)} rows for 6 tokens; expected 5"
            in str(err.value))
    assert check(r[:5], 6).shape == (5, L, K)


@pytest.mark.parametrize("shape, what", [((5, L + 1, K), "layers"), ((5, L, K + 1), "top-")])
def test_wrong_shape_names_sample_and_axis(shape, what):
    with pytest.raises(RouteError) as err:
        check(np.zeros(shape, dtype=np.uint8), 6, sample=3)
    assert "sample 3" in str(err.value) and what in str(err.value) and "layer" in str(err.value)


def test_out_of_range_id_names_sample_layer_and_token():
    r = routes_for(6)
    r[2, 1] = [E, 0]
    with pytest.raises(RouteError, match=r"sample 5, layer 1: expert id \[8, 0\] at token 2"):
        check(r, 6, sample=5)


def test_duplicate_ids_in_a_row_are_refused():
    r = routes_for(6)
    r[4, 2] = [3, 3]
    with pytest.raises(RouteError, match=r"sample 1, layer 2: token 4 .* same expert twice"):
        check(r, 6, sample=1)


def test_missing_routes_are_refused():
    with pytest.raises(RouteError, match="sample 2: no routed experts"):
        check(None, 6, sample=2)


def test_filler_rows_hold_distinct_valid_ids():
    f = filler(50, L, K, E, np.dtype(np.uint8))
    assert f.dtype == np.uint8 and f.max() < E
    assert (np.sort(f, axis=-1)[..., 1:] != np.sort(f, axis=-1)[..., :-1]).all()


def test_pack_routes_row_order_and_padding():
    lengths = [5, 8, 3]
    routes = [routes_for(n, seed=n) for n in lengths]
    seq_len = 9
    packed = pack_routes(routes, seq_len, TokenLayout(), num_layers=L, topk=K, num_experts=E)
    batch = len(lengths)
    assert packed.rows.dtype == np.uint8 and packed.rows.shape == (seq_len * batch, L, K)
    for b, r in enumerate(routes):
        for s in range(seq_len):
            row = packed.rows[s * batch + b]
            if s < len(r):
                assert np.array_equal(row, r[s]) and packed.has_route[s * batch + b]
            else:
                # the never-forwarded last token and the padding: filler, K distinct valid ids per layer
                assert not packed.has_route[s * batch + b]
                assert row.max() < E and all(len(set(row[layer])) == K for layer in range(L))
    target = packed.layer_targets(1, torch.device("cpu"))
    assert target.dtype == torch.int64 and target.shape == (seq_len * batch, K)
    assert np.array_equal(target.numpy(), packed.rows[:, 1].astype(np.int64))


@pytest.mark.parametrize("cp, sp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)])
def test_routes_follow_tokens_through_context_and_sequence_parallel(cp, sp):
    """Every rank's router rows carry exactly the routes of the tokens that rank's router sees."""
    batch = 2
    base = TokenLayout(cp_size=cp, sp_size=sp)
    seq_len = base.padded_len(13)
    assert seq_len % base.align == 0
    token_id = np.arange(batch * seq_len).reshape(batch, seq_len)  # a unique id per (sample, position)
    routes_by_token = {int(t): np.array([[t % E, (t + 1) % E]] * L) for t in token_id.ravel()}
    routes = [np.stack([routes_by_token[int(t)] for t in token_id[b, :12]]).astype(np.uint8) for b in range(batch)]
    seen = []
    for cp_rank in range(cp):
        for sp_rank in range(sp):
            layout = TokenLayout(cp_size=cp, cp_rank=cp_rank, sp_size=sp, sp_rank=sp_rank)
            tokens_local = layout.local_tokens(token_id)  # what this rank embeds: [B, S_cp]
            # Megatron's router input under SP: the [s, b] tokens of this rank's sequence shard, flattened s-major
            seq_first = tokens_local.T
            shard = seq_first.shape[0] // sp
            router_tokens = seq_first[sp_rank * shard:(sp_rank + 1) * shard].reshape(-1)
            packed = pack_routes(routes, seq_len, layout, num_layers=L, topk=K, num_experts=E)
            assert packed.rows.shape[0] == router_tokens.size
            for row, tok in enumerate(router_tokens):
                if packed.has_route[row]:
                    assert np.array_equal(packed.rows[row], routes_by_token[int(tok)])
                else:
                    assert (tok % seq_len) >= 12  # only tokens without a rollout route get filler
            seen.extend(router_tokens.tolist())
    assert sorted(seen) == sorted(token_id.ravel().tolist())  # every token on exactly one rank


def test_cp_positions_are_zigzag_and_invertible():
    layout = TokenLayout(cp_size=2)
    assert layout.cp_positions(8, 0).tolist() == [0, 1, 6, 7]
    assert layout.cp_positions(8, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError):
        layout.cp_positions(6)
