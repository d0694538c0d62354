"""
Tests for nanopaged, in the order a reader meets the code: first the layer below (kernel.py: the
kernels, then 8-bit caches), then nanopaged.py's sections in its own order (sequences and
requests, the prefix cache, the block pools and the connectors, the block allocator, the
scheduler, tensor parallelism beside it, the model, sampling, output processing, the engine, the
checks beside it), then the files above it (checkpoints.py, speculative.py, detokenizer.py,
demo.py, bench.py). Each section's tests carry its pytest marker, named in its title
(pyproject.toml lists them).

    python -m pytest -q                               what CI runs (the default profile)
    python -m pytest -q -m allocator                  one part; -m "not bench" leaves one out
    python -m pytest -q --hypothesis-profile fast     the whole suite in about 2 minutes
    python -m pytest -q --hypothesis-profile thorough --timeout 0
                                                      10x the examples, for a night (its
                                                      slowest tests pass the per-test limit)
    bash tools/seeds.sh                               every Hypothesis test at seeds 0 to 4

Without a GPU the Triton kernels run in Triton's interpreter.
"""

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import itertools
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
from collections import Counter, deque
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, event, example, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import checkpoints
import checks
import connectors
import demo
import disaggregation
import kernel
import nanopaged
import pagetrace
import parallel
import read_policy
import speculative
from kernel import HEAD_DIMS, naive_attention, paged_attention, paged_attention_torch, store_kv
from nanopaged import (EVICTION_POLICIES, GPT, NO_BLOCK, SCHEDULING_POLICIES, BlockAllocator,
                       Engine, GPTConfig, OutOfBlocksError, SamplingParams, Sequence, chain_hash)

# Hypothesis profiles (registered in conftest.py, chosen with --hypothesis-profile): "default" is
# what CI runs; "fast" is a researcher's edit-test loop; "thorough" is for a night. Each test
# states the examples it checks in the default profile, through examples(), which scales them
# by the active profile's max_examples (read here, at import: the plugin loads the profile
# before pytest imports this file). Under "fast" the slowest fixed tests run smaller (FAST,
# some()), each still asserting what it checks.
SCALE = settings.default.max_examples / settings.get_profile("default").max_examples
FAST = SCALE < 1


def examples(n):
    """n examples in the default profile, scaled by the active one (at least one)."""
    return max(1, round(n * SCALE))


def some(cases, n):
    """Every case; under the fast profile, n of them spread over the list."""
    return list(cases)[::-(-len(cases) // n)] if FAST and len(cases) > n else cases


# Policies your copy would add, one entry each, so that every test that holds for any policy runs
# under one nobody built in: shortest prompt first; the most recently freed block first, and
# the first cached first (FIFO, from the stamp each block keeps).
# The machines and the naive equality tests run under every registered policy; what belongs to
# one policy alone is stated in its part's section.
SCHEDULING_POLICIES.setdefault("shortest_prompt", lambda g: (len(g.prompt_token_ids), g.request_id))
EVICTION_POLICIES.setdefault("mru", lambda block: -block.freed_at)
EVICTION_POLICIES.setdefault("fifo", lambda block: block.cached_at)
SCHEDULING, EVICTION = sorted(SCHEDULING_POLICIES), sorted(EVICTION_POLICIES)


# And an attention kind (RECIPES.md's): StreamingLLM's attention sinks (Xiao et al., ICLR
# 2024), the first few tokens beside a sliding window, whose blocks are kept. One class and one
# entry: every property that holds for any kind runs under it too.
@dataclass(frozen=True)
class AttentionSinks(nanopaged.AttentionKind):
    window: int
    sink: int = 4  # StreamingLLM's four
    name = "sink_attention"

    @classmethod
    def from_config(cls, config):
        return cls(config.sliding_window)

    @property
    def mask(self):
        return kernel.Mask(window=self.window, sink=self.sink)


nanopaged.ATTENTION_KINDS.setdefault(AttentionSinks.name, AttentionSinks)
KINDS = sorted(nanopaged.ATTENTION_KINDS)


# And a speculative method: a proposer that guesses one token, the same every time, for every
# slot the scheduler reserves. Every property of speculation runs under it too, and demo.py and
# server.py take its name as a flag.
class FixedTokenProposer(speculative.Proposer):
    def __init__(self, num_speculative_tokens, token):
        super().__init__(num_speculative_tokens)
        self.token = token

    def bytes_per_block(self, block_size, kv_cache_dtype):  # no cache of its own
        return 0

    def allocate_cache(self, num_blocks, num_cpu_blocks, block_size, target_runner):
        return self

    def propose(self, out):
        return {seq.seq_id: [self.token] * slots for seq, slots in out.lookahead}


def fixed_token(config, model, device):
    """{"method": "fixed_token", "num_speculative_tokens": k, "token": t (default 0)}."""
    k = speculative.check_config(config, ("token",))
    token = config.get("token", 0)
    if not (nanopaged.integer(token) and 0 <= token < model.config.vocab_size):
        raise ValueError(f"speculative_config: token must be a token id, got {token!r}")
    return FixedTokenProposer(k, token)


nanopaged.SPECULATIVE_METHODS.setdefault("fixed_token", fixed_token)


# And a read policy, so that every property that holds for any read policy runs under one
# nobody built in: StreamingLLM's first and recent tokens, by the block.
class FirstAndRecentBlocks:
    """A fork's read policy, no key bounds needed: StreamingLLM's attention sinks and recent
    window (Xiao et al., ICLR 2024) by the block, the first blocks and the last ones, the same
    for every KV head."""
    needs_key_bounds = False

    def __init__(self, first=1, recent=1):
        self.first, self.recent = first, recent

    def select(self, layer, q, key_bounds, block_tables, seq_lens, block_size):
        num_blocks = (seq_lens.long() + block_size - 1) // block_size                  # (S,)
        pos = torch.arange(block_tables.shape[1], device=q.device)                     # (W,)
        keep = (pos < self.first) | (pos >= num_blocks[:, None] - self.recent)       # (S, W)
        return keep[:, None]                                                        # (S, 1, W)


nanopaged.READ_POLICIES.setdefault("first_and_recent", FirstAndRecentBlocks)
READ_POLICY_NAMES = sorted(nanopaged.READ_POLICIES)
# The settings each reads by in the tests, where its defaults would read every block of these
# small models (Quest reads 1024 tokens, past two dense layers); a policy not listed runs with
# its defaults. SELECTING: those that thin what a decode reads (all but "all"); BOUNDED: those
# that keep key bounds.
READ_POLICY_SETTINGS = {"quest": dict(token_budget=4, dense_layers=1)}
SELECTING = [name for name in READ_POLICY_NAMES if nanopaged.READ_POLICIES[name]() is not None]
BOUNDED = [name for name in SELECTING if nanopaged.READ_POLICIES[name]().needs_key_bounds]


# -----------------------------------------------------------------------------
# Helpers the sections share: sequences, state snapshots, tiny models and the naive
# references they are checked against, and the Hugging Face models the tests compare with


def make_seq(seq_id, tokens):
    return Sequence(seq_id, tokens, len(tokens))


# What a state comparison leaves out: the model and its tensors, the journal of the step in
# progress, the clocks and id counters a failed step may have advanced, an observer's error
# waiting for the next step, and the eviction heap, whose stale entries are a detail of its
# laziness (the evictable set it indexes is compared).
NOT_STATE = {"model", "model_runner", "proposer", "kv_cache", "journal", "taken", "clock", "heap",
             "seq_ids", "request_ids", "observer_error"}


def state_of(x, path=(), skip=NOT_STATE):
    """x as plain data, recursively: every field of every object (vars()) but those named in
    skip, every element of every container. Two equal results mean equal states, whatever fields
    your copy adds. An object met again below itself (the swap pool's allocator) is named, not
    walked."""
    if isinstance(x, nanopaged.BlockTable):  # its entries, whatever room its array keeps
        return x.tolist()
    if isinstance(x, dict):
        return {k: state_of(v, path, skip) for k, v in x.items()}
    if isinstance(x, (list, tuple, deque)):
        return [state_of(v, path, skip) for v in x]
    if isinstance(x, (set, frozenset)):
        return frozenset(x)
    if hasattr(x, "__dict__") and not callable(x) and not isinstance(x, torch.nn.Module):
        if id(x) in path:
            return f"<the {type(x).__name__} above>"
        return type(x).__name__, {k: state_of(v, path + (id(x),), skip)
                                  for k, v in vars(x).items() if k not in skip}
    return x


# Models run in float64 in these tests, so that the paged and the contiguous computations
# agree to ~1e-15 and an argmax can only flip on an exact tie.

def tiny_model(n_kv_head=None, seed=0, vocab_size=32, max_seq_len=64, **switches):
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, vocab_size=vocab_size,
                       max_seq_len=max_seq_len, **switches)
    return GPT(config).double()


MODEL = tiny_model()
# The Llama family's switches; its rotary scaling has all three bands at head_dim 8.
LLAMA = tiny_model(n_kv_head=2, seed=1, rope_theta=1e4, norm="rmsnorm", mlp="swiglu", bias=False,
                   qkv_bias=True, tie_word_embeddings=False, intermediate_size=48,
                   rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=0.25,
                                     high_freq_factor=4.0, original_max_position_embeddings=32))
MODELS = {"gpt2": MODEL, "llama": LLAMA}
# A model of each registered attention kind (the suite's own too), windows and chunks of 3 tokens,
# in every layer (one KV cache group); and a window beside full attention (two groups, a table
# each: full attention keeps its blocks, the window gives its old ones back)
KIND_MODELS = {name: tiny_model(seed=2 + i, sliding_window=3, attention_chunk_size=3,
                                layer_types=[name] * 2)
               for i, name in enumerate(KINDS) if name != "full_attention"}
WINDOWED = KIND_MODELS["sliding_attention"]
HYBRID = tiny_model(seed=3, sliding_window=3, layer_types=["full_attention", "sliding_attention"])
PAGED_MODELS = {"gpt2": MODEL, **KIND_MODELS, "hybrid": HYBRID}


def blocks_a_request_may_hold(engine, prompt, params):
    """What Engine.check_request refuses a request for exceeding: num_seqs x each sequence's
    most blocks at once, computing a token at a time, by its kinds' bound."""
    most = engine.allocator.max_blocks(len(prompt) + params.max_tokens, 1)
    return params.num_seqs * most


@torch.no_grad()
def naive_logprobs(model, tokens):
    """Next-token log-probabilities after tokens: the whole sequence again, contiguous attention."""
    return model(torch.tensor([tokens]))[0, -1].log_softmax(-1)


def naive_greedy(model, prompt, max_tokens):
    """Greedy decoding by recomputing the whole sequence every token (memoized: tests repeat
    prompts)."""
    return list(_naive_greedy(model, tuple(prompt), max_tokens))


@functools.lru_cache(maxsize=None)
def _naive_greedy(model, prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(naive_logprobs(model, tokens).argmax()))
    return tuple(tokens[len(prompt):])


def drain(engine, max_steps=1000):
    """Step the engine until no request is left, with a bound: an engine that stops making
    progress fails the test in seconds instead of hanging it. Returns request_id -> output."""
    outputs = {}
    for _ in range(max_steps):
        if not engine.scheduler.has_unfinished():
            return outputs
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    pytest.fail(f"requests still unfinished after {max_steps} steps: {engine.stats()}")


def stepped(engine, max_steps):
    """Each step's outputs until no request is left, bounded as drain() is, by max_steps: the
    steps its requests can need (with a budget for every prompt and no preemption, a step each
    token they compute)."""
    for _ in range(max_steps):
        if not engine.scheduler.has_unfinished():
            return
        yield engine.step()
    pytest.fail(f"requests still unfinished after {max_steps} steps: {engine.stats()}")


def assert_all_blocks_free(engine):
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_blocks"] and \
        s["num_free_cpu_blocks"] == s["num_cpu_blocks"]
    assert s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0 and not engine.requests


def serves_normally(engine):
    """After whatever happened, the engine still serves a request right and returns its blocks."""
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.outputs[0].token_ids == naive_greedy(MODEL, [1, 2, 3], 5)
    assert_all_blocks_free(engine)
    return True


def kinds_of_requests(vocab_size=32):
    """Up to 6 requests: (prompt, max_tokens, kind), each kind a way to sample: greedy, seeded,
    two samples, or a beam search of two."""
    return st.lists(st.tuples(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=10),
                              st.integers(1, 6),
                              st.sampled_from(["greedy", "seeded", "n=2", "beam=2"])),
                    min_size=1, max_size=6)


def tight_engine(requests, params, block_size, spare, mode, speculate):
    """An engine for (prompt, max_tokens, kind) requests whose pool holds the largest one and
    spare blocks more: too tight for all of them at once."""
    worst = max(p.num_seqs * -(-(len(r[0]) + p.max_tokens) // block_size)
                for r, p in zip(requests, params))
    return Engine(MODEL, block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                  max_num_batched_tokens=6, max_num_seqs=4, tokenizer=UserTokenizer(),
                  speculative_config=speculative_config("ngram", 2, MODEL) if speculate
                  else None)


@st.composite
def request_mixes(draw):
    """Prompts (often sharing a prefix), output lengths, and an engine sized from ample to tight."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    common = draw(st.lists(st.integers(0, 31), max_size=20))
    prompts, max_tokens = [], []
    for _ in range(draw(st.integers(1, 6))):
        prefix = common[:draw(st.integers(0, len(common)))]
        prompts.append(prefix + draw(st.lists(st.integers(0, 31), min_size=0 if prefix else 1,
                                              max_size=20)))
        max_tokens.append(draw(st.integers(1, 12)))
    worst = max(-(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens))
    engine_args = dict(
        block_size=block_size,
        num_blocks=worst + draw(st.integers(0, 3 * worst)),  # from "one request at a time" to roomy
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        enable_prefix_caching=draw(st.booleans()),
        # small budgets chunk the prefills
        max_num_batched_tokens=draw(st.sampled_from([7, 16, 64])),
        max_num_seqs=draw(st.integers(1, 8)),
        scheduling_policy=draw(st.sampled_from(SCHEDULING)),
        eviction_policy=draw(st.sampled_from(EVICTION)),
    )
    priorities = draw(st.lists(st.integers(0, 2), min_size=len(prompts), max_size=len(prompts)))
    return prompts, max_tokens, priorities, engine_args


def greedy_reference(model, prompts, max_tokens, kv_cache_dtype="auto"):
    """What greedy generation must give: naive generation; with an 8-bit cache (whose rounding
    naive attention does not do), each prompt alone in an engine of ample blocks, no sharing."""
    if kv_cache_dtype == "auto":
        return [naive_greedy(model, p, max_tokens) for p in prompts]
    return [list(_alone(model, tuple(p), max_tokens, kv_cache_dtype)) for p in prompts]


@functools.lru_cache(maxsize=None)
def _alone(model, prompt, max_tokens, kv_cache_dtype):
    engine = Engine(model, block_size=16, num_blocks=32, enable_prefix_caching=False,
                    kv_cache_dtype=kv_cache_dtype)
    out = engine.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, temperature=0))
    return tuple(out[0].outputs[0].token_ids)


@pytest.fixture
def no_writes_into_shared_blocks(monkeypatch):
    """Make every KV write check that the block it lands in has exactly one owner, or is being
    filled in this step: published by the schedule, then read by the requests that hit it only
    after each layer's store."""
    engines, filling = [], set()

    def checked(store):
        def checked_store_kv(k, v, k_cache, v_cache, slot_mapping, **kwargs):
            for engine in engines:
                if engine.kv_cache.data_ptr() <= k_cache.data_ptr() < engine.kv_cache[1].data_ptr():
                    for slot in slot_mapping.tolist():
                        block = engine.allocator.blocks[slot // engine.block_size]
                        assert block.ref_count == 1 or \
                            (id(engine.allocator.blocks), block.block_id) in filling, \
                            f"write into block {block.block_id} with ref count {block.ref_count}"
            store(k, v, k_cache, v_cache, slot_mapping, **kwargs)
        return checked_store_kv

    for name, backend in list(kernel.ATTENTION_BACKENDS.items()):  # engines built after this
        monkeypatch.setitem(kernel.ATTENTION_BACKENDS, name,
                            dataclasses.replace(backend, store=checked(backend.store)))
    real_publish, real_step = nanopaged.PrefixCache.publish, nanopaged.Engine.step

    def publish(self, seq, i, block_id, group=0):  # the blocks a step's plan fills
        real_publish(self, seq, i, block_id, group)
        filling.add((id(self.blocks), block_id))

    def step(engine):
        filling.clear()
        return real_step(engine)
    monkeypatch.setattr(nanopaged.PrefixCache, "publish", publish)
    monkeypatch.setattr(nanopaged.Engine, "step", step)
    return engines.append


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=0.1,
                   high_freq_factor=4.0, original_max_position_embeddings=32)  # all 3 bands at hs 8
LLAMA_FAMILY = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=6, max_position_embeddings=64, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None)
HF_MODELS = {  # between them: 1, 2 and 3 K/V heads for 6 query heads, tied and untied, both RoPEs
    "gpt2": ("GPT2Config", dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=48,
                                bos_token_id=None, eos_token_id=None)),
    "llama": ("LlamaConfig", dict(LLAMA_FAMILY, num_key_value_heads=1,
                                  rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(LLAMA_FAMILY, num_key_value_heads=2, head_dim=16,
                                      sliding_window=None, tie_word_embeddings=True,
                                      rope_parameters=dict(rope_theta=1e4))),
    "qwen2": ("Qwen2Config", dict(LLAMA_FAMILY, num_key_value_heads=3, tie_word_embeddings=True,
                                  rope_parameters=dict(rope_theta=1e6))),
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """hf_folder(name) -> (path, model): a small random transformers model saved to disk, once."""
    transformers = pytest.importorskip("transformers")

    @functools.cache
    def build(name):
        config_class, kwargs = (HF_MODELS | TP_HF_MODELS | WINDOWED_HF_MODELS)[name]
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**kwargs)
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # zero biases, unit norms, faint attention: make every tensor count
            for p in hf.parameters():
                p.add_(0.1 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        return path, hf
    return build


def hf_greedy(hf, prompts, max_new_tokens):
    """transformers' greedy generate, each prompt alone: the new tokens."""
    expected = []
    for p in prompts:  # token 0 is not padding here, so the mask is explicit
        mask = torch.ones(1, len(p), dtype=torch.long)
        out = hf.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return expected


@functools.cache
def _double(hf):
    return copy.deepcopy(hf).double()


@functools.cache
def _from_pretrained64(path):
    return GPT.from_pretrained(path, dtype=torch.float64)


# -----------------------------------------------------------------------------
# The kernels (kernel.py): Triton and the torch paged path against naive attention  (-m kernel)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def masks_of(longest):
    """Masks (kernel.Mask) of every kind: full attention, a sliding window, a chunk, and sinks
    beside either; each 1, a few tokens, or any size up to past a context of longest."""
    size = st.one_of(st.just(1), st.integers(2, 24), st.integers(1, 2 * longest))
    return st.one_of(st.just(kernel.Mask()), size.map(lambda n: kernel.Mask(window=n)),
                     size.map(lambda n: kernel.Mask(chunk=n)),
                     st.tuples(st.none() | size, st.none() | size, st.integers(1, 9)).map(
                         lambda wcs: kernel.Mask(*wcs)))


def keys_seen(mask, seq_len, q_len):
    """The positions the q_len new tokens of a sequence of seq_len see under mask (None: all),
    by its rule, key by key."""
    if mask is None:
        return set(range(seq_len))
    return {k for p in range(seq_len - q_len, seq_len) for k in range(p + 1)
            if mask.visible(torch.tensor(p), torch.tensor(k))}


@st.composite
def paged_batches(draw, dtypes, max_seqs=4, max_seq_len=150, decode_only=False, min_seqs=1,
                  long_prefills=0, head_dims=HEAD_DIMS, block_sizes=(1, 3, 4, 5, 16),
                  groups=(1, 2, 3, 4, 8), cache_dtypes=(None,), masks=False,
                  poison_unseen=True):
    """A packed batch of sequences in a paged cache, and the same K/V laid out contiguously.
    Tables are shuffled, later sequences may share a prefix of sequence 0's blocks (as after
    a fork or a prefix-cache hit), and every cache slot no sequence uses holds NaN.
    long_prefills: that many more sequences, prefilling 2-4x max_seq_len tokens, anywhere.
    cache_dtypes: None (q's dtype) or 8-bit ones: the cache is quantized with per-batch scales
    from its amax times 0.5-2 (k_scale, v_scale in the batch), k and v are what it holds
    dequantized to q's dtype, and k_full, v_full what was quantized.
    masks: a kernel.Mask in the batch ("mask": full attention, a sliding window, a chunk, sinks
    beside either; each 1, a few tokens, or any size up to past every context), else None; or a
    function of the longest context that gives a strategy of masks (a fork's subclass). A
    block that holds no key a sequence's new tokens see is -1 in its table (a freed block's
    placeholder) and its slots NaN; the positions they do not see are NaN in the contiguous
    copy, and in the cache too unless another sequence needs the slot (poison_unseen=False
    leaves real K/V in the blocks a sequence reads: flex reads them whole)."""
    num_seqs = draw(st.integers(min_seqs, max_seqs))
    block_size = draw(st.sampled_from(block_sizes))
    n_kv_head = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from(groups))  # n_kv_head == 1 with group > 1 is MQA
    head_dim = draw(st.sampled_from(head_dims))
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
    for _ in range(long_prefills):
        seq_len = draw(st.integers(2 * max_seq_len, 4 * max_seq_len))
        # the whole prompt, or its end over a cached prefix
        q_len = draw(st.sampled_from([seq_len, draw(st.integers(2, seq_len))]))
        at = draw(st.integers(0, len(seq_lens)))
        seq_lens.insert(at, seq_len)
        q_lens.insert(at, q_len)
        num_seqs += 1

    masks = masks_of if masks is True else masks  # or a fork's: longest -> a strategy of masks
    mask = draw(masks(max(seq_lens))) if masks else None

    # block tables: shuffled physical ids; sequence i > 0 may start with sequence 0's blocks
    num_blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_seq) + 2
    free = draw(st.permutations(range(num_blocks)))
    tables = []
    for i, n in enumerate(num_blocks_per_seq):
        shared = draw(st.integers(0, min(n, num_blocks_per_seq[0]) - 1)) if i > 0 else 0
        tables.append((tables[0][:shared] if i > 0 else []) + free[:n - shared])
        free = free[n - shared:]
    # the positions any new token of a sequence sees; blocks without one are -1
    seen = [keys_seen(mask, n, q) for n, q in zip(seq_lens, q_lens)]
    tables = [[b if seen_i & set(range(j * block_size, (j + 1) * block_size)) else -1
               for j, b in enumerate(table)] for table, seen_i in zip(tables, seen)]
    max_blocks = max(num_blocks_per_seq) + 1  # at least one -1 column of padding
    block_tables = torch.tensor([t + [-1] * (max_blocks - len(t)) for t in tables],
                                dtype=torch.int32)

    # fill the slots a sequence sees (shared ones once) and gather the contiguous copy slot by
    # slot, NaN where no new token of the sequence sees it
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    k_cache = torch.full((num_blocks, block_size, n_kv_head, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    nan = torch.full((n_kv_head, head_dim), float("nan"), dtype=dtype)
    k_ctx, v_ctx = [], []
    for table, seq_len, seen_i in zip(tables, seq_lens, seen, strict=True):
        for t in range(seq_len):
            b, o = table[t // block_size], t % block_size
            filled = t in seen_i or not poison_unseen and b != -1
            if filled and k_cache[b, o].isnan().any():
                k_cache[b, o] = torch.randn(n_kv_head, head_dim, generator=g).to(dtype)
                v_cache[b, o] = torch.randn(n_kv_head, head_dim, generator=g).to(dtype)
            k_ctx.append(k_cache[b, o] if t in seen_i else nan)
            v_ctx.append(v_cache[b, o] if t in seen_i else nan)
    q = torch.randn(sum(q_lens), n_kv_head * group, head_dim, generator=g).to(dtype)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    k, v = torch.stack(k_ctx), torch.stack(v_ctx)
    scales, cache_dtype = {}, draw(st.sampled_from(cache_dtypes))
    if cache_dtype is not None:  # an 8-bit cache: unused slots stay NaN (clamp keeps NaN)
        for name, x in (("k", k), ("v", v)):
            amax = x.nan_to_num(0).abs().amax()  # NaN: positions no new token sees
            scales[name] = kernel.kv_scales(amax * draw(st.sampled_from([0.5, 1, 2])), cache_dtype)
        # the quantized cache, and the contiguous copy of what it holds, dequantized
        k_cache, v_cache = (kernel.quantize(c, scales[n], cache_dtype)
                            for c, n in ((k_cache, "k"), (v_cache, "v")))
        full = dict(k_full=k.to(DEVICE), v_full=v.to(DEVICE))
        k, v = ((kernel.quantize(x, scales[n], cache_dtype).double() * scales[n]).to(dtype)
                for x, n in ((k, "k"), (v, "v")))  # q * scale, computed here, not by kernel.py
    def to(t):
        return t.to(DEVICE)
    return dict(
        q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), block_tables=to(block_tables),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)), cu_seqlens_q=to(cu_seqlens_q),
        scale=head_dim**-0.5, k=to(k), v=to(v), mask=mask,
        **({} if cache_dtype is None else dict(
            k_scale=to(scales["k"]), v_scale=to(scales["v"]), **full)),
    )


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def paged_args(b):
    return (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
            b["cu_seqlens_q"], b["scale"])


def scales(b):
    """An 8-bit batch's k_scale and v_scale, as keyword arguments (none for a 16/32-bit one)."""
    return {name: b[name] for name in ("k_scale", "v_scale") if name in b}


def reference(b):
    return naive_attention(b["q"], b["k"], b["v"], b["cu_seqlens_q"], b["seq_lens"], b["scale"],
                           mask=b["mask"], keep=b.get("keep"))  # keep: selected_batches


def assert_close(out, ref):
    tol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in the output: a slot past seq_len or the mask was read"
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.kernel
@settings(max_examples=examples(40), deadline=None)
@given(
    paged_batches(dtypes=[torch.float32, torch.float16, torch.bfloat16], masks=True),
    st.sampled_from([None, 1, 2, 3]), st.booleans(),
)
def test_triton_matches_naive(b, num_splits, pass_max_q_len):
    # the engine passes max_q_len to avoid a sync; without it the launcher reads cu_seqlens_q
    max_q_len = (int((b["cu_seqlens_q"][1:] - b["cu_seqlens_q"][:-1]).max()) if pass_max_q_len
                 else None)
    out = paged_attention(*paged_args(b), max_q_len=max_q_len, num_splits=num_splits,
                          mask=b["mask"])
    assert_close(out, reference(b))


@pytest.mark.kernel
@settings(max_examples=examples(18), deadline=None)
@given(paged_batches(dtypes=[torch.float32], max_seqs=2, max_seq_len=300, decode_only=True,
                     cache_dtypes=(None, None, *FP8), masks=True),
       st.integers(2, 64))
def test_split_kv_agrees_with_one_split(b, num_splits):
    # the split path must give the same result as one program per sequence, including
    # splits left empty because the context (or the window) is shorter than num_splits tiles
    # (8-bit caches too)
    one = paged_attention(*paged_args(b), max_q_len=1, num_splits=1, mask=b["mask"],
                          **scales(b))
    split = paged_attention(*paged_args(b), max_q_len=1, num_splits=num_splits,
                            mask=b["mask"], **scales(b))
    assert_close(split, one)


@pytest.mark.kernel
@settings(max_examples=examples(8), deadline=None)
@given(paged_batches(dtypes=[torch.float32, torch.float16, torch.bfloat16], min_seqs=8, max_seqs=24,
                     max_seq_len=60, long_prefills=2, head_dims=(16, 32, 64, 80),
                     cache_dtypes=(None, None, *FP8), masks=True),
       st.integers(1, 64))
def test_triton_mixed_batches_many_decodes_few_long_prefills(b, num_splits):
    # the engine's usual step: the decode launch (split or not) and the prefill launch, whose
    # query tiles are numbered across sequences, each take their own rows and only those
    max_q_len = int(b["cu_seqlens_q"].diff().max())
    out = paged_attention(*paged_args(b), max_q_len=max_q_len, num_splits=num_splits,
                          mask=b["mask"], **scales(b))
    assert_close(out, reference(b))


@pytest.mark.kernel
@settings(max_examples=examples(200), deadline=None)
@given(paged_batches(dtypes=[torch.float64, torch.float32, torch.bfloat16], masks=True),
       st.sampled_from([kernel.CHUNK_BYTES, 0, 1 << 12, 1 << 15]))
def test_torch_path_matches_naive(b, chunk_bytes):
    # small chunk budgets cut the decode and short groups into many calls (0: one sequence each)
    default, kernel.CHUNK_BYTES = kernel.CHUNK_BYTES, chunk_bytes
    try:
        assert_close(paged_attention_torch(*paged_args(b), mask=b["mask"]), reference(b))
    finally:
        kernel.CHUNK_BYTES = default


@pytest.mark.kernel
@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 300)), min_size=1, max_size=40),
       st.integers(0, 1 << 16), st.integers(1, 4), masks_of(320))
def test_torch_path_plan_calls_stay_within_chunk_bytes(seqs, chunk_bytes, block_size, mask):
    # (new tokens, earlier context) per sequence: every new token is in exactly one call, a call
    # gathers at most CHUNK_BYTES of K/V unless it holds one sequence, and pads to no span
    # longer than its own sequences' longest; a span is what the sequence's new tokens see,
    # under its mask: nothing outside the mask is gathered
    q_lens = [q for q, _ in seqs]
    lens = [q + c for q, c in seqs]
    seen = [keys_seen(mask, n, q) for n, q in zip(lens, q_lens)]
    spans = list(map(len, seen))
    max_blocks = -(-max(lens) // block_size)
    tables = torch.arange(len(seqs) * max_blocks, dtype=torch.int32).view(len(seqs), -1)
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    token_bytes = 24
    default, kernel.CHUNK_BYTES = kernel.CHUNK_BYTES, chunk_bytes
    try:
        plan = kernel._attention_plan(tables, torch.tensor(lens, dtype=torch.int32), cu,
                                      block_size, 2, True, token_bytes, mask)
    finally:
        kernel.CHUNK_BYTES = default
    written, decode_calls = [], []
    for rows, slots, (B, Q, L), hidden, kept, out_rows in plan["calls"]:
        order = torch.searchsorted(cu, rows.view(B, Q)[:, 0], right=True) - 1  # call's sequences
        seqs_in = sorted(set(order.tolist()))
        assert len(seqs_in) == B
        assert B == 1 or B * L * token_bytes <= chunk_bytes
        assert L == max(spans[i] for i in seqs_in) and Q == max(q_lens[i] for i in seqs_in)
        # each row gathers its own sequence's slots (tables: block i * max_blocks + j), of every
        # position its new tokens see and no other
        seq, pos = slots.view(B, L).div(max_blocks * block_size, rounding_mode="floor"), \
            slots.view(B, L) % (max_blocks * block_size)
        assert torch.equal(seq, order[:, None].expand(B, L))
        assert [set(row) for row in pos.tolist()] == [seen[i] for i in order.tolist()]
        # a boolean mask only where something is hidden: padding, later tokens of a chunk, or
        # keys a later token no longer sees
        assert (hidden is None) == (Q == 1 and all(spans[i] == L for i in seqs_in))
        written += out_rows.tolist()
        decode_calls += [(seqs_in, L)] if Q == 1 else []
    assert sorted(written) == list(range(sum(q_lens)))
    # one call of every sequence, all with its Q new tokens, takes q as it is (no index ops)
    calls = plan["calls"]
    assert plan["whole"] == (len(calls) == 1 and calls[0][2][0] == len(seqs)
                             and len(set(q_lens)) == 1)
    # shortest spans first, and no more calls than the budget needs: a decode call could not
    # also take the next one's shortest sequence
    for (seqs_in, L), (after, _) in zip(decode_calls, decode_calls[1:]):
        shortest = min(spans[i] for i in after)
        assert L <= shortest and (len(seqs_in) + 1) * shortest * token_bytes > chunk_bytes


@pytest.mark.kernel
@settings(max_examples=examples(8), deadline=None)
@given(paged_batches(dtypes=[torch.float32], max_seqs=6, head_dims=(64,), block_sizes=(16,),
                     groups=(1, 3), masks=True, poison_unseen=False))
def test_flex_decode_matches_naive(b):
    # the opt-in gather-free decode (flex_attention compiled by Inductor, one compile for these
    # shapes), in batches of decodes, prefills and chunked prefills with mixed lengths and GQA
    out = paged_attention_torch(*paged_args(b), decode_attention=kernel.paged_attention_flex,
                                mask=b["mask"])
    assert_close(out, reference(b))


@pytest.mark.kernel
@settings(max_examples=examples(4), deadline=None)
@given(paged_batches(dtypes=[torch.float32], max_seqs=4, head_dims=(64,), block_sizes=(16,),
                     groups=(1, 3), masks=True, poison_unseen=False))
def test_flex_decode_is_right_when_it_runs_eagerly(b):
    # past Dynamo's recompile limit (8 compiles of one function in a process), flex_attention
    # runs uncompiled, where its block lists skip nothing: the mask alone must hide every block
    # a sequence does not see (it once did not, and a suite whose earlier tests had compiled
    # flex eight times got another sequence's keys)
    from torch.nn.attention.flex_attention import flex_attention
    q, k_cache, v_cache, *rest = paged_args(b)
    # uncompiled, it weighs every slot's V, if only by zero: unwritten slots hold zeros, as the
    # engine's cache does, not the strategy's NaNs (0 x NaN would spoil every output)
    k_cache, v_cache = k_cache.nan_to_num(0), v_cache.nan_to_num(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel, "_flex", flex_attention)
        out = paged_attention_torch(q, k_cache, v_cache, *rest,
                                    decode_attention=kernel.paged_attention_flex,
                                    mask=b["mask"])
    assert_close(out, reference(b))


@pytest.mark.kernel
@settings(max_examples=examples(50), deadline=None)
@given(
    st.integers(1, 6), st.integers(1, 5), st.integers(1, 3), st.sampled_from([16, 80]),
    st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(),
    st.sampled_from([None, None, *FP8]), st.data(),
)
def test_store_kv_writes_exactly_the_given_slots(
    num_blocks, block_size, n_kv_head, head_dim, dtype, use_triton, cache_dtype, data
):
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), max_size=num_slots, unique=True))
    slots = [s if data.draw(st.booleans()) else -1 for s in slots]  # -1: skip the token
    slot_mapping = torch.tensor(slots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])),
                                device=DEVICE)
    # k and v as the model makes them: views into one fused qkv tensor
    qkv = torch.randn(len(slots), 3, n_kv_head, head_dim, device=DEVICE).to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    k_cache = torch.full((num_blocks, block_size, n_kv_head, head_dim), float("nan"), device=DEVICE,
                         dtype=dtype).to(cache_dtype or dtype)
    v_cache = k_cache.clone()
    # an 8-bit cache: scales that put k, v anywhere in fp8's range, up to saturation
    kv_scales = {} if cache_dtype is None else {
        name: kernel.kv_scales(x.abs().amax() if len(x) else torch.ones(()),
                               cache_dtype) * data.draw(st.sampled_from([0.1, 0.5, 1.0, 30.0]))
        for name, x in (("k_scale", k), ("v_scale", v))}
    (store_kv if use_triton else kernel.store_kv_torch)(k, v, k_cache, v_cache, slot_mapping,
                                                       **kv_scales)
    k_want, v_want = (kernel.quantize(x, kv_scales.get(n), k_cache.dtype).view(torch.uint8)
                      for x, n in ((k, "k_scale"), (v, "v_scale")))  # the bytes (bitwise: fp8)
    written = torch.zeros(num_slots, dtype=torch.bool, device=DEVICE)
    for i, s in enumerate(slots):
        if s >= 0:
            written[s] = True
            assert torch.equal(k_cache.flatten(0, 1)[s].view(torch.uint8), k_want[i]) and \
                torch.equal(v_cache.flatten(0, 1)[s].view(torch.uint8), v_want[i])
    assert k_cache.flatten(0, 1)[~written].float().isnan().all() and \
        v_cache.flatten(0, 1)[~written].float().isnan().all()


@pytest.mark.kernel
@settings(max_examples=examples(30), deadline=None)
@given(st.integers(1, 40), st.integers(0, 40), st.sampled_from(["sliding", "chunked"]),
       st.integers(1, 90), st.sampled_from([1, 4, 5]))
def test_every_path_sees_the_keys_transformers_masks_see(q_len, cached, kind, size, block_size):
    # which keys a new token sees, read off its attention weights: with q = 0 they are uniform
    # over the keys seen, and v = one-hot positions returns them; against transformers' own
    # mask functions, which start a window or a chunk at its exact place (past the context too)
    masking_utils = pytest.importorskip("transformers.masking_utils")
    seq_len = q_len + cached
    q_pos, k_pos = torch.arange(cached, seq_len)[:, None], torch.arange(seq_len)[None]
    if kind == "sliding":
        mask = kernel.Mask(window=size)
        rule = masking_utils.sliding_window_causal_mask_function(size)
    else:  # Llama 4's, with no left padding
        mask = kernel.Mask(chunk=size)
        rule = masking_utils.chunked_causal_mask_function(size, torch.zeros(1, dtype=torch.long))
    expected = rule(0, 0, q_pos, k_pos)
    assert torch.equal(mask.visible(q_pos, k_pos), expected)
    q = torch.zeros(q_len, 1, 128)
    kv = torch.eye(seq_len, 128)[:, None]                                        # (L, 1, 128)
    cu, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([seq_len]).int()
    num_blocks = -(-seq_len // block_size)
    cache = torch.zeros(num_blocks * block_size, 1, 128)
    cache[:seq_len] = kv
    cache = cache.view(num_blocks, block_size, 1, 128)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    paged = (q.to(DEVICE), cache.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), lens.to(DEVICE),
             cu.to(DEVICE), 1.0)
    for name, out in [("naive", naive_attention(q, kv, kv, cu, lens, 1.0, mask=mask)),
                      ("torch", paged_attention_torch(*paged, mask=mask)),
                      ("triton", paged_attention(*paged, mask=mask))]:
        assert torch.equal(out[:, 0, :seq_len].cpu() > 0, expected), name


@contextlib.contextmanager
def interpreter_reads():
    """Under Triton's interpreter, record every address a kernel's loads read (the lanes their
    masks keep) and count its tl.dot calls: what it reads, and how many K/V tiles it visits."""
    from triton.runtime import interpreter
    builder, record = interpreter.interpreter_builder, SimpleNamespace(addresses=[], dots=0)
    load, dot = builder.create_masked_load, builder.create_dot

    def recorded_load(ptrs, mask, *args):
        record.addresses.append(ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)])
        return load(ptrs, mask, *args)

    def counted_dot(*args):
        record.dots += 1
        return dot(*args)
    builder.create_masked_load, builder.create_dot = recorded_load, counted_dot
    try:
        yield record
    finally:
        del builder.create_masked_load, builder.create_dot  # the class's own again


def read_slots(addresses, tensor):
    """Which rows of tensor, flattened over its first two dims, the addresses read: for a cache,
    the slots (block * block_size + offset)."""
    base, size = tensor.data_ptr(), tensor.element_size()
    ours = addresses[(addresses >= base) & (addresses < base + tensor.numel() * size)]
    return set(((ours - base) // size // math.prod(tensor.shape[2:])).tolist())


@pytest.mark.kernel
@pytest.mark.skipif(not kernel.INTERPRETED, reason="reads are recorded in Triton's interpreter")
@settings(max_examples=examples(16), deadline=None)
@given(paged_batches(dtypes=[torch.float16], max_seqs=3, max_seq_len=300, head_dims=(16,),
                     groups=(1, 4), masks=True),
       st.sampled_from([1, 2, 3]))
def test_triton_never_reads_a_block_outside_the_mask(b, num_splits):
    # masking a score is not skipping its block: the kernel must not read the K/V of a position
    # no new token of the sequence sees, nor the block-table entry of a block without one (a
    # freed block's placeholder), nor visit a tile that holds no key any of its rows sees
    with interpreter_reads() as reads:
        out = paged_attention(*paged_args(b), num_splits=num_splits, mask=b["mask"])
    assert_close(out, reference(b))
    mask, bs = b["mask"] or kernel.Mask(), b["k_cache"].shape[1]
    lens, cu = b["seq_lens"].tolist(), b["cu_seqlens_q"].tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    seen = [keys_seen(mask, n, q) for n, q in zip(lens, q_lens)]
    tables = b["block_tables"].tolist()
    slots = {tables[i][t // bs] * bs + t % bs for i in range(len(lens)) for t in seen[i]}
    addresses = np.concatenate(reads.addresses)
    for cache in (b["k_cache"], b["v_cache"]):
        assert read_slots(addresses, cache) <= slots
    max_blocks = b["block_tables"].shape[1]
    entries = read_slots(addresses, b["block_tables"].view(-1, 1, 1))  # table row * width + col
    assert all({t // bs for t in seen[e // max_blocks]} >= {e % max_blocks} for e in entries)
    # tiles: a program visits its first row's sinks, then from its first row's first key to
    # its last row's position
    n_kv_head, group = b["k_cache"].shape[2], b["q"].shape[1] // b["k_cache"].shape[2]
    tiles = 0
    for n, q_len in zip(lens, q_lens):
        config = kernel.kernel_config(torch.float16, 16, group, bs, decode=q_len == 1)
        for first in range(0, q_len, config["BLOCK_Q"]):
            end = n - q_len + min(first + config["BLOCK_Q"], q_len)
            start = mask.first_seen(n - q_len + first)
            tiles += -(-(min(mask.sink, start) + end - start) // config["BLOCK_N"])
    assert reads.dots == 2 * n_kv_head * tiles  # q k^T and p v, per tile


@st.composite
def selected_batches(draw, every_block=False, **kwargs):
    """A batch of full attention (paged_batches' kwargs) read through per-head block tables, as
    a read policy gives them: each (sequence, KV head) keeps a random subset of its blocks, in
    order, always with every block that holds a new token (a decode's last, partly filled one),
    or all of them (every_block: each head repeats its sequence's table). Adds "tables"
    [S, n_kv_head, W] (-1 past each head's blocks), "lens" [S, n_kv_head] (its blocks' tokens)
    and "keep" [sum(seq_lens), n_kv_head] for naive_attention; the K/V of a (block, KV head)
    that no table lists are NaN in the cache, and those a head does not keep in the contiguous
    copy, so reading one spoils the output."""
    b = draw(paged_batches(**kwargs))
    num_blocks, bs, n_kv_head = b["k_cache"].shape[:3]
    lens, cu, tables = b["seq_lens"].tolist(), b["cu_seqlens_q"].tolist(), b["block_tables"]
    rows, row_lens, keep = [], [], []
    listed = torch.zeros(num_blocks, n_kv_head, dtype=torch.bool)  # by some head's table
    for i, n in enumerate(lens):
        first_new = (n - (cu[i + 1] - cu[i])) // bs  # the first block with a new token
        kept = torch.zeros(n, n_kv_head, dtype=torch.bool)                    # (n, nkv)
        for h in range(n_kv_head):
            chosen = [j for j in range(-(-n // bs))
                      if every_block or j >= first_new or draw(st.booleans())]
            blocks = tables[i, chosen].cpu()
            rows.append(blocks.tolist())
            row_lens.append(sum(min(bs, n - j * bs) for j in chosen))
            listed[blocks.long(), h] = True
            for j in chosen:
                kept[j * bs:(j + 1) * bs, h] = True
        keep.append(kept)
    width = max(map(len, rows)) + 1  # a -1 column of padding
    per_head = [r + [-1] * (width - len(r)) for r in rows]
    keep = torch.cat(keep).to(DEVICE)                                         # (sum(n), nkv)
    unlisted = ~listed.to(DEVICE)[:, None, :, None]                           # (nb, 1, nkv, 1)
    return dict(
        b, tables=torch.tensor(per_head, dtype=torch.int32, device=DEVICE).view(
            len(lens), n_kv_head, width),
        lens=torch.tensor(row_lens, dtype=torch.int32, device=DEVICE).view(len(lens), n_kv_head),
        keep=keep, k_cache=poisoned(b["k_cache"], unlisted),
        v_cache=poisoned(b["v_cache"], unlisted),
        k=poisoned(b["k"], ~keep[..., None]), v=poisoned(b["v"], ~keep[..., None]))


def poisoned(x, where):
    """x with NaN where `where` holds (broadcast); for an 8-bit cache, which masked_fill does not
    take, fp8's NaN byte (0x7f in e4m3fn and e5m2 alike)."""
    if x.dtype in FP8:
        return x.view(torch.uint8).masked_fill(where, 0x7F).view(x.dtype)
    return x.masked_fill(where, float("nan"))


SELECTED_BLOCKS = (1, 3, 4, 5, 8)  # blocks smaller than a context, so that a head has some to skip


def selected_args(b):
    """paged_attention's arguments with a selected batch's per-head tables and lengths."""
    return (b["q"], b["k_cache"], b["v_cache"], b["tables"], b["lens"], b["cu_seqlens_q"],
            b["scale"])


@pytest.mark.kernel
@settings(max_examples=examples(12), deadline=None)
@given(selected_batches(every_block=True, dtypes=[torch.float32, torch.float16], max_seqs=3,
                        max_seq_len=100, head_dims=(16, 32), groups=(1, 4)),
       st.sampled_from([1, 2, 3, 7]))
def test_per_head_tables_that_repeat_the_shared_one_give_the_same_output(b, num_splits):
    # a table per KV head, each its sequence's own, is the shared table read once per head: the
    # same numbers, bit for bit, on the Triton launches (decode, split, prefill) and the torch path
    for attend, kwargs in ((paged_attention, dict(num_splits=num_splits)),
                           (paged_attention_torch, {})):
        shared = attend(*paged_args(b), **kwargs)
        assert torch.equal(attend(*selected_args(b), **kwargs), shared), attend.__name__


@pytest.mark.kernel
@settings(max_examples=examples(20), deadline=None)
@given(selected_batches(dtypes=[torch.float32, torch.float16, torch.bfloat16], max_seqs=4,
                        max_seq_len=120, head_dims=(16, 64, 80), block_sizes=SELECTED_BLOCKS,
                        cache_dtypes=(None, None, *FP8)),
       st.sampled_from([None, 1, 2, 3, 9]))
def test_triton_reads_a_selection_as_naive_attention_over_its_keys(b, num_splits):
    # decodes read their heads' selections; prefills and chunks their new tokens' blocks and a
    # selection of the blocks before: each head attends to its kept keys alone (8-bit caches too)
    out = paged_attention(*selected_args(b), num_splits=num_splits, **scales(b))
    assert_close(out, reference(b))


@pytest.mark.kernel
@settings(max_examples=examples(60), deadline=None)
@given(selected_batches(dtypes=[torch.float64, torch.float32, torch.bfloat16],
                        block_sizes=SELECTED_BLOCKS, cache_dtypes=(None, None, *FP8)),
       st.sampled_from([kernel.CHUNK_BYTES, 0, 1 << 12]))
def test_torch_path_reads_a_selection_as_naive_attention_over_its_keys(b, chunk_bytes):
    default, kernel.CHUNK_BYTES = kernel.CHUNK_BYTES, chunk_bytes
    try:
        assert_close(paged_attention_torch(*selected_args(b), **scales(b)), reference(b))
    finally:
        kernel.CHUNK_BYTES = default


@pytest.mark.kernel
@pytest.mark.skipif(not kernel.INTERPRETED, reason="reads are recorded in Triton's interpreter")
@settings(max_examples=examples(15), deadline=None)
@given(selected_batches(dtypes=[torch.float16], max_seqs=3, max_seq_len=200, head_dims=(16,),
                        groups=(1, 4), block_sizes=SELECTED_BLOCKS),
       st.sampled_from([1, 2, 3]))
def test_triton_never_reads_a_block_its_heads_table_leaves_out(b, num_splits):
    # a KV head reads the K/V of the blocks its own table lists and no other (not another
    # head's), only the table entries of those blocks, and visits only the tiles of their keys
    with interpreter_reads() as reads:
        out = paged_attention(*selected_args(b), num_splits=num_splits)
    assert_close(out, reference(b))
    bs, n_kv_head = b["k_cache"].shape[1:3]
    tables, lens, cu = b["tables"].tolist(), b["lens"].tolist(), b["cu_seqlens_q"].tolist()
    kept = {(block * bs + o) * n_kv_head + h  # rows of the caches' (slot, KV head) pairs
            for i, heads in enumerate(tables) for h, table in enumerate(heads)
            for j, block in enumerate(table[:-(-lens[i][h] // bs)])
            for o in range(min(bs, lens[i][h] - j * bs))}
    addresses = np.concatenate(reads.addresses)
    for cache in (b["k_cache"], b["v_cache"]):
        assert read_slots(addresses, cache.view(-1, 1, cache.shape[3])) <= kept
    width = b["tables"].shape[2]
    entries = read_slots(addresses, b["tables"].view(-1, 1, 1))  # (row * nkv + head) * W + col
    assert all(e % width < -(-lens[e // width // n_kv_head][e // width % n_kv_head] // bs)
               for e in entries)
    group = b["q"].shape[1] // n_kv_head
    tiles = 0
    for i, heads in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        config = kernel.kernel_config(torch.float16, 16, group, bs, decode=q_len == 1)
        for n in heads:
            for first in range(0, q_len, config["BLOCK_Q"]):
                end = n - q_len + min(first + config["BLOCK_Q"], q_len)
                tiles += -(-end // config["BLOCK_N"])
    assert reads.dots == 2 * tiles  # q k^T and p v, per tile of each head's own keys


@pytest.mark.kernel
def test_per_head_tables_take_full_attention_their_own_lengths_and_no_flex():
    q, k_cache, v_cache, tables, lens, cu, scale = small_batch()
    per_head = tables[:, None].repeat(1, 2, 1)                                # (S, nkv, W)
    per_head_lens = lens[:, None].repeat(1, 2)                                # (S, nkv)
    for attend in (paged_attention, paged_attention_torch):
        with pytest.raises(AssertionError, match="they take full attention"):
            attend(q, k_cache, v_cache, per_head, per_head_lens, cu, scale,
                   mask=kernel.Mask(window=4))
        with pytest.raises(AssertionError, match="with seq_lens"):
            attend(q, k_cache, v_cache, per_head, lens, cu, scale)
        with pytest.raises(AssertionError, match=r"n_kv_head \(2\)"):
            attend(q, k_cache, v_cache, per_head[:, :1], per_head_lens[:, :1], cu, scale)
        with pytest.raises(AssertionError, match="seq_lens is \\[num_seqs\\]"):
            attend(q, k_cache, v_cache, tables, per_head_lens, cu, scale)
        attend(q, k_cache, v_cache, per_head, per_head_lens, cu, scale, mask=kernel.Mask())
    with pytest.raises(ValueError, match="no per-head block tables"):
        paged_attention_torch(q, k_cache, v_cache, per_head, per_head_lens, cu, scale,
                              decode_attention=kernel.paged_attention_flex)
    backends = kernel.ATTENTION_BACKENDS
    assert [name for name in backends if backends[name].per_head_tables] == ["triton", "torch"]


def small_batch(head_dim=64, dtype=torch.float32):
    q = torch.randn(3, 4, head_dim, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(4, 4, 2, head_dim, device=DEVICE, dtype=dtype)
    block_tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32, device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    return [q, k_cache, k_cache.clone(), block_tables, seq_lens, cu_seqlens_q, head_dim**-0.5]


@pytest.mark.kernel
def test_triton_matches_torch_path_on_a_fixed_batch():
    args = small_batch()  # a chunk of 2 new tokens over 6, and a decode over 3 with -1 padding
    assert_close(paged_attention(*args), paged_attention_torch(*args))


@pytest.mark.kernel
def test_torch_path_works_inside_and_outside_inference_mode():
    # its reused gather buffers must not leak inference tensors into normal autograd mode
    args = small_batch()
    with torch.inference_mode():
        inside = paged_attention_torch(*args)
    torch.testing.assert_close(paged_attention_torch(*args), inside)


def with_arg(i, value):
    return lambda args: args[:i] + [value(args[i])] + args[i + 1:]


@pytest.mark.kernel
@pytest.mark.parametrize("break_it, message", [
    (lambda args: small_batch(head_dim=48), "head_dim 48 not supported"),
    (with_arg(0, lambda q: torch.randn(3, 4, 32, device=DEVICE)), "head_dim of q"),
    (with_arg(0, lambda q: q.half()), "dtypes differ"),
    (lambda args: small_batch(dtype=torch.float64), "unsupported dtype"),
    (with_arg(0, lambda q: q[:, :3]), "multiple of n_kv_head"),
    (with_arg(2, lambda v_cache: v_cache[:, :2]), "v_cache"),
    (with_arg(2, lambda v_cache: v_cache.transpose(0, 1).contiguous().transpose(0, 1)),
     "same strides"),
    (with_arg(3, lambda block_tables: block_tables.long()), "block_tables must be int32"),
    (with_arg(3, lambda block_tables: block_tables[:1]), "block_tables is"),
    (with_arg(5, lambda cu_seqlens_q: cu_seqlens_q[:2]), "cu_seqlens_q is"),
    (with_arg(0, lambda q: q[0]), "q is"),
])
def test_launcher_rejects_bad_inputs(break_it, message):
    with pytest.raises(AssertionError, match=message):
        paged_attention(*break_it(small_batch()))


@pytest.mark.kernel
@pytest.mark.parametrize("mask, message", [
    (dict(window=0), "Mask.window must be None or an int in 1.."),
    (dict(window=2.5), "Mask.window"), (dict(window=True), "Mask.window"),
    (dict(chunk=2**31), "Mask.chunk must be None or an int in 1.."),
    (dict(chunk=-1), "Mask.chunk"), (dict(sink=None), "Mask.sink must be an int in 0.."),
    (dict(sink=-1), "Mask.sink"),
])
def test_every_path_rejects_a_mask_that_is_not_counts_of_positions(mask, message):
    for attend in (paged_attention, paged_attention_torch):
        with pytest.raises(AssertionError, match=message):
            attend(*small_batch(), mask=kernel.Mask(**mask))
    with pytest.raises(AssertionError, match="mask must be a kernel.Mask"):
        paged_attention(*small_batch(), mask=4)


class TwoChunkMask(kernel.Mask):
    """A fork's rule, which no window, chunk and sinks express: a query sees its own chunk and
    the one before it (sinks as Mask's; no window)."""

    def first_seen(self, p):
        start = p - p % self.chunk - self.chunk
        return start.clamp(min=0) if isinstance(p, torch.Tensor) else max(start, 0)

    def reach(self, context):  # admission's bound: two chunks
        return min(context, self.sink + 2 * self.chunk)


class NamedWindow(kernel.Mask):
    """A fork's subclass that keeps Mask's rule (it adds a name) and says so: the kernels' rule
    on its kernel_args is its own."""
    kernel_args = kernel.Mask.kernel_args

    def __str__(self):
        return f"a window of {self.window}"


def two_chunk_masks(longest):
    """TwoChunkMasks of a chunk of 1, a few tokens, or up to past a context of longest, with
    sinks or without."""
    size = st.one_of(st.just(1), st.integers(2, 12), st.integers(1, 2 * longest))
    return st.tuples(size, st.sampled_from([0, 0, 1, 5])).map(
        lambda cs: TwoChunkMask(chunk=cs[0], sink=cs[1]))


@pytest.mark.kernel
@settings(max_examples=examples(60), deadline=None)
@given(paged_batches(dtypes=[torch.float32], max_seq_len=60, head_dims=(16, 32),
                     masks=two_chunk_masks))
def test_a_mask_subclass_runs_on_the_torch_path_and_the_kernels_refuse_it(b):
    """The torch path calls a mask's own methods: it reads what the fork's rule shows (the
    strategy poisons the rest with NaN) and matches naive attention. The Triton and flex kernels
    read kernel_args alone, so their launchers refuse the mask, naming its class."""
    assert_close(paged_attention_torch(*paged_args(b), mask=b["mask"]), reference(b))
    assert not kernel.kernels_follow(b["mask"]) and b["mask"] != kernel.Mask(*b["mask"])
    with pytest.raises(AssertionError, match="TwoChunkMask .*the Triton kernel"):
        paged_attention(*paged_args(b), mask=b["mask"])
    q, k_cache, v_cache, tables, seq_lens, _, scale = paged_args(b)
    with pytest.raises(AssertionError, match="TwoChunkMask .*flex attention"):
        kernel.paged_attention_flex(q[:len(seq_lens)], k_cache, v_cache, tables, seq_lens, scale,
                                    mask=b["mask"])


@pytest.mark.kernel
@settings(max_examples=examples(6), deadline=None)
@given(paged_batches(dtypes=[torch.float32], max_seqs=3, max_seq_len=40, head_dims=(16,),
                     masks=lambda longest: st.integers(1, longest).map(
                         lambda n: NamedWindow(window=n))))
def test_a_mask_subclass_that_declares_kernel_args_runs_on_triton(b):
    """A subclass whose own body defines kernel_args: Triton takes it and matches naive
    attention, which calls its (Mask's) methods."""
    assert kernel.kernels_follow(b["mask"])
    out = paged_attention(*paged_args(b), mask=b["mask"])
    assert_close(out, reference(b))


@pytest.mark.kernel
@given(st.integers(1, 512), st.integers(1, 64), st.integers(1, 2**17), st.integers(1, 5000))
def test_split_count_fills_the_gpu_once(num_seqs, n_kv_head, max_context, resident):
    splits = kernel.split_count(num_seqs, n_kv_head, max_context, resident)
    assert 1 <= splits <= kernel.MAX_SPLITS and splits & (splits - 1) == 0, "a power of two"
    if splits > 1:  # only to fill idle resident slots, never past them, and >= 256 keys a split
        assert num_seqs * n_kv_head * splits <= resident and max_context // splits >= 256
    else:  # a second wave of splits would fit nowhere, or the context is too short to split
        assert num_seqs * n_kv_head * 2 > resident or max_context < 512


@pytest.mark.kernel
def test_programs_per_sm_matches_cuda_occupancy():
    # CUDA's occupancy rules: 64K registers a SM, allocated per warp in units of 256
    assert kernel.programs_per_sm(128, 0, 4, 233472, 2048) == 4      # 65536 / (128 * 128)
    assert kernel.programs_per_sm(80, 0, 4, 233472, 2048) == 6       # 80 regs x 32 = 2560 per warp
    assert kernel.programs_per_sm(24, 0, 4, 233472, 2048) == 16      # threads: 2048 / 128
    assert kernel.programs_per_sm(30, 40000, 4, 102400, 1536) == 2   # shared memory
    assert kernel.programs_per_sm(16, 0, 1, 233472, 2048) == 32      # at most 32 blocks


@pytest.mark.kernel
def test_grid_stays_within_cuda_limits():
    # dims 1 and 2 of a CUDA grid stop at 65,535: an MQA prefill of 2**16 tokens x 64 heads must
    # not put its query tiles there (q broadcast with stride 0: the launches are only captured)
    import bench
    n = 2**16
    q = torch.zeros(1, 1, 16, dtype=torch.float16).expand(n, 64, 16)
    k_cache = torch.zeros(n // 16, 16, 1, 16, dtype=torch.float16)
    block_tables = torch.arange(n // 16, dtype=torch.int32)[None]
    args = (q, k_cache, k_cache, block_tables, torch.tensor([n], dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32), 0.25)
    for fn, grid, _, _ in bench.capture_launches(args, max_q_len=n, num_splits=64):
        assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), (fn.__name__, grid)
    grids = [grid for _, grid, _, _ in bench.capture_launches(args, max_q_len=n)]
    assert max(grid[0] for grid in grids) >= n, "a tile for each token"


def run_without_interpreter(code, timeout=600):
    """Run code in a fresh Python where @triton.jit gives Triton's JIT, not its interpreter (the
    compiler needs no GPU to build one); returns its stdout."""
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.kernel
def test_kernel_compiles_for_a_gpu():
    # the interpreter never runs Triton's compiler. bench.py --kernel --aot captures the
    # launcher's real arguments for engine-shaped steps, lets Triton's JIT specialize them as a
    # launch would and compile them for sm_80, sm_86 and sm_90, and reads the binaries: here a
    # subset that still takes every target, dtype, head size, group, block size and launch (a
    # prefill with sinks, a binary of its own, at one head size each; a decode through per-head
    # tables, the same binaries), and every 8-bit cache each target supports
    import json
    code = "import json, bench; print(json.dumps(bench.aot_rows(bench.aot_matrix(full=False), 2)))"
    if FAST:  # one head size with every target, dtype and launch; sm_90's two 8-bit caches
        code = ("import json, bench, torch; print(json.dumps(bench.aot_rows([c for c in "
                "bench.aot_matrix(full=False) if (c[2] == 64 or c[5] in ('prefill', "
                "'split decode', 'selected decode') if len(c) == 6 else c[0] == 90 and "
                "c[1] == torch.float16)], 2)))")
    rows = json.loads(run_without_interpreter(code))
    launches = Counter((r["sm"], r["dtype"], r["head_dim"], r["launch"]) for r in rows
                       if r["cache"] == r["dtype"])
    fp8 = {(r["sm"], r["cache"], r["dtype"], r["launch"]) for r in rows if r["cache"] != r["dtype"]}
    sinks = {(sm, dtype, launch) for sm, dtype, _, launch in launches if "sinks" in launch}
    assert sinks == {(sm, dtype, f"{launch}, sinks") for sm in (80, 86, 90)
                     for dtype in ("float16", "bfloat16")
                     for launch in ("decode", "split decode", "prefill")}
    launches = Counter(k for k in launches if "sinks" not in k[3])
    selected = {(r["sm"], r["dtype"], r["launch"]) for r in rows if r["step"] == "selected decode"}
    assert selected == {(sm, dtype, launch) for sm in (80, 86, 90) for dtype in ("float16",
                        "bfloat16") for launch in ("split decode", "merge")}, selected
    if FAST:
        assert {k for k in launches if k[2] == 64} == {
            (sm, dtype, 64, launch) for sm in (80, 86, 90) for dtype in ("float16", "bfloat16")
            for launch in ("decode", "split decode", "merge", "prefill")}
        assert fp8 == {(90, cache, "float16", launch) for cache in ("float8_e5m2", "float8_e4m3fn")
                       for launch in ("split decode", "merge", "prefill", "store")}, fp8
    else:
        assert len(launches) == 3 * 2 * len(kernel.HEAD_DIMS) * 4, \
            "a target, dtype, head size or launch is missing"
        # 8-bit caches: e4m3 on sm_90 (Triton has it from sm_89), e5m2 on every target, each
        # with both query dtypes, the store that quantizes and every attention launch of a
        # mixed step
        assert fp8 == {(sm, cache, dtype, launch) for sm, cache in [
            (80, "float8_e5m2"), (86, "float8_e5m2"), (90, "float8_e5m2"), (90, "float8_e4m3fn")]
            for dtype in ("float16", "bfloat16")
            for launch in ("split decode", "merge", "prefill", "store")}, fp8
        assert len({r["head_dim"] for r in rows if r["cache"] != r["dtype"]}) >= 4
    for r in rows:
        where = "sm_{sm} {dtype} cache {cache} head_dim {head_dim} group {group} {launch}".format(
            **r)
        assert r["fits"], f"{where}: {r['shared']} bytes of shared memory do not fit"
        assert r["spills"] == 0, f"{where}: {r['spills']} spills ({r['regs']} registers)"
        if r["launch"] not in ("merge", "store"):  # tensor cores on the 16-bit dtype: no tf32,
            # no fp16 for bf16 (an 8-bit cache is converted to q's dtype before the dots)
            assert r["mma"] and all(("BF16" in m) == (r["dtype"] == "bfloat16") and "TF32" not in m
                                    for m in r["mma"]), f"{where}: MMA {r['mma']}"


def jit_keys_of_steps(seed=0, steps=40):
    """The JIT cache keys (sm_90) of the launches of random engine steps of one model: many
    sequences or few, short or long tables, decode, split decode, prefill and mixed, in layers
    of every kind of mask: full attention, windows, chunks and sinks (1, a multiple of 16 or
    not), and of full attention read through per-head tables (a read policy's selection)."""
    import bench
    rng, keys = random.Random(seed), {}
    for _ in range(steps):
        q_lens = [rng.choice([1, 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 40))]
        contexts = [n + rng.randint(0, rng.choice([100, 3000, 30000])) for n in q_lens]
        args = bench.engine_step(torch.float16, 128, 4, 16, q_lens, contexts)
        resident = rng.choice([132, 1000])  # an H100's SMs, or several programs on each
        num_splits = kernel.split_count(len(q_lens), 2, args[3].shape[1] * 16, resident)
        size = rng.choice([None, 1, 16, 100, 4096])
        mask = rng.choice([None, kernel.Mask(window=size), kernel.Mask(chunk=size),
                           kernel.Mask(window=size, sink=rng.choice([1, 4, 32]))])
        if mask is None and rng.random() < 0.5:  # each decode's heads read 1 to 32 blocks
            args = bench.select_blocks(args, rng.choice([1, 2, 16, 32]), seed=rng.randrange(99))
        launches = bench.capture_launches(args, max_q_len=max(q_lens), num_splits=num_splits,
                                          mask=mask)
        for fn, _, a, k in launches:
            launch = (fn.__name__, k.get("DECODE"), k.get("SPLIT_KV"), k.get("SINKS"))
            keys.setdefault(launch, set()).add(bench.jit_key(90, fn, a, k))
    return {str(launch): len(k) for launch, k in keys.items()}


@pytest.mark.kernel
def test_kernel_compiles_once_per_launch_kind_not_per_step():
    # Triton specializes integers on == 1 and divisibility by 16: a block-table width or a
    # sequence count that does it mid-serving would recompile (seconds) in the middle of a step,
    # and a mask that did would compile per attention kind: a prefill with sinks alone has a
    # binary of its own. Per-head tables (head strides not 0) are the shared tables' binary
    import json
    counts = json.loads(run_without_interpreter(
        "import json, test_nanopaged as t; print(json.dumps(t.jit_keys_of_steps()))"))
    merges = counts.pop(str(("_merge_splits_kernel", None, None, None)))
    assert counts == {str(("_paged_attention_kernel", decode, split, sinks)): 1
                      for decode, split in ((True, False), (True, True), (False, False))
                      for sinks in (False, True)}, counts
    assert merges <= math.log2(kernel.MAX_SPLITS), "the merge compiles once per power of two"


@pytest.mark.kernel
def test_engine_on_the_triton_kernel_generates_like_naive():
    # the engine's GPU path (Triton attention and KV store), here under the interpreter on a CPU
    torch.manual_seed(3)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, vocab_size=32,
                          max_seq_len=64))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10] * 12]
    engine = Engine(model, block_size=4, num_blocks=24, attention_backend="triton",
                    max_num_batched_tokens=10)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == [naive_greedy(model, p, 6) for p in prompts]
    assert_all_blocks_free(engine)
    # speculating: each sequence's verification is a chunk of several new tokens, the draft's
    # cache is written by the Triton store too
    engine = Engine(model, block_size=4, num_blocks=24, attention_backend="triton",
                    speculative_config={"method": "draft", "model": model,
                                        "num_speculative_tokens": 3})
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == [naive_greedy(model, p, 6) for p in prompts]
    assert engine.stats()["num_accepted_tokens"] > 0
    assert_all_blocks_free(engine)


# -----------------------------------------------------------------------------
# 8-bit KV caches (kernel.py's scheme): both attention paths, the error bound, the engine  (-m fp8)
#
# Both attention paths read what an 8-bit cache holds, dequantized to q's dtype, as naive
# attention over those K/V does, within q's dtype's tolerance, and stay within the
# documented bound of the K/V before quantizing; the engine serves requests from it alike.


@pytest.mark.fp8
@settings(max_examples=examples(25), deadline=None)
@given(paged_batches(dtypes=[torch.float32, torch.float16, torch.bfloat16], cache_dtypes=FP8),
       st.sampled_from([None, 1, 2, 3]))
def test_triton_reads_an_8bit_cache_as_naive_attention_over_what_it_holds(b, num_splits):
    out = paged_attention(*paged_args(b), num_splits=num_splits, **scales(b))
    assert_close(out, reference(b))


@pytest.mark.fp8
@settings(max_examples=examples(100), deadline=None)
@given(paged_batches(dtypes=[torch.float64, torch.float32, torch.bfloat16], cache_dtypes=FP8))
def test_torch_path_reads_an_8bit_cache_as_naive_attention_over_what_it_holds(b):
    assert_close(paged_attention_torch(*paged_args(b), **scales(b)), reference(b))


def fp8_error(dtype, scale):
    """(eps, eta): an 8-bit cache stores x as x' with |x' - x| <= eps |x| + eta. Round to nearest:
    half a step, relative 2**-4 (e4m3, 3 mantissa bits) or 2**-3 (e5m2); below the smallest
    normal the step is fixed, and eta is half of it, times the scale."""
    f = torch.finfo(dtype)
    return f.eps / 2, f.smallest_normal * f.eps / 2 * float(scale)


@pytest.mark.fp8
@settings(max_examples=examples(60), deadline=None)
@given(paged_batches(dtypes=[torch.float64, torch.float32], cache_dtypes=FP8))
def test_an_8bit_cache_moves_attention_within_its_documented_bound(b):
    # The bound (README): every K element off by <= eps|k| + eta moves a score q.k * scale by at
    # most delta = scale * sum_d |q_d| (eps max|k_d| + eta); softmax weights then move by a factor
    # within exp(+-delta) each, their sum of changes by <= exp(2 delta) - 1; V's own error adds
    # eps max|v| + eta. So |out - out_full| <= eps max|v| + eta + (exp(2 delta) - 1) max|v|.
    q, dtype = b["q"], b["k_cache"].dtype
    group = q.shape[1] // b["k"].shape[1]
    (eps, eta_k), (_, eta_v) = fp8_error(dtype, b["k_scale"]), fp8_error(dtype, b["v_scale"])
    k_max = b["k_full"].abs().amax(0).repeat_interleave(group, 0)                   # (nh, D)
    v_max = b["v_full"].abs().amax((0, 2)).repeat_interleave(group, 0)             # (nh,)
    delta = b["scale"] * (q.abs() * (eps * k_max + eta_k)).sum(-1)                 # (T, nh)
    bound = eps * v_max + eta_v + torch.expm1(2 * delta) * v_max + TOL[q.dtype]    # (T, nh)
    full = naive_attention(q, b["k_full"], b["v_full"], b["cu_seqlens_q"], b["seq_lens"],
                           b["scale"])
    error = (paged_attention_torch(*paged_args(b), **scales(b)) - full).abs().amax(-1)
    assert (error <= bound).all(), f"error {error.max():.3g} past the bound {bound.min():.3g}"


@pytest.mark.fp8
@settings(max_examples=examples(30), deadline=None)
@given(st.sampled_from(FP8), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       st.integers(-2, 4), st.booleans(), st.integers(0, 2**31))
def test_an_8bit_cache_round_trips_kv_up_to_1e4_within_fp8s_relative_error(
        cache_dtype, dtype, top, use_triton, seed):
    # K/V whose magnitudes spread over seven decades up to 10**top (1e4 at most), scaled as the
    # engine's calibration scales them (amax, KV_SCALE_HEADROOM); a last token at 3x the
    # headroom saturates at +-fmax * scale instead of turning into inf or NaN
    g = torch.Generator().manual_seed(seed)
    decades = torch.rand(17, 2, 32, generator=g) * 7                                # (T, nkv, D)
    x = (torch.randn(17, 2, 32, generator=g).sign() * 10.0 ** (top - decades)).to(dtype)
    amax = x[:16].abs().amax()
    x[16] = 3 * kernel.KV_SCALE_HEADROOM * amax * x[16].sign()
    caches = [torch.zeros(5, 4, 2, 32, dtype=cache_dtype, device=DEVICE) for _ in range(2)]
    scale = kernel.kv_scales(amax, cache_dtype).to(DEVICE)
    x = x.to(DEVICE)
    (store_kv if use_triton else kernel.store_kv_torch)(
        x, -x, *caches, torch.arange(17, device=DEVICE), k_scale=scale, v_scale=scale)
    eps, eta = fp8_error(cache_dtype, scale)
    for sign, cache in zip((1, -1), caches):
        back = kernel.dequantize(cache.flatten(0, 1)[:17], scale, torch.float32)  # (T, nkv, D)
        want = sign * x.float()
        assert (back[:16] - want[:16]).abs().le(eps * want[:16].abs() + eta).all()
        fmax = torch.finfo(cache_dtype).max
        assert torch.equal(back[16], want[16].sign() * fmax * scale)


@pytest.mark.fp8
def test_e4m3_on_a_gpu_before_sm_89_is_a_clear_error_naming_e5m2(monkeypatch):
    # Triton converts e4m3 (fp8e4nv) from compute capability 8.9 on; e5m2 from 8.0
    for capability, ok in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
        cuda = torch.device("cuda")
        assert kernel.check_kv_cache_dtype("fp8_e5m2", torch.float16, cuda, "triton") == \
            torch.float8_e5m2
        if ok:
            assert kernel.check_kv_cache_dtype("fp8", torch.float16, cuda, "triton") == \
                torch.float8_e4m3fn
        else:
            with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is e4m3.*use 'fp8_e5m2'"):
                kernel.check_kv_cache_dtype("fp8", torch.float16, cuda, "triton")
        assert kernel.check_kv_cache_dtype("fp8", torch.float16, cuda, "torch") == \
            torch.float8_e4m3fn


@pytest.mark.fp8
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_an_8bit_cache_holds_twice_the_blocks_of_16_bits_and_4x_of_32_in_the_same_bytes(
        model_dtype):
    model = copy.deepcopy(MODEL).to(model_dtype)
    budget = 1 << 20
    engines = {d: Engine(model, block_size=16, num_blocks=None, kv_cache_bytes=budget,
                         kv_cache_dtype=d) for d in ("auto", "fp8", "fp8_e5m2")}
    blocks = {d: e.stats()["num_blocks"] for d, e in engines.items()}
    per_block = 2 * 2 * 16 * 4 * 8  # K and V, 2 layers, 16 tokens, 4 heads of 8
    assert blocks["auto"] == budget // (per_block * model_dtype.itemsize)
    assert blocks["fp8"] == blocks["fp8_e5m2"] == model_dtype.itemsize * blocks["auto"]
    for d, e in engines.items():
        assert e.kv_cache.nbytes <= budget and e.kv_cache.nbytes == blocks[d] * per_block * \
            e.kv_cache.dtype.itemsize
        assert e.stats()["kv_cache_dtype"] == {"auto": str(model_dtype)[6:], "fp8": "float8_e4m3fn",
                                               "fp8_e5m2": "float8_e5m2"}[d]


@pytest.mark.fp8
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_mixes(), st.sampled_from(["gpt2", "llama"]), st.sampled_from(["fp8", "fp8_e5m2"]))
def test_greedy_generation_with_an_8bit_cache_does_not_depend_on_how_it_is_served(
        mix, name, kv_cache_dtype):
    # sharing, chunking, preemption (both modes), prefix caching and batch-mates change where
    # and when a token's K/V are stored, never what: the scales are fixed, so the tokens are
    # those of each request alone
    prompts, max_tokens, priorities, engine_args = mix
    engine = Engine(MODELS[name], kv_cache_dtype=kv_cache_dtype, **engine_args)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    outputs = engine.generate(prompts, params, priority=priorities)
    for prompt, m, out in zip(prompts, max_tokens, outputs):
        assert out.outputs[0].token_ids == greedy_reference(MODELS[name], [prompt], m,
                                                            kv_cache_dtype)[0]
    assert_all_blocks_free(engine)


@pytest.mark.fp8
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["gpt2", "llama"]), layer=st.integers(0, 1),
       exponent=st.integers(-8, 8).filter(bool), prompt=st.lists(st.integers(0, 31), min_size=1,
                                                                 max_size=12),
       kv_cache_dtype=st.sampled_from(["fp8", "fp8_e5m2"]))
@example(name="gpt2", layer=1, exponent=6, prompt=[3, 1, 4, 1, 5], kv_cache_dtype="fp8")
def test_an_8bit_cache_scales_v_by_vs_own_range_not_ks(name, layer, exponent, prompt,
                                                      kv_cache_dtype):
    """A model whose V in one layer is 2**e times larger (its V rows of c_attn times 2**e, its
    c_proj times 2**-e: the same function, K unchanged): that layer's v_scale is 2**e times
    the original's and every k_scale stays, so each V is stored as the same 8 bits, and the
    logprobs are the original's to the bit. V scaled by K's scale would saturate (e > 0) or fall
    into fp8's subnormals (e < 0)."""
    model, c = MODELS[name], 2.0 ** exponent
    scaled = copy.deepcopy(model)
    attn, v_rows = scaled.transformer.h[layer].attn, model.config.qkv_widths[2]
    with torch.no_grad():
        attn.c_attn.weight[-v_rows:] *= c
        if attn.c_attn.bias is not None:
            attn.c_attn.bias[-v_rows:] *= c
        attn.c_proj.weight /= c
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    runs = []
    for m in (model, scaled):
        engine = Engine(m, block_size=4, num_blocks=16, kv_cache_dtype=kv_cache_dtype)
        out = engine.generate([prompt], params)[0].outputs[0]
        runs.append((engine.model_runner.kv_scales, out.token_ids, out.logprobs))
    (scales, tokens, logprobs), (scaled_scales, scaled_tokens, scaled_logprobs) = runs
    for i, (before, after) in enumerate(zip(scales, scaled_scales)):
        assert torch.equal(after["k_scale"], before["k_scale"])
        assert torch.equal(after["v_scale"], before["v_scale"] * (c if i == layer else 1))
    assert (scaled_tokens, scaled_logprobs) == (tokens, logprobs)


@pytest.mark.fp8
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_copy_on_write_and_swap_move_8bit_blocks_byte_for_byte_and_scales_stay(mode):
    # the scales are per layer and fixed: a block copy (copy-on-write, swap out, swap in) is
    # its bytes and nothing else, and no step changes a scale
    engine = Engine(MODEL, block_size=2, num_blocks=27, preemption_mode=mode,
                    max_num_batched_tokens=8, kv_cache_dtype="fp8")
    runner, moved = engine.model_runner, Counter()
    scales = [{n: s.clone() for n, s in layer.items()} for layer in runner.kv_scales]
    real_copy_blocks = runner.copy_blocks

    def block(cache, b, on_cpu):  # (2, n_layer, block_size, nkv, hs) as bytes
        return (cache[b] if on_cpu else cache[:, :, b]).view(torch.uint8).clone()

    def copy_blocks(copies):
        moves = [(copies.swap_out, False, True), (copies.swap_in, True, False),
                 (copies.cow, False, False)]
        caches = {False: runner.kv_cache, True: runner.cpu_kv_cache}
        want = [(dst, to_cpu, block(caches[from_cpu], src, from_cpu))
                for pairs, from_cpu, to_cpu in moves for src, dst in pairs]
        real_copy_blocks(copies)
        for dst, to_cpu, data in want:
            assert torch.equal(block(caches[to_cpu], dst, to_cpu), data)
        moved.update(name for name, (pairs, _, _) in zip(("out", "in", "copy"), moves) if pairs)

    runner.copy_blocks = copy_blocks
    prompts = [[(5 * i + j) % 32 for j in range(6 + i)] for i in range(4)]
    engine.generate(prompts, [SamplingParams(max_tokens=10, beam_width=3),
                              SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7),
                              SamplingParams(max_tokens=10, temperature=0),
                              SamplingParams(max_tokens=10, beam_width=2)])
    assert moved["copy"] and (mode == "recompute" or moved["out"] and moved["in"]), moved
    assert all(torch.equal(s[n], runner.kv_scales[i][n]) for i, s in enumerate(scales) for n in s)
    assert_all_blocks_free(engine)


@pytest.mark.fp8
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_engine_on_the_triton_kernel_with_an_8bit_cache_generates_like_the_torch_path(
        kv_cache_dtype):
    # the Triton store quantizes to the same bytes and the kernel reads them as the torch path
    torch.manual_seed(3)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, vocab_size=32,
                          max_seq_len=64))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10] * 12]
    engines = [Engine(model, block_size=4, num_blocks=24, attention_backend=backend,
                      max_num_batched_tokens=10, kv_cache_dtype=kv_cache_dtype)
               for backend in ("triton", "torch")]
    assert torch.equal(engines[0].model_runner.kv_scales[1]["v_scale"],
                       engines[1].model_runner.kv_scales[1]["v_scale"])
    outputs = [e.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=1))
               for e in engines]
    assert [o.outputs[0].token_ids for o in outputs[0]] == \
        [o.outputs[0].token_ids for o in outputs[1]]
    for a, b in zip(*outputs):
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob,
                                                                abs=1e-4)
    assert_all_blocks_free(engines[0])


# -----------------------------------------------------------------------------
# 1. Sequences and requests: SamplingParams, prompts, the lifecycle's metrics  (-m engine)
#
# A request's settings and its lifecycle are checked as the engine takes and serves it: these
# tests run with the engine's (-m engine).


@pytest.mark.engine
@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), r"max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens=5.0), r"max_tokens must be an int >= 1, got 5.0"),
    (dict(temperature=-0.1), r"temperature must be a number >= 0"),
    (dict(temperature="1"), r"temperature must be a number >= 0, got '1'"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=None), r"top_p must be a number in \(0, 1\], got None"),
    (dict(top_k=-1), r"top_k must be an int >= 0"),
    (dict(top_k=True), r"top_k must be an int >= 0, got True"),
    (dict(n=0), r"n must be an int >= 1"),
    (dict(n=2.0), r"n must be an int >= 1, got 2.0"),
    (dict(beam_width=0), r"beam_width must be None or an int >= 1"),
    (dict(beam_width=2.0), r"beam_width must be None or an int >= 1, got 2.0"),
    (dict(seed=1.5), r"seed must be None or an int, got 1.5"),
    (dict(stop_token_ids=10), r"stop_token_ids must be None or a list of token ids, got 10"),
    (dict(stop_token_ids=[1.0]), r"stop_token_ids must be None or a list of token ids"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be None or a list of token ids"),
    (dict(stop_token_ids="ab"), r"stop_token_ids must be None or a list of token ids"),
    (dict(ignore_eos="yes"), r"ignore_eos must be True or False, got 'yes'"),
    (dict(length_penalty=None), r"length_penalty must be a number, got None"),
    (dict(logprobs=-1), r"logprobs must be None or an int >= 0, got -1"),
    (dict(logprobs=2, beam_width=2), r"logprobs does not apply to beam search"),
    (dict(prompt_logprobs=1.0), r"prompt_logprobs must be None or an int >= 0, got 1.0"),
    (dict(n=2, beam_width=2), "not both"),
    (dict(output_kind="stream"), r"output_kind must be 'cumulative', 'delta' or 'final_only'"),
    (dict(output_kind="delta", beam_width=2), r"output_kind 'delta' does not apply to beam"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.engine
def test_beam_search_ignores_the_warpers_and_refuses_the_fields_it_does_not_honour():
    """One rule, read from the fields' metadata, so a new field follows it: beside beam_width
    a field marked beams=False is refused, naming it, and a warper (hf_default: it only shapes
    a draw, and beams draw nothing) is taken and changes no beam, as in transformers."""
    def set_apart(f):  # a value its check takes, not its default
        candidates = (0.5, 3, 0.25, 2, [7], ["ab"], True, [UserProcessor()])
        return next(x for x in candidates if f.metadata["ok"](x) and x != f.default)
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    beams = SamplingParams(max_tokens=4, beam_width=2)
    plain = [c.token_ids for c in engine.generate([[1, 2, 3]], beams)[0].outputs]
    warpers = []
    for f in dataclasses.fields(SamplingParams):
        if "ok" not in f.metadata or f.name in ("beam_width", "n", "output_kind"):
            continue
        value = set_apart(f)
        if not f.metadata["beams"]:
            with pytest.raises(ValueError, match=f"{f.name} does not apply to beam search"):
                dataclasses.replace(beams, **{f.name: value})
        elif "hf_default" in f.metadata:
            warpers.append(f.name)
            warped = dataclasses.replace(beams, **{f.name: value})
            out = engine.generate([[1, 2, 3]], warped)[0].outputs
            assert [c.token_ids for c in out] == plain, f.name
    assert {"temperature", "top_k", "top_p", "min_p"} <= set(warpers)


# vLLM's ranges of the numeric sampling parameters (vllm/sampling_params.py, _verify_args):
# field -> (low, high, whether each end is allowed)
VLLM_RANGES = dict(temperature=(0, math.inf, True, False), top_p=(0, 1, False, True),
                   min_p=(0, 1, True, True), repetition_penalty=(0, math.inf, False, False),
                   presence_penalty=(-2, 2, True, True), frequency_penalty=(-2, 2, True, True))


def range_edges():
    """(field, value): each end of each range and the floats just past it."""
    return [(name, x) for name, (low, high, _, _) in VLLM_RANGES.items()
            for edge in (low, high) if math.isfinite(edge)
            for x in (edge, math.nextafter(edge, -math.inf), math.nextafter(edge, math.inf))]


@pytest.mark.engine
@settings(max_examples=examples(200), deadline=None)
@given(case=st.sampled_from(range_edges()) | st.sampled_from(sorted(VLLM_RANGES)).flatmap(
    lambda name: st.tuples(st.just(name), st.floats(-3, 3) | st.integers(-3, 3))))
@example(case=("presence_penalty", 2))  # an end vLLM allows: no other test sets one
def test_numeric_sampling_params_take_exactly_vllms_ranges_ends_included(case):
    """A value is taken if and only if vLLM takes it: both ends of presence_penalty's [-2, 2]
    are allowed, and the float just past an end is a ValueError naming the field."""
    name, value = case
    low, high, low_in, high_in = VLLM_RANGES[name]
    above_low = low < value or (low_in and value == low)
    below_high = value < high or (high_in and value == high)
    if above_low and below_high:
        assert getattr(SamplingParams(**{name: value}), name) == value
    else:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name} must be .*got"):
            SamplingParams(**{name: value})


def asks_for(annotation):
    """What a field or parameter annotated so asks for: "int" (int, or int | None), "number"
    (float, which takes ints too), "ints" (a list of ints), or None (anything else: a bool, a
    string, a callable)."""
    kinds = set(typing.get_args(annotation)) - {type(None)} or {annotation}
    if int in kinds:
        return "int"
    if float in kinds:
        return "number"
    if any(typing.get_origin(k) is list and typing.get_args(k) == (int,) for k in kinds):
        return "ints"
    return None


# Where a user's code hands over an int it may hold it as numpy's or torch's integer scalar; a
# bool is an int to Python, but never an int to a user
INT_SCALARS = st.sampled_from([np.int64, np.int32, np.int16, torch.tensor,
                               functools.partial(torch.tensor, dtype=torch.int32)])
BOOLS = st.sampled_from([True, False, np.bool_(True), torch.tensor(False)])
INT_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if asks_for(f.type)]


def outcome(make):
    """What make() gives, as plain data: what it made (its repr, in which an int held as numpy's
    or torch's shows as such), or the ValueError's message up to the value it got."""
    try:
        made = make()
    except ValueError as e:
        return "refused", str(e).split(", got ")[0]
    return "made", repr(state_of(made))


@pytest.mark.engine
@settings(max_examples=examples(100), deadline=None)
@given(name=st.sampled_from(INT_FIELDS), value=st.integers(-2, 40), scalar=INT_SCALARS,
       bool_=BOOLS)
def test_int_fields_refuse_bools_and_take_numpy_and_torch_ints(name, value, scalar, bool_):
    """Every field of SamplingParams annotated int or float (which takes ints) or a list of ints,
    found from its annotation: a bool is a ValueError naming the field; numpy's and torch's
    integer scalars make the SamplingParams the same Python int makes, or the same refusal."""
    ids = asks_for(SamplingParams.__dataclass_fields__[name].type) == "ints"

    def in_place(x):  # the value, or a list of ids with it among them
        return [3, x] if ids else x
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} must be "):
        SamplingParams(**{name: in_place(bool_)})
    assert outcome(lambda: SamplingParams(**{name: in_place(scalar(value))})) == \
        outcome(lambda: SamplingParams(**{name: in_place(value)}))


@functools.cache
def checking_engine():
    return Engine(MODEL, block_size=4, num_blocks=16)


@pytest.mark.engine
@settings(max_examples=examples(50), deadline=None)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=8), priority=st.integers(-3, 3),
       data=st.data())
def test_prompts_refuse_bools_and_take_numpy_and_torch_ints(prompt, priority, data):
    """A bool anywhere in a prompt, or as its priority, is a ValueError naming it; a prompt and a
    priority of numpy's and torch's integer scalars are taken as the Python ints."""
    engine, params = checking_engine(), SamplingParams(max_tokens=4)
    i, bool_ = data.draw(st.integers(0, len(prompt) - 1)), data.draw(BOOLS)
    with pytest.raises(ValueError, match=rf"prompt token {i} is {re.escape(repr(bool_))}, not an"):
        engine.check_request(prompt[:i] + [bool_] + prompt[i + 1:], params)
    with pytest.raises(ValueError, match="priority must be an int"):
        engine.add_request(prompt, params, priority=bool_)
    scalars = [data.draw(INT_SCALARS)(t) for t in prompt]
    request_id = engine.add_request(scalars, params, priority=data.draw(INT_SCALARS)(priority))
    request = engine.requests[request_id]
    assert repr((request.prompt_token_ids, request.seqs[0].token_ids, request.priority)) == \
        repr((prompt, prompt, priority))
    engine.abort(request_id)


@pytest.mark.engine
def test_stop_token_ids_none_means_none_and_a_tuple_is_a_list():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    engine = Engine(MODEL, block_size=4, num_blocks=12)
    with pytest.raises(ValueError, match=r"stop token id 32 is outside the vocabulary \[0, 32\)"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[5, 32]))
    assert serves_normally(engine)


@pytest.mark.engine
def test_tensor_prompts_work_in_generate_and_add_request_alike():
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    expected = naive_greedy(MODEL, [1, 2, 3], 5)
    for prompt in (torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32), (1, 2, 3)):
        assert engine.generate([prompt], greedy)[0].outputs[0].token_ids == expected
        request_id = engine.add_request(prompt, greedy)
        assert drain(engine)[request_id].outputs[0].token_ids == expected
    for prompt, message in [
            (torch.tensor([[1, 2]]), r"tensor prompt must be 1-D .* got shape \(1, 2\)"),
            (torch.tensor([1.0, 2.0]), r"integer token ids, got shape \(2,\) of torch.float32"),
            ("hello", "a prompt is a list or tuple of token ids or a 1-D integer tensor, got str"),
            (torch.tensor([1, 40]), "prompt token 1 is 40, outside the vocabulary")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, greedy)
        with pytest.raises(ValueError, match="prompt 0: .*" + message):
            engine.generate([prompt], greedy)
    assert serves_normally(engine)


@pytest.mark.engine
def test_request_metrics_follow_the_lifecycle_and_count_cached_prompt_tokens():
    engine = Engine(MODEL, block_size=2, num_blocks=64, max_num_seqs=1)
    prompt, params = [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0)
    first, second = engine.add_request(prompt, params), engine.add_request(prompt, params)
    streamed = {}
    for _ in range(50):
        for o in engine.step():
            streamed.setdefault(o.request_id, []).append(o)
    for outs in streamed.values():
        assert [o.finished for o in outs] == [False, False, True]
        assert all(o.metrics.finished_time is None and o.latency is None for o in outs[:-1])
        m = outs[-1].metrics
        assert m.arrival_time < m.first_scheduled_time < m.first_token_time < m.finished_time
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
        assert outs[-1].time_to_first_token == m.first_token_time - m.arrival_time
        assert outs[-1].latency == m.finished_time - m.arrival_time
        assert all(o.metrics.first_token_time == m.first_token_time for o in outs)
    # one at a time: the second is admitted after the first finished, and finds 2 blocks cached
    assert streamed[second][0].metrics.first_scheduled_time > \
        streamed[first][-1].metrics.finished_time
    assert [streamed[r][-1].num_cached_tokens for r in (first, second)] == [0, 4]


@pytest.mark.engine
def test_a_request_leaves_the_queue_when_scheduled_not_when_its_forward_ends():
    """vLLM stamps a request's first scheduling as the scheduler schedules it: on an idle engine
    its time in the queue ends before the first forward begins, however long that takes. A
    step that fails takes its stamp back, with the rest of its plan."""
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    real_forward, starts = GPT.forward, []

    def forward(self, *args, **kwargs):
        starts.append(time.perf_counter())
        if len(starts) == 1:
            raise RuntimeError("injected")
        return real_forward(self, *args, **kwargs)

    request_id = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GPT, "forward", forward)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        assert engine.requests[request_id].metrics.first_scheduled_time is None
        (out,) = drain(engine).values()
    m = out.metrics
    assert starts[0] < m.first_scheduled_time <= starts[1] < m.first_token_time
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_metrics_are_set_once_even_when_a_request_is_preempted(mode):
    prompts = [[(7 * i + j) % 32 for j in range(5 + 3 * i)] for i in range(8)]
    engine = Engine(MODEL, block_size=4, num_blocks=16, preemption_mode=mode)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert any(o.num_preemptions for o in outputs)
    for o in outputs:  # a re-admission is not a first schedule, and finds its own blocks cached
        m = o.metrics
        assert m.arrival_time < m.first_scheduled_time < m.first_token_time < m.finished_time
        assert o.num_cached_tokens == 0


@st.composite
def prefills_preempted_midway(draw):
    """Short prompts that decode long, then a long prompt prefilled in chunks of a small budget,
    on a pool that has room for all of them at its admission but not once the decoders grow:
    a decoder's new block preempts it (it comes last) between two chunks, before its first
    token. Returns the requests [(prompt, max_tokens)] and the engine's arguments."""
    block_size = draw(st.sampled_from([2, 4]))
    decoders = draw(st.lists(st.tuples(st.lists(st.integers(0, 31), min_size=1, max_size=4),
                                       st.integers(8, 20)), min_size=1, max_size=2))
    prompt = draw(st.lists(st.integers(0, 31), min_size=12, max_size=30))
    requests = decoders + [(prompt, draw(st.integers(1, 3)))]
    room = sum(-(-(len(p) + 1) // block_size) for p, _ in decoders)  # the decoders' first tokens
    need = max(room + -(-(len(prompt) + 1) // block_size),  # all at the prompt's admission
               max(-(-(len(p) + m) // block_size) for p, m in requests))  # the largest alone
    return requests, dict(block_size=block_size, num_blocks=need + draw(st.integers(0, 2)),
                          max_num_batched_tokens=draw(st.integers(3, 5)),
                          preemption_mode=draw(st.sampled_from(["recompute"] * 2 + ["swap"])))


@pytest.mark.engine
@settings(max_examples=examples(40), deadline=None)
@given(case=prefills_preempted_midway())
@example(case=([([1, 2], 16), ([(7 * j) % 32 for j in range(16)], 2)],
               dict(block_size=4, num_blocks=10, max_num_batched_tokens=4,
                    preemption_mode="recompute")))
def test_a_request_preempted_before_its_first_token_keeps_its_first_stamps(case):
    """A request's first schedule and the prompt tokens the prefix cache served it are those of
    its first admission, also when it is preempted midway through a chunked prefill and admitted
    again (its chunks then cached): its queue time ends before its first preemption, and its
    num_cached_tokens is its first allocation's hit. Outputs are naive greedy's."""
    requests, engine_args = case
    engine, firsts, midway = None, {}, []  # firsts: request -> (its first hit, first preempt)

    def observe(e):
        if e["event"] == "allocate" and "group" not in e:
            firsts.setdefault(e["request"], [e["hits"] * engine.block_size, None])
        elif e["event"] == "preempt":
            first = firsts[e["request"]]
            first[1] = first[1] or time.perf_counter()
            seq = engine.requests[e["request"]].seqs[0]
            midway.append(e["mode"] == "recompute" and not seq.num_output_tokens)
    engine = Engine(MODEL, observer=observe, **engine_args)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0))
           for p, m in requests]
    outputs = drain(engine)
    for i, (prompt, max_tokens) in zip(ids, requests):
        o, (hit, preempted) = outputs[i], firsts[i]
        assert o.outputs[0].token_ids == naive_greedy(MODEL, prompt, max_tokens)
        m = o.metrics
        assert m.arrival_time < m.first_scheduled_time < m.first_token_time < m.finished_time
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
        assert preempted is None or m.first_scheduled_time < preempted
        assert o.num_cached_tokens == hit
    event(f"preempted by recompute before its first token: {any(midway)}")


@pytest.mark.engine
def test_a_fork_goes_on_apart_from_its_parent_in_every_field_your_copy_adds():
    """A sample forked from its parent shares what was generated so far, but no container: a
    list, dict or set field (nanopaged's, or one a copy of it adds) that the child changes
    leaves the parent's as it was."""
    parent = nanopaged.Sequence(0, [1, 2, 3], 2, request_id=0)
    parent.logprobs, parent.history, parent.seen = [{1: -0.5}], [7], {"a": 1}
    child = parent.fork(1, 1)
    for name, value in vars(parent).items():
        if isinstance(value, (list, dict, set)) and name != "block_tables":
            assert getattr(child, name) == (value if name != "prompt_logprobs" else [])
            assert getattr(child, name) is not value, name
    child.history.append(8)
    child.seen["b"] = 2
    child.token_ids.append(4)
    assert (parent.history, parent.seen, parent.token_ids) == ([7], {"a": 1}, [1, 2, 3])


# -----------------------------------------------------------------------------
# 3. The prefix cache: chained keys, hits, eviction policies  (-m prefix_cache)


@pytest.mark.prefix_cache
def test_last_reference_to_a_cached_block_goes_away_and_comes_back():
    a = BlockAllocator(num_blocks=6, block_size=2)
    first = make_seq(0, [1, 2, 3, 4, 5])
    allocate_whole(a, first)
    first.num_computed_tokens = 5
    a.cache_full_blocks(first)
    cached = first.block_table[:2]
    a.free(first)
    assert a.num_free_blocks == 6 and all(a.blocks[b].hash is not None for b in cached)
    again = make_seq(1, [1, 2, 3, 4, 9])  # same two full blocks, different tail
    # the hit's two revived blocks come out of the free list, then one for its last token
    assert a.num_blocks_to_allocate(again) == 2
    allocate_whole(a, again)
    assert again.block_table[:2] == cached and again.num_computed_tokens == 4
    assert a.num_free_blocks == 3
    other = make_seq(2, [3, 4, 1, 2, 7])  # the same blocks after a different prefix must not hit
    allocate_whole(a, other)
    assert other.num_computed_tokens == 0


@pytest.mark.prefix_cache
def test_fully_cached_prompt_still_computes_its_last_token():
    a = BlockAllocator(num_blocks=6, block_size=2)
    first = make_seq(0, [1, 2, 3, 4])
    allocate_whole(a, first)
    first.num_computed_tokens = 4
    a.cache_full_blocks(first)
    second = make_seq(1, [1, 2, 3, 4])
    allocate_whole(a, second)
    # the last token's logits are needed, so its block is recomputed into a private block
    assert second.num_computed_tokens == 2 and second.block_table[0] == first.block_table[0]
    assert a.blocks[second.block_table[1]].ref_count == 1


@pytest.mark.prefix_cache
def test_hash_collision_is_caught_by_comparing_tokens():
    a = BlockAllocator(num_blocks=4, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    allocate_whole(a, seq)
    seq.num_computed_tokens = 3
    a.cache_full_blocks(seq)
    (h, holders), = a.prefix_cache.blocks_by_key.items()
    block_id, = holders
    a.blocks[block_id].token_ids = (5, 6)  # pretend [5, 6] hashed to the same key
    other = make_seq(1, [1, 2, 3])
    assert not a.allocate(other)  # no copies: nothing came from the CPU, nothing was evicted
    assert other.num_computed_tokens == 0 and a.blocks[block_id].ref_count == 1  # no hit


@pytest.mark.prefix_cache
@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=2),
                         min_size=1, max_size=3),
                min_size=2, max_size=10))
def test_chained_keys_differ_whenever_prefixes_differ(prefixes):
    keys = {}
    # short blocks of three tokens: equal blocks after other prefixes abound
    for blocks in prefixes:
        key = None
        for block in blocks:
            key = chain_hash(key, block)
        assert keys.setdefault(key, blocks) == blocks


@pytest.mark.prefix_cache
def test_prefix_cache_keys_do_not_trust_pythons_hash(monkeypatch):
    """Keys must not be Python's hash of (key before, tokens): a collision crafted for it would
    share another prompt's K/V (vLLM's CVE-2025-25183). Here the weakest such hash, blind to
    the prefix, makes block [3, 4] after [1, 2] collide with [3, 4] at the start of a prompt;
    SHA-256 keys ignore it."""
    import builtins
    def blind(key):  # to a (key before, tokens) pair's first; anything else as it is
        pair = isinstance(key, tuple) and len(key) == 2
        return builtins.hash(key[1] if pair else key)
    monkeypatch.setattr(nanopaged, "hash", blind, raising=False)
    engine = Engine(MODEL, block_size=2, num_blocks=16)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    for prompt in ([1, 2, 3, 4, 9], [3, 4, 9]):
        assert engine.generate([prompt], greedy)[0].outputs[0].token_ids == \
            naive_greedy(MODEL, prompt, 4)
    assert engine.allocator.prefix_cache.counts.hit_tokens == 0


@pytest.mark.prefix_cache
@settings(max_examples=examples(40), deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9),
                        min_size=2, max_size=6),
       block_size=st.sampled_from([1, 2, 3]), name=st.sampled_from(["gpt2", "llama"]))
def test_generation_is_right_even_if_every_prefix_key_collides(prompts, block_size, name):
    """Patch the key to a constant: a block already cached under it is reused (published twin or
    prefix hit) only if it holds the same tokens at the same place, so generation still equals
    the naive reference. Prompts from 4 letters repeat blocks at other places."""
    from unittest import mock
    model, greedy = MODELS[name], SamplingParams(max_tokens=3, temperature=0)
    with mock.patch.object(nanopaged, "chain_hash", lambda prev, tokens: b"the same key"):
        engine = Engine(model, block_size=block_size, num_blocks=64)
        for i in range(0, len(prompts), 2):  # two at a time: twins are published in one step
            for prompt, out in zip(prompts[i:i + 2], engine.generate(prompts[i:i + 2], greedy)):
                tokens = naive_greedy(model, prompt, 3)
                logprob = sum(naive_logprobs(model, prompt + tokens[:j])[t].item()
                              for j, t in enumerate(tokens))
                assert out.outputs[0].token_ids == tokens  # and the logits, to sampling's rounding:
                assert out.outputs[0].cumulative_logprob == pytest.approx(logprob, abs=1e-5)  # fp32


@pytest.mark.prefix_cache
def test_least_recently_freed_cached_block_is_evicted_first():
    a = BlockAllocator(num_blocks=5, block_size=2)
    old, new = make_seq(0, [1, 2, 9]), make_seq(1, [3, 4, 9])
    for seq in (old, new):
        allocate_whole(a, seq)
        seq.num_computed_tokens = 3
        a.cache_full_blocks(seq)
    a.free(old)
    a.free(new)
    # 4 blocks: the three holding nothing worth keeping go first, then the oldest cached prefix
    allocate_whole(a, make_seq(2, [5, 6, 7, 8, 5, 6, 7]))
    assert chain_hash(None, (3, 4)) in a.prefix_cache.blocks_by_key
    assert chain_hash(None, (1, 2)) not in a.prefix_cache.blocks_by_key


@pytest.mark.prefix_cache
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_lfu_keeps_the_prefix_hit_more_often_where_lru_loses_it(policy):
    a, ids = BlockAllocator(num_blocks=5, block_size=2, eviction_policy=policy), itertools.count()

    def serve(tokens):  # a request whose prompt is computed, then it finishes
        seq = make_seq(next(ids), tokens)
        allocate_whole(a, seq)
        seq.num_computed_tokens = len(tokens)
        a.cache_full_blocks(seq)
        a.free(seq)
        return seq.block_hashes[0]

    popular = [serve([1, 2, 9]) for _ in range(3)][0]  # hit twice
    rare = serve([3, 4, 9])  # freed last, never hit
    assert [a.blocks[b].num_hits for h in (popular, rare)
            for b in a.prefix_cache.blocks_by_key[h]] == [2, 0]
    # 4 blocks: the 3 uncached free ones first, then one cached prefix is evicted
    new = make_seq(next(ids), [5, 6, 7, 8, 5, 6, 7])
    allocate_whole(a, new)
    survivor = popular if policy == "lfu" else rare
    assert list(a.prefix_cache.blocks_by_key) == [survivor]
    assert all(a.blocks[b].num_hits == 0 for b in new.block_table)  # an evicted block's hits go


@pytest.mark.prefix_cache
@pytest.mark.parametrize("policy", EVICTION)
def test_blocks_go_out_in_eviction_order_after_many_hits_and_after_a_rollback(policy):
    a, ids = BlockAllocator(num_blocks=8, block_size=2, eviction_policy=policy), itertools.count()
    rng = random.Random(0)

    def serve(tokens):
        seq = make_seq(next(ids), tokens)
        allocate_whole(a, seq)
        seq.num_computed_tokens = len(tokens)
        a.cache_full_blocks(seq)
        return seq

    # prefixes hit different numbers of times, freed in a random order; each hit on a free block
    # leaves a stale entry in the free list's heap, which rebuilds itself from time to time
    for _ in range(60):
        a.free(serve([rng.randrange(3), rng.randrange(3), 9]))
    order = free_order(a)
    assert a.blocks[order[0]].hash is None  # (so the step below takes a block caching nothing)
    a.journal.open()  # a step that hits the last cached block, takes one, frees both, then fails
    a.free(serve(list(a.blocks[order[-1]].token_ids) + [9]))
    a.journal.rollback()
    assert free_order(a) == order
    # one-token prompts never seen take one block each: the free list, front first
    assert [serve([100 + i]).block_table[0] for i in range(len(order))] == order


@pytest.mark.prefix_cache
def test_a_recomputed_sequence_publishes_its_blocks_to_the_prefix_cache_again():
    engine = Engine(MODEL, block_size=2, num_blocks=16)
    a, prompt = engine.allocator, [3, 1, 4, 1, 5, 9, 2]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # prefill: its three full blocks are published
    keys = [chain_hash(None, prompt[:2])]
    keys.append(chain_hash(keys[-1], prompt[2:4]))
    keys.append(chain_hash(keys[-1], prompt[4:6]))
    assert all(k in a.prefix_cache.blocks_by_key for k in keys)
    request = engine.requests[request_id]
    engine.scheduler._preempt(request, nanopaged.SchedulerOutput())  # recompute: freed, cached
    filler = make_seq(99, [0] * (a.num_free_blocks * 2))
    allocate_whole(a, filler)  # takes every free block: the cached ones are evicted
    a.free(filler)
    assert not any(k in a.prefix_cache.blocks_by_key for k in keys)
    drain(engine)
    assert all(k in a.prefix_cache.blocks_by_key for k in keys), \
        "the recomputed prompt is shareable again"


@pytest.mark.prefix_cache
def test_prompt_fully_in_the_cache_still_gets_its_next_token():
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    prompt = list(range(8))  # exactly two blocks
    first = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    second = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    # the block with the last token is recomputed
    assert engine.stats()["prefix_cache_hit_tokens"] == 4
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == \
        naive_greedy(MODEL, prompt, 3)


@pytest.mark.prefix_cache
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("model", [MODEL, LLAMA], ids=["gpt2", "llama"])
def test_prefix_caching_on_and_off_give_identical_outputs(model, kv_cache_dtype,
                                                          no_writes_into_shared_blocks):
    system = [(11 * j) % 32 for j in range(13)]
    prompts = [system + [i, i + 1] for i in range(6)] + [system[:8], system]
    params = SamplingParams(max_tokens=6, temperature=0)
    results = {}
    for caching in (True, False):
        engine = Engine(model, block_size=4, num_blocks=64, enable_prefix_caching=caching,
                        max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
        no_writes_into_shared_blocks(engine)
        results[caching] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        hits = engine.stats()["prefix_cache_hit_tokens"]
        assert hits > 0 if caching else hits == 0
        assert_all_blocks_free(engine)
        assert engine.stats()["num_cached_blocks"] > 0 if caching else \
            engine.stats()["num_cached_blocks"] == 0
    assert results[True] == results[False] == greedy_reference(model, prompts, 6, kv_cache_dtype)


@pytest.mark.prefix_cache
def test_a_request_owed_prompt_logprobs_takes_no_cache_hits_but_publishes_its_blocks():
    """A cached block has no logits, so a request with prompt_logprobs computes its whole prompt;
    its blocks still enter the prefix cache for the requests after it."""
    engine, prompt = Engine(MODEL, block_size=4, num_blocks=32), list(range(1, 14))
    a = engine.allocator

    def hits(params):
        before = a.prefix_cache.counts.hit_tokens
        engine.generate([prompt], params)
        return a.prefix_cache.counts.hit_tokens - before
    assert hits(SamplingParams(max_tokens=2, prompt_logprobs=1)) == 0  # nothing cached yet
    assert hits(SamplingParams(max_tokens=2)) == 12  # its 3 full prompt blocks were published
    assert hits(SamplingParams(max_tokens=2, prompt_logprobs=0)) == 0
    assert hits(SamplingParams(max_tokens=2, logprobs=2)) == 12


# -- prefix sharing from the first step -----------------------------------------------------------

@pytest.mark.prefix_cache
def test_identical_prompts_admitted_together_share_all_but_the_last_block():
    """vLLM's case: two identical 64-token prompts scheduled in one step share 48 tokens (the
    first request's four blocks are published as its step is scheduled; the second takes three
    of them, since its last token is always computed)."""
    prompt, model = [(7 * i) % 32 for i in range(64)], tiny_model(max_seq_len=128)
    engine = Engine(model, block_size=16, num_blocks=64, max_num_batched_tokens=256)
    first, second = engine.generate([prompt, prompt], SamplingParams(max_tokens=4, temperature=0))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 48)
    s = engine.stats()
    assert (s["prefix_cache_hit_tokens"], s["prefix_cache_queried_tokens"]) == (48, 128)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == \
        naive_greedy(model, prompt, 4)


@pytest.mark.prefix_cache
def test_no_cache_counts_no_queries():
    engine = Engine(MODEL, block_size=4, num_blocks=32, enable_prefix_caching=False)
    engine.generate([[1, 2, 3, 4, 5]] * 3, SamplingParams(max_tokens=2))
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] == s["prefix_cache_queried_tokens"] == 0


@pytest.mark.prefix_cache
@settings(max_examples=examples(60), deadline=None)
@given(families=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1,
                         max_size=3),
       picks=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12),
                                st.lists(st.integers(0, 3), max_size=3)), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 3, 4]))
def test_requests_admitted_together_hit_every_block_an_earlier_one_computes(families, picks,
                                                                           block_size):
    """All admitted in one step, each request hits exactly the leading full blocks (never the
    last token's) it shares with any request admitted before it, whose blocks are published as
    that one's step is scheduled."""
    prompts = [families[f % len(families)][:n] + tail for f, n, tail in picks]
    engine = Engine(MODEL, block_size=block_size, num_blocks=256, max_num_batched_tokens=512,
                    max_num_seqs=8)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        shared = 0
        for earlier in prompts[:i]:
            k = 0
            while (k + 1) * block_size <= min(len(prompt) - 1, len(earlier)) and \
                    prompt[:(k + 1) * block_size] == earlier[:(k + 1) * block_size]:
                k += 1
            shared = max(shared, k)
        assert out.num_cached_tokens == shared * block_size
    assert engine.stats()["num_preemptions"] == 0


@st.composite
def shared_prefix_batches(draw):
    """Requests that share random prefixes (several families of them), greedy or seeded, with
    n > 1 samples now and then; how they arrive (all in one step, or a few per step), the token
    budget (small ones chunk the prompts), the pool (tight ones preempt) and the mode."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    families = [draw(st.lists(st.integers(0, 31), min_size=1, max_size=12)) for _ in range(3)]
    requests = []
    for i in range(draw(st.integers(2, 6))):
        prefix = draw(st.sampled_from(families))
        prompt = prefix[:draw(st.integers(1, len(prefix)))] + \
            draw(st.lists(st.integers(0, 31), max_size=4))
        kind = draw(st.sampled_from(["greedy", "greedy", "seeded", "n=2"]))
        requests.append((prompt, SamplingParams(
            max_tokens=draw(st.integers(1, 5)), temperature=0 if kind == "greedy" else 1.0,
            seed=i, n=2 if kind == "n=2" else 1)))
    worst = max(p.num_seqs * -(-(len(q) + p.max_tokens) // block_size) for q, p in requests)
    return dict(requests=requests, per_step=draw(st.sampled_from([None, 1, 2])),
                settings=dict(block_size=block_size, num_blocks=worst + draw(st.integers(0, 24)),
                              max_num_batched_tokens=draw(st.sampled_from([4, 8, 64])),
                              max_num_seqs=8,
                              preemption_mode=draw(st.sampled_from(["recompute", "swap"]))))


def serve(engine, requests, per_step):
    """Outputs by request, the requests added all at once (per_step None) or a few per step."""
    pending, ids, outputs = list(requests), [], {}
    for _ in range(500):  # bounded: see drain
        if not pending and not engine.requests:
            break
        take = len(pending) if per_step is None else per_step
        ids += [engine.add_request(q, p) for q, p in pending[:take]]
        pending = pending[take:]
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.requests
    return [[(c.token_ids, c.finish_reason) for c in outputs[i].outputs] for i in ids]


@pytest.mark.prefix_cache
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=shared_prefix_batches())
def test_prefix_sharing_from_the_first_step_changes_no_output(batch):
    """With the cache on, requests that share prefixes hit blocks published in the step that
    computes them (admitted in that step, or later); their outputs equal the cache off's, no
    block leaks, and when nothing is preempted every hit is counted once: the hit counter is the
    sum of what the requests report."""
    requests, per_step, settings_ = batch["requests"], batch["per_step"], batch["settings"]
    off = serve(Engine(MODEL, enable_prefix_caching=False, **settings_), requests, per_step)
    engine = Engine(MODEL, **settings_)
    reports = []
    real_step = engine.step
    engine.step = lambda: [reports.append(o) or o for o in real_step()]
    assert serve(engine, requests, per_step) == off
    assert_all_blocks_free(engine)
    s = engine.stats()
    if not s["num_preemptions"]:
        finals = [o for o in reports if o.finished]
        assert s["prefix_cache_hit_tokens"] == sum(o.num_cached_tokens for o in finals)
        assert s["prefix_cache_queried_tokens"] == sum(len(q) for q, _ in requests)


# -- the prefix cache after a failed step


def cached_kv_is_recomputed_kv(engine, prefixes):
    """Every block either tier of the prefix cache holds holds the K/V its tokens produce: each
    one's whole prefix (found among prefixes by its key, made its KV cache group's own beyond
    the first) prefilled again in a fresh engine, in one step."""
    a, cpu_kv = engine.allocator, engine.model_runner.cpu_kv_cache
    by_key = {}  # a block's key in a KV cache group -> (the group, its prefix)
    for key, tokens in prefixes.items():
        for g in range(len(a.kinds)):
            by_key[key if g == 0 else hashlib.sha256(bytes([g]) + key).digest()] = g, tokens
    cached = [(b, engine.kv_cache[:, :, b.block_id]) for b in a.blocks if b.hash is not None]
    cached += [(b, cpu_kv[b.block_id]) for b in a.swap_pool.blocks if b.hash is not None]
    wanted = {tuple(by_key[b.hash][1]) for b, _ in cached}  # each prefix once, for every group
    num_tokens = sum(map(len, wanted))  # all of them prefilled in one step
    fresh = Engine(engine.model, block_size=engine.block_size,
                   num_blocks=max(512, 2 * len(a.kinds) * num_tokens),
                   max_num_batched_tokens=max(4096, num_tokens), enable_prefix_caching=False)
    for tokens in wanted:
        fresh.add_request(list(tokens), SamplingParams(max_tokens=2, temperature=0))
    fresh.step()  # every prefill, whole: each prompt token's K/V stored
    seqs = {tuple(r.prompt_token_ids): r.seqs[0] for r in fresh.scheduler.running}
    assert seqs.keys() == wanted
    for block, kv in cached:
        g, tokens = by_key[block.hash]
        table = seqs[tuple(tokens)].block_tables[g]
        torch.testing.assert_close(kv, fresh.kv_cache[:, :, table[block.logical_index]],
                                   rtol=1e-9, atol=1e-9)


def hit_on_device(allocator, seq):
    """The most leading blocks of seq of which the device's cache alone holds, in every KV cache
    group, the blocks its kind needs for a hit (hit_blocks), seen from the keys, tokens and
    places of the device's blocks: none for a sequence owed prompt logprobs (it computes its
    whole prompt)."""
    a, bs = allocator, allocator.block_size
    if not a.prefix_cache.enabled or seq.prompt_logprob_positions(0, len(seq)):
        return 0
    held = {(b.hash, b.token_ids, b.logical_index) for b in a.blocks if b.hash is not None}
    a.prefix_cache.key_blocks(seq)

    def cached(g, i):
        return (nanopaged.PrefixCache.key(seq, i, g), tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                i) in held
    return max(m for m in range((len(seq) - 1) // bs + 1)
               if all(cached(g, i) for g, kind in enumerate(a.kinds)
                      for i in kind.hit_blocks(m, bs)))


def keys_of(tokens, block_size):
    """Prefix-cache key -> the tokens up to the end of that block, for every full block."""
    keys, key = {}, None
    for i in range(len(tokens) // block_size):
        key = nanopaged.chain_hash(key, tokens[i * block_size:(i + 1) * block_size])
        keys[key] = tokens[:(i + 1) * block_size]
    return keys


FAILURE_AFTER_KV = ["last layer", "sample", "stop check"]


@pytest.mark.prefix_cache
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=10), min_size=2,
                        max_size=5),
       where=st.sampled_from(FAILURE_AFTER_KV), at=st.integers(1, 8),
       block_size=st.sampled_from([1, 2, 3]), spare=st.integers(0, 4),
       mode=st.sampled_from(["recompute", "swap"]), then=st.sampled_from(["retry", "abort"]))
# the failed step evicts a cached block of the second prompt to grow the first: once aborted,
# nothing takes that block again, and its prefix must not come back with the step's K/V in it
@example(prompts=[[1, 2, 3, 4], [5, 6, 7, 0]], where="last layer", at=4, block_size=2,
         spare=0, mode="recompute", then="abort")
def test_after_a_failed_step_the_prefix_cache_holds_only_what_its_tokens_produce(
        prompts, where, at, block_size, spare, mode, then):
    """A step fails after its K/V writes (in the model's last layer, in sampling, in a stop
    check), in a pool tight enough that the step hands out cached blocks and writes into them.
    Its requests are retried, or aborted (as server.py does with a failed step's requests), so
    the next step need not take those blocks again. Then requests that share every prefix the
    failed step touched (every prompt and every output so far, again) are served: their outputs
    equal a run without the failure, and every block the prefix cache holds holds exactly the
    K/V its tokens produce."""
    params = SamplingParams(max_tokens=4, temperature=0)
    worst = -(-(max(map(len, prompts)) + 6) // block_size)  # the longest request of both rounds
    settings_ = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                     max_num_batched_tokens=8)
    engine, calls = Engine(MODEL, **settings_), [0]

    def after(real):
        def failing(*args, **kwargs):
            result = real(*args, **kwargs)
            calls[0] += 1
            if calls[0] == at:
                raise RuntimeError("injected after the K/V writes")
            return result
        return failing
    targets = {"last layer": (MODEL.transformer.h[-1], "forward"), "sample": (nanopaged, "sample"),
               "stop check": (nanopaged.OutputProcessor, "stop_check")}
    owner, name = targets[where]
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, after(getattr(owner, name)))
        for _ in range(200):  # bounded: see drain
            if not engine.requests:
                break
            try:
                outputs.update({o.request_id: o for o in engine.step()})  # the latest of each
            except RuntimeError as e:
                assert "injected" in str(e)
                for request_id in list(engine.requests) if then == "abort" else []:
                    engine.abort(request_id)
    texts = [p + (outputs[i].outputs[0].token_ids if i in outputs else [])
             for p, i in zip(prompts, ids)]
    prefixes = {}
    for t in texts:
        prefixes |= keys_of(t, block_size)
    cached_kv_is_recomputed_kv(engine, prefixes)  # before a later request could evict any
    again = [t[:n] for t in texts for n in range(1, len(t))]  # every prefix, again
    second = engine.generate(again, SamplingParams(max_tokens=2, temperature=0))
    plain = Engine(MODEL, block_size=block_size, num_blocks=256, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in second] == \
        [o.outputs[0].token_ids for o in plain.generate(again, SamplingParams(max_tokens=2,
                                                                              temperature=0))]
    for t in [a + o.outputs[0].token_ids for a, o in zip(again, second)]:
        prefixes |= keys_of(t, block_size)
    cached_kv_is_recomputed_kv(engine, prefixes)
    event(f"failed: {calls[0] >= at}")


@pytest.mark.prefix_cache
@settings(max_examples=examples(30), deadline=None)
@given(kind=st.sampled_from(sorted(PAGED_MODELS)), block_size=st.sampled_from([1, 2, 3, 4]),
       prompt=st.lists(st.integers(0, 31), min_size=1, max_size=40), caching=st.booleans())
@example(kind="chunked_attention", block_size=1, prompt=[3] * 20, caching=True)
def test_on_an_empty_cache_a_requests_hit_is_the_leading_blocks_no_later_token_sees(
        kind, block_size, prompt, caching):
    """num_cached_tokens counts the prompt tokens a request did not compute at its first
    admission, as vLLM counts them: the prefix cache's hit, and with it the leading whole blocks
    no token from the hit's end on sees under any of the model's kinds (under chunked local
    attention, the chunks before the last), cached or not. On an empty cache, with prefix caching
    on, it is those blocks alone; with it off, nothing. stats()' hit tokens (/metrics' hits)
    count the same; the output is naive greedy's."""
    model = PAGED_MODELS[kind]
    engine = Engine(model, block_size=block_size, num_blocks=64, enable_prefix_caching=caching)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    masks = [k.mask for k in engine.allocator.kinds]

    def unseen(n):  # whether no token from position n * block_size on sees blocks 0 to n - 1
        p = n * block_size
        return all(m.first_seen(p) >= p and not (n and m.sink) for m in masks)
    most = (len(prompt) - 1) // block_size  # the last prompt token is computed
    skipped = max(n for n in range(most + 1) if unseen(n)) * block_size if caching else 0
    assert out.num_cached_tokens == engine.stats()["prefix_cache_hit_tokens"] == skipped
    assert out.outputs[0].token_ids == naive_greedy(model, prompt, 2)
    event(f"counted tokens no later token sees: {skipped > 0}")


# -----------------------------------------------------------------------------
# 4. The block pools: the CPU pool, sized in bytes  (-m allocator)
#
# The CPU pool's tests run with the allocator's (-m allocator), whose state machine (section 5)
# swaps sequences out and in as well.


@pytest.mark.allocator
@pytest.mark.parametrize("swap_space", [0, 2**-20, 2**-10])
def test_the_swap_space_is_sized_in_bytes(swap_space):
    engine = Engine(MODEL, block_size=4, num_blocks=64, preemption_mode="swap",
                    swap_space=swap_space)
    bytes_per_block = engine.kv_cache[:, :, 0].numel() * engine.kv_cache.itemsize
    assert engine.allocator.num_blocks == 64  # at most the device pool's count
    assert engine.allocator.swap_pool.num_blocks == \
        min(64, int(swap_space * 2**30) // bytes_per_block)
    assert engine.model_runner.cpu_kv_cache.shape[0] == engine.allocator.swap_pool.num_blocks
    # recompute
    assert Engine(MODEL, block_size=4, num_blocks=64).model_runner.cpu_kv_cache.shape[0] == 0


@pytest.mark.allocator
@pytest.mark.parametrize("swap_space", [10**6, -1, "4", True])
def test_a_swap_space_the_host_cannot_hold_is_a_clear_error(swap_space):
    with pytest.raises(ValueError, match=r"swap_space must be a number of GiB in \[0, [0-9.]+\] "
                                         r"\(70% of this host's [0-9.]+ GiB\), "
                                         rf"got {re.escape(repr(swap_space))}"):
        Engine(MODEL, block_size=4, num_blocks=8, preemption_mode="swap", swap_space=swap_space)


# -- the CPU tier: cached prefixes the device evicts wait in CPU memory  (-m tier)


def bytes_per_block(engine):
    return engine.kv_cache[:, :, 0].numel() * engine.kv_cache.itemsize


@pytest.mark.tier
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_cpu_pool_holds_the_swap_space_and_the_tier_beside_it(mode):
    """One CPU pool: the swap space (in swap mode) and cpu_cache_bytes more, in blocks."""
    engine = Engine(MODEL, block_size=4, num_blocks=16, preemption_mode=mode,
                    swap_space=2**-20, cpu_cache_bytes=10_000)
    swap = 2**10 // bytes_per_block(engine) if mode == "swap" else 0
    assert engine.allocator.swap_pool.num_blocks == swap + 10_000 // bytes_per_block(engine)
    assert engine.model_runner.cpu_kv_cache.shape[0] == engine.allocator.swap_pool.num_blocks


@pytest.mark.tier
@pytest.mark.parametrize("kwargs, message", [
    (dict(cpu_cache_bytes=-1), "cpu_cache_bytes must be an integer >= 0, got -1"),
    (dict(cpu_cache_bytes=1.5), "cpu_cache_bytes must be an integer >= 0, got 1.5"),
    (dict(cpu_cache_bytes=True), "cpu_cache_bytes must be an integer >= 0, got True"),
    (dict(cpu_cache_bytes=4096, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(cpu_cache_bytes=4096, cpu_eviction_policy="mfu"), "cpu_eviction_policy must be one"),
])
def test_bad_cpu_tier_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(MODEL, block_size=4, num_blocks=16, **kwargs)


def returning_conversation(engine, max_tokens=3):
    """A conversation's first turn, then other requests that push its blocks out of a 12-block
    device pool, then its second turn: the first turn's prompt and answer and one new token.
    Returns the second turn's output, and every request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    first = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # three blocks of 4
    texts = [first + engine.generate([first], params)[0].outputs[0].token_ids]
    for i in range(3):  # 3 x 4 blocks: every cached block is evicted
        prompt = [10 + i] * 14
        texts.append(prompt + engine.generate([prompt], params)[0].outputs[0].token_ids)
    out = engine.generate([texts[0] + [7]], params)[0]
    return out, texts + [out.prompt_token_ids + out.outputs[0].token_ids]


@pytest.mark.tier
def test_a_conversation_that_comes_back_is_served_from_the_cpu_tier():
    """Its history was evicted from the device: without the tier it is computed again; with it,
    its blocks are copied back (counted as hits, the CPU tier's), the output is the same, and
    both tiers hold exactly the K/V their tokens produce."""
    plain = Engine(MODEL, block_size=4, num_blocks=12)
    tiered = Engine(MODEL, block_size=4, num_blocks=12, cpu_cache_bytes=64 * 4096)
    (without, _), (with_tier, texts) = returning_conversation(plain), returning_conversation(tiered)
    assert without.outputs[0].token_ids == with_tier.outputs[0].token_ids
    assert without.num_cached_tokens == 0 and with_tier.num_cached_tokens == 12
    s = tiered.stats()
    assert s["prefix_cache_cpu_hit_tokens"] == 12 and s["num_reloaded_blocks"] == 3
    assert s["num_offloaded_blocks"] >= 3 and s["num_cpu_cached_blocks"] >= 3
    prefixes = {}
    for tokens in texts:
        prefixes |= keys_of(tokens, 4)
    cached_kv_is_recomputed_kv(tiered, prefixes)


@pytest.mark.tier
@pytest.mark.parametrize("kind", sorted(PAGED_MODELS))
def test_the_cpu_tier_counts_the_tokens_it_adds_to_the_devices_hit(kind):
    """Whatever the model's attention kinds, the returning conversation's second turn hits its
    12 leading tokens with the tier, and the CPU tier's hit tokens are the hit tokens the tier
    adds to those of the engine without it: what the device alone serves (none of that turn's,
    but under chunked attention, whose requests hold fewer blocks and push none of it out).
    Under a window only the blocks the window sees are copied back, yet all 12 are served."""
    model = PAGED_MODELS[kind]
    plain = Engine(model, block_size=4, num_blocks=12)
    tiered = Engine(model, block_size=4, num_blocks=12, cpu_cache_bytes=128 * 4096)
    (without, _), (with_tier, _) = returning_conversation(plain), returning_conversation(tiered)
    assert without.outputs[0].token_ids == with_tier.outputs[0].token_ids
    s, alone = tiered.stats(), plain.stats()
    assert with_tier.num_cached_tokens == 12
    assert s["prefix_cache_cpu_hit_tokens"] == \
        s["prefix_cache_hit_tokens"] - alone["prefix_cache_hit_tokens"] == \
        12 - without.num_cached_tokens


@pytest.mark.tier
def test_an_8bit_cache_goes_to_the_tier_and_back_byte_for_byte():
    """With an 8-bit KV cache (its scales are the layer's, fixed) the tier keeps a block's bytes:
    the returning conversation's output is the same with the tier as without it, and every
    prefix both tiers hold is the same bytes in each."""
    plain = Engine(MODEL, block_size=4, num_blocks=12, kv_cache_dtype="fp8")
    tiered = Engine(MODEL, block_size=4, num_blocks=12, kv_cache_dtype="fp8",
                    cpu_cache_bytes=64 * 4096)
    (without, _), (with_tier, _) = returning_conversation(plain), returning_conversation(tiered)
    assert without.outputs[0].token_ids == with_tier.outputs[0].token_ids
    assert with_tier.num_cached_tokens == 12 and tiered.stats()["num_reloaded_blocks"] == 3
    a, cpu_kv = tiered.allocator, tiered.model_runner.cpu_kv_cache
    on_device = {b.hash: b.block_id for b in a.blocks if b.hash is not None}
    both = [(on_device[b.hash], b.block_id) for b in a.swap_pool.blocks if b.hash in on_device]
    assert len(both) >= 3  # the blocks copied back, at least
    for block_id, cpu_block in both:
        assert torch.equal(tiered.kv_cache[:, :, block_id].view(torch.uint8),
                           cpu_kv[cpu_block].view(torch.uint8))


@pytest.mark.tier
def test_a_swap_out_takes_room_from_the_tier_never_the_other_way():
    """The CPU pool is full of cached prefixes when a request must be preempted by swap: the
    swap evicts cached blocks (the tier's policy) and the request is swapped, not recomputed."""
    per_block = bytes_per_block(Engine(MODEL, block_size=2, num_blocks=1))
    engine = Engine(MODEL, block_size=2, num_blocks=10, preemption_mode="swap", swap_space=0,
                    cpu_cache_bytes=8 * per_block, max_num_batched_tokens=64)
    trace = pagetrace.Trace()
    engine.set_observer(trace)
    params = SamplingParams(max_tokens=2, temperature=0)
    for i in range(6):  # each prompt leaves 3 cached blocks; the device evicts them to the tier
        engine.generate([[i] * 7], params)
    tier = engine.allocator.swap_pool
    assert tier.num_blocks == 8 and sum(b.hash is not None for b in tier.blocks) == 8
    # two requests that grow past the pool together: one of them is preempted, by swap
    prompts = [[20, 21, 22], [23, 24, 25]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == [naive_greedy(MODEL, p, 12) for p in prompts]
    preempts = [e for e in trace.events if e["event"] == "preempt"]
    assert preempts and all(e["mode"] == "swap" for e in preempts)
    assert any(e["event"] == "cpu_evict" for e in trace.events)


# six prompts, in runs of up to 20: they return often enough that a wrong order shows in about
# one run of 13 drawn uniformly (fewer of Hypothesis's); the @example below shows it every time
PROMPTS = "UVWXYZ"


@pytest.mark.tier
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(serves=st.lists(st.sampled_from([*PROMPTS, 2, 4]), min_size=2, max_size=20),
       device_blocks=st.integers(2, 5), tier_blocks=st.integers(1, 3),
       device=st.sampled_from(EVICTION), cpu=st.sampled_from([None, *EVICTION]))
@example(serves=list("WXYZ"), device_blocks=2, tier_blocks=2, device="lru", cpu="mru")
# X's copy in the tier, used again (a CPU hit, then a device hit), is evicted before the older
# Y's, were the device's giving up X no use of its copy
@example(serves=["X", "Y", 4, "X", "X", "Z", 4, "W", 4, "X", "Y"], device_blocks=5,
         tier_blocks=2, device="lru", cpu=None)
def test_the_cpu_tier_evicts_by_its_own_policy_in_the_order_of_use(
        serves, device_blocks, tier_blocks, device, cpu):
    """cpu_eviction_policy orders the tier (the device's when None), whatever the device's is,
    and a copy's place in it follows use: its copy in, a copy back (a CPU hit), and the device
    giving up a block the tier holds a copy of, each a use (its freed_at starts again). Served
    one at a time: prompts of a block and a token ("U".."Z"), each of whose block the device
    caches, and k fillers of less than a block (cached nowhere), whose blocks push cached ones
    out of the device (at most all but one at once: the watermark). A model of both pools (the
    device: its empty blocks, its cached ones by its policy; the tier: copies by its policy, no
    hits counted) says each prompt's hit (the device's, the tier's, or none), the tier's
    evictions in order, and what it holds at the end."""
    trace = pagetrace.Trace()
    per_block = bytes_per_block(Engine(MODEL, block_size=4, num_blocks=1))
    engine = Engine(MODEL, block_size=4, num_blocks=device_blocks, eviction_policy=device,
                    cpu_eviction_policy=cpu, observer=trace,
                    cpu_cache_bytes=tier_blocks * per_block)
    device_score, cpu_score = EVICTION_POLICIES[device], EVICTION_POLICIES[cpu or device]
    clock = itertools.count()  # a release's freed_at, in either pool: only their order counts
    stamp = itertools.count()  # a publish's cached_at (FIFO's order), likewise
    empty, cached, tier = device_blocks, {}, {}  # cached, tier: prompt -> its block's state
    held = set()  # the tier's copies being copied back: not evictable
    expected_evictions, expected_hits, hits = [], [], []

    def victim(blocks, score):  # the lowest score, ties least recently freed
        return min(blocks, key=lambda name: (score(blocks[name]), blocks[name].freed_at))

    def offload(name):  # the device gives up name's block
        if name in tier:  # a use of its copy
            tier[name].freed_at = next(clock)
        elif len(held) < tier_blocks:  # the tier has room: its victim makes it
            if len(tier) == tier_blocks:
                expected_evictions.append(victim({n: b for n, b in tier.items()
                                                  if n not in held}, cpu_score))
                del tier[expected_evictions[-1]]
            tier[name] = SimpleNamespace(freed_at=next(clock), cached_at=next(stamp),
                                         num_hits=0)

    def take():  # a device block: an empty one, else the cached one the policy gives up
        nonlocal empty
        if empty:
            empty -= 1
        else:
            name = victim(cached, device_score)
            del cached[name]
            offload(name)

    params = SamplingParams(max_tokens=1, temperature=0)
    for serve in serves:
        before = engine.stats()
        if isinstance(serve, int):  # fillers: all but one of the pool's blocks at most, at once
            engine.generate([[30, 31, i] for i in range(serve)], params)
            for _ in range(min(serve, device_blocks - 1)):
                take()
            empty += min(serve, device_blocks - 1)
            continue
        out = engine.generate([[10 + PROMPTS.index(serve), 1, 2, 3, 4]], params)[0]
        s = engine.stats()
        hits.append("cpu" if s["num_reloaded_blocks"] > before["num_reloaded_blocks"] else
                    "device" if out.num_cached_tokens else None)
        if serve in cached:  # shared, and a block for the last token
            expected_hits.append("device")
            block = cached.pop(serve)
            block.num_hits += 1
            take()
        elif serve in tier:  # copied back into a fresh block (its copy held meanwhile), then
            expected_hits.append("cpu")  # a block for the last token
            held.add(serve)
            take()
            held.clear()
            tier[serve].freed_at = next(clock)
            block = SimpleNamespace(num_hits=0, cached_at=next(stamp))  # published again
            take()
        else:
            expected_hits.append(None)
            block = SimpleNamespace(num_hits=0, cached_at=next(stamp))
            take()
            take()
        empty += 1  # freed tail first: the last token's block, then the cached one
        block.freed_at = next(clock)
        cached[serve] = block
    names, evicted = {}, []
    for e in trace.events:
        if e["event"] == "cpu_publish":
            names[e["block"]] = PROMPTS[e["tokens"][0] - 10]
        elif e["event"] == "cpu_evict":
            evicted.append(names.pop(e["block"]))
    assert hits == expected_hits
    assert evicted == expected_evictions
    assert sorted(names.values()) == sorted(tier)


@st.composite
def conversation_rounds(draw):
    """Multi-turn chats in rounds: each round sends some conversations' next turns at once
    (the conversation so far, earlier answers included, and new tokens), so conversations come
    back after others have pushed their history out of a small device pool."""
    num_convs = draw(st.integers(2, 4))
    rounds = draw(st.lists(st.lists(st.tuples(st.integers(0, num_convs - 1),
                                              st.lists(st.integers(0, 15), min_size=1,
                                                       max_size=5)),
                                    min_size=1, max_size=3, unique_by=lambda t: t[0]),
                           min_size=2, max_size=5))
    return num_convs, rounds


@pytest.mark.tier
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chats=conversation_rounds(), block_size=st.sampled_from([1, 2, 4]),
       spare=st.integers(0, 4), mode=st.sampled_from(["recompute", "swap"]),
       tier_blocks=st.sampled_from([2, 6, 32]), policy=st.sampled_from(EVICTION),
       fail_at=st.sets(st.integers(1, 40), max_size=2), sampled=st.booleans(),
       abort_after=st.none() | st.integers(0, 3), kind=st.sampled_from(sorted(PAGED_MODELS)),
       speculate=st.booleans())
def test_the_cpu_tier_changes_no_output_and_counts_the_copies_it_makes(
        chats, block_size, spare, mode, tier_blocks, policy, fail_at, sampled, abort_after, kind,
        speculate):
    """Returning conversations on a small device pool, preemption in both modes, steps that fail
    (after the forward) and are retried, and in each round a request beside them (a head of a
    conversation) aborted after a few steps, on a model of each attention kind and a hybrid,
    speculating or not (lookahead slots take blocks too): greedy or seeded outputs with the tier
    equal those without it.
    After every step, the tier's counters are the copies the steps that stood made (offloads,
    reloads), and its hit tokens what each sequence's hit adds to the hit the device alone holds
    for it as it is allocated (seen from the keys of the device's blocks); no offload wrote a
    prefix the tier held before the step, unless the tier evicted it in the step (each is written
    once while it stays); and at the end both tiers hold exactly the K/V their tokens produce."""
    num_convs, rounds = chats
    model = PAGED_MODELS[kind]
    longest = 6 * 5 + 3 * 4  # every round's new tokens and answers
    worst = Engine(model, block_size=block_size, num_blocks=1024).allocator.max_blocks(
        longest, 1) + 1

    def serve(engine, fail):
        histories, answers, asides = [[] for _ in range(num_convs)], [], []
        real_forward, calls = GPT.forward, [0]

        def forward(self, *args, **kwargs):
            logits = real_forward(self, *args, **kwargs)
            calls[0] += 1
            if fail and calls[0] in fail_at:
                raise RuntimeError("injected")
            return logits
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(GPT, "forward", forward)
            for turns in rounds:
                ids = [engine.add_request(histories[c] + new, SamplingParams(
                    max_tokens=3, temperature=1.0 if sampled else 0, seed=len(answers) + i))
                    for i, (c, new) in enumerate(turns)]
                c = turns[0][0]
                aside = engine.add_request(histories[c][:4 * block_size] + [31],
                                           SamplingParams(max_tokens=3))
                outputs, steps = {}, 0
                for _ in range(300):  # bounded: see drain
                    if steps == abort_after and aside in engine.requests:
                        engine.abort(aside)
                    if not set(ids) & set(engine.requests):
                        break
                    try:
                        outputs.update({o.request_id: o for o in checked_step(engine)})
                        steps += 1
                    except RuntimeError as e:
                        assert "injected" in str(e)
                if aside in engine.requests:
                    engine.abort(aside)
                asides.append(histories[c][:4 * block_size] + [31] + (
                    outputs[aside].outputs[0].token_ids if aside in outputs else []))
                for (c, new), i in zip(turns, ids):
                    histories[c] += new + outputs[i].outputs[0].token_ids
                    answers.append(outputs[i].outputs[0].token_ids)
        return answers, histories + asides

    def checked_step(engine):
        a, copies, evicted, hits = engine.allocator, [], set(), []  # hits: (blocks, device's)
        tier, real_allocate, written = a.swap_pool, a.allocate, set()  # written: offloads' keys
        real_copy = engine.model_runner.copy_blocks
        engine.model_runner.copy_blocks = lambda c: copies.append(c) or real_copy(c)
        held_before = {b.block_id: b.hash for b in tier.blocks if b.hash is not None}
        tier.prefix_cache.observer = lambda e: e["event"] == "cpu_evict" and evicted.add(
            held_before.get(e["block"]))
        # the key an offload writes, as it writes it: a later take in the step (a swap-out's)
        # may evict its block and publish another key there
        tier.observer = lambda e: e["event"] == "offload" and written.add(
            tier.blocks[e["cpu_block"]].hash)

        def allocate(seq):
            on_device = hit_on_device(a, seq)
            copies = real_allocate(seq)
            hits.append((seq.num_computed_tokens // a.block_size, on_device))
            return copies
        a.allocate = allocate
        before = engine.stats()
        try:
            outputs = engine.step()
        finally:
            engine.model_runner.copy_blocks = real_copy
            del tier.prefix_cache.observer, tier.observer, a.allocate
        s, (made,) = engine.stats(), copies or [nanopaged.BlockCopies()]
        offloaded, reloaded = len(made.offload), len(made.reload)
        assert s["num_offloaded_blocks"] - before["num_offloaded_blocks"] == offloaded
        assert s["num_reloaded_blocks"] - before["num_reloaded_blocks"] == reloaded
        assert s["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == \
            sum(n for n, _ in hits) * engine.block_size
        assert s["prefix_cache_cpu_hit_tokens"] - before["prefix_cache_cpu_hit_tokens"] == \
            sum(n - on_device for n, on_device in hits) * engine.block_size
        # a prefix the tier held is written again only once the tier has given it up
        assert written & set(held_before.values()) <= evicted
        return outputs

    settings_ = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                     max_num_batched_tokens=8, max_num_seqs=3,
                     speculative_config=speculative_config("ngram", 2, model) if speculate
                     else None)
    expected, _ = serve(Engine(model, **settings_), fail=False)
    engine = Engine(model, **settings_, eviction_policy=policy,
                    cpu_cache_bytes=tier_blocks * bytes_per_block(Engine(model, **settings_)))
    answers, histories = serve(engine, fail=True)
    assert answers == expected
    assert_all_blocks_free(engine)
    prefixes = {}
    for tokens in histories:
        for n in range(len(tokens) + 1):
            prefixes |= keys_of(tokens[:n], block_size)
    cached_kv_is_recomputed_kv(engine, prefixes)
    event(f"reloaded: {engine.stats()['num_reloaded_blocks'] > 0}")


# -- connectors: where blocks go when they leave the device, and come back from  (-m tier)


class SuiteStore(connectors.Connector):
    """The suite's own connector, so that every property over connectors runs under one nobody
    built in: each published block's K/V and key bounds, kept by its key in a dict, copied in
    on a hit."""
    enabled = True

    def __init__(self, facts):
        self.allocator, self.kept = facts.allocator, {}  # key -> (tokens, index), tensors

    def find(self, key, seq, i):
        bs = self.allocator.block_size
        kept = self.kept.get(key)
        return key if kept and kept[0] == (tuple(seq.token_ids[i * bs:(i + 1) * bs]), i) else None

    def save(self, block, copies, evicted):
        if not evicted:
            copies.offload.append((block.block_id, (block.hash, block.token_ids,
                                                    block.logical_index)))

    def transfer(self, copies, runner, stage):
        tensors = [cache for cache, _ in runner.paged_tensors()]
        if stage == "in":
            for key, block_id in copies.reload:
                for cache, data in zip(tensors, self.kept[key][1]):
                    cache[:, :, block_id] = data
        elif stage == "computed":
            for block_id, (key, tokens, index) in copies.offload:
                data = [cache[:, :, block_id].clone() for cache in tensors]
                self.kept[key] = (tokens, index), data


connectors.CONNECTORS["suite_store"] = SuiteStore

# What a connector needs to be built in a test (a size, a folder of the test's own): a
# connector not named here takes none
CONNECTOR_SETTINGS = {
    "cpu": lambda engine, folder: {"cpu_cache_bytes": 6 * bytes_per_block(engine)},
    "disk": lambda engine, folder: {"path": folder},
}


def served_connectors():  # every registered connector that serves within one process
    return sorted(name for name, make in connectors.CONNECTORS.items()
                  if not getattr(make, "needs_peer", False))


@pytest.mark.tier
@pytest.mark.parametrize("name", served_connectors())
@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chats=conversation_rounds(), block_size=st.sampled_from([1, 2, 4]),
       spare=st.integers(0, 4), mode=st.sampled_from(["recompute", "swap"]),
       sampled=st.booleans(), kind=st.sampled_from(sorted(PAGED_MODELS)),
       fail_at=st.sets(st.tuples(st.integers(1, 30), st.sampled_from(["out", "in", "computed"])),
                       max_size=2))
def test_every_connector_changes_no_output_and_holds_nothing_after(
        name, chats, block_size, spare, mode, sampled, kind, fail_at):
    """Conversations that come back to a small device pool, with preemption in both modes and
    transfers that fail (at a stage of a step's run: the step fails, its plan is undone, and the
    next step computes the same tokens), on a model of each attention kind and a hybrid: greedy
    or seeded outputs through every registered connector equal those of an engine without one;
    afterwards no block is held, and every cached block holds the K/V its tokens produce (so no
    block a failed load touched kept a prefix)."""
    num_convs, rounds = chats
    model = PAGED_MODELS[kind]
    longest = 6 * 5 + 3 * 4  # every round's new tokens and answers
    worst = Engine(model, block_size=block_size, num_blocks=1024).allocator.max_blocks(
        longest, 1) + 1
    engine_settings = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                           max_num_batched_tokens=8, max_num_seqs=3)

    def serve(engine):
        histories, answers = [[] for _ in range(num_convs)], []
        for turns in rounds:
            ids = [engine.add_request(histories[c] + new, SamplingParams(
                max_tokens=3, temperature=1.0 if sampled else 0, seed=len(answers) + i))
                for i, (c, new) in enumerate(turns)]
            outputs = {}
            for _ in range(300):  # bounded: see drain
                if not engine.requests:
                    break
                before = counts_of(engine)  # the connector's counts among them
                try:
                    outputs.update({o.request_id: o for o in engine.step()})
                except RuntimeError as e:
                    assert "injected" in str(e)
                    assert counts_of(engine) == before  # a failed step counts nothing
            for request_id, (c, new) in zip(ids, turns):
                answer = outputs[request_id].outputs[0].token_ids
                histories[c] += new + answer
                answers.append(answer)
        return answers, histories

    expected, _ = serve(Engine(model, **engine_settings))
    with tempfile.TemporaryDirectory() as folder:
        config = CONNECTOR_SETTINGS.get(name, lambda engine, folder: {})(
            Engine(model, **engine_settings), folder)
        engine = Engine(model, **engine_settings, connector=name, connector_config=config)
        connector, calls = engine.allocator.connector, Counter()
        real_transfer = connector.transfer

        def transfer(copies, runner, stage):  # fails at the chosen calls of each stage
            calls[stage] += 1
            if (calls[stage], stage) in fail_at:
                raise RuntimeError(f"injected into the connector's transfer at stage {stage}")
            return real_transfer(copies, runner, stage)
        with mock.patch.object(connector, "transfer", transfer):
            answers, histories = serve(engine)
        assert answers == expected
        assert_all_blocks_free(engine)
        assert engine.stats()["num_staged_blocks"] == 0
        prefixes = {}
        for tokens in histories:
            for n in range(len(tokens) + 1):
                prefixes |= keys_of(tokens[:n], block_size)
        cached_kv_is_recomputed_kv(engine, prefixes)
        event(f"{name} reloaded: {engine.stats()['num_reloaded_blocks'] > 0}")


# -- the disk store: cached prefixes in files, one per block key, a server restarted over the
# same folder serves them  (-m connector)


def disk_engine(folder, model=MODEL, **settings):
    return Engine(model, connector="disk", connector_config={"path": str(folder)}, **settings)


def disk_files(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".kv"))


def conversation_params(kind, seed):
    """One turn's SamplingParams: greedy, seeded, two seeded samples, or two beams."""
    return dict(greedy=SamplingParams(max_tokens=3, temperature=0),
                seeded=SamplingParams(max_tokens=3, temperature=1.0, seed=seed),
                samples=SamplingParams(max_tokens=3, temperature=1.0, seed=seed, n=2),
                beams=SamplingParams(max_tokens=3, beam_width=2))[kind]


def serve_rounds(engine, chats, params_kind):
    """The rounds of conversation_rounds, each round's turns at once, every step retried while
    it fails with an injected error. Returns every output's token ids, in order."""
    num_convs, rounds = chats
    histories, answers = [[] for _ in range(num_convs)], []
    for turns in rounds:
        ids = [engine.add_request(histories[c] + new,
                                  conversation_params(params_kind, len(answers) + i))
               for i, (c, new) in enumerate(turns)]
        outputs = {}
        for _ in range(300):  # bounded: see drain
            if not engine.scheduler.has_unfinished():
                break
            try:
                outputs.update({o.request_id: o for o in engine.step() if o.finished})
            except RuntimeError as e:
                assert "injected" in str(e)
        for (c, new), i in zip(turns, ids):
            histories[c] += new + outputs[i].outputs[0].token_ids
            answers.append([o.token_ids for o in outputs[i].outputs])
    return answers


@pytest.mark.connector
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chats=conversation_rounds(), block_size=st.sampled_from([1, 2, 4]),
       spare=st.integers(0, 4), mode=st.sampled_from(["recompute", "swap"]),
       kind=st.sampled_from(sorted(PAGED_MODELS)),
       params=st.sampled_from(["greedy", "seeded", "samples", "beams"]),
       fp8=st.booleans(), speculate=st.booleans(), fail_at=st.sets(st.integers(1, 60), max_size=2))
def test_the_disk_store_changes_no_output_and_serves_a_restarted_engine(
        tmp_path_factory, chats, block_size, spare, mode, kind, params, fp8, speculate, fail_at):
    """Conversations that come back on a small device pool, preemption in both modes, on a model
    of each attention kind, greedy, seeded, two samples or two beams, an 8-bit cache or not,
    speculating by n-grams or not, with transfers that fail (after they copied) and steps
    retried: the outputs with the disk store equal those without it; then an engine started
    over the same folder serves them again, the same, its prefixes read from disk. Every block
    comes back, and no read is held once the requests are done."""
    model, folder = PAGED_MODELS[kind], tmp_path_factory.mktemp("disk")
    speculate = speculate and params in ("greedy", "seeded")  # no guesses for n > 1 or beams
    longest = 6 * 5 + 3 * 4  # every round's new tokens and answers
    num_seqs = 2 if params in ("samples", "beams") else 1
    worst = num_seqs * Engine(model, block_size=block_size, num_blocks=1024).allocator.max_blocks(
        longest, 1) + num_seqs
    settings_ = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                     max_num_batched_tokens=8, max_num_seqs=3,
                     kv_cache_dtype="fp8" if fp8 else "auto",
                     speculative_config=speculative_config("ngram", 2, model) if speculate
                     else None)
    expected = serve_rounds(Engine(model, **settings_), chats, params)
    real_transfer, calls = connectors.DiskStore.transfer, [0]

    def transfer(self, copies, runner, stage):
        real_transfer(self, copies, runner, stage)
        calls[0] += 1
        if calls[0] in fail_at:
            raise RuntimeError("injected")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(connectors.DiskStore, "transfer", transfer)
        first = disk_engine(folder, model, **settings_)
        assert serve_rounds(first, chats, params) == expected
    restarted = disk_engine(folder, model, **settings_)
    assert serve_rounds(restarted, chats, params) == expected
    for engine in (first, restarted):
        assert_all_blocks_free(engine)
        assert engine.allocator.connector.staged == {}
        assert engine.stats()["num_refused_disk_files"] == 0
    event(f"loaded: {first.stats()['num_reloaded_blocks'] > 0}, restarted engine loaded: "
          f"{restarted.stats()['num_reloaded_blocks'] > 0}")
    event(f"failed transfers: {len({n for n in fail_at if n <= calls[0]})}")


@pytest.mark.connector
@pytest.mark.parametrize("kind", ["gpt2", "hybrid"])
def test_a_restarted_engine_serves_an_earlier_prefix_from_disk(tmp_path, kind):
    """An engine writes each block it publishes; a second engine over the same folder (a server
    restarted) serves the first one's prompt and answer from disk: counted as hits and loads,
    the same output as an engine without the store, and its device blocks hold exactly the K/V
    their tokens produce (in each KV cache group of a hybrid model)."""
    model, params = PAGED_MODELS[kind], SamplingParams(max_tokens=4, temperature=0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    first = disk_engine(tmp_path, model, block_size=4, num_blocks=32)
    history = prompt + first.generate([prompt], params)[0].outputs[0].token_ids
    groups = len(first.allocator.kinds)
    assert len(disk_files(tmp_path)) == groups * (len(history) - 1) // 4  # each block once
    assert first.stats()["num_offloaded_blocks"] == len(disk_files(tmp_path))
    restarted = disk_engine(tmp_path, model, block_size=4, num_blocks=32)
    out = restarted.generate([history + [7]], params)[0]
    plain = Engine(model, block_size=4, num_blocks=32).generate([history + [7]], params)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.num_cached_tokens == 16 and plain.num_cached_tokens == 0
    s = restarted.stats()
    assert s["prefix_cache_cpu_hit_tokens"] == 16 and s["num_reloaded_blocks"] >= 4
    # what it loaded is on disk already: it writes only the block its answer fills
    assert s["num_offloaded_blocks"] == len(disk_files(tmp_path)) - 4 * groups == groups
    cached_kv_is_recomputed_kv(restarted, keys_of(history + [7] + out.outputs[0].token_ids, 4))
    assert_all_blocks_free(restarted) and restarted.allocator.connector.staged == {}


@pytest.mark.connector
def test_key_bounds_go_to_disk_and_come_back_with_their_blocks(tmp_path):
    """Read by a policy that keeps key bounds, a block's file holds them beside its K/V: a
    restarted engine's loaded blocks keep the bounds of their keys, and its output is the
    same as without the store."""
    name = BOUNDED[0]
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt, settings_ = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9], dict(
        block_size=4, num_blocks=32, attention_backend="torch", connector="disk",
        connector_config={"path": str(tmp_path)})
    policy_engine(name, MODEL, **settings_).generate([prompt], params)
    restarted = policy_engine(name, MODEL, **settings_)
    out = restarted.generate([prompt + [7]], params)[0]
    plain = policy_engine(name, MODEL, block_size=4, num_blocks=32, attention_backend="torch")
    expected = plain.generate([prompt + [7]], params)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens == 12 and restarted.stats()["num_reloaded_blocks"] == 3
    r = restarted.model_runner
    for b in (b for b in restarted.allocator.blocks if b.hash is not None):
        keys = r.kv_cache[0, :, b.block_id].to(r.key_bounds.dtype)  # (L, bs, nkv, hs)
        assert torch.equal(r.key_bounds[0, :, b.block_id], keys.amin(1))
        assert torch.equal(r.key_bounds[1, :, b.block_id], keys.amax(1))


# another engine's files, each differing from MODEL's at block size 4 in one thing the header
# checks: the weights, the KV cache's dtype, the block size, the paged tensors (key bounds)
OTHER_ENGINES = {"model": dict(model=tiny_model(seed=7)), "dtype": dict(kv_cache_dtype="fp8"),
                 "block size": dict(block_size=2), "key bounds": dict(read_policy="quest")}


@pytest.mark.connector
@pytest.mark.parametrize("other", sorted(OTHER_ENGINES))
def test_files_of_another_engine_are_refused_never_read_as_kv(tmp_path, other):
    """Another engine wrote the prompt's blocks under the names this engine looks for (a file of
    another block size renamed to this one's key): each is refused (no hit), left in place,
    and counted; the output is right; then this engine's own blocks replace them, and an engine
    like it started after serves the prompt from disk."""
    settings_ = dict(block_size=4, num_blocks=32)
    other_settings = settings_ | OTHER_ENGINES[other]
    other_model = other_settings.pop("model", MODEL)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    params = SamplingParams(max_tokens=1, temperature=0)
    writer = disk_engine(tmp_path, other_model, **other_settings)
    writer.generate([prompt], params)
    ours = keys_of(prompt, 4)
    theirs = keys_of(prompt, other_settings["block_size"])
    for mine, key in zip(ours, theirs):  # block i's file under this engine's key for block i
        os.replace(tmp_path / f"{key.hex()}.rank0.kv", tmp_path / f"{mine.hex()}.rank0.kv")
    planted = {name: (tmp_path / name).read_bytes() for name in disk_files(tmp_path)}
    engine = disk_engine(tmp_path, **settings_)
    out = engine.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == naive_greedy(MODEL, prompt, 1)
    assert out.num_cached_tokens == 0 and engine.stats()["num_reloaded_blocks"] == 0
    assert engine.stats()["num_refused_disk_files"] == 1  # the hit stops at the first block
    later = disk_engine(tmp_path, **settings_)
    out = later.generate([prompt + [7]], params)[0]
    assert out.num_cached_tokens == 12 and later.stats()["num_refused_disk_files"] == 0
    assert out.outputs[0].token_ids == naive_greedy(MODEL, prompt + [7], 1)
    assert all((tmp_path / name).read_bytes() != data for name, data in planted.items()
               if name in {f"{k.hex()}.rank0.kv" for k in ours})


def damage(path, how):
    """Spoil a block file: a payload byte flipped, the file cut in half, or emptied."""
    data = path.read_bytes()
    if how == "corrupt":
        data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    elif how == "truncated":
        data = data[:len(data) // 2]
    else:
        data = b""
    path.write_bytes(data)


@pytest.mark.connector
@pytest.mark.parametrize("how", ["corrupt", "truncated", "empty"])
@pytest.mark.parametrize("which", [0, 1])
def test_a_corrupt_or_torn_file_is_a_miss_and_is_written_again(tmp_path, how, which):
    """One block's file is spoiled: the restarted engine's hit stops before it (its blocks
    before it come from disk), the output is right, the file is deleted and, once this
    engine publishes its block again, written whole: a third engine hits every block."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    params = SamplingParams(max_tokens=1, temperature=0)
    disk_engine(tmp_path, block_size=4, num_blocks=32).generate([prompt], params)
    spoiled = tmp_path / f"{list(keys_of(prompt, 4))[which].hex()}.rank0.kv"
    damage(spoiled, how)
    engine = disk_engine(tmp_path, block_size=4, num_blocks=32)
    out = engine.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == naive_greedy(MODEL, prompt, 1)
    assert out.num_cached_tokens == 4 * which
    assert engine.stats()["num_refused_disk_files"] == 1
    # the spoiled one is written again; the whole ones after it, computed again, are not
    assert engine.stats()["num_offloaded_blocks"] == 1
    third = disk_engine(tmp_path, block_size=4, num_blocks=32)
    assert third.generate([prompt], params)[0].num_cached_tokens == 12
    assert third.stats()["num_refused_disk_files"] == 0


@pytest.mark.connector
@pytest.mark.parametrize("stage", ["in", "computed"])
def test_a_failure_inside_a_transfer_fails_the_step_and_leaks_nothing(tmp_path, stage):
    """A transfer that raises halfway (at "in": after one block of a load is copied into the
    device; at "computed": after one block's file is written) fails the step: no device block
    the load touched keeps a prefix, the next steps compute the same tokens as an engine without
    the store, every block comes back and no read is held. The files on disk stay whole."""
    params = SamplingParams(max_tokens=3, temperature=0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    if stage == "in":  # on disk before, with other prompts' blocks cached on the device
        disk_engine(tmp_path, block_size=4, num_blocks=12).generate([prompt], params)
    engine = disk_engine(tmp_path, block_size=4, num_blocks=12)
    for i in range(4):  # every block cached and free: a load evicts one of them
        engine.generate([[20 + i] * 10], params)
    assert not engine.allocator.empty_block_ids
    held = [b.hash for b in engine.allocator.blocks]  # each block's prefix before the step
    store, touched = engine.allocator.connector, []
    real_copy_in, real_write_file = store.copy_in, store.write_file

    def copy_in(reload, runner):  # one block copied, then the failure
        touched.extend(block_id for _, block_id in reload)
        real_copy_in(reload[:1], runner)
        raise RuntimeError("injected")

    def write_file(handle, payload):  # the second file fails
        if touched:
            raise RuntimeError("injected")
        touched.append(handle)
        real_write_file(handle, payload)
    if stage == "in":
        store.copy_in = copy_in
    else:
        store.write_file = write_file
    request_id = engine.add_request(prompt, params)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert touched
    if stage == "in":
        assert all(held[b] is not None for b in touched)  # each one held a prefix, and
        assert all(engine.allocator.blocks[b].hash is None for b in touched)  # has none now
    assert store.staged == {}
    store.copy_in, store.write_file = real_copy_in, real_write_file
    out = drain(engine)
    assert out[request_id].outputs[0].token_ids == naive_greedy(MODEL, prompt, 3)
    assert_all_blocks_free(engine) and store.staged == {}
    restarted = disk_engine(tmp_path, block_size=4, num_blocks=12)
    assert restarted.generate([prompt], params)[0].num_cached_tokens == 12
    assert restarted.stats()["num_refused_disk_files"] == 0


@pytest.mark.connector
@pytest.mark.parametrize("config, message", [
    (None, "connector_config={'path': FOLDER}"),
    ({}, "connector_config={'path': FOLDER}"),
    ({"path": "/no/such/folder"}, "an existing folder, got path='/no/such/folder'"),
    ({"path": __file__}, "an existing folder"),
    ({"path": ".", "size": 1}, "does not fit connector 'disk'"),
])
def test_a_disk_store_without_a_folder_is_a_clear_error(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(MODEL, block_size=4, num_blocks=8, connector="disk", connector_config=config)


@pytest.mark.connector
def test_the_disk_store_refuses_a_draft_model_and_serves_ngrams(tmp_path):
    """A draft model's K/V sit in every block beside the target's, and the store saves the
    target's only: refused up front, naming both. Guesses by n-grams keep no K/V: served."""
    with pytest.raises(ValueError, match="connector='disk'.*draft model"):
        disk_engine(tmp_path, block_size=4, num_blocks=8,
                    speculative_config=speculative_config("draft=target", 2, MODEL))
    disk_engine(tmp_path, block_size=4, num_blocks=8,
                speculative_config=speculative_config("ngram", 2, MODEL))


@pytest.mark.connector
def test_the_disk_store_refuses_tensor_parallelism(tmp_path, monkeypatch):
    """Each rank reads its own files, and nothing makes the ranks agree on a hit: refused up
    front, naming both (a mismatch would otherwise diverge the ranks' schedules)."""
    monkeypatch.setattr(parallel.tp, "world_size", 2)  # as a rank of two sees it
    with pytest.raises(ValueError, match="connector='disk' does not run under tensor parallel"):
        connectors.make_connector(
            "disk", {"path": str(tmp_path)}, allocator=None, model=MODEL, block_shape=None,
            dtype=torch.float32, paged_blocks=[], device="cpu", rank=0,
            world_size=parallel.tp.world_size, speculative=None, prefix_caching=True)


# -----------------------------------------------------------------------------
# 5. The block allocator: free list, ref counts, copy-on-write  (-m allocator)
#
# The test keeps a fake KV cache that stores token ids instead of K/V vectors. It "computes"
# a token by writing its id into the slot the block table names, performs the block copies
# the allocator asks for, and so can read every sequence back through its table.


class Cache:
    """Fake KV: token ids in block slots, refusing writes into shared blocks and into the
    places no token to come sees (NO_BLOCK). Every KV cache group's table holds the tokens."""

    def __init__(self, allocator, num_blocks, num_cpu_blocks, block_size):
        self.allocator, self.bs = allocator, block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]

    def compute(self, seq, num_new=None):
        """Write seq's next num_new tokens (by default all it has), as a model step would, and
        publish the blocks they fill."""
        end = len(seq) if num_new is None else seq.num_computed_tokens + num_new
        for table in seq.block_tables:
            for p in range(seq.num_computed_tokens, end):
                block_id = table[p // self.bs]
                assert block_id != NO_BLOCK, f"position {p} has no block to be written into"
                assert self.allocator.blocks[block_id].ref_count == 1, \
                    f"write into shared block {block_id}"
                self.device[block_id][p % self.bs] = seq.token_ids[p]
        self.allocator.cache_full_blocks(seq, end)
        seq.num_computed_tokens = end

    def copy(self, pairs, src_pool, dst_pool):
        for src, dst in pairs:
            dst_pool[dst] = list(src_pool[src])

    def read(self, seq, pool, table):
        """seq's computed tokens as table holds them; None where no block is left."""
        blocks = [table[p // self.bs] for p in range(seq.num_computed_tokens)]
        return [None if b == NO_BLOCK else pool[b][p % self.bs] for p, b in enumerate(blocks)]


def allocate_whole(a, seq):
    """Give seq its prefix hit and blocks for all its other tokens at once, as one chunk."""
    a.allocate(seq)
    return a.allocate_slots(seq, len(seq) - seq.num_computed_tokens)


def free_order(a):
    """The free blocks in the order the allocator hands them out (the allocate rule checks it)."""
    cached = a.prefix_cache.evictable
    return a.empty_block_ids[::-1] + sorted(cached, key=cached.get)


def allocator_state(a):
    return state_of(a)


def group_key(key, group):
    """A block's prefix-cache key in a KV cache group: the chained key, made the group's own
    past the first (the groups' blocks hold other layers' K/V)."""
    return key if group == 0 else hashlib.sha256(bytes([group]) + key).digest()


def held(tables):
    return [b for table in tables for b in table if b != NO_BLOCK]


def unseen_blocks(kind, n, num_blocks, block_size):
    """The model of the blocks a sequence no longer needs once its first n tokens are computed:
    those of its first num_blocks whose every key no token from position n on sees, by the
    kind's mask alone (key k is first seen, if ever, by position max(n, k): the first position
    a query sees only moves on)."""
    def needed(k):
        return bool(kind.mask.visible(torch.tensor(max(n, k)), torch.tensor(k)))
    return {j for j in range(num_blocks)
            if not any(needed(k) for k in range(j * block_size, (j + 1) * block_size))}


def kinds_of(sizes=st.integers(1, 4)):
    """Per KV cache group an attention kind, one or two groups (a hybrid model), each of every
    registered kind (the suite's own included), with windows and chunks of a few tokens."""
    def kind(name, window, chunk):
        config = SimpleNamespace(sliding_window=window, attention_chunk_size=chunk)
        return nanopaged.ATTENTION_KINDS[name].from_config(config)
    return st.lists(st.builds(kind, st.sampled_from(KINDS), sizes, sizes), min_size=1,
                    max_size=2).map(tuple)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator alone, with one KV cache group or two side by side (a hybrid model: a table
    per group over one pool), of every attention kind. Every move takes the blocks it counted,
    from the front of the free list; ref counts are the tables' entries; what a kind no longer
    needs goes back, and those blocks are taken again; a sequence holds no more than its
    kinds' bound."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(1, 12),
                num_cpu_blocks=st.integers(0, 8), caching=st.booleans(),
                policy=st.sampled_from(EVICTION),
                kinds=st.sampled_from([(nanopaged.FullAttention(),)]) | kinds_of())
    def setup(self, block_size, num_blocks, num_cpu_blocks, caching, policy, kinds):
        self.a = BlockAllocator(num_blocks * len(kinds), block_size, num_cpu_blocks,
                                enable_prefix_caching=caching, eviction_policy=policy,
                                kinds=kinds)
        self.kinds = kinds
        self.score = EVICTION_POLICIES[policy]
        self.cache = Cache(self.a, self.a.num_blocks, num_cpu_blocks, block_size)
        self.on_device, self.on_cpu = [], []  # live sequences, by where their blocks are
        self.next_id = 0
        # A plain model of the prefix cache: key (each group's own) -> the blocks that hold it,
        # in publishing order, from what was computed and handed out
        self.published = {}
        self.freed_at, self.clock = {}, 0  # when each free block joined the free list

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def unseen(self, group, n, num_blocks):
        return unseen_blocks(self.kinds[group], n, num_blocks, self.a.block_size)

    def model_hits(self, tokens):
        """The longest run of leading full blocks (never the last token's) whose blocks each
        group needs are cached, the model says: all but those no token after them sees."""
        bs, key, keys = self.a.block_size, None, []
        for i in range((len(tokens) - 1) // bs if self.a.prefix_cache.enabled else 0):
            keys.append(key := chain_hash(key, tuple(tokens[i * bs:(i + 1) * bs])))

        def served(n):
            return all(group_key(keys[i], g) in self.published for g in range(len(self.kinds))
                       for i in set(range(n)) - self.unseen(g, n * bs, n))
        return max(n for n in range(len(keys) + 1) if served(n))

    def keys(self, seq):
        """The keys of seq's full computed blocks."""
        bs, key, keys = self.a.block_size, None, []
        for i in range(seq.num_computed_tokens // bs if self.a.prefix_cache.enabled else 0):
            keys.append(key := chain_hash(key, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return keys

    def forget(self, lost):
        """The model's published blocks, but those in lost (handed out fresh: evicted)."""
        holders = {k: [b for b in blocks if b not in lost] for k, blocks in self.published.items()}
        self.published = {k: blocks for k, blocks in holders.items() if blocks}

    def compute(self, seq, fresh, num_new=None):
        """The blocks handed out fresh lose what they held; then seq's next num_new tokens are
        written, and its full blocks from num_published_blocks on (after a swap, all of them: fresh
        copies) are published in each group that holds them, each beside any other block that
        holds its prefix (a twin, cached too, as in vLLM): every computed full block is
        cached."""
        self.forget(set(fresh))
        offered = seq.num_published_blocks
        self.cache.compute(seq, num_new)
        keys = self.keys(seq)
        for g, table in enumerate(seq.block_tables):
            for key, block_id in zip(keys[offered:], table[offered:]):
                if block_id != NO_BLOCK:
                    holders = self.published.setdefault(group_key(key, g), [])
                    holders += [] if block_id in holders else [block_id]
        assert seq.num_published_blocks == len(keys)
        for g, table in enumerate(seq.block_tables):
            for key, block_id in zip(keys, table):
                if block_id != NO_BLOCK:
                    key = group_key(key, g)
                    assert self.a.blocks[block_id].hash == key and block_id in self.published[key]

    def took(self, counted, free_before, tables_before, tables):
        """A move took exactly the blocks it counted: the free blocks now in seq's tables."""
        taken = (set(held(tables)) - set(held(tables_before))) & set(free_before)
        assert len(taken) == counted == len(free_before) - self.a.num_free_blocks, \
            "the blocks counted are not the blocks taken"

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), min_size=0, max_size=9))
    def allocate(self, data, suffix):
        # Prompts from a 3-letter alphabet, often extending a live sequence, so prefixes repeat.
        live = self.on_device + self.on_cpu
        prefix = (data.draw(st.sampled_from([s.token_ids for s in live]))
                  if live and data.draw(st.booleans()) else [])
        tokens = (prefix[:data.draw(st.integers(0, len(prefix)))] + suffix) or [0]
        seq = Sequence(self.new_id(), tokens, len(tokens))
        counted = self.a.num_blocks_to_allocate(seq)
        if counted > self.a.num_free_blocks:
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.allocate(seq)
            assert allocator_state(self.a) == before and not any(seq.block_tables)
            return
        free_before = free_order(self.a)
        hit_tokens_before, hits = self.a.prefix_cache.counts.hit_tokens, self.model_hits(tokens)
        self.a.allocate(seq)
        bs = self.a.block_size
        assert seq.num_computed_tokens == hits * bs < len(seq)
        assert self.a.prefix_cache.counts.hit_tokens - hit_tokens_before == seq.num_computed_tokens
        keys = self.keys(seq)
        for g, table in enumerate(seq.block_tables):  # no block where no token to come sees
            unseen = self.unseen(g, hits * bs, hits)  # one; else the prefix's first cached holder
            assert table == [NO_BLOCK if i in unseen else self.published[group_key(key, g)][0]
                             for i, key in enumerate(keys[:hits])]
        self.took(counted, free_before, [], seq.block_tables)  # a hit's blocks only, if free
        self.on_device.append(seq)

    def skip(self, seq):
        """Give back what seq's kinds no longer need: each group's blocks no token to come
        sees become NO_BLOCK, released; those nobody else holds join the free list, the
        uncached ones on top (the next taken), the last released first."""
        tables, free_before = [list(t) for t in seq.block_tables], free_order(self.a)
        refs = [b.ref_count for b in self.a.blocks]
        self.a.free_skipped_blocks(seq)
        released = []
        for g, (old, table) in enumerate(zip(tables, seq.block_tables)):
            unseen = self.unseen(g, seq.num_computed_tokens, len(old))
            assert table == [NO_BLOCK if i in unseen else b for i, b in enumerate(old)], \
                "a kind kept a block no token to come sees, or gave back one it needs"
            released += [b for i, b in reversed(list(enumerate(old)))
                         if b != NO_BLOCK and i in unseen]
        freed = [b for b in released if refs[b] == 1]
        assert len(free_before) + len(freed) == self.a.num_free_blocks
        empty = [b for b in reversed(freed) if self.a.blocks[b].hash is None]
        assert free_order(self.a)[:len(empty)] == empty

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def skip_blocks(self, data):
        self.skip(data.draw(st.sampled_from(self.on_device)))

    @precondition(lambda self: self.on_device)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=3))
    def compute_a_chunk(self, data, tokens):
        # a sequence gains tokens (or has its prompt's left), then computes a chunk of them, as
        # an engine step does: what its kinds no longer need goes back first
        seq = data.draw(st.sampled_from(self.on_device))
        seq.token_ids += tokens
        if seq.num_computed_tokens == len(seq):
            return
        num_new = data.draw(st.integers(1, len(seq) - seq.num_computed_tokens))
        self.skip(seq)
        counted = self.a.num_blocks_to_append([seq], num_new)
        # the decode's shortcut (a table takes one block at most) says what the count says
        if num_new == 1 and seq.num_computed_tokens + 1 == len(seq):
            assert self.a.can_append([seq]) == (counted <= self.a.num_free_blocks)
        # a chunk shrinks to the blocks free: the most tokens whose count fits
        fits = self.a.num_slots_free(seq, num_new)
        assert all((self.a.num_blocks_to_append([seq], n) <= self.a.num_free_blocks) == (n <= fits)
                   for n in range(num_new + 1))
        if counted > self.a.num_free_blocks:
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.allocate_slots(seq, num_new)
            assert allocator_state(self.a) == before
            return
        tables, free_before = [list(t) for t in seq.block_tables], free_order(self.a)
        copies = self.a.allocate_slots(seq, num_new).cow  # no CPU tier here: nothing else
        assert all(self.a.blocks[src].ref_count >= 1 for src, _ in copies), \
            "copy-on-write source must still be owned"
        self.cache.copy(copies, self.cache.device, self.cache.device)
        self.took(counted, free_before, tables, seq.block_tables)
        fresh = [b for old, table in zip(tables, seq.block_tables) for b in table if b not in old]
        assert fresh == free_before[:len(fresh)]  # group by group, from the front of the list
        most = self.a.max_blocks(len(seq), num_new)  # its kinds' bound, while the chunk runs
        assert len(held(seq.block_tables)) <= most
        self.compute(seq, fresh, num_new)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.on_device))
        child = parent.fork(self.new_id(), 1)
        self.a.fork(parent, child)
        assert child.block_tables == parent.block_tables
        self.on_device.append(child)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.on_device))
        tables, free_before = [list(t) for t in seq.block_tables], set(free_order(self.a))
        self.a.free(seq)
        self.on_device.remove(seq)
        if self.score is EVICTION_POLICIES["lru"]:  # tail first, group by group: of its blocks
            # that keep a cached prefix, the head of the last group joins the free list last
            free = free_order(self.a)
            cached = [b for b in free if b not in free_before and self.a.blocks[b].hash is not None]
            assert cached == [b for table in tables for b in reversed(table) if b in cached]
            assert free[len(free) - len(cached):] == cached

    def move(self, data, source, target, can_move, move, src_pool, dst_pool):
        # a request at once (a parent and its forks, say), so blocks they share stay shared
        seqs = data.draw(st.lists(st.sampled_from(source), min_size=1, unique=True))
        swap_in = move == self.a.swap_pool.swap_in
        num_free = self.a.num_free_blocks if swap_in else self.a.swap_pool.num_free_blocks
        # Swapping in, a block whose prefix the model says is cached comes back as that block,
        # which takes a free block only if it is free itself; every other block takes one.
        kept = {table[i]: self.published[group_key(key, g)][0] for seq in seqs if swap_in
                for g, table in enumerate(seq.block_tables) for i, key in enumerate(self.keys(seq))
                if table[i] != NO_BLOCK and group_key(key, g) in self.published}
        revived = {b for b in kept.values() if self.a.blocks[b].ref_count == 0}
        blocks = set(held(t for seq in seqs for t in seq.block_tables))
        num_blocks = len(blocks - kept.keys()) + len(revived)
        assert can_move(seqs) == (num_blocks <= num_free)  # exact, not an estimate
        if not can_move(seqs):
            before = allocator_state(self.a)
            with pytest.raises(OutOfBlocksError):
                move(seqs)
            assert allocator_state(self.a) == before
            return
        left = [[b == NO_BLOCK for b in t] for seq in seqs for t in seq.block_tables]
        moved = move(seqs)  # its BlockCopies: no CPU tier here, so the move's alone
        copies = moved.swap_in if swap_in else moved.swap_out
        assert num_free - (self.a.num_free_blocks if swap_in else
                           self.a.swap_pool.num_free_blocks) == num_blocks
        assert left == [[b == NO_BLOCK for b in t] for seq in seqs for t in seq.block_tables], \
            "a place given back moved, or a held block did not"
        assert not {src for src, _ in copies} & kept.keys(), "a block still cached is copied"
        self.cache.copy(copies, src_pool, dst_pool)
        for seq in seqs:
            source.remove(seq)
            target.append(seq)
        if swap_in:  # blocks taken fresh forgot their prefix; they are published again
            self.forget({b.block_id for b in self.a.blocks if b.hash is None})
            for seq in seqs:
                self.compute(seq, [], 0)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def swap_out(self, data):
        self.move(data, self.on_device, self.on_cpu, self.a.swap_pool.can_swap_out,
                  self.a.swap_pool.swap_out,
                  self.cache.device, self.cache.cpu)

    @precondition(lambda self: self.on_cpu)
    @rule(data=st.data())
    def swap_in(self, data):
        self.move(data, self.on_cpu, self.on_device, self.a.swap_pool.can_swap_in,
                  self.a.swap_pool.swap_in,
                  self.cache.cpu, self.cache.device)

    @invariant()
    def free_plus_used_is_everything(self):
        free = free_order(self.a)
        assert set(free) == {b.block_id for b in self.a.blocks if b.ref_count == 0}
        assert self.a.num_free_blocks == len(free) and \
            len(free) + sum(b.ref_count > 0 for b in self.a.blocks) == self.a.num_blocks
        assert set(self.a.swap_pool.empty_block_ids) == \
            {b.block_id for b in self.a.swap_pool.blocks if b.ref_count == 0}

    @invariant()
    def ref_counts_equal_block_table_entries(self):
        # nothing leaked: every taken block is in the tables (of any group) as often as its
        # count says, and no block is in two groups' tables
        for seqs, pool in ((self.on_device, self.a), (self.on_cpu, self.a.swap_pool)):
            counts = [0] * pool.num_blocks
            for seq in seqs:
                for b in held(seq.block_tables):
                    counts[b] += 1
            assert counts == [b.ref_count for b in pool.blocks]
            groups = [set(held(seq.block_tables[g] for seq in seqs))
                      for g in range(len(self.kinds))]
            assert sum(map(len, groups)) == len(set().union(*groups)), "a block in two groups"

    @invariant()
    def every_sequence_reads_back_what_it_computed(self):
        for seqs, pool in ((self.on_device, self.cache.device), (self.on_cpu, self.cache.cpu)):
            for seq in seqs:
                for g, table in enumerate(seq.block_tables):
                    assert len(table) == -(-seq.num_computed_tokens // self.a.block_size), \
                        "a table covers its computed tokens, its last block at most partial"
                    # blocks given back are only those no token to come sees
                    gone = {i for i, b in enumerate(table) if b == NO_BLOCK}
                    assert gone <= self.unseen(g, seq.num_computed_tokens, len(table))
                    assert self.cache.read(seq, pool, table) == [
                        None if p // self.a.block_size in gone else t
                        for p, t in enumerate(seq.token_ids[:seq.num_computed_tokens])]

    @invariant()
    def the_cache_is_the_plain_model_and_evicts_uncached_then_by_score(self):
        if not hasattr(self, "a"):
            return
        assert {k: list(blocks) for k, blocks in self.a.prefix_cache.blocks_by_key.items()} == \
            self.published
        free, blocks = free_order(self.a), self.a.blocks
        for b in free:
            self.freed_at.setdefault(b, self.clock)
        self.freed_at = {b: t for b, t in self.freed_at.items() if b in free}
        self.clock += 1
        cached = [blocks[b].hash is not None for b in free]
        assert cached == sorted(cached), "an uncached free block sits behind a cached one"
        # the policy's score of a free block cannot change while it is free
        keys = [(self.score(blocks[b]), self.freed_at[b]) for b in free if blocks[b].hash]
        assert keys == sorted(keys), "cached free blocks not by score, then least recently freed"

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for h, holders in self.a.prefix_cache.blocks_by_key.items():
            for block_id in holders:
                block = self.a.blocks[block_id]
                assert block.hash == h and list(block.token_ids) == self.cache.device[block_id]

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for seq in self.on_device:
            self.a.free(seq)
        for seq in self.on_cpu:
            self.a.swap_pool.free(seq)
        assert self.a.num_free_blocks == self.a.num_blocks
        assert self.a.swap_pool.num_free_blocks == self.a.swap_pool.num_blocks


AllocatorMachine.TestCase.settings = settings(max_examples=examples(300), stateful_step_count=40,
                                              deadline=None)
test_allocator_state_machine = pytest.mark.allocator(AllocatorMachine.TestCase)


@pytest.mark.allocator
@settings(max_examples=examples(200), deadline=None)
@given(kinds_of(st.integers(1, 40)), st.integers(1, 8), st.integers(1, 200), st.integers(1, 60),
       st.data())
def test_a_kinds_bound_holds_every_block_a_chunk_can_need(kinds, block_size, num_tokens, chunk,
                                                          data):
    # a sequence at any point, n tokens computed, about to compute a chunk: the blocks it holds
    # then are those of its first n + chunk tokens but the ones no token from n on sees; the
    # bound admission and check_request count covers them, wherever n falls
    n = data.draw(st.integers(0, num_tokens - 1))
    chunk = min(chunk, num_tokens - n)
    for kind in kinds:
        num_blocks = -(-(n + chunk) // block_size)
        held = num_blocks - len(unseen_blocks(kind, n, num_blocks, block_size))
        assert held <= kind.max_blocks(num_tokens, chunk, block_size)
        # and the kind's own rule is the model's: the blocks it gives back, the hit it needs
        assert set(kind.skipped_blocks(n, block_size)) == unseen_blocks(kind, n, n // block_size,
                                                                        block_size)
        hit = n // block_size
        assert kind.hit_blocks(hit, block_size) == sorted(
            set(range(hit)) - unseen_blocks(kind, hit * block_size, hit, block_size))


@pytest.mark.allocator
def test_a_hybrid_append_without_room_for_every_group_changes_nothing():
    # a window beside full attention, blocks of one token: each group's table needs a block for
    # the next token, and one is free; the first group's must not be taken before the refusal
    a = BlockAllocator(3, 1, kinds=(nanopaged.FullAttention(), nanopaged.SlidingWindow(2)))
    seq = Sequence(0, [1], 1)
    allocate_whole(a, seq)
    seq.num_computed_tokens = 1
    seq.token_ids.append(2)
    assert a.num_blocks_to_append([seq]) == 2 > a.num_free_blocks == 1
    before = allocator_state(a)
    with pytest.raises(OutOfBlocksError):
        a.allocate_slots(seq, 1)
    assert allocator_state(a) == before


@pytest.mark.allocator
def test_sequences_allocated_together_take_no_more_than_their_counts_sum():
    # a window of 3, blocks of one token. Cached and free, least recently freed first: the four
    # blocks of [5, 6, 7, 8], then two of [1, 1]. Of two samples recomputed together, the first
    # hits nothing and takes nothing yet (its blocks come with its chunks); the second hits the
    # blocks its window sees, [7] and [8] (those before it are not needed), and takes those 2
    a = BlockAllocator(6, 1, kinds=(nanopaged.SlidingWindow(3),))
    for tokens in ([5, 6, 7, 8], [1, 1]):
        seq = make_seq(0, tokens)
        allocate_whole(a, seq)
        seq.num_computed_tokens = len(tokens)
        a.cache_full_blocks(seq)
        a.free(seq)
    first, second = make_seq(1, [9, 9, 9]), make_seq(2, [5, 6, 7, 8, 0])
    counts = [a.num_blocks_to_allocate(seq) for seq in (first, second)]
    assert counts == [0, 2] and a.num_free_blocks == 6
    a.allocate_together([first, second])
    assert a.num_free_blocks == 6 - sum(counts)
    assert second.num_computed_tokens == 4 and second.block_table[:2] == [NO_BLOCK] * 2
    assert [a.blocks[b].token_ids for b in second.block_table[2:]] == [(7,), (8,)]


@pytest.mark.allocator
def test_block_size_one_takes_a_block_per_token():
    a = BlockAllocator(num_blocks=5, block_size=1)
    seq = make_seq(0, [7, 8, 9])
    allocate_whole(a, seq)
    assert len(seq.block_table) == 3 and a.num_free_blocks == 2
    seq.num_computed_tokens = 3
    seq.token_ids.append(10)
    assert not a.allocate_slots(seq, 1) and len(seq.block_table) == 4


@pytest.mark.allocator
def test_sequence_that_exactly_fills_its_blocks_takes_a_new_block_on_the_next_token():
    a = BlockAllocator(num_blocks=4, block_size=4)
    seq = make_seq(0, list(range(8)))
    allocate_whole(a, seq)
    assert len(seq.block_table) == 2 and a.num_free_blocks == 2
    seq.num_computed_tokens = 8
    seq.token_ids.append(8)
    assert a.num_blocks_to_append([seq]) == 1
    assert not a.allocate_slots(seq, 1) and len(seq.block_table) == 3


@pytest.mark.allocator
def test_a_prompt_gets_its_blocks_chunk_by_chunk():
    # admitted, a sequence holds its hit alone (none here); each chunk takes the blocks its
    # tokens fill, so a prompt of 10 in blocks of 4 holds 1, then 2, then 3 blocks
    a = BlockAllocator(num_blocks=8, block_size=4)
    seq = make_seq(0, list(range(10)))
    a.allocate(seq)
    assert len(seq.block_table) == 0 and a.num_free_blocks == 8
    for chunk, blocks in [(3, 1), (3, 2), (4, 3)]:
        assert a.num_blocks_to_append([seq], chunk) == blocks - len(seq.block_table)
        a.allocate_slots(seq, chunk)
        seq.num_computed_tokens += chunk
        assert len(seq.block_table) == blocks == 8 - a.num_free_blocks


@pytest.mark.allocator
def test_fork_with_a_partial_last_block_copies_it_on_first_write_only():
    a = BlockAllocator(num_blocks=8, block_size=4)
    parent = make_seq(0, list(range(6)))  # one full block, one partial block
    allocate_whole(a, parent)
    parent.num_computed_tokens = 6
    child = parent.fork(1, 1)
    a.fork(parent, child)
    assert [a.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    shared_last = parent.block_table[-1]
    child.token_ids.append(100)
    (src, dst), = a.allocate_slots(child, 1).cow  # the child writes first: it moves to a copy
    assert src == shared_last and child.block_table == [parent.block_table[0], dst]
    assert a.blocks[shared_last].ref_count == 1 and a.blocks[dst].ref_count == 1
    parent.token_ids.append(200)
    assert not a.allocate_slots(parent, 1)  # now the parent is the only owner: in place
    assert parent.block_table[-1] == shared_last
    assert a.blocks[parent.block_table[0]].ref_count == 2  # the full block stays shared


@pytest.mark.allocator
def test_out_of_blocks_leaves_the_allocator_unchanged():
    a = BlockAllocator(num_blocks=2, block_size=2)
    allocate_whole(a, make_seq(0, [1, 2, 3]))
    seq = make_seq(1, [4])
    a.allocate(seq)
    before = allocator_state(a)
    with pytest.raises(OutOfBlocksError, match="needs 1 blocks, 0 are free"):
        a.allocate_slots(seq, 1)
    assert allocator_state(a) == before


@pytest.mark.allocator
def test_double_free_raises():
    a = BlockAllocator(num_blocks=2, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    allocate_whole(a, seq)
    table = nanopaged.BlockTable()
    table.extend(seq.block_table)
    a.free(seq)
    seq.block_table = table  # a buggy caller frees the same blocks again
    with pytest.raises(RuntimeError, match="released more times than it was taken"):
        a.free(seq)


# -----------------------------------------------------------------------------
# 6. The scheduler: policies, preemption, the budgets  (-m scheduler)


def schedule_fingerprint(mode, **policies):
    """A hash of every step's SchedulerOutput and every output of a mixed workload (shared
    prefixes, samples, beams) in a pool that preempts, and the number of preemptions."""
    engine = Engine(MODEL, block_size=2, num_blocks=16, preemption_mode=mode,
                    max_num_batched_tokens=8, max_num_seqs=8, **policies)
    rng, trace, s = random.Random(0), [], engine.scheduler
    common = [rng.randrange(32) for _ in range(6)]
    for i in range(14):
        prompt = common[:rng.randrange(5)] + [rng.randrange(32) for _ in range(rng.randrange(1, 4))]
        kind = i % 3
        engine.add_request(prompt, SamplingParams(
            max_tokens=rng.randrange(4, 10), temperature=0 if kind != 1 else 1.0, seed=i,
            n=2 if kind == 1 else 1, beam_width=2 if kind == 2 else None))
    schedule = s.schedule

    def recorded():
        out = schedule()
        trace.append(([(q.seq_id, n) for q, n in out.scheduled], out.copies.cow,
                      out.copies.swap_in, out.copies.swap_out,
                      [g.request_id for g in out.preempted]))
        return out
    s.schedule = recorded
    finished = []
    for _ in range(300):
        if not s.has_unfinished():
            break
        finished += [(o.request_id, [c.token_ids for c in o.outputs])
                     for o in engine.step() if o.finished]
    trace += [finished, s.num_preemptions]
    return hashlib.sha256(repr(trace).encode()).hexdigest()[:16], s.num_preemptions


@pytest.mark.scheduler
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_default_policies_are_fcfs_and_lru(mode):
    assert schedule_fingerprint(mode) == \
        schedule_fingerprint(mode, scheduling_policy="fcfs", eviction_policy="lru")


@pytest.mark.scheduler
def test_priority_runs_lower_values_first_and_ties_in_arrival_order():
    prompts, priority = [[1, 2], [3], [4, 5, 6], [7], [8, 9]], [2, 0, 1, 0, 2]
    params = SamplingParams(max_tokens=3, temperature=0)
    for policy, order in [("priority", [1, 3, 2, 0, 4]), ("fcfs", [0, 1, 2, 3, 4])]:
        engine = Engine(MODEL, block_size=4, num_blocks=32, max_num_seqs=1,
                        scheduling_policy=policy)
        outs = engine.generate(prompts, params, priority=priority)
        assert sorted(range(5), key=lambda i: outs[i].metrics.first_scheduled_time) == order
        assert [o.outputs[0].token_ids for o in outs] == \
            [naive_greedy(MODEL, p, 3) for p in prompts]
    # streaming: one that arrives later with a lower value runs before those still waiting
    engine = Engine(MODEL, block_size=4, num_blocks=32, max_num_seqs=1,
                    scheduling_policy="priority")
    first, late = engine.add_request([1], params, priority=1), engine.add_request([2], params, 1)
    engine.step()
    urgent = engine.add_request([3], params, priority=0)
    finished = [o.request_id for _ in range(30) for o in engine.step() if o.finished]
    assert finished == [first, urgent, late]


@pytest.mark.scheduler
def test_a_preempted_request_comes_back_by_its_key_and_the_last_by_the_key_is_the_victim():
    # Under "priority" the victim is the running request with the highest value, even when it is
    # the oldest; it waits behind nothing with a higher value.
    engine = Engine(MODEL, block_size=2, num_blocks=10, max_num_seqs=4,
                    scheduling_policy="priority")
    params = SamplingParams(max_tokens=8, temperature=0)
    ids = [engine.add_request([i + 1, i + 2], params, priority=p) for i, p in enumerate([3, 0, 1])]
    victims = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        victims.extend(g.request_id for g in out.preempted)
        return out
    engine.scheduler.schedule = recorded
    outputs = drain(engine)
    assert victims and victims[0] == ids[0]
    assert [outputs[i].outputs[0].token_ids for i in ids] == \
        [naive_greedy(MODEL, [i + 1, i + 2], 8) for i in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler and the allocator without a model, under every attention kind. Each
    SchedulerOutput is checked against the policies, given the state before the step; then a
    fake model computes the scheduled tokens and samples as an engine step's commit does (forks
    the samples, appends a token, stops, frees), with tokens from a 4-letter alphabet so that
    prefixes repeat."""

    @initialize(block_size=st.integers(1, 3), num_blocks=st.integers(4, 12),
                num_cpu_blocks=st.sampled_from([0, 2, 4, 16]),
                mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
                max_num_seqs=st.integers(1, 6),
                max_num_batched_tokens=st.integers(3, 12), watermark=st.sampled_from([0.01, 0.25]),
                policy=st.sampled_from(SCHEDULING),
                # KV cache groups: full attention, or one or two of every kind
                kinds=st.sampled_from([(nanopaged.FullAttention(),)]) | kinds_of())
    def setup(self, block_size, num_blocks, num_cpu_blocks, mode, caching, max_num_seqs,
              max_num_batched_tokens, watermark, policy, kinds=(nanopaged.FullAttention(),)):
        self.a = a = BlockAllocator(num_blocks * len(kinds), block_size, num_cpu_blocks,
                                    caching, kinds=kinds)
        self.s = s = nanopaged.Scheduler(a, max_num_seqs, max_num_batched_tokens, mode, watermark,
                                         scheduling_policy=policy)
        self.policy, self.key = policy, SCHEDULING_POLICIES[policy]
        self.requests, self.next_id = {}, 0
        # A shadow KV cache: each computed slot holds token + 4 * position, and the step's block
        # moves are made by the engine's own ModelRunner.copy_blocks, in its order.
        self.runner = runner = nanopaged.ModelRunner.__new__(nanopaged.ModelRunner)
        runner.device = torch.device("cpu")
        runner.kv_cache = torch.full((1, 1, a.num_blocks, block_size, 1, 1), -1)
        runner.cpu_kv_cache = torch.full((num_cpu_blocks, 1, 1, block_size, 1, 1), -1)
        runner.key_bounds = None  # no read policy: nothing else kept per block
        runner.connector = a.connector  # the CPU tier's copies, when the pool is a tier
        # Accounting: what num_blocks_to_allocate / num_blocks_to_append promise is what is taken,
        # for a request's decodes as one (their copies on write counted together)
        real_allocate, real_slots, real_append_slots = a.allocate, a.allocate_slots, s._append_slots

        def allocate(seq):
            expected, before = a.num_blocks_to_allocate(seq), a.num_free_blocks
            copies = real_allocate(seq)
            assert before - a.num_free_blocks == expected, "num_blocks_to_allocate is wrong"
            return copies

        def allocate_slots(seq, num_new):
            expected, before = a.num_blocks_to_append([seq], num_new), a.num_free_blocks
            copies = real_slots(seq, num_new)
            assert before - a.num_free_blocks == expected, "num_blocks_to_append is wrong"
            return copies

        def append_slots(request, out):
            expected, before = a.num_blocks_to_append(request.seqs), a.num_free_blocks
            real_append_slots(request, out)
            assert before - a.num_free_blocks == expected, "num_blocks_to_append is wrong"

        a.allocate, a.allocate_slots, s._append_slots = allocate, allocate_slots, append_slots

    def new_id(self):
        self.next_id += 1
        return self.next_id - 1

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=6), max_tokens=st.integers(1, 10),
          n=st.integers(1, 3), stop=st.booleans(), priority=st.integers(0, 2))
    def add(self, prompt, max_tokens, n, stop, priority=0):
        s = self.s
        worst = n * self.a.max_blocks(len(prompt) + max_tokens, 1)
        if n > min(s.max_num_seqs, s.max_num_batched_tokens) or worst > self.a.num_blocks:
            return  # Engine.check_request refuses it: it could never run
        params = SamplingParams(max_tokens=max_tokens, n=n, stop_token_ids=[3] if stop else [])
        request_id = self.new_id()
        seq = Sequence(self.new_id(), prompt, len(prompt), request_id=request_id)
        request = nanopaged.Request(request_id, prompt, params, seq, priority)
        self.requests[request_id] = request
        s.add(request)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        request = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
        self.s.abort(request)

    @rule(rng=st.randoms(use_true_random=False), num_steps=st.integers(1, 3))
    def steps(self, rng, num_steps):
        for _ in range(num_steps):
            self.step(rng)

    def step(self, rng):
        a, s = self.a, self.s
        a.journal.open()  # as the engine does each step: a.taken, the blocks it hands out
        for seq in (seq for g in s.running for seq in g.seqs):  # the plan's first part (so that
            a.free_skipped_blocks(seq)  # the state before the rest is known): blocks go back
        pre = dict(running=list(s.running), waiting=list(s.waiting), swapped=list(s.swapped),
                   free=a.num_free_blocks, refs=[b.ref_count for b in a.blocks],
                   tables={g.request_id: [list(t) for q in g.seqs for t in q.block_tables]
                           for g in s.running},
                   decoding={g.request_id: g.is_decoding for g in s.running},
                   need={g.request_id: a.num_blocks_to_append(g.seqs) for g in s.running})
        hashes = [b.hash for b in a.blocks]
        out = s.schedule()
        a.journal.close()
        self.check_step(pre, out)
        self.runner.copy_blocks(out.copies)
        self.fake_model(out, rng, hashes)

    def expected_decodes_and_victims(self, pre):
        """Step 1 of the policy on the state before the step: running requests decode in order;
        one whose blocks are not free preempts the last, and only then, until its blocks are."""
        running, refs, free, tokens = list(pre["running"]), list(pre["refs"]), pre["free"], 0
        decoded, victims, i, budget = [], [], 0, self.s.max_num_batched_tokens
        while i < len(running):
            g = running[i]
            if not pre["decoding"][g.request_id] or len(g.seqs) > budget - tokens:
                i += 1
                continue
            while pre["need"][g.request_id] > free:
                victim = running.pop()
                victims.append(victim)
                for table in pre["tables"][victim.request_id]:
                    for b in (b for b in table if b != nanopaged.NO_BLOCK):
                        refs[b] -= 1
                        free += refs[b] == 0
                if victim is g:
                    break
            else:
                free -= pre["need"][g.request_id]
                tokens += len(g.seqs)
                decoded.append(g)
                i += 1
        return decoded, victims

    def check_step(self, pre, out):
        a, s = self.a, self.s
        M, S = s.max_num_batched_tokens, s.max_num_seqs
        scheduled = {seq.seq_id: n for seq, n in out.scheduled}
        # budgets
        assert len(scheduled) == len(out.scheduled) and all(n >= 1 for n in scheduled.values())
        assert out.num_batched_tokens == sum(scheduled.values()) <= M
        assert sum(g.params.num_seqs for g in s.running) <= S
        # preemption: exactly the victims the policy names, last first, only when blocks ran out:
        # the decodes' (step 1); then a prefill chunk that got no token for want of blocks takes
        # the last running request if that has not run in the step (step 3)
        decoded, victims = self.expected_decodes_and_victims(pre)
        assert out.preempted[:len(victims)] == victims == pre["running"][::-1][:len(victims)]
        assert all(scheduled.get(seq.seq_id) == 1 for g in decoded for seq in g.seqs)
        by_chunks = out.preempted[len(victims):]
        assert all(not any(q.seq_id in scheduled for q in g.seqs) for g in by_chunks)
        assert [self.key(g) for g in by_chunks] == sorted(map(self.key, by_chunks), reverse=True)
        assert all(self.key(g) >= self.key(h) for g in by_chunks for h in s.running)
        # Any policy: what starts running comes before everything still waiting or swapped out by
        # the key; admitted and swapped-in requests come off the front of their queues (nobody
        # overtakes), none after a preemption.
        key = self.key
        started = [g for g in s.running if g not in pre["running"]]
        admitted = [g for g in started if g in pre["waiting"]]
        swapped_in = [g for g in started if g in pre["swapped"]]
        assert admitted == pre["waiting"][:len(admitted)]
        assert swapped_in == pre["swapped"][:len(swapped_in)]
        assert all(key(g) <= key(h) for g in started for h in [*s.waiting, *s.swapped])
        assert not (victims and started) and not (by_chunks and admitted)
        if self.policy == "priority":  # a lower value is never admitted after a higher one
            assert all(g.priority <= h.priority for g in admitted for h in s.waiting)
        # watermark: admission leaves blocks spare while anything else runs
        if admitted and (pre["running"] or swapped_in or len(admitted) > 1):
            assert a.num_free_blocks >= s.watermark_blocks >= 1
        # work conservation: nothing that fits both budgets and the free blocks is left out; a
        # running prefill's chunk is cut short only by the budget or by the blocks (none is left
        # free for its next token; or a later chunk preempted, freeing blocks after it was cut).
        # An admitted request starts with a chunk its prefill's bound fits: one token at least
        left = M - out.num_batched_tokens
        for g in s.running:
            if g.is_decoding:
                assert all(q.seq_id in scheduled for q in g.seqs) or len(g.seqs) > left, "decode"
            else:
                hold_back = 1 if len(g.seqs) > 1 else 0
                for seq in g.seqs:
                    n = scheduled.get(seq.seq_id, 0)
                    rest = len(seq) - hold_back - seq.num_computed_tokens
                    cut = a.num_blocks_to_append([seq], n + 1) > a.num_free_blocks or by_chunks
                    if g in admitted:  # its first chunk is its own: what its bound fits
                        cut = n > 0
                    assert rest <= 0 or n == rest or left == 0 or cut, "chunk"
        # the kinds' bound: what a sequence holds while its chunk runs (decodes: one token)
        for seq in (seq for g in s.running for seq in g.seqs):
            num_new = max(1, scheduled.get(seq.seq_id, 0))
            assert len(held(seq.block_tables)) <= a.max_blocks(len(seq), num_new), "bound"
        spare = s.watermark_blocks if s.running else 0
        num_seqs = sum(g.params.num_seqs for g in s.running)
        def ahead(queue, other):  # whether queue's first request comes before other's
            return bool(queue) and key(queue[0]) < key(other[0])

        if s.waiting and not out.preempted and not ahead(s.swapped, s.waiting):
            g = s.waiting[0]  # its prefill, in chunks of one token, by its kinds' bound
            need = sum(a.num_blocks_to_admit(seq, 1) for seq in g.seqs)
            fits = left > 0 and need + spare <= a.num_free_blocks and \
                num_seqs + g.params.num_seqs <= S
            assert not fits, "admission left out"
        # (as step 2 saw it: a request ahead waiting then, even if admitted since, holds it back)
        recomputed = any(g in pre["swapped"] for g in [*s.waiting, *admitted])  # no room even alone
        if (s.swapped and not out.preempted and not recomputed
                and not ahead(pre["waiting"], s.swapped) and not ahead(s.waiting, s.swapped)):
            g = s.swapped[0]  # the budget as it stood before step 3's prefill chunks
            prefill_tokens = sum(n for seq, n in out.scheduled
                                 if not self.requests[seq.request_id].is_decoding)
            # + a block for each sequence's next token in each KV cache group
            need = a.swap_pool.num_blocks_to_swap_in(g.seqs) + len(g.seqs) * len(a.kinds)
            assert (need + spare > a.num_free_blocks or len(g.seqs) > left + prefill_tokens
                    or num_seqs + g.params.num_seqs > S), "swap-in left out"

    def fake_model(self, out, rng, hashes):
        a, bs, kv = self.a, self.a.block_size, self.runner.kv_cache
        # A shared block is written only in the step that fills it: published by the schedule,
        # it is read by a request admitted after its publisher, only after the write.
        filling = {b.block_id for b, h in zip(a.blocks, hashes)
                   if b.hash not in (None, h) or b.hash and b.block_id in a.taken}
        for seq, n in out.scheduled:
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                for table in seq.block_tables:  # every KV cache group's layers store it
                    block_id = table[p // bs]
                    assert block_id != nanopaged.NO_BLOCK, "a token where no block is left"
                    assert a.blocks[block_id].ref_count == 1 or block_id in filling, \
                        "a write into a shared block"
                    kv[0, 0, block_id, p % bs] = seq.token_ids[p] + 4 * p
            seq.num_computed_tokens += n
        ready = {seq.request_id: self.requests[seq.request_id] for seq, _ in out.scheduled
                 if seq.num_computed_tokens == len(seq)}
        for request in ready.values():
            assert all(q.num_computed_tokens == len(q) for q in request.seqs), "completes together"
            first = request.seqs[0]
            if request.params.n > 1 and len(request.seqs) == 1 and first.num_output_tokens == 0:
                for i in range(1, request.params.n):
                    child = request.seqs[0].fork(self.new_id(), i)
                    a.fork(request.seqs[0], child)
                    request.seqs.append(child)
            for seq in list(request.seqs):
                seq.token_ids.append(rng.randrange(4))
                a.prefix_cache.key_blocks(seq)
                p = request.params
                if seq.token_ids[-1] in p.stop_token_ids or seq.num_output_tokens == p.max_tokens:
                    a.free(seq)
                    request.seqs.remove(seq)
            if request.is_finished:
                del self.requests[request.request_id]
        self.s.remove_finished()

    @invariant()
    def blocks_owned_as_the_queues_say(self):
        if not hasattr(self, "a"):
            return
        a, s = self.a, self.s
        device, cpu = Counter(), Counter()
        for counter, queue in ((device, s.running), (cpu, s.swapped)):
            counter.update(b for g in queue for seq in g.seqs for table in seq.block_tables
                           for b in table if b != nanopaged.NO_BLOCK)
        assert all(not any(seq.block_tables) for g in s.waiting for seq in g.seqs)
        assert [b.ref_count for b in a.blocks] == [device[i] for i in range(a.num_blocks)]
        assert [b.ref_count for b in a.swap_pool.blocks] == \
            [cpu[i] for i in range(a.swap_pool.num_blocks)]
        assert sum(len(g.seqs) for g in s.running) <= s.max_num_seqs  # sequences, samples included

    @invariant()
    def every_computed_token_is_where_its_block_table_says(self):
        if not hasattr(self, "a"):
            return
        a, bs = self.a, self.a.block_size
        for queue, pool in ((self.s.running, self.runner.kv_cache[0, 0]),
                            (self.s.swapped, self.runner.cpu_kv_cache[:, 0, 0])):
            for seq in (seq for g in queue for seq in g.seqs):
                for g, table in enumerate(seq.block_tables):
                    # blocks given back hold nothing (no token to come sees them); the rest
                    # hold every token
                    gone = {i for i, b in enumerate(table) if b == nanopaged.NO_BLOCK}
                    assert gone <= unseen_blocks(a.kinds[g], seq.num_computed_tokens, len(table),
                                                 bs)
                    kept = [p for p in range(seq.num_computed_tokens) if p // bs not in gone]
                    assert [pool[table[p // bs], p % bs].item() for p in kept] == \
                        [seq.token_ids[p] + 4 * p for p in kept]

    @invariant()
    def queues_keep_the_policys_order(self):
        if not hasattr(self, "a"):
            return
        s = self.s
        for queue in (s.running, list(s.waiting), s.swapped):
            assert [self.key(g) for g in queue] == sorted(self.key(g) for g in queue)
        if self.policy == "fcfs":  # the running requests are the oldest: nobody overtook anybody
            assert all(g.request_id < h.request_id
                       for g in s.running for h in [*s.waiting, *s.swapped])

    @invariant()
    def a_block_is_cached_iff_full_and_computed(self):
        if not hasattr(self, "a"):
            return
        a, bs = self.a, self.a.block_size
        for h, holders in a.prefix_cache.blocks_by_key.items():
            for block_id in holders:
                assert a.blocks[block_id].hash == h and len(a.blocks[block_id].token_ids) == bs
        for seq in (seq for g in self.s.running for seq in g.seqs):
            keys = []  # each full block's, chained over its tokens
            for i in range(len(seq) // bs):
                block = seq.token_ids[i * bs:(i + 1) * bs]
                keys.append(chain_hash(keys[-1] if keys else None, block))
            assert seq.block_hashes[:len(keys)] == keys or not a.prefix_cache.enabled
            for g, table in enumerate(seq.block_tables):
                for i, block_id in enumerate(table):
                    if block_id == nanopaged.NO_BLOCK:  # no token to come sees it: freed
                        continue
                    chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                    computed = seq.num_computed_tokens >= (i + 1) * bs
                    if a.blocks[block_id].hash is not None:
                        assert computed and a.blocks[block_id].token_ids == chunk
                    if computed and a.prefix_cache.enabled:  # under its group's key
                        assert a.blocks[block_id].hash == a.prefix_cache.key(seq, i, g), \
                            f"block {i} of seq {seq.seq_id} is not cached"

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for _ in range(400):  # every request finishes: nobody starves, nothing deadlocks
            if not self.requests:
                break
            self.step(random.Random(0))
            self.blocks_owned_as_the_queues_say()
            self.queues_keep_the_policys_order()
            self.a_block_is_cached_iff_full_and_computed()
        assert not self.requests and not self.s.has_unfinished()
        assert self.a.num_free_blocks == self.a.num_blocks
        assert self.a.swap_pool.num_free_blocks == self.a.swap_pool.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=examples(600), stateful_step_count=50,
                                              deadline=None)
test_scheduler_state_machine = pytest.mark.scheduler(SchedulerMachine.TestCase)


ONE_TOKEN = dict(max_tokens=1, n=1, priority=0, prompt=[0], stop=False)


@pytest.mark.scheduler
@pytest.mark.parametrize("setup, requests", [
    # samples recomputed together: the first's blocks must not evict a hit the others' counts
    # relied on (in a windowed group, a hit lost costs the blocks before the window too)
    (dict(block_size=3, num_blocks=10, watermark=0.25, policy="priority"),
     [ONE_TOKEN] * 2 + [dict(ONE_TOKEN, max_tokens=7, n=3, priority=1)] + [ONE_TOKEN] * 4
     + [dict(ONE_TOKEN, max_tokens=5, n=3, priority=1, prompt=[0, 0, 1, 0, 0, 0])]),
    # three samples of a request longer than the pool holds under full attention: recomputed,
    # each comes back in chunks its window's blocks hold
    (dict(block_size=2, num_blocks=9, watermark=0.01, policy="fcfs"),
     [ONE_TOKEN] * 2 + [dict(ONE_TOKEN, max_tokens=5, n=3)] + [ONE_TOKEN] * 4
     + [dict(ONE_TOKEN, max_tokens=10, n=3, prompt=[0] * 6)]),
])
def test_windowed_samples_recomputed_together_fit_and_finish(setup, requests):
    """Two cases the scheduler machine found: requests a windowed pool admits, preempts by
    recompute and must then run to the end, every step's block counts exact."""
    machine = SchedulerMachine()
    machine.setup(**setup, num_cpu_blocks=0, mode="recompute", caching=True, max_num_seqs=6,
                  max_num_batched_tokens=7, kinds=(nanopaged.SlidingWindow(3),))
    for request in requests:
        machine.add(**request)
    assert len(machine.requests) == len(requests)  # each within its window's bound
    last = requests[-1]
    assert 3 * -(-(len(last["prompt"]) + last["max_tokens"]) // 2) > machine.a.num_blocks
    machine.teardown()  # every request admitted finishes, and every block comes back


@pytest.mark.scheduler
def test_a_request_recomputed_for_lack_of_swap_space_resumes_before_younger_swapped_ones():
    # Requests 0, 2, 4 run; 4 is swapped out, then 2 is preempted too, but the 3-block swap space
    # is full, so 2 is recomputed. 2 is older than 4, so it must run again first, not after 4
    # swaps in. The machine checks every policy at every step.
    m = SchedulerMachine()
    m.setup(block_size=1, num_blocks=10, num_cpu_blocks=3, mode="swap", caching=False,
            max_num_seqs=4, max_num_batched_tokens=12, watermark=0.01, policy="fcfs")
    for prompt, max_tokens in [([0, 1], 7), ([1, 2], 8), ([2, 3], 8)]:
        m.add(prompt, max_tokens, n=1, stop=False)
    rng, queues = random.Random(0), []
    for _ in range(200):  # bounded: see drain
        if not m.requests:
            break
        m.step(rng)
        queues.append(([g.request_id for g in m.s.waiting], [g.request_id for g in m.s.swapped]))
    assert ([2], [4]) in queues and not m.requests
    m.teardown()


@pytest.mark.scheduler
@settings(max_examples=examples(60), deadline=None)
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5),
                                   st.integers(2, 6), st.sampled_from([1, 3, 3])),
                         min_size=4, max_size=10),
       block_size=st.integers(2, 3), num_blocks=st.integers(8, 14), seed=st.integers(0, 99),
       policy=st.sampled_from(SCHEDULING))
def test_swaps_and_copies_in_one_step_keep_every_token_where_its_table_says(requests, block_size,
                                                                              num_blocks, seed,
                                                                              policy):
    """Swap-heavy runs of the scheduler machine (several requests swapped out in a step,
    copy-on-write beside swaps): ModelRunner.copy_blocks, in its order, leaves every computed
    token of every running or swapped sequence in the slot its block table names."""
    m = SchedulerMachine()
    m.setup(block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=16, mode="swap",
            caching=True, max_num_seqs=9, max_num_batched_tokens=16, watermark=0.01, policy=policy)
    for prompt, max_tokens, n in requests:
        m.add(prompt, max_tokens, n, stop=False)
    rng, moves = random.Random(seed), Counter()
    real_copy_blocks = m.runner.copy_blocks

    def copy_blocks(copies):
        moves.update(k for k in ("swap_out", "cow") if getattr(copies, k))
        moves["both"] += bool(copies.swap_out and copies.cow)
        moves["several out"] += len({b for b, _ in copies.swap_out}) > 1
        return real_copy_blocks(copies)

    m.runner.copy_blocks = copy_blocks
    for _ in range(300):  # bounded: see drain
        if not m.requests:
            break
        m.step(rng)
        m.every_computed_token_is_where_its_block_table_says()
    assert not m.requests
    event(f"steps with swap-outs and copies: {min(moves['both'], 2)}+, "
          f"several out: {min(moves['several out'], 2)}+")
    m.teardown()


def decoding_group(allocator, request_id, n, first_seq_id):
    """A request of n samples, each two tokens long with the first computed: all decoding."""
    seqs = [Sequence(first_seq_id + i, [request_id, i], 1, i, request_id) for i in range(n)]
    request = nanopaged.Request(request_id, seqs[0].token_ids, SamplingParams(n=n), seqs[0])
    request.seqs = seqs
    for seq in seqs:
        allocator.allocate(seq)
        allocator.allocate_slots(seq, 1)
        seq.num_computed_tokens = 1
    return request


@pytest.mark.scheduler
@pytest.mark.parametrize("limit", ["max_num_batched_tokens", "max_num_seqs"])
@pytest.mark.parametrize("budget", [4, 5])
def test_a_swapped_request_comes_back_only_within_both_budgets(limit, budget):
    # Request 0 decodes 3 samples; request 1's 2 samples wait in the swap space. Blocks are
    # plenty, so only the budget decides: 3 + 2 tokens (or sequences) fit in 5, not in 4.
    budgets = dict(max_num_batched_tokens=8, max_num_seqs=8) | {limit: budget}
    allocator = BlockAllocator(64, 4, num_cpu_blocks=16, enable_prefix_caching=False)
    scheduler = nanopaged.Scheduler(allocator, preemption_mode="swap", **budgets)
    running, swapped = decoding_group(allocator, 0, 3, 0), decoding_group(allocator, 1, 2, 3)
    allocator.swap_pool.swap_out(swapped.seqs)
    scheduler.running, scheduler.swapped = [running], [swapped]
    out = scheduler.schedule()
    fits = budget == 5
    assert scheduler.swapped == ([] if fits else [swapped]) and bool(out.copies.swap_in) == fits
    assert [seq.request_id for seq, _ in out.scheduled] == [0, 0, 0] + [1, 1] * fits
    assert out.num_batched_tokens <= budgets["max_num_batched_tokens"]


@pytest.mark.scheduler
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tight_pool_forces_preemption_and_outputs_do_not_change(mode, kv_cache_dtype):
    prompts = [[(7 * i + j) % 32 for j in range(5 + 3 * i)] for i in range(8)]
    engine = Engine(MODEL, block_size=4, num_blocks=16, preemption_mode=mode,
                    kv_cache_dtype=kv_cache_dtype)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert engine.stats()["num_preemptions"] > 0
    assert any(o.num_preemptions for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == \
        greedy_reference(MODEL, prompts, 24, kv_cache_dtype)
    assert_all_blocks_free(engine)


@pytest.mark.scheduler
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hundreds_of_requests_in_a_pool_a_few_sequences_deep(mode):
    rng = random.Random(0)
    prompts = [[rng.randrange(32) for _ in range(rng.randint(1, 12))] for _ in range(200)]
    params = [SamplingParams(max_tokens=rng.randint(1, 10), temperature=0) for _ in prompts]
    ample = Engine(MODEL, block_size=4, num_blocks=2048).generate(prompts, params)
    # about three sequences deep
    engine = Engine(MODEL, block_size=4, num_blocks=16, preemption_mode=mode)
    tight = engine.generate(prompts, params)
    assert engine.stats()["num_preemptions"] > 10
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in ample]
    assert_all_blocks_free(engine)


@pytest.mark.scheduler
def test_an_engine_that_cannot_make_progress_raises_at_once(monkeypatch):
    """Nothing outside the engine could unblock a step that schedules, preempts and moves nothing:
    with an allocator that reports no free block, generate() ends with a RuntimeError naming
    the queues, not a loop that never ends."""
    engine = Engine(MODEL, block_size=4, num_blocks=16)
    monkeypatch.setattr(BlockAllocator, "num_free_blocks", property(lambda self: 0))
    message = (r"the engine can make no progress: this step scheduled, preempted and moved "
               r"nothing, while 2 waiting and 0 swapped requests and 0 running sequences are "
               r"unfinished \(0 of 16 KV")
    with pytest.raises(RuntimeError, match=message):
        engine.generate([[1, 2], [3]], SamplingParams(max_tokens=4))
    monkeypatch.undo()
    assert len(engine.scheduler.waiting) == 2 and drain(engine) and \
        assert_all_blocks_free(engine) is None


@pytest.mark.scheduler
def test_a_stall_counts_the_requests_of_every_queue_each_from_its_own():
    """The no-progress RuntimeError names how many requests wait and are swapped out and how many
    sequences run, each read from its own queue: a swap-mode engine runs until all three queues
    hold requests, in counts that differ (and running sequences that outnumber running requests),
    so that no two counts can trade places unseen; then its scheduler (a subclass, as a fork
    passes one) plans nothing. The stalled step changes nothing, and once the scheduler plans
    again every request ends as in a run that never stalled."""
    class HeldScheduler(nanopaged.Scheduler):
        held = False

        def schedule(self):
            return nanopaged.SchedulerOutput() if self.held else super().schedule()

    def run(stall):
        engine = Engine(MODEL, block_size=2, num_blocks=16, preemption_mode="swap",
                        max_num_batched_tokens=8, scheduler_cls=HeldScheduler)
        for i in range(6):
            engine.add_request([i + 1] * 5, SamplingParams(max_tokens=10, n=1 + i % 2, seed=i))
        s, outputs = engine.scheduler, {}
        for _ in range(100):  # bounded: see drain
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
            counts = (len(s.waiting), len(s.swapped), sum(len(g.seqs) for g in s.running))
            if stall and min(counts) and len({*counts, len(s.running)}) == 4:
                break
        else:
            assert not stall, f"never had requests in every queue in distinct counts: {counts}"
        if stall:
            s.held = True
            before = engine_state(engine)
            with pytest.raises(RuntimeError, match="can make no progress") as stalled:
                engine.step()
            said = re.search(r"while (\d+) waiting and (\d+) swapped requests and (\d+) running "
                             r"sequences are unfinished \((\d+) of (\d+) KV blocks free\)",
                             str(stalled.value))
            assert said and tuple(map(int, said.groups())) == \
                (*counts, engine.allocator.num_free_blocks, 16)
            assert engine_state(engine) == before
            s.held = False
        outputs.update(drain(engine))
        assert_all_blocks_free(engine)
        return [[c.token_ids for c in outputs[i].outputs] for i in range(6)]
    assert run(stall=True) == run(stall=False)


# -- budgets of every step, at their boundaries


def checked_budgets(engine):
    """Check every SchedulerOutput: its tokens (prefill chunks, every sequence's decode, lookahead
    slots) within max_num_batched_tokens, running sequences within max_num_seqs, and every request
    whose sequences all decode scheduled whole or not at all. Returns the steps' token counts."""
    s, counts = engine.scheduler, []
    schedule = s.schedule

    def checked():
        out = schedule()
        tokens = sum(n for _, n in out.scheduled) + sum(n for _, n in out.lookahead)
        assert out.num_batched_tokens == tokens <= s.max_num_batched_tokens
        assert sum(len(g.seqs) for g in s.running) <= s.max_num_seqs
        scheduled = {seq.seq_id for seq, _ in out.scheduled}
        for g in s.running:
            if g.is_decoding:
                assert len({seq.seq_id in scheduled for seq in g.seqs}) == 1, "a request in part"
        counts.append(tokens)
        return out
    s.schedule = checked
    return counts


@pytest.mark.scheduler
@pytest.mark.parametrize("width,slack", [(2, 0), (3, 1), (4, 0)])
@pytest.mark.parametrize("kind", ["n", "beam"])
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=st.sampled_from(["recompute", "swap"]),
       block_size=st.sampled_from([1, 2]))
def test_every_step_keeps_its_budgets_with_groups_as_large_as_they_allow(width, slack, kind,
                                                                         data, mode, block_size):
    """Requests of `width` samples or beams under a token budget just above a request's size (slack
    0-2), several decoding at once, in a pool tight enough to preempt (recompute, or swap and
    back), with prefix caching (block size 1: a recomputed request comes back decoding, its prompt
    all cached): every step keeps max_num_batched_tokens and max_num_seqs and never schedules
    part of a decoding request; outputs equal the same requests served with room to spare."""
    prompts = data.draw(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6),
                                 min_size=2, max_size=4))
    max_tokens = data.draw(st.integers(2, 5))
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3,
                            **({"n": width} if kind == "n" else {"beam_width": width}))
    worst = width * -(-(max(map(len, prompts)) + max_tokens) // block_size)
    engine = Engine(MODEL, block_size=block_size, num_blocks=worst + data.draw(st.integers(0, 6)),
                    max_num_batched_tokens=width + slack,  # two requests' sequences fit at once:
                    max_num_seqs=2 * width + data.draw(st.integers(0, 2)), preemption_mode=mode)
    counts = checked_budgets(engine)
    outputs = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]
    assert max(counts) <= width + slack and assert_all_blocks_free(engine) is None
    ample = Engine(MODEL, block_size=block_size, num_blocks=256)
    assert outputs == [[c.token_ids for c in o.outputs] for o in ample.generate(prompts, params)]
    event(f"preempted: {engine.stats()['num_preemptions'] > 0}")


@pytest.mark.scheduler
@pytest.mark.parametrize("recomputed", [False, True])
def test_a_decoding_group_runs_whole_within_the_budget_or_waits(recomputed):
    """The two boundaries, one example each. A request of two samples decodes (2 tokens) under a
    budget of 3; a second request of two that decodes too, already running or coming back from
    recompute with everything but its last tokens in the prefix cache, must wait: its 2 tokens
    would make 4."""
    allocator = BlockAllocator(64, 1)
    scheduler = nanopaged.Scheduler(allocator, max_num_seqs=8, max_num_batched_tokens=3)
    first = decoding_group(allocator, 0, 2, 0)
    second = decoding_group(allocator, 1, 2, 2)
    scheduler.running = [first, second]
    if recomputed:  # its prompt's block stays cached for it: it comes back decoding
        for seq in second.seqs:
            allocator.cache_full_blocks(seq)
        scheduler.preempt_by_recompute(second)
    out = scheduler.schedule()
    assert [seq.request_id for seq, _ in out.scheduled] == [0, 0]
    assert out.num_batched_tokens == 2 and second in scheduler.running  # admitted, waiting its turn
    assert all(seq.num_computed_tokens == 1 for seq in second.seqs)  # decoding, not scheduled


# -----------------------------------------------------------------------------
# parallel.py: tensor parallelism, two gloo ranks against one process  (-m tensor_parallel)
#
# With two ranks the all-reduce sums each layer's output in another order, so logits differ
# from one process's in the last bits. These models run in float64, where that is ~1e-16 and
# a token could only change on a near-exact tie; the demo checks the float32 model as well.


TP_CONFIG = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=32, max_seq_len=64)
TP_HF_MODELS = {  # Llama and Qwen2 with K/V heads that split in two: untied, llama3 RoPE, biases
    "llama_2kv": ("LlamaConfig", dict(LLAMA_FAMILY, num_key_value_heads=2,
                                      rope_parameters=LLAMA3_ROPE)),
    "qwen2_2kv": ("Qwen2Config", dict(LLAMA_FAMILY, num_key_value_heads=2,
                                      rope_parameters=dict(rope_theta=1e6))),
}
TP_CHECKPOINTS = ["gpt2", "mistral", "llama_2kv", "qwen2_2kv"]
TP_DEMO_FLAGS = ["--max-tokens", "8", "--num-blocks", "24"]  # float32, sampled at 0.8, preempts


def tp_scenarios(model, names=None):
    """Each engine feature (or those named) on a fresh engine: what two ranks must reproduce."""
    prompts = [[(5 * i + j) % 32 for j in range(3 + 3 * i)] for i in range(6)]
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=i)
               for i in range(6)]
    mixed = [SamplingParams(max_tokens=12, temperature=0), sampled[1],
             SamplingParams(max_tokens=8, n=3, seed=5), SamplingParams(max_tokens=8, beam_width=3)]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    cases = dict(  # engine settings, prompts, params
        greedy=({}, prompts, [greedy] * 6),
        seeded=({}, prompts, sampled),
        parallel=({}, prompts[:3], [SamplingParams(max_tokens=10, n=3, seed=5)] * 3),
        beam=({}, prompts[:3], [SamplingParams(max_tokens=10, beam_width=3)] * 3),
        recompute=(dict(num_blocks=16), prompts[:4] * 2, mixed * 2),
        swap=(dict(num_blocks=16, preemption_mode="swap"), prompts[:4] * 2, mixed * 2),
        prefix=({}, [list(range(9)), list(range(8)) + [30]], [greedy] * 2),
        # prompts that come back after others evicted them: each rank copies its own heads
        tier=(dict(num_blocks=12, cpu_cache_bytes=2**20), prompts[2:5] * 2, [greedy] * 6),
    )
    results = {}
    for name, (settings_, prompts_, params) in cases.items():
        if names and name not in names:
            continue
        engine = Engine(model, **dict(block_size=4, num_blocks=64) | settings_)
        # two calls, so the second finds the first one's prompt blocks in the prefix cache
        outs = engine.generate(prompts_[:1], params[:1]) + engine.generate(prompts_[1:], params[1:])
        s = engine.stats()
        results[name] = dict(tokens=[[c.token_ids for c in o.outputs] for o in outs],
                             preemptions=s["num_preemptions"], hits=s["prefix_cache_hit_tokens"],
                             reloads=s["num_reloaded_blocks"])
    if names:
        return results
    # Quest, on a backend that reads per-head tables: each rank keeps its K/V heads' key bounds
    backend = "torch"
    engine = quest_engine(model, token_budget=8, dense_layers=1, block_size=4, num_blocks=16,
                          preemption_mode="swap", attention_backend=backend)
    outs = engine.generate(prompts[:4] * 2, mixed * 2)
    results["quest"] = [[c.token_ids for c in o.outputs] for o in outs]
    results["quest_bounds"] = engine.model_runner.key_bounds
    torch.manual_seed(1 + nanopaged.tp.rank)  # unseeded: each rank draws its own seeds
    engine = Engine(model, block_size=4, num_blocks=64)
    unseeded = engine.generate(prompts, SamplingParams(max_tokens=10))
    results["unseeded"] = [o.outputs[0].token_ids for o in unseeded]
    results["kv_heads"] = engine.kv_cache.shape[-2]
    results["budget_blocks"] = Engine(model, kv_cache_bytes=65536).allocator.num_blocks
    return results


def tp_worker(rank, port, folder, checkpoints):
    """One of two ranks: every scenario, then the demo; then rank 1 dies and rank 0 must raise."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel.init_tensor_parallel(2, timeout_s=120)
    full = torch.load(os.path.join(folder, "full.pt"))
    model = GPT(TP_CONFIG).double().load_full_state_dict(full)
    results = dict(scenarios=tp_scenarios(model))
    for name, path in checkpoints.items():  # sharded as each tensor is read
        checkpoint = GPT.from_pretrained(path, dtype=torch.float64)
        results[name] = tp_scenarios(checkpoint, ["greedy", "beam"])
        results[name + " shapes"] = {k: tuple(p.shape) for k, p in checkpoint.named_parameters()}
    report = demo.main(TP_DEMO_FLAGS + ["--tensor-parallel-size", "2"])
    results["demo"] = [[c.token_ids for c in o.outputs] for o in report["outputs"]]
    with torch.no_grad():  # what lets greedy and beam choices agree without a broadcast
        results["logits"] = model(torch.arange(30).view(2, 15))
    if rank == 1:
        torch.save(results, os.path.join(folder, "rank1.pt"))
        os._exit(3)  # dies mid-serving: rank 0's next all-reduce must fail, not wait forever
    try:
        Engine(model, num_blocks=8).generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        results["after_crash"] = "no error"
    except RuntimeError as e:
        results["after_crash"] = str(e)
    torch.save(results, os.path.join(folder, "rank0.pt"))
    os._exit(0)  # skip tearing down a group whose peer is gone, which gloo answers with an abort


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.tensor_parallel
def test_two_ranks_serve_every_feature_like_one_process(hf_folder, tmp_path):
    torch.manual_seed(0)
    model = GPT(TP_CONFIG).double()
    torch.save(model.state_dict(), tmp_path / "full.pt")
    checkpoints = {name: str(hf_folder(name)[0]) for name in TP_CHECKPOINTS}
    ctx, port = torch.multiprocessing.get_context("spawn"), free_port()
    ranks = [ctx.Process(target=tp_worker, args=(rank, port, str(tmp_path), checkpoints))
             for rank in (0, 1)]
    for p in ranks:
        p.start()
    # meanwhile the same work in this one process, on one thread: three processes share the
    # cores, and OpenMP threads waiting on a descheduled sibling make small ops ~20x slower
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = tp_scenarios(model)
        single |= {name: tp_scenarios(GPT.from_pretrained(path, dtype=torch.float64),
                                      ["greedy", "beam"]) for name, path in checkpoints.items()}
        demo_outputs = demo.main(TP_DEMO_FLAGS)["outputs"]
    finally:
        torch.set_num_threads(num_threads)
    for p in ranks:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ranks] == [0, 3]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for name in ("greedy", "seeded", "parallel", "beam", "recompute", "swap", "prefix"):
        assert rank0["scenarios"][name] == rank1["scenarios"][name] == single[name], name
    assert single["recompute"]["preemptions"] > 0 and single["swap"]["preemptions"] > 0
    assert single["prefix"]["hits"] == 8
    assert single["tier"]["reloads"] > 0
    assert rank0["scenarios"]["unseeded"] == rank1["scenarios"]["unseeded"]
    assert rank0["scenarios"]["quest"] == rank1["scenarios"]["quest"] == single["quest"]
    for r, rank in enumerate((rank0, rank1)):  # (2, n_layer, num_blocks, nkv, hs): its heads'
        torch.testing.assert_close(rank["scenarios"]["quest_bounds"],
                                   single["quest_bounds"][:, :, :, r:r + 1], rtol=0, atol=1e-12)
    for name in TP_CHECKPOINTS:
        assert rank0[name] == rank1[name] == single[name], name
    assert rank0["demo"] == rank1["demo"] == \
        [[c.token_ids for c in o.outputs] for o in demo_outputs]
    # each rank caches its own K/V heads only, so one byte budget holds twice the blocks
    assert single["kv_heads"] == 2
    assert rank0["scenarios"]["kv_heads"] == rank1["scenarios"]["kv_heads"] == 1
    assert rank0["scenarios"]["budget_blocks"] == 2 * single["budget_blocks"]
    assert rank0["gpt2 shapes"]["transformer.h.0.attn.c_attn.weight"] == (3 * 64 // 2, 64)
    assert rank0["gpt2 shapes"]["transformer.h.0.mlp.c_proj.weight"] == (64, 4 * 64 // 2)
    mistral = rank0["mistral shapes"]  # 6 query and 2 K/V heads of 16
    assert mistral["transformer.h.0.attn.c_attn.weight"] == ((6 + 2 * 2) * 16 // 2, 48)
    assert mistral["transformer.h.0.mlp.c_gate.weight"] == (64 // 2, 48)
    assert torch.equal(rank0["logits"], rank1["logits"])  # bit for bit on every rank
    with torch.no_grad():
        one_process = model(torch.arange(30).view(2, 15))
    torch.testing.assert_close(rank0["logits"], one_process, rtol=0, atol=1e-12)
    assert "Connection" in rank0["after_crash"]  # closed or reset by the rank that died


def tp_failure_worker(rank, port, folder):
    """One of two ranks, each with its own KV budget; then rank 0's forward fails mid-serving."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel.init_tensor_parallel(2, timeout_s=300, device="cpu")
    model = GPT(TP_CONFIG).double().load_full_state_dict(
        torch.load(os.path.join(folder, "full.pt")))
    results = dict(num_blocks=Engine(model, block_size=4,
                                     kv_cache_bytes=65536 * (1 + rank)).allocator.num_blocks)
    engine = Engine(model, block_size=4, num_blocks=32)
    for i in range(3):
        engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    real_forward, calls = GPT.forward, [0]

    def forward(self, *args, **kwargs):
        calls[0] += 1
        # mid-serving, with rank 1 already in the step's first all-reduce
        if rank == 0 and calls[0] == 3:
            raise RuntimeError("CUDA out of memory (simulated) on rank 0")
        return real_forward(self, *args, **kwargs)

    GPT.forward = forward
    for key in ("error", "retry"):
        try:
            for _ in range(50):
                engine.step()
            results[key] = "no error"
        except RuntimeError as e:
            results[key] = str(e)
    results["steps"] = calls[0]
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    os._exit(0)


@pytest.mark.tensor_parallel
def test_a_failure_on_one_rank_ends_every_rank_at_once_and_pools_agree(tmp_path):
    torch.manual_seed(0)
    torch.save(GPT(TP_CONFIG).double().state_dict(), tmp_path / "full.pt")
    ctx, port = torch.multiprocessing.get_context("spawn"), free_port()
    ranks = [ctx.Process(target=tp_failure_worker, args=(rank, port, str(tmp_path)))
             for rank in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:  # well within the group's 300 s timeout, which no rank may wait out
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # rank 1's budget is twice rank 0's, but both take rank 0's count: the same block ids everywhere
    # half the K/V heads
    bytes_per_block = math.prod(nanopaged.kv_block_shape(TP_CONFIG, 4)) * 8 // 2
    assert rank0["num_blocks"] == rank1["num_blocks"] == 65536 // bytes_per_block
    assert "simulated" in rank0["error"] and "Connection" in rank1["error"]  # closed or reset
    assert rank0["steps"] == rank1["steps"] == 3  # rank 1 learnt of it in the very step that failed
    for r in (rank0, rank1):
        assert r["retry"].startswith("tensor parallelism was shut down after a step failed on rank")


@pytest.mark.tensor_parallel
def test_the_process_group_backend_follows_the_engines_device(monkeypatch):
    """--device cpu under torchrun on a CUDA machine must not pick NCCL for CPU tensors."""
    backends = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: backends.append(f"set_device({i})"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: backends.append(backend))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    for name in ("rank", "world_size", "failed"):  # each put back as it is after the test
        monkeypatch.setattr(parallel.tp, name, getattr(parallel.tp, name))
    for device in ("cpu", "cuda", None, "cuda:1"):
        parallel.init_tensor_parallel(2, device=device)
    assert backends == ["gloo", "set_device(0)", "nccl", "set_device(0)", "nccl",
                        "set_device(0)", "nccl"]


@pytest.mark.tensor_parallel
@pytest.mark.parametrize("size,env,message", [
    (2, {}, "tensor_parallel_size=2 needs one process per rank: launch with torchrun --nproc-per"),
    (2, dict(WORLD_SIZE="3"), "tensor_parallel_size=2 but torchrun launched 3 processes: give "
                              "torchrun --nproc-per-node 2, or tensor_parallel_size=3"),
    (1, dict(WORLD_SIZE="2"), "tensor_parallel_size=1 but torchrun launched 2 processes"),
    (0, {}, "tensor_parallel_size must be an integer >= 1, got 0"),
])
def test_a_bad_tensor_parallel_launch_fails_fast(size, env, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        parallel.init_tensor_parallel(size)
    assert nanopaged.tp.world_size == 1 and not torch.distributed.is_initialized()
    with pytest.raises(SystemExit, match="nanopaged: error: " + message):
        demo.main(["--tensor-parallel-size", str(size)])


@pytest.mark.tensor_parallel
@pytest.mark.parametrize("n_head,n_kv_head,message", [(6, None, "n_head=6 does not divide"),
                                                      (4, 2, "n_kv_head=2 does not divide")])
def test_heads_that_do_not_divide_across_ranks_are_rejected(n_head, n_kv_head, message,
                                                            monkeypatch):
    monkeypatch.setattr(nanopaged.tp, "world_size", 4)
    with pytest.raises(ValueError, match=message + " by tensor_parallel_size=4: each rank"):
        GPT(GPTConfig(n_layer=1, n_head=n_head, n_kv_head=n_kv_head, n_embd=48))


@pytest.mark.tensor_parallel
@settings(max_examples=examples(40), deadline=None)
@given(world_size=st.sampled_from([2, 4]), kv_per_rank=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), family=st.sampled_from(["gpt2", "llama", "qwen2"]))
def test_the_ranks_slices_of_a_layer_sum_to_the_whole_layer(world_size, kv_per_rank, group, family):
    """Megatron's identity, for any split: attention and MLP outputs are the sum over ranks of
    each rank's output before the all-reduce (row-parallel biases counted once)."""
    from unittest import mock
    llama = dict(rope_theta=1e4, norm="rmsnorm", mlp="swiglu", bias=False,
                 qkv_bias=family == "qwen2")
    n_kv_head = kv_per_rank * world_size
    config = GPTConfig(n_layer=1, n_head=n_kv_head * group, n_kv_head=n_kv_head, head_dim=8,
                       n_embd=16, vocab_size=32, intermediate_size=6 * world_size,
                       **({} if family == "gpt2" else llama))
    torch.manual_seed(world_size + 10 * kv_per_rank + 100 * group)
    whole = GPT(config).double()
    with torch.no_grad():
        for p in whole.parameters():  # biases start at zero: make every tensor count
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    rope = nanopaged.rope_cos_sin(config, torch.arange(5), x.dtype) if family != "gpt2" else None
    layer = whole.transformer.h[0]
    with torch.no_grad():
        want_attn, want_mlp = layer.attn(x, rope=rope), layer.mlp(x)
        attn = mlp = 0
        with mock.patch.object(nanopaged, "all_reduce", lambda y: y):  # each rank's partial sum
            for rank in range(world_size):
                with mock.patch.multiple(nanopaged.tp, rank=rank, world_size=world_size):
                    shard = GPT(config).double().load_full_state_dict(whole.state_dict())
                shard = shard.transformer.h[0]
                assert shard.attn.c_attn.out_features == (group + 2) * kv_per_rank * 8
                attn, mlp = attn + shard.attn(x, rope=rope), mlp + shard.mlp(x)
    torch.testing.assert_close(attn, want_attn, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mlp, want_mlp, rtol=1e-12, atol=1e-12)


# -----------------------------------------------------------------------------
# disaggregation.py: prefill and decode in two processes, against one engine  (-m disaggregation)
#
# The protocol runs first in one process, over a loopback link, where each stage can be reached
# on purpose (an abort mid-transfer, a copy that fails); then over torch.distributed in two gloo
# processes on 127.0.0.1, each with a timeout and the link's timeout short, as the demo does
# under --disaggregate. "Nothing held": on both sides, every block free, nothing staged, awaited
# or waiting to be sent, no request in either engine.


def pd_requests():
    """Prompts with full blocks to send (block_size 4), two of them sharing a prefix, a short
    one served by the front alone; greedy, seeded, n > 1 and beams."""
    base = [(7 * j) % 32 for j in range(14)]
    prompts = [base, base + [1, 2, 3], [(5 + j) % 32 for j in range(9)], base[:9] + [4] * 6,
               [3, 1, 2], base[:5] + list(range(20))]
    params = [SamplingParams(max_tokens=10, temperature=0),
              SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=1),
              SamplingParams(max_tokens=8, n=3, seed=5),
              SamplingParams(max_tokens=8, beam_width=3),
              SamplingParams(max_tokens=6, temperature=0.8, seed=4),
              SamplingParams(max_tokens=12, temperature=0)]
    return prompts, params


def token_lists(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def pd_pair(model, decode=None, prefill=None):
    """A decode front and a prefill worker over a loopback link, each engine with its settings."""
    down, up = disaggregation.loopback_pair()
    settings_ = dict(block_size=4, num_blocks=64, connector="remote")
    worker = disaggregation.PrefillWorker(
        Engine(model, **settings_ | (prefill or {}), connector_config=dict(link=up)), up)
    front = disaggregation.DecodeFront(
        Engine(model, **settings_ | (decode or {}), connector_config=dict(link=down)), down)
    return front, worker


def pd_prefill_round(worker):
    """The worker takes its messages, then steps once if it has work."""
    item = worker.link.receive()
    while item is not None:
        worker.handle(item[0])
        item = worker.link.receive()
    if worker.engine.scheduler.has_unfinished():
        worker.step()


def pd_serve(front, worker, prompts, params):
    ids = [front.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    outputs = {}
    for _ in range(500):
        if not front.has_unfinished():
            break
        pd_prefill_round(worker)
        outputs.update((o.request_id, o) for o in front.step() if o.finished)
    return [outputs[i] for i in ids]


def pd_held(front_stats, prefill_stats):
    """What either side holds, by name: empty when nothing is held."""
    held = {}
    for side, s in (("decode", front_stats), ("prefill", prefill_stats)):
        counts = dict(used_blocks=s["num_blocks"] - s["num_free_blocks"],
                      running=s["num_running"] + s["num_waiting"] + s["num_swapped"],
                      staged=s.get("num_staged_blocks", 0),
                      awaited=s.get("num_awaited_requests", 0),
                      prefilling=s.get("num_prefilling", 0), wanted=s.get("num_wanted", 0),
                      pending_sends=s.get("num_pending_sends", 0))
        held |= {f"{side} {name}": n for name, n in counts.items() if n}
    return held


def pd_nothing_held(front, worker):
    assert pd_held(front.stats(), worker.engine.stats()) == {}
    assert not front.engine.requests and not worker.engine.requests and not worker.requests


PD_SCENARIOS = dict(  # the decode engine's settings (the reference's too), the prefill's
    plain=({}, {}),
    chunked=({}, dict(max_num_batched_tokens=8)),  # the prefill process sends block by block
    recompute=(dict(num_blocks=18), {}),
    swap=(dict(num_blocks=18, preemption_mode="swap"), {}),
    fp8=(dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8")),
)


@pytest.mark.disaggregation
@pytest.mark.parametrize("scenario", PD_SCENARIOS)
def test_prefill_and_decode_apart_equal_one_engine_token_for_token(scenario):
    decode, prefill = PD_SCENARIOS[scenario]
    prompts, params = pd_requests()
    # two calls, so the second finds the first one's prompt blocks cached on the front; all the
    # prompts in the second, so that a pool of 18 blocks preempts
    batches = [(prompts[:3], params[:3]), (prompts[3:] + prompts[:3], params[3:] + params[:3])]
    one = Engine(MODEL, **dict(block_size=4, num_blocks=64) | decode)
    want = [o for batch in batches for o in one.generate(*batch)]
    front, worker = pd_pair(MODEL, decode, prefill)
    got = [o for batch in batches for o in pd_serve(front, worker, *batch)]
    assert token_lists(got) == token_lists(want)
    s = front.stats()
    assert s["num_reloaded_blocks"] > 0 and s["prefix_cache_cpu_hit_tokens"] > 0  # sent blocks
    assert [o.num_cached_tokens > 0 for o in got] == [True] * 4 + [False] + [True] * 4
    if scenario in ("recompute", "swap"):
        assert s["num_preemptions"] > 0
    pd_nothing_held(front, worker)


@pytest.mark.disaggregation
@pytest.mark.parametrize("model", ["windowed", "hybrid"])
def test_a_windowed_model_apart_equals_one_engine(model):
    """Every KV cache group's blocks are sent under that group's keys."""
    model = dict(windowed=WINDOWED, hybrid=HYBRID)[model]
    prompts, params = pd_requests()
    want = Engine(model, block_size=4, num_blocks=64).generate(prompts, params)
    front, worker = pd_pair(model)
    assert token_lists(pd_serve(front, worker, prompts, params)) == token_lists(want)
    assert front.stats()["num_reloaded_blocks"] > 0
    pd_nothing_held(front, worker)


def pd_reach(stage, front, worker, request_id):
    """Run both sides until request_id is at `stage` of its life; the front takes one message at
    a time, so that it can stop after the first block it stages."""
    if stage == "sent":  # the prompt is on its way; the prefill process has not read it
        return
    worker.handle(worker.link.receive()[0])
    decoded = False
    for _ in range(200):
        if (stage == "received"  # in the prefill engine, nothing computed yet
                or stage == "mid-transfer" and front.consumer.held.get(request_id)
                or stage == "prefilled" and request_id in front.engine_ids  # not stepped since
                or stage == "decoding" and decoded):
            return
        if request_id in front.engine_ids:
            decoded = any(o.request_id == request_id for o in front.step())
            continue
        if worker.engine.scheduler.has_unfinished():
            worker.step()
        item = front.link.receive()
        if item is not None:
            front.handle(*item)
    raise AssertionError(f"request {request_id} never reached {stage}")


@pytest.mark.disaggregation
@pytest.mark.parametrize("stage", ["sent", "received", "mid-transfer", "prefilled", "decoding"])
def test_an_abort_at_any_stage_frees_everything_on_both_sides(stage):
    prompts, params = pd_requests()
    long_prompt = [(3 * j) % 32 for j in range(30)]  # 7 blocks to send, one a step
    want = Engine(MODEL, block_size=4, num_blocks=64).generate(prompts[:2], params[:2])
    front, worker = pd_pair(MODEL, prefill=dict(max_num_batched_tokens=4))
    victim = front.add_request(long_prompt, SamplingParams(max_tokens=20, temperature=0))
    pd_reach(stage, front, worker, victim)
    front.abort(victim)
    assert victim not in front.consumer.held and not front.consumer.staged
    # the others are served as if it had never come; late blocks of it are dropped
    assert token_lists(pd_serve(front, worker, prompts[:2], params[:2])) == token_lists(want)
    pd_prefill_round(worker)  # the abort reaches the prefill process, if it had not
    assert victim not in worker.requests
    pd_nothing_held(front, worker)
    with pytest.raises(ValueError, match=f"no unfinished request with id {victim}"):
        front.abort(victim)


@pytest.mark.disaggregation
def test_a_request_the_prefill_process_gives_up_is_computed_by_the_front():
    prompts, params = pd_requests()
    want = Engine(MODEL, block_size=4, num_blocks=64).generate(prompts[:3:2], params[:3:2])
    front, worker = pd_pair(MODEL, prefill=dict(max_num_batched_tokens=4))
    ids = [front.add_request(prompt, p) for prompt, p in zip(prompts[:3:2], params[:3:2])]
    pd_reach("mid-transfer", front, worker, ids[0])
    worker.abort(ids[0])  # aborted there, mid-transfer
    assert not worker.requests.get(ids[0])
    outputs = {}
    while front.has_unfinished():
        pd_prefill_round(worker)
        outputs.update((o.request_id, o) for o in front.step() if o.finished)
    assert token_lists([outputs[i] for i in ids]) == token_lists(want)
    assert outputs[ids[0]].num_cached_tokens == 0  # its staged blocks were dropped
    pd_nothing_held(front, worker)


@pytest.mark.disaggregation
def test_a_failed_transfer_fails_its_step_on_its_side_and_the_undo_uncaches_what_it_touched():
    prompts, params = pd_requests()
    want = Engine(MODEL, block_size=4, num_blocks=64).generate(prompts, params)
    front, worker = pd_pair(MODEL)
    consumer, producer = front.consumer, worker.producer
    real_load, real_send, touched = consumer.transfer, producer.transfer, []

    def load_one_then_fail(copies, runner, stage):  # a partial load
        if stage == "in" and len(copies.reload) > 1 and not touched:
            touched.extend(block for _, block in copies.reload)
            real_load(nanopaged.BlockCopies(reload=copies.reload[:1]), runner, stage)
            raise RuntimeError("copy failed (simulated)")
        real_load(copies, runner, stage)

    def fail_first_send(copies, runner, stage):
        if stage == "computed" and copies.offload and not worker.num_failed_steps:
            raise RuntimeError("send failed (simulated)")
        real_send(copies, runner, stage)

    consumer.transfer, producer.transfer = load_one_then_fail, fail_first_send
    ids = [front.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    outputs, failures = {}, []
    while front.has_unfinished():
        pd_prefill_round(worker)
        try:
            outputs.update((o.request_id, o) for o in front.step() if o.finished)
        except RuntimeError as e:
            failures.append(str(e))
            blocks = front.engine.allocator.blocks
            assert all(blocks[b].hash is None and blocks[b].ref_count == 0 for b in touched)
    assert failures == ["copy failed (simulated)"] and worker.num_failed_steps == 1
    assert token_lists([outputs[i] for i in ids]) == token_lists(want)
    pd_nothing_held(front, worker)


@pytest.mark.disaggregation
def test_what_disaggregation_cannot_serve_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(nanopaged.tp, "world_size", 2)
    with pytest.raises(ValueError, match="does not combine with tensor parallelism"):
        disaggregation.Link()
    monkeypatch.setattr(nanopaged.tp, "world_size", 1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="needs two processes, launched by torchrun"):
        disaggregation.Link()
    with pytest.raises(SystemExit, match="--disaggregate runs one engine per process: it does not "
                                         "combine with --tensor-parallel-size"):
        demo.main(["--disaggregate", "--tensor-parallel-size", "2"])


def pd_process(rank, port, folder, scenario):
    """One of the two processes: rank 0 decodes, rank 1 prefills; scenario(rank, link, model)
    returns what the test checks, saved to rank{rank}.pt."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    link = disaggregation.Link(timeout_s=20, device="cpu")
    model = GPT(MODEL.config).double().load_full_state_dict(
        torch.load(os.path.join(folder, "full.pt")))
    try:
        results = scenario(rank, link, model)
    except Exception as e:
        results = dict(error=repr(e))
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    os._exit(0)  # skip tearing down a group whose peer may be gone: gloo answers with an abort


def pd_run(tmp_path, scenario):
    """Both processes of a scenario; their exit codes and results (None where none was saved)."""
    torch.save(MODEL.state_dict(), tmp_path / "full.pt")
    ctx, port = torch.multiprocessing.get_context("spawn"), free_port()
    processes = [ctx.Process(target=pd_process, args=(rank, port, str(tmp_path), scenario))
                 for rank in (0, 1)]
    for p in processes:
        p.start()
    return processes


def pd_results(tmp_path, processes, timeout_s=150):
    for p in processes:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    results = [torch.load(tmp_path / f"rank{r}.pt") if (tmp_path / f"rank{r}.pt").exists()
               else None for r in (0, 1)]
    return [p.exitcode for p in processes], results


def pd_engine(model, link, **settings_):
    return Engine(model, **dict(block_size=4, num_blocks=64) | settings_, connector="remote",
                  connector_config=dict(link=link))


def pd_handshake_serve_abort(rank, link, model):
    """Two handshakes that must fail (another block size, other weights), then the requests,
    an abort mid-transfer, and the demo under --disaggregate."""
    role = disaggregation.DecodeFront if rank == 0 else disaggregation.PrefillWorker
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight[0, 0] += 1e-3
    results = {}
    for name, (m, block_size) in dict(block_size=(model, 4 + 4 * rank),
                                      model=(model if rank == 0 else other, 4)).items():
        try:
            role(pd_engine(m, link, block_size=block_size), link)
            results[name] = "no error"
        except ValueError as e:
            results[name] = str(e)
    if rank == 1:  # until the front says bye; then the demo's prefill process
        worker = disaggregation.PrefillWorker(pd_engine(model, link, max_num_batched_tokens=8),
                                              link)
        results["stats"] = worker.serve()
        results["demo"] = demo.main(TP_DEMO_FLAGS + ["--disaggregate"])["prefill_stats"]
        return results
    front = disaggregation.DecodeFront(pd_engine(model, link), link)
    prompts, params = pd_requests()
    results["tokens"] = token_lists(front.generate(prompts, params))
    victim = front.add_request([(3 * j) % 32 for j in range(30)], SamplingParams(max_tokens=4))
    for _ in range(1000):  # one message at a time, until a block of it is staged
        item = front.link.receive(timeout=0.1)
        if item is not None:
            front.handle(*item)
        if front.consumer.held.get(victim) or victim not in front.prefilling:
            break
    results["aborted mid-transfer"] = victim in front.prefilling
    front.abort(victim)
    results["after abort"] = token_lists(front.generate(prompts[:2], params[:2]))
    results["stats"] = front.stats()
    front.close()
    results["demo"] = token_lists(demo.main(TP_DEMO_FLAGS + ["--disaggregate"])["outputs"])
    return results


@pytest.mark.disaggregation
def test_two_processes_check_each_other_serve_like_one_engine_and_abort_on_both_sides(tmp_path):
    processes = pd_run(tmp_path, pd_handshake_serve_abort)
    prompts, params = pd_requests()  # meanwhile, one engine
    want = token_lists(Engine(MODEL, block_size=4, num_blocks=64).generate(prompts, params))
    demo_want = token_lists(demo.main(TP_DEMO_FLAGS)["outputs"])
    codes, (decode, prefill) = pd_results(tmp_path, processes)
    assert codes == [0, 0], (decode, prefill)
    for side in (decode, prefill):
        assert side["block_size"].startswith("disaggregation handshake: the prefill and decode "
                                             "engines must hold the same blocks of the same model")
        assert "block_size is 4 here, 8 in the prefill process" in decode["block_size"]
        assert "block_size is 8 here, 4 in the decode process" in prefill["block_size"]
        assert "model is '" in side["model"] and "block_size" not in side["model"]
    assert decode["tokens"] == want and decode["after abort"] == want[:2]
    assert decode["aborted mid-transfer"]
    assert pd_held(decode["stats"], prefill["stats"]) == {}
    assert decode["stats"]["num_reloaded_blocks"] > 0
    assert decode["demo"] == demo_want
    assert prefill["demo"]["num_free_blocks"] == prefill["demo"]["num_blocks"]


def pd_prefill_killed_mid_transfer(rank, link, model):
    """The prefill process kills itself mid-message: the header of its third block sent, its
    K/V never. The front must finish every request and serve new ones alone."""
    if rank == 1:
        real_send, num_sent = disaggregation.Link._send_tensor, [0]

        def send_tensor(self, tensor, data):
            num_sent[0] += 1
            if num_sent[0] == 3:  # the third block's header and JSON went; its K/V never go
                os.kill(os.getpid(), signal.SIGKILL)
            real_send(self, tensor, data)
        disaggregation.Link._send_tensor = send_tensor
        engine = pd_engine(model, link, max_num_batched_tokens=8)
        disaggregation.PrefillWorker(engine, link).serve()
        return dict(error="the prefill process was not killed")
    front = disaggregation.DecodeFront(pd_engine(model, link), link)
    prompts, params = pd_requests()
    results = dict(tokens=token_lists(front.generate(prompts, params)), peer=front.peer_error)
    results["later"] = token_lists(front.generate(prompts[:2], params[:2]))
    results["stats"] = front.stats()
    return results


@pytest.mark.disaggregation
def test_a_prefill_process_killed_mid_transfer_leaves_the_front_serving(tmp_path):
    processes = pd_run(tmp_path, pd_prefill_killed_mid_transfer)
    prompts, params = pd_requests()
    want = token_lists(Engine(MODEL, block_size=4, num_blocks=64).generate(prompts, params))
    codes, (decode, prefill) = pd_results(tmp_path, processes, timeout_s=90)
    assert codes == [0, -signal.SIGKILL] and prefill is None, decode
    assert decode["tokens"] == want and decode["later"] == want[:2]
    assert "Connection" in decode["peer"]  # closed or reset by the process that died
    s = decode["stats"]
    assert not s["prefill_process_alive"] and s["num_received_blocks"] == 2
    assert pd_held(s, dict(num_blocks=0, num_free_blocks=0, num_running=0, num_waiting=0,
                           num_swapped=0)) == {}


# The server over a decode front: its engine loop steps the front as it steps an Engine

PD_SERVER_FLAGS = ["--served-model-name", "pydoc-chat", "--temperature", "0", "--block-size",
                   "8", "--num-blocks", "128"]


def pd_server_answers(url):
    """The same requests through the openai client, for a server over one engine and one over a
    front: greedy with logprobs, seeded with n > 1, two prompts and a stop string, streamed
    (a completion and a chat), echo with logprobs (whose prompt the front computes alone). What
    each answers (ids and times left out) and the counts of /metrics' histograms; the logprobs
    apart, to compare within float error: the prefill process's forward is batched otherwise."""
    client = served_client(url)
    prompt = SERVED_PROMPTS[0] + ": " + SERVED_PROMPTS[2]  # 4 blocks of 8 to send
    answers, logprobs = [], []
    out = client.completions.create(model="pydoc-chat", prompt=prompt, max_tokens=12, logprobs=2)
    answers.append([(c.text, c.finish_reason, c.logprobs.tokens) for c in out.choices])
    logprobs += out.choices[0].logprobs.token_logprobs
    out = client.completions.create(model="pydoc-chat", prompt=[prompt, SERVED_PROMPTS[3] * 2],
                                    max_tokens=10, temperature=0.9, seed=3, n=2, stop=["e"])
    answers.append([(c.index, c.text, c.finish_reason, c.stop_reason) for c in out.choices])
    stream = client.completions.create(model="pydoc-chat", prompt=SERVED_PROMPTS[4] * 2,
                                       max_tokens=12, temperature=0.8, seed=5, stream=True)
    answers.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    stream = client.chat.completions.create(
        model="pydoc-chat", messages=[{"role": "user", "content": SERVED_PROMPTS[5]}],
        max_tokens=10, seed=7, temperature=0.7, stream=True)
    answers.append("".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices))
    out = client.completions.create(model="pydoc-chat", prompt=prompt, max_tokens=3, echo=True,
                                    logprobs=1)
    answers.append((out.choices[0].text, out.choices[0].logprobs.tokens))
    logprobs += out.choices[0].logprobs.token_logprobs[1:]  # the first token has none
    # each finished request in every histogram, a gap for each step after its first token's
    answers.append({name: value for name, value in served_metrics(url).items()
                    if name.endswith("_count")})
    return answers, logprobs


def pd_reference_answers(folder):
    """pd_server_answers of a server over one engine, as the flags build it; and the model,
    engine and tokenizer, and the server's ServedModel."""
    import server
    args = server.argument_parser().parse_args(["--model", str(folder)] + PD_SERVER_FLAGS)
    model, engine, tokenizer = demo.load(args)
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
        return pd_server_answers(url), (args, model, engine, tokenizer)


def pd_front_and_worker(args, model, tokenizer):
    """A front and a prefill worker over a loopback link, their engines as the server's flags
    build them (the worker's model a copy: it steps in a thread of its own)."""
    down, up = disaggregation.loopback_pair()
    settings_ = dict(block_size=args.block_size, num_blocks=args.num_blocks, tokenizer=tokenizer,
                     connector="remote")
    worker = disaggregation.PrefillWorker(
        Engine(copy.deepcopy(model), **settings_, connector_config=dict(link=up)), up)
    front = disaggregation.DecodeFront(
        Engine(model, **settings_, connector_config=dict(link=down)), down)
    return front, worker


def pd_wait(condition, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.disaggregation
def test_a_server_over_a_decode_front_answers_as_over_one_engine_and_frees_an_aborted_stream(
        tmp_path):
    """A server whose loop steps a DecodeFront, its prefill worker serving in a thread: the
    openai client's answers equal a server's over one engine; a stream the client closes frees
    its blocks; a prefill process that leaves leaves the server serving alone, the same
    answers; nothing is held on either side at the end."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import server
    folder = served_chat_folder(tmp_path)
    (want, want_logprobs), (args, model, _, tokenizer) = pd_reference_answers(folder)
    front, worker = pd_front_and_worker(args, model, tokenizer)
    for _ in range(2):  # its engine's ids run ahead of the front's: the loop must tell them apart
        front.engine.abort(front.engine.add_request([1, 2], SamplingParams()))
    one_at_a_time(front.engine, worker.engine)
    stats = []
    thread = threading.Thread(target=lambda: stats.append(worker.serve()), daemon=True)
    thread.start()
    try:
        with served_in_thread(front, server.served_model(args, model, front, tokenizer)) as url:
            got, logprobs = pd_server_answers(url)
            assert got == want and logprobs == pytest.approx(want_logprobs, abs=1e-4)
            assert front.consumer.num_reloaded_blocks > 0  # the prefill worker computed prompts
            stream = served_client(url).completions.create(
                model="pydoc-chat", prompt=SERVED_PROMPTS[6] * 3, max_tokens=150, stream=True)
            next(iter(stream))
            stream.close()  # the client leaves: the server aborts it
            pd_wait(lambda: served_metrics(url)[
                'vllm:request_success_total{finished_reason="abort"}'] == 1)
            assert served_metrics(url)["nanopaged:num_blocks_in_use"] == 0
            worker.link.inbox.put(({"type": "bye"}, []))  # the prefill process leaves
            thread.join(timeout=20)
            assert not thread.is_alive()
            alone = pd_server_answers(url)[0]  # every prompt computed here
            assert alone[:-1] == want[:-1]
            assert alone[-1] == {name: 2 * n for name, n in want[-1].items()}  # the abort in none
            assert not front.stats()["prefill_process_alive"]
    finally:
        worker.link.inbox.put(({"type": "bye"}, []))  # if the test failed before it left
        thread.join(timeout=20)
    pd_nothing_held(front, worker)
    assert stats[0]["num_free_blocks"] == stats[0]["num_blocks"]


def one_at_a_time(*engines):
    """The engines' steps never overlap: two engines stepping at once in one process (threads)
    gave other sampled tokens in about one run in five, never two processes."""
    lock = threading.Lock()
    for engine in engines:
        def step(step=engine.step):
            with lock:
                return step()
        engine.step = step


def pd_server_process(rank, port, master_port, folder, log):
    """`python server.py --disaggregate` as torchrun starts rank `rank` of two."""
    env = os.environ | dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(master_port), OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen([sys.executable, os.path.join(here, "server.py"), "--disaggregate",
                             "--host", "127.0.0.1", "--port", str(port), "--model", str(folder),
                             "--uvicorn-log-level", "warning", *PD_SERVER_FLAGS], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=here)


@pytest.mark.disaggregation
def test_server_disaggregate_in_two_processes_answers_as_one_engine_and_stops_both(tmp_path):
    """server.py --disaggregate as torchrun runs it, rank 0 the server and rank 1 the prefill
    process: the openai client's answers equal a server's over one engine, nothing is held
    after them on either side, and a SIGTERM to the server ends the prefill process too."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import server
    folder = served_chat_folder(tmp_path)
    port, master_port = server.free_port(), server.free_port()
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in (0, 1)]
    ranks = [pd_server_process(rank, port, master_port, folder, logs[rank]) for rank in (0, 1)]
    try:
        (want, want_logprobs), _ = pd_reference_answers(folder)  # while the two start
        url = f"http://127.0.0.1:{port}"
        pd_wait(lambda: server.healthy(url) or any(p.poll() is not None for p in ranks), 60)
        assert server.healthy(url), [server.read_back(log) for log in logs]
        got, logprobs = pd_server_answers(url)
        assert got == want and logprobs == pytest.approx(want_logprobs, abs=1e-4)
        m = served_metrics(url)
        assert m["nanopaged:num_blocks_in_use"] == 0 and m["nanopaged:reloaded_blocks_total"] > 0
        ranks[0].send_signal(signal.SIGTERM)
        for p in ranks:
            p.wait(timeout=30)
        assert ranks[1].returncode == 0, server.read_back(logs[1])
        assert "prefill process: stopped; 128 of 128 blocks free" in server.read_back(logs[1])
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


# -----------------------------------------------------------------------------
# 7. The model against Hugging Face GPT-2, Llama, Mistral and Qwen2, and naive attention  (-m model)


@pytest.mark.model
@pytest.mark.parametrize("name", HF_MODELS)
def test_logits_match_hugging_face(hf_folder, name):
    path, hf = hf_folder(name)
    model = GPT.from_pretrained(str(path))
    idx = torch.randint(hf.config.vocab_size, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.model
@pytest.mark.parametrize("name", HF_MODELS)
def test_paged_greedy_generation_equals_hugging_face_generate(hf_folder, name):
    path, hf = hf_folder(name)
    model, hf64 = GPT.from_pretrained(str(path), dtype=torch.float64), copy.deepcopy(hf).double()
    prompts = [[(7 * i + 3 * j) % 97 for j in range(n)] for i, n in enumerate([5, 7, 11, 13])]
    expected = hf_greedy(hf64, prompts, 12)
    for mode in ["recompute", "swap"]:
        engine = Engine(model, block_size=3, num_blocks=12, preemption_mode=mode)  # 3 divides none
        outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
        assert engine.stats()["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.model
@pytest.mark.parametrize("kinds, message", [
    (dict(sliding_window=0), "sliding_window must be None or an int >= 1, got 0"),
    (dict(sliding_window=4.0), "sliding_window must be None or an int >= 1, got 4.0"),
    (dict(attention_chunk_size=0), "attention_chunk_size must be None or an int >= 1, got 0"),
    (dict(sliding_window=4, layer_types=["sliding_attention"]), "layer_types must list 2"),
    (dict(sliding_window=4, layer_types=["sliding_attention", "local_attention"]),
     f"layer_types must list 2 (n_layer) of {KINDS}"),  # every registered kind
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types has sliding_attention layers but sliding_window is None"),
    (dict(sliding_window=4, layer_types=["chunked_attention", "sliding_attention"]),
     "layer_types has chunked_attention layers but attention_chunk_size is None"),
])
def test_an_attention_kind_the_model_cannot_honour_is_a_clear_error(kinds, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(n_layer=2, n_head=2, n_embd=16, **kinds)


def layer_windows(config):
    """Each layer's sliding window, None where it has none."""
    return [getattr(kind, "window", None) for kind in config.attention_kinds]


@pytest.mark.model
def test_gpt2_and_llama_see_the_whole_context_unless_told_otherwise():
    for model in MODELS.values():
        assert model.config.attention_kinds == [nanopaged.FullAttention()] * 2
        assert model.config.layer_types == ["full_attention"] * 2
    config = GPTConfig(n_layer=3, n_head=2, n_embd=16, sliding_window=8)  # Mistral: every layer
    assert config.attention_kinds == [nanopaged.SlidingWindow(8)] * 3
    assert len(config.kv_cache_groups) == 1


# Windows of 16 to 32 tokens over contexts of a few hundred: Mistral's on every layer, Qwen2's on
# the layers from max_window_layers on, and Qwen2's layer_types mixing them in any order
WINDOWED_HF_MODELS = {
    "mistral-window": ("MistralConfig", dict(LLAMA_FAMILY, num_key_value_heads=2, head_dim=16,
                                             max_position_embeddings=512, sliding_window=16,
                                             rope_parameters=dict(rope_theta=1e4))),
    "qwen2-window": ("Qwen2Config", dict(LLAMA_FAMILY, num_hidden_layers=3, num_key_value_heads=3,
                                         max_position_embeddings=512, use_sliding_window=True,
                                         sliding_window=24, max_window_layers=1,
                                         rope_parameters=dict(rope_theta=1e6))),
    "qwen2-layer-types": ("Qwen2Config", dict(
        LLAMA_FAMILY, num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=32, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def hf_windows(config):
    """Each layer's sliding window (None: full attention) as transformers' model applies it:
    Mistral's on every layer, Qwen2's and Ministral's by their layer_types, none in GPT-2 and
    Llama."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    kinds = {"mistral": ["sliding_attention"] * n}.get(config.model_type, [None] * n)
    if config.model_type in ("qwen2", "ministral"):
        kinds = config.layer_types
    return [window if kind == "sliding_attention" else None for kind in kinds]


@pytest.mark.model
@pytest.mark.parametrize("name", WINDOWED_HF_MODELS)
def test_windowed_logits_match_hugging_face(hf_folder, name):
    path, hf = hf_folder(name)
    model = GPT.from_pretrained(str(path))
    assert layer_windows(model.config) == hf_windows(hf.config)
    assert any(layer_windows(model.config))
    idx = torch.randint(hf.config.vocab_size, (2, 300))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.model
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", WINDOWED_HF_MODELS)
def test_windowed_requests_past_the_pool_equal_hugging_face(hf_folder, name, mode):
    # prompts of up to 8 windows sharing a prefix and 48 new tokens, past many windows, served in
    # prefill chunks of 8 tokens and preempted (by recompute or by swap); then the longest
    # conversation's next turn, whose prompt is its last one and its answer, a prefix hit under
    # the hybrid rule (each group's blocks its kind needs). All in a pool of blocks of 5 that
    # holds the longest request by its kinds' bound and little more: a fraction of what it would
    # need under full attention (Mistral's every layer is windowed; a Qwen2 hybrid is bounded by
    # its full-attention layers). Ten short prompts come first, whose windows grow as they decode
    path, hf = hf_folder(name)
    model, hf64 = GPT.from_pretrained(str(path), dtype=torch.float64), _double(hf)
    shared = [(5 * j + 1) % 97 for j in range(20)]
    prompts = [[(3 * i + 2) % 97] * 2 for i in range(10)]
    prompts += [shared + [(7 * i + 3 * j) % 97 for j in range(n)]
                for i, n in enumerate([3, 60, 180])]
    expected = hf_greedy(hf64, prompts, 48)
    turn = prompts[-1] + expected[-1] + [1, 2, 3]
    full_attention = copy.deepcopy(model)
    for block in full_attention.transformer.h:
        block.attn.mask = kernel.Mask()
    assert naive_greedy(full_attention, prompts[-1], 48) != expected[-1], "windows matter here"
    groups, longest = len(model.config.kv_cache_groups), len(turn) + 48
    num_blocks = Engine(model, block_size=5, num_blocks=1024).allocator.max_blocks(longest, 8)
    num_blocks += groups * 4
    under_full_attention = groups * -(-longest // 5)
    # a third of a Qwen2 hybrid's layers keep every block: under 3x, and near it as it grows
    assert num_blocks < under_full_attention / (5 if name.startswith("mistral") else 1.8)
    engine = Engine(model, block_size=5, num_blocks=num_blocks, preemption_mode=mode,
                    max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=48, temperature=0)
    outputs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.stats()["num_preemptions"] > 0
    out = engine.generate([turn], params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf64, [turn], 48)[0]
    assert out.num_cached_tokens >= len(prompts[-1])  # the whole last turn, and some of its answer
    assert_all_blocks_free(engine)


@pytest.mark.model
def test_gqa_model_generates_like_naive():
    model = tiny_model(n_kv_head=2, seed=1)
    engine = Engine(model, block_size=4, num_blocks=64)
    prompts = [[1, 2, 3], [4] * 9, [5, 6]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == \
        [naive_greedy(model, p, 10) for p in prompts]


class RecordingEngine(Engine):
    """An engine that keeps the logits of every step, by the tokens they follow."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits = {}  # token ids -> next-token logits
        decide = self.output_processor.decide

        def record(chunks, logits, proposals):
            assert not proposals, "one row per sequence"
            done = [c.seq for c in chunks if c.start + len(c.tokens) == len(c.seq)]
            self.logits.update({tuple(s.token_ids): row
                                for s, row in zip(done, logits, strict=True)})
            return decide(chunks, logits, proposals)
        self.output_processor.decide = record


@pytest.mark.model
@settings(max_examples=examples(20), deadline=None)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=40),
       block_size=st.sampled_from([1, 2, 3, 4, 8]), chunk=st.integers(1, 9),
       mode=st.sampled_from(["recompute", "swap"]))
def test_rotary_positions_do_not_depend_on_how_a_prompt_is_served(prompt, block_size, chunk, mode):
    """A token's rotary angle comes from its position in its sequence, so the logits after a
    prompt are the same served whole, in prefill chunks, after a prefix-cache hit, or after
    its sequence was preempted and its K/V recomputed (or swapped back)."""
    params = SamplingParams(max_tokens=block_size + 1, temperature=0)  # crosses a block boundary
    num_blocks = -(-len(prompt) // block_size)

    def serve(prompts, **kwargs):
        engine = RecordingEngine(LLAMA, block_size=block_size, **{"num_blocks": 64, **kwargs})
        engine.generate(prompts, params)
        return engine
    whole = serve([prompt])
    chunked = serve([prompt], max_num_batched_tokens=chunk)
    cached = serve([prompt])
    cached.logits.clear()
    cached.generate([prompt], params)
    # Two copies admitted together into a pool with one spare block: the younger is preempted
    # when both need a new block, and comes back to finish.
    preempted = serve([prompt, prompt], num_blocks=2 * num_blocks + 1, preemption_mode=mode,
                      enable_prefix_caching=False)
    assert preempted.stats()["num_preemptions"] > 0
    assert cached.stats()["prefix_cache_hit_tokens"] == (len(prompt) - 1) // block_size * block_size
    for engine in (whole, chunked, cached, preempted):
        assert tuple(prompt) in engine.logits
        for tokens, logits in engine.logits.items():
            torch.testing.assert_close(logits, naive_logits(LLAMA, tokens), atol=1e-10, rtol=1e-10)


@functools.lru_cache(maxsize=4096)
def naive_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


# -- sliding windows: each layer's own, from the contiguous path to every backend


def windowed_model(size, kinds, seed=2, dtype=torch.float64):
    """A tiny Llama-family model (head size 16, as Triton takes); layer i is windowed if
    kinds[i] is "s", chunked if "c", full if "f", with windows and chunks of size tokens, and
    sinks beside a window if "k" (the suite's own kind), two chunks if "t" (a test's kind, which
    it registers). Its weights are made large enough for attention to be sharp, so that which
    keys a token sees changes what it generates."""
    torch.manual_seed(seed)
    names = {"s": "sliding_attention", "f": "full_attention", "c": "chunked_attention",
             "k": AttentionSinks.name, "t": TwoChunkLocal.name}
    config = GPTConfig(n_layer=len(kinds), n_head=4, n_kv_head=2, n_embd=64, vocab_size=32,
                       max_seq_len=96, rope_theta=1e4, norm="rmsnorm", mlp="swiglu", bias=False,
                       intermediate_size=48, sliding_window=size, attention_chunk_size=size,
                       layer_types=[names[k] for k in kinds])
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.to(dtype)


@pytest.mark.model
@settings(max_examples=examples(30), deadline=None)
@given(st.lists(st.integers(0, 31), min_size=1, max_size=60), st.integers(1, 20),
       st.integers(1, 2))
def test_windowed_layers_see_exactly_the_last_tokens_their_windows_reach(tokens, window, layers):
    # a model without positions (GPT-2's, its learned positions zeroed): n layers of windows of
    # W reach back n * (W - 1) positions, so the next token after a sequence is the next token
    # after its last n * (W - 1) + 1 tokens alone; windows one wider reach further, which
    # changes it (unless the token they reach repeats one already seen: a value averaged in)
    def model(window):
        torch.manual_seed(4)
        gpt = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=64, vocab_size=32, max_seq_len=64,
                            sliding_window=window)).double()
        with torch.no_grad():
            for p in gpt.parameters():
                p.add_(0.3 * torch.randn_like(p))
            gpt.transformer.wpe.weight.zero_()
        return gpt
    reach = layers * (window - 1) + 1
    exact, wider = model(window), model(window + 1)
    torch.testing.assert_close(naive_logits(exact, tuple(tokens)),
                               naive_logits(exact, tuple(tokens[-reach:])), atol=1e-12, rtol=0)
    if len(tokens) > reach and tokens[-reach - 1] not in tokens[-reach:]:
        assert not torch.allclose(naive_logits(wider, tuple(tokens)),
                                  naive_logits(wider, tuple(tokens[-reach:])), atol=1e-9)


@pytest.mark.model
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_mixes(), st.integers(1, 12),
       st.sampled_from(["ss", "sf", "fs", "cc", "cf", "sc", "kk", "kf"]))
def test_windowed_models_generate_like_naive_contiguous(mix, size, kinds):
    # models of every kind, and hybrids, served paged (chunked prefills, prefix hits, both
    # preemptions, tight pools: a hybrid's two KV cache groups take a block each per block of
    # tokens) generate what the contiguous path does, past several windows and chunks: the
    # attention skips what its mask hides, the allocator gives back what no token to come sees
    prompts, max_tokens, priorities, engine_args = mix
    model = windowed_model(size, kinds)
    engine_args["num_blocks"] *= len(model.config.kv_cache_groups)
    engine = Engine(model, **engine_args)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    for _ in range(2):  # the second time, the prompts hit the prefix cache if it is on
        outputs = engine.generate(prompts, params, priority=priorities)
        assert [o.outputs[0].token_ids for o in outputs] == \
            [naive_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    assert_all_blocks_free(engine)


@pytest.mark.model
def test_a_kind_a_backend_cannot_honour_is_refused_up_front_naming_both(monkeypatch):
    """A backend written without masks (its attend takes none: RECIPES.md's) still serves
    every model of full attention; for a model with another kind it is a clear error up front,
    naming the backend and the kind. So is one whose unsupported_mask refuses a kind's mask."""
    def attend(q, k_cache, v_cache, meta, scale, **scales):
        return kernel.ATTENTION_BACKENDS["torch"].attend(q, k_cache, v_cache, meta, scale,
                                                          **scales)
    monkeypatch.setitem(kernel.ATTENTION_BACKENDS, "no_masks",
                        kernel.AttentionBackend(kernel.store_kv_torch, attend))
    with pytest.raises(ValueError, match="'no_masks'.*takes no mask.*sliding_attention"):
        Engine(HYBRID, block_size=4, num_blocks=16, attention_backend="no_masks")
    engine = Engine(MODEL, block_size=4, num_blocks=16, attention_backend="no_masks")
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.outputs[0].token_ids == naive_greedy(MODEL, [1, 2, 3], 4)
    torch_path = kernel.ATTENTION_BACKENDS["torch"]
    monkeypatch.setitem(kernel.ATTENTION_BACKENDS, "no_chunks", dataclasses.replace(
        torch_path, unsupported_mask=lambda mask: "no chunks" if mask.chunk else None))
    with pytest.raises(ValueError, match="'no_chunks'.*chunked_attention.*no chunks"):
        Engine(KIND_MODELS["chunked_attention"], block_size=4, num_blocks=16,
               attention_backend="no_chunks")
    Engine(WINDOWED, block_size=4, num_blocks=16, attention_backend="no_chunks")


@dataclass(frozen=True)
class TwoChunkLocal(nanopaged.AttentionKind):
    """A fork's kind whose mask only the torch path honours: its own chunk and the one before."""
    chunk: int
    name = "two_chunk_attention"

    @classmethod
    def from_config(cls, config):
        return cls(config.attention_chunk_size)

    @property
    def mask(self):
        return TwoChunkMask(chunk=self.chunk)


@pytest.mark.model
@pytest.mark.kernel
def test_a_forks_mask_runs_on_torch_and_triton_and_flex_refuse_it_up_front(monkeypatch):
    """A kind whose kernel.Mask subclass changes the rule: Triton and flex, which would apply
    Mask's rule to its numbers, refuse it at Engine(...), naming the mask and the backend; the
    torch path serves it as the contiguous model computes it, and gives back the blocks behind
    two chunks. A subclass that declares its kernel_args is taken by all three."""
    monkeypatch.setitem(nanopaged.ATTENTION_KINDS, TwoChunkLocal.name, TwoChunkLocal)
    model = windowed_model(3, "tt", seed=4, dtype=torch.float32)
    for backend, kernel_name in (("triton", "the Triton kernel"), ("flex", "flex attention")):
        refused = (rf"attention_backend='{backend}' cannot run this model: "
                   rf".*two_chunk_attention.*its mask TwoChunkMask .*{kernel_name}")
        with pytest.raises(ValueError, match=refused):
            Engine(model, block_size=2, num_blocks=40, attention_backend=backend)
    engine = Engine(model, block_size=2, num_blocks=40, attention_backend="torch",
                    max_num_batched_tokens=5)
    prompts = [list(range(1, 14)), [8, 9], list(range(1, 9)) + [30] * 7]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0))
    tokens, given_back = {}, 0
    for step in stepped(engine, 100):
        tokens |= {o.request_id: o.outputs[0].token_ids for o in step}
        given_back += sum(seq.block_table.count(NO_BLOCK) for r in engine.scheduler.running
                          for seq in r.seqs)
    expected = [naive_greedy(model, p, 10) for p in prompts]
    assert [tokens[i] for i in range(3)] == expected and given_back
    # what a kernel reading Mask(chunk=3) would compute instead
    assert expected != [naive_greedy(windowed_model(3, "cc", seed=4, dtype=torch.float32), p, 10)
                        for p in prompts]
    assert_all_blocks_free(engine)
    monkeypatch.setattr(TwoChunkLocal, "mask", property(lambda kind: NamedWindow(window=3)))
    for backend in ("triton", "flex", "torch"):
        Engine(windowed_model(3, "tt", seed=4, dtype=torch.float32), block_size=2,
               num_blocks=40, attention_backend=backend)


@pytest.mark.model
@pytest.mark.parametrize("backend", ["triton", "torch", "flex"])
def test_a_hybrid_model_generates_like_naive_on_every_backend(backend):
    # a window, full attention, chunks and sinks, of 5 over prompts up to 3 windows long and 12
    # new tokens, in blocks of 4: windows and chunks end mid-block; chunked prefills (7 tokens
    # a step) and a prefix hit (prompt 2 starts as prompt 0 does); fp32, the kernels' dtype
    model = windowed_model(5, "sfck", seed=3, dtype=torch.float32)
    prompts = [list(range(1, 14)), [8, 9], list(range(1, 9)) + [30] * 7]
    engine = Engine(model, block_size=4, num_blocks=40, attention_backend=backend,
                    max_num_batched_tokens=7)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == \
        [naive_greedy(model, p, 12) for p in prompts]
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_all_blocks_free(engine)


@pytest.mark.model
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_the_batch_block_table_is_each_table_then_minus_ones_whatever_changed_between_steps(
        data):
    """ModelRunner.batch_table keeps its rows from step to step and writes a row again only when
    its table changed or another table holds it now. After any changes between two steps (a
    block appended, replaced or truncated away, a table swapped for a new one, sequences
    leaving and coming in another order), row i is the step's table i, then -1s. And the rows
    kept grow as a list does, each way on its own: at most twice the most tables and twice the
    widest table a step has had, and never less than before."""
    runner = Engine(MODEL, block_size=2, num_blocks=8).model_runner
    tables = [nanopaged.BlockTable() for _ in range(4)]
    most = widest = 0
    before = (0, 0)
    for _ in range(data.draw(st.integers(1, 10))):
        for i, table in enumerate(tables):
            change = data.draw(st.sampled_from(["append", "replace", "truncate", "new", "none"]))
            if change == "append" or change == "replace" and not table.n:
                table.append(data.draw(st.integers(-1, 9)))
            elif change == "replace":
                table[data.draw(st.integers(0, table.n - 1))] = data.draw(st.integers(-1, 9))
            elif change == "truncate":
                table.truncate(data.draw(st.integers(0, table.n)))
            elif change == "new":  # another table in its place
                tables[i] = nanopaged.BlockTable()
        step = data.draw(st.lists(st.sampled_from(tables), min_size=1, max_size=4,
                                  unique_by=id))
        width = max(table.n for table in step)
        assert runner.batch_table(0, step).tolist() == \
            [table.tolist() + [-1] * (width - table.n) for table in step]
        most, widest = max(most, len(step)), max(widest, width)
        kept = runner.table_rows[0][0].shape
        assert kept[0] <= 2 * most and kept[1] <= 2 * widest, (kept, most, widest)
        assert kept[0] >= before[0] and kept[1] >= before[1], (kept, before)
        before = kept


# -----------------------------------------------------------------------------
# 9. Sampling: the pipeline against transformers' processors, seeds, logprobs  (-m sampling)


def sampling_meta(temperatures, top_ks, top_ps, generators=None):
    """A step's SamplingMetadata for rows of (temperature, top_k, top_p), each row a one-token
    prompt with no output yet."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in zip(temperatures, top_ks, top_ps, strict=True)]
    R = len(params)
    return nanopaged.SamplingMetadata(params, [make_seq(i, [0]) for i in range(R)], [[]] * R,
                                      generators or [None] * R, set(), torch.device("cpu"))


def sample_rows(logits, temperatures, top_ks, top_ps, generators):
    return nanopaged.sample(logits, sampling_meta(temperatures, top_ks, top_ps, generators))


def pipeline_probs(logits, temperatures, top_ks, top_ps):
    """The distribution each row draws from: softmax of what the sampling pipeline leaves."""
    meta, scores = sampling_meta(temperatures, top_ks, top_ps), logits
    for step in nanopaged.LOGITS_STEPS + nanopaged.SAMPLING_STEPS:
        scores = step(scores, meta)
    return scores.softmax(-1)


@pytest.mark.sampling
def test_sampling_respects_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(3, 50, dtype=torch.float64)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for _ in range(50):
        tokens = sample_rows(logits, [1.0, 1.0, 0.0], [3, 0, 0], [1.0, 0.5, 1.0], gens)
        assert tokens[0] in logits[0].topk(3).indices
        probs = logits[1].softmax(-1).sort(descending=True)
        nucleus = probs.indices[:int((probs.values.cumsum(-1) < 0.5).sum()) + 1]
        assert tokens[1] in nucleus
        assert tokens[2] == logits[2].argmax()


def transformers_scores(logits, temperature, top_k, top_p):
    """A row's scores after transformers' TemperatureLogitsWarper -> TopKLogitsWarper ->
    TopPLogitsWarper, as generate() chains them (top_k 0 and top_p 1 add no warper): the oracle
    of what sampling may draw. -inf marks a token it cannot draw."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    chain = [warpers.TemperatureLogitsWarper(float(temperature))]
    chain += [warpers.TopKLogitsWarper(top_k)] if top_k > 0 else []
    chain += [warpers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    scores = logits.float()[None]                                                   # (1, V)
    for warper in chain:
        scores = warper(None, scores)
    return scores[0]


@st.composite
def sampling_batches(draw):
    """Rows of logits over one vocabulary, each with its temperature, top_k and top_p. Logits
    are normal draws (no ties), rounded ones (ties at the top-k and top-p edges) or logs of
    small counts with top_p a multiple of 1/64 (ties, and a top_p on a boundary of the sums).
    Logits within +-8 and temperatures >= 0.25 keep every softmax term a normal float, so a
    token has probability 0 only if filtered out."""
    V = draw(st.integers(1, 40))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        kind = draw(st.sampled_from(["normal", "rounded", "counts"]))
        logits = (torch.randn(V, generator=g, dtype=torch.float64) * 3).clamp(-8, 8)
        counts = torch.randint(1, 6, (V,), generator=g).double()
        logits = {"normal": logits, "rounded": logits.round(), "counts": counts.log()}[kind]
        top_p = draw(st.one_of(st.just(1.0), st.floats(0, 1, exclude_min=True),
                               st.integers(1, 64).map(lambda i: i / 64)))
        rows.append((logits, draw(st.floats(0.25, 4)), draw(st.integers(0, V + 1)), top_p))
    return rows


@pytest.mark.sampling
@settings(max_examples=examples(300), deadline=None)
@given(sampling_batches())
def test_sampling_matches_transformers_top_k_then_top_p(rows):
    logits = torch.stack([r[0] for r in rows]).float()  # a float32 model's, as generate() casts
    temperatures, top_ks, top_ps = ([r[i] for r in rows] for i in (1, 2, 3))
    probs = pipeline_probs(logits, temperatures, top_ks, top_ps)                  # (R, V)
    for r, (row, temperature, top_k, top_p) in enumerate(rows):
        scores = transformers_scores(row, temperature, top_k, top_p)
        assert (probs[r] > 0).tolist() == scores.isfinite().tolist()  # the same support
        torch.testing.assert_close(probs[r], scores.softmax(-1), rtol=1e-6, atol=1e-7)


# Two fixed rows: a spread-out one, and a dominant token over a long tail of twelve equal
# tokens (ties with the k-th token and at the top-p edge).
DRAW_ROWS = [torch.randn(16, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 1.5,
             torch.tensor([4.0, 2.5, 2.0, 1.0] + [0.0] * 12, dtype=torch.float64)]


@pytest.mark.sampling
@pytest.mark.parametrize("row", [0, 1])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 6, 0.7)])
def test_draws_follow_transformers_distribution(row, temperature, top_k, top_p):
    """4,000 seeded draws, each one row with its own generator, against softmax of transformers'
    processed scores: none outside the support, and a chi-square test with p > 1e-4 (fixed seeds,
    so it passes or fails the same way every run)."""
    logits, N = DRAW_ROWS[row], 4000
    gens = [nanopaged.sample_generator(11, i, 0, "cpu") for i in range(N)]
    tokens = sample_rows(logits.expand(N, -1), [temperature] * N, [top_k] * N, [top_p] * N, gens)
    counts = torch.bincount(tokens, minlength=len(logits)).double()                  # (V,)
    scores = transformers_scores(logits, temperature, top_k, top_p)
    assert counts[scores.isinf()].sum() == 0  # no draw outside the support
    assert_chi_square(counts, scores.double().softmax(-1) * N, scores.isfinite())


def assert_chi_square(counts, expected, support):
    """Observed counts against expected ones over the support: a chi-square test with p > 1e-4.
    Tokens expected fewer than 5 times are pooled into one cell, as chi-square needs."""
    rare = support & (expected < 5)
    common = support & ~rare
    observed = torch.cat([counts[common], counts[rare].sum()[None]])
    expected = torch.cat([expected[common], expected[rare].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    assert len(expected) >= 2
    chi2 = ((observed - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc((len(expected) - 1) / torch.tensor(2.0), chi2 / 2)  # chi2.sf
    assert p_value > 1e-4, (chi2, counts, expected)


@pytest.mark.sampling
@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 2**31), st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                                 st.integers(0, 6),
                                                 st.sampled_from([1.0, 0.9, 0.5, 0.1])),
                                       min_size=1, max_size=4))
def test_sample_draws_only_from_the_support_and_greedy_is_the_argmax(seed, rows):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), 16, generator=g, dtype=torch.float64).round(decimals=1)  # ties
    temperatures, top_ks, top_ps = map(list, zip(*rows))
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(rows))]
    support = pipeline_probs(logits, [t or 1.0 for t in temperatures], top_ks, top_ps) > 0
    for _ in range(20):
        tokens = sample_rows(logits, temperatures, top_ks, top_ps, gens)
        for r, t in enumerate(tokens.tolist()):
            assert t == logits[r].argmax() if temperatures[r] == 0 else support[r, t]


@pytest.mark.sampling
@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 2**31), st.lists(st.tuples(st.sampled_from([0.0, 0.7, 1.0]),
                                                 st.sampled_from([0, 3]),
                                                 st.sampled_from([1.0, 0.6])),
                                       min_size=2, max_size=5))
def test_a_rows_draw_ignores_the_other_rows(seed, rows):
    logits = torch.randn(len(rows), 40, generator=torch.Generator().manual_seed(seed))
    temperatures, top_ks, top_ps = map(list, zip(*rows))

    def generators():
        return [nanopaged.sample_generator(seed, i, 0, "cpu") for i in range(len(rows))]
    together = sample_rows(logits, temperatures, top_ks, top_ps, generators()).tolist()
    alone = [sample_rows(logits[r:r + 1], [t], [k], [p], [g]).item()
             for r, (t, k, p, g) in enumerate(zip(temperatures, top_ks, top_ps, generators()))]
    assert together == alone


@pytest.mark.sampling
def test_sample_sorts_only_to_filter(monkeypatch):
    logits = torch.randn(3, 50)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    sorts, real_sort = [], torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    assert sample_rows(logits, [1.0, 0.0, 0.7], [0, 0, 0], [1.0, 1.0, 1.0], gens).shape == (3,)
    assert not sorts  # no top-k, no top-p: nothing to sort
    sample_rows(logits, [1.0, 0.0, 0.7], [0, 0, 0], [1.0, 1.0, 0.9], gens)
    assert len(sorts) == 1


@pytest.mark.sampling
@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.one_of(st.integers(0, 5), st.integers(0, 2**64 - 1)),
                          st.integers(0, 12), st.integers(0, 12)),
                min_size=2, max_size=12, unique=True))
def test_distinct_seed_index_and_position_triples_draw_distinct_streams(triples):
    # (1, 12, 3) and (11, 2, 3) would spell alike joined without separators
    triples += [(1, 12, 3), (11, 2, 3), (1, 1, 23)]
    triples = list(dict.fromkeys(triples))
    gens = [nanopaged.sample_generator(seed, i, t, "cpu") for seed, i, t in triples]
    streams = {tuple(torch.empty(4).exponential_(generator=g).tolist()) for g in gens}
    assert len(streams) == len(triples)


@pytest.mark.sampling
def test_samples_of_requests_with_nearby_seeds_do_not_replay_each_other():
    # sample 1 of seed 0 must not draw from seed 0 + 1, the very stream of seed 1's sample 0
    engine = Engine(MODEL, block_size=4, num_blocks=64)
    prompt = [5, 6, 7]
    first, second = engine.generate([prompt, prompt], [
        SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=0),
        SamplingParams(max_tokens=12, temperature=1.0, seed=1)])
    assert first.outputs[1].token_ids != second.outputs[0].token_ids


@pytest.mark.sampling
def test_seeded_sampling_ignores_batch_mates_and_preemption():
    prompt, params = [5, 6, 7, 8, 9], SamplingParams(max_tokens=16, temperature=0.9, top_k=20,
                                                     top_p=0.9, seed=1234)
    alone = (Engine(MODEL, block_size=4, num_blocks=64).generate([prompt], params)[0]
             .outputs[0].token_ids)
    others = [[(3 * i + j) % 32 for j in range(4 + i)] for i in range(6)]
    for mode in ["recompute", "swap"]:
        engine = Engine(MODEL, block_size=4, num_blocks=14, preemption_mode=mode)
        outputs = engine.generate(others + [prompt],
                                  [SamplingParams(max_tokens=16, temperature=1.0)] * 6 + [params])
        assert engine.stats()["num_preemptions"] > 0
        assert outputs[-1].outputs[0].token_ids == alone
    unseeded = Engine(MODEL, block_size=4, num_blocks=64).generate([prompt] * 4,
                                                                   SamplingParams(max_tokens=16))
    # without a seed, samples differ
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


@pytest.mark.sampling
@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=10), seed=st.integers(0, 2**32),
       n=st.integers(1, 2), top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.8]),
       mates=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=10), max_size=4),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans())
def test_a_seeded_request_ignores_batch_mates_preemption_and_prefix_caching(
        prompt, seed, n, top_k, top_p, mates, mode, caching):
    # bitwise on the CPU torch path: the model runs in float64 here, sampling in float32
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=top_k, top_p=top_p, seed=seed, n=n)
    alone = Engine(MODEL, block_size=2, num_blocks=64).generate([prompt], params)[0]
    mates = [prompt[:len(m) % len(prompt) + 1] + m for m in mates]  # they share its prefix
    num_blocks = max(n * -(-(len(prompt) + 8) // 2), 14) + 2  # tight: preemptions are common
    crowded = Engine(MODEL, block_size=2, num_blocks=num_blocks, preemption_mode=mode,
                     enable_prefix_caching=caching, max_num_batched_tokens=8)
    mates_params = [SamplingParams(max_tokens=8, temperature=1.0)] * len(mates)
    outputs = crowded.generate(mates + [prompt], mates_params + [params])
    assert [c.token_ids for c in outputs[-1].outputs] == [c.token_ids for c in alone.outputs]


# -- penalties, min_p, min_tokens and logits processors -------------------------------------------

def history_meta(rows):
    """A SamplingMetadata for rows of (SamplingParams, prompt, output so far)."""
    seqs = []
    for i, (_, prompt, output) in enumerate(rows):
        seqs.append(Sequence(i, prompt + output, len(prompt)))
    return nanopaged.SamplingMetadata([p for p, _, _ in rows], seqs, [[]] * len(rows),
                                      [None] * len(rows), {0}, torch.device("cpu"))


def pipeline_scores(logits, meta):
    scores = logits.clone()
    for step in nanopaged.LOGITS_STEPS + nanopaged.SAMPLING_STEPS:
        scores = step(scores, meta)
    return scores


def vllm_presence_frequency(row, output, presence, frequency):
    """vLLM's documented rule, token by token: logit[t] -= presence * (t was generated) +
    frequency * (times t was generated)."""
    row = row.clone()
    for t, c in Counter(output).items():
        row[t] -= presence * 1.0 + frequency * c
    return row


def transformers_processed(row, prompt, output, p, eos=(0,)):
    """The oracle: transformers' processors and warpers in generate()'s order (repetition
    penalty; min_new_tokens; then temperature, top-k, top-p, min-p), with vLLM's presence and
    frequency rule (which transformers lacks) after the repetition penalty, as vLLM applies its
    penalties."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    ids, scores = torch.tensor([prompt + output]), row[None].float()
    if p.repetition_penalty != 1:
        scores = lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = vllm_presence_frequency(scores[0], output, p.presence_penalty,
                                     p.frequency_penalty)[None]
    if p.min_tokens:
        ends = sorted(set(p.stop_token_ids) | set(eos))
        scores = lp.MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, ends)(ids, scores)
    chain = [lp.TemperatureLogitsWarper(float(p.temperature))]
    chain += [lp.TopKLogitsWarper(p.top_k)] if p.top_k > 0 else []
    chain += [lp.TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
    chain += [lp.MinPLogitsWarper(p.min_p)] if p.min_p > 0 else []
    for warper in chain:
        scores = warper(ids, scores)
    return scores[0]


@st.composite
def penalised_rows(draw):
    """Rows of float32 logits over one vocabulary with a random prompt and output (repeats
    likely), and random penalties and filters (the values transformers and vLLM allow)."""
    V = draw(st.integers(2, 24))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        logits = (torch.randn(V, generator=g) * 3).clamp(-8, 8)
        if draw(st.booleans()):
            logits = logits.round()  # ties
        ids = st.lists(st.integers(0, V - 1), max_size=8)
        prompt, output = draw(ids) or [1 % V], draw(ids)
        p = SamplingParams(
            temperature=draw(st.sampled_from([0.5, 1.0, 1.7])), top_k=draw(st.integers(0, V)),
            top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.25])),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.3, 1.0])),
            repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
            presence_penalty=draw(st.sampled_from([0.0, -0.5, 1.2])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.4, -2.0])),
            min_tokens=draw(st.integers(0, 3)), max_tokens=8,
            stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=2)))
        rows.append((logits, p, prompt, output))
    return rows


@pytest.mark.sampling
@settings(max_examples=examples(300), deadline=None)
@given(penalised_rows())
def test_penalties_and_filters_match_transformers_processors(rows):
    meta = history_meta([(p, prompt, output) for _, p, prompt, output in rows])
    scores = pipeline_scores(torch.stack([r[0] for r in rows]), meta)
    for r, (row, p, prompt, output) in enumerate(rows):
        expected = transformers_processed(row, prompt, output, p)
        assert scores[r].isfinite().tolist() == expected.isfinite().tolist()  # the same support
        kept = expected.isfinite()
        torch.testing.assert_close(scores[r][kept], expected[kept], rtol=1e-6, atol=1e-5)


@pytest.mark.sampling
@settings(max_examples=examples(100), deadline=None)
@given(st.integers(2, 30), st.lists(st.integers(0, 29), max_size=12), st.integers(0, 2**31),
       st.floats(-2, 2), st.floats(-2, 2))
def test_presence_and_frequency_follow_vllms_formula(V, output, seed, presence, frequency):
    output = [t % V for t in output]
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed))
    p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, temperature=0)
    got = nanopaged.apply_penalties(logits.clone(), history_meta([(p, [0], output)]))
    torch.testing.assert_close(got[0], vllm_presence_frequency(logits[0], output, presence,
                                                               frequency))


@pytest.mark.sampling
def test_penalised_draws_follow_the_processed_distribution():
    """4,000 seeded draws of one row with every penalty and min_p on: none outside the support of
    transformers' processed scores, and a chi-square test with p > 1e-4 (fixed seeds)."""
    logits, N = DRAW_ROWS[0].float(), 4000
    prompt, output = [0, 1, 2, 2], [3, 3, 1]
    p = SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.3,
                       frequency_penalty=0.2, min_p=0.02, min_tokens=5, top_k=12)
    meta = history_meta([(p, prompt, output)] * N)
    meta.generators = [nanopaged.sample_generator(5, i, 0, "cpu") for i in range(N)]
    tokens = nanopaged.sample(logits.expand(N, -1), meta)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    scores = transformers_processed(logits, prompt, output, p)
    assert counts[scores.isinf()].sum() == 0
    assert_chi_square(counts, scores.double().softmax(-1) * N, scores.isfinite())


@pytest.mark.sampling
def test_logits_processors_see_the_prompt_and_the_output_so_far():
    seen = []

    def only_the_next_of(prompt, output, logits):  # count up from the prompt's last token
        seen.append((list(prompt), list(output)))
        forced = torch.full_like(logits, -math.inf)
        forced[(prompt[-1] + len(output) + 1) % len(logits)] = 0
        return forced
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=2,
                            logits_processors=[only_the_next_of])
    out = Engine(MODEL, block_size=2, num_blocks=32).generate([[5, 9]], params)[0]
    assert [c.token_ids for c in out.outputs] == [[10, 11, 12, 13]] * 2
    assert sorted(seen) == sorted([([5, 9], [10, 11, 12, 13][:i]) for i in range(4)] * 2)


def vllm_penalised(row, prompt, output, p):
    """vLLM's penalties on a row of scores: the repetition penalty over prompt and output (a
    positive score divided by it, a negative one multiplied), then presence and frequency."""
    seen = torch.zeros(len(row), dtype=torch.bool)
    seen[list(prompt) + list(output)] = True
    penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
    return vllm_presence_frequency(torch.where(seen, penalised, row), output,
                                   p.presence_penalty, p.frequency_penalty)


@pytest.mark.sampling
@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 7), min_size=1, max_size=8), seed=st.integers(0, 2**31),
       repetition=st.sampled_from([0.5, 1.0, 2.0]), presence=st.sampled_from([0.0, -2.0, 1.5]),
       frequency=st.sampled_from([0.0, 2.0, -0.5]))
@example(prompt=[1, 2, 1, 2], seed=0, repetition=2.0, presence=1.5, frequency=2.0)
def test_logits_processors_run_first_on_the_models_own_logits_then_the_penalties(
        prompt, seed, repetition, presence, frequency):
    """vLLM's order: a request's logits processors read the model's logits as they come (no
    penalty applied yet), and the penalties apply to what the processors return. A processor
    that adds a random bias: every row it sees is the model's (naive, contiguous) logits after
    the tokens so far, and each greedy token is the argmax of vLLM's penalties on its output."""
    bias = torch.randn(32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    seen = []

    def biased(prompt_ids, output_ids, logits):
        seen.append((list(prompt_ids) + list(output_ids), logits.clone()))
        return logits + bias
    p = SamplingParams(max_tokens=5, temperature=0, repetition_penalty=repetition,
                       presence_penalty=presence, frequency_penalty=frequency,
                       logits_processors=[biased])
    out = Engine(MODEL, block_size=2, num_blocks=32).generate([prompt], p)[0].outputs[0]
    assert len(seen) == len(out.token_ids)
    for (tokens, logits), token in zip(seen, out.token_ids):
        with torch.no_grad():
            raw = MODEL(torch.tensor([tokens]))[0, -1]
        torch.testing.assert_close(logits, raw, rtol=0, atol=1e-9)
        output = tokens[len(prompt):]
        assert token == int(vllm_penalised(raw + bias, prompt, output, p).argmax())


@pytest.mark.sampling
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=6), min_size=1,
                        max_size=4),
       min_tokens=st.integers(0, 6), extra=st.integers(0, 3), greedy=st.booleans(),
       stops=st.lists(st.integers(0, 31), max_size=3))
def test_min_tokens_hold_back_every_end_token(prompts, min_tokens, extra, greedy, stops):
    """With the model's end-of-text id the likeliest token everywhere (a processor makes it so),
    no sample ends before min_tokens, and one that may ends right there; stop tokens alike."""
    model = tiny_model()
    model.config.eos_token_id = 7

    def eos_first(prompt, output, logits):
        logits = logits.clone()
        logits[7] = logits.max() + 5
        return logits
    params = SamplingParams(max_tokens=min_tokens + extra + 1, min_tokens=min_tokens,
                            temperature=0 if greedy else 1.0, seed=1, stop_token_ids=stops,
                            logits_processors=[eos_first])
    for out in Engine(model, block_size=2, num_blocks=128).generate(prompts, params):
        tokens = out.outputs[0].token_ids
        assert len(tokens) >= min_tokens + 1
        assert not set(tokens[:min_tokens]) & ({7} | set(stops))
        if greedy:
            assert tokens[min_tokens] == 7 and out.outputs[0].finish_reason == "stop"


@pytest.mark.sampling
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("penalty", [0.8, 1.3])
def test_repetition_penalty_decodes_as_transformers_generate(hf_folder, family, penalty):
    """Greedy and beam search with repetition_penalty against transformers' generate()."""
    path, hf = hf_folder(family)
    hf64, model = _double(hf), _from_pretrained64(str(path))
    prompts = [[(5 * i + 3 * j) % 97 for j in range(n)] for i, n in enumerate([3, 6, 9])]
    engine = Engine(model, block_size=2, num_blocks=256)
    for kwargs, params in [
            (dict(do_sample=False), SamplingParams(max_tokens=10, temperature=0,
                                                   repetition_penalty=penalty)),
            (dict(do_sample=False, num_beams=3, num_return_sequences=3, early_stopping=True),
             SamplingParams(max_tokens=10, beam_width=3, repetition_penalty=penalty))]:
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            hf_out = hf64.generate(torch.tensor([prompt]), max_new_tokens=10, pad_token_id=0,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   eos_token_id=None, repetition_penalty=penalty, **kwargs)
            assert [c.token_ids for c in out.outputs] == \
                [row[len(prompt):].tolist() for row in hf_out]


# -- logprobs: the model's own, however the request was served ------------------------------------

def assert_logprobs(entries, tokens, ref, k, abs_tol):
    """entries[t] is vLLM's {tokens[t]: its logprob} plus the k likeliest, by ref[t] (T, V)."""
    assert len(entries) == len(tokens)
    for t, (token, logprobs) in enumerate(zip(tokens, entries)):
        assert set(logprobs) == {token} | set(ref[t].topk(k).indices.tolist())
        for i, lp in logprobs.items():
            assert lp == pytest.approx(ref[t, i].item(), abs=abs_tol)


def check_logprobs(out, prompt, p, hf):
    """out's logprobs, cumulative logprob and prompt logprobs against transformers' model hf."""
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)  # (T, V)
    assert_logprobs(out.outputs[0].logprobs, tokens, ref[len(prompt) - 1:], p.logprobs, 1e-4)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(ref[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(tokens)), abs=1e-3)
    if p.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert out.prompt_logprobs[0] is None
        assert_logprobs(out.prompt_logprobs[1:], prompt[1:], ref, p.prompt_logprobs, 1e-4)


@pytest.mark.sampling
def test_logprobs_are_the_models_as_transformers_computes_them(hf_folder):
    """SamplingParams.logprobs=k: per generated token, the k likeliest tokens' log-probabilities
    and the drawn token's, under the model itself (vLLM's raw logprobs); prompt_logprobs=k the
    same per prompt token after the first. Transformers' logits of the same sequence,
    log-softmaxed, are the oracle, for greedy and sampled requests alike."""
    for name in ("gpt2", "llama"):
        path, hf = hf_folder(name)
        model = GPT.from_pretrained(str(path))
        prompt = [(7 * j + 3) % 97 for j in range(9)]
        both = [SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2),
                SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=1, logprobs=0)]
        for params in (both, both[1:]):  # together, and logprobs=0 with no row asking for more
            engine = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=4)
            for out in engine.generate([prompt] * len(params), params):
                check_logprobs(out, prompt, params[out.request_id], hf)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name}=33 exceeds the vocabulary \(32\)"):
            Engine(MODEL, block_size=4, num_blocks=8).add_request([1], SamplingParams(**{name: 33}))


@pytest.mark.sampling
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.sampled_from([(), (5, 6, 7, 8, 9, 10)]),
                                   st.lists(st.integers(0, 31), min_size=1, max_size=9),
                                   st.integers(1, 4), st.sampled_from([None, 0, 3]),
                                   st.sampled_from([None, 1]),
                                   st.sampled_from(["greedy", "seeded", "n=2", "beam=2"])),
                         min_size=1, max_size=5),
       model=st.sampled_from(["gpt2", "llama"]), block_size=st.sampled_from([2, 4]),
       budget=st.sampled_from([3, 7, 64]), mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), spare=st.integers(0, 6))
def test_logprobs_do_not_depend_on_how_the_prompt_was_served(requests, model, block_size, budget,
                                                              mode, caching, spare):
    """Prompt and sample logprobs are the naive model's log-softmax of the same sequence however
    the prompt was served: chunked prefill, preemption in either mode, a prefix-cache hit (a
    request owed prompt logprobs takes none; the others may, on the same prefix), batch-mates."""
    model = MODELS[model]
    prompts = [list(prefix) + suffix for prefix, suffix, *_ in requests]
    params = [SamplingParams(max_tokens=m, temperature=0 if kind in ("greedy", "beam=2") else 1.0,
                             seed=i, n=2 if kind == "n=2" else 1,
                             beam_width=2 if kind == "beam=2" else None,
                             prompt_logprobs=pk, logprobs=None if kind == "beam=2" else k)
              for i, (_, _, m, pk, k, kind) in enumerate(requests)]
    worst = max(p.num_seqs * -(-(len(t) + p.max_tokens) // block_size)
                for t, p in zip(prompts, params))
    engine = Engine(model, block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                    enable_prefix_caching=caching, max_num_batched_tokens=budget)
    engine.generate(prompts[:1], SamplingParams(max_tokens=1))  # leaves its prompt in the cache
    for prompt, p, out in zip(prompts, params, engine.generate(prompts, params)):
        with torch.no_grad():
            ref = model(torch.tensor([prompt + out.outputs[0].token_ids]))[0].log_softmax(-1)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert out.prompt_logprobs[0] is None
            assert_logprobs(out.prompt_logprobs[1:], prompt[1:], ref, p.prompt_logprobs, 1e-9)
        for c in out.outputs:
            if p.logprobs is None:
                assert c.logprobs is None
                continue
            with torch.no_grad():
                ref = model(torch.tensor([prompt + c.token_ids]))[0, len(prompt) - 1:]
            assert_logprobs(c.logprobs, c.token_ids, ref.log_softmax(-1), p.logprobs, 1e-9)
    assert_all_blocks_free(engine)


@pytest.mark.sampling
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_are_recorded_once_when_the_request_is_preempted(mode):
    """The youngest request is preempted while it decodes, after its prompt logprobs are in:
    recomputing its prompt must not record them again, nor change them."""
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2)
    engine = Engine(MODEL, block_size=2, num_blocks=10, preemption_mode=mode)
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0))
    young = engine.add_request([5, 6, 7, 8, 9], params)
    out = drain(engine)[young]
    solo = Engine(MODEL, block_size=2, num_blocks=10).generate([[5, 6, 7, 8, 9]], params)[0]
    assert engine.stats()["num_preemptions"] == 1 and len(out.prompt_logprobs) == 5
    assert out.prompt_logprobs == solo.prompt_logprobs


# -----------------------------------------------------------------------------
# 10. Output processing: parallel samples and beams on copy-on-write blocks, stop tokens  (-m beam)


UNLIKELY = math.log(0.1)  # the fork's threshold: a draw less likely than 1 in 10


@contextlib.contextmanager
def unlikely_draws():
    """A fork's per-draw field, in the two places it takes: Sequence.__init__ declares it, and
    OutputProcessor.land updates it from each draw (the fork would edit those two places in
    nanopaged.py; here the originals run first, then the fork's line)."""
    real_init, real_land = Sequence.__init__, nanopaged.OutputProcessor.land

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.extras = {"num_unlikely": 0}  # place 1

    def land(self, seq, tokens, logprobs):
        real_land(self, seq, tokens, logprobs)
        seq.extras["num_unlikely"] += sum(logprob < UNLIKELY for logprob in logprobs)  # place 2
    with (mock.patch.object(Sequence, "__init__", init),
          mock.patch.object(nanopaged.OutputProcessor, "land", land)):
        yield


def logprobs_under_model(model, prompt, tokens):
    """Each of tokens' log-probability under model after prompt and the tokens before it,
    computed contiguously (no cache)."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = model(ids)[0, len(prompt) - 1:-1].double()                   # (len(tokens), V)
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


@pytest.mark.beam
@settings(max_examples=examples(6), deadline=None)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=8), n=st.integers(1, 3),
       beam_width=st.integers(1, 3), seed=st.integers(0, 2**31),
       stops=st.lists(st.integers(0, 31), max_size=3))
def test_a_per_draw_field_sees_every_draw_of_samples_and_beams(prompt, n, beam_width, seed,
                                                               stops):
    """A per-draw field reaches every output: each sample's count of draws less likely than 1
    in 10 under the model, and each finished beam's (its last token too), counted from the
    tokens' log-probabilities computed contiguously."""
    engine = Engine(MODEL, block_size=2, num_blocks=96)
    sampled = SamplingParams(max_tokens=6, n=n, seed=seed, temperature=1.5, stop_token_ids=stops)
    beams = SamplingParams(max_tokens=5, beam_width=beam_width, stop_token_ids=stops)
    with unlikely_draws():
        outs = engine.generate([prompt, prompt], [sampled, beams])
    for out in outs:
        assert out.outputs
        for c in out.outputs:
            logprobs = logprobs_under_model(MODEL, prompt, c.token_ids)
            # a draw within float error of the threshold counts either way
            assume(all(abs(lp - UNLIKELY) > 1e-6 for lp in logprobs))
            assert c.extras == {"num_unlikely": sum(lp < UNLIKELY for lp in logprobs)}


@pytest.mark.beam
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("model", [MODEL, LLAMA], ids=["gpt2", "llama"])
def test_parallel_samples_equal_the_same_seeds_run_one_by_one(model, kv_cache_dtype,
                                                              no_writes_into_shared_blocks):
    prompt = list(range(1, 11))  # 2.5 blocks: two shared full blocks and a partial one to copy
    engine = Engine(model, block_size=4, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    no_writes_into_shared_blocks(engine)
    params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=42)
    request_id = engine.add_request(prompt, params)
    engine.step()  # prefill once, fork, sample
    request = engine.requests[request_id]
    assert len(request.seqs) == 4 and len({tuple(s.block_table[:2]) for s in request.seqs}) == 1
    assert engine.allocator.blocks[request.seqs[0].block_table[0]].ref_count == 4
    s = engine.stats()
    assert s["num_logical_blocks"] == 12 and s["num_blocks"] - s["num_free_blocks"] == 3
    outputs = drain(engine)
    samples = [c.token_ids for c in outputs[request_id].outputs]
    singles = []
    for i in range(4):  # sample i alone: a request of one sample that draws as sample i
        single = Engine(model, block_size=4, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
        only = single.add_request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=42))
        single.requests[only].seqs[0].index = i
        singles += [o.outputs[0].token_ids for o in drain(single).values()]
    assert samples == singles and len(set(map(tuple, samples))) > 1
    assert_all_blocks_free(engine)


@pytest.mark.beam
@settings(max_examples=examples(25), deadline=None)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=8), n=st.integers(1, 4),
       seed=st.integers(0, 2**31), filters=st.sampled_from([(1.0, 0, 1.0), (0.8, 5, 0.9)]),
       stops=st.lists(st.integers(0, 31), max_size=4), spare_blocks=st.sampled_from([0, 64]))
def test_samples_come_back_in_index_order_with_their_tokens_logprob_under_the_model(
        prompt, n, seed, filters, stops, spare_blocks):
    """Every sample's cumulative_logprob is the sum of its tokens' log-probabilities under the
    model (the raw model, as vLLM reports it, not the filtered distribution it drew from), and
    outputs[i] is sample i in every output, however the samples finished (stop tokens end them
    out of order; a pool of just the blocks the request may need or a roomy one)."""
    temperature, top_k, top_p = filters
    params = SamplingParams(max_tokens=6, n=n, seed=seed, temperature=temperature, top_k=top_k,
                            top_p=top_p, stop_token_ids=stops)
    num_blocks = n * nanopaged.cdiv(len(prompt) + 6, 2) + spare_blocks
    engine = Engine(MODEL, block_size=2, num_blocks=num_blocks)
    engine.add_request(prompt, params)
    for outputs in stepped(engine, len(prompt) + 6):
        for out in outputs:  # streamed too: by index, none finished or some
            assert [c.index for c in out.outputs] == list(range(n))
    outputs = out.outputs
    for c in outputs:
        logprobs = [naive_logprobs(MODEL, prompt + c.token_ids[:t])[token].item()
                    for t, token in enumerate(c.token_ids)]
        assert c.cumulative_logprob == pytest.approx(sum(logprobs), rel=1e-6, abs=1e-5)  # float32
    assert_all_blocks_free(engine)


def naive_beam_search(model, prompt, width, max_tokens, stop_token_ids=(), length_penalty=1.0):
    """Beam search as transformers' generate(num_beams=width, early_stopping=True) runs it, as
    plainly as possible: every extension of every beam, sorted; a candidate that ends (a stop
    token, or the last allowed token) finishes only among the step's width best."""
    beams, finished = [([], 0.0)], []  # (generated tokens, cumulative log-probability)
    for step in range(max_tokens):
        candidates = []
        for b, (tokens, score) in enumerate(beams):
            logprobs = naive_logprobs(model, prompt + tokens).tolist()
            candidates += [(score + lp, b, t) for t, lp in enumerate(logprobs)]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        new_beams, last = [], step == max_tokens - 1
        for rank, (score, b, t) in enumerate(candidates):
            tokens = beams[b][0] + [t]
            if t in stop_token_ids or last:
                if rank < width:
                    finished.append((tokens, score, "stop" if t in stop_token_ids else "length"))
            elif len(new_beams) < width:
                new_beams.append((tokens, score))
        beams = new_beams
        if len(finished) >= width or not beams:
            break
    return sorted(finished, key=lambda h: -h[1] / len(h[0]) ** length_penalty)[:width]


@pytest.mark.beam
@pytest.mark.parametrize("width,stop", [(1, ()), (3, ()), (4, (5, 17)), (6, (9,))])
@pytest.mark.parametrize("model", [MODEL, LLAMA], ids=["gpt2", "llama"])
def test_beam_search_equals_naive_beam_search(model, width, stop, no_writes_into_shared_blocks):
    prompt = [3, 14, 15, 9, 2, 6]
    engine = Engine(model, block_size=2, num_blocks=128, preemption_mode="swap")
    no_writes_into_shared_blocks(engine)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, beam_width=width,
                                                   stop_token_ids=list(stop)))[0]
    expected = naive_beam_search(model, prompt, width, 8, stop)
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [(t, r) for t, _, r in expected]
    assert [c.cumulative_logprob for c in out.outputs] == \
        pytest.approx([s for _, s, _ in expected], abs=1e-9)
    if width == 1:  # beam search of width 1 is greedy decoding
        assert out.outputs[0].token_ids == naive_greedy(model, prompt, 8)
    assert_all_blocks_free(engine)


@pytest.mark.beam
@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=8), width=st.integers(1, 4),
       max_tokens=st.integers(3, 10), length_penalty=st.sampled_from([0.0, 1.0, 2.0]),
       met_at=st.tuples(st.integers(0, 3), st.integers(0, 9)),
       family=st.sampled_from(["gpt2", "llama"]))
def test_beam_search_equals_transformers_beam_search(hf_folder, prompt, width, max_tokens,
                                                     length_penalty, met_at, family):
    """transformers is the oracle: generate(num_beams=w, num_return_sequences=w,
    early_stopping=True, length_penalty=...), with an end token the beams meet (a token of one of
    its own beams)."""
    path, hf = hf_folder(family)
    hf64, model = _double(hf), _from_pretrained64(str(path))

    def hf_beams(eos):
        out = hf64.generate(torch.tensor([prompt]),
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            num_beams=width, num_return_sequences=width, do_sample=False,
                            early_stopping=True, length_penalty=length_penalty,
                            max_new_tokens=max_tokens, eos_token_id=eos,
                            pad_token_id=eos if eos is not None else 0)
        beams = [row[len(prompt):].tolist() for row in out]
        return [b[:b.index(eos) + 1] if eos in b else b for b in beams]

    free = hf_beams(None)
    beam = free[met_at[0] % len(free)]
    eos = beam[met_at[1] % len(beam)]
    params = SamplingParams(max_tokens=max_tokens, beam_width=width, stop_token_ids=[eos],
                            length_penalty=length_penalty)
    out = Engine(model, block_size=2, num_blocks=256).generate([prompt], params)[0]
    assert [c.token_ids for c in out.outputs] == hf_beams(eos)
    # and so the tests' plain reference, which the fixed cases above compare with, agrees with it
    expected = naive_beam_search(model, prompt, width, max_tokens, [eos], length_penalty)
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [(t, r) for t, _, r in expected]
    assert [c.cumulative_logprob for c in out.outputs] == \
        pytest.approx([s for _, s, _ in expected], abs=1e-9)


@pytest.mark.beam
@pytest.mark.parametrize("width", [1, 2, 3])
def test_beam_search_breaks_ties_by_earlier_beam_then_smaller_token(width):
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # every logit 0: every candidate of every step ties
    out = Engine(model, block_size=4, num_blocks=32).generate(
        [[1, 2]], SamplingParams(max_tokens=3, beam_width=width))
    # each step keeps beam 0's extensions by tokens 0, 1, ...; the last step's width best finish
    assert [c.token_ids for c in out[0].outputs] == [[0, 0, t] for t in range(width)]


@pytest.mark.beam
def test_beam_search_ends_when_every_candidate_is_a_stop_token():
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=5, beam_width=2, stop_token_ids=list(range(32)))
    out = engine.generate([[1, 2, 3]], params)
    assert [len(c.token_ids) for c in out[0].outputs] == [1, 1]
    assert all(c.finish_reason == "stop" for c in out[0].outputs)
    assert_all_blocks_free(engine)


@pytest.mark.beam
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_and_parallel_samples_survive_preemption(mode, kv_cache_dtype):
    prompts = [[(5 * i + j) % 32 for j in range(6 + i)] for i in range(4)]
    params = [SamplingParams(max_tokens=10, beam_width=3),
              SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7),
              SamplingParams(max_tokens=10, temperature=0),
              SamplingParams(max_tokens=10, beam_width=2)]
    ample = Engine(MODEL, block_size=2, num_blocks=256,
                   kv_cache_dtype=kv_cache_dtype).generate(prompts, params)
    engine = Engine(MODEL, block_size=2, num_blocks=27, preemption_mode=mode,
                    max_num_batched_tokens=8, kv_cache_dtype=kv_cache_dtype)
    tight = engine.generate(prompts, params)
    assert engine.stats()["num_preemptions"] > 0
    assert [[c.token_ids for c in o.outputs] for o in tight] == \
        [[c.token_ids for c in o.outputs] for o in ample]
    assert_all_blocks_free(engine)


@pytest.mark.beam
def test_stop_tokens_and_eos():
    prompt = [3, 1, 4, 1, 5]
    free_run = naive_greedy(MODEL, prompt, 12)
    stop = free_run[4]
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                   stop_token_ids=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run[:free_run.index(stop) + 1]
    MODEL.config.eos_token_id = stop
    try:
        eos = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
        ignored = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                           ignore_eos=True))[0].outputs[0]
    finally:
        MODEL.config.eos_token_id = None
    assert eos.token_ids == out.token_ids and eos.finish_reason == "stop"
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


@pytest.mark.beam
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=6), max_tokens=st.integers(1, 10),
       stops=st.lists(st.integers(0, 31), max_size=6),
       eos=st.one_of(st.none(), st.integers(0, 31), st.lists(st.integers(0, 31), max_size=4)),
       ignore_eos=st.booleans(), kind=st.sampled_from(["greedy", "n=2", "beam=2"]),
       seed=st.integers(0, 99))
@example(prompt=[1], max_tokens=3, stops=[5], eos=list(range(32)), ignore_eos=False,
         kind="n=2", seed=0)  # every token an end-of-text one: each sample ends on its first
def test_stop_tokens_always_stop_and_max_tokens_is_exact(
        prompt, max_tokens, stops, eos, ignore_eos, kind, seed):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if kind == "greedy" else 1,
                            seed=seed, n=2 if kind == "n=2" else 1,
                            beam_width=2 if kind == "beam=2" else None,
                            stop_token_ids=stops, ignore_eos=ignore_eos)
    eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)  # as HF
    ends = set(stops) | (set() if ignore_eos else eos_ids)
    MODEL.config.eos_token_id = eos
    try:
        out = Engine(MODEL, block_size=4, num_blocks=32).generate([prompt], params)[0]
    finally:
        MODEL.config.eos_token_id = None
    assert len(out.outputs) == params.num_seqs or (kind == "beam=2" and out.outputs)
    for c in out.outputs:
        assert 1 <= len(c.token_ids) <= max_tokens and not ends & set(c.token_ids[:-1])
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in ends
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == max_tokens
            assert c.token_ids[-1] not in ends
        # a sample's stop_reason, as vLLM's: the id of the stop_token_ids token that ended it,
        # None for an end-of-text token or the length (a token that is both is left out: vLLM
        # checks the end-of-text id first)
        last = c.token_ids[-1]
        if kind != "beam=2" and not (last in stops and last in eos_ids and not ignore_eos):
            assert c.stop_reason == (last if c.finish_reason == "stop" and last in stops
                                     else None)


@pytest.mark.beam
@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 31), min_size=1, max_size=6),
                                   st.integers(1, 6), st.sampled_from([None, 1, 2, 3])),
                         min_size=1, max_size=3),
       spare=st.integers(0, 6), mode=st.sampled_from(["recompute", "swap"]))
@example(requests=[([1, 2, 3], 3, 2)], spare=0, mode="recompute")
def test_every_token_a_beam_search_generates_is_counted_once(requests, spare, mode):
    """vLLM's generation_tokens_total counts every token generated: with no token that ends a
    beam early, each of a search's beam_width beams gains one token a step for max_tokens steps,
    the last step's tokens ending its hypotheses, so num_generated_tokens is beam_width x
    max_tokens for each search, beside its batch-mates' tokens (greedy, width None), however
    often a tight pool preempts them."""
    params = [SamplingParams(max_tokens=m, temperature=0, beam_width=w, ignore_eos=True)
              for _, m, w in requests]
    worst = max(p.num_seqs * -(-(len(r[0]) + p.max_tokens) // 2) for r, p in zip(requests, params))
    engine = Engine(MODEL, block_size=2, num_blocks=worst + spare, preemption_mode=mode,
                    max_num_batched_tokens=8, max_num_seqs=4)
    outs = engine.generate([r[0] for r in requests], params)
    assert engine.stats()["num_generated_tokens"] == sum(
        p.beam_width * p.max_tokens if p.beam_width else len(o.outputs[0].token_ids)
        for p, o in zip(params, outs))
    assert_all_blocks_free(engine)


@pytest.mark.beam
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=6), width=st.integers(2, 4),
       length_penalty=st.sampled_from([1.0, 0.5, 2.0]), max_tokens=st.integers(2, 6))
def test_streamed_beams_come_best_first_by_the_final_ranking(prompt, width, length_penalty,
                                                            max_tokens):
    """Every streamed output of a beam search lists its live beams best first by the score the
    final output ranks by (cumulative log-probability / length ** length_penalty)."""
    engine = Engine(MODEL, block_size=2, num_blocks=128)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, beam_width=width,
                                              length_penalty=length_penalty))
    streamed = [o for _ in range(50) if engine.requests for o in engine.step()]
    for out in streamed:
        scores = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in out.outputs]
        assert scores == sorted(scores, reverse=True)
    assert streamed[-1].finished and len(streamed) >= 2


# -----------------------------------------------------------------------------
# 11. The engine: against naive generation, streaming, its parts, abort, failures inside a
# step, and a random walk through its API  (-m engine)


@pytest.mark.engine
@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_mixes(), st.sampled_from(["gpt2", "llama"]))
def test_greedy_paged_generation_equals_naive_generation(mix, name):
    prompts, max_tokens, priorities, engine_args = mix
    model = MODELS[name]
    engine = Engine(model, **engine_args)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    outputs = engine.generate(prompts, params, priority=priorities)
    for prompt, m, out in zip(prompts, max_tokens, outputs):
        assert out.outputs[0].token_ids == naive_greedy(model, prompt, m)
        assert out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(engine)


@pytest.mark.engine
def test_streaming_with_add_request_and_step():
    engine = Engine(MODEL, block_size=2, num_blocks=64)
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    engine.step()
    # joins mid-flight
    second = engine.add_request([9, 9], SamplingParams(max_tokens=3, temperature=0))
    finished = drain(engine)
    assert finished[first].outputs[0].token_ids == naive_greedy(MODEL, [1, 2, 3], 8)
    assert finished[second].outputs[0].token_ids == naive_greedy(MODEL, [9, 9], 3)
    assert finished[second].latency < finished[first].latency
    engine.add_request([4, 4], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="generate\\(\\) needs an idle engine, but 1 requests"):
        engine.generate([[1]], SamplingParams(max_tokens=2))


@pytest.mark.engine
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 31), min_size=1, max_size=8),
                                   st.integers(1, 6), st.sampled_from(["greedy", "n=2", "beam=2"])),
                         min_size=1, max_size=5),
       mode=st.sampled_from(["recompute", "swap"]))
def test_step_streams_every_request_that_gained_tokens(requests, mode):
    """step() returns one RequestOutput per request that gained tokens in it: a sample's tokens
    only grow, a request is finished exactly once and last, and the finished outputs equal
    generate()'s (in a pool tight enough to preempt)."""
    params = [SamplingParams(max_tokens=m, temperature=0 if kind != "n=2" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1,
                             beam_width=2 if kind == "beam=2" else None,
                             logprobs=1 if kind == "n=2" else None)
              for i, (_, m, kind) in enumerate(requests)]
    settings_ = dict(block_size=2, num_blocks=24, preemption_mode=mode, max_num_batched_tokens=8)
    expected = Engine(MODEL, **settings_).generate([p for p, _, _ in requests], params)
    engine = Engine(MODEL, **settings_)
    ids = [engine.add_request(p, sp) for (p, _, _), sp in zip(requests, params)]
    last, finished = {}, {}
    for _ in range(500):  # bounded: see drain
        if not engine.requests:
            break
        longest = {rid: max(map(len, g.seqs)) for rid, g in engine.requests.items()}
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs)
        for o in outs:
            assert o.request_id not in finished, "an output after the request finished"
            total = sum(len(c.token_ids) for c in o.outputs)
            if o.request_id in last and params[o.request_id].beam_width is None:
                before = last[o.request_id]
                assert total > sum(len(c.token_ids) for c in before.outputs), "gained nothing"
                for c, b in zip(o.outputs, before.outputs):  # samples only grow
                    assert c.index == b.index and c.token_ids[:len(b.token_ids)] == b.token_ids
            reasons = {c.finish_reason for c in o.outputs}  # a sample may stop before the others
            assert reasons <= {"stop", "length"} if o.finished else None in reasons
            last[o.request_id] = o
            if o.finished:
                finished[o.request_id] = o
        gained = {rid for rid in longest if rid not in engine.requests
                  or max(map(len, engine.requests[rid].seqs)) > longest[rid]}
        assert {o.request_id for o in outs} == gained
    assert [finished[i].outputs for i in ids] == [o.outputs for o in expected]


@pytest.mark.engine
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 31), min_size=1, max_size=8),
                                   st.integers(1, 6), st.sampled_from(["greedy", "n=2", "beam=2"]),
                                   st.lists(st.text("abcdefgh", min_size=1, max_size=3),
                                            max_size=2)),
                         min_size=1, max_size=5),
       mode=st.sampled_from(["recompute", "swap"]), speculate=st.booleans())
def test_delta_outputs_add_up_to_the_cumulative_ones(requests, mode, speculate):
    """The same requests in three engines stepped side by side, each asking for another
    output_kind (vLLM's RequestOutputKind). At every step, a "delta" request's outputs so far,
    joined per sample, are the "cumulative" one's: tokens, logprobs and text (held back before a
    possible stop string); a delta holds just the samples that gained tokens, and the prompt's
    logprobs come with the first. A "final_only" request has one output, at its end, equal to
    the cumulative one's. Beams, which cannot stream deltas, ask for final_only in the delta
    engine, beside the others; in a pool tight enough to preempt, speculating (no beams then)
    or not."""
    def params(i, kind, stop, output_kind):
        beam = kind == "beam=2" and not speculate
        return SamplingParams(
            max_tokens=requests[i][1], temperature=0 if kind != "n=2" else 1.0, seed=i,
            n=2 if kind == "n=2" else 1, beam_width=2 if beam else None,
            stop=None if beam else stop, logprobs=None if beam else 1, prompt_logprobs=1,
            output_kind="final_only" if beam and output_kind == "delta" else output_kind)
    kinds = ["cumulative", "delta", "final_only"]
    engines = [Engine(MODEL, block_size=2, num_blocks=24, preemption_mode=mode,
                      max_num_batched_tokens=8, tokenizer=UserTokenizer(),
                      speculative_config=speculative_config("ngram", 2, MODEL) if speculate
                      else None) for _ in kinds]
    for engine, output_kind in zip(engines, kinds):
        for i, (prompt, _, kind, stop) in enumerate(requests):
            engine.add_request(prompt, params(i, kind, stop, output_kind))
    joined, seen, finals = {}, set(), {}  # (request, sample) -> [tokens, logprobs, text]
    for _ in range(500):  # bounded: see drain
        if not engines[0].requests:
            break
        cumulative, delta, final = ({o.request_id: o for o in e.step()} for e in engines)
        assert set(engines[0].requests) == set(engines[1].requests) == set(engines[2].requests)
        for rid, o in final.items():
            assert o.finished and rid not in finals
            finals[rid] = o
        for rid, c in cumulative.items():
            if requests[rid][2] == "beam=2" and not speculate:
                assert rid not in delta or delta[rid].outputs == c.outputs and c.finished
                continue
            d, before = delta[rid], {k: list(v[0]) for k, v in joined.items() if k[0] == rid}
            assert (d.prompt_logprobs is not None) == (rid not in seen)
            assert d.prompt_logprobs in (None, c.prompt_logprobs)
            seen.add(rid)
            for s in d.outputs:
                j = joined.setdefault((rid, s.index), [[], [], ""])
                j[0] += s.token_ids
                j[1] += s.logprobs
                j[2] += s.text
            for s in c.outputs:  # every sample, joined, as it stands
                assert joined[rid, s.index] == [s.token_ids, s.logprobs, s.text]
            gained = {s.index for s in c.outputs if s.token_ids != before.get((rid, s.index))}
            assert [s.index for s in d.outputs] == sorted(gained)
            by_index = {s.index: s for s in c.outputs}
            for s in d.outputs:
                assert (s.finish_reason, s.stop_reason) == (by_index[s.index].finish_reason,
                                                            by_index[s.index].stop_reason)
            assert d.finished == c.finished
            if c.finished:
                assert finals[rid].outputs == c.outputs
                assert finals[rid].prompt_logprobs == c.prompt_logprobs
    assert not any(e.requests for e in engines) and len(finals) == len(requests)


@pytest.mark.engine
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=8),
                                   st.integers(1, 6),
                                   st.sampled_from(["greedy", "seeded", "n=2", "beam=2"])),
                         min_size=1, max_size=5),
       block_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 4),
       mode=st.sampled_from(["recompute", "swap"]), speculate=st.booleans(),
       abort_at=st.sets(st.integers(0, 20), max_size=1))
def test_every_output_step_returned_keeps_what_it_said(requests, block_size, spare, mode,
                                                       speculate, abort_at):
    """Every RequestOutput step() returns is a snapshot: after each later step, and after its
    request finishes (or another is aborted), it equals a deep copy taken when it was returned.
    An output that shared a list with its live sequence (its tokens, logprobs or prompt logprobs)
    or its metrics would change under the caller. Over samples, beams, logprobs, prompt
    logprobs, stop strings and text through a tokenizer, speculation, and preemption in a pool
    too tight for all (prefills in chunks)."""
    def kind_of(kind):
        return "n=2" if kind == "beam=2" and speculate else kind
    params = [SamplingParams(max_tokens=m, temperature=0 if kind_of(k) == "greedy" else 1.0,
                             seed=i, n=2 if kind_of(k) == "n=2" else 1,
                             beam_width=2 if kind_of(k) == "beam=2" else None,
                             logprobs=None if kind_of(k) == "beam=2" else 2,
                             prompt_logprobs=1, stop=None if kind_of(k) == "beam=2" else ["ba"])
              for i, (_, m, k) in enumerate(requests)]
    engine = tight_engine(requests, params, block_size, spare, mode, speculate)
    for (prompt, _, _), p in zip(requests, params):
        engine.add_request(prompt, p)
    returned = []  # (an output step() returned, its deep copy then)
    for i in range(300):  # bounded: see drain
        if not engine.requests:
            break
        if i in abort_at and len(engine.requests) > 1:  # one is left to finish
            engine.abort(sorted(engine.requests)[-1])
        returned += [(out, copy.deepcopy(out)) for out in engine.step()]
        for out, then in returned:
            assert out == then, f"request {out.request_id}: an output changed after it was returned"
    assert not engine.requests and returned
    assert_all_blocks_free(engine)


@pytest.mark.engine
def test_an_engine_takes_its_parts_by_class():
    """Your copy subclasses a part and passes the class: here bench.py's allocator that reserves
    max_seq_len at admission (its contiguous mode) and a scheduler that counts its steps.
    Every part sees the same allocator: none keeps a reference to another one."""
    from bench import ReservingAllocator

    class CountingScheduler(nanopaged.Scheduler):
        num_steps = 0

        def schedule(self):
            self.num_steps += 1
            return super().schedule()

    engine = Engine(MODEL, block_size=4, num_blocks=48, scheduler_cls=CountingScheduler,
                    allocator_cls=functools.partial(ReservingAllocator, max_seq_len=64))
    assert engine.allocator is engine.scheduler.allocator is engine.output_processor.allocator
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == [naive_greedy(MODEL, p, 5) for p in prompts]
    # 3 at a time
    assert engine.stats()["num_preemptions"] == 0 and engine.scheduler.num_steps >= 10
    assert_all_blocks_free(engine)


@pytest.mark.engine
def test_the_recipes_run_as_written():
    recipes_md = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RECIPES.md")
    recipes = re.findall(r"```python\n(.*?)```", open(recipes_md).read(), re.S)
    assert len(recipes) == 6
    registries = (SCHEDULING_POLICIES, EVICTION_POLICIES, kernel.ATTENTION_BACKENDS,
                  nanopaged.ATTENTION_KINDS, nanopaged.READ_POLICIES, connectors.CONNECTORS)
    saved = [dict(r) for r in registries]
    steps = list(nanopaged.LOGITS_STEPS), list(nanopaged.SAMPLING_STEPS)
    try:
        for code in recipes:
            exec(compile(code, "RECIPES.md", "exec"), {"__name__": "recipe"})
        # each recipe registered what it shows, in the one place it names, and nothing else
        assert "deepest_first" in EVICTION_POLICIES and "sdpa" in kernel.ATTENTION_BACKENDS
        assert nanopaged.ATTENTION_KINDS["sink_attention"] is not AttentionSinks  # the recipe's
        policies = nanopaged.READ_POLICIES
        assert set(policies) == set(saved[4]) | {"sink_and_recent"}
        assert policies["sink_and_recent"]().needs_key_bounds is False
        assert set(connectors.CONNECTORS) == set(saved[5]) | {"dict"}
        assert dict(SCHEDULING_POLICIES) == saved[0] and nanopaged.LOGITS_STEPS == steps[0]
        assert nanopaged.SAMPLING_STEPS[:-1] == steps[1]
        assert nanopaged.SAMPLING_STEPS[-1].__name__ == "apply_epsilon_cutoff"
    finally:
        for registry, entries in zip(registries, saved):
            registry.clear()
            registry.update(entries)
        nanopaged.LOGITS_STEPS[:] = steps[0]
        nanopaged.SAMPLING_STEPS[:] = steps[1]


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_anywhere_returns_every_block(mode):
    engine = Engine(MODEL, block_size=2, num_blocks=24, preemption_mode=mode,
                    max_num_batched_tokens=6)
    long_prompt = list(range(20))
    ids = [engine.add_request(long_prompt, SamplingParams(max_tokens=20, temperature=0))
           for _ in range(3)]
    ids.append(engine.add_request([5, 6], SamplingParams(max_tokens=10, n=3, temperature=1.0)))
    engine.step()  # the first prompt is mid-prefill (6 of 20 tokens), the rest wait
    assert engine.requests[ids[0]].seqs[0].num_computed_tokens == 6
    engine.abort(ids[0])
    engine.abort(ids[2])  # waiting
    for _ in range(200):  # run until a request is swapped out (swap) or preempted back to waiting
        engine.step()
        if engine.scheduler.swapped or engine.scheduler.num_preemptions:
            break
    assert engine.scheduler.num_preemptions
    victim = (engine.scheduler.swapped or engine.scheduler.waiting)[0].request_id
    engine.abort(victim)
    with pytest.raises(ValueError, match=f"no unfinished request with id {victim}"):
        engine.abort(victim)
    drain(engine)
    assert serves_normally(engine)


@pytest.mark.engine
def test_a_model_error_inside_a_step_loses_nothing(monkeypatch):
    engine = Engine(MODEL, block_size=2, num_blocks=20, max_num_batched_tokens=8)
    prompts = [list(range(i, i + 7)) for i in range(4)]
    real_forward, calls = GPT.forward, []

    def flaky_forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) in (3, 4, 9):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", flaky_forward)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    s = engine.stats()
    assert s["num_running"] + s["num_waiting"] == 4 and s["num_free_blocks"] < s["num_blocks"]
    outputs = {}
    for _ in range(1000):  # bounded: see drain
        if not engine.scheduler.has_unfinished():
            break
        try:
            outputs.update({o.request_id: o for o in engine.step()})
        except RuntimeError:
            pass
    assert [outputs[i].outputs[0].token_ids for i in range(4)] == \
        [naive_greedy(MODEL, p, 10) for p in prompts]
    assert_all_blocks_free(engine)


def floats_apart(x, floats):
    """x with each float replaced by None, the floats appended to floats in order."""
    if isinstance(x, float):
        return floats.append(x)
    if isinstance(x, dict):
        return {k: floats_apart(v, floats) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(floats_apart(v, floats) for v in x)
    return x


def assert_same_but_rounding(got, expected):
    """Equal, but log-probabilities only within 1e-9: a row's matmul in another batch may round
    differently (tokens, stops and which tokens the logprobs name must be equal)."""
    got_floats, expected_floats = [], []
    assert floats_apart(got, got_floats) == floats_apart(expected, expected_floats)
    assert got_floats == pytest.approx(expected_floats, abs=1e-9, rel=0)


def engine_state(engine):
    """Everything a step may change."""
    return state_of(engine)


# What Engine.stats() says of where blocks and requests are: a failed step's undo may change it
# (it preempts the requests whose blocks the step wrote over), and nothing else in stats()
WHERE_THINGS_ARE = {"num_free_blocks", "num_cached_blocks", "num_free_cpu_blocks",
                    "num_cpu_cached_blocks", "num_running", "num_waiting", "num_swapped",
                    "num_preemptions", "kv_utilization", "num_logical_blocks",
                    "num_staged_blocks"}


def counts_of(engine):
    """Engine.stats() but where things are: what the steps that stood counted (copies to and from
    the CPU tier, hits, tokens), which a failed step leaves as it found them."""
    return {k: v for k, v in engine.stats().items() if k not in WHERE_THINGS_ARE}


@pytest.mark.engine
def test_a_failing_request_does_not_strand_its_batch_mates(monkeypatch):
    """A failure after the forward (here a stop check that raises for one request) leaves the
    batch-mates' num_computed_tokens where they were: advanced, they would never be scheduled
    again."""
    engine = Engine(MODEL, block_size=4, num_blocks=24)
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0))
    bad = engine.add_request([4, 5], SamplingParams(max_tokens=6, temperature=0))
    real_stop_check = nanopaged.OutputProcessor.stop_check

    def stop_check(self, seq, params, tokens, eos):
        if seq.request_id == bad:
            raise TypeError("a stop rule that fails (simulated)")
        return real_stop_check(self, seq, params, tokens, eos)

    monkeypatch.setattr(nanopaged.OutputProcessor, "stop_check", stop_check)
    before = engine_state(engine)
    with pytest.raises(TypeError, match="simulated"):
        engine.step()
    assert engine_state(engine) == before
    engine.abort(bad)
    outputs = [o for _ in range(20) if engine.requests for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outputs] == [naive_greedy(MODEL, [1, 2, 3], 6)]
    assert outputs[0].request_id == good and assert_all_blocks_free(engine) is None


class UserProcessor:  # a logits processor that changes nothing: user code a failure can be in
    def __call__(self, prompt, output, logits):
        return logits


class UserTokenizer:  # a tokenizer of its own: one letter a token
    def decode(self, ids):
        return "".join("abcdefgh"[t % 8] for t in ids)


class UserObserver:  # an observer that listens and does nothing
    def __call__(self, event):
        pass


# Where a step can fail: (owner, function name), in its plan (the scheduler and the allocator)
# or its run (the block copies, the model, sampling, stops; the user's logits processor,
# tokenizer and observer). The failure is raised before or after the call. The commit calls
# none of these but the observer, which cannot stop it: its error waits for the next step.
FAILURE_POINTS = [(nanopaged.Scheduler, "schedule"), (BlockAllocator, "allocate"),
                  (BlockAllocator, "allocate_slots"), (nanopaged.SwapPool, "swap_out"),
                  (nanopaged.SwapPool, "swap_in"), (BlockAllocator, "cache_full_blocks"),
                  (nanopaged.PrefixCache, "publish"), (nanopaged.PrefixCache, "evict"),
                  (nanopaged.Scheduler, "_admit"), (nanopaged.Scheduler, "_preempt"),
                  (nanopaged.Scheduler, "_recompute"),
                  (nanopaged.ModelRunner, "copy_blocks"), (nanopaged.ModelRunner, "prepare"),
                  (GPT, "forward"), (nanopaged, "sample"),
                  (nanopaged.OutputProcessor, "stop_check"),
                  (nanopaged.OutputProcessor, "prompt_logprob_entries"),
                  (nanopaged, "beam_search_step"), (UserProcessor, "__call__"),
                  (UserTokenizer, "decode"), (UserObserver, "__call__"),
                  (nanopaged.SwapPool, "offload"), (nanopaged.SwapPool, "reload")]


@pytest.mark.engine
@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=kinds_of_requests(vocab_size=32),
       point=st.sampled_from(FAILURE_POINTS), call=st.integers(1, 12), after=st.booleans(),
       block_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 6),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       tier=st.sampled_from([0, 0, 3, 12]), scheduling=st.sampled_from(SCHEDULING),
       eviction=st.sampled_from(EVICTION))
# a step that fails before it plans anything, after one whose plan offloaded to the CPU tier
# (found at --hypothesis-seed=3: the allocator kept the last plan's copies until the next began)
@example(requests=[([0] * 7, 1, "greedy")] * 2, point=(nanopaged.Scheduler, "schedule"), call=4,
         after=False, block_size=1, spare=0, mode="recompute", caching=True, tier=3,
         scheduling="fcfs", eviction="lfu")
# a step that fails just after its plan's first offload to the CPU tier: the copy is undone, and
# so is its count
@example(requests=[([0] * 7, 1, "greedy")] * 2, point=(nanopaged.SwapPool, "offload"), call=1,
         after=True, block_size=1, spare=0, mode="recompute", caching=True, tier=3,
         scheduling="fcfs", eviction="lfu")
def test_a_failure_anywhere_in_a_step_changes_nothing(requests, point, call, after, block_size,
                                                      spare, mode, caching, tier, scheduling,
                                                      eviction):
    """Raise once, at a random call of a random function inside a step's plan or run, the user's
    code included: the step leaves every request, queue and block, in both tiers, as it found
    them (but for K/V the failed step may have overwritten: blocks it handed out leave the
    prefix cache, and a request that held one is recomputed); the next steps serve every
    request to the same output as a run without the failure."""
    params = [SamplingParams(max_tokens=m, temperature=0 if kind == "greedy" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1,
                             beam_width=2 if kind == "beam=2" else None,
                             stop_token_ids=[7], logprobs=2 if kind == "seeded" else None,
                             prompt_logprobs=1 if kind in ("greedy", "n=2") else None,
                             stop=["ba"] if kind == "seeded" else None,
                             logits_processors=None if kind == "beam=2" else [UserProcessor()])
              for i, (_, m, kind) in enumerate(requests)]
    worst = max(p.num_seqs * -(-(len(r[0]) + p.max_tokens) // block_size)
                for r, p in zip(requests, params))

    def run(engine, inject):
        ids = [engine.add_request(r[0], p, priority=i % 3)
               for i, (r, p) in enumerate(zip(requests, params))]
        engine.set_observer(UserObserver())
        outputs, failures = {}, 0
        for _ in range(300):  # a bound, so a stalled engine fails instead of hanging
            if not engine.requests and engine.observer_error is None:  # (the next step raises it)
                break
            before, counts = engine_state(engine), counts_of(engine)
            held_or_cached.clear()
            for pool in (engine.allocator, engine.allocator.swap_pool):
                held_or_cached.update((pool, b.block_id) for b in pool.blocks
                                      if b.ref_count or b.hash is not None)
            try:
                outputs.update({o.request_id: o for o in engine.step()})
            except RuntimeError as e:
                assert "injected" in str(e) and inject and not failures
                assert counts_of(engine) == counts  # whatever it wrote over
                failures += 1
                if not taken:  # it overwrote no block that was held or cached: exactly as before
                    assert engine_state(engine) == before
                    exact.append(1)
        assert not engine.requests and (failures == 1 or not inject or not fired)
        assert_all_blocks_free(engine)
        return [(outputs[i].prompt_logprobs,
                 [(c.token_ids, c.finish_reason, c.logprobs) for c in outputs[i].outputs])
                for i in ids]

    settings_ = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                     enable_prefix_caching=caching, max_num_batched_tokens=6, max_num_seqs=4,
                     scheduling_policy=scheduling, eviction_policy=eviction,
                     tokenizer=UserTokenizer(), cpu_cache_bytes=tier * 4096 if caching else 0)
    held_or_cached = set()  # before each step: (pool, block) held or cached
    expected = run(Engine(MODEL, **settings_), inject=False)
    owner, name = point
    real, calls, fired, taken, exact = getattr(owner, name), [0], [], set(), []
    real_rollback = nanopaged.Journal.rollback

    def failing(*args, **kwargs):
        calls[0] += 1
        hit = calls[0] == call and not fired
        if hit and not after:
            fired.append(1)
            raise RuntimeError("injected failure")
        result = real(*args, **kwargs)
        if hit:
            fired.append(1)
            raise RuntimeError("injected failure")
        return result

    def rollback(self):  # what the failed step handed out, and which block held or cached then
        taken.clear()
        taken.update({(pool, b) for pool in self.pools for b in pool.taken} & held_or_cached)
        return real_rollback(self)

    def engine_rollback(self):  # no queued request keeps a block the failed step handed out
        real_engine_rollback(self)
        s = self.scheduler
        for queue, written in zip((s.running, s.swapped), rolled_back_taken):
            held = {b for g in queue for q in g.seqs for b in q.block_table}
            assert not held & written, "a request kept a block written over"

    rolled_back_taken = [set(), set()]  # the device's, the CPU pool's

    def journal_rollback(self):
        rolled_back_taken[:] = rollback(self)
        return rolled_back_taken

    real_engine_rollback = Engine.rollback
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, failing)
        mp.setattr(nanopaged.Journal, "rollback", journal_rollback)
        mp.setattr(Engine, "rollback", engine_rollback)
        assert_same_but_rounding(run(Engine(MODEL, **settings_), inject=True), expected)
    event(f"failed: {bool(fired)}, exactly as before: {bool(exact)}")


# What a step's plan can do beside computing: give a cached block up to the CPU tier, copy a
# shared block on write, swap a request out or in, publish a block it fills
PLAN_EVENTS = {"offload", "cow", "swap_out", "swap_in", "publish"}


@pytest.mark.engine
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(warm=st.lists(st.lists(st.integers(0, 15), min_size=2, max_size=6), min_size=2,
                     max_size=4),
       prompts=st.lists(st.lists(st.integers(16, 31), min_size=1, max_size=5), min_size=2,
                        max_size=3),
       block_size=st.sampled_from([2, 3]), spare=st.integers(0, 2), tier=st.integers(2, 6),
       pick=st.integers(0, 2**16), after=st.booleans())
def test_a_failure_at_any_point_of_a_step_that_offloads_copies_swaps_and_publishes_counts_nothing(
        warm, prompts, block_size, spare, tier, pick, after):
    """Prompts served one at a time leave the device's pool full of cached blocks; then requests
    of two sampled samples each grow together past a tight pool: a step's plan evicts cached
    blocks into the CPU tier, copies shared blocks on write, swaps requests out or in and
    publishes the blocks it fills. Of a run without failures, the step whose plan did the most
    of these is chosen, and a failure is raised before or after one of the calls that step made
    (drawn from all of them, at every point a step can fail). The failed step leaves every
    count as it found them (the tier's copies, hits, tokens), and the run's outputs are those
    of the run without the failure."""
    points = [p for p in FAILURE_POINTS if p[0] is not UserObserver]  # its error waits a step
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, n=2,
                             logits_processors=[UserProcessor()]) for i in range(len(prompts))]
    worst = max(2 * -(-(len(p) + 4) // block_size) for p in prompts)
    per_block = bytes_per_block(Engine(MODEL, block_size=block_size, num_blocks=1))
    settings_ = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode="swap",
                     max_num_batched_tokens=8, max_num_seqs=6, tokenizer=UserTokenizer(),
                     cpu_cache_bytes=tier * per_block)

    def run(fail_at=None):
        """The warm-up, then the requests together; a call to a point is (point, its call number
        in the run). Returns the outputs, and the log of the steps of the second part: (step,
        call) for each call, (step, event name) for each event of paging, in order."""
        engine, log, calls, step = Engine(MODEL, **settings_), [], Counter(), [None]

        def wrapped(i, real):
            def call(*args, **kwargs):
                calls[i] += 1
                log.append((step[0], (i, calls[i])))
                if fail_at == (i, calls[i], False):
                    raise RuntimeError("injected")
                result = real(*args, **kwargs)
                if fail_at == (i, calls[i], True):
                    raise RuntimeError("injected")
                return result
            return call
        with pytest.MonkeyPatch.context() as mp:
            for i, (owner, name) in enumerate(points):
                mp.setattr(owner, name, wrapped(i, getattr(owner, name)))
            for prompt in warm:
                engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
            engine.set_observer(lambda e: log.append((step[0], e["event"])))
            ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
            outputs, failed = {}, []
            for step[0] in range(300):  # bounded: see drain
                if not engine.requests:
                    break
                counts = counts_of(engine)
                try:
                    outputs.update({o.request_id: o for o in engine.step()})
                except RuntimeError as e:
                    assert "injected" in str(e) and fail_at and not failed
                    assert counts_of(engine) == counts
                    failed.append(step[0])
        assert not engine.requests and failed == ([failed[0]] if fail_at else [])
        assert_all_blocks_free(engine)
        return [[c.token_ids for c in outputs[i].outputs] for i in ids], log, failed

    expected, log, _ = run()
    done = {}  # step -> what its plan did
    for step, what in log:
        if what in PLAN_EVENTS:
            done.setdefault(step, set()).add(what.removesuffix("_in").removesuffix("_out"))
    chosen = max(done, key=lambda step: (len(done[step]), -step))
    in_step = [(j, what) for j, (step, what) in enumerate(log) if step == chosen]
    j, (i, n) = [(j, what) for j, what in in_step if isinstance(what, tuple)][pick % sum(
        isinstance(what, tuple) for _, what in in_step)]
    outputs, _, failed = run(fail_at=(i, n, after))
    assert outputs == expected and failed == [chosen]
    offloaded = any(what == "offload" and k < j for k, what in in_step)
    event(f"plan did: {sorted(done[chosen])}")
    event(f"failed after an offload in the same plan: {offloaded}")


@pytest.mark.engine
def test_a_failed_step_recomputes_every_request_whose_blocks_it_handed_out():
    """Two neighbours in the running queue lose blocks to a step that then fails: both must be
    recomputed, or one reads K/V the failed step wrote over (as a loop that removes the first
    from the list it walks would, skipping the second)."""
    engine = Engine(MODEL, block_size=2, num_blocks=6, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [[i + 1] * n for i, n in enumerate([1, 3, 2, 1])]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
    real_forward, real_rollback, calls, taken = GPT.forward, nanopaged.Journal.rollback, [0], set()

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected after the forward wrote K/V")
        return out

    def rollback(self):
        device, cpu = real_rollback(self)
        taken.update(device)
        return device, cpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GPT, "forward", forward)
        mp.setattr(nanopaged.Journal, "rollback", rollback)
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(3):
                engine.step()
    held = {b for g in engine.scheduler.running for q in g.seqs for b in q.block_table}
    assert taken and not held & taken
    outputs = drain(engine)
    assert [outputs[i].outputs[0].token_ids for i in ids] == \
        [naive_greedy(MODEL, p, 6) for p in prompts]


class PlainCounterCache(nanopaged.PrefixCache):
    """A fork's FIFO order kept the wrong way: a plain count of the blocks published, which a
    failed step's undo does not take back (section 2's rule: journal it, or read the blocks'
    own stamps)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_published = 0

    def insert(self, block_id, *args):
        self.num_published += 1
        super().insert(block_id, *args)


@pytest.mark.engine
@pytest.mark.parametrize("fork", ["plain counter", "fifo by the blocks' stamps"])
def test_the_failure_property_sees_the_state_a_fork_adds(fork):
    """What the failure property compares (engine_state) takes in a fork's own state: a plain
    counter the failed step moved shows, so the property fails on it; FIFO as one registry
    entry over the blocks' cached_at stamps is undone with the blocks, and passes."""
    planted = fork == "plain counter"
    engine = Engine(MODEL, block_size=2, num_blocks=16, eviction_policy="fifo",
                    prefix_cache_cls=PlainCounterCache if planted else None)
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0))
    before = engine_state(engine)

    def forward(*args, **kwargs):
        raise RuntimeError("injected")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GPT, "forward", forward)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()  # its plan published the prompt's two full blocks
    assert (engine_state(engine) != before) == planted
    (out,) = drain(engine).values()
    assert out.outputs[0].token_ids == naive_greedy(MODEL, [1, 2, 3, 4, 5], 2)

def held_blocks(queue):
    """The blocks the tables of a queue's requests point at (each once; a window's gaps not)."""
    return {b for request in queue for seq in request.seqs for table in seq.block_tables
            for b in table if b != NO_BLOCK}


# the events of a plan that move blocks between owners or pools
MOVES = {"preempt", "swap_out", "swap_in", "offload", "reload"}


@pytest.mark.engine
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=6),
                                   st.integers(2, 8), st.sampled_from(["greedy", "n=2", "beam=2"])),
                         min_size=2, max_size=4),
       block_size=st.sampled_from([1, 2]), spare=st.integers(0, 2),
       mode=st.sampled_from(["recompute", "swap"]), tier=st.sampled_from([0, 4, 16]),
       fail=st.sets(st.integers(1, 4), min_size=1, max_size=2), after=st.booleans())
# the first decode preempts the second request by recompute, and fails: its table comes back
@example(requests=[([0], 2, "greedy")] * 2, block_size=1, spare=0, mode="recompute", tier=0,
         fail={1}, after=True)
# the second moving step swaps a request in, and the device's evictions go to the tier, into the
# CPU blocks that request just gave up: after the failure it is recomputed, not swapped in
@example(requests=[([2, 4, 1, 7], 7, "greedy"), ([4], 3, "beam=2"),
                   ([1, 4, 6, 5, 4, 6], 2, "greedy")], block_size=2, spare=1, mode="swap",
         tier=16, fail={2}, after=False)
# the same rule where blocks come chunk by chunk (the one above no longer reaches it): a swapped
# request's CPU blocks, given up to the tier by the failed step, take its offloads
@example(requests=[([0], 5, "greedy"), ([0, 0], 4, "greedy"), ([0], 3, "greedy"),
                   ([0, 0, 0, 0], 2, "greedy")], block_size=1, spare=0, mode="swap", tier=4,
         fail={4}, after=True)
def test_a_step_that_fails_after_moving_blocks_leaves_them_counted_and_none_written_held(
        requests, block_size, spare, mode, tier, fail, after):
    """Steps that fail after a plan that preempted, swapped or copied to or from the CPU tier
    (the k-th such step, before or after its forward writes K/V): the undo puts back whole every
    table the plan cut (a request preempted by recompute keeps all its blocks), so after it the
    free blocks of each pool are those no table points at; no running request holds a device
    block, and no swapped request a CPU block, that the failed step handed out (its rollback
    event names them: the forward, or an offload, may have written them); and every request
    ends as it does without the failures."""
    params = [SamplingParams(max_tokens=m, temperature=0 if kind == "greedy" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1,
                             beam_width=2 if kind == "beam=2" else None)
              for i, (_, m, kind) in enumerate(requests)]
    worst = max(p.num_seqs * -(-(len(r[0]) + p.max_tokens) // block_size)
                for r, p in zip(requests, params))
    settings_ = dict(block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                     max_num_batched_tokens=8, max_num_seqs=4)
    cpu_block = bytes_per_block(Engine(MODEL, **settings_))

    def run(inject):
        trace = pagetrace.Trace()
        engine = Engine(MODEL, **settings_, cpu_cache_bytes=tier * cpu_block, observer=trace)
        ids = [engine.add_request(r[0], p) for r, p in zip(requests, params)]
        real_forward, moving_steps, failed = GPT.forward, [0], []

        def forward(self, *args, **kwargs):
            this_step = trace.events[max(i for i, e in enumerate(trace.events)
                                         if e["event"] == "step"):]
            moved = any(e["event"] in MOVES for e in this_step)
            moving_steps[0] += moved
            if inject and moved and moving_steps[0] in fail and not after:
                raise RuntimeError("injected before the forward")
            logits = real_forward(self, *args, **kwargs)
            if inject and moved and moving_steps[0] in fail:
                raise RuntimeError("injected after the forward")
            return logits
        outputs = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(GPT, "forward", forward)
            for _ in range(300):  # bounded: see drain
                if not engine.requests:
                    break
                try:
                    outputs.update({o.request_id: o for o in engine.step() if o.finished})
                except RuntimeError as e:
                    assert "injected" in str(e)
                    failed.append(1)
                    s = engine.stats()
                    rollback = next(event for event in reversed(trace.events)
                                    if event["event"] == "rollback")
                    running, swapped = (held_blocks(engine.scheduler.running),
                                        held_blocks(engine.scheduler.swapped))
                    assert s["num_free_blocks"] == s["num_blocks"] - len(running)
                    assert s["num_free_cpu_blocks"] == s["num_cpu_blocks"] - len(swapped)
                    assert not running & set(rollback["uncached"])
                    assert not swapped & set(rollback["cpu_uncached"])
        assert not engine.requests
        assert_all_blocks_free(engine)
        event(f"failed: {bool(failed)}")
        return [[(c.token_ids, c.finish_reason) for c in outputs[i].outputs] for i in ids]
    assert run(inject=True) == run(inject=False)


# What a step's plan may change of a sequence: its paging state, through the allocator; and of
# a request, at its first admission: the stamps of its time in the queue (vLLM's) and its hits
PAGING_STATE = {"block_tables", "num_computed_tokens", "num_published_blocks"}
ADMISSION_STATE = {"first_scheduled_time", "time_in_queue", "num_cached_tokens"}


@pytest.mark.engine
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=kinds_of_requests(vocab_size=32),
       block_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 6),
       mode=st.sampled_from(["recompute", "swap"]), speculate=st.booleans())
def test_only_a_steps_commit_changes_a_request(requests, block_size, spare, mode, speculate):
    """Over random workloads (samples, beams, logprobs, prompt logprobs, stop strings through a
    tokenizer, logits processors, speculation, preemption in both modes): the run changes no
    request, sequence, queue or block, and the plan changes no request or sequence but the
    sequences' paging state and the first admission's stamps, those of the requests it admits
    for the first time (so a field your copy adds needs no undo), nor any counter."""
    def kind_of(kind):
        return "n=2" if kind == "beam=2" and speculate else kind
    params = [SamplingParams(max_tokens=m, temperature=0 if kind_of(k) == "greedy" else 1.0,
                             seed=i, n=2 if kind_of(k) == "n=2" else 1,
                             beam_width=2 if kind_of(k) == "beam=2" else None,
                             logprobs=2 if kind_of(k) == "seeded" else None,
                             prompt_logprobs=1 if kind_of(k) == "greedy" else None,
                             stop=["ba"] if kind_of(k) == "seeded" else None,
                             logits_processors=None if kind_of(k) == "beam=2" else
                             [UserProcessor()])
              for i, (_, m, k) in enumerate(requests)]
    engine = tight_engine(requests, params, block_size, spare, mode, speculate)
    real_plan, real_run = engine.plan, engine.run
    leave_out = NOT_STATE | PAGING_STATE | ADMISSION_STATE

    def counters():
        s = engine.stats()
        return [s[k] for k in ("num_preemptions", "num_generated_tokens", "num_proposed_tokens",
                               "num_accepted_tokens")]

    def plan():
        before = state_of(engine.requests, skip=leave_out), counters()
        queued = {i for i, r in engine.requests.items() if r.metrics.first_scheduled_time is None}
        out = real_plan()
        assert (state_of(engine.requests, skip=leave_out), counters()) == before
        stamped = {i for i in queued if engine.requests[i].metrics.first_scheduled_time}
        assert stamped == {r.request_id for r in out.admitted} & queued
        return out

    def run(out):
        before = engine_state(engine)
        result = real_run(out)
        assert engine_state(engine) == before
        return result

    engine.plan, engine.run = plan, run
    for prompt, p in zip([r[0] for r in requests], params):
        engine.add_request(prompt, p)
    drain(engine)
    assert_all_blocks_free(engine)


@pytest.mark.engine
def test_a_field_your_copy_adds_to_a_sequence_needs_no_undo(monkeypatch):
    """Your copy counts each sequence's draws in a field of its own, set in the commit where
    every draw lands, a sample's or a beam's (here by a wrapper of land, the one place), and
    named by no undo: steps that fail after the forward leave it as they found it, and it stays
    equal to the tokens each sample and each beam drew (a forked beam inherits its parent's)."""
    real_land, real_forward, calls = nanopaged.OutputProcessor.land, GPT.forward, [0]

    def land(self, seq, tokens, logprobs):
        seq.num_draws = getattr(seq, "num_draws", 0) + len(tokens)
        real_land(self, seq, tokens, logprobs)

    def forward(self, *args, **kwargs):
        calls[0] += 1
        logits = real_forward(self, *args, **kwargs)
        if calls[0] % 3 == 0:
            raise RuntimeError("injected after the forward")
        return logits

    monkeypatch.setattr(nanopaged.OutputProcessor, "land", land)
    monkeypatch.setattr(GPT, "forward", forward)
    # room for all (no request is preempted, so none is recomputed after a failure either)
    engine = Engine(MODEL, block_size=2, num_blocks=48, max_num_batched_tokens=8,
                    enable_prefix_caching=False)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, n=2, seed=i))
           for i, p in enumerate(prompts)]
    engine.add_request([5, 6], SamplingParams(max_tokens=6, beam_width=2))
    requests = [engine.requests[i] for i in ids]
    beams_drew = []
    for _ in range(200):  # bounded: see drain
        if not engine.requests:
            break
        before = engine_state(engine)
        try:
            engine.step()
        except RuntimeError:
            assert engine_state(engine) == before
        for request in engine.requests.values():
            for seq in request.seqs:
                assert getattr(seq, "num_draws", 0) == seq.num_output_tokens
                beams_drew.append(seq.num_output_tokens if request.params.beam_width else 0)
    assert not engine.requests and calls[0] >= 3 and max(beams_drew) >= 3
    assert [[(s.num_draws, s.num_output_tokens) for s in g.finished_seqs] for g in requests] == \
        [[(6, 6)] * 2] * 3


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_undo_costs_what_the_plan_changed(mode):
    """The journal a decode step's plan writes is as long for sequences of 200 tokens as for
    sequences of 8: it records the blocks and queue moves the plan makes, never what the
    sequences hold (snapshots of token lists and block tables would grow 25 times)."""
    def journal_length(prompt_len):
        engine = Engine(tiny_model(max_seq_len=256), block_size=4, num_blocks=300,
                        max_num_seqs=4, max_num_batched_tokens=900, preemption_mode=mode)
        for i in range(4):
            engine.add_request([i] * prompt_len, SamplingParams(max_tokens=12, temperature=0))
        engine.step()  # the prefills
        lengths, real_run = [], engine.run

        def run(plan):
            lengths.append(len(engine.allocator.journal.undo))
            return real_run(plan)
        engine.run = run
        for _ in range(8):  # decodes, some filling a block and taking the next
            engine.step()
        return lengths
    assert journal_length(8) == journal_length(200)


@pytest.mark.engine
def test_every_example_starts_from_the_same_torch_random_state():
    """A request sampled without a seed draws its seed from torch's global generator; conftest.py
    has Hypothesis seed it before each example, as it seeds Python's, so an example that takes
    such a request replays exactly (else a state machine's preconditions could follow the draws:
    FlakyStrategyDefinition)."""
    starts = []

    @settings(max_examples=5, database=None)
    @given(st.integers(0, 7))
    def unseeded(prompt_token):
        starts.append(torch.get_rng_state())
        Engine(MODEL, block_size=4, num_blocks=8).generate([[prompt_token]],
                                                           SamplingParams(max_tokens=2))
    unseeded()
    assert len(starts) == 5 and all(torch.equal(s, starts[0]) for s in starts)


class EngineMachine(RuleBasedStateMachine):
    """Random interleavings of add_request, step and abort on a tiny pool."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(10, 24),
                mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
                max_num_seqs=st.integers(2, 5), scheduling=st.sampled_from(SCHEDULING),
                eviction=st.sampled_from(EVICTION),
                speculator=st.sampled_from([None, None, "ngram", "draft=target"]),
                model=st.sampled_from(sorted(PAGED_MODELS)))
    def setup(self, block_size, num_blocks, mode, caching, max_num_seqs, scheduling, eviction,
              speculator, model):
        self.model = PAGED_MODELS[model]
        if speculator == "draft=target" and model == "hybrid":  # a draft needs one kind: refused
            speculator = "ngram"
        self.engine = Engine(self.model, block_size=block_size, num_blocks=num_blocks,
                             preemption_mode=mode, enable_prefix_caching=caching,
                             max_num_batched_tokens=8, max_num_seqs=max_num_seqs,
                             scheduling_policy=scheduling, eviction_policy=eviction,
                             speculative_config=speculator and speculative_config(
                                 speculator, 2, self.model))
        self.unfinished, self.expected = set(), {}
        s, schedule = self.engine.scheduler, self.engine.scheduler.schedule

        # every step's SchedulerOutput, with samples and beams beside single sequences
        def checked_schedule():
            before = {g.request_id for g in s.running}
            out = schedule()
            assert out.num_batched_tokens == sum(n for _, n in out.scheduled + out.lookahead) <= 8
            assert sum(len(g.seqs) for g in s.running) <= s.max_num_seqs
            started = [g for g in s.running if g.request_id not in before]
            assert not (out.preempted and (started or out.copies.swap_in)), "after preempting"
            a, ahead = self.engine.allocator, {seq.seq_id for seq, _ in out.lookahead}
            decodes = [seq for seq, n in out.scheduled  # one token, the last: not a prefill's
                       if n == 1 and seq.num_computed_tokens + 1 == len(seq)  # chunk of one
                       and seq.seq_id not in ahead]
            for seq in decodes:  # a decode holds its kinds' bound, however long the sequence
                for kind, table in zip(a.kinds, seq.block_tables):
                    assert len(table) - table.count(nanopaged.NO_BLOCK) <= \
                        kind.max_blocks(len(seq), 1, a.block_size)
            return out

        s.schedule = checked_schedule

    @rule(prompt=st.lists(st.integers(0, 7), min_size=1, max_size=9), max_tokens=st.integers(1, 6),
          kind=st.sampled_from(["greedy", "greedy", "n=2", "beam=2"]), priority=st.integers(0, 2),
          seed=st.integers(0, 2**16))
    def add(self, prompt, max_tokens, kind, priority, seed):
        if kind == "beam=2" and self.engine.proposer:  # refused when speculating: its own test
            kind = "n=2"
        # Seeded: unseeded, a sample's stop would follow torch's global random state, and so would
        # whether abort() may run; Hypothesis could not replay a case
        params = SamplingParams(max_tokens=max_tokens, temperature=0 if kind == "greedy" else 1.0,
                                n=2 if kind == "n=2" else 1, seed=seed,
                                beam_width=2 if kind == "beam=2" else None)
        try:
            request_id = self.engine.add_request(prompt, params, priority=priority)
        except ValueError:  # too big for this pool: rejected up front, and nothing changed
            assert blocks_a_request_may_hold(self.engine, prompt, params) > \
                self.engine.allocator.num_blocks
            return
        self.unfinished.add(request_id)
        if kind == "greedy":
            self.expected[request_id] = naive_greedy(self.model, prompt, max_tokens)

    @rule()
    def step(self):
        for out in self.engine.step():
            if not out.finished:
                continue
            self.unfinished.remove(out.request_id)
            if out.request_id in self.expected:
                assert out.outputs[0].token_ids == self.expected[out.request_id]

    @precondition(lambda self: self.unfinished)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.unfinished)))
        self.engine.abort(request_id)
        self.unfinished.remove(request_id)

    @invariant()
    def no_block_leaked_or_double_owned(self):
        a, s = self.engine.allocator, self.engine.scheduler
        device, cpu = Counter(), Counter()
        for counter, queue in ((device, s.running), (cpu, s.swapped)):
            for seq in (seq for request in queue for seq in request.seqs):
                for table in seq.block_tables:
                    counter.update(b for b in table if b != nanopaged.NO_BLOCK)
        for request in s.waiting:
            assert all(not any(seq.block_tables) for seq in request.seqs)
        assert all(a.blocks[b].ref_count == device[b] for b in range(a.num_blocks))
        assert all(a.swap_pool.blocks[b].ref_count == cpu[b] for b in range(a.swap_pool.num_blocks))
        assert a.num_free_blocks == sum(1 for b in a.blocks if b.ref_count == 0)
        assert set(self.engine.requests) == self.unfinished
        assert sum(len(g.seqs) for g in s.running) <= s.max_num_seqs  # samples and beams count

    @invariant()
    def a_kind_holds_only_the_blocks_it_sees(self):
        """A sequence's table holds every block a token to come sees; those none sees went
        back to the pool (NO_BLOCK), by the step before the next chunk."""
        a = self.engine.allocator
        for seq in (seq for g in self.engine.scheduler.running for seq in g.seqs):
            for kind, table in zip(a.kinds, seq.block_tables):
                gone = {i for i, b in enumerate(table) if b == nanopaged.NO_BLOCK}
                assert gone <= unseen_blocks(kind, seq.num_computed_tokens, len(table),
                                             a.block_size)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(500):  # every request that was not aborted finishes
            if not self.unfinished:
                break
            self.step()
        assert not self.unfinished
        assert_all_blocks_free(self.engine)


EngineMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=50,
                                           deadline=None)
test_engine_state_machine = pytest.mark.engine(EngineMachine.TestCase)


# -----------------------------------------------------------------------------
# checks.py: the checks of requests and of the engine's settings  (-m engine)


@pytest.mark.engine
@pytest.mark.parametrize("prompt,params,message", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 32], SamplingParams(), r"prompt token 1 is 32, outside the vocabulary \[0, 32\)"),
    ([1, -1], SamplingParams(), "prompt token 1 is -1"),
    ([1, 2.5], SamplingParams(), "prompt token 1 is 2.5"),
    ([1] * 60, SamplingParams(max_tokens=5), r"= 65 exceeds the model's max_seq_len \(64\)"),
    ([1] * 30, SamplingParams(max_tokens=30),
     "may need 15 KV blocks .* but the pool has 12: it could never run"),
    ([1] * 11, SamplingParams(max_tokens=6, n=3), r"may need 15 KV blocks \(3 x 17 tokens"),
    ([1], SamplingParams(n=9), r"n/beam_width \(9\) exceeds max_num_seqs .*at most 8 sequences"),
    ([1], "greedy", "params must be a SamplingParams"),
])
def test_bad_requests_are_rejected_before_taking_blocks(prompt, params, message):
    engine = Engine(MODEL, block_size=4, num_blocks=12, max_num_seqs=8)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert_all_blocks_free(engine) and serves_normally(engine)


@pytest.mark.engine
@pytest.mark.parametrize("name", sorted(PAGED_MODELS))
def test_what_a_request_may_need_and_the_default_pool_follow_its_kinds_bound(name):
    """check_request refuses only a request that could never run: num_seqs sequences holding,
    each, its kinds' bound at one token a chunk; a request of max_seq_len within it runs. And
    without num_blocks or kv_cache_bytes, the pool holds max_num_seqs sequences of max_seq_len
    at the budget's chunks, by their kinds' bound (vLLM's: no more than they could use)."""
    model = PAGED_MODELS[name]
    kinds, n = [g.kind for g in model.config.kv_cache_groups], model.config.max_seq_len
    engine = Engine(model, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    assert engine.allocator.num_blocks == 3 * sum(k.max_blocks(n, 8, 4) for k in kinds)
    need = 2 * sum(k.max_blocks(n, 1, 4) for k in kinds)
    prompt = [t % 32 for t in range(n - 4)]
    params = SamplingParams(max_tokens=4, n=2, temperature=0)
    for num_blocks in (need - 1, need):
        engine = Engine(model, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=8)
        if num_blocks < need:
            with pytest.raises(ValueError, match=f"may need {need} KV blocks .* could never run"):
                engine.add_request(prompt, params)
            continue
        assert engine.generate([prompt], params)[0].outputs[1].token_ids == \
            naive_greedy(model, prompt, 4)
        assert_all_blocks_free(engine)


def call(f, *args):  # st.builds' callable, for builders drawn from a list
    return f(*args)


def ids_as_given(good):
    """Token ids as users put them in a prompt's list: ones the engine takes (ints, numpy's
    integers, 0-d integer tensors and arrays, in the vocabulary [0, 32)), or ones it refuses."""
    if good:
        return st.builds(call, st.sampled_from([int, np.int64, np.int32, np.uint8, np.array,
                                                torch.tensor, lambda t: torch.tensor(t).short()]),
                         st.integers(0, 31))
    wide = st.sampled_from([int, np.int64, np.array, torch.tensor])  # holds any id we draw
    return st.one_of(
        st.sampled_from([True, False, np.True_, torch.tensor(True), 2.5, math.nan, "3", None]),
        st.builds(call, st.sampled_from([float, np.float32, lambda t: torch.tensor(t) / 1]),
                  st.integers(0, 31)),  # integral floats too
        st.builds(call, wide, st.integers(-2**40, -1) | st.integers(32, 2**40) | st.just(32)),
        st.builds(call, st.sampled_from([np.uint8, lambda t: torch.tensor(t).byte()]),
                  st.integers(32, 255)),
        st.builds(call, st.sampled_from([lambda t: [t], lambda t: (t,), lambda t: [[t]],
                                         lambda t: torch.tensor([t]), lambda t: np.array([t])]),
                  st.integers(0, 31)))  # nested


@st.composite
def prompts_as_given(draw):
    """(a prompt as a user may pass it, the plain ints the engine must run it as or None, and
    what the ValueError must name if it refuses it): a list or tuple of ids_as_given, a tensor
    or numpy array of ids (of any dtype and shape, maybe empty), or something else."""
    form = draw(st.sampled_from(["list", "tuple", "tensor", "array", "other"]))
    if form in ("list", "tuple"):
        good = draw(st.lists(st.booleans(), max_size=6))
        prompt = [draw(ids_as_given(g)) for g in good]
        prompt = prompt if form == "list" else tuple(prompt)
        if not good:
            return prompt, None, "the prompt is empty"
        if not all(good):
            return prompt, None, f"prompt token {good.index(False)} is "
        return prompt, [int(t) for t in prompt], None
    if form == "other":
        return draw(st.sampled_from(["hello", 5, None, {1, 2}, range(3), np.array(5),
                                     torch.tensor(5)])), None, "prompt"
    ids = draw(st.lists(st.integers(0, 31) | st.integers(-3, 40), max_size=6))
    dtype = draw(st.sampled_from(["int64", "int32", "int16", "float32", "bool"]))
    wide = draw(st.booleans())  # 2-D
    prompt = (torch.tensor(ids, dtype=getattr(torch, dtype)) if form == "tensor"
              else np.array(ids, dtype=dtype))
    prompt = prompt.reshape(1, -1) if wide else prompt
    if wide or dtype in ("float32", "bool") or not ids:
        return prompt, None, "prompt"
    bad = [i for i, t in enumerate(ids) if not 0 <= t < 32]
    return prompt, None if bad else ids, f"prompt token {bad[0]} is " if bad else None


@pytest.mark.engine
@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=prompts_as_given())
def test_a_prompt_runs_as_plain_ints_or_is_refused_naming_it_before_anything_changes(case):
    """Random prompts, good and bad. A bad one (bools, floats, negative ids, ids at or past the
    vocabulary, nested lists, a float or 2-D tensor, an empty one, not a list) is a ValueError
    naming the prompt, or the first token it refuses, before anything changes, in add_request()
    beside a request in flight and in generate(); a good one (numpy's and torch's integers too,
    as ids or whole) runs, as its ids in plain ints."""
    prompt, ids, names = case
    greedy = SamplingParams(max_tokens=3, temperature=0)
    engine = Engine(MODEL, block_size=2, num_blocks=24)
    mate = engine.add_request([1, 2, 3, 4, 5], greedy)
    engine.step()  # in flight: it holds blocks and has cached some
    if ids is None:
        before = engine_state(engine)
        with pytest.raises(ValueError, match=re.escape(names)):
            engine.add_request(prompt, greedy)
        assert engine_state(engine) == before
        idle = Engine(MODEL, block_size=2, num_blocks=24)
        before = engine_state(idle)
        with pytest.raises(ValueError, match="prompt 1: .*" + re.escape(names)):
            idle.generate([[1], prompt], greedy)
        assert engine_state(idle) == before
        assert drain(engine)[mate].outputs[0].token_ids == naive_greedy(MODEL, [1, 2, 3, 4, 5], 3)
        return
    request_id = engine.add_request(prompt, greedy)
    out = drain(engine)[request_id]
    assert out.prompt_token_ids == ids and {type(t) for t in out.prompt_token_ids} == {int}
    assert out.outputs[0].token_ids == naive_greedy(MODEL, ids, 3)
    assert_all_blocks_free(engine)


@pytest.mark.engine
def test_a_batch_with_one_bad_prompt_is_rejected_whole():
    engine = Engine(MODEL, block_size=4, num_blocks=32)
    with pytest.raises(ValueError, match=r"prompt 2: prompt token 0 is 99"):
        engine.generate([[1, 2], [3], [99], [4]], SamplingParams(max_tokens=3))
    assert not engine.requests and not engine.scheduler.waiting and serves_normally(engine)


@pytest.mark.engine
@pytest.mark.parametrize("priority", ["high", True, 1.5, None])
def test_a_priority_must_be_an_int(priority):
    engine = Engine(MODEL, block_size=4, num_blocks=8)
    message = f"priority must be an int, got {re.escape(repr(priority))}"
    with pytest.raises(ValueError, match=message):
        engine.add_request([1], SamplingParams(max_tokens=2), priority=priority)
    with pytest.raises(ValueError, match="prompt 1: priority must be an int"):
        engine.generate([[1], [2]], SamplingParams(max_tokens=2), priority=[0, priority])
    with pytest.raises(ValueError, match="got 2 prompts, 2 SamplingParams and 1 priorities"):
        engine.generate([[1], [2]], SamplingParams(max_tokens=2), priority=[0])
    assert serves_normally(engine)


@pytest.mark.engine
@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=0), r"block_size must be an integer >= 1, got 0"),
    (dict(num_blocks=0), r"num_blocks must be an integer >= 1, got 0"),
    (dict(num_blocks=None, kv_cache_bytes=1000),
     r"kv_cache_bytes=1000 is smaller than one KV block \(4096 bytes"),
    (dict(preemption_mode="evict"), r"preemption_mode must be one of \['recompute', 'swap'\]"),
    # the built-in names, wherever your own ones sort among them
    (dict(scheduling_policy="sjf"),
     r"scheduling_policy must be one of \[.*'fcfs'.*'priority'.*\], got 'sjf'"),
    (dict(eviction_policy=None), r"eviction_policy must be one of \[.*'lfu'.*'lru'.*\], got None"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(attention_backend="flash"),
     r"attention_backend must be one of \[.*'flex'.*'torch'.*'triton'.*\], got 'flash'"),
    (dict(attention_backend="triton"), r"attention_backend='triton' cannot run this model: the "
     r"Triton kernel takes head sizes .* not head size 8 in torch.float64"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks must be an integer >= 0, got -1"),
    (dict(num_cpu_blocks=2.0), "num_cpu_blocks must be an integer >= 0, got 2.0"),
    (dict(num_blocks=None, kv_cache_bytes=-1), "kv_cache_bytes must be an integer >= 1, got -1"),
    (dict(block_size=True), "block_size must be an integer >= 1, got True"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1, got 0"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False, got 'no'"),
    (dict(device="gpu"), "device must be like 'cpu', 'cuda' or 'cuda:1', got 'gpu'"),
    (dict(kv_cache_dtype="int8"),
     r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\], got 'int8'"),
    (dict(kv_cache_dtype=torch.float8_e4m3fn), "kv_cache_dtype must be one of .* got torch"),
])
def test_bad_engine_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, **{"block_size": 4, "num_blocks": 8, **kwargs})


ENGINE_INT_SETTINGS = [name for name, p in inspect.signature(Engine).parameters.items()
                       if asks_for(p.annotation)]


@pytest.mark.engine
def test_int_engine_settings_say_so_in_their_annotations():
    """What the next test finds the settings by: a setting whose default is a number is
    annotated (so one added later is found too)."""
    for name, p in inspect.signature(Engine).parameters.items():
        if type(p.default) in (int, float):
            assert asks_for(p.annotation), f"Engine's {name} needs an annotation: int or float"
    assert {"block_size", "num_blocks", "kv_cache_bytes", "max_num_seqs"} <= \
        set(ENGINE_INT_SETTINGS)


@pytest.mark.engine
@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(ENGINE_INT_SETTINGS), value=st.integers(0, 64), scalar=INT_SCALARS,
       bool_=BOOLS)
def test_int_engine_settings_refuse_bools_and_take_numpy_and_torch_ints(name, value, scalar, bool_):
    """Every setting of Engine annotated int or float, found from its signature: a bool is a
    ValueError naming it; numpy's and torch's integer scalars build the engine the same Python
    int builds, or the same refusal."""
    settings_ = {key: v for key, v in dict(block_size=4, num_blocks=16).items() if key != name}
    with pytest.raises(ValueError, match=rf"Engine: {name} must be "):
        Engine(MODEL, **settings_, **{name: bool_})
    assert outcome(lambda: Engine(MODEL, **settings_, **{name: scalar(value)})) == \
        outcome(lambda: Engine(MODEL, **settings_, **{name: value}))


@pytest.mark.engine
def test_engine_takes_a_gpt_model():
    with pytest.raises(ValueError, match=r"model must be a GPT .* got Linear"):
        Engine(torch.nn.Linear(2, 2), block_size=4, num_blocks=8)


@pytest.mark.engine
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the error for a machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        Engine(MODEL, block_size=4, num_blocks=8, device="cuda")


def counters_from_the_outside(engine, queue_before, seen):
    """stats()'s counters as the queues, block tables and streamed outputs imply them, each
    derived apart from engine_stats: blocks held are the union of the tables, a slot is filled
    once however many tables share its block, a preemption is a request that was running before
    a step and is waiting or swapped after it."""
    s, a, bs = engine.scheduler, engine.allocator, engine.block_size
    running = [seq for g in s.running for seq in g.seqs]
    held = {b for seq in running for b in seq.block_table}
    filled = {(seq.block_table[i // bs], i % bs) for seq in running
              for i in range(seq.num_computed_tokens)}
    queue_after = {g.request_id: name for name in ("waiting", "running", "swapped")
                   for g in getattr(s, name)}
    return dict(
        num_free_blocks=a.num_blocks - len(held),
        num_free_cpu_blocks=a.swap_pool.num_blocks - len(
            {b for g in s.swapped for seq in g.seqs for b in seq.block_table}),
        num_cached_blocks=len({b.block_id for b in a.blocks if b.hash is not None} - held),
        num_logical_blocks=sum(len(seq.block_table) for seq in running),
        kv_utilization=len(filled) / (len(held) * bs) if held else 0.0,
        num_running=len(running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
        preempted=sum(queue_before.get(r) == "running" and q in ("waiting", "swapped")
                      for r, q in queue_after.items()),
        generated=sum(len(c.token_ids) for c in seen.values()),
    ), queue_after


@pytest.mark.engine
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=10),
                                   st.integers(1, 6), st.sampled_from(["greedy", "seeded", "n=2"])),
                         min_size=1, max_size=6),
       shared=st.lists(st.integers(0, 7), max_size=6), block_size=st.sampled_from([1, 2, 4]),
       spare=st.integers(0, 8), mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), abort_at=st.sets(st.integers(0, 30), max_size=2))
@example(requests=[([1, 2, 3], 6, "n=2"), ([1, 2, 3], 6, "seeded")], shared=[4, 5, 6, 7],
         block_size=2, spare=0, mode="swap", caching=True, abort_at=set())
def test_stats_counters_are_what_the_queues_and_tables_imply(
        requests, shared, block_size, spare, mode, caching, abort_at):
    """After every step, stats() against counters_from_the_outside(): free and cached blocks,
    the sharing it reports, the slots filled, the queues, preemptions step by step, every
    token drawn (each sample's streamed tokens, aborted ones too), and the prompt tokens of the
    requests that have had a first token, each once (vLLM's prompt_tokens_total), however often
    a preemption computes them again."""
    prompts = [shared + prompt for prompt, _, _ in requests]
    params = [SamplingParams(max_tokens=m, temperature=0 if kind == "greedy" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1)
              for i, (_, m, kind) in enumerate(requests)]
    worst = max(p.n * -(-(len(q) + p.max_tokens) // block_size) for q, p in zip(prompts, params))
    engine = Engine(MODEL, block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                    enable_prefix_caching=caching, max_num_batched_tokens=6, max_num_seqs=4)
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    queues, seen, preemptions = {}, {}, 0  # seen: (request, sample) -> its latest output
    for i in range(300):
        if not engine.requests:
            break
        if i in abort_at:
            engine.abort(sorted(engine.requests)[0])
        for out in engine.step():
            seen.update(((out.request_id, c.index), c) for c in out.outputs)
        expected, queues = counters_from_the_outside(engine, queues, seen)
        preemptions += expected.pop("preempted")
        stats = engine.stats()
        assert stats["num_prompt_tokens"] == sum(len(prompts[r]) for r in {r for r, _ in seen})
        assert stats["num_preemptions"] == preemptions
        assert stats["num_generated_tokens"] == expected.pop("generated")
        assert stats["kv_utilization"] == pytest.approx(expected.pop("kv_utilization"))
        assert {k: stats[k] for k in expected} == expected
    assert not engine.requests
    event(f"preempted: {preemptions > 0}")


# -----------------------------------------------------------------------------
# checkpoints.py: Hugging Face folders, their config dialects, shards, dtypes,
# generation_config.json and chat templates  (-m checkpoints)


@pytest.mark.checkpoints
def test_both_config_dialects_and_sharded_folders_load_alike(hf_folder, tmp_path):
    path, hf = hf_folder("llama")
    idx = torch.randint(128, (2, 50))  # past original_max_position_embeddings (32)
    with torch.no_grad():
        expected = hf(idx).logits
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")  # the dialect of published Llama 3.1 folders
    config |= dict(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    config |= dict(sliding_window=16, use_sliding_window=False)  # a window, but off
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        logits = GPT.from_pretrained(str(tmp_path))(idx)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()  # a download cut short
    with pytest.raises(ValueError, match=f"'{shard.name}', a shard the index lists, is missing"):
        GPT.from_pretrained(str(tmp_path))


@pytest.mark.checkpoints
def test_from_pretrained_reads_pytorch_model_bin(hf_folder, tmp_path):
    path, hf = hf_folder("gpt2")
    from safetensors.torch import load_file
    torch.save(load_file(os.path.join(path, "model.safetensors")), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    idx = torch.randint(100, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_pretrained(str(tmp_path))(idx), hf(idx).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.checkpoints
@pytest.mark.parametrize("name,key,size,message", [
    ("gpt2", "transformer.h.1.mlp.c_fc.weight", 100,
     r"'h.1.mlp.c_fc.weight' has shape \(64, 100\), config.json implies \(64, 256\)"),
    ("llama", "model.layers.1.self_attn.k_proj.weight", 4,
     r"'model.layers.1.self_attn.k_proj.weight' has shape \(8, 4\), config.json implies \(8, 48\)"),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias", 5,
     r"'model.layers.0.self_attn.v_proj.bias' has shape \(5,\), config.json implies \(24,\)"),
    ("llama", "lm_head.weight", 7,
     r"'lm_head.weight' has shape \(128, 7\), config.json implies \(128, 48\)"),
    ("mistral", "model.layers.0.mlp.gate_proj.weight", 3,
     r"'model.layers.0.mlp.gate_proj.weight' has shape \(64, 3\), config.json implies \(64, 48\)"),
])
def test_from_pretrained_bad_folders(hf_folder, tmp_path, name, key, size, message):
    path, _ = hf_folder(name)
    with pytest.raises(ValueError, match="config.json not found"):
        GPT.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="no weights"):
        GPT.from_pretrained(str(tmp_path))
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights[key] = weights[key][..., :size].contiguous()
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(str(tmp_path))
    del weights[key]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"'{key.removeprefix('transformer.')}' is missing"):
        GPT.from_pretrained(str(tmp_path))


# Settings that change the math, each loaded exactly: (family, transformers config edits, keys
# then left out of config.json, which transformers reads as its config class's default)
SETTINGS_LOADED_EXACTLY = [
    ("gpt2", dict(tie_word_embeddings=False), ()),  # the head is lm_head.weight, not wte
    ("gpt2", dict(tie_word_embeddings=True), ("tie_word_embeddings",)),  # GPT-2's default: tied
    ("gpt2", dict(scale_attn_weights=False), ()),  # scores unscaled
    ("gpt2", dict(reorder_and_upcast_attn=True), ()),  # fp32 scores: ours always are
    ("gpt2", dict(n_inner=100), ()),
    ("gpt2", dict(n_inner=None), ("n_inner",)),
    ("gpt2", dict(activation_function="gelu"), ()),  # exact erf GELU, not the tanh one
    ("gpt2", dict(activation_function="relu"), ()),
    ("gpt2", dict(layer_norm_epsilon=0.5), ()),
    ("llama", dict(rms_norm_eps=0.5, hidden_act="gelu_pytorch_tanh"), ()),
    ("llama", dict(pretraining_tp=2), ()),  # a training detail: transformers ignores it
    ("llama", dict(tie_word_embeddings=True), ()),
    ("llama", dict(tie_word_embeddings=False), ("tie_word_embeddings",)),  # Llama's default
    ("mistral", dict(rope_parameters=dict(rope_type="default", rope_theta=50.0)), ()),
    ("qwen2", dict(tie_word_embeddings=False), ("tie_word_embeddings",)),  # Qwen2's default
    ("qwen2", dict(rms_norm_eps=0.5, rope_parameters=dict(rope_theta=100.0)), ()),
    # sliding windows, over 30 tokens: Mistral's on every layer (4096 where config.json is
    # silent); Qwen2's only with use_sliding_window, on the layers from max_window_layers on
    # (28 where silent) unless layer_types lists them
    ("mistral", dict(sliding_window=7), ()),
    ("mistral", dict(sliding_window=1), ()),  # each token sees itself alone
    ("mistral", dict(sliding_window=16), ("sliding_window",)),
    # a Mistral folder with layer_types: transformers reads it as Ministral, which follows them
    ("mistral", dict(sliding_window=7, layer_types=["full_attention", "sliding_attention"]), ()),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),
     ("layer_types",)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),
     ("layer_types", "max_window_layers")),
    ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0), ()),
    ("qwen2", dict(use_sliding_window=True, max_window_layers=0),
     ("layer_types", "sliding_window")),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7,
                   layer_types=["sliding_attention", "full_attention"]), ("max_window_layers",)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=7, max_window_layers=0),
     ("layer_types",)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=0),
     ("layer_types", "use_sliding_window")),
]


@pytest.mark.checkpoints
@pytest.mark.parametrize("name,edit,omit", SETTINGS_LOADED_EXACTLY, ids=[
    f"{name}-{','.join(omit) + '-omitted' if omit else ','.join(edit)}"
    for name, edit, omit in SETTINGS_LOADED_EXACTLY])
def test_from_pretrained_loads_each_setting_as_transformers_does(tmp_path, name, edit, omit):
    transformers = pytest.importorskip("transformers")
    config_class, kwargs = HF_MODELS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**kwargs | edit))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                      if k not in omit}))
    # what the folder means is what transformers reads from it (eager: reorder_and_upcast_attn)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    idx = torch.randint(hf.config.vocab_size, (2, 30))
    model = GPT.from_pretrained(str(tmp_path))
    assert layer_windows(model.config) == hf_windows(hf.config)  # too long for 30 tokens too
    with torch.no_grad():
        expected = hf.float().eval()(idx).logits
        torch.testing.assert_close(model(idx), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.checkpoints
@pytest.mark.parametrize("name,edit,message", [
    ("llama", dict(model_type="gemma"), "model_type='gemma'; this GPT loads 'gpt2', 'llama'"),
    ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
     "rope_scaling / rope_parameters rope_type='yarn'; this model takes only 'default' or"),
    ("llama", dict(rope_parameters=None, rope_scaling=dict(type="linear", factor=2.0)),
     "rope_type='linear'"),
    ("qwen2", dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),  # older dialect
    ("mistral", dict(sliding_window=0), "sliding_window=0; a window is a number of positions"),
    ("mistral", dict(sliding_window=16.0), "sliding_window=16.0"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=-4), "sliding_window=-4"),
    # transformers itself fails on these
    ("mistral", dict(sliding_window=None, layer_types=["full_attention"] * 2),
     "layer_types and sliding_window=None; transformers reads it as Ministral"),
    ("qwen2", dict(use_sliding_window=False, layer_types=["full_attention", "sliding_attention"]),
     "layer_types with sliding_attention layers, but no window (use_sliding_window=False"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                   layer_types=["chunked_attention", "full_attention"]),
     "layer_types=['chunked_attention', 'full_attention']; this model takes 2"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
     "layer_types=['full_attention']; this model takes 2 (num_hidden_layers)"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=None,
                   max_window_layers=None), "max_window_layers=None"),
    ("llama", dict(hidden_act="quick_gelu"), "hidden_act='quick_gelu'"),
    ("llama", dict(attention_bias=True), "attention_bias=True"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("gpt2", dict(activation_function="quick_gelu"), "activation_function='quick_gelu'"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention=True"),
])
def test_from_pretrained_rejects_settings_it_would_get_wrong(hf_folder, tmp_path, name, edit,
                                                            message):
    path, _ = hf_folder(name)
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | edit))
    with pytest.raises(ValueError, match=re.escape(message)):
        GPT.from_pretrained(str(tmp_path))


@pytest.mark.checkpoints
def test_every_eos_id_of_both_config_files_stops_like_transformers(hf_folder, tmp_path):
    """config.json and generation_config.json may each list several end-of-text ids (Llama 3.1
    Instruct, Qwen2.5 Instruct): any id of either file ends a sample or a beam."""
    path, hf = hf_folder("llama")
    hf64 = copy.deepcopy(hf).double()
    prompts = [[(7 * i + 3 * j) % 97 for j in range(n)] for i, n in enumerate([5, 7, 11, 13])]

    def hf_generate(p, eos):
        mask = torch.ones(1, len(p), dtype=torch.long)
        out = hf64.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=10,
                            do_sample=False, pad_token_id=0, eos_token_id=eos)
        return out[0, len(p):].tolist()
    runs = [hf_generate(p, None) for p in prompts]
    ids = [runs[0][2], runs[1][6], runs[2][4], runs[3][8]]  # each run meets one at another step
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | dict(eos_token_id=ids[:2])))
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=ids[1:] + [128])))
    model = GPT.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert model.config.eos_token_ids == set(ids)  # the union; 128 is outside the vocabulary
    engine = Engine(model, block_size=3, num_blocks=64)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert [o.outputs[0].token_ids for o in greedy] == [hf_generate(p, ids) for p in prompts]
    assert all(o.outputs[0].finish_reason == "stop" for o in greedy)
    ignored = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0,
                                                      ignore_eos=True))
    assert [o.outputs[0].token_ids for o in ignored] == runs
    for p in prompts:
        beams = engine.generate([p], SamplingParams(max_tokens=10, beam_width=3))[0].outputs
        expected = naive_beam_search(model, p, 3, 10, ids)
        assert [(c.token_ids, c.finish_reason) for c in beams] == [(t, r) for t, _, r in expected]
    assert_all_blocks_free(engine)


@pytest.mark.checkpoints
def test_a_bf16_checkpoint_loads_in_bf16_when_asked_and_in_fp32_on_a_cpu_by_default(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_FAMILY, num_key_value_heads=2)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)  # config.json: "dtype": "bfloat16"
    idx = torch.randint(128, (2, 30))
    bf16 = GPT.from_pretrained(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        logits, expected = bf16(idx), hf(idx).logits
        assert logits.dtype == torch.bfloat16
        # within a few bf16 steps (1/64 at these logits, up to ~4)
        torch.testing.assert_close(logits.float(), expected.float(), atol=0.05, rtol=0.02)
        # "auto" on a CPU: fp32, the same weights (bf16 widens exactly) as transformers' in fp32
        auto = GPT.from_pretrained(str(tmp_path), device="cpu")
        assert {p.dtype for p in auto.parameters()} == {torch.float32}
        torch.testing.assert_close(auto(idx), hf.float()(idx).logits, atol=1e-4, rtol=1e-4)
    engine = Engine(bf16, block_size=4, num_blocks=16, device="cpu")
    assert engine.model_runner.kv_cache.dtype == torch.bfloat16  # the cache follows the model
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"i0: dtype must be 'auto', 'float32', 'float16', "
                                         r"'bfloat16' or a floating torch dtype, got 'fp16'"):
        GPT.from_pretrained(str(tmp_path), dtype="fp16")


@pytest.mark.checkpoints
def test_dtype_auto_is_the_checkpoints_own_on_a_gpu_and_fp32_on_a_cpu():
    """checkpoints.choose_dtype takes the device as an argument: the GPU rule is checked here
    without a GPU."""
    choose = checkpoints.choose_dtype
    bf16 = {"dtype": "bfloat16"}  # as transformers 5 writes it; older folders say torch_dtype
    assert choose("auto", bf16, "cuda", bf16_supported=True) == torch.bfloat16
    assert choose("auto", bf16, "cuda:1", bf16_supported=False) == torch.float16  # vLLM's fallback
    assert choose("auto", {"torch_dtype": "float16"}, "cuda", bf16_supported=True) == torch.float16
    assert choose("auto", {}, "cuda", bf16_supported=True) == torch.float32  # nothing said
    assert choose("auto", bf16, "cpu") == torch.float32
    assert choose("auto", {"torch_dtype": "int8"}, "cpu") == torch.float32  # not read on a CPU
    for name, dtype in [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                        ("float32", torch.float32), (torch.float64, torch.float64)]:
        assert choose(name, bf16, "cpu") == dtype  # a CPU runs all of them (fp32 fastest)
    assert choose("bfloat16", {}, "cuda", bf16_supported=True) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='bfloat16' but this GPU"):
        choose("bfloat16", {}, "cuda", bf16_supported=False)
    with pytest.raises(ValueError, match=r"config.json sets torch_dtype='int8'"):
        choose("auto", {"torch_dtype": "int8"}, "cuda", bf16_supported=True)
    for bad in ["fp16", "half", "bf16", None, torch.int32, 16]:
        with pytest.raises(ValueError, match=r"^dtype must be 'auto'"):
            choose(bad, {}, "cpu")


@pytest.mark.checkpoints
@pytest.mark.parametrize("gen", [
    {}, {"do_sample": True}, {"do_sample": False, "temperature": 0.7, "top_k": 20},
    {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]},
    {"do_sample": True, "top_k": 0, "temperature": 1.3, "max_new_tokens": 40},
    {"temperature": 0.5, "top_p": None}, None,
    # Qwen2.5-Instruct's, then processors and warpers transformers reads besides
    {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8,
     "top_k": 20}, {"repetition_penalty": 1.3, "min_new_tokens": 3},
    {"do_sample": True, "min_p": 0.1, "min_new_tokens": 2}])
def test_generation_defaults_read_generation_config_json_as_transformers_does(tmp_path, gen):
    transformers = pytest.importorskip("transformers")
    if gen is None:  # no file: the folder says nothing
        assert checkpoints.generation_defaults(str(tmp_path)) == {}
        return
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    config = transformers.GenerationConfig.from_pretrained(tmp_path)
    unset = transformers.GenerationConfig._get_default_generation_params()  # what generate() uses

    def value(key):
        return unset.get(key) if getattr(config, key, None) is None else getattr(config, key)
    # the fields the file can set, by their metadata: warpers (hf_default) apply only when it
    # samples, taking generate()'s default where it is silent (None: no warper, the field's
    # own default); processors, whether or not it samples, where the file sets them
    read = [f for f in dataclasses.fields(SamplingParams) if "hf" in f.metadata]
    expected = {} if value("do_sample") is True else dict(temperature=0.0)  # greedy
    for f in read:
        key, warper = f.metadata["hf"], "hf_default" in f.metadata
        if warper and value("do_sample") is True:
            expected[f.name] = f.default if value(key) is None else value(key)
        elif not warper and getattr(config, key, None) is not None:
            expected[f.name] = getattr(config, key)
    assert {"temperature", "top_k", "min_p", "max_tokens"} <= {f.name for f in read}
    got = checkpoints.generation_defaults(str(tmp_path))
    assert got == expected and type(got.get("top_k", 0)) is int
    SamplingParams(**got)  # they are SamplingParams' own


CHAT_TEMPLATE = """{{ bos_token }}{% for m in messages %}
{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] | trim }}<</SYS>>
{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]
    {% elif loop.first %}{{ raise_exception('a chat starts with a user or system message') }}
    {% else %}{{ m | tojson }}{{ eos_token }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


@pytest.mark.checkpoints
def test_chat_template_renders_as_transformers_apply_chat_template(hf_folder, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "INST": 4, "[": 5, "]": 6, "/": 7}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.post_processor = tokenizers.processors.TemplateProcessing(  # adds a BOS by default
        single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    # a stale copy in tokenizer_config.json: chat_template.jinja wins, as in transformers
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        tokenizer_config | {"chat_template": "{{ messages[0]['content'] }}"}))
    chats = [[{"role": "user", "content": "hello"}],
             [{"role": "system", "content": "  Be brief.\n"},
              {"role": "user", "content": "héllo ☃ \"quoted\""},
              {"role": "assistant", "content": "añ ☃"}, {"role": "user", "content": "again"}]]
    for folder in ["jinja", "tokenizer_config"]:
        if folder == "tokenizer_config":  # the older place: in tokenizer_config.json
            (tmp_path / "chat_template.jinja").unlink()
            (tmp_path / "tokenizer_config.json").write_text(json.dumps(
                tokenizer_config | {"chat_template": CHAT_TEMPLATE}))
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
        for chat in chats:
            for add in (True, False):
                expected = loaded.apply_chat_template(chat, tokenize=False,
                                                      add_generation_prompt=add)
                assert checkpoints.render_chat(str(tmp_path), chat, add) == expected
        with pytest.raises(ValueError, match="chat template: a chat starts with a user"):
            checkpoints.render_chat(str(tmp_path), [{"role": "assistant", "content": "hi"}])
    # --chat: the prompt is one user message, tokenized as transformers does (no second BOS)
    path, _ = hf_folder("llama")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    report = demo.main(["--model", str(tmp_path), "--chat", "--prompt", "hello",
                             "--max-tokens", "3", "--temperature", "0", "--num-blocks", "8"])
    chat = [{"role": "user", "content": "hello"}]
    ids = loaded.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert report["outputs"][0].prompt_token_ids == ids
    assert "[0.0] 'hello' -> " in capsys.readouterr().out


def added_token(content, **more):
    """A special token as many published tokenizer_config.json files store it: an AddedToken's
    dict, not a string."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, **more}


SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
                  "pad_token": "<pad>"}
ADDED_TOKENS_DECODER = {str(i): {"content": t, "lstrip": False, "normalized": False,
                                 "rstrip": False, "single_word": False, "special": True}
                        for i, t in enumerate(SPECIAL_TOKENS.values())}
# tokenizer_config.json as published folders of each era write it, special_tokens_map.json (or
# None) beside it, where the template lies (chat_template.jinja beside them, or in the config),
# and what the template shows for bos, unk, pad and eos (transformers 5 reads no
# special_tokens_map.json)
REAL_TOKENIZER_CONFIGS = {
    "llama-2": (dict(add_bos_token=True, add_eos_token=False, clean_up_tokenization_spaces=False,
                     legacy=False, model_max_length=1e30, pad_token=None, sp_model_kwargs={},
                     tokenizer_class="LlamaTokenizer", bos_token=added_token("<s>"),
                     eos_token=added_token("</s>"), unk_token=added_token("<unk>")),
                None, "tokenizer_config.json", ("<s>", "<unk>", "", "</s>")),
    "mistral": (dict(added_tokens_decoder=ADDED_TOKENS_DECODER, additional_special_tokens=[],
                     tokenizer_class="LlamaTokenizer",
                     **{k: added_token(t, special=True) for k, t in SPECIAL_TOKENS.items()}),
                None, "chat_template.jinja", ("<s>", "<unk>", "<pad>", "</s>")),
    "qwen2": (dict(added_tokens_decoder=ADDED_TOKENS_DECODER, bos_token=None, eos_token="</s>",
                   pad_token="<pad>", unk_token=None, errors="replace", split_special_tokens=False,
                   tokenizer_class="PreTrainedTokenizerFast"),
              None, "chat_template.jinja", ("", "", "<pad>", "</s>")),
    "special_tokens_map.json": (dict(added_tokens_decoder=ADDED_TOKENS_DECODER,
                                     tokenizer_class="PreTrainedTokenizerFast"),
                                {k: added_token(t) for k, t in SPECIAL_TOKENS.items()},
                                "chat_template.jinja", ("", "", "", "")),
}
# every special token a template may name, whether or not the folder sets it
SPECIALS_TEMPLATE = CHAT_TEMPLATE + "{{ unk_token }}|{{ pad_token }}|{{ eos_token }}"


@pytest.fixture(scope="module")
def real_tokenizer_folders(tmp_path_factory):
    """{name: (folder, transformers' tokenizer loaded from it)} for REAL_TOKENIZER_CONFIGS, each
    folder a tokenizer.json, its configs and its template, written here."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS.values())} | {"hello": 4, "[": 5, "]": 6}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(SPECIAL_TOKENS.values()))
    folders = {}
    for name, (config, special_tokens_map, place, _) in REAL_TOKENIZER_CONFIGS.items():
        path = tmp_path_factory.mktemp("tokenizer")
        backend.save(str(path / "tokenizer.json"))
        if place == "chat_template.jinja":
            (path / "chat_template.jinja").write_text(SPECIALS_TEMPLATE)
        else:
            config = config | {"chat_template": SPECIALS_TEMPLATE}
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        if special_tokens_map is not None:
            (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
        folders[name] = path, transformers.AutoTokenizer.from_pretrained(path)
    return folders


@pytest.mark.checkpoints
@settings(max_examples=examples(40), deadline=None)
@given(chat=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(
    st.characters(codec="utf-8"), max_size=12)), min_size=1, max_size=4).map(
        lambda c: [{"role": r, "content": t} for r, t in c]), add=st.booleans())
def test_chat_templates_of_real_configs_render_as_transformers(real_tokenizer_folders, chat,
                                                               add):
    """Published folders store special tokens as AddedToken dicts or as strings, beside an
    added_tokens_decoder, some in special_tokens_map.json too, and the template in
    chat_template.jinja or in tokenizer_config.json: each chat renders as transformers'
    apply_chat_template renders it, or both refuse it (here, a chat that starts with the
    assistant)."""
    for name, (path, loaded) in real_tokenizer_folders.items():
        try:
            expected = loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=add)
        except Exception as e:  # the template's own raise_exception
            with pytest.raises(ValueError, match=re.escape(str(e))):
                checkpoints.render_chat(str(path), chat, add)
            continue
        assert checkpoints.render_chat(str(path), chat, add) == expected, name
        bos, unk, pad, eos = REAL_TOKENIZER_CONFIGS[name][3]  # transformers read the tokens
        assert expected.startswith(bos) and expected.endswith(f"{unk}|{pad}|{eos}")


@pytest.mark.checkpoints
def test_chat_without_a_template_or_jinja2_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="no chat template"):
        checkpoints.render_chat(str(tmp_path), [{"role": "user", "content": "hi"}])
    monkeypatch.setitem(sys.modules, "jinja2", None)  # as if not installed
    with pytest.raises(ValueError, match="a chat template needs jinja2: pip install jinja2"):
        checkpoints.render_chat(str(tmp_path), [{"role": "user", "content": "hi"}])


# -----------------------------------------------------------------------------
# speculative.py: proposals verified in one step, lookahead slots given back  (-m speculative)
#
# The speculating engine must produce the target's output exactly (greedy, and seeded samples
# too: see speculative.py), and plain scheduling must not change: lookahead only uses what it
# left.


# The settings of a method's variants the tests run, a function of the target model each: ngram
# looking for shorter repeats than its defaults; a draft equal to the target (its every guess is
# kept) and an unrelated one (few are). A method not listed runs once, with its defaults.
SPECULATOR_VARIANTS = {
    "ngram": {"ngram": lambda target: {"prompt_lookup_max": 3, "prompt_lookup_min": 1}},
    "draft": {"draft=target": lambda target: {"model": target},
              "draft=other": lambda target: {"model": LLAMA if target is MODEL else MODEL}},
}
SPECULATORS = [variant for method in sorted(nanopaged.SPECULATIVE_METHODS)
               for variant in SPECULATOR_VARIANTS.get(method, [method])]


def speculative_config(name, k, target):
    """The speculative_config of a variant in SPECULATORS ("method" or "method=variant")."""
    method = name.partition("=")[0]
    settings = SPECULATOR_VARIANTS.get(method, {}).get(name, lambda target: {})(target)
    return {"method": method, "num_speculative_tokens": k, **settings}


def checked_speculation(engine, register_cache):
    """Check every step of a speculating engine: its schedule is plain scheduling's plus
    lookahead slots within the budgets; after it, no block past a sequence's tokens is kept, the
    prefix cache holds only kept tokens, and no KV write (target's or draft's) lands in a shared
    block."""
    s, k = engine.scheduler, engine.scheduler.num_lookahead_slots
    register_cache(engine)
    if hasattr(engine.proposer, "runner"):  # the draft's cache, paged by the same allocator
        register_cache(SimpleNamespace(kv_cache=engine.proposer.runner.kv_cache,
                                       allocator=engine.allocator, block_size=engine.block_size))

    def schedule():
        plain = copy.deepcopy(s)
        plain.num_lookahead_slots = 0
        expected, out = nanopaged.Scheduler.schedule(plain), nanopaged.Scheduler.schedule(s)
        slots = [n for _, n in out.lookahead]
        assert [(q.seq_id, n) for q, n in out.scheduled] == \
            [(q.seq_id, n) for q, n in expected.scheduled]
        # as many as fit: a sequence with fewer than it may take found the budget or pool spent
        got = {q.seq_id: n for q, n in out.lookahead}
        for q, n in out.scheduled:
            if q.num_computed_tokens + n == len(q) and q.num_output_tokens:
                want = min(k, engine.requests[q.request_id].params.max_tokens
                           - q.num_output_tokens - 1)
                room = len(q.block_table) * s.allocator.block_size - len(q)
                assert got.get(q.seq_id, 0) == want or \
                    out.num_batched_tokens == s.max_num_batched_tokens or \
                    s.allocator.num_free_blocks == 0 and room == got.get(q.seq_id, 0)
        assert [g.request_id for g in out.preempted] == [g.request_id for g in expected.preempted]
        for name in ("swap_out", "swap_in", "cow"):
            assert getattr(out.copies, name) == getattr(expected.copies, name)
        assert all(1 <= n <= k for n in slots)
        assert out.num_batched_tokens == expected.num_batched_tokens + sum(slots) <= \
            s.max_num_batched_tokens
        return out

    s.schedule = schedule
    real_step = engine.step

    def step():
        outputs = real_step()
        a, bs, held = engine.allocator, engine.block_size, Counter()
        for request in s.running:
            for seq in request.seqs:
                held.update(seq.block_table)
                assert len(seq.block_table) <= -(-len(seq) // bs), "a block past its tokens"
                for i, block_id in enumerate(seq.block_table):
                    if a.blocks[block_id].hash is not None:  # cached: kept, computed tokens only
                        assert (i + 1) * bs <= seq.num_computed_tokens
                        assert a.blocks[block_id].token_ids == tuple(seq.token_ids[i * bs:][:bs])
        assert all(a.blocks[b].ref_count == held[b] for b in range(a.num_blocks))
        return outputs

    engine.step = step
    return engine


@pytest.mark.speculative
@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mix=request_mixes(), name=st.sampled_from(["gpt2", "llama"]),
       speculator=st.sampled_from(SPECULATORS), k=st.integers(1, 5))
def test_speculative_greedy_output_is_the_targets_and_speculation_only_adds_lookahead(
        mix, name, speculator, k, no_writes_into_shared_blocks):
    prompts, max_tokens, priorities, engine_args = mix
    model = MODELS[name]
    engine = checked_speculation(
        Engine(model, speculative_config=speculative_config(speculator, k, model), **engine_args),
        no_writes_into_shared_blocks)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    ids = [engine.add_request(p, q, priority=r) for p, q, r in zip(prompts, params, priorities)]
    outputs = drain(engine)
    for i, prompt, m in zip(ids, prompts, max_tokens):
        assert outputs[i].outputs[0].token_ids == naive_greedy(model, prompt, m)
    stats = engine.stats()
    assert stats["num_accepted_tokens"] <= stats["num_proposed_tokens"]
    if speculator == "draft=target":  # float64: the draft's argmax is the target's
        assert stats["num_accepted_tokens"] == stats["num_proposed_tokens"]
    # every token is drawn once: a kept guess is one of them, never one more
    assert stats["num_generated_tokens"] == sum(max_tokens)
    event(f"proposed: {stats['num_proposed_tokens'] > 0}")
    assert_all_blocks_free(engine)


# Logits processors that read what a row has so far, as a user's would: one that pulls toward the
# token d back (a sequence that repeats itself, whose guesses the n-gram proposer often gets
# right) and one that bans the last output token
def echo(d, bias=4.0):
    def processor(prompt, output, logits):
        so_far = list(prompt) + list(output)
        logits = logits.clone()
        logits[so_far[-min(d, len(so_far))]] += bias
        return logits
    return processor


def ban_last(prompt, output, logits):
    return logits.index_fill(0, torch.tensor(output[-1:], dtype=torch.long), -math.inf)


OUTPUT_READERS = {"echo 2": echo(2), "echo 3": echo(3), "ban last": ban_last}


class RowsSeen:
    """A logits processor that changes nothing and records what each row it is asked about saw:
    (prompt, output so far)."""

    def __init__(self):
        self.rows = set()

    def __call__(self, prompt, output, logits):
        self.rows.add((tuple(prompt), tuple(output)))
        return logits


# Each of MODEL's 32 tokens decodes to one of these pieces: stop strings over their characters
# end samples often, across tokens and inside one
PIECES = ["a", "b", "ab", "ba", " ", "é", "☃", "a b"]


class PieceTokenizer:
    def decode(self, ids):
        return "".join(PIECES[t % len(PIECES)] for t in ids)


@st.composite
def every_sampling_parameter(draw, seed, seen):
    """SamplingParams with everything a step's draws read drawn at random: greedy or seeded,
    filters, penalties, min_tokens, logits processors that read the output, stop strings and
    stop token ids. seen (RowsSeen) records every row."""
    readers = draw(st.lists(st.sampled_from(sorted(OUTPUT_READERS)), max_size=2, unique=True))
    return SamplingParams(
        max_tokens=10, seed=seed, n=draw(st.integers(1, 2)), logprobs=2,
        temperature=draw(st.sampled_from([0, 0.5, 1.0])), top_k=draw(st.sampled_from([0, 3])),
        top_p=draw(st.sampled_from([1.0, 0.8])), min_p=draw(st.sampled_from([0.0, 0.1])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.5])),
        presence_penalty=draw(st.sampled_from([0.0, -1.5, 1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, -0.5, 0.8])),
        min_tokens=draw(st.integers(0, 3)),
        logits_processors=[OUTPUT_READERS[name] for name in readers] + [seen],
        stop=draw(st.lists(st.text("ab é☃", min_size=1, max_size=3), max_size=2)),
        include_stop_str_in_output=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, 31), max_size=2)))


def completions(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
              c.logprobs) for c in o.outputs] for o in outputs]


@pytest.mark.speculative
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=12), min_size=1,
                        max_size=5),
       seed=st.integers(0, 2**32), data=st.data(), speculator=st.sampled_from(SPECULATORS),
       k=st.integers(1, 4), mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       spare=st.integers(0, 24))
# a one-token prompt and k = 4 guesses: the blocks to publish were once counted from before 0
@example(prompts=[[0]], seed=0, data=None, speculator="draft=target", k=4, mode="recompute",
         caching=False, spare=0)
def test_speculation_changes_no_token_with_every_sampling_parameter_on(
        prompts, seed, data, speculator, k, mode, caching, spare):
    """Greedy and seeded requests with every parameter a draw reads (penalties, min_tokens,
    min_p, logits processors that read the output, stop strings and stop token ids) come out of
    a speculating engine as out of a plain one: tokens, text, why and where each stopped,
    logprobs. The row after guess j sees the output so far and guesses 0..j-1, as the same row
    would without speculation: each kept token was drawn by a row that saw exactly the prompt
    and the output before it."""
    seen = RowsSeen()
    params = [SamplingParams(max_tokens=10, temperature=0.5, seed=seed, ignore_eos=True,
                             logprobs=2, logits_processors=[seen])] if data is None else [
        data.draw(every_sampling_parameter(seed + i, seen)) for i in range(len(prompts))]
    n = max(p.n for p in params)
    worst = n * -(-(max(map(len, prompts)) + 10) // 2)  # from one request at a time to roomy
    settings_ = dict(block_size=2, num_blocks=worst + spare, preemption_mode=mode,
                     enable_prefix_caching=caching, max_num_batched_tokens=12,
                     tokenizer=PieceTokenizer())
    plain = Engine(MODEL, **settings_).generate(prompts, params)
    seen.rows.clear()
    engine = Engine(MODEL, speculative_config=speculative_config(speculator, k, MODEL),
                    **settings_)
    outputs = engine.generate(prompts, params)
    assert_same_but_rounding(completions(outputs), completions(plain))
    for prompt, o in zip(prompts, outputs):
        for c in o.outputs:
            assert all((tuple(prompt), tuple(c.token_ids[:j])) in seen.rows
                       for j in range(len(c.token_ids)))
    event(f"guesses kept: {engine.stats()['num_accepted_tokens'] > 0}")
    assert_all_blocks_free(engine)


@pytest.mark.speculative
def test_speculative_sampling_keeps_the_targets_distribution():
    # Many seeds of one prompt, a draft that often guesses wrong: the second token, given the
    # first, must follow the target's distribution (chi-square, 8 tokens, 7 degrees of freedom:
    # 24.3 is the 0.1% tail). Keeping guesses the target would not draw, or drawing the
    # replacement of a rejected guess from the draft's side, moves mass onto the guesses.
    target, draft = tiny_model(vocab_size=8, seed=3).float(), tiny_model(vocab_size=8, seed=4)
    with torch.no_grad():  # a flatter target: every token keeps some mass
        target.lm_head.weight.mul_(0.05)
    prompt, draws = [1, 2, 3], 3000
    engine = Engine(target, block_size=4, num_blocks=4000, max_num_seqs=512,
                    speculative_config={"method": "draft", "model": draft,
                                        "num_speculative_tokens": 2})
    outputs = engine.generate([prompt] * draws, [SamplingParams(max_tokens=3, seed=i)
                                                 for i in range(draws)])
    firsts = Counter(o.outputs[0].token_ids[0] for o in outputs)
    first = firsts.most_common(1)[0][0]
    seconds = Counter(o.outputs[0].token_ids[1] for o in outputs
                      if o.outputs[0].token_ids[0] == first)
    p = naive_logprobs(target.double(), prompt + [first]).exp()
    total = sum(seconds.values())
    chi2 = sum((seconds[t] - total * p[t].item()) ** 2 / (total * p[t].item()) for t in range(8))
    stats = engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_proposed_tokens"]  # both branches ran
    assert chi2 < 24.3, (chi2, seconds, p)


@pytest.mark.speculative
def test_lookahead_slots_are_reserved_from_what_plain_scheduling_left_and_given_back():
    # One decoding sequence of 5 tokens at block_size 4 (one block full, one with 1 slot used):
    # 4 guesses need the rest of the second block and one more block; rejected, it goes back.
    a = BlockAllocator(num_blocks=4, block_size=4)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    allocate_whole(a, seq)
    seq.num_computed_tokens = 4
    a.allocate_slots(seq, 1 + 4)  # its last token, then 4 guesses
    assert len(seq.block_table) == 3 and a.num_free_blocks == 1
    seq.num_computed_tokens = 5  # the target kept no guess: only token 5 was computed
    a.trim(seq)
    assert len(seq.block_table) == 2 and a.num_free_blocks == 2
    # the watermark keeps blocks from admission, not from guesses; max_tokens bounds them
    engine = Engine(MODEL, block_size=4, num_blocks=4, speculative_config=speculative_config(
        "draft=target", 12, MODEL))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=13, temperature=0))
    engine.step()  # prefill, first token
    out = engine.scheduler.schedule()
    # 4 tokens, then 11 guesses: with the token after them, the 13th output token
    assert [n for _, n in out.lookahead] == [11] and engine.allocator.num_free_blocks == 0


@pytest.mark.speculative
@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2},
     re.escape(f"method 'medusa' is not registered: SPECULATIVE_METHODS has "
               f"{sorted(nanopaged.SPECULATIVE_METHODS)} (`import speculative` registers")),
    ({"method": ["ngram"], "num_speculative_tokens": 2},
     re.escape("method ['ngram'] is not registered")),
    ({"method": "fixed_token", "num_speculative_tokens": 2, "token": 32}, "must be a token id"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": np.bool_(True)},
     "need ints prompt_lookup_max >= prompt_lookup_min >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_max >= prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": MODEL}, "unknown keys"),
    ({"method": "draft", "num_speculative_tokens": 2, "model": "gpt2"}, "must be a GPT"),
    ({"method": "draft", "num_speculative_tokens": 2, "model": tiny_model(vocab_size=16)},
     "vocab_size is 16, the target's 32"),
    ({"method": "draft", "num_speculative_tokens": 2, "model": tiny_model(max_seq_len=32)},
     "max_seq_len 32 is shorter"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_clear_errors(config, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, num_blocks=16, speculative_config=config)


@pytest.mark.speculative
@settings(max_examples=examples(20), deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=12), min_size=1,
                        max_size=3),
       token=st.integers(0, 31), k=st.integers(1, 4), name=st.sampled_from(["gpt2", "llama"]))
def test_a_method_a_fork_registers_runs_by_name_and_keeps_the_targets_output(prompts, token, k,
                                                                              name):
    """The suite's own method, found by its name in SPECULATIVE_METHODS with its own setting:
    the engine asks its proposer for every reserved slot, and greedy outputs are the target's."""
    model = MODELS[name]
    engine = Engine(model, block_size=4, num_blocks=48, speculative_config={
        "method": "fixed_token", "num_speculative_tokens": k, "token": token})
    assert type(engine.proposer) is FixedTokenProposer and engine.proposer.token == token
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == [naive_greedy(model, p, 8) for p in prompts]
    s = engine.stats()
    assert s["num_proposed_tokens"] > 0 and s["num_generated_tokens"] == 8 * len(prompts)
    assert_all_blocks_free(engine)


@pytest.mark.speculative
def test_a_speculative_config_takes_numpy_and_torch_integers_as_ints():
    engine = Engine(MODEL, num_blocks=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": np.int64(3),
        "prompt_lookup_max": torch.tensor(3), "prompt_lookup_min": np.int8(1)})
    p = engine.proposer
    assert repr((p.num_speculative_tokens, p.max_n, p.min_n)) == repr((3, 3, 1))
    assert repr(engine.scheduler.num_lookahead_slots) == "3" and serves_normally(engine)


@pytest.mark.speculative
def test_a_draft_shares_the_byte_budget_and_an_8bit_cache_with_its_target():
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7], [9] * 9]
    params = SamplingParams(max_tokens=12, temperature=0)
    budget = 40 * 2 * 2 * (2 * 32)  # 40 blocks: K and V, 2 layers, 2 tokens of 32 bytes each
    plain = Engine(MODEL, block_size=2, kv_cache_bytes=budget, kv_cache_dtype="fp8")
    engine = Engine(MODEL, block_size=2, kv_cache_bytes=budget, kv_cache_dtype="fp8",
                    speculative_config=speculative_config("draft=target", 3, MODEL))
    draft_cache = engine.proposer.runner.kv_cache
    assert plain.allocator.num_blocks == 40 and engine.allocator.num_blocks == 20  # two caches
    assert draft_cache.dtype == engine.kv_cache.dtype == torch.float8_e4m3fn
    assert draft_cache.shape[2] == engine.kv_cache.shape[2] == 20
    # stored bytes depend on the token and its context alone, so speculating changes no token
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert engine.stats()["num_accepted_tokens"] == engine.stats()["num_proposed_tokens"] > 0


@pytest.mark.speculative
def test_beam_search_is_refused_when_speculating_and_n_samples_run():
    engine = Engine(MODEL, block_size=4, num_blocks=64,
                    speculative_config=speculative_config("draft=target", 3, MODEL))
    with pytest.raises(ValueError, match="beam search does not run with speculative decoding"):
        engine.add_request([1, 2, 3], SamplingParams(beam_width=2))
    assert serves_normally(engine)


def naive_ngram(tokens, max_n, min_n, k):
    """Prompt lookup by its definition: for n from max_n down to min_n, the latest earlier
    occurrence of the last n tokens, and up to k tokens after it; [] if none."""
    for n in range(max_n, min_n - 1, -1):
        earlier = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if n < len(tokens) and earlier:
            return tokens[max(earlier) + n:max(earlier) + n + k]
    return []


@pytest.mark.speculative
@settings(max_examples=examples(300), deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30), max_n=st.integers(1, 5),
       spread=st.integers(0, 4), k=st.integers(1, 6))
def test_the_ngram_proposer_is_prompt_lookup_by_its_definition(tokens, max_n, spread, k):
    import speculative
    min_n = max(1, max_n - spread)
    assert speculative.ngram_proposal(tokens, max_n, min_n, k) == \
        naive_ngram(tokens, max_n, min_n, k)


@pytest.mark.speculative
@pytest.mark.parametrize("speculator", ["ngram", "draft=target", "unrelated draft"])
def test_proposed_and_accepted_counts_are_what_the_acceptance_rule_implies(speculator):
    """Every guess is recorded as the proposer makes it; a guess is kept while it equals the
    token the target then generated at its place: the stats' proposed and accepted tokens are
    those sums (a draft equal to the target keeps every guess), and each request's tokens are the
    target's own."""
    model = MODELS["gpt2"]
    config = speculative_config({"unrelated draft": "draft=other"}.get(speculator, speculator),
                                3, model)
    engine = Engine(model, block_size=2, num_blocks=128, speculative_config=config)
    guesses, propose = [], engine.proposer.propose

    def recorded(out):
        proposals = propose(out)
        guesses.extend((seq.request_id, seq.num_output_tokens, proposals[seq.seq_id])
                       for seq, _ in out.lookahead if seq.seq_id in proposals)
        return proposals
    engine.proposer.propose = recorded
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5, 4], [6, 7, 0, 6, 7]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    tokens = {o.request_id: o.outputs[0].token_ids for o in outs}
    accepted = 0
    for request_id, done, guess in guesses:  # guess j is for output token done + j
        after = tokens[request_id][done:]
        accepted += next((j for j, (g, t) in enumerate(zip(guess, after)) if g != t),
                         min(len(guess), len(after)))
    s = engine.stats()
    assert s["num_proposed_tokens"] == sum(len(g) for *_, g in guesses) > 0
    assert s["num_accepted_tokens"] == accepted
    if speculator == "draft=target":
        assert accepted == s["num_proposed_tokens"]
    assert list(tokens.values()) == [naive_greedy(model, p, 12) for p in prompts]


def model_ending_at(eos_token_id):  # LLAMA (its weights shared), with an end token
    model = copy.copy(LLAMA)
    model.config = dataclasses.replace(LLAMA.config, eos_token_id=eos_token_id)
    return model


@pytest.mark.speculative
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 31), min_size=2, max_size=8), k=st.integers(1, 4),
       speculator=st.sampled_from(["draft=target", *SPECULATORS]), at=st.integers(1, 11),
       stop=st.sampled_from(["stop_token_ids", "eos", "stop"]))
@example(prompt=[1, 2, 3, 1, 2, 3, 1], k=3, speculator="draft=target", at=2,
         stop="stop_token_ids")
def test_the_accepted_count_holds_where_a_stop_ends_a_sample_on_a_guess(prompt, k, speculator,
                                                                        at, stop):
    """A stop the draft can guess: a token the target itself draws (the first at or after a
    drawn place that it had not drawn before), as a stop token id, as the model's end token, or
    its letter as a stop string. The sample ends there; each guess counts as accepted while it
    equals the tokens the sample kept, so a stop kept on an accepted guess counts as accepted
    too (the kept tokens are not the accepted ones plus one there: nothing is drawn after it).
    LLAMA, whose greedy outputs vary (MODEL's mostly repeat one token)."""
    def name(t):  # what the stop matches
        return UserTokenizer().decode([t]) if stop == "stop" else t
    plain = naive_greedy(LLAMA, prompt, 12)
    new = [j for j in range(at, 12) if name(plain[j]) not in {name(t) for t in plain[:j]}]
    end = new[0] if new else min(j for j in range(12) if name(plain[j]) == name(plain[at]))
    token = plain[end]
    model = model_ending_at(token) if stop == "eos" else LLAMA
    params = SamplingParams(max_tokens=12, temperature=0,
                            stop_token_ids=[token] if stop == "stop_token_ids" else None,
                            stop=[name(token)] if stop == "stop" else None)
    engine = Engine(model, block_size=2, num_blocks=64, tokenizer=UserTokenizer(),
                    speculative_config=speculative_config(speculator, k, model))
    guesses, propose = [], engine.proposer.propose

    def recorded(out):
        proposals = propose(out)
        guesses.extend((seq.num_output_tokens, proposals[seq.seq_id])
                       for seq, _ in out.lookahead if seq.seq_id in proposals)
        return proposals
    engine.proposer.propose = recorded
    (out,) = engine.generate([prompt], params)
    tokens = out.outputs[0].token_ids
    assert tokens == plain[:end + 1] and out.outputs[0].finish_reason == "stop"
    accepted = sum(next((j for j, (g, t) in enumerate(zip(guess, tokens[done:])) if g != t),
                        min(len(guess), len(tokens) - done)) for done, guess in guesses)
    s = engine.stats()
    assert s["num_proposed_tokens"] == sum(len(g) for _, g in guesses)
    assert s["num_accepted_tokens"] == accepted
    on_a_guess = any(done <= end < done + len(guess) and guess[:end + 1 - done] == tokens[done:]
                     for done, guess in guesses)
    event(f"a stop ended the sample on an accepted guess: {on_a_guess}")


@pytest.mark.speculative
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=request_mixes(), speculator=st.sampled_from(SPECULATORS), k=st.integers(1, 4))
@example(mix=([[1, 2, 3, 1, 2, 3, 1]], [9], [0], dict(block_size=4, num_blocks=16)),
         speculator="draft=target", k=3)
def test_a_step_keeps_the_guesses_the_target_confirms_and_one_token_more(mix, speculator, k):
    """Speculation's gain: in a step that verifies a sample's guesses, the sample gains the
    guesses its target confirmed and then the target's own next token (the one at the first
    rejected guess, or after the last guess when all were kept: k + 1 tokens for one step), but
    no more than max_tokens leaves. Its tokens are the target's either way, so only the tokens
    gained a step show a bonus token dropped."""
    prompts, max_tokens, priorities, engine_args = mix
    engine = Engine(MODEL, speculative_config=speculative_config(speculator, k, MODEL),
                    **engine_args)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    ids = [engine.add_request(p, q, priority=r) for p, q, r in zip(prompts, params, priorities)]
    max_of = dict(zip(ids, max_tokens))
    steps, propose = [], engine.proposer.propose

    def recorded(out):  # each step's guesses: (request, its output tokens then, the guesses)
        proposals = propose(out)
        steps[-1][0].extend((seq.request_id, seq.num_output_tokens, proposals[seq.seq_id])
                            for seq, _ in out.lookahead if proposals.get(seq.seq_id))
        return proposals
    engine.proposer.propose = recorded
    tokens = {}
    for _ in range(1000):  # bounded: see drain
        if not engine.requests:
            break
        steps.append(([], {}))
        for out in engine.step():
            steps[-1][1][out.request_id] = len(out.outputs[0].token_ids)
            tokens[out.request_id] = out.outputs[0].token_ids
    assert not engine.requests
    verified = 0
    for guesses, lengths in steps:
        for request_id, done, guess in guesses:
            after = tokens[request_id][done:]
            confirmed = next((j for j, (g, t) in enumerate(zip(guess, after)) if g != t),
                             len(guess))
            assert lengths[request_id] - done == min(confirmed + 1, max_of[request_id] - done)
            verified += 1
    assert [tokens[i] for i in ids] == [naive_greedy(MODEL, p, m)
                                        for p, m in zip(prompts, max_tokens)]
    event(f"verified guesses: {verified > 0}")


@pytest.mark.speculative
def test_speculation_with_the_cache_off_keeps_the_blocks_its_guesses_filled():
    """One-token prompts, a draft other than the target, four guesses, blocks of one token and
    no prefix cache: giving back the blocks of rejected guesses after a step that kept some read
    the step's kept tokens from the wrong place (before the sequence's start) and failed."""
    engine = Engine(MODEL, block_size=1, num_blocks=7, enable_prefix_caching=False,
                    max_num_batched_tokens=7, max_num_seqs=1,
                    speculative_config=speculative_config("draft=other", 4, MODEL))
    outputs = engine.generate([[0]] * 6, [SamplingParams(max_tokens=m, temperature=0)
                                          for m in [1, 1, 1, 1, 1, 6]])
    assert [o.outputs[0].token_ids for o in outputs] == \
        [naive_greedy(MODEL, [0], m) for m in [1, 1, 1, 1, 1, 6]]
    assert_all_blocks_free(engine)


# -----------------------------------------------------------------------------
# Read policies (nanopaged: key bounds, per-head tables) and quest.py's selection  (-m read_policy)


def quest_engine(model=LLAMA, token_budget=4, dense_layers=1, **settings):
    """An engine that reads by Quest."""
    return Engine(model, read_policy="quest",
                  read_policy_config=dict(token_budget=token_budget, dense_layers=dense_layers),
                  **settings)


def policy_engine(name, model=LLAMA, **settings):
    """An engine that reads by the read policy of that name, with its READ_POLICY_SETTINGS."""
    return Engine(model, read_policy=name, read_policy_config=READ_POLICY_SETTINGS.get(name),
                  **settings)


@st.composite
def written_keys(draw):
    """A cache's blocks written in chunks, as steps write them: (block_size, num_blocks, n_kv_head,
    group size, head_dim, cache dtype, chunks of slots, seed)."""
    block_size, num_blocks = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    slots = list(range(draw(st.integers(1, block_size * num_blocks))))
    chunks, i = [], 0
    while i < len(slots):
        n = draw(st.integers(1, len(slots) - i))
        chunk = slots[i:i + n]
        if draw(st.booleans()):  # a token that is not written (slot -1)
            chunk.insert(draw(st.integers(0, len(chunk))), -1)
        chunks.append(chunk)
        i += n
    return (block_size, num_blocks, draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3])),
            draw(st.sampled_from([2, 8])), draw(st.sampled_from(["auto", "fp8", "fp8_e5m2"])),
            chunks, draw(st.integers(0, 2**16)))


@pytest.mark.read_policy
@settings(max_examples=examples(100), deadline=None)
@given(written_keys())
def test_key_bounds_are_min_and_max_and_quests_score_bounds_every_key(case):
    """Keys stored chunk by chunk into blocks that held other keys before: each block's bounds
    are the min and max of what it holds, as attention reads it (dequantized, for an 8-bit
    cache); and a block's Quest score bounds q.k of each of its keys, for every query head of
    the KV head's group (the group's score is the largest)."""
    import quest
    block_size, num_blocks, n_kv_head, G, head_dim, cache_dtype, chunks, seed = case
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32
    cache = dtype if cache_dtype == "auto" else kernel.KV_CACHE_DTYPES[cache_dtype]
    shape = (num_blocks, block_size, n_kv_head, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=cache), torch.zeros(shape, dtype=cache)
    scale = {} if cache == dtype else {"k_scale": torch.tensor(0.05), "v_scale": torch.tensor(1.)}
    bounds = torch.randn(2, num_blocks, n_kv_head, head_dim, generator=gen)  # what was there
    for chunk in chunks:
        k = 4 * torch.randn(len(chunk), n_kv_head, head_dim, generator=gen)
        slots = torch.tensor(chunk)
        kernel.store_kv_torch(k, k, k_cache, v_cache, slots, **scale)
        nanopaged.update_key_bounds(bounds, k_cache, slots, scale.get("k_scale"))
    n = max(s for chunk in chunks for s in chunk) + 1  # slots written: [0, n)
    keys = kernel.dequantize(k_cache.flatten(0, 1)[:n], scale.get("k_scale"), dtype)
    for b in range(nanopaged.cdiv(n, block_size)):
        held = keys[b * block_size:(b + 1) * block_size]
        assert torch.equal(bounds[0, b], held.amin(0)) and torch.equal(bounds[1, b], held.amax(0))
    q = torch.randn(1, n_kv_head * G, head_dim, generator=gen, dtype=torch.float64)
    q[0, :, 0] = 0  # a zero channel takes either bound
    table = torch.arange(num_blocks)[None]
    score = quest.page_scores(q, bounds.double(), table)[0]                      # (nkv, W)
    qk = torch.einsum("hd,khd->hk", q[0], keys.double().repeat_interleave(G, dim=1))  # (nh, n)
    for t in range(n):
        for h in range(n_kv_head * G):
            bound = score[h // G, t // block_size]
            assert qk[h, t] <= bound + 1e-12 * (1 + bound.abs())  # summed in another order


def naive_quest(q, lo, hi, tables, seq_lens, block_size, token_budget):
    """Quest's selection with Python lists: each block's score, the largest over a KV head's
    query heads of sum_i max(q_i lo_i, q_i hi_i); per (sequence, KV head) the last block and the
    top (pages - 1) of the others by score, the earlier of equal ones first."""
    n_kv_head = lo.shape[1]
    G = q.shape[1] // n_kv_head
    pages = max(1, token_budget // block_size)
    kept = []
    for s, seq_len in enumerate(seq_lens):
        n = nanopaged.cdiv(seq_len, block_size)
        kept.append([])
        for h in range(n_kv_head):
            def score(j):
                b = tables[s][j]
                return max(sum(max(x * a, x * c) for x, a, c in zip(q[s, g].tolist(),
                                                                   lo[b, h].tolist(),
                                                                   hi[b, h].tolist()))
                           for g in range(h * G, (h + 1) * G))
            ranked = sorted(range(n - 1), key=lambda j: (-score(j), j))
            kept[s].append(sorted(ranked[:pages - 1] + [n - 1]))
    return kept


@pytest.mark.read_policy
@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), block_size=st.integers(1, 4), n_kv_head=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2]), token_budget=st.integers(1, 20), layer=st.integers(0, 3),
       dense_layers=st.integers(0, 2))
def test_quest_selects_the_naive_top_k_by_bound_ties_to_the_earlier_block(
        data, block_size, n_kv_head, G, token_budget, layer, dense_layers):
    """Small integer queries and bounds, so equal scores are common: Quest keeps what the naive
    ranking keeps, and reads every block of a dense layer."""
    import quest
    num_blocks, head_dim = 12, 3
    seq_lens = data.draw(st.lists(st.integers(1, 6 * block_size), min_size=1, max_size=3))
    width = max(nanopaged.cdiv(n, block_size) for n in seq_lens)
    tables = [data.draw(st.permutations(range(num_blocks)))[:width] for _ in seq_lens]
    ints = st.integers(-2, 2)
    q = torch.tensor(data.draw(st.lists(ints, min_size=len(seq_lens) * n_kv_head * G * head_dim,
                                        max_size=len(seq_lens) * n_kv_head * G * head_dim)),
                     dtype=torch.float64).view(len(seq_lens), n_kv_head * G, head_dim)
    a, b = (torch.tensor(data.draw(st.lists(ints, min_size=num_blocks * n_kv_head * head_dim,
                                            max_size=num_blocks * n_kv_head * head_dim)),
                         dtype=torch.float64).view(num_blocks, n_kv_head, head_dim)
            for _ in range(2))
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    policy = quest.Quest(token_budget=token_budget, dense_layers=dense_layers)
    keep = policy.select(layer, q, torch.stack([lo, hi]), torch.tensor(tables, dtype=torch.int32),
                         torch.tensor(seq_lens, dtype=torch.int32), block_size)
    if layer < dense_layers:
        assert keep is None
        return
    got = [[keep[s, h].nonzero().flatten().tolist() for h in range(n_kv_head)]
           for s in range(len(seq_lens))]
    assert got == naive_quest(q, lo, hi, tables, seq_lens, block_size, token_budget)


@pytest.mark.read_policy
@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), block_size=st.integers(1, 4), n_kv_head=st.sampled_from([1, 3]))
def test_a_selection_becomes_per_head_tables_of_the_kept_blocks_and_their_tokens(
        data, block_size, n_kv_head):
    """Whatever a policy keeps: each head's table lists its kept blocks in order, the last
    (being written) always, then -1s; its length counts their tokens, the last block's own."""
    seq_lens = data.draw(st.lists(st.integers(1, 5 * block_size), min_size=1, max_size=3))
    width = max(nanopaged.cdiv(n, block_size) for n in seq_lens)
    width += data.draw(st.integers(0, 2))  # padding past every sequence's blocks
    tables = torch.tensor([data.draw(st.permutations(range(20)))[:width] for _ in seq_lens],
                          dtype=torch.int32)
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(seq_lens) * n_kv_head *
                                           width, max_size=len(seq_lens) * n_kv_head * width)))
    keep = keep.view(len(seq_lens), n_kv_head, width)
    got, lens = read_policy.selected_tables(keep, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                          block_size)
    for s, seq_len in enumerate(seq_lens):
        n = nanopaged.cdiv(seq_len, block_size)
        for h in range(n_kv_head):
            read = [j for j in range(n - 1) if keep[s, h, j]] + [n - 1]
            row = got[s, h].tolist()
            assert row == [int(tables[s, j]) for j in read] + [-1] * (got.shape[2] - len(read))
            assert lens[s, h] == (len(read) - 1) * block_size + seq_len - (n - 1) * block_size


def assert_key_bounds_are_the_keys(engine, exact=True):
    """Every block a live sequence holds, on the device or swapped out to the CPU, keeps the
    min and max of the keys of its computed tokens, recomputed from K where the block is (as
    attention reads it: an 8-bit cache's dequantized with its layer's scale; one KV cache
    group); or, not exact, bounds them. Returns how many blocks it checked: none where the
    engine's read policy keeps no bounds."""
    r, s, bs = engine.model_runner, engine.scheduler, engine.block_size
    if r.key_bounds is None:
        return 0

    def read(keys):  # (L, n, nkv, hs) as stored -> as attended
        return torch.stack([kernel.dequantize(k, scales.get("k_scale"), r.key_bounds.dtype)
                            for k, scales in zip(keys, r.kv_scales)])
    places = [(s.running, lambda b: r.kv_cache[0, :, b], lambda b: r.key_bounds[:, :, b]),
              (s.swapped, lambda b: r.cpu_kv_cache[b, 0], lambda b: r.cpu_key_bounds[b])]
    checked = 0
    for queue, keys_at, bounds_at in places:
        for request in queue:
            for seq in request.seqs:
                n = seq.num_computed_tokens
                for j, b in enumerate(seq.block_tables[0].tolist()[:nanopaged.cdiv(n, bs)]):
                    keys = read(keys_at(b)[:, :min(bs, n - j * bs)])       # (L, n, nkv, hs)
                    lo, hi = bounds_at(b)
                    if exact:
                        assert torch.equal(lo, keys.amin(1)), (seq.seq_id, j, b)
                        assert torch.equal(hi, keys.amax(1)), (seq.seq_id, j, b)
                    assert bool((lo <= keys.amin(1)).all() & (hi >= keys.amax(1)).all())
                    checked += 1
    return checked


@pytest.mark.read_policy
@pytest.mark.parametrize("name", SELECTING)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_key_bounds_move_with_their_blocks(
        name, mode, kv_cache_dtype):
    """Beams and parallel samples (copy-on-write), in a pool too small for them all (preemption:
    recompute, or swap out and in), under every read policy that thins what decodes read: every
    request ends and gives its blocks back; and, where the policy keeps key bounds, after every
    step every block a sequence holds, wherever it is, keeps the bounds of its keys."""
    backend = "torch"  # a backend that reads per-head tables
    engine = policy_engine(name, block_size=2, num_blocks=27, preemption_mode=mode,
                           max_num_batched_tokens=8, attention_backend=backend,
                           kv_cache_dtype=kv_cache_dtype)
    runner, moved = engine.model_runner, Counter()
    real_copy_blocks = runner.copy_blocks

    def copy_blocks(copies):
        moved.update(name for name in ("swap_out", "swap_in", "cow") if getattr(copies, name))
        real_copy_blocks(copies)

    runner.copy_blocks = copy_blocks
    prompts = [[(5 * i + j) % 32 for j in range(6 + i)] for i in range(4)]
    for prompt, params in zip(prompts, [
            SamplingParams(max_tokens=10, beam_width=3),
            SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7),
            SamplingParams(max_tokens=10, temperature=0),
            SamplingParams(max_tokens=10, beam_width=2)]):
        engine.add_request(prompt, params)
    checked = sum(assert_key_bounds_are_the_keys(engine) for _ in stepped(engine, 500))
    assert (checked > 0) == (name in BOUNDED) and moved["cow"], moved
    assert engine.stats()["num_preemptions"] and (
        mode == "recompute" or moved["swap_out"] and moved["swap_in"]), moved
    assert_all_blocks_free(engine)


@pytest.mark.read_policy
@pytest.mark.parametrize("name", SELECTING)
@pytest.mark.parametrize("fail_at", [2, 5, 9, 14])
def test_a_failed_step_leaves_bounds_that_bound_and_its_retry_the_exact_ones(name, fail_at,
                                                                            monkeypatch):
    """A layer raises mid-step, after earlier layers stored K (and updated bounds, where the
    read policy keeps them): the step is undone, its blocks' bounds still bound their computed
    keys, the next steps make them exact again, and every request ends as in a run without the
    failure."""
    prompts = [[(5 * i + j) % 32 for j in range(4 + 3 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0)
    real_forward, calls = nanopaged.MLP.forward, [0]

    def forward(self, x):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected")
        return real_forward(self, x)

    def run(engine):
        for prompt in prompts:
            engine.add_request(prompt, params)
        outs, failed = {}, 0
        for _ in range(200):
            if not engine.requests:
                break
            try:
                outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
                exact = True  # a retry writes the same keys where the undone step wrote
            except RuntimeError as e:
                assert "injected" in str(e)
                failed += 1
                exact = False  # the undone step's keys stay in its blocks' bounds till then
            assert_key_bounds_are_the_keys(engine, exact)
        return outs, failed

    backend = "torch"  # a backend that reads per-head tables
    settings_ = dict(block_size=2, num_blocks=16, max_num_batched_tokens=6,
                     attention_backend=backend)
    expected, _ = run(policy_engine(name, **settings_))
    monkeypatch.setattr(nanopaged.MLP, "forward", forward)
    outs, failed = run(policy_engine(name, **settings_))
    assert failed == 1 and outs == expected


@pytest.mark.read_policy
@pytest.mark.tier
@pytest.mark.parametrize("name", BOUNDED)
def test_key_bounds_go_to_the_cpu_tier_and_come_back_with_their_blocks(name):
    """The returning conversation with the CPU tier, read by a policy that keeps key bounds:
    its blocks come back from the tier, and every cached block on either tier keeps the bounds
    of its keys."""
    backend = "torch"  # a backend that reads per-head tables
    engine = policy_engine(name, MODEL, block_size=4, num_blocks=12, cpu_cache_bytes=64 * 4096,
                           attention_backend=backend)
    out, _ = returning_conversation(engine)
    assert out.num_cached_tokens == 12 and engine.stats()["num_reloaded_blocks"] == 3
    r, a = engine.model_runner, engine.allocator
    held = [(r.kv_cache[0, :, b.block_id], r.key_bounds[:, :, b.block_id])
            for b in a.blocks if b.hash is not None]
    held += [(r.cpu_kv_cache[b.block_id, 0], r.cpu_key_bounds[b.block_id])
             for b in a.swap_pool.blocks if b.hash is not None]
    assert len(held) >= 6
    for keys, bounds in held:  # a cached block is full: every slot a key    (L, bs, nkv, hs)
        assert torch.equal(bounds[0], keys.amin(1)) and torch.equal(bounds[1], keys.amax(1))


@pytest.mark.read_policy
@settings(max_examples=examples(20), deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=12), min_size=1,
                        max_size=3),
       max_tokens=st.integers(1, 8), block_size=st.sampled_from([1, 2, 4]))
def test_all_is_todays_path_and_quest_within_its_budget_reads_the_same(prompts, max_tokens,
                                                                         block_size):
    """read_policy="all" keeps nothing and changes nothing: the same tokens, logprobs and K/V as
    an engine without the setting; Quest with a budget of the whole context (every layer
    selecting) gives the same tokens and logprobs, bit for bit."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2)
    plain = Engine(LLAMA, block_size=block_size, num_blocks=64)
    named = Engine(LLAMA, block_size=block_size, num_blocks=64, read_policy="all")
    assert named.model_runner.key_bounds is None and named.model_runner.read_policy is None
    backend = "torch"  # a backend that reads per-head tables
    ample = quest_engine(token_budget=LLAMA.config.max_seq_len, dense_layers=0,
                         block_size=block_size, num_blocks=64, attention_backend=backend)
    outs = [[o.outputs[0] for o in e.generate(prompts, params)]
            for e in (plain, named, ample)]
    for other in outs[1:]:
        assert [o.token_ids for o in other] == [o.token_ids for o in outs[0]]
        assert [o.logprobs for o in other] == [o.logprobs for o in outs[0]]
    assert torch.equal(plain.kv_cache, named.kv_cache)


@pytest.mark.read_policy
@pytest.mark.parametrize("token_budget", [4, 64])
def test_a_hybrid_models_window_layers_read_as_their_kind_says_under_quest(token_budget):
    """A full-attention layer beside a sliding window (two KV cache groups): Quest selects for
    the full layer alone, the window reads its own; within the budget the tokens are the same as
    without it, and under a small one every held block of the full group keeps its bounds."""
    params = SamplingParams(max_tokens=10, temperature=0)
    prompts = [[(3 * i + j) % 32 for j in range(7 + 5 * i)] for i in range(3)]
    plain = Engine(HYBRID, block_size=2, num_blocks=64).generate(prompts, params)
    backend = "torch"  # a backend that reads per-head tables
    engine = quest_engine(HYBRID, token_budget=token_budget, dense_layers=0, block_size=2,
                          num_blocks=64, attention_backend=backend)
    for prompt in prompts:
        engine.add_request(prompt, params)
    checked, outs = 0, {}
    for step in stepped(engine, 200):
        checked += assert_key_bounds_are_the_keys(engine)
        outs.update((o.request_id, o.outputs[0].token_ids) for o in step if o.finished)
    assert checked and len(outs) == 3
    if token_budget == 64:
        assert [outs[i] for i in range(3)] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.read_policy
@pytest.mark.parametrize("token_budget", [1, 2, 4, 6, 64])
def test_decodes_attend_to_the_blocks_quest_selects_and_the_rest_to_all(token_budget):
    """One layer's attention over a step of two decodes and a prefill chunk: each decode's query
    heads attend to the keys of the blocks naive Quest keeps for their KV head (the last one
    partly filled), the chunk to its whole context."""
    import quest
    torch.manual_seed(0)
    config = LLAMA.config  # 4 query heads on 2 KV heads, head_dim 8
    layer = nanopaged.CausalSelfAttention(config, 1).double()
    bs, nkv, hs = 2, config.n_kv_head, config.head_dim
    seq_lens, q_lens = [9, 4, 11], [1, 3, 1]
    tables = [[7, 2, 12, 0, 5, -1], [1, 3, -1, -1, -1, -1], [4, 6, 8, 9, 10, 11]]
    k_cache, v_cache = torch.randn(2, 13, bs, nkv, hs, dtype=torch.float64)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, n in zip(tables, seq_lens)
                          for p in range(n)])
    bounds = torch.zeros(2, 13, nkv, hs, dtype=torch.float64)
    nanopaged.update_key_bounds(bounds, k_cache, slots)
    q = torch.randn(sum(q_lens), config.n_head, hs, dtype=torch.float64)
    cu = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    group = nanopaged.GroupBatch(block_tables=torch.tensor(tables, dtype=torch.int32),
                                 slot_mapping=slots[:5], seq_lens=torch.tensor(seq_lens).int(),
                                 cu_seqlens_q=cu, max_q_len=3)
    backend = "torch"  # a backend that reads per-head tables
    batch = SimpleNamespace(backend=kernel.ATTENTION_BACKENDS[backend],
                            read_policy=quest.Quest(token_budget=token_budget, dense_layers=0))
    kv = nanopaged.LayerKV(k_cache=k_cache, v_cache=v_cache, group=group, scales={},
                           key_bounds=bounds)
    y = read_policy.attend_selected(layer, q, kv, batch)
    keys = [(k_cache.flatten(0, 1)[slots[sum(seq_lens[:s]):sum(seq_lens[:s + 1])]],
             v_cache.flatten(0, 1)[slots[sum(seq_lens[:s]):sum(seq_lens[:s + 1])]])
            for s in range(3)]                                                 # (n, nkv, hs)
    ks, vs = keys[1]
    want = naive_attention(q[1:4], ks, vs, torch.tensor([0, 3]).int(), torch.tensor([4]).int(),
                           layer.scale)
    torch.testing.assert_close(y[1:4], want, rtol=1e-12, atol=1e-12)
    decodes = [0, 2]
    kept = naive_quest(q[[0, 4]], bounds[0], bounds[1], [tables[s] for s in decodes],
                       [seq_lens[s] for s in decodes], bs, token_budget)
    for row, s, blocks in zip([0, 4], decodes, kept):
        for h, read in enumerate(blocks):
            pos = [p for j in read for p in range(j * bs, min((j + 1) * bs, seq_lens[s]))]
            k, v = keys[s][0][pos, h], keys[s][1][pos, h]                      # (n, hs)
            heads = slice(2 * h, 2 * h + 2)
            want = torch.softmax(q[row, heads] @ k.T * layer.scale, dim=-1) @ v
            torch.testing.assert_close(y[row, heads], want, rtol=1e-12, atol=1e-12)


@pytest.mark.read_policy
@pytest.mark.parametrize("name", READ_POLICY_NAMES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_pools_count_the_key_bounds_bytes(name, kv_cache_dtype):
    """A byte budget buys fewer blocks when each keeps its key bounds (in the model's dtype,
    whatever the cache's), on the device and in the CPU pool alike; and as many as without a
    read policy when the policy keeps none."""
    backend = "torch"  # a backend that reads per-head tables
    engine = policy_engine(name, block_size=4, num_blocks=None, kv_cache_bytes=100_000,
                           preemption_mode="swap", swap_space=2**-10,
                           cpu_cache_bytes=50_000, kv_cache_dtype=kv_cache_dtype,
                           attention_backend=backend)
    r, c = engine.model_runner, LLAMA.config
    kv = r.kv_cache[:, :, 0].numel() * r.kv_cache.itemsize
    bounds = 0
    if name in BOUNDED:  # min and max, float64 like the model
        bounds = 2 * c.n_layer * c.n_kv_head * c.head_dim * 8
        assert r.key_bounds[:, :, 0].numel() * r.key_bounds.itemsize == bounds
    else:
        assert r.key_bounds is None and r.cpu_key_bounds is None
    num_blocks = 100_000 // (kv + bounds)
    assert engine.stats()["num_blocks"] == num_blocks == r.kv_cache.shape[2]
    num_cpu_blocks = min(num_blocks, 2**20 // (kv + bounds)) + 50_000 // (kv + bounds)
    assert r.cpu_kv_cache.shape[0] == num_cpu_blocks
    if name in BOUNDED:
        assert r.key_bounds.shape[2] == num_blocks and r.cpu_key_bounds.shape[0] == num_cpu_blocks


@pytest.mark.read_policy
@pytest.mark.parametrize("kwargs, message", [
    (dict(read_policy="streaming"),
     f"Engine: read_policy must be one of {READ_POLICY_NAMES}, got 'streaming'"),
    (dict(read_policy=None), f"Engine: read_policy must be one of {READ_POLICY_NAMES}, got None"),
    *[(dict(read_policy=name, read_policy_config=[64]), "read_policy_config must be a dict")
      for name in READ_POLICY_NAMES],
    *[(dict(read_policy=name, read_policy_config=dict(budget_of_nobody=64)),
       f"read_policy_config {{'budget_of_nobody': 64}} does not fit read_policy {name!r}")
      for name in READ_POLICY_NAMES],
    # what cannot work with any policy that thins what decodes read
    *[(dict(read_policy=name, attention_backend="flex"),
       f"read_policy={name!r} reads a selection of blocks per KV head, which this "
       "attention_backend does not take") for name in SELECTING],
    *[(dict(read_policy=name, speculative_config=dict(method="ngram", num_speculative_tokens=2)),
       f"read_policy={name!r} does not run with speculative_config") for name in SELECTING],
    # Quest's own settings
    (dict(read_policy="quest", read_policy_config=dict(token_budget=0)),
     "Quest's token_budget must be an int >= 1, got 0"),
    (dict(read_policy="quest", read_policy_config=dict(token_budget=1.5)),
     "Quest's token_budget must be an int >= 1, got 1.5"),
    (dict(read_policy="quest", read_policy_config=dict(token_budget=True)),
     "Quest's token_budget must be an int >= 1, got True"),
    (dict(read_policy="quest", read_policy_config=dict(dense_layers=-1)),
     "Quest's dense_layers must be an int >= 0, got -1"),
])
def test_bad_read_policy_settings_are_clear_errors(kwargs, message):
    backend = "torch"  # a backend that reads per-head tables
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(MODEL, block_size=4, num_blocks=8, **{"attention_backend": backend, **kwargs})


@pytest.mark.read_policy
def test_a_forks_read_policy_runs_and_each_decode_reads_only_the_blocks_it_chose(monkeypatch):
    """Registered by name (at the top of this file) with its settings, with no edit to
    nanopaged.py: the backend is given, for each decoding sequence and KV head, the table of
    exactly its first and recent blocks, and the engine serves every request to its end."""
    thinned = []

    def attend(q, k_cache, v_cache, meta, scale, **kwargs):
        if meta.block_tables.dim() == 3:  # the policy's tables: check them against the tables
            tables = {tuple(seq.block_tables[0].tolist()) for r in engine.scheduler.running
                      for seq in r.seqs}
            for row in meta.block_tables.flatten(0, 1).tolist():
                read = [b for b in row if b >= 0]
                ids = next(t for t in tables if t[-1] == read[-1])  # whose last block it reads
                assert read == sorted(set(ids[:2]) | set(ids[-3:]), key=ids.index)
                thinned.append(read)
        return real.attend(q, k_cache, v_cache, meta, scale, **kwargs)

    backend = "torch"  # a backend that reads per-head tables
    real = kernel.ATTENTION_BACKENDS[backend]
    monkeypatch.setitem(kernel.ATTENTION_BACKENDS, "recording",
                        SimpleNamespace(**{**vars(real), "attend": attend}))
    engine = Engine(LLAMA, block_size=2, num_blocks=64, enable_prefix_caching=False,
                    read_policy="first_and_recent", attention_backend="recording",
                    read_policy_config=dict(first=2, recent=3))
    outs = engine.generate([[(3 * i + j) % 32 for j in range(5 + 4 * i)] for i in range(3)],
                           SamplingParams(max_tokens=12, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 3
    assert thinned and max(map(len, thinned)) == 5
    assert_all_blocks_free(engine)


# -----------------------------------------------------------------------------
# detokenizer.py: text as it is generated, and stop strings with a real tokenizer  (-m detokenizer)


@pytest.mark.detokenizer
@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=30), st.binary(max_size=6),
       st.data())
def test_incremental_decoding_never_shows_a_broken_character(text, junk, data):
    """Token ids that are random chunks of text's UTF-8 bytes (a byte-level model's single bytes,
    a BPE model's longer pieces), decoded one after another as the engine does: the text only
    grows, is always a prefix of the decode of all of them, holds no U+FFFD unless that decode
    does (junk: invalid bytes too), and is the whole of it unless it ends in a broken character
    (which vLLM's detokenizer never hands out either)."""
    import detokenizer
    raw = text.encode() + (junk if data.draw(st.booleans()) else b"")
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(raw) - 1, 1)))) | {0, len(raw)})
    chunks = [raw[a:b] for a, b in zip(cuts, cuts[1:])]
    tokenizer = SimpleNamespace(decode=lambda ids: b"".join(chunks[i] for i in ids).decode(
        "utf-8", errors="replace"))
    decoder, seq = detokenizer.Detokenizer(tokenizer), Sequence(0, [], 0)
    decoder.start(seq)
    full, texts = tokenizer.decode(range(len(chunks))), []
    at_once = decoder.texts(seq, list(range(len(chunks))))  # as a step that keeps them all
    for i in range(len(chunks)):
        (text, offsets, new), = decoder.texts(seq, [i])  # a step's run decodes; its commit keeps
        assert (text, offsets, new) == at_once[i] and text == seq.text + new
        seq.token_ids.append(i)
        seq.text, seq.text_offsets = text, offsets
        texts.append(seq.text)
        assert full.startswith(seq.text) and ("\ufffd" in full or "\ufffd" not in seq.text)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert seq.text == full or full.endswith("\ufffd")


# Text with one-byte, two-byte, three-byte and four-byte characters, so that a byte-level
# tokenizer splits characters across tokens
STOP_ALPHABET = "ab \n.é☃🙂"


@functools.cache
def byte_bpe():
    """A byte-level BPE (GPT-2's scheme) trained here on text of STOP_ALPHABET, with the
    `tokenizers` package: every byte is a token, and merges join characters and words."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = ["".join(rng.choice(STOP_ALPHABET) for _ in range(40)) for _ in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def random_tokenization(tok, text, cuts):
    """text's ids, cut into pieces at the given byte offsets, each piece tokenized on its own:
    the pieces' boundaries may fall inside a character."""
    alphabet = pre_tokenizers_bytes()
    mapped = "".join(alphabet[b] for b in text.encode())
    bounds = sorted({0, len(mapped), *(c % (len(mapped) + 1) for c in cuts)})
    return [t.id for a, b in zip(bounds, bounds[1:]) for t in tok.model.tokenize(mapped[a:b])]


@functools.cache
def pre_tokenizers_bytes():
    """GPT-2's byte -> printable character table, as the ByteLevel pre-tokenizer maps bytes."""
    chars = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
    codes, n = list(chars), 0
    for b in range(256):
        if b not in chars:
            chars.append(b)
            codes.append(256 + n)
            n += 1
    return dict(zip(chars, map(chr, codes)))


def released_texts(tok, prompt, ids):
    """vLLM's text of a sample after each of its tokens (after k tokens: texts[k - 1]), recomputed
    from scratch: the decode of the sample's tokens after (up to) five prompt tokens of context,
    released while it does not end in U+FFFD."""
    context = prompt[max(len(prompt) - 5, 0):]
    base, text, texts = tok.decode(context), "", []
    for k in range(1, len(ids) + 1):
        full = tok.decode(context + ids[:k])
        if not full.endswith("\ufffd") and len(full) > len(base) + len(text):
            text += full[len(base) + len(text):]
        texts.append(text)
    return texts


def vllm_stop_reference(tok, prompt, ids, stop, include, min_tokens):
    """vLLM's rule, after every token: once more than min_tokens tokens are out, the first stop
    string in the order given that occurs ending within the newly released characters ends the
    sample, its text cut before it (or after it, include). Returns (text, number of tokens, the
    stop string or None)."""
    before = ""
    for k, text in enumerate(released_texts(tok, prompt, ids), 1):
        new, before = text[len(before):], text
        if not new or k <= min_tokens:
            continue
        for s in stop:
            at = [i for i in range(len(text) - len(s) + 1) if text[i:i + len(s)] == s
                  and i + len(s) > len(text) - len(new)]
            if at:
                return (text[:at[0] + len(s)] if include else text[:at[0]]), k, s
    return before, len(ids), None


def assert_streams_as_vllm(streamed, texts, params):
    """vLLM's streaming (its detokenizer's get_next_output_text): while a sample runs, its
    streamed text is its text so far (texts, as released_texts) less the last len(longest stop
    string) - 1 characters, which may yet begin a stop string to cut, none held back with
    include_stop_str_in_output; once finished, all of it. So each streamed text extends the one
    before, and the deltas a client is sent add up to the final text."""
    hold = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
    sent = ""
    for c in streamed:
        if c.finish_reason is None:
            so_far = texts[len(c.token_ids) - 1]
            assert c.text == so_far[:max(0, len(so_far) - hold)]
        assert c.text.startswith(sent)
        sent = c.text


def forcing(ids):
    """A logits processor that makes the model emit ids, one after another."""
    def force(prompt, output, logits):
        forced = torch.full_like(logits, -math.inf)
        forced[ids[len(output)]] = 0
        return forced
    return force


@pytest.mark.detokenizer
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(STOP_ALPHABET, min_size=1, max_size=24),
       prompt_text=st.text(STOP_ALPHABET, min_size=1, max_size=8),
       cuts=st.lists(st.integers(0, 200), max_size=10), data=st.data(),
       include=st.booleans(), min_tokens=st.integers(0, 3))
def test_stop_strings_end_and_stream_the_text_as_vllms_rules_say(text, prompt_text, cuts, data,
                                                                 include, min_tokens):
    """A model made (by a logits processor) to emit a random text in a random tokenization, with
    stop strings cut from that text and from the alphabet (across token boundaries, inside
    multi-byte characters): the engine's text, tokens, finish_reason and stop_reason are those of
    vLLM's rule, recomputed from scratch after every token, and every step streams the text as
    vLLM streams it; asked for deltas, the texts each step sends add up to that stream's."""
    tok = byte_bpe()
    ids, prompt = random_tokenization(tok, text, cuts), tok.encode(prompt_text).ids
    pieces = st.integers(0, len(text) - 1).flatmap(lambda i: st.integers(i + 1, len(text)).map(
        lambda j: text[i:j]))
    stop = data.draw(st.lists(st.one_of(pieces, st.text(STOP_ALPHABET, min_size=1, max_size=3)),
                              max_size=3))
    min_tokens = min(min_tokens, len(ids))
    model = stop_model(tok.get_vocab_size())
    params = SamplingParams(max_tokens=len(ids), temperature=0, stop=stop, min_tokens=min_tokens,
                            include_stop_str_in_output=include, logits_processors=[forcing(ids)])
    engine = Engine(model, block_size=4, num_blocks=64, tokenizer=tok)
    deltas = Engine(model, block_size=4, num_blocks=64, tokenizer=tok)
    streamed, sent = [], ""
    request_id = engine.add_request(prompt, params)
    deltas.add_request(prompt, dataclasses.replace(params, output_kind="delta"))
    for outputs in stepped(engine, len(prompt) + len(ids)):
        streamed += [o.outputs[0] for o in outputs if o.request_id == request_id]
        sent += "".join(o.outputs[0].text for o in deltas.step())
        assert sent == streamed[-1].text
    out = streamed[-1]
    expected_text, num_tokens, stop_string = vllm_stop_reference(tok, prompt, ids, stop, include,
                                                                 min_tokens)
    assert (out.text, out.token_ids, out.stop_reason) == (expected_text, ids[:num_tokens],
                                                          stop_string)
    assert out.finish_reason == ("stop" if stop_string is not None else "length")
    assert_streams_as_vllm(streamed, released_texts(tok, prompt, ids), params)


# vLLM's rules for a sample's text at its end (vllm-project/vllm: vllm/v1/core/sched/utils.py,
# check_stop; vllm/v1/engine/detokenizer.py, BaseIncrementalDetokenizer.update and
# get_next_output_text): a stop token ends the sample from min_tokens on, and its own text is
# left out unless include_stop_str_in_output (vLLM PR 14624); then the stop strings are looked
# for in the text the step added, a stop token's own text included when it is kept (PR 23938):
# the first found ends the sample there and is its stop_reason, the text cut before it, or
# after it with include_stop_str_in_output. While the sample runs, the streamed text holds back
# len(longest stop string) - 1 characters, none with include_stop_str_in_output.
#
# The output a model is made to emit: "ab é b☃.a\n🙂aa", one token a piece ("☃." is one token
# of two characters), the 🙂 split across two tokens inside its four bytes.
STOP_PIECES = ["ab", " é", " b", "☃.", "a", "\n", b"\xf0\x9f", b"\x99\x82", "aa"]
STOP_ROWS = [  # stop token (a piece), stop strings, include: text, tokens kept, stop_reason
    ("☃.", [], False, "ab é b", 4, "its id"),
    ("☃.", [], True, "ab é b☃.", 4, "its id"),
    (None, ["b☃"], False, "ab é ", 4, "b☃"),
    (None, ["b☃"], True, "ab é b☃", 4, "b☃"),
    (None, ["x", "\n🙂"], False, "ab é b☃.a", 8, "\n🙂"),  # found inside a split character
    (None, ["x", "\n🙂"], True, "ab é b☃.a\n🙂", 8, "\n🙂"),
    ("☃.", ["☃"], False, "ab é b", 4, "its id"),  # its text, left out, holds no stop string
    ("☃.", ["☃"], True, "ab é b☃", 4, "☃"),  # kept, it does: the string stops and cuts
    (None, [], False, "ab é b☃.a\n🙂aa", 9, None),
    ("a", ["aa"], True, "ab é b☃.a", 5, "its id"),  # the first stop token, not a later string
]


@pytest.mark.detokenizer
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "generate"])
@pytest.mark.parametrize("stop_token, stop, include, text, num_tokens, reason", STOP_ROWS, ids=[
    "token", "token kept", "string", "string kept", "split character", "split character kept",
    "token holding a string", "token holding a string kept", "none", "token before a string"])
def test_stop_tokens_and_strings_end_the_text_as_vllm_does(
        stop_token, stop, include, text, num_tokens, reason, streamed):
    tok = byte_bpe()
    alphabet = pre_tokenizers_bytes()
    pieces = [p if isinstance(p, bytes) else p.encode() for p in STOP_PIECES]
    ids = [t.id for p in pieces for t in tok.model.tokenize("".join(alphabet[b] for b in p))]
    assert len(ids) == len(STOP_PIECES) and tok.decode(ids) == "ab é b☃.a\n🙂aa"
    stop_ids = [ids[STOP_PIECES.index(stop_token)]] if stop_token else []
    params = SamplingParams(max_tokens=len(ids), temperature=0, stop=stop, stop_token_ids=stop_ids,
                            include_stop_str_in_output=include, logits_processors=[forcing(ids)])
    engine = Engine(stop_model(tok.get_vocab_size()), block_size=4, num_blocks=64, tokenizer=tok)
    prompt = tok.encode("a b").ids
    if streamed:
        request_id, outputs = engine.add_request(prompt, params), []
        for step_outputs in stepped(engine, len(prompt) + len(ids)):
            outputs += [o.outputs[0] for o in step_outputs if o.request_id == request_id]
        assert_streams_as_vllm(outputs, released_texts(tok, prompt, ids), params)
        out = outputs[-1]
    else:
        out = engine.generate([prompt], params)[0].outputs[0]
    reason = stop_ids[0] if reason == "its id" else reason
    assert (out.text, out.token_ids, out.stop_reason) == (text, ids[:num_tokens], reason)
    assert out.finish_reason == ("length" if reason is None else "stop")


@pytest.mark.detokenizer
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(STOP_ALPHABET, min_size=1, max_size=8), longest=st.integers(2, 12),
       cuts=st.lists(st.integers(0, 40), max_size=4))
@example(text="ab é b", longest=8, cuts=[])  # 6 characters, 7 held back
def test_a_stream_shorter_than_the_hold_back_shows_none_of_it(text, longest, cuts):
    """A sample whose text stays shorter than its longest stop string less one (a string that
    never occurs, "x" repeated) streams nothing until it finishes: any character it showed
    might begin that string. Then it shows its whole text, and the deltas add up to it."""
    tok = byte_bpe()
    ids, prompt = random_tokenization(tok, text, cuts), tok.encode("a").ids
    params = SamplingParams(max_tokens=len(ids), temperature=0, stop=["x" * longest, "x"],
                            logits_processors=[forcing(ids)])
    engine = Engine(stop_model(tok.get_vocab_size()), block_size=4, num_blocks=64, tokenizer=tok)
    request_id, streamed = engine.add_request(prompt, params), []
    for _ in range(len(ids) + 1):  # a token a step
        streamed += [o.outputs[0] for o in engine.step() if o.request_id == request_id]
    assert streamed[-1].finish_reason == "length" and not engine.requests
    texts = released_texts(tok, prompt, ids)
    assert_streams_as_vllm(streamed, texts, params)
    assert streamed[-1].text == texts[-1]
    assert all(c.text == "" for c in streamed[:-1] if len(texts[len(c.token_ids) - 1]) < longest)


@functools.cache
def stop_model(vocab_size):
    return tiny_model(vocab_size=vocab_size)


@pytest.mark.detokenizer
def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop strings .* needs a tokenizer"):
        Engine(MODEL, block_size=4, num_blocks=16).add_request([1, 2], SamplingParams(stop="\n"))


# -----------------------------------------------------------------------------
# demo.py: `python nanopaged.py` on the built-in model or a folder, and its flags  (-m demo)


@pytest.mark.demo
def test_demo_serves_its_workload_and_reports_true_numbers(capsys, tmp_path):
    report = demo.main(["--max-tokens", "12", "--num-blocks", "24", "--temperature", "0",
                             "--plot", str(tmp_path / "demo.png")])
    printed = capsys.readouterr().out
    engine, summary, outputs = report["engine"], report["summary"], report["outputs"]
    prompts = [report["tokenizer"].encode((demo.DEMO_PREFIX if i % 3 == 0 else "") + topic)
               for i, topic in enumerate(demo.DEMO_TOPICS)]
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs) for o in outputs] == \
        [3 if i in (3, 7) else 1 for i in range(len(prompts))]
    assert all(len(c.token_ids) == 12 and all(0 <= t < 256 for t in c.token_ids)
               for o in outputs for c in o.outputs)
    model = engine.model
    # greedy, so checkable
    assert outputs[1].outputs[0].token_ids == naive_greedy(model, prompts[1], 12)
    # the summary is the engine's own account, and says so in print
    s = engine.stats()
    assert summary["preemptions"] == s["num_preemptions"] > 0
    assert summary["generated_tokens"] == sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert summary["contiguous_capacity"] == 24 * 16 // 256 < summary["peak_running"]
    assert summary["peak_blocks_saved"] > 0 and 0.5 < summary["kv_utilization"] <= 1
    assert f"{summary['preemptions']} preemptions" in printed and \
        "physical KV blocks at step" in printed
    assert f"holds {summary['contiguous_capacity']} in the same memory" in printed
    assert s["num_free_blocks"] == s["num_blocks"] and not engine.requests
    assert (tmp_path / "demo.png").stat().st_size > 10_000


@pytest.mark.demo
def test_the_demo_speculates_with_the_built_in_draft_and_says_how_much_it_kept(capsys):
    flags = ["--max-tokens", "24", "--temperature", "0"]
    plain = demo.main(flags)
    draft = os.path.join(os.path.dirname(demo.DEMO_MODEL), "pydoc-draft")
    report = demo.main(flags + ["--speculative-model", draft])
    s, printed = report["engine"].stats(), capsys.readouterr().out
    # the same requests but the beam search, which does not speculate; the same greedy tokens
    assert [len(o.outputs) for o in report["outputs"]] == \
        [3 if i == 3 else 1 for i in range(len(report["outputs"]))]
    assert [o.outputs[0].token_ids for i, o in enumerate(report["outputs"]) if i != 7] == \
        [o.outputs[0].token_ids for i, o in enumerate(plain["outputs"]) if i != 7]
    assert 0 < s["num_accepted_tokens"] < s["num_proposed_tokens"]
    assert (f"speculative decoding ({draft}): {s['num_accepted_tokens']} of "
            f"{s['num_proposed_tokens']} guessed tokens accepted") in printed


@pytest.mark.demo
@pytest.mark.speculative
@pytest.mark.parametrize("method", sorted(nanopaged.SPECULATIVE_METHODS))
def test_the_demo_speculates_by_every_registered_methods_name(method):
    """--speculative-method takes every name in the registry (the suite's own too) and nothing
    else; each gives the greedy tokens of the demo without speculation. A draft's folder is
    --speculative-model, and its short spelling 'ngram' is method ngram."""
    parser = demo.argument_parser()
    choices = next(a.choices for a in parser._actions if a.dest == "speculative_method")
    assert choices == sorted(nanopaged.SPECULATIVE_METHODS)
    flags = ["--prompt", "The for statement", "--prompt", "A list", "--max-tokens", "16",
             "--temperature", "0"]
    plain = demo.main(flags)
    draft = ["--speculative-model", os.path.join(os.path.dirname(demo.DEMO_MODEL), "pydoc-draft")]
    report = demo.main(flags + ["--speculative-method", method] + (draft if method == "draft"
                                                                     else []))
    assert [o.outputs[0].token_ids for o in report["outputs"]] == \
        [o.outputs[0].token_ids for o in plain["outputs"]]
    assert report["engine"].stats()["num_proposed_tokens"] > 0
    if method != "ngram":
        with pytest.raises(ValueError, match="--speculative-model ngram is method ngram"):
            demo.speculative_config(parser.parse_args(["--speculative-model", "ngram",
                                                       "--speculative-method", method]))


@pytest.mark.demo
def test_readmes_python_use_runs_as_printed(tmp_path):
    """README's "Use it from Python" block, as a user would paste it, in a folder of their own
    (the built-in model reached as models/pydoc-gpt): it runs, streams, and writes its page."""
    here = os.path.dirname(os.path.abspath(__file__))
    readme = open(os.path.join(here, "README.md")).read()
    section = readme.split("\n## Use it from Python\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    os.symlink(os.path.join(here, "models"), tmp_path / "models")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=here))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.match(r"'.*' (stop|length) ", run.stdout)  # the first sample's text and end
    assert "True" in run.stdout and "num_free_blocks" in run.stdout  # a finished stream, stats
    assert "<html" in (tmp_path / "paging.html").read_text()[:500].lower()


@pytest.mark.demo
def test_demo_takes_the_kv_cache_dtype_from_the_command_line(capsys):
    report = demo.main(["--prompt", "def ", "--max-tokens", "4", "--temperature", "0",
                             "--kv-cache-dtype", "fp8_e5m2"])
    assert report["engine"].kv_cache.dtype == torch.float8_e5m2
    assert "blocks x 16 tokens in float8_e5m2 on" in capsys.readouterr().out


@pytest.mark.demo
def test_demo_takes_the_policies_and_priorities_from_the_command_line(capsys):
    report = demo.main(["--prompt", "def ", "--priority", "1", "--prompt", "class ",
                             "--priority", "0", "--max-tokens", "2", "--temperature", "0",
                             "--scheduling-policy", "priority", "--eviction-policy", "lfu"])
    engine, (low, high) = report["engine"], report["outputs"]
    assert engine.scheduler.key is SCHEDULING_POLICIES["priority"]
    assert engine.allocator.prefix_cache.score is EVICTION_POLICIES["lfu"]
    # both arrive in the first step; the lower value is admitted first
    assert high.metrics.first_scheduled_time < low.metrics.first_scheduled_time


@pytest.mark.demo
@pytest.mark.connector
def test_demo_takes_the_connector_and_its_settings_from_the_command_line(capsys, tmp_path):
    """--connector disk over a folder, run twice: the second run (a restart) reads the first
    one's prompt from disk and prints the same completion."""
    flags = ["--prompt", "def function(argument):", "--max-tokens", "4", "--temperature", "0",
             "--connector", "disk", "--connector-config", json.dumps({"path": str(tmp_path)})]
    first, restarted = demo.main(flags), demo.main(flags)
    assert type(first["engine"].allocator.connector).__name__ == "DiskStore"
    assert restarted["outputs"][0].num_cached_tokens > 0
    assert [r["outputs"][0].outputs[0].token_ids for r in (first, restarted)] == \
        [restarted["outputs"][0].outputs[0].token_ids] * 2


@pytest.mark.demo
@pytest.mark.read_policy
def test_demo_takes_the_read_policy_and_its_settings_from_the_command_line(capsys):
    backend = "torch"  # a backend that reads per-head tables
    report = demo.main(["--prompt", "def ", "--max-tokens", "4", "--temperature", "0",
                        "--read-policy", "quest", "--read-policy-config",
                        '{"token_budget": 32}', "--attention-backend", backend])
    policy = report["engine"].model_runner.read_policy
    assert (type(policy).__name__, policy.token_budget, policy.dense_layers) == ("Quest", 32, 2)
    assert len(report["outputs"][0].outputs[0].token_ids) == 4


@pytest.mark.demo
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_demo_takes_text_prompts_through_a_model_folders_tokenizer(hf_folder, tmp_path, capsys,
                                                                   name):
    tokenizers = pytest.importorskip("tokenizers")
    path, _ = hf_folder(name)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    vocab = {"[UNK]": 0, "hello": 1, "paged": 2, "world": 3} | {f"w{i}": i for i in range(4, 100)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    report = demo.main(["--model", str(tmp_path), "--prompt", "hello paged world",
                             "--max-tokens", "5", "--temperature", "0", "--num-blocks", "8"])
    out = report["outputs"][0]
    assert out.prompt_token_ids == [1, 2, 3] and len(out.outputs[0].token_ids) == 5
    assert "'hello paged world' -> " in capsys.readouterr().out


@pytest.mark.demo
def test_the_cli_applies_generation_config_json_unless_a_flag_overrides_it(hf_folder, tmp_path):
    path, _ = hf_folder("llama")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps(
        dict(do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=3)))
    flags = ["--model", str(tmp_path), "--prompt", "abc", "--num-blocks", "8"]
    sp = demo.main(flags)["params"][0]
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (0.6, 50, 0.9, 3)
    sp = demo.main(flags + ["--temperature", "0", "--top-k", "5", "--max-tokens", "2"])[
        "params"][0]
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (0, 5, 0.9, 2)
    (tmp_path / "generation_config.json").unlink()  # then the CLI's own defaults
    sp = demo.main(flags + ["--max-tokens", "2"])["params"][0]  # 64 would pass max_seq_len
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.8, 0, 0.95)


@pytest.mark.demo
def test_the_demo_streams_one_request_after_another_as_tokens_arrive(capsys):
    def output(text, finished):
        return SimpleNamespace(outputs=[SimpleNamespace(text=text)], finished=finished)
    streamer = demo.Streamer(["p", "q"], [SamplingParams(), SamplingParams()])
    printed = [capsys.readouterr().out]
    # the engine holds back a half-received "€" (three bytes, three tokens of the byte model)
    for i, text, finished in [(0, "ab", False), (1, "xy", False), (0, "ab", False),
                              (0, "ab€", False), (1, "xyz", False), (0, "ab€c", True),
                              (1, "xyzw", True)]:
        streamer(i, output(text, finished))
        printed.append(capsys.readouterr().out)
    assert printed == ["[0.0] 'p' -> ", "ab", "", "", "€", "", "c\n[1.0] 'q' -> xyz", "w\n"]


@pytest.mark.demo
@pytest.mark.parametrize("flags,message", some([  # each starts a python: 4 of them under fast
    (["--model", "/no/such/folder"], "config.json not found"),
    (["--block-size", "0"], "block_size must be an integer >= 1, got 0"),
    (["--prompt", "x" * 300], r"= 364 exceeds the model's max_seq_len \(256\)"),
    (["--max-tokens", "many"], "argument --max-tokens: invalid int value"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    # a flag given is a flag used: zero is a bad value, not "the default"
    (["--max-tokens", "0"], r"max_tokens must be an int >= 1, got 0"),
    (["--n", "0"], r"\bn must be an int >= 1, got 0"),
    (["--beam-width", "0"], r"beam_width must be None or an int >= 1, got 0"),
    (["--prompt", "x", "--max-tokens", "0"], r"max_tokens must be an int >= 1, got 0"),
    (["--prompt", "x", "--n", "0"], r"\bn must be an int >= 1, got 0"),
    (["--chat"], r"pydoc-gpt: no chat template \(chat_template.jinja, or chat_template in "),
    (["--scheduling-policy", "sjf"],
     r"scheduling_policy must be one of \[.*'fcfs'.*'priority'.*\]"),
    (["--eviction-policy", "fifo"],
     r"eviction_policy must be one of \[.*'lfu'.*'lru'.*\], got 'fifo'"),
    (["--prompt", "x", "--priority", "1", "--priority", "0"], "got 2 --priority for 1 prompts"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative-model"),
    (["--speculative-model", "ngram", "--num-speculative-tokens", "0"],
     "num_speculative_tokens must be an int >= 1, got 0"),
    (["--speculative-model", "ngram", "--beam-width", "2", "--prompt", "x"],
     "beam search does not run with speculative decoding"),
    (["--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice: 'int8'"),
    (["--speculative-method", "medusa"],
     "argument --speculative-method: invalid choice: 'medusa'"),
    (["--read-policy", "sparse"], r"read_policy must be one of \['all', 'quest'\], got 'sparse'"),
    (["--read-policy", "quest", "--read-policy-config", '{"token_budget": 0}'],
     "Quest's token_budget must be an int >= 1, got 0"),
], 4))
def test_demo_bad_flags_end_with_one_clear_line(flags, message):
    run = subprocess.run([sys.executable, "nanopaged.py", *flags], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("nanopaged: error:")
    assert re.search(message, run.stderr), run.stderr


@pytest.mark.demo
def test_running_nanopaged_py_loads_the_module_once():
    """`python nanopaged.py` runs demo.py, which imports nanopaged: that must be the running
    module, not a second copy with classes of its own (a GPT of one would not be a GPT of the
    other)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "nanopaged.py", "--help"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()
                if line.startswith("import time:")]
    assert "demo" in imported and "nanopaged" not in imported


# -----------------------------------------------------------------------------
# server.py: the OpenAI-compatible server, through the official openai client  (-m server)

SERVED_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
SERVED_PROMPTS = demo.DEMO_TOPICS[:16]  # distinct lengths and openings


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The built-in model in a folder with a chat template (its tokenizer: bytes), served by
    `python server.py` on a free port for the module, greedy unless a request says otherwise;
    stopped (killed if need be) however the tests end. Yields (url, folder, model)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pytest.importorskip("prometheus_client")
    import server
    folder = served_chat_folder(tmp_path_factory.mktemp("pydoc-chat"))
    with open(folder / "server.log", "w+") as log, server.running_server(
            ["--model", str(folder), "--served-model-name", "pydoc-chat", "--temperature", "0",
             "--uvicorn-log-level", "warning"], timeout_s=60, log=log) as url:
        yield url, str(folder), GPT.from_pretrained(str(folder))


def served_chat_folder(folder):
    """The built-in model in folder, with a chat template."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{demo.DEMO_MODEL}/{name}", folder / name)
    (folder / "chat_template.jinja").write_text(SERVED_CHAT_TEMPLATE)
    return folder


@pytest.mark.server
@pytest.mark.speculative
def test_server_speculates_by_a_registered_methods_name_and_answers_as_without(tmp_path):
    """--speculative-method takes its choices from the registry: the suite's own method, by
    name, serves greedy completions token for token as Engine.generate without speculation."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import server
    parser = server.argument_parser()
    assert next(a.choices for a in parser._actions if a.dest == "speculative_method") == \
        sorted(nanopaged.SPECULATIVE_METHODS)
    folder = served_chat_folder(tmp_path)
    args = parser.parse_args(["--model", str(folder), "--temperature", "0",
                              "--speculative-method", "fixed_token",
                              "--num-speculative-tokens", "3",
                              "--served-model-name", "pydoc-chat"])
    model, engine, tokenizer = demo.load(args)
    assert type(engine.proposer) is FixedTokenProposer
    prompts = SERVED_PROMPTS[:3]
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
        client = served_client(url)
        outs = [client.completions.create(model="pydoc-chat", prompt=p, max_tokens=16,
                                          logprobs=0) for p in prompts]
    ref = served_reference(model, [tokenizer.encode(p) for p in prompts],
                           SamplingParams(max_tokens=16, temperature=0))
    assert [o.choices[0].logprobs.tokens for o in outs] == \
        [[served_token(t) for t in r.outputs[0].token_ids] for r in ref]
    assert engine.stats()["num_proposed_tokens"] >= 3 * len(prompts)


@pytest.mark.server
def test_server_serves_a_returning_prompt_from_the_cpu_tier(tmp_path):
    """--cpu-cache-gib: a prompt whose blocks a 12-block device pool evicted (three other
    prompts came between) comes back from the CPU tier: /metrics counts the copies and the
    hits, and the answers are those of a server without the tier (the engine's own)."""
    import server
    first = list(range(40, 52))  # three blocks of 4
    prompts = [first, *[[60 + i] * 14 for i in range(3)], first + [7]]
    answers, metrics = [], []
    for tier in ("0", "0.001"):
        flags = ["--num-blocks", "12", "--block-size", "4", "--cpu-cache-gib", tier,
                 "--temperature", "0", "--uvicorn-log-level", "warning"]
        with open(tmp_path / "server.log", "w+") as log, server.running_server(
                flags, timeout_s=60, log=log) as url:
            client = served_client(url)
            answers.append([client.completions.create(model="pydoc-gpt", prompt=p, max_tokens=3
                                                      ).choices[0].text for p in prompts])
            metrics.append(served_metrics(url))
    assert answers[0] == answers[1]
    assert metrics[0]["nanopaged:cpu_prefix_cache_hits_total"] == 0
    assert metrics[1]["nanopaged:cpu_prefix_cache_hits_total"] == 12
    assert metrics[1]["nanopaged:reloaded_blocks_total"] == 3
    assert metrics[1]["nanopaged:offloaded_blocks_total"] >= 3
    assert metrics[1]["vllm:prefix_cache_hits_total"] == 12


def served_client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def served_metrics(url, cpu=True):
    """/metrics, read by prometheus_client's own parser, as {sample name or name{labels}: value},
    the model_name label that every sample has left out (and the server's CPU seconds, which
    every call moves, unless cpu)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name"), sample
            if cpu or sample.name != "process_cpu_seconds_total":
                named = ",".join(f'{k}="{v}"' for k, v in labels.items())
                samples[sample.name + (f"{{{named}}}" if named else "")] = sample.value
    return samples


def served_reference(model, prompts, params, folder=demo.DEMO_MODEL):
    """Engine.generate's outputs for the same prompts, as the server's engine is built, on one
    thread as the server runs this model (two, beside the server on two busy cores, crawl)."""
    engine = Engine(model, block_size=16, max_num_seqs=26, tokenizer=demo.Tokenizer(folder))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return engine.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)


def served_token(t):  # how the server names the built-in model's token t (a byte) in logprobs
    try:
        return bytes([t]).decode("utf-8")
    except UnicodeDecodeError:
        return f"bytes:\\x{t:02x}"


def served_token_bytes(token):  # the inverse: a token's bytes from its name
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token.removeprefix("bytes:").split("\\x")[1:])
    return token.encode()


@pytest.mark.server
def test_server_completions_and_chat_stream_and_not_as_engine_generate(served):
    url, folder, model = served
    client, tok = served_client(url), demo.Tokenizer(folder)
    messages = [{"role": "system", "content": "Python docs."},
                {"role": "user", "content": "The with statement"}]
    chat_ids = tok.encode(checkpoints.render_chat(folder, messages), add_special_tokens=False)
    ref_text, ref_chat = served_reference(model, [tok.encode("Lambdas"), chat_ids],
                                          SamplingParams(max_tokens=24, temperature=0))
    assert client.models.list().data[0].id == "pydoc-chat"
    out = client.completions.create(model="pydoc-chat", prompt="Lambdas", max_tokens=24)
    assert out.object == "text_completion" and out.choices[0].text == ref_text.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (7, 24)
    chat = client.chat.completions.create(model="pydoc-chat", messages=messages, max_tokens=24)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref_chat.outputs[0].text
    assert chat.usage.prompt_tokens == len(chat_ids) and chat.usage.completion_tokens == 24
    stream = client.completions.create(model="pydoc-chat", prompt="Lambdas", max_tokens=24,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref_text.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * 23 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    stream = client.chat.completions.create(model="pydoc-chat", messages=messages,
                                            max_completion_tokens=24, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage is None
    assert "".join(c.choices[0].delta.content for c in chunks) == ref_chat.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # continuous_usage_stats (guidellm sends it): the usage so far in every chunk too
    for create, args in [(client.completions.create, dict(prompt="Lambdas")),
                         (client.chat.completions.create, dict(messages=messages))]:
        chunks = list(create(model="pydoc-chat", max_tokens=5, stream=True, **args,
                             stream_options={"include_usage": True,
                                             "continuous_usage_stats": True}))
        prompt = 7 if "prompt" in args else len(chat_ids)
        assert [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
                for c in chunks] == [(prompt, i, prompt + i) for i in
                                     ([0] if "messages" in args else []) + [1, 2, 3, 4, 5, 5]]
        assert chunks[-1].choices == []
    # on the wire: server-sent events, each "data: {json}", the last "data: [DONE]"
    body = json.dumps(dict(model="pydoc-chat", prompt="Lambdas", max_tokens=3, stream=True))
    request = urllib.request.Request(url + "/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and len(events) == 5
    assert all(json.loads(e.removeprefix("data: "))["object"] == "text_completion"
               for e in events[:-2])


@pytest.mark.server
def test_server_usage_streams_in_every_chunk_only_with_both_include_usage_and_continuous(served):
    """vLLM's stream_options: include_usage adds a last chunk with the usage and no choices;
    continuous_usage_stats puts the usage so far in every chunk too, but only beside
    include_usage (alone it changes nothing)."""
    url, _, _ = served
    client = served_client(url)
    messages = [{"role": "user", "content": "Lambdas"}]
    for create, args in [(client.completions.create, dict(prompt="Lambdas")),
                         (client.chat.completions.create, dict(messages=messages))]:
        for include, continuous in itertools.product([False, True], repeat=2):
            chunks = list(create(model="pydoc-chat", max_tokens=3, stream=True, **args,
                                 stream_options=dict(include_usage=include,
                                                     continuous_usage_stats=continuous)))
            with_usage = [c.usage is not None for c in chunks]
            assert with_usage[:-1] == [include and continuous] * (len(chunks) - 1)
            assert with_usage[-1] == include and (chunks[-1].choices == []) == include


@pytest.mark.server
def test_server_chat_without_max_tokens_generates_the_room_left_in_the_context(served):
    """vLLM's default for a chat request that sets no max_tokens: what max_seq_len leaves after
    the prompt (the built-in model has no end-of-text token, so it runs to that length)."""
    url, _, model = served
    client = served_client(url)
    chat = client.chat.completions.create(
        model="pydoc-chat", messages=[{"role": "user", "content": "The with statement"}])
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == model.config.max_seq_len
    assert chat.choices[0].finish_reason == "length"


@pytest.mark.server
def test_server_chat_default_max_tokens_is_capped_by_generation_config(tmp_path):
    """A folder whose generation_config.json sets max_new_tokens: a chat request that sets no
    max_tokens generates that many, or the room left if less (vLLM's get_max_tokens, as this
    project's CLI reads the file); a max_tokens given wins, and a completion's default is the
    OpenAI API's 16."""
    pytest.importorskip("fastapi")
    import server
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{demo.DEMO_MODEL}/{name}", tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(SERVED_CHAT_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(max_new_tokens=5)))
    args = server.argument_parser().parse_args(["--model", str(tmp_path)])
    model, engine, tokenizer = demo.load(args)
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
        client, name = served_client(url), tmp_path.name

        def chat(content, **more):
            return client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": content}], **more).usage
        assert chat("Lambdas").completion_tokens == 5
        assert chat("Lambdas", max_tokens=7).completion_tokens == 7
        long = chat("x" * (model.config.max_seq_len - 20))  # and the template's 17 bytes
        assert long.completion_tokens == model.config.max_seq_len - long.prompt_tokens < 5
        out = client.completions.create(model=name, prompt="Lambdas")
        assert out.usage.completion_tokens == 16


@pytest.mark.server
def test_server_echo_with_more_prompt_logprobs_than_logprobs_gives_each_its_k(served):
    """An echoed completion asks logprobs k for its generated tokens and, through vLLM's
    prompt_logprobs, k' for its prompt: the echoed prompt's top_logprobs hold k (and the prompt's
    own token), prompt_logprobs ranks k', each the engine's own, whichever of k and k' is
    larger."""
    url, folder, model = served
    client, tok = served_client(url), demo.Tokenizer(folder)
    prompt = tok.encode(SERVED_PROMPTS[2])
    ref = served_reference(model, [prompt], SamplingParams(max_tokens=1, temperature=0,
                                                           prompt_logprobs=4))[0]
    for k, prompt_k in [(0, 3), (1, 4), (3, 1), (2, 2)]:
        body = client.completions.create(model="pydoc-chat", prompt=prompt, echo=True,
                                         logprobs=k, max_tokens=1,
                                         extra_body=dict(prompt_logprobs=prompt_k)).model_dump()
        choice = body["choices"][0]
        echoed = choice["logprobs"]["top_logprobs"][1:len(prompt)]
        ranked = [sorted((x["logprob"] for x in entry.values() if x["rank"]), reverse=True)
                  for entry in choice["prompt_logprobs"][1:]]
        for t, top, ranks, e in zip(prompt[1:], echoed, ranked, ref.prompt_logprobs[1:]):
            top_k = {served_token(i) for i in sorted(e, key=e.get, reverse=True)[:k]}
            assert top_k <= set(top) <= top_k | {served_token(t)}
            assert ranks == pytest.approx(sorted(e.values(), reverse=True)[:prompt_k],
                                          abs=1e-4)


@pytest.mark.server
def test_server_greedy_outputs_of_16_concurrent_clients_equal_engine_generate(served):
    """16 clients at once, half streaming: every token as Engine.generate's for the same
    prompts. A batch changes a logit only by rounding (~1e-6 here), so an argmax can differ only
    where the top two are that close: the prompts are checked to have margins far above it."""
    import openai
    url, folder, model = served
    tok = demo.Tokenizer(folder)
    ref = served_reference(model, [tok.encode(p) for p in SERVED_PROMPTS],
                           SamplingParams(max_tokens=32, temperature=0, logprobs=2))
    margins = [a - b for o in ref for e in o.outputs[0].logprobs
               for a, b in [sorted(e.values(), reverse=True)[:2]]]
    assert min(margins) > 1e-3  # else these prompts cannot tell rounding from a wrong token

    async def client_of(i, prompt, client):
        args = dict(model="pydoc-chat", prompt=prompt, max_tokens=32, logprobs=0)
        if i % 2:
            out = await client.completions.create(**args)
            return out.choices[0].logprobs.tokens, out.choices[0].logprobs.token_logprobs
        tokens, logprobs = [], []
        async for chunk in await client.completions.create(**args, stream=True):
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
        return tokens, logprobs

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                      timeout=60) as client:
            return await asyncio.gather(*(client_of(i, p, client)
                                          for i, p in enumerate(SERVED_PROMPTS)))
    for (tokens, logprobs), expected in zip(asyncio.run(all_clients()), ref):
        c = expected.outputs[0]
        assert tokens == [served_token(t) for t in c.token_ids]
        assert logprobs == pytest.approx([e[t] for t, e in zip(c.token_ids, c.logprobs)],
                                         abs=1e-4)


@pytest.mark.server
def test_server_every_sampling_field_reaches_the_engine_as_given(served):
    """Each field, under its API name, lands in the SamplingParams field it names: the sampled
    tokens, finishes and stop reasons equal Engine.generate's with those SamplingParams."""
    url, folder, model = served
    client, tok = served_client(url), demo.Tokenizer(folder)
    fields = dict(temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5,
                  frequency_penalty=0.3, repetition_penalty=1.2, seed=11, n=3, max_tokens=40,
                  min_tokens=4, stop_token_ids=[ord("\n")])
    expected = served_reference(model, [tok.encode("Exceptions")],
                                SamplingParams(**fields, logprobs=0))[0].outputs
    openai_fields = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                     "n", "max_tokens")  # the rest are vLLM's: the client sends them as extra
    out = client.completions.create(
        model="pydoc-chat", prompt="Exceptions", logprobs=0,
        **{k: fields[k] for k in openai_fields},
        extra_body={k: v for k, v in fields.items() if k not in openai_fields})
    for choice, c in zip(out.choices, expected):
        assert choice.logprobs.tokens == [served_token(t) for t in c.token_ids]
        assert (choice.finish_reason, choice.stop_reason) == (c.finish_reason, c.stop_reason)
    assert {c.stop_reason for c in expected} & {10}  # a stop token id ended some sample


@pytest.mark.server
@pytest.mark.parametrize("include", [False, True])
def test_server_stop_strings_cut_the_text_streamed_or_not_as_engine_generate(served, include):
    url, folder, model = served
    client, tok = served_client(url), demo.Tokenizer(folder)
    prompt = tok.encode("The import system")
    plain = served_reference(model, [prompt], SamplingParams(max_tokens=40, temperature=0))
    stop = plain[0].outputs[0].text[14:17]  # met in the 15th to 17th characters, or before
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop, "never met"],
                            include_stop_str_in_output=include)
    expected = served_reference(model, [prompt], params)[0].outputs[0]
    assert expected.finish_reason == "stop" and expected.text.endswith(stop) == include
    args = dict(model="pydoc-chat", prompt=prompt, max_tokens=40, stop=[stop, "never met"],
                extra_body=dict(include_stop_str_in_output=include))
    out = client.completions.create(**args).choices[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected.text, "stop", stop)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.server
def test_server_n_samples_and_logprobs_are_shaped_as_the_api_says(served):
    url, folder, model = served
    client, tok = served_client(url), demo.Tokenizer(folder)
    prompts = [tok.encode("Generators"), tok.encode("Slicings")]
    sample = dict(max_tokens=12, n=3, temperature=1.0, top_p=1.0, seed=7)
    ref = served_reference(model, prompts, SamplingParams(**sample, logprobs=3))
    # two prompts as token ids, n=3: choice i * n + j is sample j of prompt i
    out = client.completions.create(model="pydoc-chat", prompt=prompts, logprobs=3, **sample)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == 6 * 12 and out.usage.prompt_tokens == 10 + 8
    for choice in out.choices:
        expected = ref[choice.index // 3].outputs[choice.index % 3]
        lp = choice.logprobs
        assert lp.tokens == [served_token(t) for t in expected.token_ids]
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
        assert lp.text_offset == list(range(12))  # one character per byte token
        for t, top, logprob, entry in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs,
                                          expected.logprobs):
            assert len(top) in (3, 4) and top[t] == logprob  # the 3 likeliest and the drawn one
            assert sorted(top.values(), reverse=True)[:3] == pytest.approx(
                sorted(entry.values(), reverse=True)[:3], abs=1e-4)
    chat = client.chat.completions.create(
        model="pydoc-chat", messages=[{"role": "user", "content": "Lambdas"}], n=2,
        max_tokens=10, logprobs=True, top_logprobs=2, temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        content = choice.logprobs.content
        assert len(content) == 10
        assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == \
            choice.message.content
        for e in content:
            assert bytes(e.bytes) == served_token_bytes(e.token) and len(e.top_logprobs) == 2
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= -9999
            assert e.logprob <= e.top_logprobs[0].logprob
    # without logprobs there are none
    assert client.completions.create(model="pydoc-chat", prompt="A", max_tokens=2).choices[
        0].logprobs is None


@pytest.mark.server
def test_server_echo_returns_the_prompt_and_its_logprobs_as_engine_computes_them(served):
    """What lm-eval's loglikelihood tasks send: token-id prompts, echo, logprobs, max_tokens 0 or
    1. Every prompt's echoed logprobs are the engine's own prompt logprobs (the first null, as
    the OpenAI API and vLLM give it), its text the prompt's, nothing generated with max_tokens 0;
    with tokens generated, the prompt comes first, streamed or not; vLLM's prompt_logprobs too."""
    import openai
    url, folder, model = served
    client, tok = served_client(url), demo.Tokenizer(folder)
    prompts = [tok.encode(p) for p in SERVED_PROMPTS]
    ref = served_reference(model, prompts, SamplingParams(max_tokens=3, temperature=0,
                                                          prompt_logprobs=2, logprobs=2))
    out = client.completions.create(model="pydoc-chat", prompt=prompts, echo=True, logprobs=2,
                                    max_tokens=0)
    assert out.usage.completion_tokens == 0 and [c.index for c in out.choices] == list(range(16))
    for choice, r, text in zip(out.choices, ref, SERVED_PROMPTS):
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert lp.tokens == [served_token(t) for t in r.prompt_token_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(
            [e[t] for t, e in zip(r.prompt_token_ids[1:], r.prompt_logprobs[1:])], abs=1e-4)
        assert lp.text_offset == list(range(len(text)))
        for top, e in zip(lp.top_logprobs[1:], r.prompt_logprobs[1:]):
            assert len(top) in (2, 3)
            assert max(top.values()) == pytest.approx(max(e.values()), abs=1e-4)
    # tokens generated after the echoed prompt, streamed or not: Engine.generate's
    args = dict(model="pydoc-chat", prompt=prompts[3], echo=True, logprobs=1, max_tokens=3)
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(**args, stream=True))
    for text, tokens in [(whole.text, whole.logprobs.tokens),
                         ("".join(c.choices[0].text for c in chunks),
                          [t for c in chunks for t in c.choices[0].logprobs.tokens])]:
        assert text == SERVED_PROMPTS[3] + ref[3].outputs[0].text
        assert tokens == [served_token(t) for t in prompts[3] + ref[3].outputs[0].token_ids]
    assert whole.logprobs.token_logprobs[-3:] == pytest.approx(
        [e[t] for t, e in zip(ref[3].outputs[0].token_ids, ref[3].outputs[0].logprobs)],
        abs=1e-4)
    plain = client.completions.create(model="pydoc-chat", prompt=prompts[3], echo=True,
                                      max_tokens=3).choices[0]
    assert plain.text == whole.text and plain.logprobs is None
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per prompt token
    body = client.completions.create(model="pydoc-chat", prompt=prompts[5], max_tokens=1,
                                     extra_body=dict(prompt_logprobs=2)).model_dump()
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompts[5])
    for t, entry, e in zip(prompts[5][1:], entries[1:], ref[5].prompt_logprobs[1:]):
        assert entry[str(t)]["logprob"] == pytest.approx(e[t], abs=1e-4)
        assert entry[str(t)]["decoded_token"] == served_token(t)
        ranked = sorted((x for x in entry.values() if x["rank"]), key=lambda x: x["rank"])
        assert [x["rank"] for x in ranked] == [1, 2]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] == pytest.approx(sorted(
            e.values())[-2], abs=1e-4)
        assert len(entry) == 2 or entry[str(t)]["rank"] is None  # the prompt's, not in the 2
    chat = client.chat.completions.create(
        model="pydoc-chat", messages=[{"role": "user", "content": "Lambdas"}], max_tokens=1,
        extra_body=dict(prompt_logprobs=0)).model_dump()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:  # as vLLM: echo them instead
        list(client.completions.create(model="pydoc-chat", prompt="A", max_tokens=1,
                                       stream=True, extra_body=dict(prompt_logprobs=1)))
    assert e.value.param == "prompt_logprobs"


@pytest.mark.server
def test_server_tokenizes_and_detokenizes_as_vllms_routes(served):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, which lm-eval's remote tokenizer reads:
    the server's own tokenizer, round trip."""
    url, folder, _ = served

    def post(route, body):
        request = urllib.request.Request(url + route, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    text = "Lambdas é ∑"
    ids = post("/tokenize", dict(prompt=text, add_special_tokens=False))
    assert ids["tokens"] == demo.Tokenizer(folder).encode(text)
    assert ids["count"] == len(text.encode()) and ids["max_model_len"] == 256
    assert post("/detokenize", dict(tokens=ids["tokens"]))["prompt"] == text
    info = json.loads(urllib.request.urlopen(url + "/tokenizer_info", timeout=10).read())
    assert info["eos_token"] is None and info["model_max_length"] == 256  # no end token
    with pytest.raises(urllib.error.HTTPError) as e:
        post("/detokenize", dict(tokens=[1, 256]))
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "tokens"


@pytest.mark.server
@pytest.mark.parametrize("template", ["<s> $A", "<s> $A </s>"])
def test_server_tokenize_adds_special_tokens_only_when_asked(tmp_path, template):
    """A folder whose tokenizer.json adds special tokens (a BOS, or a BOS and an EOS: built here
    with tokenizers, nothing downloaded): /tokenize adds them by default and with
    add_special_tokens true, never with false, and the rest is the same tokens; its count is
    a completion's prompt_tokens for the same text (lm-eval counts context tokens so). Drawn:
    texts of the vocabulary's words."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("fastapi")
    import server
    served_chat_folder(tmp_path)
    words = [f"w{i}" for i in range(3, 40)]
    special = {"<s>": 1, "</s>": 2}
    vocab = {"[UNK]": 0, **special} | {w: i for i, w in enumerate(words, 3)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(special))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single=template, special_tokens=list(special.items()))
    backend.save(str(tmp_path / "tokenizer.json"))
    args = server.argument_parser().parse_args(["--model", str(tmp_path), "--temperature", "0"])
    model, engine, tokenizer = demo.load(args)
    added = [special[t] for t in template.split() if t in special]
    assert tokenizer.encode("w3") != tokenizer.encode("w3", add_special_tokens=False)
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:

        @settings(max_examples=examples(20), deadline=None, database=None)
        @given(text=st.lists(st.sampled_from(words), min_size=1, max_size=8).map(" ".join))
        def check(text):
            asked = {flag: served_post(url, "/tokenize", dict(prompt=text) | (
                {} if flag is None else dict(add_special_tokens=flag)))
                for flag in (None, True, False)}
            assert {status for status, _ in asked.values()} == {200}
            plain, with_special = asked[False][1]["tokens"], asked[True][1]["tokens"]
            assert asked[None][1] == asked[True][1]
            assert not set(plain) & set(special.values())
            assert sorted(t for t in with_special if t in special.values()) == sorted(added)
            assert [t for t in with_special if t not in special.values()] == plain
            assert plain == tokenizer.encode(text, add_special_tokens=False)
            assert all(out["count"] == len(out["tokens"]) for _, out in asked.values())
            status, out = served_post(url, "/v1/completions",
                                      dict(prompt=text, max_tokens=1))
            assert status == 200 and out["usage"]["prompt_tokens"] == len(with_special)
        check()


LM_EVAL_RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
url, tasks = sys.argv[1], sys.argv[2]
out = lm_eval.simple_evaluate(
    model="local-completions", tasks=["pydoc_mc", "pydoc_gen"], log_samples=True,
    model_args=dict(model="pydoc-chat", base_url=url + "/v1/completions", max_length=256,
                    batch_size=4),
    task_manager=TaskManager(include_path=tasks, include_defaults=False))
print(json.dumps(dict(results=out["results"], samples={
    task: [dict(arguments=x["arguments"], resps=x["resps"], doc=x["doc"]) for x in samples]
    for task, samples in out["samples"].items()})))
"""


def lm_eval_tasks(folder):
    """Two small lm-eval tasks written as local files, nothing to download: multiple choice
    (a loglikelihood per choice) over the docs' topics, whose right answer is each topic's own
    ending or another's (so that the model gets some wrong), and generate_until."""
    endings = ["statement is used to", "is a mutable sequence", "finds and loads modules",
               "are raised when", "defines a function", "defines a class", "wraps a block",
               "map keys to values"]
    docs = [dict(question=t, choices=[endings[i], endings[(i + 3) % 8], "zq xv"], answer=i % 3)
            for i, t in enumerate(SERVED_PROMPTS[:8])]
    with open(folder / "mc.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(folder / "gen.jsonl", "w") as f:
        f.writelines(json.dumps(dict(prompt=t)) + "\n" for t in SERVED_PROMPTS[8:12])
    local = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: pydoc_mc\n" + local.format(folder / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    (folder / "gen.yaml").write_text(
        "task: pydoc_gen\n" + local.format(folder / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: ""\ngeneration_kwargs:\n'
        '  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    return docs


@pytest.mark.server
def test_lm_eval_through_the_server_scores_as_the_engine(served, tmp_path):
    """lm-eval itself (its Python API, its local-completions model, unchanged) against the
    server: each choice's loglikelihood is the sum of the engine's own prompt logprobs over the
    choice's tokens, the multiple-choice accuracy is what those give directly, and each
    generation is Engine.generate's. lm-eval tokenizes through the server's /tokenize; its
    tasks are local files, and nothing is fetched (the Hugging Face libraries kept offline)."""
    pytest.importorskip("lm_eval")
    url, folder, model = served
    tok = demo.Tokenizer(folder)
    docs = lm_eval_tasks(tmp_path)
    env = os.environ | dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                            HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run([sys.executable, "-c", LM_EVAL_RUN, url, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    # loglikelihoods: lm-eval's, per (context, continuation), against the engine's logprobs
    pairs = [tuple(a) for x in out["samples"]["pydoc_mc"] for a in x["arguments"]]
    assert len(pairs) == 3 * len(docs)
    wholes = [tok.encode(context + continuation) for context, continuation in pairs]
    ref = served_reference(model, wholes, SamplingParams(max_tokens=1, temperature=0,
                                                         prompt_logprobs=0))
    engine_ll = {}
    for (context, continuation), whole, r in zip(pairs, wholes, ref):
        # lm-eval scores a context's trailing spaces as the continuation's ("def ", " x"): its
        # loglikelihood is of the tokens after the stripped context
        n = len(whole) - len(tok.encode(context.rstrip()))
        engine_ll[context, continuation] = sum(
            e[t] for t, e in zip(whole[-n:], r.prompt_logprobs[-n:]))
    right = 0
    for x in out["samples"]["pydoc_mc"]:
        got = [resp[0][0] for resp in x["resps"]]
        want = [engine_ll[tuple(a)] for a in x["arguments"]]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-3)
        right += max(range(3), key=want.__getitem__) == x["doc"]["answer"]
    assert out["results"]["pydoc_mc"]["acc,none"] == right / len(docs)
    assert 0 < right < len(docs)  # the task tells a right ranking from a wrong one
    # generations: lm-eval's text against Engine.generate's, with its until as stop strings
    gens = out["samples"]["pydoc_gen"]
    prompts = [tok.encode(x["arguments"][0][0]) for x in gens]
    ref = served_reference(model, prompts, SamplingParams(max_tokens=16, temperature=0,
                                                          stop=["\n"]))
    assert [x["resps"][0][0] for x in gens] == [r.outputs[0].text for r in ref]
    assert all(r.outputs[0].text for r in ref)


@pytest.mark.server
def test_guidellm_benchmarks_the_server_and_every_request_succeeds(served, tmp_path):
    """guidellm's synthetic benchmark, unchanged, against the server's chat route (guidellm's
    default: it streams with continuous usage stats, and sends ignore_eos and
    max_completion_tokens): every request succeeds with the output tokens it asked for."""
    pytest.importorskip("guidellm")
    import bench
    url, _, _ = served
    report = bench.guidellm_run(url, str(tmp_path), requests=4, concurrency=2, prompt_tokens=16,
                                output_tokens=8, request_format="/v1/chat/completions")
    requests = report["benchmarks"][0]["requests"]
    assert len(requests["successful"]) == 4 and not requests["errored"]
    assert not requests["incomplete"]
    for r in requests["successful"]:
        assert r["output_tokens"] == 8 and r["prompt_tokens"] > 16  # the template's tokens too
        body = json.loads(r["request_args"])["body"]
        assert body["max_completion_tokens"] == 8 and body["ignore_eos"] is True
        assert body["stream_options"]["continuous_usage_stats"] is True


@pytest.mark.server
@pytest.mark.parametrize("stream", [True, False])
def test_server_client_that_disconnects_leaves_no_request_and_no_block(served, stream):
    url, _, _ = served
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    before = served_metrics(url)
    if stream:  # the openai client reads three chunks, then goes away with 237 tokens to go
        chunks = served_client(url).completions.create(model="pydoc-chat", prompt="The for",
                                                       max_tokens=240, stream=True)
        assert next(chunks).choices[0].finish_reason is None
        next(chunks), next(chunks)
        chunks.close()
    else:  # a client waiting for one JSON body hangs up once the request runs
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("POST", "/v1/completions", json.dumps(dict(
            model="pydoc-chat", prompt="The for", max_tokens=240)),
            {"Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while served_metrics(url)["vllm:num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
        connection.close()
    deadline = time.monotonic() + 10
    while (m := served_metrics(url))[aborted] == before[aborted]:
        assert time.monotonic() < deadline, "the request was never aborted"
        time.sleep(0.05)
    assert m[aborted] == before[aborted] + 1
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["nanopaged:num_blocks_in_use"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    # it stopped where the client left, long before its 240 tokens
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 120


@pytest.mark.server
def test_server_answers_health_while_a_long_request_streams(served):
    url, _, _ = served
    stream = served_client(url).completions.create(model="pydoc-chat", prompt="Dictionaries",
                                                   max_tokens=200, stream=True)
    first = next(stream)
    start = time.monotonic()
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        assert response.status == 200
    assert time.monotonic() - start < 1.0
    rest = list(stream)  # it was still streaming: what is left came after /health answered
    assert first.choices[0].finish_reason is None and len(rest) >= 100
    assert rest[-1].choices[0].finish_reason == "length"


SERVED_BAD_FIELDS = [  # (endpoint, field, value[, the param the 400 names]); each alone in an
    # otherwise good request
    ("completions", "temperature", -1), ("completions", "temperature", "hot"),
    ("completions", "top_p", 0), ("completions", "top_p", 1.5), ("completions", "top_k", -1),
    ("completions", "min_p", 2), ("completions", "n", 0), ("completions", "n", 1.5),
    ("completions", "max_tokens", 0), ("completions", "max_tokens", 1000),
    ("completions", "presence_penalty", 3), ("completions", "frequency_penalty", -3),
    ("completions", "repetition_penalty", 0), ("completions", "min_tokens", -1),
    ("completions", "seed", "x"), ("completions", "stop", 5), ("completions", "stop", [""]),
    ("completions", "stop_token_ids", [256]), ("completions", "logprobs", -1),
    ("completions", "logprobs", 21), ("completions", "prompt", []),
    ("completions", "prompt", [[300]]), ("completions", "prompt", ""),
    ("completions", "prompt", "x" * 300), ("completions", "stream", "yes"),
    ("completions", "priority", 1), ("completions", "stream_options", {"include_usage": True}),
    ("completions", "stream_options", {"include_usage": "yes"}, "stream_options.include_usage"),
    ("completions", "stream_options", {"continuous_usage_stats": 1},
     "stream_options.continuous_usage_stats"),
    ("completions", "ignore_eos", "yes"), ("completions", "include_stop_str_in_output", 1),
    # known, but beyond this server: refused, not ignored
    ("completions", "best_of", 2), ("completions", "suffix", "!"),
    ("completions", "logit_bias", {"65": 5}), ("chat", "tools", []),
    ("chat", "response_format", {"type": "json_object"}),
    ("chat", "messages", []), ("chat", "messages", [{"content": "no role"}], "messages.[0].role"),
    ("chat", "messages", [{"role": "user", "content": [{"type": "image_url"}]}],
     "messages.[0].content"),
    ("chat", "messages", [{"role": "user", "content": 5}], "messages.[0].content"),
    ("chat", "max_completion_tokens", 0), ("chat", "top_logprobs", 2),
    ("chat", "logprobs", 1), ("chat", "temperature", -0.5), ("chat", "echo", True),
    ("completions", "prompt_logprobs", 21), ("completions", "prompt_logprobs", -1),
    ("completions", "echo", 1), ("chat", "prompt_logprobs", 1.5),
]


@pytest.mark.server
@pytest.mark.parametrize("endpoint, field, value, param", [
    case if len(case) == 4 else (*case, case[1]) for case in SERVED_BAD_FIELDS])
def test_server_bad_field_is_a_400_naming_it_and_reaches_no_engine(served, endpoint, field,
                                                                    value, param):
    import openai
    url, _, _ = served
    client = served_client(url)
    good = (dict(prompt="Lambdas", max_tokens=4) if endpoint == "completions" else
            dict(messages=[{"role": "user", "content": "Lambdas"}], max_tokens=4))
    before = served_metrics(url, cpu=False)
    create = client.completions.create if endpoint == "completions" else \
        client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model="pydoc-chat", extra_body={field: value}, **good)
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.type == "invalid_request_error" and param in e.value.message
    assert served_metrics(url, cpu=False) == before  # nothing of it reached the engine
    with pytest.raises(openai.NotFoundError) as e:  # and an unknown model is a 404
        create(model="gpt-4o", **good)
    assert e.value.param == "model" and e.value.code == "model_not_found"
    assert create(model="pydoc-chat", **good).usage.completion_tokens == 4


def served_post(url, route, body):
    """The status and JSON answer of a POST, an error's included."""
    request = urllib.request.Request(url + route, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.server
def test_server_reads_null_as_unset_in_every_optional_field(served):
    """Clients that write every field send null for those they leave unset (vLLM reads them so):
    each optional field of a request's model (a fork's new sampling field too), each field this
    server refuses a value for, and each of stream_options', sent as null alone and all at once,
    gives the answer of the request without it. A required field sent as null is a 400."""
    import server
    url, _, _ = served
    completion, chat = server.request_models()
    goods = {"/v1/completions": (completion, dict(prompt="Lambdas", max_tokens=3)),
             "/v1/chat/completions": (chat, dict(messages=[{"role": "user", "content": "Lambdas"}],
                                                 max_tokens=3)),
             "/tokenize": (server.TokenizeRequest, dict(prompt="Lambdas é"))}

    def answer(route, body):  # what does not change from one request to the next (the hit)
        status, out = served_post(url, route, body)
        assert status == 200, out
        if route == "/tokenize":
            return out
        usage = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
        return [c.get("text", c.get("message")) for c in out["choices"]], usage
    for route, (model, good) in goods.items():
        plain = answer(route, good)
        optional = [name for name, f in model.model_fields.items()
                    if not f.is_required() and name not in good]
        unsupported = sorted(server.UNSUPPORTED) if route != "/tokenize" else []
        for name in optional + unsupported:
            assert answer(route, good | {name: None}) == plain, name
        assert answer(route, good | dict.fromkeys(optional + unsupported)) == plain
        required = [name for name, f in model.model_fields.items() if f.is_required()]
        for name in required:
            status, out = served_post(url, route, good | {name: None})
            assert status == 400 and out["error"]["param"] == name
    streamed = dict(goods["/v1/completions"][1], stream=True)
    request = urllib.request.Request(url + "/v1/completions", json.dumps(streamed).encode(),
                                     {"Content-Type": "application/json"})
    for options in [{}, dict.fromkeys(server.StreamOptions.model_fields)]:
        body = json.dumps(streamed | dict(stream_options=options)).encode()
        with urllib.request.urlopen(request, body, timeout=30) as response:
            events = response.read().decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""] and len(events) == 5  # no usage chunk


@pytest.mark.server
def test_server_ignores_fields_it_does_not_know_and_logs_one_line_naming_them(served):
    """vLLM's reading: a field nobody here defines (a newer API's, a typo) changes nothing and
    is named, with its full path, in one line of the server's log."""
    url, folder, _ = served
    client = served_client(url)
    args = dict(model="pydoc-chat", prompt="Lambdas", max_tokens=6, stream=True,
                stream_options={"include_usage": True})
    plain = list(client.completions.create(**args))
    log = os.path.join(folder, "server.log")
    before = open(log).read()
    odd = list(client.completions.create(**args | dict(stream_options={
        "include_usage": True, "zest": 1}), extra_body=dict(frobnicate=[1], n_=2)))
    assert [c.choices and c.choices[0].text for c in odd] == \
        [c.choices and c.choices[0].text for c in plain]
    new = open(log).read()[len(before):].splitlines()
    named = [line for line in new if "frobnicate" in line]
    assert len(named) == 1 and "n_" in named[0] and "stream_options.zest" in named[0]


@pytest.mark.server
def test_server_chat_through_a_folders_tokenizer_json_and_template(hf_folder, tmp_path):
    """A Hugging Face folder: text through its tokenizer.json (a BOS added to a completion's
    prompt, none to a chat's: the template writes it), token names from it in logprobs."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("fastapi")
    import server
    path, _ = hf_folder("llama")  # vocabulary 128, 64 positions
    for name in ("config.json", "model.safetensors"):
        shutil.copy(path / name, tmp_path / name)
    vocab = {"[UNK]": 0, "<s>": 1, "hello": 2} | {f"w{i}": i for i in range(3, 128)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>"])  # so the template's "<s>" is one token
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])  # a BOS, unless told not to
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}" + SERVED_CHAT_TEMPLATE)
    tok = demo.Tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "hello w7 w9"}]
    chat_ids = tok.encode(checkpoints.render_chat(str(tmp_path), messages),
                          add_special_tokens=False)
    assert chat_ids.count(1) == 1 and tok.encode("hello w5")[:2] == [1, 2]
    ref = served_reference(GPT.from_pretrained(str(tmp_path)), [chat_ids, tok.encode("hello w5")],
                           SamplingParams(max_tokens=8, temperature=0, logprobs=1), str(tmp_path))
    with open(tmp_path / "server.log", "w+") as log, server.running_server(
            ["--model", str(tmp_path), "--temperature", "0", "--uvicorn-log-level", "warning"],
            timeout_s=60, log=log) as url:
        client = served_client(url)
        chat = client.chat.completions.create(model=tmp_path.name, messages=messages,
                                              max_tokens=8, logprobs=True, top_logprobs=1)
        out = client.completions.create(model=str(tmp_path), prompt="hello w5", max_tokens=8)
        echo = client.completions.create(model=str(tmp_path), prompt="hello w5", max_tokens=0,
                                         echo=True, logprobs=0).choices[0]
        info = json.loads(urllib.request.urlopen(url + "/tokenizer_info", timeout=10).read())
        request = urllib.request.Request(url + "/tokenize", json.dumps(dict(
            prompt="hello w5")).encode(), {"Content-Type": "application/json"})
        tokenized = json.loads(urllib.request.urlopen(request, timeout=10).read())
    assert chat.usage.prompt_tokens == len(chat_ids) and out.usage.prompt_tokens == 3
    c = ref[0].outputs[0]
    assert chat.choices[0].message.content == c.text
    assert [e.token for e in chat.choices[0].logprobs.content] == \
        [tok.decode([t]) for t in c.token_ids]
    assert [e.bytes for e in chat.choices[0].logprobs.content] == \
        [list(tok.decode([t]).encode()) for t in c.token_ids]
    assert out.choices[0].text == ref[1].outputs[0].text
    names = server.TokenTexts(tok)  # a special token goes by its text, as vLLM shows it
    assert (names.token(1), names.bytes(1), names.text(1)) == ("<s>", b"<s>", "")
    assert (names.token(2), names.text(2)) == ("hello", "hello")
    assert echo.text == "hello w5" and echo.logprobs.tokens[:2] == ["<s>", "hello"]
    assert info["bos_token"] == "<s>" and tokenized["tokens"] == tok.encode("hello w5")


@pytest.mark.server
@pytest.mark.parametrize("body, param", [(b"{not json", None), (b"[1, 2]", None),
                                         (b'{"prompt": "x", "n": 2.5}', "n")])
def test_server_a_body_that_does_not_parse_is_a_400_in_the_openai_shape(served, body, param):
    url, _, _ = served
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400
    error = json.loads(e.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


@pytest.mark.server
def test_server_api_key_and_seed_as_vllm_serve_takes_them():
    """--api-key: a /v1 request without it (or with another) is a 401 in the OpenAI API's shape,
    /health and /metrics stay open; --seed: unseeded sampled requests repeat, in order, on a
    server started with the same seed, and differ on another."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import server

    def texts(flags, key="k"):
        args = server.argument_parser().parse_args(flags)
        model, engine, tokenizer = demo.load(args)
        with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            return [client.completions.create(model="pydoc-gpt", prompt="The", max_tokens=12,
                                              temperature=1.0, n=2).choices[i].text
                    for _ in range(2) for i in range(2)], url
    flags = ["--api-key", "k", "--seed", "3"]
    first, url = texts(flags)
    assert texts(flags)[0] == first and len(set(first)) == 4  # each sample its own stream
    assert texts(["--api-key", "k", "--seed", "4"])[0] != first
    args = server.argument_parser().parse_args(["--api-key", "k"])
    model, engine, tokenizer = demo.load(args)
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
        for key in ("wrong", "none"):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                client.completions.create(model="pydoc-gpt", prompt="The", max_tokens=2)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        for route in ("/v1/models", "/tokenizer_info"):  # no header at all
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(url + route, timeout=10)
            assert e.value.code == 401
        assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
        assert served_metrics(url)["vllm:num_requests_running"] == 0
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


# What /metrics exported before prometheus_client rendered it: each is still there
SERVED_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc", "vllm:cpu_cache_usage_perc", "nanopaged:num_blocks",
    "nanopaged:num_blocks_in_use", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hit_rate", "nanopaged:cpu_cache_blocks",
    "nanopaged:cpu_prefix_cache_hits_total", "nanopaged:offloaded_blocks_total",
    "nanopaged:reloaded_blocks_total", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "process_cpu_seconds_total"] + [
    f'vllm:request_success_total{{finished_reason="{r}"}}' for r in ("stop", "length", "abort",
                                                                     "error")]
# vLLM's buckets for its latency histograms (vllm/v1/metrics/loggers.py), in seconds
VLLM_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                         160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                         0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:request_queue_time_seconds": VLLM_REQUEST_BUCKETS,
    "vllm:e2e_request_latency_seconds": VLLM_REQUEST_BUCKETS,
}


@pytest.mark.server
def test_server_metrics_parse_keep_every_count_and_observe_each_finished_request_once(tmp_path):
    """/metrics through prometheus_client's own parser: every metric it had before the library
    rendered it, labelled with the served name, with the engine's and the requests' values; and
    vLLM's latency histograms after requests of each kind (completions and chat, streamed or
    not, n=2) that queue for two sequence slots. Each finished request is observed once, with
    the engine's own RequestMetrics (the sums and the buckets of its time to first token, in the
    queue and end to end), and each gap between two steps that gave a request tokens once."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    parser = pytest.importorskip("prometheus_client.parser")
    import server
    folder = served_chat_folder(tmp_path)
    # two sequences at a time, and 16 tokens a step: the prompts are prefilled in chunks, steps
    # that give a request no token
    args = server.argument_parser().parse_args(["--model", str(folder), "--temperature", "0",
                                                "--max-num-seqs", "2",
                                                "--max-num-batched-tokens", "16",
                                                "--served-model-name", "pydoc-chat"])
    model, engine, tokenizer = demo.load(args)
    finals, step = [], engine.step

    def recorded():  # the engine's outputs as the loop gets them, in its thread
        outs = step()
        finals.extend(out for out in outs if out.finished)
        return outs
    engine.step = recorded
    # (route, stream, n, max_tokens): the prompts share a block, so the prefix cache hits
    kinds = [("completions", False, 1, 9), ("completions", True, 1, 12), ("chat", False, 2, 7),
             ("chat", True, 1, 10), ("completions", True, 2, 8), ("completions", False, 1, 1),
             ("chat", True, 2, 11), ("completions", False, 1, 14)]

    def ask(i):
        route, stream, n, max_tokens = kinds[i]
        prompt = f"The for statement of Python, {SERVED_PROMPTS[i]}"
        more = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
        if route == "chat":
            out = client.chat.completions.create(model="pydoc-chat", max_tokens=max_tokens, n=n,
                                                 messages=[{"role": "user", "content": prompt}],
                                                 **more)
        else:
            out = client.completions.create(model="pydoc-chat", prompt=prompt, n=n,
                                            max_tokens=max_tokens, **more)
        usage = list(out)[-1].usage if stream else out.usage
        assert usage.completion_tokens == n * max_tokens  # one token a sample a step, no end
        return usage
    served = server.served_model(args, model, engine, tokenizer)
    with served_in_thread(engine, served) as url:
        client = served_client(url)
        with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
            usages = list(pool.map(ask, range(len(kinds))))
        cpu = time.process_time()  # the server runs in this process: its CPU seconds are ours
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        cpu_after = time.process_time()
    s = engine.stats()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "pydoc-chat", sample
            named = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[sample.name + (f"{{{named}}}" if named else "")] = sample.value
    assert set(SERVED_METRICS) <= set(samples)
    want = {  # the counts as the engine keeps them, once it is idle
        "vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
        "vllm:num_requests_swapped": 0, "vllm:kv_cache_usage_perc": 0,
        "nanopaged:num_blocks": s["num_blocks"],
        "nanopaged:num_blocks_in_use": s["num_blocks"] - s["num_free_blocks"],
        "vllm:cpu_cache_usage_perc": 0,  # nothing swapped out
        "vllm:prefix_cache_queries_total": s["prefix_cache_queried_tokens"],
        "vllm:prefix_cache_hits_total": s["prefix_cache_hit_tokens"],
        "vllm:gpu_prefix_cache_hit_rate": (s["prefix_cache_hit_tokens"]
                                           / s["prefix_cache_queried_tokens"]),
        "nanopaged:cpu_cache_blocks": s["num_cpu_cached_blocks"],
        "nanopaged:cpu_prefix_cache_hits_total": s["prefix_cache_cpu_hit_tokens"],
        "nanopaged:offloaded_blocks_total": s["num_offloaded_blocks"],
        "nanopaged:reloaded_blocks_total": s["num_reloaded_blocks"],
        "vllm:num_preemptions_total": s["num_preemptions"],
        "vllm:prompt_tokens_total": sum(u.prompt_tokens for u in usages),
        "vllm:generation_tokens_total": sum(u.completion_tokens for u in usages),
        'vllm:request_success_total{finished_reason="length"}': len(kinds)}
    assert {name: samples[name] for name in want} == pytest.approx(want, rel=1e-12)
    assert s["prefix_cache_hit_tokens"] > 0 and s["num_blocks"] > 0
    for reason in ("stop", "abort", "error"):
        assert samples[f'vllm:request_success_total{{finished_reason="{reason}"}}'] == 0
    assert cpu <= samples["process_cpu_seconds_total"] <= cpu_after
    # the histograms: each finished request once, as its own metrics have it
    assert sorted(out.request_id for out in finals) == list(range(len(kinds)))
    observed = {
        "vllm:time_to_first_token_seconds": [o.metrics.first_token_time - o.metrics.arrival_time
                                             for o in finals],
        "vllm:request_queue_time_seconds": [o.metrics.time_in_queue for o in finals],
        "vllm:e2e_request_latency_seconds": [o.metrics.finished_time - o.metrics.arrival_time
                                             for o in finals]}
    assert max(observed["vllm:request_queue_time_seconds"]) > 0  # two slots: some waited
    for name, buckets in VLLM_BUCKETS.items():
        bounds = re.findall(rf'^{name}_bucket{{le="([^"]+)"}}$', "\n".join(samples), re.M)
        assert bounds == [str(le) for le in buckets] + ["+Inf"]
    for name, values in observed.items():
        assert samples[name + "_count"] == len(kinds)
        assert samples[name + "_sum"] == pytest.approx(sum(values), rel=1e-12, abs=1e-12)
        for le in VLLM_BUCKETS[name]:  # cumulative: the values at most le
            assert samples[f'{name}_bucket{{le="{le}"}}'] == sum(v <= le for v in values)
        assert samples[f'{name}_bucket{{le="+Inf"}}'] == len(kinds)
    # a gap between each two steps that gave a request tokens, however many samples it has
    # and whether or not it streams; together they span each request's first token to its
    # last, stamped where the loop hands them out, just after the engine's own stamps
    itl = "vllm:inter_token_latency_seconds"
    assert samples[itl + "_count"] == sum(max_tokens - 1 for *_, max_tokens in kinds)
    decode = sum(o.metrics.finished_time - o.metrics.first_token_time for o in finals)
    assert abs(samples[itl + "_sum"] - decode) < 0.02 * len(kinds)


@pytest.mark.server
def test_server_stream_interval_sends_n_tokens_an_event_that_add_up_to_the_answer(tmp_path,
                                                                                   monkeypatch):
    """--stream-interval N (SGLang's): a streamed choice of T tokens, one a step, comes in
    1 + ceil((T - 1) / N) chunks: its first token at once, then N at a time, then the rest with
    its finish (SGLang sends at tokens 1, N + 1, 2N + 1, ... and the last). Together they are the
    text, tokens and logprob offsets of the same request not streamed, each chunk with the usage
    so far, and the usage chunk is the whole; N = 1 is a chunk a token, as without the flag.
    Drawn: N, T, n, the route and the prompt."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pytest.importorskip("prometheus_client")
    import server

    def loaded(args):  # refused flags never get this far (else main would go on to serve)
        raise AssertionError("main loaded the model for a refused --stream-interval")
    monkeypatch.setattr(demo, "load", loaded)
    with pytest.raises(SystemExit, match="--stream-interval must be an integer >= 1"):
        server.main(["--stream-interval", "0"])
    monkeypatch.undo()
    base = ["--model", str(served_chat_folder(tmp_path)), "--temperature", "0",
            "--served-model-name", "pydoc-chat"]
    assert server.argument_parser().parse_args(base).stream_interval == 1
    args = server.argument_parser().parse_args(base + ["--stream-interval", "3"])
    model, engine, tokenizer = demo.load(args)
    served = server.served_model(args, model, engine, tokenizer)
    assert served.stream_interval == 3

    def pieces(choice, chat, streamed):  # a choice's text, its tokens, and their text offsets
        if chat:
            text = choice.delta.content if streamed else choice.message.content
            return text, [e.token for e in choice.logprobs.content], []
        logprobs = choice.logprobs
        return choice.text, logprobs.tokens, logprobs.text_offset

    with served_in_thread(engine, served) as url:
        client = served_client(url)

        @settings(max_examples=examples(20), deadline=None, database=None)
        @given(interval=st.integers(1, 6), max_tokens=st.integers(1, 12), n=st.integers(1, 2),
               chat=st.booleans(), prompt=st.sampled_from(SERVED_PROMPTS))
        @example(interval=3, max_tokens=11, n=1, chat=False, prompt=SERVED_PROMPTS[0])  # 1+3+3+3
        @example(interval=3, max_tokens=12, n=2, chat=True, prompt=SERVED_PROMPTS[1])  # 1+3+3+3+2
        @example(interval=1, max_tokens=5, n=1, chat=False, prompt=SERVED_PROMPTS[0])  # as before
        def check(interval, max_tokens, n, chat, prompt):
            served.stream_interval = interval  # as the flag sets it: each stream reads it
            if chat:
                create = client.chat.completions.create
                asked = dict(messages=[{"role": "user", "content": prompt}], logprobs=True,
                             top_logprobs=0)
            else:
                create, asked = client.completions.create, dict(prompt=prompt, logprobs=0)
            asked |= dict(model="pydoc-chat", max_tokens=max_tokens, n=n)
            whole = create(**asked)
            chunks = list(create(**asked, stream=True, stream_options={
                "include_usage": True, "continuous_usage_stats": True}))
            assert chunks[-1].choices == []  # the usage chunk: the whole's tokens
            assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == (
                n * max_tokens)
            assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
            # tokens a content chunk: the first at once, then N at a time, the rest with the end
            rest = max_tokens - 1
            sizes = [1] + [interval] * (rest // interval)
            if rest % interval:
                sizes.append(rest % interval)
            assert len(sizes) == 1 + math.ceil(rest / interval)
            for choice in whole.choices:
                mine = [c for c in chunks[:-1] if c.choices[0].index == choice.index]
                if chat:  # the role's chunk first, as without the flag
                    assert mine[0].choices[0].delta.role == "assistant"
                    mine = mine[1:]
                got = [pieces(c.choices[0], chat, True) for c in mine]
                assert [len(tokens) for _, tokens, _ in got] == sizes
                text, tokens, offsets = pieces(choice, chat, False)
                assert "".join(t for t, _, _ in got) == text
                assert sum((t for _, t, _ in got), []) == tokens
                assert sum((o for _, _, o in got), []) == offsets
                assert [c.choices[0].finish_reason for c in mine] == [None] * (len(sizes) - 1) + [
                    choice.finish_reason]
                assert [c.usage.completion_tokens for c in mine] == list(
                    itertools.accumulate(sizes))
        check()


# -----------------------------------------------------------------------------
# A step that fails: the engine rolls it back, the loop fails its requests, the rest go on

SERVED_POISON = 31  # a token id the poisoned model refuses, as a bug or a bad kernel might


def served_poisoned_model():
    model = copy.deepcopy(MODEL)
    forward = model.forward

    def poisoned(idx, *args, **kwargs):
        if (idx == SERVED_POISON).any():
            raise RuntimeError("poisoned batch")
        return forward(idx, *args, **kwargs)
    model.forward = poisoned
    return model


@pytest.mark.server
def test_engine_loop_fails_the_requests_of_a_failed_step_and_serves_the_rest():
    pytest.importorskip("fastapi")
    import server
    healthy, poisoned, waiting, later = [1, 2, 3], [4, SERVED_POISON, 5], [6, 7], [8, 9, 10]
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = Engine(MODEL, block_size=4, num_blocks=64).generate([waiting, later], params)
    engine = Engine(served_poisoned_model(), block_size=4, num_blocks=64, max_num_seqs=2)

    async def scenario():
        loop = server.EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        mailbox = server.Mailbox()
        # the first step admits the first two (max_num_seqs=2) and fails; the third waits
        subs = [server.Submission(p, params, 0, mailbox, i)
                for i, p in enumerate([healthy, poisoned, waiting])]
        for sub in subs:
            loop.submit(sub)
        ends = {}
        while len(ends) < 3:
            for sub, out in await mailbox.take():
                if isinstance(out, Exception) or out.finished:
                    ends[sub.index] = out
        after = server.Submission(later, params, 0, mailbox)  # and the server goes on serving
        loop.submit(after)
        out = None
        while out is None or not out.finished:
            out = (await mailbox.take())[-1][1]
        stats = await loop.stats()
        loop.stop()
        return ends, out, stats, loop.metrics
    ends, after, stats, metrics = asyncio.run(scenario())
    assert isinstance(ends[0], server.StepFailed) and isinstance(ends[1], server.StepFailed)
    assert "poisoned batch" in str(ends[1])
    assert ends[2].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert after.outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert stats["finished"] == {"error": 2, "length": 2} and not engine.requests
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # the latency histograms hold the two that finished, and the loop keeps no stamp of any
    counts = {name: value for name, value in rendered_histograms(metrics, stats).items()
              if name.endswith("_count")}
    assert counts == {"vllm:time_to_first_token_seconds_count": 2,
                      "vllm:request_queue_time_seconds_count": 2,
                      "vllm:e2e_request_latency_seconds_count": 2,
                      "vllm:inter_token_latency_seconds_count": 2 * (params.max_tokens - 1)}
    assert metrics.token_times == {}


def rendered_histograms(metrics, stats):
    """ServerMetrics' text through prometheus_client's parser: {histogram sample: value}."""
    from prometheus_client.parser import text_string_to_metric_families
    samples = {}
    for family in text_string_to_metric_families(metrics.render(stats).decode()):
        if family.type == "histogram":
            samples |= {x.name: x.value for x in family.samples if "le" not in x.labels}
    return samples


@pytest.mark.server
def test_engine_loop_latency_histograms_leave_out_an_aborted_request():
    """A streamed request aborted after steps that gave it tokens (its first token and gaps
    between them) is in no latency histogram; the request that finished beside it is in each
    once, with a gap for each step after its first."""
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    import server
    streamed = SamplingParams(max_tokens=60, temperature=0, output_kind="delta")
    whole = SamplingParams(max_tokens=6, temperature=0)
    engine = Engine(MODEL, block_size=4, num_blocks=64)
    released, step, steps = threading.Event(), engine.step, []

    def held():  # the fourth step waits for the abort, so the streamed request cannot finish
        if len(steps) == 3:
            assert released.wait(timeout=30)
        steps.append(len(steps))
        return step()
    engine.step = held

    async def scenario():
        loop = server.EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        mailbox = server.Mailbox()
        aborted = server.Submission([1, 2, 3], streamed, 0, mailbox, 0)
        finished = server.Submission([4, 5], whole, 0, mailbox, 1)
        loop.submit(aborted)
        loop.submit(finished)
        deltas, last = 0, None
        while last is None or not last.finished:
            for sub, out in await mailbox.take():
                deltas += sub is aborted
                last = out if sub is finished else last
            if deltas == 3 and not released.is_set():  # three steps gave it tokens
                loop.abort([aborted])
                released.set()
        stats = await loop.stats()
        loop.stop()
        return last, stats, loop.metrics
    last, stats, metrics = asyncio.run(scenario())
    assert stats["finished"] == {"abort": 1, "length": 1} and not engine.requests
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 6
    counts = {name: value for name, value in rendered_histograms(metrics, stats).items()
              if name.endswith("_count")}
    assert counts == {"vllm:time_to_first_token_seconds_count": 1,
                      "vllm:request_queue_time_seconds_count": 1,
                      "vllm:e2e_request_latency_seconds_count": 1,
                      "vllm:inter_token_latency_seconds_count": whole.max_tokens - 1}
    assert metrics.token_times == {}


@pytest.mark.server
def test_a_histogram_added_to_the_table_is_in_metrics_with_each_finished_request(tmp_path,
                                                                                monkeypatch):
    """A row a fork adds to server.HISTOGRAMS, and nothing else: /metrics shows it beside the
    built-in ones, with its help and buckets, observed once for each finished request with what
    its function reads from the request's output."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pytest.importorskip("prometheus_client")
    import server
    name = "nanopaged:request_generation_tokens"
    generated = server.RequestHistogram(
        name, "Tokens a finished request generated, all its samples.", (1.0, 4.0, 8.0, 16.0),
        lambda out, times: [sum(len(c.token_ids) for c in out.outputs)])
    monkeypatch.setattr(server, "HISTOGRAMS", [*server.HISTOGRAMS, generated])
    folder = served_chat_folder(tmp_path)
    args = server.argument_parser().parse_args(["--model", str(folder), "--temperature", "0",
                                                "--served-model-name", "pydoc-chat"])
    model, engine, tokenizer = demo.load(args)
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
        client = served_client(url)
        values = [client.completions.create(model="pydoc-chat", prompt=prompt, max_tokens=m,
                                            n=n).usage.completion_tokens
                  for prompt, m, n in zip(SERVED_PROMPTS, [3, 5, 12], [1, 2, 1])]
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        samples = served_metrics(url)
    assert f"# HELP {name} {generated.documentation}" in text
    assert samples[name + "_count"] == len(values) and samples[name + "_sum"] == sum(values)
    for le in generated.buckets:  # cumulative: the values at most le
        assert samples[f'{name}_bucket{{le="{le}"}}'] == sum(v <= le for v in values)
    assert samples[f'{name}_bucket{{le="+Inf"}}'] == len(values)
    for built_in in VLLM_BUCKETS:
        assert f"{built_in}_count" in samples
    assert samples["vllm:e2e_request_latency_seconds_count"] == len(values)


@contextlib.contextmanager
def served_in_thread(engine, served):
    """server.build_app(engine, served) under uvicorn in a thread of this process (so a test can
    hand it an engine of its own); yields its URL, and stops it however the test ends."""
    import uvicorn

    import server
    port = server.free_port()
    uv = uvicorn.Server(uvicorn.Config(server.build_app(engine, served), host="127.0.0.1",
                                       port=port, log_level="critical"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.mark.server
def test_server_a_failed_step_is_a_500_or_an_error_event_in_the_openai_shape():
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import server
    engine = Engine(served_poisoned_model(), block_size=4, num_blocks=64)
    served = server.ServedModel(
        names=["poisoned"], path="", tokenizer=demo.Tokenizer(demo.DEMO_MODEL), max_seq_len=64,
        vocab_size=32, defaults=demo.sampling_defaults() | dict(temperature=0.0),
        priority_scheduling=False, check_request=engine.check_request)
    with served_in_thread(engine, served) as url:
        client = served_client(url)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="poisoned", prompt=[1, SERVED_POISON], max_tokens=3)
        assert e.value.status_code == 500 and e.value.type == "server_error"
        assert "poisoned batch" in e.value.message
        with pytest.raises(openai.APIError, match="poisoned batch"):
            list(client.completions.create(model="poisoned", prompt=[SERVED_POISON],
                                           max_tokens=3, stream=True))
        out = client.completions.create(model="poisoned", prompt=[1, 2], max_tokens=3)
        assert out.choices[0].finish_reason == "length"
        m = served_metrics(url)
        assert m['vllm:request_success_total{finished_reason="error"}'] == 2
        assert m["nanopaged:num_blocks_in_use"] == 0


@pytest.mark.server
@pytest.mark.demo
def test_every_setting_generation_config_json_sets_is_a_flag_that_overrides_it(tmp_path):
    """What a folder's generation_config.json can set, the command line can override: each
    SamplingParams field it reads (but max_new_tokens, --max-tokens in the CLI and the cap of a
    chat's default in the server) is a flag of `python nanopaged.py` and of server.py, whose
    value the requests get, and without which they get the file's; and every flag README.md
    names is the CLI's. The fields come from the metadata that says where the file keeps them,
    so a field whose flag metadata went missing loses its flag here, not silently."""
    pytest.importorskip("fastapi")
    import server
    read = [f for f in dataclasses.fields(SamplingParams) if "hf" in f.metadata
            and f.name != "max_tokens"]
    assert {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
            "min_tokens"} <= {f.name for f in read}

    def allowed(f, n):  # n values the field's own check takes, none its default
        return [x for x in (0.5, 3, 0.25, 2) if f.metadata["ok"](x) and x != f.default][:n]
    from_file, from_flag = ({f.name: allowed(f, 2)[i] for f in read} for i in (0, 1))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{demo.DEMO_MODEL}/{name}", tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        dict(do_sample=True) | {f.metadata["hf"]: from_file[f.name] for f in read}))
    flags = [x for name, value in from_flag.items()
             for x in (f"--{name.replace('_', '-')}", str(value))]
    base = ["--model", str(tmp_path)]
    for extra, want in (([], from_file), (flags, from_flag)):
        cli = demo.argument_parser().parse_args(base + ["--prompt", "A", "--max-tokens", "4"]
                                                + extra)
        params = demo.build(cli)[4][0]
        assert {name: getattr(params, name) for name in want} == want
        args = server.argument_parser().parse_args(base + extra)
        served = server.served_model(args, *demo.load(args))
        assert {name: served.defaults[name] for name in want} == want
    readme = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read()
    named = set(re.findall(r"`(--[a-z][a-z-]*)", readme.split("lists every flag:")[1][:600]))
    options = set(re.findall(r"--[a-z][a-z-]*", demo.argument_parser().format_help()))
    assert "--min-p" in named and named <= options


@dataclasses.dataclass
class TypicalSamplingParams(SamplingParams):
    """A fork's new sampling parameter, transformers' typical_p, as its one field: what it allows,
    its flag's words, its generation_config.json key and transformers' default (a warper)."""
    typical_p: float = checks.setting(
        1.0, "a number in (0, 1]", lambda x: checks.number(x) and 0 < x <= 1, hf="typical_p",
        hf_default=1.0, flag="keep the likeliest tokens of typical information, up to this mass")


@pytest.mark.server
@pytest.mark.demo
def test_a_new_sampling_field_reaches_flags_requests_and_checkpoints(monkeypatch, tmp_path):
    """Issue 38's fork: typical_p as a SamplingParams field with its metadata, and a pipeline
    step that hears it, and nothing else edited: the CLI flag, generation_config.json, the
    server's flag and its request field all reach the step."""
    pytest.importorskip("fastapi")
    import server
    heard = []

    def apply_typical_p(scores, meta):  # the fork's step: here it only listens
        heard.extend(p.typical_p for p in meta.params)
        return scores
    for module in (checks, nanopaged, demo):  # as if the fork had edited checks.py itself
        monkeypatch.setattr(module, "SamplingParams", TypicalSamplingParams)
    monkeypatch.setattr(nanopaged, "SAMPLING_STEPS", nanopaged.SAMPLING_STEPS + [apply_typical_p])
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{demo.DEMO_MODEL}/{name}", tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(do_sample=True,
                                                                     typical_p=0.9)))
    assert checkpoints.generation_defaults(str(tmp_path))["typical_p"] == 0.9
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(do_sample=True)))
    assert checkpoints.generation_defaults(str(tmp_path))["typical_p"] == 1.0  # transformers'
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(typical_p=0.9)))
    assert "typical_p" not in checkpoints.generation_defaults(str(tmp_path))  # greedy: no warper
    # the CLI: a flag with its words, which wins over generation_config.json's value
    assert "typical information" in demo.argument_parser().format_help()
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(  # server.py, which has
        do_sample=True, typical_p=0.9, max_new_tokens=3)))  # no --max-tokens, reads it too
    flags = ["--model", str(tmp_path), "--prompt", "Lambdas", "--max-tokens", "2"]
    assert demo.build(demo.argument_parser().parse_args(flags))[4][0].typical_p == 0.9
    args = demo.argument_parser().parse_args(flags + ["--typical-p", "0.5"])
    _, engine, _, prompts, params, _ = demo.build(args)
    assert params[0].typical_p == 0.5
    engine.generate(prompts, params)
    assert heard and set(heard) == {0.5}
    # the server: its flag is the default of a request field under the same name
    heard.clear()
    args = server.argument_parser().parse_args(["--model", str(tmp_path), "--typical-p", "0.7"])
    model, engine, tokenizer = demo.load(args)
    with served_in_thread(engine, server.served_model(args, model, engine, tokenizer)) as url:
        client = served_client(url)
        name = tmp_path.name
        client.completions.create(model=name, prompt="A", max_tokens=2, temperature=1.0)
        assert set(heard) == {0.7}
        heard.clear()
        client.completions.create(model=name, prompt="A", max_tokens=2, temperature=1.0,
                                  extra_body=dict(typical_p=0.25))
        assert set(heard) == {0.25}
        with pytest.raises(Exception) as e:
            client.completions.create(model=name, prompt="A", max_tokens=2,
                                      extra_body=dict(typical_p=2))
        assert e.value.status_code == 400 and e.value.param == "typical_p"


# -----------------------------------------------------------------------------
# pagetrace.py: the trace of paging, its replay, and its page in a real browser  (-m trace)


def assert_replay_is_the_engine(pool, engine):
    """The replayed pool is the engine's: every block table, ref count and cached prefix."""
    s, a = engine.scheduler, engine.allocator

    def tables(queue):  # each sequence's, by the trace's names (pagetrace.table_of)
        return {pagetrace.table_of(dict(seq=seq.seq_id, group=g)): table
                for request in queue for seq in request.seqs
                for g, table in enumerate(seq.block_tables)}
    assert pool.tables == tables(s.running) and pool.cpu_tables == tables(s.swapped)
    assert pool.ref_counts() == Counter({b.block_id: b.ref_count for b in a.blocks
                                         if b.ref_count})
    assert {b: tuple(tokens) for b, (_, tokens) in pool.cached.items()} == \
        {b.block_id: b.token_ids for b in a.blocks if b.hash is not None}
    assert {b: tuple(tokens) for b, (_, tokens) in pool.cpu_cached.items()} == \
        {b.block_id: b.token_ids for b in a.swap_pool.blocks if b.hash is not None}
    for g in [*s.running, *s.swapped, *s.waiting]:
        for seq in g.seqs:
            computed = seq.token_ids[:seq.num_computed_tokens]
            assert pool.tokens[seq.seq_id][:len(computed)] == computed
    statuses = {g.request_id: name for name, queue in [("running", s.running),
                                                      ("waiting", s.waiting),
                                                      ("swapped", s.swapped)] for g in queue}
    assert {r: st for r, st in pool.requests.items() if st not in ("finished", "aborted")} == \
        statuses


@pytest.mark.trace
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=kinds_of_requests(vocab_size=8),
       block_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 8),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       tier=st.sampled_from([0, 4, 16]),
       fail_at=st.sets(st.integers(0, 30), max_size=3), abort_at=st.sets(st.integers(0, 30),
                                                                           max_size=2),
       point=st.sampled_from([(GPT, "forward"), (nanopaged, "sample"),
                              (nanopaged.PrefixCache, "publish"), (nanopaged.Scheduler, "_admit"),
                              (nanopaged.SwapPool, "offload")]),
       model=st.sampled_from(sorted(PAGED_MODELS)))
def test_replaying_the_trace_rebuilds_the_pool_at_every_step(requests, block_size, spare, mode,
                                                             caching, tier, fail_at, abort_at,
                                                             point, model):
    """Over random workloads (both preemption modes, prefix caching on and off, the CPU tier on
    and off, samples, beams, aborts, steps that fail and are rolled back; full attention,
    sliding windows and both: every KV cache group's table), the pool replayed from the trace
    alone equals the engine's after every step, failed or not, in both tiers."""
    params = [SamplingParams(max_tokens=m, temperature=0 if kind == "greedy" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1,
                             beam_width=2 if kind == "beam=2" else None)
              for i, (_, m, kind) in enumerate(requests)]
    model = PAGED_MODELS[model]
    roomy = Engine(model, block_size=block_size, num_blocks=1024)
    worst = max(blocks_a_request_may_hold(roomy, r[0], p) for r, p in zip(requests, params))
    trace = pagetrace.Trace()
    engine = Engine(model, block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                    enable_prefix_caching=caching, max_num_batched_tokens=6, max_num_seqs=4,
                    observer=trace, cpu_cache_bytes=tier * 1024 if caching else 0)
    ids = [engine.add_request(r[0], p) for r, p in zip(requests, params)]
    owner, name = point
    real, calls = getattr(owner, name), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        result = real(*args, **kwargs)
        if calls[0] in fail_at:
            raise RuntimeError("injected")
        return result
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, flaky)
        for i in range(300):  # bounded: see drain
            if not engine.requests:
                break
            if i in abort_at and engine.requests:
                engine.abort(sorted(engine.requests)[0])
            try:
                engine.step()
            except RuntimeError as e:
                assert "injected" in str(e)
            assert_replay_is_the_engine(pagetrace.replay(trace.events)[-1][1], engine)
    assert not engine.requests and set(ids) >= set(pagetrace.replay(trace.events)[-1][1].requests)
    event(f"rolled back: {any(e['event'] == 'rollback' for e in trace.events)}")


@pytest.mark.trace
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=8),
                                   st.integers(1, 4), st.sampled_from(["greedy", "n=2"])),
                         min_size=2, max_size=6),
       block_size=st.sampled_from([1, 2]), spare=st.integers(0, 3),
       mode=st.sampled_from(["recompute", "swap"]), tier=st.sampled_from([0, 2, 8]),
       cpu=st.booleans(), fail=st.sets(st.integers(1, 4), min_size=1, max_size=2),
       point=st.sampled_from([(GPT, "forward"), (nanopaged, "sample")]))
@example(requests=[([0, 0], 1, "greedy"), ([1, 1], 1, "greedy"), ([2, 2], 1, "greedy")],
         block_size=1, spare=0, mode="recompute", tier=0, cpu=False, fail={1},
         point=(GPT, "forward"))  # the second prompt's step takes the first's cached block
@example(requests=[([0, 0, 0], 1, "greedy"), ([0], 1, "greedy"), ([0], 3, "greedy")],
         block_size=1, spare=0, mode="recompute", tier=2, cpu=False, fail={3},
         point=(GPT, "forward"))  # and the CPU tier's, to offload a block the device evicts
def test_the_replay_forgets_the_prefix_of_a_block_a_failed_step_evicted(
        requests, block_size, spare, mode, tier, cpu, fail, point):
    """A step that evicts a cached block and then fails: its undo gives the block back to the
    free list but not its prefix (the failed step may have written into it), in either tier.
    Failures are injected after the forward (or the draw) of the k-th step that evicted from
    the device's cache (or from the CPU tier's, with cpu), for k drawn: in a tight pool of
    prompts from three tokens, cached blocks are evicted often. The pool replayed from the trace
    equals the engine's after the failed step and after every one that follows."""
    params = [SamplingParams(max_tokens=m, temperature=0 if kind == "greedy" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1)
              for i, (_, m, kind) in enumerate(requests)]
    worst = max(p.n * -(-(len(r[0]) + p.max_tokens) // block_size)
                for r, p in zip(requests, params))
    trace = pagetrace.Trace()
    engine = Engine(MODEL, block_size=block_size, num_blocks=worst + spare, preemption_mode=mode,
                    max_num_batched_tokens=6, max_num_seqs=4, observer=trace,
                    cpu_cache_bytes=tier * 1024 * block_size)  # tier blocks
    evicting = "cpu_" if cpu and tier else ""  # the prefix cache's tier whose evictions count
    for r, p in zip(requests, params):
        engine.add_request(r[0], p)
    owner, name = point
    real, real_evict = getattr(owner, name), nanopaged.PrefixCache.evict
    evicted, evicting_steps, failed = [], [0], []  # this step's evictions, steps that evicted

    def evict(self):
        if self.tier == evicting:
            evicted.append(1)
        return real_evict(self)

    def flaky(*args, **kwargs):
        result = real(*args, **kwargs)
        if evicted and evicting_steps[0] + 1 in fail:
            failed.append(1)
            raise RuntimeError("injected")
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, flaky)
        mp.setattr(nanopaged.PrefixCache, "evict", evict)
        for _ in range(300):  # bounded: see drain
            if not engine.requests:
                break
            evicted.clear()
            try:
                engine.step()
            except RuntimeError as e:
                assert "injected" in str(e)
            evicting_steps[0] += bool(evicted)
            assert_replay_is_the_engine(pagetrace.replay(trace.events)[-1][1], engine)
    assert not engine.requests
    rollbacks = [e for e in trace.events if e["event"] == "rollback"]
    event(f"failed after evicting: {bool(failed)}; uncached: device "
          f"{any(e['uncached'] for e in rollbacks)}, CPU "
          f"{any(e['cpu_uncached'] for e in rollbacks)}")


@pytest.mark.trace
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4),
                                   st.integers(4, 8), st.sampled_from(["greedy", "n=2"])),
                         min_size=2, max_size=4),
       spare=st.integers(0, 2), picks=st.lists(st.integers(0, 3), min_size=1, max_size=2),
       tier=st.sampled_from([0, 8]))
@example(requests=[([1, 2, 3], 6, "greedy"), ([4, 5, 6], 6, "n=2")], spare=0, picks=[0], tier=0)
def test_the_replay_frees_the_cpu_blocks_of_a_swapped_request_that_is_aborted(
        requests, spare, picks, tier):
    """A request preempted by swap and aborted while swapped out gives back its CPU blocks: the
    pool replayed from the trace holds no table of it, in either pool, and equals the engine's
    after the abort and at the end (samples, a pool too tight for the requests together, the
    tier on or off)."""
    params = [SamplingParams(max_tokens=m, temperature=0 if kind == "greedy" else 1.0, seed=i,
                             n=2 if kind == "n=2" else 1)
              for i, (_, m, kind) in enumerate(requests)]
    worst = max(p.n * (len(r[0]) + p.max_tokens) for r, p in zip(requests, params))
    trace = pagetrace.Trace()
    engine = Engine(MODEL, block_size=1, num_blocks=worst + spare, preemption_mode="swap",
                    max_num_batched_tokens=8, max_num_seqs=4, observer=trace,
                    cpu_cache_bytes=tier * 1024)  # 1024 bytes: a block of one token
    for r, p in zip(requests, params):
        engine.add_request(r[0], p)
    aborted = []
    for _ in range(300):  # bounded: see drain
        if not engine.requests:
            break
        swapped = [g.request_id for g in engine.scheduler.swapped]
        if swapped and len(aborted) < len(picks):
            aborted.append(swapped[picks[len(aborted)] % len(swapped)])
            engine.abort(aborted[-1])
            pool = pagetrace.replay(trace.events)[-1][1]
            assert not any(pool.request_of[pagetrace.seq_of(t)] == aborted[-1]
                           for t in [*pool.tables, *pool.cpu_tables])
            assert_replay_is_the_engine(pool, engine)
        engine.step()
    assert not engine.requests
    assert_replay_is_the_engine(pagetrace.replay(trace.events)[-1][1], engine)
    event(f"aborted a swapped request: {bool(aborted)}")


@pytest.mark.trace
def test_an_observer_that_raises_fails_the_step_and_changes_nothing():
    """A raising observer is the step's failure like any other: rolled back, nothing lost; an
    observer that raises while the step is undone cannot stop the undo."""
    def fragile(event):
        if event["event"] in ("publish", "rollback", "free"):
            raise RuntimeError(f"observer failed on {event['event']}")
    engine = Engine(MODEL, block_size=2, num_blocks=24, observer=fragile)
    prompt = [1, 2, 3, 4, 5]
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    before = engine_state(engine)
    with pytest.raises(RuntimeError, match="observer failed on publish"):
        engine.step()
    assert engine_state(engine) == before
    engine.set_observer(None)
    assert drain(engine)[0].outputs[0].token_ids == naive_greedy(MODEL, prompt, 4)
    assert_all_blocks_free(engine)


@pytest.mark.trace
def test_an_observer_that_raises_in_a_commit_is_heard_at_the_next_step():
    """A commit cannot stop halfway: an observer that raises on "free" (a finished sequence
    gives its blocks back in the commit) lets the step stand and return its outputs; the next
    step raises the error and changes nothing; generate() raises it before it returns."""
    failed = []

    def fragile(event):
        if event["event"] == "free" and not failed:
            failed.append(1)
            raise RuntimeError("observer failed on free")
    engine = Engine(MODEL, block_size=2, num_blocks=24, observer=fragile)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    outputs = [o for _ in range(10) if engine.requests for o in engine.step()]
    assert failed and outputs[-1].finished
    assert outputs[-1].outputs[0].token_ids == naive_greedy(MODEL, [1, 2, 3], 2)
    before = engine_state(engine)
    with pytest.raises(RuntimeError, match="observer failed on free"):
        engine.step()
    assert engine_state(engine) == before and engine.step() == []
    failed.clear()
    with pytest.raises(RuntimeError, match="observer failed on free"):
        engine.generate([[4, 5]], SamplingParams(max_tokens=2, temperature=0))
    assert engine.step() == [] and assert_all_blocks_free(engine) is None


@pytest.mark.trace
def test_with_nobody_listening_nothing_is_recorded():
    engine = Engine(MODEL, block_size=2, num_blocks=24)
    a = engine.allocator
    assert all(part.observer is None for part in (
        engine, engine.scheduler, a, a.prefix_cache, a.swap_pool, a.swap_pool.prefix_cache))


@pytest.mark.trace
def test_the_trace_is_one_json_object_a_line_with_its_step(tmp_path):
    trace = pagetrace.Trace()
    engine = Engine(MODEL, block_size=2, num_blocks=24, observer=trace)
    engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_tokens=3, n=2, temperature=1.0))
    trace.write_jsonl(tmp_path / "trace.jsonl")
    events = pagetrace.read_jsonl(tmp_path / "trace.jsonl")
    assert events == json.loads(json.dumps(trace.events))
    assert [e["step"] for e in events] == sorted(e["step"] for e in events)
    kinds = {e["event"] for e in events}
    assert {"add", "admit", "allocate", "fork", "cow", "publish", "free", "finished"} <= kinds



PAGE_BROWSERS = ("chromium-headless-shell", "chromium")  # Debian's; .ci/run installs the first
PAGE_TIMEOUT_MS = 20_000  # the bound on every launch and wait: a broken page fails, never hangs


def page_browser():
    """The system's headless Chromium, and Playwright's sync API to drive it. Skipped where
    either is missing, except on CI (CI=true), where a skip would hide a page nobody tested."""
    path = next(filter(None, map(shutil.which, PAGE_BROWSERS)), None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if path and sync_playwright:
        return path, sync_playwright
    missing = ("the playwright package (requirements-dev.txt)" if path else
               "a headless Chromium (apt-get install --no-install-recommends "
               "chromium-headless-shell)")
    (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the page test needs {missing}")


@functools.cache  # one run for every test here: they only read it
def page_run_events():
    """The trace of a small run with what the page shows: a prompt prefix two requests share
    from the prefix cache, two samples forked from one prompt that copy on write, and a pool
    of 12 blocks of 4 tokens, too small for all of them: a request is preempted."""
    trace = pagetrace.Trace()
    engine = Engine(MODEL, block_size=4, num_blocks=12, max_num_seqs=4, observer=trace)
    trace(pagetrace.header(engine))
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]  # two full blocks
    for prompt, params in [
            (prefix + [5, 3], SamplingParams(max_tokens=10, n=2, temperature=1.0, seed=0)),
            (prefix + [8, 9, 7], SamplingParams(max_tokens=10, temperature=0)),
            ([2, 7, 1, 8, 2, 8], SamplingParams(max_tokens=12, temperature=0)),
            (prefix + [1], SamplingParams(max_tokens=8, temperature=0))]:
        engine.add_request(prompt, params)
    for _ in range(200):  # bounded: a stall fails the test, never hangs it
        if not engine.requests:
            break
        engine.step()
    assert not engine.requests
    return trace.events


@pytest.mark.trace
def test_every_event_the_engine_tells_has_words():
    events = page_run_events()
    names = pagetrace.seq_names(events)
    assert {e["event"] for e in events} <= set(pagetrace.WORDS)
    for e in events:  # a sentence is what a browser shows: no stray space, no empty list
        words = pagetrace.describe(e, names)
        assert words is None or (words == " ".join(words.split()) and "()" not in words), e
    cow = next(e for e in events if e["event"] == "cow")
    assert pagetrace.describe(cow, names).startswith(
        f"seq {names[cow['seq']]} copied block {cow['src']} to {cow['dst']} before writing")
    hit = next(e for e in events if e["event"] == "allocate" and e["hits"])
    assert f"request {hit['request']} hit {hit['hits']} cached blocks" in \
        pagetrace.describe(hit, names)


def page_step_with_sharing(states):
    """The index in replay()'s states of a step where a request runs two sequences and blocks
    are shared (the most shared), its most shared block, and that block's request's sequences."""
    def sharing(i):
        pool = states[i][1]
        forked = len({pool.request_of[s] for s in pool.tables}) < len(pool.tables)
        return forked, sum(n > 1 for n in pool.ref_counts().values())
    at = max(range(len(states)), key=sharing)
    pool = states[at][1]
    refs = pool.ref_counts()
    shared = max(refs, key=refs.get)
    owner = next(s for s, table in pool.tables.items() if shared in table)
    seqs = [s for s in pool.tables if pool.request_of[s] == pool.request_of[owner]]
    assert refs[shared] > 1 and len(seqs) > 1, "the run has a step with sharing and a fork"
    return at, shared, seqs


@pytest.mark.trace
def test_the_page_replays_the_trace_in_a_real_browser(tmp_path):
    """The page loads with no console error; moved to a step with sharing, it draws the pool,
    the ref counts, the block tables and the events replay() and step_words() give there."""
    path, sync_playwright = page_browser()
    events = page_run_events()
    assert {"fork", "cow", "preempt", "publish"} <= {e["event"] for e in events}
    assert any(e["event"] == "allocate" and e["hits"] for e in events)  # a prefix-cache hit
    page_file = tmp_path / "paging.html"
    pagetrace.write_html(events, page_file)
    states, names = pagetrace.replay(events), pagetrace.seq_names(events)
    at, shared, seqs = page_step_with_sharing(states)
    step, pool = states[at]
    refs = pool.ref_counts()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, timeout=PAGE_TIMEOUT_MS)
        try:
            page = browser.new_page(viewport=dict(width=1366, height=768))  # a laptop's
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_file.as_uri())
            page.locator("#slider").fill(str(at))
            assert f"step {step} " in page.locator("#step").inner_text()
            assert page.locator("#pool .block").count() == 12
            assert page.locator("#pool .block.used").count() == len(refs)
            cell = page.locator(f'#pool [data-block="{shared}"]')
            assert cell.locator(".ref").inner_text() == f"\u00d7{refs[shared]}"
            assert page.locator("#tables .row:not(.swapped)").count() == len(pool.tables)
            for seq in seqs:
                row = page.locator(f'#tables .row:not(.swapped)[data-seq="{seq}"] .chip')
                assert [int(b) for b in row.all_inner_texts()] == pool.tables[seq]
            cell.hover()  # the tooltip tells its ref count, owners and tokens
            tip = page.locator("#tip").inner_text()
            assert f"block {shared}, ref count {refs[shared]}" in tip and "tokens: " in tip
            assert all(f"seq {names[s]}" in tip for s in seqs if shared in pool.tables[s])
            page.locator(f'#tables .row[data-seq="{seqs[0]}"] .name').click()  # light it up
            lit = {b for s in seqs for b in pool.tables[s]}
            assert page.locator("#pool .block.lit").count() == len(lit)
            assert page.locator("#events li").all_inner_texts() == pagetrace.step_words(
                pagetrace.by_step(events)[at], names)
            page.screenshot(path=tmp_path / "paging.png")
        finally:
            browser.close()
    assert errors == []
    assert (tmp_path / "paging.png").stat().st_size > 0


# -----------------------------------------------------------------------------
# bench.py: every section runs, small  (-m bench)


@pytest.mark.bench
def test_overhead_against_steps_the_other_checkouts_engine_beside_this_ones(tmp_path):
    """bench.py --overhead --against PATH times an engine of PATH's code beside this checkout's:
    a copy that counts its steps counts every step of its engine, and none of this one's."""
    import bench
    path = tmp_path / "nanopaged.py"
    path.write_text(open(nanopaged.__file__).read() + "\n\nSTEPS = []\n_step = Engine.step\n"
                    "Engine.step = lambda self: STEPS.append(1) or _step(self)\n")
    other = bench.other_checkout(path)
    engine = bench.decoding_engine(4, 16, 8, 16, 32, module=other)
    assert isinstance(engine, other.Engine) and not isinstance(engine, Engine)
    assert len(other.STEPS) == bench.WARM_UP_STEPS
    mine = bench.decoding_engine(4, 16, 8, 16, 32)
    assert isinstance(mine, Engine) and len(other.STEPS) == bench.WARM_UP_STEPS
    result = bench.overhead_against(other, path, sizes=(4,), prompt_len=16, steps=3, rounds=1)
    assert result[4]["ratio"] > 0 and result[4]["against_us_per_seq"] > 0
    (tmp_path / "other.py").write_text("Engine = None\n")
    for bad, named in [(tmp_path / "none.py", "not a Python file"),
                       (tmp_path / "other.py", "no GPTConfig, SamplingParams")]:
        with pytest.raises(ValueError, match=named):
            bench.other_checkout(bad)


@pytest.mark.bench
def test_overhead_times_the_engine_on_one_thread_and_gives_the_process_its_own_back(monkeypatch):
    """The engine's own time is one thread's work: --overhead runs on one of torch's threads,
    and the sections after it (or a caller) get the process's count back, even if it fails."""
    import bench
    seen = []

    def timed(*args, **kwargs):  # the section's first timing
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop here")
    monkeypatch.setattr(bench, "least_of_rounds", timed)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            bench.bench_overhead()
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


class ByteTokenizer:
    """transformers' tokenizer interface as bench.py's real-checkpoint part calls it, on bytes."""

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=list(text.encode()))

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


@pytest.mark.bench
def test_bench_sparse_checkpoint_part_runs_on_a_small_model(tmp_path, monkeypatch):
    """bench.py --sparse --checkpoint's passkey retrieval and agreement, on a small random Llama
    and a byte tokenizer: each prompt holds its key's line at its depth within its context; a
    budget of the whole context is every block (the run itself checks "all" against
    Engine(read_policy="all")); the plot takes the results."""
    import bench
    tokenizer = ByteTokenizer()
    for depth in (0.0, 0.5, 1.0):
        text = tokenizer.decode(bench.passkey_prompt(tokenizer, 1024, depth, 12345))
        assert 1024 - 2 * len(bench.PASSKEY_FILLER) < len(text) <= 1024
        at = text.index(bench.PASSKEY_LINE.format(key=12345))  # after depth of the filler
        assert text[:at].count(bench.PASSKEY_FILLER) == round(depth * text.count(
            bench.PASSKEY_FILLER))
        assert text.startswith(bench.PASSKEY_INTRO) and text.endswith(bench.PASSKEY_QUESTION)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, vocab_size=256,
                          max_seq_len=1024, rope_theta=1e4, norm="rmsnorm", mlp="swiglu",
                          bias=False, intermediate_size=48)).double()
    passkey = bench.passkey_retrieval(model, tokenizer, (512, 768), (32, 1024), trials=2)
    assert list(passkey) == [512, 768]
    for r in passkey.values():
        assert list(r["accuracy"]) == ["all", 32, 1024]
        assert r["accuracy"][1024] == r["accuracy"]["all"]
    agree = bench.checkpoint_agreement(model, tokenizer, (32, 1024), 2, 256, 6)
    assert agree[1024] == dict(equal=1.0, before_first_difference=6.0)
    assert 0 <= agree[32]["equal"] <= 1
    monkeypatch.setattr(bench, "OUT_DIR", str(tmp_path))
    real = dict(passkey=passkey, agreement=agree, context=256)
    bench.plot_sparse({512: {"all": 1.0, 64: 0.5}}, (64,), agree, 256, real)
    assert (tmp_path / "sparse.png").stat().st_size > 0


@pytest.mark.bench
def test_bench_serve_without_guidellm_skips_its_benchmark_and_says_so(tmp_path, monkeypatch,
                                                                     capsys):
    """guidellm is a dev requirement that a machine may lack, as lm-eval: without it, --serve
    (and so bench.py --quick) measures the rest and says what it skipped, as their tests skip,
    instead of failing."""
    import bench
    # guidellm as if not installed: in this process, and in every Python it starts
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["guidellm"] = None\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setitem(sys.modules, "guidellm", None)
    results = bench.bench_serve(num_requests=2, rates=(), max_output=4, rounds=1, guidellm=dict(
        requests=2, concurrency=1, prompt_tokens=8, output_tokens=4))
    assert "guidellm" not in results
    assert results["http @ inf/s"]["output_tokens"] == results["Engine.generate"]["output_tokens"]
    assert "guidellm skipped: it needs the guidellm package" in capsys.readouterr().out


@pytest.mark.bench
def test_bench_quick_runs_every_section_and_leaves_the_readmes_results_alone():
    here = os.path.dirname(os.path.abspath(__file__))
    cited = os.path.join(here, "results", "results.json")
    before = os.path.getmtime(cited) if os.path.exists(cited) else None
    # the fast profile runs the sections whose figures are checked below, not the slowest
    # (throughput against transformers, kernel, tensor_parallel, soak)
    checked = ["memory", "capacity", "sharing", "quality", "overhead", "disaggregate"]
    flags = [f"--{name}" for name in checked] if FAST else []
    run = subprocess.run([sys.executable, "bench.py", "--quick", *flags], capture_output=True,
                         text=True, timeout=240, cwd=here)
    assert run.returncode == 0, run.stderr[-3000:]
    written = re.search(r"wrote (\S+results\.json) and plots", run.stdout).group(1)
    assert not written.startswith(os.path.join(here, "results"))
    assert (os.path.getmtime(cited) if os.path.exists(cited) else None) == before
    results = json.load(open(written))
    assert set(results) >= (set(checked) if FAST else {
        "memory", "capacity", "sharing", "throughput", "kernel", "overhead", "tensor_parallel",
        "soak", "quality", "page", "serve"})
    if "serve" in results:  # the server's CPU against the engine's, and guidellm, every request
        serve = results["serve"]
        assert serve["http_over_generate_cpu_per_token"] > 0
        assert serve["http @ inf/s"]["output_tokens"] == serve["Engine.generate"]["output_tokens"]
        if importlib.util.find_spec("guidellm") is None:  # see the test above
            assert "guidellm" not in serve
        else:
            assert serve["guidellm"]["requests"] == {"successful": 4, "errored": 0,
                                                     "incomplete": 0}
    # the same bytes: an fp8 pool holds every request the fp32 pool held, and the loss moves
    assert results["capacity"]["paged fp8 @ inf/s"]["peak_running"] >= \
        results["capacity"]["paged @ inf/s"]["peak_running"]
    assert 0 < abs(results["quality"]["fp8"]["loss"] - results["quality"]["auto"]["loss"]) < 0.1
    churn = results["sharing"]["eviction under churn"]  # LFU keeps what LRU loses
    assert churn["lfu"]["popular_prefix_kept"] == 1 and churn["lru"]["popular_prefix_kept"] == 0
    assert {"lru", "lfu"} <= set(results["overhead"]["take_block_us"])  # the built-in ones
    # both setups served the load, and blocks crossed between the two processes
    disaggregate = results["disaggregate"]
    assert {"one engine @ 8.0/s", "prefill + decode @ 8.0/s"} <= set(disaggregate)
    assert disaggregate["decode_process"]["num_received_blocks"] > 0

