"""
demo.py: what `python nanopaged.py` runs. A mixed workload on the built-in byte-level model
(shared prefixes, parallel samples, a beam search) served in a KV pool small enough to
preempt, with a live progress line, a map of the physical block pool at the moment of most
sharing, and a summary against a contiguous cache; --trace writes every change to paging, and
--html a page that replays them step by step (pagetrace.py). With --prompt it serves those
prompts instead and streams their text as it is generated; --model serves a Hugging Face folder
(its dtype, its generation_config.json and, with --chat, its chat template).
`python nanopaged.py --help`.
"""

import argparse
import json
import os
import sys
import time
import typing
from dataclasses import fields

import torch

import checkpoints
import connectors
import nanopaged
import parallel
import pagetrace
import speculative  # noqa: F401  registers its methods in nanopaged.SPECULATIVE_METHODS
from kernel import ATTENTION_BACKENDS
from nanopaged import GPT, Engine, SamplingParams

DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "pydoc-gpt")
# two full blocks of 16 bytes, shared by every third request
DEMO_PREFIX = "From the Python 3 documentation: "
DEMO_TOPICS = ["The for statement", "A list", "The import system", "Exceptions", "def ", "class ",
               "The with statement", "Dictionaries", "Strings", "The while statement", "Coroutines",
               "Generators", "The return statement", "Boolean operations", "Slicings",
               "The global statement", "Lambdas", "Integer literals", "The try statement", "Calls",
               "Comparisons", "Assignment statements", "Keyword arguments", "The assert statement",
               "Modules", "Sequences", "Numbers", "The if statement"]
CELLS = "abcdefghijklmnopqrstuvwxyz"
# the demo's own sampling defaults, where neither a flag nor generation_config.json sets one;
# the other sampling flags default to SamplingParams' own
DEMO_SAMPLING = dict(temperature=0.8, top_p=0.95)


class Tokenizer:
    """Bytes, unless the model folder has a tokenizer.json and the tokenizers package is
    installed."""

    def __init__(self, path):
        self.hf = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            try:
                from tokenizers import Tokenizer as HFTokenizer
                self.hf = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
            except ImportError:
                pass

    def encode(self, text, add_special_tokens=True):  # False for a chat template's text
        if self.hf:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return self.hf.decode(ids) if self.hf else bytes(ids).decode("utf-8", errors="replace")


class Streamer:
    """Prints each request's first sample as its text arrives (the engine decodes it), one
    request after another in the order given: the one on screen streams live while the later
    ones' text waits (they are generated alongside it) until it finishes. A beam search prints
    its best beam at the end: the best so far is not a prefix of the best at the end."""

    def __init__(self, texts, params):
        self.texts, self.params, self.current = texts, params, 0
        self.printed = [""] * len(texts)  # the text each request has shown, or will show
        self.pieces, self.finished = [[] for _ in texts], [False] * len(texts)
        self.header(0)

    def header(self, i):
        print(f"[{i}.0] {self.texts[i]!r} -> ", end="", flush=True)

    def __call__(self, i, output):
        if self.params[i].beam_width is None or output.finished:
            text = output.outputs[0].text
            self.pieces[i].append(text[len(self.printed[i]):])
            self.printed[i] = text
        self.finished[i] = output.finished
        while self.current < len(self.texts):  # catch up: print what the request on screen has
            print("".join(self.pieces[self.current]), end="", flush=True)
            self.pieces[self.current] = []
            if not self.finished[self.current]:
                break
            print()
            self.current += 1
            if self.current < len(self.texts):
                self.header(self.current)


def block_map(engine):
    """Physical KV memory as a grid of cells, one per block, and who owns each."""
    owners = {}  # block id -> request ids whose sequences point at it (every table of each)
    for request in engine.scheduler.running:
        for table in (table for seq in request.seqs for table in seq.block_tables):
            for block_id in table:
                owners.setdefault(block_id, set()).add(request.request_id)
    letters = {r.request_id: CELLS[i % len(CELLS)] for i, r in enumerate(engine.scheduler.running)}
    cells = []
    for block in engine.allocator.blocks:
        ids = owners.get(block.block_id)
        if block.ref_count == 0:
            cells.append(":" if block.hash is not None else ".")
        elif len(ids) > 1:
            cells.append("*")  # one prompt prefix, many requests: a prefix-cache hit
        else:
            letter = letters[min(ids)]
            # forked samples or beams
            cells.append(letter.upper() if block.ref_count > 1 else letter)
    return cells, letters


