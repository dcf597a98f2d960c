"""Decode attention as a Pallas TPU kernel: one new query per row against one layer of the KV cache,
reading only the cached positions that are filled. Only jax: the file works on its own.

XLA's decode attention (KVCache.attend) reads every position up to a static bucket, filled or not.
This kernel walks a grid (row blocks, position blocks) and, per row block, stops fetching after
the block that holds its longest row's last position: past it the k/v index_map names the next
block the kernel reads (skipped_steps_block), and Pallas skips a copy whose block index repeats,
so the blocks past it are never read (and the next copy overlaps this row block's last compute);
their compute is skipped with pl.when, as is each row's past its own length.

Measured on a v5e (GPT-2: 12 layers, K·H = 768, B = 256, S = 256, blocks of 8 rows x 128
positions): a bfloat16 cache is read at ~610 GB/s (XLA's products over a bucket: ~705), the
compute hidden behind the copies; an int8 cache's kernel is bound by its compute (the int8 ->
bfloat16 conversion and two small products per row), ~490 GB/s with 256-position blocks. So it
gains where the filled part is well short of XLA's bucket (long caches, rows of unequal lengths).

Layout (as layers/kv_cache.py stores the cache): keys and values (L, R, S, K·H), a kv head's H
lanes side by side; an int8 cache has float32 scales (L, R, S, K). The query of head n is spread
"block-diagonally" over all K·H lanes (zero outside its kv head's H lanes), so one product
contracting K·H gives every head's scores against its own kv head, and the values' product gives
each query head all K heads' outputs (the caller keeps its own block: kv_cache.blockwise_attention).

The result is a partial softmax (flash-decoding style): unnormalised outputs, the running max and
the sum of exp(score - max), which the caller merges with the new token's own key and value.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# The max and sum per (row, head) are stored broadcast over one lane tile: an (N, 128) block
# meets the TPU's block rules for any N and any number of rows per block (even 1).
LANES = 128


@functools.partial(jax.jit, static_argnames=("kv_heads", "block_rows", "block_positions", "interpret"))
def cached_attention(
    q_BxNxKH,
    k_LxRxSxKH,
    v_LxRxSxKH,
    layer,
    lengths_B,
    kv_heads: int,
    k_scale=None,
    v_scale=None,
    block_rows: int = 8,
    block_positions: int = 128,
    interpret: bool = False,
):
    """Row b's query against positions s < lengths_B[b] of layer `layer` of the cache, for rows
    0..B-1 of the cache (R >= B; the rest are neither read nor written).

    q_BxNxKH: queries already scaled (H ** -0.5) and expanded block-diagonally (as in
    KVCache.attend), in the compute dtype (the cache is read in it: an int8 cache is converted).
    k/v_LxRxSxKH: the whole cache, bfloat16, float32 or int8; int8 needs k_scale and v_scale,
    float32 (L, R, S, K): key scales multiply the scores, value scales the probabilities, query
    head n taking kv head n // (N // K)'s. The kernel reads the scales as (L, R, K, S), positions
    minor: the transpose is free where XLA stores them that way (KVCache.write keeps positions
    minor), a copy of the scales otherwise.
    layer: int or traced int32 scalar. lengths_B: int32 (B,), each in [0, S] (larger ones are
    clamped to S).

    Returns (o_BxNxKH float32, unnormalised: sum_s p[s] v[s]; max_BxN float32; sum_BxN float32,
    sum_s p[s]) with p[s] = exp(score[s] - max). A row of length 0 gives o = 0, max = -inf, sum = 0.

    Blocks: block_rows rows by block_positions positions (each clamped to B and S); B must be a
    multiple of block_rows and S of block_positions. block_positions should be a multiple of 16
    (bfloat16 tiles), 32 (int8), and of 128 for an int8 cache (its scales' lanes) unless it is S.
    Pass interpret=True to run it off a TPU (tests on the CPU)."""
    B, N, KH = q_BxNxKH.shape
    L, R, S, KH_cache = k_LxRxSxKH.shape
    if KH_cache != KH or v_LxRxSxKH.shape != k_LxRxSxKH.shape:
        raise ValueError(f"queries (.., {KH}) do not match the cache {k_LxRxSxKH.shape} / {v_LxRxSxKH.shape}")
    if B > R:
        raise ValueError(f"{B} query rows but the cache holds {R}")
    if N % kv_heads or KH % kv_heads:
        raise ValueError(f"{N} query heads and {KH} lanes must be multiples of the {kv_heads} kv heads")
    quantized = k_LxRxSxKH.dtype == jnp.int8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("an int8 cache needs k_scale and v_scale, and only an int8 cache has them")
    block_rows, block_positions = min(block_rows, B), min(block_positions, S)
    if B % block_rows or S % block_positions:
        raise ValueError(
            f"B={B} and S={S} must be multiples of block_rows={block_rows} and block_positions={block_positions}"
        )
    if quantized and block_positions % LANES and block_positions != S:
        raise ValueError(
            f"an int8 cache's scales need block_positions a multiple of {LANES} (or S), not {block_positions}"
        )
    row_blocks, position_blocks = B // block_rows, S // block_positions

    lengths_B = jnp.clip(jnp.asarray(lengths_B, jnp.int32), 0, S)
    layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
    # Position blocks each row block needs: those up to its longest row's last position (0 for
    # a block of empty rows).
    blocks_needed = -(-lengths_B.reshape(row_blocks, block_rows).max(axis=1) // block_positions)
    skip_rows, skip_positions = skipped_steps_block(blocks_needed)

    def cache_block(i, j, lengths_ref, layer_ref, *needed_and_skipped):
        return (layer_ref[0], *cache_block_index(i, j, *needed_and_skipped), 0)

    def row_block(i, j, *scalars):
        return i, 0, 0

    # Keys and values stay in HBM: left free, XLA may stage a whole operand in VMEM ahead of the
    # call (it did with an int8 cache's scales), reading every row and position the kernel skips.
    # Not the scales: the constraint kept XLA from making their transpose a bitcast (a copy).
    in_hbm = functools.partial(pltpu.with_memory_space_constraint, memory_space=pltpu.HBM)
    cache_spec = pl.BlockSpec((None, block_rows, block_positions, KH), cache_block)
    in_specs = [pl.BlockSpec((block_rows, N, KH), row_block), cache_spec, cache_spec]
    operands = [q_BxNxKH, in_hbm(k_LxRxSxKH), in_hbm(v_LxRxSxKH)]
    if quantized:

        def scale_block(i, j, *scalars):
            layer_index, rows, positions, _ = cache_block(i, j, *scalars)
            return layer_index, rows, 0, positions

        # Positions in lanes, as the scores have them: (L, R, K, S).
        in_specs += [pl.BlockSpec((None, block_rows, kv_heads, block_positions), scale_block)] * 2
        operands += [jnp.swapaxes(k_scale, 2, 3), jnp.swapaxes(v_scale, 2, 3)]

    out_shape = (
        jax.ShapeDtypeStruct((B, N, KH), jnp.float32),
        jax.ShapeDtypeStruct((B, N, LANES), jnp.float32),
        jax.ShapeDtypeStruct((B, N, LANES), jnp.float32),
    )
    out_specs = (
        pl.BlockSpec((block_rows, N, KH), row_block),
        pl.BlockSpec((block_rows, N, LANES), row_block),
        pl.BlockSpec((block_rows, N, LANES), row_block),
    )

    kernel = functools.partial(
        _decode_kernel, block_rows=block_rows, block_positions=block_positions, group=N // kv_heads, quantized=quantized
    )
    cache_bytes = block_rows * block_positions * KH * k_LxRxSxKH.dtype.itemsize
    rows_bytes = block_rows * N * (KH * (q_BxNxKH.dtype.itemsize + 4) + 2 * LANES * 4)
    # Two buffers of each block, plus room for the per-row temporaries (the converted keys and
    # values of an int8 cache, the scores).
    vmem_bytes = 2 * (2 * cache_bytes + rows_bytes) + 4 * block_positions * KH * 4 + (8 << 20)
    read_bytes = int(2 * B * S * KH * k_LxRxSxKH.dtype.itemsize)  # at most: the kernel reads the filled part
    o_BxNxKH, max_BxNxL, sum_BxNxL = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(row_blocks, position_blocks), in_specs=in_specs, out_specs=out_specs
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=int(min(vmem_bytes, 100 << 20))
        ),
        cost_estimate=pl.CostEstimate(
            flops=4 * B * N * S * KH, transcendentals=B * N * S, bytes_accessed=read_bytes + B * N * KH * 4
        ),
        interpret=interpret,
    )(lengths_B, layer_1, blocks_needed, skip_rows, skip_positions, *operands)
    return o_BxNxKH, max_BxNxL[..., 0], sum_BxNxL[..., 0]


def cache_block_index(i, j, blocks_needed, skip_rows, skip_positions):
    """The (row block, position block) of the cache that grid step (i, j) names: its own up to the row
    block's needed ones, then where skipped_steps_block points (the kernel's index map, minus the layer)."""
    past = j >= blocks_needed[i]
    return jnp.where(past, skip_rows[i], i), jnp.where(past, skip_positions[i], j)


def skipped_steps_block(blocks_needed):
    """(row block, position block) that row block i's steps past its needed blocks point at, as two
    arrays over i. Pallas starts each step's copy during the step before and skips a copy whose
    block index repeats, so they name the next block the kernel will read: the first block of the
    next row block that needs any (read once, its copy overlapping this row block's last compute),
    and after the last such row block, its last block again. Row blocks of empty rows then cost no
    copy (pointing at the next row block's first block cost one each: 0.46 ms of GPT-2's step with
    1 of 64 rows in use on a v5e). Every needed block is copied once and no other."""
    row_blocks = blocks_needed.shape[0]
    rows = jnp.arange(row_blocks)
    needing = jnp.where(blocks_needed > 0, rows, row_blocks)  # row_blocks: needs none
    next_needing = jax.lax.cummin(jnp.append(needing[1:], row_blocks), reverse=True)
    last_needing = jnp.max(jnp.where(blocks_needed > 0, rows, 0))
    has_next = next_needing < row_blocks
    return (
        jnp.where(has_next, next_needing, last_needing).astype(jnp.int32),
        jnp.where(has_next, 0, jnp.maximum(blocks_needed[last_needing] - 1, 0)).astype(jnp.int32),
    )


def _decode_kernel(
    lengths_ref,
    layer_ref,
    needed_ref,
    skip_rows_ref,
    skip_positions_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    block_rows: int,
    block_positions: int,
    group: int,
    quantized: bool,
):
    """One (row block i, position block j) step of the online softmax. The outputs' blocks stay in
    VMEM across j (their index does not change with it), so they are the running state:
    o_ref (rows, N, K·H) the unnormalised outputs, max_ref and sum_ref (rows, N, 128), each
    (row, head)'s value broadcast over the lanes."""
    if quantized:
        k_scale_ref, v_scale_ref, o_ref, max_ref, sum_ref = refs
    else:
        o_ref, max_ref, sum_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _start():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, max_ref.dtype)
        sum_ref[...] = jnp.zeros(sum_ref.shape, sum_ref.dtype)

    first_position = j * block_positions
    for r in range(block_rows):  # rows have their own keys: one pair of products each
        length = lengths_ref[i * block_rows + r]

        # Rows of the block may be shorter than its longest: skip each row's blocks past its end
        # (which also keeps every block it does see holding a visible position: a finite max).
        @pl.when(first_position < length)
        def _update(r=r, length=length):
            q_NxKH = q_ref[r]
            dtype = q_NxKH.dtype
            k_PxKH, v_PxKH = k_ref[r], v_ref[r]
            if k_PxKH.dtype != dtype:  # int8 (or a cache in another dtype): read in the queries' dtype
                k_PxKH = k_PxKH.astype(jnp.float32).astype(dtype)
                v_PxKH = v_PxKH.astype(jnp.float32).astype(dtype)
            scores_NxP = jax.lax.dot_general(
                q_NxKH, k_PxKH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            if quantized:  # (q·k)·s = q·(k·s): the cache is never dequantized
                scores_NxP = scores_NxP * _per_query_head(k_scale_ref[r], group)
            position_NxP = first_position + jax.lax.broadcasted_iota(jnp.int32, scores_NxP.shape, 1)
            scores_NxP = jnp.where(position_NxP < length, scores_NxP, -jnp.inf)

            max_before_NxL = max_ref[r]
            max_NxL = jnp.maximum(max_before_NxL, scores_NxP.max(axis=1, keepdims=True))
            rescale_NxL = jnp.exp(max_before_NxL - max_NxL)  # 0 on the first block: max_before = -inf
            p_NxP = jnp.exp(scores_NxP - max_NxL[:, :1])
            sum_ref[r] = rescale_NxL * sum_ref[r] + p_NxP.sum(axis=1, keepdims=True)
            max_ref[r] = max_NxL
            if quantized:
                p_NxP = p_NxP * _per_query_head(v_scale_ref[r], group)
            values_NxKH = jax.lax.dot_general(
                p_NxP.astype(dtype), v_PxKH, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            o_ref[r] = rescale_NxL[:, :1] * o_ref[r] + values_NxKH


def _per_query_head(scale_KxP, group: int):
    """Scales (K, P) of the kv heads as (N, P): query head n gets kv head n // group's row. Built
    from selects: a (K, G, P) -> (N, P) reshape is a relayout Mosaic may refuse."""
    if group == 1:
        return scale_KxP
    K, P = scale_KxP.shape
    # No integer division: jnp's floor division lowers through sign, whose Mosaic rule asks the
    # backend for the chip's generation (failing a compile for a TPU on a CPU host).
    query_head_NxP = jax.lax.broadcasted_iota(jnp.int32, (K * group, P), 0)
    expanded_NxP = jnp.zeros((K * group, P), scale_KxP.dtype)
    for head in range(K):  # the last head whose first query head is <= n is n // group
        expanded_NxP = jnp.where(query_head_NxP >= head * group, scale_KxP[head : head + 1, :], expanded_NxP)
    return expanded_NxP
