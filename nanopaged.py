"""
nanopaged: PagedAttention in one file, read top to bottom.

The KV cache of a GPT lives in fixed-size physical blocks; every sequence owns a block
table that maps its logical blocks to physical ones, like pages in virtual memory.
Blocks are reference-counted, so sequences can share them, and a write into a shared
block copies it first (copy-on-write). A continuous-batching scheduler packs as many
sequences onto the device as the blocks allow and preempts when they run out.

    Kwon et al., "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", SOSP 2023.  https://arxiv.org/abs/2309.06180

Sections, in reading order, each using only what the ones before it define: 1. sequences,
requests and their lifecycle; 2. physical blocks and the undo of a failed step; 3. the prefix
cache; 4. the block pools, the device's and the CPU's; 5. the block allocator; 6. the
scheduler; 7. the model; 8. the model runner; 9. sampling; 10. output processing; 11. the
engine. An appendix holds the metrics.

What a reader of paging can skip lives in files beside this one, which it imports and which
import nothing of it: kernel.py (the attention kernels), checks.py (SamplingParams and the
checks of settings and requests), parallel.py (tensor parallelism's primitives),
read_policy.py and quest.py (which blocks a decode reads), checkpoints.py (Hugging Face
folders) and detokenizer.py (text and stop strings). Capabilities over the core import it and
register themselves by name: speculative.py's proposers (SPECULATIVE_METHODS; `import
speculative` registers the built-in ones). This file imports nothing above it, except where
`python nanopaged.py` hands its __main__ to demo.py.
Run `python nanopaged.py`, or `torchrun --nproc-per-node 2 nanopaged.py
--tensor-parallel-size 2` to split the model and its KV cache across two processes.
"""

import copy
import hashlib
import itertools
import math
import sys
import time
from bisect import insort
from collections import deque
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from heapq import heappop, heappush
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoints
import connectors
import kernel
from checks import SamplingParams, as_int, check_engine_settings, check_request, integer
from detokenizer import Detokenizer
from parallel import all_reduce, broadcast, tp, tp_min, tp_shard, tp_shut_down
from read_policy import READ_POLICIES, attend_selected, make_read_policy


# -----------------------------------------------------------------------------
# 1. Sequences and requests, and the lifecycle of a request (paper, sections 4.3 to 4.5)
#
# A Request holds Sequences: one while its prompt is prefilled, then n parallel samples or
# beam_width beams. Every sequence keeps one invariant: its tokens
# [0, num_computed_tokens) have their K/V in the cache, and [num_computed_tokens, len) are
# the ones to compute next. A step computes some of them; only a step that computes the
# last one yields logits, and so a next token. Where a request is, is which queue holds it:
#
#   waiting  (scheduler.waiting)  new, or preempted by recompute; holds no blocks
#   running  (scheduler.running)  holds device blocks: prefilling while more than one token
#                                 is uncomputed (maybe over several steps, in chunks),
#                                 decoding when one is (the token sampled last step)
#   swapped  (scheduler.swapped)  preempted by swap; its blocks are in the CPU pool
#   finished                      no live sequences left; out of every queue
#
# waiting -> running on admission, running -> waiting or swapped on preemption, swapped ->
# running on swap-in (or -> waiting, to be recomputed, when nothing running can make room
# for it), running -> finished when every sequence stops; abort() leaves from anywhere.
# Recompute frees the blocks, which sets num_computed_tokens to 0: the prompt and the tokens
# generated so far are prefilled again (less what the prefix cache still holds). Swap keeps
# num_computed_tokens and moves the blocks to CPU memory and back. A recomputed request of
# several sequences holds back the last token of each: the request advances in lockstep (its
# beams are compared, its samples were forked together), so all its sequences must reach
# their last tokens in the same step, which the scheduler makes one decode step for all.


def cdiv(n, d):
    """n / d rounded up: the blocks that n tokens fill."""
    return -(-n // d)


NO_BLOCK = -1  # a block table's entry for a block no token to come sees, given back: it holds none


class BlockTable:
    """A sequence's block table: the physical block of each of its logical blocks, in order.
    The ids live in a numpy int32 row that doubles as it fills, and each change moves its
    version, so the model runner keeps the batch's rows and writes a table's row again only
    when it changed (ModelRunner.batch_table), without walking Python lists. Read it as a list;
    change it by append, item assignment and truncate, each journaled once the allocator has
    given it its journal."""

    def __init__(self):
        self.ids, self.n, self.journal = np.zeros(4, dtype=np.int32), 0, None
        self.version = 0  # counts its changes: the model runner rewrites its batch row on one

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.tolist())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.ids[:self.n][i].tolist()
        if not -self.n <= i < self.n:
            raise IndexError(f"block table index {i} out of range ({self.n} blocks)")
        return self.ids.item(i % self.n)  # a Python int, without a numpy scalar on the way

    def __eq__(self, other):
        return isinstance(other, (BlockTable, list, tuple)) and self.tolist() == list(other)

    def __repr__(self):
        return f"BlockTable({self.tolist()})"

    def tolist(self):
        return self.ids[:self.n].tolist()

    def count(self, block_id):
        return int((self.ids[:self.n] == block_id).sum())

    def append(self, block_id):
        if self.n == len(self.ids):
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
        self.ids[self.n] = block_id
        self.n += 1
        self.version += 1
        if self.journal is not None:
            self.journal.record(self.truncate, self.n - 1)

    def __setitem__(self, i, block_id):
        old = self[i]
        self.ids[i % self.n] = block_id
        self.version += 1
        if self.journal is not None:
            self.journal.record(self.__setitem__, i, old)

    def truncate(self, n):
        """Keep the first n blocks."""
        if self.journal is not None:
            self.journal.record(self.extend, self[n:])
        self.n = min(n, self.n)
        self.version += 1

    def extend(self, block_ids):
        for block_id in block_ids:
            self.append(block_id)


def blocks_held(seqs):
    """The physical blocks the sequences point at, each once however many share it."""
    return {b for seq in seqs for table in seq.block_tables for b in table if b != NO_BLOCK}


class Sequence:
    """One token stream: a prompt and what has been generated after it, with its block table."""

    def __init__(self, seq_id, token_ids, num_prompt_tokens, index=0, request_id=None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which sample or beam of its request it is
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        # Its paging state, which a step's plan changes through the allocator (section 5),
        # each change with Journal.set (section 2), so a failed step undoes it. A field you
        # add here and change in a plan must go through Journal.set too:
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache: see the lifecycle above
        # device blocks, or CPU blocks while swapped out: a table per KV cache group (one, but
        # for models that mix attention types: section 7)
        self.block_tables = [BlockTable()]
        self.num_published_blocks = 0  # its leading full blocks offered to the prefix cache
        # The prefix-cache keys of its full blocks, one per block its tokens fill, computed as
        # the tokens arrive (with prefix caching on: section 3).
        self.block_hashes = []
        self.cumulative_logprob = 0.0
        self.logprobs = []  # per generated token {token id: log-probability}, when asked for
        self.prompt_logprobs = []  # when asked for: None, then one per prompt token as computed
        self.finish_reason = None
        self.stop_reason = None  # the stop token id or stop string that ended it (vLLM's)
        # A fork's per-draw fields, by name: OutputProcessor.land updates them as each token is
        # drawn, and every CompletionOutput carries a copy (its extras)
        self.extras = {}
        self.text = None  # its output decoded so far, when the engine has a tokenizer
        # detokenizer.py's offsets into token_ids: where its decoding window starts, and where
        # the text decoded so far ends
        self.text_offsets = None
        # where its next delta output starts (output_kind "delta"): the output tokens and the
        # characters of text that earlier outputs reported
        self.num_reported_tokens = 0
        self.num_reported_chars = 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def block_table(self):  # its first KV cache group's, the only one of most models
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table):
        self.block_tables[0] = table

    @property
    def output_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens

    def prompt_logprob_positions(self, start, end):
        """Positions in [start, end) whose logits give a prompt logprob still missing: the logits
        after position p are the distribution of prompt token p + 1."""
        if not self.prompt_logprobs:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1),
                     min(end, self.num_prompt_tokens - 1))

    def fork(self, seq_id, index):
        """A copy of everything generated so far (every field a copy of nanopaged adds, too),
        its lists and dicts copied, so parent and child go on apart; with empty block tables:
        the allocator shares the blocks. The prompt's logprobs stay the parent's."""
        child = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (list, dict, set)):
                setattr(child, name, copy.copy(value))
        child.seq_id, child.index, child.prompt_logprobs = seq_id, index, []
        child.block_tables = [BlockTable() for _ in self.block_tables]
        return child


@dataclass(frozen=True)
class RequestMetrics:  # vLLM's; time.perf_counter() seconds, each set where the lifecycle changes
    """Frozen: a change replaces the request's metrics whole, so every output that holds them
    keeps them as they were when it was made, without a copy per output."""
    arrival_time: float  # add_request
    first_scheduled_time: float | None = None  # first admission to running
    first_token_time: float | None = None  # first sampled token
    finished_time: float | None = None  # the last token; None while the request runs
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time


class Request:
    """The sequences of one request, scheduled and preempted together: one while the prompt is
    prefilled, then n parallel samples or beam_width beams (vLLM v0's sequence group, which v1
    renamed Request)."""

    def __init__(self, request_id, prompt_token_ids, params, seq, priority=0):
        self.request_id, self.params, self.priority = request_id, params, priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.seqs = [seq]  # the live ones
        self.finished_seqs = []  # parallel samples that finished
        self.hypotheses = []  # beam search: the finished hypotheses (BeamHypothesis)
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        # prompt tokens not computed at the first admission: the prefix cache's hit, which
        # counts the leading blocks no later token sees (chunked attention's), as vLLM's
        self.num_cached_tokens = 0
        self.num_preemptions = 0  # counted in one place: Scheduler.count_preemption
        self.seed = None  # sampled requests: token t of sample i draws from (seed, i, t)
        self.prompt_logprobs = seq.prompt_logprobs  # the same list, filled by the prefill

    @property
    def is_finished(self):
        return not self.seqs

    @property
    def is_decoding(self):  # every live sequence computes just its newest token next
        for seq in self.seqs:
            if len(seq) - seq.num_computed_tokens != 1:
                return False
        return True


@dataclass(slots=True)  # slots: one is made per sample per step, in half the time
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None  # "length" or "stop"; None while the sequence runs
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None = None  # per token, with SamplingParams.logprobs
    text: str | None = None  # decoded, cut at a stop string: with an Engine tokenizer
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    extras: dict | None = None  # the sample's per-draw fields (Sequence.extras), if it keeps any


@dataclass(slots=True)
class RequestOutput:
    """A request as it stood after a step: a snapshot, which later steps leave as it is (with
    SamplingParams.output_kind "delta", its samples hold what they gained in the step)."""
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n samples in order, or the beams best first
    metrics: RequestMetrics  # as of this output (frozen: later steps replace the request's)
    num_preemptions: int
    finished: bool = True  # step() also returns unfinished requests that gained a token
    # prompt tokens served from the prefix cache, and with them (as vLLM counts) the leading
    # blocks no later token sees, cached or not: chunked attention's chunks before the last
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with prompt_logprobs

    @property
    def time_to_first_token(self):  # seconds from add_request to the first sampled token
        return self.metrics.first_token_time - self.metrics.arrival_time

    @property
    def latency(self):  # seconds from add_request to the last; None until finished
        m = self.metrics
        return None if m.finished_time is None else m.finished_time - m.arrival_time


# Each part that changes paging tells an observer what it did, if one listens
# (Engine(observer=...): pagetrace.py records, replays and draws it). Nobody listens by default.

def notify(part, event, **details):
    if part.observer is not None:
        part.observer(dict(event=event, **details))


def group_field(group):  # an event's KV cache group (section 7): said only past the first
    return {"group": group} if group else {}

# -----------------------------------------------------------------------------
# 2. Physical blocks, the copies a plan asks for, and the undo of a failed step
#
# A physical block is block_size token slots of K/V in every layer, with a ref count: the
# block-table entries that point at it. A step plans first (section 6): it takes and moves
# blocks before the model runs, and each change to the tables returns the BlockCopies the run
# must make on the KV tensors (copy-on-write, swap, the CPU tier's). If the step then fails,
# its plan is undone from one Journal: a list of (function, args) that put back each change,
# replayed latest first. Every change a plan makes records its undo there:
# - a block's fields (ref_count, hash, stamps, ...): PhysicalBlock records each assignment
#   itself, so `block.ref_count += 1` anywhere is undone without a word at the call;
# - a block table's entries: BlockTable records each append, assignment and truncate;
# - any other field (a sequence's paging state, a request's first admission, the counters):
#   Journal.set(obj, name, value), which records the old value;
# - a request's move between queues: Scheduler._move records the move back.
# What is derived from those is not journaled but rebuilt after the undo, from the blocks
# alone: the free lists and the prefix cache's index and eviction heap (rebuild_free_list of
# each pool the Journal knows). So the undo costs what the plan changed, plus one pass over
# each pool to rebuild, and Journal.rollback is all of it.
#
# The rule for a fork: a field you add to PhysicalBlock is journaled for free. A field you add
# to anything else (a sequence, a request, a pool, a counter) and change in the plan must be
# changed with Journal.set, or rebuilt from the blocks in rebuild(). A plain assignment there is
# not undone, and the failure property (test_nanopaged.py) catches it.


class Journal:
    """The undo of one step's plan: its log, and the pools whose derived state it rebuilds.
    The engine opens it as each step starts, closes it once the step stands, and rolls it back
    if the step fails; the commit that follows records nothing (it cannot fail halfway:
    section 11)."""

    def __init__(self):
        self.undo = None  # while open: (function, args) that put back each change, in order
        self.pools = []  # the BlockPools whose blocks it journals: the device's, the CPU's

    def open(self):
        self.undo = []
        for pool in self.pools:
            pool.taken = set()

    def close(self):  # the plan stands
        self.undo = None

    def record(self, undo, *args):
        if self.undo is not None:
            self.undo.append((undo, args))

    def set(self, obj, name, value):
        """obj.name = value, journaled: any field the plan changes outside blocks and tables."""
        self.record(setattr, obj, name, getattr(obj, name))
        setattr(obj, name, value)

    def rollback(self):
        """Undo every change since open(), the latest first, and close the journal. Every
        block, block table, sequence's paging state and queue is as open() found it, but no
        block handed out since keeps a prefix: its slots may hold the failed step's writes.
        Then each pool rebuilds its free list and cache index. Returns the blocks handed out,
        per pool (the device's, the CPU's)."""
        undo, self.undo = self.undo or [], None
        for fn, args in reversed(undo):
            fn(*args)
        taken = []
        for pool in self.pools:
            for block_id in pool.taken:
                pool.blocks[block_id].hash, pool.blocks[block_id].token_ids = None, ()
            taken.append(pool.taken)
            pool.taken = set()
            pool.rebuild_free_list()
        return taken


class OutOfBlocksError(RuntimeError):
    """More free blocks were asked for than the pool holds; the allocator is left unchanged."""


@dataclass
class PhysicalBlock:
    block_id: int
    ref_count: int = 0      # block-table entries that point here; the block is free iff this is 0
    freed_at: int = 0       # when its count last fell to 0: the order of the free lists
    hash: bytes | None = None  # its prefix-cache key, once published (section 3)
    token_ids: tuple = ()   # the tokens it holds and which block of its sequence it is, to
    logical_index: int = 0  # confirm a key hit: a colliding key must never share K/V
    num_hits: int = 0       # prefix-cache hits since it was taken
    cached_at: int = 0      # when it was last published: the order of a fifo policy
    score: float = 0        # its eviction policy's score, when last freed
    journal = None          # its pool's Journal (a class attribute, not a field, until then)

    def __setattr__(self, name, value):  # every change to a block is journaled, here
        if self.journal is not None:
            self.journal.record(object.__setattr__, self, name, getattr(self, name))
        object.__setattr__(self, name, value)


@dataclass
class BlockCopies:
    """The block copies a change to the tables asks for, each (source, destination): the change
    returns them, the step's plan carries them, and the run makes them (copy_blocks, and the
    connector's transfer). Blocks of the device pool, of the CPU pool (section 4), or the
    connector's handles (connectors.py), where named so."""
    cow: list = field(default_factory=list)  # (src, dst) device blocks: copy-on-write
    swap_out: list = field(default_factory=list)  # (device, cpu block): a preempted sequence's
    swap_in: list = field(default_factory=list)  # (cpu, device block): its way back
    offload: list = field(default_factory=list)  # (device block, handle): to the connector
    reload: list = field(default_factory=list)  # (handle, device block): a connector's hit

    def __iadd__(self, other):
        for name in BLOCK_COPY_KINDS:  # a decode step adds one per sequence: no fields() call
            getattr(self, name).extend(getattr(other, name))
        return self

    def __bool__(self):
        return any(getattr(self, name) for name in BLOCK_COPY_KINDS)


BLOCK_COPY_KINDS = tuple(f.name for f in fields(BlockCopies))


# -----------------------------------------------------------------------------
# 3. The prefix cache. Later vLLM: automatic prefix caching; its v1 publishes a block in the
#    step that computes it.
#
# A full block is keyed by a hash of every token up to its end, so a prompt that starts like
# an earlier one finds the blocks that already hold its K/V and computes only the rest. A
# block is published in the step that computes its last token: a request admitted later in
# that same step hits it, because every layer stores the whole step's K/V (store_kv) before
# any sequence's attention reads them, in one process (the torch path) or one CUDA stream (the
# Triton launches). A cached block nobody holds stays cached until the allocator needs a block
# and none holding nothing is left: then the eviction policy says which goes.


def chain_hash(prev_hash, token_ids):
    """Key of a full block: SHA-256 of its tokens chained with the key of the block before it, so
    equal blocks after different prefixes get different keys (vLLM's automatic prefix caching;
    Python's hash let a crafted prompt collide with another's, vLLM's CVE-2025-25183)."""
    return hashlib.sha256((prev_hash or bytes(32)) + repr(tuple(token_ids)).encode()).digest()


# A score given to a cached block when it is freed: the lowest is evicted first, ties least
# recently freed. A policy reads the block's stamps (freed_at, cached_at, num_hits,
# logical_index); FIFO, say, is lambda block: block.cached_at
EVICTION_POLICIES = {"lru": lambda block: 0,  # all tie: least recently used first
                     "lfu": lambda block: block.num_hits}  # fewest prefix-cache hits first


@dataclass
class HitCounts:  # the hit rate is hit_tokens / queried_tokens
    queried_tokens: int = 0  # tokens of sequences allocated with caching on (a recomputed
    # one's output so far too)
    hit_tokens: int = 0  # of those, the tokens found in the cache (in either tier)
    cpu_hit_tokens: int = 0  # of those, the tokens past the hit the device serves alone


class CachedBlock(NamedTuple):  # a leading block of a sequence, found in a prefix cache
    block_id: int
    cache: object  # the device's PrefixCache, or the connector (copied into a fresh block)


