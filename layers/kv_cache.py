"""Decoding's KV cache: the keys and values of every layer for the tokens seen so far, which
model.GPT.decode reads and extends. `config` is a model.GPTConfig (read by name, as in layers/blocks.py).

A decode step reads the cache and writes one token per row, so its cost should follow the bytes
it must read: the layer stack only reads each layer's slice (the cache is not carried through
the layer scan, which would copy it), attention covers the filled prefix the caller names
(Prefix: inference/generate.py buckets it) or, through layers/decode_attention.py's kernel, each
block of rows' filled positions (Filled: inference/engine.py's slots on one TPU chip), and the new
tokens of every layer are written after the stack, in place (layers/cache_write.py's kernel on one TPU
chip; elsewhere a scatter per array, per layer at large batches; an int8 cache's scales with a select).
"""

import dataclasses

import jax
import jax.numpy as jnp

from layers import cache_write, decode_attention, quantization
from layers.blocks import constrain, splits

# Keys and values (L, B, S, K·H): a kv head's H lanes are contiguous, so splitting the last axis over
# `tensor` keeps whole heads on a device (when it divides K: cache_axes); an int8 cache's scales (L, B, S, K).
CACHE_AXES = ("layers", "batch", "seq", "heads")
# A decode step writes its new keys (values) in one scatter up to this many (layer, row) pairs, and
# in one scatter per layer past it (KVCache.write: the v5e's measurements).
ONE_SCATTER_MAX_PAIRS = 768


@dataclasses.dataclass(frozen=True)
class Prefix:
    """How a decode step reads the cache: each layer's first `positions` positions (None: all of them),
    by attention written out for XLA. The caller that knows every row's start is below `positions` reads
    no more than it must (inference/generate.py buckets it)."""

    positions: int | None = None

    def layer(self, cache: "KVCache", index, rows: int) -> "KVCache":
        return cache.layer(index, self.positions, rows)


@dataclasses.dataclass(frozen=True)
class Filled:
    """How a decode step reads the cache: each block of rows' filled positions, through
    layers/decode_attention.py's kernel, which reads the whole cache in place (one token per row). The
    cheaper step when rows differ in length: a serving engine's slots on one TPU chip."""

    def layer(self, cache: "KVCache", index, rows: int) -> "InPlaceLayer":
        return InPlaceLayer(cache, index)


