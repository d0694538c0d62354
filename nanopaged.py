"""
nanopaged: PagedAttention in one file, read top to bottom.

The KV cache of a GPT lives in fixed-size physical blocks; every sequence owns a block
table that maps its logical blocks to physical ones, like pages in virtual memory.
Blocks are reference-counted, so sequences can share them, and a write into a shared
block copies it first (copy-on-write). A continuous-batching scheduler packs as many
sequences onto the device as the blocks allow and preempts when they run out.

    Kwon et al., "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", SOSP 2023.  https://arxiv.org/abs/2309.06180

Sections, in reading order, each built on the ones before it: 1. sequences, requests and
their lifecycle; 2. the block allocator; 3. the prefix cache; 4. the swap pool; 5. the
scheduler; 6. tensor parallelism; 7. the model; 8. the model runner; 9. sampling; 10. output
processing; 11. the engine. An appendix holds the checks of settings and requests, and the
metrics. The attention kernels live in kernel.py, the only file this one imports at load;
checkpoint loading (checkpoints.py), speculative decoding's proposers (speculative.py), text
and stop strings (detokenizer.py) and the demo (demo.py) are each reached by one lazy import
where it is needed.
Run `python nanopaged.py`, or `torchrun --nproc-per-node 2 nanopaged.py
--tensor-parallel-size 2` to split the model and its KV cache across two processes.
"""

import copy
import hashlib
import itertools
import math
import os
import sys
import time
from bisect import insort
from collections import Counter, deque
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from heapq import heappop, heappush
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernel


# -----------------------------------------------------------------------------
# 1. Sequences and requests, and the lifecycle of a request (paper, sections 4.3 to 4.5)
#
# A request is a SequenceGroup of Sequences: one while its prompt is prefilled, then n
# parallel samples or beam_width beams. Every sequence keeps one invariant: its tokens
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
# Recompute frees the blocks and sets num_computed_tokens to 0: the prompt and the tokens
# generated so far are prefilled again (less what the prefix cache still holds). Swap keeps
# num_computed_tokens and moves the blocks to CPU memory and back. A recomputed group of
# several sequences holds back the last token of each: the group advances in lockstep (its
# beams are compared, its samples were forked together), so all its sequences must reach
# their last tokens in the same step, which the scheduler makes one decode step for all.


