"""
parallel.py: tensor parallelism's primitives, Megatron-LM's split of each layer across ranks
(the PagedAttention paper, section 4.6), for the model in nanopaged.py.

Under torchrun, each of tensor_parallel_size ranks holds a slice of every attention and MLP
layer. A column-parallel layer (c_attn, c_fc, c_gate) keeps its rows of the weight: its query
heads, K/V heads or MLP columns. The row-parallel c_proj after it keeps the matching input
columns, so its output is a partial sum that one all-reduce completes. Embeddings, norms and
the LM head are replicated, and each rank caches the K/V of its own heads only. Rank 0's
scheduler decides and its sampled tokens are broadcast, so the ranks never diverge.
(Shoeybi et al., "Megatron-LM", 2019, section 3.) It imports nothing of nanopaged.
"""

import os
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

# This process's place in the group (1 without torchrun), and why the group was shut down, if it
# was. Every layer below reads it when it is built: init_tensor_parallel first, then the model.
tp = SimpleNamespace(rank=0, world_size=1, failed=None)
# The weight dim each layer splits along: 0, output rows (column-parallel); 1, input columns
# (row-parallel). c_attn is fused [q | k | v]: each of the three splits on its own.
TP_SPLIT_DIM = {"attn.c_attn": 0, "mlp.c_fc": 0, "mlp.c_gate": 0, "attn.c_proj": 1, "mlp.c_proj": 1}


def init_tensor_parallel(tensor_parallel_size, timeout_s=300, device=None):
    """Join the group torchrun launched: NCCL when the engines will run on GPUs (device, by default
    cuda where there is one), gloo on CPUs. Models built after this hold this rank's slice of
    each layer, and Engines the K/V of its heads."""
    size, launched = tensor_parallel_size, os.environ.get("WORLD_SIZE")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if launched is None and size > 1:
        raise ValueError(f"tensor_parallel_size={size} needs one process per rank: launch with "
                         f"torchrun --nproc-per-node {size} (RANK and WORLD_SIZE are not set)")
    if int(launched or 1) != size:
        raise ValueError(f"tensor_parallel_size={size} but torchrun launched {launched} "
                         f"processes: give torchrun --nproc-per-node {size}, or "
                         f"tensor_parallel_size={launched}")
    if size == 1:
        return
    if not dist.is_initialized():
        device_type = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # The timeout bounds every collective: when a rank dies, the others raise, not hang.
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    tp.rank, tp.world_size, tp.failed = dist.get_rank(), dist.get_world_size(), None


def all_reduce(x):
    """Complete a row-parallel layer's partial sums; every rank gets the same bits."""
    if tp.world_size > 1:
        dist.all_reduce(x)
    return x


def tp_min(n, device):
    """The least of the ranks' n: pools sized from each rank's own free memory would differ, and
    ranks with other block counts schedule differently (as vLLM, every rank takes the minimum)."""
    if tp.world_size == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def tp_shut_down(error):
    """After a step failed on this rank: close its connections, so a rank blocked in a collective
    with it fails at once instead of waiting out the timeout (gloo; on NCCL it waits)."""
    tp.failed = f"a step failed on rank {tp.rank}: {error!r}"
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(x):
    """Rank 0's x on every rank: rank 0 decides, the others follow."""
    if tp.world_size > 1:
        dist.broadcast(x, src=0)
    return x


def tp_split_dim(name):
    """The dim along which the whole-model tensor `name` splits; None: each rank holds it all."""
    layer, kind = name.rsplit(".", 1)
    dim = TP_SPLIT_DIM.get(".".join(layer.split(".")[-2:]))  # h.3.attn.c_attn -> attn.c_attn
    return None if tp.world_size == 1 or kind == "bias" and dim == 1 else dim


def tp_shard(name, tensor, config):
    """This rank's slice of one whole-model tensor. Loading calls it as it reads each tensor,
    so no rank ever holds the whole model on its device."""
    dim = tp_split_dim(name)
    if dim is None:  # replicated; but a row-parallel bias must enter the all-reduce's sum once
        row_bias = tp.world_size > 1 and name.endswith("c_proj.bias")
        return tensor * (tp.rank == 0) if row_bias else tensor
    parts = tensor.split(config.qkv_widths) if ".c_attn." in name else [tensor]
    return torch.cat([part.chunk(tp.world_size, dim)[tp.rank] for part in parts], dim)
