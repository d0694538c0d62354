"""
train.py: train the byte-level demo model that nanopaged serves, in minutes on a CPU.

A small GPT-2 (nanopaged.GPT) learns to write Python documentation from the text every
Python install ships: the interpreter's own help topics, `pydoc_data.topics.topics`
(~465 KB). Its tokens are the bytes of the UTF-8 text, so it needs no tokenizer and
its vocabulary is 256. At the end it writes a Hugging Face GPT-2 folder (config.json +
fp16 model.safetensors) that `GPT.from_pretrained` and transformers both load.

    python train.py                                      # models/pydoc-gpt: ~11 min, 2 cores
    python train.py --max_iters 20 --out_dir /tmp/smoke  # a smoke test, under a minute

The topics differ a little between Python versions, and float sums between machines, so
a rerun elsewhere gives a close but not bitwise-equal checkpoint; config.json records
the command, the versions and the losses it reached.
"""

import argparse
import json
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

from nanopaged import GPT, GPTConfig

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--out_dir", default="models/pydoc-gpt",
                    help="where the Hugging Face GPT-2 folder is written")
# The CPU sets the size. On 2 shared cores the loss falls with the number of windows and
# bytes seen more than with the width: 8 windows a step sat near bigram loss (~2.5 nats/byte)
# for 400+ steps at width 128 and 256 alike, 32 windows broke through by step 500, and
# width 256 (3.3M parameters) costs ~4x the time of width 128 per step.
parser.add_argument("--n_layer", type=int, default=4, help="transformer blocks")
parser.add_argument("--n_head", type=int, default=4,
                    help="attention heads (head_dim = n_embd / n_head = 32)")
parser.add_argument("--n_embd", type=int, default=128,
                    help="model width; 4/4/128 is ~0.86M parameters")
parser.add_argument("--max_seq_len", type=int, default=256,
                    help="context length in bytes; every window is this long, so every position "
                    "is trained")
parser.add_argument("--batch_size", type=int, default=32,
                    help="windows per step; many short windows learn faster than a few long ones")
parser.add_argument("--max_iters", type=int, default=1500,
                    help="optimizer steps: 32 x 256 x 1500 = 12M bytes, ~29 passes; val loss "
                    "levels off by 1250")
parser.add_argument("--lr", type=float, default=4e-3,
                    help="peak learning rate; beat 2e-3 at this batch size, while 4e-3 lost at "
                    "batch 8")
parser.add_argument("--min_lr", type=float, default=4e-4,
                    help="learning rate at the end of the cosine decay")
parser.add_argument("--warmup_iters", type=int, default=50,
                    help="linear warm-up steps, so Adam's early noisy moments do no harm")
parser.add_argument("--weight_decay", type=float, default=0.1,
                    help="AdamW decay on weight matrices only")
parser.add_argument("--grad_clip", type=float, default=1.0,
                    help="clip the global gradient norm to this")
parser.add_argument("--eval_interval", type=int, default=250,
                    help="report train/val loss every this many steps")
parser.add_argument("--eval_iters", type=int, default=4, help="batches per loss estimate")
parser.add_argument("--val_fraction", type=float, default=0.1,
                    help="the tail of each topic held out for validation")
parser.add_argument("--seed", type=int, default=1337,
                    help="seeds the weights and the windows, for a reproducible run")


def load_pydoc_bytes(val_fraction):
    """The help topics as bytes, split into (train, val) uint8 tensors."""
    from pydoc_data.topics import topics
    train, val = [], []
    for name in sorted(topics):  # dict order is an accident of how the file was generated
        # each topic ends in "\n": a blank line between topics
        text = (topics[name] + "\n").encode("utf-8")
        # hold out the tail of every topic, not the tail of the whole: sorted by name, the
        # last 10% would be only the types* topics through yield
        cut = int(len(text) * (1 - val_fraction))
        train.append(text[:cut])
        val.append(text[cut:])
    return [torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
            for parts in (train, val)]


def get_batch(data, batch_size, seq_len, generator):
    """Random windows: x (B, T) bytes, y (B, T) the byte after each."""
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + seq_len] for s in starts]).long()          # (B, T)
    y = torch.stack([data[s + 1:s + 1 + seq_len] for s in starts]).long()  # (B, T)
    return x, y


