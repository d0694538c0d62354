"""
checkpoints: GPT.from_pretrained's reader of local Hugging Face folders (gpt2, llama, mistral,
qwen2), without transformers or a network. A checkpoint either loads with logits equal to
transformers' or is refused with a ValueError naming the config.json field it would get wrong.
Also what else a folder says about serving it: its dtype, its sampling defaults
(generation_config.json) and its chat template. It sits beside the core: nanopaged.py imports
it, and it imports nothing of nanopaged (GPT.from_pretrained hands it the class to fill, and
the class its config class).
"""

import dataclasses
import datetime
import json
import os

import torch

import checks
from parallel import tp, tp_shard, tp_split_dim

# the attention kinds (nanopaged.ATTENTION_KINDS) transformers' Mistral (Ministral) and Qwen2
# layers run: their masks know no other layer_types
LAYER_TYPES = ("full_attention", "sliding_attention")

# Checkpoints: GPT-2's names are ours less "transformer."; the Llama family's are below, per layer
# "transformer.h.N." -> "model.layers.N."; three names are q, k, v, stacked in that order in c_attn.
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_LLAMA_NAMES = {
    "transformer.wte.weight": ["model.embed_tokens.weight"],
    "ln_1.weight": ["input_layernorm.weight"],
    "attn.c_attn.weight": [f"self_attn.{x}_proj.weight" for x in "qkv"],
    "attn.c_attn.bias": [f"self_attn.{x}_proj.bias" for x in "qkv"],  # Qwen2
    "attn.c_proj.weight": ["self_attn.o_proj.weight"],
    "ln_2.weight": ["post_attention_layernorm.weight"],
    "mlp.c_fc.weight": ["mlp.up_proj.weight"],
    "mlp.c_gate.weight": ["mlp.gate_proj.weight"],
    "mlp.c_proj.weight": ["mlp.down_proj.weight"],
    "transformer.ln_f.weight": ["model.norm.weight"],
    "lm_head.weight": ["lm_head.weight"],  # untied heads only
}


def hf_names(name, model_type):
    if model_type == "gpt2":
        return [name.removeprefix("transformer.")]
    if name.startswith("transformer.h."):
        layer, _, rest = name.removeprefix("transformer.h.").partition(".")
        return [f"model.layers.{layer}.{key}" for key in HF_LLAMA_NAMES[rest]]
    return HF_LLAMA_NAMES[name]


def read_json(path, name):
    """The folder's JSON file name, or None if the folder has none."""
    if not os.path.isfile(os.path.join(path, name)):
        return None
    with open(os.path.join(path, name), encoding="utf-8") as f:
        return json.load(f)


def read_hf_config(path):
    hf = read_json(path, "config.json")
    if hf is None:
        raise ValueError(f"no checkpoint at {path!r}: config.json not found")
    if hf.get("model_type") not in ("gpt2", "llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: config.json has model_type={hf.get('model_type')!r}; "
                         "this GPT loads 'gpt2', 'llama', 'mistral' and 'qwen2'")
    # Every end-of-text id of config.json and generation_config.json ends a sample (as in vLLM):
    # Llama 3.1 Instruct lists three in each, Qwen2.5 Instruct adds one in generation_config.json.
    eos = set()
    for config in (hf, read_json(path, "generation_config.json") or {}):
        ids = config.get("eos_token_id")
        eos |= {ids} if isinstance(ids, int) else set(ids or ())
    eos = sorted(t for t in eos if type(t) is int and 0 <= t < hf["vocab_size"])  # in the vocab
    hf["eos_token_id"] = eos or None
    return hf


def reject(path, hf, key, default, supported, where=""):
    if hf.get(key, default) not in supported:
        raise ValueError(f"{path}: config.json sets {where}{key}={hf[key]!r}; this model takes "
                         "only " + " or ".join(map(repr, supported)))


def gpt2_config(config_cls, hf, path):
    # reorder_and_upcast_attn computes the scores in fp32, as the kernels always do: no change
    reject(path, hf, "activation_function", "gelu_new", config_cls.activations)
    reject(path, hf, "scale_attn_by_inverse_layer_idx", False, (False,))  # a scale per layer
    reject(path, hf, "add_cross_attention", False, (False,))  # the decoder of an encoder-decoder
    return config_cls(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                      n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                      layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                      eos_token_id=hf["eos_token_id"], intermediate_size=hf.get("n_inner"),
                      activation=hf.get("activation_function", "gelu_new"),
                      attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
                      tie_word_embeddings=hf.get("tie_word_embeddings", True))


