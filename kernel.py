"""
Paged attention for nanopaged: the KV store, a Triton kernel that reads K/V through block
tables, a plain-torch path for the CPU, and a naive contiguous reference to check both.
PagedAttention: Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023.

Tests: python -m pytest -q test_nanopaged.py   (no GPU: Triton runs under TRITON_INTERPRET=1)
"""

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheel (macOS, Windows): the torch path below still works
    from types import SimpleNamespace
    triton, tl = SimpleNamespace(jit=lambda fn: None), SimpleNamespace(constexpr=None)

# -----------------------------------------------------------------------------
# Triton paged attention: one kernel for prefill, decode, chunked prefill and prefill on
# top of a cached prefix. FlashAttention-2's online softmax (Dao, 2023) over K/V tiles
# gathered through the block table, as in vLLM's paged attention; GQA heads share loads.


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_bt,
    qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # one program: BLOCK_Q new tokens of one sequence x the GROUP query heads of one KV head
    # x one split of the context (NUM_SPLITS == 1 unless split-KV)
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the longest sequence
        return

    # row r of the tile is new token r // GROUP_PAD under query head r % GROUP_PAD of the
    # group: the group's heads share every K/V tile this program loads
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = seq_len - q_len + q_idx  # position in the sequence: sees keys 0..q_pos
    token = (q_start + q_idx).to(tl.int64)  # row of q and out; int64, a long batch * stride can pass 2**31
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32)  # (BLOCK_M, HEAD_DIM_PAD)

    # keys past the tile's last new token are masked for every row: never load them
    kv_end = seq_len - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    # split-KV (Flash-Decoding): this program takes one BLOCK_N-aligned chunk of 0..kv_end
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        # the physical slot of each key, so BLOCK_N does not depend on the cache block size;
        # masked lanes never read a padded (-1) table entry or a slot past seq_len
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_mask, other=0)
        block = block.to(tl.int64)  # likewise block * stride in a large cache
        offset = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k_offs = (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :]
        v_offs = (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :]
        # fp32 tiles: the interpreter's tl.dot is wrong on bf16, and fp32 accumulation is wanted anyway
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_N, HEAD_DIM_PAD)
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_N, HEAD_DIM_PAD)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(pos_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key yet (only possible in a split) keeps exp2 at 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split has l = 0 and acc = 0
    out = acc / l_safe[:, None]
    out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] + split * stride_os
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    if NUM_SPLITS > 1:
        # log2 of the split's softmax denominator (-inf when empty), for the merge below
        lse = m_i + tl.log2(l_safe)
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # one program per (token, head); partial (.., NUM_SPLITS, HEAD_DIM), lse and out are contiguous
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(lse_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))  # (SPLITS_PAD,)
    o_offs = (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :]
    o = tl.load(partial_ptr + o_offs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # (SPLITS_PAD, D_PAD)
    # each split's output is normalized by its own denominator; reweight by its share
    w = tl.exp2(lse - tl.max(lse, 0))
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # head sizes the kernel is built for (padded to a power of two)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # cast to fp32 inside, for the dots


def default_num_splits(q, num_seqs, n_kv_head, max_q_len, max_context):
    """Flash-Decoding's rule (Dao et al., 2023): split the context only when every sequence
    decodes one token, its num_seqs * n_kv_head programs would leave the GPU's SMs idle, and
    the context is long (>= 512 keys); then use enough splits to fill the SMs, each >= 256 keys."""
    if not q.is_cuda or max_q_len != 1 or max_context < 512:
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = num_seqs * n_kv_head
    if programs >= num_sms:
        return 1
    return min(triton.cdiv(num_sms, programs), max_context // 256, 16)


def kernel_config(dtype, head_dim, group, block_size, max_q_len, num_splits):
    """The paged-attention kernel's compile-time constants and launch options for one call
    (a function of its own so the tests can compile exactly this for a GPU they lack)."""
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # the M dimension stacks (new token, head of the group) rows: at least 16 for tl.dot,
    # at most 64 (32 for head_dim 256) unless one token's group alone is larger; with
    # BLOCK_N below, the fp32 tiles fit the ~100 KiB of shared memory of consumer GPUs
    block_m = max(16, group_pad, min(8192 // head_dim_pad, 64, triton.next_power_of_2(max_q_len) * group_pad))
    return dict(
        GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_Q=block_m // group_pad, BLOCK_N=min(64, 4096 // head_dim_pad),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        # fp32 inputs get a full-precision dot; fp16/bf16 tiles, cast to fp32, get the backend's
        # fast default (tf32 on NVIDIA), which holds fp16 and bf16 values exactly
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        num_warps=8 if head_dim_pad > 128 else 4, num_stages=2,
    )


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                    max_q_len=None, num_splits=None):
    """Causal attention of the packed new tokens q over their sequences' paged K/V.
    q [num_tokens, n_head, head_dim]; caches [num_blocks, block_size, n_kv_head, head_dim];
    block_tables int32 [num_seqs, max_blocks] (-1 past the end); seq_lens int32 [num_seqs]
    (context including the new tokens); cu_seqlens_q int32 [num_seqs + 1].
    max_q_len (>= every q_len; if known) saves a device->host sync; num_splits forces the
    split-KV choice (default: default_num_splits)."""
    assert q.dim() == 3 and k_cache.dim() == 4, "q is [num_tokens, n_head, head_dim], caches are 4-D"
    num_tokens, n_head, head_dim = q.shape
    block_size, n_kv_head = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    assert q.dtype in DTYPES, f"unsupported dtype {q.dtype}"
    assert k_cache.dtype == v_cache.dtype == q.dtype, \
        f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
    assert v_cache.shape == k_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    assert k_cache.shape[3] == head_dim, f"head_dim of q ({head_dim}) != that of the caches ({k_cache.shape[3]})"
    assert head_dim in HEAD_DIMS, f"head_dim {head_dim} not supported, use one of {HEAD_DIMS}"
    assert n_head % n_kv_head == 0, f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})"
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert t.device == q.device, f"{name} is on {t.device}, q on {q.device}"
    assert k_cache.device == v_cache.device == q.device, "q and the caches must share a device"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables is [num_seqs, max_blocks]"
    assert seq_lens.dim() == 1 and cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q is [num_seqs + 1]"
    assert q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1, "head_dim must be contiguous"
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous()

    out = torch.empty((num_tokens, n_head, head_dim), device=q.device, dtype=q.dtype)  # (T, nh, D)
    if num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # device->host sync
    if num_splits is None:
        num_splits = default_num_splits(q, num_seqs, n_kv_head, max_q_len, block_tables.shape[1] * block_size)

    config = kernel_config(q.dtype, head_dim, n_head // n_kv_head, block_size, max_q_len, num_splits)
    if num_splits == 1:
        partial, lse = out[:, :, None], out  # write the final output directly; no lse
    else:
        partial = torch.empty((num_tokens, n_head, num_splits, head_dim), device=q.device, dtype=torch.float32)
        lse = torch.empty((num_tokens, n_head, num_splits), device=q.device, dtype=torch.float32)

    grid = (num_seqs, triton.cdiv(max_q_len, config["BLOCK_Q"]), n_kv_head * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, partial, lse,
        block_tables, seq_lens, cu_seqlens_q,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        block_tables.stride(0),
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2, cheaper than exp
        **config,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens * n_head,)](
            partial, lse, out,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=config["HEAD_DIM_PAD"],
        )
    return out


# -----------------------------------------------------------------------------
# KV store: write the new tokens' K/V into their cache slots


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    N_KV_HEAD: tl.constexpr, N_KV_HEAD_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # one program per token: copy its (n_kv_head, head_dim) K and V rows into its slot
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # -1: skip this token
        return
    h = tl.arange(0, N_KV_HEAD_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < N_KV_HEAD) & (d < HEAD_DIM)
    cache_offs = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping, use_triton=None):
    """Write k, v [num_tokens, n_kv_head, head_dim] into the caches at slot_mapping
    (slot = block_id * block_size + offset); a slot of -1 skips its token. On CUDA (or with
    use_triton=True) a Triton kernel does it without the device->host sync of the torch op."""
    num_tokens, n_kv_head, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[:2]
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), "k, v [T, n_kv_head, D], slot_mapping [T]"
    assert k_cache.shape == v_cache.shape == (num_blocks, block_size, n_kv_head, head_dim), "caches do not match k"
    if use_triton is None:
        use_triton = k.is_cuda
    if not use_triton:
        slots = slot_mapping.long()
        if (slots < 0).any():
            keep = slots >= 0
            slots, k, v = slots[keep], k[keep], v[keep]
        # one row per slot: view, not reshape, so a cache that is not contiguous over (block, slot) fails loudly
        k_cache.view(num_blocks * block_size, n_kv_head, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(num_blocks * block_size, n_kv_head, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    assert k.stride(2) == v.stride(2) == k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride() and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_KV_HEAD=n_kv_head, N_KV_HEAD_PAD=triton.next_power_of_2(n_kv_head),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )


# -----------------------------------------------------------------------------
# Torch paged path (the engine's attention on the CPU)

_buffers = {}  # (name, device, dtype, inference mode) -> flat tensor, grown as needed and reused across calls


def _buffer(name, shape, like):
    """A tensor of the given shape with like's device and dtype, carved from a reused buffer."""
    numel = math.prod(shape)
    key = (name, like.device, like.dtype, torch.is_inference_mode_enabled())  # inference tensors stay inside
    if key not in _buffers or _buffers[key].numel() < numel:
        _buffers[key] = torch.empty(numel, device=like.device, dtype=like.dtype)
    return _buffers[key][:numel].view(shape)


def _gather_kv(k_cache, v_cache, block_table, positions):
    """K and V at positions [B, L] of the B sequences whose block tables are block_table
    [B, max_blocks], each returned as a [B, n_kv_head, L, head_dim] view for attention."""
    block_size, n_kv_head, head_dim = k_cache.shape[1:]
    blocks = block_table.gather(1, positions // block_size).long()                 # (B, L)
    slots = (blocks * block_size + positions % block_size).flatten()              # (B*L,)
    rows = (len(slots), n_kv_head, head_dim)
    k = torch.index_select(k_cache.flatten(0, 1), 0, slots, out=_buffer("k", rows, k_cache))
    v = torch.index_select(v_cache.flatten(0, 1), 0, slots, out=_buffer("v", rows, v_cache))
    shape = (*positions.shape, n_kv_head, head_dim)                               # (B, L, nkv, D)
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)           # (B, nkv, L, D) each


def _attend(q, k, v, mask, scale):
    """q [B, n_kv_head, M, D] (M stacks the group's query heads), k, v [B, n_kv_head, L, D],
    mask broadcastable to [B, n_kv_head, M, L], True = attend. Computes in fp32 (fp64 for fp64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return F.scaled_dot_product_attention(q.to(acc), k.to(acc), v.to(acc), attn_mask=mask, scale=scale)


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len=None):
    """paged_attention in plain torch: the decoding sequences (q_len == 1) in one batched call,
    then one call per sequence with more new tokens. Accepts float64 (the tests run models in
    it). max_q_len is accepted for the same signature; this path reads the lengths on the host.
    K/V are gathered only from positions < seq_len, so unused slots (even NaN) are never read."""
    n_head, head_dim = q.shape[1:]
    n_kv_head = k_cache.shape[2]
    group = n_head // n_kv_head
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim
    assert n_head % n_kv_head == 0, "n_head must be a multiple of n_kv_head"
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        rows = cu_seqlens_q.index_select(0, idx).long()                           # (B,) their one new token
        ctx = seq_lens.index_select(0, idx).long()[:, None]                       # (B, 1)
        pos = torch.arange(max(lens[i] for i in decode), device=q.device)[None]   # (1, L)
        # positions past a sequence's end re-read its last token: real values, masked out below
        k, v = _gather_kv(k_cache, v_cache, block_tables.index_select(0, idx), torch.minimum(pos, ctx - 1))
        q_dec = q.index_select(0, rows).view(len(decode), n_kv_head, group, head_dim)  # (B, nkv, G, D)
        o = _attend(q_dec, k, v, (pos < ctx)[:, None, None, :], scale)           # (B, nkv, G, D)
        out.index_copy_(0, rows, o.reshape(len(decode), n_head, head_dim).to(q.dtype))

    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        pos = torch.arange(lens[i], device=q.device)                              # (L,)
        k, v = _gather_kv(k_cache, v_cache, block_tables[i : i + 1], pos[None])   # (1, nkv, L, D)
        q_seq = q[cu[i] : cu[i + 1]].view(q_len, n_kv_head, group, head_dim)
        q_seq = q_seq.permute(1, 2, 0, 3).reshape(1, n_kv_head, group * q_len, head_dim)
        # causal: new token j sits at position L - q_len + j and sees positions 0..that
        mask = pos[None, :] <= pos[lens[i] - q_len :, None]                       # (q_len, L)
        o = _attend(q_seq, k, v, mask.repeat(group, 1), scale)                    # (1, nkv, G*q_len, D)
        o = o.view(n_kv_head, group, q_len, head_dim).permute(2, 0, 1, 3)          # (q_len, nkv, G, D)
        out[cu[i] : cu[i + 1]] = o.reshape(q_len, n_head, head_dim).to(q.dtype)
    return out


# -----------------------------------------------------------------------------
# Naive reference: contiguous K/V, one sequence at a time, nothing clever


def naive_attention(q, k, v, cu_seqlens_q, seq_lens, scale):
    """q [num_tokens, n_head, D] packed new tokens; k, v [sum(seq_lens), n_kv_head, D] with
    each sequence's whole context concatenated in order. Returns [num_tokens, n_head, D]."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_head, n_kv_head = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    kv_start = 0
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        q_len = q_end - q_start
        qs = q[q_start:q_end].to(acc)                                             # (q_len, nh, D)
        ks = k[kv_start : kv_start + seq_len].to(acc)                             # (seq_len, nkv, D)
        vs = v[kv_start : kv_start + seq_len].to(acc)
        ks = ks.repeat_interleave(n_head // n_kv_head, dim=1)                     # (seq_len, nh, D)
        vs = vs.repeat_interleave(n_head // n_kv_head, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale                     # (nh, q_len, seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        scores = scores.masked_fill((k_pos > q_pos).to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
        kv_start += seq_len
    return out