def lr_at(it, args):
    """Linear warm-up, then cosine decay from lr to min_lr over the remaining steps."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    progress = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, splits, args):
    """Mean cross-entropy in nats per byte on each split, over the same windows every time
    (a fixed generator), so successive reports differ only because the model did."""
    model.eval()
    losses = {}
    for name, data in splits.items():
        generator = torch.Generator().manual_seed(0)
        total = 0.0
        for _ in range(args.eval_iters):
            x, y = get_batch(data, args.batch_size, args.max_seq_len, generator)
            total += F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
        losses[name] = total / args.eval_iters
    model.train()
    return losses


def configure_optimizer(model, args):
    """AdamW that decays the weight matrices (and the tied embedding), not biases or LayerNorms."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied lm_head appears once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # beta2 0.99: few steps, small batches
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99))


@torch.no_grad()
def sample(model, prompt, max_new_tokens, temperature=1.0, generator=None):
    """The plain contiguous loop: rerun the whole context for every new byte. temperature 0 is
    greedy."""
    idx = torch.tensor([list(prompt)], dtype=torch.long)  # (1, T)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.config.max_seq_len:])[:, -1, :]  # (1, V)
        if temperature == 0:
            next_byte = logits.argmax(-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)                       # (1, V)
            next_byte = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, next_byte], dim=1)
    return bytes(idx[0].tolist())


def save_hf_checkpoint(model, path, extra):
    """Write model as a Hugging Face GPT-2 folder: config.json and an fp16 model.safetensors
    with GPT-2's tensor names and layout. `extra` goes into config.json under "nanopaged"."""
    from safetensors.torch import save_file
    cfg = model.config
    assert cfg.n_kv_head == cfg.n_head, (
        "GPT-2 has no GQA: its c_attn packs n_head query, key and value heads")
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # GPT-2's 4 * n_embd
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # trained without dropout
        "tie_word_embeddings": True,
        "bos_token_id": None,  # bytes have no end-of-text token
        "eos_token_id": None,
        "nanopaged": extra,
    }
    # GPT-2 keeps its linear layers as Conv1D, whose weight is (in, out): nn.Linear's transposed
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    tensors = {}
    # lm_head.weight is wte.weight, so it is skipped as a duplicate
    for name, param in model.named_parameters():
        tensor = param.detach().t() if name.endswith(conv1d) else param.detach()
        tensors[name] = tensor.to(torch.float16).contiguous()
    assert "lm_head.weight" not in tensors and "transformer.wte.weight" in tensors
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def main():
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    train_data, val_data = load_pydoc_bytes(args.val_fraction)
    print(f"data: {len(train_data):,} train bytes, {len(val_data):,} val bytes "
          f"(Python {sys.version.split()[0]} help topics)")
    config = GPTConfig(vocab_size=256, max_seq_len=args.max_seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    optimizer = configure_optimizer(model, args)
    # the training windows, separate from eval's
    generator = torch.Generator().manual_seed(args.seed)
    splits = {"train": train_data, "val": val_data}

    t0 = time.time()
    for it in range(args.max_iters + 1):
        if it % args.eval_interval == 0 or it == args.max_iters:
            losses = estimate_loss(model, splits, args)
            print(f"step {it:5d}: train {losses['train']:.4f}, val {losses['val']:.4f} nats/byte, "
                  f"{time.time() - t0:6.0f} s", flush=True)
        if it == args.max_iters:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, args)
        x, y = get_batch(train_data, args.batch_size, args.max_seq_len, generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B*T, V) vs (B*T,)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
    wall_s = time.time() - t0

    model.eval()
    extra = {"train_loss": round(losses["train"], 4), "val_loss": round(losses["val"], 4),
             "loss_unit": "nats per byte",
             "data": "pydoc_data.topics.topics, sorted by name, bytes of UTF-8",
             "command": "python " + shlex.join(sys.argv), "train_seconds": round(wall_s),
             "python": sys.version.split()[0], "torch": torch.__version__}
    save_hf_checkpoint(model, args.out_dir, extra)
    # the folder must give back the model we trained, up to fp16 rounding of the weights
    reloaded = GPT.from_pretrained(args.out_dir)
    x, _ = get_batch(val_data, 2, args.max_seq_len, torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(x)
        diff = (reference - reloaded(x)).abs().max().item()
    assert diff < 0.01 * reference.abs().max().item(), (
        f"reloaded checkpoint differs from the trained model by {diff}")
    size = os.path.getsize(os.path.join(args.out_dir, "model.safetensors"))
    print(f"wrote {args.out_dir} ({size / 1e6:.1f} MB), {wall_s / 60:.1f} min; reloaded logits "
          f"within {diff:.4f}")
    for prompt in (b"The ", b"def "):
        text = sample(reloaded, prompt, 200, temperature=0.8,
                      generator=torch.Generator().manual_seed(0))
        print(f"--- sample, temperature 0.8, prompt {prompt!r}\n{text.decode('utf-8', 'replace')}")


if __name__ == "__main__":
    main()
