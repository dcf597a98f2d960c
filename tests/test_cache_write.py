"""layers/cache_write.py's Pallas kernel (a decode step's cache write), run by Pallas's interpreter on the
CPU against XLA's scatter (kv_cache.scatter_tokens) and numpy's indexing; the tests marked tpu run
Mosaic's compiled kernel on the chip, alone and in generate.py's decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
import train
from configurator import Config
from inference import generate
from layers import cache_write, kv_cache


def written_by_numpy(cache_LxRxSxKH, x_LxBxKH, start_B):
    want = np.asarray(cache_LxRxSxKH.astype(jnp.float32)).copy()
    L, B = x_LxBxKH.shape[:2]
    want[np.arange(L)[:, None], np.arange(B)[None, :], np.asarray(start_B)[None, :]] = np.asarray(x_LxBxKH, np.float32)
    return want


def cache_and_tokens(dtype, L=3, R=6, B=5, S=32, KH=256):
    """A random cache of R rows and B < R rows' new tokens at positions that start, end and cross windows."""
    keys = jax.random.split(jax.random.key(0), 2)
    cache = jax.random.normal(keys[0], (L, R, S, KH)).astype(dtype)
    x_LxBxKH = jax.random.normal(keys[1], (L, B, KH)).astype(dtype)
    return cache, x_LxBxKH, jnp.array([0, 7, 8, 19, S - 1][:B], jnp.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_writes_each_rows_token_at_its_position_and_nothing_else(dtype):
    """Every layer's token at [l, b, start_B[b]]; the rest of each window, the other positions and the
    rows past B as they were: equal to numpy's write and to the scatter's, bit for bit."""
    cache, x_LxBxKH, start_B = cache_and_tokens(dtype)
    want = written_by_numpy(cache, x_LxBxKH, start_B)
    got = cache_write.write_tokens(cache, x_LxBxKH, start_B, interpret=True)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    scattered = kv_cache.scatter_tokens(cache, x_LxBxKH, start_B)
    np.testing.assert_array_equal(np.asarray(scattered.astype(jnp.float32)), want)


def test_takes_only_caches_of_whole_windows_in_16_or_32_bit_dtypes_within_its_vmem():
    assert cache_write.fits(jnp.zeros((1, 2, 16, 128), jnp.bfloat16), 2)
    assert cache_write.fits(jnp.zeros((1, 2, 16, 128), jnp.float32), 2)
    assert not cache_write.fits(jnp.zeros((1, 2, 12, 128), jnp.bfloat16), 2)  # 12 positions: a window cut short
    assert not cache_write.fits(jnp.zeros((1, 2, 16, 128), jnp.int8), 2)  # int8 tiles hold 32 positions
    gpt2 = jax.ShapeDtypeStruct((12, 256, 144, 768), jnp.bfloat16)
    assert cache_write.rows_per_step(gpt2, 8) == 8 and cache_write.rows_per_step(gpt2, 256) == 32
    assert cache_write.fits(gpt2, 1024) and not cache_write.fits(gpt2, 1020)  # 1,020 rows: no block of 8 divides
    too_wide = jax.ShapeDtypeStruct((48, 256, 144, 8192), jnp.bfloat16)  # 8 rows' windows: 72 MiB
    assert not cache_write.fits(too_wide, 256)


def test_writes_a_block_of_rows_a_step(monkeypatch):
    """With VMEM for 8 rows only, 24 rows take three grid steps, and each writes its own rows."""
    cache, x_LxBxKH, _ = cache_and_tokens("bfloat16", L=2, R=26, B=24, S=24, KH=128)
    start_B = jax.random.randint(jax.random.key(1), (24,), 0, 24)
    monkeypatch.setattr(cache_write, "VMEM_BYTES", 2 * 8 * 2 * 128 * (8 * 2 + 4))
    assert cache_write.rows_per_step(cache, 24) == 8
    got = cache_write.write_tokens(cache, x_LxBxKH, start_B, interpret=True)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), written_by_numpy(cache, x_LxBxKH, start_B))


@pytest.mark.tpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_on_the_chip_writes_as_numpy_does(dtype):
    """Mosaic's kernel at GPT-2's width (K·H = 768) and 256 rows of a 264-row cache, in a jitted step that
    donates the cache (in place), and KVCache.write of a decode step on the chip, which takes the kernel."""
    cache, x_LxBxKH, start_B = cache_and_tokens(dtype, L=4, R=264, B=256, S=144, KH=768)
    start_B = jax.random.randint(jax.random.key(3), (256,), 0, 144)
    want = written_by_numpy(cache, x_LxBxKH, start_B)
    got = jax.jit(cache_write.write_tokens, donate_argnums=0)(cache, x_LxBxKH, start_B)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    cache = jnp.asarray(want, dtype)
    written = jax.jit(
        lambda cache, x, start_B: kv_cache.KVCache(cache, cache, 12).write(kv_cache.KVCache(x, x, 12), start_B).k
    )(cache, x_LxBxKH[:, :, None], start_B)
    np.testing.assert_array_equal(np.asarray(written.astype(jnp.float32)), written_by_numpy(cache, x_LxBxKH, start_B))


@pytest.mark.tpu
def test_on_the_chip_greedy_tokens_are_the_scatters(monkeypatch):
    """generate.py's decode on the chip with the kernel and with XLA's scatter (the kernel refused):
    the same greedy tokens for rows of mixed prompt lengths, in float32 and bfloat16."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 90, 16)]
    for dtype in ("float32", "bfloat16"):
        config = Config(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=256, dtype=dtype, batch_size=1)
        setup = train.make_setup(config, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), 256)
        params = jax.tree.map(lambda a: a * 4, train.init_state(setup)["params"])  # peaked logits: fewer near-ties
        tokens, wrote_by_kernel = {}, {}
        for writer in ("kernel", "scatter"):
            if writer == "scatter":
                monkeypatch.setattr(cache_write, "fits", lambda cache, rows: False)
            generate._compile.cache_clear()  # compiled programs are cached by their arguments, not by fits
            _, run_decode = generate.first_programs(setup, params, prompts, 40, temperature=0)
            wrote_by_kernel[writer] = "write_tokens" in run_decode.as_text()
            tokens[writer] = generate.generate(setup, params, prompts, 40, temperature=0).tokens
        monkeypatch.undo()
        assert wrote_by_kernel == {"kernel": True, "scatter": False}
        assert tokens["kernel"] == tokens["scatter"], dtype
