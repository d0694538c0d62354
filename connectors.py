"""
connectors.py: where blocks go when they leave an engine's device pool, and where they come
back from. One interface, keyed by the prefix cache's chained block keys (vLLM's KV
connectors, with far fewer methods), and the connectors registered by name (CONNECTORS).

A connector is a lower tier of the prefix cache. A request's prefix hit walks the device's
cache first, then the connector's (find); a block found there is copied into a fresh device
block (load). A cached block the device gives up (evicted), and a block as it is published,
are offered to the connector, which may keep a copy (save). Those are the plan's calls: each
adds the copies it asks for to the plan's BlockCopies (offload: device block -> the
connector's handle; reload: handle -> device block), and changes nothing a failed step's
Journal cannot undo. The run makes the copies (transfer), in three stages: "out" before any
block of the step is copied (it reads the device blocks it saves, before anything writes
them), "in" after the swaps (it writes the blocks it loads, and lands its saves), and
"computed" after the forward (the blocks the step computed and published). A transfer that
fails fails the step: the Journal undoes its plan, and no block a partial load touched keeps
a prefix. finished(request_id) says a request is done (finished or aborted), so a connector
holds nothing for it afterwards.

The CPU tier is the first connector here, the disk store the second; a fork adds its own to
CONNECTORS (RECIPES.md). This file imports nothing of nanopaged: the engine hands each connector
what it needs.
"""

import hashlib
import json
import os
import tempfile
from types import SimpleNamespace
from typing import NamedTuple

import torch


class Connector:
    """The interface, and what a connector that keeps nothing does (the default: no connector).
    enabled says whether a lookup asks it at all. A handle is the connector's own name for a
    block it holds (the CPU tier's: a CPU block id). A connector that serves hits keeps the
    engine's allocator as self.allocator (facts.allocator), for load's take."""
    enabled = False
    num_reloaded_blocks = 0  # hits copied into device blocks (load, journaled)

    def find(self, key, seq, i):
        """The handle of the block this connector holds for seq's block i under key (its tokens
        and place confirm it, as the device's cache confirms a hit), or None. In the plan."""
        return None

    def load(self, seq, i, handle, copies, group=0):
        """A hit: take a fresh device block (the allocator's take), add the copy of handle's
        K/V into it to copies.reload, count it, and return it. In the plan."""
        block_id = self.allocator.take(copies)
        copies.reload.append((handle, block_id))
        self.allocator.journal.set(self, "num_reloaded_blocks", self.num_reloaded_blocks + 1)
        return block_id

    def save(self, block, copies, evicted):
        """The device gives up block, a cached PhysicalBlock (evicted=True), or publishes it,
        its K/V computed in this step (evicted=False): add a copy to copies.offload if this
        connector keeps one. In the plan."""

    def share(self, handle):
        """Hold a hit while other blocks are taken (an eviction must not give it up)."""

    def release(self, handle):
        """Let go of a hit that share() held."""

    def transfer(self, copies, runner, stage):
        """Make this connector's copies of a step (copies.offload, copies.reload) on runner's
        paged tensors (ModelRunner.paged_tensors), at stage "out", "in" or "computed" (the
        module's docstring says when). Raises if a copy fails: the step fails with it."""

    def finished(self, request_id):
        """The request is done (finished or aborted): hold nothing for it."""

    def stats(self):
        """Counts for Engine.stats(), by name: num_offloaded_blocks and num_reloaded_blocks, the
        blocks copied to it and back; num_staged_blocks, the blocks it holds for requests in
        flight (none once they are done)."""
        return dict(num_reloaded_blocks=self.num_reloaded_blocks)


