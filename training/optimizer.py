"""The optimizer: AdamW (GPT-2's) or Muon, with one learning-rate schedule, from the config.

    optimizer = 'adamw'   AdamW on every parameter; weight decay on matrices and embeddings
    optimizer = 'muon'    Muon (momentum, then Newton-Schulz orthogonalisation) on the
                          transformer blocks' weight matrices; AdamW, as above, on the rest:
                          embeddings (wte, wpe), the output head (lm_head_kernel), norm
                          scales and biases

Both groups follow the same schedule shape (linear warmup, cosine decay to min_lr), scaled
to each group's peak: learning_rate for AdamW, muon_learning_rate for Muon.

The blocks' parameters are stacked over layers (model.py): the leading L axis is a batch of
matrices, and a kernel with several input or output axes is the matrix of their products,
e.g. qkv_kernel (L, D, C, K, H) is L matrices of shape (D, C·K·H). BLOCK_MATRICES says which
axes are which; optax's MuonDimensionNumbers treats every axis it does not name as a batch axis.
"""

import math

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers
from optax.contrib import _muon as optax_muon
from optax.contrib import scale_by_muon

from configurator import Config

# The blocks' weight matrices: (reduction axes, output axes) of the stacked array, i.e. the
# axes x @ W contracts with and the axes it produces. Axis 0 (layers) is a batch axis; so is a
# mixture of experts' expert axis, which comes next (moe.MoE: fc_kernel (L, E, D, F)), so its
# kernels' axes are these shifted by one.
BLOCK_MATRICES = {
    "qkv_kernel": MuonDimensionNumbers(reduction_axis=1, output_axis=(2, 3, 4)),  # (L, D, C, K, H)
    "out_kernel": MuonDimensionNumbers(reduction_axis=(1, 2), output_axis=3),  # (L, N, H, D)
    "fc_kernel": MuonDimensionNumbers(reduction_axis=1, output_axis=2),  # (L, D, F)
    "gate_kernel": MuonDimensionNumbers(reduction_axis=1, output_axis=2),  # (L, D, F)
    "proj_kernel": MuonDimensionNumbers(reduction_axis=1, output_axis=2),  # (L, F, D)
}
STACKS = ("blocks", "dense_blocks")  # model.GPT's layer stacks
ADAMW_MATRICES = ("router_kernel",)  # a mixture of experts' router: small, and its columns compete
NS_STEPS = 5  # Newton-Schulz iterations per update (optax's default coefficients 3.4445, -4.775, 2.0315)


def learning_rate(config: Config, step, peak: float | None = None):
    """Linear warmup to `peak` (default learning_rate), cosine decay to min_lr at lr_decay_iters,
    then flat. Another group's peak scales the whole curve, min_lr included."""
    floor = config.min_lr
    if peak is None:
        peak = config.learning_rate
    else:  # min_lr is in [0, learning_rate] (configurator checks it): keep the same ratio
        floor = peak * (config.min_lr / config.learning_rate if config.learning_rate else 0.0)
    if not config.decay_lr:
        return jnp.asarray(peak, jnp.float32)
    step = jnp.asarray(step, jnp.float32)
    warmup = peak * (step + 1) / (config.warmup_iters + 1)
    progress = (step - config.warmup_iters) / max(1, config.lr_decay_iters - config.warmup_iters)
    cosine = 0.5 * (1 + jnp.cos(math.pi * jnp.clip(progress, 0.0, 1.0)))
    decayed = floor + cosine * (peak - floor)
    return jnp.where(step < config.warmup_iters, warmup, decayed)


def decays(path, _) -> bool:
    """AdamW's weight decay on matrices and embeddings (LoRA's adapters too: towards the base model);
    never on biases or norm scales."""
    name = path[-1].key
    return name.endswith("kernel") or name in ("wte", "wpe", "lora_a", "lora_b")


def _muon_dimension_numbers(path, leaf):
    """MuonDimensionNumbers for a block weight matrix, None for a parameter AdamW updates."""
    keys = [k.key for k in path]
    name = keys[-1]
    if keys[0] not in STACKS or not name.endswith("kernel") or name in ADAMW_MATRICES:
        return None
    if name not in BLOCK_MATRICES:  # a new weight in model.py: say how it multiplies
        raise ValueError(
            f"training/optimizer.py: {'.'.join(keys)} {tuple(leaf.shape)} is a block weight "
            f"matrix whose axes Muon does not know: add it to BLOCK_MATRICES"
        )
    dims = BLOCK_MATRICES[name]
    shift = len(leaf.shape) - 1 - len(_axes(dims.reduction_axis)) - len(_axes(dims.output_axis))
    if not shift:
        return dims
    return MuonDimensionNumbers(
        reduction_axis=tuple(a + shift for a in _axes(dims.reduction_axis)),
        output_axis=tuple(a + shift for a in _axes(dims.output_axis)),
    )


