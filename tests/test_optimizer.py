"""Tests of training/optimizer.py: Muon's Newton-Schulz step and parameter groups, AdamW unchanged, and their resume."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import _muon
from test_train import ONE_DEVICE, small_config

import sharding
import train
from configurator import Config, ConfigError
from training import optimizer
from weights import checkpoint

LLAMA_STYLE = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1, bias=False, tie_embeddings=False)
QUINTIC = (3.4445, -4.7750, 2.0315)  # Keller Jordan's published coefficients for Muon
NS_COEFFS = jnp.asarray(QUINTIC)


def singular_values(x) -> np.ndarray:
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def newton_schulz_reference(g, steps=5) -> np.ndarray:
    """Muon's orthogonalisation written out in float64 NumPy (not optax's): the matrix scaled to
    Frobenius norm 1, wide side last (a tall one is transposed and back), then `steps` times the
    quintic X <- aX + (bA + cA²)X with A = XXᵀ, which maps each singular value s to as + bs³ + cs⁵."""
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / np.linalg.norm(x)
    a, b, c = QUINTIC
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def test_newton_schulz_brings_singular_values_into_its_band():
    """5 steps of the quintic map every singular value of a well-conditioned matrix into about
    [0.68, 1.2] (the coefficients trade exactness for speed: they oscillate around 1)."""
    x = jax.random.normal(jax.random.key(0), (64, 256))
    before = singular_values(x / jnp.linalg.norm(x))
    assert before.max() / before.min() > 2.5 and before.max() < 0.2  # spread out, far below 1
    after = singular_values(newton_schulz_reference(x, 5))
    assert 0.66 < after.min() and after.max() < 1.22, (after.min(), after.max())
    one_step = singular_values(newton_schulz_reference(x, 1))
    assert one_step.min() < 0.5  # the band is not reached by accident
    for steps in (1, 5):  # the function optimizer.py's Muon calls is the same iteration
        np.testing.assert_allclose(
            _muon.orthogonalize_via_newton_schulz(x, NS_COEFFS, steps),
            newton_schulz_reference(x, steps),
            rtol=0,
            atol=1e-5,
        )


def model_params(config: Config, vocab_size=64, seed=0):
    """Random arrays of the model's parameter shapes (numpy: no compiling for each shape)."""
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), vocab_size)
    return random_like(setup.abstract_state["params"], seed)


def random_like(params, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)), params)


GPT2_GROUPS = {
    "wte": "adamw",
    "wpe": "adamw",
    "ln_f.scale": "adamw",
    "ln_f.bias": "adamw",
    "blocks.ln_1.scale": "adamw",
    "blocks.ln_1.bias": "adamw",
    "blocks.ln_2.scale": "adamw",
    "blocks.ln_2.bias": "adamw",
    "blocks.attn.qkv_bias": "adamw",
    "blocks.attn.out_bias": "adamw",
    "blocks.mlp.fc_bias": "adamw",
    "blocks.mlp.proj_bias": "adamw",
    "blocks.attn.qkv_kernel": "muon",
    "blocks.attn.out_kernel": "muon",
    "blocks.mlp.fc_kernel": "muon",
    "blocks.mlp.proj_kernel": "muon",
}
LLAMA_GROUPS = {
    "wte": "adamw",
    "lm_head_kernel": "adamw",
    "ln_f.scale": "adamw",
    "blocks.ln_1.scale": "adamw",
    "blocks.ln_2.scale": "adamw",
    "blocks.attn.qkv_kernel": "muon",
    "blocks.attn.out_kernel": "muon",
    "blocks.mlp.gate_kernel": "muon",
    "blocks.mlp.fc_kernel": "muon",
    "blocks.mlp.proj_kernel": "muon",
}


MOE = dict(n_layer=2, n_experts=4, experts_per_token=2, moe_dense_layers=1)
MOE_GROUPS = {  # the dense first layer as GPT-2's; the sparse one: experts (no biases) and a router
    **{name.replace("blocks.", "dense_blocks.", 1): g for name, g in GPT2_GROUPS.items() if name.startswith("blocks.")},
    **{name: g for name, g in GPT2_GROUPS.items() if not name.startswith("blocks.mlp.")},
    "blocks.mlp.router_kernel": "adamw",
    "blocks.mlp.fc_kernel": "muon",
    "blocks.mlp.proj_kernel": "muon",
}


@pytest.mark.parametrize("architecture, expected", [({}, GPT2_GROUPS), (LLAMA_STYLE, LLAMA_GROUPS), (MOE, MOE_GROUPS)])
def test_param_groups_muon_on_block_matrices_adamw_on_the_rest(tmp_path, architecture, expected):
    setup = train.make_setup(
        small_config(tmp_path, optimizer="muon", **architecture), sharding.make_mesh(devices=ONE_DEVICE), 64
    )
    assert optimizer.param_groups(setup.abstract_state["params"]) == expected
    line = optimizer.groups_summary(setup.abstract_state["params"])
    assert line.startswith("optimizer: muon on ") and "adamw on " in line and "blocks.mlp.fc_kernel" in line