FILLED = Filled()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values as the cache stores them: (L, B, S, K·H) each for the whole cache, in the
    compute dtype, with K = n_kv_head (so grouped-query attention shrinks the cache by n_head / K) and
    each kv head's H values side by side in the last axis. An int8 cache also holds a float32 scale per
    token and head, (L, B, S, K): each token's key (value) head is rounded on its own grid, max|.| /
    127, when it is written. The same arrays without the leading L are one layer's slice (layer), and
    new tokens' keys and values come in this form too (encode), so that a layer's attention and the
    write after the stack see them as stored.

    Why K·H in one axis: a TPU tiles an array's last two axes in (8, 128) tiles, so (S, K·H) =
    (positions, 768) for GPT-2 is stored as it is, where (K, H) = (12, 64) was padded to (16, 128),
    2.67x the bytes for every read (bench/NOTES.md). Attention never splits that axis (a relayout on
    a TPU): it multiplies by a block-diagonal copy of the queries instead (attend).

    The cache does not know how much of itself is filled: the caller says where new tokens go
    (start_B) and attention sees only the positions before them, so stale entries past them are
    harmless.
    """

    k: jax.Array
    v: jax.Array
    kv_heads: int = dataclasses.field(metadata=dict(static=True))  # K: the last axis is K·H
    k_scale: jax.Array | None = None  # int8 caches only
    v_scale: jax.Array | None = None

    @property
    def capacity(self) -> int:
        """S, the positions it holds (a layer's slice: the positions it was cut to)."""
        return self.k.shape[-2]

    def layer(self, index, n: int | None = None, rows: int | None = None) -> "KVCache":
        """Layer `index`'s slice (rows, n, K·H) of the whole cache: its first n positions and rows
        (default all), in one dynamic slice (index may be traced: the layer scan's). Sliced in one go
        so that XLA reads them inside the attention (a slice of the layer's whole cache first was
        materialised: a copy per layer and step on TPUs)."""
        n = self.capacity if n is None else min(n, self.capacity)
        return jax.tree.map(
            lambda a: jax.lax.dynamic_slice(
                a, (index,) + (0,) * (a.ndim - 1), (1, rows or a.shape[1], n) + a.shape[3:]
            )[0],
            self,
        )

    def encode(self, k_BxTxKxH, v_BxTxKxH) -> "KVCache":
        """New tokens' keys and values (B, T, K·H) as this cache stores them: cast, or rounded to int8
        with scales (B, T, K)."""
        B, T, K, H = k_BxTxKxH.shape
        merged = lambda x_BxTxKxH: x_BxTxKxH.reshape(B, T, K * H)
        if self.k_scale is None:
            return KVCache(merged(k_BxTxKxH).astype(self.k.dtype), merged(v_BxTxKxH).astype(self.v.dtype), K)
        (k, k_scale), (v, v_scale) = (quantization.quantize_int8(x, axis=-1) for x in (k_BxTxKxH, v_BxTxKxH))
        return KVCache(merged(k), merged(v), K, k_scale[..., 0], v_scale[..., 0])

    def read(self, dtype):
        """(keys, values) (..., K·H) in `dtype`, an int8 cache's scaled back."""
        if self.k_scale is None:
            return self.k.astype(dtype), self.v.astype(dtype)
        H = self.k.shape[-1] // self.kv_heads
        return tuple(
            (x.astype(jnp.float32) * jnp.repeat(scale, H, axis=-1)).astype(dtype)
            for x, scale in ((self.k, self.k_scale), (self.v, self.v_scale))
        )

    def attend(self, q_BxTxNxH, new: "KVCache", start_B):
        """Attention of T new queries per row (row b's at positions start_B[b] + [0, T)) over this
        layer's cached positions before start_B[b] and the new tokens' own keys (`new`, as encode
        stored them; causal among themselves): one softmax over both, so the new tokens need not
        be in the cache first. Written out for XLA (blockwise_attention says how).

        An int8 cache is read as int8: its key scales multiply the scores and its value scales the
        probabilities, (q·k)·s = q·(k·s), so no dequantized copy of the cache is made."""
        return blockwise_attention(
            q_BxTxNxH, self.kv_heads, lambda q_BxTxNxKH: self._attend_prefix(q_BxTxNxKH, new, start_B)
        )

    def _attend_prefix(self, q_BxTxNxKH, new: "KVCache", start_B):
        """Attention over the whole of this (sliced) cache and the new tokens, written out for XLA:
        float32 (B, T, N, K·H), normalised."""
        T, G = q_BxTxNxKH.shape[1], q_BxTxNxKH.shape[2] // self.kv_heads
        S, dtype = self.capacity, q_BxTxNxKH.dtype
        s_BxNxTxS = jnp.einsum("btnd,bsd->bnts", q_BxTxNxKH, self.k.astype(dtype), preferred_element_type=jnp.float32)
        if self.k_scale is not None:
            s_BxNxTxS = s_BxNxTxS * per_query_head(self.k_scale, G)[:, :, None, :]
        cached_visible = (jnp.arange(S) < start_B[:, None])[:, None, None, :]
        s_BxNxTxS = jnp.where(cached_visible, s_BxNxTxS, -jnp.inf)
        new_k_BxTxKH, new_v_BxTxKH = new.read(dtype)
        s_BxNxTxT = jnp.einsum("btnd,bud->bntu", q_BxTxNxKH, new_k_BxTxKH, preferred_element_type=jnp.float32)
        s_BxNxTxT = jnp.where(jnp.tri(T, dtype=bool), s_BxNxTxT, -jnp.inf)
        # every query sees itself, so the max is finite
        max_BxNxT = jnp.maximum(s_BxNxTxS.max(-1, initial=-jnp.inf), s_BxNxTxT.max(-1))[..., None]
        p_BxNxTxS, p_BxNxTxT = jnp.exp(s_BxNxTxS - max_BxNxT), jnp.exp(s_BxNxTxT - max_BxNxT)
        sum_BxNxT = p_BxNxTxS.sum(-1) + p_BxNxTxT.sum(-1)
        if self.v_scale is not None:
            p_BxNxTxS = p_BxNxTxS * per_query_head(self.v_scale, G)[:, :, None, :]
        o_BxNxTxKH = jnp.einsum(
            "bnts,bsd->bntd", p_BxNxTxS.astype(dtype), self.v.astype(dtype), preferred_element_type=jnp.float32
        ) + jnp.einsum("bntu,bud->bntd", p_BxNxTxT.astype(dtype), new_v_BxTxKH, preferred_element_type=jnp.float32)
        o_BxTxNxKH = o_BxNxTxKH.transpose(0, 2, 1, 3)  # (B, T, N) out of the product made XLA:CPU's bf16 dot fail
        return o_BxTxNxKH / sum_BxNxT.transpose(0, 2, 1)[..., None]

    def write(self, new: "KVCache", start_B) -> "KVCache":
        """The whole cache (L, B, S, K·H) with every layer's T new tokens per row (`new`, (L, B, T,
        K·H), as encode stored them) written at positions start_B[b] + [0, T). One token per row
        (a decode step) is written in place: by layers/cache_write.py's kernel on one TPU, by a scatter
        elsewhere, an int8 cache's scales by a select; longer runs go row by row. A decode step's cache
        may hold more rows than B: the tokens are its first B rows, the others untouched."""
        L, B, T = new.k.shape[:3]
        if T > 1:
            per_row = jax.vmap(
                lambda cache, x, start: jax.lax.dynamic_update_slice_in_dim(cache, x, start, axis=1),
                in_axes=(1, 1, 0),
                out_axes=1,
            )
            return self._constrained(
                **{name: per_row(getattr(self, name), getattr(new, name), start_B) for name in self._names()}
            )

        # On one TPU a kernel writes each row's token in place (layers/cache_write.py: XLA's scatter
        # took a quarter of GPT-2's decode step at 256 rows); elsewhere, and for an int8 cache, a scatter.
        mesh = jax.sharding.get_abstract_mesh()
        one_device = jax.device_count() == 1 if mesh.empty else mesh.size == 1

        def put(cache, x_LxBx1xKH):
            if not (one_device and cache_write.fits(cache, B)):
                return scatter_tokens(cache, x_LxBx1xKH[:, :, 0], start_B)
            return jax.lax.platform_dependent(
                cache, x_LxBx1xKH[:, :, 0], start_B, tpu=cache_write.write_tokens, default=scatter_tokens
            )

        arrays = {"k": put(self.k, new.k), "v": put(self.v, new.v)}
        if self.k_scale is not None:
            # A scatter of the scales' K-wide rows wanted K as their minor axis (10.7x padded on a
            # TPU) and relayouts each step; a select over all of them keeps positions minor, as
            # the attention reads them (a head's scale is 4 bytes beside its H int8 keys).
            at_start_1xBxSx1 = (jnp.arange(self.capacity) == start_B[:, None])[None, :, :, None]

            def put_scales(scales, new_LxBx1xK):  # the first B rows' scales only
                selected = jnp.where(at_start_1xBxSx1, new_LxBx1xK, scales[:, :B])
                return jax.lax.dynamic_update_slice(scales, selected, (0, 0, 0, 0))

            arrays.update(k_scale=put_scales(self.k_scale, new.k_scale), v_scale=put_scales(self.v_scale, new.v_scale))
        return self._constrained(**arrays)

    def _names(self):
        return ("k", "v") if self.k_scale is None else ("k", "v", "k_scale", "v_scale")

    def _constrained(self, **arrays) -> "KVCache":
        """A KVCache of whole-cache arrays (L, B, S, ...) pinned to the cache's sharding: the last axis
        over `tensor` (heads) where it divides the kv heads (cache_axes)."""
        axes = cache_axes(self.kv_heads)
        return KVCache(kv_heads=self.kv_heads, **{name: constrain(a, axes) for name, a in arrays.items()})

    def padded(self, length: int) -> "KVCache":
        """This cache (L, B, T, K·H) of a prompt's T tokens, as the first T positions of one of
        `length` positions (the rest zeros)."""
        pad = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, length - a.shape[2])] + [(0, 0)] * (a.ndim - 3))
        return self._constrained(**{name: pad(getattr(self, name)) for name in self._names()})


