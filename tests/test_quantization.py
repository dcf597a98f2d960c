"""Tests of layers/quantization.py: int8 and fp8 matmuls and int8 weights within their rounding bounds,
straight-through gradients."""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from flax import nnx
from inference import loader
from layers import embedding, kv_cache, quantization


def operands(scale, outlier=None, shape=((128, 96), (96, 64)), seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = scale * jax.random.normal(kx, shape[0])
    w = jax.random.normal(kw, shape[1]) / np.sqrt(shape[0][1])
    if outlier is not None:  # one huge activation in token 3, as LLM activations have
        x = x.at[3, 5].set(outlier * scale)
    return x, w


def product_error_bound(x, w, x_error, w_error):
    """|(x + dx) @ (w + dw) - x @ w| <= |x| @ |dw| + |dx| @ |w| + |dx| @ |dw|, elementwise."""
    ax, aw = jnp.abs(x), jnp.abs(w)
    return ax @ w_error + x_error @ aw + x_error @ w_error


def int8_rounding_error(a, axis):
    """Rounding to the nearest multiple of scale = max|a| / 127 along `axis` errs by <= scale / 2."""
    scale = jnp.max(jnp.abs(a), axis=axis, keepdims=True) / 127
    return jnp.broadcast_to(scale / 2, a.shape)


def fp8_rounding_error(a, dtype):
    """e4m3 keeps 3 mantissa bits (half an ulp <= 2^-4 relative), e5m2 keeps 2 (2^-3);
    below the smallest normal the spacing is fixed: half of it, in units of the scale."""
    info = jnp.finfo(dtype)
    scale = jnp.max(jnp.abs(a)) / float(info.max)
    relative = 2.0 ** -(info.nmant + 1)
    return jnp.abs(a) * relative + scale * float(info.smallest_subnormal) / 2


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("outlier", [None, 100.0])
def test_int8_matmul_is_within_its_rounding_error_bound(scale, outlier):
    x, w = operands(scale, outlier)
    exact = x @ w
    got = quantization.matmul(x, w, "int8")
    bound = product_error_bound(x, w, int8_rounding_error(x, 1), int8_rounding_error(w, 0))
    error = jnp.abs(got - exact)
    assert bool(jnp.all(error <= bound * 1.001 + 1e-6 * jnp.abs(exact)))
    assert float(jnp.max(error)) > 0  # it really did round
    # relative to the output's size the error is small, whatever the input scale...
    others = np.arange(x.shape[0]) != 3
    relative = jnp.abs(got - exact)[others].max() / jnp.abs(exact)[others].max()
    assert float(relative) < 0.02
    # ...and an outlier coarsens only its own token's grid: the others match the no-outlier case
    if outlier is not None:
        clean = quantization.matmul(operands(scale)[0], w, "int8")
        np.testing.assert_array_equal(np.asarray(got)[others], np.asarray(clean)[others])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("outlier", [None, 100.0])
def test_fp8_matmul_is_within_its_rounding_error_bound(scale, outlier):
    x, w = operands(scale, outlier)
    exact = x @ w
    got = quantization.matmul(x, w, "fp8")
    e4m3 = quantization.FORWARD_FP8
    bound = product_error_bound(x, w, fp8_rounding_error(x, e4m3), fp8_rounding_error(w, e4m3))
    error = jnp.abs(got - exact)
    assert bool(jnp.all(error <= bound * 1.001 + 1e-6 * jnp.abs(exact)))
    assert float(jnp.max(error)) > 0


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_gradients_are_straight_through(mode):
    """With loss = sum(y * c), dL/dy = c whatever the forward rounded, so the weight gradient
    (kept in float) is exactly x^T c and the input gradient is c @ w^T up to its own rounding."""
    x, w = operands(1.0, outlier=20.0)
    c = jax.random.normal(jax.random.key(7), (x.shape[0], w.shape[1]))
    dx, dw = jax.grad(lambda x, w: jnp.sum(quantization.matmul(x, w, mode) * c), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dw, x.T @ c, rtol=1e-5, atol=1e-5)
    if mode == "int8":
        bound = product_error_bound(c, w.T, int8_rounding_error(c, 1), int8_rounding_error(w.T, 0))
    else:
        bound = product_error_bound(
            c, w.T, fp8_rounding_error(c, quantization.GRADIENT_FP8), fp8_rounding_error(w.T, quantization.FORWARD_FP8)
        )
    exact = c @ w.T
    assert bool(jnp.all(jnp.abs(dx - exact) <= bound * 1.001 + 1e-6 * jnp.abs(exact)))
    assert float(jnp.abs(dx - exact).max()) > 0  # quantized, not the float product


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_operands_really_are_8_bit(mode):
    """The compiled forward multiplies 8-bit operands with a wide accumulator."""
    x, w = operands(1.0)
    hlo = jax.jit(lambda x, w: quantization.matmul(x, w, mode)).lower(x, w).as_text()
    operand = {"int8": "i8", "fp8": "f8E4M3FN"}[mode]
    accumulator = {"int8": "i32", "fp8": "f32"}[mode]
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and f"tensor<128x96x{operand}>" in dots[0] and f"x{accumulator}>" in dots[0]


def test_none_is_the_plain_matmul_and_zeros_stay_zero():
    x, w = operands(1.0)
    np.testing.assert_array_equal(quantization.matmul(x, w, "none"), x @ w)
    zeros = jnp.zeros_like(x)
    for mode in ("int8", "fp8"):
        assert not np.any(np.asarray(quantization.matmul(zeros, w, mode)))  # no 0/0 from a zero scale


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients():
    x, w = (a.astype(jnp.bfloat16) for a in operands(1.0))
    for mode in ("int8", "fp8"):
        y, grads = jax.value_and_grad(lambda x, w: quantization.matmul(x, w, mode).sum(), argnums=(0, 1))(x, w)
        assert y.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)


