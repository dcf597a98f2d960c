"""Parameters with logical axis names, their initializers, and dropout: what every file of layers/
builds on (blocks.py, lora.py). jax/flax only."""

import jax
import jax.numpy as jnp
from flax import nnx


def param(value, logical_axes) -> nnx.Param:
    """A float32 parameter whose `out_sharding` metadata holds logical axis names."""
    # eager_sharding=False: logical names can't be applied at creation; sharding.py turns
    # them into mesh shardings for the out_shardings of the jitted initializer instead.
    return nnx.Param(value.astype(jnp.float32), out_sharding=logical_axes, eager_sharding=False)


def normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
