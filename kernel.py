"""
Paged attention for nanopaged: the KV store, a Triton kernel that reads K/V through block
tables, a plain-torch path for the CPU, a naive contiguous reference to check both, and the
attention backends the engine picks them by (ATTENTION_BACKENDS). A block table is a sequence's,
or, for a read policy (Quest: Tang et al., ICML 2024), one per sequence and KV head that lists
only the blocks that head reads: every path is still one gather through a table.
PagedAttention: Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023.

Tests: python -m pytest -q test_nanopaged.py   (no GPU: Triton runs under TRITON_INTERPRET=1)
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, NamedTuple

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
# Which keys a query sees: one rule, Mask, for every attention kind and every path below. A
# query at position p sees key k iff k <= p (causal) and k is either one of the first `sink`
# positions or at or after first_seen(p), the latest of
#   p - window + 1   a sliding window of the last `window` positions, its own included (Jiang
#                    et al., "Mistral 7B", 2023, after Beltagy et al., "Longformer", 2020;
#                    transformers' sliding_window_overlay: k > p - window)
#   p - p % chunk    chunked local attention: only p's own chunk of `chunk` positions (Llama 4;
#                    transformers' chunked_overlay: k // chunk == p // chunk)
# and 0. The defaults are full attention; sinks beside a window are StreamingLLM's (Xiao et
# al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024). first_seen never
# decreases with p, so every path reads the keys of a run of new tokens as the sinks, then
# first_seen of its first token on: the blocks between are never read, nor their block-table
# entries, and the allocator may give them back.

NO_LIMIT = 2**31 - 1  # a window or chunk no context reaches: full attention, to the kernel


class Mask(NamedTuple):
    """The rule above. A fork may subclass it and override first_seen (and reach) for a rule of
    its own: the torch path calls these methods, but the Triton and flex kernels read only
    kernel_args and apply the rule above to them. So they refuse a subclass (kernels_follow)
    unless its own class body defines kernel_args, which says "the kernels' rule on these
    numbers is my rule". Masks of two classes are never equal, whatever their fields."""
    window: int | None = None  # the last `window` positions
    chunk: int | None = None  # p's own chunk of `chunk` positions
    sink: int = 0  # the first `sink` positions, whatever else

    def first_seen(self, p):
        """The first key past the sinks that a query at position p sees: p an int, or an
        integer tensor of positions."""
        after = p - self.window + 1 if self.window else p * 0
        within = p - p % self.chunk if self.chunk else p * 0
        if isinstance(p, torch.Tensor):
            return torch.maximum(after, within)
        return max(after, within)

    def visible(self, q_pos, k_pos):
        """Whether the query at q_pos sees the key at k_pos (integer tensors, broadcast)."""
        return (k_pos <= q_pos) & ((k_pos >= self.first_seen(q_pos)) | (k_pos < self.sink))

    def reach(self, context):
        """The most keys a query sees in a context of that many positions."""
        return min(context, self.sink + min(self.window or NO_LIMIT, self.chunk or NO_LIMIT))

    @property
    def kernel_args(self):  # what the Triton kernel takes: ints, NO_LIMIT for none
        return self.window or NO_LIMIT, self.chunk or NO_LIMIT, self.sink

    # A tuple equals any tuple of the same fields: a fork's rule would pass for full attention,
    # or share a torch-path plan with a Mask of the same numbers. The class is part of the rule.
    def __eq__(self, other):
        return type(self) is type(other) and tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((type(self), tuple(self)))


FULL_ATTENTION = Mask()


def kernels_follow(mask):
    """Whether the kernels' rule on mask.kernel_args (window, chunk, sink) is mask's own rule:
    mask is None, a Mask, or of a subclass whose own body defines kernel_args. A subclass of
    such a subclass says so again: it may have changed the rule."""
    return mask is None or type(mask) is Mask or "kernel_args" in vars(type(mask))


def kernels_refuse(mask, name):
    """Why the kernel of that name cannot honour mask, or None (for unsupported_mask)."""
    if kernels_follow(mask):
        return None
    return (f"its mask {type(mask).__name__} is a subclass of kernel.Mask, and {name} applies "
            f"only Mask's own rule to kernel_args (window, chunk, sink); a subclass declares "
            f"that rule its own by defining kernel_args in its own class body")


def check_mask(mask):
    """A Mask of counts of positions below 2**31 (or None: full attention)."""
    assert mask is None or isinstance(mask, Mask), f"mask must be a kernel.Mask, got {mask!r}"
    for name, least in (("window", 1), ("chunk", 1), ("sink", 0)):
        n, optional = getattr(mask or FULL_ATTENTION, name), name != "sink"
        assert (n is None and optional) or (type(n) is int and least <= n < NO_LIMIT), \
            f"Mask.{name} must be {'None or ' * optional}an int in {least}..{NO_LIMIT - 1}, " \
            f"got {n!r}"


