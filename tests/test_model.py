"""model.py: parameter counts, FLOPs, causality, layer layouts, remat, init, dropout, dtypes,
and the forward pass against an independent float64 NumPy implementation of GPT-2, of its
Llama-style options (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output) and of the
GPT-2 speedruns' switches (qk_norm, ReLU² MLP, zero-initialised projections, logit soft-cap)."""

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
from layers import attention  # noqa: E402
from layers import blocks  # noqa: E402
from layers import kv_cache  # noqa: E402
from layers import moe as moe_layer  # noqa: E402
from layers import rope as rotary  # noqa: E402
from configurator import load_config  # noqa: E402
from common import model_setup  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from weights import hf  # noqa: E402

TINY = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
# Every switch away from GPT-2: 4 query heads in 2 groups (G = 2), head size 8, SwiGLU 64 wide.
LLAMA = dataclasses.replace(
    TINY,
    pos_embedding="rope",
    norm="rmsnorm",
    norm_eps=1e-6,
    mlp="swiglu",
    n_kv_head=2,
    bias=False,
    tie_embeddings=False,
)
# modded-nanogpt's switches on a Llama-style model (grouped-query attention included).
SPEEDRUN = dataclasses.replace(LLAMA, qk_norm=True, mlp="relu2", zero_init_proj=True, logit_softcap=15.0)
# Mixtures of experts, dropless (capacity_factor 0) unless a test says otherwise.
MOE_VARIANTS = {
    "gelu, top-2 of 4": dataclasses.replace(TINY, n_experts=4, experts_per_token=2, capacity_factor=0.0),
    "swiglu, top-1, a shared expert, first layer dense": dataclasses.replace(
        LLAMA,
        n_layer=3,
        n_experts=4,
        experts_per_token=1,
        n_shared_experts=1,
        moe_hidden=24,
        moe_dense_layers=1,
        capacity_factor=0.0,
    ),
    "relu2, top-3 of 3": dataclasses.replace(TINY, mlp="relu2", n_experts=3, experts_per_token=3, capacity_factor=0.0),
}
GPT2_SMALL_PARAMS = 124_439_808


# --- the NumPy reference ------------------------------------------------------------------