def llama_config(config_cls, hf, path):
    # Published folders have rope_theta and rope_scaling; transformers 5 writes rope_parameters.
    # A top-level partial_rotary_factor counts too: transformers moves it into rope_parameters.
    rope = {"rope_theta": hf.get("rope_theta", 10000.0),
            "partial_rotary_factor": hf.get("partial_rotary_factor", 1.0),
            **(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    for key, supported in [("rope_type", ("default", "llama3")), ("partial_rotary_factor", (1.0,))]:
        reject(path, rope, key, supported[0], supported, where="rope_scaling / rope_parameters ")
    reject(path, hf, "hidden_act", "silu", config_cls.activations)
    # Only Llama reads attention_bias (q, k, v and o) and mlp_bias; pretraining_tp changes nothing
    biases = ("attention_bias", "mlp_bias") if hf["model_type"] == "llama" else ()
    for key in biases:
        reject(path, hf, key, False, (False,))
    max_seq_len = hf.get("max_position_embeddings", 2048)
    rope.setdefault("original_max_position_embeddings", max_seq_len)  # as transformers, for llama3
    sliding_window, layer_types = windows(hf, path)
    return config_cls(
        vocab_size=hf["vocab_size"], max_seq_len=max_seq_len, n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_kv_head=hf.get("num_key_value_heads"),
        n_embd=hf["hidden_size"], head_dim=hf.get("head_dim"), eos_token_id=hf["eos_token_id"],
        layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6), rope_theta=rope["rope_theta"],
        rope_scaling=rope if rope["rope_type"] == "llama3" else None, norm="rmsnorm", mlp="swiglu",
        intermediate_size=hf["intermediate_size"], bias=False, qkv_bias=hf["model_type"] == "qwen2",
        tie_word_embeddings=hf.get("tie_word_embeddings", False),  # the default of all three
        activation=hf.get("hidden_act", "silu"), sliding_window=sliding_window,
        layer_types=layer_types)


def windows(hf, path):
    """The sliding window and each layer's attention (GPTConfig's sliding_window, layer_types) as
    transformers 5 reads them. Llama has none (transformers ignores the keys there). Mistral
    windows every layer by sliding_window (4096 where config.json is silent, null for none);
    with layer_types, transformers reads the folder as Ministral, whose layers follow them.
    Qwen2's window is off unless use_sliding_window (then sliding_window, 4096 if silent); its
    layer_types, or where there are none, full attention for the first max_window_layers layers
    (28 if silent) and the window for the rest."""
    kind, n = hf["model_type"], hf["num_hidden_layers"]
    if kind == "llama":
        return None, None
    window = hf.get("sliding_window", 4096)
    if kind == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"{path}: config.json sets sliding_window={window!r}; a window is a "
                         "number of positions >= 1 (or null for none)")
    types = hf.get("layer_types")
    if kind == "mistral" and types is None:
        return window, None  # every layer windowed, or none
    if kind == "mistral" and window is None:
        raise ValueError(f"{path}: config.json sets layer_types and sliding_window=None; "
                         "transformers reads it as Ministral, whose masks need a window")
    if types is None:
        first = hf.get("max_window_layers", 28)
        if window is not None and type(first) is not int:
            raise ValueError(f"{path}: config.json sets max_window_layers={first!r}; "
                             "a number of layers")
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or any(t not in LAYER_TYPES for t in types)):
        raise ValueError(f"{path}: config.json sets layer_types={types!r}; this model takes "
                         f"{n} (num_hidden_layers) of {LAYER_TYPES}")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{path}: config.json sets layer_types with sliding_attention layers, but "
                         f"no window (use_sliding_window={hf.get('use_sliding_window', False)!r}, "
                         f"sliding_window={hf.get('sliding_window')!r})")
    return window, types


