"""
checks.py: what a user sets, and the checks that refuse what cannot work: SamplingParams (each
field with what it allows and the metadata the CLI, the server and generation_config.json
read), Engine's settings, and each request. A setting or request a user got wrong is a
ValueError that names it and what it allows, raised before anything changes. A reader of the
paged core (nanopaged.py) can skip this file: the core imports it, and it imports nothing of
the core.
"""

import inspect
import math
import os
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn as nn

import kernel


def integer(x):
    """An int, or numpy's or torch's integer scalar (a user's code may hold one); never a bool,
    which is an int to Python but never to a user."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not (x.dtype == torch.bool or x.is_floating_point()
                                     or x.is_complex())
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def as_int(x):
    """An integer() as the Python int it holds; anything else as it is, for its check to refuse."""
    return int(x) if integer(x) else x


def number(x):
    return integer(x) or isinstance(x, float)


def setting(default, allowed, ok, beams=True, **about):
    """A dataclass field and what it allows: ok(value) says whether a value is allowed, allowed
    says which in words, for the ValueError that names the field (check_fields). beams=False: a
    sampling parameter that would change what beam search ranks and that it does not honour,
    refused beside beam_width. Beams draw nothing, so a warper (a field with hf_default:
    temperature, top_k, top_p, min_p), which shapes only a draw, is ignored by them, as by
    transformers' beam search. about: more metadata, for the layers that read the fields
    (SamplingParams says which)."""
    return field(default=default, metadata=dict(allowed=allowed, ok=ok, beams=beams, **about))


def int_setting(default, least, none=False, beams=True, **about):
    """A setting() that holds an int >= least, or None too if none."""
    def ok(x):
        return none if x is None else integer(x) and x >= least
    return setting(default, f"{'None or ' * none}an int >= {least}", ok, beams, **about)


def check_fields(obj):
    """Every field of a dataclass made with setting(), or a ValueError naming the first one
    whose value its check refuses. An integer scalar of numpy's or torch's becomes its int."""
    for f in fields(obj):
        given = getattr(obj, f.name)
        if (value := as_int(given)) is not given:
            setattr(obj, f.name, value)
        if "ok" in f.metadata and not f.metadata["ok"](value):
            raise ValueError(f"{type(obj).__name__}.{f.name} must be {f.metadata['allowed']}, "
                             f"got {value!r}")


def strings(x):  # a non-empty string, or a list of them
    return isinstance(x, str) and x or isinstance(x, (list, tuple)) and all(
        isinstance(s, str) and s for s in x)


@dataclass
class SamplingParams:
    """How a request is sampled: vLLM's names, defaults and ranges. A new parameter is a field
    here, with what it allows, and a step of the sampling pipeline (nanopaged.py, section 9).
    Its metadata is all the layers above need, so they list no field by name. flag="what it
    does" makes it a sampling flag (`python nanopaged.py --top-k`, and server.py's default for a
    request that leaves it out). hf="name" reads it from generation_config.json under
    transformers' name; hf_default marks a warper, which applies only with do_sample and takes
    transformers' default where the file is silent. http=False keeps it out of server.py's
    requests (every other field is a request field under its own name, as vLLM's extensions
    are)."""
    max_tokens: int = int_setting(16, 1, hf="max_new_tokens")
    temperature: float = setting(1.0, "a number >= 0", lambda x: number(x) and x >= 0,  # 0: greedy
                                 flag="sampling temperature, 0 for greedy", hf="temperature",
                                 hf_default=1.0)
    # keep the k likeliest tokens and ties with the k-th; 0: all
    top_k: int = int_setting(0, 0, flag="keep the k likeliest tokens, 0 for all", hf="top_k",
                             hf_default=50)
    # then of those, renormalised, the smallest set reaching top_p; then those at least min_p
    # times as likely as the likeliest
    top_p: float = setting(1.0, "a number in (0, 1]", lambda x: number(x) and 0 < x <= 1,
                           flag="nucleus sampling threshold", hf="top_p", hf_default=1.0)
    min_p: float = setting(0.0, "a number in [0, 1]", lambda x: number(x) and 0 <= x <= 1,
                           hf="min_p", hf_default=0.0,
                           flag="drop tokens less likely than this times the likeliest")
    # over prompt and output, a token's positive logit divided by it, a negative one multiplied
    repetition_penalty: float = setting(
        1.0, "a number > 0", lambda x: number(x) and 0 < x < math.inf, hf="repetition_penalty",
        flag="divide the positive logits of tokens seen in the prompt or output by this, "
        "multiply the negative ones")
    # over the output: minus presence once per token present, minus frequency times its count
    presence_penalty: float = setting(0.0, "a number in [-2, 2]",
                                      lambda x: number(x) and -2 <= x <= 2, beams=False,
                                      flag="subtract this from tokens generated already")
    frequency_penalty: float = setting(0.0, "a number in [-2, 2]",
                                       lambda x: number(x) and -2 <= x <= 2, beams=False,
                                       flag="subtract this times a generated token's count")
    # token t of sample i is drawn by a generator seeded by (seed, i, t); None: a random seed
    seed: int | None = setting(None, "None or an int", lambda x: x is None or integer(x))
    n: int = int_setting(1, 1)  # parallel samples of one prompt, sharing its blocks
    # beam search, this many beams
    beam_width: int | None = int_setting(None, 1, none=True, http=False)
    # beams rank by sum of log-probabilities / length ** length_penalty
    length_penalty: float = setting(1.0, "a number", number, http=False)
    # these tokens end a sample (None: none), and these strings, found in its text (a tokenizer
    # decodes it), which is cut before them unless include_stop_str_in_output
    stop_token_ids: list[int] | None = setting(
        None, "None or a list of token ids", lambda x: x is None or isinstance(
            x, (list, tuple)) and all(integer(t) and t >= 0 for t in x))
    stop: str | list[str] | None = setting(None, "None, a string or a list of non-empty strings",
                                           lambda x: x is None or x == [] or strings(x),
                                           beams=False)
    include_stop_str_in_output: bool = setting(False, "True or False",
                                               lambda x: isinstance(x, bool))
    ignore_eos: bool = setting(False, "True or False", lambda x: isinstance(x, bool))
    # no end token or stop string ends a sample before these
    min_tokens: int = int_setting(0, 0, hf="min_new_tokens",
                                  flag="tokens before an end token or a stop string may stop")
    # per generated token, the k likeliest tokens' log-probabilities and the drawn one's, under
    # the model (before penalties, temperature and filters), as vLLM returns them; and the same
    # for each prompt token after the first
    logprobs: int | None = int_setting(None, 0, none=True, beams=False)
    prompt_logprobs: int | None = int_setting(None, 0, none=True)
    # callables (prompt_token_ids, output_token_ids, logits (V,)) -> logits, run first (vLLM's)
    logits_processors: list | None = setting(
        None, "None or a list of callables", lambda x: x is None or isinstance(
            x, (list, tuple)) and all(map(callable, x)), beams=False, http=False)
    # what step() returns of the request, as vLLM's RequestOutputKind: "cumulative", each sample
    # as it stands; "delta", what each sample gained since the last output, so that a stream
    # costs what it adds, not what it holds; "final_only", one output, at the end (generate's)
    output_kind: str = setting("cumulative", "'cumulative', 'delta' or 'final_only'",
                               lambda x: x in ("cumulative", "delta", "final_only"), http=False)

    def __post_init__(self):
        check_fields(self)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.logits_processors = list(self.logits_processors or [])
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be at most "
                             f"max_tokens ({self.max_tokens})")
        if self.n > 1 and self.beam_width is not None:
            raise ValueError("SamplingParams: choose n > 1 (parallel sampling) or beam_width "
                             "(beam search), not both")
        if self.output_kind == "delta" and self.beam_width is not None:
            raise ValueError("SamplingParams.output_kind 'delta' does not apply to beam search "
                             "(the best beams change, so no output extends the one before): "
                             "use 'cumulative' or 'final_only'")
        # beams rank by (penalised) log-probabilities, as transformers' beam search, which
        # draws nothing: the warpers do not apply to them, the fields it lacks are refused
        for f in fields(self):
            if (self.beam_width is not None and not f.metadata.get("beams", True)
                    and getattr(self, f.name) not in (f.default, [])):
                raise ValueError(f"SamplingParams.{f.name} does not apply to beam search: leave "
                                 "it unset with beam_width")

    @property
    def num_seqs(self):
        """How many sequences this request can run at once."""
        return self.beam_width or self.n


def check_engine_settings(model, config_cls, device, attention_backend, preemption_mode,
                          enable_prefix_caching, swap_space, kv_cache_dtype, choices, **counts):
    """Engine's settings, or a ValueError naming the one that cannot work and its range. choices:
    {setting: (its value, the registry it names an entry of)}, the core's registries (scheduling
    and eviction policies, read policies). Returns the torch.device, the kernel.AttentionBackend
    and the KV cache's dtype, defaults filled in."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"Engine: device must be like 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from None
    if not isinstance(model, nn.Module) or not isinstance(getattr(model, "config", None),
                                                          config_cls):
        raise ValueError(f"Engine: model must be a GPT (or a module with a GPTConfig as "
                         f".config), got {type(model).__name__}")
    # The Triton kernel on a GPU; on the CPU the torch path (the interpreter is ~1000x slower).
    attention_backend = attention_backend or ("triton" if device.type == "cuda" else "torch")
    for name, value in counts.items():  # None: it follows from the other settings
        least = 0 if name in ("num_cpu_blocks", "cpu_cache_bytes") else 1  # none is fine
        if value is not None and (not integer(value) or value < least):
            raise ValueError(f"Engine: {name} must be an integer >= {least}, got {value!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"Engine: enable_prefix_caching must be True or False, "
                         f"got {enable_prefix_caching!r}")
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if not number(swap_space) or not 0 <= swap_space <= 0.7 * host_gib:  # vLLM's: 70% of host
        raise ValueError(f"Engine: swap_space must be a number of GiB in [0, {0.7 * host_gib:.1f}]"
                         f" (70% of this host's {host_gib:.1f} GiB), got {swap_space!r}")
    if counts["cpu_cache_bytes"] and not enable_prefix_caching:
        raise ValueError("Engine: cpu_cache_bytes is a second tier of the prefix cache: it needs "
                         "enable_prefix_caching=True")
    choices = dict(choices, preemption_mode=(preemption_mode, ("recompute", "swap")),
                   attention_backend=(attention_backend, kernel.ATTENTION_BACKENDS))
    for name, (value, allowed) in choices.items():
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"Engine: {name} must be one of {sorted(allowed)}, got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("Engine: device='cuda' but no CUDA GPU is available; use device='cpu'")
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        raise ValueError(f"Engine: the model's dtype {dtype} is not a floating-point type")
    cache_dtype = kernel.check_kv_cache_dtype(kv_cache_dtype, dtype, device, attention_backend)
    backend = kernel.ATTENTION_BACKENDS[attention_backend]
    why = backend.unsupported(dtype, model.config.head_dim, cache_dtype)
    for kind in {group.kind for group in model.config.kv_cache_groups}:
        if why or kind.mask == kernel.FULL_ATTENTION:
            continue
        if "mask" not in inspect.signature(backend.attend).parameters:
            why = f"its attend() takes no mask, and this model has {kind.name} layers ({kind})"
        elif reason := backend.unsupported_mask(kind.mask):
            why = f"this model has {kind.name} layers ({kind}): {reason}"
    if why:
        raise ValueError(f"Engine: attention_backend={attention_backend!r} cannot run this "
                         f"model: {why} (attention_backend='torch' takes any)")
    return device, backend, cache_dtype