def _layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * scale
    return y if bias is None else y + bias


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _rms_norm(x, scale, bias=None, eps=1e-5):
    assert bias is None
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _unit_rms(x, eps):
    """qk_norm: every head vector (last axis) scaled to root mean square 1, no learned scale."""
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def _frequencies(H, config):
    """RoPE's angular frequencies as Llama 3.1's reference code states them: by wavelength
    2π / f, one at a time: short waves kept, long ones divided by the factor, the band between
    interpolated by how many periods fit in the original context."""
    freqs = []
    for i in range(H // 2):
        f = config.rope_theta ** (-2.0 * i / H)
        if config.rope_scaling == "llama3":
            wavelength = 2 * math.pi / f
            short = config.rope_original_context / config.rope_high_freq_factor
            long = config.rope_original_context / config.rope_low_freq_factor
            if wavelength > long:
                f = f / config.rope_scaling_factor
            elif wavelength >= short:
                smooth = (config.rope_original_context / wavelength - config.rope_low_freq_factor) / (
                    config.rope_high_freq_factor - config.rope_low_freq_factor
                )
                f = (1 - smooth) * f / config.rope_scaling_factor + smooth * f
        freqs.append(f)
    return np.array(freqs)


def _rotate(x, positions, freqs):
    """RoPE the slow way: every head vector x[..., t, :, :] (H dims) is multiplied by a rotation
    matrix built for its position, turning the plane of dimensions (i, i + H/2) by
    position · freqs[i]. x: (B, T, ..., H); positions: (B, T)."""
    H = x.shape[-1]
    out = np.empty_like(x)
    for b, t in np.ndindex(*positions.shape):
        rotation = np.zeros((H, H))
        for i in range(H // 2):
            angle = positions[b, t] * freqs[i]
            c, s = np.cos(angle), np.sin(angle)
            rotation[i, i], rotation[i, i + H // 2] = c, -s
            rotation[i + H // 2, i], rotation[i + H // 2, i + H // 2] = s, c
        out[b, t] = x[b, t] @ rotation.T
    return out


def reference_forward(params, idx, config=None):
    """The forward pass in float64 NumPy, from the stacked parameters of model.GPT.

    GPT-2's by default; config's switches (pos_embedding, norm, mlp, n_kv_head, tie_embeddings)
    make it Llama-style, and qk_norm, mlp='relu2', logit_softcap modded-nanogpt's (zero_init_proj
    is only an initialisation: nothing to compute). params: nested dict as nnx.to_pure_dict(nnx.state(model)) gives it;
    biases may be absent (bias=False). idx: int array (B, T). Returns float64 logits (B, T, V)
    over every row of the output layer, padding rows included (no masking).
    """
    config = config or TINY
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    idx = np.asarray(idx)
    # one dict per layer: a mixture of experts keeps its first dense layers in a stack of their own
    stacks = [p["dense_blocks"], p["blocks"]] if "dense_blocks" in p else [p["blocks"]]
    layers = [jax.tree.map(lambda a: a[i], stack) for stack in stacks for i in range(len(stack["ln_1"]["scale"]))]
    ln_f = p["ln_f"]
    norm = {"layernorm": _layer_norm, "rmsnorm": _rms_norm}[config.norm]
    B, T = idx.shape
    D, C, K, H = layers[0]["attn"]["qkv_kernel"].shape  # C = G query heads per key/value head + k + v
    G = C - 2
    causal_TxT = np.tril(np.ones((T, T), bool))
    positions = np.broadcast_to(np.arange(T), (B, T))

    x = p["wte"][idx] + (p["wpe"][:T] if config.pos_embedding == "learned" else 0)  # (B, T, D)
    for layer in layers:
        attn, mlp = layer["attn"], layer["mlp"]
        h = norm(x, layer["ln_1"]["scale"], layer["ln_1"].get("bias"), config.norm_eps)
        qkv = np.einsum("btd,dckh->btckh", h, attn["qkv_kernel"])
        if "qkv_bias" in attn:
            qkv = qkv + attn["qkv_bias"]
        q, k, v = qkv[:, :, :G], qkv[:, :, G], qkv[:, :, G + 1]  # (B, T, G, K, H), (B, T, K, H) x 2
        if config.qk_norm:  # before RoPE
            q, k = _unit_rms(q, config.norm_eps), _unit_rms(k, config.norm_eps)
        if config.pos_embedding == "rope":
            q = _rotate(q, positions, _frequencies(H, config))
            k = _rotate(k, positions, _frequencies(H, config))
        scores = np.einsum("bqgkh,bskh->bkgqs", q, k) / np.sqrt(H)  # query head n = k·G + g
        scores = np.where(causal_TxT, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
        y = np.einsum("bkgqs,bskh->bqkgh", weights, v).reshape(B, T, K * G, H)
        y = np.einsum("btnh,nhd->btd", y, attn["out_kernel"])
        if "out_bias" in attn:
            y = y + attn["out_bias"]
        x = x + y

        h = norm(x, layer["ln_2"]["scale"], layer["ln_2"].get("bias"), config.norm_eps)
        x = x + (_experts(h, mlp, config) if "router_kernel" in mlp else _mlp(h, mlp, config.mlp))
    x = norm(x, ln_f["scale"], ln_f.get("bias"), config.norm_eps)
    logits = x @ (p["wte"].T if config.tie_embeddings else p["lm_head_kernel"])
    if config.logit_softcap:
        logits = config.logit_softcap * np.tanh(logits / config.logit_softcap)
    return logits


def _mlp(h, mlp, kind):
    """One dense MLP of the given kind; its biases where it has them."""
    bias = lambda name: mlp.get(name, 0)
    if kind == "swiglu":
        h = _silu(h @ mlp["gate_kernel"] + bias("gate_bias")) * (h @ mlp["fc_kernel"] + bias("fc_bias"))
    elif kind == "relu2":
        h = np.maximum(h @ mlp["fc_kernel"] + bias("fc_bias"), 0.0) ** 2
    else:
        h = _gelu_tanh(h @ mlp["fc_kernel"] + bias("fc_bias"))
    return h @ mlp["proj_kernel"] + bias("proj_bias")


def _experts(h, moe, config):
    """A mixture of experts as its definition reads: every expert on every token, then each token
    keeps its experts_per_token best by router probability (renormalised when several), nothing
    dropped; plus the shared experts."""
    probs = np.exp(h @ moe["router_kernel"])
    probs = probs / probs.sum(-1, keepdims=True)  # (B, T, E)
    best = np.argsort(-probs, -1)[..., : config.experts_per_token]
    gates = np.zeros_like(probs)
    np.put_along_axis(gates, best, np.take_along_axis(probs, best, -1), -1)
    if config.experts_per_token > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    names = [n for n in ("gate_kernel", "fc_kernel", "proj_kernel") if n in moe]
    outputs = np.stack([_mlp(h, {n: moe[n][e] for n in names}, config.mlp) for e in range(config.n_experts)])
    y = np.einsum("bte,ebtd->btd", gates, outputs)
    return y + _mlp(h, moe["shared"], config.mlp) if "shared" in moe else y


# --- helpers ------------------------------------------------------------------------------


def make(config=TINY, seed=0, **changes):
    return GPT(dataclasses.replace(config, **changes), jax.random.key(seed))


def tokens(shape=(2, 16), vocab=TINY.vocab_size, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def randomize(gpt, seed=2):
    """Nonzero biases and non-unit layer norm scales, so the reference check covers them; kernels
    that start at zero (zero_init_proj) get random values, as they would after some training."""
    rng = np.random.default_rng(seed)
    pure = nnx.to_pure_dict(nnx.state(gpt))

    def perturb(path, a):
        name = str(path[-1].key)
        if name == "scale":
            return a + 0.2 * rng.standard_normal(a.shape).astype(np.float32)
        if "bias" in name:
            return a + 0.1 * rng.standard_normal(a.shape).astype(np.float32)
        if "kernel" in name and not np.any(a):
            return 0.02 * rng.standard_normal(a.shape).astype(np.float32)
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
    assert np.abs(before[:, t + 1 :] - after[:, t + 1 :]).max() > 1e-4


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


@pytest.mark.parametrize(
    "policy, scan_layers", [(policy, True) for policy in sorted(model.REMAT_POLICIES)] + [("full", False)]
)
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
        "wte": (pure["wte"], 0.02),
        "wpe": (pure["wpe"], 0.02),
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
    for name, bias in [
        ("qkv_bias", blocks["attn"]["qkv_bias"]),
        ("out_bias", blocks["attn"]["out_bias"]),
        ("fc_bias", blocks["mlp"]["fc_bias"]),
        ("proj_bias", blocks["mlp"]["proj_bias"]),
        ("ln_1", blocks["ln_1"]["bias"]),
        ("ln_2", blocks["ln_2"]["bias"]),
        ("ln_f", pure["ln_f"]["bias"]),
    ]:
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


def test_output_layer_matmuls_are_bfloat16_forward_and_backward():
    """Under dtype=bfloat16 the logits matmul and both of its backward matmuls (the ones whose
    operands or result have the vocabulary's width) take bfloat16 operands; only the logits are
    cast to float32 for the loss. Read from the lowered StableHLO: XLA:CPU's compiled HLO turns
    bfloat16 dots into float32 ones."""
    graphdef, params = nnx.split(make(dtype="bfloat16", vocab_size=80))
    idx = tokens(vocab=80)

    def loss(params):
        logits = nnx.merge(graphdef, params)(idx)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), idx[..., None], -1).mean()

    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    vocab_dots = [line for line in text.splitlines() if "dot_general" in line and "x80x" in line.replace("<", "x")]
    assert len(vocab_dots) == 3, vocab_dots  # forward, input gradient, weight gradient
    for line in vocab_dots:
        operand_types = line.rsplit(":", 1)[1].split("->")[0]
        assert operand_types.count("bf16") == 2 and "f32" not in operand_types, line


@pytest.mark.parametrize("name", ["gelu, top-2 of 4", "swiglu, top-1, a shared expert, first layer dense"])
def test_weights_cast_for_inference_compute_exactly_what_training_computes(name):
    """cast_for_inference rounds the matrices and embedding tables to bfloat16, as the forward pass
    does where it uses them, and leaves norm scales, biases and the router float32: the same
    logits to the last bit (GPT-2 layout with biases, and a Llama layout; both with experts)."""
    gpt = randomize(make(MOE_VARIANTS[name], dtype="bfloat16"))
    graphdef, state = nnx.split(gpt)
    params = nnx.to_pure_dict(state)
    cast = model.cast_for_inference(params, jnp.bfloat16)
    run = lambda p: np.asarray(nnx.merge(graphdef, p)(tokens()))
    np.testing.assert_array_equal(run(cast), run(params))
    for path, p in jax.tree_util.tree_leaves_with_path(cast):
        name = path[-1].key
        kept = name in ("scale", "router_kernel") or "bias" in name
        assert p.dtype == (jnp.float32 if kept else jnp.bfloat16), jax.tree_util.keystr(path)


# --- decoding with a KV cache ---------------------------------------------------------------


@pytest.mark.parametrize(
    "base, scan_layers",
    [
        (TINY, True),
        (TINY, False),
        (LLAMA, True),
        (SPEEDRUN, True),
        (dataclasses.replace(TINY, qk_norm=True, logit_softcap=0.5), False),
        (MOE_VARIANTS["gelu, top-2 of 4"], False),
        (MOE_VARIANTS["swiglu, top-1, a shared expert, first layer dense"], True),
    ],
    ids=[
        "gpt2-scan",
        "gpt2-unrolled",
        "llama-scan",
        "speedrun-scan",
        "gpt2-qk_norm-softcap-unrolled",
        "moe-unrolled",
        "moe-dense-first-scan",
    ],
)
def test_decode_with_cache_matches_the_full_forward(base, scan_layers):
    """Feed each row in two chunks that start at different positions per row; every logit
    must equal the full causal forward's at the same position."""
    config = dataclasses.replace(base, scan_layers=scan_layers, pad_vocab_to_multiple=64)
    gpt = randomize(nnx.jit(lambda: GPT(config, jax.random.key(0)))())  # eager is slow
    graphdef, state = nnx.split(gpt)
    decode = jax.jit(lambda *args: nnx.merge(graphdef, state).decode(*args))
    idx = tokens((3, 16))
    full = np.asarray(nnx.jit(lambda gpt, idx: gpt(idx))(gpt, idx))
    split_B = jnp.array([1, 6, 11])  # row b: tokens [0, split) in one call, then 5 one at a time
    cache = kv_cache.init_cache(gpt.config, batch_size=3, length=16)
    rows = jnp.arange(3)
    # Right-padded with a wrong token: its cache entries must stay hidden until overwritten.
    first = jnp.where(jnp.arange(11) < split_B[:, None], idx[:, :11], 7)
    logits, cache = decode(first, cache, jnp.zeros(3, jnp.int32), split_B - 1)
    np.testing.assert_allclose(logits, full[np.arange(3), np.asarray(split_B) - 1], rtol=0, atol=1e-5)
    second = idx[rows[:, None], split_B[:, None] + jnp.arange(5)]
    for t in range(5):  # then one token at a time, each row at its own position
        logits, cache = decode(second[:, t : t + 1], cache, split_B + t)
        np.testing.assert_allclose(logits, full[np.arange(3), np.asarray(split_B) + t], rtol=0, atol=1e-5)
    assert cache.k.shape == (config.n_layer, 3, 16, config.kv_heads * 8) and cache.k.dtype == jnp.float32


# --- architecture options: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output ------

VARIANTS = {  # between them, each switch both ways
    "llama": LLAMA,
    "qwen2: qkv biases, llama3 rope scaling, untied": dataclasses.replace(
        LLAMA, qkv_bias=True, rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_context=32
    ),
    "multi-query, rope, layernorm, swiglu, biases, tied": dataclasses.replace(
        TINY, pos_embedding="rope", rope_theta=500_000.0, n_kv_head=1, mlp="swiglu", mlp_hidden=48
    ),
    "speedrun: qk_norm, relu2, zero-init projections, softcap 15 on llama": SPEEDRUN,
    # a cap of 0.5 bends these small logits (|logit| up to ~0.5), so tanh really is in the check
    "gpt2 + qk_norm, relu2 (biases, 48 wide), softcap 0.5": dataclasses.replace(
        TINY, qk_norm=True, mlp="relu2", mlp_hidden=48, logit_softcap=0.5
    ),
}


@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
def test_rope_matches_a_float64_numpy_rotation(theta):
    config = dataclasses.replace(LLAMA, rope_theta=theta)
    rng = np.random.default_rng(0)
    x_BxTxNxH = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    position_BxT = np.array([[0, 1, 2, 3, 4], [7, 100, 101, 500, 1000]])
    rotated = np.asarray(rotary.rope(jnp.asarray(x_BxTxNxH), jnp.asarray(position_BxT), config))
    expected = _rotate(x_BxTxNxH.astype(np.float64), position_BxT, _frequencies(16, config))
    np.testing.assert_allclose(rotated, expected, rtol=0, atol=1e-4)  # float32 angles: measured 2e-5
    np.testing.assert_array_equal(rotated[0, 0], x_BxTxNxH[0, 0])  # position 0: unchanged
    # What RoPE is for: a rotated query-key product depends on their distance only.
    q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32) for _ in range(2))
    score = lambda i, j: float(
        jnp.sum(rotary.rope(q, jnp.array([[i]]), config) * rotary.rope(k, jnp.array([[j]]), config))
    )
    assert abs(score(9, 4) - score(105, 100)) < 1e-4 and abs(score(9, 4) - score(4, 9)) > 1e-3


def test_llama3_rope_scaling_follows_the_published_formula():
    """Llama 3.1 8B's values (head size 128, theta 500000, factor 8, 1 / 4, 8192 tokens)."""
    llama31 = dataclasses.replace(
        LLAMA,
        n_embd=4096,
        n_head=32,
        rope_theta=500_000.0,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_context=8192,
    )
    scaled, expected = rotary.rope_frequencies(128, llama31), _frequencies(128, llama31)
    plain = rotary.rope_frequencies(128, dataclasses.replace(llama31, rope_scaling="none"))
    np.testing.assert_allclose(scaled, expected, rtol=1e-12)
    kept, divided = scaled == plain, np.isclose(scaled, plain / 8, rtol=1e-12)
    assert kept[:25].all() and divided[-25:].all()  # short waves kept, long ones slowed down 8x
    assert (~kept & ~divided).sum() >= 3  # and a band in between


@pytest.mark.parametrize("name", VARIANTS)
def test_architecture_options_match_the_numpy_reference(name):
    config = VARIANTS[name]
    gpt = randomize(nnx.jit(lambda: GPT(config, jax.random.key(0)))())
    idx = tokens((2, 16))
    logits = np.asarray(nnx.jit(lambda gpt, idx: gpt(idx))(gpt, idx))
    expected = reference_forward(nnx.to_pure_dict(nnx.state(gpt)), idx, config)
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-6)  # measured: ~9e-8


def test_grouped_query_attention_equals_multi_head_attention_with_shared_key_value_heads():
    """n_kv_head = n_head is GPT-2's attention exactly; GQA with K = 2 key/value heads for N = 4
    query heads is multi-head attention whose heads k·G and k·G + 1 share a key and a value."""
    forward = nnx.jit(lambda gpt, idx: gpt(idx))
    idx = tokens()
    mha, explicit = make(), make(n_kv_head=4)
    for a, b in zip(param_leaves(explicit), param_leaves(mha), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(forward(explicit, idx), forward(mha, idx))

    G, K = 2, 2
    gqa = randomize(make(n_kv_head=K))
    p = nnx.to_pure_dict(nnx.state(gqa))
    assert p["blocks"]["attn"]["qkv_kernel"].shape == (2, 32, G + 2, K, 8)

    def to_multi_head(a_xCxKxH):  # (..., G+2, K, H) -> (..., 3, N, H), query head n = k·G + g
        q = np.swapaxes(a_xCxKxH[..., :G, :, :], -3, -2)
        q = q.reshape(*q.shape[:-3], K * G, q.shape[-1])
        k, v = (np.repeat(a_xCxKxH[..., i, :, :], G, axis=-2) for i in (G, G + 1))
        return np.stack([q, k, v], axis=-3)

    attn = p["blocks"]["attn"]
    attn["qkv_kernel"], attn["qkv_bias"] = to_multi_head(attn["qkv_kernel"]), to_multi_head(attn["qkv_bias"])
    state = nnx.state(mha)
    nnx.replace_by_pure_dict(state, p)
    nnx.update(mha, state)
    np.testing.assert_allclose(forward(gqa, idx), forward(mha, idx), rtol=0, atol=1e-5)


def test_count_params_of_a_llama_style_model():
    V, L, D, N, K, H = 65, 2, 32, 4, 2, 8
    F = LLAMA.mlp_hidden_size
    assert F == 128  # 8/3 x 32 = 85.3, rounded up to a multiple of 64
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F + 2 * D  # no wpe, no biases, RMSNorm scales
    assert model.count_params(LLAMA) == L * per_layer + V * D + D * V + D == 35_040
    gpt = make(LLAMA)
    assert gpt.wpe is None and gpt.lm_head_kernel.shape == (D, V)
    assert sum(a.size for a in param_leaves(gpt)) == 35_040
    # SwiGLU's default width keeps GPT-2's MLP size: 3 x 768 x 2048 = 2 x 768 x 3072.
    assert GPTConfig(mlp="swiglu").mlp_hidden_size == 2048
    no_bias = lambda mlp: model.count_params(GPTConfig(mlp=mlp, bias=False))
    assert no_bias("swiglu") == no_bias("gelu")


def test_flops_per_token_by_hand_with_attention_in_full_and_causal_half():
    """Every matmul of a small multi-query SwiGLU model written out: 2 FLOPs per multiply-add forward,
    twice that backward (the input's and the weight's gradients)."""
    config = GPTConfig(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_kv_head=1,
        mlp="swiglu",
        mlp_hidden=96,
        vocab_size=128,
        block_size=32,
        pos_embedding="rope",
        norm="rmsnorm",
        qk_norm=True,
        bias=False,
        tie_embeddings=False,
    )
    D, H, F, V, T = 64, 16, 96, 128, 32  # width, head size, SwiGLU hidden, vocabulary, context
    # q, k, v (one head of 16 each), out; gate, up, down; the two RMSNorm scales (nanoGPT counts them)
    per_layer = D * D + D * H + D * H + D * D + D * F + D * F + F * D + 2 * D
    weights = 2 * per_layer + D + D * V  # + the final norm's scale and the output layer (the table is a lookup)
    # each of the 4 query heads: q·k over T keys (2·H·T) and the weights times T values (2·H·T)
    attention_square = 4 * (2 * H * T + 2 * H * T)
    full = 3 * (2 * weights + 2 * attention_square)
    assert full == 444_288
    assert model.flops_per_token(config) == full
    # MaxText's causal count: each query sees T/2 keys on average
    assert model.flops_per_token(config, causal_half=True) == full - 3 * 2 * attention_square // 2 == 419_712


@pytest.mark.parametrize("name", ["gpt2", *VARIANTS])
def test_flops_per_token_counts_the_matmul_weights_of_the_real_model(name):
    """6 FLOPs per weight that multiplies (every parameter but the lookup tables: wpe, and wte
    when the output layer is separate) + 12·L·T·D for attention, from the model's own arrays."""
    config = VARIANTS.get(name, TINY)
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(config, jax.random.key(0)))))
    lookups = {"wpe"} | ({"wte"} if "lm_head_kernel" in params else set())
    n_matmul = sum(
        math.prod(a.shape) for path, a in jax.tree_util.tree_leaves_with_path(params) if path[0].key not in lookups
    )
    T = 16
    assert model.flops_per_token(config) == 6 * n_matmul + 12 * config.n_layer * T * config.n_embd