def scatter_tokens(cache_LxRxSxKH, x_LxBxKH, start_B):
    """The cache with x_LxBxKH[l, b] at [l, b, start_B[b]] (rows b < B), by XLA's scatter. Each unit written
    is one K·H row of the last axis: with a unit of (L, K·H) XLA stored the cache with layers second-minor,
    not positions, and copied it into the attention's layout and back every step. Measured on a v5e
    (GPT-2, bench/NOTES.md): one scatter of every (layer, row) took 0.1 ms per array at 768 of them
    (batch 64) but 2.6 ms at 3,072 (batch 256: XLA linearised its indices); one scatter per layer costs
    ~0.07 ms a step more at batch 1 and 64 (24 small writes) and took batch 256's step from 7.4 to 3.0 ms."""
    L, B = x_LxBxKH.shape[:2]
    rows_B = jnp.arange(B)
    if L * B <= ONE_SCATTER_MAX_PAIRS:
        at = (jnp.arange(L)[:, None], rows_B[None, :], start_B[None, :])
        return cache_LxRxSxKH.at[at].set(
            x_LxBxKH, indices_are_sorted=True, unique_indices=True, mode="promise_in_bounds"
        )
    for layer in range(L):
        cache_LxRxSxKH = cache_LxRxSxKH.at[layer, rows_B, start_B].set(
            x_LxBxKH[layer], indices_are_sorted=True, unique_indices=True, mode="promise_in_bounds"
        )
    return cache_LxRxSxKH