def cdiv(n, d):
    """n / d rounded up: the blocks that n tokens fill."""
    return -(-n // d)


def blocks_held(seqs):
    """The physical blocks the sequences point at, each once however many share it."""
    return {b for seq in seqs for b in seq.block_table}


def integer(x):  # bool is an int to Python, never to a user
    return isinstance(x, int) and not isinstance(x, bool)


def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def setting(default, allowed, ok, beams=True):
    """A dataclass field and what it allows: ok(value) says whether a value is allowed, allowed
    says which in words, for the ValueError that names the field (check_fields). beams=False: a
    sampling parameter beam search cannot honour, refused beside beam_width."""
    return field(default=default, metadata=dict(allowed=allowed, ok=ok, beams=beams))


def int_setting(default, least, none=False, beams=True):  # an int >= least (or None)
    return setting(default, f"{'None or ' * none}an int >= {least}",
                   lambda x: none and x is None or integer(x) and x >= least, beams)


def check_fields(obj):
    """Every field of a dataclass made with setting(), or a ValueError naming the first one
    whose value its check refuses."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "ok" in f.metadata and not f.metadata["ok"](value):
            raise ValueError(f"{type(obj).__name__}.{f.name} must be {f.metadata['allowed']}, "
                             f"got {value!r}")


def strings(x):  # a non-empty string, or a list of them
    return isinstance(x, str) and x or isinstance(x, (list, tuple)) and all(
        isinstance(s, str) and s for s in x)


@dataclass
class SamplingParams:
    """How a request is sampled: vLLM's names, defaults and ranges. A new parameter is a field
    here, with what it allows, and a step of the sampling pipeline (section 9)."""
    max_tokens: int = int_setting(16, 1)
    temperature: float = setting(1.0, "a number >= 0", lambda x: number(x) and x >= 0)  # 0: greedy
    top_k: int = int_setting(0, 0)  # keep the k likeliest tokens and ties with the k-th; 0: all
    # then of those, renormalised, the smallest set reaching top_p; then those at least min_p
    # times as likely as the likeliest
    top_p: float = setting(1.0, "a number in (0, 1]", lambda x: number(x) and 0 < x <= 1)
    min_p: float = setting(0.0, "a number in [0, 1]", lambda x: number(x) and 0 <= x <= 1,
                           beams=False)
    # over prompt and output, a token's positive logit divided by it, a negative one multiplied
    repetition_penalty: float = setting(1.0, "a number > 0",
                                        lambda x: number(x) and 0 < x < math.inf)
    # over the output: minus presence once per token present, minus frequency times its count
    presence_penalty: float = setting(0.0, "a number in [-2, 2]",
                                      lambda x: number(x) and -2 <= x <= 2, beams=False)
    frequency_penalty: float = setting(0.0, "a number in [-2, 2]",
                                       lambda x: number(x) and -2 <= x <= 2, beams=False)
    # token t of sample i is drawn by a generator seeded by (seed, i, t); None: a random seed
    seed: int | None = setting(None, "None or an int", lambda x: x is None or integer(x))
    n: int = int_setting(1, 1)  # parallel samples of one prompt, sharing its blocks
    beam_width: int | None = int_setting(None, 1, none=True)  # beam search, this many beams
    # beams rank by sum of log-probabilities / length ** length_penalty
    length_penalty: float = setting(1.0, "a number", number)
    # these tokens end a sample (None: none), and these strings, found in its text (a tokenizer
    # decodes it), which is cut before them unless include_stop_str_in_output
    stop_token_ids: list[int] | None = setting(
        None, "None or a list of token ids", lambda x: x is None or isinstance(
            x, (list, tuple)) and all(integer(t) and t >= 0 for t in x))
    stop: str | list[str] | None = setting(None, "None, a string or a list of non-empty strings",
                                           lambda x: x is None or x == [] or strings(x),
                                           beams=False)
    include_stop_str_in_output: bool = setting(False, "True or False",
                                               lambda x: isinstance(x, bool))
    ignore_eos: bool = setting(False, "True or False", lambda x: isinstance(x, bool))
    min_tokens: int = int_setting(0, 0)  # no end token or stop string ends a sample before these
    # per generated token, the k likeliest tokens' log-probabilities and the drawn one's, under
    # the model (before penalties, temperature and filters), as vLLM returns them; and the same
    # for each prompt token after the first
    logprobs: int | None = int_setting(None, 0, none=True, beams=False)
    prompt_logprobs: int | None = int_setting(None, 0, none=True)
    # callables (prompt_token_ids, output_token_ids, logits (V,)) -> logits, run first (vLLM's)
    logits_processors: list | None = setting(
        None, "None or a list of callables", lambda x: x is None or isinstance(
            x, (list, tuple)) and all(map(callable, x)), beams=False)

    def __post_init__(self):
        check_fields(self)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.logits_processors = list(self.logits_processors or [])
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be at most "
                             f"max_tokens ({self.max_tokens})")
        if self.n > 1 and self.beam_width is not None:
            raise ValueError("SamplingParams: choose n > 1 (parallel sampling) or beam_width "
                             "(beam search), not both")
        # beams rank by (penalised) log-probabilities, as transformers' beam search, which
        # draws nothing: temperature, top_k and top_p do not apply to them
        for f in fields(self):
            if (self.beam_width is not None and not f.metadata.get("beams", True)
                    and getattr(self, f.name) not in (f.default, [])):
                raise ValueError(f"SamplingParams.{f.name} does not apply to beam search: leave "
                                 "it unset with beam_width")

    @property
    def num_seqs(self):
        """How many sequences this request can run at once."""
        return self.beam_width or self.n


class Sequence:
    """One token stream: a prompt and what has been generated after it, with its block table."""

    def __init__(self, seq_id, token_ids, num_prompt_tokens, index=0, request_id=None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which sample or beam of its request it is
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache: see the lifecycle above
        self.block_table = []  # physical block ids; device blocks, or CPU blocks while swapped out
        self.block_hashes = []  # prefix-cache keys of its full blocks, computed or being computed
        self.cumulative_logprob = 0.0
        self.logprobs = []  # per generated token {token id: log-probability}, when asked for
        self.prompt_logprobs = []  # when asked for: None, then one per prompt token as computed
        self.finish_reason = None
        self.stop_reason = None  # the stop token id or stop string that ended it (vLLM's)
        self.text = None  # its output decoded so far, when the engine has a tokenizer

    def __len__(self):
        return len(self.token_ids)

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
        """A copy that shares everything generated so far, every field a fork of nanopaged adds
        too; the allocator shares its blocks. The prompt's logprobs stay the parent's."""
        child = copy.copy(self)
        child.seq_id, child.index, child.block_table, child.prompt_logprobs = seq_id, index, [], []
        child.token_ids, child.block_hashes = list(self.token_ids), list(self.block_hashes)
        child.logprobs = list(self.logprobs)
        return child


@dataclass
class RequestMetrics:  # vLLM's; time.perf_counter() seconds, each set where the lifecycle changes
    arrival_time: float  # add_request
    first_scheduled_time: float | None = None  # first admission to running
    first_token_time: float | None = None  # first sampled token
    finished_time: float | None = None  # the last token; None while the request runs
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time


class SequenceGroup:
    """The sequences of one request, scheduled and preempted together: one while the prompt is
    prefilled, then n parallel samples or beam_width beams (vLLM's sequence group)."""

    def __init__(self, request_id, prompt_token_ids, params, seq, priority=0):
        self.request_id, self.params, self.priority = request_id, params, priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.seqs = [seq]  # the live ones
        self.finished = []  # finished samples, or beam hypotheses (token_ids, logprob, reason)
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at the first admission
        self.num_preemptions = 0  # counted in one place: Scheduler._count_preemption
        self.seed = None  # sampled requests: token t of sample i draws from (seed, i, t)
        self.prompt_logprobs = seq.prompt_logprobs  # the same list, filled by the prefill

    @property
    def is_finished(self):
        return not self.seqs

    @property
    def is_decoding(self):  # every live sequence computes just its newest token next
        return all(len(seq) - seq.num_computed_tokens == 1 for seq in self.seqs)

    def admitted(self):  # to running: the first admission ends its time in the queue
        if (m := self.metrics).first_scheduled_time is None:
            m.first_scheduled_time = time.perf_counter()
            m.time_in_queue = m.first_scheduled_time - m.arrival_time
            self.num_cached_tokens = self.seqs[0].num_computed_tokens


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None  # "length" or "stop"; None while the sequence runs
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None = None  # per token, with SamplingParams.logprobs
    text: str | None = None  # decoded, cut at a stop string: with an Engine tokenizer
    stop_reason: int | str | None = None  # the stop token id or string that ended it


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n samples in order, or the beams best first
    metrics: RequestMetrics  # a copy as of this output
    time_to_first_token: float  # seconds from add_request to the first sampled token
    latency: float | None  # seconds from add_request to the last; None until finished
    num_preemptions: int
    finished: bool = True  # step() also returns unfinished requests that gained a token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with prompt_logprobs


# A step is a transaction: it either completes or leaves every object it reached as it found
# it. Rather than undo each change by name, a Transaction keeps each object as it was before
# the step first changed it, all its fields at once, so a field a fork adds is covered too.

CONTAINERS = {list, dict, set, deque}


class Transaction:
    """save(obj) before obj's first change keeps its state: a container's contents, or an
    object's fields (vars()) and the contents of every container among them. rollback() puts
    each field back to the very object it held and refills each container, so objects that
    share a list still share it. Latest saved first, so an earlier snapshot of a shared
    container wins."""

    def __init__(self):
        self.saved = {}  # id(obj) -> (obj, its fields or contents, its containers' contents)

    def save(self, obj):
        if id(obj) not in self.saved:
            state = obj.copy() if type(obj) in CONTAINERS else vars(obj).copy()
            contents = {} if type(obj) in CONTAINERS else \
                {name: value.copy() for name, value in state.items() if type(value) in CONTAINERS}
            self.saved[id(obj)] = (obj, state, contents)
        return obj

    def rollback(self):
        for obj, state, contents in reversed(self.saved.values()):
            if type(obj) in CONTAINERS:
                refill(obj, state)
                continue
            for name in vars(obj).keys() - state.keys():  # fields the step added
                delattr(obj, name)
            for name, value in state.items():  # a reader never finds one missing
                if name in contents:
                    refill(value, contents[name])
                setattr(obj, name, value)
        self.saved = {}


def refill(container, contents):
    container.clear()
    (container.update if isinstance(container, (dict, set)) else container.extend)(contents)


# Each part that changes paging tells an observer what it did, if one listens
# (Engine(observer=...): pagetrace.py records, replays and draws it). Nobody listens by default.

def notify(part, event, **details):
    if part.observer is not None:
        part.observer(dict(event=event, **details))


# -----------------------------------------------------------------------------
# 2. The block allocator. Paper: blocks and block tables (section 4.2), ref counts and
#    copy-on-write (4.4). Later vLLM: its BlockPool; nano-vllm: its BlockManager.
#
# Like an OS handing out page frames, the allocator owns a fixed pool of num_blocks
# physical blocks of block_size token slots each. A sequence's block table lists the
# physical blocks that hold its tokens in order: token t lives in slot t % block_size of
# block block_table[t // block_size]. Blocks are taken one at a time as a sequence grows,
# so a sequence wastes at most the unfilled tail of its last block (paper, section 4.2).


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
    score: float = 0        # its eviction policy's score, when last freed


class BlockAllocator:
    """The pool of physical blocks and the block tables that point into it. A free list, a ref
    count per block; whole sequences are allocated, grown, forked and freed, and a write into a
    shared block copies it first. Free blocks that still hold a cached prefix are the prefix
    cache's to give up (section 3); swapping moves tables to the CPU pool (section 4). Every
    change to a block is journaled, so a step that fails can be undone."""
    observer = None  # see notify

    def __init__(self, num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=True,
                 eviction_policy="lru"):
        for name, value, least in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                                   ("num_cpu_blocks", num_cpu_blocks, 0)):
            if not integer(value) or value < least:
                raise ValueError(f"BlockAllocator: {name} must be an int >= {least}, "
                                 f"got {value!r}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.blocks = [PhysicalBlock(i, freed_at=-i) for i in range(num_blocks)]  # 0 goes first
        self.clock = itertools.count(1)  # stamps freed_at
        self.prefix_cache = PrefixCache(self.blocks, block_size, enable_prefix_caching,
                                        eviction_policy, touch=self.touch)
        self.swap_pool = SwapPool(num_cpu_blocks, self)
        self.begin()
        self._rebuild_free_lists()

    @property
    def num_free_blocks(self):  # blocks that hold nothing, and cached blocks nobody holds
        return len(self.free_block_ids) + self.prefix_cache.num_evictable

    # -- one physical block at a time ---------------------------------------------------

    def _take(self):
        """A free block for one owner: the last freed of those that hold nothing, or, when none
        is left, the cached block the eviction policy gives up."""
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        elif self.prefix_cache.num_evictable:
            block_id = self.prefix_cache.evict()
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block = self.touch(block_id)
        block.ref_count, block.num_hits = 1, 0
        self.taken.add(block_id)
        return block_id

    def _share(self, block_id):
        block = self.touch(block_id)
        if block.ref_count == 0:  # a cached free block comes back to life
            self.prefix_cache.revive(block)
        block.ref_count += 1

    def _release(self, block_id):
        if self.blocks[block_id].ref_count < 1:  # a double free would hand one block to two
            raise RuntimeError(f"block {block_id} released more times than it was taken")
        block = self.touch(block_id)
        block.ref_count -= 1
        if block.ref_count == 0:
            block.freed_at = next(self.clock)
            if block.hash is None:
                self.free_block_ids.append(block_id)
            else:  # it keeps its prefix until the cache gives it up
                self.prefix_cache.retire(block)

    # -- whole sequences ------------------------------------------------------------------

    def num_blocks_to_allocate(self, seq):
        """Free blocks allocate(seq) would take: cache misses, and cache hits now free."""
        hits, _ = self.prefix_cache.lookup(seq)
        return (cdiv(len(seq), self.block_size) - len(hits)
                + sum(self.blocks[b].ref_count == 0 for b in hits))

    def allocate(self, seq):
        """Give a new (or recomputing) sequence a block table covering all its tokens, reusing
        cached prefix blocks. Sets seq.num_computed_tokens to the tokens found in the cache."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        num_taken = self.num_blocks_to_allocate(seq)  # what a fork's override says, too
        if num_taken > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {num_taken} blocks, "
                                   f"{self.num_free_blocks} are free")
        hits, keys = self.prefix_cache.lookup(seq)
        for block_id in hits:  # share before taking, so _take cannot evict a hit
            self._share(block_id)
        num_needed = cdiv(len(seq), self.block_size)
        seq.block_table = hits + [self._take() for _ in range(num_needed - len(hits))]
        seq.block_hashes, seq.num_computed_tokens = keys, len(hits) * self.block_size
        self.prefix_cache.count(seq, hits)
        notify(self, "allocate", seq=seq.seq_id, request=seq.request_id,
               table=list(seq.block_table), hits=len(hits))

    def num_blocks_to_append(self, seqs):
        """Free blocks append_slot needs to give each of seqs a slot for its newest token."""
        num_new, writers = 0, Counter()
        for seq in seqs:
            if len(seq.block_table) * self.block_size < len(seq):
                num_new += 1
            elif self.blocks[seq.block_table[-1]].ref_count > 1:
                writers[seq.block_table[-1]] += 1
        # c writers into a block of count r copy it min(c, r - 1) times: the last writes in place
        return num_new + sum(min(c, self.blocks[b].ref_count - 1) for b, c in writers.items())

    def append_slot(self, seq):
        """Make room for seq's newest token. Returns the (src, dst) block copy that copy-on-write
        needs, for the engine to perform on the KV tensors before the step, or None."""
        if len(seq.block_table) * self.block_size < len(seq):  # last block is full
            seq.block_table.append(self._take())
            notify(self, "append", seq=seq.seq_id, block=seq.block_table[-1])
            return None
        last = seq.block_table[-1]
        if self.blocks[last].ref_count == 1:
            return None
        # Copy-on-write: the block is shared (after a fork), so this writer moves to a private
        # copy and the other owners keep the original (paper, section 4.4).
        new = self._take()
        self._release(last)
        seq.block_table[-1] = new
        notify(self, "cow", seq=seq.seq_id, src=last, dst=new)
        return last, new

    def append_lookahead_slots(self, seq, num_slots):
        """Speculative decoding: room for num_slots proposed tokens after seq's newest, in fresh
        blocks (append_slot already made the newest token's block seq's own, copied on write)."""
        while len(seq.block_table) * self.block_size < len(seq) + num_slots:
            seq.block_table.append(self._take())
            notify(self, "append", seq=seq.seq_id, block=seq.block_table[-1])

    def free_lookahead_slots(self, seq):
        """After verification: give back the blocks past seq's computed tokens, which only
        rejected proposals wrote. Its table covers its computed tokens again, as after any step."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        notify(self, "trim", seq=seq.seq_id, keep=keep)

    def fork(self, parent, child):
        """The child shares every block of the parent: parallel samples and beams start this way."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self._share(block_id)
        notify(self, "fork", seq=child.seq_id, parent=parent.seq_id)

    def free(self, seq):
        """Return every block of a finished, aborted or preempted sequence."""
        # Tail first: the head of a prompt is the likeliest to be shared, so it is evicted last.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        notify(self, "free", seq=seq.seq_id)

    def cache_full_blocks(self, seq, start=0):
        """After a step computed seq's tokens from start on: publish its full blocks the schedule
        could not (kept speculative proposals, or a block whose prefix a twin was caching then,
        evicted since), and give back each block it filled whose prefix another block caches,
        to share that one: every computed full block is cached, one block per prefix."""
        cache = self.prefix_cache
        cache.publish(seq, seq.num_computed_tokens)
        for i in range(start // self.block_size, len(seq.block_hashes)):
            key, block_id = seq.block_hashes[i], seq.block_table[i]
            if key not in cache.hash_to_block:
                cache.publish_block(seq, i)
            elif (twin := cache.find(key, seq, i)) is not None and twin != block_id:
                self._share(twin)
                self._release(block_id)
                seq.block_table[i] = twin
                notify(self, "twin", seq=seq.seq_id, index=i, block=twin)

    # -- a step as a transaction: undo every change since begin() --------------------------

    def begin(self):
        """Start journaling: each block is saved before its first change, the hit counts and
        the swap pool too (the engine calls this at the start of every step, and rollback() if
        the step fails)."""
        self.txn = Transaction()
        self.txn.save(self.prefix_cache.counts)
        self.taken = set()  # blocks handed out since: their slots may be written

    def touch(self, block_id):
        """The block, saved first if this is its first change since begin()."""
        return self.txn.save(self.blocks[block_id])

    def rollback(self):
        """Put every block back as begin() found it, but keep no prefix in a block handed out
        since: its slots may hold writes of the failed step. Returns the blocks handed out."""
        taken = self.taken
        self.txn.rollback()
        for block_id in taken:
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, ()
        self._rebuild_free_lists()
        self.begin()
        return taken

    def _rebuild_free_lists(self):  # from the blocks alone
        free = sorted((b for b in self.blocks if b.ref_count == 0), key=lambda b: b.freed_at)
        self.free_block_ids = [b.block_id for b in free if b.hash is None]  # last freed on top
        self.prefix_cache.rebuild()


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
# recently freed
EVICTION_POLICIES = {"lru": lambda block: 0,  # all tie: least recently used first
                     "lfu": lambda block: block.num_hits}  # fewest prefix-cache hits first


@dataclass
class HitCounts:  # the hit rate is hit_tokens / queried_tokens
    queried_tokens: int = 0  # prompt tokens of sequences allocated with caching on
    hit_tokens: int = 0  # of those, the tokens found in the cache


class PrefixCache:
    """Published blocks by key, the free ones among them by eviction order, and hit counts.
    touch(block_id) returns a block about to change (the allocator's journal)."""
    observer = None  # see notify

    def __init__(self, blocks, block_size, enabled=True, eviction_policy="lru", touch=None):
        self.blocks, self.block_size, self.enabled = blocks, block_size, enabled
        self.score = EVICTION_POLICIES[eviction_policy]
        self.touch = touch or blocks.__getitem__
        self.hash_to_block = {}
        self.evictable = {}  # cached free block -> its entry in heap (other entries are stale)
        self.heap = []  # (score, freed_at, block_id), smallest first
        self.counts = HitCounts()

    @property
    def num_evictable(self):
        return len(self.evictable)

    def lookup(self, seq):
        """The blocks holding the longest cached run of seq's full leading blocks, and their
        keys."""
        hits, keys, bs = [], [], self.block_size
        # A cached block has no logits: a sequence still owed prompt logprobs computes its whole
        # prompt (as vLLM does), and publishes its blocks for others as usual.
        if not self.enabled or seq.prompt_logprob_positions(0, len(seq)):
            return hits, keys
        # The last token is always computed again, because sampling needs its logits; so its
        # block is never taken from the cache and never written while shared.
        for i in range((len(seq) - 1) // bs):
            key = chain_hash(keys[-1] if keys else None, seq.token_ids[i * bs:(i + 1) * bs])
            if (block_id := self.find(key, seq, i)) is None:
                break
            hits.append(block_id)
            keys.append(key)
        return hits, keys

    def count(self, seq, hits):
        """A sequence was allocated on these hits: count them for the hit rate and the policy."""
        if not self.enabled:
            return
        for block_id in hits:
            self.touch(block_id).num_hits += 1
        self.counts.queried_tokens += len(seq)
        self.counts.hit_tokens += len(hits) * self.block_size

    def find(self, key, seq, i):
        """The cached block that holds seq's block i under key, or None. Under SHA-256 keys the
        key would do; its tokens and place are compared too, so that were every key to collide,
        no block would be shared at another place (other prefixes are SHA-256's to tell apart)."""
        block_id, bs = self.hash_to_block.get(key), self.block_size
        if block_id is None:
            return None
        block = self.blocks[block_id]
        held = block.token_ids == tuple(seq.token_ids[i * bs:(i + 1) * bs])
        return block_id if held and block.logical_index == i else None

    def publish(self, seq, num_tokens, again=False):
        """Key seq's full blocks among its first num_tokens and publish each whose key no
        block holds yet (a twin computed alongside stays private to its sequence). again: its
        keyed blocks too, which are fresh copies (swapped in)."""
        if not self.enabled:
            return
        bs = self.block_size
        for i in range(0 if again else len(seq.block_hashes), num_tokens // bs):
            if i == len(seq.block_hashes):
                seq.block_hashes.append(chain_hash(seq.block_hashes[-1] if i else None,
                                                   seq.token_ids[i * bs:(i + 1) * bs]))
            if seq.block_hashes[i] not in self.hash_to_block:
                self.publish_block(seq, i)

    def publish_block(self, seq, i):
        """Cache seq's block i under its key."""
        block, bs = self.touch(seq.block_table[i]), self.block_size
        block.hash, block.logical_index = seq.block_hashes[i], i
        block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
        self.hash_to_block[block.hash] = block.block_id
        notify(self, "publish", block=block.block_id, index=i, tokens=list(block.token_ids))

    def revive(self, block):  # a hit on a cached block nobody held
        del self.evictable[block.block_id]

    def retire(self, block):  # a cached block nobody holds any more
        block.score = self.score(block)  # a policy may read freed_at
        self.evictable[block.block_id] = entry = (block.score, block.freed_at, block.block_id)
        heappush(self.heap, entry)
        if len(self.heap) > 2 * len(self.blocks):  # mostly stale entries
            self.heap = sorted(self.evictable.values())  # a sorted list is a heap

    def evict(self):
        """The cached free block the policy gives up, its prefix forgotten."""
        while self.evictable.get((entry := heappop(self.heap))[-1]) != entry:
            pass  # stale: that block was hit since it was freed
        block = self.touch(entry[-1])
        del self.evictable[block.block_id], self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
        notify(self, "evict", block=block.block_id)
        return block.block_id

    def rebuild(self):  # the index and the eviction order, from the blocks alone
        cached = [b for b in self.blocks if b.hash is not None]
        self.hash_to_block = {b.hash: b.block_id for b in cached}
        self.evictable = {b.block_id: (b.score, b.freed_at, b.block_id) for b in cached
                          if b.ref_count == 0}
        self.heap = sorted(self.evictable.values())


# -----------------------------------------------------------------------------
# 4. The swap pool (paper, section 4.5): CPU blocks for sequences preempted by swap, and
#    the moves between the pools


class SwapPool:
    """A second pool of blocks, in CPU memory, with a free list and ref counts as the device pool
    has and no cache; and the moves of whole sequences between the two pools. A block the
    sequences share maps to one block on the other side, so sharing survives a swap."""
    observer = None  # see notify

    def __init__(self, num_blocks, allocator):
        self.allocator = allocator  # the device pool's
        self.ref_count = [0] * num_blocks
        self.free_block_ids = deque(range(num_blocks))

    @property
    def num_blocks(self):
        return len(self.ref_count)

    @property
    def num_free_blocks(self):
        return len(self.free_block_ids)

    def can_swap_out(self, seqs):
        return len(blocks_held(seqs)) <= self.num_free_blocks

    def swap_out(self, seqs):
        """Move seqs' blocks to this pool; returns the (device, cpu block) copies to make."""
        if not self.can_swap_out(seqs):
            raise OutOfBlocksError("the CPU swap space cannot hold these sequences")
        self.allocator.txn.save(self)
        copies = self._move(seqs, lambda _: self._take(), self._share, self.allocator._release)
        for seq in seqs:
            notify(self, "swap_out", seq=seq.seq_id, table=list(seq.block_table))
        return copies

    def _still_cached(self, seqs):
        """CPU block -> the device block that still holds its prefix in the cache: swapping in
        shares it instead of copying."""
        kept = {}
        for seq in seqs:
            for i, key in enumerate(seq.block_hashes):  # its full computed blocks
                if (block_id := self.allocator.prefix_cache.find(key, seq, i)) is not None:
                    kept.setdefault(seq.block_table[i], block_id)
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
        """Bring swapped-out seqs back; returns the (cpu block, device block) copies to perform,
        which land before the step runs. Their fresh blocks are published again."""
        a, kept = self.allocator, self._still_cached(seqs)
        if not self.can_swap_in(seqs, kept):
            raise OutOfBlocksError("not enough free device blocks to swap these sequences in")
        a.txn.save(self)

        def take(cpu_block):
            if cpu_block in kept:
                a._share(kept[cpu_block])
                return kept[cpu_block]
            return a._take()
        pinned = set(kept.values())
        for block_id in pinned:  # held while fresh blocks are taken, so none of them is evicted
            a._share(block_id)
        copies = self._move(seqs, take, a._share, self._release)
        for block_id in pinned:
            a._release(block_id)
        for seq in seqs:
            notify(self, "swap_in", seq=seq.seq_id, table=list(seq.block_table))
            a.prefix_cache.publish(seq, len(seq.block_hashes) * a.block_size, again=True)
        return [(src, dst) for src, dst in copies if src not in kept]

    @staticmethod
    def _move(seqs, take, share, release):
        mapping = {}  # block on this side -> block on the other
        for seq in seqs:
            for i, src in enumerate(seq.block_table):
                if src in mapping:
                    share(mapping[src])
                else:
                    mapping[src] = take(src)
                release(src)
                seq.block_table[i] = mapping[src]
        return list(mapping.items())

    def free(self, seq):
        """Return the CPU blocks of a swapped-out sequence (aborted, or to be recomputed)."""
        self.allocator.txn.save(self)
        for block_id in seq.block_table:
            self._release(block_id)
        seq.block_table = []
        notify(self, "free", seq=seq.seq_id)

    def _take(self):
        block_id = self.free_block_ids.popleft()
        self.ref_count[block_id] = 1
        return block_id

    def _share(self, block_id):
        self.ref_count[block_id] += 1

    def _release(self, block_id):
        if self.ref_count[block_id] < 1:
            raise RuntimeError(f"cpu block {block_id} released more times than it was taken")
        self.ref_count[block_id] -= 1
        if self.ref_count[block_id] == 0:
            self.free_block_ids.append(block_id)


# -----------------------------------------------------------------------------
# 5. The scheduler: continuous batching in a policy's order, one step at a time. Orca:
#    iteration-level scheduling. Paper: preemption by recompute or swap (section 4.5).
#    Later vLLM: chunked prefill, the admission watermark, priority scheduling.
#
# Every step re-decides which sequences run (Orca's iteration-level scheduling): finished
# requests leave at once and waiting ones take their blocks. A step is a token budget shared
# by decodes (one token per sequence) and prefill chunks (many tokens of one prompt), so a
# long prompt is prefilled over several steps without stalling running decodes. When a
# decode finds no free block, the running request that comes last is preempted (paper, 4.5).

SCHEDULING_POLICIES = {  # the order: a SequenceGroup's key (fixed while queued), smaller first
    "fcfs": lambda group: group.request_id,  # first come, first served: ids count arrivals
    "priority": lambda group: (group.priority, group.request_id),  # vLLM's: lower first
}


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)  # (seq, num_new_tokens) in batch order
    blocks_to_swap_out: list = field(default_factory=list)  # (device block, cpu block)
    blocks_to_swap_in: list = field(default_factory=list)  # (cpu block, device block)
    blocks_to_copy: list = field(default_factory=list)  # (src, dst) device blocks, copy-on-write
    preempted: list = field(default_factory=list)  # groups preempted this step
    lookahead: list = field(default_factory=list)  # (seq, slots) for proposals: see speculative
    num_batched_tokens: int = 0


class Scheduler:
    observer = None  # see notify

    def __init__(self, allocator, max_num_seqs, max_num_batched_tokens, preemption_mode="recompute",
                 watermark=0.01, scheduling_policy="fcfs", num_lookahead_slots=0):
        self.allocator, self.key = allocator, SCHEDULING_POLICIES[scheduling_policy]
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.num_lookahead_slots = num_lookahead_slots  # proposals per sequence, when speculating
        # Admission keeps a few blocks spare, so a request just let in is not preempted by the
        # next decode step (vLLM's watermark, 1% of the pool).
        self.watermark_blocks = max(1, round(watermark * allocator.num_blocks))
        # Each queue is ordered by the policy's key, first first; nobody overtakes in its queue.
        self.waiting = deque()  # new, or preempted by recompute and waiting to prefill again
        self.running = []  # holding device blocks
        self.swapped = []  # preempted by swap, blocks in the CPU pool
        self.num_preemptions = 0

    def add(self, group):  # into its queue by the key, after its equals
        insort(self.waiting, group, key=self.key)

    def has_unfinished(self):
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self):
        """This step's tokens and block moves, in four phases: 1. decodes of running groups,
        first first (preempting when blocks run out); 2. swapped-out groups come back; 3. prefill
        chunks of running groups; 4. waiting groups are admitted while blocks, sequence slots
        and the token budget allow. Then, speculating, lookahead slots from what is left."""
        out = SchedulerOutput()
        self._schedule_decodes(out)
        num_seqs = sum(g.params.num_seqs for g in self.running)  # room held for all samples of each
        num_seqs = self._swap_in(out, num_seqs)
        for group in self.running:
            if not group.is_decoding:
                self._schedule_prefill(group, out)
        self._admit(out, num_seqs)
        if self.num_lookahead_slots:
            self._reserve_lookahead(out)
        return out

    def _schedule_decodes(self, out):
        # A group whose next tokens need blocks that are not free preempts the last running
        # group, possibly itself.
        i = 0
        while i < len(self.running):
            group = self.running[i]
            if not group.is_decoding or self._over_budget(out, len(group.seqs)):
                i += 1
                continue
            while self.allocator.num_blocks_to_append(group.seqs) > self.allocator.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                self._append_slots(group, out)
                i += 1

    def _swap_in(self, out, num_seqs):
        # First first, unless this step had to preempt or a waiting group comes before them.
        while self.swapped and not out.preempted and not self._ahead(self.waiting, self.swapped):
            group = self.swapped[0]
            # + one block per next token
            need = self.allocator.swap_pool.num_blocks_to_swap_in(group.seqs) + len(group.seqs)
            if (not self._fits(need) or num_seqs + group.params.num_seqs > self.max_num_seqs
                    or self._over_budget(out, len(group.seqs))):
                if not self.running:  # nothing will free blocks for it: recompute, not wait forever
                    self.swapped.pop(0)
                    self._recompute(group)
                break
            self.swapped.pop(0)
            num_seqs += group.params.num_seqs
            out.blocks_to_swap_in += self.allocator.swap_pool.swap_in(group.seqs)
            insort(self.running, group, key=self.key)
            notify(self, "resume", request=group.request_id)
            if group.is_decoding:
                self._append_slots(group, out)
        return num_seqs

    def _admit(self, out, num_seqs):
        # None while a swapped-out group comes before them, and none in a step that had to
        # preempt, which would only preempt again.
        while (self.waiting and not out.preempted and not self._ahead(self.swapped, self.waiting)
               and out.num_batched_tokens < self.max_num_batched_tokens):
            group = self.waiting[0]
            need = sum(self.allocator.num_blocks_to_allocate(seq) for seq in group.seqs)
            if not self._fits(need) or num_seqs + group.params.num_seqs > self.max_num_seqs:
                break  # nobody overtakes the first waiting request
            num_seqs += group.params.num_seqs
            self.waiting.popleft()
            notify(self, "admit", request=group.request_id)
            for seq in group.seqs:
                self.allocator.allocate(seq)
            group.admitted()
            insort(self.running, group, key=self.key)
            if not group.is_decoding:
                self._schedule_prefill(group, out)
            elif not self._over_budget(out, len(group.seqs)):
                self._append_slots(group, out)  # recomputed samples, all but the last tokens cached

    def _ahead(self, queue, other):  # whether queue's first group comes before other's
        return bool(queue) and self.key(queue[0]) < self.key(other[0])

    def _over_budget(self, out, num_tokens):
        return out.num_batched_tokens + num_tokens > self.max_num_batched_tokens

    def _fits(self, num_blocks):
        # Alone on the device, a group needs no watermark: there is nobody left to preempt.
        spare = self.watermark_blocks if self.running else 0
        return num_blocks + spare <= self.allocator.num_free_blocks

    def _schedule(self, seq, num_new, out):
        """seq computes num_new more tokens this step. The blocks they fill are published now,
        so a request admitted after it in this step can hit them (section 3)."""
        out.scheduled.append((seq, num_new))
        out.num_batched_tokens += num_new
        self.allocator.prefix_cache.publish(seq, seq.num_computed_tokens + num_new)

    def _append_slots(self, group, out):
        for seq in group.seqs:
            copy = self.allocator.append_slot(seq)
            if copy:
                out.blocks_to_copy.append(copy)
            self._schedule(seq, 1, out)

    def _schedule_prefill(self, group, out):
        # Samples or beams being recomputed stop one token short: their last tokens go together
        # as one decode step, so the group gets all its next-token logits at once (section 1).
        hold_back = 1 if len(group.seqs) > 1 else 0
        for seq in group.seqs:
            num_new = min(len(seq) - hold_back - seq.num_computed_tokens,
                          self.max_num_batched_tokens - out.num_batched_tokens)
            if num_new > 0:
                self._schedule(seq, num_new, out)

    def _reserve_lookahead(self, out):
        """Speculative decoding: slots for up to num_lookahead_slots proposed tokens after each
        sequence whose last token runs this step (a prompt's first token is sampled plainly),
        from the token budget and free blocks the step left, so speculation never preempts nor
        holds back what plain decoding would run; and never past max_tokens."""
        a = self.allocator
        last = {seq.seq_id for seq, n in out.scheduled if seq.num_computed_tokens + n == len(seq)}
        for group in self.running:
            for seq in group.seqs:
                if seq.seq_id not in last or not seq.num_output_tokens:
                    continue
                room = (len(seq.block_table) + a.num_free_blocks) * a.block_size - len(seq)
                slots = min(self.num_lookahead_slots, room,
                            group.params.max_tokens - seq.num_output_tokens - 1,
                            self.max_num_batched_tokens - out.num_batched_tokens)
                if slots > 0:
                    a.append_lookahead_slots(seq, slots)
                    out.lookahead.append((seq, slots))
                    out.num_batched_tokens += slots

    def _preempt(self, group, out):
        """Take a running group's blocks: swap them out in swap mode (while the swap space holds
        them), else free them to be recomputed."""
        out.preempted.append(group)
        if self.preemption_mode == "swap" and self.allocator.swap_pool.can_swap_out(group.seqs):
            out.blocks_to_swap_out += self.allocator.swap_pool.swap_out(group.seqs)
            insort(self.swapped, group, key=self.key)
            self._count_preemption(group, "swap")
        else:
            self.preempt_by_recompute(group)

    def preempt_by_recompute(self, group):
        """Free a running group's blocks and send it back to the waiting queue."""
        for seq in group.seqs:
            self.allocator.free(seq)
        self._recompute(group)
        self._count_preemption(group, "recompute")

    def _count_preemption(self, group, mode):  # the one place preemptions are counted
        group.num_preemptions += 1
        self.num_preemptions += 1
        notify(self, "preempt", request=group.request_id, mode=mode)

    def _recompute(self, group):
        for seq in group.seqs:
            if seq.block_table:  # still in the CPU pool
                self.allocator.swap_pool.free(seq)
            seq.num_computed_tokens, seq.block_hashes = 0, []  # published again once computed
        self.add(group)  # under FCFS to the front: it arrived before everything still waiting

    def abort(self, group):
        """Drop a group wherever it is and return all its blocks."""
        if group in self.swapped:
            self.swapped.remove(group)
            for seq in group.seqs:
                self.allocator.swap_pool.free(seq)
        else:  # a waiting group holds no blocks: freeing its sequences returns nothing
            (self.running if group in self.running else self.waiting).remove(group)
            for seq in group.seqs:
                self.allocator.free(seq)
        group.seqs = []

    def remove_finished(self):
        self.running = [g for g in self.running if not g.is_finished]


# -----------------------------------------------------------------------------
# 6. Tensor parallelism: Megatron-LM's split of each layer across ranks (paper, section 4.6)
#
# Under torchrun, each of tensor_parallel_size ranks holds a slice of every attention and MLP
# layer. A column-parallel layer (c_attn, c_fc, c_gate) keeps its rows of the weight: its query
# heads, K/V heads or MLP columns. The row-parallel c_proj after it keeps the matching input
# columns, so its output is a partial sum that one all-reduce completes. Embeddings, norms and
# the LM head are replicated, and each rank caches the K/V of its own heads only.
# (Shoeybi et al., "Megatron-LM", 2019, section 3.)

# This process's place in the group (1 without torchrun), and why the group was shut down, if it
# was. Every layer below reads it when it is built: init_tensor_parallel first, then the model.
tp = SimpleNamespace(rank=0, world_size=1, failed=None)
# The weight dim each layer splits along: 0, output rows (column-parallel); 1, input columns
# (row-parallel). c_attn is fused [q | k | v]: each of the three splits on its own.
TP_SPLIT_DIM = {"attn.c_attn": 0, "mlp.c_fc": 0, "mlp.c_gate": 0, "attn.c_proj": 1, "mlp.c_proj": 1}


def init_tensor_parallel(tensor_parallel_size, timeout_s=300, device=None):
    """Join the group torchrun launched: NCCL when the engines will run on GPUs (device, by default
    cuda where there is one), gloo on CPUs. Models built after this hold this rank's slice of
    each layer, and Engines the K/V of its heads."""
    size, launched = tensor_parallel_size, os.environ.get("WORLD_SIZE")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if launched is None and size > 1:
        raise ValueError(f"tensor_parallel_size={size} needs one process per rank: launch with "
                         f"torchrun --nproc-per-node {size} (RANK and WORLD_SIZE are not set)")
    if int(launched or 1) != size:
        raise ValueError(f"tensor_parallel_size={size} but torchrun launched {launched} "
                         f"processes: give torchrun --nproc-per-node {size}, or "
                         f"tensor_parallel_size={launched}")
    if size == 1:
        return
    if not dist.is_initialized():
        device_type = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # The timeout bounds every collective: when a rank dies, the others raise, not hang.
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    tp.rank, tp.world_size, tp.failed = dist.get_rank(), dist.get_world_size(), None


def all_reduce(x):
    """Complete a row-parallel layer's partial sums; every rank gets the same bits."""
    if tp.world_size > 1:
        dist.all_reduce(x)
    return x


def tp_min(n, device):
    """The least of the ranks' n: pools sized from each rank's own free memory would differ, and
    ranks with other block counts schedule differently (as vLLM, every rank takes the minimum)."""
    if tp.world_size == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def tp_shut_down(error):
    """After a step failed on this rank: close its connections, so a rank blocked in a collective
    with it fails at once instead of waiting out the timeout (gloo; on NCCL it waits)."""
    tp.failed = f"a step failed on rank {tp.rank}: {error!r}"
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(x):
    """Rank 0's x on every rank: rank 0 decides, the others follow."""
    if tp.world_size > 1:
        dist.broadcast(x, src=0)
    return x


def tp_split_dim(name):
    """The dim along which the whole-model tensor `name` splits; None: each rank holds it all."""
    layer, kind = name.rsplit(".", 1)
    dim = TP_SPLIT_DIM.get(".".join(layer.split(".")[-2:]))  # h.3.attn.c_attn -> attn.c_attn
    return None if tp.world_size == 1 or kind == "bias" and dim == 1 else dim


def tp_shard(name, tensor, config):
    """This rank's slice of one whole-model tensor. Loading calls it as it reads each tensor,
    so no rank ever holds the whole model on its device."""
    dim = tp_split_dim(name)
    if dim is None:  # replicated; but a row-parallel bias must enter the all-reduce's sum once
        row_bias = tp.world_size > 1 and name.endswith("c_proj.bias")
        return tensor * (tp.rank == 0) if row_bias else tensor
    parts = tensor.split(config.qkv_widths) if ".c_attn." in name else [tensor]
    return torch.cat([part.chunk(tp.world_size, dim)[tp.rank] for part in parts], dim)


# -----------------------------------------------------------------------------
# 7. The model: one GPT for GPT-2 and the Llama family (Llama, Mistral, Qwen2), told apart by
#    a few config switches as in litgpt. Paper: PagedAttention (section 4.1), where the
#    kernel meets the block table, in CausalSelfAttention.forward.


# Activations by Hugging Face's names (GPT-2's activation_function, Llama's hidden_act): GPT-2's
# gelu_new is the tanh approximation of GELU, "gelu" the exact one
ACTIVATIONS = dict(gelu=F.gelu, relu=F.relu, silu=F.silu,
                   gelu_new=lambda x: F.gelu(x, approximate="tanh"))
ACTIVATIONS["gelu_pytorch_tanh"] = ACTIVATIONS["gelu_new"]
LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names for a layer's attention


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
    # Mistral's sliding window: a windowed layer's token at position p sees keys p - W < k <= p
    # (transformers' rule), the last W positions; None: every layer sees the whole context
    sliding_window: int | None = None
    # per layer "sliding_attention" (the window) or "full_attention", transformers' layer_types;
    # None: every layer windowed if sliding_window is set (Mistral), else none
    layer_types: list[str] | None = None

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
        self.check_windows()

    def check_windows(self):
        window, kinds = self.sliding_window, self.layer_types
        if window is not None and (type(window) is not int or window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {window!r}")
        if kinds is None:
            kinds = ["full_attention" if window is None else "sliding_attention"] * self.n_layer
        if (not isinstance(kinds, (list, tuple)) or len(kinds) != self.n_layer
                or any(kind not in LAYER_TYPES for kind in kinds)):
            raise ValueError(f"layer_types must list {self.n_layer} (n_layer) of {LAYER_TYPES}, "
                             f"got {kinds!r}")
        if window is None and "sliding_attention" in kinds:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        self.layer_types = list(kinds)

    @property
    def windows(self):
        """Each layer's sliding window, or None where it sees the whole context."""
        return [self.sliding_window if kind == "sliding_attention" else None
                for kind in self.layer_types]

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


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism): see TP_SPLIT_DIM
        self.n_head = config.n_head // tp.world_size
        self.n_kv_head = config.n_kv_head // tp.world_size
        self.head_dim, self.scale = config.head_dim, config.attn_scale
        self.window = config.windows[layer]  # a sliding window, or None: the whole context
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
            mask = None
            if self.window is not None:  # causal, and the last window positions only
                pos = torch.arange(q.shape[2], device=q.device)
                mask = (pos <= pos[:, None]) & (pos > pos[:, None] - self.window)       # (T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=True)
            return all_reduce(self.c_proj(y.transpose(1, 2).flatten(2)))
        # paged (T, C): first write the new K/V into their slots, then every new token attends
        # to its sequence's context (its window's, in a windowed layer), gathered block by block
        # through the block table, by the attention backend the engine chose
        # (kernel.ATTENTION_BACKENDS; only windowed layers pass a window, so a backend without
        # windows still serves every model that has none)
        k_cache, v_cache, scales = kv_cache                   # (num_blocks, block_size, nkv, hs)
        batch.attention.store(k, v, k_cache, v_cache, batch.slot_mapping, **scales)
        window = {} if self.window is None else {"window": self.window}
        y = batch.attention.attend(q, k_cache, v_cache, batch, self.scale, **window,
                                   **scales)                                        # (T, nh, hs)
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

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)  # GPT-2's initializer_range
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, batch=None, kv_cache=None):
        """Contiguous: idx (B, T) -> logits (B, T, V). Paged: idx (T,) packed, batch and
        kv_cache (2, n_layer, num_blocks, block_size, nkv, hs) given -> logits (R, V) at
        batch.logits_indices."""
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
            kv = None if batch is None else (kv_cache[0, i], kv_cache[1, i], batch.kv_scales[i])
            x = block(x, batch, kv, rope)  # kv: this layer's K and V caches and their scales
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
        import checkpoints  # the layer above this one: it imports nanopaged for GPT's parts
        return checkpoints.load_pretrained(cls, path, dtype, device).eval()


# -----------------------------------------------------------------------------
# 8. The model runner: the scheduler's decision becomes block copies and one packed batch
#
# The worker of the paper's system overview (section 4): it owns the model and the KV
# cache, performs the swaps and copy-on-write copies the scheduler ordered, then runs every
# scheduled token of every sequence as one varlen batch through the attention backend.


def kv_block_shape(config, block_size):
    """One KV block on this rank: K and V of every layer, for this rank's own K/V heads (see
    tensor parallelism above)."""
    return (2, config.n_layer, block_size, config.n_kv_head // tp.world_size, config.head_dim)


def pool_sizes(config, device, block_size, bytes_per_block, num_blocks, kv_cache_bytes,
               max_num_seqs, num_cpu_blocks, swap_space):
    """The blocks of the device pool and of the CPU swap pool. The device pool is sized like
    vLLM's: by a byte budget, by default 90% of free GPU memory (but no more than max_num_seqs
    full-length sequences use); the swap pool by swap_space GiB (vLLM's), or the device pool's
    size if smaller: more rarely helps, as a group that finds it full is recomputed instead.
    Each rank holds its own K/V heads: one budget makes tp times the blocks, and every rank
    takes the least."""
    if num_blocks is None:
        if kv_cache_bytes is None:
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 30
            most = bytes_per_block * max_num_seqs * cdiv(config.max_seq_len, block_size)
            kv_cache_bytes = min(int(0.9 * free), most)
        num_blocks = kv_cache_bytes // bytes_per_block
    num_blocks = tp_min(num_blocks, device)
    if num_blocks < 1:  # only a budget can come to this; and then it does on every rank
        raise ValueError(f"Engine: kv_cache_bytes={kv_cache_bytes} is smaller than one KV "
                         f"block ({bytes_per_block} bytes at block_size={block_size})")
    if num_cpu_blocks is None:
        num_cpu_blocks = min(num_blocks, int(swap_space * 2**30) // bytes_per_block)
    return num_blocks, tp_min(num_cpu_blocks, device)


@dataclass
class Batch:
    """One engine step, packed: the new tokens of every scheduled sequence, back to back."""
    input_ids: torch.Tensor       # (T,) int64, T = total new tokens this step
    positions: torch.Tensor       # (T,) int64, position of each token in its sequence
    slot_mapping: torch.Tensor    # (T,) int64, physical KV slot each new token is written to
    block_tables: torch.Tensor    # (S, max_blocks) int32, -1 past each sequence's last block
    seq_lens: torch.Tensor        # (S,) int32, context length including the new tokens
    cu_seqlens_q: torch.Tensor    # (S+1,) int32, sequence i's new tokens are [cu[i], cu[i+1])
    max_q_len: int                # longest run of new tokens, so the kernel needs no host sync
    logits_indices: torch.Tensor  # (R,) int64, rows whose next-token logits we need
    attention: kernel.AttentionBackend  # how every layer stores and reads K/V
    kv_scales: list               # per layer: {} or an 8-bit cache's {k_scale, v_scale} (kernel.py)
    scratch: dict = field(default_factory=dict)  # the backend's, shared by the step's layers


class ModelRunner:

    def __init__(self, model, num_blocks, num_cpu_blocks, block_size, attention, device, dtype):
        self.model, self.block_size, self.device = model, block_size, device
        self.attention = attention  # a kernel.AttentionBackend
        shape = kv_block_shape(model.config, block_size)  # (2, n_layer, block_size, nkv, hs)
        # The KV cache is one tensor, so a block copy (copy-on-write, swap) is one indexing op
        # for all layers.
        self.kv_cache = torch.zeros(*shape[:2], num_blocks, *shape[2:], dtype=dtype, device=device)
        # The swap space is block-major and pinned, so each block moves by one direct
        # non_blocking copy (DMA) that does not stall the host; it runs on the step's stream,
        # before the forward.
        self.cpu_kv_cache = torch.zeros(num_cpu_blocks, *shape, dtype=dtype,
                                        pin_memory=device.type == "cuda")
        # per layer, an 8-bit cache's scales, fixed here once (kernel.py says how and why)
        self.kv_scales = calibrate_kv_scales(model, shape, dtype)  # [{k_scale, v_scale}]

    def execute(self, out, proposals={}):
        """Copy the blocks out orders, then run its scheduled tokens, each sequence's proposals
        after them (speculative decoding). Returns the logits (R, V) after each sequence whose
        last token is now computed, and after each of its proposals; or None if nothing runs."""
        self.copy_blocks(out)
        if not out.scheduled:
            return None
        return self.forward(step_chunks(out.scheduled, proposals))

    def forward(self, chunks, prompt_logprobs=True):
        batch = self.prepare(chunks, prompt_logprobs)
        with torch.inference_mode():
            return self.model(batch.input_ids, batch, self.kv_cache)  # (R, V)

    def copy_blocks(self, out):
        # Order matters: blocks swapped out may be handed to others this very step, and
        # copy-on-write may copy a block that was just swapped in.
        if out.blocks_to_swap_out:
            src, dst = zip(*out.blocks_to_swap_out)
            staged = self.kv_cache[:, :, list(src)].movedim(2, 0).contiguous()  # (n, 2, L, ...)
            for block, cpu_block in zip(staged, dst):
                self.cpu_kv_cache[cpu_block].copy_(block, non_blocking=True)
        if out.blocks_to_swap_in:
            src, dst = zip(*out.blocks_to_swap_in)
            staged = torch.stack([self.cpu_kv_cache[b].to(self.device, non_blocking=True)
                                  for b in src])                              # (n, 2, L, ...)
            self.kv_cache[:, :, list(dst)] = staged.movedim(0, 2)
        if out.blocks_to_copy:  # copy-on-write, every block of the step in one batched copy
            src, dst = zip(*out.blocks_to_copy)
            self.kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)]

    def prepare(self, chunks, prompt_logprobs=True):
        """Pack chunks (seq, start, tokens, num_logits) into one varlen batch: each puts tokens
        at positions [start, start + len(tokens)) of its sequence and wants the logits after its
        last num_logits of them; then the rows that prompt logprobs need, if asked for."""
        bs, chunks = self.block_size, list(chunks)
        max_blocks = max(len(seq.block_table) for seq, *_ in chunks)
        input_ids, positions, slot_mapping, block_tables, seq_lens = [], [], [], [], []
        cu_seqlens_q, logits_indices, prompt_rows = [0], [], []
        for seq, start, tokens, num_logits in chunks:
            table, end = seq.block_table, start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            block_tables += table
            block_tables += [-1] * (max_blocks - len(table))  # rows end in -1s
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(tokens))
            logits_indices += range(cu_seqlens_q[-1] - num_logits, cu_seqlens_q[-1])
            if prompt_logprobs:  # rows after the sampling rows
                prompt_rows += [cu_seqlens_q[-1] - end + p
                                for p in seq.prompt_logprob_positions(start, end)]

        def tensor(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype, device=self.device)
        block_tables = tensor(block_tables, torch.int32).view(len(chunks), max_blocks)
        return Batch(tensor(input_ids), tensor(positions), tensor(slot_mapping), block_tables,
                     tensor(seq_lens, torch.int32), tensor(cu_seqlens_q, torch.int32),
                     max(len(tokens) for _, _, tokens, _ in chunks),
                     tensor(logits_indices + prompt_rows), self.attention, self.kv_scales)


