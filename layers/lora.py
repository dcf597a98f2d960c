"""LoRA (Hu et al., 2021): low-rank adapters on the blocks' dense matrices, the one part of a LoRA run
that trains.

A target matrix W (in -> out) gets two small matrices, A (in, r) and B (r, out):

    y = x @ W + (alpha / r) · dropout(x) @ A @ B

A starts random (PEFT's default: uniform in ±1/sqrt(in)), B at zero, so a fresh adapter changes
nothing. The adapter runs beside W on the activations (r-wide products), never as W + A·B: its
backward then costs ~r/in of W's weight gradient, which LoRA does not compute at all.

Targets, by the names PEFT's Llama adapters use (GPT-2's fused c_attn is q, k and v; its c_fc is
`up`, its c_proj's are `o` and `down`):

    q, k, v   the attention's query, key and value projections (model.Attention's qkv_kernel)
    o         its output projection (out_kernel)
    gate, up  the MLP's input matrices (gate_kernel: SwiGLU only; fc_kernel)
    down      its output matrix (proj_kernel)

The default is all of them: QLoRA (Dettmers et al., 2023) found that adapting every linear layer is
what matches full fine-tuning, more than the rank does; the adapters stay ~1% of a 1B model at r=16.
A mixture of experts' experts get none.

An adapter is an nnx.Module beside its matrix (`q_lora` beside `qkv_kernel`), or None when the
matrix is not a target: `add(adapter, x, y)` is y with the adapter's output added, or y itself.
Its parameters are named lora_a and lora_b, which is how training tells them from the frozen base
(`split`), and `merge` folds them into the base's matrices for inference and export. jax/flax only.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers.params import dropout, param

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ADAPTER_LEAVES = ("lora_a", "lora_b")
# Each target's matrix in model.py, and its adapter's name beside it.
KERNELS = {
    "q": "qkv_kernel",
    "k": "qkv_kernel",
    "v": "qkv_kernel",
    "o": "out_kernel",
    "gate": "gate_kernel",
    "up": "fc_kernel",
    "down": "proj_kernel",
}


def parse_targets(text: str) -> tuple[str, ...]:
    """'q,v' -> ('q', 'v'); 'all' -> every target."""
    if text.strip() == "all":
        return TARGETS
    return tuple(part.strip() for part in text.split(",") if part.strip())


class Adapter(nnx.Module):
    """One target's A (in..., r) and B (r, out...), stacked over layers like their matrix. The input
    and output axes keep the matrix's logical names, so the mesh splits A like W's rows and B like
    W's columns; the rank axis is never split."""

    def __init__(self, config, target: str, key, in_shape: tuple, in_axes: tuple, out_shape: tuple, out_axes: tuple):
        r = config.lora_rank
        bound = 1 / math.sqrt(math.prod(in_shape))
        self.lora_a = param(jax.random.uniform(key, (*in_shape, r), jnp.float32, -bound, bound), (*in_axes, None))
        self.lora_b = param(jnp.zeros((r, *out_shape)), (None, *out_axes))
        self.scale = config.lora_alpha / r
        self.rate = config.lora_dropout
        self.stream = TARGETS.index(target)  # each target draws its own dropout mask

    def __call__(self, x_NxI, dropout_key=None):
        """scale · dropout(x) @ A @ B: (N, out) in x's dtype."""
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, self.stream)
        a_IxR, b_RxO = self.lora_a[...], self.lora_b[...]
        h_NxR = dropout(x_NxI, self.rate, key) @ a_IxR.reshape(-1, a_IxR.shape[-1]).astype(x_NxI.dtype)
        return (h_NxR * self.scale) @ b_RxO.reshape(b_RxO.shape[0], -1).astype(x_NxI.dtype)


def adapter(config, target: str, key, in_shape, in_axes, out_shape, out_axes) -> Adapter | None:
    """An Adapter when config.lora_rank > 0 and `target` is among config.lora_targets, else None."""
    if config.lora_rank == 0 or target not in parse_targets(config.lora_targets):
        return None
    return Adapter(
        config, target, jax.random.fold_in(key, TARGETS.index(target)), in_shape, in_axes, out_shape, out_axes
    )


