"""
Paged attention for nanopaged: the KV store, a Triton kernel that reads K/V through block
tables, a plain-torch path for the CPU, a naive contiguous reference to check both, and the
attention backends the engine picks them by (ATTENTION_BACKENDS).
PagedAttention: Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023.

Tests: python -m pytest -q test_nanopaged.py   (no GPU: Triton runs under TRITON_INTERPRET=1)
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # no Triton wheel (macOS, Windows): the torch path below still works
    triton, tl = SimpleNamespace(jit=lambda fn: None), SimpleNamespace(constexpr=None)
    HAS_TRITON = False

# -----------------------------------------------------------------------------
# Triton paged attention: one kernel for prefill, decode, chunked prefill and prefill on
# top of a cached prefix. FlashAttention-2's online softmax (Dao, 2023) over K/V tiles
# gathered through the block table, as in vLLM's paged attention; GQA heads share loads.
# A step launches it twice at most, with tile shapes of their own: once over the decoding
# sequences (one new token each, optionally split along the context), once over the query
# tiles of all the others, numbered across sequences as in vLLM's unified attention.
# A sliding window (Jiang et al., "Mistral 7B", 2023, after Beltagy et al., "Longformer", 2020)
# limits each token to the last `window` positions, its own included, as transformers'
# sliding_window_causal_mask_function has it: key k is seen from position p iff
# p - window < k <= p. A program's loop starts at the window of its first new token, so blocks
# wholly before it are never read, not even their block-table entries: they may be given back.


# the sequence and split counts, the block tables' width, the window and the split partials'
# strides change from step to step or layer to layer: Triton's specialization of integers (== 1,
# divisible by 16) would recompile
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "window", "stride_lt", "stride_lh",
                               "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, num_seqs, num_splits, window,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_bt,
    qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DECODE: tl.constexpr, SPLIT_KV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # one program: BLOCK_Q new tokens of one sequence x the GROUP query heads of one KV head
    # x one split of the context (split-KV only on decode)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # program i: decoding sequence i, if it decodes
        seq = tl.program_id(0)
        q_tile = 0
    else:
        # vLLM's numbering: sequence s's tiles start at cu_seqlens_q[s] // BLOCK_Q + s (the + s
        # makes room for its ragged last tile); a binary search over cu_seqlens_q finds s
        lo, hi = 0, num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tl.program_id(0):
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_tile = tl.program_id(0) - tl.load(cu_seqlens_q_ptr + seq) // BLOCK_Q - seq
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if (q_len == 1) != DECODE or q_tile * BLOCK_Q >= q_len:  # the other launch's, or past the end
        return

    # row r of the tile is new token r // GROUP_PAD under query head r % GROUP_PAD of the
    # group: the group's heads share every K/V tile this program loads
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = seq_len - q_len + q_idx  # its position: it sees keys q_pos - window < k <= q_pos
    # row of q and out; int64, a long batch * stride can pass 2**31
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    # tiles stay in the cache dtype for fp16/bf16 tensor-core dots; DOT_DTYPE is fp32 only for
    # fp32 caches and for bf16 under the interpreter, whose bf16 tl.dot is wrong
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(DOT_DTYPE)  # (BLOCK_M, HEAD_DIM_PAD)
    if k_scale_ptr is not None:  # an 8-bit cache: fp8 -> the dot dtype is exact (fp16 holds every
        # e4m3 and e5m2 value); the per-layer scales are scalars, so dequantizing K multiplies
        # the scores once per tile, and V the output once at the end, not every loaded element
        qk_scale *= tl.load(k_scale_ptr)

    # keys past the tile's last new token are masked for every row, and so are keys before the
    # window of its first one: never load them
    kv_end = seq_len - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_start = tl.maximum(seq_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    # split-KV (Flash-Decoding): this program takes one chunk of kv_start..kv_end, a whole number
    # of BLOCK_N-key tiles
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        # the physical slot of each key, so BLOCK_N does not depend on the cache block size;
        # masked lanes never read a padded (-1) table entry or a slot past seq_len
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_mask,
                        other=0)
        block = block.to(tl.int64)  # likewise block * stride in a large cache
        offset = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        slot_offs = block * stride_cb + offset * stride_cs + kv_head * stride_ch  # K and V alike
        kv_offs = slot_offs[:, None] + d[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # (N, D_PAD)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # (N, D_PAD)
        if k_scale_ptr is not None:  # fp8 -> fp16 is exact and cheap (e5m2 is fp16's top byte);
            k, v = k.to(tl.float16), v.to(tl.float16)  # fp16 -> bf16 too, for fp8's few bits
        k, v = k.to(DOT_DTYPE), v.to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N) fp32
        if DECODE:  # one new token, and the loop runs over exactly the keys it sees
            s = tl.where(pos_mask[None, :], s, float("-inf"))
        else:  # causal and within the window, 0 <= q_pos - pos < window: one unsigned compare
            behind = (q_pos[:, None] - pos[None, :]).to(tl.uint32)
            s = tl.where(pos_mask[None, :] & (behind < window.to(tl.uint32)), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key yet (only possible in a split) keeps exp2 at 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split has l = 0 and acc = 0
    out = acc / l_safe[:, None]
    if v_scale_ptr is not None:
        out *= tl.load(v_scale_ptr)
    # out rows are tokens; split partials are rows of decoding sequences
    row = tl.full([BLOCK_M], seq, tl.int64) if SPLIT_KV else token
    out_offs = row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] + split * stride_os
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])
    if SPLIT_KV:
        # log2 of the split's softmax denominator (-inf when empty), for the merge below
        lse = m_i + tl.log2(l_safe)
        tl.store(lse_ptr + row * stride_lt + head * stride_lh + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh"])
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, cu_seqlens_q_ptr, num_splits,
    stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # one program per (sequence, head): the decoding sequences' split partials into out
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    if tl.load(cu_seqlens_q_ptr + seq + 1) - token != 1:  # not decoding: the other launch wrote it
        return
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse_offs = seq.to(tl.int64) * stride_lt + head * stride_lh + s
    lse = tl.load(lse_ptr + lse_offs, mask=s_mask, other=float("-inf"))  # (SPLITS_PAD,)
    o_offs = seq.to(tl.int64) * stride_pt + head * stride_ph + s[:, None] * HEAD_DIM + d[None, :]
    o = tl.load(partial_ptr + o_offs, mask=s_mask[:, None] & d_mask[None, :],
                other=0.0)                                              # (SPLITS_PAD, D_PAD)
    # each split's output is normalized by its own denominator; reweight by its share
    w = tl.exp2(lse - tl.max(lse, 0))
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    out_offs = token * stride_ot + head * stride_oh + d
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# head sizes the kernel is built for (padded to a power of two)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64
# the interpreter's tl.dot is wrong on bf16 (exact on fp16): there, bf16 tiles are cast to fp32
INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def kernel_config(dtype, head_dim, group, block_size, decode, split_kv=False, cache_dtype=None):
    """The paged-attention kernel's compile-time constants and launch options for the decode
    launch (decode=True) or the prefill launch of one call. Sized for the ~100 KiB of shared
    memory of consumer GPUs, and for no register spills (the compile gate checks both)."""
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # the M dimension stacks (new token, head of the group) rows, at least 16 for tl.dot:
    # decode has one token; prefill takes 64 rows (32 at head_dim 256) of new tokens x heads,
    # which share each K/V tile. K and V tiles of 8 KiB in fp16: decode, memory bound, keeps
    # two more in flight (num_stages=3; block-table entries too) while it computes on one
    block_m = max(16, group_pad) if decode else max(group_pad, min(64, 8192 // head_dim_pad))
    # an 8-bit cache's fp8 -> fp16 conversions take registers. On sm_90 (the compile gate's full
    # matrix) its decode spilled with three stages up to head_dim 128 and with two at 256, its
    # prefill at head_dim 256 with 32-row tiles or two stages: ptxas's choices, found by trying
    eight_bit = cache_dtype in FP8_DTYPES
    wide_8bit = eight_bit and head_dim_pad > 128
    block_m = max(group_pad, block_m // 2) if wide_8bit and not decode else block_m
    upcast = dtype == torch.float32 or (dtype == torch.bfloat16 and INTERPRETED)
    return dict(
        GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_Q=1 if decode else block_m // group_pad,
        BLOCK_N=min(64, 4096 // head_dim_pad),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        DECODE=decode, SPLIT_KV=split_kv,
        DOT_DTYPE=tl.float32 if upcast else tl.float16 if dtype == torch.float16 else tl.bfloat16,
        DOT_PRECISION="ieee" if upcast else None,
        num_warps=4 if head_dim_pad <= 128 or decode else 8,
        num_stages=(2 if eight_bit and not wide_8bit else 3) if decode else 1 if wide_8bit else 2,
    )


def programs_per_sm(n_regs, shared, num_warps, sm_shared, sm_threads):
    """How many programs of a compiled kernel one SM holds at once: registers (64K per SM,
    allocated per warp in units of 256), shared memory, threads, and at most 32 blocks."""
    regs_per_warp = triton.cdiv(n_regs * 32, 256) * 256
    return max(1, min(65536 // (regs_per_warp * num_warps), sm_shared // max(shared, 1),
                      sm_threads // (32 * num_warps), 32))


def split_count(num_seqs, n_kv_head, max_context, resident_programs):
    """Flash-Decoding's split-KV (Dao et al., 2023), sized by what the GPU holds at once: when the
    num_seqs * n_kv_head decode programs leave resident slots empty, split every context into
    enough chunks to fill them, each >= 256 keys so the merge stays cheap. A power of two, so the
    merge kernel compiles for a handful of counts."""
    splits = min(resident_programs // max(1, num_seqs * n_kv_head), max_context // 256, MAX_SPLITS)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


_resident = {}  # (device, config) -> resident programs of the compiled decode kernel


def _resident_programs(q, args, config):
    key = (q.device, tuple(config.items()))
    if key not in _resident:
        compiled = _paged_attention_kernel.warmup(*args, grid=(1,), **config)
        compiled._init_handles()  # loads it: sets n_regs
        props = torch.cuda.get_device_properties(q.device)
        _resident[key] = props.multi_processor_count * programs_per_sm(
            compiled.n_regs, compiled.metadata.shared, config["num_warps"],
            props.shared_memory_per_multiprocessor, props.max_threads_per_multi_processor)
    return _resident[key]


# full attention, to the kernel: a window no context reaches (an int32, as every window)
NO_WINDOW = 2**31 - 1


def check_window(window):
    """A sliding window is None or 0 (full attention) or a number of positions below 2**31."""
    assert window is None or (type(window) is int and 0 <= window < NO_WINDOW), \
        f"window must be None or an int in 0..{NO_WINDOW - 1} (0: full attention), got {window!r}"


def check_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, num_splits=None,
                 k_scale=None, v_scale=None, window=None):
    """paged_attention's arguments as the kernel needs them: shapes, dtypes, devices, strides."""
    assert q.dim() == 3 and k_cache.dim() == 4, \
        "q is [num_tokens, n_head, head_dim], caches are 4-D"
    n_head, head_dim = q.shape[1:]
    n_kv_head, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    assert q.dtype in DTYPES, f"unsupported dtype {q.dtype}"
    check_scales(q, k_cache, v_cache, k_scale, v_scale)
    assert v_cache.shape == k_cache.shape, \
        f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    assert v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides"
    assert k_cache.shape[3] == head_dim, \
        f"head_dim of q ({head_dim}) != that of the caches ({k_cache.shape[3]})"
    assert head_dim in HEAD_DIMS, f"head_dim {head_dim} not supported, use one of {HEAD_DIMS}"
    assert n_head % n_kv_head == 0, \
        f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})"
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert t.device == q.device, f"{name} is on {t.device}, q on {q.device}"
    assert k_cache.device == v_cache.device == q.device, "q and the caches must share a device"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, \
        "block_tables is [num_seqs, max_blocks]"
    assert seq_lens.dim() == 1 and cu_seqlens_q.shape == (num_seqs + 1,), \
        "cu_seqlens_q is [num_seqs + 1]"
    assert q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1, "head_dim must be contiguous"
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous()
    assert num_splits is None or 1 <= num_splits <= MAX_SPLITS, f"num_splits is in 1..{MAX_SPLITS}"
    check_window(window)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                    max_q_len=None, num_splits=None, k_scale=None, v_scale=None, window=None):
    """Causal attention of the packed new tokens q over their sequences' paged K/V.
    q [num_tokens, n_head, head_dim]; caches [num_blocks, block_size, n_kv_head, head_dim];
    block_tables int32 [num_seqs, max_blocks] (-1 past the end); seq_lens int32 [num_seqs]
    (context including the new tokens); cu_seqlens_q int32 [num_seqs + 1].
    max_q_len (>= every q_len; if known) saves a device->host sync; num_splits (1..64) forces
    the split-KV of the decoding sequences (default: split_count, on a GPU). An 8-bit cache
    comes with k_scale and v_scale, one-element fp32 tensors on q's device (see quantize).
    window: a sliding window of that many positions (a token at p sees p - window < k <= p), or
    None / 0 for full attention. Table entries of blocks wholly before the window of a
    sequence's first new token are never read: they may be anything (-1 for a freed block)."""
    check_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, num_splits, k_scale,
                 v_scale, window)
    num_tokens, n_head, head_dim = q.shape
    block_size, n_kv_head = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, n_head, head_dim), device=q.device, dtype=q.dtype)  # (T, nh, D)
    if num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # device->host sync
    group = n_head // n_kv_head

    def args(out, lse, num_splits):
        return (q, k_cache, v_cache, out, lse, block_tables, seq_lens, cu_seqlens_q,
                num_seqs, num_splits, window or NO_WINDOW, k_scale, v_scale,
                q.stride(0), q.stride(1), *k_cache.stride()[:3],
                *out.stride()[:3], *lse.stride()[:2], block_tables.stride(0),
                scale * 1.4426950408889634)  # log2(e): the kernel uses exp2, cheaper than exp

    # decode: one program per sequence x KV head x split; those not decoding exit at once
    decode = kernel_config(q.dtype, head_dim, group, block_size, decode=True,
                           cache_dtype=k_cache.dtype)
    if num_splits is None:
        resident = _resident_programs(q, args(out[:, :, None], out, 1), decode) if q.is_cuda else 0
        context = block_tables.shape[1] * block_size  # the longest a decode can see
        num_splits = split_count(num_seqs, n_kv_head, min(context, window or context), resident)
    if num_splits == 1:
        _paged_attention_kernel[(num_seqs, n_kv_head, 1)](*args(out[:, :, None], out, 1), **decode)
    else:  # partials of the decoding sequences, in buffers reused across calls (for CUDA graphs)
        f32 = q.new_empty(0, dtype=torch.float32)
        partial = _buffer("partial", (num_seqs, n_head, num_splits, head_dim), f32)  # (S, nh, n, D)
        lse = _buffer("lse", (num_seqs, n_head, num_splits), f32)                     # (S, nh, n)
        decode = kernel_config(q.dtype, head_dim, group, block_size, decode=True, split_kv=True,
                               cache_dtype=k_cache.dtype)
        grid = (num_seqs, n_kv_head, num_splits)
        _paged_attention_kernel[grid](*args(partial, lse, num_splits), **decode)
        _merge_splits_kernel[(num_seqs, n_head)](
            partial, lse, out, cu_seqlens_q, num_splits,
            *partial.stride()[:2], *lse.stride()[:2], *out.stride()[:2],
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=decode["HEAD_DIM_PAD"],
        )
    if max_q_len > 1:  # prefill: query tiles numbered across sequences; decoding ones exit at once
        prefill = kernel_config(q.dtype, head_dim, group, block_size, decode=False,
                                cache_dtype=k_cache.dtype)
        grid = (num_tokens // prefill["BLOCK_Q"] + num_seqs, n_kv_head, 1)  # >= all the tiles
        _paged_attention_kernel[grid](*args(out[:, :, None], out, 1), **prefill)
    return out


# -----------------------------------------------------------------------------
# 8-bit KV caches (vLLM's fp8 KV cache): a slot in half the bytes of a 16-bit one, so the same
# memory holds twice the blocks. One scale per layer for K and one for V (vLLM's per-tensor
# scales): a value x is stored as q = clamp(x / scale, -fmax, fmax) in fp8 and read back as q *
# scale in the query's dtype. The scales are fixed when the engine is built, from one calibration
# prefill (nanopaged's calibrate_kv_scales): scale = KV_SCALE_HEADROOM * amax / fmax, amax the
# largest |K| (or |V|) of the layer on it. A value up to KV_SCALE_HEADROOM times that comes back
# within fp8's relative error, 2**-4 for e4m3 (3 mantissa bits) and 2**-3 for e5m2 (2), round to
# nearest (below fp8's smallest normal, within half its smallest step times scale); a larger one
# saturates at fmax * scale. The clamp is explicit: a cast past fp8's range is not saturation
# everywhere (e5m2 gives inf; e4m3fn has no inf and its format says NaN). Fixed scales make a
# token's stored bytes independent of the requests before it, so recompute and prefix caching
# store the same bytes, and swap and copy-on-write move blocks and nothing else. Finer scales (per
# head or per block, as in KIVI or KVQuant) follow outliers more closely but must move with their
# blocks. Triton converts e4m3 (fp8e4nv) only on sm_89 and later; e5m2 compiles from sm_80 (see
# check_kv_cache_dtype).

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# amax comes from a few hundred fixed tokens; real prompts may go past it. 2x keeps e4m3's 448
# at 224 for the calibration's largest value: one binade of room, one bit of range spent
KV_SCALE_HEADROOM = 2.0


def check_kv_cache_dtype(name, model_dtype, device, attention_backend):
    """Engine(kv_cache_dtype=name) -> the cache's torch dtype, or a ValueError naming it."""
    if not isinstance(name, str) or name not in ("auto", *KV_CACHE_DTYPES):
        raise ValueError(f"Engine: kv_cache_dtype must be one of "
                         f"{['auto', *KV_CACHE_DTYPES]}, got {name!r}")
    dtype = model_dtype if name == "auto" else KV_CACHE_DTYPES[name]
    if (dtype == torch.float8_e4m3fn and attention_backend == "triton" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError(f"Engine: kv_cache_dtype={name!r} is e4m3, which Triton converts only "
                         f"on compute capability 8.9 and later (this GPU is "
                         f"{torch.cuda.get_device_capability(device)}); use 'fp8_e5m2'")
    return dtype


def check_scales(x, k_cache, v_cache, k_scale, v_scale):
    """The launchers' check: caches in x's dtype and no scales, or 8-bit ones with a scale each."""
    if k_cache.dtype in FP8_DTYPES and k_cache.dtype == v_cache.dtype:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert (s is not None and s.dtype == torch.float32 and s.numel() == 1
                    and s.device == x.device), \
                f"an 8-bit cache needs {name}: a one-element fp32 tensor on {x.device}"
    else:
        assert k_cache.dtype == v_cache.dtype == x.dtype, \
            f"dtypes differ: q {x.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        assert k_scale is None and v_scale is None, "scales go with 8-bit caches only"


def quantize(x, scale, dtype):
    """x as a cache of dtype stores it: 8-bit with scale (the scheme above), else a cast."""
    if scale is None:
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def dequantize(x, scale, dtype):
    """What a cache holds, in dtype: q * scale for an 8-bit cache."""
    return x.to(dtype) if scale is None else x.to(dtype) * scale.to(dtype)


def kv_scales(amax, dtype):
    """The scales for K/V whose largest magnitude on the calibration is amax (a tensor)."""
    scale = KV_SCALE_HEADROOM * amax.float() / torch.finfo(dtype).max
    return torch.where(scale > 0, scale, 1.0)  # a layer of zeros: any scale stores them exactly


# -----------------------------------------------------------------------------
# KV store: write the new tokens' K/V into their cache slots (quantized, for an 8-bit cache)


@triton.jit
def _round_to_fp8(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 x (within fp8's range) rounded to nearest even onto fp8's grid, so the cast that
    follows is exact: Triton's own fp32 -> fp8 casts round wrongly in places (the interpreter
    drops the carry into the next binade, 31.98 -> 16 in e4m3, triton issue #8322; Ada's e4m3
    goes through fp16 and pre-Ada e5m2 breaks ties away from zero, triton PR #11753)."""
    drop: tl.constexpr = 23 - MANTISSA_BITS  # fp32 mantissa bits that fp8 lacks
    bits = x.to(tl.int32, bitcast=True)  # the sign bit stays: |x| <= fmax never carries into it
    bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)
    normal = bits.to(tl.float32, bitcast=True)  # a carry out of the mantissa bumps the exponent
    # below fp8's smallest normal its step is fixed: fp32 addition rounds onto it, to even
    c: tl.constexpr = MIN_NORMAL * 2.0 ** (23 - MANTISSA_BITS)  # ulp(c) = fp8's subnormal step
    tiny = (tl.abs(x) + c) - c
    return tl.where(tl.abs(x) < MIN_NORMAL, tl.where(x < 0, -tiny, tiny), normal)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    N_KV_HEAD: tl.constexpr, N_KV_HEAD_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
):
    # one program per token: copy its (n_kv_head, head_dim) K and V rows into its slot
    token = tl.program_id(0).to(tl.int64)  # token * stride passes 2**31 at ~200k tokens a step
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # -1: skip this token
        return
    h = tl.arange(0, N_KV_HEAD_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < N_KV_HEAD) & (d < HEAD_DIM)
    cache_offs = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                  + h * stride_ch + d)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    if k_scale_ptr is not None:  # an 8-bit cache: quantize() in Triton
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
        k = _round_to_fp8(k, FP8_MANTISSA, FP8_MIN_NORMAL)
        v = _round_to_fp8(v, FP8_MANTISSA, FP8_MIN_NORMAL)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    num_tokens, n_kv_head, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), \
        "k, v [T, n_kv_head, D], slot_mapping [T]"
    assert k_cache.shape == v_cache.shape == (*k_cache.shape[:2], n_kv_head, head_dim), \
        "caches do not match k"
    check_scales(k, k_cache, v_cache, k_scale, v_scale)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write k, v [num_tokens, n_kv_head, head_dim] into the caches at slot_mapping
    (slot = block_id * block_size + offset); a slot of -1 skips its token. A Triton kernel, so a
    GPU makes no device->host sync. An 8-bit cache comes with k_scale and v_scale, and stores
    quantize(k, k_scale), ..."""
    check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, n_kv_head, head_dim = k.shape
    block_size = k_cache.shape[1]
    assert k.stride(2) == v.stride(2) == k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride() and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    fp8 = torch.finfo(k_cache.dtype if k_scale is not None else torch.float8_e4m3fn)  # or unused
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_KV_HEAD=n_kv_head, N_KV_HEAD_PAD=triton.next_power_of_2(n_kv_head),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        FP8_MAX=fp8.max, FP8_MANTISSA=round(-math.log2(fp8.eps)),  # 3 for e4m3, 2 for e5m2
        FP8_MIN_NORMAL=fp8.smallest_normal,
    )


def store_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """store_kv in plain torch: one index_copy_ per cache."""
    check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_blocks, block_size, n_kv_head, head_dim = k_cache.shape
    slots = slot_mapping.long()
    if (slots < 0).any():
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = quantize(x, scale, cache.dtype)
        if scale is not None:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        # one row per slot: view, not reshape, so a cache that is not contiguous over
        # (block, slot) fails loudly
        cache.view(num_blocks * block_size, n_kv_head, head_dim).index_copy_(0, slots, x)


# -----------------------------------------------------------------------------
# Torch paged path (the engine's attention on the CPU)

# (name, device, dtype, inference mode) -> flat tensor, grown as needed and reused across calls
_buffers = {}


def _buffer(name, shape, like):
    """A tensor of the given shape with like's device and dtype, carved from a reused buffer."""
    numel = math.prod(shape)
    # inference tensors stay inside inference mode: a buffer for each
    key = (name, like.device, like.dtype, torch.is_inference_mode_enabled())
    if key not in _buffers or _buffers[key].numel() < numel:
        _buffers[key] = torch.empty(numel, device=like.device, dtype=like.dtype)
    return _buffers[key][:numel].view(shape)


