"""
validation.py: settings and requests a user got wrong, as ValueErrors that name the field and
what it allows, raised before anything changes. nanopaged.py calls these where its main line
takes input (SamplingParams, Engine, add_request); a reader of the paged core can skip them.
They import what they check against from nanopaged when they run, since nanopaged imports this.
"""

import os

import torch
import torch.nn as nn

import kernel


def integer(x):  # bool is an int to Python, never to a user
    return isinstance(x, int) and not isinstance(x, bool)


def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_sampling_params(self):
    """SamplingParams.__post_init__: every field's type and range, or a ValueError naming
    it; stop_token_ids None (or a tuple) becomes a list."""
    stops = self.stop_token_ids
    stops = [] if stops is None else list(stops) if isinstance(stops, (list, tuple)) else stops
    checks = [("max_tokens", integer(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
              ("temperature", number(self.temperature) and self.temperature >= 0,
               "a number >= 0"),
              ("top_k", integer(self.top_k) and self.top_k >= 0, "an int >= 0 (0 disables it)"),
              ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
              ("seed", self.seed is None or integer(self.seed), "None or an int"),
              ("n", integer(self.n) and self.n >= 1, "an int >= 1"),
              ("beam_width", self.beam_width is None or integer(self.beam_width)
               and self.beam_width >= 1, "None or an int >= 1"),
              ("length_penalty", number(self.length_penalty), "a number"),
              ("stop_token_ids", isinstance(stops, list)
               and all(integer(t) and t >= 0 for t in stops), "None or a list of token ids"),
              ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
              ("logprobs", self.logprobs is None or integer(self.logprobs)
               and self.logprobs >= 0 and self.beam_width is None,
               "None or an int >= 0, without beam_width"),
              ("prompt_logprobs", self.prompt_logprobs is None
               or integer(self.prompt_logprobs) and self.prompt_logprobs >= 0,
               "None or an int >= 0")]
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(f"SamplingParams.{name} must be {allowed}, "
                             f"got {getattr(self, name)!r}")
    self.stop_token_ids = stops
    if self.n > 1 and self.beam_width is not None:
        raise ValueError("SamplingParams: choose n > 1 (parallel sampling) or beam_width "
                         "(beam search), not both")


def check_engine_settings(model, device, attention_backend, preemption_mode,
                          enable_prefix_caching, swap_space, kv_cache_dtype, scheduling_policy,
                          eviction_policy, **counts):
    """Raise ValueError for engine settings that cannot work, naming the setting and its range.
    Returns the torch.device, the attention backend and the KV cache's dtype, defaults filled in."""
    from nanopaged import EVICTION_POLICIES, SCHEDULING_POLICIES, GPTConfig
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"Engine: device must be like 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from None
    if not isinstance(model, nn.Module) or not isinstance(getattr(model, "config", None),
                                                          GPTConfig):
        raise ValueError(f"Engine: model must be a GPT (or a module with a GPTConfig as "
                         f".config), got {type(model).__name__}")
    # The Triton kernel on a GPU; on the CPU the torch path (the interpreter is ~1000x slower).
    attention_backend = attention_backend or ("triton" if device.type == "cuda" else "torch")
    config, dtype = model.config, next(model.parameters()).dtype
    for name, value in counts.items():  # None: it follows from the other settings
        least = 0 if name == "num_cpu_blocks" else 1  # no swap space is fine
        if value is not None and (type(value) is not int or value < least):
            raise ValueError(f"Engine: {name} must be an integer >= {least}, got {value!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"Engine: enable_prefix_caching must be True or False, "
                         f"got {enable_prefix_caching!r}")
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if (isinstance(swap_space, bool) or not isinstance(swap_space, (int, float))
            or not 0 <= swap_space <= 0.7 * host_gib):  # vLLM's limit: 70% of host memory
        raise ValueError(f"Engine: swap_space must be a number of GiB in [0, {0.7 * host_gib:.1f}]"
                         f" (70% of this host's {host_gib:.1f} GiB), got {swap_space!r}")
    for name, value, allowed in [("preemption_mode", preemption_mode, ("recompute", "swap")),
                                 ("scheduling_policy", scheduling_policy, SCHEDULING_POLICIES),
                                 ("eviction_policy", eviction_policy, EVICTION_POLICIES)]:
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"Engine: {name} must be one of {sorted(allowed)}, got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("Engine: device='cuda' but no CUDA GPU is available; use device='cpu'")
    if not dtype.is_floating_point:
        raise ValueError(f"Engine: the model's dtype {dtype} is not a floating-point type")
    if attention_backend not in ("triton", "torch"):
        raise ValueError(f"Engine: attention_backend must be 'triton' or 'torch', "
                         f"got {attention_backend!r}")
    supported = dtype in kernel.DTYPES and config.head_dim in kernel.HEAD_DIMS
    if attention_backend == "triton" and not supported:
        raise ValueError(f"Engine: the Triton kernel takes head sizes {kernel.HEAD_DIMS} in "
                         f"{kernel.DTYPES}; this model has head size {config.head_dim} in {dtype} "
                         f"(attention_backend='torch' takes any)")
    return device, attention_backend, kernel.check_kv_cache_dtype(kv_cache_dtype, dtype, device,
                                                                  attention_backend)


def check_request(prompt, params, priority, config, scheduler, allocator):
    """Engine.check_request: a prompt as a list of token ids, or a ValueError."""
    from nanopaged import SamplingParams, cdiv
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
            raise ValueError(f"a tensor prompt must be 1-D and hold integer token ids, "
                             f"got shape {tuple(prompt.shape)} of {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is a list or tuple of token ids or a 1-D integer tensor, "
                         f"got {type(prompt).__name__}")
    prompt_token_ids = list(prompt)
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
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < config.vocab_size:
            raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary "
                             f"[0, {config.vocab_size})")
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
    # Worst case: every sample ends up with private blocks for all its tokens.
    worst = params.num_seqs * cdiv(total, allocator.block_size)
    if worst > allocator.num_blocks:
        raise ValueError(f"the request may need {worst} KV blocks ({params.num_seqs} x {total} "
                         f"tokens at block_size {allocator.block_size}) but the pool has "
                         f"{allocator.num_blocks}: it could never run; use more num_blocks or "
                         f"shorter requests")
    return prompt_token_ids