def blockwise_attention(q_BxTxNxH, kv_heads: int, attend):
    """Decode attention in the cache's layout: `attend` takes the queries spread block-diagonally over the
    cache's last axis d = (kv head, lane), which is never split (a relayout on a TPU): query head n (kv
    head n // G) is zero outside its kv head's H lanes, so one product contracting d gives every head's
    scores against its own kv head (K times the multiplications of the head-by-head product: nothing
    beside the bytes of the cache), and the values' product gives each query head all K heads' outputs
    (float32 (B, T, N, K·H), normalised), of which it keeps its own block here."""
    (B, T, N, H), K = q_BxTxNxH.shape, kv_heads
    G, KH, dtype = N // K, K * H, q_BxTxNxH.dtype
    # own_NxKH[n, d]: lane d belongs to query head n's kv head
    own_NxKH = (jnp.arange(KH) // H)[None, :] == (jnp.arange(N) // G)[:, None]
    q_BxTxNxKH = jnp.where(own_NxKH, jnp.tile(q_BxTxNxH * H**-0.5, (1, 1, 1, K)), 0).astype(dtype)
    o_BxTxNxKH = attend(q_BxTxNxKH)
    # Each query head keeps its own kv head's block: summing over the K groups of query heads
    # leaves o_BxTxGxKH[b, t, g, (k, h)] = head k·G + g's output, lane h.
    o_BxTxGxKH = jnp.where(own_NxKH, o_BxTxNxKH, 0).reshape(B, T, K, G, KH).sum(2)
    o_BxTxKxGxH = o_BxTxGxKH.reshape(B, T, G, K, H).transpose(0, 1, 3, 2, 4)  # no-op for G = 1
    return o_BxTxKxGxH.reshape(B, T, N, H).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InPlaceLayer:
    """Layer `index` (traced: the layer scan's) of the whole cache, for layers/decode_attention.py's
    kernel, which reads the cache's arrays in place: each row's filled positions only, so no prefix
    needs slicing first (Filled)."""

    cache: KVCache
    index: jax.Array

    def encode(self, k_BxTxKxH, v_BxTxKxH) -> KVCache:
        return self.cache.encode(k_BxTxKxH, v_BxTxKxH)

    def attend(self, q_BxTxNxH, new: KVCache, start_B):
        """KVCache.attend's result for one new query per row, through the kernel."""
        return blockwise_attention(
            q_BxTxNxH, self.cache.kv_heads, lambda q_BxTxNxKH: self._partial(q_BxTxNxKH, new, start_B)
        )

    def _partial(self, q_BxTxNxKH, new: KVCache, start_B):
        """One new query per row through the kernel (the cached positions' partial softmax), merged
        with its own key's score here: float32 (B, 1, N, K·H), normalised."""
        if q_BxTxNxKH.shape[1] != 1:
            raise ValueError(f"the kernel takes one new token per row, not {q_BxTxNxKH.shape[1]}")
        q_BxNxKH, f32 = q_BxTxNxKH[:, 0], jnp.float32
        B, S = q_BxNxKH.shape[0], self.cache.capacity
        blocks = dict(block_rows=max(d for d in range(1, 9) if B % d == 0), block_positions=128 if S % 128 == 0 else S)

        def kernel(interpret: bool):
            return lambda q_BxNxKH, layer, start_B: decode_attention.cached_attention(
                q_BxNxKH,
                layer.cache.k,
                layer.cache.v,
                layer.index,
                start_B,
                layer.cache.kv_heads,
                layer.cache.k_scale,
                layer.cache.v_scale,
                interpret=interpret,
                **blocks,
            )

        # Mosaic's kernel where the program is for a TPU, Pallas's interpreter elsewhere (tests)
        o_BxNxKH, max_BxN, sum_BxN = jax.lax.platform_dependent(
            q_BxNxKH, self, start_B, tpu=kernel(False), default=kernel(True)
        )
        new_k_BxKH, new_v_BxKH = (x[:, 0] for x in new.read(q_BxNxKH.dtype))
        own_BxN = jnp.einsum("bnd,bd->bn", q_BxNxKH, new_k_BxKH, preferred_element_type=f32)
        top_BxN = jnp.maximum(max_BxN, own_BxN)  # finite: every query sees its own key
        cached_BxN, own_BxN = jnp.exp(max_BxN - top_BxN), jnp.exp(own_BxN - top_BxN)
        o_BxNxKH = o_BxNxKH * cached_BxN[..., None] + own_BxN[..., None] * new_v_BxKH[:, None].astype(f32)
        return (o_BxNxKH / (sum_BxN * cached_BxN + own_BxN)[..., None])[:, None]


def per_query_head(scale_BxSxK, G: int):
    """An int8 cache's scales (B, S, K) as (B, N, S): query head n gets kv head n // G's."""
    return jnp.repeat(scale_BxSxK.transpose(0, 2, 1), G, axis=1)


def cache_axes(kv_heads: int) -> tuple:
    """The cache's logical axes: its last axis (K·H, or the scales' K) split over `tensor` only where
    that divides the K heads, as (L, B, S, K, H) was: K·H could divide where K does not, putting
    parts of one head on different devices."""
    return CACHE_AXES if splits(kv_heads, "heads") else CACHE_AXES[:-1] + (None,)


def init_cache(config, batch_size: int, length: int) -> KVCache:
    """An empty cache for `batch_size` rows of up to `length` tokens, in config.kv_cache_dtype, sharded
    like the model (heads over `tensor`, rows over the batch axes) when sharding rules are active."""
    K, H = config.kv_heads, config.n_embd // config.n_head
    shape = (config.n_layer, batch_size, length, K * H)
    dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    zeros = lambda shape, dtype: constrain(jnp.zeros(shape, dtype), cache_axes(K))
    if dtype != "int8":
        return KVCache(zeros(shape, dtype), zeros(shape, dtype), K)
    scales = shape[:-1] + (K,)
    return KVCache(
        zeros(shape, jnp.int8), zeros(shape, jnp.int8), K, zeros(scales, jnp.float32), zeros(scales, jnp.float32)
    )
