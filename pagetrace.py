"""
pagetrace.py: a record of everything the engine does to its KV blocks, a replay of it, and a
page that shows it.

An Engine built with observer=Trace() (or `python nanopaged.py --trace FILE.jsonl`) tells the
trace each change to paging as it happens (nanopaged.notify): a block table allocated, grown,
copied on write, forked, trimmed, freed, swapped out or in; a block published to the prefix cache
or evicted from it, on the device or in the CPU tier, and copied between them; a request added,
admitted, preempted, resumed, finished or aborted; each step's schedule, and the undo of a step
that failed. replay() rebuilds, from those events alone, the pool at the end of every step:
every block table, each block's owners and ref count, and what each tier of the prefix cache
holds. The tests check the replay against the engine's own state at every
step, so the trace is complete by construction, not by hope. It imports nothing of the project.

describe() puts an event in words ("seq 7.2 copied block 31 to 44 before writing"), and
write_html(events, path) (or `python nanopaged.py --html FILE.html`) writes one self-contained
page that replays the run: a step slider; the pool as a grid of blocks coloured by request, with
ref counts and cached free blocks; each sequence's block table; the step's events; curves of
blocks in use and of requests over time. The states are computed here; its script only draws.
"""

import itertools
import json
from collections import Counter
from html import escape


class Trace:
    """An observer that keeps every event, each stamped with the step it happened in."""

    def __init__(self):
        self.events, self.step = [], 0

    def __call__(self, event):
        if event["event"] == "step":
            self.step = event["step"]
        self.events.append(dict(event, step=self.step))

    def write_jsonl(self, path):
        """One JSON object a line."""
        with open(path, "w") as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fresh(value):
    """A deep copy of the pool's dicts, lists and tuples: copy.deepcopy's result, many times
    faster, since nothing in a pool is shared or cyclic and its lists hold one kind of item."""
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, tuple):  # (index, tokens): short, mixed
        return tuple(fresh(v) for v in value)
    if isinstance(value, list):
        if value and isinstance(value[0], (dict, list, tuple)):
            return [fresh(v) for v in value]
        return list(value)  # ints: copied by the C loop
    return value


NO_BLOCK = -1  # a block table's entry for a block no token to come sees, given back (nanopaged's)


def table_of(e):
    """The block table an event is about: its sequence's, or for a model whose layers mix
    attention types, "seq/g" for the table of its KV cache group g past the first."""
    return f"{e['seq']}/{e['group']}" if e.get("group") else e["seq"]


def seq_of(table):  # the sequence a block table belongs to
    return int(str(table).split("/")[0])


