"""LoRA adapters in Hugging Face PEFT's format, out and in: a directory with adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the base model.

PEFT names each adapted module's pair by the module's path in transformers' model, under
`base_model.model.`, and stores them as torch's Linear layers store weights:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   (r, in)
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   (out, r)

and adds scale · B·A to the module's weight, scale = lora_alpha / r (rank_pattern and alpha_pattern
set them per module). layers/lora.py's adapters are the same product, A (in, r) and B (r, out) per
target, stacked over layers, with the inputs and outputs in the order of transformers' weights
(query head k·G + g, then its H dimensions). GPT-2's c_attn computes q, k and v in one Conv1D: their
adapters export as one of rank n·r (A's stacked, B block-diagonal; alpha scaled alike), and any
c_attn adapter imports as q, k and v adapters sharing its A.
"""

import json
import os
import re

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from layers import lora
from model import GPT, GPTConfig
from weights import hf

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
LLAMA_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
GPT2_MODULES = {"q": "attn.c_attn", "k": "attn.c_attn", "v": "attn.c_attn", "o": "attn.c_proj"}
GPT2_MODULES |= {"up": "mlp.c_fc", "down": "mlp.c_proj"}
QKV = ("q", "k", "v")  # GPT-2's c_attn: its output columns in this order


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _layout(c: GPTConfig) -> tuple[str, dict]:
    """(the prefix of layer i's modules, {target: module}) of the transformers model c exports as."""
    if hf.check_architecture(c) == "gpt2":
        return "base_model.model.transformer.h.{i}.", GPT2_MODULES
    return "base_model.model.model.layers.{i}.", LLAMA_MODULES


# ----------------------------------------------------------------------------- out


def to_peft(adapters: dict, c: GPTConfig, base: str) -> tuple[dict, dict]:
    """(tensors, adapter_config.json) of a LoRA model's adapters (the pure dict of lora.split's first half,
    NumPy arrays); `base`: the base model's directory or hub name, for base_model_name_or_path."""
    prefix, modules = _layout(c)
    r, alpha = c.lora_rank, c.lora_alpha
    stack = adapters["blocks"]
    found = {name[: -len("_lora")]: pair for part in stack.values() for name, pair in part.items()}
    tensors, ranks = {}, {}
    fused = [t for t in QKV if t in found] if modules is GPT2_MODULES else []
    for i in range(c.n_layer):
        pairs = {t: (pair["lora_a"][i], pair["lora_b"][i]) for t, pair in found.items()}
        per_module = {modules[t]: _linear_pair(*pairs[t], r) for t in found if t not in fused}
        if fused:  # c_attn: A's stacked, B block-diagonal over its (q, k, v) column blocks
            D = c.n_embd
            a = np.concatenate([_linear_pair(*pairs[t], r)[0] for t in fused])
            b = np.zeros((3 * D, len(fused) * r), np.float32)
            for j, t in enumerate(fused):
                b[QKV.index(t) * D : (QKV.index(t) + 1) * D, j * r : (j + 1) * r] = _linear_pair(*pairs[t], r)[1]
            per_module["attn.c_attn"] = (a, b)
            ranks["attn.c_attn"] = len(fused) * r
        for module, (a, b) in per_module.items():
            name = prefix.format(i=i) + module
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    targets = sorted({modules[t] for t in found})
    gpt2 = modules is GPT2_MODULES
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": c.lora_dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": gpt2,  # GPT-2's Conv1D stores its weight (in, out)
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        # scale · B·A with scale = alpha / rank: a fused c_attn of rank n·r keeps alpha / r with alpha·n
        "rank_pattern": ranks,
        "alpha_pattern": {m: alpha * rank / r for m, rank in ranks.items()},
        "revision": None,
    }
    return tensors, config


def _linear_pair(a, b, r: int) -> tuple:
    """Our A (in..., r) and B (r, out...) of one layer as torch Linear weights: (r, in), (out, r)."""
    return np.asarray(a, np.float32).reshape(-1, r).T, np.asarray(b, np.float32).reshape(r, -1).T


