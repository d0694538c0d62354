"""
disaggregation.py: prefill and decode in two processes (DistServe, OSDI 2024; Splitwise, ISCA
2024; Mooncake, FAST 2025; vLLM's P2pNcclConnector). A long prompt's prefill no longer stalls
the decodes of the requests already running: one engine computes prompts, another generates.

    torchrun --nproc-per-node 2 nanopaged.py --disaggregate     # one machine
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port P \
        nanopaged.py --disaggregate                             # two machines

Rank 0 is the decode process, the front: it takes the requests and prints. Rank 1 is the
prefill process. For each request the front sends the prompt to the prefill process, whose
engine computes it (max_tokens=1) and sends back each full block it publishes: its chained
key, tokens, place in the sequence and K/V (the producer connector, stage "computed"). The
front stages them (the consumer connector) and, once the prompt is done, adds the request to
its own engine, where the staged blocks are a prefix hit, copied into fresh device blocks at
stage "in"; the engine computes the rest (at least the last prompt token) and generates.
Meanwhile it keeps stepping the requests it runs.

Messages, each a JSON header on a gloo group, then its tensors (on NCCL between GPUs):
    decode -> prefill  prefill {request, prompt, have}  compute the prompt; the decode
                                                        process caches its first `have` blocks
                       abort {request}                  drop it: send nothing more for it
    prefill -> decode  block {key, tokens, index}       + one tensor per paged tensor
                       done {request}                   every block of it was sent before this
                       rejected {request, error}        not prefilled: the front computes it
    both ways          ping (every timeout / 4 while idle, so a wait never times out on a live
                       peer), bye (the last message: the link is closing)

An abort at the front frees the request's staged blocks and tells the prefill process, which
aborts it in its engine; blocks already on the way are dropped as they arrive. A prefill process
that gives a request up says rejected, and the front computes it alone. A peer that dies (its
sockets close: gloo's receive fails at once) or hangs past the timeout ends the link, not the
survivor: the front adds every request still in prefill to its own engine, with whatever whole
blocks had arrived, and serves on alone; the prefill process aborts what it holds and returns.

Nothing here is a transport of its own: torch.distributed's send and recv over process groups.
Engine(connector="remote", connector_config={"link": link}) picks the role from the link.
"""

import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

import connectors
from nanopaged import SamplingParams, Sequence, tp

PROTOCOL = 1  # the messages' version: both processes must speak the same
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0)  # the token drawn is not used


# -----------------------------------------------------------------------------
# The link: messages between the two processes, over torch.distributed


