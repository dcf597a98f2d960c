"""GPT-2 in Flax NNX.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `mlp`, `layers`, ...)
as its `out_sharding` metadata; sharding.py maps those names to mesh axes, so this file knows
nothing about devices. The layers are stored stacked (one array per weight with a leading
`layers` axis) and run with lax.scan, so compile time does not grow with depth.

Shape suffixes name the axes: B batch, T time, D model width, N heads, H head size,
F MLP hidden, V vocabulary; BT is batch and time flattened into one axis.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # real vocabulary; logits of padding entries are -inf
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    dtype: str = "float32"  # compute dtype; parameters are always float32
    scan_layers: bool = True
    remat_policy: str = "none"
    pad_vocab_to_multiple: int = 1

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to_multiple
        return (self.vocab_size + m - 1) // m * m


def param(value, logical_axes) -> nnx.Param:
    """A float32 parameter whose `out_sharding` metadata holds logical axis names."""
    # eager_sharding=False: logical names can't be applied at creation; sharding.py turns
    # them into mesh shardings for the out_shardings of the jitted initializer instead.
    return nnx.Param(value.astype(jnp.float32), out_sharding=logical_axes, eager_sharding=False)


def normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def constrain(x, logical_axes):
    """Pin an activation's sharding by logical names, when sharding.py has set rules."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    rules = dict(rules)
    spec = jax.sharding.PartitionSpec(*(rules.get(name) for name in logical_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, config: GPTConfig):
        self.scale = param(jnp.ones(config.n_embd), ("norm",))
        self.bias = param(jnp.zeros(config.n_embd), ("norm",)) if config.bias else None

    def __call__(self, x_BxTxD):
        x = x_BxTxD.astype(jnp.float32)  # statistics in float32, even under bfloat16
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x_BxTxD.dtype)