class PrefixHit(NamedTuple):
    """A sequence's prefix-cache hit: its first num_blocks blocks, and per KV cache group a
    CachedBlock for each of them, or None where no token to come sees it (a window's)."""
    num_blocks: int
    blocks: list

    def cached_blocks(self):  # every CachedBlock of every group
        return [block for hits in self.blocks for block in hits if block is not None]


class PrefixCache:
    """Published blocks by key, the free ones among them in eviction order, and hit counts. Its
    blocks journal their own changes; its index (blocks_by_key, evictable, heap) is rebuilt
    from them after an undo."""
    observer = None  # see notify

    def __init__(self, blocks, block_size, journal, enabled=True, eviction_policy="lru",
                 tier=""):
        self.blocks, self.block_size, self.journal = blocks, block_size, journal
        self.enabled, self.score = enabled, EVICTION_POLICIES[eviction_policy]
        self.tier = tier  # what its events begin with: "" on the device, "cpu_" in CPU memory
        self.blocks_by_key = {}  # key -> the blocks that hold it (a dict: first published first)
        self.evictable = {}  # cached free block -> its entry in heap (other entries are stale)
        self.heap = []  # (score, freed_at, block_id), smallest first
        self.counts = HitCounts()
        # stamps cached_at; an order, so the values a failed step skips need no undo
        self.clock = itertools.count(1)

    @property
    def num_evictable(self):
        return len(self.evictable)

    def key_blocks(self, seq):
        """Key seq's full blocks that have no key yet. Their tokens are known, so their keys
        are, computed or not: the engine keys a prompt when it arrives and each block as its
        last token is drawn (as vLLM v1 hashes a request's blocks)."""
        if not self.enabled:
            return
        keys, bs = seq.block_hashes, self.block_size
        for i in range(len(keys), len(seq) // bs):
            keys.append(chain_hash(keys[-1] if i else None, seq.token_ids[i * bs:(i + 1) * bs]))

    @staticmethod
    def key(seq, i, group=0):
        """The key of seq's block i in a KV cache group (section 7): the chained key, made the
        group's own beyond the first (their blocks hold other layers' K/V)."""
        key = seq.block_hashes[i]
        return key if group == 0 else hashlib.sha256(bytes([group]) + key).digest()

    def lookup(self, seq, group=0, lower=None, full=True):
        """For each of seq's full leading blocks (of a KV cache group), the CachedBlock that
        holds it: this cache's, or where it lacks one, the lower tier's (a connector: the CPU
        tier, say); None where neither has it. full: stop at the first miss (a full-attention
        group needs every block before its hit's end; another kind, those its tokens to come
        see)."""
        found = []
        # A cached block has no logits: a sequence still owed prompt logprobs computes its whole
        # prompt (as vLLM does), and publishes its blocks for others as usual.
        if not self.enabled or seq.prompt_logprob_positions(0, len(seq)):
            return found
        self.key_blocks(seq)  # the engine keyed them already; a caller of its own may not have
        # The last token is always computed again, because sampling needs its logits; so its
        # block is never taken from the cache and never written while shared.
        for i in range((len(seq) - 1) // self.block_size):
            key, cache = self.key(seq, i, group), self
            block_id = self.find(key, seq, i)
            if block_id is None and lower is not None and lower.enabled:
                block_id, cache = lower.find(key, seq, i), lower
            if block_id is None:
                if full:
                    break
                found.append(None)
                continue
            found.append(CachedBlock(block_id, cache))
        return found

    def hit(self, seq, kinds, lower=None):
        """seq's PrefixHit: the most leading full blocks of which every KV cache group can serve
        the blocks its kind (kinds, per group) needs (hit_blocks: vLLM's hybrid rule), and per
        group a CachedBlock for each of them, this cache's or the lower tier's to copy back
        (lookup), or None where no token to come sees it."""
        bs = self.block_size
        # a group whose kind never skips a block needs every block of a hit: its list ends at
        # its first miss; another's runs on, None where it misses
        found = [self.lookup(seq, g, lower, full=not kind.skipped_blocks(len(seq), bs))
                 for g, kind in enumerate(kinds)]
        length = min(map(len, found))
        def served(length):  # every group finds the blocks its kind needs of the first length
            for g, kind in enumerate(kinds):
                if not all(found[g][i] for i in kind.hit_blocks(length, bs)):
                    return False
            return True
        while length and not served(length):
            length -= 1  # a group misses a block its kind needs: a shorter hit
        blocks = []
        for g, kind in enumerate(kinds):
            need = set(kind.hit_blocks(length, bs))
            blocks.append([found[g][i] if i in need else None for i in range(length)])
        return PrefixHit(length, blocks)

    def count(self, seq, num_blocks, hits, num_own=None):
        """A sequence was allocated on a hit of its num_blocks leading blocks: hits, the blocks
        of this cache it shares, and num_own of its leading blocks the hit this cache alone
        serves (all of them by default); the lower tier served the rest. Count them for the hit
        rates and the policy."""
        if not self.enabled:
            return
        for block_id in hits:
            self.blocks[block_id].num_hits += 1
        c, bs = self.counts, self.block_size
        num_own = num_blocks if num_own is None else num_own
        self.journal.set(c, "queried_tokens", c.queried_tokens + len(seq))
        self.journal.set(c, "hit_tokens", c.hit_tokens + num_blocks * bs)
        self.journal.set(c, "cpu_hit_tokens", c.cpu_hit_tokens + (num_blocks - num_own) * bs)

    def find(self, key, seq, i):
        """The cached block that holds seq's block i under key, or None: the first published of
        its holders (the others, twins, wait to take its place). Under SHA-256 keys the key would
        do; its tokens and place are compared too, so that were every key to collide, no block
        would be shared at another place (other prefixes are SHA-256's to tell apart)."""
        if key not in self.blocks_by_key:
            return None
        bs = self.block_size
        return self.find_block(key, tuple(seq.token_ids[i * bs:(i + 1) * bs]), i)

    def find_block(self, key, token_ids, index):
        """The cached block that holds token_ids as block index of its sequence, under key."""
        holders = self.blocks_by_key.get(key)
        if not holders:
            return None
        block_id = next(iter(holders))
        block = self.blocks[block_id]
        held = block.token_ids == token_ids and block.logical_index == index
        return block_id if held else None

    def publish(self, seq, i, block_id, group=0):
        """Cache block_id as a holder of seq's block i (of a KV cache group), under its key."""
        bs = self.block_size
        self.insert(block_id, self.key(seq, i, group), tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                    i)

    def insert(self, block_id, key, token_ids, index):
        """Cache block_id as a holder of token_ids, block index of its sequence, under key."""
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.logical_index = key, token_ids, index
        block.cached_at = next(self.clock)
        self.blocks_by_key.setdefault(key, {})[block_id] = None
        notify(self, self.tier + "publish", block=block_id, index=index, tokens=list(token_ids))

    def revive(self, block):  # a hit on a cached block nobody held
        del self.evictable[block.block_id]

    def retire(self, block):  # a cached block nobody holds any more
        block.score = self.score(block)  # a policy may read freed_at
        self.evictable[block.block_id] = entry = (block.score, block.freed_at, block.block_id)
        heappush(self.heap, entry)
        if len(self.heap) > 2 * len(self.blocks):  # mostly stale entries
            self.heap = sorted(self.evictable.values())  # a sorted list is a heap

    def next_victim(self):
        """The cached free block the policy gives up next."""
        while self.evictable.get(self.heap[0][-1]) != self.heap[0]:  # stale: hit since freed
            heappop(self.heap)
        return self.heap[0][-1]

    def evict(self):
        """The cached free block the policy gives up, its prefix forgotten."""
        block = self.blocks[self.next_victim()]
        heappop(self.heap)
        holders = self.blocks_by_key[block.hash]
        del self.evictable[block.block_id], holders[block.block_id]
        if not holders:
            del self.blocks_by_key[block.hash]
        block.hash, block.token_ids = None, ()
        notify(self, self.tier + "evict", block=block.block_id)
        return block.block_id

    def rebuild(self):  # the index and the eviction order, from the blocks alone
        cached = [b for b in self.blocks if b.hash is not None]
        self.blocks_by_key = {}
        for b in cached:
            self.blocks_by_key.setdefault(b.hash, {})[b.block_id] = None
        self.evictable = {b.block_id: (b.score, b.freed_at, b.block_id) for b in cached
                          if b.ref_count == 0}
        self.heap = sorted(self.evictable.values())

# -----------------------------------------------------------------------------
# 4. The block pools: the device's, and the CPU's (swap space, paper section 4.5, and a second
#    tier of the prefix cache: vLLM's CPU offloading, SGLang's hierarchical cache)
#
# A pool owns a fixed number of physical blocks, like an OS owns page frames: a free list and
# a ref count per block (vLLM v1's BlockPool). A free block that still holds a cached prefix
# stays in the prefix cache until the pool needs it back.
#

class BlockPool:
    """Physical blocks, a ref count each and a free list; take, share and release one block at
    a time (vLLM v1's BlockPool). A free block that still holds a cached prefix is the prefix
    cache's to give up (section 3); the other free blocks go first, the last freed on top."""

    def __init__(self, num_blocks, block_size, journal, enable_prefix_caching=False,
                 eviction_policy="lru", prefix_cache_cls=None, tier=""):
        self.block_size, self.num_blocks, self.journal = block_size, num_blocks, journal
        self.blocks = [PhysicalBlock(i, freed_at=-i) for i in range(num_blocks)]  # 0 goes first
        for block in self.blocks:
            block.journal = journal
        journal.pools.append(self)
        self.clock = itertools.count(1)  # stamps freed_at
        self.prefix_cache = (prefix_cache_cls or PrefixCache)(
            self.blocks, block_size, journal, enable_prefix_caching, eviction_policy, tier)
        self.taken = set()  # blocks handed out since the plan began: their slots may be written
        self.rebuild_free_list()

    @property
    def num_free_blocks(self):  # blocks that hold nothing, and cached blocks nobody holds
        return len(self.empty_block_ids) + self.prefix_cache.num_evictable

    def take(self, copies=None):
        """A free block for one owner: the last freed of those that hold nothing, or, when none
        is left, the cached block the eviction policy gives up. An eviction may ask for block
        copies (the CPU tier copies the evicted block first); evict() adds them to copies."""
        if self.empty_block_ids:
            block_id = self.empty_block_ids.pop()
        elif self.prefix_cache.num_evictable:
            block_id = self.evict(copies)
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block = self.blocks[block_id]
        block.ref_count, block.num_hits = 1, 0
        self.taken.add(block_id)
        return block_id

    def evict(self, copies):
        """The cached free block the eviction policy gives up, its prefix forgotten."""
        return self.prefix_cache.evict()

    def share(self, block_id):
        block = self.blocks[block_id]
        if block.ref_count == 0:  # a cached free block comes back to life
            self.prefix_cache.revive(block)
        block.ref_count += 1

    def release(self, block_id):
        block = self.blocks[block_id]
        if block.ref_count < 1:  # a double free would hand one block to two
            raise RuntimeError(f"block {block_id} released more times than it was taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            block.freed_at = next(self.clock)
            if block.hash is None:
                self.empty_block_ids.append(block_id)
            else:  # it keeps its prefix until the cache gives it up
                self.prefix_cache.retire(block)

    def rebuild_free_list(self):
        """The free list and the prefix cache's index, from the blocks alone: after an undo."""
        free = sorted((b for b in self.blocks if b.ref_count == 0), key=lambda b: b.freed_at)
        self.empty_block_ids = [b.block_id for b in free if b.hash is None]  # last freed on top
        self.prefix_cache.rebuild()


# The CPU pool is swap space and, when the engine has a CPU tier (the connector "cpu",
# connectors.py), the prefix cache's second tier. One pool of CPU blocks serves both, as one pool
# of device blocks serves sequences and the prefix cache: a block a swapped-out sequence holds is
# held, a cached block nobody holds is free, and a swap-out takes blocks the way a device
# allocation does, evicting cached ones by the tier's policy when none holding nothing is left. So
# a preempted sequence always has the room it had without the tier, the tier has all the room
# nobody's swap needs, and no memory is set aside for either. A cached block the device evicts is
# copied to a CPU block first, under the same key, if the pool has room and does not hold that
# prefix yet (offload); a swapped-out sequence's full blocks are cached there too, as they move. A
# lookup walks the device's cache, then this one; a block found here is copied back into a fresh
# device block (reload), in the step that admits its request, before the forward. The copies are
# the plan's, made in the run (connectors.CpuTier.transfer). The tier's order follows use, as the
# device's does: a copy is used when it is written, when it is copied back, and when the device
# gives up a block it already holds a copy of (the device used that block since; vLLM's CPU
# offloading touches it), and each use frees it anew, for the tier's policy to score (so under
# "lru" the copy used last is evicted last).


class SwapPool(BlockPool):
    """A second pool of blocks, in CPU memory, with ref counts and a free list as the device pool
    has, and a prefix cache of its own when it is a tier; and the moves between the pools,
    through the device allocator's take, share and release. A block the sequences share maps to
    one block on the other side, so sharing survives a swap."""
    observer = None  # see notify

    def __init__(self, num_blocks, allocator, enable_caching=False, eviction_policy="lru"):
        super().__init__(num_blocks, allocator.block_size, allocator.journal, enable_caching,
                         eviction_policy, tier="cpu_")
        self.allocator = allocator  # the device pool's
        self.num_offloaded_blocks = self.num_reloaded_blocks = 0  # copies each way, ever

    def offload(self, block):
        """Before the device gives up cached block: copy its K/V to a CPU block, cached under
        its key, if the pool has room; if it holds a copy already, that copy is used instead
        (so each block is written to the tier at most once while it stays). Returns the copies
        to make: [(device block, cpu block)], or none."""
        cache = self.prefix_cache
        if not cache.enabled:
            return []
        cpu_block = cache.find_block(block.hash, block.token_ids, block.logical_index)
        if cpu_block is not None:
            self.use(cpu_block)  # the device used the block since its copy was last used
            return []
        if not self.num_free_blocks:
            return []
        cpu_block = self.take()  # may evict the tier's own least valuable block
        cache.insert(cpu_block, block.hash, block.token_ids, block.logical_index)
        self.release(cpu_block)  # held by nobody: a cached free block, evictable by the policy
        self.journal.set(self, "num_offloaded_blocks", self.num_offloaded_blocks + 1)
        notify(self, "offload", block=block.block_id, cpu_block=cpu_block)
        return [(block.block_id, cpu_block)]

    def reload(self, seq, i, cpu_block, copies, group=0):
        """seq's block i (of a KV cache group), found in this tier: a fresh device block, into
        which the step copies cpu_block's K/V before the forward (and publishes it, as seq is
        scheduled). The copy joins copies."""
        block_id = self.allocator.take(copies)
        copies.reload.append((cpu_block, block_id))
        self.use(cpu_block)
        self.journal.set(self, "num_reloaded_blocks", self.num_reloaded_blocks + 1)
        notify(self, "reload", cpu_block=cpu_block, block=block_id, **group_field(group))
        return block_id

    def use(self, cpu_block):
        """A use of a cached CPU block: it is freed again, as if just now, so the tier's policy
        scores it anew (under "lru", it goes last). Held by a swapped-out sequence, it is not
        free: its turn comes when that sequence lets it go."""
        self.share(cpu_block)
        self.release(cpu_block)

    def can_swap_out(self, seqs):
        return len(blocks_held(seqs)) <= self.num_free_blocks

    def swap_out(self, seqs):
        """Move seqs' blocks to this pool; returns the BlockCopies to make (swap_out). Their
        device blocks that hold a prefix stay cached, free; num_published_blocks goes to 0, so the
        blocks they swap back into are published again as they are scheduled."""
        if not self.can_swap_out(seqs):
            raise OutOfBlocksError("the CPU swap space cannot hold these sequences")
        copies = BlockCopies(swap_out=self._move(seqs, lambda _: self.take(), self.share,
                                                 self.allocator.release))
        for seq in seqs:
            self.journal.set(seq, "num_published_blocks", 0)
            for g, table in enumerate(seq.block_tables):
                notify(self, "swap_out", seq=seq.seq_id, table=table.tolist(), **group_field(g))
            self.cache_full_blocks(seq)
        return copies

    def cache_full_blocks(self, seq):
        """A tier caches the full blocks of a sequence swapped out to it, as it does the device's
        evicted blocks: its prefix is found here for others, and after it swaps back in."""
        cache = self.prefix_cache
        for i in range(seq.num_computed_tokens // self.block_size if cache.enabled else 0):
            for g, table in enumerate(seq.block_tables):
                if table[i] != NO_BLOCK:
                    cache.publish(seq, i, table[i], g)

    def _still_cached(self, seqs):
        """CPU block -> the device block that still holds its prefix in the cache: swapping in
        shares it instead of copying. Only computed blocks: the rest will be written."""
        kept, cache = {}, self.allocator.prefix_cache
        for seq in seqs:
            for i in range(min(len(seq.block_hashes), seq.num_computed_tokens // self.block_size)):
                for g, table in enumerate(seq.block_tables):
                    if table[i] == NO_BLOCK:
                        continue
                    block_id = cache.find(cache.key(seq, i, g), seq, i)
                    if block_id is not None:
                        kept.setdefault(table[i], block_id)
        return kept

    def num_blocks_to_swap_in(self, seqs, kept=None):
        """Free device blocks swap_in(seqs) takes: a fresh one per CPU block, but none for a
        block the prefix cache still holds on the device (kept), unless that one is free too."""
        kept = self._still_cached(seqs) if kept is None else kept
        revived = {b for b in kept.values() if self.allocator.blocks[b].ref_count == 0}
        return len(blocks_held(seqs) - kept.keys()) + len(revived)

    def can_swap_in(self, seqs, kept=None):
        return self.num_blocks_to_swap_in(seqs, kept) <= self.allocator.num_free_blocks

    def swap_in(self, seqs):
        """Bring swapped-out seqs back; returns the BlockCopies to make, which land before the
        step runs: swap_in, and the tier's copies of the blocks it evicts (the fresh blocks
        are published again as they are scheduled)."""
        a, kept = self.allocator, self._still_cached(seqs)
        if not self.can_swap_in(seqs, kept):
            raise OutOfBlocksError("not enough free device blocks to swap these sequences in")
        copies = BlockCopies()

        def take(cpu_block):
            if cpu_block in kept:
                a.share(kept[cpu_block])
                return kept[cpu_block]
            return a.take(copies)
        pinned = set(kept.values())
        for block_id in pinned:  # held while fresh blocks are taken, so none of them is evicted
            a.share(block_id)
        moved = self._move(seqs, take, a.share, self.release)
        for block_id in pinned:
            a.release(block_id)
        for seq in seqs:
            for g, table in enumerate(seq.block_tables):
                notify(self, "swap_in", seq=seq.seq_id, table=table.tolist(), **group_field(g))
        copies.swap_in = [(src, dst) for src, dst in moved if src not in kept]
        return copies

    @staticmethod
    def _move(seqs, take, share, release):
        mapping = {}  # block on this side -> block on the other
        tables = [table for seq in seqs for table in seq.block_tables]  # every group's, each seq
        for table in tables:
            for i, src in enumerate(table):
                if src == NO_BLOCK:  # a block given back moves nowhere
                    continue
                if src in mapping:
                    share(mapping[src])
                else:
                    mapping[src] = take(src)
                release(src)
                table[i] = mapping[src]
        return list(mapping.items())

    def free(self, seq):
        """Return the CPU blocks of a swapped-out sequence (aborted, or to be recomputed)."""
        for g, table in enumerate(seq.block_tables):
            for block_id in table:
                if block_id != NO_BLOCK:
                    self.release(block_id)
            table.truncate(0)
            notify(self, "free", seq=seq.seq_id, **group_field(g))
        self.journal.set(seq, "num_computed_tokens", 0)


# -----------------------------------------------------------------------------
# 5. The block allocator. Paper: blocks and block tables (section 4.2), ref counts and
#    copy-on-write (4.4). Later vLLM: its KVCacheManager; nano-vllm: its BlockManager.
#
# A sequence's block table lists the physical blocks that hold its tokens in order: token t
# lives in slot t % block_size of block block_table[t // block_size]. Blocks are taken one at a
# time as a sequence grows, so a sequence wastes at most the unfilled tail of its last block
# (paper, section 4.2). Which blocks a sequence needs at all is its layers' attention kind's
# to say.


# -- attention kinds: which keys a layer's queries see, and so which blocks a sequence needs
#
# An attention kind (vLLM v1: a KVCacheSpec and its SingleTypeKVCacheManager) says in one place
# what paging needs to know of a layer's attention: its mask (kernel.Mask, the rule every
# attention backend applies), the blocks a sequence no longer needs once its first n tokens are
# computed (given back before its next chunk, NO_BLOCK left in their places so positions stay
# put), the blocks a prefix hit needs, and the most blocks a sequence holds while it computes a
# chunk of c tokens (what admission, check_request and pool sizing count, so a sliding window
# serves contexts far longer than the pool would hold under full attention). The layers of one
# kind share a KV cache group (section 7), with a block table per sequence. AttentionKind
# derives the blocks and the bound from the mask; a kind says its mask and where it comes from
# in a config, and may override the rest.


@dataclass(frozen=True)
class AttentionKind:
    """Full attention: a query sees every key before it, so a sequence keeps every block."""
    name = "full_attention"  # transformers' layer_types name, the key in ATTENTION_KINDS

    @classmethod
    def from_config(cls, config):
        """The kind of a layer that config.layer_types names so, or a ValueError naming the
        config field it lacks."""
        return cls()

    @property
    def mask(self):
        return kernel.FULL_ATTENTION

    def skipped_blocks(self, num_computed, block_size):
        """The logical blocks no token from position num_computed on sees, as a range: between
        the mask's sinks and the first key num_computed sees (vLLM's get_num_skipped_tokens).
        The mask's first_seen never decreases, so the range only grows."""
        end = self.mask.first_seen(num_computed) // block_size
        return range(min(cdiv(self.mask.sink, block_size), end), end)

    def hit_blocks(self, num_blocks, block_size):
        """The blocks of a prefix hit of num_blocks leading blocks that its sequence needs: all
        but those no token after the hit sees (vLLM's hybrid hit rule)."""
        skipped = self.skipped_blocks(num_blocks * block_size, block_size)
        return [i for i in range(num_blocks) if i not in skipped]

    def max_blocks(self, num_tokens, chunk, block_size):
        """The most blocks a sequence of num_tokens tokens holds while it computes `chunk` of
        them: its sinks' blocks, and the keys the chunk sees, at most reach - 1 + chunk
        positions (reach: the most a query sees past the sinks), over one block more where they
        start mid-block (vLLM's SlidingWindowSpec.max_memory_usage_bytes); never more than the
        blocks its tokens fill."""
        reach = self.mask.reach(kernel.NO_LIMIT) - self.mask.sink
        seen = cdiv(self.mask.sink, block_size) + cdiv(reach - 1 + chunk, block_size) + 1
        return min(cdiv(num_tokens, block_size), seen)


class FullAttention(AttentionKind):
    """Every key before the query: GPT-2's and Llama's layers, Qwen2's first ones."""


@dataclass(frozen=True)
class SlidingWindow(AttentionKind):
    """Mistral's sliding window: a query sees the last `window` positions, its own included."""
    window: int
    name = "sliding_attention"

    @classmethod
    def from_config(cls, config):
        if config.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        return cls(config.sliding_window)

    @property
    def mask(self):
        return kernel.Mask(window=self.window)


@dataclass(frozen=True)
class ChunkedLocalAttention(AttentionKind):
    """Llama 4's chunked local attention: a query sees only its own chunk of `chunk` positions
    (chunk p // chunk), up to itself."""
    chunk: int
    name = "chunked_attention"

    @classmethod
    def from_config(cls, config):
        if config.attention_chunk_size is None:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size "
                             "is None")
        return cls(config.attention_chunk_size)

    @property
    def mask(self):
        return kernel.Mask(chunk=self.chunk)


# layer_types names -> kinds: a fork registers its own (RECIPES.md: an attention kind)
ATTENTION_KINDS = {kind.name: kind for kind in (FullAttention, SlidingWindow,
                                                 ChunkedLocalAttention)}


class BlockAllocator(BlockPool):
    """Sequences' block tables over the device pool, each change beside the count of the free
    blocks it takes: a sequence is given its prefix cache hit when admitted, then blocks chunk
    by chunk as its tokens are scheduled (a write into a shared block copies it first); it is
    forked, trimmed and freed, and the blocks its kinds no longer need go back as it goes. A
    model whose layers mix attention kinds keeps a table per KV cache group (section 7) over
    this one pool. The prefix cache finds hits (PrefixCache.hit), the CPU pool keeps what
    leaves the device (SwapPool), and the Journal undoes a failed step's changes."""
    observer = None  # see notify

    def __init__(self, num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=True,
                 eviction_policy="lru", prefix_cache_cls=None, cpu_cache=False,
                 cpu_eviction_policy=None, kinds=(FullAttention(),)):
        for name, value, least in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                                   ("num_cpu_blocks", num_cpu_blocks, 0)):
            if not integer(value) or value < least:
                raise ValueError(f"BlockAllocator: {name} must be an int >= {least}, "
                                 f"got {value!r}")
        super().__init__(num_blocks, block_size, Journal(), enable_prefix_caching,
                         eviction_policy, prefix_cache_cls)
        # cpu_cache: the CPU pool caches prefixes too, a second tier under the device's
        self.swap_pool = SwapPool(num_cpu_blocks, self, enable_prefix_caching and cpu_cache,
                                  cpu_eviction_policy or eviction_policy)
        # where blocks go when they leave the device, and come back from: the CPU tier, if the
        # CPU pool caches prefixes; none otherwise (the engine may hand it another)
        self.connector = (connectors.CpuTier(self.swap_pool) if self.swap_pool.prefix_cache.enabled
                          else connectors.Connector())
        self.kinds = list(kinds)  # per KV cache group (section 7): its layers' attention kind
        # whether any group gives blocks back as its sequences grow (not full attention alone)
        self.skips_blocks = any(kind.mask != kernel.FULL_ATTENTION for kind in self.kinds)

    def evict(self, copies):
        """The device gives up a cached block: it is offered to the connector first (the CPU
        tier copies it, if it has room), so that a prefix that comes back is copied in, not
        computed again. Its copy joins copies (every device take passes the BlockCopies of the
        change it serves)."""
        self.connector.save(self.blocks[self.prefix_cache.next_victim()], copies, evicted=True)
        return super().evict(copies)

    def max_blocks(self, num_tokens, chunk):
        """The most blocks a sequence of num_tokens tokens holds while it computes a chunk of
        `chunk` tokens: each KV cache group's kind's bound, summed."""
        return sum(kind.max_blocks(num_tokens, chunk, self.block_size) for kind in self.kinds)

    def journaled_tables(self, seq):
        """seq's block tables, one per KV cache group (made if it has one for a single group),
        each given the journal, so its changes from here on are undone with the plan."""
        if len(seq.block_tables) != len(self.kinds):  # made for one group
            self.journal.set(seq, "block_tables", [BlockTable() for _ in self.kinds])
        for table in seq.block_tables:
            table.journal = self.journal
        return seq.block_tables

    def lookup(self, seq, tier=True):
        """seq's PrefixHit in the device's prefix cache, and below it in the connector's (tier:
        whether to look there), over every KV cache group's kind (PrefixCache.hit)."""
        return self.prefix_cache.hit(seq, self.kinds, self.connector if tier else None)

    def num_blocks_to_allocate(self, seq):
        """Free blocks allocate(seq) takes: the device's hits that are free now, and a fresh
        block for each of the connector's (copied in)."""
        num_taken = 0
        for hit in self.lookup(seq).cached_blocks():
            copied_back = hit.cache is not self.prefix_cache
            num_taken += copied_back or self.blocks[hit.block_id].ref_count == 0
        return num_taken

    def num_blocks_to_admit(self, seq, chunk):
        """The most free blocks seq holds at once from its admission to the end of its prefill,
        computed in chunks of at most `chunk` tokens: in each KV cache group its kind's bound,
        less the hits other sequences hold that no chunk gives back (a window gives back its
        old hits, and takes blocks in their stead)."""
        need = 0
        for kind, hits in zip(self.kinds, self.lookup(seq).blocks):
            skipped = kind.skipped_blocks(len(seq) - 1, self.block_size)  # by the last chunk
            kept = 0  # the device's hits that others hold and no chunk of seq gives back
            for i, hit in enumerate(hits):
                if hit and i not in skipped and hit.cache is self.prefix_cache:
                    kept += self.blocks[hit.block_id].ref_count > 0
            need += kind.max_blocks(len(seq), chunk, self.block_size) - kept
        return need

    def allocate(self, seq):
        """Give a new (or recomputing) sequence its prefix-cache hit: block tables over its
        cached leading blocks (NO_BLOCK where no token to come sees one), and num_computed_tokens
        the tokens they hold. Its other tokens get blocks chunk by chunk (allocate_slots).
        Returns the BlockCopies it asks for: the connector's hits copied in, and its copies of
        the blocks it evicts."""
        assert not any(seq.block_tables), f"sequence {seq.seq_id} already holds blocks"
        num_taken = self.num_blocks_to_allocate(seq)  # what an override says, too
        if num_taken > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {num_taken} blocks, "
                                   f"{self.num_free_blocks} are free")
        hit, tables = self.lookup(seq), self.journaled_tables(seq)
        length = hit.num_blocks
        reloaded = set()  # the indices of the blocks the connector serves, in any group
        for hits in hit.blocks:
            reloaded |= {i for i, h in enumerate(hits) if h and h.cache is not self.prefix_cache}
        reloaded = sorted(reloaded)
        # The device's share of the hit is the hit it serves alone (vLLM: the local cache's hit,
        # before its connector's): looked up before a block is taken, as a block taken to copy
        # into may evict one. It ends at or before the first block copied in, in any group
        # (at it, under full attention alone); the connector serves the rest of the hit.
        own = self.lookup(seq, tier=False).num_blocks if reloaded else length
        held = [h.block_id for h in hit.cached_blocks() if h.cache is self.prefix_cache]
        for block_id in held:  # share before taking, so take() cannot evict a hit
            self.share(block_id)
        copies = BlockCopies()
        for g, (table, hits) in enumerate(zip(tables, hit.blocks)):
            for i, h in enumerate(hits):
                if h is None:
                    table.append(NO_BLOCK)  # no token to come sees it
                elif h.cache is self.prefix_cache:
                    table.append(h.block_id)
                else:  # the connector's: copied into a fresh block
                    table.append(self.connector.load(seq, i, h.block_id, copies, g))
            notify(self, "allocate", seq=seq.seq_id, request=seq.request_id,
                   table=table.tolist(), hits=length, **group_field(g))
        self.journal.set(seq, "num_computed_tokens", length * self.block_size)
        # the device's leading hits are cached; the blocks copied back are published with the
        # blocks seq computes, as it is scheduled (cache_full_blocks)
        self.journal.set(seq, "num_published_blocks", (reloaded or [length])[0])
        self.prefix_cache.count(seq, length, held, own)
        return copies

    def allocate_together(self, seqs):
        """allocate() each of a request's sequences (samples or beams recomputed together), their
        prefix hits held first: a block one of them takes could otherwise evict a hit that
        another's count relied on. So the request takes at most the sum of their
        num_blocks_to_allocate. Returns their BlockCopies."""
        hits = []  # (the device pool or the connector, its block) of each sequence's hit
        for seq in seqs:
            for h in self.lookup(seq).cached_blocks():
                hits.append((self if h.cache is self.prefix_cache else self.connector, h.block_id))
        for pool, block in hits:
            pool.share(block)
        copies = BlockCopies()
        for seq in seqs:
            copies += self.allocate(seq)
        for pool, block in hits:
            pool.release(block)
        return copies

    def num_blocks_to_append(self, seqs, num_new=1):
        """Free blocks allocate_slots takes to give each of seqs its next num_new tokens: the
        blocks past its tables' ends, and a copy of each shared block they write into."""
        bs = self.block_size
        num_blocks = 0
        writers = {}  # shared block -> how many of seqs write into it
        for seq in seqs:
            start = seq.num_computed_tokens
            for table in seq.block_tables:
                num_blocks += max(0, cdiv(start + num_new, bs) - len(table))
                written = num_new and start // bs < len(table)  # a block it holds: shared?
                if written and self.blocks[table[start // bs]].ref_count > 1:
                    writers[table[start // bs]] = writers.get(table[start // bs], 0) + 1
        # c writers into a block of count r copy it min(c, r - 1) times: the last writes in place
        for block_id, c in writers.items():
            num_blocks += min(c, self.blocks[block_id].ref_count - 1)
        return num_blocks

    def can_append(self, seqs):
        """Whether the free blocks are enough for each of seqs' next token. A table takes one
        block at most, so they are counted only when fewer blocks than tables are free (every
        sequence has a table per KV cache group)."""
        free = self.num_free_blocks
        return (len(seqs) * len(seqs[0].block_tables) <= free
                or self.num_blocks_to_append(seqs) <= free)

    def num_slots_free(self, seq, most):
        """The most of seq's next `most` tokens whose blocks are free: all of them, or as many as
        the blocks allow (a prefill chunk shrinks to fit)."""
        free = self.num_free_blocks
        lo, hi = 0, most
        while lo < hi:  # the largest count whose blocks fit; the blocks grow with it
            mid = (lo + hi + 1) // 2
            if self.num_blocks_to_append([seq], mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def allocate_slots(self, seq, num_new):
        """Room for seq's next num_new tokens, from num_computed_tokens on, in each of its block
        tables: fresh blocks past a table's end, and a private copy of a shared block they write
        into (copy-on-write: the block is shared after a fork, so this writer moves to a copy
        and the other owners keep the original, paper section 4.4). Returns the BlockCopies
        the step makes on the KV tensors before the forward: the copy-on-write ones, and the
        connector's copies of the blocks it evicts."""
        need = self.num_blocks_to_append([seq], num_new)  # every group's, before any group takes
        if need > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {need} blocks, "
                                   f"{self.num_free_blocks} are free")
        bs, start = self.block_size, seq.num_computed_tokens
        copies = BlockCopies()
        for g, table in enumerate(seq.block_tables):
            i = start // bs
            if num_new and i < len(table) and self.blocks[table[i]].ref_count > 1:
                old, new = table[i], self.take(copies)
                self.release(old)
                table[i] = new
                notify(self, "cow", seq=seq.seq_id, src=old, dst=new, **group_field(g))
                copies.cow.append((old, new))
            while len(table) * bs < start + num_new:
                table.append(self.take(copies))
                notify(self, "append", seq=seq.seq_id, block=table[-1], **group_field(g))
        return copies

    def trim(self, seq):
        """Give back the blocks past seq's computed tokens (after a step that verified proposed
        tokens, those only rejected proposals wrote): its tables cover them again, as after
        any step."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        for g, table in enumerate(seq.block_tables):
            for block_id in reversed(table[keep:]):
                self.release(block_id)
            table.truncate(keep)
            notify(self, "trim", seq=seq.seq_id, keep=keep, **group_field(g))

    def fork(self, parent, child):
        """The child shares every block of the parent: parallel samples and beams start this way."""
        tables = zip(parent.block_tables, self.journaled_tables(child))
        for g, (parent_table, table) in enumerate(tables):
            for block_id in parent_table:
                if block_id != NO_BLOCK:
                    self.share(block_id)
                table.append(block_id)
            notify(self, "fork", seq=child.seq_id, parent=parent.seq_id, **group_field(g))

    def free(self, seq):
        """Return every block of a finished, aborted or preempted sequence: none of its tokens
        has K/V in the cache any more."""
        for g, table in enumerate(seq.block_tables):
            # Tail first: the head of a prompt is the likeliest to be shared, so it goes last.
            for block_id in reversed(table):
                if block_id != NO_BLOCK:
                    self.release(block_id)
            table.truncate(0)
            notify(self, "free", seq=seq.seq_id, **group_field(g))
        self.journal.set(seq, "num_computed_tokens", 0)
        self.journal.set(seq, "num_published_blocks", 0)

    def free_skipped_blocks(self, seq):
        """Give back the blocks of seq that no token from its next one on sees, in each KV cache
        group (its kind's skipped_blocks; vLLM's remove_skipped_blocks): each leaves NO_BLOCK in
        its table, so positions stay put; one that holds a prefix stays cached, free. A long
        sequence under a window of W keeps about W / block_size + 1 blocks of its group."""
        for g, (kind, table) in enumerate(zip(self.kinds, seq.block_tables)):
            for i in reversed(kind.skipped_blocks(seq.num_computed_tokens, self.block_size)):
                if table[i] == NO_BLOCK:  # those before it went back in earlier steps
                    break
                self.release(table[i])
                table[i] = NO_BLOCK
                notify(self, "skip", seq=seq.seq_id, index=i, **group_field(g))

    def cache_full_blocks(self, seq, num_tokens=None, copies=None):
        """Publish seq's full blocks among its first num_tokens (by default its computed ones)
        to the prefix cache. The engine's one call is in the plan of the step that computes
        their last tokens, so a request admitted later in that step shares them (section 3).
        A block whose prefix another block holds already (the same tokens computed at once by
        two samples, or two prompts in flight) is cached beside it, as in vLLM: each stays its
        sequence's own, and either serves a hit while the other is evicted. Each published
        block is offered to the connector too: the copies it asks for (a disk store's, made
        once the step has computed the block) join copies, the plan's BlockCopies."""
        cache = self.prefix_cache
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = num_tokens // self.block_size
        if not cache.enabled or num_full <= seq.num_published_blocks:
            return
        copies = BlockCopies() if copies is None else copies
        cache.key_blocks(seq)  # the engine keyed them already; a caller of its own may not have
        for g, table in enumerate(seq.block_tables):
            for i in range(seq.num_published_blocks, num_full):
                if table[i] != NO_BLOCK:
                    cache.publish(seq, i, table[i], g)
                    self.connector.save(self.blocks[table[i]], copies, evicted=False)
        self.journal.set(seq, "num_published_blocks", num_full)

# -----------------------------------------------------------------------------
# 6. The scheduler: continuous batching in a policy's order, one step at a time. Orca:
#    iteration-level scheduling. Paper: preemption by recompute or swap (section 4.5).
#    Later vLLM: chunked prefill, the admission watermark, priority scheduling.
#
# Every step re-decides which sequences run (Orca's iteration-level scheduling): finished
# requests leave at once and waiting ones take their blocks. A step is a token budget shared
# by decodes (one token per sequence) and prefill chunks (many tokens of one prompt), so a
# long prompt is prefilled over several steps without stalling running decodes. When a
# decode finds no free block, the running request that comes last is preempted (paper, 4.5).
#
# schedule() is a step's plan: it moves requests between queues and takes the blocks their
# tokens need, every change journaled (section 2), and returns what the step runs. It changes
# no sequence but its paging state (block table, num_computed_tokens on a hit or a preemption)
# and a request's first admission (its queue time ends as it is scheduled, vLLM's stamp); the
# tokens, the other counters and times change in the step's commit (section 10).

SCHEDULING_POLICIES = {  # the order: a Request's key (fixed while queued), smaller first
    "fcfs": lambda request: request.request_id,  # first come, first served: ids count arrivals
    "priority": lambda request: (request.priority, request.request_id),  # vLLM's: lower first
}


@dataclass
class SchedulerOutput:
    """A step's plan."""
    scheduled: list = field(default_factory=list)  # (seq, num_new_tokens) in batch order
    copies: BlockCopies = field(default_factory=BlockCopies)  # what its takes and moves ask
    admitted: list = field(default_factory=list)  # requests admitted from waiting
    preempted: list = field(default_factory=list)  # requests preempted
    lookahead: list = field(default_factory=list)  # (seq, slots) for proposals: see speculative
    num_batched_tokens: int = 0


class Scheduler:
    observer = None  # see notify

    def __init__(self, allocator, max_num_seqs, max_num_batched_tokens, preemption_mode="recompute",
                 watermark=0.01, scheduling_policy="fcfs", num_lookahead_slots=0):
        self.allocator = allocator
        self.key = SCHEDULING_POLICIES[scheduling_policy]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.num_lookahead_slots = num_lookahead_slots  # proposals per sequence, when speculating
        # Admission keeps a few blocks spare, so a request just let in is not preempted by the
        # next decode step (vLLM's watermark: 1% of the pool, and at least one block, so a pool
        # of 4 blocks keeps 25% spare).
        self.watermark_blocks = max(1, round(watermark * allocator.num_blocks))
        # Each queue is ordered by the policy's key, first first; nobody overtakes in its queue.
        self.waiting = deque()  # new, or preempted by recompute and waiting to prefill again
        self.running = []  # holding device blocks
        self.swapped = []  # preempted by swap, blocks in the CPU pool
        self.num_preemptions = 0

    def add(self, request):  # into its queue by the key, after its equals
        insort(self.waiting, request, key=self.key)

    def has_unfinished(self):
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self):
        """This step's plan, in four phases (after the blocks no token to come sees go back):
        1. decodes of running requests, first first (preempting when blocks run out); 2.
        swapped-out requests come back; 3. prefill chunks of running requests; 4. waiting
        requests are admitted while blocks, sequence slots and the token budget allow. Then,
        speculating, lookahead slots from what is left."""
        out = SchedulerOutput()
        if self.allocator.skips_blocks:  # before any block is counted in this step
            for seq in (seq for request in self.running for seq in request.seqs):
                self.allocator.free_skipped_blocks(seq)
        self._schedule_decodes(out)
        # room held for all samples of each request
        num_seqs = sum(request.params.num_seqs for request in self.running)
        num_seqs = self._swap_in(out, num_seqs)
        for request in list(self.running):  # a copy: a chunk may preempt a request after it
            if not request.is_decoding and request in self.running:
                self._schedule_prefill(request, out)
        self._admit(out, num_seqs)
        if self.num_lookahead_slots:
            self._reserve_lookahead(out)
        return out

    def _move(self, request, source, target):
        """Move request from one queue to another, in its place by the key; journaled, so a failed
        step's undo puts it back where it was."""
        i = source.index(request)
        del source[i]
        insort(target, request, key=self.key)
        self.allocator.journal.record(self._move_back, request, source, i, target)

    @staticmethod
    def _move_back(request, source, i, target):
        target.remove(request)
        source.insert(i, request)

    def _schedule_decodes(self, out):
        # A request whose next tokens need blocks that are not free preempts the last running
        # request, possibly itself.
        i = 0
        while i < len(self.running):
            request = self.running[i]
            if not request.is_decoding or self._over_budget(out, len(request.seqs)):
                i += 1
                continue
            while not self.allocator.can_append(request.seqs):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self._append_slots(request, out)
                i += 1

    def _swap_in(self, out, num_seqs):
        # First first, unless this step had to preempt or a waiting request comes before them.
        swap_pool = self.allocator.swap_pool
        while self.swapped and not out.preempted and not self._ahead(self.waiting, self.swapped):
            request = self.swapped[0]
            # + a block for each sequence's next token, in each of its tables
            need = (swap_pool.num_blocks_to_swap_in(request.seqs)
                    + sum(len(seq.block_tables) for seq in request.seqs))
            if (not self._fits(need) or num_seqs + request.params.num_seqs > self.max_num_seqs
                    or self._over_budget(out, len(request.seqs))):
                if not self.running:  # nothing will free blocks for it: recompute, not wait forever
                    self._recompute(request, self.swapped)
                break
            num_seqs += request.params.num_seqs
            out.copies += swap_pool.swap_in(request.seqs)
            self._move(request, self.swapped, self.running)
            notify(self, "resume", request=request.request_id)
            if request.is_decoding:
                self._append_slots(request, out)
        return num_seqs

    def _admit(self, out, num_seqs):
        # None while a swapped-out request comes before them, and none in a step that had to
        # preempt, which would only preempt again.
        while (self.waiting and not out.preempted and not self._ahead(self.swapped, self.waiting)
               and out.num_batched_tokens < self.max_num_batched_tokens):
            request = self.waiting[0]
            chunk = self._admission_chunk(request, out)
            if not chunk or num_seqs + request.params.num_seqs > self.max_num_seqs:
                break  # nobody overtakes the first waiting request
            num_seqs += request.params.num_seqs
            self._move(request, self.waiting, self.running)
            out.admitted.append(request)
            notify(self, "admit", request=request.request_id)
            out.copies += self.allocator.allocate_together(request.seqs)
            self._first_scheduled(request)
            if not request.is_decoding:
                self._schedule_prefill(request, out, chunk)
            elif not self._over_budget(out, len(request.seqs)):
                self._append_slots(request, out)  # recomputed samples, all but the last cached

    def _first_scheduled(self, request):
        """A request's first admission ends its time in the queue as the scheduler schedules it
        (vLLM's stamp), not after the forward, and counts the prompt tokens the prefix cache
        served it. Journaled: a failed step's undo takes both back."""
        m = request.metrics
        if m.first_scheduled_time is None:
            now, journal = time.perf_counter(), self.allocator.journal
            journal.set(request, "metrics", replace(m, first_scheduled_time=now,
                                                    time_in_queue=now - m.arrival_time))
            journal.set(request, "num_cached_tokens", request.seqs[0].num_computed_tokens)

    def _admission_chunk(self, request, out):
        """The longest first chunk (tokens a sequence, up to the budget left) with which the
        request's whole prefill fits in the free blocks, by its kinds' bound (with the
        watermark); 0 if none does. Under full attention the bound is every block of the prompt,
        whatever the chunk; under a window it grows with the chunk, so a long prompt starts in
        chunks that fit where it could not start whole."""
        def need(chunk):
            return sum(self.allocator.num_blocks_to_admit(seq, chunk) for seq in request.seqs)
        most = self.max_num_batched_tokens - out.num_batched_tokens
        if not self._fits(need(1)):
            return 0
        lo, hi = 1, most
        while lo < hi:  # the longest chunk that fits; the bound grows with it
            mid = (lo + hi + 1) // 2
            if self._fits(need(mid)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _ahead(self, queue, other):  # whether queue's first request comes before other's
        return bool(queue) and self.key(queue[0]) < self.key(other[0])

    def _over_budget(self, out, num_tokens):
        return out.num_batched_tokens + num_tokens > self.max_num_batched_tokens

    def _fits(self, num_blocks):
        # Alone on the device, a request needs no watermark: there is nobody left to preempt.
        spare = self.watermark_blocks if self.running else 0
        return num_blocks + spare <= self.allocator.num_free_blocks

    def _schedule(self, seq, num_new, out):
        """seq computes num_new more tokens this step. The blocks they fill are published now,
        so a request admitted after it in this step can hit them (section 3)."""
        out.scheduled.append((seq, num_new))
        out.num_batched_tokens += num_new
        self.allocator.cache_full_blocks(seq, seq.num_computed_tokens + num_new, out.copies)

    def _append_slots(self, request, out):
        for seq in request.seqs:
            out.copies += self.allocator.allocate_slots(seq, 1)
            self._schedule(seq, 1, out)

    def _schedule_prefill(self, request, out, most=None):
        """A chunk of each of request's sequences: its uncomputed tokens, up to the budget left
        (and `most`), and then up to what the free blocks hold. A chunk that gets no token for
        want of blocks preempts the last running request, unless that is this one or has run in
        this step; then it waits, holding what it computed: those that hold the blocks run
        now, or come before it."""
        # Samples or beams being recomputed stop one token short: their last tokens go together
        # as one decode step, so the request gets all its next-token logits at once (section 1).
        hold_back = 1 if len(request.seqs) > 1 else 0
        for seq in request.seqs:
            while (want := min(len(seq) - hold_back - seq.num_computed_tokens, most or math.inf,
                               self.max_num_batched_tokens - out.num_batched_tokens)) > 0:
                if num_new := self.allocator.num_slots_free(seq, want):
                    out.copies += self.allocator.allocate_slots(seq, num_new)
                    self._schedule(seq, num_new, out)
                    break
                victim = self.running[-1]
                if victim is request or self._has_run(victim, out):
                    return
                self._preempt(victim, out)

    @staticmethod
    def _has_run(request, out):  # whether any of its sequences has tokens in this step
        return any(seq.request_id == request.request_id for seq, _ in out.scheduled)

    def _reserve_lookahead(self, out):
        """Speculative decoding: slots for up to num_lookahead_slots proposed tokens after each
        sequence whose last token runs this step (a prompt's first token is sampled plainly),
        from the token budget and free blocks the step left, so speculation never preempts nor
        holds back what plain decoding would run; and never past max_tokens."""
        a = self.allocator
        last = {seq.seq_id for seq, n in out.scheduled if seq.num_computed_tokens + n == len(seq)}
        for request in self.running:
            for seq in request.seqs:
                if seq.seq_id not in last or not seq.num_output_tokens:
                    continue
                # a slot takes a block in each table: of the free blocks, its share
                num_free = a.num_free_blocks // len(seq.block_tables)
                room = (len(seq.block_table) + num_free) * a.block_size - len(seq)
                slots = min(self.num_lookahead_slots, room,
                            request.params.max_tokens - seq.num_output_tokens - 1,
                            self.max_num_batched_tokens - out.num_batched_tokens)
                if slots > 0:
                    # the chunk's tokens have their slots: slots after its last token too
                    out.copies += a.allocate_slots(seq, len(seq) + slots - seq.num_computed_tokens)
                    out.lookahead.append((seq, slots))
                    out.num_batched_tokens += slots

    def _preempt(self, request, out):
        """Take a running request's blocks: swap them out in swap mode (while the swap space holds
        them), else free them to be recomputed."""
        out.preempted.append(request)
        if self.preemption_mode == "swap" and self.allocator.swap_pool.can_swap_out(request.seqs):
            out.copies += self.allocator.swap_pool.swap_out(request.seqs)
            self._move(request, self.running, self.swapped)
            notify(self, "preempt", request=request.request_id, mode="swap")
        else:
            self._recompute(request, self.running)
            notify(self, "preempt", request=request.request_id, mode="recompute")

    def preempt_by_recompute(self, request):
        """Outside a step (the undo of a failed one): free a running or swapped-out request's
        blocks and send it back to the waiting queue (a running one is preempted once more)."""
        running = request in self.running
        self._recompute(request, self.running if running else self.swapped)
        if running:
            self.count_preemption(request)
        notify(self, "preempt", request=request.request_id, mode="recompute")

    def count_preemption(self, request):  # the one place preemptions are counted
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _recompute(self, request, queue):
        """Free the blocks of a request in queue (running, or swapped: CPU blocks) and send it to
        the waiting queue, under FCFS to its front: it arrived before everything still waiting.
        What the prefix cache still holds of it, it finds again when readmitted."""
        pool = self.allocator.swap_pool if queue is self.swapped else self.allocator
        for seq in request.seqs:
            pool.free(seq)
        self._move(request, queue, self.waiting)

    def abort(self, request):
        """Drop a request wherever it is and return all its blocks (between steps)."""
        queue = next(q for q in (self.waiting, self.running, self.swapped) if request in q)
        queue.remove(request)
        pool = self.allocator.swap_pool if queue is self.swapped else self.allocator
        for seq in request.seqs:
            if any(seq.block_tables):  # a waiting request holds none
                pool.free(seq)
        request.seqs = []

    def remove_finished(self):
        self.running = [request for request in self.running if not request.is_finished]
# -----------------------------------------------------------------------------
# 7. The model: one GPT for GPT-2 and the Llama family (Llama, Mistral, Qwen2), told apart by
#    a few config switches as in litgpt. Paper: PagedAttention (section 4.1), where the
#    kernel meets the block table, in CausalSelfAttention.forward.


# Activations by Hugging Face's names (GPT-2's activation_function, Llama's hidden_act): GPT-2's
# gelu_new is the tanh approximation of GELU, "gelu" the exact one
ACTIVATIONS = dict(gelu=F.gelu, relu=F.relu, silu=F.silu,
                   gelu_new=lambda x: F.gelu(x, approximate="tanh"))
ACTIVATIONS["gelu_pytorch_tanh"] = ACTIVATIONS["gelu_new"]


class KVCacheGroup(NamedTuple):
    kind: AttentionKind  # its layers' attention kind (section 5)
    layers: list  # its layers, in order: layer layers[j] keeps its K/V in slot j of a block


class LayerKV(NamedTuple):
    """What one layer's attention reads and writes of a step: its K and V caches, its KV cache
    group's view of the step, its 8-bit cache's scales, and its blocks' key bounds."""
    k_cache: torch.Tensor  # (num_blocks, block_size, nkv, hs)
    v_cache: torch.Tensor  # (num_blocks, block_size, nkv, hs)
    group: "GroupBatch"  # its KV cache group's block tables and slots (section 8)
    scales: dict  # {} or an 8-bit cache's {k_scale, v_scale} (kernel.py)
    key_bounds: torch.Tensor | None  # (2, num_blocks, nkv, hs), if the read policy keeps them


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # GPT-2's BPE vocabulary; 256 for the byte-level demo model
    max_seq_len: int = 1024  # learned positions make this a hard context limit (HF: n_positions)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int | None = None  # fewer K/V heads than query heads is GQA; None: n_head (GPT-2)
    head_dim: int | None = None  # None: n_embd // n_head; some checkpoints choose their own
    layer_norm_epsilon: float = 1e-5  # the eps of either norm (HF Llama: rms_norm_eps)
    eos_token_id: int | list[int] | None = None  # each ends a sample; GPT-2's is 50256, the byte
    # model has none, Llama 3.1 Instruct lists three: an int, a list or None, as in HF's config
    rope_theta: float | None = None  # None: GPT-2's learned positions; else rotary, of this base
    rope_scaling: dict | None = None  # Llama 3.1's "llama3" slowing of the slow rotary frequencies
    norm: str = "layernorm"  # Llama's "rmsnorm" divides by the root mean square: no mean, no bias
    mlp: str = "gelu"  # Llama's "swiglu" gates the MLP: down(silu(gate(x)) * up(x))
    intermediate_size: int | None = None  # the MLP's hidden width; None: GPT-2's 4 * n_embd
    bias: bool = True  # GPT-2 has biases in every linear layer and norm; Llama has none
    qkv_bias: bool | None = None  # Qwen2 keeps biases on q, k and v alone; None follows bias
    tie_word_embeddings: bool = True  # the output head is wte (GPT-2, the small Qwen2 models)
    activation: str | None = None  # a key of ACTIVATIONS; None: gelu_new (GPT-2), silu (swiglu)
    attn_scale: float | None = None  # scores times this; None: 1/sqrt(head_dim). GPT-2 may use 1
    # Each layer's attention kind by name (ATTENTION_KINDS: "full_attention",
    # "sliding_attention", "chunked_attention", or a fork's), transformers' layer_types; None:
    # every layer "sliding_attention" if sliding_window is set (Mistral), else "full_attention"
    layer_types: list[str] | None = None
    # Mistral's sliding window: a windowed layer's token at position p sees keys p - W < k <= p
    # (transformers' rule), the last W positions
    sliding_window: int | None = None
    # Llama 4's chunked local attention: a token sees the keys of its own chunk of this many
    # positions (transformers' attention_chunk_size)
    attention_chunk_size: int | None = None
    activations = tuple(ACTIVATIONS)  # a class attribute, not a field: the names activation takes

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_head % self.n_kv_head or self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must divide by n_head ({self.n_head}) "
                             f"and n_head by n_kv_head ({self.n_kv_head})")
        if self.norm not in ("layernorm", "rmsnorm") or self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm' (got {self.norm!r}), "
                             f"mlp 'gelu' or 'swiglu' (got {self.mlp!r})")
        self.activation = self.activation or ("silu" if self.mlp == "swiglu" else "gelu_new")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        if self.attn_scale is None:
            self.attn_scale = 1 / math.sqrt(self.head_dim)
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        self.qkv_bias = self.bias if self.qkv_bias is None else self.qkv_bias
        self.check_attention()

    def check_attention(self):
        for name in ("sliding_window", "attention_chunk_size"):
            if (n := getattr(self, name)) is not None and (type(n) is not int or n < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {n!r}")
        if self.layer_types is None:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [kind] * self.n_layer
        kinds = self.layer_types
        if (not isinstance(kinds, (list, tuple)) or len(kinds) != self.n_layer
                or any(kind not in ATTENTION_KINDS for kind in kinds)):
            raise ValueError(f"layer_types must list {self.n_layer} (n_layer) of "
                             f"{sorted(ATTENTION_KINDS)}, got {kinds!r}")
        self.layer_types = list(kinds)
        self.attention_kinds  # each kind's own check of the fields it reads

    @property
    def attention_kinds(self):
        """Each layer's attention kind (section 5)."""
        return [ATTENTION_KINDS[name].from_config(self) for name in self.layer_types]

    @property
    def kv_cache_groups(self):
        """The layers in KV cache groups (vLLM v1's hybrid KV cache manager): each group the
        layers of one attention kind, and each the same number of layers, so that one block of
        the pool holds the K/V of any group's layers for block_size tokens. Each group has a
        block table per sequence, and gives back the blocks its kind no longer needs. One group,
        all layers, but for models that mix kinds."""
        by_kind = {}
        for layer, kind in enumerate(self.attention_kinds):
            by_kind.setdefault(kind, []).append(layer)
        size = math.gcd(*map(len, by_kind.values()))
        return [KVCacheGroup(kind, layers[i:i + size]) for kind, layers in by_kind.items()
                for i in range(0, len(layers), size)]

    @property
    def eos_token_ids(self):
        """The end-of-text ids as a set, read when asked: eos_token_id may be changed later."""
        eos = self.eos_token_id
        return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)

    @property
    def qkv_widths(self):
        """Widths of q, k and v, stacked in that order in the whole model's fused c_attn."""
        return [n * self.head_dim for n in (self.n_head, self.n_kv_head, self.n_kv_head)]


def rope_cos_sin(config, positions, dtype):
    """RoPE (Su et al., 2021): dims i and i + hs/2 of every head turn by position * inv_freq[i].
    The angles are computed in fp32, as transformers does, whatever the model's dtype."""
    hs, device = config.head_dim, positions.device
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hs, 2, device=device).float() / hs)
    if config.rope_scaling:  # llama3: frequencies slower than the original context turn factor
        s = config.rope_scaling  # times slower still, fast ones stay, a linear ramp between
        wavelen = 2 * math.pi / inv_freq
        ramp = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)
        inv_freq = (1 - ramp) * inv_freq / s["factor"] + ramp * inv_freq
    angles = positions.float()[:, None] * inv_freq                            # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]                   # (T, 1, hs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x (..., T, heads, hs): each pair (x1, x2) turns to (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def update_key_bounds(key_bounds, k_cache, slot_mapping, k_scale=None):
    """After a layer stores the step's keys: a block whose first slot the step writes starts
    over (it is new, or handed out again), then every block takes the min and max of the keys
    written into it. The keys are read back from the cache in the bounds' dtype (the model's),
    as attention reads them (an 8-bit cache's dequantized: the bound holds for what is
    attended). No host sync: a skipped slot (-1) and a block not starting over take +-inf where
    a reduction ignores it.
    key_bounds (2, num_blocks, nkv, hs): [0] the min, [1] the max; k_cache (num_blocks,
    block_size, nkv, hs); slot_mapping (T,)."""
    block_size = k_cache.shape[1]
    written = slot_mapping >= 0                                                      # (T,)
    slots = slot_mapping.clamp(min=0)                                                # (T,)
    k = torch.index_select(k_cache.flatten(0, 1), 0, slots)                   # (T, nkv, hs)
    k = kernel.dequantize(k, k_scale, key_bounds.dtype)
    starts = (written & (slots % block_size == 0))[:, None, None].expand_as(k)  # (T, nkv, hs)
    blocks = (slots // block_size)[:, None, None].expand_as(k)                  # (T, nkv, hs)
    inf = torch.full_like(k, float("inf"))
    lo, hi = key_bounds
    # starting over: the min goes to +inf, the max to -inf, so the first key replaces them
    lo.scatter_reduce_(0, blocks, torch.where(starts, inf, -inf), "amax")
    hi.scatter_reduce_(0, blocks, torch.where(starts, -inf, inf), "amin")
    ok = written[:, None, None]
    lo.scatter_reduce_(0, blocks, torch.where(ok, k, inf), "amin")
    hi.scatter_reduce_(0, blocks, torch.where(ok, k, -inf), "amax")



class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism): see TP_SPLIT_DIM
        self.n_head = config.n_head // tp.world_size
        self.n_kv_head = config.n_kv_head // tp.world_size
        self.head_dim, self.scale = config.head_dim, config.attn_scale
        self.layer = layer  # a read policy may read every block of the first layers (Quest)
        self.mask = config.attention_kinds[layer].mask  # which keys its queries see (kernel.Mask)
        qkv_dim = (self.n_head + 2 * self.n_kv_head) * self.head_dim  # q, k, v: one matmul
        self.c_attn = nn.Linear(config.n_embd, qkv_dim, bias=config.qkv_bias)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)

    def forward(self, x, batch=None, kv_cache=None, rope=None):
        q, k, v = self.c_attn(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                        self.n_kv_head * self.head_dim], dim=-1)
        q = q.unflatten(-1, (self.n_head, self.head_dim))     # (B, T, nh, hs), paged (T, nh, hs)
        k = k.unflatten(-1, (self.n_kv_head, self.head_dim))  # (B, T, nkv, hs), paged (T, nkv, hs)
        v = v.unflatten(-1, (self.n_kv_head, self.head_dim))
        if rope is not None:  # before the cache: it holds rotated keys, kernels need no positions
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if batch is None:
            # contiguous (B, T, C): training and the reference path, no cache involved
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)
            seen = None  # causal: SDPA's own
            if self.mask != kernel.FULL_ATTENTION:
                pos = torch.arange(q.shape[2], device=q.device)
                seen = self.mask.visible(pos[:, None], pos[None, :])                    # (T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, is_causal=seen is None,
                                               scale=self.scale, enable_gqa=True)
            return all_reduce(self.c_proj(y.transpose(1, 2).flatten(2)))
        # paged (T, C): first write the new K/V into their slots, then every new token attends
        # to the keys of its sequence's context that its mask shows, gathered block by block
        # through the block table, by the attention backend the engine chose
        # (kernel.ATTENTION_BACKENDS; only layers other than full attention pass a mask, so a
        # backend without masks still serves every model of full attention)
        kv, group = kv_cache, kv_cache.group  # this layer's LayerKV
        batch.backend.store(k, v, kv.k_cache, kv.v_cache, group.slot_mapping, **kv.scales)
        if kv.key_bounds is not None:
            update_key_bounds(kv.key_bounds, kv.k_cache, group.slot_mapping,
                              kv.scales.get("k_scale"))
        if batch.read_policy is not None and self.mask == kernel.FULL_ATTENTION:
            # a window or a chunk reads what its kind keeps; full attention, the selection
            y = attend_selected(self, q, kv, batch)                                # (T, nh, hs)
        else:
            mask = {} if self.mask == kernel.FULL_ATTENTION else {"mask": self.mask}
            y = batch.backend.attend(q, kv.k_cache, kv.v_cache, group, self.scale, **mask,
                                     **kv.scales)                                   # (T, nh, hs)
        return all_reduce(self.c_proj(y.flatten(1)))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        n, bias = config.n_embd, config.bias
        hidden = config.intermediate_size // tp.world_size  # this rank's columns
        self.c_fc = nn.Linear(n, hidden, bias=bias)  # HF Llama: up_proj
        self.c_gate = nn.Linear(n, hidden, bias=bias) if config.mlp == "swiglu" else None  # Llama
        self.c_proj = nn.Linear(hidden, n, bias=bias)  # HF Llama: down_proj
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x):
        if self.c_gate is None:
            h = self.act(self.c_fc(x))
        else:
            h = self.act(self.c_gate(x)) * self.c_fc(x)
        return all_reduce(self.c_proj(h))