def step_chunks(scheduled, proposals):
    """A step's chunks for ModelRunner.prepare: the tokens [num_computed_tokens, + num_new) of
    each scheduled sequence, then its proposals; logits after its last token and each proposal
    when its last token is in."""
    for seq, num_new in scheduled:
        start, proposal = seq.num_computed_tokens, proposals.get(seq.seq_id, [])
        complete = start + num_new == len(seq)
        yield seq, start, seq.token_ids[start:start + num_new] + proposal, \
            complete * (1 + len(proposal))


@torch.no_grad()
def calibrate_kv_scales(model, block_shape, dtype, num_tokens=256):
    """Per layer, the k_scale and v_scale (fp32, 0-d) of an 8-bit cache of dtype for model (the
    scheme in kernel.py), as keyword arguments of the attention backends; {} for a cache of 16 or
    32 bits. num_tokens fixed ids spread over the vocabulary, in sequences of at most
    max_seq_len, prefilled on the torch path (whatever the engine's backend, so the scales
    depend on the model alone) into a cache of the model's dtype; amax per layer of what it
    stored. block_shape: (2, n_layer, block_size, n_kv_head, head_dim) of this rank (each rank
    calibrates its own heads; the ranks run it together, so their collectives match)."""
    config, param = model.config, next(model.parameters())
    if dtype not in kernel.FP8_DTYPES:
        return [{}] * config.n_layer
    seq_len = min(num_tokens, config.max_seq_len)
    num_seqs, device = cdiv(num_tokens, seq_len), param.device
    # a prime stride walks the vocabulary in a fixed order, no two neighbours alike
    ids = torch.arange(num_seqs * seq_len, device=device) * 7919 % config.vocab_size
    cache = torch.zeros(*block_shape[:2], num_seqs, seq_len, *block_shape[3:], dtype=param.dtype,
                        device=device)  # (2, n_layer, num_seqs, seq_len, nkv, hs): a block each
    int32 = dict(dtype=torch.int32, device=device)
    batch = Batch(  # one block per sequence, the whole of it new
        ids, torch.arange(seq_len, device=device).repeat(num_seqs),
        torch.arange(len(ids), device=device), torch.arange(num_seqs, **int32)[:, None],
        torch.full((num_seqs,), seq_len, **int32), torch.arange(0, len(ids) + 1, seq_len, **int32),
        seq_len, torch.zeros(0, dtype=torch.long, device=device),
        kernel.ATTENTION_BACKENDS["torch"], [{}] * config.n_layer)
    with torch.inference_mode():
        model(ids, batch, cache)
    s = kernel.kv_scales(cache.abs().amax(dim=(2, 3, 4, 5)), dtype)  # (2, n_layer)
    return [dict(k_scale=s[0, i], v_scale=s[1, i]) for i in range(config.n_layer)]


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
        """A parameter's default, read from the class of a row that has it: a fork may add a
        parameter in a subclass of SamplingParams, and give it to some requests only (MISSING:
        to none)."""
        return next((type(p).__dataclass_fields__[name].default for p in self.params
                     if name in type(p).__dataclass_fields__), MISSING)

    def uses(self, name):
        """Whether any row sets the parameter away from its default."""
        default = self.default(name)
        return any(getattr(p, name, default) not in (default, []) for p in self.params)

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

    def counts(self, ids_of_row, V):
        """(R, V) how many times each token id is in each row's ids_of_row(r)."""
        ids = [ids_of_row(r) for r in range(len(self.params))]
        rows = torch.tensor([r for r, row in enumerate(ids) for _ in row], dtype=torch.long)
        cols = torch.tensor([t for row in ids for t in row], dtype=torch.long)
        return torch.zeros(len(ids), V, device=self.device).index_put_(
            (rows.to(self.device), cols.to(self.device)),
            torch.ones(len(rows), device=self.device), accumulate=True)