def test_llama_style_bfloat16_compute():
    full, half = make(LLAMA), make(LLAMA, dtype="bfloat16")
    idx = tokens()
    diff = np.abs(np.asarray(half(idx)) - np.asarray(full(idx))).max()
    assert 0 < diff < 0.02


# --- quantized matmuls (layers/quantization.py) --------------------------------------------------


@pytest.mark.parametrize(
    "base, mode, tolerance, grad_tolerance",
    [
        (TINY, "int8", 0.03, 0.03),
        (LLAMA, "int8", 0.03, 0.03),
        (TINY, "fp8", 0.1, 0.25),
        (MOE_VARIANTS["gelu, top-2 of 4"], "int8", 0.03, 0.03),
    ],
    ids=["gpt2-int8", "llama-int8", "gpt2-fp8", "moe-int8"],
)  # e5m2 gradients: 2 mantissa bits
def test_quantized_model_is_close_to_the_float_model(base, mode, tolerance, grad_tolerance):
    """Same weights: logits and gradients within a few percent of the float model's, and not equal."""
    idx, targets = tokens(seed=1), tokens(seed=3)
    exact = randomize(make(base))
    quantized = randomize(make(base, quantization=mode))
    logits, logits_q = np.asarray(exact(idx)), np.asarray(quantized(idx))
    error = np.abs(logits_q - logits).max() / np.abs(logits).max()
    assert 0 < error < tolerance
    for g, g_q in zip(
        jax.tree.leaves(grads_of(exact, idx, targets)), jax.tree.leaves(grads_of(quantized, idx, targets)), strict=True
    ):
        assert np.linalg.norm(g_q - g) <= grad_tolerance * np.linalg.norm(g) + 1e-6