class Pool:
    """The paging state the events describe: block tables on the device and in the CPU pool,
    the blocks the prefix cache holds (logical index and tokens), where each request is, and the
    tokens each sequence has computed or is computing."""

    def __init__(self):
        self.tables, self.cpu_tables = {}, {}  # seq -> block ids
        self.cached = {}  # block -> (its index in its sequence, its tokens)
        self.cpu_cached = {}  # the CPU tier's: CPU block -> (index, tokens)
        self.requests = {}  # request -> waiting, running, swapped, finished or aborted
        self.request_of, self.tokens = {}, {}  # seq -> request; seq -> token ids
        self.saved = None  # the state at the start of the step, for a rollback

    def copy(self):
        """A copy that shares nothing that changes (the saved start of the step left out)."""
        twin = Pool()
        vars(twin).update(fresh({k: v for k, v in vars(self).items() if k != "saved"}))
        return twin

    def ref_counts(self):
        """Block -> the device block-table entries that point at it."""
        return Counter(b for table in self.tables.values() for b in table if b != NO_BLOCK)

    def apply(self, e):
        getattr(self, "on_" + e["event"])(e)

    def on_config(self, e):  # the pool's shape: settings(events) reads it
        pass

    # requests
    def on_add(self, e):
        self.requests[e["request"]] = "waiting"
        self.request_of[e["seq"]], self.tokens[e["seq"]] = e["request"], list(e["prompt"])

    def on_admit(self, e):
        self.requests[e["request"]] = "running"

    def on_preempt(self, e):
        self.requests[e["request"]] = "swapped" if e["mode"] == "swap" else "waiting"

    def on_resume(self, e):
        self.requests[e["request"]] = "running"

    def on_finished(self, e):
        self.requests[e["request"]] = "finished"

    def on_abort(self, e):
        self.requests[e["request"]] = "aborted"

    # steps
    def on_step(self, e):
        self.saved = vars(self.copy())

    def on_schedule(self, e):
        for seq, start, tokens in e["scheduled"]:
            self.tokens[seq][start:start + len(tokens)] = tokens

    def on_rollback(self, e):
        vars(self).update(fresh(self.saved))
        for block in e["uncached"]:  # the failed step may have written into them
            self.cached.pop(block, None)
        for block in e.get("cpu_uncached", ()):
            self.cpu_cached.pop(block, None)

    # block tables
    def on_allocate(self, e):
        self.tables[table_of(e)] = list(e["table"])
        self.request_of[e["seq"]] = e["request"]

    def on_append(self, e):
        self.tables[table_of(e)].append(e["block"])

    def on_cow(self, e):
        self.tables[table_of(e)][-1] = e["dst"]

    def on_trim(self, e):
        del self.tables[table_of(e)][e["keep"]:]

    def on_skip(self, e):  # a block no token to come sees (its attention kind's), given back
        self.tables[table_of(e)][e["index"]] = NO_BLOCK

    def on_fork(self, e):
        self.tables[table_of(e)] = list(self.tables[table_of(dict(e, seq=e["parent"]))])
        self.request_of[e["seq"]] = self.request_of[e["parent"]]
        self.tokens[e["seq"]] = list(self.tokens[e["parent"]])

    def on_free(self, e):  # from the device pool, or the CPU pool
        self.tables.pop(table_of(e), None) or self.cpu_tables.pop(table_of(e), None)

    def on_swap_out(self, e):
        self.cpu_tables[table_of(e)] = list(e["table"])
        del self.tables[table_of(e)]

    def on_swap_in(self, e):
        self.tables[table_of(e)] = list(e["table"])
        del self.cpu_tables[table_of(e)]

    # the prefix cache
    def on_publish(self, e):
        self.cached[e["block"]] = (e["index"], list(e["tokens"]))

    def on_evict(self, e):
        del self.cached[e["block"]]

    # the CPU tier (the copies themselves change no table or key: on_publish's say where they go)
    def on_cpu_publish(self, e):
        self.cpu_cached[e["block"]] = (e["index"], list(e["tokens"]))

    def on_cpu_evict(self, e):
        del self.cpu_cached[e["block"]]

    def on_offload(self, e):
        pass

    def on_reload(self, e):
        pass


def by_step(events):
    """The events in runs, one a step: each run opens with a step event (the first also holds
    what came before the first step, requests added before it ran)."""
    runs, stepped = [[]], False
    for e in events:
        if e["event"] == "step" and stepped:
            runs.append([])
        stepped = stepped or e["event"] == "step"
        runs[-1].append(e)
    return [run for run in runs if run]


def replay(events):
    """The Pool after each step, in order: (step, a copy of the pool) at each step's end. A step
    that failed and was rolled back is one entry, and its retry another, with the same number."""
    pool, states = Pool(), []
    for run in by_step(events):
        for e in run:
            pool.apply(e)
        states.append((run[-1].get("step"), pool.copy()))
    return states


def header(engine):
    """The event a trace opens with, for the page: the pool's shape and the model's context,
    read from an Engine's attributes (this file imports nothing of the project)."""
    a = engine.allocator
    return dict(event="config", block_size=engine.block_size, num_blocks=a.num_blocks,
                num_cpu_blocks=a.swap_pool.num_blocks, max_seq_len=engine.config.max_seq_len)


def settings(events):
    """The header's settings, or what the events tell of them in a trace without one."""
    for e in events:
        if e["event"] == "config":
            return {k: v for k, v in e.items() if k not in ("event", "step")}
    blocks = [b for e in events for b in (e.get("table") or [e.get("block", e.get("dst", -1))])
              if e["event"] != "swap_out"]  # a swapped-out table holds CPU blocks
    sizes = [len(e["tokens"]) for e in events if e["event"] == "publish"]
    return dict(block_size=sizes[0] if sizes else None, num_blocks=max(blocks, default=-1) + 1,
                num_cpu_blocks=None, max_seq_len=None)


