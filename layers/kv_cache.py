"""Decoding's KV cache: the keys and values of every layer for the tokens seen so far, which
model.GPT.decode reads and extends. `config` is a model.GPTConfig (read by name, as in layers.py).
"""

import dataclasses

import jax
import jax.numpy as jnp

from layers import quantization
from layers.blocks import constrain

CACHE_AXES = ("layers", "batch", "seq", "heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of the tokens seen so far: (L, B, S, K, H) each, in the compute dtype,
    with K = n_kv_head (so grouped-query attention shrinks the cache by n_head / K). An int8
    cache also holds a float32 scale per token and head, (L, B, S, K, 1): each token's key (value)
    head is rounded on its own grid, max|.| / 127, when it is written.

    The layer scan hands each layer its (B, S, K, H) slice. The cache does not know how
    much of itself is filled: the caller says where new tokens go (start_B) and the causal
    mask hides everything past them, so stale entries there are harmless.
    """
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None  # int8 caches only
    v_scale: jax.Array | None = None

    def write(self, k_BxTxKxH, v_BxTxKxH, start_B) -> "KVCache":
        """One layer's cache with T new positions per row written at start_B[b] (per row)."""
        put = jax.vmap(lambda cache_SxKxH, new_TxKxH, start:
                       jax.lax.dynamic_update_slice_in_dim(cache_SxKxH, new_TxKxH.astype(cache_SxKxH.dtype),
                                                           start, axis=0))
        new = {"k": k_BxTxKxH, "v": v_BxTxKxH}
        if self.k_scale is not None:
            for name in ("k", "v"):
                new[name], new[f"{name}_scale"] = quantization.quantize_int8(new[name], axis=-1)
        return KVCache(**{name: constrain(put(getattr(self, name), x, start_B), CACHE_AXES[1:])
                          for name, x in new.items()})

    def read(self, dtype):
        """This layer's (keys, values) in `dtype`, an int8 cache's scaled back."""
        if self.k_scale is None:
            return self.k, self.v
        return tuple((x.astype(jnp.float32) * scale).astype(dtype)
                     for x, scale in ((self.k, self.k_scale), (self.v, self.v_scale)))


def init_cache(config, batch_size: int, length: int) -> KVCache:
    """An empty cache for `batch_size` rows of up to `length` tokens, in config.kv_cache_dtype, sharded
    like the model (heads over `tensor`, rows over the batch axes) when sharding rules are active."""
    shape = (config.n_layer, batch_size, length, config.kv_heads, config.n_embd // config.n_head)
    dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    zeros = lambda shape, dtype: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
    if dtype != "int8":
        return KVCache(zeros(shape, dtype), zeros(shape, dtype))
    scales = shape[:-1] + (1,)
    return KVCache(zeros(shape, jnp.int8), zeros(shape, jnp.int8), zeros(scales, jnp.float32),
                   zeros(scales, jnp.float32))