def test_quantized_layers_scanned_unrolled_and_rematerialized_agree():
    idx, targets = tokens(seed=1), tokens(seed=3)
    runs = [
        randomize(make(quantization="int8", scan_layers=scan, remat_policy=policy))
        for scan, policy in ((True, "none"), (False, "none"), (True, "full"), (True, "dots_saveable"))
    ]
    logits = [np.asarray(gpt(idx)) for gpt in runs]
    grads = [jax.tree.leaves(grads_of(gpt, idx, targets)) for gpt in runs]
    for other_logits, other_grads in zip(logits[1:], grads[1:]):
        np.testing.assert_allclose(other_logits, logits[0], rtol=0, atol=1e-5)
        for a, b in zip(grads[0], other_grads, strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_quantized_decode_with_cache_matches_the_full_forward():
    gpt = randomize(make(quantization="int8"))
    idx = tokens((2, 12))
    full = np.asarray(gpt(idx))
    cache = kv_cache.init_cache(gpt.config, 2, 16)
    logits, cache = gpt.decode(idx[:, :8], cache, jnp.zeros(2, jnp.int32))
    np.testing.assert_allclose(logits, full[:, 7], rtol=0, atol=1e-4)
    for t in range(8, 12):
        logits, cache = gpt.decode(idx[:, t : t + 1], cache, jnp.full(2, t, jnp.int32))
        # one token's quantization grid is its own (per-token scales), so it matches the batch's
        np.testing.assert_allclose(logits, full[:, t], rtol=0, atol=1e-4)


def test_int8_grouped_query_cache_attends_as_its_dequantized_keys_and_values():
    """The cache's merged (K·H) last axis with 2 query heads per kv head and int8 scales per token
    and head: attend equals per-head softmax attention, written out here, over the keys and
    values the int8 cache holds (scaled back), the new tokens' included, at each row's position."""
    B, T, N, K, H, S = 3, 2, 4, 2, 8, 16
    q, keys, values, new_k, new_v = (
        jax.random.normal(jax.random.key(i), shape)
        for i, shape in enumerate([(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, K, H), (B, T, K, H)])
    )
    empty = kv_cache.KVCache(
        jnp.zeros((B, 0, K * H), jnp.int8),
        jnp.zeros((B, 0, K * H), jnp.int8),
        K,
        jnp.zeros((B, 0, K)),
        jnp.zeros((B, 0, K)),
    )
    cache, new = empty.encode(keys, values), empty.encode(new_k, new_v)
    assert cache.k.shape == (B, S, K * H) and cache.k.dtype == jnp.int8 and cache.k_scale.shape == (B, S, K)
    start_B = np.array([5, 0, 14])
    out = np.asarray(cache.attend(q, new, jnp.asarray(start_B)))
    (k_all, v_all), (k_new, v_new) = (
        (np.asarray(x).reshape(B, -1, K, H) for x in cache.read(jnp.float32)),
        (np.asarray(x).reshape(B, T, K, H) for x in new.read(jnp.float32)),
    )
    for b in range(B):
        for t in range(T):
            k_seen = np.concatenate([k_all[b, : start_B[b]], k_new[b, : t + 1]])  # (visible, K, H)
            v_seen = np.concatenate([v_all[b, : start_B[b]], v_new[b, : t + 1]])
            for n in range(N):
                scores = k_seen[:, n // (N // K)] @ np.asarray(q[b, t, n]) / np.sqrt(H)
                p = np.exp(scores - scores.max())
                expected = (p / p.sum()) @ v_seen[:, n // (N // K)]
                np.testing.assert_allclose(out[b, t, n], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_prefill_through_splash_gives_the_written_out_attentions_logits_and_cache(style):
    """A prefill through splash (interpreted here) runs heads-major, as training does, and transposes
    only the keys and values it caches: the last tokens' logits and the cache of the written-out
    attention's prefill, GPT-2 and grouped-query Llama-style, rows ending at different tokens."""
    config = dataclasses.replace(TINY if style == "gpt2" else LLAMA, block_size=256)
    idx, last_B = tokens((2, 128)), jnp.array([127, 40])
    (logits, cache), (want_logits, want_cache) = (
        randomize(make(config, attention=name)).prefill(idx, 160, last_B) for name in ("splash", "einsum")
    )
    assert attention.choose_attention(make(config, attention="splash").config, 128).heads_major
    np.testing.assert_allclose(logits, want_logits, atol=1e-5)
    for name in ("k", "v"):
        assert getattr(cache, name).shape == (config.n_layer, 2, 160, config.kv_heads * config.n_embd // config.n_head)
        np.testing.assert_allclose(getattr(cache, name), getattr(want_cache, name), atol=1e-5)


def test_int8_cache_written_a_token_at_a_time_holds_what_prefill_writes():
    """Grouped-query int8 cache: decode's one-token writes (a scatter of the keys and values, a
    select of the scales) put each token where prefill puts the whole prompt, rows at different
    positions; int8 entries equal up to a rounding step and scales to 1% (the two paths compute
    the keys with different float errors)."""
    gpt = randomize(make(LLAMA, kv_cache_dtype="int8"))
    idx = tokens((3, 12))
    prefilled = gpt.prefill(idx, 16)[1]
    split_B = jnp.array([3, 5, 8])
    first = jnp.where(jnp.arange(8) < split_B[:, None], idx[:, :8], 0)
    cache = gpt.decode(first, kv_cache.init_cache(gpt.config, 3, 16), jnp.zeros(3, jnp.int32))[1]
    for t in range(4):  # each row one token at a time from its own position
        position_B = split_B + t
        cache = gpt.decode(idx[jnp.arange(3), position_B][:, None], cache, position_B)[1]
    for b, end in enumerate(np.asarray(split_B) + 4):
        for name in ("k", "v"):
            written, expected = (np.asarray(getattr(c, name)[:, b, :end], np.int32) for c in (cache, prefilled))
            assert written.shape == (LLAMA.n_layer, end, 2 * 8) and np.abs(written - expected).max() <= 1
            np.testing.assert_allclose(
                getattr(cache, name + "_scale")[:, b, :end], getattr(prefilled, name + "_scale")[:, b, :end], rtol=1e-2
            )


@pytest.mark.parametrize("one_scatter_max_pairs", [0, 10**6], ids=["a_scatter_per_layer", "one_scatter"])
def test_a_decode_steps_write_puts_each_rows_token_at_its_position(monkeypatch, one_scatter_max_pairs):
    """Both ways KVCache.write stores one token per row (past ONE_SCATTER_MAX_PAIRS (layer, row) pairs
    a scatter per layer) change exactly the (layer, row, start_B[row]) entries, to the new ones."""
    monkeypatch.setattr(kv_cache, "ONE_SCATTER_MAX_PAIRS", one_scatter_max_pairs)
    L, B, S, K, H = 3, 5, 8, 2, 4
    old, new = (
        kv_cache.KVCache(*(jax.random.normal(jax.random.key(i + j), shape) for j in range(2)), K)
        for i, shape in ((0, (L, B, S, K * H)), (2, (L, B, 1, K * H)))
    )
    start_B = np.array([0, 7, 3, 3, 5])
    written = old.write(new, jnp.asarray(start_B))
    for name in ("k", "v"):
        expected = np.array(getattr(old, name))
        expected[:, np.arange(B), start_B] = np.asarray(getattr(new, name))[:, :, 0]
        np.testing.assert_array_equal(getattr(written, name), expected)


# --- the GPT-2 speedruns' switches: qk_norm, relu2, zero_init_proj, logit_softcap --------------


def test_speedrun_switches_off_are_the_default_model():
    """Off, each switch leaves the default model as it was: the same parameters (same random
    draws) and the same logits, bit for bit; relu2 has gelu's parameters, qk_norm and the
    soft-cap add none."""
    idx = tokens()
    default = make()
    explicit = make(qk_norm=False, mlp="gelu", zero_init_proj=False, logit_softcap=0.0)
    for a, b in zip(param_leaves(default), param_leaves(explicit), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(default(idx), explicit(idx))
    on = make(qk_norm=True, mlp="relu2", logit_softcap=30.0)
    for a, b in zip(param_leaves(default), param_leaves(on), strict=True):
        np.testing.assert_array_equal(a, b)  # same weights, another function of them
    assert (
        model.count_params(dataclasses.replace(GPTConfig(), mlp="relu2", qk_norm=True, logit_softcap=30.0))
        == GPT2_SMALL_PARAMS
    )
    assert model.flops_per_token(
        dataclasses.replace(GPTConfig(), mlp="relu2", qk_norm=True, logit_softcap=30.0)
    ) == model.flops_per_token(GPTConfig())


def test_zero_init_proj_zeroes_only_the_residual_projections():
    default, zero = make(), make(zero_init_proj=True)
    pd, pz = (nnx.to_pure_dict(nnx.state(g)) for g in (default, zero))
    flat_d, flat_z = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (pd, pz))
    zeroed = {path for path in flat_z if str(path[-1].key) in ("out_kernel", "proj_kernel")}
    assert len(zeroed) == 2
    for path, a in flat_z.items():
        if path in zeroed:
            assert np.all(np.asarray(a) == 0) and np.any(np.asarray(flat_d[path]) != 0)
        else:
            np.testing.assert_array_equal(a, flat_d[path])
    # Every block starts as the identity, yet its output projections get a gradient at once.
    idx, targets = tokens(seed=1), tokens(seed=3)
    grads = nnx.to_pure_dict(grads_of(zero, idx, targets))["blocks"]
    assert np.abs(grads["attn"]["out_kernel"]).max() > 1e-4 and np.abs(grads["mlp"]["proj_kernel"]).max() > 1e-4
    assert np.all(np.asarray(grads["attn"]["qkv_kernel"]) == 0)  # nothing flows through a 0 matrix yet


def test_logit_softcap_is_tanh_of_the_uncapped_logits_and_keeps_padding_at_minus_inf():
    idx = tokens()
    plain = randomize(make(pad_vocab_to_multiple=64))
    capped = randomize(make(pad_vocab_to_multiple=64, logit_softcap=0.5))
    uncapped, logits = np.asarray(plain(idx), np.float64), np.asarray(capped(idx))
    assert logits.dtype == np.float32
    assert np.abs(logits[..., :65] - uncapped[..., :65]).max() > 0.02  # the cap bends them
    np.testing.assert_allclose(logits[..., :65], 0.5 * np.tanh(uncapped[..., :65] / 0.5), rtol=0, atol=1e-6)
    assert np.abs(logits[..., :65]).max() < 0.5 and np.all(logits[..., 65:] == -np.inf)
    # in float32 under bfloat16 compute too
    assert make(dtype="bfloat16", logit_softcap=0.5)(idx).dtype == jnp.float32


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    """Multiplying the query and key projections by 10 changes next to nothing with qk_norm
    (heads are normalised before their scores; only norm_eps sees the scale), and a lot without."""
    idx = tokens()
    change = {}
    for qk_norm in (True, False):
        gpt = make(bias=False, qk_norm=qk_norm)
        before = np.asarray(gpt(idx))
        gpt.blocks.attn.qkv_kernel[...] = gpt.blocks.attn.qkv_kernel[...].at[:, :, :2].multiply(10.0)
        change[qk_norm] = np.abs(np.asarray(gpt(idx)) - before).max()
    assert change[True] < 1e-3 * 0.3 and change[False] > 0.03  # measured: 6e-5 and 0.06


@pytest.mark.parametrize("base", ["llama", "speedrun", "moe"])
def test_switches_scanned_unrolled_and_rematerialized_agree(base):
    """Logits and gradients: scanned without remat against unrolled, and every remat policy
    (each with the other layout, so both layouts meet recomputation); Llama-style, the speedrun's
    switches, and a mixture of experts with a dense first layer."""
    idx, targets = tokens(seed=1), tokens(seed=3)
    config = {
        "llama": LLAMA,
        "speedrun": SPEEDRUN,
        "moe": MOE_VARIANTS["swiglu, top-1, a shared expert, first layer dense"],
    }[base]

    def logits_and_grads(**changes):
        gpt = randomize(make(config, **changes))
        graphdef, state = nnx.split(gpt)

        def loss(state):
            logits = nnx.merge(graphdef, state)(idx)
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1).mean(), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        return [logits, *jax.tree.leaves(grads)]

    base = logits_and_grads()  # scanned, nothing recomputed
    assert any(np.abs(g).max() > 1e-3 for g in base[1:])
    layouts = [(False, "none")] + [(i % 2 == 1, p) for i, p in enumerate(sorted(model.REMAT_POLICIES))]
    assert {p for _, p in layouts} == {"none", *model.REMAT_POLICIES} and len({s for s, _ in layouts}) == 2
    for scan_layers, policy in layouts:
        for a, b in zip(base, logits_and_grads(scan_layers=scan_layers, remat_policy=policy), strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=f"{scan_layers=}, {policy=}")


def test_export_refuses_the_switches_transformers_lacks_and_takes_zero_init_proj():
    """qk_norm, relu2 and logit_softcap change the function: GPT2, Llama and Qwen2 have none of
    them, so export_hf.py refuses, naming the key. zero_init_proj is only an initialisation."""
    gpt2 = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
    for changes, key in (
        ({"qk_norm": True}, "qk_norm=True"),
        ({"mlp": "relu2"}, "mlp='relu2'"),
        ({"logit_softcap": 30.0}, "logit_softcap=30.0"),
    ):
        for base in (gpt2, LLAMA):
            with pytest.raises(hf.HFError, match=f"{key} .*has no equivalent in transformers"):
                hf.check_architecture(dataclasses.replace(base, **changes))
    assert hf.check_architecture(dataclasses.replace(gpt2, zero_init_proj=True)) == "gpt2"
    assert hf.check_architecture(dataclasses.replace(LLAMA, zero_init_proj=True)) == "llama"
    assert hf.hf_config(dataclasses.replace(gpt2, zero_init_proj=True), "float32", 0, 0)["model_type"] == "gpt2"


# --- mixture of experts ---------------------------------------------------------------------


def decisive_router(gpt, scale=20.0):
    """Router weights scaled up, so that no two experts' probabilities are within float32
    rounding of each other and float32 and float64 pick the same experts."""
    gpt.blocks.mlp.router_kernel[...] = gpt.blocks.mlp.router_kernel[...] * scale
    return gpt


@pytest.mark.parametrize("name", MOE_VARIANTS)
def test_moe_matches_every_expert_on_every_token_masked(name):
    """The one-hot dispatch and combine (dropless) equal running every expert on every token and
    keeping each token's top-k, in float64 (reference_forward's _experts)."""
    config = MOE_VARIANTS[name]
    gpt = decisive_router(randomize(make(config)))
    idx = tokens()
    expected = reference_forward(nnx.to_pure_dict(nnx.state(gpt)), idx, config)
    np.testing.assert_allclose(gpt(idx), expected, rtol=0, atol=1e-5)
    _, stats = gpt.forward(idx)
    assert np.all(np.asarray(stats["dropped"]) == 0) and stats["load"].shape == (config.sparse_layers, config.n_experts)


@pytest.mark.parametrize("k", [1, 2])
def test_routing_picks_the_most_probable_experts_with_weights_as_configured(k):
    """Top-k by router probability; one expert keeps its probability (Switch: the router still
    gets a gradient through it), several are renormalised to sum to 1 (Mixtral)."""
    config = dataclasses.replace(MOE_VARIANTS["gelu, top-2 of 4"], experts_per_token=k)
    moe = moe_layer.MoE(config, jax.random.key(0))
    moe.router_kernel[...] = moe.router_kernel[...] * 20
    x = jax.random.normal(jax.random.key(1), (2, 16, config.n_embd))
    weights, experts, logits = (np.asarray(a) for a in moe.route(x))
    probs = np.asarray(jax.nn.softmax(logits))
    np.testing.assert_array_equal(experts, np.argsort(-probs, -1)[..., :k])
    chosen = np.take_along_axis(probs, experts, -1)
    expected = chosen if k == 1 else chosen / chosen.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    assert len(np.unique(experts)) == config.n_experts  # the test sees every expert chosen


def test_capacity_keeps_first_choices_first_then_earlier_tokens_and_counts_the_rest_dropped():
    """capacity_factor 0.5 with top-2 of 4 on 16 tokens: 4 slots per expert and row. The layer
    equals a loop that hands out slots choice by choice, token by token."""
    config = dataclasses.replace(MOE_VARIANTS["gelu, top-2 of 4"], capacity_factor=0.5)
    assert moe_layer.expert_capacity(config, 16) == 4
    moe = moe_layer.MoE(config, jax.random.key(0))
    moe.router_kernel[...] = moe.router_kernel[...] * 20
    x = jax.random.normal(jax.random.key(1), (2 * 16, config.n_embd))
    y, stats = moe(x, batch_size=2)
    weights, experts, _ = (np.asarray(a, np.float64) for a in moe.route(x.reshape(2, 16, -1)))
    experts = experts.astype(int)
    params = {n: np.asarray(getattr(moe, n)[...], np.float64) for n in ("fc_kernel", "proj_kernel")}
    h = np.asarray(x, np.float64).reshape(2, 16, -1)
    expected, kept = np.zeros_like(h), 0
    for b in range(2):
        used = np.zeros(config.n_experts, int)
        for k in range(2):
            for t in range(16):
                e = experts[b, t, k]
                if used[e] < 4:
                    used[e] += 1
                    kept += 1
                    expected[b, t] += weights[b, t, k] * _mlp(h[b, t], {n: a[e] for n, a in params.items()}, "gelu")
    assert 0 < kept < 2 * 16 * 2  # some choices dropped, some kept
    np.testing.assert_allclose(np.asarray(y).reshape(2, 16, -1), expected, rtol=0, atol=1e-5)
    assert float(stats["dropped"]) == pytest.approx(1 - kept / 64)


def test_router_losses_on_a_hand_worked_example():
    """Two tokens, two experts, both routed to expert 0 with probabilities (3/4, 1/4):
    f = (1, 0), P = (3/4, 1/4), balance = E·Σ f·P = 2 · 3/4 = 1.5; each token's logsumexp
    is log(3 + 1) = log 4, so z = (log 4)²; nothing dropped."""
    logits = jnp.log(jnp.asarray([[[3.0, 1.0], [3.0, 1.0]]]))  # (B=1, T=2, E=2)
    chosen = jax.nn.one_hot(jnp.zeros((1, 2, 1), int), 2)  # (B, T, k=1, E): expert 0
    dispatch = jnp.einsum("btke,btkc->btec", chosen, jax.nn.one_hot(jnp.asarray([[[0], [1]]]), 2))
    stats = moe_layer.router_stats(logits, chosen, dispatch)
    assert float(stats["balance_loss"]) == pytest.approx(1.5)
    assert float(stats["z_loss"]) == pytest.approx(math.log(4) ** 2)
    assert float(stats["dropped"]) == 0.0
    np.testing.assert_allclose(stats["load"], [1.0, 0.0])
    uniform = moe_layer.router_stats(jnp.zeros((1, 2, 2)), jax.nn.one_hot(jnp.asarray([[[0], [1]]]), 2), dispatch)
    assert float(uniform["balance_loss"]) == pytest.approx(1.0)  # balanced: its minimum


def test_moe_counts_total_and_active_parameters_and_flops_on_the_active_ones():
    config = MOE_VARIANTS["swiglu, top-1, a shared expert, first layer dense"]
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(config, jax.random.key(0)))))
    assert model.count_params(config) == sum(math.prod(a.shape) for a in jax.tree.leaves(params))
    expert_kernels = sum(
        math.prod(params["blocks"]["mlp"][n].shape) for n in ("gate_kernel", "fc_kernel", "proj_kernel")
    )
    idle = expert_kernels * (config.n_experts - config.experts_per_token) // config.n_experts
    assert model.active_params(config) == model.count_params(config) - idle
    # a token uses the dense model, but in each of the 2 sparse layers a router, its one expert
    # and the shared expert (each 3 matrices 32 x 24) in place of the 32 x 128 SwiGLU
    dense = dataclasses.replace(config, n_experts=0)
    per_sparse_layer = 32 * 4 + 2 * 3 * 32 * 24 - 3 * 32 * 128
    assert model.active_params(config) == model.count_params(dense) + 2 * per_sparse_layer
    assert model.flops_per_token(config) == 6 * (model.matmul_params(config) - idle) + 12 * 3 * 16 * 32


@pytest.mark.parametrize("n_head, n_kv_head, T", [(4, 4, 12), (4, 2, 12), (4, 4, 40), (4, 2, 150)])
def test_written_out_attention_and_its_backward_equal_xla(n_head, n_kv_head, T):
    """'einsum' (its own backward: rowsum(dO·O) instead of a reduction over the T x T scores; one
    query block at T = 12, two at 40, four of uneven size at 150) gives XLA's attention and
    gradients, multi-head and grouped-query."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    assert len(attention.query_blocks(T)) == {12: 1, 40: 2, 150: 4}[T]
    q = jax.random.normal(kq, (2, T, n_head, 8))
    k, v = (jax.random.normal(key, (2, T, n_kv_head, 8)) for key in (kk, kv))
    dy = jax.random.normal(kd, q.shape)
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    @jax.jit  # one compiled program: run op by op, the blocks' many small operations took seconds
    def outputs_and_gradients(q, k, v, dy):
        ours, our_pullback = jax.vjp(attention.causal_attention, q, k, v)
        theirs, their_pullback = jax.vjp(xla, q, k, v)
        return ours, theirs, our_pullback(dy), their_pullback(dy)

    ours, theirs, our_gradients, their_gradients = outputs_and_gradients(q, k, v, dy)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    for a, b in zip(our_gradients, their_gradients):  # dq, dk, dv
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("segmented", [False, True])
def test_attention_dropout_and_its_backward_equal_autodiff_of_the_formula(segmented):
    """nanoGPT's attention dropout in the written-out attention (two query blocks at T = 40,
    grouped-query): probabilities dropped by the mask attention_keep_mask draws from the key and
    the survivors scaled by 1 / (1 - rate); its backward draws the same mask again. Segmented: packed
    rows (a segment across the two query blocks), where a query sees only its own segment's keys."""
    T, rate, key = 40, 0.25, jax.random.key(9)
    ids = jnp.array([[0] * 7 + [1] * 25 + [2] * 8, [4] * 40]) if segmented else None
    visible = jnp.tril(jnp.ones((T, T), bool)) & (
        True if ids is None else (ids[:, None, :, None] == ids[:, None, None])
    )
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, T, 4, 8))
    k, v = (jax.random.normal(x, (2, T, 2, 8)) for x in (kk, kv))
    dy = jax.random.normal(kd, q.shape)

    def formula(q, k, v):
        k, v = (jnp.repeat(x, 2, axis=2) for x in (k, v))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(8)
        p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf))
        p = jnp.where(attention.attention_keep_mask(key, rate, p.shape), p / (1 - rate), 0.0)
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    @jax.jit  # one compiled program, as in the test above
    def outputs_and_gradients(q, k, v, dy):
        ours, our_pullback = jax.vjp(lambda q, k, v: attention.causal_attention(q, k, v, rate, key, ids), q, k, v)
        theirs, their_pullback = jax.vjp(formula, q, k, v)
        return ours, theirs, our_pullback(dy), their_pullback(dy)

    ours, theirs, our_gradients, their_gradients = outputs_and_gradients(q, k, v, dy)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    for a, b in zip(our_gradients, their_gradients):  # dq, dk, dv
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert np.abs(ours - attention.causal_attention(q, k, v, 0.0, None, ids)).max() > 0.1  # it does drop
    np.testing.assert_array_equal(
        attention.causal_attention(q, k, v, 0.0, key, ids), attention.causal_attention(q, k, v, 0.0, None, ids)
    )