def apply_logits_processors(scores, meta):
    """Each row's own SamplingParams.logits_processors, in order, on its scores (vLLM's
    per-request form): constrained decoding, watermarks, a bias of one's own."""
    for r, p in enumerate(meta.params):
        for processor in p.logits_processors:
            scores[r] = processor(meta.prompt_ids(r), meta.output_ids(r), scores[r])
    return scores


def apply_penalties(scores, meta):
    """repetition_penalty over the tokens of prompt and output, as transformers'
    RepetitionPenaltyLogitsProcessor and vLLM divide a positive score by it and multiply a
    negative one; then, over the output, minus presence_penalty once for each token present and
    minus frequency_penalty times its count (vLLM's and the OpenAI API's rule)."""
    if not (meta.uses("repetition_penalty") or meta.uses("presence_penalty")
            or meta.uses("frequency_penalty")):
        return scores
    counts = meta.counts(meta.output_ids, scores.shape[-1]).to(scores.dtype)           # (R, V)
    seen = (meta.counts(meta.prompt_ids, scores.shape[-1]) > 0) | (counts > 0)
    penalty = meta.column("repetition_penalty").to(scores.dtype)[:, None]
    scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    presence = meta.column("presence_penalty").to(scores.dtype)[:, None]
    frequency = meta.column("frequency_penalty").to(scores.dtype)[:, None]
    return scores - presence * (counts > 0) - frequency * counts