# -----------------------------------------------------------------------------
# Triton paged attention: one kernel for prefill, decode, chunked prefill and prefill on
# top of a cached prefix. FlashAttention-2's online softmax (Dao, 2023) over K/V tiles
# gathered through the block table, as in vLLM's paged attention; GQA heads share loads.
# A step launches it twice at most, with tile shapes of their own: once over the decoding
# sequences (one new token each, optionally split along the context), once over the query
# tiles of all the others, numbered across sequences as in vLLM's unified attention. A
# program's keys are its mask's: the sinks before the first key its first row sees, then from
# there to its last row, numbered one after the other, so a split and a tile never land on a
# block between them. A program reads one KV head's table: its sequence's, or, for a read policy
# (Quest), a table of its own that lists only the blocks that head reads; the binary is the same.


# the sequence and split counts, the block tables' width, the mask and the split partials'
# strides change from step to step or layer to layer, and the tables' and lengths' head strides
# are 0 where every KV head shares them: Triton's specialization of integers (== 1, divisible by
# 16, which 0 is) would recompile, and a read policy's per-head tables would be a binary of their
# own
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "window", "chunk", "sink", "stride_lt",
                               "stride_lh", "stride_bt", "stride_bh", "stride_ns", "stride_nh"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, num_seqs, num_splits,
    window, chunk, sink,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_bt, stride_bh,
    stride_ns, stride_nh,
    qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DECODE: tl.constexpr, SPLIT_KV: tl.constexpr, SINKS: tl.constexpr,
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
    # this KV head's context: its sequence's, or, read through a per-head table, the tokens of
    # the blocks its table lists, numbered as the table's own positions
    seq_len = tl.load(seq_lens_ptr + seq * stride_ns + kv_head * stride_nh)
    table_ptr = block_tables_ptr + seq * stride_bt + kv_head * stride_bh
    if (q_len == 1) != DECODE or q_tile * BLOCK_Q >= q_len:  # the other launch's, or past the end
        return

    # row r of the tile is new token r // GROUP_PAD under query head r % GROUP_PAD of the
    # group: the group's heads share every K/V tile this program loads
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = seq_len - q_len + q_idx  # its position
    # it sees keys first_seen <= k <= q_pos, q_span of them, and the sinks k < q_sink (Mask)
    q_span = q_pos - tl.maximum(q_pos - window + 1, q_pos - q_pos % chunk) + 1
    if SINKS:
        q_sink = tl.minimum(sink, q_pos + 1)
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

    # keys past the tile's last new token are masked for every row, and so are keys between the
    # sinks and the first key its first row sees: never load them. Key j of the program is at
    # position kv_start + j; with sinks, at j among the num_sink sinks, then at
    # kv_start + j - num_sink (in a binary of its own: the second index costs registers that
    # would spill in the 8-bit caches' decode and prefill at some head sizes)
    first_pos = seq_len - q_len + q_tile * BLOCK_Q
    kv_start = tl.maximum(first_pos - window + 1, first_pos - first_pos % chunk)
    kv_end = seq_len - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    num_sink = 0
    if SINKS:
        num_sink = tl.minimum(sink, kv_start)
    # split-KV (Flash-Decoding): this program takes one share of the keys, a whole number of
    # BLOCK_N-key tiles
    per_split = tl.cdiv(tl.cdiv(num_sink + kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_sink + kv_end - kv_start)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_mask = j < hi
        if SINKS:
            pos = tl.where(j < num_sink, j, j - num_sink + kv_start)
        else:
            pos = j + kv_start
        # the physical slot of each key, so BLOCK_N does not depend on the cache block size;
        # masked lanes never read a padded (-1) table entry or a slot past seq_len
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=j_mask, other=0)
        block = block.to(tl.int64)  # likewise block * stride in a large cache
        offset = pos % BLOCK_SIZE
        kv_mask = j_mask[:, None] & d_mask[None, :]
        slot_offs = block * stride_cb + offset * stride_cs + kv_head * stride_ch  # K and V alike
        kv_offs = slot_offs[:, None] + d[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # (N, D_PAD)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # (N, D_PAD)
        if k_scale_ptr is not None:  # fp8 -> fp16 is exact and cheap (e5m2 is fp16's top byte);
            k, v = k.to(tl.float16), v.to(tl.float16)  # fp16 -> bf16 too, for fp8's few bits
        k, v = k.to(DOT_DTYPE), v.to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N) fp32
        if DECODE:  # one new token, and the loop runs over exactly the keys it sees
            s = tl.where(j_mask[None, :], s, float("-inf"))
        else:  # 0 <= q_pos - pos < q_span (one unsigned compare), or a sink (a second one)
            behind = (q_pos[:, None] - pos[None, :]).to(tl.uint32)
            seen = behind < q_span[:, None].to(tl.uint32)
            if SINKS:
                seen |= pos[None, :] < q_sink[:, None]
            s = tl.where(j_mask[None, :] & seen, s, float("-inf"))
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