def read_hf_weights(path):
    """Every tensor of model.safetensors, of the shards its index lists, or of pytorch_model.bin,
    memory-mapped: each is read as it is copied (or sliced, under tensor parallelism)."""
    from safetensors.torch import load_file
    sd, index = {}, read_json(path, "model.safetensors.index.json")
    if index is not None:
        for shard in sorted(set(index["weight_map"].values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise ValueError(f"{path}: {shard!r}, a shard the index lists, is missing")
            sd.update(load_file(os.path.join(path, shard)))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        sd = load_file(os.path.join(path, "model.safetensors"))
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        sd = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                        weights_only=True, mmap=True)
    else:
        raise ValueError(f"{path}: no weights (model.safetensors, its shards or pytorch_model.bin)")
    return {k.removeprefix("transformer."): v for k, v in sd.items()}  # GPT-2 saves both ways


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def choose_dtype(dtype, hf, device, bf16_supported=None):
    """The torch dtype to load a checkpoint in (a pure function of its arguments, hence
    testable without a GPU). dtype: "auto", "float32", "float16", "bfloat16" or a floating torch
    dtype; hf: config.json as a dict; device: where the model will run; bf16_supported: whether
    that GPU multiplies bf16 (None: ask torch). "auto" is the checkpoint's own dtype (torch_dtype,
    or dtype as transformers 5 writes it) on a GPU, as vLLM, with vLLM's fallback to float16 on a
    GPU without bf16 (before Ampere); float32 on a CPU, where most chips multiply bf16 and fp16
    slowly (no matrix units for them) and the saved bytes buy nothing."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError("dtype must be 'auto', " + ", ".join(map(repr, DTYPES))
                         + f" or a floating torch dtype, got {dtype!r}")
    device = torch.device(device)
    if device.type == "cuda" and bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        field = "torch_dtype" if "torch_dtype" in hf else "dtype"
        dtype = hf.get(field) or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"config.json sets {field}={dtype!r}; dtype='auto' takes "
                             + " or ".join(map(repr, DTYPES)) + " (pass dtype= to choose)")
        if dtype == "bfloat16" and not bf16_supported:
            return torch.float16
    elif dtype == "bfloat16" and device.type == "cuda" and not bf16_supported:
        raise ValueError(f"dtype='bfloat16' but this GPU ({device}) has no bf16 arithmetic; "
                         "use dtype='float16' or 'float32'")
    return DTYPES[dtype]


def load_pretrained(cls, path, dtype="auto", device=None):
    """A cls (nanopaged.GPT, whose config_class is GPTConfig) with the weights of the folder at
    path, each tensor checked against the shape config.json implies and sliced for this rank as
    it is read, in the dtype choose_dtype picks for the device (None: a GPU if there is one, as
    Engine's default)."""
    hf = read_hf_config(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dtype = choose_dtype(dtype, hf, device)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    make_config = gpt2_config if hf["model_type"] == "gpt2" else llama_config
    config = make_config(cls.config_class, hf, path)
    model, sd = cls(config), read_hf_weights(path)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is wte, listed once
            keys = hf_names(name, hf["model_type"])
            # GPT-2 stores linear layers as Conv1D, weight (in, out): nn.Linear's transposed
            transpose = hf["model_type"] == "gpt2" and name.endswith(GPT2_CONV1D)
            whole = list(param.shape)  # the whole model's: all ranks' slices together
            if (dim := tp_split_dim(name)) is not None:
                whole[dim] *= tp.world_size
            shapes = [(n, *whole[1:]) for n in config.qkv_widths] if len(keys) == 3 else [whole]
            for key, shape in zip(keys, shapes):
                expected = tuple(shape[::-1] if transpose else shape)
                if key not in sd:
                    raise ValueError(f"{path}: tensor {key!r} is missing from the checkpoint")
                if sd[key].shape != expected:
                    raise ValueError(f"{path}: tensor {key!r} has shape {tuple(sd[key].shape)},"
                                     f" config.json implies {tuple(expected)}")
            tensors = [sd[key].t() if transpose else sd[key] for key in keys]
            tensor = torch.cat(tensors) if len(keys) == 3 else tensors[0]  # q, k, v stacked
            param.copy_(tp_shard(name, tensor, config))
    return model.to(dtype)


def generation_defaults(path):
    """The sampling defaults the folder's generation_config.json sets, as SamplingParams keyword
    arguments: SamplingParams(**generation_defaults(path), max_tokens=...). Read as transformers'
    generate() reads the file, for every SamplingParams field whose metadata names its key (hf):
    logits processors (repetition_penalty, min_new_tokens as min_tokens) and max_new_tokens
    where the file sets them; without do_sample=true it is greedy (temperature 0); with it, the
    warpers (the fields with an hf_default: temperature, top_k, top_p, min_p), each transformers'
    default where the file is silent. {} without the file (a folder that says nothing leaves
    SamplingParams' own defaults, vLLM's). Its end ids need nothing here: they join config.json's
    in model.config.eos_token_id when the model loads (read_hf_config)."""
    gen = read_json(path, "generation_config.json")
    if gen is None:
        return {}
    sampled = gen.get("do_sample") is True
    params = {} if sampled else {"temperature": 0.0}
    for f in dataclasses.fields(checks.SamplingParams):
        key = f.metadata.get("hf")
        if key is None:
            continue
        if "hf_default" not in f.metadata:  # a processor: whether or not it samples
            if gen.get(key) is not None:
                params[f.name] = gen[key]
        elif sampled:  # a warper
            params[f.name] = f.metadata["hf_default"] if gen.get(key) is None else gen[key]
    return params


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # what transformers hands a chat template as variables


def render_chat(path, messages, add_generation_prompt=True):
    """The text of messages ([{"role": "user", "content": ...}, ...]) through the folder's chat
    template (chat_template.jinja, or chat_template in tokenizer_config.json), rendered as
    transformers' apply_chat_template(messages, tokenize=False) renders it: jinja2's sandbox with
    trim_blocks and lstrip_blocks, raise_exception, strftime_now, a tojson that leaves non-ASCII
    alone, and the special tokens of tokenizer_config.json as variables. Tokenize it without
    adding special tokens: the template wrote them. A ValueError without jinja2 or a template."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("a chat template needs jinja2: pip install jinja2") from None
    config = read_json(path, "tokenizer_config.json") or {}
    template = config.get("chat_template")
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):  # the newer place wins
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # several named templates: the default one
        template = {t["name"]: t["template"] for t in template}.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{path}: no chat template (chat_template.jinja, or chat_template in "
                         "tokenizer_config.json); this model takes raw prompts")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3.1
    # older files store a special token as an AddedToken's dict: its text is "content"
    tokens = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()
              if k in SPECIAL_TOKENS and v is not None}
    try:
        return env.from_string(template).render(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt,
                                                **tokens)
    except jinja2.TemplateError as e:  # a syntax error, or the template's own raise_exception
        raise ValueError(f"{path}: chat template: {e}") from None