def apply_min_tokens(scores, meta):
    """No row with fewer than min_tokens output tokens may draw an end: its stop_token_ids and
    the model's end-of-text ids score -inf (vLLM's, ignore_eos or not; transformers'
    MinNewTokensLengthLogitsProcessor)."""
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
# Each group whose sequences got logits this step moves on by one token: sampled, or chosen
# by beam search. Parallel samples fork from the prompt here, sharing its blocks; a finished
# sequence frees its blocks at once.


class OutputProcessor:

    def __init__(self, config, scheduler, seq_ids, device, detokenizer=None):
        self.config, self.scheduler, self.device = config, scheduler, device
        self.seq_ids = seq_ids  # the engine's counter of sequence ids, shared with forks
        self.detokenizer = detokenizer  # text and stop strings, with a tokenizer
        self.num_generated_tokens = 0
        self.num_proposed_tokens = self.num_accepted_tokens = 0  # speculative decoding

    @property
    def allocator(self):
        return self.scheduler.allocator

    def process(self, scheduled, logits, proposals={}):
        """Advance the scheduled sequences past their new tokens, then give each group whose
        sequences got logits its next token, or, speculating, the tokens its proposals earn.
        Returns those groups, for the engine to report."""
        row_of = {}  # seq_id -> its first row of logits, for sequences whose last token is now in
        num_rows, owed = 0, []  # owed: (seq, position p), prompt logprobs from the rows after
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            owed += [(seq, p) for p in seq.prompt_logprob_positions(start, start + num_new)]
            seq.num_computed_tokens += num_new
            self.allocator.cache_full_blocks(seq, start)
            if seq.num_computed_tokens == len(seq):
                row_of[seq.seq_id] = num_rows  # then a row after each of its proposals
                num_rows += 1 + len(proposals.get(seq.seq_id, ()))
        running = {g.request_id: g for g in self.scheduler.running}
        if owed:
            self.record_prompt_logprobs(owed, logits[num_rows:], running)
        # The scheduler completes all sequences of a group in the same step.
        ready = list({seq.request_id: running[seq.request_id] for seq, _ in scheduled
                      if seq.seq_id in row_of}.values())
        to_sample = []  # (group, seq, row)
        for group in ready:
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = time.perf_counter()
            if group.params.beam_width is not None:
                self.num_generated_tokens += beam_search_step(
                    group, logits[[row_of[seq.seq_id] for seq in group.seqs]],
                    self.stop_ids(group.params), self.fork, self.allocator.free,
                    self.config.eos_token_ids)
                continue
            prompt_row = row_of.get(group.seqs[0].seq_id)
            if group.params.n > 1 and len(group.seqs) == 1 and group.seqs[0].num_output_tokens == 0:
                self.fork_samples(group)  # they draw their first tokens from the prompt's logits
            to_sample += [(group, seq, row_of.get(seq.seq_id, prompt_row)) for seq in group.seqs]
        if to_sample:
            self.sample_tokens(to_sample, logits, proposals)
        for group in ready:
            if group.is_finished:
                group.metrics.finished_time = time.perf_counter()
        self.scheduler.remove_finished()
        return ready

    def sample_tokens(self, to_sample, logits, proposals):
        """Draw the next token of each (group, seq, row of logits); finish the seqs that stop.
        A sequence with proposals has a row after each of them too: it draws token j from row j
        as if nothing were proposed, and goes on to row j + 1 while token j is proposal j, whose
        K/V the step computed (speculative.py: this is rejection sampling). The blocks past the
        tokens it keeps go back to the pool."""
        draws = [(g, seq, row + j, j) for g, seq, row in to_sample
                 for j in range(1 + len(proposals.get(seq.seq_id, ())))]
        rows = [r for _, _, r, _ in draws]
        logits = logits if rows == list(range(len(logits))) else logits[rows]           # (D, V)
        meta = SamplingMetadata(
            [g.params for g, *_ in draws], [seq for _, seq, *_ in draws],
            [list(proposals.get(seq.seq_id, ())[:j]) for _, seq, _, j in draws],
            [None if g.seed is None else sample_generator(
                g.seed, seq.index, seq.num_output_tokens + j, self.device)
             for g, seq, _, j in draws], self.config.eos_token_ids, logits.device)
        # Tensor parallel ranks run this same scheduler on bit-identical logits (the all-reduce
        # gives each the same sum), so greedy picks, beams and stops agree; a random draw may
        # not (unseeded, each rank has its own seed), so all take rank 0's tokens.
        tokens = broadcast(sample(logits, meta))
        logprobs = log_probs(logits)                                                   # (D, V)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        top = logprobs.topk(max(p.logprobs or 0 for p in meta.params))  # for those who asked
        done = set()  # sequences that stopped, or drew a token other than their proposal
        kept_from = {seq.seq_id: seq.num_computed_tokens for _, seq, _ in to_sample}
        for r, ((group, seq, _, j), token) in enumerate(zip(draws, tokens.tolist())):
            if seq.seq_id in done:
                continue
            seq.token_ids.append(token)
            seq.cumulative_logprob += chosen[r]
            if (k := group.params.logprobs) is not None:
                seq.logprobs.append(logprob_entry(token, chosen[r], top, r, k))
            proposal = proposals.get(seq.seq_id, ())
            accepted = j < len(proposal) and token == proposal[j]
            seq.num_computed_tokens += accepted
            self.num_accepted_tokens += accepted
            self.num_generated_tokens += 1
            if reason := self.stop_reason(seq, group.params):
                self.finish(group, seq, reason)
            if reason or not accepted:
                done.add(seq.seq_id)
        for _, seq, _ in to_sample:
            if seq.seq_id in proposals:
                self.num_proposed_tokens += len(proposals[seq.seq_id])
                if seq.finish_reason is None:  # a finished one gave back every block
                    self.allocator.free_lookahead_slots(seq)
                    self.allocator.cache_full_blocks(seq, kept_from[seq.seq_id])

    def record_prompt_logprobs(self, owed, logits, groups):
        """Prompt token p + 1's logprob and the k likeliest, from the logits after position p."""
        logprobs = log_probs(logits)                                                   # (P, V)
        ks = [groups[seq.request_id].params.prompt_logprobs for seq, _ in owed]
        tokens = [seq.token_ids[p + 1] for seq, p in owed]
        index = torch.tensor(tokens, device=logprobs.device)[:, None]
        chosen = logprobs.gather(-1, index).squeeze(-1).tolist()
        top = logprobs.topk(max(ks))
        for r, ((seq, _), token, k) in enumerate(zip(owed, tokens, ks)):
            seq.prompt_logprobs.append(logprob_entry(token, chosen[r], top, r, k))

    def stop_ids(self, params):
        """The tokens that end a sequence: the request's, and every end-of-text id unless
        ignore_eos."""
        eos = set() if params.ignore_eos else self.config.eos_token_ids
        return set(params.stop_token_ids) | eos

    def stop_reason(self, seq, params):
        """Why seq ends at its newest token, as vLLM decides: "stop" for an end token (none
        before min_tokens), or for a stop string its text now holds (with a tokenizer: the end
        token's own text is left out unless include_stop_str_in_output); "length" at max_tokens;
        else None. Sets seq.stop_reason to the stop token id or string."""
        token, detokenizer = seq.token_ids[-1], self.detokenizer
        if seq.num_output_tokens >= params.min_tokens and token in self.stop_ids(params):
            if detokenizer is not None and params.include_stop_str_in_output:
                detokenizer.update(seq, params)
            seq.stop_reason = token if token in params.stop_token_ids else None
            return "stop"
        if detokenizer is not None and (stop := detokenizer.update(seq, params)) is not None:
            seq.stop_reason = stop
            return "stop"
        return "length" if seq.num_output_tokens >= params.max_tokens else None

    def finish(self, group, seq, reason):
        seq.finish_reason = reason
        self.allocator.free(seq)
        group.seqs.remove(seq)
        group.finished.append(seq)

    def fork(self, seq, index=0):
        child = seq.fork(next(self.seq_ids), index)
        self.allocator.fork(seq, child)
        return child

    def fork_samples(self, group):
        """Parallel sampling: the prompt was prefilled once; n - 1 forks share all its blocks,
        and the shared partial last block is copied on the first write (paper, section 4.4)."""
        parent = group.seqs[0]
        for i in range(1, group.params.n):
            group.seqs.append(self.fork(parent, index=i))


