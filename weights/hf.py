"""Hugging Face model directories in and out: config.json <-> the model's config keys,
safetensors weights <-> model.py's parameters, hub names -> a directory in the local cache.

Supported: GPT-2 (model_type gpt2) and the Llama family: llama (Llama 2 / 3 / 3.1 / 3.2,
SmolLM2, TinyLlama), mistral (when its sliding window is off or covers the context) and
qwen2 (biases on q, k, v). Anything else in a config.json is one HFError that names the key.

A nanomax parameter is built from one or more Hugging Face tensors (a `Piece` each): the
tensor's axes are split into the dimensions model.py uses, then reordered. Reading and writing
both follow the same table, so an import followed by an export gives back the same tensors.
Reading takes only the rows and columns a device holds (safetensors reads slices of the file).
"""

import dataclasses
import json
import math
import os
import shutil
import tempfile

import ml_dtypes  # registers bfloat16 with NumPy: safetensors returns bf16 tensors as such
import numpy as np
from huggingface_hub import snapshot_download
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

import configurator
from model import GPTConfig

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2")
# What a download fetches: the model, its tokenizer, nothing else (no .bin, .pth or
# consolidated.safetensors copies of the same weights).
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]
# Buffers some files carry that are not weights: GPT-2's causal masks, old Llamas' RoPE table.
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
FLOAT_DTYPES = ("F32", "BF16", "F16")


class HFError(configurator.ConfigError):
    """A Hugging Face directory nanomax cannot use; the message names the file and the key."""


# ----------------------------------------------------------------------------- hub names


