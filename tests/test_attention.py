"""The splash kernel (layers/attention.py, Pallas; on a CPU in interpret mode) against the written-out
attention: forward and gradients, causal, packed rows, grouped- and multi-query; per shard under a
mesh, inside a train step; and what attention='auto' picks on each platform."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import assert_gradients_close, assert_near_in_learning_rates, make_setup_keeping_gradients

import model
import sharding
import train
from configurator import Config, ConfigError
from common import model_setup
from layers import attention
from training import optimizer

pytestmark = pytest.mark.skipif(attention.splash is None, reason="this JAX has no Pallas splash kernel")
SMALL_BLOCKS = (128, 128)  # at T = 256: 2 x 2 tiles, the one above the diagonal skipped


def qkv(B, T, N, K, H, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, T, N, H), dtype),
        jax.random.normal(kk, (B, T, K, H), dtype),
        jax.random.normal(kv, (B, T, K, H), dtype),
    )


def two_documents_a_row(B, T):
    """Segment ids: row b's second document starts at 37 + 50·b (one inside a tile, one across)."""
    return jnp.asarray([[0] * (37 + 50 * b) + [1] * (T - 37 - 50 * b) for b in range(B)], jnp.int32)


def sin_loss_and_gradients(attend, q, k, v):
    """sum(sin(attend(q, k, v))) and its gradients with respect to q, k and v."""
    return jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), argnums=(0, 1, 2))(q, k, v)


def small_blocks(T):
    """128-token tiles everywhere: several per row, some skipped above the diagonal."""
    return attention.splash.BlockSizes(
        block_q=128,
        block_kv=128,
        block_kv_compute=128,
        block_q_dkv=128,
        block_kv_dkv=128,
        block_kv_dkv_compute=128,
        use_fused_bwd_kernel=True,
    )


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (4, 1)], ids=["multi-head", "grouped-query", "multi-query"])
@pytest.mark.parametrize("segmented", [False, True], ids=["causal", "packed"])
def test_splash_and_its_gradients_equal_the_written_out_attention(N, K, segmented):
    B, T, H = 2, 256, 64
    q, k, v = qkv(B, T, N, K, H)
    ids = two_documents_a_row(B, T) if segmented else None
    dy = jax.random.normal(jax.random.key(7), q.shape)
    ours, our_pullback = jax.vjp(lambda q, k, v: attention.splash_attention(q, k, v, ids, small_blocks(T)), q, k, v)
    theirs, their_pullback = jax.vjp(lambda q, k, v: attention.causal_attention(q, k, v, segment_ids_BxT=ids), q, k, v)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5)
    for a, b in zip(our_pullback(dy), their_pullback(dy), strict=True):  # dq, dk, dv
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)
    if segmented:  # the documents are really apart: the unsegmented kernel differs after the first start
        apart = attention.splash_attention(q, k, v, None, small_blocks(T))
        assert np.abs(apart - ours)[:, 37:].max() > 0.1


def test_splash_head_size_128_with_the_tables_blocks():
    """Llama-style heads (H = 128) in rows of 384 tokens: the table's 1024- and 512-token tiles cut to 384."""
    blocks = attention.splash_block_sizes(384, 128)
    assert (blocks.block_q, blocks.block_kv, blocks.block_kv_compute, blocks.block_q_dkv) == (384, 384, 384, 384)
    q, k, v = qkv(1, 384, 2, 1, 128, seed=3)
    ours = sin_loss_and_gradients(attention.splash_attention, q, k, v)
    theirs = sin_loss_and_gradients(attention.causal_attention, q, k, v)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for a, b in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)


def test_splash_head_size_64_with_the_tables_blocks_and_seq_minor_layout():
    """GPT-2's heads (H = 64): the table gives queries, keys and values to the kernel as (H, T) tiles; packed,
    grouped-query rows of 256 tokens, forward and gradients as the written-out attention's."""
    blocks = attention.splash_block_sizes(256, 64)
    assert blocks.q_layout == blocks.k_layout == blocks.v_layout == attention.splash.QKVLayout.SEQ_MINOR
    wide = attention.splash_block_sizes(256, 128)
    assert wide.q_layout == wide.k_layout == attention.splash.QKVLayout.HEAD_DIM_MINOR
    q, k, v = qkv(2, 256, 4, 2, 64, seed=5)
    ids = two_documents_a_row(2, 256)
    ours = sin_loss_and_gradients(lambda q, k, v: attention.splash_attention(q, k, v, ids), q, k, v)
    theirs = sin_loss_and_gradients(lambda q, k, v: attention.causal_attention(q, k, v, segment_ids_BxT=ids), q, k, v)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for a, b in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)