def beam_search_step(group, logits, stops, fork, free, eos_token_ids=frozenset()):
    """Keep the beam_width best one-token extensions of the live beams, by cumulative
    log-probability, as transformers' beam search with early_stopping=True: a candidate that
    ends (a stop token, or the last token max_tokens allows) is a finished hypothesis only if
    it ranks among the step's beam_width best; the search ends with beam_width hypotheses.
    A beam chosen twice forks, so both continuations share its blocks; a beam not chosen is
    freed, and what it shared lives on in the survivors. repetition_penalty and min_tokens apply
    to the log-probabilities, as transformers' processors do. Returns the tokens it generated."""
    params, beams = group.params, group.seqs
    width = params.beam_width
    logprobs = logits.double().log_softmax(-1)                                           # (k, V)
    meta = SamplingMetadata([params] * len(beams), beams, [[]] * len(beams),
                            [None] * len(beams), set(eos_token_ids), logprobs.device)
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
    candidates = sorted(zip(scores[flat].tolist(), flat.tolist()), key=lambda c: (-c[0], c[1]))
    last = beams[0].num_output_tokens + 1 >= params.max_tokens  # beams move in lockstep
    picks, num_finished = [], len(group.finished)
    for rank, (score, flat) in enumerate(candidates):
        parent, token = divmod(flat, V)
        if (token in stops or last) and rank < width:
            hypothesis = beams[parent].output_token_ids + [token]
            group.finished.append((hypothesis, score, "stop" if token in stops else "length"))
        elif token not in stops and not last:
            picks.append((parent, token, score))
        if rank + 1 >= width and (last or len(picks) == width):
            break
    survivors, chosen = [], set()
    for parent, token, score in picks:
        seq = fork(beams[parent]) if parent in chosen else beams[parent]
        chosen.add(parent)
        survivors.append((seq, token, score))
    for i, seq in enumerate(beams):
        if i not in chosen:
            free(seq)
    for seq, token, score in survivors:  # after every fork, so no child copies a new token
        seq.token_ids.append(token)
        seq.cumulative_logprob = score
    group.seqs = [seq for seq, _, _ in survivors]
    if len(group.finished) >= width:  # done (or no survivor: every candidate ended)
        for seq in group.seqs:
            free(seq)
        group.seqs = []
    return len(survivors) + len(group.finished) - num_finished