def add(adapter: Adapter | None, x_NxI, y, dropout_key=None, heads_major: bool = False):
    """y + the adapter's output for the rows x (N, in), shaped like y: (N, out...) row-major, or with
    heads_major y (B, heads, T, H) whose rows are N = B·T. y itself when there is no adapter."""
    if adapter is None:
        return y
    delta = adapter(x_NxI, dropout_key)
    if heads_major:
        B, N, T, H = y.shape
        return y + delta.reshape(B, T, N, H).swapaxes(1, 2)
    return y + delta.reshape(y.shape)


def dropout_key(key):
    """The adapters' dropout stream of a layer's key (folded, so the model's other dropout masks stay
    what they were); None without one."""
    return None if key is None else jax.random.fold_in(key, 0x10AA)


# ----------------------------------------------------------------------------- the parameters' tree


def is_adapter(path) -> bool:
    return getattr(path[-1], "key", path[-1]) in ADAPTER_LEAVES


def _partition(tree: dict, keep) -> dict:
    """The nested dict with only the leaves keep(path) holds, and no empty dicts."""

    def walk(node, path):
        if not isinstance(node, dict):
            return node if keep(path) else None
        kept = {k: walk(v, (*path, k)) for k, v in node.items()}
        kept = {k: v for k, v in kept.items() if v is not None}
        return kept or None

    return walk(tree, ()) or {}


def has_adapters(params: dict) -> bool:
    return bool(_partition(params, is_adapter))


def split(params: dict) -> tuple[dict, dict]:
    """(what trains, what is frozen): with adapters, (the adapters, the rest); without, (params, {})."""
    adapters = _partition(params, is_adapter)
    if not adapters:
        return params, {}
    return adapters, _partition(params, lambda path: not is_adapter(path))


def join(a: dict, b: dict) -> dict:
    """Two nested dicts with disjoint leaves as one (split's inverse)."""
    joined = dict(a)
    for k, v in b.items():
        joined[k] = join(joined[k], v) if k in joined else v
    return joined


def base_of(params: dict) -> dict:
    """The parameters without adapters."""
    return _partition(params, lambda path: not is_adapter(path))


# ----------------------------------------------------------------------------- merging


def delta(adapter_params: dict, scale: float):
    """scale · A @ B of one stacked adapter, float32 (L, in..., out...)."""
    a, b = (adapter_params[name].astype(jnp.float32) for name in ADAPTER_LEAVES)
    return scale * jnp.einsum(
        "lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(*b.shape[:2], -1)
    ).reshape(*a.shape[:-1], *b.shape[2:])


def merge(params: dict, config) -> dict:
    """The parameters with every adapter folded into its matrix, W + (alpha / r) · A @ B in float32 (an
    int8 W dequantized first), and no adapters: a model without
    LoRA (config.lora_rank = 0) computes with them what the model with adapters computed. Works on
    the pure dict of parameters, stacked layers included; a dict without adapters comes back as it is."""
    if not has_adapters(params):
        return params
    scale = config.lora_alpha / config.lora_rank

    def merge_module(module: dict) -> dict:
        module = {k: merge_module(v) if isinstance(v, dict) else v for k, v in module.items()}
        targets = [t for t in TARGETS if f"{t}_lora" in module]
        if not targets:
            return module
        merged = {k: v for k, v in module.items() if not k.endswith("_lora")}
        for target in targets:
            name = KERNELS[target]
            merged[name] = merged[name].astype(jnp.float32)  # an Int8Weight dequantized
            d = delta(module[f"{target}_lora"], scale)
            if name == "qkv_kernel":
                merged[name] = _add_to_qkv(merged[name], d, target)
            else:
                merged[name] = merged[name] + d
        return merged

    return merge_module(params)


def _add_to_qkv(kernel_LxDxCxKxH, d, target: str):
    """A q, k or v delta added into the fused (L, D, G + 2, K, H) kernel: q's (L, D, N, H) is the G
    query heads of each of the K groups (head k·G + g), k's and v's (L, D, K, H) one slot each."""
    L, D, C, K, H = kernel_LxDxCxKxH.shape
    G = C - 2
    if target == "q":
        return kernel_LxDxCxKxH.at[:, :, :G].add(d.reshape(L, D, K, G, H).swapaxes(2, 3))
    return kernel_LxDxCxKxH.at[:, :, G if target == "k" else G + 1].add(d)
