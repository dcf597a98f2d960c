"""GPT-2 weights from a Hugging Face directory (config.json + model.safetensors, the way
`save_pretrained` writes gpt2, gpt2-medium, -large and -xl), as model.py's parameters.

Read with NumPy only (no safetensors or torch package), so this file needs just jax/numpy.
"""

import json
import math
import os

import numpy as np

from model import GPTConfig


SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
                      "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def read_safetensors(path) -> dict:
    """{name: NumPy array} of a .safetensors file; BF16 comes back as float32.

    The format: 8 bytes little-endian header length, a JSON header {name: {"dtype", "shape",
    "data_offsets": [begin, end]}} with offsets counted from the end of the header, then
    the raw little-endian bytes. The file is memory-mapped, not read whole.
    """
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data = np.memmap(path, np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw, dtype = data[begin:end], info["dtype"]
        if dtype == "BF16":  # bfloat16 is the top half of a float32: NumPy has no bf16 of its own
            array = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in SAFETENSORS_DTYPES:
            array = raw.view(SAFETENSORS_DTYPES[dtype])
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}, which this reader does not "
                             f"know ({', '.join(['BF16', *SAFETENSORS_DTYPES])})")
        if array.size != math.prod(info["shape"]):
            raise ValueError(f"{path}: tensor {name} has {end - begin} bytes, not shape {info['shape']} "
                             f"of {dtype}: the file is truncated or damaged")
        tensors[name] = array.reshape(info["shape"])
    return tensors


def read_hf_gpt2_config(path) -> dict:
    """GPTConfig fields (vocab_size, block_size, n_layer, n_head, n_embd, bias) of path/config.json."""
    file = os.path.join(path, "config.json")
    with open(file, encoding="utf-8-sig") as f:  # -sig: a byte-order mark from an editor is fine
        try:
            hf = json.load(f)
        except ValueError as e:  # json's errors, and UnicodeDecodeError for bytes that are not UTF-8
            raise ValueError(f"{file} is not valid JSON ({e}): download or save it again") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file} holds a JSON {type(hf).__name__}, not an object: is it a GPT-2 config?")
    if "n_positions" not in hf and "n_ctx" in hf:
        hf["n_positions"] = hf["n_ctx"]
    missing = [k for k in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd") if k not in hf]
    if missing:
        raise ValueError(f"{file} lacks {', '.join(missing)}: is it a GPT-2 config?")
    problems = []
    if hf.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type is {hf['model_type']!r}, not 'gpt2'")
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:  # model.py's LayerNorm has GPT-2's 1e-5 built in
        problems.append(f"layer_norm_epsilon is {hf['layer_norm_epsilon']}, nanomax supports 1e-5 only")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function is {hf['activation_function']!r}, nanomax has GPT-2's "
                        f"tanh GELU ('gelu_new') only")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        problems.append(f"n_inner is {hf['n_inner']}, nanomax's MLP is 4 * n_embd wide")
    if problems:
        raise ValueError(f"{file}: " + "; ".join(problems))
    return {"vocab_size": hf["vocab_size"], "block_size": hf["n_positions"],
            "n_layer": hf["n_layer"], "n_head": hf["n_head"], "n_embd": hf["n_embd"], "bias": True}


def load_hf_gpt2(path, config: GPTConfig) -> dict:
    """GPT-2 weights from a Hugging Face directory as parameters of GPT(config).

    Returns the nested dict nnx.to_pure_dict(nnx.state(model)) has, of float32 NumPy
    arrays. The config must have the checkpoint's shape; block_size may be shorter (the
    position table is cut) and the vocabulary may be padded (with zero rows). HF's Conv1D
    stores weights (in, out), i.e. y = x @ W: the orientation of our kernels.
    """
    hf = read_hf_gpt2_config(path)
    differ = [f"{k}: checkpoint {hf[k]}, config {getattr(config, k)}"
              for k in ("n_layer", "n_head", "n_embd", "vocab_size", "bias") if hf[k] != getattr(config, k)]
    gpt2 = GPTConfig(n_head=config.n_head, n_embd=config.n_embd)  # GPT-2's architecture switches
    differ += [f"{k}: GPT-2 {getattr(gpt2, k)!r}, config {getattr(config, k)!r}"
               for k in ("pos_embedding", "norm", "norm_eps", "mlp", "mlp_hidden_size", "kv_heads",
                         "tie_embeddings") if getattr(gpt2, k) != getattr(config, k)]
    if config.block_size > hf["block_size"]:
        differ.append(f"block_size: checkpoint {hf['block_size']}, config {config.block_size} "
                      f"(may be smaller)")
    if differ:
        raise ValueError(f"{path} does not fit the model config ({'; '.join(differ)}): "
                         f"use the checkpoint's values")
    file = os.path.join(path, "model.safetensors")
    tensors = {name.removeprefix("transformer."): array for name, array in read_safetensors(file).items()
               if not name.endswith((".attn.bias", ".attn.masked_bias"))}  # causal-mask buffers
    lm_head = tensors.pop("lm_head.weight", None)
    L, N, D, V = config.n_layer, config.n_head, config.n_embd, config.vocab_size
    H = D // N

    def take(name, shape):
        if name not in tensors:
            raise ValueError(f"{file} has no tensor {name!r} (nor transformer.{name})")
        array = tensors.pop(name)
        if array.shape != shape:
            raise ValueError(f"{file}: {name} has shape {array.shape}, expected {shape}")
        return array.astype(np.float32)

    def layers(name, shape, reshape_to=None):  # h.0.<name> ... h.{L-1}.<name>, stacked
        stacked = np.stack([take(f"h.{i}.{name}", shape) for i in range(L)])
        return stacked if reshape_to is None else stacked.reshape(L, *reshape_to)

    wte = take("wte.weight", (V, D))
    if lm_head is not None and not np.array_equal(lm_head, wte):
        raise ValueError(f"{file}: lm_head.weight differs from wte.weight; nanomax ties the two")
    params = {
        "wte": np.pad(wte, ((0, config.padded_vocab_size - V), (0, 0))),
        "wpe": take("wpe.weight", (hf["block_size"], D))[:config.block_size],
        "blocks": {
            "ln_1": {"scale": layers("ln_1.weight", (D,)), "bias": layers("ln_1.bias", (D,))},
            "attn": {  # c_attn's 3D outputs are [q | k | v], each split into N heads of H
                "qkv_kernel": layers("attn.c_attn.weight", (D, 3 * D), (D, 3, N, H)),
                "qkv_bias": layers("attn.c_attn.bias", (3 * D,), (3, N, H)),
                "out_kernel": layers("attn.c_proj.weight", (D, D), (N, H, D)),
                "out_bias": layers("attn.c_proj.bias", (D,)),
            },
            "ln_2": {"scale": layers("ln_2.weight", (D,)), "bias": layers("ln_2.bias", (D,))},
            "mlp": {
                "fc_kernel": layers("mlp.c_fc.weight", (D, 4 * D)),
                "fc_bias": layers("mlp.c_fc.bias", (4 * D,)),
                "proj_kernel": layers("mlp.c_proj.weight", (4 * D, D)),
                "proj_bias": layers("mlp.c_proj.bias", (D,)),
            },
        },
        "ln_f": {"scale": take("ln_f.weight", (D,)), "bias": take("ln_f.bias", (D,))},
    }
    if tensors:
        raise ValueError(f"{file} has tensors a GPT-2 of this config does not: {sorted(tensors)[:5]}")
    return params