class CpuTier(Connector):
    """Cached prefixes the device gives up wait in CPU memory (vLLM's CPU offloading, SGLang's
    hierarchical cache): the CPU pool's prefix cache (nanopaged.SwapPool), which shares its
    blocks with swap space. The pool does the paging (offload, reload, its eviction order);
    this class puts it behind the connector interface and makes its copies."""
    enabled = True

    def __init__(self, pool):
        self.pool = pool  # a SwapPool whose prefix cache is enabled
        # the K/V of a step's offloads, read at "out" and landed at "in" (a step that fails
        # between the two leaves it to the next step's "out", which replaces it)
        self.staged = None

    def find(self, key, seq, i):
        cpu_block = self.pool.prefix_cache.find(key, seq, i)
        # a CPU block taken in this step (a swap-out's) will be written: no hit can read it
        return None if cpu_block in self.pool.taken else cpu_block

    def load(self, seq, i, handle, copies, group=0):
        return self.pool.reload(seq, i, handle, copies, group)

    def save(self, block, copies, evicted):
        if evicted:  # what the device still holds, it serves itself
            copies.offload += self.pool.offload(block)

    def share(self, handle):
        self.pool.share(handle)

    def release(self, handle):
        self.pool.release(handle)

    def transfer(self, copies, runner, stage):
        """The tier's copies, in the CPU pool's memory, for each paged tensor: at "out" its
        offloads read their device blocks (a swap-in or copy-on-write may write them next); at
        "in", after the swaps, its reloads read their CPU blocks and then its offloads land (a
        swap-in read its CPU block, which an offload may now overwrite, before)."""
        if stage == "out":
            self.staged = [cache[:, :, [b for b, _ in copies.offload]].movedim(2, 0).contiguous()
                           for cache, _ in runner.paged_tensors()] if copies.offload else None
        elif stage == "in":
            for t, (cache, cpu_cache) in enumerate(runner.paged_tensors()):
                if copies.reload:  # (n, a, b, ...), each block by one direct non_blocking copy
                    loaded = torch.stack([cpu_cache[b].to(runner.device, non_blocking=True)
                                          for b, _ in copies.reload])
                    cache[:, :, [b for _, b in copies.reload]] = loaded.movedim(0, 2)
                if copies.offload:
                    for block, (_, cpu_block) in zip(self.staged[t], copies.offload):
                        cpu_cache[cpu_block].copy_(block, non_blocking=True)
            self.staged = None

    def stats(self):
        pool = self.pool
        return dict(num_cpu_cached_blocks=sum(b.hash is not None for b in pool.blocks),
                    num_offloaded_blocks=pool.num_offloaded_blocks,
                    num_reloaded_blocks=pool.num_reloaded_blocks)


# -- the disk store: a prefix survives the engine
#
# One file per block key and tensor-parallel rank, written as the block is published (write-
# through) and read back on a hit, by this engine or by one started later over the same folder.
# A file is a magic line, the header's length (4 bytes, little-endian), the header (JSON), then
# the payload: the block's bytes of each paged tensor in turn (the K/V, then the key bounds if
# the read policy keeps them). The header says whose K/V they are: the model (model_identity),
# the cache's dtype, the block's shape, the rank and the shape of each paged tensor's block; the
# block's key, tokens and place in its sequence (a key collision must never share K/V); and the
# payload's length and SHA-256. A file is used only if all of it matches. Written to a temporary
# file and renamed over the final name (os.replace), so a crash leaves a whole file or none.

DISK_MAGIC = b"nanopaged KV block 1\n"


