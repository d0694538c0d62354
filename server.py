"""
server.py: nanopaged behind the OpenAI HTTP API, as vLLM's `vllm serve` puts its engine there,
so that clients nobody here wrote (the official `openai` package, lm-eval, guidellm, `vllm bench
serve`, chat UIs) can drive a scheduling or eviction policy under online load, or score the
model. One optional file over the core: nanopaged.py never imports it.

    pip install -r requirements.txt                      # FastAPI, uvicorn, prometheus_client
    python server.py [--model PATH] [--port 8000] [--api-key KEY] [--seed N]
                     [--stream-interval N] [engine and sampling flags of `python nanopaged.py`]
    torchrun --nproc-per-node 2 server.py --disaggregate [flags]   # prefill in a process apart

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    out = client.completions.create(model="pydoc-gpt", prompt="The for statement", max_tokens=32)
    print(out.choices[0].text)

Routes: POST /v1/completions (with echo: the prompt and its logprobs, what lm-eval's
loglikelihood tasks read) and /v1/chat/completions (the folder's chat template), streamed as
server-sent events with `stream=true` (--stream-interval N tokens an event, SGLang's flag);
GET /v1/models; vLLM's /tokenize, /detokenize and /tokenizer_info; /health and /metrics
(prometheus_client's text, vLLM's metric names and latency histograms). Request fields are
the OpenAI API's, and SamplingParams' own fields under their names (vLLM's extensions: top_k,
min_p, ignore_eos, ...), read as vLLM reads them (an unknown field ignored and logged). A
sampling field left out takes the server's sampling flag, which defaults to the folder's
generation_config.json as in `python nanopaged.py`; a chat request without max_tokens generates
the room its prompt leaves, at most the file's max_new_tokens (vLLM's default).

A thread of its own, EngineLoop's, steps the Engine: nothing else touches it. Handlers check a
request completely (nothing bad reaches the engine), queue it for that thread, and read the
RequestOutputs it hands back, a step's at a time, in the request's own mailbox; a client that
goes away aborts its request between two steps. The event loop keeps answering while the model
computes. `python bench.py --serve` measures this path against Engine.generate.

Under --disaggregate (disaggregation.py) rank 0 serves HTTP, and its loop steps a DecodeFront,
which has the Engine's API: a prompt goes to rank 1, the prefill process, while rank 0 decodes
the requests it runs. Rank 1 serves no HTTP: it computes prompts until the server stops (its
shutdown says bye) or is gone. A prefill process that dies leaves the server serving alone.
Every field works as over one engine; usage's cached_tokens counts the prompt tokens whose
blocks came from the prefill process too (the decode engine did not compute them).
"""

import argparse
import asyncio
import functools
import gc
import hmac
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.request
import uuid
from collections import Counter, defaultdict, deque
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, fields

import prometheus_client
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from starlette.exceptions import HTTPException

import checkpoints
import demo
import nanopaged
import speculative  # noqa: F401  its methods, by name: --speculative-method's choices

logger = logging.getLogger("nanopaged.server")
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs; the OpenAI API's top_logprobs allows 0-20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: vLLM sends this for a token the model rules out

# -----------------------------------------------------------------------------
# Request bodies: the OpenAI API's fields and vLLM's extensions, under their names. Strict: a
# string is not a number, nor true an int. Read as vLLM reads them: a field nobody here knows is
# ignored, with a log line naming it (clients send fields of newer API versions), and one that
# names a feature this server lacks is a 400 naming it (ignoring it would answer another
# question). The sampling fields are SamplingParams' own (the OpenAI API's names and vLLM's
# extensions are SamplingParams' names), read from its fields when the app is built.


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def null_is_unset(cls, data):
        """null for an optional field that takes no null is the field left out, as vLLM reads
        it: clients that write every field send null for those they leave unset. A field that
        takes null keeps it (a completion's max_tokens: the room left), and a required one is
        still a 400."""
        if not isinstance(data, dict):
            return data
        unset = {name for name, f in cls.model_fields.items()
                 if not f.is_required() and type(None) not in typing.get_args(f.annotation)}
        return {k: v for k, v in data.items() if v is not None or k not in unset}


class StreamOptions(RequestBody):
    include_usage: bool = False  # one more chunk before [DONE], with usage and no choices
    continuous_usage_stats: bool = False  # with include_usage: usage so far in every chunk too


class OpenAIFields(RequestBody):
    model: str | None = None  # None: the served model (vLLM's); the openai client always sends it
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end user's id, for abuse monitoring at OpenAI: unused here
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower runs first


# fields of the OpenAI API and vLLM's extensions that this server cannot honour: any value but
# null is a 400 naming the field
UNSUPPORTED = {"best_of", "logit_bias", "tools", "tool_choice", "functions", "function_call",
               "response_format", "use_beam_search", "length_penalty", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
               "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "return_token_ids",
               "return_tokens_as_token_ids", "prompt_embeds", "audio", "modalities",
               "prediction", "suffix"}