class Link:
    """One end of the two processes' link, in the group torchrun launched (WORLD_SIZE=2): rank 0
    the decode process, rank 1 the prefill process. A thread sends the outbox's messages in
    order, another receives the peer's into the inbox, so the engine's steps never wait on the
    peer. Each direction has groups of its own: a gloo group for headers (gloo's receive fails
    as soon as the peer's sockets close), and for the tensors the world's backend (NCCL on
    GPUs, where a communicator's ops run in order: a receive posted one way would hold up a send
    the other way)."""

    def __init__(self, timeout_s=60.0, device=None):
        if tp.world_size > 1:
            raise ValueError("disaggregation runs one engine per process: it does not combine "
                             "with tensor parallelism (tensor_parallel_size > 1)")
        launched = os.environ.get("WORLD_SIZE")
        if launched != "2":
            raise ValueError(f"disaggregation needs two processes, launched by torchrun "
                             f"--nproc-per-node 2 (WORLD_SIZE is {launched})")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=self.timeout)
        self.rank, self.peer = dist.get_rank(), 1 - dist.get_rank()
        self.role = "decode" if self.rank == 0 else "prefill"
        backend = dist.get_backend()
        self.device = torch.device("cpu")  # where received tensors land: the data group's
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.groups = []  # per sending rank: (headers' group, tensors' group)
        for _ in range(2):  # new_group is collective: both ranks make them in one order
            control = dist.new_group([0, 1], timeout=self.timeout, backend="gloo")
            data = control if backend == "gloo" else dist.new_group([0, 1], timeout=self.timeout)
            self.groups.append((control, data))
        self.outbox, self.inbox = queue.Queue(), queue.Queue()
        self.num_unsent = 0  # messages sent by send() that are not on the wire yet
        self.lock = threading.Lock()
        self.error = None  # why the link ended, once it has
        self.threads = []

    def handshake(self, identity):
        """Exchange the engines' identities (identity()) and check them: a mismatch is a
        ValueError on both sides, at start. Then the link starts."""
        both = [None, None]
        dist.all_gather_object(both, identity)  # the world group, bounded by its timeout
        check_peer(identity, both[self.peer])
        if not self.threads:
            self.threads = [threading.Thread(target=self._send_loop, daemon=True),
                            threading.Thread(target=self._receive_loop, daemon=True)]
            for thread in self.threads:
                thread.start()

    def send(self, message, tensors=()):
        """Queue a message (a JSON-able dict with a "type") and its tensors, which nobody may
        write afterwards; dropped once the link has ended."""
        if self.error is None:
            with self.lock:
                self.num_unsent += 1
            self.outbox.put((message, list(tensors)))

    def receive(self, timeout=0):
        """The next (message, tensors) from the peer, or None if none came within timeout
        seconds. A message of type "dead" says the peer is gone (its "error" says why)."""
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def num_pending_sends(self):
        return self.num_unsent

    def close(self, wait_s=10.0):
        """Say bye, and wait (at most wait_s) until the peer has said it too."""
        self.send({"type": "bye"})
        for thread in self.threads:
            thread.join(wait_s)

    def _send_loop(self):
        control, data = self.groups[self.rank]
        ping_s = self.timeout.total_seconds() / 4
        try:
            while True:
                try:
                    message, tensors = self.outbox.get(timeout=ping_s)
                except queue.Empty:  # idle: keep the peer's pending receive from timing out
                    message, tensors = {"type": "ping"}, []
                    with self.lock:
                        self.num_unsent += 1
                self._send(message, tensors, control, data)
                with self.lock:
                    self.num_unsent -= 1
                if message["type"] == "bye":
                    return
        except Exception as e:  # the peer is gone, or hung past the timeout
            self._end(e)

    def _send(self, message, tensors, control, data):
        tensors = [t.contiguous() for t in tensors]
        self._send_header(message, tensors, control)
        for t in tensors:
            self._send_tensor(t, data)

    def _send_header(self, message, tensors, control):
        """The message as JSON, the tensors' shapes and dtypes in it, after its length."""
        described = dict(message, tensors=[[list(t.shape), str(t.dtype).removeprefix("torch.")]
                                           for t in tensors])
        payload = torch.frombuffer(bytearray(json.dumps(described).encode()), dtype=torch.uint8)
        dist.send(torch.tensor([len(payload)]), self.peer, group=control)
        dist.send(payload, self.peer, group=control)

    def _send_tensor(self, tensor, data):
        # as bytes: gloo and NCCL lack the 8-bit float types
        dist.send(tensor.reshape(-1).view(torch.uint8), self.peer, group=data)

    def _receive_loop(self):
        control, data = self.groups[self.peer]
        try:
            while True:
                message, tensors = self._receive(control, data)
                if message["type"] != "ping":
                    self.inbox.put((message, tensors))
                if message["type"] == "bye":
                    return
        except Exception as e:
            self._end(e)

    def _receive(self, control, data):
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, self.peer, group=control)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, self.peer, group=control)
        message = json.loads(payload.numpy().tobytes())
        tensors = []
        for shape, dtype in message.pop("tensors"):
            dtype = getattr(torch, dtype)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dist.recv(t, self.peer, group=data)
            tensors.append(t.view(dtype).reshape(shape))
        if tensors and self.device.type == "cuda":  # the receive ran on NCCL's stream
            torch.cuda.synchronize(self.device)
        return message, tensors

    def _end(self, error):
        """The link is over: tell the engine's thread once, and drop what is left to send."""
        with self.lock:
            if self.error is not None:
                return
            self.error = f"{type(error).__name__}: {error}"
            self.num_unsent = 0
        self.inbox.put(({"type": "dead", "error": self.error}, []))