def test_block_sizes_divide_the_row_and_rows_the_kernel_cannot_take_are_said():
    assert attention.splash_block_sizes(640, 64).block_q == 128  # 512 halved until it divides 640
    for T in (128, 256, 384, 640, 1024, 2048, 8192):
        blocks = attention.splash_block_sizes(T, 64)
        sizes = (
            blocks.block_q,
            blocks.block_kv,
            blocks.block_kv_compute,
            blocks.block_q_dkv,
            blocks.block_kv_dkv,
            blocks.block_kv_dkv_compute,
        )
        assert all(T % b == 0 and b % 128 == 0 and b <= T for b in sizes), (T, sizes)
        assert blocks.block_kv % blocks.block_kv_compute == 0 and blocks.block_kv_dkv % blocks.block_kv_dkv_compute == 0
    assert attention.splash_fits(1024) and attention.splash_fits(1000) and not attention.splash_fits(64)


@pytest.mark.parametrize("T", [200, 640])
def test_rows_are_padded_to_whole_tiles_and_the_padding_is_never_seen(T):
    """Rows the tiles do not divide go to the kernel padded: 200 tokens to 256, 896 (a long prompt) to
    1,024 with tiles of 512 rather than cut to tiles of 128 (slow on a TPU). The real queries' outputs
    and gradients are the written-out attention's."""
    lengths = [attention.splash_length(T) for T in (128, 200, 256, 512, 640, 896, 1000, 1024, 1152)]
    assert lengths == [128, 256, 256, 512, 1024, 1024, 1024, 1024, 1536]
    assert attention.splash_block_sizes(attention.splash_length(896), 64).block_q == 512
    q, k, v = qkv(1, T, 4, 2, 64, seed=11)
    ids = two_documents_a_row(1, T)
    ours = sin_loss_and_gradients(lambda q, k, v: attention.splash_attention(q, k, v, ids), q, k, v)
    theirs = sin_loss_and_gradients(lambda q, k, v: attention.causal_attention(q, k, v, segment_ids_BxT=ids), q, k, v)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert a.shape == b.shape == q.shape[:2] + a.shape[2:]
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_remat_keeps_the_kernels_output_and_log_sum_exp(policy):
    """Under remat the backward pass needs splash's output and log-sum-exp: the policies keep them
    (else the forward kernel runs again in the backward pass: on a TPU, ~10 ms of GPT-2's step)."""
    q, k, v = qkv(2, 128, 4, 2, 64)

    def kept_shapes(policy):
        """The shapes of what the backward pass keeps (JAX prints them, one a line: 'f32[2,4,128] output of ...')."""
        attend = jax.checkpoint(lambda q, k, v: jnp.sum(jnp.sin(attention.splash_attention(q, k, v))), policy=policy)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            jax.ad_checkpoint.print_saved_residuals(attend, q, k, v)
        return re.findall(r"^\w+\[([\d,]*)\]", printed.getvalue(), re.MULTILINE)

    output, log_sum_exp = "2,4,128,64", "2,4,128"  # the kernel's (B, N, T, H) and (B, N, T)
    kept = kept_shapes(model.REMAT_POLICIES[policy])
    assert output in kept and log_sum_exp in kept
    assert kept.count("2,2,128,64") == 2  # its inputs k and v (K = 2 heads) as well, in its own layout
    assert log_sum_exp not in kept_shapes(getattr(jax.checkpoint_policies, policy))  # JAX's own policy alone
    assert log_sum_exp not in kept_shapes(model.REMAT_POLICIES["full"])  # 'full' keeps nothing


def step_config(**overrides) -> Config:
    values = dict(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        block_size=128,
        batch_size=8,
        vocab_size=96,
        pos_embedding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_embeddings=False,
        learning_rate=1e-3,
        warmup_iters=0,
        document_masking=True,
    )
    return Config(**(values | overrides))


def losses_of(config, mesh, steps=2):
    """The setup, losses, each step's gradients (before AdamW) and final parameters of `steps` train steps
    on fixed random tokens (id 0 starts a document: several per row)."""
    setup, gradients = make_setup_keeping_gradients(config, mesh, config.vocab_size, document_start=0), []
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 12, (2, 1, config.batch_size, config.block_size)).astype(np.int32)
    batch = tuple(jax.device_put(a, setup.micro_batch_sharding) for a in tokens)
    with sharding.activate(mesh):
        step = train.jit_train_step(setup)
        state, losses = train.init_state(setup), []
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            gradients.append(jax.device_get(state["opt_state"].gradients))
    return setup, losses, gradients, jax.device_get(state["params"])


def assert_same_steps(config, got, expected):
    """Two runs of losses_of took the same steps: the same losses, the first step's gradients (from the same
    parameters) within 1e-5 of each array's largest (measured: 4e-7), and parameters within 1% of a learning
    rate (rms; measured: 1e-5)."""
    (_, losses, gradients, params), (_, reference, reference_gradients, reference_params) = got, expected
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert_gradients_close(gradients[0], reference_gradients[0], rtol=1e-5)
    assert_near_in_learning_rates(params, reference_params, optimizer.learning_rate(config, 0))