def request_output(group, detokenizer=None):
    """The request as it stands: finished, or still running with the tokens it has so far;
    with a detokenizer, the text too (a streamed one without what may begin a stop string)."""
    params = group.params
    if params.beam_width is not None and group.is_finished:
        # rank by length-normalised log-probability, so short hypotheses are not favoured
        best = sorted(group.finished, key=lambda h: -h[1] / len(h[0]) ** params.length_penalty)
        outputs = [CompletionOutput(i, tokens, reason, logprob)
                   for i, (tokens, logprob, reason) in enumerate(best[:params.beam_width])]
    elif params.beam_width is not None:  # the live beams, best first
        outputs = [CompletionOutput(i, seq.output_token_ids, None, seq.cumulative_logprob)
                   for i, seq in enumerate(group.seqs)]
    else:
        outputs = [CompletionOutput(
            seq.index, seq.output_token_ids, seq.finish_reason, seq.cumulative_logprob,
            None if params.logprobs is None else list(seq.logprobs),
            None if detokenizer is None else detokenizer.visible(seq, params, seq.finish_reason),
            seq.stop_reason) for seq in sorted(group.finished + group.seqs, key=lambda s: s.index)]
    if detokenizer is not None and params.beam_width is not None:
        for c in outputs:
            c.text = detokenizer.decode(c.token_ids)
    m = RequestMetrics(**vars(group.metrics))  # a copy; the times derive from it alone
    return RequestOutput(
        request_id=group.request_id, prompt_token_ids=group.prompt_token_ids, outputs=outputs,
        metrics=m, time_to_first_token=m.first_token_time - m.arrival_time,
        latency=m.finished_time and m.finished_time - m.arrival_time,
        num_preemptions=group.num_preemptions, finished=group.is_finished,
        num_cached_tokens=group.num_cached_tokens,
        prompt_logprobs=list(group.prompt_logprobs) or None)


# -----------------------------------------------------------------------------
# 11. The engine: the step loop and the public API (Orca's iteration-level scheduling)
#
# One step: the scheduler decides which tokens run and which blocks move; the model runner
# copies the blocks and runs one packed batch; the output processor samples the next tokens
# and retires finished requests. The same three calls, in this order, are Engine.step.