def cpu_block_map(engine, letters):
    """The CPU pool as cells: a swapped-out request's block (its letter, upper-case when its
    sequences share it), a free block the CPU tier caches a prefix in (:), or a free one (.)."""
    owners = {b: r.request_id for r in engine.scheduler.swapped for seq in r.seqs
              for table in seq.block_tables for b in table}
    letters.update({g.request_id: CELLS[(len(letters) + i) % len(CELLS)]
                    for i, g in enumerate(engine.scheduler.swapped)})
    return [":" if b.ref_count == 0 and b.hash is not None else "." if b.ref_count == 0 else
            letters[owners[b.block_id]].upper() if b.ref_count > 1 else
            letters[owners[b.block_id]] for b in engine.allocator.swap_pool.blocks]


def render_block_map(cells, letters, width=64, cpu_cells=()):
    def grid(cells):
        return ["".join(cells[i:i + width]) for i in range(0, len(cells), width)]
    lines = grid(cells) + (["CPU pool:", *grid(cpu_cells)] if cpu_cells else [])
    by_letter = [f"{letter}={request_id}" for request_id, letter in letters.items()]
    lines += ["legend: a-z one sequence's block, A-Z shared by the sequences of one request "
              "(fork / beams),",
              "        * shared across requests (prefix cache), "
              ": free but caching a prefix, . free",
              "requests: " + " ".join(by_letter)]
    return "\n".join(lines)


def demo_workload(tokenizer, args):
    """A few dozen requests: mixed lengths, some sharing a prefix, one with n > 1, one beam
    search."""
    prompts, params = [], []
    for i, topic in enumerate(DEMO_TOPICS):
        prompts.append(tokenizer.encode((DEMO_PREFIX if i % 3 == 0 else "") + topic))
        # a flag given is used as given (0 included, for SamplingParams to refuse); None: the mix
        n = 3 if args.n is None else args.n
        width = 3 if args.beam_width is None else args.beam_width
        beams = i == 7 and not speculating(args)  # beam search does not speculate
        kind = dict(n=n) if i == 3 else dict(beam_width=width) if beams else {}
        max_tokens = (32, 64, 128, 192)[i % 4] if args.max_tokens is None else args.max_tokens
        params.append(SamplingParams(max_tokens=max_tokens, seed=args.seed + i,
                                     **sampling_flags(args) | kind))
    return prompts, params