class LoopbackLink:
    """Both ends in one process (loopback_pair()), for tests and notebooks: the same messages
    through queues, delivered in order the moment they are sent. The handshake checks when the
    second end arrives."""

    def __init__(self, role, inbox, outbox, identities):
        self.role, self.inbox, self.outbox, self.identities = role, inbox, outbox, identities
        self.error = None

    def handshake(self, identity):
        self.identities[self.role] = identity
        peer = "prefill" if self.role == "decode" else "decode"
        if peer in self.identities:
            check_peer(identity, self.identities[peer])

    def send(self, message, tensors=()):
        if self.error is None:  # a round trip through JSON, as on the wire
            self.outbox.put((json.loads(json.dumps(message)), [t.clone() for t in tensors]))

    def receive(self, timeout=0):
        # waits as Link's does: an end served in a thread of its own (a test's prefill worker
        # beside a server) sleeps while idle instead of spinning against its peer's thread
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def num_pending_sends(self):
        return 0

    def close(self):
        self.send({"type": "bye"})
        self.error = "closed"


def loopback_pair():
    """(decode end, prefill end) of a link inside one process."""
    down, up, identities = queue.Queue(), queue.Queue(), {}
    return (LoopbackLink("decode", down, up, identities),
            LoopbackLink("prefill", up, down, identities))


# -----------------------------------------------------------------------------
# The handshake: what both engines must agree on before a block moves


def identity(engine, role):
    """What the peer checks: every field must be equal, but the role."""
    return dict(role=role, protocol=PROTOCOL, block_size=engine.block_size,
                kv_cache_dtype=str(engine.kv_cache.dtype).removeprefix("torch."),
                # one block of each tensor kept per block: the K/V, and key bounds if the read
                # policy keeps them
                block_shapes=[list(cache[:, :, 0].shape)
                              for cache, _ in engine.model_runner.paged_tensors()],
                model=connectors.model_identity(engine.model),
                tensor_parallel_size=tp.world_size)


def check_peer(mine, theirs):
    """A ValueError naming every field in which the two engines differ."""
    if mine["role"] == theirs["role"]:
        raise ValueError(f"disaggregation handshake: both processes are {mine['role']} "
                         f"engines: one prefills (rank 1), the other decodes (rank 0)")
    differ = [f"{name} is {mine[name]!r} here, {theirs.get(name)!r} in the {theirs['role']} "
              f"process" for name in mine if name != "role" and mine[name] != theirs.get(name)]
    if differ:
        raise ValueError("disaggregation handshake: the prefill and decode engines must hold "
                         "the same blocks of the same model, but " + "; ".join(differ))