# -----------------------------------------------------------------------------
# The events in words, for the page and for anyone reading a trace

def seq_names(events):
    """Sequence id -> "r.k": the k-th sequence of request r (its samples or beams, by birth)."""
    names, born = {}, Counter()
    request_of = {}
    for e in events:
        if e["event"] in ("add", "fork"):
            r = e["request"] if e["event"] == "add" else request_of[e["parent"]]
            request_of[e["seq"]], names[e["seq"]] = r, f"{r}.{born[r]}"
            born[r] += 1
    return names


def _ids(blocks):
    return ", ".join(map(str, blocks))


def _allocated(e, seq):
    hits, table = e["hits"], e["table"]
    if not hits:  # no prefix hit: its blocks come chunk by chunk as it runs ("append")
        return None
    rest = f"; {seq(e['seq'])} took {_ids(table[hits:])} for the rest" if table[hits:] else ""
    return f"request {e['request']} hit {hits} cached blocks ({_ids(table[:hits])}){rest}"


def _scheduled(e, seq):
    chunks = [len(tokens) for _, _, tokens in e["scheduled"]]
    if not chunks:
        return None
    decodes, prefills = chunks.count(1), [n for n in chunks if n > 1]
    words = f"ran {sum(chunks)} tokens for {len(chunks)} sequences: {decodes} decoding one"
    if prefills:  # a prompt, a chunk of one, or a preempted sequence recomputed
        words += f", {len(prefills)} prefilling {sum(prefills)} tokens"
    return words + (f", {len(e['lookahead'])} with lookahead slots" if e["lookahead"] else "")


# event -> its sentence, given seq(id) -> "seq r.k"; None: no words (the frame tells it)
WORDS = {
    "config": None, "step": None, "schedule": _scheduled, "allocate": _allocated,
    "rollback": lambda e, seq: "the step failed and was undone; " + (
        f"blocks {_ids(e['uncached'])} forget their prefix" if e["uncached"] else "no block lost"),
    "add": lambda e, seq: f"request {e['request']} arrives, {len(e['prompt'])} prompt tokens",
    "abort": lambda e, seq: f"request {e['request']} aborted",
    "admit": lambda e, seq: f"request {e['request']} admitted",
    "resume": lambda e, seq: f"request {e['request']} swapped back in, running again",
    "preempt": lambda e, seq: f"request {e['request']} preempted ({e['mode']}): " + (
        "its blocks move to the CPU" if e["mode"] == "swap" else "blocks freed, to recompute"),
    "finished": lambda e, seq: f"request {e['request']} finished",
    "append": lambda e, seq: f"{seq(e['seq'])} filled its last block, took block {e['block']}",
    "cow": lambda e, seq: f"{seq(e['seq'])} copied block {e['src']} to {e['dst']} before "
                          f"writing (copy-on-write: {e['src']} was shared)",
    "trim": lambda e, seq: f"{seq(e['seq'])} cut its table to {e['keep']} blocks, giving back "
                           "any that held only rejected proposals",
    "fork": lambda e, seq: f"{seq(e['seq'])} forked from {seq(e['parent'])}, sharing its blocks",
    "skip": lambda e, seq: f"{seq(e['seq'])} gave back its block {e['index']}"
                           f"{' of group ' + str(e['group']) if e.get('group') else ''}: no "
                           "token to come sees it (its attention kind: a window, a chunk)",
    "free": lambda e, seq: f"{seq(e['seq'])} freed its blocks",
    "swap_out": lambda e, seq: f"{seq(e['seq'])} swapped out to CPU blocks {_ids(e['table'])}",
    "swap_in": lambda e, seq: f"{seq(e['seq'])} swapped in to blocks {_ids(e['table'])}",
    "publish": lambda e, seq: f"block {e['block']} cached as block {e['index']} of its prefix",
    "evict": lambda e, seq: f"block {e['block']} evicted from the prefix cache, to be reused",
    "offload": lambda e, seq: f"block {e['block']} copied to CPU block {e['cpu_block']} before "
                              "its eviction: the CPU tier keeps its prefix",
    "reload": lambda e, seq: f"CPU block {e['cpu_block']} copied back into block {e['block']}: "
                             "a hit in the CPU tier",
    "cpu_publish": lambda e, seq: f"CPU block {e['block']} caches block {e['index']} of its "
                                  "prefix",
    "cpu_evict": lambda e, seq: f"CPU block {e['block']} evicted from the CPU tier",
}