def run_demo(engine, prompts, params, arrivals_per_step=2, progress=True, priorities=None,
             on_output=None):
    """Serve the requests step by step as they arrive, a few per step as at a server, recording
    KV use and the moment of most sharing; on_output(i, output) sees every output of request i
    (the i-th prompt) that gained tokens."""
    ids, pending = [], list(zip(prompts, params, priorities or [0] * len(prompts)))
    outputs, timeline, snapshot, start = {}, [], None, time.perf_counter()
    while pending or has_unfinished(engine):
        for prompt, sp, priority in pending[:arrivals_per_step]:
            ids.append(engine.add_request(prompt, sp, priority=priority))
        pending = pending[arrivals_per_step:]
        for o in engine.step():
            if on_output:
                on_output(ids.index(o.request_id), o)
            if o.finished:
                outputs[o.request_id] = o
        s = engine.stats()
        num_used = s["num_blocks"] - s["num_free_blocks"]
        num_shared = sum(1 for b in engine.allocator.blocks if b.ref_count > 1)
        timeline.append(dict(used=num_used, logical=s["num_logical_blocks"],
                             running=s["num_running"], utilization=s["kv_utilization"],
                             shared=num_shared))
        if num_shared and (snapshot is None or num_shared > snapshot["shared"]):
            cells, letters = block_map(engine)
            cpu_cells = cpu_block_map(engine, letters)
            snapshot = dict(step=len(timeline), shared=num_shared, map=(cells, letters),
                            text=render_block_map(cells, letters, cpu_cells=cpu_cells))
        if progress and (len(timeline) % 10 == 0 or not has_unfinished(engine)):
            print("\r" + progress_line(engine, len(outputs), len(ids), time.perf_counter() - start)
                  + "\x1b[K", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return [outputs[i] for i in ids], timeline, snapshot, time.perf_counter() - start


def has_unfinished(engine):
    """Whether an Engine, or a disaggregation.DecodeFront (its prompts in prefill too), has
    requests to finish."""
    front = getattr(engine, "has_unfinished", None)  # an Engine has none of its own
    return front() if front else engine.scheduler.has_unfinished()


def progress_line(engine, done, total, elapsed):
    s = engine.stats()
    return (f"[{done}/{total} requests] running {s['num_running']} waiting {s['num_waiting']} "
            f"swapped {s['num_swapped']} preempted {s['num_preemptions']} | "
            f"{s['num_generated_tokens'] / max(elapsed, 1e-9):.0f} tok/s | "
            f"KV blocks {s['num_blocks'] - s['num_free_blocks']}/{s['num_blocks']}")


def summarize(engine, outputs, timeline, seconds):
    s, config = engine.stats(), engine.config
    busy = [t for t in timeline if t["used"]]
    return dict(
        requests=len(outputs),
        generated_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        seconds=seconds, tokens_per_second=s["num_generated_tokens"] / seconds,
        kv_utilization=sum(t["utilization"] for t in busy) / max(len(busy), 1),
        peak_blocks_saved=max(t["logical"] - t["used"] for t in timeline),
        preemptions=s["num_preemptions"], peak_running=max(t["running"] for t in timeline),
        # a contiguous cache reserves max_seq_len slots for every sequence it admits
        contiguous_capacity=s["num_blocks"] * engine.block_size // config.max_seq_len,
        num_free_blocks=s["num_free_blocks"], num_blocks=s["num_blocks"],
    )


def plot_demo(path, snapshot, timeline, engine, width=32):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_map, ax_use) = plt.subplots(1, 2, figsize=(14, 5),
                                         gridspec_kw=dict(width_ratios=[1, 1.2]))
    cells = snapshot["map"][0] if snapshot else ["."] * engine.allocator.num_blocks
    palette = plt.get_cmap("tab20").colors
    for i, c in enumerate(cells):  # the terminal map, in colour: one colour per request
        colour = ("white" if c == "." else "lightgrey" if c == ":" else "black" if c == "*" else
                  palette[CELLS.index(c.lower()) % len(palette)])
        y, x = divmod(i, width)
        ax_map.add_patch(plt.Rectangle((x, -y), 1, -1, facecolor=colour, edgecolor="grey", lw=0.3))
        ax_map.text(x + 0.5, -y - 0.5, c, ha="center", va="center", fontsize=7,
                    color="white" if c == "*" else "black",
                    weight="bold" if c.isupper() else "normal")
    ax_map.set_xlim(0, width)
    ax_map.set_ylim(-(-(-len(cells) // width)), 0)
    ax_map.set_aspect("equal")
    ax_map.axis("off")
    ax_map.set_title(f"physical KV blocks at step {snapshot['step'] if snapshot else 0}: "
                     "a-z one sequence, A-Z shared\nwithin a request, * across requests, "
                     ": cached free, . free", fontsize=9)
    steps = range(1, len(timeline) + 1)
    ax_use.plot(steps, [t["used"] for t in timeline], label="physical blocks in use")
    ax_use.plot(steps, [t["logical"] for t in timeline],
                label="logical blocks (what it would take without sharing)")
    ax_use.axhline(engine.allocator.num_blocks, color="grey", ls="--", label="pool")
    ax_use.set_xlabel("engine step")
    ax_use.set_ylabel("KV blocks")
    ax_use.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, no usage dump
        sys.exit(f"nanopaged: error: {message}")


def speculating(args):
    """The method --speculative-method or --speculative-model names, or None."""
    if args.speculative_model == "ngram":  # the short spelling of --speculative-method ngram
        return "ngram"
    if args.speculative_model is not None:
        return args.speculative_method or "draft"
    return args.speculative_method


def speculative_config(args):
    """Engine's speculative_config from --speculative-method, --speculative-model and
    --num-speculative-tokens: the method, k, and the model a folder holds as "model"."""
    method = speculating(args)
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative-model or "
                             "--speculative-method")
        return None
    if args.speculative_model == "ngram" and args.speculative_method not in (None, "ngram"):
        raise ValueError(f"--speculative-model ngram is method ngram, and --speculative-method "
                         f"says {args.speculative_method}: give one of them")
    k = 4 if args.num_speculative_tokens is None else args.num_speculative_tokens
    config = {"method": method, "num_speculative_tokens": k}
    if args.speculative_model not in (None, "ngram"):
        config["model"] = GPT.from_pretrained(args.speculative_model, dtype=args.dtype,
                                              device=args.device)
    return config


def add_engine_flags(p):
    """The flags that choose the model and build its engine (server.py takes them too)."""
    p.add_argument("--model", default=os.path.relpath(DEMO_MODEL),
                   help="a local Hugging Face folder of a gpt2, llama, mistral or qwen2 model "
                   "(default: models/pydoc-gpt, the built-in byte-level model trained on Python's "
                   "docs)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="weights and KV cache (default auto: the checkpoint's own on a GPU, "
                   "float32 on a CPU)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   default="auto", help="the KV cache's dtype: auto (the model's) or 8-bit, with "
                   "per-layer scales (fp8 is e4m3): twice the blocks of 16 bits in the same bytes")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=len(CELLS),
                   help="sequences running at once, at most (default: one per letter of the map)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens one step computes, at most (prefill chunks and decodes)")
    p.add_argument("--num-blocks", type=int, default=96,
                   help="KV blocks in the pool; few enough to preempt")
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                   help="what to do with a request when blocks run out")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn automatic prefix caching off")
    p.add_argument("--scheduling-policy", default="fcfs",
                   help="the order requests run in: a name in nanopaged.SCHEDULING_POLICIES "
                   f"({', '.join(nanopaged.SCHEDULING_POLICIES)}; default fcfs)")
    p.add_argument("--eviction-policy", default="lru",
                   help="which free cached block is reused first: a name in "
                   f"nanopaged.EVICTION_POLICIES ({', '.join(nanopaged.EVICTION_POLICIES)}; "
                   "default lru)")
    p.add_argument("--cpu-cache-gib", type=float, default=0,
                   help="GiB of CPU memory for a second tier of the prefix cache: cached blocks "
                   "the pool evicts wait there, and come back on a hit (default 0: none)")
    p.add_argument("--connector", choices=sorted(connectors.CONNECTORS),
                   help="where cached blocks go when they leave the device and come back from: a "
                   "name in connectors.CONNECTORS (cpu: CPU memory; disk: a folder, kept across "
                   "restarts; default: none)")
    p.add_argument("--connector-config", type=json.loads, metavar="JSON",
                   help='its settings, e.g. \'{"path": "kv-cache"}\' (disk) or '
                   '\'{"cpu_cache_bytes": 1073741824}\' (cpu)')
    p.add_argument("--cpu-eviction-policy",
                   help="which cached block the CPU tier gives up first: a name in "
                   "nanopaged.EVICTION_POLICIES (default: --eviction-policy's)")
    p.add_argument("--read-policy", default="all",
                   help="which blocks a decode reads: a name in nanopaged.READ_POLICIES "
                   f"({', '.join(nanopaged.READ_POLICIES)}; default all, exact)")
    p.add_argument("--read-policy-config", type=json.loads, metavar="JSON",
                   help='its settings, e.g. \'{"token_budget": 512, "dense_layers": 2}\' (quest)')
    p.add_argument("--attention-backend",
                   help=f"a name in kernel.ATTENTION_BACKENDS ({', '.join(ATTENTION_BACKENDS)};"
                   " default triton on a GPU, torch on a CPU)")
    p.add_argument("--speculative-method", choices=sorted(nanopaged.SPECULATIVE_METHODS),
                   help="speculative decoding by a method in nanopaged.SPECULATIVE_METHODS "
                   "(ngram: guesses from each sequence's own text; draft: a draft model, "
                   "--speculative-model; default: draft when --speculative-model is a folder)")
    p.add_argument("--speculative-model", metavar="ngram|PATH",
                   help="speculative decoding: 'ngram' is --speculative-method ngram; a folder "
                   "is a model with the same vocabulary, the method's 'model' (the draft: "
                   "models/pydoc-draft for the built-in model)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="tokens guessed per sequence per step (default: 4)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks that split every layer and its K/V heads; launch with torchrun "
                   "--nproc-per-node N (rank 0 prints)")
    p.add_argument("--disaggregate", action="store_true",
                   help="prefill and decode in two processes (disaggregation.py): launch with "
                   "torchrun --nproc-per-node 2; rank 0 decodes and prints, rank 1 prefills")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch (default: 1 for models under 100M parameters, "
                   "whose ops are too small to split and crawl when another process shares the "
                   "cores; torch's default, one per core, for larger models)")
    return add_sampling_flags(p)