def resolve(name: str, cache_dir: str | None = None, download: bool = True) -> str:
    """A local directory for init_from: the directory itself, or a hub model ('gpt2',
    'org/name') from the Hugging Face cache, downloaded there first if it is not yet."""
    if os.path.isdir(name):
        return name
    try:
        return snapshot_download(name, allow_patterns=HUB_FILES, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        if not download:
            raise HFError(_not_cached(name)) from None
    try:
        return snapshot_download(name, allow_patterns=HUB_FILES, cache_dir=cache_dir)
    except GatedRepoError:
        raise HFError(
            f"{name} is gated on the Hugging Face Hub: accept its licence at "
            f"https://huggingface.co/{name}, then log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise HFError(f"{name} is neither a local directory nor a model on the Hugging Face Hub") from None
    except Exception as e:  # no network, a proxy, a full disk: huggingface_hub has many of them
        raise HFError(f"could not download {name} ({type(e).__name__}). {_not_cached(name)}") from None


def _not_cached(name: str) -> str:
    return (
        f"{name} is not in the Hugging Face cache and this machine is offline: run `hf download "
        f"{name}` where there is a network and copy its cache (~/.cache/huggingface, or $HF_HOME) "
        f"here, or pass --init_from=DIRECTORY with config.json and *.safetensors"
    )


# ----------------------------------------------------------------------------- config.json


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark from an editor is fine
            value = json.load(f)
    except FileNotFoundError:
        raise HFError(
            f"{path} is missing: a Hugging Face model directory has config.json and "
            f"model.safetensors (or shards with model.safetensors.index.json)"
        ) from None
    except ValueError as e:  # json's errors, and UnicodeDecodeError for bytes that are not UTF-8
        raise HFError(f"{path} is not valid JSON ({e}): download or save it again") from None
    if not isinstance(value, dict):
        raise HFError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a directory's config.json says: nanomax's config keys for the model, and the
    longest context (block_size) it may run at."""

    model_type: str
    keys: dict
    max_context: int
    context_note: str  # why max_context is what it is, for messages


def read_config(directory: str) -> HFModel:
    file = os.path.join(directory, "config.json")
    hf = read_json(file)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise HFError(f"{file}: model_type {model_type!r} is not supported; nanomax reads {', '.join(SUPPORTED)}")
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hf.get(key):
            raise HFError(f"{file}: {key}={hf[key]}: mixtures of experts are not supported")
    gpt2 = model_type == "gpt2"
    keys = _gpt2_keys(hf, file) if gpt2 else _llama_keys(hf, file)
    context, note = keys.pop("block_size"), "its position table" if gpt2 else "max_position_embeddings"
    window = None if gpt2 or not hf.get("use_sliding_window", model_type == "mistral") else hf.get("sliding_window")
    if window and window < context:
        context, note = (
            window,
            (f"its sliding window ({window} tokens; nanomax attends to the whole context, so it may not be longer)"),
        )
    return HFModel(model_type, keys, context, note)


def _require(hf: dict, file: str, *names) -> list:
    missing = [k for k in names if k not in hf]
    if missing:
        raise HFError(f"{file} lacks {', '.join(missing)}: is it a complete {hf['model_type']} config?")
    return [hf[k] for k in names]


def _refuse(file: str, problems: list) -> None:
    if problems:
        raise HFError(f"{file}: " + "; ".join(problems))


def _gpt2_keys(hf: dict, file: str) -> dict:
    if "n_positions" not in hf and "n_ctx" in hf:
        hf = {**hf, "n_positions": hf["n_ctx"]}
    V, P, L, N, D = _require(hf, file, "vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
    problems = [
        f"{key} is {hf[key]!r}, nanomax's GPT-2 has {want!r}"
        for key, want in (
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("add_cross_attention", False),
        )
        if hf.get(key, want) != want
    ]
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(
            f"activation_function is {hf['activation_function']!r}; nanomax's GPT-2 has the tanh GELU ('gelu_new')"
        )
    _refuse(file, problems)
    F = hf.get("n_inner") or 4 * D
    return {
        "vocab_size": V,
        "block_size": P,
        "n_layer": L,
        "n_head": N,
        "n_embd": D,
        "bias": True,
        "qkv_bias": False,
        "pos_embedding": "learned",
        "norm": "layernorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        "mlp": "gelu",
        "mlp_hidden": 0 if F == 4 * D else F,
        "n_kv_head": 0,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "rope_scaling": "none",
    }


def _llama_keys(hf: dict, file: str) -> dict:
    V, P, L, N, D, F = _require(
        hf,
        file,
        "vocab_size",
        "max_position_embeddings",
        "num_hidden_layers",
        "num_attention_heads",
        "hidden_size",
        "intermediate_size",
    )
    K = hf.get("num_key_value_heads") or N
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {hf['hidden_act']!r}; nanomax's SwiGLU uses 'silu'")
    if hf.get("head_dim") not in (None, D // N):
        problems.append(f"head_dim is {hf['head_dim']}, not hidden_size / num_attention_heads = {D // N}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append("attention_bias / mlp_bias are set: nanomax has no biases on Llama's output projection or MLP")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor is {hf['partial_rotary_factor']}; nanomax rotates whole heads")
    # transformers 4.x writes rope_theta and rope_scaling; 5.x one rope_parameters dict.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    keys = {
        "vocab_size": V,
        "block_size": P,
        "n_layer": L,
        "n_head": N,
        "n_embd": D,
        "bias": False,
        "qkv_bias": hf["model_type"] == "qwen2",
        "pos_embedding": "rope",
        "rope_theta": float(theta),
        "norm": "rmsnorm",
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "mlp": "swiglu",
        "mlp_hidden": F,
        "n_kv_head": 0 if K == N else K,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_scaling": "none",
    }
    if rope_type == "llama3":
        try:
            keys.update(
                rope_scaling="llama3",
                rope_scaling_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_context=int(rope["original_max_position_embeddings"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"rope scaling 'llama3' lacks or garbles {e}")
    elif rope_type != "default":
        problems.append(f"rope scaling type {rope_type!r} is not supported (nanomax has 'llama3' and none)")
    _refuse(file, problems)
    return keys


def fill_model_keys(explicit: dict, model: HFModel, directory: str, default_block_size: int) -> dict:
    """The config values given (config files and flags) completed with the model's keys from its
    config.json; a given value that contradicts config.json is an HFError naming both. block_size
    may be anything up to the model's context (default: default_block_size, capped there)."""
    differ = [
        f"{k}={explicit[k]!r} (config.json: {v!r})" for k, v in model.keys.items() if k in explicit and explicit[k] != v
    ]
    if differ:
        raise HFError(
            f"{', '.join(differ)} contradict {directory}/config.json: the model's shape comes "
            f"from there; drop these keys"
        )
    block_size = explicit.get("block_size", min(default_block_size, model.max_context))
    return {**explicit, **model.keys, "block_size": block_size}


def with_model_keys(values: dict, default_block_size: int = configurator.Config.block_size) -> dict:
    """configurator's `complete` hook: when init_from names a Hugging Face model, its config.json
    sets the model keys (see fill_model_keys)."""
    init_from = values.get("init_from", "scratch")
    if init_from in ("scratch", "resume") or os.path.isdir(os.path.join(init_from, "checkpoints")):
        return values  # nothing to fill in, or a nanomax run's out_dir (checkpoint.with_checkpoint_keys)
    configurator.check_init_from(init_from)
    directory = resolve(init_from)
    return fill_model_keys(values, read_config(directory), directory, default_block_size)


def check_config(config, model: HFModel, directory: str) -> None:
    """The run's config (anything with the model keys as attributes) against config.json."""
    differ = [
        f"{k}: config.json {v!r}, config {getattr(config, k)!r}"
        for k, v in model.keys.items()
        if getattr(config, k) != v
    ]
    if config.block_size > model.max_context:
        differ.append(
            f"block_size {config.block_size} is longer than {model.context_note} allows ({model.max_context})"
        )
    if differ:
        raise HFError(
            f"{directory} does not fit the config ({'; '.join(differ)}): leave the model keys to its config.json"
        )


# ----------------------------------------------------------------------------- the layout


@dataclasses.dataclass(frozen=True)
class Piece:
    """A Hugging Face tensor as (part of) a nanomax parameter. `split` gives, for each axis of
    the tensor, the dimensions it holds (row-major); `order` lists those dimensions in the order
    model.py has them. `name` has {i} for the layer in stacked parameters."""

    name: str
    split: tuple
    order: tuple

    @property
    def hf_shape(self) -> tuple:
        return tuple(math.prod(dims) for dims in self.split)

    @property
    def shape(self) -> tuple:  # in model.py's order
        dims = [d for dims in self.split for d in dims]
        return tuple(dims[i] for i in self.order)


def layout(c: GPTConfig) -> dict:
    """{parameter path: (pieces, axis they are concatenated on)} for model_config c."""
    D, N, K, F, V = c.n_embd, c.n_head, c.kv_heads, c.mlp_hidden_size, c.vocab_size
    H, G = D // N, N // K
    one = lambda name, split, order=None: ([Piece(name, split, order or tuple(range(sum(map(len, split)))))], None)
    if c.pos_embedding == "learned":  # GPT-2: Conv1D weights are stored (in, out), as model.py's
        h = "h.{i}."
        table = {
            ("wte",): one("wte.weight", ((V,), (D,))),
            ("wpe",): one("wpe.weight", ((c.block_size,), (D,))),
            ("blocks", "ln_1", "scale"): one(h + "ln_1.weight", ((D,),)),
            ("blocks", "ln_1", "bias"): one(h + "ln_1.bias", ((D,),)),
            ("blocks", "attn", "qkv_kernel"): one(h + "attn.c_attn.weight", ((D,), (3, N, H))),
            ("blocks", "attn", "qkv_bias"): one(h + "attn.c_attn.bias", ((3, N, H),)),
            ("blocks", "attn", "out_kernel"): one(h + "attn.c_proj.weight", ((N, H), (D,))),
            ("blocks", "attn", "out_bias"): one(h + "attn.c_proj.bias", ((D,),)),
            ("blocks", "ln_2", "scale"): one(h + "ln_2.weight", ((D,),)),
            ("blocks", "ln_2", "bias"): one(h + "ln_2.bias", ((D,),)),
            ("blocks", "mlp", "fc_kernel"): one(h + "mlp.c_fc.weight", ((D,), (F,))),
            ("blocks", "mlp", "fc_bias"): one(h + "mlp.c_fc.bias", ((F,),)),
            ("blocks", "mlp", "proj_kernel"): one(h + "mlp.c_proj.weight", ((F,), (D,))),
            ("blocks", "mlp", "proj_bias"): one(h + "mlp.c_proj.bias", ((D,),)),
            ("ln_f", "scale"): one("ln_f.weight", ((D,),)),
            ("ln_f", "bias"): one("ln_f.bias", ((D,),)),
        }
    else:  # Llama: Linear weights are stored (out, in); query head k·G + g is row block k·G + g
        h = "model.layers.{i}."
        q, kv = h + "self_attn.q_proj.", [h + "self_attn.k_proj.", h + "self_attn.v_proj."]
        table = {
            ("wte",): one("model.embed_tokens.weight", ((V,), (D,))),
            ("blocks", "ln_1", "scale"): one(h + "input_layernorm.weight", ((D,),)),
            ("blocks", "attn", "qkv_kernel"): (  # (D, G + 2, K, H): G query heads, a key, a value
                [Piece(q + "weight", ((K, G, H), (D,)), (3, 1, 0, 2))]
                + [Piece(p + "weight", ((1, K, H), (D,)), (3, 0, 1, 2)) for p in kv],
                1,
            ),
            ("blocks", "attn", "out_kernel"): one(h + "self_attn.o_proj.weight", ((D,), (N, H)), (1, 2, 0)),
            ("blocks", "ln_2", "scale"): one(h + "post_attention_layernorm.weight", ((D,),)),
            ("blocks", "mlp", "gate_kernel"): one(h + "mlp.gate_proj.weight", ((F,), (D,)), (1, 0)),
            ("blocks", "mlp", "fc_kernel"): one(h + "mlp.up_proj.weight", ((F,), (D,)), (1, 0)),
            ("blocks", "mlp", "proj_kernel"): one(h + "mlp.down_proj.weight", ((D,), (F,)), (1, 0)),
            ("ln_f", "scale"): one("model.norm.weight", ((D,),)),
        }
        if c.qkv_bias:
            table[("blocks", "attn", "qkv_bias")] = (
                [Piece(q + "bias", ((K, G, H),), (1, 0, 2))] + [Piece(p + "bias", ((1, K, H),), (0, 1, 2)) for p in kv],
                0,
            )
    if not c.tie_embeddings:
        table[("lm_head_kernel",)] = one("lm_head.weight", ((V,), (D,)), (1, 0))
    return table


def check_architecture(c: GPTConfig) -> str:
    """'gpt2' or 'llama'/'qwen2': the transformers model with exactly this architecture, or an
    HFError saying which switch has no equivalent there. zero_init_proj is only how training
    starts: such a model exports like any other."""
    lacking = {
        "n_experts": (c.n_experts > 0, "a mixture of experts; Mixtral-style export is not built"),
        "qk_norm": (c.qk_norm, "RMSNorm on each query and key head"),
        "mlp": (c.mlp == "relu2", "the ReLU² MLP, proj(relu(fc(x))²)"),
        "logit_softcap": (c.logit_softcap > 0, "logits soft-capped by cap·tanh(logits / cap)"),
    }
    for key, (on, what) in lacking.items():
        if on:
            raise HFError(
                f"{key}={getattr(c, key)!r} ({what}) has no equivalent in transformers' GPT2, "
                f"Llama or Qwen2 models: a model trained with it cannot be exported to them"
            )
    gpt2 = dict(pos_embedding="learned", norm="layernorm", mlp="gelu", bias=True, kv_heads=c.n_head)
    llama = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    for name, switches in (("gpt2", gpt2), ("llama", llama)):
        if c.pos_embedding == switches["pos_embedding"]:
            differ = [f"{k}={getattr(c, k)!r}" for k, v in switches.items() if getattr(c, k) != v]
            if differ:
                raise HFError(
                    f"this model mixes {name}'s pos_embedding={switches['pos_embedding']!r} with "
                    f"{', '.join(differ)}: transformers has no such architecture ({name} has "
                    f"{', '.join(f'{k}={v!r}' for k, v in switches.items())})"
                )
            return "qwen2" if name == "llama" and c.qkv_bias else name
    raise AssertionError(c.pos_embedding)


# ----------------------------------------------------------------------------- reading


class Weights:
    """The tensors of model.safetensors, or of the shards model.safetensors.index.json lists,
    read a slice at a time. Everything is checked against the layout before any is read.

    `file_config` is the model as the files hold it; model.py's parameters may have a padded
    vocabulary (zero rows or columns are added) and a shorter position table (it is cut)."""

    def __init__(self, directory: str, file_config: GPTConfig):
        self.directory, self.config = directory, file_config
        single, index = (os.path.join(directory, f) for f in ("model.safetensors", "model.safetensors.index.json"))
        if os.path.isfile(single):
            files = [single]
        elif os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFError(f"{index} has no 'weight_map' object")
            files = sorted({os.path.join(directory, f) for f in weight_map.values()})
            for f in files:
                if not os.path.isfile(f):
                    raise HFError(
                        f"{index} names {os.path.basename(f)}, which is missing from {directory}: "
                        f"download that shard again"
                    )
        else:
            bins = [f for f in os.listdir(directory) if f.endswith((".bin", ".pth"))]
            raise HFError(
                f"{directory} has neither model.safetensors nor model.safetensors.index.json"
                + (
                    f" ({bins[0]} is a PyTorch pickle: nanomax reads safetensors only; save it "
                    f"again with transformers' save_pretrained)"
                    if bins
                    else ""
                )
            )
        self.handles, self.file_of = {}, {}
        for f in files:
            try:
                self.handles[f] = safe_open(f, framework="np")
            except (SafetensorError, OSError) as e:
                raise HFError(f"{f} is not a readable safetensors file ({e}): download it again") from None
            for name in self.handles[f].keys():
                self.file_of[name.removeprefix("transformer.")] = (f, name)  # GPT-2 files have it or not
        self.layout = layout(file_config)
        self._check()

    def _names(self, piece: Piece) -> list:
        return [piece.name.format(i=i) for i in range(self.config.n_layer)] if "{i}" in piece.name else [piece.name]

    def _check(self):
        expected = {
            name: piece.hf_shape
            for pieces, _ in self.layout.values()
            for piece in pieces
            for name in self._names(piece)
        }
        missing = [n for n in expected if n not in self.file_of]
        if missing:
            raise HFError(
                f"{self.directory}'s safetensors lack {len(missing)} tensors this model needs, "
                f"e.g. {missing[0]}: a missing shard, or a config.json of another model"
            )
        tied_head = "lm_head.weight" if self.config.tie_embeddings else None  # a copy of wte, if there
        extra = sorted(n for n in self.file_of if n not in expected and n != tied_head and not n.endswith(NOT_WEIGHTS))
        if extra:
            raise HFError(
                f"{self.directory} has tensors this model does not use, e.g. "
                f"{', '.join(extra[:3])}: an unsupported feature (biases, experts, ...)"
            )
        for name, shape in expected.items():
            file, stored = self.file_of[name]
            tensor = self.handles[file].get_slice(stored)
            if tuple(tensor.get_shape()) != shape or tensor.get_dtype() not in FLOAT_DTYPES:
                raise HFError(
                    f"{file}: {stored} is {tensor.get_dtype()} {tuple(tensor.get_shape())}, expected "
                    f"a float ({'/'.join(FLOAT_DTYPES)}) of shape {shape}"
                )

    def read(self, path: tuple, shape: tuple, index: tuple) -> np.ndarray:
        """The float32 block `index` (slices, as jax.make_array_from_callback gives them) of the
        parameter `path` whose whole shape in model.py is `shape`."""
        pieces, axis = self.layout[path]
        want = [range(*s.indices(n)) for s, n in zip(tuple(index) + (slice(None),) * len(shape), shape)]
        stacked = "{i}" in pieces[0].name
        layers, want = (want[0], want[1:]) if stacked else ([None], want)
        blocks = []
        for layer in layers:
            parts, start = [], 0
            for piece in pieces:
                piece_want = list(want)
                if axis is not None:  # the stretch of the concatenated axis this piece fills
                    size, r = piece.shape[axis], want[axis]
                    lo, hi = max(r.start, start), min(r.stop, start + size)
                    piece_want[axis] = range(lo - start, hi - start)
                    start += size
                    if lo >= hi:
                        continue
                parts.append(self._read_piece(piece, layer, piece_want))
            blocks.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis))
        return np.stack(blocks) if stacked else blocks[0]

    def _read_piece(self, piece: Piece, layer, want: list) -> np.ndarray:
        """One tensor's block: for each of its axes, the range of the axis's first dimension is
        read from the file (zeros past the file's end: a padded vocabulary), the inner dimensions
        are read whole and sliced after; then the dimensions are put in model.py's order."""
        file, stored = self.file_of[piece.name.format(i=layer)]
        want_by_dim = [None] * len(piece.order)
        for model_axis, dim in enumerate(piece.order):
            want_by_dim[dim] = want[model_axis]
        reads, pads, block_shape, inner_slices, dim = [], [], [], [], 0
        for dims in piece.split:
            r, inner = want_by_dim[dim], math.prod(dims[1:])
            in_file = range(r.start, max(r.start, min(r.stop, dims[0])))
            reads.append(slice(in_file.start * inner, in_file.stop * inner))
            pads.append((0, (len(r) - len(in_file)) * inner))
            block_shape += [len(r), *dims[1:]]
            inner_slices += [slice(None)] + [slice(w.start, w.stop) for w in want_by_dim[dim + 1 : dim + len(dims)]]
            dim += len(dims)
        block = self.handles[file].get_slice(stored)[tuple(reads)].astype(np.float32)
        block = np.pad(block, pads).reshape(block_shape)[tuple(inner_slices)]
        return block.transpose(piece.order)


