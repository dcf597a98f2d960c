"""model.py: parameter counts, FLOPs, causality, layer layouts, remat, init, dropout, dtypes,
and the forward pass against an independent float64 NumPy implementation of GPT-2."""

import dataclasses
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # model.py lives at the repo root

import model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
GPT2_SMALL_PARAMS = 124_439_808


# --- the NumPy reference ------------------------------------------------------------------

def _layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * scale
    return y if bias is None else y + bias


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_forward(params, idx):
    """GPT-2's forward pass in float64 NumPy, from the stacked parameters of model.GPT.

    params: nested dict as nnx.to_pure_dict(nnx.state(model)) gives it (arrays of any kind);
        biases may be absent (bias=False). idx: int array (B, T). Returns float64 logits
        (B, T, V) over every row of wte, padding rows included (no masking).
    """
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    blocks, idx = p["blocks"], np.asarray(idx)
    attn, mlp = blocks["attn"], blocks["mlp"]
    ln_1, ln_2, ln_f = blocks["ln_1"], blocks["ln_2"], p["ln_f"]
    B, T = idx.shape
    L, D, _, N, H = attn["qkv_kernel"].shape
    causal_TxT = np.tril(np.ones((T, T), bool))

    x = p["wte"][idx] + p["wpe"][:T]  # (B, T, D)
    for l in range(L):
        h = _layer_norm(x, ln_1["scale"][l], ln_1.get("bias", [None] * L)[l])
        qkv = np.einsum("btd,dcnh->btcnh", h, attn["qkv_kernel"][l])
        if "qkv_bias" in attn:
            qkv = qkv + attn["qkv_bias"][l]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, N, H)
        scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
        scores = np.where(causal_TxT, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
        y = np.einsum("bnqk,bknh->bqnh", weights, v)
        y = np.einsum("btnh,nhd->btd", y, attn["out_kernel"][l])
        if "out_bias" in attn:
            y = y + attn["out_bias"][l]
        x = x + y

        h = _layer_norm(x, ln_2["scale"][l], ln_2.get("bias", [None] * L)[l])
        h = h @ mlp["fc_kernel"][l]
        if "fc_bias" in mlp:
            h = h + mlp["fc_bias"][l]
        h = _gelu_tanh(h) @ mlp["proj_kernel"][l]
        if "proj_bias" in mlp:
            h = h + mlp["proj_bias"][l]
        x = x + h
    x = _layer_norm(x, ln_f["scale"], ln_f.get("bias"))
    return x @ p["wte"].T  # tied output layer


# --- helpers ------------------------------------------------------------------------------

def make(config=TINY, seed=0, **changes):
    return GPT(dataclasses.replace(config, **changes), jax.random.key(seed))


def tokens(shape=(2, 16), vocab=TINY.vocab_size, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def randomize(gpt, seed=2):
    """Nonzero biases and non-unit layer norm scales, so the reference check covers them."""
    rng = np.random.default_rng(seed)
    pure = nnx.to_pure_dict(nnx.state(gpt))

    def perturb(path, a):
        name = str(path[-1].key)
        if name == "scale":
            return a + 0.2 * rng.standard_normal(a.shape).astype(np.float32)
        if "bias" in name:
            return a + 0.1 * rng.standard_normal(a.shape).astype(np.float32)
        return a

    pure = jax.tree_util.tree_map_with_path(perturb, pure)
    state = nnx.state(gpt)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(gpt, state)
    return gpt


def param_leaves(gpt):
    return jax.tree.leaves(nnx.state(gpt, nnx.Param))


def grads_of(gpt, idx, targets):
    graphdef, state = nnx.split(gpt)

    def loss(state):
        logits = nnx.merge(graphdef, state)(idx)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()

    return jax.grad(loss)(state)


# --- sizes --------------------------------------------------------------------------------

def test_count_params_gpt2_small():
    assert model.count_params(GPTConfig()) == GPT2_SMALL_PARAMS
    V, T, L, D = 50257, 1024, 12, 768
    assert V * D + T * D + L * (12 * D * D + 13 * D) + 2 * D == GPT2_SMALL_PARAMS


def test_count_params_with_padded_vocab():
    padded = GPTConfig(pad_vocab_to_multiple=64)
    assert padded.padded_vocab_size == 50304
    assert model.count_params(padded) == GPT2_SMALL_PARAMS + (50304 - 50257) * 768


@pytest.mark.parametrize("bias", [True, False])
def test_count_params_matches_a_real_model(bias):
    config = dataclasses.replace(TINY, bias=bias)
    real = sum(a.size for a in param_leaves(GPT(config, jax.random.key(0))))
    assert model.count_params(config) == real
    D = config.n_embd
    per_layer = 12 * D * D + (13 * D if bias else 2 * D)  # without biases: the 2 LN scales
    assert real == (65 + 16) * D + 2 * per_layer + (2 * D if bias else D)


def test_flops_per_token_gpt2_small():
    expected = 6 * (GPT2_SMALL_PARAMS - 1024 * 768) + 12 * 12 * 1024 * 768
    assert expected == 855_166_464
    assert model.flops_per_token(GPTConfig()) == expected
    # A shorter context only shrinks the attention term.
    assert model.flops_per_token(GPTConfig(), seq_len=512) == expected - 12 * 12 * 512 * 768


# --- behaviour ----------------------------------------------------------------------------

def test_logits_shape_and_dtype():
    logits = make()(tokens())
    assert logits.shape == (2, 16, 65) and logits.dtype == jnp.float32
    with pytest.raises(ValueError, match="block_size"):
        make()(tokens((1, 17)))


def test_causality():
    gpt, t = make(), 6
    idx = tokens((1, 16))
    changed = idx.at[0, t].set((idx[0, t] + 1) % TINY.vocab_size)
    before, after = np.asarray(gpt(idx)), np.asarray(gpt(changed))
    np.testing.assert_array_equal(before[:, :t], after[:, :t])
    assert np.abs(before[:, t] - after[:, t]).max() > 1e-4
    assert np.abs(before[:, t + 1:] - after[:, t + 1:]).max() > 1e-4


def test_scan_and_unrolled_layers_agree():
    scanned, unrolled = make(scan_layers=True), make(scan_layers=False)
    for a, b in zip(param_leaves(scanned), param_leaves(unrolled), strict=True):
        np.testing.assert_array_equal(a, b)
    idx = tokens()
    np.testing.assert_allclose(scanned(idx), unrolled(idx), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def no_remat():
    """Logits and gradients of the remat_policy='none' model, shared by the remat tests."""
    idx, targets = tokens(seed=1), tokens(seed=3)
    base = randomize(make())
    return idx, targets, np.asarray(base(idx)), jax.tree.leaves(grads_of(base, idx, targets))


@pytest.mark.parametrize("policy, scan_layers", [(policy, True) for policy in sorted(model.REMAT_POLICIES)]
                         + [("full", False)])
def test_remat_policies_give_the_same_logits_and_gradients(no_remat, policy, scan_layers):
    idx, targets, logits_base, grads_base = no_remat
    remat = randomize(make(scan_layers=scan_layers, remat_policy=policy))
    np.testing.assert_allclose(remat(idx), logits_base, rtol=0, atol=1e-5)
    grads_remat = jax.tree.leaves(grads_of(remat, idx, targets))
    assert len(grads_base) == len(grads_remat) == len(param_leaves(remat))
    assert any(np.abs(g).max() > 1e-3 for g in grads_base)  # the gradients are not all ~0
    for a, b in zip(grads_base, grads_remat, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_padded_vocab_logits():
    gpt = make(pad_vocab_to_multiple=64)
    assert gpt.wte.shape == (128, TINY.n_embd)
    logits = np.asarray(gpt(tokens()))
    assert logits.shape == (2, 16, 128)
    assert np.all(np.isfinite(logits[..., :65]))
    assert np.all(logits[..., 65:] == -np.inf)
    # The real entries match an unpadded model with the same real rows.
    unpadded = make()
    unpadded.wte[...] = gpt.wte[...][:65]
    np.testing.assert_allclose(logits[..., :65], unpadded(tokens()), rtol=0, atol=1e-5)


def test_init_statistics():
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
    gpt = nnx.jit(lambda: GPT(config, jax.random.key(0)))()
    pure = nnx.to_pure_dict(nnx.state(gpt))
    blocks = pure["blocks"]
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    expected_std = {
        "wte": (pure["wte"], 0.02), "wpe": (pure["wpe"], 0.02),
        "qkv_kernel": (blocks["attn"]["qkv_kernel"], 0.02),
        "fc_kernel": (blocks["mlp"]["fc_kernel"], 0.02),
        "out_kernel": (blocks["attn"]["out_kernel"], residual_std),
        "proj_kernel": (blocks["mlp"]["proj_kernel"], residual_std),
    }
    for name, (array, std) in expected_std.items():
        array = np.asarray(array)
        assert abs(array.mean()) < 0.1 * std, name
        assert abs(array.std() / std - 1) < 0.1, (name, array.std(), std)
    # Each layer gets its own weights, not copies of one.
    assert not np.allclose(blocks["attn"]["qkv_kernel"][0], blocks["attn"]["qkv_kernel"][1])
    for name, bias in [("qkv_bias", blocks["attn"]["qkv_bias"]), ("out_bias", blocks["attn"]["out_bias"]),
                       ("fc_bias", blocks["mlp"]["fc_bias"]), ("proj_bias", blocks["mlp"]["proj_bias"]),
                       ("ln_1", blocks["ln_1"]["bias"]), ("ln_2", blocks["ln_2"]["bias"]),
                       ("ln_f", pure["ln_f"]["bias"])]:
        assert np.all(np.asarray(bias) == 0), name
    for scale in (blocks["ln_1"]["scale"], blocks["ln_2"]["scale"], pure["ln_f"]["scale"]):
        assert np.all(np.asarray(scale) == 1)
    assert all(a.dtype == jnp.float32 for a in param_leaves(gpt))


def test_dropout():
    idx, key = tokens(), jax.random.key(7)
    gpt = make(dropout=0.1)
    plain = np.asarray(gpt(idx))
    dropped = np.asarray(gpt(idx, dropout_key=key))
    assert np.abs(dropped - plain).max() > 1e-3
    np.testing.assert_array_equal(dropped, gpt(idx, dropout_key=key))
    assert np.abs(dropped - np.asarray(gpt(idx, dropout_key=jax.random.key(8)))).max() > 1e-3
    no_dropout = make(dropout=0.0)
    np.testing.assert_array_equal(no_dropout(idx, dropout_key=key), no_dropout(idx))
    np.testing.assert_array_equal(no_dropout(idx), plain)  # same weights; no key = no dropout


@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_numpy_reference(bias):
    gpt = randomize(make(bias=bias))
    idx = tokens((2, 16))
    logits = np.asarray(gpt(idx))
    expected = reference_forward(nnx.to_pure_dict(nnx.state(gpt)), idx)
    assert expected.shape == logits.shape
    assert np.abs(expected).max() > 0.1  # not a trivially small comparison
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-6)  # measured: ~7e-8


def test_forward_matches_numpy_reference_on_a_prefix_with_padded_vocab():
    gpt = randomize(make(pad_vocab_to_multiple=64))
    idx = tokens((2, 9))  # shorter than block_size: only the first 9 wpe rows are used
    logits = np.asarray(gpt(idx))
    expected = reference_forward(nnx.to_pure_dict(nnx.state(gpt)), idx)
    np.testing.assert_allclose(logits[..., :65], expected[..., :65], rtol=0, atol=1e-6)  # measured: ~7e-8


def test_bfloat16_compute():
    idx = tokens()
    full = make()
    half = make(dtype="bfloat16")
    assert all(a.dtype == jnp.float32 for a in param_leaves(half))
    logits_full, logits_half = np.asarray(full(idx)), half(idx)
    assert logits_half.dtype == jnp.float32
    diff = np.abs(np.asarray(logits_half) - logits_full).max()
    assert 0 < diff < 0.02  # really computed in bfloat16 (measured ~2e-3), and close