def test_an_unknown_block_matrix_is_named():
    params = {"blocks": {"mlp": {"expert_kernel": jax.ShapeDtypeStruct((2, 4, 8, 8), jnp.float32)}}}
    with pytest.raises(ValueError, match="blocks.mlp.expert_kernel .* add it to BLOCK_MATRICES"):
        optimizer.param_groups(params)


def test_muon_update_is_each_layers_matrix_orthogonalised_and_adamw_is_unchanged(tmp_path):
    """One step from zero state: a block matrix's update, layer by layer, is -lr x width scale x
    Newton-Schulz of that layer's gradient seen as (fan_in, fan_out), so the layer axis is a batch
    axis, not part of the matrix; every other parameter gets exactly optimizer='adamw''s update."""
    config = small_config(
        tmp_path,
        n_embd=64,
        n_head=4,
        optimizer="muon",
        grad_clip=0.0,
        decay_lr=False,
        muon_learning_rate=0.05,
        **LLAMA_STYLE,
    )
    params = model_params(config)
    grads = random_like(params, seed=1)
    tx = optimizer.make_optimizer(config)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    adamw = optimizer.make_optimizer(dataclasses.replace(config, optimizer="adamw"))
    adamw_updates, _ = jax.jit(adamw.update)(grads, adamw.init(params), params)
    groups, banded = optimizer.param_groups(params), set()
    for (path, update), g, a in zip(
        jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(grads), jax.tree.leaves(adamw_updates)
    ):
        name = ".".join(k.key for k in path)
        if groups[name] == "adamw":
            np.testing.assert_array_equal(update, a, err_msg=name)
            continue
        dims = optimizer.BLOCK_MATRICES[path[-1].key]
        fan_in = np.prod([update.shape[i] for i in np.atleast_1d(dims.reduction_axis)])
        for layer in range(config.n_layer):
            u = np.asarray(update[layer]).reshape(fan_in, -1)  # input axes come first in every kernel
            u = u / (-config.muon_learning_rate * np.sqrt(max(1, u.shape[1] / u.shape[0])))
            expected = newton_schulz_reference(g[layer].reshape(fan_in, -1))
            np.testing.assert_allclose(u, expected, rtol=0, atol=2e-5, err_msg=f"{name}[{layer}]")
            s_grad, s = singular_values(g[layer].reshape(fan_in, -1)), singular_values(u)
            if s_grad.max() / s_grad.min() < 20:  # a square random matrix has tiny singular values
                assert 0.66 < s.min() and s.max() < 1.22, (name, s.min(), s.max())
                banded.add(name)
    assert len(banded) >= 3


def test_muon_orthogonalises_each_expert_of_each_layer_on_its_own(tmp_path):
    """An expert kernel (L, E, D, F): layers and experts are both batch axes of Muon."""
    config = small_config(
        tmp_path,
        n_embd=64,
        n_head=4,
        optimizer="muon",
        grad_clip=0.0,
        decay_lr=False,
        muon_learning_rate=0.05,
        **{**MOE, "moe_dense_layers": 0},
    )
    params = model_params(config)
    grads = random_like(params, seed=1)
    tx = optimizer.make_optimizer(config)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for name in ("fc_kernel", "proj_kernel"):
        update, grad = updates["blocks"]["mlp"][name], grads["blocks"]["mlp"][name]
        assert update.shape[:2] == (2, 4)
        for layer in range(2):
            for expert in range(4):
                u = np.asarray(update[layer, expert])
                u = u / (-config.muon_learning_rate * np.sqrt(max(1, u.shape[1] / u.shape[0])))
                expected = newton_schulz_reference(grad[layer, expert])
                np.testing.assert_allclose(u, expected, rtol=0, atol=2e-5, err_msg=f"{name}[{layer}, {expert}]")


def test_adamw_is_the_same_optimizer_as_before_muon(tmp_path):
    """optimizer='adamw' is built as train.py built it before training/optimizer.py: same updates, bit for bit."""
    config = small_config(tmp_path)
    params = model_params(config)
    schedule = lambda count: optimizer.learning_rate(config, count)
    before = optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(
            learning_rate=schedule,
            b1=config.beta1,
            b2=config.beta2,
            weight_decay=config.weight_decay,
            mask=lambda p: jax.tree_util.tree_map_with_path(optimizer.decays, p),
        ),
    )
    now = optimizer.make_optimizer(config)
    states = before.init(params), now.init(params)
    for step in range(3):
        grads = random_like(params, seed=step)
        (u_before, s_before), (u_now, s_now) = (
            jax.jit(before.update)(grads, states[0], params),
            jax.jit(now.update)(grads, states[1], params),
        )
        jax.tree.map(np.testing.assert_array_equal, u_now, u_before)
        states = s_before, s_now
    assert float(optimizer.learning_rate(config, 1)) == pytest.approx(3e-3 * 2 / 3)