def write(directory: str, tensors: dict, config: dict) -> list:
    """adapter_config.json and adapter_model.safetensors into a new directory; returns the file names."""
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise hf.HFError(
            f"{directory} already exists and is not an empty directory: choose another --to (nothing is overwritten)"
        )
    os.makedirs(directory, exist_ok=True)
    save_file({n: np.ascontiguousarray(t) for n, t in tensors.items()}, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return sorted(os.listdir(directory))


# ----------------------------------------------------------------------------- in


def read_config(directory: str) -> dict:
    """adapter_config.json, checked for what nanomax can load: LoRA, no DoRA, rsLoRA or layer subsets."""
    file = os.path.join(directory, CONFIG_FILE)
    config = hf.read_json(file)
    unsupported = [
        f"{key}={config.get(key)!r}"
        for key, fine in (
            ("peft_type", ("LORA",)),
            ("use_dora", (False, None)),
            ("use_rslora", (False, None)),
            ("layers_to_transform", (None,)),
            ("modules_to_save", (None, [])),
        )
        if config.get(key, fine[-1]) not in fine
    ]
    if unsupported:
        raise hf.HFError(f"{file}: {', '.join(unsupported)} is not what nanomax's LoRA (plain LoRA) loads")
    if not config.get("base_model_name_or_path"):
        raise hf.HFError(f"{file} names no base_model_name_or_path: nanomax needs the base model it adapts")
    return config


def lora_keys(directory: str) -> dict:
    """The config keys of the adapters in an adapter directory: lora_rank (the largest of its modules'
    ranks, as their lora_A tensors have them), lora_alpha, lora_targets."""
    config = read_config(directory)
    ranks = _tensor_shapes(directory, lambda name: name.endswith(".lora_A.weight"))
    targets = set()
    for module in sorted({n.rsplit(".lora_", 1)[0] for n in ranks}):
        found = {t for modules in (LLAMA_MODULES, GPT2_MODULES) for t, m in modules.items() if module.endswith("." + m)}
        if not found:  # an embedding, the output layer, an expert: nothing here to load it into
            raise hf.HFError(f"{directory} adapts {module}, which nanomax's LoRA has no adapter for")
        targets |= found
    order = [t for t in lora.TARGETS if t in targets]
    return {
        "lora_rank": max(shape[0] for shape in ranks.values()),
        "lora_alpha": float(config.get("lora_alpha", 8)),
        "lora_targets": ",".join(order),
    }


def _tensor_shapes(directory: str, keep) -> dict:
    try:
        with safe_open(os.path.join(directory, WEIGHTS_FILE), "np") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys() if keep(name)}
    except (OSError, SafetensorError) as e:
        raise hf.HFError(f"{os.path.join(directory, WEIGHTS_FILE)} can't be read ({e})") from None


def _alpha(config: dict, module_path: str) -> float:
    """A module's lora_alpha: alpha_pattern's entry whose pattern ends its path (PEFT's rule), else lora_alpha."""
    for pattern, alpha in config.get("alpha_pattern", {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_path):
            return alpha
    return config.get("lora_alpha", 8)


def from_peft(directory: str, c: GPTConfig) -> dict:
    """Our adapters (a pure dict of float32 NumPy arrays shaped as model.py's, stacked over layers) from a
    PEFT adapter directory, for the LoRA model c (c's lora keys: lora_keys(directory)). A module's own rank
    and alpha are kept exactly: its B is scaled by its own alpha / rank over c's, and A and B padded with
    zeros to c's rank."""
    config = read_config(directory)
    prefix, modules = _layout(c)
    R, scale = c.lora_rank, c.lora_alpha / c.lora_rank
    shapes = lora.split(_abstract_adapters(c))[0]["blocks"]
    out = {part: {name: {} for name in pairs} for part, pairs in shapes.items()}
    tensors = _tensors(directory)
    for part, pairs in shapes.items():
        for name, pair in pairs.items():
            target = name[: -len("_lora")]
            module = modules[target]
            a_layers, b_layers = [], []
            for i in range(c.n_layer):
                key = prefix.format(i=i) + module
                if f"{key}.lora_A.weight" not in tensors:
                    raise hf.HFError(f"{directory}: no {key}.lora_A.weight, though {target} has adapters")
                a, b = (tensors[f"{key}.lora_{m}.weight"].astype(np.float32) for m in "AB")
                own_scale = _alpha(config, key.removeprefix("base_model.model.")) / a.shape[0]
                b = b * own_scale / scale
                if module == "attn.c_attn":  # q, k, v: its A, and B's column block of the target
                    D = c.n_embd
                    b = b[QKV.index(target) * D : (QKV.index(target) + 1) * D]
                a_layers.append(np.pad(a, ((0, R - a.shape[0]), (0, 0))).T)
                b_layers.append(np.pad(b, ((0, 0), (0, R - b.shape[1]))).T)
            a_shape, b_shape = pair["lora_a"].shape, pair["lora_b"].shape
            out[part][name] = {
                "lora_a": np.stack(a_layers).reshape(a_shape),
                "lora_b": np.stack(b_layers).reshape(b_shape),
            }
    return {"blocks": out}


def _tensors(directory: str) -> dict:
    try:
        with safe_open(os.path.join(directory, WEIGHTS_FILE), "np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as e:
        raise hf.HFError(f"{os.path.join(directory, WEIGHTS_FILE)} can't be read ({e})") from None


def _abstract_adapters(c: GPTConfig) -> dict:
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(c, jax.random.key(0)))))
