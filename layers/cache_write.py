"""A decode step's cache write as a Pallas TPU kernel: one new token per row, each at its own position,
written into every layer of the cache in place. Only jax: the file works on its own.

XLA makes the same write (KVCache.write's scatter) a loop over (layer, row) units on a TPU: ~0.8 ms
a step for GPT-2's keys and values at 256 rows on a v5e, about a quarter of the decode step. A DMA
moves whole tiles only, and a position is one row of a tile of 8 (the cache (L, B, S, K·H) has
positions second-minor), so the kernel copies each row's 8-position window holding its new position
into VMEM, selects the new token into it and copies it back. A row's new position is the same in
every layer, so one strided DMA each way moves the row's windows of all L layers, and a block of rows'
copies in overlaps the previous block's copies out: ~0.12 ms an array at 256 rows on a v5e, against
0.26 with a DMA per (layer, row) and 0.16 without the overlap (bench/NOTES.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Positions in a tile of the cache's second-minor axis: a DMA's offset along it must be a multiple.
WINDOW = 8
# VMEM the kernel may take (two blocks of rows' windows, and of their new tokens): under the 16 MiB a TPU
# kernel gets by default.
VMEM_BYTES = 12 << 20


def rows_per_step(cache_LxRxSxKH, rows: int) -> int | None:
    """How many rows a grid step writes: all of them, or a block of a multiple of 8 rows (the new tokens'
    block is (L, rows, K·H)) that divides them, the largest whose VMEM fits; None if none fits."""
    L, _, _, KH = cache_LxRxSxKH.shape
    vmem = lambda n: 2 * n * L * KH * (WINDOW * cache_LxRxSxKH.dtype.itemsize + 4)  # two blocks of each
    blocks = [rows] + [n for n in (128, 64, 32, 16, 8) if n < rows and rows % n == 0]
    return next((n for n in blocks if vmem(n) <= VMEM_BYTES), None)


def fits(cache_LxRxSxKH, rows: int) -> bool:
    """Whether the kernel takes this cache and `rows` new tokens: a 16- or 32-bit dtype (int8 tiles hold
    32 positions), whole windows of positions, and a block of rows within VMEM_BYTES."""
    S, itemsize = cache_LxRxSxKH.shape[2], cache_LxRxSxKH.dtype.itemsize
    return itemsize in (2, 4) and S % WINDOW == 0 and rows_per_step(cache_LxRxSxKH, rows) is not None


@functools.partial(jax.jit, static_argnames="interpret")
def write_tokens(cache_LxRxSxKH, new_LxBxKH, start_B, interpret: bool = False):
    """The cache with new_LxBxKH[l, b] at [l, b, start_B[b]] for rows b < B (R >= B; the other rows
    untouched), in place when the caller donates the cache. start_B in [0, S). Pass interpret=True to run
    it off a TPU (tests on the CPU)."""
    L, R, S, KH = cache_LxRxSxKH.shape
    B = new_LxBxKH.shape[1]
    rows = rows_per_step(cache_LxRxSxKH, B) or B
    return pl.pallas_call(
        _write_kernel,
        out_shape=jax.ShapeDtypeStruct(cache_LxRxSxKH.shape, cache_LxRxSxKH.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B // rows,),
            # float32 rows: Mosaic loads one row of a packed (bfloat16) tile only with its neighbours
            in_specs=[
                pl.BlockSpec((L, rows, KH), lambda step, start: (0, step, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[
                pltpu.VMEM((2, rows, L, WINDOW, KH), cache_LxRxSxKH.dtype),  # this block's windows and the next's
                pltpu.SemaphoreType.DMA((2, 2)),  # (block parity, inward or outward)
            ],
        ),
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * L * B * WINDOW * KH * 4),
        interpret=interpret,
    )(start_B.astype(jnp.int32), new_LxBxKH.astype(jnp.float32), cache_LxRxSxKH)


def _write_kernel(start_ref, new_ref, cache_in_ref, cache_ref, windows_ref, sems):
    """One block of rows: each row's windows (all layers) copied in, its new tokens selected in, copied
    back. The next block's windows are copied in meanwhile, into the other half of windows_ref.
    cache_in_ref is cache_ref's buffer (aliased)."""
    step, steps, rows = pl.program_id(0), pl.num_programs(0), windows_ref.shape[1]
    # no % or //: their lowering (through sign) asks for the chip's generation, failing a CPU host's compile
    half = step & 1

    def copy(block, half, r, inward: bool):
        row = block * rows + r
        first = pl.multiple_of(start_ref[row] & -WINDOW, WINDOW)
        in_cache, window = cache_ref.at[:, row, pl.ds(first, WINDOW)], windows_ref.at[half, r]
        source, destination = (in_cache, window) if inward else (window, in_cache)
        return pltpu.make_async_copy(source, destination, sems.at[half, 0 if inward else 1])

    def each_row(body):
        jax.lax.fori_loop(0, rows, lambda r, carry: (body(r), carry)[1], 0)

    @pl.when(step == 0)
    def _():
        each_row(lambda r: copy(0, 0, r, inward=True).start())

    @pl.when(step > 0)  # the other half's last writes out, before the next block is copied into it
    def _():
        each_row(lambda r: copy(step - 1, 1 - half, r, inward=False).wait())

    @pl.when(step + 1 < steps)
    def _():
        each_row(lambda r: copy(step + 1, 1 - half, r, inward=True).start())

    each_row(lambda r: copy(step, half, r, inward=True).wait())

    def select_in(r):
        offset = start_ref[step * rows + r] & (WINDOW - 1)
        at_start = jax.lax.broadcasted_iota(jnp.int32, windows_ref.shape[2:], 1) == offset
        window = windows_ref.at[half, r]
        window[...] = jnp.where(at_start, new_ref[:, pl.ds(r, 1)].astype(window.dtype), window[...])

    each_row(select_in)
    each_row(lambda r: copy(step, half, r, inward=False).start())

    @pl.when(step == steps - 1)
    def _():
        each_row(lambda r: copy(step, half, r, inward=False).wait())
