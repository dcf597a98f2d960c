"""The building blocks of model.py's GPT, and of layers/moe.py's experts: sharding constraints by logical
axis names (layers/params.py makes parameters that carry them), linear layers (int8/fp8 operands through
layers/quantization.py), the norms and the MLPs. `config` is a model.GPTConfig (its fields are read by
name; this file does not import model.py, so layers/moe.py can use it too).
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd

from layers import lora, quantization
from layers.params import dropout, normal, param


def residual_init(key, shape, config):
    """The output projections that write into the residual stream: GPT-2 scales their init down
    with depth; zero_init_proj starts them at 0 (modded-nanogpt), so each block is the identity
    at step 0 and only its output projection gets a gradient at first."""
    if config.zero_init_proj:
        return jnp.zeros(shape, jnp.float32)
    return normal(key, shape, 0.02 / math.sqrt(2 * config.n_layer))


def constrain(x, logical_axes):
    """Pin an activation's sharding by logical names, when sharding.py has set rules."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    rules = dict(rules)
    # A dimension the mesh axes don't divide stays replicated (as sharding.param_shardings leaves
    # such a parameter): a grouped-query cache of 2 heads on tensor=8, a prefill's one row on data=2.
    spec = jax.sharding.PartitionSpec(
        *(
            rules.get(name) if name is not None and splits(dim, name) else None
            for dim, name in zip(x.shape, logical_axes)
        )
    )
    return jax.lax.with_sharding_constraint(x, spec)


def splits(count: int, logical_axis: str) -> bool:
    """Whether constrain would split `count` entries of `logical_axis` (its mesh axes divide them);
    True when no sharding rules are active."""
    rules, mesh = dict(spmd.get_logical_axis_rules() or ()), jax.sharding.get_abstract_mesh()
    axes = rules.get(logical_axis)
    if axes is None or mesh.empty:
        return True
    return count % math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))) == 0


def sequence_axis() -> tuple[str | None, int]:
    """The mesh axis that splits each row's tokens (logical 'seq': `context`) and its size; (None, 1)
    when none does."""
    rules, mesh = dict(spmd.get_logical_axis_rules() or ()), jax.sharding.get_abstract_mesh()
    axes = rules.get("seq")
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if mesh.empty or len(axes) != 1 or mesh.shape.get(axes[0], 1) == 1:
        return None, 1
    return axes[0], mesh.shape[axes[0]]


def linear(x_BTxI, kernel_IxO, bias, quantize: str = "none"):
    """x @ kernel (+ bias) in the compute dtype of x, from int8/fp8 operands if asked.
    kernel and bias may be nnx.Params or arrays."""
    kernel_IxO = kernel_IxO[...]
    if isinstance(kernel_IxO, quantization.Int8Weight):  # stored as int8 for serving
        y_BTxO = kernel_IxO.matmul(x_BTxI, quantize)
    else:
        y_BTxO = quantization.matmul(x_BTxI, kernel_IxO.astype(x_BTxI.dtype), quantize)
    return y_BTxO if bias is None else y_BTxO + bias[...].astype(x_BTxI.dtype)


class LayerNorm(nnx.Module):
    """GPT-2's: centre, scale to unit variance, then a learned scale and (with bias) shift."""

    def __init__(self, config):
        self.scale = param(jnp.ones(config.n_embd), ("norm",))
        self.bias = param(jnp.zeros(config.n_embd), ("norm",)) if config.bias else None
        self.eps = config.norm_eps

    def __call__(self, x_BxTxD):
        return layer_norm(x_BxTxD, self.scale[...], None if self.bias is None else self.bias[...], self.eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x_xD, scale_D, bias_D, eps: float):
    """(x - mean) / std * scale (+ bias) over the last axis, statistics in float32 even under
    bfloat16. Its backward is written out (a few passes over x) rather than left to autodiff,
    which made XLA:CPU run ~16 small kernels per norm."""
    return _layer_norm_fwd(x_xD, scale_D, bias_D, eps)[0]


def _layer_norm_fwd(x_xD, scale_D, bias_D, eps):
    x = x_xD.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + eps)
    y = (x - mean) * rstd * scale_D
    if bias_D is not None:
        y = y + bias_D
    return y.astype(x_xD.dtype), (x_xD, mean, rstd, scale_D, bias_D)


def _layer_norm_bwd(eps, saved, dy_xD):
    x_xD, mean, rstd, scale_D, bias_D = saved
    xhat = (x_xD.astype(jnp.float32) - mean) * rstd
    dy = dy_xD.astype(jnp.float32)
    g = dy * scale_D
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(dy.ndim - 1))
    dbias = None if bias_D is None else dy.sum(rows)
    return dx.astype(x_xD.dtype), (dy * xhat).sum(rows), dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class RMSNorm(nnx.Module):
    """Llama's: divide by the root mean square (no centring), times a learned scale; no bias."""

    def __init__(self, config):
        self.scale = param(jnp.ones(config.n_embd), ("norm",))
        self.eps = config.norm_eps

    def __call__(self, x_BxTxD):
        x = x_BxTxD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps) * self.scale[...]
        return y.astype(x_BxTxD.dtype)


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def no_head_norm(x_BxTxNxH, config):
    return x_BxTxNxH