def norm(config):
    return (nn.RMSNorm(config.n_embd, eps=config.layer_norm_epsilon) if config.norm == "rmsnorm"
            else nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias))


class TransformerBlock(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)

    def forward(self, x, batch=None, kv_cache=None, rope=None):
        x = x + self.attn(self.ln_1(x), batch, kv_cache, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    config_class = GPTConfig  # what checkpoints.py builds from a folder's config.json

    def __init__(self, config):
        super().__init__()
        for name in ("n_head", "n_kv_head", "intermediate_size"):
            if (n := getattr(config, name)) % tp.world_size:
                raise ValueError(f"{name}={n} does not divide by tensor_parallel_size="
                                 f"{tp.world_size}: each rank holds whole heads, equal MLP slices")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=None if config.rope_theta else nn.Embedding(config.max_seq_len, config.n_embd),
            h=nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer)),
            ln_f=norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        self.rope_table = {}  # (device, dtype) -> cos, sin (max_seq_len, 1, head_dim) of rotary
        # layer -> (its KV cache group, its slot in a block): where its K/V live
        self.kv_cache_slots = {layer: (g, slot) for g, group in enumerate(config.kv_cache_groups)
                               for slot, layer in enumerate(group.layers)}

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)  # GPT-2's initializer_range
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, batch=None, kv_cache=None):
        """Contiguous: idx (B, T) -> logits (B, T, V). Paged: idx (T,) packed, batch and
        kv_cache (2, layers per KV cache group, num_blocks, block_size, nkv, hs) given -> logits
        (R, V) at batch.logits_indices."""
        pos = torch.arange(idx.shape[-1], device=idx.device) if batch is None else batch.positions
        x, rope = self.transformer.wte(idx), None
        if self.transformer.wpe is not None:
            x = x + self.transformer.wpe(pos)
        else:  # each token's angles, from a table made once (as vLLM's cos_sin_cache)
            if (key := (x.device, x.dtype)) not in self.rope_table:
                self.rope_table[key] = rope_cos_sin(
                    self.config, torch.arange(self.config.max_seq_len, device=x.device), x.dtype)
            rope = [t[pos] for t in self.rope_table[key]]
        for i, block in enumerate(self.transformer.h):
            kv = None
            if batch is not None:
                g, slot = self.kv_cache_slots[i]
                bounds = None if batch.key_bounds is None else batch.key_bounds[:, slot]
                kv = LayerKV(k_cache=kv_cache[0, slot], v_cache=kv_cache[1, slot],
                             group=batch.groups[g], scales=batch.kv_scales[i], key_bounds=bounds)
            x = block(x, batch, kv, rope)
        if batch is not None:
            x = x[batch.logits_indices]  # the LM head is the widest matmul: only where we sample
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def load_full_state_dict(self, state_dict):
        """Copy in a whole model's state dict, keeping this rank's slice of each tensor."""
        for name, param in self.named_parameters():
            param.copy_(tp_shard(name, state_dict[name], self.config))
        return self

    @classmethod
    def from_pretrained(cls, path, dtype="auto", device=None):
        """Load a local Hugging Face folder whose config.json says model_type gpt2, llama, mistral
        or qwen2, from disk, without a network or transformers (checkpoints.py). dtype "auto": the
        checkpoint's own on a GPU, float32 on a CPU; or "float32", "float16", "bfloat16", or a
        torch dtype. device: where it will run, for "auto" (default: a GPU if there is one)."""
        return checkpoints.load_pretrained(cls, path, dtype, device).eval()


