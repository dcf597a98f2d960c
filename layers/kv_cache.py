"""Decoding's KV cache: the keys and values of every layer for the tokens seen so far, which
model.GPT.decode reads and extends. `config` is a model.GPTConfig (read by name, as in layers/blocks.py).

A decode step reads the cache and writes one token per row, so its cost should follow the bytes
it must read: the layer stack only reads each layer's slice (the cache is not carried through
the layer scan, which would copy it), attention covers the filled prefix the caller names
(`attend`: inference/generate.py and inference/engine.py bucket it), and the new tokens of every layer are written
after the stack, in one scatter per array.
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

    The same class holds one layer's slice (B, S, K, H) inside the layer stack, and the new
    tokens' keys and values as stored (encode). The cache does not know how much of itself is
    filled: the caller says where new tokens go (start_B) and attention sees only the positions
    before them, so stale entries past them are harmless.
    """
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None  # int8 caches only
    v_scale: jax.Array | None = None

    @property
    def length(self) -> int:
        """S, the positions it holds."""
        return self.k.shape[-3]

    def layer(self, index, n: int | None = None) -> "KVCache":
        """Layer `index`'s slice (B, n, K, H) of the whole cache: its first n positions (default all),
        in one dynamic slice (index may be traced: the layer scan's)."""
        n = self.length if n is None else min(n, self.length)
        return jax.tree.map(lambda a: jax.lax.dynamic_slice(a, (index,) + (0,) * (a.ndim - 1),
                                                            (1, a.shape[1], n) + a.shape[3:])[0], self)

    def encode(self, k_BxTxKxH, v_BxTxKxH) -> "KVCache":
        """New tokens' keys and values as this cache stores them: cast, or rounded to int8 with scales."""
        if self.k_scale is None:
            return KVCache(k_BxTxKxH.astype(self.k.dtype), v_BxTxKxH.astype(self.v.dtype))
        (k, k_scale), (v, v_scale) = (quantization.quantize_int8(x, axis=-1) for x in (k_BxTxKxH, v_BxTxKxH))
        return KVCache(k, v, k_scale, v_scale)

    def read(self, dtype):
        """(keys, values) in `dtype`, an int8 cache's scaled back."""
        if self.k_scale is None:
            return self.k.astype(dtype), self.v.astype(dtype)
        return tuple((x.astype(jnp.float32) * scale).astype(dtype)
                     for x, scale in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def attend(self, q_BxTxNxH, new: "KVCache", start_B):
        """Attention of T new queries per row (row b's at positions start_B[b] + [0, T)) over this
        layer's cached positions before start_B[b] and the new tokens' own keys (`new`, as encode
        stored them; causal among themselves): one softmax over both, so the new tokens need not
        be in the cache first. An int8 cache is read as int8: its key scales multiply the scores
        and its value scales the probabilities, (q·k)·s = q·(k·s), so no dequantized copy of the
        cache is made."""
        (B, T, N, H), K, S = q_BxTxNxH.shape, self.k.shape[-2], self.length
        G, dtype = N // K, q_BxTxNxH.dtype
        q_BxTxKxGxH = (q_BxTxNxH * H ** -0.5).reshape(B, T, K, G, H)  # query head k·G + g uses key head k
        s_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, self.k.astype(dtype),
                                 preferred_element_type=jnp.float32)
        if self.k_scale is not None:
            s_BxKxGxTxS = s_BxKxGxTxS * self.k_scale[..., 0].transpose(0, 2, 1)[:, :, None, None, :]
        cached_visible = (jnp.arange(S) < start_B[:, None])[:, None, None, None, :]
        s_BxKxGxTxS = jnp.where(cached_visible, s_BxKxGxTxS, -jnp.inf)
        new_k_BxTxKxH, new_v_BxTxKxH = new.read(dtype)
        s_BxKxGxTxT = jnp.einsum("btkgh,bukh->bkgtu", q_BxTxKxGxH, new_k_BxTxKxH, preferred_element_type=jnp.float32)
        s_BxKxGxTxT = jnp.where(jnp.tri(T, dtype=bool), s_BxKxGxTxT, -jnp.inf)
        # every query sees itself, so the max is finite
        max_BxKxGxT = jnp.maximum(s_BxKxGxTxS.max(-1, initial=-jnp.inf), s_BxKxGxTxT.max(-1))[..., None]
        p_BxKxGxTxS, p_BxKxGxTxT = jnp.exp(s_BxKxGxTxS - max_BxKxGxT), jnp.exp(s_BxKxGxTxT - max_BxKxGxT)
        sum_BxKxGxT = p_BxKxGxTxS.sum(-1) + p_BxKxGxTxT.sum(-1)
        if self.v_scale is not None:
            p_BxKxGxTxS = p_BxKxGxTxS * self.v_scale[..., 0].transpose(0, 2, 1)[:, :, None, None, :]
        o_BxTxKxGxH = (jnp.einsum("bkgts,bskh->btkgh", p_BxKxGxTxS.astype(dtype), self.v.astype(dtype),
                                  preferred_element_type=jnp.float32)
                       + jnp.einsum("bkgtu,bukh->btkgh", p_BxKxGxTxT.astype(dtype), new_v_BxTxKxH,
                                    preferred_element_type=jnp.float32))
        o_BxTxKxGxH = o_BxTxKxGxH / sum_BxKxGxT.transpose(0, 3, 1, 2)[..., None]
        return o_BxTxKxGxH.reshape(B, T, N, H).astype(dtype)

    def write(self, new: "KVCache", start_B) -> "KVCache":
        """The whole cache (L, B, S, K, H) with every layer's T new tokens per row (`new`, (L, B, T,
        K, H), as encode stored them) written at positions start_B[b] + [0, T). One token per row
        (a decode step) is one scatter per array, in place; longer runs go row by row."""
        B, T = new.k.shape[1], new.k.shape[2]
        rows_B = jnp.arange(B)
        per_row = jax.vmap(lambda cache, x, start: jax.lax.dynamic_update_slice_in_dim(cache, x, start, axis=1),
                           in_axes=(1, 1, 0), out_axes=1)

        def put(cache, x):
            if T == 1:
                return cache.at[:, rows_B, start_B].set(x[:, :, 0], indices_are_sorted=True, unique_indices=True,
                                                        mode="promise_in_bounds")
            return per_row(cache, x, start_B)

        return KVCache(**{name: constrain(put(getattr(self, name), getattr(new, name)), CACHE_AXES)
                          for name in self._names()})

    def _names(self):
        return ("k", "v") if self.k_scale is None else ("k", "v", "k_scale", "v_scale")

    def padded(self, length: int) -> "KVCache":
        """This cache (L, B, T, K, H) of a prompt's T tokens, as the first T positions of one of
        `length` positions (the rest zeros)."""
        pad = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, length - a.shape[2])] + [(0, 0)] * (a.ndim - 3))
        return jax.tree.map(lambda a: constrain(pad(a), CACHE_AXES), self)


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
