"""
read_policy.py: which blocks a decode query reads, a choice made when serving (READ_POLICIES),
apart from the attention kind, which is the model's exact semantics.

"all" is no policy: every block the kind keeps is read, exactly, by the same call as without
read policies (the default). A policy that reads fewer blocks, such as Quest (quest.py), may
rank a block by its key bounds: the elementwise min and max of its keys per KV head (Quest's
page metadata). The bounds are paging, so they live in nanopaged.py: each layer updates them as
it stores K, and the model runner moves them with their block. They bound the keys the block
holds: a failed step's keys, past what is computed, may widen them until its retry writes the
same keys (or the block is handed out again), which keeps every bound.

This file holds the rest: the registry, the selection as the kernels read it (a shorter block
table per sequence and KV head, so every decode is still one gather through a table), and the
attention of a full-attention layer under a policy. It imports nothing of nanopaged.
"""

from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import quest


def read_all():
    """No policy: every block is read, exactly, and no key bounds are kept (the default)."""
    return None


# name -> a callable of the policy's settings (Engine's read_policy_config) that returns None
# (no policy: read every block) or a policy: an object with needs_key_bounds (whether the model
# runner keeps them), and select(layer, q (S, nh, hs), key_bounds (2, num_blocks, nkv, hs) or
# None, block_tables (S, W), seq_lens (S,), block_size) -> None (read every block at this
# layer) or keep, bool (S, nkv, W), or (S, 1, W) for all heads alike: the blocks each decoding
# sequence's KV heads read, given its one new token's query q. Only full-attention layers ask.
# A fork adds its own (RECIPES.md: a read policy).
READ_POLICIES = {"all": read_all, "quest": quest.Quest}


def selected_tables(keep, block_tables, seq_lens, block_size):
    """A read policy's selection as the kernel reads it: per (sequence, KV head) a table of the
    blocks it reads, in order, -1 after them, and their tokens. The last block, the one being
    written, is always read (whatever the policy says: the new token sees itself), last in its
    table, so the count is the other blocks' full ones and the last's. keep (S, nkv, W) bool;
    block_tables (S, W) int32; seq_lens (S,) int32 -> tables (S, nkv, W') int32, lens (S, nkv)
    int32, W' the most blocks a head reads."""
    S, nkv, W = keep.shape
    num_blocks = (seq_lens.long() + block_size - 1) // block_size                    # (S,)
    pos = torch.arange(W, device=keep.device)                                        # (W,)
    held = (pos < num_blocks[:, None])[:, None]                                      # (S, 1, W)
    last = (pos == num_blocks[:, None] - 1)[:, None]                                 # (S, 1, W)
    keep = (keep & held) | last                                                   # (S, nkv, W)
    count = keep.sum(-1)                                                            # (S, nkv)
    # the kept blocks first, in their order (a stable sort of "not kept")
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices    # (S, nkv, W)
    width = int(count.max())
    tables = block_tables[:, None].expand(S, nkv, W).gather(-1, order[..., :width])
    tables = torch.where(pos[:width] < count[..., None], tables, -1)          # (S, nkv, W')
    last_len = seq_lens.long() - (num_blocks - 1) * block_size                       # (S,)
    lens = (count - 1) * block_size + last_len[:, None]                             # (S, nkv)
    return tables.to(torch.int32), lens.to(torch.int32)


def decode_split(group):
    """A step's sequences as a read policy sees them, worked out by its first layer and kept in
    the group's scratch: those with one new token (decodes, whose reads a policy may thin) and
    their rows of q, and a GroupBatch of the others (prefill chunks, speculative verification),
    which read every block. None: the step has no decode."""
    if "decodes" in group.scratch:
        return group.scratch["decodes"]
    cu = group.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]                                                        # (S,)
    one = q_lens == 1
    split = None
    if one.any():
        owner = torch.repeat_interleave(torch.arange(len(q_lens), device=cu.device), q_lens)
        others = (~one).nonzero().flatten()                                          # (S',)
        other_rows = (~one[owner]).nonzero().flatten()                               # (T',)
        rest = None if not len(others) else replace(
            group, block_tables=group.block_tables[others],
            slot_mapping=group.slot_mapping[other_rows], seq_lens=group.seq_lens[others],
            cu_seqlens_q=F.pad(q_lens[others].cumsum(0), (1, 0)).to(torch.int32), scratch={})
        split = SimpleNamespace(decodes=one.nonzero().flatten(), rows=cu[:-1][one],
                                others=rest, other_rows=other_rows)
    group.scratch["decodes"] = split
    return split