# ----------------------------------------------------------------------------- writing


def to_hf_tensors(params: dict, c: GPTConfig) -> dict:
    """{Hugging Face name: float32 array} of model.py's parameters (a nested dict of NumPy
    arrays, as nnx.to_pure_dict gives): the inverse of Weights.read."""
    model_type = check_architecture(c)
    tensors = {}
    for path, (pieces, axis) in layout(c).items():
        value = params
        for key in path:
            value = value[key]
        stacked = "{i}" in pieces[0].name
        for layer in range(c.n_layer) if stacked else [None]:
            whole, start = np.asarray(value[layer] if stacked else value, np.float32), 0
            for piece in pieces:
                part = whole
                if axis is not None:
                    part = np.take(whole, range(start, start + piece.shape[axis]), axis)
                    start += piece.shape[axis]
                part = part[tuple(slice(0, n) for n in piece.shape)]  # drop vocabulary padding
                name = piece.name.format(i=layer)
                if model_type == "gpt2" and name != "lm_head.weight":
                    name = "transformer." + name  # as transformers' GPT2LMHeadModel names them
                tensors[name] = np.ascontiguousarray(part.transpose(np.argsort(piece.order)).reshape(piece.hf_shape))
    return tensors


def hf_config(c: GPTConfig, dtype: str, eos_id: int | None, bos_id: int | None) -> dict:
    """config.json for transformers' GPT2LMHeadModel, LlamaForCausalLM or Qwen2ForCausalLM."""
    model_type = check_architecture(c)
    tokens = {"bos_token_id": bos_id if bos_id is not None else eos_id, "eos_token_id": eos_id}
    common = {
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "torch_dtype": dtype,
        "tie_word_embeddings": c.tie_embeddings,
        **tokens,
    }
    if model_type == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            **common,
            "n_positions": c.block_size,
            "n_ctx": c.block_size,
            "n_embd": c.n_embd,
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_inner": c.mlp_hidden_size,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    rope_scaling = (
        None
        if c.rope_scaling == "none"
        else {
            "rope_type": "llama3",
            "factor": c.rope_scaling_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_context,
        }
    )
    config = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        **common,
        "hidden_size": c.n_embd,
        "intermediate_size": c.mlp_hidden_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.n_embd // c.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_dropout": 0.0,
    }
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    else:
        config.update(attention_bias=False, mlp_bias=False)
    return config