def _axes(a) -> tuple:
    return (a,) if isinstance(a, int) else tuple(a)


def _group(path, leaf) -> str:
    return "adamw" if _muon_dimension_numbers(path, leaf) is None else "muon"


def param_groups(params) -> dict:
    """{'blocks.attn.qkv_kernel': 'muon', 'wte': 'adamw', ...}: which optimizer updates which
    parameter when optimizer='muon'. `params` may hold arrays or ShapeDtypeStructs."""
    return {
        ".".join(k.key for k in path): _group(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


def groups_summary(params) -> str:
    """One line for the start-up summary: the parameters in each group."""
    groups = param_groups(params)
    sizes = {path: math.prod(leaf.shape) for path, leaf in zip(groups, jax.tree.leaves(params))}
    parts = []
    for group in ("muon", "adamw"):
        names = [path for path, g in groups.items() if g == group]
        parts.append(f"{group} on {sum(sizes[n] for n in names):,} parameters ({', '.join(names)})")
    return "optimizer: " + "; ".join(parts)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    tx = adamw = optax.adamw(
        learning_rate=lambda count: learning_rate(config, count),
        b1=config.beta1,
        b2=config.beta2,
        weight_decay=config.weight_decay,
        mask=lambda params: jax.tree_util.tree_map_with_path(decays, params),
    )
    if config.optimizer == "muon":  # each parameter goes to one of the two, by param_groups
        tx = optax.partition(
            {"muon": muon(config), "adamw": adamw},
            param_labels=lambda params: jax.tree_util.tree_map_with_path(_group, params),
        )
    if config.grad_clip > 0:  # on the whole gradient, before either group sees it
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), tx)
    return tx


def muon(config: Config) -> optax.GradientTransformation:
    """Muon for the block matrices: optax.contrib.muon's own chain of steps. Not optax.contrib.muon
    itself: its AdamW half takes Muon's nesterov flag (so it would be NAdam) and decays every
    parameter it updates (norm scales and biases too), where the AdamW group here must be
    exactly optimizer='adamw''s."""

    def dimension_numbers(updates):  # the Muon half's tree: other parameters are masked out
        return jax.tree_util.tree_map_with_path(_muon_dimension_numbers, updates)

    # Updates are scaled by sqrt(max(1, fan_out / fan_in)): by scale_by_muon itself in optax 0.2.6,
    # by a step of its own (not exported from optax.contrib) from 0.2.7 on.
    width_scaling = (
        [optax_muon.scale_by_shape(weight_dimension_numbers=dimension_numbers)]
        if hasattr(optax_muon, "scale_by_shape")
        else []
    )
    return optax.chain(
        scale_by_muon(
            ns_steps=NS_STEPS, beta=config.muon_momentum, nesterov=True, weight_dimension_numbers=dimension_numbers
        ),
        *width_scaling,
        optax.add_decayed_weights(config.muon_weight_decay),
        optax.scale_by_learning_rate(lambda count: learning_rate(config, count, config.muon_learning_rate)),
    )


def state_shardings(tx: optax.GradientTransformation, abstract_opt_state, param_shardings, replicated):
    """The optimizer state's shardings: each copy of a parameter (moment, momentum) is sharded like
    the parameter; counts and the like are replicated. A group's copy has its other group's
    parameters masked out (optax.MaskedNode), and keeps those holes."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    return optax.tree_map_params(
        tx,
        lambda leaf, s: leaf if masked(leaf) else s,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )


def flops_per_step(params, config: Config) -> float:
    """FLOPs of Muon's Newton-Schulz iterations in one step, all devices (0 for AdamW; its and
    Muon's elementwise work are left out). Each of NS_STEPS iterations on an m x n matrix
    (m <= n, optax transposes it so) computes A = X·Xᵀ (2·m²·n), A·A (2·m³) and (bA + cA²)·X
    (2·m²·n): 4·m²·n + 2·m³ FLOPs, times the L matrices of a stacked weight."""
    if config.optimizer != "muon":
        return 0.0
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dims = _muon_dimension_numbers(path, leaf)
        if dims is None:
            continue
        rows = math.prod(leaf.shape[a] for a in _axes(dims.reduction_axis))
        cols = math.prod(leaf.shape[a] for a in _axes(dims.output_axis))
        m, n = min(rows, cols), max(rows, cols)
        total += math.prod(leaf.shape) // (m * n) * NS_STEPS * (4 * m * m * n + 2 * m**3)
    return total