def kernel_config(dtype, head_dim, group, block_size, decode, split_kv=False, cache_dtype=None,
                  sinks=False):
    """The paged-attention kernel's compile-time constants and launch options for the decode
    launch (decode=True) or the prefill launch of one call (sinks: its mask has some). Sized
    for the ~100 KiB of shared memory of consumer GPUs, and for no register spills (the compile
    gate checks both)."""
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
        DECODE=decode, SPLIT_KV=split_kv, SINKS=sinks,
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


def check_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, num_splits=None,
                 k_scale=None, v_scale=None, mask=None):
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
    check_tables(block_tables, seq_lens, n_kv_head, mask)
    assert kernels_follow(mask), kernels_refuse(mask, "the Triton kernel")
    assert cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q is [num_seqs + 1]"
    assert q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1, "head_dim must be contiguous"
    assert block_tables.stride(-1) == 1 and cu_seqlens_q.is_contiguous()
    assert num_splits is None or 1 <= num_splits <= MAX_SPLITS, f"num_splits is in 1..{MAX_SPLITS}"


def check_tables(block_tables, seq_lens, n_kv_head, mask):
    """Every path's check of the tables and lengths: a table and a length per sequence, or, for a
    read policy's selection, per sequence and KV head, and then full attention only (a per-head
    table numbers its keys as its own positions, which a window or a chunk would misplace)."""
    check_mask(mask)
    num_seqs = seq_lens.shape[0]
    assert block_tables.dim() in (2, 3) and block_tables.shape[0] == num_seqs, \
        "block_tables is [num_seqs, max_blocks], or [num_seqs, n_kv_head, max_blocks]"
    if block_tables.dim() == 2:
        assert seq_lens.dim() == 1, "seq_lens is [num_seqs] with a block table per sequence"
        return
    assert block_tables.shape[1] == n_kv_head and seq_lens.shape == (num_seqs, n_kv_head), \
        f"per-head block_tables are [num_seqs, n_kv_head ({n_kv_head}), max_blocks], with " \
        f"seq_lens [num_seqs, n_kv_head]: got {tuple(block_tables.shape)}, {tuple(seq_lens.shape)}"
    assert mask in (None, FULL_ATTENTION), \
        f"per-head block_tables number a head's keys as the table's own positions: they take " \
        f"full attention, not {mask}"


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                    max_q_len=None, num_splits=None, k_scale=None, v_scale=None, mask=None):
    """Causal attention of the packed new tokens q over their sequences' paged K/V.
    q [num_tokens, n_head, head_dim]; caches [num_blocks, block_size, n_kv_head, head_dim];
    block_tables int32 [num_seqs, max_blocks] (-1 past the end); seq_lens int32 [num_seqs]
    (context including the new tokens); cu_seqlens_q int32 [num_seqs + 1]. Or, for a read
    policy's selection (full attention only), block_tables [num_seqs, n_kv_head, max_blocks] and
    seq_lens [num_seqs, n_kv_head]: each KV head reads the blocks its own table lists, in order,
    as a context of their seq_lens tokens whose last q_len are the new tokens (a decode keeps
    its last block; a prefill repeats its whole table).
    max_q_len (>= every q_len; if known) saves a device->host sync; num_splits (1..64) forces
    the split-KV of the decoding sequences (default: split_count, on a GPU). An 8-bit cache
    comes with k_scale and v_scale, one-element fp32 tensors on q's device (see quantize).
    mask: which keys a token sees (a Mask: a sliding window, a chunk, sinks), or None for full
    attention. Table entries of blocks wholly between a sequence's sinks and the first key its
    first new token sees are never read: they may be anything (-1 for a freed block)."""
    check_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, num_splits, k_scale,
                 v_scale, mask)
    mask = mask or FULL_ATTENTION
    num_tokens, n_head, head_dim = q.shape
    block_size, n_kv_head = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    # a table and a length per (sequence, KV head): a shared one is a view with head stride 0
    if block_tables.dim() == 2:
        block_tables = block_tables[:, None].expand(-1, n_kv_head, -1)           # (S, nkv, W)
        seq_lens = seq_lens[:, None].expand(-1, n_kv_head)                       # (S, nkv)
    out = torch.empty((num_tokens, n_head, head_dim), device=q.device, dtype=q.dtype)  # (T, nh, D)
    if num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # device->host sync
    group = n_head // n_kv_head

    def args(out, lse, num_splits):
        return (q, k_cache, v_cache, out, lse, block_tables, seq_lens, cu_seqlens_q,
                num_seqs, num_splits, *mask.kernel_args, k_scale, v_scale,
                q.stride(0), q.stride(1), *k_cache.stride()[:3],
                *out.stride()[:3], *lse.stride()[:2],
                *block_tables.stride()[:2], *seq_lens.stride(),
                scale * 1.4426950408889634)  # log2(e): the kernel uses exp2, cheaper than exp

    # decode: one program per sequence x KV head x split; those not decoding exit at once
    decode = kernel_config(q.dtype, head_dim, group, block_size, decode=True,
                           cache_dtype=k_cache.dtype, sinks=mask.sink > 0)
    if num_splits is None:
        resident = _resident_programs(q, args(out[:, :, None], out, 1), decode) if q.is_cuda else 0
        context = block_tables.shape[-1] * block_size  # the longest a decode can read
        num_splits = split_count(num_seqs, n_kv_head, mask.reach(context), resident)
    if num_splits == 1:
        _paged_attention_kernel[(num_seqs, n_kv_head, 1)](*args(out[:, :, None], out, 1), **decode)
    else:  # partials of the decoding sequences, in buffers reused across calls (for CUDA graphs)
        f32 = q.new_empty(0, dtype=torch.float32)
        partial = _buffer("partial", (num_seqs, n_head, num_splits, head_dim), f32)  # (S, nh, n, D)
        lse = _buffer("lse", (num_seqs, n_head, num_splits), f32)                     # (S, nh, n)
        decode = kernel_config(q.dtype, head_dim, group, block_size, decode=True, split_kv=True,
                               cache_dtype=k_cache.dtype, sinks=mask.sink > 0)
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
                                cache_dtype=k_cache.dtype, sinks=mask.sink > 0)
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