def write_model(
    directory: str, tensors: dict, config: dict, dtype: str, max_shard_bytes: int = 5 << 30, extra_files=None
) -> list:
    """config.json and the tensors (as `dtype`) in model.safetensors, or in shards of at most
    max_shard_bytes plus model.safetensors.index.json, into a new `directory`; extra_files(tmp)
    may add more. Everything is written in a temporary directory beside it that is renamed at
    the end, so a failure leaves nothing behind. Returns the file names."""
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise HFError(
            f"{directory} already exists and is not an empty directory: choose another --to (nothing is overwritten)"
        )
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    shards, size = [[]], 0
    for name, array in tensors.items():
        nbytes = array.size * np.dtype(np_dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.", dir=parent)
    try:
        names = (
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            if len(shards) > 1
            else ["model.safetensors"]
        )
        for file, shard in zip(names, shards):
            save_file(
                {n: tensors[n].astype(np_dtype) for n in shard}, os.path.join(tmp, file), metadata={"format": "pt"}
            )  # transformers wants to know the tensors are torch's
        if len(shards) > 1:
            total = sum(t.size * np.dtype(np_dtype).itemsize for t in tensors.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {n: file for file, shard in zip(names, shards) for n in shard},
            }
            _write_json(os.path.join(tmp, "model.safetensors.index.json"), index)
            names.append("model.safetensors.index.json")
        _write_json(os.path.join(tmp, "config.json"), config)
        if extra_files is not None:
            extra_files(tmp)
        if os.path.isdir(directory):
            os.rmdir(directory)  # empty, checked above
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(os.listdir(directory))


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
