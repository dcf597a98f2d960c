"""A decode step's cache write as a Pallas TPU kernel: one new token per row, each at its own position,
written into every layer of the cache in place. Only jax: the file works on its own.

XLA makes the same write (KVCache.write's scatter) a loop over (layer, row) units on a TPU: ~0.8 ms
a step for GPT-2's keys and values at 256 rows on a v5e, about a quarter of the decode step. A position
is one row of a tile of 8 (the cache (L, B, S, K·H) has positions second-minor), and a DMA moves whole
tiles only, so the kernel copies each (layer, row)'s 8-position window holding its new position into
VMEM, selects the new token into it and copies it back: ~0.24 ms a step an array at 256 rows, ~0.055 at
64 (bench/NOTES.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Positions in a tile of the cache's second-minor axis: a DMA's offset along it must be a multiple.
WINDOW = 8
# VMEM the kernel may take (the windows and the new tokens, double-buffered): under the 16 MiB a TPU
# kernel gets by default. GPT-2 at 256 rows takes 4.5 MiB.
VMEM_BYTES = 12 << 20


def fits(cache_LxRxSxKH, rows: int) -> bool:
    """Whether the kernel takes this cache and `rows` new tokens: a 16- or 32-bit dtype (int8 tiles hold
    32 positions), whole windows of positions, and its VMEM within VMEM_BYTES."""
    S, KH, itemsize = *cache_LxRxSxKH.shape[2:], cache_LxRxSxKH.dtype.itemsize
    vmem = rows * KH * (WINDOW * itemsize + 2 * 4)
    return itemsize in (2, 4) and S % WINDOW == 0 and vmem <= VMEM_BYTES


@functools.partial(jax.jit, static_argnames="interpret")
def write_tokens(cache_LxRxSxKH, new_LxBxKH, start_B, interpret: bool = False):
    """The cache with new_LxBxKH[l, b] at [l, b, start_B[b]] for rows b < B (R >= B; the other rows
    untouched), in place when the caller donates the cache. start_B in [0, S). Pass interpret=True to run
    it off a TPU (tests on the CPU)."""
    L, R, S, KH = cache_LxRxSxKH.shape
    B = new_LxBxKH.shape[1]
    return pl.pallas_call(
        _write_kernel,
        out_shape=jax.ShapeDtypeStruct(cache_LxRxSxKH.shape, cache_LxRxSxKH.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(L,),
            # float32 rows: Mosaic loads one row of a packed (bfloat16) tile only with its neighbours
            in_specs=[
                pl.BlockSpec((None, B, KH), lambda layer, start: (layer, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((B, WINDOW, KH), cache_LxRxSxKH.dtype), pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * L * B * WINDOW * KH * 4),
        interpret=interpret,
    )(start_B.astype(jnp.int32), new_LxBxKH.astype(jnp.float32), cache_LxRxSxKH)


def _write_kernel(start_ref, new_ref, cache_in_ref, cache_ref, window_ref, sem):
    """Layer l's B windows: all copied in, the new tokens selected in, all copied back. cache_in_ref is
    cache_ref's buffer (aliased)."""
    layer, B = pl.program_id(0), new_ref.shape[0]

    def copy(b, inward: bool):
        # no //: its lowering (through sign) asks for the chip's generation, failing a compile on a CPU host
        first = pl.multiple_of(start_ref[b] & -WINDOW, WINDOW)
        in_cache = cache_ref.at[layer, b, pl.ds(first, WINDOW)]
        source, destination = (in_cache, window_ref.at[b]) if inward else (window_ref.at[b], in_cache)
        return pltpu.make_async_copy(source, destination, sem)

    def each_row(body):
        jax.lax.fori_loop(0, B, lambda b, carry: (body(b), carry)[1], 0)

    each_row(lambda b: copy(b, inward=True).start())
    each_row(lambda b: copy(b, inward=True).wait())

    def select_in(b):
        at_start = jax.lax.broadcasted_iota(jnp.int32, window_ref.shape[1:], 0) == (start_ref[b] & (WINDOW - 1))
        window_ref[b] = jnp.where(at_start, new_ref[pl.ds(b, 1)].astype(window_ref.dtype), window_ref[b])

    each_row(select_in)
    each_row(lambda b: copy(b, inward=False).start())
    each_row(lambda b: copy(b, inward=False).wait())