# -----------------------------------------------------------------------------
# 8. The model runner: the scheduler's decision becomes block copies and one packed batch
#
# The worker of the paper's system overview (section 4): it owns the model and the KV
# cache, performs the swaps and copy-on-write copies the scheduler ordered, then runs every
# scheduled token of every sequence as one varlen batch through the attention backend.


def kv_block_shape(config, block_size):
    """One KV block on this rank: K and V of the layers of a KV cache group (every layer, but
    for models that mix attention types), for this rank's own K/V heads (see tensor
    parallelism above)."""
    layers = len(config.kv_cache_groups[0].layers)
    return (2, layers, block_size, config.n_kv_head // tp.world_size, config.head_dim)


def key_bounds_shape(config):
    """One block's key bounds on this rank (a read policy's that needs them: read_policy.py): the
    elementwise min and max of its keys, for each layer of a KV cache group and each of this
    rank's K/V heads, in the model's dtype: 1 / block_size of the block's K/V in that dtype."""
    layers = len(config.kv_cache_groups[0].layers)
    return (2, layers, config.n_kv_head // tp.world_size, config.head_dim)


def block_bytes(model, block_size, dtype, proposer=None, read_policy=None):
    """What one block of the pool costs in bytes: its K/V in the cache's dtype (kv_cache_dtype
    "fp8": half of 16 bits), a draft model's K/V (speculative decoding), and its key bounds in
    the model's dtype if the read policy keeps them."""
    num_bytes = math.prod(kv_block_shape(model.config, block_size)) * dtype.itemsize
    num_bytes += proposer.bytes_per_block(block_size, dtype) if proposer else 0
    if read_policy is not None and read_policy.needs_key_bounds:
        model_dtype = next(model.parameters()).dtype
        num_bytes += math.prod(key_bounds_shape(model.config)) * model_dtype.itemsize
    return num_bytes


def pool_sizes(device, block_size, bytes_per_block, num_blocks, kv_cache_bytes, most_blocks,
               num_cpu_blocks, swap_space, cpu_cache_bytes=0):
    """The blocks of the device pool and of the CPU pool. The device pool is sized like vLLM's:
    by a byte budget, by default 90% of free GPU memory, but no more than most_blocks (what
    max_num_seqs full-length sequences may hold, by their attention kinds' bound). The CPU pool
    holds swap_space GiB (vLLM's), or the device pool's size if smaller (more rarely helps, as a
    request that finds it full is recomputed instead), and cpu_cache_bytes more for the second
    tier. Each rank holds its own K/V heads: one budget makes tp times the blocks, and every
    rank takes the least."""
    if num_blocks is None:
        if kv_cache_bytes is None:
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 30
            kv_cache_bytes = min(int(0.9 * free), bytes_per_block * most_blocks)
        num_blocks = kv_cache_bytes // bytes_per_block
    num_blocks = tp_min(num_blocks, device)
    if num_blocks < 1:  # only a budget can come to this; and then it does on every rank
        raise ValueError(f"Engine: kv_cache_bytes={kv_cache_bytes} is smaller than one KV "
                         f"block ({bytes_per_block} bytes at block_size={block_size})")
    if num_cpu_blocks is None:
        num_cpu_blocks = min(num_blocks, int(swap_space * 2**30) // bytes_per_block)
    num_cpu_blocks += cpu_cache_bytes // bytes_per_block
    return num_blocks, tp_min(num_cpu_blocks, device)


@dataclass
class GroupBatch:
    """What the attention layers of one KV cache group read of a step (a backend's meta)."""
    block_tables: torch.Tensor    # (S, max_blocks) int32, -1 past each sequence's last block, and
    #                               for a block no token to come sees (NO_BLOCK)
    slot_mapping: torch.Tensor    # (T,) int64, physical KV slot each new token is written to
    seq_lens: torch.Tensor        # (S,) int32, context length including the new tokens
    cu_seqlens_q: torch.Tensor    # (S+1,) int32, sequence i's new tokens are [cu[i], cu[i+1])
    max_q_len: int                # longest run of new tokens, so the kernel needs no host sync
    scratch: dict = field(default_factory=dict)  # the backend's, shared by the group's layers


@dataclass
class Batch:
    """One engine step, packed: the new tokens of every scheduled sequence, back to back."""
    input_ids: torch.Tensor       # (T,) int64, T = total new tokens this step
    positions: torch.Tensor       # (T,) int64, position of each token in its sequence
    logits_indices: torch.Tensor  # (R,) int64, rows whose next-token logits we need
    groups: list                  # per KV cache group: a GroupBatch (one, for most models)
    backend: kernel.AttentionBackend  # how every layer stores and reads K/V
    kv_scales: list               # per layer: {} or an 8-bit cache's {k_scale, v_scale} (kernel.py)
    # the blocks' key bounds (2, layers per KV cache group, num_blocks, nkv, hs), None if the
    # read policy needs none; the read policy (read_policy.py), None for "all"
    key_bounds: torch.Tensor | None = None
    read_policy: object = None


class Chunk(NamedTuple):
    """One sequence's part of a batch: its tokens at positions [start, start + len(tokens)),
    and the rows of logits wanted after its last num_logits of them."""
    seq: Sequence
    start: int
    tokens: list
    num_logits: int


class ModelRunner:

    def __init__(self, model, num_blocks, num_cpu_blocks, block_size, backend, device, dtype,
                 read_policy=None):
        self.model, self.block_size, self.device = model, block_size, device
        self.backend = backend  # a kernel.AttentionBackend
        self.read_policy = read_policy  # which blocks a decode reads (read_policy.py); None: all
        shape = kv_block_shape(model.config, block_size)  # (2, L, block_size, nkv, hs)
        # The KV cache is one tensor, so a block copy (copy-on-write, swap) is one indexing op
        # for all layers (L: the layers of a KV cache group, section 7).
        self.kv_cache = torch.zeros(*shape[:2], num_blocks, *shape[2:], dtype=dtype, device=device)
        # The swap space is block-major and pinned, so each block moves by one direct
        # non_blocking copy (DMA) that does not stall the host; it runs on the step's stream,
        # before the forward.
        self.cpu_kv_cache = torch.zeros(num_cpu_blocks, *shape, dtype=dtype,
                                        pin_memory=device.type == "cuda")
        # per layer, an 8-bit cache's scales, fixed here once (kernel.py says how and why)
        self.kv_scales = calibrate_kv_scales(model, shape, dtype)  # [{k_scale, v_scale}]
        # Each block's key bounds, if the read policy ranks blocks by them, in the model's dtype
        # (what attention dequantizes an 8-bit cache to), laid out as the K/V (block dim 2 on
        # the device, block-major on the CPU): a block copy moves them in the same indexing op
        self.key_bounds = self.cpu_key_bounds = None
        if read_policy is not None and read_policy.needs_key_bounds:
            bounds = key_bounds_shape(model.config)                        # (2, L, nkv, hs)
            model_dtype = next(model.parameters()).dtype
            self.key_bounds = torch.zeros(*bounds[:2], num_blocks, *bounds[2:],
                                          dtype=model_dtype, device=device)
            self.cpu_key_bounds = torch.zeros(num_cpu_blocks, *bounds, dtype=model_dtype,
                                              pin_memory=device.type == "cuda")
        self.table_rows = []  # per KV cache group, the batch's block table rows: batch_table
        self.connector = connectors.Connector()  # the engine hands it the allocator's

    def execute(self, plan, chunks):
        """Copy the blocks the plan orders, then run the step's chunks (its scheduled tokens,
        each sequence's proposals after them: step_chunks). Returns the logits (R, V) in
        logits_rows' order; or None if nothing runs."""
        self.copy_blocks(plan.copies)
        logits = self.forward(chunks) if chunks else None
        self.connector.transfer(plan.copies, self, "computed")  # what the step computed
        return logits

    def forward(self, chunks, prompt_logprobs=True):
        batch = self.prepare(chunks, prompt_logprobs)
        with torch.inference_mode():
            return self.model(batch.input_ids, batch, self.kv_cache)  # (R, V)

    def copy_blocks(self, copies):
        """A plan's BlockCopies, of the K/V and of whatever is kept beside them per block (key
        bounds): a block's data moves wherever the block does. The connector reads the blocks
        it saves before anything writes a block, and writes the blocks it loads after the swaps
        (connectors.py)."""
        self.connector.transfer(copies, self, "out")
        for cache, cpu_cache in self.paged_tensors():
            copy_blocks(copies, cache, cpu_cache, self.device)
        self.connector.transfer(copies, self, "in")

    def paged_tensors(self):
        """Each tensor kept per block, on the device and in the CPU pool: the K/V, and the key
        bounds if the read policy keeps them."""
        pairs = [(self.kv_cache, self.cpu_kv_cache)]
        if self.key_bounds is not None:
            pairs.append((self.key_bounds, self.cpu_key_bounds))
        return pairs

    def batch_table(self, g, seq_tables):
        """KV cache group g's block tables as the batch's (S, max_blocks) int32 rows, each ending
        in -1s. The rows stay between steps (vLLM v1's persistent block table), and row i is
        written again only when another table holds it now or its table changed since (each
        change moves the table's version): a decode step writes the rows of the sequences that
        took a block, not every row a sequence holds."""
        width = max(table.n for table in seq_tables)
        if len(self.table_rows) <= g:
            self.table_rows.append((np.full((0, 0), -1, dtype=np.int32), [], []))
        rows, tables, versions = self.table_rows[g]  # what each row holds, and as of which change
        if len(seq_tables) > rows.shape[0] or width > rows.shape[1]:  # more room, all rows anew
            # each way as a list grows, alone: a wider table doubles the width, not the rows
            shape = [have if need <= have else max(need, 2 * have)
                     for need, have in zip((len(seq_tables), width), rows.shape)]
            rows = np.full(shape, -1, dtype=np.int32)
            tables, versions = [None] * len(rows), [0] * len(rows)
            self.table_rows[g] = rows, tables, versions
        for i, table in enumerate(seq_tables):
            if tables[i] is not table or versions[i] != table.version:
                rows[i, :table.n] = table.ids[:table.n]
                rows[i, table.n:] = -1
                tables[i], versions[i] = table, table.version
        # a view: the step reads it before the next one writes (a GPU's batch gets a copy)
        return rows[:len(seq_tables), :width]

    def prepare(self, chunks, prompt_logprobs=True):
        """Pack chunks into one varlen batch; after the rows of logits each chunk wants, the rows
        that prompt logprobs need, if asked for. The work is per token scheduled and per block
        table that changed, never per token a sequence holds: on the CPU the batch reads the
        kept block table rows in place; a GPU gets them in one copy, as vLLM v1's each step."""
        bs, chunks = self.block_size, list(chunks)
        q_lens = np.array([len(c.tokens) for c in chunks])                            # (S,)
        starts = np.array([c.start for c in chunks])                                   # (S,)
        cu_seqlens_q = np.concatenate([[0], np.cumsum(q_lens)])                       # (S+1,)
        owner = np.repeat(np.arange(len(chunks)), q_lens)        # (T,) each token's chunk
        positions = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[owner] + starts[owner]  # (T,)
        block_tables, slot_mappings = [], []  # per KV cache group
        for g in range(len(chunks[0].seq.block_tables)):
            tables = self.batch_table(g, [c.seq.block_tables[g] for c in chunks])  # (S, max_blocks)
            block_tables.append(tables)
            slot_mappings.append(tables[owner, positions // bs].astype(np.int64) * bs
                                 + positions % bs)                                  # (T,)
        # each row of logits wanted: the token at position p of chunk i, in the batch
        logits_indices = [int(cu_seqlens_q[i]) + p - chunks[i].start
                          for i, p in logits_rows(chunks, prompt_logprobs)]

        def tensor(x, dtype=torch.int64):
            return torch.as_tensor(x, dtype=dtype).to(self.device)
        seq_lens, cu = tensor(starts + q_lens, torch.int32), tensor(cu_seqlens_q, torch.int32)
        groups = [GroupBatch(block_tables=tensor(tables, torch.int32),
                             slot_mapping=tensor(slots), seq_lens=seq_lens, cu_seqlens_q=cu,
                             max_q_len=int(q_lens.max()))
                  for tables, slots in zip(block_tables, slot_mappings)]
        return Batch(input_ids=tensor([t for c in chunks for t in c.tokens]),
                     positions=tensor(positions), logits_indices=tensor(logits_indices),
                     groups=groups, backend=self.backend, kv_scales=self.kv_scales,
                     key_bounds=self.key_bounds, read_policy=self.read_policy)


def copy_blocks(copies, cache, cpu_cache, device):
    """A plan's swaps and copies-on-write of one paged tensor, cache (a, b, num_blocks, ...) on
    the device and cpu_cache (num_cpu_blocks, a, b, ...), each kind in one indexing op, in an
    order where each reads what it should: swap-outs read their device blocks before anything
    writes them, swap-ins read their CPU blocks before the swap-outs land, and copy-on-write,
    last, may copy a block just swapped in. They run on the step's stream, before the
    forward."""
    to_cpu, from_cpu = copies.swap_out, copies.swap_in
    if to_cpu:
        staged = cache[:, :, [b for b, _ in to_cpu]].movedim(2, 0).contiguous()
    if from_cpu:  # (n, a, b, ...), each block by one direct non_blocking copy (DMA)
        staged_in = torch.stack([cpu_cache[b].to(device, non_blocking=True)
                                 for b, _ in from_cpu])
        cache[:, :, [b for _, b in from_cpu]] = staged_in.movedim(0, 2)
    if to_cpu:
        for block, (_, cpu_block) in zip(staged, to_cpu):
            cpu_cache[cpu_block].copy_(block, non_blocking=True)
    if copies.cow:  # copy-on-write, every block of the step in one batched copy
        src, dst = zip(*copies.cow)
        cache[:, :, list(dst)] = cache[:, :, list(src)]


def logits_rows(chunks, prompt_logprobs=True):
    """The rows of a step's logits, in order, each as (chunk index, position): first each
    chunk's sampling rows, after its last num_logits tokens; then, if asked, the positions
    whose logits give a prompt logprob still owed. The model runner gathers these rows and the
    output processor reads them: the order is worked out here alone."""
    rows = []
    for i, c in enumerate(chunks):
        end = c.start + len(c.tokens)
        rows += [(i, p) for p in range(end - c.num_logits, end)]
    if prompt_logprobs:
        for i, c in enumerate(chunks):
            if c.seq.prompt_logprobs:  # it asked for them
                end = c.start + len(c.tokens)
                rows += [(i, p) for p in c.seq.prompt_logprob_positions(c.start, end)]
    return rows


def step_chunks(scheduled, proposals):
    """A step's chunks for ModelRunner.prepare: the tokens [num_computed_tokens, + num_new) of
    each scheduled sequence, then its proposals; logits after its last token and each proposal
    when its last token is in."""
    for seq, num_new in scheduled:
        start, proposal = seq.num_computed_tokens, proposals.get(seq.seq_id, [])
        complete = start + num_new == len(seq)
        yield Chunk(seq=seq, start=start, tokens=seq.token_ids[start:start + num_new] + proposal,
                    num_logits=complete * (1 + len(proposal)))


@torch.no_grad()
def calibrate_kv_scales(model, block_shape, dtype, num_tokens=256):
    """Per layer, the k_scale and v_scale (fp32, 0-d) of an 8-bit cache of dtype for model (the
    scheme in kernel.py), as keyword arguments of the attention backends; {} for a cache of 16 or
    32 bits. num_tokens fixed ids spread over the vocabulary, in sequences of at most
    max_seq_len, prefilled on the torch path (whatever the engine's backend, so the scales
    depend on the model alone) into a cache of the model's dtype; amax per layer of what it
    stored. block_shape: (2, layers per KV cache group, block_size, n_kv_head, head_dim) of this
    rank (each rank calibrates its own heads; the ranks run it together, so their collectives
    match)."""
    config, param = model.config, next(model.parameters())
    if dtype not in kernel.FP8_DTYPES:
        return [{}] * config.n_layer
    seq_len = min(num_tokens, config.max_seq_len)
    num_seqs, device = cdiv(num_tokens, seq_len), param.device
    num_groups = len(config.kv_cache_groups)
    # a prime stride walks the vocabulary in a fixed order, no two neighbours alike
    ids = torch.arange(num_seqs * seq_len, device=device) * 7919 % config.vocab_size
    # (2, layers per group, groups x num_seqs, seq_len, nkv, hs): a block a sequence and group
    cache = torch.zeros(*block_shape[:2], num_groups * num_seqs, seq_len, *block_shape[3:],
                        dtype=param.dtype, device=device)
    int32 = dict(dtype=torch.int32, device=device)
    seq_lens = torch.full((num_seqs,), seq_len, **int32)
    cu = torch.arange(0, len(ids) + 1, seq_len, **int32)
    groups = [GroupBatch(  # group g's blocks: one per sequence, the whole of it new
        block_tables=torch.arange(g * num_seqs, (g + 1) * num_seqs, **int32)[:, None],
        slot_mapping=torch.arange(len(ids), device=device) + g * len(ids), seq_lens=seq_lens,
        cu_seqlens_q=cu, max_q_len=seq_len) for g in range(num_groups)]
    batch = Batch(input_ids=ids, positions=torch.arange(seq_len, device=device).repeat(num_seqs),
                  logits_indices=torch.zeros(0, dtype=torch.long, device=device), groups=groups,
                  backend=kernel.ATTENTION_BACKENDS["torch"], kv_scales=[{}] * config.n_layer)
    with torch.inference_mode():
        model(ids, batch, cache)
    amax = cache.abs().unflatten(2, (num_groups, num_seqs)).amax(dim=(3, 4, 5, 6))  # (2, L, G)
    s = kernel.kv_scales(amax, dtype)
    return [dict(k_scale=s[0, slot, g], v_scale=s[1, slot, g])
            for g, slot in (model.kv_cache_slots[i] for i in range(config.n_layer))]


# -----------------------------------------------------------------------------
# 9. Sampling: one engine step's logits through a pipeline of small steps, then the draw
#    (transformers' logits processors and warpers; vLLM's SamplingMetadata and sampler)
#
# The step gathers its rows' SamplingParams once into a SamplingMetadata. Each step of the
# pipeline is one short function of (scores, metadata), in transformers' order, that leaves
# alone the rows whose parameter is at its default. Then greedy rows take the argmax and the
# others draw from the softmax of what the pipeline left.


@dataclass
class SamplingMetadata:
    """The rows of one step that choose a token: each one's SamplingParams; its Sequence and the
    tokens proposed before this one (speculative decoding), whose prompt and output the
    penalties and logits processors read; and the generator it draws with (None for greedy
    rows, and for beams). And the model's end-of-text ids."""
    params: list
    seqs: list
    proposed: list
    generators: list
    eos_token_ids: set
    device: torch.device
    columns: dict = field(default_factory=dict)  # made once per step, on first use

    def default(self, name):
        """A parameter's default, read from the class of a row that has it: your copy may add a
        parameter in a subclass of SamplingParams, and give it to some requests only (MISSING:
        to none)."""
        return next((type(p).__dataclass_fields__[name].default for p in self.params
                     if name in type(p).__dataclass_fields__), MISSING)

    def rows_using(self, *names):
        """The rows whose params set any of these parameters away from its default."""
        rows = set()
        for name in names:  # one pass per name, with one comparison per row
            default = self.default(name)
            unset = (default, [])  # a list's default is a factory's: empty
            rows.update([r for r, p in enumerate(self.params)
                         if getattr(p, name, default) not in unset])
        return sorted(rows)

    def uses(self, name):
        """Whether any row sets the parameter away from its default."""
        return bool(self.rows_using(name))

    def column(self, name, dtype=torch.float64):
        """(R,) every row's parameter (the default where its params lack it), on the logits'
        device."""
        if (name, dtype) not in self.columns:
            default = self.default(name)
            self.columns[name, dtype] = torch.tensor(
                [getattr(p, name, default) for p in self.params], dtype=dtype, device=self.device)
        return self.columns[name, dtype]

    def prompt_ids(self, r):
        return self.seqs[r].token_ids[:self.seqs[r].num_prompt_tokens]

    def output_ids(self, r):
        return self.seqs[r].output_token_ids + self.proposed[r]

    def counts(self, ids_of_row, V, rows):
        """(R, V) how many times each token id is in ids_of_row(r), for each of rows (zeros in
        the others: only the rows that ask for it read their tokens)."""
        ids = [ids_of_row(r) for r in rows]
        index = torch.tensor([(r, t) for r, row in zip(rows, ids) for t in row],
                             dtype=torch.long).reshape(-1, 2).to(self.device)
        return torch.zeros(len(self.params), V, device=self.device).index_put_(
            (index[:, 0], index[:, 1]), torch.ones(len(index), device=self.device),
            accumulate=True)


def apply_logits_processors(scores, meta):
    """Each row's own SamplingParams.logits_processors, in order, on its scores (vLLM's
    per-request form): constrained decoding, watermarks, a bias of one's own."""
    if not meta.uses("logits_processors"):
        return scores
    for r, p in enumerate(meta.params):
        for processor in p.logits_processors:
            scores[r] = processor(meta.prompt_ids(r), meta.output_ids(r), scores[r])
    return scores


def apply_penalties(scores, meta):
    """repetition_penalty over the tokens of prompt and output, as transformers'
    RepetitionPenaltyLogitsProcessor and vLLM divide a positive score by it and multiply a
    negative one; then, over the output, minus presence_penalty once for each token present and
    minus frequency_penalty times its count (vLLM's and the OpenAI API's rule)."""
    rows = meta.rows_using("repetition_penalty", "presence_penalty", "frequency_penalty")
    if not rows:
        return scores
    counts = meta.counts(meta.output_ids, scores.shape[-1], rows).to(scores.dtype)     # (R, V)
    seen = (meta.counts(meta.prompt_ids, scores.shape[-1], rows) > 0) | (counts > 0)
    penalty = meta.column("repetition_penalty").to(scores.dtype)[:, None]
    scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    presence = meta.column("presence_penalty").to(scores.dtype)[:, None]
    frequency = meta.column("frequency_penalty").to(scores.dtype)[:, None]
    return scores - presence * (counts > 0) - frequency * counts


def apply_min_tokens(scores, meta):
    """No row with fewer than min_tokens output tokens may draw an end: its stop_token_ids and
    the model's end-of-text ids score -inf (vLLM's, ignore_eos or not; transformers'
    MinNewTokensLengthLogitsProcessor)."""
    if not meta.uses("min_tokens"):
        return scores
    for r, p in enumerate(meta.params):
        if meta.seqs[r].num_output_tokens + len(meta.proposed[r]) < p.min_tokens:
            ends = sorted(set(p.stop_token_ids) | meta.eos_token_ids)
            scores[r, ends] = -math.inf
    return scores


def apply_temperature(scores, meta):
    """Scores divided by the row's temperature (transformers' TemperatureLogitsWarper)."""
    if not meta.uses("temperature"):
        return scores
    t = meta.column("temperature")
    return scores / torch.where(t > 0, t, 1).to(scores.dtype)[:, None]


def apply_top_k(scores, meta):
    """Keep the top_k highest scores of a row and every score tied with the k-th (0 keeps all),
    as transformers' TopKLogitsWarper."""
    if not meta.uses("top_k"):
        return scores
    k, V = meta.column("top_k", torch.int64), scores.shape[-1]
    k = torch.where(k > 0, k.clamp(max=V), V)
    kth = scores.sort(dim=-1, descending=True).values.gather(-1, k[:, None] - 1)       # (R, 1)
    return scores.masked_fill(scores < kth, -math.inf)


def apply_top_p(scores, meta):
    """Of what is left, renormalised, the smallest set whose probability reaches top_p (the
    token that crosses it is in), as transformers' TopPLogitsWarper: in ascending order a token
    stays if the mass up to and with it is > 1 - top_p, and the likeliest always does. Equal
    scores at that edge fall as the same sort that transformers calls orders them."""
    if not meta.uses("top_p"):
        return scores
    threshold = (1 - meta.column("top_p")).to(scores.dtype)  # rounded as transformers rounds it
    sorted_scores, order = scores.sort(dim=-1)                                          # (R, V)
    keep = sorted_scores.softmax(dim=-1).cumsum(dim=-1) > threshold[:, None]
    keep[:, -1] = True
    return scores.masked_fill(~torch.zeros_like(keep).scatter_(-1, order, keep), -math.inf)


def apply_min_p(scores, meta):
    """Then drop the tokens less likely than min_p times the likeliest, as transformers'
    MinPLogitsWarper (the likeliest always stays)."""
    if not meta.uses("min_p"):
        return scores
    probs = scores.softmax(dim=-1)                                                      # (R, V)
    floor = meta.column("min_p").to(scores.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(probs < floor, -math.inf)


# A new sampling parameter is a field of SamplingParams and one step in one of these lists, in
# its place. LOGITS_STEPS change which token is likeliest, so greedy rows take them too, and
# beams on their log-probabilities (transformers' logits processors); SAMPLING_STEPS shape what
# a sampled row draws from (its warpers, which greedy decoding skips).
LOGITS_STEPS = [apply_logits_processors, apply_penalties, apply_min_tokens]
SAMPLING_STEPS = [apply_temperature, apply_top_k, apply_top_p, apply_min_p]


def sample(logits, meta):
    """Next token per row of logits (R, V), from the scores the pipeline leaves, in float32 (or
    the logits' dtype if wider): greedy rows (temperature 0) take the argmax after LOGITS_STEPS,
    the others draw after SAMPLING_STEPS too, each with its own generator on the logits' device,
    so a draw depends only on its row and its generator, bitwise (the row itself matches a solo
    run within rounding: a matmul may take another kernel for another number of rows)."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    for step in LOGITS_STEPS:
        scores = step(scores, meta)
    tokens = scores.argmax(dim=-1)
    rows = [i for i, p in enumerate(meta.params) if p.temperature > 0]
    if not rows:
        return tokens
    for step in SAMPLING_STEPS:
        scores = step(scores, meta)
    probs = scores[rows].softmax(dim=-1)                                                # (D, V)
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i,
    # and each row draws its E from its own generator.
    noise = torch.empty_like(probs)
    for r, i in enumerate(rows):
        noise[r].exponential_(generator=meta.generators[i])
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def sample_generator(seed, index, position, device):
    """The generator that draws output token `position` of sample `index`, seeded by a 64-bit
    hash of (seed, index, position): a draw is a function of those and the logits alone, so
    neither batch-mates, preemption nor a failed step that is retried can change it. Distinct
    triples draw distinct streams (seed + index made seed 0's sample 1 replay seed 1's sample 0).
    A CUDA generator keeps all 64 bits, torch's CPU one the low 32: a clash has odds 2**-32."""
    digest = hashlib.blake2b(f"{seed},{index},{position}".encode(), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest, "little"))


def log_probs(logits):
    """Log-softmax in float32 at least (16-bit logits would round the logprobs), else as given."""
    return logits.log_softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))


def logprob_entry(token, logprob, top, r, k):
    """vLLM's logprobs entry: {token that came: its logprob}, then the k likeliest of row r."""
    return {token: logprob} | dict(zip(top.indices[r, :k].tolist(), top.values[r, :k].tolist()))


# -----------------------------------------------------------------------------
# 10. Output processing: parallel samples, beam search (paper, section 4.4), stops, outputs
#
# In a step's run, the output processor turns the logits into what each request gains: each
# sample's next token (speculating, the guesses its draws confirm too), each beam search's
# next beams, why each sample stops, and its text: the tokenizer's and the logits
# processors' code runs here, and nothing changes. In the step's commit it applies them:
# parallel samples fork from the prompt and share its blocks, beams fork and free, a finished
# sequence frees its blocks at once. Nothing in the commit can fail halfway.


class SampleUpdate(NamedTuple):
    """What one sample gains in a step: decided in its run, applied in its commit."""
    request: Request
    seq: Sequence  # the sample, or the prompt's sequence that a new sample forks from
    index: int  # the sample's index: a new one's differs from seq's
    tokens: list  # drawn and kept, in order (more than one when proposed tokens are kept)
    logprobs: list  # each token's log-probability under the model
    entries: list | None  # each token's logprobs entry, when asked for
    text: tuple | None  # with a tokenizer: (text, text_offsets) after the tokens
    finish_reason: str | None  # None: it goes on
    stop_reason: int | str | None = None


class BeamCandidate(NamedTuple):
    """A one-token extension of a live beam that the search keeps: a next beam, or a
    hypothesis."""
    parent: int  # the index of the beam it extends
    token: int
    logprob: float  # the token's own, as the search ranks it (after the logits steps)
    score: float  # the cumulative log-probability with the token


class BeamHypothesis(NamedTuple):
    """A finished beam: its output tokens, their cumulative log-probability, why it ended."""
    token_ids: list
    cumulative_logprob: float
    finish_reason: str
    text: str | None = None  # with a tokenizer
    extras: dict | None = None  # its per-draw fields (Sequence.extras), set in the commit


class BeamStep(NamedTuple):
    """What one beam search does in a step: decided in its run, applied in its commit."""
    survivors: list  # a BeamCandidate for each next beam
    ended: list  # a BeamCandidate for each hypothesis that ended this step, with them in order:
    hypotheses: list  # BeamHypothesis
    done: bool  # enough hypotheses, or no beam goes on
    texts: list | None = None  # with a tokenizer, each survivor's text


@dataclass
class StepResult:
    """What a step's run computed, for its commit to apply."""
    ready: list = field(default_factory=list)  # requests whose sequences got logits
    samples: list = field(default_factory=list)  # SampleUpdate for each sample of those
    beams: dict = field(default_factory=dict)  # request_id -> BeamStep
    prompt_logprobs: list = field(default_factory=list)  # (seq, entry) computed this step
    proposals: dict = field(default_factory=dict)  # seq_id -> the tokens proposed after it


class OutputProcessor:

    def __init__(self, config, scheduler, seq_ids, device, detokenizer=None, proposer=None):
        self.config, self.scheduler, self.device = config, scheduler, device
        self.seq_ids = seq_ids  # the engine's counter of sequence ids, shared with forks
        self.detokenizer = detokenizer  # text and stop strings, with a tokenizer
        self.proposer = proposer  # speculative decoding's: it verifies and counts proposals
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # of the requests that have had a first token, each once

    @property
    def allocator(self):
        return self.scheduler.allocator

    # -- run: decide, changing nothing ---------------------------------------------------

    def decide(self, chunks, logits, proposals):
        """What the step's logits (R, V), run for its chunks, give each request whose sequences
        reached their last token: the rows after those tokens (and after each proposal), then
        prompt logprobs'."""
        result = StepResult(proposals=proposals)
        if logits is None:
            return result
        running = {request.request_id: request for request in self.scheduler.running}
        gathered = logits_rows(chunks)  # the order the model runner gathered them in
        num_sampling = sum(c.num_logits for c in chunks)
        row_of = {}  # seq_id -> its first row of logits, for sequences whose last token is in
        ready = {}  # request_id -> request: the scheduler completes a request's sequences together
        for row, (i, _) in enumerate(gathered[:num_sampling]):
            seq = chunks[i].seq
            row_of.setdefault(seq.seq_id, row)  # then a row after each of its proposals
            ready[seq.request_id] = running[seq.request_id]
        owed = [(chunks[i].seq, p) for i, p in gathered[num_sampling:]]  # their rows
        if owed:
            result.prompt_logprobs = self.prompt_logprob_entries(owed, logits[num_sampling:],
                                                                 running)
        result.ready = list(ready.values())
        to_sample = []  # (request, seq, sample index, row)
        for request in result.ready:
            seqs, params = request.seqs, request.params
            if params.beam_width is not None:
                rows = [row_of[seq.seq_id] for seq in seqs]
                result.beams[request.request_id] = self.beam_step(request, logits[rows])
            elif params.n > 1 and len(seqs) == 1 and not seqs[0].num_output_tokens:
                # parallel samples draw their first tokens from the prompt's logits
                row = row_of[seqs[0].seq_id]
                to_sample += [(request, seqs[0], i, row) for i in range(params.n)]
            else:
                for seq in seqs:
                    to_sample.append((request, seq, seq.index, row_of[seq.seq_id]))
        if to_sample:
            result.samples = self.draw(to_sample, logits, proposals)
        return result

    def draw(self, to_sample, logits, proposals):
        """Each sample's next token; speculating, one after each of its proposals too, from the
        row after it, as if nothing were proposed (speculative.py keeps the draws that confirm
        the proposals). Then where each stops. A SampleUpdate each."""
        draws = []  # (request, seq, sample index, row, the proposals before this draw)
        for request, seq, index, row in to_sample:
            proposal = proposals.get(seq.seq_id, [])
            for j in range(1 + len(proposal)):
                draws.append((request, seq, index, row + j, proposal[:j]))
        rows = [row for _, _, _, row, _ in draws]
        logits = logits if rows == list(range(len(logits))) else logits[rows]           # (D, V)
        generators = []  # a seeded draw's own: token t of sample i from (seed, i, t)
        for request, seq, index, _, before in draws:
            t = seq.num_output_tokens + len(before)
            seeded = request.seed is not None
            generators.append(sample_generator(request.seed, index, t, self.device) if seeded
                              else None)
        meta = SamplingMetadata(
            params=[request.params for request, _, _, _, _ in draws],
            seqs=[seq for _, seq, _, _, _ in draws],
            proposed=[before for _, _, _, _, before in draws], generators=generators,
            eos_token_ids=self.config.eos_token_ids, device=logits.device)
        # Tensor parallel ranks run this same scheduler on bit-identical logits (the all-reduce
        # gives each the same sum), so greedy picks, beams and stops agree; a random draw may
        # not (unseeded, each rank has its own seed), so all take rank 0's tokens.
        tokens = broadcast(sample(logits, meta))                                        # (D,)
        eos = self.config.eos_token_ids
        logprobs = log_probs(logits)                                                   # (D, V)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        asked = [p.logprobs for p in meta.params if p.logprobs is not None]  # top-k logprobs
        top = logprobs.topk(max(asked)) if asked else None
        tokens, updates = tokens.tolist(), []
        d = 0  # the first draw of the sample in hand
        for request, seq, index, _ in to_sample:
            proposal = proposals.get(seq.seq_id)
            drawn = tokens[d:d + 1 + len(proposal or ())]
            kept = self.proposer.verify(drawn, proposal) if proposal else drawn
            kept, reason, stop, text = self.stop_check(seq, request.params, kept, eos)
            k = request.params.logprobs
            entries = None if k is None else [logprob_entry(t, chosen[d + j], top, d + j, k)
                                              for j, t in enumerate(kept)]
            updates.append(SampleUpdate(request=request, seq=seq, index=index, tokens=kept,
                                        logprobs=chosen[d:d + len(kept)], entries=entries,
                                        text=text, finish_reason=reason, stop_reason=stop))
            d += len(drawn)
        return updates

    def stop_check(self, seq, params, tokens, eos):
        """Of the tokens a sample drew this step, those it keeps, why it ends after them (None,
        "stop" or "length"), the stop token id or string that ended it, and its (text,
        text_offsets) then, with a tokenizer. vLLM's rules: an end token (one of stop_token_ids,
        or of eos unless ignore_eos) counts from min_tokens on, and its own text is left out of
        the output unless include_stop_str_in_output; a stop string counts once the output is
        longer than min_tokens, and cuts the text, even inside an end token's text that is kept
        (it is then the stop_reason)."""
        detokenizer = self.detokenizer
        texts = detokenizer.texts(seq, tokens) if detokenizer else None
        state = (seq.text, seq.text_offsets) if detokenizer else None
        for j, token in enumerate(tokens):
            num_output = seq.num_output_tokens + j + 1
            ends = token in params.stop_token_ids or (not params.ignore_eos and token in eos)
            ends = ends and num_output >= params.min_tokens
            if detokenizer and (params.include_stop_str_in_output or not ends):
                text, offsets, new = texts[j]
                state = (text, offsets)
                found = detokenizer.stop_string(text, new, params, num_output)
                if found:
                    stop, text = found
                    return tokens[:j + 1], "stop", stop, (text, offsets)
            if ends:
                stop = token if token in params.stop_token_ids else None
                return tokens[:j + 1], "stop", stop, state
            if num_output >= params.max_tokens:
                return tokens[:j + 1], "length", None, state
        return tokens, None, None, state

    def beam_step(self, request, logits):
        """beam_search_step, and with a tokenizer the text of each next beam and hypothesis."""
        step = beam_search_step(request, logits, self.stop_ids(request.params),
                                self.config.eos_token_ids)
        if self.detokenizer is None:
            return step
        decode, beams = self.detokenizer.decode, request.seqs
        return step._replace(
            hypotheses=[h._replace(text=decode(h.token_ids)) for h in step.hypotheses],
            texts=[decode(beams[c.parent].output_token_ids + [c.token])
                   for c in step.survivors])

    def prompt_logprob_entries(self, owed, logits, requests):
        """Prompt token p + 1's logprob and the k likeliest, from the logits after position p."""
        logprobs = log_probs(logits)                                                   # (P, V)
        ks = [requests[seq.request_id].params.prompt_logprobs for seq, _ in owed]
        tokens = [seq.token_ids[p + 1] for seq, p in owed]
        index = torch.tensor(tokens, device=logprobs.device)[:, None]
        chosen = logprobs.gather(-1, index).squeeze(-1).tolist()
        top = logprobs.topk(max(ks))
        return [(seq, logprob_entry(token, chosen[r], top, r, k))
                for r, ((seq, _), token, k) in enumerate(zip(owed, tokens, ks))]

    def stop_ids(self, params):
        """The tokens that end a sequence: the request's, and every end-of-text id unless
        ignore_eos."""
        eos = set() if params.ignore_eos else self.config.eos_token_ids
        return set(params.stop_token_ids) | eos

    # -- commit: apply, nothing can fail halfway ------------------------------------------

    def commit(self, plan, result):
        """Advance the scheduled sequences past their new tokens, give each ready request what
        the run decided, retire finished sequences. Returns the ready requests, to report."""
        for request in plan.preempted:
            self.scheduler.count_preemption(request)
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
        for seq, entry in result.prompt_logprobs:
            seq.prompt_logprobs.append(entry)
        now = time.perf_counter()
        for request in result.ready:
            if request.metrics.first_token_time is None:
                request.metrics = replace(request.metrics, first_token_time=now)
                self.num_prompt_tokens += len(request.prompt_token_ids)
            if request.request_id in result.beams:
                self.apply_beam_step(request, result.beams[request.request_id])
        # New samples fork from the prompt before it gains its own first token.
        samples = [u.seq if u.index == u.seq.index else self.fork(u.request, u.seq, u.index)
                   for u in result.samples]
        for seq, update in zip(samples, result.samples):
            self.apply_sample(seq, update, result.proposals.get(seq.seq_id))
        finished = [request for request in result.ready if request.is_finished]
        for request in finished:
            request.metrics = replace(request.metrics, finished_time=time.perf_counter())
        if finished:
            self.scheduler.remove_finished()
        return result.ready

    def land(self, seq, tokens, logprobs):
        """Where every draw lands, a sample's, a beam's or a finished hypothesis's: its tokens
        join the sequence, its new full blocks are keyed, and the tokens counted. logprobs: each
        token's log-probability, under the model for a sample (as vLLM's logprobs), as the
        search ranks it for a beam. A fork that keeps a per-draw field declares it in
        Sequence.extras and updates it here; outputs carry it."""
        seq.token_ids += tokens
        self.allocator.prefix_cache.key_blocks(seq)
        self.num_generated_tokens += len(tokens)

    def apply_sample(self, seq, update, proposal):
        self.land(seq, update.tokens, update.logprobs)
        for logprob in update.logprobs:
            seq.cumulative_logprob += logprob
        if update.entries is not None:
            seq.logprobs += update.entries
        if update.text is not None:
            seq.text, seq.text_offsets = update.text
        seq.num_computed_tokens += len(update.tokens) - 1  # the proposed tokens it kept
        if proposal is not None:
            self.proposer.count(proposal, update.tokens)
        if update.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = update.finish_reason, update.stop_reason
            self.allocator.free(seq)
            update.request.seqs.remove(seq)
            update.request.finished_seqs.append(seq)
        elif proposal is not None:
            self.allocator.trim(seq)  # the blocks only rejected proposals wrote go back

    def apply_beam_step(self, request, step):
        """The next beams: a beam chosen twice forks, so both continuations share its blocks; a
        beam not chosen is freed, and what it shared lives on in the survivors."""
        beams = request.seqs
        for candidate, hypothesis in zip(step.ended, step.hypotheses):
            ended = beams[candidate.parent].fork(None, 0)  # a copy of the beam, holding no block
            self.land(ended, [candidate.token], [candidate.logprob])
            request.hypotheses.append(hypothesis._replace(extras=ended.extras))
        if step.done:  # the survivors' tokens were drawn too, and the search ends with them
            self.num_generated_tokens += len(step.survivors)
            for seq in request.seqs:
                self.allocator.free(seq)
            request.seqs = []
            return
        chosen, survivors = set(), []  # the beams chosen, and the next beams in order
        for candidate in step.survivors:
            seq = beams[candidate.parent]
            if candidate.parent in chosen:
                seq = self.fork(request, seq, 0, join=False)
            chosen.add(candidate.parent)
            survivors.append(seq)
        for i, seq in enumerate(beams):
            if i not in chosen:
                self.allocator.free(seq)
        for i, (seq, candidate) in enumerate(zip(survivors, step.survivors)):
            # after every fork, so no child copies a new token
            self.land(seq, [candidate.token], [candidate.logprob])
            seq.cumulative_logprob = candidate.score
            if step.texts is not None:
                seq.text = step.texts[i]
        request.seqs = survivors

    def fork(self, request, seq, index, join=True):
        child = seq.fork(next(self.seq_ids), index)
        self.allocator.fork(seq, child)
        if join:
            request.seqs.append(child)
        return child


def beam_search_step(request, logits, stops, eos_token_ids=frozenset()):
    """The beam_width best one-token extensions of the live beams, by cumulative
    log-probability, as transformers' beam search with early_stopping=True: a candidate that
    ends (a stop token, or the last token max_tokens allows) is a finished hypothesis only if
    it ranks among the step's beam_width best; the search ends with beam_width hypotheses.
    repetition_penalty and min_tokens apply to the log-probabilities, as transformers'
    processors do. Decides; changes nothing."""
    params, beams = request.params, request.seqs
    width = params.beam_width
    logprobs = logits.double().log_softmax(-1)                                           # (k, V)
    meta = SamplingMetadata(params=[params] * len(beams), seqs=beams, proposed=[[]] * len(beams),
                            generators=[None] * len(beams), eos_token_ids=set(eos_token_ids),
                            device=logprobs.device)
    for step in LOGITS_STEPS:
        logprobs = step(logprobs, meta)
    cumulative = torch.tensor([seq.cumulative_logprob for seq in beams],
                              dtype=torch.float64, device=logprobs.device)
    scores = logprobs + cumulative[:, None]                                              # (k, V)
    V = scores.shape[1]
    # Enough candidates that width of them survive even if the best ones all end in a stop.
    num_candidates = min(scores.numel(), width * (2 + len(stops)))
    # (score, parent * V + token), best first; ties go to the earlier beam, then the smaller
    # token: every candidate that ties with the last of topk's is in, as topk picks among ties
    scores = scores.flatten()                                                          # (k * V,)
    flat = (scores >= scores.topk(num_candidates).values[-1]).nonzero().squeeze(1)
    step_logprobs = logprobs.flatten()[flat].tolist()  # each candidate's own draw's
    candidates = sorted(zip(scores[flat].tolist(), flat.tolist(), step_logprobs),
                        key=lambda c: (-c[0], c[1]))
    last = beams[0].num_output_tokens + 1 >= params.max_tokens  # beams move in lockstep
    picks, ended, hypotheses = [], [], []
    for rank, (score, flat, logprob) in enumerate(candidates):
        parent, token = divmod(flat, V)
        candidate = BeamCandidate(parent=parent, token=token, logprob=logprob, score=score)
        if (token in stops or last) and rank < width:
            ended.append(candidate)
            hypotheses.append(BeamHypothesis(beams[parent].output_token_ids + [token], score,
                                             "stop" if token in stops else "length"))
        elif token not in stops and not last:
            picks.append(candidate)
        if rank + 1 >= width and (last or len(picks) == width):
            break
    done = not picks or len(request.hypotheses) + len(hypotheses) >= width
    return BeamStep(survivors=picks, ended=ended, hypotheses=hypotheses, done=done)


def request_output(request, detokenizer=None):
    """A snapshot of the request as it stands: finished, or still running with the tokens it
    has so far; with a detokenizer, the text too (a streamed one without what may begin a stop
    string); asked for deltas, what it gained since its last output. Built in a step's commit
    from what the run computed: no tokenizer code runs."""
    params, delta = request.params, request.params.output_kind == "delta"
    first = True  # the request's first output, which a delta's prompt logprobs come with
    if params.beam_width is not None and request.is_finished:
        # rank by length-normalised log-probability, so short hypotheses are not favoured
        best = sorted(request.hypotheses, key=lambda h: -h.cumulative_logprob
                      / len(h.token_ids) ** params.length_penalty)
        outputs = [CompletionOutput(index=i, token_ids=list(h.token_ids),
                                    finish_reason=h.finish_reason,
                                    cumulative_logprob=h.cumulative_logprob, text=h.text,
                                    extras=dict(h.extras) if h.extras else None)
                   for i, h in enumerate(best[:params.beam_width])]
    elif params.beam_width is not None:  # the live beams, best first
        outputs = [CompletionOutput(index=i, token_ids=seq.output_token_ids, finish_reason=None,
                                    cumulative_logprob=seq.cumulative_logprob, text=seq.text,
                                    extras=dict(seq.extras) if seq.extras else None)
                   for i, seq in enumerate(request.seqs)]
    else:
        samples = samples_in_order(request)
        first = not samples[0].num_reported_tokens  # sample 0 reports in the first output
        if delta and request.finished_seqs:  # one finished in an earlier output has nothing new
            samples = [seq for seq in samples if seq.num_output_tokens > seq.num_reported_tokens]
        outputs = [sample_output(seq, params, detokenizer, delta) for seq in samples]
    prompt_logprobs = list(request.prompt_logprobs) if request.prompt_logprobs and first else None
    return RequestOutput(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, outputs=outputs,
        metrics=request.metrics,  # frozen: a later step replaces the request's, not these
        num_preemptions=request.num_preemptions, finished=request.is_finished,
        num_cached_tokens=request.num_cached_tokens, prompt_logprobs=prompt_logprobs)


def sample_output(seq, params, detokenizer=None, delta=False):
    """A sample's CompletionOutput: all it has so far, or (delta) what it gained since its last
    output, which moves its marks: the only change that building an output makes."""
    tokens, chars = (seq.num_reported_tokens, seq.num_reported_chars) if delta else (0, 0)
    text = None if detokenizer is None else detokenizer.visible(seq, params, seq.finish_reason,
                                                                chars)
    out = CompletionOutput(
        index=seq.index, token_ids=seq.token_ids[seq.num_prompt_tokens + tokens:],
        finish_reason=seq.finish_reason, cumulative_logprob=seq.cumulative_logprob,
        logprobs=None if params.logprobs is None else seq.logprobs[tokens:], text=text,
        stop_reason=seq.stop_reason, extras=dict(seq.extras) if seq.extras else None)
    if delta:
        seq.num_reported_tokens += len(out.token_ids)
        seq.num_reported_chars += len(text or "")
    return out


def samples_in_order(request):
    """A request's samples by index, finished or not. The live ones are in order already: a
    fork joins after its parent and the samples before it."""
    if not request.finished_seqs:
        return request.seqs
    return sorted(request.finished_seqs + request.seqs, key=lambda s: s.index)


# -----------------------------------------------------------------------------
# 11. The engine: the step loop and the public API (Orca's iteration-level scheduling)
#
# A step has three phases, and only the last changes a request:
#   1. plan    the scheduler decides what runs and takes the blocks it needs (section 6):
#              every change it makes is journaled (section 2), and is the whole undo
#   2. run     the model runner copies blocks and runs one packed batch (section 8), the
#              proposer guesses (speculative.py), the output processor draws and finds the
#              stops and the text (section 10): all the user's code runs here, and nothing
#              here changes a request, a sequence or a block table
#   3. commit  the output processor appends the tokens, advances what is computed, stops and
#              frees; the engine reports: nothing in it can fail halfway
# A failure in plan or run undoes the plan and propagates: the step leaves every request,
# queue and block as it found them, and the next step computes the same tokens again. One
# exception, as K/V writes cannot be undone: a request that held a block the failed step
# handed out (a preemption in the step gave it away, or the CPU tier took a swapped request's
# CPU blocks) is preempted by recompute; a running one's preemption is counted, outside any
# commit (Engine.rollback).

# Speculative decoding's methods by name: name -> a callable (speculative_config, the target
# model, device) that returns a proposer or raises a ValueError naming the setting that is
# wrong. speculative.py registers "ngram" and "draft" when it is imported; a fork registers its
# own the same way. The engine imports none of them. A proposer has num_speculative_tokens and
# the methods of speculative.Proposer: bytes_per_block, allocate_cache, propose, verify, count.
SPECULATIVE_METHODS = {}


def make_proposer(config, model, device):
    """Engine(speculative_config=config): the proposer of its method, or a ValueError."""
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict with a 'method', got {config!r}")
    method = config.get("method")
    if not isinstance(method, str) or method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not registered: "
                         f"SPECULATIVE_METHODS has {sorted(SPECULATIVE_METHODS)} (`import "
                         f"speculative` registers the built-in ones, 'ngram' and 'draft')")
    return SPECULATIVE_METHODS[method](config, model, device)


class Engine:
    observer = None  # see notify

    def __init__(self, model, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, num_cpu_blocks: int | None = None,
                 preemption_mode="recompute", enable_prefix_caching=True, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, device=None, attention_backend=None,
                 swap_space: float = 4, allocator_cls=None, scheduler_cls=None,
                 scheduling_policy="fcfs", eviction_policy="lru", kv_cache_dtype="auto",
                 speculative_config=None, tokenizer=None, observer=None, prefix_cache_cls=None,
                 cpu_cache_bytes: int = 0, cpu_eviction_policy=None, read_policy="all",
                 read_policy_config=None, connector=None, connector_config=None):
        # connector="cpu" is the CPU tier, which cpu_cache_bytes sizes (its shorthand)
        cpu_cache_bytes = connectors.cpu_cache_bytes(connector, connector_config, cpu_cache_bytes)
        # the annotated settings: an int held as numpy's or torch's is taken as that int
        (block_size, num_blocks, kv_cache_bytes, num_cpu_blocks, max_num_seqs,
         max_num_batched_tokens, swap_space, cpu_cache_bytes) = map(as_int, (
            block_size, num_blocks, kv_cache_bytes, num_cpu_blocks, max_num_seqs,
            max_num_batched_tokens, swap_space, cpu_cache_bytes))
        device, backend, dtype = check_engine_settings(
            model, GPTConfig, device, attention_backend, preemption_mode, enable_prefix_caching,
            swap_space, kv_cache_dtype, choices=dict(
                scheduling_policy=(scheduling_policy, SCHEDULING_POLICIES),
                eviction_policy=(eviction_policy, EVICTION_POLICIES),
                cpu_eviction_policy=(cpu_eviction_policy or eviction_policy, EVICTION_POLICIES),
                read_policy=(read_policy, READ_POLICIES)),
            block_size=block_size, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
            num_cpu_blocks=num_cpu_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, cpu_cache_bytes=cpu_cache_bytes)
        self.model, self.config = model.to(device).eval(), model.config
        self.device, self.block_size = device, block_size
        proposer = None
        if speculative_config is not None:  # a method registered by name: see make_proposer
            proposer = make_proposer(speculative_config, model, device)
        reads = make_read_policy(read_policy, read_policy_config, backend, proposer)  # None: all
        bytes_per_block = block_bytes(model, block_size, dtype, proposer, reads)
        kinds = [group.kind for group in self.config.kv_cache_groups]
        most_blocks = max_num_seqs * sum(kind.max_blocks(
            self.config.max_seq_len, max_num_batched_tokens, block_size) for kind in kinds)
        num_blocks, num_cpu_blocks = pool_sizes(
            device, block_size, bytes_per_block, num_blocks, kv_cache_bytes, most_blocks,
            num_cpu_blocks, swap_space if preemption_mode == "swap" else 0, cpu_cache_bytes)
        # Replaceable parts (vLLM's scheduler_cls): your copy passes its subclass, edits nothing
        # else
        allocator = (allocator_cls or BlockAllocator)(
            num_blocks, block_size, num_cpu_blocks, enable_prefix_caching, eviction_policy,
            prefix_cache_cls=prefix_cache_cls, cpu_cache=cpu_cache_bytes > 0,
            cpu_eviction_policy=cpu_eviction_policy, kinds=kinds)
        self.scheduler = (scheduler_cls or Scheduler)(
            allocator, max_num_seqs, max_num_batched_tokens, preemption_mode,
            scheduling_policy=scheduling_policy,
            num_lookahead_slots=proposer.num_speculative_tokens if proposer else 0)
        self.model_runner = ModelRunner(self.model, num_blocks, num_cpu_blocks, block_size,
                                        backend, device, dtype, reads)
        if connector not in (None, "cpu"):  # the CPU tier is the allocator's own
            allocator.connector = connectors.make_connector(
                connector, connector_config, allocator=allocator, model=self.model,
                block_shape=kv_block_shape(self.config, block_size), dtype=dtype, device=device,
                rank=tp.rank, world_size=tp.world_size, speculative=proposer,
                prefix_caching=enable_prefix_caching,
                # one block of each paged tensor (the K/V, key bounds if kept): (shape, dtype)
                paged_blocks=[(cache[:, :, 0].shape, cache.dtype)
                              for cache, _ in self.model_runner.paged_tensors()])
        self.model_runner.connector = allocator.connector
        self.proposer = proposer and proposer.allocate_cache(num_blocks, num_cpu_blocks,
                                                             block_size, self.model_runner)
        self.kv_cache = self.model_runner.kv_cache  # (2, L, num_blocks, block_size, nkv, hs)
        self.requests = {}  # request_id -> Request, until it finishes or is aborted
        self.request_ids, self.seq_ids = itertools.count(), itertools.count()
        # text and stop strings need a tokenizer: decode(ids) -> str
        self.detokenizer = None if tokenizer is None else Detokenizer(tokenizer)
        self.output_processor = OutputProcessor(self.config, self.scheduler, self.seq_ids, device,
                                                self.detokenizer, self.proposer)
        self.num_steps = 0
        self.observer_error = None  # what an observer raised in the last commit: see commit()
        self.set_observer(observer)

    def set_observer(self, observer):
        """observer(event: dict) hears every change to paging (notify); None: nobody listens."""
        a = self.allocator
        for part in (self, self.scheduler, a, a.prefix_cache, a.swap_pool,
                     a.swap_pool.prefix_cache):
            part.observer = observer

    @property
    def allocator(self):  # one reference, the scheduler's, so no part can hold a stale one
        return self.scheduler.allocator

    def step(self):
        """Run one step: plan, run, commit. Returns a RequestOutput for each request that gained
        tokens in it (.finished says which are done: outputs stream). If anything in plan or run
        raises (the model, sampling, a logits processor, a tokenizer, an observer), rollback()
        undoes the plan and the error propagates; the next step computes the same tokens."""
        if tp.failed:
            raise RuntimeError(f"tensor parallelism was shut down after {tp.failed}; the ranks "
                               "cannot agree on the state any more: start them again")
        self.raise_observer_error()
        self.allocator.journal.open()
        try:
            plan = self.plan()
            result = self.run(plan)
        except BaseException as e:
            self.rollback()
            if tp.world_size > 1:  # every rank learns of it: see tp_shut_down
                tp_shut_down(e)
            raise
        self.allocator.journal.close()
        return self.commit(plan, result)

    def plan(self):
        notify(self, "step", step=self.num_steps)
        plan = self.scheduler.schedule()
        if not (plan.scheduled or plan.preempted) and self.scheduler.has_unfinished():
            raise RuntimeError(stall_message(self))  # nothing outside could unblock it
        return plan

    def run(self, plan):
        if self.observer is not None:
            notify(self, "schedule", **schedule_summary(plan))
        proposals = self.proposer.propose(plan) if self.proposer else {}  # seq_id -> tokens
        chunks = list(step_chunks(plan.scheduled, proposals))  # the batch, in the logits' order
        logits = self.model_runner.execute(plan, chunks)
        return self.output_processor.decide(chunks, logits, proposals)

    def commit(self, plan, result):
        """Apply the run's result and report. An observer that raises here cannot stop the
        commit halfway: its error is raised by the next step() before that step changes
        anything, or by generate() before it returns."""
        observer = self.observer
        if observer is not None:
            self.set_observer(self.deferred(observer))
        try:
            requests = self.output_processor.commit(plan, result)
            outputs = [request_output(request, self.detokenizer) for request in requests
                       if request.is_finished or request.params.output_kind != "final_only"]
            for request in requests:
                if request.is_finished:
                    notify(self, "finished", request=request.request_id)
                    del self.requests[request.request_id]
                    self.allocator.connector.finished(request.request_id)
        finally:
            self.set_observer(observer)
        self.num_steps += 1
        return outputs

    def deferred(self, observer):  # the observer, its first error kept for the next step
        def call(event):
            try:
                observer(event)
            except Exception as e:
                self.observer_error = self.observer_error or e
        return call

    def raise_observer_error(self):
        """Raise what an observer raised while it heard the last commit, if anything."""
        if self.observer_error is not None:
            error, self.observer_error = self.observer_error, None
            raise error

    def rollback(self):
        """Undo a failed step's plan (the allocator's journal). Its writes into the KV cache
        cannot be undone, and they land only in blocks it handed out: a request that held such a
        block before the step (its blocks were taken from it by a preemption in the step, or
        its CPU blocks by the CPU tier) is left preempted by recompute. An observer hears of the
        undo, but cannot stop it."""
        observer = self.observer
        self.set_observer(observer and quiet(observer))
        try:
            taken, cpu_taken = self.allocator.journal.rollback()
            notify(self, "rollback", step=self.num_steps, uncached=sorted(taken),
                   cpu_uncached=sorted(cpu_taken))
            s = self.scheduler
            for queue, written in ((s.running, taken), (s.swapped, cpu_taken)):
                for request in list(queue):  # a copy: requests leave the queue
                    if written & blocks_held(request.seqs):
                        s.preempt_by_recompute(request)
        finally:
            self.set_observer(observer)

    # -- requests -----------------------------------------------------------------------

    def add_request(self, prompt_token_ids, params=None, priority=0):
        """Queue a request; returns its id. step() advances it, abort() drops it."""
        params = params if params is not None else SamplingParams()
        return self._enqueue(self.check_request(prompt_token_ids, params, priority), params,
                             priority)

    def _enqueue(self, prompt_token_ids, params, priority=0):
        request_id = next(self.request_ids)
        seq = Sequence(next(self.seq_ids), prompt_token_ids, len(prompt_token_ids),
                       request_id=request_id)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)  # the first prompt token has nothing before it
        if self.detokenizer is not None:
            self.detokenizer.start(seq)
        self.allocator.prefix_cache.key_blocks(seq)
        notify(self, "add", request=request_id, seq=seq.seq_id, prompt=prompt_token_ids)
        request = Request(request_id, prompt_token_ids, params, seq, as_int(priority))
        if params.beam_width is None and params.temperature > 0:
            # without a seed, a seed drawn from torch's global RNG
            request.seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id):
        """Drop a request wherever it is (waiting, running, swapped); free its blocks."""
        if request_id not in self.requests:
            raise ValueError(f"no unfinished request with id {request_id}")
        notify(self, "abort", request=request_id)
        self.scheduler.abort(self.requests.pop(request_id))
        self.allocator.connector.finished(request_id)

    def check_request(self, prompt, params, priority=0):
        """Raise ValueError saying what is wrong with a request, before it takes any block. A
        prompt is a list or tuple of token ids (ints, numpy's integers, 0-d integer tensors), or
        a 1-D integer tensor or numpy array; returns it as a list of ints."""
        return check_request(prompt, params, priority, self.config, self.scheduler,
                             self.detokenizer is not None)

    def generate(self, prompts, params=None, priority=0):
        """Serve prompts (token id lists or 1-D tensors) to the end; one RequestOutput per
        prompt, in order. params: one SamplingParams for all, or one per prompt; priority too."""
        if not isinstance(params, list):
            params = [params if params is not None else SamplingParams()] * len(prompts)
        priority = priority if isinstance(priority, list) else [priority] * len(prompts)
        if len(params) != len(prompts) or len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts, {len(params)} SamplingParams and "
                             f"{len(priority)} priorities")
        if self.requests:  # their outputs would come out of step() here, with nobody to take them
            raise ValueError(f"generate() needs an idle engine, but {len(self.requests)} requests "
                             "added with add_request() are unfinished: step() them to the end or "
                             "abort() them first")
        checked = []
        for i, (prompt, p, q) in enumerate(zip(prompts, params, priority)):  # reject a bad batch
            try:  # whole, first
                checked.append(self.check_request(prompt, p, q))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        # each request's one output, at its end: nothing is built for the steps between
        final = {id(p): replace(p, output_kind="final_only") for p in params}
        ids = [self._enqueue(prompt, final[id(p)], q)
               for prompt, p, q in zip(checked, params, priority)]
        outputs = {}
        while any(i not in outputs for i in ids):
            outputs.update((o.request_id, o) for o in self.step() if o.finished)
        self.raise_observer_error()
        return [outputs[i] for i in ids]

    def stats(self):
        return engine_stats(self)