def test_int8_weight_in_bfloat16_rounds_once():
    """A served int8 weight w ≈ q · scale in a bfloat16 model: x @ w is the float32 product, rounded to
    bfloat16 once (rounding x @ q and the scale to bfloat16 first changed 37% of these outputs)."""
    x, w = operands(1.0)
    x = x.astype(jnp.bfloat16)
    weight = quantization.Int8Weight.of(w, (0,))
    assert weight.q.dtype == jnp.int8 and weight.scale.dtype == jnp.float32 and weight.scale.shape == (1, 64)
    expected = (x.astype(jnp.float32) @ (weight.q.astype(jnp.float32) * weight.scale)).astype(jnp.bfloat16)
    y = weight.matmul(x)
    assert y.dtype == jnp.bfloat16 and np.array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_weight_times_a_few_rows_equals_those_rows_of_a_full_product(rows):
    """Fewer rows than the matrix unit takes are padded with zero rows and the padding dropped: each
    row's product is the one it has in a larger batch, and the output keeps the input's rows."""
    x, w = operands(1.0)
    x = x.astype(jnp.bfloat16)
    weight = quantization.Int8Weight.of(w, (0,))
    y = weight.matmul(x[:rows])
    assert y.shape == (rows, w.shape[1])
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(weight.matmul(x)[:rows], np.float32))


