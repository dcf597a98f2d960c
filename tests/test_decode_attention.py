"""layers/decode_attention.py's Pallas decode kernel, run by Pallas's interpreter on the CPU: its
partial softmax over each row's filled cache positions against plain attention per head, for
float32, bfloat16 and int8 caches, grouped-query heads, rows of different lengths (0 and the
whole cache among them), a cache of more rows than the queries, and a layer other than the first;
and, merged with the new token (kv_cache.InPlaceLayer), against KVCache.attend. One test (marked tpu) runs Mosaic's
compiled kernel on the chip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from layers import decode_attention, kv_cache

# A value no correct read of the cache meets: written where the kernel must not look (positions
# at or past a row's length: a key there would win the softmax; rows past B: NaN).
GARBAGE = 1e4


def block_diagonal(q_BxNxH, K: int, dtype):
    """Queries scaled and spread over the K·H lanes as KVCache.attend spreads them."""
    B, N, H = q_BxNxH.shape
    own_NxKH = (jnp.arange(K * H) // H)[None, :] == (jnp.arange(N) // (N // K))[:, None]
    return jnp.where(own_NxKH, jnp.tile(q_BxNxH * H**-0.5, (1, 1, K)), 0).astype(dtype)


def make_cache(key, L, R, S, K, H, dtype, lengths_B):
    """A cache (L, R, S, K·H) of random tokens at every layer's filled positions, GARBAGE past them
    and NaN in the rows past len(lengths_B) (an int8 cache: its scales)."""
    B = len(lengths_B)
    k_LxRxSxKxH, v_LxRxSxKxH = (jax.random.normal(k, (L, R, S, K, H), jnp.float32) for k in jax.random.split(key))
    filled_1xRxSx1x1 = (jnp.arange(S)[None, :] < jnp.pad(jnp.asarray(lengths_B), (0, R - B))[:, None])[
        None, :, :, None, None
    ]
    k_LxRxSxKxH, v_LxRxSxKxH = (jnp.where(filled_1xRxSx1x1, x, GARBAGE) for x in (k_LxRxSxKxH, v_LxRxSxKxH))
    empty = kv_cache.KVCache(
        jnp.zeros((1, 1, K * H), jnp.int8 if dtype == "int8" else dtype),
        jnp.zeros((1, 1, K * H), jnp.int8 if dtype == "int8" else dtype),
        K,
        *((jnp.zeros((1, 1, K), jnp.float32),) * 2 if dtype == "int8" else ()),
    )
    cache = empty.encode(k_LxRxSxKxH.reshape(L * R, S, K, H), v_LxRxSxKxH.reshape(L * R, S, K, H))
    cache = jax.tree.map(lambda a: a.reshape(L, R, *a.shape[1:]), cache)
    if dtype == "int8":
        poison = lambda a: a.at[:, B:].set(jnp.nan)
        cache = kv_cache.KVCache(cache.k, cache.v, K, poison(cache.k_scale), poison(cache.v_scale))
    else:
        cache = kv_cache.KVCache(cache.k.at[:, B:].set(jnp.nan), cache.v.at[:, B:].set(jnp.nan), K)
    return cache


def plain_attention(q_BxNxH, cache, layer, lengths_B):
    """Softmax attention per head over each row's first lengths_B[b] positions, in float32 from the
    cache as read back (an int8 cache's scaled): (B, N, H); rows of length 0 left out (None)."""
    B, N, H = q_BxNxH.shape
    K = cache.kv_heads
    k_BxSxKH, v_BxSxKH = cache.layer(layer, rows=B).read(jnp.float32)
    S = k_BxSxKH.shape[1]
    k_BxSxNxH, v_BxSxNxH = (jnp.repeat(x.reshape(B, S, K, H), N // K, axis=2) for x in (k_BxSxKH, v_BxSxKH))
    scores_BxNxS = jnp.einsum("bnh,bsnh->bns", q_BxNxH.astype(jnp.float32) * H**-0.5, k_BxSxNxH)
    scores_BxNxS = jnp.where((jnp.arange(S) < jnp.asarray(lengths_B)[:, None])[:, None, :], scores_BxNxS, -jnp.inf)
    return jnp.einsum("bns,bsnh->bnh", jax.nn.softmax(scores_BxNxS, axis=-1), v_BxSxNxH)


def own_heads(o_BxNxKH, K: int):
    """Each query head's own kv head's H lanes of the block-diagonal output: (B, N, H)."""
    B, N, KH = o_BxNxKH.shape
    H, G = KH // K, N // K
    return jnp.stack([o_BxNxKH[:, n, (n // G) * H : (n // G + 1) * H] for n in range(N)], axis=1)


def reference_attention(q_BxNxKH, k_LxRxSxKH, v_LxRxSxKH, layer, lengths_B, kv_heads: int, k_scale=None, v_scale=None):
    """What cached_attention computes, in plain jnp over all S positions: the same (o unnormalised,
    max, sum)."""
    B, N, KH = q_BxNxKH.shape
    S, G = k_LxRxSxKH.shape[2], N // kv_heads
    k_BxSxKH, v_BxSxKH = k_LxRxSxKH[layer, :B], v_LxRxSxKH[layer, :B]
    dtype = q_BxNxKH.dtype
    scores_BxNxS = jnp.einsum("bnd,bsd->bns", q_BxNxKH, k_BxSxKH.astype(dtype), preferred_element_type=jnp.float32)
    if k_scale is not None:
        scores_BxNxS = scores_BxNxS * jnp.repeat(jnp.swapaxes(k_scale[layer, :B], 1, 2), G, axis=1)
    visible_Bx1xS = (jnp.arange(S) < jnp.asarray(lengths_B)[:, None])[:, None, :]
    scores_BxNxS = jnp.where(visible_Bx1xS, scores_BxNxS, -jnp.inf)
    max_BxN = scores_BxNxS.max(-1)
    p_BxNxS = jnp.exp(scores_BxNxS - jnp.where(jnp.isfinite(max_BxN), max_BxN, 0)[..., None])
    sum_BxN = p_BxNxS.sum(-1)
    if v_scale is not None:
        p_BxNxS = p_BxNxS * jnp.repeat(jnp.swapaxes(v_scale[layer, :B], 1, 2), G, axis=1)
    o_BxNxKH = jnp.einsum(
        "bns,bsd->bnd", p_BxNxS.astype(dtype), v_BxSxKH.astype(dtype), preferred_element_type=jnp.float32
    )
    return o_BxNxKH, max_BxN, sum_BxN


# (query heads N, kv heads K, head size H): grouped-query (a Llama-style test model) and one kv head per query head
HEADS = {"gqa": (4, 2, 32), "mha": (2, 2, 64)}
# Per dtype: the tolerance, and the blocks (rows, positions) and cache length S; an int8 cache's
# position blocks are whole lane tiles (its scales), so its S is longer to have two of them.
DTYPES = {"float32": (1e-5, 2, 16, 64), "bfloat16": (3e-2, 2, 16, 64), "int8": (3e-2, 2, 128, 256)}


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_attention_over_the_filled_positions(dtype, heads):
    N, K, H = HEADS[heads]
    tolerance, block_rows, block_positions, S = DTYPES[dtype]
    L, R, layer = 3, 10, 2
    # Rows of a block differ (0 and S among them); a block of empty rows; rows that end inside a
    # position block and at its end.
    lengths_B = jnp.array([0, S, 0, 0, block_positions + 3, 1, 5, block_positions], jnp.int32)
    B = len(lengths_B)  # < R: the last rows of the cache are not queries
    cache = make_cache(jax.random.key(0), L, R, S, K, H, dtype, lengths_B)
    q_BxNxH = jax.random.normal(jax.random.key(1), (B, N, H), jnp.float32)
    compute = jnp.float32 if dtype == "float32" else jnp.bfloat16
    o_BxNxKH, max_BxN, sum_BxN = decode_attention.cached_attention(
        block_diagonal(q_BxNxH, K, compute),
        cache.k,
        cache.v,
        jnp.int32(layer),
        lengths_B,
        K,
        cache.k_scale,
        cache.v_scale,
        block_rows=block_rows,
        block_positions=block_positions,
        interpret=True,
    )
    assert o_BxNxKH.shape == (B, N, K * H) and max_BxN.shape == sum_BxN.shape == (B, N)
    assert o_BxNxKH.dtype == max_BxN.dtype == sum_BxN.dtype == jnp.float32

    empty = np.asarray(lengths_B) == 0
    np.testing.assert_array_equal(max_BxN[empty], -np.inf)
    np.testing.assert_array_equal(sum_BxN[empty], 0)
    np.testing.assert_array_equal(o_BxNxKH[empty], 0)
    assert np.all(np.isfinite(max_BxN[~empty])) and np.all(sum_BxN[~empty] >= 1)  # the max's own term is 1
    got_BxNxH = own_heads(o_BxNxKH, K) / sum_BxN[..., None]
    want_BxNxH = plain_attention(q_BxNxH, cache, layer, lengths_B)
    np.testing.assert_allclose(got_BxNxH[~empty], want_BxNxH[~empty], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_the_plain_reference_at_any_blocks(dtype):
    """One row (blocks of 1 row), blocks larger than the array (clamped to it), row blocks of empty rows
    before and after the only one in use, and a traced layer."""
    N, K, H = HEADS["gqa"]
    L, R, S = 2, 3, 64
    compute = jnp.float32 if dtype == "float32" else jnp.bfloat16
    cases = (([37], 8, 16), ([64, 3], 1, 32), ([0, 0], 2, 512), ([0, 0, 9, 0, 0, 0], 2, 16))  # empty blocks around one
    for lengths_B, block_rows, block_positions in cases:
        lengths_B = jnp.array(lengths_B, jnp.int32)
        cache = make_cache(jax.random.key(2), L, max(R, len(lengths_B)), S, K, H, dtype, lengths_B)
        q_BxNxKH = block_diagonal(jax.random.normal(jax.random.key(3), (len(lengths_B), N, H)), K, compute)
        run = jax.jit(
            lambda layer: decode_attention.cached_attention(
                q_BxNxKH,
                cache.k,
                cache.v,
                layer,
                lengths_B,
                K,
                block_rows=block_rows,
                block_positions=block_positions,
                interpret=True,
            )
        )
        got = run(jnp.int32(1))
        # the reference reads garbage and NaN nowhere it weighs: positions past the lengths get p = 0
        want = reference_attention(q_BxNxKH, jnp.nan_to_num(cache.k), jnp.nan_to_num(cache.v), 1, lengths_B, K)
        tolerance = DTYPES[dtype][0]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_the_decode_step_through_the_kernel_matches_kv_cache_attend(dtype):
    """A layer of the whole cache in place (the kernel's partial softmax, merged with each row's new
    key and value) attends as the layer's slice does through XLA (one new token per row)."""
    N, K, H = HEADS["gqa"]
    S = 256 if dtype == "int8" else 64
    L, R, layer = 2, 4, 1
    lengths_B = jnp.array([0, 130 if dtype == "int8" else 40, 7], jnp.int32)
    B = len(lengths_B)
    cache = make_cache(jax.random.key(4), L, R, S, K, H, dtype, lengths_B)
    q_BxNxH, new_k_BxKxH, new_v_BxKxH = (
        jax.random.normal(jax.random.key(5 + i), shape) for i, shape in enumerate(((B, N, H), (B, K, H), (B, K, H)))
    )
    new = cache.encode(new_k_BxKxH[:, None], new_v_BxKxH[:, None])  # (B, 1, K·H) as stored
    q_Bx1xNxH = q_BxNxH.astype(jnp.bfloat16)[:, None]
    got_BxNxH = kv_cache.InPlaceLayer(cache, jnp.int32(layer)).attend(q_Bx1xNxH, new, lengths_B)[:, 0]
    # XLA's attention reads every position: give it the layer's rows without the NaN past B
    layer_cache = jax.tree.map(jnp.nan_to_num, cache.layer(layer, rows=B))
    want_BxNxH = layer_cache.attend(q_Bx1xNxH, new, lengths_B)[:, 0]
    np.testing.assert_allclose(got_BxNxH.astype(jnp.float32), want_BxNxH.astype(jnp.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("needed", [[2, 0, 0, 1, 0], [0, 0, 0, 3], [1, 1, 1], [0, 0], [0, 2, 0, 0, 0]])
def test_the_grid_copies_each_needed_block_once_and_no_other(needed):
    """The cache blocks the grid's steps name, in order (a row block's needed steps, then where its
    skipped steps point): Pallas copies a block when the name changes, so the copies are the needed
    blocks, each once (a grid that needs none copies its first block)."""
    needed_R = jnp.array(needed, jnp.int32)
    skip_rows, skip_positions = decode_attention.skipped_steps_block(needed_R)
    position_blocks = max(needed) + 1
    named = [
        tuple(int(b) for b in decode_attention.cache_block_index(i, j, needed_R, skip_rows, skip_positions))
        for i in range(len(needed))
        for j in range(position_blocks)
    ]
    copies = [block for k, block in enumerate(named) if k == 0 or block != named[k - 1]]
    want = [(i, j) for i in range(len(needed)) for j in range(needed[i])] or [(0, 0)]
    assert copies == want


def test_refuses_what_it_cannot_block():
    q = jnp.zeros((6, 2, 64), jnp.bfloat16)
    k = jnp.zeros((1, 8, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples"):
        decode_attention.cached_attention(q, k, k, 0, jnp.zeros(6, jnp.int32), 2, block_rows=4, interpret=True)
    k8, scale = jnp.zeros((1, 8, 256, 64), jnp.int8), jnp.zeros((1, 8, 256, 2), jnp.float32)
    with pytest.raises(ValueError, match="lanes|multiple of 128"):
        decode_attention.cached_attention(
            q, k8, k8, 0, jnp.zeros(6, jnp.int32), 2, scale, scale, block_rows=2, block_positions=64, interpret=True
        )
    with pytest.raises(ValueError, match="int8"):
        decode_attention.cached_attention(q, k8, k8, 0, jnp.zeros(6, jnp.int32), 2, block_rows=2, interpret=True)


CHIP_HEADS = {"gpt2": (12, 12, 64), "llama_350m": (8, 4, 128)}  # (N, K, H): grouped queries in the second


@pytest.mark.tpu
@pytest.mark.parametrize("heads", CHIP_HEADS)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_compiled_on_the_chip_matches_the_reference(dtype, heads):
    """Mosaic's kernel on a TPU at GPT-2's heads and at config/llama_350m.py's (two query heads per key
    and value head, 128 wide), rows of many lengths, a cache of more rows than queries, blocks of 8
    rows and of 1."""
    (N, K, H), L, R, S = CHIP_HEADS[heads], 3, 24, 256
    lengths_B = jnp.array([0, 1, 80, 127, 128, 129, 255, 256] + [17] * 8, jnp.int32)
    cache = make_cache(jax.random.key(6), L, R, S, K, H, dtype, lengths_B)
    cache = jax.tree.map(jnp.nan_to_num, cache)  # the reference reads the rows past B
    q_BxNxKH = block_diagonal(jax.random.normal(jax.random.key(7), (len(lengths_B), N, H)), K, jnp.bfloat16)
    want = reference_attention(q_BxNxKH, cache.k, cache.v, 2, lengths_B, K, cache.k_scale, cache.v_scale)
    for block_rows in (8, 1):
        got = jax.jit(
            lambda layer: decode_attention.cached_attention(
                q_BxNxKH, cache.k, cache.v, layer, lengths_B, K, cache.k_scale, cache.v_scale, block_rows=block_rows
            )
        )(jnp.int32(2))
        empty = np.asarray(lengths_B) == 0
        np.testing.assert_array_equal(got[1][empty], -np.inf)
        np.testing.assert_allclose(got[0] / got[2][..., None], want[0] / want[2][..., None], atol=2e-2, rtol=2e-2)


MODELS = {
    "gpt2": {},
    "gqa-int8": dict(
        n_kv_head=2, pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False, kv_cache_dtype="int8"
    ),
    "moe": dict(n_layer=3, n_experts=4, moe_dense_layers=1, capacity_factor=0.0),
}


@pytest.mark.parametrize("style", MODELS)
def test_model_decode_through_the_kernel_equals_xla(style):
    """model.decode with reads=FILLED (the kernel, interpreted) gives XLA's logits, step after step,
    for rows at different positions: GPT-2, grouped-query heads with an int8 cache, and a mixture of
    experts whose dense first layer is its own stack (the kernel reads its layers in the whole cache)."""
    config = model.GPTConfig(
        **{**dict(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_embd=64, dtype="float32"), **MODELS[style]}
    )
    gpt = model.GPT(config, jax.random.key(0))
    tokens_Bx12 = jax.random.randint(jax.random.key(1), (3, 12), 0, 97)
    step = jax.jit(
        lambda gpt, cache, token_Bx1, start_B, reads: gpt.decode(token_Bx1, cache, start_B, reads=reads),
        static_argnums=4,
    )
    logits = {}
    for reads in (kv_cache.Prefix(), kv_cache.FILLED):
        cache, start_B, steps = kv_cache.init_cache(config, 4, 64), jnp.array([0, 5, 17]), []
        for t in range(12):
            step_logits, cache = step(gpt, cache, tokens_Bx12[:, t : t + 1], start_B + t, reads)
            steps.append(step_logits)
        logits[reads] = np.stack(steps)
    np.testing.assert_allclose(logits[kv_cache.FILLED], logits[kv_cache.Prefix()], atol=1e-5, rtol=1e-5)