def sampling_fields():
    """SamplingParams' fields that are sampling flags: those whose metadata says what they do
    (read when called, so that a fork's new field is one too)."""
    return [f for f in fields(nanopaged.SamplingParams) if "flag" in f.metadata]


def sampling_defaults():
    """What each sampling flag defaults to when neither it nor generation_config.json sets it."""
    return {f.name: f.default for f in sampling_fields()} | DEMO_SAMPLING


def flag_type(f):
    """What argparse turns a field's text into: its type (less None), true/false for a bool."""
    kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
    return truth if kind is bool else kind


def truth(text):  # bool("false") is True
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


def add_sampling_flags(p):
    """A flag per sampling field, --top-k for top_k: None when not given; given, it overrides
    generation_config.json."""
    defaults = sampling_defaults()
    for f in sampling_fields():
        p.add_argument(f"--{f.name.replace('_', '-')}", type=flag_type(f),
                       help=f"{f.metadata['flag']} (default: generation_config.json's, else "
                       f"{defaults[f.name]})")
    return p


def argument_parser():
    p = add_engine_flags(_ArgumentParser(
        description="Serve a mixed workload with PagedAttention and show the KV block pool."))
    p.add_argument("--prompt", action="append",
                   help="a prompt to serve instead of the built-in workload, its answer printed as "
                   "it is generated (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model folder's chat "
                   "template (needs jinja2)")
    p.add_argument("--max-tokens", type=int,
                   help="tokens to generate per request (default: generation_config.json's "
                   "max_new_tokens, else 64 for --prompt, 32-192 mixed for the workload)")
    p.add_argument("--stop", action="append",
                   help="a string that ends a sample, cut from its text (repeatable)")
    p.add_argument("--n", type=int,
                   help="parallel samples per prompt (the workload has one request with 3)")
    p.add_argument("--beam-width", type=int,
                   help="beam search width (the workload has one request with 3)")
    p.add_argument("--priority", type=int, action="append",
                   help="with --scheduling-policy priority: the priority of each --prompt, "
                   "lower first (repeatable, in order; default 0)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the block map and KV use over time to an image")
    p.add_argument("--trace", metavar="FILE.jsonl",
                   help="write every change to paging, one JSON object a line (pagetrace.py)")
    p.add_argument("--html", metavar="FILE.html",
                   help="write one self-contained page that replays the run step by step: the "
                   "pool, the block tables, sharing, copy-on-write, prefix hits, preemption")
    return p