def test_layer_norm_backward_equals_autodiff_of_its_formula():
    x = jax.random.normal(jax.random.key(0), (6, 16)) * 3 + 1
    scale, bias = jax.random.normal(jax.random.key(1), (16,)), jax.random.normal(jax.random.key(2), (16,))

    def formula(x, scale, bias):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + 1e-5) * scale + bias

    loss = lambda norm: lambda *args: jnp.sum(jnp.sin(norm(*args)))
    ours = jax.grad(loss(lambda x, s, b: blocks.layer_norm(x, s, b, 1e-5)), argnums=(0, 1, 2))(x, scale, bias)
    reference = jax.grad(loss(formula), argnums=(0, 1, 2))(x, scale, bias)
    for a, b in zip(ours, reference):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


# --- packed rows: segment ids -------------------------------------------------------------

PACKED_ROWS = ((9, 14, 6), (20, 12))  # example lengths per row of 32; row 0 ends with 3 filler tokens


def packing(T=32, vocab=TINY.vocab_size, seed=5):
    """Examples of the lengths in PACKED_ROWS, packed into rows with segment ids (the filler at the end
    of a row is a segment of its own), and each alone at the start of a row of its own (causal: what
    follows it there does not change its logits). Returns the packed inputs, targets and ids (R, T),
    the alone inputs and targets (E, T), and for every example token its (row, t) in both."""
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, vocab, (2, len(PACKED_ROWS), T)).astype(np.int32)
    ids = np.zeros((len(PACKED_ROWS), T), np.int32)
    alone_x, alone_y = rng.integers(0, vocab, (2, sum(map(len, PACKED_ROWS)), T)).astype(np.int32)
    packed_at, alone_at, e = [], [], 0
    for r, lengths in enumerate(PACKED_ROWS):
        start = 0
        for i, n in enumerate(lengths):
            ids[r, start : start + n] = 7 - i  # any ids: equal within a run, different from the next
            alone_x[e, :n], alone_y[e, :n] = x[r, start : start + n], y[r, start : start + n]
            packed_at += [(r, start + t) for t in range(n)]
            alone_at += [(e, t) for t in range(n)]
            start, e = start + n, e + 1
        ids[r, start:] = 99
    return x, y, ids, alone_x, alone_y, tuple(np.array(packed_at).T), tuple(np.array(alone_at).T)


