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

The CPU tier is the first connector here; a fork adds its own to CONNECTORS (RECIPES.md). This
file imports nothing of nanopaged: the engine hands each connector what it needs.
"""

from types import SimpleNamespace

import torch


class Connector:
    """The interface, and what a connector that keeps nothing does (the default: no connector).
    enabled says whether a lookup asks it at all. A handle is the connector's own name for a
    block it holds (the CPU tier's: a CPU block id)."""
    enabled = False

    def find(self, key, seq, i):
        """The handle of the block this connector holds for seq's block i under key (its tokens
        and place confirm it, as the device's cache confirms a hit), or None. In the plan."""
        return None

    def load(self, seq, i, handle, copies, group=0):
        """A hit: take a fresh device block (the allocator's take), add the copy of handle's
        K/V into it to copies.reload, and return it. In the plan."""
        raise NotImplementedError

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
        return {}


class CpuTier(Connector):
    """Cached prefixes the device gives up wait in CPU memory (vLLM's CPU offloading, SGLang's
    hierarchical cache): the CPU pool's prefix cache (nanopaged.SwapPool), which shares its
    blocks with swap space. The pool does the paging (offload, reload, its eviction order);
    this class puts it behind the connector interface and makes its copies."""
    enabled = True

    def __init__(self, pool):
        self.pool = pool  # a SwapPool whose prefix cache is enabled

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


# name -> a callable (engine's facts, **connector_config) -> a Connector; Engine(connector=name,
# connector_config={...}). facts: the allocator (its swap_pool, take), the KV block's shape and
# dtype, the model's identity, the tensor-parallel rank.
CONNECTORS = {"cpu": lambda facts: CpuTier(facts.allocator.swap_pool)}


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
    the engine knows (allocator, model, block_shape, dtype, device, rank, speculative,
    prefix_caching)."""
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