def sampling_flags(args):
    """The SamplingParams keyword arguments the sampling flags give every request."""
    return dict(stop=args.stop, **{f.name: getattr(args, f.name) for f in sampling_fields()})


def load(args):
    """The model the flags name, its engine (with the tokenizer, so outputs carry text) and the
    tokenizer; the sampling flags get their defaults (server.py serves the same)."""
    link = disaggregated_link(args)
    if link is None:
        parallel.init_tensor_parallel(args.tensor_parallel_size, device=args.device)
    if nanopaged.tp.rank > 0:  # every rank serves the same requests; one of them speaks
        sys.stdout = open(os.devnull, "w")
    model = GPT.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    # flags first, then the folder's generation_config.json, then ours (the flags this parser
    # has: server.py's has no --max-tokens)
    for key, value in (sampling_defaults() | checkpoints.generation_defaults(args.model)).items():
        if getattr(args, key, value) is None:
            setattr(args, key, value)
    if args.threads or sum(w.numel() for w in model.parameters()) < 100e6:
        torch.set_num_threads(args.threads or 1)
    tokenizer = Tokenizer(args.model)
    traced = getattr(args, "trace", None) or getattr(args, "html", None)  # server.py has neither
    connector, connector_config = args.connector, args.connector_config
    if link is not None:  # the other process is this engine's connector
        if connector is not None:
            raise ValueError(f"--connector {connector} does not run with --disaggregate: the "
                             "remote engine is the connector then")
        connector, connector_config = "remote", dict(link=link)
    engine = Engine(model, block_size=args.block_size, num_blocks=args.num_blocks,
                    device=args.device, preemption_mode=args.preemption,
                    enable_prefix_caching=not args.no_prefix_cache, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    scheduling_policy=args.scheduling_policy,
                    eviction_policy=args.eviction_policy, kv_cache_dtype=args.kv_cache_dtype,
                    cpu_cache_bytes=int(args.cpu_cache_gib * 2**30),
                    cpu_eviction_policy=args.cpu_eviction_policy,
                    attention_backend=args.attention_backend, read_policy=args.read_policy,
                    read_policy_config=args.read_policy_config,
                    connector=connector, connector_config=connector_config,
                    speculative_config=speculative_config(args), tokenizer=tokenizer,
                    observer=pagetrace.Trace() if traced else None)
    if traced:  # the pool's shape opens the trace: the page draws it
        engine.observer(pagetrace.header(engine))
    if link is not None:  # the front, which takes the requests, or the prefill worker
        import disaggregation
        if link.role == "decode":
            engine = disaggregation.DecodeFront(engine, link)
        else:
            engine = disaggregation.PrefillWorker(engine, link)
    return model, engine, tokenizer