@pytest.mark.parametrize("shape, input_axes", [((96, 64), (0,)), ((4, 24, 64), (0, 1))])
def test_int8_weight_errs_by_at_most_half_a_step_of_its_channels_grid(shape, input_axes):
    """A served int8 weight: every element within half a step of its output channel's grid, the
    step max|w| / 127 over the input axes computed here from w (not Int8Weight's scale), and so
    x @ w within |x| @ (step / 2). Axes as model.py's kernels have them: (in, out), and an attention
    output (heads, head_dim, out) whose two leading axes are both inputs. One channel holds an
    outlier: a grid per channel keeps it from coarsening the others."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    w[(1,) * (len(shape) - 1) + (5,)] = 40.0
    step = np.abs(w.astype(np.float64)).max(axis=input_axes, keepdims=True) / 127
    weight = quantization.Int8Weight.of(jnp.asarray(w), input_axes)
    error = np.abs(np.asarray(weight.q, np.float64) * np.asarray(weight.scale, np.float64) - w)
    assert np.all(error <= step / 2 * (1 + 1e-6)), (error / step).max()
    assert (error / step).max() > 0.4  # it really rounded: some element near the middle of a step
    fan_in = int(np.prod([shape[a] for a in input_axes]))
    x = rng.standard_normal((16, fan_in)).astype(np.float32)
    w_IxO, half_step_IxO = w.reshape(fan_in, 64), np.broadcast_to(step / 2, shape).reshape(fan_in, 64)
    got = np.asarray(weight.reshape(fan_in, 64).matmul(jnp.asarray(x)), np.float64)
    exact = x.astype(np.float64) @ w_IxO
    float32_rounding = 1e-5 * (np.abs(x) @ np.abs(w_IxO))
    assert np.all(np.abs(got - exact) <= np.abs(x) @ half_step_IxO + float32_rounding)


def test_int8_weights_through_splash_give_the_written_out_attentions_logits():
    """A forward pass without a cache (prompt scoring, sample.py --kv_cache=False) with served int8
    weights through splash (interpreted here), whose projections take the whole kernels heads-major
    (weight.astype): the logits of the written-out attention's path with the same weights, for a
    grouped-query model with biases (the heads-major path raised AttributeError on an Int8Weight)."""
    idx = jax.random.randint(jax.random.key(1), (2, 128), 0, 64)

    def logits(attention):
        config = model.GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
        graphdef, params = nnx.split(model.GPT(dataclasses.replace(config, attention=attention), jax.random.key(0)))
        int8_params = loader.int8_weights(nnx.to_pure_dict(params))
        assert any(isinstance(p, quantization.Int8Weight) for p in jax.tree.leaves(int8_params, is_leaf=is_int8))
        return nnx.merge(graphdef, int8_params)(idx)

    np.testing.assert_allclose(logits("splash"), logits("einsum"), atol=1e-5)


def is_int8(p) -> bool:
    return isinstance(p, quantization.Int8Weight)


# ----------------------------------------------------------------------------- an int8 token table


def int8_table(V=96, D=32, seed=0):
    """A (V, D) table as serving holds it: int8, one scale per row (the sum runs over the width)."""
    w = jax.random.normal(jax.random.key(seed), (V, D)) * jnp.linspace(0.1, 3.0, V)[:, None]  # rows of all sizes
    return quantization.Int8Weight.of(w, (1,))


@pytest.mark.parametrize("V, idx_shape", [(96, (1, 1)), (96, (3, 5)), (90, (1, 1))])
def test_an_int8_tables_lookup_is_its_int8_rows_times_their_scales(V, idx_shape):
    """embedding_lookup of an int8 table: q[idx] · scale[idx] in float32, exactly, whether it slices the one
    row's tile of 32 (a decode step at batch 1), gathers several rows, or the table isn't in whole tiles."""
    table = int8_table(V)
    assert table.scale.shape == (V, 1)
    idx = jax.random.randint(jax.random.key(1), idx_shape, 0, V).at[0, 0].set(V - 1)  # the last tile too
    rows = jax.jit(embedding.embedding_lookup)(table, idx)
    expected = table.q[idx].astype(jnp.float32) * table.scale[idx]
    assert rows.shape == (*idx_shape, 32) and rows.dtype == jnp.float32
    np.testing.assert_array_equal(rows, expected)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_int8_tables_logits_are_x_times_its_dequantized_transpose(rows, dtype):
    """The tied output layer on an int8 table (V, D): float32 logits x @ (q · scale)ᵀ, the int8 values cast
    to x's dtype, the product accumulated in float32 and scaled per vocabulary entry, for fewer rows than
    the matrix unit takes (padded) and more."""
    table = int8_table()
    x = jax.random.normal(jax.random.key(2), (rows, 32)).astype(dtype)
    logits = embedding.logits_matmul(x, table.T)
    expected = x.astype(jnp.float32) @ (table.q.astype(jnp.float32) * table.scale).T
    assert logits.shape == (rows, 96) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_served_int8_vocabulary_gives_the_dequantized_models_logits_and_tokens(tie):
    """serving_weights' int8 (blocks, token table and an untied output layer: a scale per vocabulary entry)
    against the same int8 values dequantized into float32 arrays: the same logits within float32 rounding,
    through the forward pass and a prefill and decode steps at batch 1 (the tile lookup, the padded output
    layer), with the vocabulary's padding -inf and the soft cap; the same greedy tokens. The decode step
    never dequantizes the table: no float (V, D) or (D, V) product q · scale (the matmul casts q to x's
    dtype, which XLA:TPU fuses into the matrix unit's operand read)."""
    config = model.GPTConfig(
        vocab_size=150, pad_vocab_to_multiple=32, block_size=16, n_layer=2, n_head=2, n_embd=32,
        tie_embeddings=tie, logit_softcap=15.0,
    )  # fmt: skip
    graphdef, params = nnx.split(model.GPT(config, jax.random.key(0)))
    setup = types.SimpleNamespace(model_config=config)
    int8_params = loader.serving_weights(setup, nnx.to_pure_dict(params), "int8")
    vocab = [int8_params["wte"]] + ([] if tie else [int8_params["lm_head_kernel"]])
    assert all(is_int8(w) for w in vocab) and int8_params["wte"].scale.shape == (160, 1)
    assert tie or int8_params["lm_head_kernel"].scale.shape == (1, 160)
    assert "int8 blocks and vocabulary" in loader.memory_summary(setup, int8_params)
    dequantized = jax.tree.map(lambda w: w.astype(jnp.float32) if is_int8(w) else w, int8_params, is_leaf=is_int8)

    def generate(params, prompt, steps=6):
        gpt = nnx.merge(graphdef, params)
        logits, cache = gpt.prefill(prompt, 16)
        all_logits, tokens = [logits], []
        for t in range(prompt.shape[1], prompt.shape[1] + steps):
            tokens.append(jnp.argmax(logits, -1).astype(jnp.int32))
            logits, cache = gpt.decode(tokens[-1][:, None], cache, jnp.full((1,), t, jnp.int32))
            all_logits.append(logits)
        return jnp.stack(all_logits), jnp.stack(tokens)

    prompt = jax.random.randint(jax.random.key(1), (1, 5), 0, 150)
    (logits, tokens), (expected_logits, expected_tokens) = (
        jax.jit(generate)(p, prompt) for p in (int8_params, dequantized)
    )
    assert np.all(np.isneginf(logits[..., 150:])) and np.all(np.isfinite(logits[..., :150]))
    assert np.abs(logits[..., :150]).max() < 15.0  # soft-capped
    np.testing.assert_allclose(logits[..., :150], expected_logits[..., :150], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tokens, expected_tokens)
    forward = lambda p: nnx.merge(graphdef, p)(jnp.tile(prompt, (2, 1)))
    np.testing.assert_allclose(forward(int8_params)[..., :150], forward(dequantized)[..., :150], rtol=1e-5, atol=1e-5)

    def decode_step(params, cache):
        return nnx.merge(graphdef, params).decode(prompt[:, :1], cache, jnp.zeros(1, jnp.int32))[0]

    step = str(jax.make_jaxpr(decode_step)(int8_params, kv_cache.init_cache(config, 1, 16)))
    assert not re.search(r"(f32|bf16)\[(160,32|32,160)\] = mul", step), "the int8 table dequantized"