def _gather_kv(k_cache, v_cache, slots, shape, scales, dtype, per_head=False):
    """K and V at the physical slots (flattened [B, L] positions of B sequences), each returned
    as a [B, n_kv_head, L, head_dim] view for attention, in dtype (dequantized with scales,
    (k_scale, v_scale), for an 8-bit cache). per_head: slots are flattened [B, n_kv_head, L]
    rows of the caches' (slot, KV head) pairs, each KV head's own keys (per-head tables)."""
    n_kv_head, head_dim = k_cache.shape[2:]
    rows = (len(slots), head_dim) if per_head else (len(slots), n_kv_head, head_dim)
    flat = 2 if per_head else 1  # rows of (slot, KV head) pairs, or of slots
    k = torch.index_select(k_cache.flatten(0, flat), 0, slots, out=_buffer("k", rows, k_cache))
    v = torch.index_select(v_cache.flatten(0, flat), 0, slots, out=_buffer("v", rows, v_cache))
    k, v = (dequantize(x, s, dtype) for x, s in zip((k, v), scales))
    B, L = shape
    if per_head:
        return k.view(B, n_kv_head, L, head_dim), v.view(B, n_kv_head, L, head_dim)
    shape = (B, L, n_kv_head, head_dim)                                            # (B, L, nkv, D)
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)  # (B, nkv, L, D) each