PACKED_VARIANTS = {  # every attention path; block 32 gives the written-out attention two query blocks
    "learned positions, xla": dataclasses.replace(TINY, attention="xla"),
    "learned positions, einsum, unrolled, remat": dataclasses.replace(
        TINY, attention="einsum", scan_layers=False, remat_policy="full"
    ),
    "rope, grouped-query, xla": dataclasses.replace(LLAMA, attention="xla"),
    "rope, grouped-query, einsum, a dense layer then experts": dataclasses.replace(
        LLAMA, attention="einsum", n_experts=4, experts_per_token=2, moe_dense_layers=1, capacity_factor=0.0
    ),
}


@pytest.mark.parametrize("name", PACKED_VARIANTS)
def test_packed_examples_get_the_losses_and_gradients_they_get_alone(name):
    """Packed with segment ids, each example's per-token losses, and the gradient of their sum, are
    those of the example alone in a row; without the ids they are not (attention crosses examples
    and positions run on)."""
    config = dataclasses.replace(PACKED_VARIANTS[name], block_size=32)
    gpt = randomize(nnx.jit(lambda: GPT(config, jax.random.key(0)))())
    graphdef, state = nnx.split(gpt)
    x, y, ids, alone_x, alone_y, packed_at, alone_at = packing()

    def token_losses(state, x, y, at, ids=None):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, state)(x, segment_ids_BxT=ids))
        losses = -jnp.take_along_axis(logp, y[..., None], -1)[..., 0][at]
        return losses.sum(), losses

    @jax.jit
    def both(state):
        (_, packed), packed_grads = jax.value_and_grad(token_losses, has_aux=True)(state, x, y, packed_at, ids)
        (_, alone), alone_grads = jax.value_and_grad(token_losses, has_aux=True)(state, alone_x, alone_y, alone_at)
        return packed, alone, token_losses(state, x, y, packed_at)[1], packed_grads, alone_grads

    packed, alone, unsegmented, packed_grads, alone_grads = both(state)
    np.testing.assert_allclose(packed, alone, rtol=0, atol=1e-5)
    assert np.abs(unsegmented - alone).max() > 1e-2
    grads = list(zip(jax.tree.leaves(packed_grads), jax.tree.leaves(alone_grads), strict=True))
    assert len(grads) == len(param_leaves(gpt)) and max(np.abs(b).max() for _, b in grads) > 1e-2
    for a, b in grads:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_segment_positions_restart_at_each_run_and_one_segment_is_the_unpacked_model():
    ids = jnp.array([[0, 0, 0, 1, 1, 2], [5, 5, 3, 3, 5, 5]])  # runs, not sorted ids
    np.testing.assert_array_equal(attention.segment_positions(ids), [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 0, 1]])
    gpt, idx = nnx.jit(lambda: GPT(LLAMA, jax.random.key(0)))(), tokens()
    one_segment = nnx.jit(lambda gpt, idx: (gpt(idx, segment_ids_BxT=jnp.full(idx.shape, 3)), gpt(idx)))
    np.testing.assert_allclose(*one_segment(gpt, idx), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [dataclasses.replace(TINY, attention="xla"), dataclasses.replace(LLAMA, attention="xla", block_size=16)],
    ids=["learned positions", "rope, grouped-query"],
)
def test_rows_in_balanced_order_get_their_in_order_logits(config):
    """Context parallelism's balanced layout (attention.balanced_order, 2 x 4 chunks): rows given
    permuted, with order_T, get the in-order rows' logits permuted the same way, documents or not
    (the positions and causal mask follow the tokens; this is the 'xla' path, the training tests
    cover 'einsum')."""
    gpt = randomize(nnx.jit(lambda: GPT(config, jax.random.key(0)))())
    graphdef, state = nnx.split(gpt)
    order_T = attention.balanced_order(16, 4)
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 65)
    ids = jnp.array([[0] * 5 + [1] * 11, [3] * 9 + [4] * 7], jnp.int32)

    @jax.jit
    def logits(x, ids):
        model_ = nnx.merge(graphdef, state)
        permuted_ids = None if ids is None else ids[:, order_T]
        return model_(x, segment_ids_BxT=ids), model_(x[:, order_T], None, permuted_ids, order_T)

    for segment_ids in (None, ids):
        in_order, permuted = logits(x, segment_ids)
        np.testing.assert_allclose(permuted, in_order[:, order_T], rtol=1e-5, atol=1e-5)


