"""
Property tests for kernel.py: the Triton paged-attention kernel and the torch paged path
against the naive contiguous reference, split-KV against no split, store_kv, bad inputs.
Without a GPU the Triton kernel runs under the interpreter (TRITON_INTERPRET=1), so the
shapes stay small. Run: python -m pytest -q test_kernel_draft.py
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernel.py's @triton.jit runs

import pytest
from hypothesis import given, settings, strategies as st

from kernel import HEAD_DIMS, naive_attention, paged_attention, paged_attention_torch, store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@st.composite
def paged_batches(draw, dtypes, max_seqs=4, max_seq_len=150, decode_only=False):
    """A packed batch of sequences in a paged cache, and the same K/V laid out contiguously.
    Tables are shuffled, later sequences may share a prefix of sequence 0's blocks (as after
    a fork or a prefix-cache hit), and every cache slot no sequence uses holds NaN."""
    num_seqs = draw(st.integers(1, max_seqs))
    block_size = draw(st.sampled_from([1, 3, 4, 5, 16]))
    n_kv_head = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))  # n_kv_head == 1 with group > 1 is MQA
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    dtype = draw(st.sampled_from(dtypes))
    seq_lens, q_lens = [], []
    for _ in range(num_seqs):
        if draw(st.booleans()):  # a context that exactly fills its blocks
            seq_len = block_size * draw(st.integers(1, max(1, max_seq_len // block_size)))
        else:
            seq_len = draw(st.integers(1, max_seq_len))
        kind = "decode" if decode_only else draw(st.sampled_from(["decode", "prefill", "chunk"]))
        q_len = {"decode": 1, "prefill": seq_len, "chunk": draw(st.integers(1, seq_len))}[kind]
        seq_lens.append(seq_len)
        q_lens.append(q_len)

    # block tables: shuffled physical ids; sequence i > 0 may start with sequence 0's blocks
    num_blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_seq) + 2
    free = draw(st.permutations(range(num_blocks)))
    tables = []
    for i, n in enumerate(num_blocks_per_seq):
        shared = draw(st.integers(0, min(n, num_blocks_per_seq[0]) - 1)) if i > 0 else 0
        tables.append((tables[0][:shared] if i > 0 else []) + free[:n - shared])
        free = free[n - shared:]
    max_blocks = max(num_blocks_per_seq) + 1  # at least one -1 column of padding
    block_tables = torch.tensor([t + [-1] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)

    # fill the used slots (shared ones once) and gather the contiguous copy slot by slot
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    k_cache = torch.full((num_blocks, block_size, n_kv_head, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    k_ctx, v_ctx = [], []
    for table, seq_len in zip(tables, seq_lens):
        for t in range(seq_len):
            b, o = table[t // block_size], t % block_size
            if k_cache[b, o].isnan().any():
                k_cache[b, o] = torch.randn(n_kv_head, head_dim, generator=g).to(dtype)
                v_cache[b, o] = torch.randn(n_kv_head, head_dim, generator=g).to(dtype)
            k_ctx.append(k_cache[b, o])
            v_ctx.append(v_cache[b, o])
    q = torch.randn(sum(q_lens), n_kv_head * group, head_dim, generator=g).to(dtype)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    to = lambda t: t.to(DEVICE)
    return dict(
        q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), block_tables=to(block_tables),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)), cu_seqlens_q=to(cu_seqlens_q),
        scale=head_dim**-0.5, k=to(torch.stack(k_ctx)), v=to(torch.stack(v_ctx)),
    )


def paged_args(b):
    return b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["cu_seqlens_q"], b["scale"]


def reference(b):
    return naive_attention(b["q"], b["k"], b["v"], b["cu_seqlens_q"], b["seq_lens"], b["scale"])


def assert_close(out, ref):
    tol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in the output: a slot past seq_len was read"
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@settings(max_examples=40, deadline=None)
@given(paged_batches(dtypes=[torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([None, 1, 2, 3]))
def test_triton_matches_naive(b, num_splits):
    out = paged_attention(*paged_args(b), num_splits=num_splits)
    assert_close(out, reference(b))


@settings(max_examples=15, deadline=None)
@given(paged_batches(dtypes=[torch.float32], max_seqs=2, max_seq_len=300, decode_only=True), st.integers(2, 8))
def test_split_kv_agrees_with_one_split(b, num_splits):
    # the split path must give the same result as one program per sequence, including
    # splits left empty because the context is shorter than num_splits tiles
    one = paged_attention(*paged_args(b), max_q_len=1, num_splits=1)
    split = paged_attention(*paged_args(b), max_q_len=1, num_splits=num_splits)
    assert_close(split, one)


@settings(max_examples=100, deadline=None)
@given(paged_batches(dtypes=[torch.float64, torch.float32, torch.bfloat16]))
def test_torch_path_matches_naive(b):
    assert_close(paged_attention_torch(*paged_args(b)), reference(b))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.sampled_from([torch.float32, torch.bfloat16]), st.data())
def test_store_kv_writes_exactly_the_given_slots(num_blocks, block_size, dtype, data):
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), max_size=num_slots, unique=True))
    slots = [s if data.draw(st.booleans()) else -1 for s in slots]  # -1: skip the token
    slot_mapping = torch.tensor(slots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])), device=DEVICE)
    k = torch.randn(len(slots), 2, 16, device=DEVICE).to(dtype)
    v = torch.randn(len(slots), 2, 16, device=DEVICE).to(dtype)
    k_cache = torch.full((num_blocks, block_size, 2, 16), float("nan"), device=DEVICE, dtype=dtype)
    v_cache = k_cache.clone()
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    written = torch.zeros(num_slots, dtype=torch.bool, device=DEVICE)
    for i, s in enumerate(slots):
        if s >= 0:
            written[s] = True
            assert torch.equal(k_cache.flatten(0, 1)[s], k[i]) and torch.equal(v_cache.flatten(0, 1)[s], v[i])
    assert k_cache.flatten(0, 1)[~written].isnan().all() and v_cache.flatten(0, 1)[~written].isnan().all()


def small_batch(head_dim=64, dtype=torch.float32):
    q = torch.randn(3, 4, head_dim, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(4, 4, 2, head_dim, device=DEVICE, dtype=dtype)
    block_tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32, device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    return [q, k_cache, k_cache.clone(), block_tables, seq_lens, cu_seqlens_q, head_dim**-0.5]


def test_small_batch_runs():
    args = small_batch()
    assert_close(paged_attention(*args), paged_attention_torch(*args))


def with_arg(i, value):
    return lambda args: args[:i] + [value(args[i])] + args[i + 1:]


@pytest.mark.parametrize("break_it, message", [
    (lambda args: small_batch(head_dim=48), "head_dim 48 not supported"),
    (with_arg(0, lambda q: torch.randn(3, 4, 32, device=DEVICE)), "head_dim of q"),
    (with_arg(0, lambda q: q.half()), "dtypes differ"),
    (lambda args: small_batch(dtype=torch.float64), "unsupported dtype"),
    (with_arg(0, lambda q: q[:, :3]), "multiple of n_kv_head"),
    (with_arg(2, lambda v_cache: v_cache[:, :2]), "v_cache"),
    (with_arg(3, lambda block_tables: block_tables.long()), "block_tables must be int32"),
    (with_arg(3, lambda block_tables: block_tables[:1]), "block_tables is"),
    (with_arg(5, lambda cu_seqlens_q: cu_seqlens_q[:2]), "cu_seqlens_q is"),
    (with_arg(0, lambda q: q[0]), "q is"),
])
def test_launcher_rejects_bad_inputs(break_it, message):
    with pytest.raises(AssertionError, match=message):
        paged_attention(*break_it(small_batch()))