def attend_selected(attn, q, kv, batch):
    """Full attention under a read policy, for layer attn (its layer index, n_kv_head, scale):
    each decoding sequence's KV heads read the blocks the policy selects for them, through
    per-head tables (a backend whose per_head_tables says it reads them; the engine refuses a
    policy without one); every other sequence reads all its blocks. Where the policy reads every
    block (a dense layer, a step without decodes, or contexts within its budget), this is the
    exact call "all" makes, so those tokens are the same bit for bit. kv: the layer's LayerKV."""
    k_cache, v_cache, group, scales = kv.k_cache, kv.v_cache, kv.group, kv.scales
    attend, block_size, scale = batch.backend.attend, k_cache.shape[1], attn.scale
    split = decode_split(group)
    if split is None:
        return attend(q, k_cache, v_cache, group, scale, **scales)
    block_tables = group.block_tables[split.decodes]                            # (S, W)
    seq_lens = group.seq_lens[split.decodes]                                    # (S,)
    keep = batch.read_policy.select(attn.layer, q[split.rows], kv.key_bounds, block_tables,
                                    seq_lens, block_size)        # (S, nkv or 1, W) or None
    if keep is None:
        return attend(q, k_cache, v_cache, group, scale, **scales)
    keep = keep.expand(-1, attn.n_kv_head, -1)                                  # (S, nkv, W)
    tables, lens = selected_tables(keep, block_tables, seq_lens, block_size)
    if torch.equal(lens, seq_lens[:, None].expand_as(lens)):  # every block kept
        return attend(q, k_cache, v_cache, group, scale, **scales)
    thinned = replace(group, block_tables=tables, slot_mapping=group.slot_mapping[split.rows],
                      seq_lens=lens, max_q_len=1, scratch={},
                      cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32,
                                                device=q.device))
    y = torch.empty_like(q)                                                      # (T, nh, hs)
    y[split.rows] = attend(q[split.rows], k_cache, v_cache, thinned, scale, **scales)
    if split.others is not None:
        rows = split.other_rows
        y[rows] = attend(q[rows], k_cache, v_cache, split.others, scale, **scales)
    return y


def make_read_policy(name, config, backend, proposer=None):
    """Engine(read_policy=name, read_policy_config=config): READ_POLICIES[name](**config) (None
    for "all": every block), or a ValueError naming what cannot work. A policy that thins what
    decodes read needs a backend that reads per-head block tables
    (kernel.AttentionBackend.per_head_tables), and no speculative decoding: its verification
    reads every block where a decode would read a selection, which would change the output."""
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"Engine: read_policy_config must be a dict of read_policy "
                         f"{name!r}'s settings, or None, got {config!r}")
    try:
        policy = READ_POLICIES[name](**(config or {}))
    except TypeError as e:  # a setting the policy does not take
        raise ValueError(f"Engine: read_policy_config {config!r} does not fit read_policy "
                         f"{name!r}: {e}") from None
    if policy is not None and not getattr(backend, "per_head_tables", False):
        raise ValueError(f"Engine: read_policy={name!r} reads a selection of blocks per KV head, "
                         f"which this attention_backend does not take (per-head block tables)")
    if policy is not None and proposer is not None:
        raise ValueError(f"Engine: read_policy={name!r} does not run with speculative_config: "
                         f"verifying proposals reads every block, where a decode would read a "
                         f"selection, so speculation would change the output")
    return policy