def test_the_llama_350m_config_is_llama_style_at_about_350m_parameters():
    config = load_config([str(ROOT / "config" / "llama_350m.py")])
    gpt = model_setup.model_config(config, 50257, "tpu")
    assert 340e6 < model.count_params(gpt) < 370e6
    assert (gpt.pos_embedding, gpt.norm, gpt.mlp, gpt.block_size, gpt.tie_embeddings) == (
        "rope",
        "rmsnorm",
        "swiglu",
        2048,
        False,
    )
    assert gpt.n_embd // gpt.n_head == 128 and 1 < gpt.kv_heads < gpt.n_head and gpt.attention == "splash"


def test_the_llama_164m_mqa_config_has_the_single_chip_records_shape():
    # issue 66: the shape of the published v5e record (its command built from config/llama_350m.py's flags)
    config = load_config([str(ROOT / "config" / "llama_164m_mqa.py")])
    gpt = model_setup.model_config(config, config.vocab_size, "tpu")
    assert model.count_params(gpt) == 163_595_264
    assert (gpt.n_layer, gpt.n_embd, gpt.n_head, gpt.kv_heads, gpt.mlp_hidden_size, gpt.padded_vocab_size) == (
        8,
        1024,
        4,
        1,
        3072,
        32768,
    )
    assert (gpt.qk_norm, gpt.logit_softcap, gpt.tie_embeddings, gpt.block_size) == (True, 15.0, False, 2048)
    assert config.batch_size * config.gradient_accumulation_steps == 64