# -----------------------------------------------------------------------------
# Appendix: the metrics


def schedule_summary(out):
    """A SchedulerOutput as an observer hears it: each scheduled chunk's sequence, start and
    tokens, and the block copies of each kind (BlockCopies' fields)."""
    return dict(scheduled=[(seq.seq_id, seq.num_computed_tokens,
                            seq.token_ids[seq.num_computed_tokens:][:n])
                           for seq, n in out.scheduled],
                lookahead=[(seq.seq_id, n) for seq, n in out.lookahead],
                copies=asdict(out.copies),
                preempted=[request.request_id for request in out.preempted])


def quiet(observer):  # the observer, its exceptions dropped
    def call(event):
        try:
            observer(event)
        except Exception:
            pass
    return call


def engine_stats(engine):
    """Engine.stats(): the pool, the queues, and what paging saved."""
    a, s, bs = engine.allocator, engine.scheduler, engine.block_size
    running = [seq for r in s.running for seq in r.seqs]
    tables = [(seq, table) for seq in running for table in seq.block_tables]
    filled = {}  # physical block -> token slots holding computed K/V (a shared block counts once)
    for seq, table in tables:
        for i, block_id in enumerate(table):
            in_block = min(bs, seq.num_computed_tokens - i * bs)
            filled[block_id] = max(filled.get(block_id, 0), in_block)
    filled.pop(NO_BLOCK, None)
    num_used = a.num_blocks - a.num_free_blocks
    hits, proposer = a.prefix_cache.counts, engine.proposer
    # the connector's counts (the CPU tier's: its blocks that hold a prefix, free or a
    # swapped-out sequence's), and the blocks copied to it and back
    connector = dict(num_cpu_cached_blocks=0, num_offloaded_blocks=0, num_reloaded_blocks=0,
                     num_staged_blocks=0)  # staged: held for requests in flight
    connector.update(a.connector.stats())
    return dict(
        num_blocks=a.num_blocks, num_free_blocks=a.num_free_blocks,
        kv_cache_dtype=str(engine.kv_cache.dtype).removeprefix("torch."),
        num_cached_blocks=a.prefix_cache.num_evictable,  # free blocks that keep a prefix
        num_cpu_blocks=a.swap_pool.num_blocks, num_free_cpu_blocks=a.swap_pool.num_free_blocks,
        **connector,
        num_running=len(running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
        num_preemptions=s.num_preemptions,
        kv_utilization=sum(filled.values()) / (num_used * bs) if num_used else 0.0,
        # minus the blocks in use: the blocks that sharing saved
        num_logical_blocks=sum(len(table) - table.count(NO_BLOCK) for _, table in tables),
        num_generated_tokens=engine.output_processor.num_generated_tokens,
        num_prompt_tokens=engine.output_processor.num_prompt_tokens,  # vLLM's prompt_tokens_total
        # speculative decoding: tokens proposed, and those the target model drew too
        num_proposed_tokens=proposer.num_proposed_tokens if proposer else 0,
        num_accepted_tokens=proposer.num_accepted_tokens if proposer else 0,
        prefix_cache_hit_tokens=hits.hit_tokens, prefix_cache_queried_tokens=hits.queried_tokens,
        prefix_cache_cpu_hit_tokens=hits.cpu_hit_tokens,
    )


def stall_message(engine):
    s = engine.stats()
    return (f"the engine can make no progress: this step scheduled, preempted and moved "
            f"nothing, while {s['num_waiting']} waiting and {s['num_swapped']} swapped "
            f"requests and {s['num_running']} running sequences are unfinished "
            f"({s['num_free_blocks']} of {s['num_blocks']} KV blocks free)")


if __name__ == "__main__":
    # The demo lives in demo.py, the layer above, which imports this file as `nanopaged`. Run as
    # a script, this file is __main__: registering it as nanopaged too keeps the demo from
    # loading a second copy of every class (and of the tensor-parallel state it sets up).
    sys.modules.setdefault("nanopaged", sys.modules[__name__])
    import demo
    demo.main()