def test_both_groups_follow_one_schedule_scaled_to_their_peaks():
    config = Config(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=110, muon_learning_rate=0.02)
    for step in (0, 5, 10, 60, 110, 500):
        adamw = float(optimizer.learning_rate(config, step))
        muon = float(optimizer.learning_rate(config, step, config.muon_learning_rate))
        assert muon == pytest.approx(adamw * 20, rel=1e-6)
    assert float(optimizer.learning_rate(config, 500, 0.02)) == pytest.approx(0.002)  # min_lr, scaled


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(optimizer="sgd"), "'optimizer' must be one of 'adamw', 'muon'; got 'sgd'"),
        (dict(muon_learning_rate=0.0), "'muon_learning_rate' must be > 0"),
        (dict(muon_momentum=1.0), "'muon_momentum' must be in [0, 1), got 1.0"),
        (dict(muon_weight_decay=-0.1), "'muon_weight_decay' must be >= 0"),
    ],
)
def test_bad_muon_settings_are_one_config_error(flags, message):
    with pytest.raises(ConfigError) as error:
        Config(**flags)
    assert message in str(error.value)


def test_newton_schulz_flops_follow_the_formula(tmp_path):
    """5 x (4·m²·n + 2·m³) per matrix, m <= n; AdamW counts none."""
    config = small_config(tmp_path, n_layer=2, n_embd=32, n_head=2, optimizer="muon")
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 64)
    ns = lambda m, n: 5 * (4 * m * m * n + 2 * m**3)
    D = 32  # qkv (D, 3D), out (D, D), fc (D, 4D), proj (4D, D): 2 layers each
    expected = 2 * (ns(D, 3 * D) + ns(D, D) + ns(D, 4 * D) + ns(D, 4 * D))
    assert optimizer.flops_per_step(setup.abstract_state["params"], config) == expected
    assert optimizer.flops_per_step(setup.abstract_state["params"], dataclasses.replace(config, optimizer="adamw")) == 0


def test_newton_schulz_flops_are_what_xla_counts_beyond_adamw(tmp_path):
    """XLA's cost analysis of the whole step: Muon's minus AdamW's is the formula's count
    (plus elementwise work: momentum, norms, scaling)."""

    def xla_flops(name):
        config = small_config(tmp_path, n_embd=64, n_head=4, scan_layers=False, optimizer=name)
        setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 64)
        cost = train.lower(setup).cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"], setup

    adamw, _ = xla_flops("adamw")
    muon, setup = xla_flops("muon")
    formula = optimizer.flops_per_step(setup.abstract_state["params"], setup.config)
    assert formula < muon - adamw < 1.05 * formula, (muon - adamw) / formula


@pytest.fixture
def toy(tmp_path):
    from test_train import make_dataset

    make_dataset(tmp_path / "data")
    return tmp_path


def test_muon_resume_gives_the_same_losses_as_an_uninterrupted_run(toy):
    common = dict(optimizer="muon", muon_learning_rate=0.03, gradient_accumulation_steps=2)
    straight = train.train(small_config(toy, out_dir=str(toy / "a"), **common), ONE_DEVICE)
    first = train.train(small_config(toy, out_dir=str(toy / "b"), max_iters=4, **common), ONE_DEVICE)
    rest = train.train(small_config(toy, out_dir=str(toy / "b"), init_from="resume", **common), ONE_DEVICE)
    assert [s for s, _ in first + rest] == list(range(8))
    np.testing.assert_allclose([l for _, l in first + rest], [l for _, l in straight], rtol=0, atol=1e-6)
    assert straight[-1][1] < straight[0][1] - 0.2  # it learns


def test_switching_optimizer_at_resume_is_refused(toy):
    train.train(small_config(toy, max_iters=4), ONE_DEVICE)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"another optimizer than this run's \(optimizer: "
        r"checkpoint 'adamw', config 'muon'\).*export_hf.py",
    ):
        train.train(small_config(toy, init_from="resume", optimizer="muon"), ONE_DEVICE)
    # A checkpoint from before the key existed was trained with AdamW.
    older = {k: v for k, v in dataclasses.asdict(small_config(toy)).items() if k != "optimizer"}
    setup = lambda name: train.make_setup(small_config(toy, optimizer=name), sharding.make_mesh(devices=ONE_DEVICE), 65)
    train.check_optimizer_state(setup("adamw"), older)
    with pytest.raises(checkpoint.CheckpointError, match="optimizer: checkpoint 'adamw', config 'muon'"):
        train.check_optimizer_state(setup("muon"), older)