def describe(event, names=None):
    """One event as a sentence ("seq 7.2 copied block 31 to 44 before writing ..."), or None for
    those the page shows otherwise. names: seq_names(events), else sequences go by their ids."""
    words = WORDS[event["event"]]
    return words and words(event, lambda s: f"seq {(names or {}).get(s, s)}")


def step_words(run, names=None):
    """The sentences of one step's events, in order; a run of evictions, of blocks cached, or
    of tables cut after speculative decoding, in one sentence."""
    words = []
    for kind, group in itertools.groupby(run, key=lambda e: e["event"]):
        group = list(group)
        blocks = _ids(e.get("block") for e in group)
        if kind == "trim" and len(group) > 1:
            seqs = _ids(f"{(names or {}).get(e['seq'], e['seq'])}" for e in group)
            words.append(f"seqs {seqs} cut their tables to their computed tokens, giving back "
                         "any block that held only rejected proposals")
        elif kind == "evict" and len(group) > 1:
            words.append(f"blocks {blocks} evicted from the prefix cache, to be reused")
        elif kind == "publish" and len(group) > 1:
            words.append(f"blocks {blocks} cached as blocks {_ids(e['index'] for e in group)} "
                         "of their prefixes")
        else:
            words += [w for e in group if (w := describe(e, names))]
    return words


# -----------------------------------------------------------------------------
# The page: the states are computed here, from replay(); its script only draws them

def _held(tables, tokens, text):
    """Block -> its owners, ref count and tokens as text, for the blocks the tables point at."""
    blocks = {}
    for key, table in tables.items():
        for i, b in enumerate(table):
            if b == NO_BLOCK:
                continue
            info = blocks.setdefault(b, dict(ref=0, owners=[], text=text(tokens(seq_of(key), i))))
            info["ref"] += 1
            info["owners"].append(key)
    return blocks


def _new_blocks(run):
    """The blocks a step took or copied into: outlined on the page."""
    new = set()
    for e in run:
        if e["event"] == "allocate":
            new.update(e["table"][e["hits"]:])
        elif e["event"] in ("append", "cow"):
            new.add(e.get("block", e.get("dst")))
        elif e["event"] == "swap_in":
            new.update(e["table"])
    return sorted(new - {NO_BLOCK})