def disaggregated_link(args):
    """With --disaggregate, this process's end of the prefill/decode link (disaggregation.py);
    else None."""
    if not getattr(args, "disaggregate", False):
        return None
    if args.tensor_parallel_size != 1:
        raise ValueError("--disaggregate runs one engine per process: it does not combine with "
                         "--tensor-parallel-size")
    import disaggregation  # torch.distributed's groups: only when asked for
    return disaggregation.Link(device=args.device)


def build(args):
    """The model, its engine and tokenizer, and the requests to serve."""
    model, engine, tokenizer = load(args)
    if args.prompt:
        prompts = [tokenizer.encode(text) for text in args.prompt]
        max_tokens = 64 if args.max_tokens is None else args.max_tokens
        n = 1 if args.n is None else args.n
        params = [SamplingParams(max_tokens=max_tokens, n=n, beam_width=args.beam_width,
                                 seed=args.seed + i, **sampling_flags(args))
                  for i in range(len(prompts))]
    else:
        prompts, params = demo_workload(tokenizer, args)
    if args.chat:  # the same requests, each prompt now the text of one user message
        texts = args.prompt or [tokenizer.decode(p) for p in prompts]
        prompts = [tokenizer.encode(checkpoints.render_chat(
            args.model, [{"role": "user", "content": text}]), add_special_tokens=False)
            for text in texts]
    priorities = (args.priority or []) + [0] * (len(prompts) - len(args.priority or []))
    if len(priorities) > len(prompts):
        raise ValueError(f"got {len(priorities)} --priority for {len(prompts)} prompts")
    for prompt, sp, priority in zip(prompts, params, priorities):
        if hasattr(engine, "check_request"):  # not the prefill worker, which takes no requests
            engine.check_request(prompt, sp, priority)
    return model, engine, tokenizer, prompts, params, priorities


