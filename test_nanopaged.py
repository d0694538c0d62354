"""
Tests for nanopaged: the block allocator as a state machine, the kernels against naive
attention, the model against Hugging Face GPT-2, the engine against naive generation, and
bad inputs. Run: python -m pytest -q   (on a CPU the Triton kernels run in the interpreter)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanopaged import BlockAllocator, OutOfBlocksError, Sequence, chain_hash

# -----------------------------------------------------------------------------
# The block allocator
#
# The test keeps a fake KV cache that stores token ids instead of K/V vectors. It "computes"
# a token by writing its id into the slot the block table names, performs the block copies
# the allocator asks for, and so can read every sequence back through its table.


class Cache:
    """Fake KV: token ids in block slots, refusing writes into shared blocks."""

    def __init__(self, allocator, num_blocks, num_cpu_blocks, block_size):
        self.allocator, self.bs = allocator, block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]

    def compute(self, seq):
        """Write the tokens of seq that are not computed yet, as a model step would."""
        for p in range(seq.num_computed_tokens, len(seq)):
            block_id = seq.block_table[p // self.bs]
            assert self.allocator.blocks[block_id].ref_count == 1, f"write into shared block {block_id}"
            self.device[block_id][p % self.bs] = seq.token_ids[p]
        seq.num_computed_tokens = len(seq)
        self.allocator.cache_full_blocks(seq)

    def copy(self, pairs, src_pool, dst_pool):
        for src, dst in pairs:
            dst_pool[dst] = list(src_pool[src])

    def read(self, seq, pool):
        return [pool[seq.block_table[p // self.bs]][p % self.bs] for p in range(len(seq))]


def allocator_state(a):
    return ([(b.ref_count, b.hash, b.token_ids) for b in a.blocks], list(a.free_block_ids), dict(a.hash_to_block),
            list(a.cpu_ref_count), list(a.cpu_free_block_ids))


class AllocatorMachine(RuleBasedStateMachine):

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(1, 12), num_cpu_blocks=st.integers(0, 8),
                caching=st.booleans())
    def setup(self, block_size, num_blocks, num_cpu_blocks, caching):
        self.a = BlockAllocator(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=caching)
        self.cache = Cache(self.a, num_blocks, num_cpu_blocks, block_size)
        self.on_device, self.on_cpu = [], []  # live sequences, by where their blocks are
        self.next_id = 0

    def new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), min_size=0, max_size=9))
    def allocate(self, data, suffix):
        # Prompts from a 3-letter alphabet, often extending a live sequence, so prefixes repeat.
        live = self.on_device + self.on_cpu
        prefix = data.draw(st.sampled_from([s.token_ids for s in live])) if live and data.draw(st.booleans()) else []
        tokens = (prefix[:data.draw(st.integers(0, len(prefix)))] + suffix) or [0]
        seq = Sequence(self.new_id(), tokens, len(tokens))
        if self.a.num_blocks_to_allocate(seq) > self.a.num_free_blocks:
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.allocate(seq)
            assert allocator_state(self.a) == before and not seq.block_table
            return
        self.a.allocate(seq)
        assert seq.num_computed_tokens % self.a.block_size == 0 and seq.num_computed_tokens < len(seq)
        self.cache.compute(seq)
        self.on_device.append(seq)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.on_device))
        seq.token_ids.append(token)
        if self.a.num_blocks_to_append([seq]) > self.a.num_free_blocks:
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.append_slot(seq)
            assert allocator_state(self.a) == before
            seq.token_ids.pop()
            return
        copy = self.a.append_slot(seq)
        if copy:
            assert self.a.blocks[copy[0]].ref_count >= 1, "copy-on-write source must still be owned"
            self.cache.copy([copy], self.cache.device, self.cache.device)
        self.cache.compute(seq)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.on_device))
        child = parent.fork(self.new_id(), 1)
        self.a.fork(parent, child)
        assert child.block_table == parent.block_table
        self.on_device.append(child)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.on_device))
        self.a.free(seq)
        self.on_device.remove(seq)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def swap_out(self, data):
        # a group at once (a parent and its forks, say), so blocks they share stay shared on the CPU
        seqs = data.draw(st.lists(st.sampled_from(self.on_device), min_size=1, unique=True))
        if not self.a.can_swap_out(seqs):
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.swap_out(seqs)
            assert allocator_state(self.a) == before
            return
        self.cache.copy(self.a.swap_out(seqs), self.cache.device, self.cache.cpu)
        for seq in seqs:
            self.on_device.remove(seq)
            self.on_cpu.append(seq)

    @precondition(lambda self: self.on_cpu)
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.on_cpu), min_size=1, unique=True))
        if not self.a.can_swap_in(seqs):
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.swap_in(seqs)
            assert allocator_state(self.a) == before
            return
        self.cache.copy(self.a.swap_in(seqs), self.cache.cpu, self.cache.device)
        for seq in seqs:
            self.on_cpu.remove(seq)
            self.on_device.append(seq)

    @invariant()
    def free_plus_used_is_everything(self):
        assert set(self.a.free_block_ids) == {b.block_id for b in self.a.blocks if b.ref_count == 0}
        assert len(self.a.free_block_ids) + sum(b.ref_count > 0 for b in self.a.blocks) == self.a.num_blocks
        assert set(self.a.cpu_free_block_ids) == {i for i, c in enumerate(self.a.cpu_ref_count) if c == 0}

    @invariant()
    def ref_counts_equal_block_table_entries(self):
        device = [0] * self.a.num_blocks
        for seq in self.on_device:
            for b in seq.block_table:
                device[b] += 1
        assert device == [b.ref_count for b in self.a.blocks]
        cpu = [0] * len(self.a.cpu_ref_count)
        for seq in self.on_cpu:
            for b in seq.block_table:
                cpu[b] += 1
        assert cpu == self.a.cpu_ref_count

    @invariant()
    def every_sequence_reads_back_what_was_appended(self):
        for seq in self.on_device:
            assert len(seq.block_table) == -(-len(seq) // self.a.block_size), "at most one partial block"
            assert self.cache.read(seq, self.cache.device) == seq.token_ids
        for seq in self.on_cpu:
            assert self.cache.read(seq, self.cache.cpu) == seq.token_ids

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for h, block_id in self.a.hash_to_block.items():
            block = self.a.blocks[block_id]
            assert block.hash == h and list(block.token_ids) == self.cache.device[block_id]

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for seq in self.on_device:
            self.a.free(seq)
        for seq in self.on_cpu:
            self.a.free_cpu(seq)
        assert self.a.num_free_blocks == self.a.num_blocks
        assert len(self.a.cpu_free_block_ids) == len(self.a.cpu_ref_count)


AllocatorMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase


def make_seq(seq_id, tokens):
    return Sequence(seq_id, tokens, len(tokens))


def test_block_size_one_takes_a_block_per_token():
    a = BlockAllocator(num_blocks=5, block_size=1)
    seq = make_seq(0, [7, 8, 9])
    a.allocate(seq)
    assert len(seq.block_table) == 3 and a.num_free_blocks == 2
    seq.num_computed_tokens = 3
    seq.token_ids.append(10)
    assert a.append_slot(seq) is None and len(seq.block_table) == 4


def test_sequence_that_exactly_fills_its_blocks_takes_a_new_block_on_the_next_token():
    a = BlockAllocator(num_blocks=4, block_size=4)
    seq = make_seq(0, list(range(8)))
    a.allocate(seq)
    assert len(seq.block_table) == 2 and a.num_free_blocks == 2
    seq.num_computed_tokens = 8
    seq.token_ids.append(8)
    assert a.num_blocks_to_append([seq]) == 1
    assert a.append_slot(seq) is None and len(seq.block_table) == 3


def test_fork_with_a_partial_last_block_copies_it_on_first_write_only():
    a = BlockAllocator(num_blocks=8, block_size=4)
    parent = make_seq(0, list(range(6)))  # one full block, one partial block
    a.allocate(parent)
    parent.num_computed_tokens = 6
    child = parent.fork(1, 1)
    a.fork(parent, child)
    assert [a.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    shared_last = parent.block_table[-1]
    child.token_ids.append(100)
    src, dst = a.append_slot(child)  # the child writes first: it moves to a private copy
    assert src == shared_last and child.block_table == [parent.block_table[0], dst]
    assert a.blocks[shared_last].ref_count == 1 and a.blocks[dst].ref_count == 1
    parent.token_ids.append(200)
    assert a.append_slot(parent) is None  # now the parent is the only owner: it writes in place
    assert parent.block_table[-1] == shared_last
    assert a.blocks[parent.block_table[0]].ref_count == 2  # the full block stays shared


def test_last_reference_to_a_cached_block_goes_away_and_comes_back():
    a = BlockAllocator(num_blocks=6, block_size=2)
    first = make_seq(0, [1, 2, 3, 4, 5])
    a.allocate(first)
    first.num_computed_tokens = 5
    a.cache_full_blocks(first)
    cached = first.block_table[:2]
    a.free(first)
    assert a.num_free_blocks == 6 and all(a.blocks[b].hash is not None for b in cached)
    again = make_seq(1, [1, 2, 3, 4, 9])  # same two full blocks, different tail
    assert a.num_blocks_to_allocate(again) == 3  # the two revived blocks come out of the free list too
    a.allocate(again)
    assert again.block_table[:2] == cached and again.num_computed_tokens == 4
    other = make_seq(2, [3, 4, 1, 2, 7])  # the same blocks after a different prefix must not hit
    a.allocate(other)
    assert other.num_computed_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_token():
    a = BlockAllocator(num_blocks=6, block_size=2)
    first = make_seq(0, [1, 2, 3, 4])
    a.allocate(first)
    first.num_computed_tokens = 4
    a.cache_full_blocks(first)
    second = make_seq(1, [1, 2, 3, 4])
    a.allocate(second)
    # the last token's logits are needed, so its block is recomputed into a private block
    assert second.num_computed_tokens == 2 and second.block_table[0] == first.block_table[0]
    assert a.blocks[second.block_table[1]].ref_count == 1


def test_least_recently_freed_cached_block_is_evicted_first():
    a = BlockAllocator(num_blocks=5, block_size=2)
    old, new = make_seq(0, [1, 2, 9]), make_seq(1, [3, 4, 9])
    for seq in (old, new):
        a.allocate(seq)
        seq.num_computed_tokens = 3
        a.cache_full_blocks(seq)
    a.free(old)
    a.free(new)
    # 4 blocks: the three holding nothing worth keeping go first, then the oldest cached prefix
    a.allocate(make_seq(2, [5, 6, 7, 8, 5, 6, 7]))
    assert chain_hash(None, (3, 4)) in a.hash_to_block
    assert chain_hash(None, (1, 2)) not in a.hash_to_block


def test_hash_collision_is_caught_by_comparing_tokens():
    a = BlockAllocator(num_blocks=4, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    a.allocate(seq)
    seq.num_computed_tokens = 3
    a.cache_full_blocks(seq)
    (h, block_id), = a.hash_to_block.items()
    a.blocks[block_id].token_ids = (5, 6)  # pretend [5, 6] hashed to the same key
    a.hash_to_block = {h: block_id}
    assert a.allocate(make_seq(1, [1, 2, 3])) is None and a.blocks[block_id].ref_count == 1


def test_out_of_blocks_leaves_the_allocator_unchanged():
    a = BlockAllocator(num_blocks=2, block_size=2)
    a.allocate(make_seq(0, [1, 2, 3]))
    before = allocator_state(a)
    with pytest.raises(OutOfBlocksError, match="needs 1 blocks, 0 are free"):
        a.allocate(make_seq(1, [4]))
    assert allocator_state(a) == before


def test_double_free_raises():
    a = BlockAllocator(num_blocks=2, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    a.allocate(seq)
    table = list(seq.block_table)
    a.free(seq)
    seq.block_table = table  # a buggy caller frees the same blocks again
    with pytest.raises(RuntimeError, match="released more times than it was taken"):
        a.free(seq)