def prompt_blocks(engine, prompt, first=0):
    """{key: (tokens, index)} of the prompt's blocks from `first` on that a prefix hit can
    serve (all its full blocks before its last token's), in every KV cache group."""
    seq, bs = Sequence(-1, prompt, len(prompt)), engine.block_size
    cache = engine.allocator.prefix_cache
    cache.key_blocks(seq)
    blocks = {}
    for i in range(first, (len(prompt) - 1) // bs):
        for g in range(len(engine.allocator.kinds)):
            blocks[cache.key(seq, i, g)] = (tuple(prompt[i * bs:(i + 1) * bs]), i)
    return blocks


def num_cached_blocks(engine, prompt):
    """The prompt's leading blocks the engine's own prefix cache holds now."""
    seq = Sequence(-1, prompt, len(prompt))
    return engine.allocator.lookup(seq, tier=False).num_blocks


# -----------------------------------------------------------------------------
# The two connectors: the prefill process's producer, the decode process's consumer


class KVProducer(connectors.Connector):
    """The prefill process's connector: each block its engine publishes that the decode process
    still lacks is sent once the step has computed it (save marks it in the plan, transfer at
    stage "computed" sends it); when a request's prefill is done, the blocks its engine's own
    cache served are sent too, then done."""
    enabled = False  # it serves no hits: the engine's own cache does

    def __init__(self, allocator, link):
        self.allocator, self.link = allocator, link
        # engine request id -> (the front's request id, {key: (tokens, index)} still to send)
        self.wanted = {}
        self.runner = None  # the model runner, as the first transfer names it
        self.num_sent_blocks = 0

    def want(self, request_id, front_id, blocks):
        self.wanted[request_id] = (front_id, dict(blocks))

    def cancel(self, request_id):
        """An abort: nothing more is sent for the request, not even done."""
        self.wanted.pop(request_id, None)

    def save(self, block, copies, evicted):
        if not evicted and any(block.hash in blocks for _, blocks in self.wanted.values()):
            # the key as text: a plan's copies are what an observer hears (pagetrace's JSON)
            copies.offload.append((block.block_id, block.hash.hex()))

    def transfer(self, copies, runner, stage):
        self.runner = runner
        if stage == "computed":  # after the forward: the K/V are in the blocks
            for block_id, key in copies.offload:
                self.send_block(block_id, bytes.fromhex(key))

    def send_block(self, block_id, key):
        block = self.allocator.blocks[block_id]
        # a copy: the block may be written once a later step reuses it
        tensors = [cache[:, :, block_id].clone() for cache, _ in self.runner.paged_tensors()]
        if tensors[0].is_cuda:  # the copies are made before another thread sends them
            torch.cuda.current_stream().synchronize()
        self.link.send(dict(type="block", key=key.hex(), tokens=list(block.token_ids),
                            index=block.logical_index), tensors)
        self.num_sent_blocks += 1
        for _, blocks in self.wanted.values():
            blocks.pop(key, None)

    def finished(self, request_id):
        """Its prefill is done: the blocks it still lacks are hits its engine's cache served,
        cached there still (their request freed them this commit); send them, then done."""
        if request_id not in self.wanted:  # cancelled
            return
        front_id, blocks = self.wanted.pop(request_id)
        for key, (tokens, index) in blocks.items():
            block_id = self.allocator.prefix_cache.find_block(key, tokens, index)
            if block_id is not None:
                self.send_block(block_id, key)
        self.link.send(dict(type="done", request=front_id))

    def stats(self):
        return dict(num_sent_blocks=self.num_sent_blocks, num_wanted=len(self.wanted),
                    num_pending_sends=self.link.num_pending_sends())


@dataclass
class StagedBlock:  # a block received from the prefill process, waiting to be loaded
    tokens: tuple
    index: int
    tensors: list  # one per paged tensor, shaped as one block of it
    holders: set = field(default_factory=set)  # the front's requests that hold it


class KVConsumer(connectors.Connector):
    """The decode process's connector: blocks received from the prefill process wait here, held
    by the requests they were sent for, until those are done. A lookup finds them by key (their
    tokens and place confirm it, as the device's cache does); a hit is copied into a fresh
    device block at stage "in"."""
    enabled = True

    def __init__(self, allocator, link):
        self.allocator, self.link = allocator, link
        self.staged = {}  # key -> StagedBlock
        self.expected = {}  # front's request id -> keys still to come for it
        self.held = {}  # front's request id -> keys of the staged blocks it holds
        self.adopted = {}  # the engine's request id -> the front's
        self.num_received_blocks = self.num_dropped_blocks = 0

    def expect(self, request_id, keys):
        self.expected[request_id], self.held[request_id] = set(keys), set()

    def arrived(self, request_id):
        """No more blocks come for the request (done, or the peer is gone)."""
        self.expected.pop(request_id, None)

    def adopt(self, request_id, engine_id):
        """The front added the request to the engine, under engine_id."""
        self.adopted[engine_id] = request_id

    def stage(self, key, tokens, index, tensors):
        """A block arrived: kept for the requests that await it, dropped if none does (they
        were aborted)."""
        self.num_received_blocks += 1
        holders = [r for r, keys in self.expected.items() if key in keys]
        if not holders:
            self.num_dropped_blocks += 1
            return
        block = self.staged.setdefault(key, StagedBlock(tuple(tokens), index, tensors))
        for request_id in holders:
            block.holders.add(request_id)
            self.held[request_id].add(key)
            self.expected[request_id].discard(key)

    def drop(self, request_id):
        """Let go of everything held for the request."""
        self.expected.pop(request_id, None)
        for key in self.held.pop(request_id, ()):
            block = self.staged[key]
            block.holders.discard(request_id)
            if not block.holders:
                del self.staged[key]

    def finished(self, request_id):  # the engine's id
        if request_id in self.adopted:
            self.drop(self.adopted.pop(request_id))

    def find(self, key, seq, i):
        block, bs = self.staged.get(key), self.allocator.block_size
        if block is None or block.index != i:
            return None
        held = block.tokens == tuple(seq.token_ids[i * bs:(i + 1) * bs])
        return key.hex() if held else None  # as text: see KVProducer.save

    def transfer(self, copies, runner, stage):
        """At "in": each hit's staged K/V into its fresh block. The step holds every staged block
        it loads (a request holds them until it is done, and none is done within a step)."""
        if stage != "in":
            return
        for key, block_id in copies.reload:
            staged = self.staged[bytes.fromhex(key)]
            for (cache, _), tensor in zip(runner.paged_tensors(), staged.tensors):
                cache[:, :, block_id] = tensor.to(cache.device, non_blocking=True)

    def stats(self):
        return dict(num_staged_blocks=len(self.staged),
                    num_received_blocks=self.num_received_blocks,
                    num_dropped_blocks=self.num_dropped_blocks,
                    num_reloaded_blocks=self.num_reloaded_blocks,
                    num_awaited_requests=len(self.expected) + len(self.held))


def remote_connector(facts, link):
    """Engine(connector="remote", connector_config={"link": link}): the producer in the prefill
    process, the consumer in the decode process."""
    if tp.world_size > 1:
        raise ValueError("connector='remote' runs one engine per process: it does not combine "
                         "with tensor parallelism")
    return (KVProducer if link.role == "prefill" else KVConsumer)(facts.allocator, link)


# it serves with a peer process (a link): the properties over connectors in one process leave it
# out, and the disaggregation tests run it with its peer
remote_connector.needs_peer = True
connectors.CONNECTORS["remote"] = remote_connector


# -----------------------------------------------------------------------------
# The two processes' loops: the prefill worker, and the decode front that takes the requests


class PrefillWorker:
    """The prefill process: computes the prompts the front sends, until the front says bye or
    is gone. engine: an Engine with connector="remote" on this link."""

    def __init__(self, engine, link, max_failures=3):
        if not isinstance(engine.allocator.connector, KVProducer):
            raise ValueError("PrefillWorker: give its Engine connector='remote', "
                             "connector_config={'link': link}, on the prefill end")
        self.engine, self.link, self.producer = engine, link, engine.allocator.connector
        link.handshake(identity(engine, "prefill"))
        self.requests = {}  # the front's request id -> the engine's
        self.max_failures = max_failures  # failed steps in a row before it gives up its requests
        self.num_failed_steps = self.failures_in_a_row = 0

    def serve(self):
        """Serve until the link ends; then hold nothing. Returns the engine's stats."""
        while True:
            busy = self.engine.scheduler.has_unfinished()
            item = self.link.receive(timeout=0 if busy else 0.05)
            while item is not None:
                if item[0]["type"] in ("bye", "dead"):
                    return self.shut_down()
                self.handle(item[0])
                item = self.link.receive()
            if self.engine.scheduler.has_unfinished():
                self.step()

    def handle(self, message):
        if message["type"] == "prefill":
            self.prefill(message["request"], message["prompt"], message["have"])
        elif message["type"] == "abort":
            self.drop(message["request"])

    def prefill(self, front_id, prompt, have):
        try:
            request_id = self.engine.add_request(prompt, PREFILL_PARAMS)
        except ValueError as e:
            self.link.send(dict(type="rejected", request=front_id, error=str(e)))
            return
        self.requests[front_id] = request_id
        self.producer.want(request_id, front_id, prompt_blocks(self.engine, prompt, have))

    def step(self):
        """One engine step. A failed step was undone by the engine and runs again; after
        max_failures in a row, every request in prefill goes back to the front, rejected."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.num_failed_steps += 1
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.max_failures:
                for front_id in list(self.requests):
                    self.abort(front_id, f"prefill failed: {e!r}")
            return
        self.failures_in_a_row = 0
        finished = {o.request_id for o in outputs if o.finished}
        self.requests = {f: r for f, r in self.requests.items() if r not in finished}

    def abort(self, front_id, why="aborted in the prefill process"):
        """Give a request up here: the front computes it alone."""
        self.drop(front_id)
        self.link.send(dict(type="rejected", request=front_id, error=why))

    def drop(self, front_id):
        """Abort the request in the engine, if it is there still; nothing more is sent for it."""
        request_id = self.requests.pop(front_id, None)
        if request_id is not None:
            self.producer.cancel(request_id)
            self.engine.abort(request_id)

    def shut_down(self):
        for front_id in list(self.requests):
            self.drop(front_id)
        self.link.close()
        return self.engine.stats()


class DecodeFront:
    """The decode process, and the front requests come to: Engine's add_request, abort, step,
    generate and stats, over an engine with connector="remote" on this link, whose prompts the
    prefill process computes. Other attributes are the engine's."""

    def __init__(self, engine, link):
        if not isinstance(engine.allocator.connector, KVConsumer):
            raise ValueError("DecodeFront: give its Engine connector='remote', "
                             "connector_config={'link': link}, on the decode end")
        self.engine, self.link, self.consumer = engine, link, engine.allocator.connector
        link.handshake(identity(engine, "decode"))
        self.ids = itertools.count()
        self.prefilling = {}  # request id -> (prompt, params, priority), while it is prefilled
        self.engine_ids, self.front_ids = {}, {}  # once in the engine: one id to the other
        self.arrivals = {}  # request id -> when the front took it
        self.peer_error = None  # why the prefill process is gone, once it is

    def __getattr__(self, name):  # config, allocator, block_size, ...: the engine's
        if name == "engine":  # not set yet (a copy being made): no attribute, not a recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def add_request(self, prompt, params=None, priority=0):
        """Queue a request; returns its id. A prompt with a full block before its last token
        goes to the prefill process first; others (and all, once it is gone) to the engine."""
        params = params if params is not None else SamplingParams()
        prompt = self.engine.check_request(prompt, params, priority)
        request_id = next(self.ids)
        self.arrivals[request_id] = time.perf_counter()
        if self.peer_error is None and params.prompt_logprobs is None:  # those compute it all
            have = num_cached_blocks(self.engine, prompt)
            blocks = prompt_blocks(self.engine, prompt, have)
            if blocks:
                self.consumer.expect(request_id, blocks)
                self.link.send(dict(type="prefill", request=request_id, prompt=prompt,
                                    have=have))
                self.prefilling[request_id] = (prompt, params, priority)
                return request_id
        self.start(request_id, prompt, params, priority)
        return request_id

    def start(self, request_id, prompt, params, priority):
        """Add the request to the engine: its staged blocks are a prefix hit there."""
        engine_id = self.engine.add_request(prompt, params, priority)
        self.engine_ids[request_id], self.front_ids[engine_id] = engine_id, request_id
        self.consumer.adopt(request_id, engine_id)

    def step(self):
        """Take what the prefill process sent, then one engine step; a RequestOutput for each
        request that gained tokens, under the front's request ids."""
        running = self.engine.scheduler.has_unfinished()
        self.poll(timeout=0 if running or not self.prefilling else 0.05)
        if not self.engine.scheduler.has_unfinished():
            return []
        return [self.front_output(o) for o in self.engine.step()]

    def poll(self, timeout=0):
        """Handle every message that has come (waiting up to timeout seconds for the first)."""
        item = self.link.receive(timeout)
        while item is not None:
            self.handle(*item)
            item = self.link.receive()

    def handle(self, message, tensors):
        kind = message["type"]
        if kind == "block":
            self.consumer.stage(bytes.fromhex(message["key"]), message["tokens"],
                                message["index"], tensors)
        elif kind == "done" and message["request"] in self.prefilling:
            self.consumer.arrived(message["request"])
            self.start(message["request"], *self.prefilling.pop(message["request"]))
        elif kind == "rejected" and message["request"] in self.prefilling:
            self.consumer.drop(message["request"])  # computed here, from the first token
            self.start(message["request"], *self.prefilling.pop(message["request"]))
        elif kind in ("dead", "bye"):  # the prefill process is gone: serve on alone
            self.peer_error = message.get("error", "the prefill process closed the link")
            for request_id in list(self.prefilling):  # with the whole blocks that arrived
                self.consumer.arrived(request_id)
                self.start(request_id, *self.prefilling.pop(request_id))

    def front_output(self, output):
        request_id = self.front_ids[output.request_id]
        if output.finished:
            del self.front_ids[output.request_id], self.engine_ids[request_id]
        output.request_id = request_id
        # time to first token counts the prefill's time too
        output.metrics = replace(output.metrics, arrival_time=self.arrivals[request_id])
        if output.finished:
            del self.arrivals[request_id]
        return output

    def abort(self, request_id):
        """Drop a request wherever it is: in prefill (the prefill process is told), or in the
        engine; everything held for it on both sides is freed."""
        if request_id in self.prefilling:
            del self.prefilling[request_id]
            self.consumer.drop(request_id)
            if self.peer_error is None:
                self.link.send(dict(type="abort", request=request_id))
        elif request_id in self.engine_ids:
            engine_id = self.engine_ids.pop(request_id)
            del self.front_ids[engine_id]
            self.engine.abort(engine_id)  # its staged blocks go with it (consumer.finished)
        else:
            raise ValueError(f"no unfinished request with id {request_id}")
        del self.arrivals[request_id]

    def has_unfinished(self):
        return bool(self.prefilling) or self.engine.scheduler.has_unfinished()

    def generate(self, prompts, params=None):
        """Serve prompts to the end; one RequestOutput per prompt, in order."""
        if not isinstance(params, list):
            params = [params if params is not None else SamplingParams()] * len(prompts)
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        outputs = {}
        while any(i not in outputs for i in ids):
            outputs.update((o.request_id, o) for o in self.step() if o.finished)
        return [outputs[i] for i in ids]

    def stats(self):
        return self.engine.stats() | dict(num_prefilling=len(self.prefilling),
                                          num_pending_sends=self.link.num_pending_sends(),
                                          prefill_process_alive=self.peer_error is None)

    def close(self):
        """Tell the prefill process that no more requests come, and wait for its bye."""
        if self.peer_error is None:
            self.link.close()