def report(args, engine, tokenizer, prompts, params, outputs, summary, snapshot, seconds, stream):
    """The block map at the moment of most sharing, a few completions, and the summary."""
    if snapshot:
        print(f"\nphysical KV blocks at step {snapshot['step']}, when the most blocks were shared:")
        print(snapshot["text"])
    shown = [i for i, (o, sp) in enumerate(zip(outputs, params)) if i < 5 or sp.num_seqs > 1]
    lines = []
    for prompt, out in [(prompts[i], outputs[i]) for i in shown]:
        for c in out.outputs[1 if stream else 0:]:  # the first sample (or beam) streamed
            more = "..." if len(c.text) > 80 else ""
            lines.append(f"[{out.request_id}.{c.index}] {tokenizer.decode(prompt)!r} -> "
                         f"{c.text[:80]!r}{more}")
    print("\n" + "\n".join(lines) if lines else "", end="\n" if lines else "")
    print(f"\n{summary['generated_tokens']} tokens in {seconds:.1f}s "
          f"({summary['tokens_per_second']:.0f} tokens/s), {summary['preemptions']} preemptions")
    print(f"KV utilization {100 * summary['kv_utilization']:.1f}% "
          f"(tokens held / slots in allocated blocks); "
          f"sharing saved up to {summary['peak_blocks_saved']} blocks")
    print(f"concurrency: up to {summary['peak_running']} sequences at once in "
          f"{summary['num_blocks']} blocks; a contiguous cache reserving "
          f"max_seq_len={engine.config.max_seq_len} per sequence holds "
          f"{summary['contiguous_capacity']} in the same memory")
    if speculating(args):
        s = engine.stats()
        label = args.speculative_model or args.speculative_method
        print(f"speculative decoding ({label}): {s['num_accepted_tokens']} of "
              f"{s['num_proposed_tokens']} guessed tokens accepted "
              f"({100 * s['num_accepted_tokens'] / max(1, s['num_proposed_tokens']):.0f}%)")


def main(argv=None):
    args = argument_parser().parse_args(argv)
    try:
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        model, engine, tokenizer, prompts, params, priorities = build(args)
    except ValueError as e:
        sys.exit(f"nanopaged: error: {e}")
    if hasattr(engine, "serve"):  # --disaggregate's prefill process: it serves rank 0, silent
        return dict(prefill_stats=engine.serve())
    ranks = f" on each of {nanopaged.tp.world_size} ranks" if nanopaged.tp.world_size > 1 else ""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    kv = "" if args.kv_cache_dtype == "auto" else f" in {engine.stats()['kv_cache_dtype']}"
    num_params = sum(w.numel() for w in model.parameters())
    print(f"model {args.model}: {num_params / 1e6:.1f}M parameters in {dtype}{ranks}, "
          f"max_seq_len {model.config.max_seq_len}; KV pool {engine.allocator.num_blocks} blocks x "
          f"{engine.block_size} tokens{kv} on {engine.device}{ranks}; {len(prompts)} requests")
    is_rank_0 = nanopaged.tp.rank == 0
    # --prompt: stream the text as it comes (no progress line to tear it); the workload: the line
    stream = Streamer(args.prompt, params) if args.prompt else None
    outputs, timeline, snapshot, seconds = run_demo(engine, prompts, params,
                                                    progress=is_rank_0 and not stream,
                                                    priorities=priorities, on_output=stream)
    summary = summarize(engine, outputs, timeline, seconds)
    report(args, engine, tokenizer, prompts, params, outputs, summary, snapshot, seconds, stream)
    if args.plot and is_rank_0:
        plot_demo(args.plot, snapshot, timeline, engine)
        print(f"wrote {args.plot}")
    if args.trace and is_rank_0:
        engine.observer.write_jsonl(args.trace)
        print(f"wrote {args.trace}: {len(engine.observer.events)} events")
    if args.html and is_rank_0:
        pagetrace.write_html(engine.observer.events, args.html, decode=tokenizer.decode)
        print(f"wrote {args.html}: open it in a browser to replay the run step by step")
    if args.disaggregate:  # the prefill process may return now
        engine.close()
    return dict(outputs=outputs, summary=summary, snapshot=snapshot, engine=engine,
                tokenizer=tokenizer, params=params)