def model_identity(model):
    """A hash of model's config and a fingerprint of its weights: each tensor's name, shape,
    dtype and 64 of its elements spread over it. Cheap (no pass over the weights), the same in
    every process that loads the same weights, different for other weights or another dtype."""
    digest = hashlib.sha256(repr(model.config).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().flatten()
        sample = flat[::max(1, flat.numel() // 64)][:64].contiguous().cpu()
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskBlock(NamedTuple):  # a published block to write: its key, tokens and place
    key: bytes
    token_ids: tuple
    logical_index: int


class Staged(NamedTuple):  # a file read and verified in this step's plan, for its "in" stage
    token_ids: tuple
    logical_index: int
    tensors: list  # per paged tensor, the block's payload on the CPU


class DiskStore(Connector):
    """Cached prefixes in files, one per block key (LMCache's and SGLang HiCache's disk tiers):
    every block is written once, as it is published, so a prefix outlives its device block, the
    engine and the process. A hit reads its file in the plan (find: the header must match this
    engine and the block, the payload its checksum) and keeps the payload until the step's "in"
    stage copies it into a fresh device block. A file that does not match is a miss, never K/V:
    another engine's is refused and left alone (this store replaces it when it publishes that
    key); an unreadable, torn or corrupt one is deleted."""
    enabled = True

    def __init__(self, facts, path=None):
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ValueError(f"Engine: connector='disk' needs connector_config={{'path': "
                             f"FOLDER}}, an existing folder, got path={path!r}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"Engine: connector='disk' cannot write into path={path!r}")
        if facts.world_size > 1:  # each rank's own files: a hit on one rank, a miss on another
            raise ValueError("Engine: connector='disk' does not run under tensor parallelism: "
                             "the ranks' files could differ, and nothing makes the ranks agree "
                             "on a hit (run it with tensor_parallel_size=1)")
        if keeps_kv_of_its_own(facts.speculative, facts.block_shape[2], facts.dtype):
            raise ValueError("Engine: connector='disk' saves the target model's K/V only: it "
                             "does not run beside a speculative method with a draft model's "
                             "cache (speculative_config's method 'ngram' keeps none)")
        self.path, self.allocator = os.fspath(path), facts.allocator
        self.block_size, self.rank = facts.block_shape[2], facts.rank
        self.layout = [(tuple(shape), dtype) for shape, dtype in facts.paged_blocks]
        # what a file's header must say to be this engine's, as JSON reads it back
        self.engine = json.loads(json.dumps(dict(
            model=model_identity(facts.model), kv_dtype=str(facts.dtype),
            block_shape=list(facts.block_shape), rank=facts.rank,
            layout=[[list(shape), str(dtype)] for shape, dtype in self.layout])))
        self.staged = {}  # key -> Staged, from find until the step's "in" stage
        self.on_disk = set()  # keys whose file this store wrote or verified: not written again
        self.refused = {}  # key -> (mtime, size) of a file of another engine's: not read again
        self.num_saved_blocks = self.num_refused_files = 0

    def file(self, key):
        return os.path.join(self.path, f"{key.hex()}.rank{self.rank}.kv")

    def find(self, key, seq, i):
        bs = self.block_size
        tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
        staged = self.staged.get(key)
        if staged is not None:  # read in this plan already (lookups repeat)
            return key if staged[:2] == (tokens, i) else None
        try:
            stat = os.stat(self.file(key))
        except FileNotFoundError:
            self.on_disk.discard(key)  # deleted by someone else: written again when published
            return None
        if self.refused.get(key) == (stat.st_mtime_ns, stat.st_size):
            return None
        tensors = self.read(key, tokens, i)
        if tensors is None:
            self.refused[key] = (stat.st_mtime_ns, stat.st_size)
            self.num_refused_files += 1
            return None
        self.staged[key] = Staged(tokens, i, tensors)
        self.on_disk.add(key)
        return key

    def read(self, key, tokens, i):
        """The payload of key's file as tensors, one block of each paged tensor, if the file is
        whole and its header says this engine wrote it for this block; else None (a corrupt file
        deleted)."""
        path = self.file(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            header, payload = parse_block_file(data)
        except (OSError, ValueError):  # unreadable, torn or not a block file
            remove(path)
            return None
        if any(header.get(name) != value for name, value in self.engine.items()):
            return None  # another model's, dtype's, block shape's or rank's
        if (header.get("key"), header.get("token_ids"), header.get("logical_index")) != \
                (key.hex(), list(tokens), i):
            return None  # another block's: a collision, or a file renamed
        if len(payload) != header.get("payload_bytes") or \
                hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            remove(path)  # ours, but its payload is not what was written
            return None
        tensors, start = [], 0
        for shape, dtype in self.layout:
            n = torch.Size(shape).numel() * dtype.itemsize
            block = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=start)
            tensors.append(block.view(dtype).view(shape))
            start += n
        return tensors

    def save(self, block, copies, evicted):
        """Write-through: a block is written when it is published, once per key, so an evicted
        one is on disk already."""
        if evicted or block.hash in self.on_disk:
            return
        if any(handle.key == block.hash for _, handle in copies.offload):  # twins, one step
            return
        handle = DiskBlock(block.hash, tuple(block.token_ids), block.logical_index)
        copies.offload.append((block.block_id, handle))

    def transfer(self, copies, runner, stage):
        """At "in", the staged payloads of the step's hits into their device blocks; at
        "computed", the blocks the step published into their files. Nothing is staged after
        "in", whether it copied or raised."""
        if stage == "in":
            try:
                self.copy_in(copies.reload, runner)
            finally:
                self.staged = {}
        elif stage == "computed" and copies.offload:
            self.write(copies.offload, runner)

    def copy_in(self, reload, runner):
        if not reload:
            return
        blocks = [block_id for _, block_id in reload]
        for t, (cache, _) in enumerate(runner.paged_tensors()):
            loaded = torch.stack([self.staged[key].tensors[t] for key, _ in reload])
            cache[:, :, blocks] = loaded.to(cache.device).movedim(0, 2)  # (n, a, b, ...) in

    def write(self, offload, runner):
        """Each block to the file of its key, unless a file of this engine's holds it already."""
        todo = [(block_id, handle) for block_id, handle in offload
                if handle.key not in self.on_disk and not self.holds(handle.key)]
        if not todo:
            return
        blocks = [block_id for block_id, _ in todo]
        # per paged tensor, the blocks' bytes, block-major: (n, a, b, ...)
        data = [cache[:, :, blocks].movedim(2, 0).contiguous().cpu()
                for cache, _ in runner.paged_tensors()]
        for n, (_, handle) in enumerate(todo):
            payload = b"".join(t[n].view(torch.uint8).numpy().tobytes() for t in data)
            self.write_file(handle, payload)
            self.on_disk.add(handle.key)
            self.num_saved_blocks += 1

    def holds(self, key):
        """Whether key's file is there and its header is this engine's (a file written by an
        engine before this one: the block is on disk)."""
        try:
            with open(self.file(key), "rb") as f:
                head = f.read(len(DISK_MAGIC) + 4)
                header, _ = parse_block_file(head + f.read(int.from_bytes(head[-4:], "little")),
                                             whole=False)
        except (OSError, ValueError):
            return False
        return all(header.get(name) == value for name, value in self.engine.items())

    def write_file(self, handle, payload):
        """One block's file, whole or not at all under its name: written beside it, renamed."""
        header = dict(self.engine, key=handle.key.hex(), token_ids=list(handle.token_ids),
                      logical_index=handle.logical_index, payload_bytes=len(payload),
                      sha256=hashlib.sha256(payload).hexdigest())
        encoded = json.dumps(header).encode()
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(DISK_MAGIC + len(encoded).to_bytes(4, "little") + encoded + payload)
            os.replace(tmp, self.file(handle.key))
        except BaseException:
            remove(tmp)
            raise
        self.refused.pop(handle.key, None)  # the file it refused is this one's now

    def finished(self, request_id):
        self.staged = {}  # a step that failed in its plan left its reads here

    def stats(self):
        return dict(num_offloaded_blocks=self.num_saved_blocks,
                    num_reloaded_blocks=self.num_reloaded_blocks,
                    num_refused_disk_files=self.num_refused_files)


def keeps_kv_of_its_own(proposer, block_size, dtype):
    """Whether a speculative proposer (None: none) keeps K/V in each block beside the target's
    (a draft model's cache). A proposer that cannot say is taken to keep some."""
    if not proposer:
        return False
    bytes_per_block = getattr(proposer, "bytes_per_block", None)
    return bytes_per_block is None or bytes_per_block(block_size, dtype) > 0


def parse_block_file(data, whole=True):
    """A block file's header (a dict) and payload, or a ValueError if it is not one (whole: the
    payload is there too, not only the header)."""
    start = len(DISK_MAGIC) + 4
    if len(data) < start or not data.startswith(DISK_MAGIC):
        raise ValueError("not a block file")
    end = start + int.from_bytes(data[start - 4:start], "little")
    if len(data) < end:
        raise ValueError("torn header")
    header = json.loads(data[start:end])  # a json.JSONDecodeError is a ValueError
    if not isinstance(header, dict):
        raise ValueError("not a block file")
    return header, bytearray(data[end:]) if whole else b""


def remove(path):
    """Delete a file if it is there (another process may have replaced or deleted it)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# name -> a callable (engine's facts, **connector_config) -> a Connector; Engine(connector=name,
# connector_config={...}). facts: the allocator (its swap_pool, take, journal), the KV block's
# shape and dtype, each paged tensor's block (shape, dtype), the model (its identity), the
# tensor-parallel rank and world size, the speculative proposer (or None). An entry whose
# needs_peer is True serves only with a peer process (disaggregation.py's "remote").
CONNECTORS = {"cpu": lambda facts: CpuTier(facts.allocator.swap_pool), "disk": DiskStore}


def cpu_cache_bytes(name, config, shorthand):
    """The CPU tier's bytes: connector_config's cpu_cache_bytes with connector="cpu", else
    Engine's cpu_cache_bytes (its shorthand, 0 for none). One connector at a time."""
    if name != "cpu":
        if shorthand and name is not None:
            raise ValueError(f"Engine: cpu_cache_bytes is the CPU tier, a connector: it does not "
                             f"run beside connector={name!r}")
        return shorthand
    if not isinstance(config, dict) or set(config) != {"cpu_cache_bytes"}:
        raise ValueError(f"Engine: connector='cpu' takes connector_config={{'cpu_cache_bytes': "
                         f"N}} (N > 0 bytes of CPU memory), got {config!r}")
    if shorthand and shorthand != config["cpu_cache_bytes"]:
        raise ValueError("Engine: give the CPU tier's size once: cpu_cache_bytes or "
                         "connector_config['cpu_cache_bytes']")
    size = config["cpu_cache_bytes"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"Engine: connector_config['cpu_cache_bytes'] must be an int >= 1, "
                         f"got {size!r}")
    return size


def make_connector(name, config, **facts):
    """CONNECTORS[name](facts, **config), or a ValueError naming what cannot work. facts: what
    the engine knows (allocator, model, block_shape, dtype, paged_blocks, device, rank,
    world_size, speculative: the proposer or None, prefix_caching)."""
    if not isinstance(name, str) or name not in CONNECTORS:
        raise ValueError(f"Engine: connector must be one of {sorted(CONNECTORS)}, got {name!r}")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"Engine: connector_config must be a dict of connector {name!r}'s "
                         f"settings, or None, got {config!r}")
    if not facts["prefix_caching"]:
        raise ValueError(f"Engine: connector={name!r} is keyed by the prefix cache's block keys: "
                         f"it needs enable_prefix_caching=True")
    try:
        return CONNECTORS[name](SimpleNamespace(**facts), **(config or {}))
    except TypeError as e:  # a setting the connector does not take
        raise ValueError(f"Engine: connector_config {config!r} does not fit connector "
                         f"{name!r}: {e}") from None