def request_fields():
    """SamplingParams' fields a request may set (all but those its metadata keeps off HTTP), as
    pydantic field definitions: each takes None too, which (or leaving it out) means the
    server's sampling flag, or SamplingParams' default."""
    return {f.name: (f.type | None, None) for f in fields(nanopaged.SamplingParams)
            if f.metadata.get("http", True)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # templates may read tool_calls, name
    role: str
    content: str | list[dict] | None = None  # text, or parts [{"type": "text", "text": ...}]


def request_models():
    """The bodies of /v1/completions and /v1/chat/completions, over the sampling fields as
    SamplingParams has them now (a fork's new field is a request field with no edit here)."""
    sampling = create_model("SamplingFields", __base__=OpenAIFields, **request_fields())

    class CompletionRequest(sampling):
        prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids, or several
        max_tokens: int | None = 16  # the OpenAI API's default; 0 with echo: the prompt alone
        logprobs: int | None = None  # the k likeliest tokens at each position, and the drawn one
        echo: bool = False  # the prompt first, in the text and (with logprobs) in the logprobs

    class ChatCompletionRequest(sampling):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = None  # the newer name of max_tokens; wins if both
        logprobs: bool = False
        top_logprobs: int | None = None  # with logprobs: this many likeliest tokens at each
        echo: bool = False  # vLLM's (the last message's content first): refused if true

    return CompletionRequest, ChatCompletionRequest


class TokenizeRequest(RequestBody):  # vLLM's /tokenize: lm-eval's tokenizer, over HTTP
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(RequestBody):  # vLLM's /detokenize
    model: str | None = None
    tokens: list[int]


def unknown_fields(body, prefix=""):
    """The fields of a request (and of the request bodies inside it) that no model here defines,
    by their full paths (stream_options.foo); a chat message's own extras go to the template."""
    names = [prefix + name for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, RequestBody):
            names += unknown_fields(value, f"{prefix}{name}.")
    return names


def check_known(req, route):
    """A 400 for a field this server cannot honour; one log line for those it ignores."""
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None:
            raise APIError(f"{name} is not supported by this server", name)
    ignored = unknown_fields(req)
    if ignored:
        logger.warning("%s: ignored fields this server does not know: %s", route,
                       ", ".join(ignored))


class APIError(Exception):
    """An error for the client, in the OpenAI API's shape: {"error": {"message", "type", "param",
    "code"}}; param names the request field at fault."""

    def __init__(self, message, param=None, status=400, code=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self):
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse(error_body(self.message, kind, self.param, self.code), self.status)


def error_body(message, kind, param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error(exc, model):
    """FastAPI's 422 for a body that does not parse (as the request model), as the OpenAI API's
    400 naming the field by its full path, written as the OpenAI API writes it
    (stream_options.include_usage, messages.[0].role)."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    param = field_path(model, first["loc"][1:]) if first["loc"][:1] == ("body",) else None
    got = f", got {first['input']!r}"[:80] if "input" in first and param else ""
    return APIError(f"{param or 'body'}: {first['msg']}{got}", param)


def field_path(model, loc):
    """The fields an error's loc walks through, from model down: their names, and [i] for an
    item of a list; it stops where the loc names no field (a union's branch: 'list[int]')."""
    path = []
    for part in loc:
        if isinstance(part, int) and path:
            path.append(f"[{part}]")
            continue
        known = getattr(model, "model_fields", {})
        if part not in known:
            break
        path.append(part)
        model = nested_model(known[part].annotation)
    return ".".join(path) or None


def nested_model(annotation):
    """The model class a field holds, alone, in a list or beside None; else None."""
    for t in (annotation, *typing.get_args(annotation)):
        for inner in (t, *typing.get_args(t)):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


# -----------------------------------------------------------------------------
# From a request to the engine's inputs: token ids and a SamplingParams, checked in full here,
# so that what reaches the engine loop cannot be refused there.


@dataclass
class ServedModel:
    """What the handlers need to know of the model and its engine, read once at start."""
    names: list  # names a request may give as "model"; the first is the one /v1/models lists
    path: str  # the folder: its chat template
    tokenizer: object  # demo.Tokenizer: encode(text), decode(ids)
    max_seq_len: int
    vocab_size: int
    defaults: dict  # the sampling flags' values: a field left out takes these
    priority_scheduling: bool
    check_request: object  # Engine.check_request: it reads only the engine's settings
    api_key: str | None = None  # --api-key: the key every /v1 request must bear, if set
    seed: int | None = None  # --seed: requests without a seed take one from this stream
    # generation_config.json's max_new_tokens, if it sets one: the most a chat request that
    # sets no max_tokens generates (vLLM's default_sampling_params["max_tokens"])
    max_tokens: int | None = None
    stream_interval: int = 1  # --stream-interval: a stream's events carry this many tokens each
    tokens: object = field(init=False)  # TokenTexts: each token's text and bytes, for logprobs
    seeds: random.Random | None = field(init=False)

    def __post_init__(self):
        self.tokens = TokenTexts(self.tokenizer)
        self.seeds = None if self.seed is None else random.Random(self.seed)

    def next_seed(self):
        """A request's seed when it gives none: None (a random one, the engine's) unless the
        server has a --seed, which makes a run of unseeded requests repeat (vllm serve's)."""
        return None if self.seeds is None else self.seeds.randrange(2**63)


def check_model(req, served):
    if req.model is not None and req.model not in served.names:
        raise APIError(f"The model `{req.model}` does not exist (this server serves "
                       f"{served.names[0]!r})", "model", 404, "model_not_found")


def completion_prompts(req, served):
    """The prompts as lists of token ids, and as text (what echo sends back): text is encoded
    (with the tokenizer's special tokens, as vLLM), ids are taken as they are and decoded."""
    prompt = req.prompt
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        prompt = [prompt]  # one prompt
    if not prompt:
        raise APIError("prompt is empty", "prompt")
    prompts = [served.tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    for ids in prompts:
        check_prompt(ids, served, "prompt")
    texts = [p if isinstance(p, str) else served.tokenizer.decode(p) for p in prompt]
    return prompts, texts


def chat_prompt(req, served):
    """The messages through the folder's chat template, tokenized without adding special tokens
    (the template wrote them)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # parts: only text ones can reach a text-only model
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str)
                   for part in content):
                raise APIError(f"messages.[{i}].content: only text parts are supported",
                               f"messages.[{i}].content")
            content = "".join(part["text"] for part in content)
        messages.append(m.model_dump(exclude_none=True) | {"content": content or ""})
    try:
        text = checkpoints.render_chat(served.path, messages)
    except ValueError as e:  # no template, no jinja2, or the template refused the messages
        raise APIError(str(e), "messages") from None
    ids = served.tokenizer.encode(text, add_special_tokens=False)
    check_prompt(ids, served, "messages")
    return ids


def check_prompt(ids, served, param):
    if not ids:
        raise APIError(f"{param}: the prompt is empty", param)
    if any(not 0 <= t < served.vocab_size for t in ids):
        raise APIError(f"{param}: token ids must be in [0, {served.vocab_size})", param)
    if len(ids) >= served.max_seq_len:  # and at least one token must follow it
        raise APIError(f"{param}: this model's maximum context length is {served.max_seq_len} "
                       f"tokens, and the prompt has {len(ids)}", param)


def sampling_params(req, served, prompts, own, names):
    """The request's SamplingParams: the sampling fields it gives, the server's sampling flags
    for those it leaves out, and own, the fields the endpoint computes itself (max_tokens,
    logprobs). SamplingParams checks each value and names the field, which names renames to the
    request's own (max_completion_tokens, top_logprobs); the engine's own check comes last (n
    against max_num_seqs, the pool's size)."""
    given = {name: getattr(req, name) for name in request_fields()
             if getattr(req, name) is not None} | own
    for name in ("logprobs", "prompt_logprobs"):
        if (given.get(name) or 0) > MAX_LOGPROBS:
            param = names.get(name, name)
            raise APIError(f"{param} must be at most {MAX_LOGPROBS}, got {given[name]}", param)
    for t in req.stop_token_ids or []:
        if not 0 <= t < served.vocab_size:
            raise APIError(f"stop_token_ids: {t} is outside the vocabulary "
                           f"[0, {served.vocab_size})", "stop_token_ids")
    if req.priority != 0 and not served.priority_scheduling:
        raise APIError("priority needs a server started with --scheduling-policy priority",
                       "priority")
    given.setdefault("seed", served.next_seed())
    try:
        params = nanopaged.SamplingParams(**served.defaults | given)
    except ValueError as e:  # "SamplingParams.<field> must be ..., got ..."
        def rename(m):
            return names.get(m[1], m[1])
        named = re.search(r"SamplingParams\.(\w+)", str(e))
        raise APIError(re.sub(r"SamplingParams\.(\w+)", rename, str(e)),
                       named and rename(named)) from None
    for ids in prompts:
        try:
            served.check_request(ids, params, req.priority)
        except ValueError as e:
            raise APIError(str(e)) from None
    return params


def max_tokens_of(max_tokens, param, served, prompts):
    """max_tokens, or, left out (chat), what the context has room for after the longest prompt,
    at most the folder's generation_config.json max_new_tokens (vLLM's get_max_tokens)."""
    longest = max(map(len, prompts))
    if max_tokens is None:
        room = served.max_seq_len - longest
        return room if served.max_tokens is None else min(room, served.max_tokens)
    if max_tokens >= 1 and longest + max_tokens > served.max_seq_len:
        raise APIError(f"{param}: this model's maximum context length is {served.max_seq_len} "
                       f"tokens, and you requested {longest + max_tokens} ({longest} in the "
                       f"prompt, {max_tokens} in the completion)", param)
    return max_tokens  # below 1: SamplingParams says so


# -----------------------------------------------------------------------------
# The engine loop: the one owner of the Engine (vLLM's engine core, in a thread of its own)


@dataclass
class Submission:
    """One engine request of an HTTP request (a completion may send several prompts): what to
    add, and the queue its outputs go to, shared by the HTTP request's submissions."""
    prompt_token_ids: list
    params: nanopaged.SamplingParams
    priority: int
    outputs: "Mailbox"  # (submission, RequestOutput or StepFailed), in order
    index: int = 0  # which prompt of the HTTP request
    request_id: int | None = None  # the engine's, once added
    finished: bool = False  # its last output (or its failure) has been handed to the client
    cancelled: bool = False  # its client left: never add it, or abort it


class StepFailed(Exception):
    """engine.step() raised in a step that scheduled this request: it was aborted."""


class Mailbox:
    """Where the engine loop leaves an HTTP request's outputs: (submission, RequestOutput or
    StepFailed) pairs, in order, without bound. Its reader takes all that came since it last
    looked, woken once per step however many of its submissions the step served (an
    asyncio.Queue wakes it per item)."""

    def __init__(self):
        self.pairs, self.waiter = [], None

    def put(self, pair):  # in the event loop
        self.pairs.append(pair)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self):
        while not self.pairs:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        pairs, self.pairs = self.pairs, []
        return pairs


class EngineLoop:
    """A thread of its own runs engine.step() while requests are unfinished, steps back to
    back; between two steps, and only there, it applies what handlers queued (new requests,
    aborts) and reads the engine's stats for them. No other code touches the engine. The event
    loop, which serves HTTP meanwhile, hears of a step once: one callback puts each of the step's
    outputs in its request's queue. It never waits on a client: the queues have no bound."""

    def __init__(self, engine, loop, model_name=""):
        self.engine, self.loop = engine, loop  # loop: the event loop the handlers run in
        self.metrics = ServerMetrics(model_name)  # what /metrics shows: see ServerMetrics
        self.wake = threading.Condition()  # guards what handlers queue; notified when they do
        self.to_add, self.to_abort = deque(), deque()  # from handlers, applied between steps
        self.stats_wanted = []  # futures of /metrics handlers: answered between steps
        self.stopping = False
        self.live = {}  # request_id -> Submission, while the engine has the request
        self.finished = Counter()  # requests by how they ended: stop, length, abort, error
        self.dead = None  # the exception that stopped the loop itself (a bug), if one did
        self.scheduled = set()  # the request ids the step in progress scheduled
        self.sampled = set()  # those of them it gives tokens (it computes them to their end)
        self.thread = threading.Thread(target=self.run, name="engine loop", daemon=True)
        record_scheduled(engine, self)

    def start(self):
        self.thread.start()

    def stop(self):
        """Stop after the step in progress, if any, and wait for that."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    def submit(self, sub):
        if self.dead:
            raise APIError(f"the engine loop stopped: {self.dead!r}", status=503)
        with self.wake:
            self.to_add.append(sub)
            self.wake.notify()

    def abort(self, subs):
        """Stop the submissions that have not finished; the engine frees their blocks before
        its next step. Safe to call twice, and for finished ones."""
        for sub in subs:
            if not (sub.cancelled or sub.finished):
                sub.cancelled = True
                with self.wake:
                    self.to_abort.append(sub)
                    self.wake.notify()

    async def stats(self):
        """engine.stats() and the loop's counters, read between two steps."""
        if self.dead:
            raise APIError(f"the engine loop stopped: {self.dead!r}", status=503)
        future = self.loop.create_future()
        with self.wake:
            self.stats_wanted.append(future)
            self.wake.notify()
        return await future

    def run(self):  # the engine loop's thread
        try:
            while True:
                with self.wake:  # idle: sleep until a handler queues something
                    while not (self.to_add or self.to_abort or self.stats_wanted or
                               self.has_unfinished() or self.stopping):
                        self.wake.wait()
                    if self.stopping:
                        return
                self.apply_queued()
                self.answer_stats()
                if self.has_unfinished():
                    self.step()
        except Exception as e:  # a bug in the loop: fail everyone rather than hang them
            logger.exception("the engine loop stopped")
            self.dead = e
            with self.wake:
                subs, wanted = list(self.live.values()) + list(self.to_add), self.stats_wanted
            self.hand_over([(sub, StepFailed(f"the engine loop stopped: {e!r}")) for sub in subs])
            for future in wanted:
                self.loop.call_soon_threadsafe(future.cancel)

    def has_unfinished(self):
        """Whether the engine has requests to step: a DecodeFront's in the prefill process too,
        whose step takes what that process sent."""
        return demo.has_unfinished(self.engine)

    def step(self):
        self.scheduled, self.sampled = set(), set()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.fail_step(e)
            return
        # every request the step gave tokens, whether or not it asked for an output now (one
        # that is not streamed hears only at its end): stamped before any client hears of it
        self.metrics.tokens_handed_out(self.sampled, time.perf_counter())
        handed = []
        for out in outputs:
            sub = self.live[out.request_id]
            handed.append((sub, out))  # a stream's deltas, or another's final output alone
            if out.finished:
                del self.live[out.request_id]
                self.finished[out.outputs[0].finish_reason] += 1
                self.metrics.request_finished(out)
        self.hand_over(handed)

    def hand_over(self, handed):
        """(submission, output or StepFailed) pairs to their mailboxes, in the event loop: one
        wake-up of it per step, however many requests the step served."""
        if handed:
            self.loop.call_soon_threadsafe(deliver, handed)

    def fail_step(self, error):
        """A step raised, and the engine rolled it back: it is as before the step, so the next
        step would fail the same way if the failure follows from its requests. Those the step
        scheduled are aborted with the error (all of them if it scheduled none: the scheduler
        raised, or found nothing it could run); the others go on."""
        logger.error("engine step failed: %r", error, exc_info=error)
        failed, handed = self.scheduled or set(self.live), []
        for request_id in failed & set(self.live):
            sub = self.live.pop(request_id)
            self.engine.abort(request_id)
            handed.append((sub, StepFailed(f"the engine step failed: {error!r}")))
            self.finished["error"] += 1
            self.metrics.forget(request_id)
        self.hand_over(handed)

    def apply_queued(self):
        with self.wake:
            to_abort, to_add = list(self.to_abort), list(self.to_add)
            self.to_abort.clear()
            self.to_add.clear()
        for sub in to_abort:
            if self.live.pop(sub.request_id, None) is not None:  # else finished, or never added
                self.engine.abort(sub.request_id)
                self.finished["abort"] += 1
                self.metrics.forget(sub.request_id)
        refused = []
        for sub in to_add:
            if sub.cancelled:
                continue
            try:  # checked by the handler already: a refusal here is a bug, for this one alone
                sub.request_id = self.engine.add_request(sub.prompt_token_ids, sub.params,
                                                         sub.priority)
            except ValueError as e:
                refused.append((sub, StepFailed(f"the engine refused it: {e}")))
                continue
            self.live[sub.request_id] = sub
        self.hand_over(refused)

    def answer_stats(self):
        with self.wake:
            wanted, self.stats_wanted = self.stats_wanted, []
        if not wanted:
            return
        s, scheduler = self.engine.stats(), self.engine.scheduler
        s |= dict(num_requests_running=len(scheduler.running),
                  # a DecodeFront's requests in the prefill process wait for their first step here
                  num_requests_waiting=len(scheduler.waiting) + s.get("num_prefilling", 0),
                  num_requests_swapped=len(scheduler.swapped),
                  finished=dict(self.finished))
        for future in wanted:
            self.loop.call_soon_threadsafe(answer, future, s)


def deliver(handed):  # in the event loop
    for sub, out in handed:
        sub.outputs.put((sub, out))


def answer(future, value):  # in the event loop
    if not future.done():  # its handler may have gone
        future.set_result(value)


def record_scheduled(engine, loop):
    """Have the scheduler tell the loop which requests each step schedules: a failed step's
    error does not name the requests at fault, and after the rollback nothing says which ran.
    And which of them the step gives tokens, for the inter-token latency: a request that is not
    streamed has no output until its last step. The wrapper lives on the scheduler object, so a
    step's undo keeps it. A DecodeFront's scheduler is its engine's, which numbers requests its
    own way: the loop hears of them by the front's ids."""
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        ids = loop_ids(engine)
        loop.scheduled = {ids(seq.request_id) for seq, _ in out.scheduled}
        # a sequence computed up to its last token gets the step's next token (the engine's
        # rule for a row of logits); one whose prompt's chunk ends before that gets none yet
        loop.sampled = {ids(seq.request_id) for seq, num_new in out.scheduled
                        if seq.num_computed_tokens + num_new == len(seq)}
        return out
    engine.scheduler.schedule = recorded


def loop_ids(engine):
    """From the ids of the engine that schedules to those the loop's requests have: a
    DecodeFront's own (its front_ids maps its engine's to them); an Engine's are the same."""
    front_ids = getattr(engine, "front_ids", None)  # an Engine has none
    return (lambda request_id: request_id) if front_ids is None else front_ids.__getitem__


async def results(subs):
    """The (submission, RequestOutput) pairs the loop hands over, a step's at a time, until
    every submission has finished; a failed step raises StepFailed."""
    left = len(subs)
    while left:
        pairs = await subs[0].outputs.take()
        for sub, out in pairs:
            sub.finished = isinstance(out, Exception) or out.finished
            if isinstance(out, Exception):
                raise out
            left -= sub.finished
        yield pairs


# -----------------------------------------------------------------------------
# /metrics: prometheus_client's text (vLLM's choice), with vLLM's metric names and buckets
# (vllm/v1/metrics/loggers.py) where vLLM has the metric, nanopaged's where it has none

# vLLM's buckets, in seconds: a first token from 1 ms to 43 minutes; a gap between two of a
# request's tokens from 10 ms to 80 s; a request's time in the queue, or its whole life, from
# 0.3 s to two hours
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # abort: the client left; error: a step
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes


class RequestHistogram(typing.NamedTuple):
    name: str
    documentation: str  # the HELP line
    buckets: tuple
    # (a finished request's last RequestOutput, the times the loop had each step's tokens of
    # it) -> the values to observe: one for a figure of the request, one a gap, or none
    values: typing.Callable


# Every histogram /metrics shows, each observed when a request finishes (see ServerMetrics). A
# fork adds its own here, before the server starts: it is made and observed as these are.
HISTOGRAMS = [
    RequestHistogram(
        "vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first "
        "token, of each finished request.", TTFT_BUCKETS,
        lambda out, times: [out.metrics.first_token_time - out.metrics.arrival_time]),
    RequestHistogram(
        "vllm:inter_token_latency_seconds", "Seconds between two steps that gave a request "
        "tokens, of each finished request.", ITL_BUCKETS,
        # the first tokens have no gap before them
        lambda out, times: [later - earlier for earlier, later in zip(times, times[1:])]),
    RequestHistogram(
        "vllm:request_queue_time_seconds", "Seconds from a request's arrival to its first "
        "scheduling, of each finished request.", REQUEST_BUCKETS,
        lambda out, times: [out.metrics.time_in_queue]),
    RequestHistogram(
        "vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its last "
        "token, of each finished request.", REQUEST_BUCKETS,
        lambda out, times: [out.metrics.finished_time - out.metrics.arrival_time]),
]


class ServerMetrics:
    """What /metrics shows, in a prometheus_client registry of the server's own (a test runs
    several servers in one process, whose figures the default registry would mix), every sample
    labelled with the model's name. Two kinds of figures:
    - counts the engine keeps (queues, pool, prefix cache, tokens) and the loop's finished
      requests: read between two steps when /metrics asks, and rendered by collect();
    - the histograms of HISTOGRAMS, of the requests that finished, each observed once, in
      the loop's thread, when it finishes: from its RequestMetrics (the engine's stamps: time
      to first token, time in the queue, end to end), and its inter-token latencies, the gaps
      between the steps that gave it tokens, stamped when the loop had those tokens (whenever
      the client is sent them: --stream-interval). vLLM observes a first token and a gap as
      they come; held to the finish here, a request aborted or failed is in none of them.
    The histograms may be a step ahead of the counts: they are not read at one moment.
    A request counts once, whatever its n (vLLM v1 counts each sample as a request): its
    samples get their tokens in the same steps."""

    def __init__(self, model_name):
        # no *_created series beside each histogram's (prometheus_client's switch: per process)
        prometheus_client.disable_created_metrics()
        self.model_name = model_name
        self.registry = prometheus_client.CollectorRegistry()
        self.stats = None  # what the scrape in progress renders: see render
        self.registry.register(self)  # collect(), below
        # (its row of HISTOGRAMS, the histogram of this server's model) for each row
        self.histograms = [(row, self.histogram(row)) for row in HISTOGRAMS]
        # request_id -> when the loop had each step's tokens of it, until it finishes
        self.token_times = defaultdict(list)

    def histogram(self, row):
        return prometheus_client.Histogram(row.name, row.documentation, ["model_name"],
                                           buckets=row.buckets,
                                           registry=self.registry).labels(self.model_name)

    def tokens_handed_out(self, request_ids, now):  # in the engine loop's thread
        """A step gave these requests tokens (several in one step, speculated, are one stamp,
        as vLLM's one gap an iteration)."""
        for request_id in request_ids:
            self.token_times[request_id].append(now)

    def request_finished(self, out):  # in the engine loop's thread; out: its last output
        times = self.token_times.pop(out.request_id, [])
        for row, histogram in self.histograms:
            for value in row.values(out, times):
                histogram.observe(value)

    def forget(self, request_id):  # aborted, or failed: it is in no histogram
        self.token_times.pop(request_id, None)

    def render(self, stats):  # in the event loop
        """The text of /metrics, with the counts of stats (EngineLoop.stats'). Nothing else
        runs in the event loop between setting them and reading them."""
        self.stats = stats
        return prometheus_client.generate_latest(self.registry)

    def collect(self):
        """The counts of the scrape in progress, as metric families (prometheus_client's
        collector interface: generate_latest calls it)."""
        s = self.stats
        if s is None:  # a registry read other than by render
            return
        used, cpu = s["num_blocks"] - s["num_free_blocks"], s["num_cpu_blocks"]
        queried, hits = s["prefix_cache_queried_tokens"], s["prefix_cache_hit_tokens"]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        rows = [  # kind, name, help, value
            (gauge, "vllm:num_requests_running", "Requests in model execution batches.",
             s["num_requests_running"]),
            (gauge, "vllm:num_requests_waiting", "Requests waiting to be processed.",
             s["num_requests_waiting"]),
            (gauge, "vllm:num_requests_swapped", "Requests swapped to CPU.",
             s["num_requests_swapped"]),
            (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             used / s["num_blocks"]),
            (gauge, "vllm:cpu_cache_usage_perc", "CPU KV-cache (swap space) usage.",
             (cpu - s["num_free_cpu_blocks"]) / cpu if cpu else 0.0),
            (gauge, "nanopaged:num_blocks", "KV blocks in the device pool.", s["num_blocks"]),
            (gauge, "nanopaged:num_blocks_in_use", "KV blocks that some sequence holds.", used),
            (counter, "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of "
             "number of queried tokens.", queried),
            (counter, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of "
             "cached tokens, and, as vLLM counts, leading blocks no later token sees (chunked "
             "attention's chunks before the last), cached or not.", hits),
            (gauge, "vllm:gpu_prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens, "
             "since the start.", hits / queried if queried else 0.0),
            (gauge, "nanopaged:cpu_cache_blocks", "CPU blocks that hold a cached prefix (the "
             "prefix cache's second tier).", s["num_cpu_cached_blocks"]),
            (counter, "nanopaged:cpu_prefix_cache_hits_total", "Prefix cache hits served "
             "through the CPU tier: the hit tokens past those the device alone holds, in terms "
             "of number of cached tokens (hits_total minus this: the device's).",
             s["prefix_cache_cpu_hit_tokens"]),
            (counter, "nanopaged:offloaded_blocks_total", "Cached blocks copied to the CPU tier "
             "before their eviction.", s["num_offloaded_blocks"]),
            (counter, "nanopaged:reloaded_blocks_total", "Blocks copied back from the CPU tier "
             "on a hit.", s["num_reloaded_blocks"]),
            (counter, "vllm:num_preemptions_total", "Cumulative number of preemptions.",
             s["num_preemptions"]),
            (counter, "vllm:prompt_tokens_total", "Prompt tokens of the requests prefilled.",
             s["num_prompt_tokens"]),
            (counter, "vllm:generation_tokens_total", "Generated tokens.",
             s["num_generated_tokens"]),
            (counter, "process_cpu_seconds_total", "Total user and system CPU time spent in "
             "seconds, by every thread of the server (Prometheus' process metric).",
             time.process_time()),
        ]
        for kind, name, documentation, value in rows:
            family = kind(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        success = counter("vllm:request_success_total", "Finished requests by finished_reason "
                          "(abort: the client left; error: a failed step).",
                          labels=["model_name", "finished_reason"])
        for reason in FINISHED_REASONS:
            success.add_metric([self.model_name, reason], s["finished"].get(reason, 0))
        yield success


# -----------------------------------------------------------------------------
# From RequestOutputs to the OpenAI API's responses. A stream's requests ask step() for deltas
# (output_kind "delta"), the others for their final output alone; a Cursor numbers the choices
# and carries what each has sent so far.


@dataclass(slots=True)
class Delta:
    """What one choice gained: its new tokens, their text and logprob entries, and its finish.
    A completion that echoes its prompt has the prompt's tokens, text and entries (None for the
    first token) before its first new ones."""
    index: int  # the choice's: prompt index * n + sample index, as vLLM numbers them
    token_ids: list
    text: str
    logprobs: list | None  # per token {token_id: logprob}, the drawn one and the k likeliest
    finish_reason: str | None
    stop_reason: int | str | None
    text_offset: int  # the summed lengths of the choice's earlier tokens' texts (with logprobs)
    num_tokens: int  # the choice's generated tokens so far, these included
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, on a choice's first delta


@dataclass
class Cursor:
    """Turns a request's outputs, each what its samples gained since the last (a delta, or the
    final output, which is all of it), into the choices' deltas."""
    call: "Call"
    sent: dict = field(default_factory=dict)  # choice index -> (tokens, text offset)

    def deltas(self, sub, out, tokens):
        call = self.call
        for c in out.outputs:
            index = sub.index * call.n + c.index
            first = index not in self.sent
            num_tokens, offset = self.sent.get(index, (0, 0))
            ids, text, entries = c.token_ids, c.text or "", c.logprobs
            finish, stop = c.finish_reason, c.stop_reason
            if call.prompt_only:  # max_tokens 0: the engine's one token is not the client's
                ids, text, entries, stop = [], "", entries and [], None
                finish = finish and "length"
            d = Delta(index, ids, text, entries, finish, stop, offset, num_tokens + len(ids))
            if first:
                self.start(d, sub, out)
            if d.logprobs is not None:  # the text offsets of later tokens' logprobs
                offset = d.text_offset + sum(len(tokens.text(t)) for t in d.token_ids)
            self.sent[index] = (d.num_tokens, offset)
            yield d

    def num_tokens(self):  # the choices' generated tokens so far
        return sum(n for n, _ in self.sent.values())

    def start(self, d, sub, out):
        """A choice's first delta: the prompt before it if echoed, and its prompt_logprobs."""
        if self.call.prompt_logprobs is not None:
            d.prompt_logprobs = out.prompt_logprobs
        if self.call.echo:
            d.token_ids = out.prompt_token_ids + d.token_ids
            d.text = self.call.prompt_texts[sub.index] + d.text
            if d.logprobs is not None:
                d.logprobs = out.prompt_logprobs + d.logprobs


class StreamInterval:
    """SGLang's --stream-interval N: a stream's chunks carry a choice's tokens N at a time, fewer
    events for the same text. A choice's first tokens go out at once (the time to first token a
    client sees is not N tokens late), then as soon as N more have come, and the rest with its
    finish. With one token a step, a choice of T tokens takes 1 + ceil((T - 1) / N) chunks (as
    SGLang's, which sends at tokens 1, N + 1, 2N + 1, ... and the last). N = 1: every delta as
    it comes, as before the flag."""

    def __init__(self, n):
        self.n = n
        self.held = {}  # choice index -> the Delta it holds back, its tokens since it last sent
        self.sent = {}  # choice index -> its num_tokens when it last sent

    def due(self, deltas):
        """The deltas to send now, each with what its choice held back before it."""
        if self.n == 1:
            yield from deltas
            return
        for d in deltas:
            held = self.held.pop(d.index, None)
            if held is not None:
                d = joined(held, d)
            last = self.sent.get(d.index)
            if last is None or d.finish_reason is not None or d.num_tokens - last >= self.n:
                self.sent[d.index] = d.num_tokens
                yield d
            else:
                self.held[d.index] = d


def joined(a, b):
    """Two deltas of one choice, a then b, as one: the text offset and prompt logprobs of the
    first, the finish and count of the second."""
    return Delta(index=a.index, token_ids=a.token_ids + b.token_ids, text=a.text + b.text,
                 logprobs=None if a.logprobs is None else a.logprobs + b.logprobs,
                 finish_reason=b.finish_reason, stop_reason=b.stop_reason,
                 text_offset=a.text_offset, num_tokens=b.num_tokens,
                 prompt_logprobs=a.prompt_logprobs)


class TokenTexts:
    """Each token's name in logprobs, its bytes, and its share of a completion's text. The
    built-in model's tokens are bytes; a token that is part of a multi-byte character shows as
    "bytes:\\xe2" (the OpenAI API's way). A special token's name is its text ("</s>", as vLLM
    shows it), though the completion's text leaves it out."""

    def __init__(self, tokenizer):
        self.tokenizer, self.names, self.texts = tokenizer, {}, {}
        self.bytes_level = isinstance(tokenizer, demo.Tokenizer) and tokenizer.hf is None
        hf = getattr(tokenizer, "hf", None)  # a tokenizers.Tokenizer, which skips specials
        self.decode_named = (tokenizer.decode if hf is None else
                             functools.partial(hf.decode, skip_special_tokens=False))

    def bytes(self, token_id):
        if token_id not in self.names:
            self.names[token_id] = (bytes([token_id]) if self.bytes_level else
                                    self.decode_named([token_id]).encode("utf-8"))
        return self.names[token_id]

    def text(self, token_id):  # its share of the completion's text
        if token_id not in self.texts:
            self.texts[token_id] = (self.bytes(token_id).decode("utf-8", errors="replace")
                                    if self.bytes_level else self.tokenizer.decode([token_id]))
        return self.texts[token_id]

    def token(self, token_id):  # the name it goes by in logprobs
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def likeliest(entry, k):
    """The k likeliest (token_id, logprob) of an entry, likeliest first (the drawn token is in
    the entry too, whether or not it is among them)."""
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def clamp(logprob):
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(d, k, tokens):
    """The completions API's logprobs of a delta: per token its text, logprob, offset, and the k
    likeliest with the drawn one (so k or k + 1 of them); an echoed prompt's first token has no
    logprob (null, as the OpenAI API and vLLM send it)."""
    offsets, offset = [], d.text_offset
    for t in d.token_ids:
        offsets.append(offset)
        offset += len(tokens.text(t))
    pairs = list(zip(d.token_ids, d.logprobs))
    return dict(
        tokens=[tokens.token(t) for t in d.token_ids],
        token_logprobs=[None if e is None else clamp(e[t]) for t, e in pairs],
        top_logprobs=[None if e is None else {
            tokens.token(i): clamp(lp) for i, lp in likeliest(e, k) + [(t, e[t])]}
            for t, e in pairs],
        text_offset=offsets)


def prompt_logprobs(prompt, entries, k, tokens):
    """vLLM's prompt_logprobs: None for the first prompt token, then for each the prompt's token
    and the k likeliest, {token id: {logprob, rank, decoded_token}}; rank 1 is the likeliest,
    and the prompt's token's rank is null when it is not among the k (the engine keeps no more)."""
    out = [None]
    for t, e in zip(prompt[1:], entries[1:]):
        top = likeliest(e, k)
        ranks = {i: r for r, (i, _) in enumerate(top, 1)}
        out.append({str(i): dict(logprob=clamp(lp), rank=ranks.get(i),
                                 decoded_token=tokens.token(i)) for i, lp in [(t, e[t])] + top})
    return out


def chat_logprobs(d, k, tokens):
    """The chat API's logprobs of a delta: per token {token, logprob, bytes, top_logprobs}."""
    def entry(t, lp):
        return dict(token=tokens.token(t), logprob=clamp(lp), bytes=list(tokens.bytes(t)))
    return dict(content=[entry(t, e[t]) | dict(top_logprobs=[entry(*x) for x in likeliest(e, k)])
                         for t, e in zip(d.token_ids, d.logprobs)], refusal=None)


def completion_choice(d, k, tokens, prompt_k=None, prompt=None):
    choice = dict(index=d.index, text=d.text, finish_reason=d.finish_reason,
                  stop_reason=d.stop_reason,
                  logprobs=None if d.logprobs is None else completion_logprobs(d, k, tokens))
    if d.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(prompt, d.prompt_logprobs, prompt_k, tokens)
    return choice


def chat_choice(d, k, tokens, streaming):
    content = {"delta": {"content": d.text}} if streaming else {
        "message": {"role": "assistant", "content": d.text, "refusal": None}}
    return dict(index=d.index, **content, finish_reason=d.finish_reason,
                stop_reason=d.stop_reason,
                logprobs=None if d.logprobs is None else chat_logprobs(d, k, tokens))


def usage(finals, completion):
    """Tokens of the prompts (each once, however many samples) and completion, every choice's."""
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    return token_usage(prompt, completion) | dict(
        prompt_tokens_details=dict(cached_tokens=sum(o.num_cached_tokens for o in finals)))


def token_usage(prompt, completion):
    return dict(prompt_tokens=prompt, completion_tokens=completion,
                total_tokens=prompt + completion)


# -----------------------------------------------------------------------------
# The routes


@dataclass
class Call:
    """One HTTP request on its way: its submissions and how to shape what comes back."""
    chat: bool
    req: OpenAIFields
    subs: list
    logprobs: int | None  # k, when logprobs were asked for
    prompt_logprobs: int | None = None  # vLLM's field: k for each prompt token, if asked for
    echo: bool = False  # the prompt first in each choice
    prompt_texts: list | None = None  # the prompts' text, for echo
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt, nothing generated
    model: str = ""  # the name it answers as
    head: bytes | None = None  # the start of each of its server-sent events, once encoded
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self):  # samples per prompt
        return self.subs[0].params.n

    def envelope(self, model, choices, streaming, **more):
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if streaming else "chat.completion"
        return dict(id=("chatcmpl-" if self.chat else "cmpl-") + self.id, object=kind,
                    created=self.created, model=model, choices=choices, **more)

    def chunk(self, choice, usage=None):
        """One server-sent event of the stream, with one choice (or none) and maybe usage: the
        envelope around them, the same in every chunk, is encoded once."""
        if self.head is None:
            self.head = sse(self.envelope(self.model, [], True))[:-len(b"]}\n\n")]
        tail = b"]}\n\n" if not usage else b'],"usage":' + encode_json(usage).encode() + b"}\n\n"
        return self.head + (b"" if choice is None else encode_json(choice).encode()) + tail

    def choice(self, d, tokens, streaming):
        if self.chat:
            return chat_choice(d, self.logprobs, tokens, streaming)
        prompt = self.subs[d.index // self.n].prompt_token_ids
        return completion_choice(d, self.logprobs, tokens, self.prompt_logprobs, prompt)


def prepare(req, served, chat):
    """A request, checked in full, as a Call whose submissions are ready for the loop."""
    check_known(req, "/v1/chat/completions" if chat else "/v1/completions")
    check_model(req, served)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream=true", "stream_options")
    if req.stream and req.prompt_logprobs is not None:  # as vLLM: echo them instead
        raise APIError("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    names = dict(max_tokens="max_tokens", logprobs="logprobs")  # SamplingParams' -> the request's
    call = Call(chat, req, [], None, req.prompt_logprobs, model=served.names[0])
    if chat:
        if req.echo:
            raise APIError("echo is not supported on chat completions", "echo")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
        prompts = [chat_prompt(req, served)]
        call.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        names["logprobs"] = "top_logprobs"
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:  # the newer name; it wins, as in vLLM
            max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    else:
        prompts, call.prompt_texts = completion_prompts(req, served)
        call.logprobs, call.echo, max_tokens = req.logprobs, req.echo, req.max_tokens
        if req.echo and max_tokens == 0:  # the prompt alone (lm-eval's loglikelihood asks so):
            # SamplingParams needs max_tokens >= 1, so the engine draws one token, from the
            # logits its prefill makes anyway (no forward more), and the answer leaves it out
            call.prompt_only, max_tokens = True, 1
    own = dict(max_tokens=max_tokens_of(max_tokens, names["max_tokens"], served, prompts),
               logprobs=call.logprobs, output_kind="delta" if req.stream else "final_only")
    if call.echo and call.logprobs is not None:  # echoed logprobs are prompt logprobs
        own["prompt_logprobs"] = max(call.logprobs, req.prompt_logprobs or 0)
    params = sampling_params(req, served, prompts, own, names)
    mailbox = Mailbox()
    call.subs = [Submission(p, params, req.priority, mailbox, i)
                 for i, p in enumerate(prompts)]
    return call


async def serve(call, loop, served, request):
    """Submit the call's requests and answer: a stream of events, or one JSON body."""
    if call.req.stream:  # it submits them when it starts: a client gone before, costs nothing
        return StreamingResponse(events(call, loop, served), media_type="text/event-stream")
    for sub in call.subs:
        loop.submit(sub)
    try:
        finals = await until_disconnected(request, collect(call))
    except StepFailed as e:
        raise APIError(str(e), status=500) from None
    finally:  # a client that left, or a failed sibling: stop the others too
        loop.abort(call.subs)
    tokens, cursor = served.tokens, Cursor(call)
    choices = sorted((call.choice(d, tokens, False) for sub, out in finals
                      for d in cursor.deltas(sub, out, tokens)), key=lambda c: c["index"])
    more = {}
    if call.chat and call.prompt_logprobs is not None:  # the response's, as vLLM's
        out = finals[0][1]
        more["prompt_logprobs"] = prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                  call.prompt_logprobs, tokens)
    return Response(encode_json(call.envelope(
        served.names[0], choices, False, usage=usage([o for _, o in finals], cursor.num_tokens()),
        **more)), media_type="application/json")


async def collect(call):
    """Each submission's final RequestOutput."""
    return [(sub, out) async for pairs in results(call.subs) for sub, out in pairs
            if out.finished]


async def until_disconnected(request, coro):
    """coro's result; if the client disconnects first, coro is cancelled (its finally runs)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # this handler cancelled (a shutdown) stops coro too
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
    if gone:
        raise APIError("the client disconnected", status=499)
    return task.result()


async def wait_for_disconnect(request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def events(call, loop, served):
    """Server-sent events: a chunk per choice as it gains tokens (--stream-interval's N at a
    time), then usage if asked, then [DONE]. Starlette cancels this generator when the client
    disconnects: finally aborts. stream_options.continuous_usage_stats puts the usage so far in
    every chunk too: the prompt's tokens and the choice's (vLLM's)."""
    tokens, cursor, finals = served.tokens, Cursor(call), []
    interval = StreamInterval(served.stream_interval)
    options = call.req.stream_options or StreamOptions()
    continuous = options.include_usage and options.continuous_usage_stats
    try:
        for sub in call.subs:
            loop.submit(sub)
        if call.chat:  # the OpenAI API's first chunk of each choice: the role, no content yet
            prompt = len(call.subs[0].prompt_token_ids)
            for i in range(call.n):
                yield call.chunk(dict(index=i, delta=dict(role="assistant", content=""),
                                      logprobs=None, finish_reason=None),
                                 continuous and token_usage(prompt, 0))
        async for pairs in results(call.subs):  # a step's chunks go out in one write
            chunks = []
            for sub, out in pairs:
                prompt = len(out.prompt_token_ids)
                for d in interval.due(cursor.deltas(sub, out, tokens)):
                    chunks.append(call.chunk(call.choice(d, tokens, True),
                                             continuous and token_usage(prompt, d.num_tokens)))
                finals += [out] if out.finished else []
            if chunks:  # every choice of the step may be holding its tokens back
                yield b"".join(chunks)
        if options.include_usage:
            yield call.chunk(None, usage(finals, cursor.num_tokens()))
    except (StepFailed, APIError) as e:  # the status line went out already: an error event
        yield sse(error_body(str(e), "server_error"))
    finally:
        loop.abort(call.subs)
    yield b"data: [DONE]\n\n"


# JSON as the server sends it: compact, and UTF-8 as it is (one encoder, made once)
encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload):
    return f"data: {encode_json(payload)}\n\n".encode()


def tokenizer_description(served):
    """vLLM's /tokenizer_info: the tokenizer's special tokens (null where the folder's
    tokenizer_config.json names none: the built-in model has no end token) and its length."""
    config = checkpoints.read_json(served.path, "tokenizer_config.json") or {}
    special = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()
               if k in checkpoints.SPECIAL_TOKENS}
    kind = "bytes (UTF-8)" if served.tokens.bytes_level else "tokenizers.Tokenizer"
    return dict(tokenizer_class=config.get("tokenizer_class", kind), eos_token=None,
                bos_token=None, pad_token=None, model_max_length=served.max_seq_len) | special


def key_check(served):
    """--api-key as vllm serve takes it: a dependency that answers 401 unless the request
    bears the key (compared in constant time)."""
    async def authorized(request: Request):
        if served.api_key is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(),
                f"Bearer {served.api_key}".encode()):
            raise APIError("a valid API key is needed: Authorization: Bearer <--api-key>",
                           status=401, code="invalid_api_key")
    return authorized


def add_tokenizer_routes(app, served, keyed):
    """vLLM's /tokenize, /detokenize and /tokenizer_info: lm-eval's remote tokenizer, which
    counts a loglikelihood request's context tokens with the server's own tokenizer."""
    @app.post("/tokenize", **keyed)
    async def tokenize(req: TokenizeRequest):
        check_known(req, "/tokenize")
        check_model(req, served)
        ids = served.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return dict(count=len(ids), max_model_len=served.max_seq_len, tokens=ids, token_strs=None)

    @app.post("/detokenize", **keyed)
    async def detokenize(req: DetokenizeRequest):
        check_known(req, "/detokenize")
        check_model(req, served)
        if any(not 0 <= t < served.vocab_size for t in req.tokens):
            raise APIError(f"tokens must be in [0, {served.vocab_size})", "tokens")
        return dict(prompt=served.tokenizer.decode(req.tokens))

    @app.get("/tokenizer_info", **keyed)
    async def tokenizer_info():
        return tokenizer_description(served)


def close_front(engine):
    """A DecodeFront says bye to its prefill process, which then ends too; called once the
    loop, the one code that touches the engine, has stopped."""
    close = getattr(engine, "close", None)  # an Engine has nothing to close
    if close is not None:
        close()


def build_app(engine, served):
    """The FastAPI app: the routes over one EngineLoop, started with the app and stopped with
    it."""
    loop = None
    CompletionRequest, ChatCompletionRequest = request_models()

    @asynccontextmanager
    async def lifespan(app):
        nonlocal loop
        loop = EngineLoop(engine, asyncio.get_running_loop(), served.names[0])
        loop.start()
        yield
        loop.stop()
        close_front(engine)

    app = FastAPI(title="nanopaged", lifespan=lifespan)
    app.add_exception_handler(APIError, lambda request, e: e.response())
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
              "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
    app.add_exception_handler(RequestValidationError, lambda request, e: validation_error(
        e, bodies.get(request.url.path)).response())
    app.add_exception_handler(HTTPException, lambda request, e: APIError(
        str(e.detail), status=e.status_code).response())

    keyed = dict(dependencies=[Depends(key_check(served))])  # all but /health and /metrics

    @app.post("/v1/completions", **keyed)
    async def completions(req: CompletionRequest, request: Request):
        return await serve(prepare(req, served, chat=False), loop, served, request)

    @app.post("/v1/chat/completions", **keyed)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serve(prepare(req, served, chat=True), loop, served, request)

    @app.get("/v1/models", **keyed)
    async def models():
        return dict(object="list", data=[dict(
            id=served.names[0], object="model", created=int(time.time()), owned_by="nanopaged",
            root=served.path, max_model_len=served.max_seq_len)])

    add_tokenizer_routes(app, served, keyed)

    @app.get("/health")
    async def health():  # 200 while the engine loop runs (vLLM's): it may be mid-step
        return Response(status_code=503 if loop.dead else 200)

    @app.get("/metrics")
    async def metrics():
        stats = await loop.stats()
        return Response(loop.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    return app


# -----------------------------------------------------------------------------
# The command line


def argument_parser():
    p = demo.add_engine_flags(argparse.ArgumentParser(
        description="An OpenAI-compatible HTTP server over nanopaged's engine.",
        epilog="--num-blocks defaults here to the engine's own sizing, not the demo's 96: as vLLM"
        " sizes its cache, enough for max_num_seqs sequences of max_seq_len tokens, within 90% "
        "of free GPU memory (1 GiB on a CPU). The sampling flags are the defaults of the "
        "request fields a client leaves out."))
    p.set_defaults(num_blocks=None)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name",
                   help="the model name clients send and /v1/models lists (default: the "
                   "folder's name); --model's value is accepted too")
    p.add_argument("--api-key",
                   help="if given, every request but /health and /metrics must send it "
                   "(Authorization: Bearer KEY); others get a 401")
    p.add_argument("--seed", type=int,
                   help="seeds the requests that give no seed, in the order they come, so that a "
                   "run repeats (default: each a random seed)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per server-sent event of a streamed response, as SGLang's flag: "
                   "a choice's first token goes out at once, then N at a time, and the last with "
                   "its finish (default 1: each step's tokens as they come)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level; info logs a line per request (default info)")
    return p


def served_model(args, model, engine, tokenizer):
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ServedModel(
        names=[name, args.model], path=args.model, tokenizer=tokenizer,
        max_seq_len=model.config.max_seq_len, vocab_size=model.config.vocab_size,
        defaults={f.name: getattr(args, f.name) for f in demo.sampling_fields()},
        priority_scheduling=args.scheduling_policy == "priority",
        check_request=engine.check_request, api_key=args.api_key, seed=args.seed,
        max_tokens=checkpoints.generation_defaults(args.model).get("max_tokens"),
        stream_interval=args.stream_interval)


def main(argv=None):
    args = argument_parser().parse_args(argv)
    try:
        if args.tensor_parallel_size != 1:  # ranks step in lockstep; one process serves HTTP
            raise ValueError("--tensor-parallel-size: the server runs in one process, "
                             "without torchrun; use 1")
        if args.stream_interval < 1:
            raise ValueError(f"--stream-interval must be an integer >= 1, "
                             f"got {args.stream_interval}")
        model, engine, tokenizer = demo.load(args)
    except ValueError as e:
        sys.exit(f"server.py: error: {e}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    if hasattr(engine, "serve"):  # --disaggregate's prefill process (rank 1): no HTTP
        return serve_prefill(engine)
    served = served_model(args, model, engine, tokenizer)
    logger.info("model %s as %r: max_seq_len %d; KV pool %d blocks x %d tokens on %s",
                args.model, served.names[0], served.max_seq_len, engine.allocator.num_blocks,
                engine.block_size, engine.device)
    app = build_app(engine, served)
    # what start-up made (the model, the libraries) lives as long as the server: the cyclic
    # collector, which every thread's allocations trigger, need not walk it again (as vLLM)
    gc.collect()
    gc.freeze()
    # a stream still open at shutdown gets a few seconds, then is cut
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=5)
    gc.unfreeze()  # and it all goes as usual at exit


def serve_prefill(worker):
    """Rank 1 under --disaggregate: the prefill worker computes the front's prompts until the
    front says bye (the server stopped) or is gone; returns its engine's stats. SIGTERM ends it
    as SIGINT does, with a bye of its own: torchrun passes a signal to every rank."""
    logger.info("prefill process: serving the prompts of rank 0, the server")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        stats = worker.serve()
    except KeyboardInterrupt:
        stats = worker.shut_down()
    logger.info("prefill process: stopped; %d of %d blocks free", stats["num_free_blocks"],
                stats["num_blocks"])
    return stats


# -----------------------------------------------------------------------------
# A server in a subprocess, for the tests and bench.py --serve


def free_port(host="127.0.0.1"):
    """A port nothing listens on now (another process may yet take it before the server does;
    a server that cannot bind exits, which running_server reports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running_server(argv=(), timeout_s=60, log=subprocess.DEVNULL):
    """`python server.py *argv` in a subprocess on a free port of 127.0.0.1, for tests and
    bench.py: yields its base URL once /health answers, within timeout_s; on exit it is stopped,
    and killed if it has not stopped within 10 s. log: where its output goes (a file, not a
    pipe nobody reads, which would fill and block it; opened "w+", a failed start quotes it)."""
    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    process = subprocess.Popen([sys.executable, os.path.join(here, "server.py"), "--host",
                                "127.0.0.1", "--port", str(port), *argv], stdout=log,
                               stderr=subprocess.STDOUT, cwd=here)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {process.returncode}" if process.poll() is not None else
                       f"did not answer /health within {timeout_s} s")
                raise RuntimeError(f"server.py {why}; its output:\n{read_back(log)}")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_back(log, limit=3000):
    """The end of what a server wrote to log, if log is a file opened for reading too."""
    try:
        log.flush()
        log.seek(0)
        return log.read()[-limit:]
    except (AttributeError, OSError, ValueError):  # DEVNULL, or a file opened "w"
        return "(not kept: pass running_server a file opened with 'w+')"


def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # not listening yet (or 503: HTTPError is an OSError too)
        return False


if __name__ == "__main__":
    main()