def test_gpt2_style_splash_step_equals_the_written_out_attention(monkeypatch):
    """GPT-2's layer (biases on q, k and v, learned positions, LayerNorm, GELU; grouped-query too) through
    splash, whose q, k and v the projection makes in the kernel's (B, heads, T, H) layout: the losses,
    gradients and parameters of two steps are those of the written-out attention's (B, T, heads, H) path."""
    config = step_config(
        pos_embedding="learned",
        norm="layernorm",
        mlp="gelu",
        bias=True,
        n_kv_head=2,
        document_masking=False,
        remat_policy="dots_with_no_batch_dims_saveable",
    )
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    reference = losses_of(config, mesh)
    monkeypatch.setitem(model_setup.AUTO_ATTENTION["cpu"], "float32", "splash")
    splashed = losses_of(config, mesh)
    assert splashed[0].model_config.attention == "splash"
    assert_same_steps(config, splashed, reference)


def test_splash_in_a_sharded_train_step_equals_the_written_out_attention(monkeypatch):
    """A Llama-style step (grouped-query, document masking) on 8 devices, rows over data x fsdp (data
    kept apart: the per-shard vmap) and heads over tensor: with 'auto' pointed at splash on this CPU,
    the losses, gradients and parameters of two steps are the written-out attention's."""
    config, mesh = step_config(), sharding.make_mesh(data=2, fsdp=2, tensor=2)
    reference = losses_of(config, mesh)
    monkeypatch.setitem(model_setup.AUTO_ATTENTION["cpu"], "float32", "splash")
    splashed = losses_of(config, mesh)
    assert splashed[0].model_config.attention == "splash" and train.shards_kept_apart(splashed[0]) == ("data",)
    assert_same_steps(config, splashed, reference)


def test_auto_attention_per_platform_and_kernels_off_their_platform_are_one_clear_error():
    for dtype in ("float32", "bfloat16"):
        config = Config(dtype=dtype)
        assert model_setup.attention_implementation(config, "cpu") == "einsum"
        assert model_setup.attention_implementation(config, "tpu") == "splash"
        assert model_setup.attention_implementation(config, "gpu") == ("cudnn" if dtype == "bfloat16" else "xla")
    assert model_setup.attention_implementation(Config(attention="einsum"), "tpu") == "einsum"
    for platform in ("cpu", "gpu"):
        with pytest.raises(ConfigError, match=f"attention='splash' needs TPUs, but this run's devices are {platform}"):
            model_setup.attention_implementation(Config(attention="splash"), platform)


@pytest.mark.tpu  # skipped off the chip (conftest.py)
@pytest.mark.parametrize("segmented", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("H", [64, 128])
def test_splash_on_the_chip_equals_the_written_out_attention_in_float32(H, segmented):
    """On a TPU, compiled (not interpreted), at GPT-2's and Llama's head sizes and the table's blocks;
    matmuls at float32 precision on both sides (a TPU's default rounds float32 operands to bfloat16)."""
    B, T, N, K = 2, 1024, 4, 2
    q, k, v = qkv(B, T, N, K, H, seed=1)
    ids = two_documents_a_row(B, T) if segmented else None
    loss = lambda f: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, ids))), argnums=(0, 1, 2)))
    with jax.default_matmul_precision("float32"):
        ours = loss(attention.splash_attention)(q, k, v)
        theirs = loss(lambda q, k, v, ids: attention.causal_attention(q, k, v, segment_ids_BxT=ids))(q, k, v)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-3)
    for a, b in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * float(np.abs(b).max()))


def test_choose_attention_runs_the_configs_attention_where_it_can_and_the_fallback_where_not():
    """One implementation per traced program, by the rules in one place: splash runs heads-major, int8
    projections on the (B, T, heads, H) layout; dropout and rows splash cannot
    take go to the written-out attention; rows split over `context` run ring attention when asked,
    else XLA's over the gathered keys and values."""
    config = model.GPTConfig(attention="splash", dropout=0.1)
    choose = lambda T, **kw: attention.choose_attention(config, T, **kw).name
    assert choose(256) == "splash_heads_major" and attention.Attend("splash_heads_major").heads_major
    assert choose(256, dropout=True) == "einsum" and choose(100) == "einsum"
    assert choose(200) == "splash_heads_major"  # padded to 256
    assert attention.choose_attention(model.GPTConfig(attention="splash", quantization="int8"), 256).name == "splash"
    assert attention.choose_attention(model.GPTConfig(attention="xla"), 100).name == "xla"
    context_split = sharding.make_mesh(1, 1, 1, jax.devices()[:2], context=2)
    with sharding.activate(context_split):
        assert choose(256) == "xla"
        ring = model.GPTConfig(attention="splash", context_attention="ring")
        assert attention.choose_attention(ring, 256).name == "ring"