def _gather_kv(k_cache, v_cache, slots, shape, scales, dtype):
    """K and V at the physical slots (flattened [B, L] positions of B sequences), each returned
    as a [B, n_kv_head, L, head_dim] view for attention, in dtype (dequantized with scales,
    (k_scale, v_scale), for an 8-bit cache)."""
    n_kv_head, head_dim = k_cache.shape[2:]
    rows = (len(slots), n_kv_head, head_dim)
    k = torch.index_select(k_cache.flatten(0, 1), 0, slots, out=_buffer("k", rows, k_cache))
    v = torch.index_select(v_cache.flatten(0, 1), 0, slots, out=_buffer("v", rows, v_cache))
    k, v = (dequantize(x, s, dtype) for x, s in zip((k, v), scales))
    shape = (*shape, n_kv_head, head_dim)                                         # (B, L, nkv, D)
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)  # (B, nkv, L, D) each


def _attend(q, k, v, mask, scale):
    """q [B, n_kv_head, M, D] (M stacks the group's query heads), k, v [B, n_kv_head, L, D],
    mask broadcastable to [B, n_kv_head, M, L], True = attend. Computes in fp32 (fp64 for fp64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return F.scaled_dot_product_attention(q.to(acc), k.to(acc), v.to(acc), attn_mask=mask,
                                          scale=scale)


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                          max_q_len=None, decode_attention=None, k_scale=None, v_scale=None,
                          plan=None, window=None):
    """paged_attention in plain torch: the decoding sequences (q_len == 1) in one batched call,
    those with a few new tokens (2 to SHORT_Q_LEN: speculative verification, short prompts) in
    another, then one call per sequence with more; a batched call that would gather more than
    CHUNK_BYTES of K/V is cut into several. Accepts float64 (the tests run models in
    it). max_q_len is accepted for the same signature; this path reads the lengths on the host.
    K/V are gathered only from positions < seq_len, so unused slots (even NaN) are never read;
    with a sliding window (paged_attention's), only from the window of each sequence's first new
    token on, so blocks wholly before it are not read and their table entries may be anything.
    decode_attention: a function (q, k_cache, v_cache, block_tables, seq_lens, scale, window) of
    the decoding rows alone that replaces their batched call (paged_attention_flex, opt-in).
    An 8-bit cache comes with k_scale and v_scale: what is gathered is dequantized to q's dtype.
    plan: a dict that every layer of one step with this window passes (the backend keeps it in
    Batch.scratch): the first call fills it with the step's gather indices and masks, the others
    reuse them (as vLLM builds its attention metadata once per step), so a layer is a few ops:
    gather, attend, scatter."""
    n_head, head_dim = q.shape[1:]
    n_kv_head = k_cache.shape[2]
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim
    assert n_head % n_kv_head == 0, "n_head must be a multiple of n_kv_head"
    check_scales(q, k_cache, v_cache, k_scale, v_scale)
    check_window(window)
    if decode_attention is not None and k_scale is not None:
        raise ValueError("paged_attention_flex reads the cache in place: it takes no 8-bit cache")
    plan = {} if plan is None else plan
    if not plan:  # this step's first layer: the indices every layer reuses
        token_bytes = 2 * n_kv_head * head_dim * q.element_size()  # K and V, as attended
        plan.update(_attention_plan(block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1],
                                    n_head // n_kv_head, decode_attention is None, token_bytes,
                                    window))
    assert plan["window"] == (window or None), "a plan serves the layers of one window"
    out = None if plan["whole"] else torch.empty_like(q)
    if decode_attention is not None and plan["decode"] is not None:
        idx = plan["decode"]
        rows = cu_seqlens_q.index_select(0, idx).long()              # (B,) their one new token
        o = decode_attention(q.index_select(0, rows), k_cache, v_cache,
                             block_tables.index_select(0, idx), seq_lens.index_select(0, idx),
                             scale, window)                                      # (B, nh, D)
        out.index_copy_(0, rows, o.to(q.dtype))
    for rows, slots, (B, Q, L), mask, kept, written in plan["calls"]:
        k, v = _gather_kv(k_cache, v_cache, slots, (B, L), (k_scale, v_scale), q.dtype)
        q_b = q if out is None else q.index_select(0, rows)
        q_b = q_b.view(B, Q, n_kv_head, -1, head_dim).permute(0, 2, 3, 1, 4)
        q_b = q_b.reshape(B, n_kv_head, -1, head_dim)  # (B, nkv, G*Q, D): per K/V head, G x Q
        o = _attend(q_b, k, v, mask, scale).view(B, n_kv_head, -1, Q, head_dim)
        o = o.permute(0, 3, 1, 2, 4).reshape(B * Q, n_head, head_dim)             # (B*Q, nh, D)
        if out is None:  # the plan's one call took q whole
            return o.to(q.dtype)
        out.index_copy_(0, written, (o if kept is None else o[kept]).to(q.dtype))
    return out


SHORT_Q_LEN = 16  # sequences with at most this many new tokens share one padded call
CHUNK_BYTES = 8 << 20  # K/V one call gathers, at most, unless one sequence alone has more


def _attention_plan(block_tables, seq_lens, cu_seqlens_q, block_size, G, decodes, token_bytes,
                    window=None):
    """The step's calls, each a group of sequences padded to its most new tokens, Q, and its
    longest span, L: the positions a sequence's new tokens see, from the window of its first
    one (0 without a window) to its end. The decodes (unless decode_attention takes them),
    those with 2 to SHORT_Q_LEN new tokens when there are several, then each other sequence
    alone. A group whose gathered K/V (token_bytes a position) would pass CHUNK_BYTES is cut,
    shortest spans first, into calls that stay within it: each call pads only to its own
    longest span, and its copy stays small (README: the budget's sweep). A call is
    (rows of q, slots to gather, (B, Q, L), mask (B, 1, G*Q, L) or None, rows of o kept, rows of
    out written): a padding row repeats its sequence's last and is not written back; positions
    past a sequence's end re-read its last token, real values that the mask hides. Indices are
    built on the host, which knows the lengths."""
    cu, lens, dev = cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.device
    window = window or None
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    starts = [max(0, n - q - window + 1) if window else 0 for n, q in zip(lens, q_lens)]
    spans = [n - start for n, start in zip(lens, starts)]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    short = [i for i, n in enumerate(q_lens) if 1 < n <= SHORT_Q_LEN]
    short = [short] if len(short) > 1 else [[i] for i in short]
    long = [[i] for i, n in enumerate(q_lens) if n > SHORT_Q_LEN]
    groups = ([decode] if decode and decodes else []) + short + long
    chunks = []
    for group in groups:  # to be cut, shortest first: a call's spans are then alike
        if len(group) * max(spans[i] for i in group) * token_bytes > CHUNK_BYTES:
            group = sorted(group, key=lambda i: spans[i])
        chunks.append(group[:1])
        for i in group[1:]:  # the longest span so far, so the one the call would pad to
            if (len(chunks[-1]) + 1) * spans[i] * token_bytes > CHUNK_BYTES:
                chunks.append([])
            chunks[-1].append(i)
    calls = []
    for seqs in chunks:
        B, Q, L = len(seqs), max(q_lens[i] for i in seqs), max(spans[i] for i in seqs)
        last = [(i, min(j, q_lens[i] - 1)) for i in seqs for j in range(Q)]  # row j, or the last
        rows = torch.tensor([cu[i] + j for i, j in last], device=dev)             # (B*Q,)
        span = torch.tensor([spans[i] for i in seqs], device=dev)[:, None]        # (B, 1)
        start = torch.tensor([starts[i] for i in seqs], device=dev)[:, None]      # (B, 1)
        pos = torch.arange(L, device=dev)[None]                                   # (1, L)
        positions = start + torch.minimum(pos, span - 1)                          # (B, L)
        blocks = block_tables[seqs].gather(1, positions // block_size).long()     # (B, L)
        slots = (blocks * block_size + positions % block_size).flatten()          # (B*L,)
        mask = None  # decodes of one span: nothing to hide
        if Q > 1 or any(spans[i] < L for i in seqs):
            # causal: new token j of a sequence sits at position len - q_len + j, sees up to
            # there, and within a window the last `window` positions; pos counts from start
            q_pos = torch.tensor([lens[i] - q_lens[i] + j - starts[i] for i, j in last],
                                 device=dev).view(B, Q)[:, :, None]
            mask = pos[:, None, :] <= q_pos                                          # (B, Q, L)
            if window:
                mask &= pos[:, None, :] > q_pos - window
            mask = mask[:, None].repeat(1, 1, G, 1)                                # (B,1,G*Q,L)
        kept = [b * Q + j for b, i in enumerate(seqs) for j in range(q_lens[i])]
        kept = None if len(kept) == B * Q else torch.tensor(kept, device=dev)
        calls.append((rows, slots, (B, Q, L), mask, kept, rows if kept is None else rows[kept]))
    # one call of every sequence in order, no padding rows: its q is q, its output the output
    whole = chunks == [list(range(len(lens)))] and calls[0][4] is None
    return dict(calls=calls, whole=whole, window=window,
                decode=torch.tensor(decode, device=dev) if decode and not decodes else None)


_flex = None  # flex_attention compiled by Inductor, made on first use (tens of seconds)


def paged_attention_flex(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None):
    """Decode (one new token a sequence: q [B, n_head, D]) with torch's flex_attention compiled
    by Inductor for the CPU, reading K/V straight from the cache through the block table: no
    gather. The whole cache is the key axis of every sequence; a block mask lists, per sequence,
    the physical blocks it uses (torch's own paged attention helper does the same): see
    _flex_block_mask. flex reads whole blocks, and on the CPU it has no log-sum-exp to merge a
    separately computed tail, so this writes zeros into the slots past each sequence's end in
    its last block (slots no sequence reads: a shared block is copied before a write) where
    0 * NaN would spoil the result; the slots before a sliding window's start in its first
    block hold real K/V, which stay. Opt-in: paged_attention_torch(...,
    decode_attention=paged_attention_flex)."""
    global _flex
    from torch.nn.attention.flex_attention import flex_attention
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=True)
    num_blocks, block_size, n_kv_head, head_dim = k_cache.shape
    B = len(seq_lens)
    seq_lens = seq_lens.long()
    num_used = (seq_lens + block_size - 1) // block_size                          # (B,)
    last_block = block_tables.gather(1, (num_used - 1)[:, None]).long()           # (B, 1)
    last_len = seq_lens - (num_used - 1) * block_size                              # (B,)
    tail = torch.arange(block_size, device=q.device)
    tail_slots = (last_block * block_size + tail)[tail >= last_len[:, None]]
    for cache in (k_cache, v_cache):
        cache.flatten(0, 1).index_fill_(0, tail_slots, 0)
    mask = _flex_block_mask(block_tables, seq_lens, num_blocks, block_size, window,
                            num_used, last_block, last_len)
    k, v = (c.view(1, -1, n_kv_head, head_dim).transpose(1, 2).expand(B, -1, -1, -1)
            for c in (k_cache, v_cache))                                        # (B, nkv, slots, D)
    with torch.no_grad():  # flex compiles for inference only on the CPU
        o = _flex(q.view(B, -1, 1, head_dim), k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return o.view(B, -1, head_dim)                                                 # (B, nh, D)


def _flex_block_mask(block_tables, seq_lens, num_blocks, block_size, window, num_used,
                     last_block, last_len):
    """The decodes' flex BlockMask over the whole cache: per sequence, the blocks it sees wholly
    as full blocks; its last block, and the first of its window if the window starts inside it,
    as partial ones that the mask_mod cuts to the sequence's end and the window's start.
    num_used, last_block (B, 1), last_len: each sequence's blocks in use, its last block and the
    tokens in that, as paged_attention_flex found them."""
    from torch.nn.attention.flex_attention import BlockMask
    B, width = block_tables.shape
    # the window's first position, its block, and whether the window starts inside that block
    start = (seq_lens - window).clamp(min=0) if window else torch.zeros_like(seq_lens)
    first, first_off = start // block_size, start % block_size                      # (B,)
    first_block = block_tables.gather(1, first[:, None]).long()                    # (B, 1)
    cut = (first_off > 0) & (first < num_used - 1)  # a partial first block, not the last one
    # full blocks: from the window's first whole block to the one before the last
    full_from = first + cut.long()
    at = (full_from[:, None] + torch.arange(width, device=seq_lens.device)).clamp(max=width - 1)
    full = F.pad(block_tables.gather(1, at).clamp(min=0), (0, num_blocks - width)).int()
    partial = F.pad(torch.cat((last_block, first_block), 1), (0, num_blocks - 2)).int()
    # slots hidden: the last block's past the sequence's end, the first's before the window.
    # A tensor of static size (B padded to a power of two: a compile per size): Inductor's CPU
    # flex template renames its split-size symbols in the mask's code by text replacement, so
    # a dynamic size there can be a symbol that one contains (ks5 in ks56) and fail to compile
    last_start, first_start = last_block.view(-1) * block_size, first_block.view(-1) * block_size
    bounds = torch.stack((last_start + last_len, last_start + block_size, first_start,
                          first_start + first_off))                                    # (4, B)
    bounds = F.pad(bounds, (0, (1 << (B - 1).bit_length()) - B))
    torch._dynamo.mark_static(bounds)
    # and the blocks each sequence sees, in the mask itself: the block lists only skip work in
    # compiled code, and past Dynamo's recompile limit flex runs eagerly, where the mask alone
    # decides (every other sequence's blocks would be seen)
    pos = torch.arange(width, device=seq_lens.device)
    in_view = (pos >= first[:, None]) & (pos < num_used[:, None])                  # (B, width)
    rows = torch.arange(B, device=seq_lens.device)[:, None].expand(B, width)
    visible = torch.zeros(bounds.shape[1], num_blocks, dtype=torch.bool, device=seq_lens.device)
    visible[rows[in_view], block_tables.long()[in_view]] = True                 # (B', num_blocks)
    torch._dynamo.mark_static(visible)

    def seen(b, h, q_idx, kv_idx):
        return (visible[b, kv_idx // block_size]
                & ((kv_idx < bounds[0, b]) | (kv_idx >= bounds[1, b]))
                & ((kv_idx < bounds[2, b]) | (kv_idx >= bounds[3, b])))
    return BlockMask.from_kv_blocks(
        (1 + cut.int()).view(B, 1, 1), partial.view(B, 1, 1, num_blocks),
        (num_used - 1 - full_from).int().view(B, 1, 1), full.view(B, 1, 1, num_blocks),
        BLOCK_SIZE=(128, block_size), mask_mod=seen,
        seq_lengths=(1, num_blocks * block_size), compute_q_blocks=False)


# -----------------------------------------------------------------------------
# Naive reference: contiguous K/V, one sequence at a time, nothing clever


def naive_attention(q, k, v, cu_seqlens_q, seq_lens, scale, window=None):
    """q [num_tokens, n_head, D] packed new tokens; k, v [sum(seq_lens), n_kv_head, D] with
    each sequence's whole context concatenated in order. Returns [num_tokens, n_head, D].
    window: a sliding window of that many positions (paged_attention's), or None / 0; the K/V
    before the window of a sequence's first new token are not read (they may be NaN)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_head, n_kv_head = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    kv_start = 0
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        q_len = q_end - q_start
        lo = max(0, seq_len - q_len - window + 1) if window else 0  # what the first one sees
        qs = q[q_start:q_end].to(acc)                                             # (q_len, nh, D)
        ks = k[kv_start + lo : kv_start + seq_len].to(acc)                        # (L, nkv, D)
        vs = v[kv_start + lo : kv_start + seq_len].to(acc)
        ks = ks.repeat_interleave(n_head // n_kv_head, dim=1)                     # (L, nh, D)
        vs = vs.repeat_interleave(n_head // n_kv_head, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale                     # (nh, q_len, L)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(lo, seq_len)[None, :]
        hidden = k_pos > q_pos  # causal; and transformers' sliding window: k > q - window
        if window:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
        kv_start += seq_len
    return out


# -----------------------------------------------------------------------------
# Attention backends by name: how a layer stores its new K/V and reads its context. The engine
# picks one when it is built (Engine(attention_backend=...)) and every step's batch carries it.
# A new backend is one function and one entry (README: Forking).


@dataclass(frozen=True)
class AttentionBackend:
    store: Callable  # (k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)
    # (q, k_cache, v_cache, meta, scale, window=None, k_scale=None, v_scale=None) ->
    # [num_tokens, n_head, D]: meta has block_tables, seq_lens, cu_seqlens_q, max_q_len, and
    # scratch, a dict the step's layers share, where a backend keeps what it builds once per
    # step. window: the layer's sliding window (paged_attention's), passed by windowed layers
    # only, so a backend written without windows still serves every model that has none
    attend: Callable
    # (dtype, head_dim, kv_cache_dtype) -> why this backend cannot run them, or None
    unsupported: Callable = lambda dtype, head_dim, kv_cache_dtype: None


def _triton_attend(q, k_cache, v_cache, meta, scale, window=None, **scales):
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.cu_seqlens_q, scale, max_q_len=meta.max_q_len, window=window,
                           **scales)


def _triton_unsupported(dtype, head_dim, kv_cache_dtype):
    if not HAS_TRITON:
        return "Triton is not installed (it has wheels for Linux)"
    if dtype not in DTYPES or head_dim not in HEAD_DIMS:
        return (f"the Triton kernel takes head sizes {HEAD_DIMS} in {DTYPES}, not head size "
                f"{head_dim} in {dtype}")
    return None


def _torch_attend(q, k_cache, v_cache, meta, scale, window=None, **scales):
    # one plan per window: the layers of a hybrid model share two
    return paged_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.cu_seqlens_q, scale, plan=meta.scratch.setdefault(window, {}),
                                 window=window, **scales)


def _flex_attend(q, k_cache, v_cache, meta, scale, window=None):
    return paged_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.cu_seqlens_q, scale, plan=meta.scratch.setdefault(window, {}),
                                 decode_attention=paged_attention_flex, window=window)


ATTENTION_BACKENDS = {
    "triton": AttentionBackend(store_kv, _triton_attend, _triton_unsupported),
    "torch": AttentionBackend(store_kv_torch, _torch_attend),
    # decodes read the cache in place with flex_attention (compiled on first use), the rest
    # as the torch path does
    "flex": AttentionBackend(store_kv_torch, _flex_attend, lambda dtype, head_dim, kv: (
        "flex attention reads the cache in place: it takes no 8-bit cache"
        if kv in FP8_DTYPES else None)),
}