def check_request(prompt, params, priority, config, scheduler, has_tokenizer=False):
    """Engine.check_request: a prompt as a list of token ids, or a ValueError."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.stop and not has_tokenizer:
        raise ValueError(f"stop={params.stop!r}: stop strings are found in the decoded text, so "
                         "the engine needs a tokenizer: Engine(model, tokenizer=...)")
    if not integer(priority):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if isinstance(prompt, (torch.Tensor, np.ndarray)):  # numpy's arrays as torch's tensors
        integral = (prompt.dtype.kind in "iu" if isinstance(prompt, np.ndarray) else not (
            prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool))
        if prompt.ndim != 1 or not integral:
            raise ValueError(f"a tensor prompt must be 1-D and hold integer token ids, "
                             f"got shape {tuple(prompt.shape)} of {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is a list or tuple of token ids or a 1-D integer tensor, "
                         f"got {type(prompt).__name__}")
    prompt_token_ids = [token_id(t) for t in prompt]  # plain ints; None: not a token id
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > config.vocab_size:
            raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary "
                             f"({config.vocab_size})")
    for t in params.stop_token_ids:
        if t >= config.vocab_size:
            raise ValueError(f"stop token id {t} is outside the vocabulary "
                             f"[0, {config.vocab_size})")
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token id")
    for i, t in enumerate(prompt_token_ids):
        if t is None or not 0 <= t < config.vocab_size:
            raise ValueError(f"prompt token {i} is {prompt[i]!r}, " + (
                "not an integer token id" if t is None else
                f"outside the vocabulary [0, {config.vocab_size})"))
    total = len(prompt_token_ids) + params.max_tokens
    if total > config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                         f"({params.max_tokens}) = {total} exceeds the model's max_seq_len "
                         f"({config.max_seq_len})")
    if params.beam_width is not None and scheduler.num_lookahead_slots:
        raise ValueError("beam search does not run with speculative decoding: use an Engine "
                         "without speculative_config for beam_width requests")
    # a request's sequences decode together, so they must fit in one step
    limit = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    if params.num_seqs > limit:
        raise ValueError(f"n/beam_width ({params.num_seqs}) exceeds max_num_seqs and "
                         f"max_num_batched_tokens (at most {limit} sequences of one request)")
    # Worst case: every sample ends up with private blocks for all the tokens its kinds keep,
    # computing them one at a time: so the request runs alone at least, in chunks that fit
    a = scheduler.allocator
    worst = params.num_seqs * a.max_blocks(total, 1)
    if worst > a.num_blocks:
        raise ValueError(f"the request may need {worst} KV blocks ({params.num_seqs} x {total} "
                         f"tokens at block_size {a.block_size}, by its attention kinds) but the "
                         f"pool has {a.num_blocks}: it could never run; use more num_blocks or "
                         f"shorter requests")
    return prompt_token_ids


def token_id(t):
    """A prompt's token id as a plain int: an integer() (numpy's and torch's too) or a 0-d
    integer array (as numpy indexes them); None for anything else, a bool too."""
    if isinstance(t, np.ndarray) and t.ndim == 0:
        t = t[()]  # the array's numpy scalar
    return int(t) if integer(t) else None