class Engine:
    observer = None  # see notify

    def __init__(self, model, block_size=16, num_blocks=None, kv_cache_bytes=None,
                 num_cpu_blocks=None, preemption_mode="recompute", enable_prefix_caching=True,
                 max_num_seqs=256, max_num_batched_tokens=2048, device=None,
                 attention_backend=None, swap_space=4, allocator_cls=None, scheduler_cls=None,
                 scheduling_policy="fcfs", eviction_policy="lru", kv_cache_dtype="auto",
                 speculative_config=None, tokenizer=None, observer=None):
        device, attention, dtype = check_engine_settings(
            model, device, attention_backend, preemption_mode, enable_prefix_caching, swap_space,
            kv_cache_dtype, scheduling_policy, eviction_policy,
            block_size=block_size, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
            num_cpu_blocks=num_cpu_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens)
        self.model, self.config = model.to(device).eval(), model.config
        self.device, self.block_size = device, block_size
        proposer = None
        if speculative_config is not None:  # the layer above, imported only when asked for
            import speculative
            proposer = speculative.make_proposer(speculative_config, model, device)
        # dtype: the KV cache's (kv_cache_dtype "fp8": half the bytes)
        bytes_per_block = math.prod(kv_block_shape(self.config, block_size)) * dtype.itemsize
        bytes_per_block += proposer.bytes_per_block(block_size, dtype) if proposer else 0  # draft
        num_blocks, num_cpu_blocks = pool_sizes(
            self.config, device, block_size, bytes_per_block, num_blocks, kv_cache_bytes,
            max_num_seqs, num_cpu_blocks, swap_space if preemption_mode == "swap" else 0)
        # Replaceable parts (vLLM's scheduler_cls): a fork passes its subclass, edits nothing else
        allocator = (allocator_cls or BlockAllocator)(num_blocks, block_size, num_cpu_blocks,
                                                      enable_prefix_caching, eviction_policy)
        self.scheduler = (scheduler_cls or Scheduler)(
            allocator, max_num_seqs, max_num_batched_tokens, preemption_mode,
            scheduling_policy=scheduling_policy,
            num_lookahead_slots=proposer.num_speculative_tokens if proposer else 0)
        self.model_runner = ModelRunner(self.model, num_blocks, num_cpu_blocks, block_size,
                                        attention, device, dtype)
        self.proposer = proposer and proposer.allocate_cache(num_blocks, num_cpu_blocks,
                                                             block_size, self.model_runner)
        self.kv_cache = self.model_runner.kv_cache  # (2, n_layer, num_blocks, block_size, nkv, hs)
        self.requests = {}  # request_id -> SequenceGroup, until it finishes or is aborted
        self.request_ids, self.seq_ids = itertools.count(), itertools.count()
        self.detokenizer = None  # text and stop strings need a tokenizer: decode(ids) -> str
        if tokenizer is not None:  # detokenizer.py, beside kernel.py: it imports nothing of ours
            import detokenizer
            self.detokenizer = detokenizer.Detokenizer(tokenizer)
        self.output_processor = OutputProcessor(self.config, self.scheduler, self.seq_ids, device,
                                                self.detokenizer)
        self.num_steps = 0
        self.set_observer(observer)

    def set_observer(self, observer):
        """observer(event: dict) hears every change to paging (notify); None: nobody listens."""
        a = self.allocator
        for part in (self, self.scheduler, a, a.prefix_cache, a.swap_pool):
            part.observer = observer

    @property
    def allocator(self):  # one reference, the scheduler's, so no part can hold a stale one
        return self.scheduler.allocator

    def step(self):
        """Run one scheduling step; returns a RequestOutput for each request that gained tokens
        in it (.finished says which are done: outputs stream). A step is all or nothing: if
        anything in it raises (the model, sampling, a stop rule), rollback() puts every request,
        queue and block back as the step found them and the error propagates; the next step
        computes the same tokens again."""
        if tp.failed:
            raise RuntimeError(f"tensor parallelism was shut down after {tp.failed}; the ranks "
                               "cannot agree on the state any more: start them again")
        txn = self.begin_step()
        try:
            notify(self, "step", step=self.num_steps)
            out = self.scheduler.schedule()
            if self.observer is not None:
                notify(self, "schedule", **schedule_summary(out))
            if not (out.scheduled or out.preempted) and self.scheduler.has_unfinished():
                raise RuntimeError(stall_message(self))  # nothing outside could unblock it
            proposals = self.proposer.propose(out) if self.proposer else {}  # seq_id -> tokens
            logits = self.model_runner.execute(out, proposals)
            groups = [] if logits is None else \
                self.output_processor.process(out.scheduled, logits, proposals)
            outputs = [request_output(group, self.detokenizer) for group in groups]
            for group in groups:
                if group.is_finished:
                    notify(self, "finished", request=group.request_id)
        except BaseException as e:
            self.rollback(txn)
            if tp.world_size > 1:  # every rank learns of it: see tp_shut_down
                tp_shut_down(e)
            raise
        for group in groups:  # the step is done: nothing after this can fail
            if group.is_finished:
                del self.requests[group.request_id]
        self.num_steps += 1
        return outputs

    # -- a step as a transaction ----------------------------------------------------------

    def begin_step(self):
        """A Transaction holding what a step may change, before it does: the scheduler and its
        queues, the counters, and every group the step can reach, with its metrics and
        sequences. Those are the running and swapped ones, and the waiting ones admission can
        reach: each admitted group takes a free block and a sequence slot, and nothing is
        admitted in a step that frees blocks by preemption. The allocator journals itself."""
        s = self.scheduler
        self.allocator.begin()
        txn = Transaction()
        for obj in (self.requests, s, self.output_processor):
            txn.save(obj)
        reachable = itertools.islice(s.waiting, min(s.max_num_seqs, self.allocator.num_free_blocks))
        for group in itertools.chain(s.running, s.swapped, reachable):
            for obj in (group, group.metrics, *group.seqs):
                txn.save(obj)
        return txn

    def rollback(self, txn):
        """Undo a failed step. Its writes into the KV cache cannot be undone, and they land only
        in blocks it handed out: a request that held such a block before the step (its blocks
        were taken from it by a preemption in the step) is left preempted by recompute. An
        observer hears of the undo, but cannot stop it by raising."""
        observer = self.observer
        self.set_observer(observer and quiet(observer))
        try:
            taken = self.allocator.rollback()
            txn.rollback()
            notify(self, "rollback", step=self.num_steps, uncached=sorted(taken))
            s = self.scheduler
            for group in list(s.running):  # a copy: groups leave s.running
                if any(taken.intersection(seq.block_table) for seq in group.seqs):
                    s.running.remove(group)
                    s.preempt_by_recompute(group)
            self.allocator.begin()  # those preemptions are the state the next step starts from
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
        notify(self, "add", request=request_id, seq=seq.seq_id, prompt=prompt_token_ids)
        group = SequenceGroup(request_id, prompt_token_ids, params, seq, priority)
        if params.beam_width is None and params.temperature > 0:
            # without a seed, a seed drawn from torch's global RNG
            group.seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()))
        self.requests[request_id] = group
        self.scheduler.add(group)
        return request_id

    def abort(self, request_id):
        """Drop a request wherever it is (waiting, running, swapped); free its blocks."""
        if request_id not in self.requests:
            raise ValueError(f"no unfinished request with id {request_id}")
        notify(self, "abort", request=request_id)
        self.scheduler.abort(self.requests.pop(request_id))

    def check_request(self, prompt, params, priority=0):
        """Raise ValueError saying what is wrong with a request, before it takes any block. A
        prompt is a list or tuple of token ids, or a 1-D integer tensor; returns it as a list."""
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
        ids = [self._enqueue(*request) for request in zip(checked, params, priority)]
        outputs = {}
        while any(i not in outputs for i in ids):
            outputs.update((o.request_id, o) for o in self.step() if o.finished)
        return [outputs[i] for i in ids]

    def stats(self):
        return engine_stats(self)


# -----------------------------------------------------------------------------
# Appendix: the checks of settings and requests, and the metrics
#
# A setting or request a user got wrong is a ValueError that names it and what it allows,
# raised before anything changes. A reader of the paged core can skip these.


def check_engine_settings(model, device, attention_backend, preemption_mode,
                          enable_prefix_caching, swap_space, kv_cache_dtype, scheduling_policy,
                          eviction_policy, **counts):
    """Engine's settings, or a ValueError naming the one that cannot work and its range. Returns
    the torch.device, the kernel.AttentionBackend and the KV cache's dtype, defaults filled in."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"Engine: device must be like 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from None
    if not isinstance(model, nn.Module) or not isinstance(getattr(model, "config", None),
                                                          GPTConfig):
        raise ValueError(f"Engine: model must be a GPT (or a module with a GPTConfig as "
                         f".config), got {type(model).__name__}")
    # The Triton kernel on a GPU; on the CPU the torch path (the interpreter is ~1000x slower).
    attention_backend = attention_backend or ("triton" if device.type == "cuda" else "torch")
    for name, value in counts.items():  # None: it follows from the other settings
        least = 0 if name == "num_cpu_blocks" else 1  # no swap space is fine
        if value is not None and (not integer(value) or value < least):
            raise ValueError(f"Engine: {name} must be an integer >= {least}, got {value!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"Engine: enable_prefix_caching must be True or False, "
                         f"got {enable_prefix_caching!r}")
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if not number(swap_space) or not 0 <= swap_space <= 0.7 * host_gib:  # vLLM's: 70% of host
        raise ValueError(f"Engine: swap_space must be a number of GiB in [0, {0.7 * host_gib:.1f}]"
                         f" (70% of this host's {host_gib:.1f} GiB), got {swap_space!r}")
    for name, value, allowed in [("preemption_mode", preemption_mode, ("recompute", "swap")),
                                 ("scheduling_policy", scheduling_policy, SCHEDULING_POLICIES),
                                 ("eviction_policy", eviction_policy, EVICTION_POLICIES),
                                 ("attention_backend", attention_backend,
                                  kernel.ATTENTION_BACKENDS)]:
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"Engine: {name} must be one of {sorted(allowed)}, got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("Engine: device='cuda' but no CUDA GPU is available; use device='cpu'")
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        raise ValueError(f"Engine: the model's dtype {dtype} is not a floating-point type")
    cache_dtype = kernel.check_kv_cache_dtype(kv_cache_dtype, dtype, device, attention_backend)
    backend = kernel.ATTENTION_BACKENDS[attention_backend]
    if why := backend.unsupported(dtype, model.config.head_dim, cache_dtype):
        raise ValueError(f"Engine: attention_backend={attention_backend!r} cannot run this "
                         f"model: {why} (attention_backend='torch' takes any)")
    return device, backend, cache_dtype


def check_request(prompt, params, priority, config, scheduler, has_tokenizer=False):
    """Engine.check_request: a prompt as a list of token ids, or a ValueError."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.stop and not has_tokenizer:
        raise ValueError(f"stop={params.stop!r}: stop strings are found in the decoded text, so "
                         "the engine needs a tokenizer: Engine(model, tokenizer=...)")
    if not integer(priority):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
            raise ValueError(f"a tensor prompt must be 1-D and hold integer token ids, "
                             f"got shape {tuple(prompt.shape)} of {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is a list or tuple of token ids or a 1-D integer tensor, "
                         f"got {type(prompt).__name__}")
    prompt_token_ids = list(prompt)
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > config.vocab_size:
            raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary "
                             f"({config.vocab_size})")
    for t in params.stop_token_ids:
        if t >= config.vocab_size:
            raise ValueError(f"stop token id {t} is outside the vocabulary "
                             f"[0, {config.vocab_size})")
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token id")
    for i, t in enumerate(prompt_token_ids):
        if not integer(t) or not 0 <= t < config.vocab_size:
            raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary "
                             f"[0, {config.vocab_size})")
    total = len(prompt_token_ids) + params.max_tokens
    if total > config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                         f"({params.max_tokens}) = {total} exceeds the model's max_seq_len "
                         f"({config.max_seq_len})")
    if params.beam_width is not None and scheduler.num_lookahead_slots:
        raise ValueError("beam search does not run with speculative decoding: use an Engine "
                         "without speculative_config for beam_width requests")
    # a request's sequences decode together, so they must fit in one step
    limit = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    if params.num_seqs > limit:
        raise ValueError(f"n/beam_width ({params.num_seqs}) exceeds max_num_seqs and "
                         f"max_num_batched_tokens (at most {limit} sequences of one request)")
    # Worst case: every sample ends up with private blocks for all its tokens.
    a = scheduler.allocator
    worst = params.num_seqs * cdiv(total, a.block_size)
    if worst > a.num_blocks:
        raise ValueError(f"the request may need {worst} KV blocks ({params.num_seqs} x {total} "
                         f"tokens at block_size {a.block_size}) but the pool has "
                         f"{a.num_blocks}: it could never run; use more num_blocks or "
                         f"shorter requests")
    return prompt_token_ids


def schedule_summary(out):
    """A SchedulerOutput as an observer hears it: each scheduled chunk's sequence, start and
    tokens, and the block moves."""
    return dict(scheduled=[(seq.seq_id, seq.num_computed_tokens,
                            seq.token_ids[seq.num_computed_tokens:][:n])
                           for seq, n in out.scheduled],
                lookahead=[(seq.seq_id, n) for seq, n in out.lookahead],
                copies=out.blocks_to_copy, swap_in=out.blocks_to_swap_in,
                swap_out=out.blocks_to_swap_out,
                preempted=[group.request_id for group in out.preempted])


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
    running = [seq for g in s.running for seq in g.seqs]
    filled = {}  # physical block -> token slots holding computed K/V (a shared block counts once)
    for seq in running:
        for i, block_id in enumerate(seq.block_table):
            in_block = min(bs, seq.num_computed_tokens - i * bs)
            filled[block_id] = max(filled.get(block_id, 0), in_block)
    num_used = a.num_blocks - a.num_free_blocks
    hits, o = a.prefix_cache.counts, engine.output_processor
    return dict(
        num_blocks=a.num_blocks, num_free_blocks=a.num_free_blocks,
        kv_cache_dtype=str(engine.kv_cache.dtype).removeprefix("torch."),
        num_cached_blocks=a.prefix_cache.num_evictable,  # free blocks that keep a prefix
        num_cpu_blocks=a.swap_pool.num_blocks, num_free_cpu_blocks=a.swap_pool.num_free_blocks,
        num_running=len(running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
        num_preemptions=s.num_preemptions,
        kv_utilization=sum(filled.values()) / (num_used * bs) if num_used else 0.0,
        # minus the blocks in use: the blocks that sharing saved
        num_logical_blocks=sum(len(seq.block_table) for seq in running),
        num_generated_tokens=o.num_generated_tokens,
        # speculative decoding: tokens proposed, and those the target model drew too
        num_proposed_tokens=o.num_proposed_tokens, num_accepted_tokens=o.num_accepted_tokens,
        prefix_cache_hit_tokens=hits.hit_tokens, prefix_cache_queried_tokens=hits.queried_tokens,
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
