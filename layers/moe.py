"""A mixture of experts in place of a block's MLP (model.GPTConfig's n_experts > 0): the router,
GShard's one-hot dispatch and combine with a capacity per expert, the experts' matmuls split over
the `expert` mesh axis, and the router's statistics for the load-balancing and z-losses.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers import quantization
from layers.blocks import ACTIVATIONS, MLPS, constrain, residual_init
from layers.params import dropout, normal, param


def expert_capacity(config, tokens_per_row: int) -> int:
    """Slots per expert per batch row: capacity_factor·T·k/E rounded up, or T (no token dropped:
    a token picks an expert at most once)."""
    if not config.capacity_factor:
        return tokens_per_row
    slots = math.ceil(config.capacity_factor * tokens_per_row * config.experts_per_token / config.n_experts)
    return min(tokens_per_row, slots)


def expert_matmul(x_ExNxI, kernel_ExIxO, quantize: str):
    """Each expert's tokens times its own matrix (int8/fp8 operands if asked)."""
    return jax.vmap(lambda x, w: quantization.matmul(x, w.astype(x.dtype), quantize))(x_ExNxI, kernel_ExIxO)


class MoE(nnx.Module):
    """A mixture of experts in place of the MLP (Switch, Mixtral, DeepSeek).

    A float32 router scores the n_experts experts for each token; the token goes to its
    experts_per_token best, and their outputs are summed weighted by the router's softmax
    probabilities (renormalised over the chosen experts when there are several, as Mixtral; a
    single expert keeps its probability, as Switch, so the router still gets a gradient).
    Each expert is an MLP of the config's kind (gelu, relu2, swiglu) without biases.

    Dispatch and combine are one-hot einsums per batch row (GShard): an expert takes up to C
    tokens of a row, first choices first, then in order of position; a token over capacity
    skips that expert (its residual stream passes on). C = T (capacity_factor 0) drops
    nothing. The `expert` mesh axis splits the (E, B, C, D) buffers by expert.
    n_shared_experts adds one ordinary MLP, n_shared_experts experts wide, for every token.
    """

    def __init__(self, config, key):
        D, F, E = config.n_embd, config.expert_hidden_size, config.n_experts
        k_router, k_gate, k_fc, k_proj, k_shared = jax.random.split(key, 5)
        self.router_kernel = param(normal(k_router, (D, E), 0.02), ("embed", None))
        self.gate_kernel = (
            param(normal(k_gate, (E, D, F), 0.02), ("experts", "embed", "mlp")) if (config.mlp == "swiglu") else None
        )
        self.fc_kernel = param(normal(k_fc, (E, D, F), 0.02), ("experts", "embed", "mlp"))
        self.proj_kernel = param(residual_init(k_proj, (E, F, D), config), ("experts", "mlp", "embed"))
        self.shared = (
            MLPS[config.mlp](dataclasses.replace(config, mlp_hidden=F * config.n_shared_experts), k_shared)
            if config.n_shared_experts
            else None
        )
        self.config = config

    def route(self, x_BxTxD):
        """(weights, experts) of each token's choices, (B, T, k) each, and the router's float32
        logits (B, T, E)."""
        logits_BxTxE = jnp.einsum("btd,de->bte", x_BxTxD.astype(jnp.float32), self.router_kernel[...])
        weights_BxTxK, experts_BxTxK = jax.lax.top_k(jax.nn.softmax(logits_BxTxE), self.config.experts_per_token)
        if self.config.experts_per_token > 1:
            weights_BxTxK = weights_BxTxK / weights_BxTxK.sum(-1, keepdims=True)
        return weights_BxTxK, experts_BxTxK, logits_BxTxE

    def __call__(self, x_BTxD, batch_size: int, dropout_key=None):
        """(y, stats): the layer's output (B·T, D) and the router's statistics for training."""
        c = self.config
        B, E, K = batch_size, c.n_experts, c.experts_per_token
        T = x_BTxD.shape[0] // B
        C = expert_capacity(c, T)
        x_BxTxD = x_BTxD.reshape(B, T, -1)
        weights_BxTxK, experts_BxTxK, logits_BxTxE = self.route(x_BxTxD)
        # A slot in the chosen expert's buffer for every (token, choice): choices ranked first by
        # k, then by position; a slot >= C is one-hot to nothing, so that choice is dropped.
        chosen_BxKxTxE = jax.nn.one_hot(experts_BxTxK.swapaxes(1, 2), E, dtype=jnp.int32)
        rank_BxKxTxE = jnp.cumsum(chosen_BxKxTxE.reshape(B, K * T, E), axis=1).reshape(B, K, T, E)
        slot_BxTxK = ((rank_BxKxTxE * chosen_BxKxTxE).sum(-1) - 1).swapaxes(1, 2)
        slot_BxTxKxC = jax.nn.one_hot(slot_BxTxK, C, dtype=jnp.float32)
        expert_BxTxKxE = jax.nn.one_hot(experts_BxTxK, E, dtype=jnp.float32)
        dispatch_BxTxExC = jnp.einsum("btke,btkc->btec", expert_BxTxKxE, slot_BxTxKxC)
        combine_BxTxExC = jnp.einsum("btke,btkc->btec", expert_BxTxKxE * weights_BxTxK[..., None], slot_BxTxKxC)

        # Dispatch where the tokens are, then move each expert's slots to its devices: the change of
        # sharding from rows (over expert) to experts (over expert) is one all-to-all.
        dtype = x_BTxD.dtype
        in_ExBxCxD = constrain(
            jnp.einsum("btec,btd->ebcd", dispatch_BxTxExC.astype(dtype), x_BxTxD), (None, "batch", None, "embed_act")
        )
        in_ExNxD = constrain(in_ExBxCxD, ("experts", "expert_batch", None, "embed_act")).reshape(E, B * C, -1)
        h_ExNxF = expert_matmul(in_ExNxD, self.fc_kernel[...], c.quantization)
        if self.gate_kernel is not None:  # swiglu
            h_ExNxF = jax.nn.silu(expert_matmul(in_ExNxD, self.gate_kernel[...], c.quantization)) * h_ExNxF
        else:
            h_ExNxF = ACTIVATIONS[c.mlp](h_ExNxF)
        out_ExNxD = expert_matmul(
            constrain(h_ExNxF, ("experts", "expert_batch", "mlp")), self.proj_kernel[...], c.quantization
        )
        out_ExBxCxD = constrain(out_ExNxD.reshape(E, B, C, -1), ("experts", "expert_batch", None, "embed_act"))
        out_ExBxCxD = constrain(out_ExBxCxD, (None, "batch", None, "embed_act"))  # back: all-to-all
        y_BxTxD = jnp.einsum("btec,ebcd->btd", combine_BxTxExC.astype(dtype), out_ExBxCxD)
        y_BTxD = y_BxTxD.reshape(B * T, -1)
        if self.shared is not None:
            y_BTxD = y_BTxD + self.shared(x_BTxD)
        return dropout(y_BTxD, c.dropout, dropout_key), router_stats(logits_BxTxE, expert_BxTxKxE, dispatch_BxTxExC)


def router_stats(logits_BxTxE, expert_BxTxKxE, dispatch_BxTxExC) -> dict:
    """What training adds to the loss and logs, per layer:
    balance_loss  E · Σ_e f_e · P_e, f_e the share of the routed choices that picked expert e
                  and P_e its mean router probability (Switch Transformer; 1.0 when balanced)
    z_loss        mean of logsumexp(router logits)² (ST-MoE: keeps the logits small)
    dropped       the share of the choices over capacity
    load          f_e, (E,)
    """
    E, choices = logits_BxTxE.shape[-1], expert_BxTxKxE[..., 0].size
    load_E = expert_BxTxKxE.sum((0, 1, 2)) / choices
    probability_E = jax.nn.softmax(logits_BxTxE).mean((0, 1))
    return {
        "balance_loss": E * jnp.sum(load_E * probability_E),
        "z_loss": jnp.square(jax.nn.logsumexp(logits_BxTxE, -1)).mean(),
        "dropped": (choices - dispatch_BxTxExC.sum()) / choices,
        "load": load_E,
    }