def _counts(pool, blocks, config):
    """What the curves plot at one step."""
    status, bs, most = Counter(pool.requests.values()), config["block_size"], config["max_seq_len"]
    return dict(used=sum(1 for info in blocks.values() if info["ref"]),
                logical=sum(map(len, pool.tables.values())),  # each sequence its own blocks
                # a contiguous cache reserves max_seq_len for every sequence it runs
                reserved=len(pool.tables) * -(-most // bs) if most and bs else None,
                running=status["running"], waiting=status["waiting"], swapped=status["swapped"],
                cpu_cached=len(pool.cpu_cached))


def frame(step, pool, run, config, names, text):
    """One step of the page: the pool after it and what happened in it."""
    bs = config["block_size"]

    def tokens(seq, i):  # what block i of seq holds
        return pool.tokens.get(seq, [])[i * bs:(i + 1) * bs] if bs else []
    order = sorted(pool.tables, key=lambda s: (pool.request_of[seq_of(s)], str(s)))
    blocks = _held({s: pool.tables[s] for s in order}, tokens, text)
    for b, (index, cached_tokens) in pool.cached.items():
        blocks.setdefault(b, dict(ref=0, owners=[], text=text(cached_tokens)))["cached"] = index
    swapped = sorted(pool.cpu_tables, key=lambda s: (pool.request_of[seq_of(s)], str(s)))
    return dict(step=step, failed=any(e["event"] == "rollback" for e in run),
                blocks=blocks, tables=[[s, pool.tables[s]] for s in order],
                cpu=_held(pool.cpu_tables, tokens, text),
                swapped=[[s, pool.cpu_tables[s]] for s in swapped],
                waiting=sorted(r for r, status in pool.requests.items() if status == "waiting"),
                new=_new_blocks(run), counts=_counts(pool, blocks, config),
                events=step_words(run, names))


def page_data(events, decode=None):
    """What the page draws: the settings, each sequence's request and name, and a frame for
    each entry of replay(events). decode(token ids) -> text; default: the ids."""
    config, names = settings(events), seq_names(events)
    text = decode or (lambda ids: " ".join(map(str, ids)))
    runs = by_step(events)
    seqs = {s: [int(name.split(".")[0]), name] for s, name in names.items()}
    for g in sorted({e["group"] for e in events if e.get("group")}):  # their other tables
        seqs |= {f"{s}/{g}": [request, f"{name}/{g}"] for s, (request, name) in list(seqs.items())
                 if "/" not in str(s)}
    return dict(config=config, seqs=seqs,
                frames=[frame(step, pool, run, config, names, text)
                        for (step, pool), run in zip(replay(events), runs)])


def write_html(events, path, decode=None, title="nanopaged: paging, step by step"):
    """One self-contained HTML file (inline script and style, nothing fetched) that replays the
    run step by step: open it in any browser. #step=N in its address opens it at step N."""
    data = json.dumps(page_data(events, decode), separators=(",", ":"))
    page = PAGE.replace("__TITLE__", escape(title)).replace("__NO_BLOCK__", str(NO_BLOCK)).replace(
        "__DATA__", data.replace("</", "<\\/"))  # no "</script>" inside the data
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


# The page. Its script reads the frames above and draws: the pool as a grid (one cell a block,
# one colour a request), the block tables as rows of block ids, the step's events, two curves.
PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { margin: 0; font: 13px/1.35 system-ui, sans-serif; color: #222; background: #fafafa; }
header { display: flex; gap: 10px; align-items: center; padding: 6px 12px;
         background: #fff; border-bottom: 1px solid #ddd; }
h1 { font-size: 15px; margin: 0 8px 0 0; white-space: nowrap; }
h2 { font-size: 13px; margin: 0 0 4px; }
button { font: inherit; min-width: 30px; }
#slider { flex: 1; }
#step { min-width: 190px; font-variant-numeric: tabular-nums; }
#stats { padding: 4px 12px; color: #444; background: #fff; border-bottom: 1px solid #eee; }
main { display: grid; grid-template-columns: minmax(520px, 1.1fr) minmax(380px, 1fr);
       gap: 12px; padding: 8px 12px; }
section { background: #fff; border: 1px solid #e3e3e3; border-radius: 4px; padding: 6px 8px;
          margin-bottom: 8px; }
#pool { display: grid; gap: 2px; }
.block { position: relative; height: 28px; border: 1px solid #ccc; border-radius: 3px;
         background: #fff; font-size: 11px; color: #999; text-align: center; line-height: 26px; }
.block.used { color: #222; border-color: #999; }
.block.cached { background: repeating-linear-gradient(45deg, #eee 0 3px, #d6d6d6 3px 5px);
                border-style: dashed; }
.shared { box-shadow: inset 0 0 0 2px #333; }
.ref { position: absolute; right: -3px; top: -5px; z-index: 1; padding: 0 3px; border-radius: 6px;
       background: #222; color: #fff; font-size: 10px; font-weight: 700; line-height: 13px; }
.ref:empty { display: none; }
.new { outline: 2px solid #e8590c; outline-offset: -1px; }
.legend { color: #555; font-size: 12px; margin-top: 5px; }
.legend span { display: inline-block; width: 18px; height: 11px; border: 1px solid #999;
               vertical-align: middle; margin: 0 3px 0 8px; border-radius: 2px; }
.legend .stripes { background: linear-gradient(135deg, hsl(0, 68%, 74%) 50%,
                                                  hsl(137, 68%, 74%) 50%); }
.legend .cached-key { background: repeating-linear-gradient(45deg, #eee 0 3px, #d6d6d6 3px 5px);
                      border-style: dashed; }
#tables { max-height: 48vh; overflow-y: auto; }
.row { display: flex; flex-wrap: wrap; gap: 2px; align-items: center; margin: 1px 0; }
.name { width: 46px; font-weight: 600; cursor: pointer; font-variant-numeric: tabular-nums; }
.chip { min-width: 22px; padding: 0 2px; border: 1px solid #999; border-radius: 3px;
        font-size: 11px; text-align: center; font-variant-numeric: tabular-nums; }
.chip.cpu { background: #eef !important; border-style: dotted; }
.chip.gone { color: #aaa; border-style: dashed; }
#events { max-height: 34vh; overflow-y: auto; margin: 0; padding-left: 28px; }
svg { width: 100%; height: 110px; display: block; cursor: pointer; }
polyline { fill: none; stroke-width: 1.6; vector-effect: non-scaling-stroke; }
.key { font-size: 12px; color: #555; }
.key b { display: inline-block; width: 14px; height: 3px; vertical-align: middle;
         margin: 0 3px 0 8px; }
body.lighting [data-requests]:not(.lit) { opacity: .22; }
#tip { position: fixed; display: none; max-width: 380px; padding: 6px 8px; background: #222;
       color: #eee; border-radius: 4px; font-size: 12px; pointer-events: none; z-index: 9;
       white-space: pre-wrap; }
</style></head><body>
<header><h1>__TITLE__</h1>
  <button id="first" title="first step">&#x21E4;</button>
  <button id="prev" title="previous step (left arrow)">&#x2190;</button>
  <button id="play" title="play / pause (space)">&#x25B6;</button>
  <button id="next" title="next step (right arrow)">&#x2192;</button>
  <button id="last" title="last step">&#x21E5;</button>
  <input id="slider" type="range" min="0" value="0" aria-label="step">
  <span id="step"></span>
</header>
<div id="stats"></div>
<main><div>
  <section><h2 id="pool-title"></h2><div id="pool"></div>
    <div class="legend">colour: a request<span class="stripes"></span>stripes: shared across
      requests (prefix-cache hit) &nbsp; <b>&times;n</b> ref count (shared)
      <span style="background:#fff"></span>free
      <span class="cached-key"></span>free, still caching a prefix
      <span style="outline:2px solid #e8590c"></span>taken or copied this step</div></section>
  <section><h2>KV blocks over time <span class="key"><b style="background:#1c7ed6"></b>in use
    (paged, shared)<b style="background:#e8590c"></b>without sharing (each sequence its own)
    <b style="background:#999"></b>pool; <span id="blocks-axis"></span></span></h2>
    <svg id="blocks-chart"></svg></section>
  <section><h2>Requests over time <span class="key"><b style="background:#2b8a3e"></b>running
    <b style="background:#f59f00"></b>waiting<b style="background:#7048e8"></b>swapped;
    <span id="requests-axis"></span></span></h2><svg id="requests-chart"></svg></section>
</div><div>
  <section><h2>Block tables: logical block i of each running sequence &rarr; its physical
    block <span class="key">(seq r.k: request r's k-th sequence; click one)</span></h2>
    <div id="tables"></div></section>
  <section><h2>What happened in this step</h2><ol id="events"></ol></section>
</div></main>
<div id="tip"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const F = D.frames, C = D.config, $ = (id) => document.getElementById(id);
const NO_BLOCK = __NO_BLOCK__;
let at = 0, lit = null, timer = null;

// one hue a request, the golden angle apart so that neighbours differ
const color = (r) => `hsl(${(r * 137.508) % 360}, 68%, 74%)`;
const requestsOf = (owners) => [...new Set(owners.map((s) => D.seqs[s][0]))].sort((a, b) => a - b);
function background(requests) {  // a request's colour, or stripes of every sharer's
  if (requests.length === 1) return color(requests[0]);
  const w = 100 / requests.length;
  return "linear-gradient(135deg," + requests.map((r, i) =>
    `${color(r)} ${i * w}% ${(i + 1) * w}%`).join(",") + ")";
}

function drawPool(f) {
  for (const cell of $("pool").children) {
    const b = +cell.dataset.block, info = f.blocks[b];
    const used = info && info.ref > 0, requests = used ? requestsOf(info.owners) : [];
    cell.className = "block" + (used ? " used" : info ? " cached" : "") +
      (used && info.ref > 1 ? " shared" : "") + (f.new.includes(b) ? " new" : "");
    cell.style.background = used ? background(requests) : "";
    cell.dataset.requests = requests.join(" ");
    cell.querySelector(".ref").textContent = used && info.ref > 1 ? "\u00d7" + info.ref : "";
  }
}

function chip(b, info, cpu, isNew) {
  if (b === NO_BLOCK) {  // a block no token to come sees, given back: its place stays, empty
    return `<span class="chip gone" title="given back: no token to come sees it">\u2013</span>`;
  }
  const requests = requestsOf(info.owners).join(" "), shared = info.ref > 1 ? " shared" : "";
  return `<span class="chip${cpu ? " cpu" : ""}${shared}${isNew ? " new" : ""}" data-requests=` +
    `"${requests}" ${cpu ? "data-cpu" : "data-block"}="${b}" style="background:` +
    `${background(requestsOf(info.owners))}">${b}</span>`;
}
function rows(f, tables, cpu) {
  return tables.map(([s, table]) => `<div class="row${cpu ? " swapped" : ""}" data-seq="${s}">` +
    `<span class="name" ` +
    `data-requests="${D.seqs[s][0]}">${D.seqs[s][1]}</span>` + table.map((b) =>
      chip(b, (cpu ? f.cpu : f.blocks)[b], cpu, !cpu && f.new.includes(b))).join("") +
    "</div>").join("");
}
function drawTables(f) {
  $("tables").innerHTML = (rows(f, f.tables, false) || "<i>no sequence running</i>") +
    (f.swapped.length ? "<h2>Swapped out: their block tables in the CPU pool</h2>" +
      rows(f, f.swapped, true) : "") +
    (f.waiting.length ? "<h2>Waiting (no blocks): requests " + f.waiting.join(", ") + "</h2>" : "");
}

function chart(svg, series, top) {  // polylines over every step, and a cursor
  const n = Math.max(F.length - 1, 1), x = (i) => (i / n) * 1000, y = (v) => 100 - (v / top) * 96;
  svg.setAttribute("viewBox", "0 0 1000 100");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.innerHTML = series.map(([pick, colour]) => `<polyline stroke="${colour}" points="` +
    F.map((f, i) => `${x(i).toFixed(1)},${y(pick(f)).toFixed(1)}`).join(" ") + `"/>`).join("") +
    `<line class="cursor" y1="0" y2="100" stroke="#222" stroke-dasharray="3 3"` +
    ` vector-effect="non-scaling-stroke"/>`;
  svg.onclick = (e) => show(Math.round((e.offsetX / svg.clientWidth) * n));
}

function show(i) {
  at = Math.max(0, Math.min(F.length - 1, i));
  const f = F[at], c = f.counts;
  $("slider").value = at;
  $("step").textContent = `step ${f.step} (${at + 1} of ${F.length})` + (f.failed ? " failed" : "");
  $("stats").textContent = `running ${c.running} \u00b7 waiting ${c.waiting} \u00b7 swapped ` +
    `${c.swapped} requests \u00b7 ${c.used} of ${C.num_blocks} blocks in use; without sharing ` +
    `${c.logical}` + (c.reserved === null ? "" : `; a contiguous cache reserving max_seq_len ` +
    `= ${C.max_seq_len} tokens per sequence would need ${c.reserved}`) +
    (c.cpu_cached ? `; the CPU tier caches ${c.cpu_cached} blocks` : "");
  drawPool(f);
  drawTables(f);
  $("events").innerHTML = "";
  for (const words of f.events)
    $("events").appendChild(document.createElement("li")).textContent = words;
  for (const line of document.querySelectorAll(".cursor")) {
    line.setAttribute("x1", (at / Math.max(F.length - 1, 1)) * 1000);
    line.setAttribute("x2", line.getAttribute("x1"));
  }
  light(lit);
  history.replaceState(null, "", "#step=" + f.step);
}

function light(request) {  // one request's blocks lit, the rest dimmed; null: all
  lit = request;
  document.body.classList.toggle("lighting", lit !== null);
  for (const el of document.querySelectorAll("[data-requests]"))
    el.classList.toggle("lit", el.dataset.requests.split(" ").includes(String(lit)));
}

function tip(el) {  // owners, ref count, tokens and prefix-cache state of the block under el
  const cpu = el.dataset.cpu !== undefined, b = cpu ? el.dataset.cpu : el.dataset.block;
  const info = (cpu ? F[at].cpu : F[at].blocks)[b];
  if (!info) return `block ${b}: free, holding nothing`;
  const owners = info.owners.map((s) => "seq " + D.seqs[s][1]).join(", ");
  return [`${cpu ? "CPU block" : "block"} ${b}, ref count ${info.ref}`,
    owners ? `owners: ${owners} (request ${requestsOf(info.owners).join(", ")})` : "owners: none",
    "tokens: " + JSON.stringify(info.text),
    "cached" in info ? `prefix cache: holds block ${info.cached} of a prefix` +
      (info.ref ? "" : ", free: a request with that prefix reuses it, else it is evicted")
      : cpu ? "" : "prefix cache: not cached (not full yet, or its prefix is held elsewhere)"
  ].filter(Boolean).join("\n");
}

function play(on) {
  clearInterval(timer);
  timer = on ? setInterval(() => (at < F.length - 1 ? show(at + 1) : play(false)), 150) : null;
  $("play").innerHTML = on ? "&#x275A;&#x275A;" : "&#x25B6;";
}

function setUp() {
  $("pool-title").textContent = `Physical KV pool: ${C.num_blocks} blocks` +
    (C.block_size ? ` of ${C.block_size} tokens` : "");
  $("pool").style.gridTemplateColumns = `repeat(${C.num_blocks > 128 ? 32 : 16}, 1fr)`;
  for (let b = 0; b < C.num_blocks; b++)
    $("pool").insertAdjacentHTML("beforeend", `<div class="block" data-block="${b}">${b}` +
      `<span class="ref"></span></div>`);
  const top = Math.max(C.num_blocks, ...F.map((f) => f.counts.logical));
  chart($("blocks-chart"), [[(f) => C.num_blocks, "#999"], [(f) => f.counts.logical, "#e8590c"],
    [(f) => f.counts.used, "#1c7ed6"]], top);
  $("blocks-axis").textContent = `height: 0 to ${top} blocks`;
  const most = Math.max(1, ...F.map((f) => f.counts.running + f.counts.waiting + f.counts.swapped));
  chart($("requests-chart"), [[(f) => f.counts.waiting, "#f59f00"],
    [(f) => f.counts.swapped, "#7048e8"], [(f) => f.counts.running, "#2b8a3e"]], most);
  $("requests-axis").textContent = `height: 0 to ${most}`;
  $("slider").max = F.length - 1;
  $("slider").oninput = (e) => show(+e.target.value);
  $("first").onclick = () => show(0);
  $("prev").onclick = () => show(at - 1);
  $("next").onclick = () => show(at + 1);
  $("last").onclick = () => show(F.length - 1);
  $("play").onclick = () => play(timer === null);
  document.onkeydown = (e) => {
    if (e.key === "ArrowLeft" || e.key === "ArrowRight")
      show(at + (e.key === "ArrowLeft" ? -1 : 1));
    else if (e.key === " ") play(timer === null);
    else return;
    e.preventDefault();
  };
  document.onclick = (e) => {  // a request's name or block lights it; elsewhere: none
    if (e.target.closest("header, svg")) return;  // stepping keeps the light on
    const el = e.target.closest("[data-requests]");
    const r = el && el.dataset.requests ? +el.dataset.requests.split(" ")[0] : null;
    light(r === lit ? null : r);
  };
  document.onmouseover = (e) => {
    const el = e.target.closest("[data-block], [data-cpu]");
    $("tip").style.display = el ? "block" : "none";
    if (el) $("tip").textContent = tip(el);
  };
  document.onmousemove = (e) => {
    $("tip").style.left = Math.min(e.clientX + 14, innerWidth - 390) + "px";
    $("tip").style.top = Math.min(e.clientY + 14, innerHeight - 120) + "px";
  };
  const wanted = /#step=(\d+)/.exec(location.hash);
  show(wanted ? Math.max(0, F.findIndex((f) => f.step === +wanted[1])) : 0);
}
setUp();
</script></body></html>
"""
