"""
quest.py: Quest's query-aware page selection, a read policy (read_policy.READ_POLICIES["quest"]).

    Tang, Zhao, Zhu, Xiao, Kasikci, Han, "Quest: Query-Aware Sparsity for Efficient
    Long-Context LLM Inference", ICML 2024.  https://arxiv.org/abs/2406.10774

Decoding a long context reads the whole KV cache every step, yet a query's softmax is made by
few keys. Quest keeps, per page (a KV block) and KV head, the elementwise min and max of the
page's keys; for a query q the page's score

    sum over channels i of max(q_i * min_i, q_i * max_i)

is at least q.k for every key k of the page (each term is the largest q_i * k_i can be over
the page's box), so a page whose score is low holds no key with a high score. Each decode step
reads only the top pages by score within a token budget, always with the page being written.
Its first layers read every page: their attention is the least sparse (the paper keeps two
dense). Prefill reads every page.

The rest is paging, and lives in nanopaged.py: the key bounds beside the KV cache, updated as
keys are stored and moved with their block (ModelRunner). read_policy.py carries the selection
to the attention backend as shorter per-head tables (attend_selected).
"""

from dataclasses import dataclass

import torch

from checks import as_int, integer


def page_scores(q, key_bounds, block_tables):
    """Quest's criticality of each block of each sequence for its query, per KV head: the upper
    bound on q.k over the block's keys. Grouped-query attention: a KV head's score is the largest
    of its query heads' bounds, which bounds q.k for every query head of the group, so no head
    loses a block whose keys it would weigh most. (A sum of the heads' bounds bounds the sum of
    their scores, not each; SGLang's Quest scores the group's mean query, a bound on the mean.)
    q (S, nh, hs); key_bounds (2, num_blocks, nkv, hs); block_tables (S, W) -> (S, nkv, W), in
    fp32 (fp64 for fp64); entries of -1 score as block 0 (select masks them)."""
    S, n_head, head_dim = q.shape
    n_kv_head = key_bounds.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lo, hi = key_bounds[:, block_tables.clamp(min=0).long()].to(acc)          # (S, W, nkv, hs)
    q = q.to(acc).view(S, 1, n_kv_head, n_head // n_kv_head, head_dim)     # (S, 1, nkv, G, hs)
    bound = torch.maximum(q * lo[:, :, :, None], q * hi[:, :, :, None]).sum(-1)  # (S, W, nkv, G)
    return bound.amax(-1).transpose(1, 2)                                        # (S, nkv, W)


def top_blocks(scores, num_blocks, pages):
    """Per (sequence, KV head), the pages blocks of highest score among its num_blocks, its last
    (the one being written) always among them; ties go to the earlier block. scores (S, nkv, W),
    num_blocks (S,) -> keep, bool (S, nkv, W)."""
    pos = torch.arange(scores.shape[-1], device=scores.device)                       # (W,)
    held = (pos < num_blocks[:, None])[:, None]                                      # (S, 1, W)
    last = (pos == num_blocks[:, None] - 1)[:, None]                                 # (S, 1, W)
    scores = scores.masked_fill(~held, -torch.inf).masked_fill(last, torch.inf)
    # a stable sort keeps the earlier of equal scores first
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices    # (S, nkv, W)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(-1, order[..., :pages], True)
    return keep & held


@dataclass
class Quest:
    """The read policy: its settings are Engine's read_policy_config. A budget below one block
    reads the block being written alone."""
    token_budget: int = 1024  # tokens a decode reads per layer and KV head (the paper: 256-4096)
    dense_layers: int = 2  # the first layers read every block (the paper's two)
    needs_key_bounds = True  # a class attribute, not a setting: the model runner keeps them

    def __post_init__(self):
        for name, least in (("token_budget", 1), ("dense_layers", 0)):
            value = as_int(getattr(self, name))  # numpy's and torch's ints as ints
            setattr(self, name, value)
            if not integer(value) or value < least:
                raise ValueError(f"read_policy_config: Quest's {name} must be an int >= {least}, "
                                 f"got {value!r}")

    def select(self, layer, q, key_bounds, block_tables, seq_lens, block_size):
        """The blocks each decoding sequence's KV heads read at this layer (the read policy's
        interface, read_policy.READ_POLICIES): the budget's worth of pages of highest score, at
        least the one being written; None for a dense layer."""
        if layer < self.dense_layers:
            return None
        pages = max(1, self.token_budget // block_size)
        num_blocks = (seq_lens.long() + block_size - 1) // block_size                 # (S,)
        return top_blocks(page_scores(q, key_bounds, block_tables), num_blocks, pages)