class Attention(nnx.Module):
    def __init__(self, config: GPTConfig, key):
        D, N = config.n_embd, config.n_head
        H = D // N
        k_qkv, k_out = jax.random.split(key)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: scale residual writes
        self.qkv_kernel = param(normal(k_qkv, (D, 3, N, H), 0.02), ("embed", "qkv", "heads", "head_dim"))
        self.out_kernel = param(normal(k_out, (N, H, D), residual_std), ("heads", "head_dim", "embed"))
        self.qkv_bias = param(jnp.zeros((3, N, H)), ("qkv", "heads", "head_dim")) if config.bias else None
        self.out_bias = param(jnp.zeros(D), ("norm",)) if config.bias else None
        self.config = config

    def __call__(self, x_BTxD, batch_size: int, dropout_key=None):
        dtype = x_BTxD.dtype
        D, (_, _, N, H) = x_BTxD.shape[-1], self.qkv_kernel.shape
        B, T = batch_size, x_BTxD.shape[0] // batch_size
        qkv_BTx3NH = x_BTxD @ self.qkv_kernel[...].reshape(D, 3 * N * H).astype(dtype)
        if self.qkv_bias is not None:
            qkv_BTx3NH = qkv_BTx3NH + self.qkv_bias[...].reshape(3 * N * H).astype(dtype)
        qkv_BxTx3xNxH = constrain(qkv_BTx3NH.reshape(B, T, 3, N, H), ("batch", "seq", None, "heads", None))
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = (qkv_BxTx3xNxH[:, :, i] for i in range(3))
        y_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, is_causal=True)
        y_BTxD = y_BxTxNxH.reshape(B * T, N * H) @ self.out_kernel[...].reshape(N * H, D).astype(dtype)
        if self.out_bias is not None:
            y_BTxD = y_BTxD + self.out_bias[...].astype(dtype)
        return dropout(y_BTxD, self.config.dropout, dropout_key)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, key):
        D, F = config.n_embd, 4 * config.n_embd
        k_fc, k_proj = jax.random.split(key)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.fc_kernel = param(normal(k_fc, (D, F), 0.02), ("embed", "mlp"))
        self.proj_kernel = param(normal(k_proj, (F, D), residual_std), ("mlp", "embed"))
        self.fc_bias = param(jnp.zeros(F), ("mlp",)) if config.bias else None
        self.proj_bias = param(jnp.zeros(D), ("norm",)) if config.bias else None
        self.config = config

    def __call__(self, x_BTxD, dropout_key=None):
        dtype = x_BTxD.dtype
        h_BTxF = x_BTxD @ self.fc_kernel[...].astype(dtype)
        if self.fc_bias is not None:
            h_BTxF = h_BTxF + self.fc_bias[...].astype(dtype)
        h_BTxF = constrain(jax.nn.gelu(h_BTxF, approximate=True), ("batch", "mlp"))
        y_BTxD = h_BTxF @ self.proj_kernel[...].astype(dtype)
        if self.proj_bias is not None:
            y_BTxD = y_BTxD + self.proj_bias[...].astype(dtype)
        return dropout(y_BTxD, self.config.dropout, dropout_key)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, key):
        k_attn, k_mlp = jax.random.split(key)
        self.ln_1 = LayerNorm(config)
        self.attn = Attention(config, k_attn)
        self.ln_2 = LayerNorm(config)
        self.mlp = MLP(config, k_mlp)

    def __call__(self, x_BTxD, batch_size: int, dropout_key=None):
        k_attn, k_mlp = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        x_BTxD = x_BTxD + self.attn(self.ln_1(x_BTxD), batch_size, k_attn)
        x_BTxD = x_BTxD + self.mlp(self.ln_2(x_BTxD), k_mlp)
        return constrain(x_BTxD, ("batch", "embed_act"))


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, key):
        k_wte, k_wpe, k_blocks = jax.random.split(key, 3)
        V, D = config.padded_vocab_size, config.n_embd
        self.wte = param(normal(k_wte, (V, D), 0.02), ("vocab", "embed"))  # also the output layer
        self.wpe = param(normal(k_wpe, (config.block_size, D), 0.02), ("seq_table", "embed"))

        # One Block per layer key, stacked: each weight gets a leading `layers` axis.
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(layer_key):
            return Block(config, layer_key)

        self.blocks = make_blocks(jax.random.split(k_blocks, config.n_layer))
        self.ln_f = LayerNorm(config)
        self.config = config

    def __call__(self, idx_BxT, dropout_key=None):
        """Token ids (B, T) -> float32 logits (B, T, padded vocab). Dropout only with a key."""
        config = self.config
        B, T = idx_BxT.shape
        if T > config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {config.block_size}")
        dtype = jnp.dtype(config.dtype)
        x_BxTxD = (self.wte[...][idx_BxT] + self.wpe[...][:T]).astype(dtype)
        # Between the matmuls, activations are 2-D (B*T, D): XLA:CPU's fast matmul path wants
        # one contracting dimension, and a weight gradient over (B, T) is 2x slower there.
        x_BTxD = constrain(x_BxTxD.reshape(B * T, -1), ("batch", "embed_act"))
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        x_BTxD = dropout(x_BTxD, config.dropout, k_emb)
        x_BTxD = self.ln_f(self._run_blocks(x_BTxD, B, k_layers))
        logits_BTxV = jax.lax.dot_general(x_BTxD, self.wte[...].astype(dtype), (((1,), (1,)), ((), ())),
                                          preferred_element_type=jnp.float32)
        logits_BxTxV = logits_BTxV.reshape(B, T, -1)
        if config.padded_vocab_size != config.vocab_size:
            is_real_token = jnp.arange(config.padded_vocab_size) < config.vocab_size
            logits_BxTxV = jnp.where(is_real_token, logits_BxTxV, -jnp.inf)
        return logits_BxTxV

    def _run_blocks(self, x_BTxD, batch_size: int, dropout_key):
        config = self.config
        graphdef, stacked_state = nnx.split(self.blocks)
        layer_keys = None if dropout_key is None else jax.random.split(dropout_key, config.n_layer)

        def one_layer(x_BTxD, layer_inputs):
            layer_state, layer_key = layer_inputs
            return nnx.merge(graphdef, layer_state)(x_BTxD, batch_size, layer_key), None

        if config.remat_policy != "none":
            one_layer = jax.checkpoint(one_layer, policy=REMAT_POLICIES[config.remat_policy])
        if config.scan_layers:
            x_BTxD, _ = jax.lax.scan(one_layer, x_BTxD, (stacked_state, layer_keys))
        else:  # unrolled: same stacked weights, one copy of the layer per depth in the program
            for i in range(config.n_layer):
                layer_i = jax.tree.map(lambda a: a[i], (stacked_state, layer_keys))
                x_BTxD, _ = one_layer(x_BTxD, layer_i)
        return x_BTxD


def count_params(config: GPTConfig) -> int:
    """Number of parameters, computed from shapes only (nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: GPT(config, jax.random.key(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) + attention scores/values.

    6N counts every matmul weight (the tied embedding counts once, as the output layer);
    12·L·T·D is the attention's QK^T and AV over a context of T tokens.
    """
    T = seq_len or config.block_size
    n_matmul = count_params(config) - config.block_size * config.n_embd  # wpe is a lookup
    return 6 * n_matmul + 12 * config.n_layer * T * config.n_embd