def _attend(q, k, v, mask, scale):
    """q [B, n_kv_head, M, D] (M stacks the group's query heads), k, v [B, n_kv_head, L, D],
    mask broadcastable to [B, n_kv_head, M, L], True = attend. Computes in fp32 (fp64 for fp64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return F.scaled_dot_product_attention(q.to(acc), k.to(acc), v.to(acc), attn_mask=mask,
                                          scale=scale)


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                          max_q_len=None, decode_attention=None, k_scale=None, v_scale=None,
                          plan=None, mask=None):
    """paged_attention in plain torch: the decoding sequences (q_len == 1) in one batched call,
    those with a few new tokens (2 to SHORT_Q_LEN: speculative verification, short prompts) in
    another, then one call per sequence with more; a batched call that would gather more than
    CHUNK_BYTES of K/V is cut into several. Accepts float64 (the tests run models in
    it). max_q_len is accepted for the same signature; this path reads the lengths on the host.
    K/V are gathered only from positions < seq_len, so unused slots (even NaN) are never read;
    with a mask (paged_attention's), only from its sinks and from the first key each sequence's
    first new token sees on, so the blocks between are not read and their table entries may be
    anything. decode_attention: a function (q, k_cache, v_cache, block_tables, seq_lens, scale,
    mask) of the decoding rows alone that replaces their batched call (paged_attention_flex,
    opt-in; it takes no per-head tables). Per-head tables (paged_attention's) are gathered per
    (sequence, KV head): each head reads only the blocks its table lists. An 8-bit cache comes
    with k_scale and v_scale: what is gathered is dequantized to q's dtype. plan: a dict that
    every layer of one step with this mask passes (the backend keeps it in GroupBatch.scratch,
    one per KV cache group): the first call fills it with the step's gather indices and masks,
    the others reuse them (as vLLM builds its attention metadata once per step), so a layer is
    a few ops: gather, attend, scatter."""
    n_head, head_dim = q.shape[1:]
    n_kv_head = k_cache.shape[2]
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim
    assert n_head % n_kv_head == 0, "n_head must be a multiple of n_kv_head"
    check_scales(q, k_cache, v_cache, k_scale, v_scale)
    check_tables(block_tables, seq_lens, n_kv_head, mask)
    mask = mask or FULL_ATTENTION
    if decode_attention is not None and k_scale is not None:
        raise ValueError("paged_attention_flex reads the cache in place: it takes no 8-bit cache")
    if decode_attention is not None and block_tables.dim() == 3:
        raise ValueError("paged_attention_flex's block mask lists one table's blocks per "
                         "sequence: it takes no per-head block tables (a read policy's selection)")
    plan = {} if plan is None else plan
    if not plan:  # this step's first layer: the indices every layer reuses
        token_bytes = 2 * n_kv_head * head_dim * q.element_size()  # K and V, as attended
        plan.update(_attention_plan(block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1],
                                    n_head // n_kv_head, decode_attention is None, token_bytes,
                                    mask))
    assert plan["mask"] == mask, "a plan serves the layers of one mask"
    out = None if plan["whole"] else torch.empty_like(q)
    if decode_attention is not None and plan["decode"] is not None:
        idx = plan["decode"]
        rows = cu_seqlens_q.index_select(0, idx).long()              # (B,) their one new token
        o = decode_attention(q.index_select(0, rows), k_cache, v_cache,
                             block_tables.index_select(0, idx), seq_lens.index_select(0, idx),
                             scale, mask)                                        # (B, nh, D)
        out.index_copy_(0, rows, o.to(q.dtype))
    for rows, slots, (B, Q, L), seen, kept, written in plan["calls"]:
        k, v = _gather_kv(k_cache, v_cache, slots, (B, L), (k_scale, v_scale), q.dtype,
                          plan["per_head"])
        q_b = q if out is None else q.index_select(0, rows)
        q_b = q_b.view(B, Q, n_kv_head, -1, head_dim).permute(0, 2, 3, 1, 4)
        q_b = q_b.reshape(B, n_kv_head, -1, head_dim)  # (B, nkv, G*Q, D): per K/V head, G x Q
        o = _attend(q_b, k, v, seen, scale).view(B, n_kv_head, -1, Q, head_dim)
        o = o.permute(0, 3, 1, 2, 4).reshape(B * Q, n_head, head_dim)             # (B*Q, nh, D)
        if out is None:  # the plan's one call took q whole
            return o.to(q.dtype)
        out.index_copy_(0, written, (o if kept is None else o[kept]).to(q.dtype))
    return out


SHORT_Q_LEN = 16  # sequences with at most this many new tokens share one padded call
CHUNK_BYTES = 8 << 20  # K/V one call gathers, at most, unless one sequence alone has more


def _attention_plan(block_tables, seq_lens, cu_seqlens_q, block_size, G, decodes, token_bytes,
                    mask=FULL_ATTENTION):
    """The step's calls, each a batch of sequences padded to its most new tokens, Q, and its
    longest span, L: the keys a sequence's new tokens see, its mask's sinks and then from the
    first key its first new token sees to its end (paged_attention's numbering). The decodes
    (unless decode_attention takes them), those with 2 to SHORT_Q_LEN new tokens when there are
    several, then each other sequence alone (_plan_batches). A batch whose gathered K/V
    (token_bytes a position) would pass CHUNK_BYTES is cut, shortest spans first, into calls that
    stay within it: each call pads only to its own longest span, and its copy stays small
    (results/README.md, Kernel: the sweep of the budget). A call is (rows of q, slots to gather,
    (B, Q, L), seen (B, H, G*Q, L) or None, rows of o kept, rows of out written): a padding row
    repeats its sequence's last and is not written back; keys past a sequence's span re-read its
    last one, real values that seen hides. H is 1, or n_kv_head with per-head tables: each
    (sequence, KV head) then has its own span, and the slots are rows of the caches' (slot, KV
    head) pairs (per_head). Indices are built on the host, which knows the lengths."""
    cu, dev = cu_seqlens_q.tolist(), block_tables.device
    tables = block_tables if block_tables.dim() == 3 else block_tables[:, None]   # (S, H, W)
    H = tables.shape[1]
    lens = seq_lens.view(len(cu) - 1, H).tolist()  # a length per (sequence, table)
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    # per (sequence, table): the first key its first new token sees, its sinks, its span
    starts = [[mask.first_seen(n - q) for n in ns] for ns, q in zip(lens, q_lens)]
    sinks = [[min(mask.sink, start) for start in ss] for ss in starts]
    spans = [[k + n - s for k, n, s in zip(ks, ns, ss)] for ks, ns, ss in zip(sinks, lens, starts)]
    longest = [max(ss) for ss in spans]  # what a sequence pads a call to
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    chunks = _plan_batches(q_lens, longest, decodes, token_bytes)
    calls = []
    for seqs in chunks:
        B, Q, L = len(seqs), max(q_lens[i] for i in seqs), max(longest[i] for i in seqs)
        last = [(i, min(j, q_lens[i] - 1)) for i in seqs for j in range(Q)]  # row j, or the last
        rows = torch.tensor([cu[i] + j for i, j in last], device=dev)             # (B*Q,)
        span = torch.tensor([spans[i] for i in seqs], device=dev)[:, :, None]     # (B, H, 1)
        start = torch.tensor([starts[i] for i in seqs], device=dev)[:, :, None]   # (B, H, 1)
        sink = torch.tensor([sinks[i] for i in seqs], device=dev)[:, :, None]     # (B, H, 1)
        key = torch.minimum(torch.arange(L, device=dev), span - 1)                # (B, H, L)
        positions = torch.where(key < sink, key, key - sink + start)              # (B, H, L)
        blocks = tables[seqs].gather(2, positions // block_size).long()           # (B, H, L)
        slots = blocks * block_size + positions % block_size                      # (B, H, L)
        if H > 1:  # KV head h of slot s is row s * H + h of the caches' (slot, head) pairs
            slots = slots * H + torch.arange(H, device=dev)[:, None]
        slots = slots.flatten()                                                   # (B*H*L,)
        seen = None  # decodes of one span: nothing to hide
        if Q > 1 or any(n < L for i in seqs for n in spans[i]):
            # new token j of a sequence sits at position len - q_len + j: the mask's rule, and
            # no key past the span (a padding repeat)
            q_pos = torch.tensor([[lens[i][h] - q_lens[i] + j for h in range(H)] for i, j in last],
                                 device=dev).view(B, Q, H).transpose(1, 2)[..., None]  # (B,H,Q,1)
            seen = mask.visible(q_pos, positions[:, :, None, :])                   # (B, H, Q, L)
            seen &= torch.arange(L, device=dev) < span[..., None]
            seen = seen.repeat(1, 1, G, 1)                                         # (B,H,G*Q,L)
        kept = [b * Q + j for b, i in enumerate(seqs) for j in range(q_lens[i])]
        kept = None if len(kept) == B * Q else torch.tensor(kept, device=dev)
        calls.append((rows, slots, (B, Q, L), seen, kept, rows if kept is None else rows[kept]))
    # one call of every sequence in order, no padding rows: its q is q, its output the output
    whole = chunks == [list(range(len(lens)))] and calls[0][4] is None
    return dict(calls=calls, whole=whole, mask=mask, per_head=H > 1,
                decode=torch.tensor(decode, device=dev) if decode and not decodes else None)


def _plan_batches(q_lens, spans, decodes, token_bytes):
    """Which sequences share a call (_attention_plan's): the decodes (unless decodes is False),
    those with 2 to SHORT_Q_LEN new tokens when there are several, then each other sequence
    alone; a batch whose K/V would pass CHUNK_BYTES cut, shortest spans first."""
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    short = [i for i, n in enumerate(q_lens) if 1 < n <= SHORT_Q_LEN]
    short = [short] if len(short) > 1 else [[i] for i in short]
    long = [[i] for i, n in enumerate(q_lens) if n > SHORT_Q_LEN]
    batches = ([decode] if decode and decodes else []) + short + long
    chunks = []
    for batch in batches:  # to be cut, shortest first: a call's spans are then alike
        if len(batch) * max(spans[i] for i in batch) * token_bytes > CHUNK_BYTES:
            batch = sorted(batch, key=lambda i: spans[i])
        chunks.append(batch[:1])
        for i in batch[1:]:  # the longest span so far, so the one the call would pad to
            if (len(chunks[-1]) + 1) * spans[i] * token_bytes > CHUNK_BYTES:
                chunks.append([])
            chunks[-1].append(i)
    return chunks


_flex = None  # flex_attention compiled by Inductor, made on first use (tens of seconds)


def paged_attention_flex(q, k_cache, v_cache, block_tables, seq_lens, scale, mask=None):
    """Decode (one new token a sequence: q [B, n_head, D]) with torch's flex_attention compiled
    by Inductor for the CPU, reading K/V straight from the cache through the block table: no
    gather. The whole cache is the key axis of every sequence; a block mask lists, per sequence,
    the physical blocks it uses (torch's own paged attention helper does the same): see
    _flex_block_mask. flex reads whole blocks, and on the CPU it has no log-sum-exp to merge a
    separately computed tail, so this writes zeros into the slots past each sequence's end in
    its last block (slots no sequence reads: a shared block is copied before a write) where
    0 * NaN would spoil the result; the other slots a mask hides in a block it reads hold real
    K/V, which stay. Opt-in: paged_attention_torch(..., decode_attention=paged_attention_flex)."""
    global _flex
    assert kernels_follow(mask), kernels_refuse(mask, "flex attention")
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
    block_mask = _flex_block_mask(block_tables, seq_lens, num_blocks, block_size,
                                  mask or FULL_ATTENTION)
    k, v = (c.view(1, -1, n_kv_head, head_dim).transpose(1, 2).expand(B, -1, -1, -1)
            for c in (k_cache, v_cache))                                        # (B, nkv, slots, D)
    with torch.no_grad():  # flex compiles for inference only on the CPU
        o = _flex(q.view(B, -1, 1, head_dim), k, v, block_mask=block_mask, scale=scale,
                  enable_gqa=True)
    return o.view(B, -1, head_dim)                                                 # (B, nh, D)


def _flex_block_mask(block_tables, seq_lens, num_blocks, block_size, mask):
    """The decodes' flex BlockMask over the whole cache: per sequence, the physical blocks of its
    table whose slots its query sees, as full blocks where it sees all of them and as partial
    ones where it sees some (the mask_mod hides the rest: past its end, before the first key it
    sees, past its sinks)."""
    from torch.nn.attention.flex_attention import BlockMask
    B, width = block_tables.shape
    dev = seq_lens.device
    q_pos = seq_lens - 1                                                             # (B,)
    pos = torch.arange(width * block_size, device=dev).view(width, block_size)      # (width, bs)
    num_seen = mask.visible(q_pos[:, None, None], pos).sum(-1)                       # (B, width)

    def listed(blocks):  # (B, width) bool -> flex's count and ids of those blocks, first first
        order = blocks.int().argsort(dim=1, descending=True, stable=True)
        ids = F.pad(block_tables.gather(1, order).clamp(min=0), (0, num_blocks - width))
        return blocks.sum(1).int().view(B, 1, 1), ids.int().view(B, 1, 1, num_blocks)
    # The rule again in the mask_mod, on each slot's position, read through the logical index of
    # its block in the sequence's table: the block lists only skip work in compiled code, and
    # past Dynamo's recompile limit flex runs eagerly, where the mask_mod alone decides (every
    # other sequence's blocks would be seen). Its tensors have static sizes (B padded to a power
    # of two: a compile per size): Inductor's CPU flex template renames its split-size symbols
    # in the mask's code by text replacement, so a dynamic size there can be a symbol that one
    # contains (ks5 in ks56) and fail to compile. The mask's numbers are tensors, not constants,
    # so that one compile serves every mask.
    padded = 1 << (B - 1).bit_length()
    logical = torch.full((padded, num_blocks), -1, dtype=torch.long, device=dev)
    seq, index = (block_tables >= 0).nonzero(as_tuple=True)
    logical[seq, block_tables[seq, index].long()] = index             # (B', num_blocks)
    last = F.pad(q_pos, (0, padded - B))                                             # (B',)
    rule = torch.tensor(mask.kernel_args, device=dev)                  # window, chunk, sink
    for t in (logical, last, rule):
        torch._dynamo.mark_static(t)

    def seen(b, h, q_idx, kv_idx):
        i = logical[b, kv_idx // block_size]
        p, q = i * block_size + kv_idx % block_size, last[b]
        first = torch.maximum(q - rule[0] + 1, q - q % rule[1])
        return (i >= 0) & (p <= q) & ((p >= first) | (p < rule[2]))
    return BlockMask.from_kv_blocks(
        *listed((num_seen > 0) & (num_seen < block_size)), *listed(num_seen == block_size),
        BLOCK_SIZE=(128, block_size), mask_mod=seen,
        seq_lengths=(1, num_blocks * block_size), compute_q_blocks=False)


# -----------------------------------------------------------------------------
# Naive reference: contiguous K/V, one sequence at a time, nothing clever


def naive_attention(q, k, v, cu_seqlens_q, seq_lens, scale, mask=None, keep=None):
    """q [num_tokens, n_head, D] packed new tokens; k, v [sum(seq_lens), n_kv_head, D] with
    each sequence's whole context concatenated in order. Returns [num_tokens, n_head, D].
    mask: which keys a token sees (paged_attention's), or None for full attention; the K/V
    no new token of a sequence sees are not read (they may be NaN): only its sinks and from
    the first key its first new token sees on. keep: bool [sum(seq_lens), n_kv_head], the keys
    each (sequence, KV head) reads (a read policy's selection), or None for all; K/V it does
    not keep are not read either. A token sees a kept key at or before its own position."""
    mask = mask or FULL_ATTENTION
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_head, n_kv_head = q.shape[1], k.shape[1]
    G = n_head // n_kv_head
    out = torch.empty_like(q)
    kv_start = 0
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        q_len = q_end - q_start
        first = mask.first_seen(seq_len - q_len)  # what the first new token sees, and later ones
        k_pos = torch.cat((torch.arange(min(mask.sink, first)), torch.arange(first, seq_len)))
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        for h in range(n_kv_head):  # KV head h and its group of query heads
            read = k_pos if keep is None else k_pos[keep[kv_start + k_pos, h].cpu()]   # (L,)
            heads = slice(h * G, (h + 1) * G)
            qs = q[q_start:q_end, heads].to(acc)                                  # (q_len, G, D)
            ks = k[kv_start + read.to(k.device), h].to(acc)                       # (L, D)
            vs = v[kv_start + read.to(v.device), h].to(acc)
            scores = torch.einsum("qgd,kd->gqk", qs, ks) * scale                  # (G, q_len, L)
            seen = mask.visible(q_pos, read[None, :])                             # (q_len, L)
            scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q_start:q_end, heads] = torch.einsum("gqk,kd->qgd", probs, vs).to(q.dtype)
        kv_start += seq_len
    return out


# -----------------------------------------------------------------------------
# Attention backends by name: how a layer stores its new K/V and reads its context. The engine
# picks one when it is built (Engine(attention_backend=...)) and every step's batch carries it.
# A new backend is one function and one entry (RECIPES.md: an attention backend).


@dataclass(frozen=True)
class AttentionBackend:
    store: Callable  # (k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)
    # (q, k_cache, v_cache, meta, scale, mask=None, k_scale=None, v_scale=None) ->
    # [num_tokens, n_head, D]: meta has block_tables, seq_lens, cu_seqlens_q, max_q_len, and
    # scratch, a dict the step's layers share, where a backend keeps what it builds once per
    # step. mask: the layer's Mask, passed only where it is not full attention, so a backend
    # written without masks still serves every model of full attention
    attend: Callable
    # (dtype, head_dim, kv_cache_dtype) -> why this backend cannot run them, or None
    unsupported: Callable = lambda dtype, head_dim, kv_cache_dtype: None
    # (mask) -> why this backend cannot honour a layer's Mask, or None (the engine asks only
    # when its attend() takes a mask)
    unsupported_mask: Callable = lambda mask: None
    # whether attend() reads per-head block tables (meta.block_tables [S, n_kv_head, W] and
    # seq_lens [S, n_kv_head]: a read policy's selection); a backend written for one table per
    # sequence does not, and gets none
    per_head_tables: bool = False


def _triton_attend(q, k_cache, v_cache, meta, scale, mask=None, **scales):
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                           meta.cu_seqlens_q, scale, max_q_len=meta.max_q_len, mask=mask,
                           **scales)


def _triton_unsupported(dtype, head_dim, kv_cache_dtype):
    if not HAS_TRITON:
        return "Triton is not installed (it has wheels for Linux)"
    if dtype not in DTYPES or head_dim not in HEAD_DIMS:
        return (f"the Triton kernel takes head sizes {HEAD_DIMS} in {DTYPES}, not head size "
                f"{head_dim} in {dtype}")
    return None


def _torch_attend(q, k_cache, v_cache, meta, scale, mask=None, **scales):
    # one plan per mask: the layers of a hybrid model share two
    return paged_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.cu_seqlens_q, scale, plan=meta.scratch.setdefault(mask, {}),
                                 mask=mask, **scales)


def _flex_attend(q, k_cache, v_cache, meta, scale, mask=None):
    return paged_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.cu_seqlens_q, scale, plan=meta.scratch.setdefault(mask, {}),
                                 decode_attention=paged_attention_flex, mask=mask)


# Which masks each honours: the torch path calls a mask's own methods, so it takes any; Triton
# and flex read kernel_args alone, so they take a Mask or a subclass that says its rule is theirs
ATTENTION_BACKENDS = {
    "triton": AttentionBackend(store_kv, _triton_attend, _triton_unsupported,
                               lambda mask: kernels_refuse(mask, "the Triton kernel"),
                               per_head_tables=True),
    "torch": AttentionBackend(store_kv_torch, _torch_attend, per_head_tables=True),
    # decodes read the cache in place with flex_attention (compiled on first use), the rest
    # as the torch path does; its block mask takes one table per sequence
    "flex": AttentionBackend(store_kv_torch, _flex_attend, lambda dtype, head_dim, kv: (
        "flex attention reads the cache in place: it takes no 8-bit cache"
        if kv in FP8_DTYPES else None), lambda mask: kernels_refuse(mask, "flex attention")),
}