def rms_head_norm(x_BxTxNxH, config):
    """qk_norm: each query and key head divided by its root mean square, with no learned scale
    (modded-nanogpt's; OLMo-2 and Qwen3 add one). Scores are then bounded by sqrt(H), so attention
    logits cannot blow up. In float32, like the other norms."""
    x = x_BxTxNxH.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + config.norm_eps)).astype(x_BxTxNxH.dtype)


HEAD_NORMS = {False: no_head_norm, True: rms_head_norm}  # by config.qk_norm


def gelu(h):
    return jax.nn.gelu(h, approximate=True)  # GPT-2's tanh approximation


def relu_squared(h):
    return jnp.square(jax.nn.relu(h))  # modded-nanogpt's (So et al., Primer, 2021)


ACTIVATIONS = {"gelu": gelu, "relu2": relu_squared}


class MLP(nnx.Module):
    """GPT-2's: proj(gelu(fc(x))); mlp='relu2': proj(relu(fc(x))²), same two matrices (each with its
    LoRA adapter when targeted: `up`, `down`)."""

    def __init__(self, config, key):
        D, F = config.n_embd, config.mlp_hidden_size
        k_fc, k_proj = jax.random.split(key)
        self.fc_kernel = param(normal(k_fc, (D, F), 0.02), ("embed", "mlp"))
        self.proj_kernel = param(residual_init(k_proj, (F, D), config), ("mlp", "embed"))
        self.fc_bias = param(jnp.zeros(F), ("mlp",)) if config.bias else None
        self.proj_bias = param(jnp.zeros(D), ("norm",)) if config.bias else None
        self.up_lora = lora.adapter(config, "up", key, (D,), ("embed",), (F,), ("mlp",))
        self.down_lora = lora.adapter(config, "down", key, (F,), ("mlp",), (D,), ("embed",))
        self.config = config

    def __call__(self, x_BTxD, dropout_key=None):
        q, k_lora = self.config.quantization, lora.dropout_key(dropout_key)
        h_BTxF = lora.add(self.up_lora, x_BTxD, linear(x_BTxD, self.fc_kernel, self.fc_bias, q), k_lora)
        h_BTxF = constrain(ACTIVATIONS[self.config.mlp](h_BTxF), ("tokens", "mlp"))
        y_BTxD = lora.add(self.down_lora, h_BTxF, linear(h_BTxF, self.proj_kernel, self.proj_bias, q), k_lora)
        return dropout(y_BTxD, self.config.dropout, dropout_key)


class SwiGLU(nnx.Module):
    """Llama's: proj(silu(gate(x)) * fc(x)), a gated unit with three matrices (LoRA: `gate`, `up`, `down`)."""

    def __init__(self, config, key):
        D, F = config.n_embd, config.mlp_hidden_size
        k_gate, k_fc, k_proj = jax.random.split(key, 3)
        self.gate_kernel = param(normal(k_gate, (D, F), 0.02), ("embed", "mlp"))
        self.fc_kernel = param(normal(k_fc, (D, F), 0.02), ("embed", "mlp"))
        self.proj_kernel = param(residual_init(k_proj, (F, D), config), ("mlp", "embed"))
        self.gate_bias = param(jnp.zeros(F), ("mlp",)) if config.bias else None
        self.fc_bias = param(jnp.zeros(F), ("mlp",)) if config.bias else None
        self.proj_bias = param(jnp.zeros(D), ("norm",)) if config.bias else None
        self.gate_lora = lora.adapter(config, "gate", key, (D,), ("embed",), (F,), ("mlp",))
        self.up_lora = lora.adapter(config, "up", key, (D,), ("embed",), (F,), ("mlp",))
        self.down_lora = lora.adapter(config, "down", key, (F,), ("mlp",), (D,), ("embed",))
        self.config = config

    def __call__(self, x_BTxD, dropout_key=None):
        q, k_lora = self.config.quantization, lora.dropout_key(dropout_key)
        gate_BTxF = lora.add(self.gate_lora, x_BTxD, linear(x_BTxD, self.gate_kernel, self.gate_bias, q), k_lora)
        h_BTxF = jax.nn.silu(gate_BTxF) * lora.add(
            self.up_lora, x_BTxD, linear(x_BTxD, self.fc_kernel, self.fc_bias, q), k_lora
        )
        h_BTxF = constrain(h_BTxF, ("tokens", "mlp"))
        y_BTxD = lora.add(self.down_lora, h_BTxF, linear(h_BTxF, self.proj_kernel, self.proj_bias, q), k_lora)
        return dropout(y_BTxD, self.config.dropout, dropout_key)


MLPS = {"gelu": MLP, "relu2": MLP, "swiglu": SwiGLU}
