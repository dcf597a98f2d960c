"""LoRA (layers/lora.py, and what train.py, the checkpoints, the loader and export_hf.py do with it): a
fresh adapter changes nothing, merging computes what the adapters compute, only adapters train and
hold optimizer state, checkpoints hold adapters and a record of the base, PEFT's format out and in."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configurator
import model
from layers import lora
from model import GPT, GPTConfig

GPT2 = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32, attention="einsum")
# 4 query heads in 2 groups (GQA), SwiGLU, untied output: every Llama-style switch the adapters meet.
LLAMA = dataclasses.replace(
    GPT2, pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False, tie_embeddings=False
)


def with_lora(config, rank=4, targets="all", alpha=8.0):
    return dataclasses.replace(config, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)


def pure(config, seed=0) -> tuple:
    graphdef, state = nnx.split(GPT(config, jax.random.key(seed)))
    return graphdef, nnx.to_pure_dict(state)


def logits(config, params, idx):
    graphdef, state = nnx.split(GPT(config, jax.random.key(0)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(idx)


def trained(adapters, seed=3):
    """The adapters moved away from their start (B no longer zero), as training would move them."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [a + 0.2 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, 65)


@pytest.mark.parametrize("base", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_a_fresh_adapter_gives_the_base_models_logits_and_merging_computes_what_the_adapters_do(base):
    config = with_lora(base)
    _, base_params = pure(base)
    adapters, frozen = lora.split(pure(config)[1])
    # the base's parameters are the same with and without adapters (the adapters' init takes no key of theirs)
    assert jax.tree.structure(frozen) == jax.tree.structure(base_params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base_params)))
    expected = logits(base, base_params, TOKENS)
    np.testing.assert_array_equal(logits(config, lora.join(adapters, base_params), TOKENS), expected)

    moved = lora.join(trained(adapters), base_params)
    with_adapters = logits(config, moved, TOKENS)
    assert float(jnp.abs(with_adapters - expected).max()) > 0.1  # the adapters do change the output
    merged = lora.merge(moved, config)
    assert not lora.has_adapters(merged) and jax.tree.structure(merged) == jax.tree.structure(base_params)
    np.testing.assert_allclose(logits(base, merged, TOKENS), with_adapters, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("targets", ["q,v", "k,o", "gate,down", "up"])
def test_each_target_adapts_only_its_matrix(targets):
    """Merging one target's adapter changes its matrix's slots only, and agrees with the adapter's forward."""
    config = with_lora(LLAMA, targets=targets)
    adapters, frozen = lora.split(pure(config)[1])
    named = {k.split("_")[0] for module in adapters["blocks"].values() for k in module}
    assert named == set(lora.parse_targets(targets))
    moved = lora.join(trained(adapters), frozen)
    merged = lora.merge(moved, config)
    G = LLAMA.n_head // LLAMA.n_kv_head
    slots = {"q": slice(0, G), "k": slice(G, G + 1), "v": slice(G + 1, G + 2)}
    qkv_before, qkv_after = frozen["blocks"]["attn"]["qkv_kernel"], merged["blocks"]["attn"]["qkv_kernel"]
    for letter, slot in slots.items():
        changed = not np.array_equal(qkv_before[:, :, slot], qkv_after[:, :, slot])
        assert changed == (letter in named), letter
    np.testing.assert_allclose(logits(LLAMA, merged, TOKENS), logits(config, moved, TOKENS), rtol=1e-5, atol=1e-5)


def test_the_heads_major_projections_add_the_same_adapters():
    """The splash kernel's layout (B, heads, T, H) gets the same q, k, v and output as the (B, T, heads, H) one."""
    graphdef, state = nnx.split(model.Attention(with_lora(LLAMA), jax.random.key(0)))
    adapters, frozen = lora.split(nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, lora.join(trained(adapters), frozen))
    layer = nnx.merge(graphdef, state)
    x = jax.random.normal(jax.random.key(5), (2 * 16, 32))
    position = jnp.broadcast_to(jnp.arange(16), (2, 16))
    for rows, heads in zip(layer._qkv(x, position, heads_major=False), layer._qkv(x, position, heads_major=True)):
        np.testing.assert_allclose(rows, heads.swapaxes(1, 2), rtol=1e-5, atol=1e-6)
    y = jax.random.normal(jax.random.key(6), (2, 16, 4, 8))
    heads_major = layer._out(y.swapaxes(1, 2), heads_major=True)
    np.testing.assert_allclose(layer._out(y, heads_major=False), heads_major, rtol=1e-5, atol=1e-6)


def test_adapter_dropout_is_on_the_adapters_input_only_and_off_without_a_key():
    config = dataclasses.replace(with_lora(GPT2), lora_dropout=0.5)
    adapters, frozen = lora.split(pure(config)[1])
    moved = lora.join(trained(adapters), frozen)
    graphdef, state = nnx.split(GPT(config, jax.random.key(0)))
    nnx.replace_by_pure_dict(state, moved)
    gpt = nnx.merge(graphdef, state)
    plain = gpt(TOKENS)
    np.testing.assert_allclose(plain, logits(GPT2, lora.merge(moved, config), TOKENS), rtol=1e-5, atol=1e-5)
    dropped = gpt(TOKENS, dropout_key=jax.random.key(9))
    assert float(jnp.abs(dropped - plain).max()) > 1e-3
    # with B at zero the adapters add nothing, dropped or not: the model's own dropout is 0 here
    fresh = lora.join(adapters, frozen)
    nnx.replace_by_pure_dict(state, fresh)
    gpt = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(gpt(TOKENS, dropout_key=jax.random.key(9)), gpt(TOKENS))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora_rank=-1"], "lora_rank must be >= 0"),
        (["--lora_rank=8", "--lora_alpha=0"], "lora_alpha must be > 0"),
        (["--lora_rank=8", "--lora_dropout=1.0"], "lora_dropout must be in [0, 1)"),
        (["--lora_rank=8", "--lora_targets=q,query"], "lora_targets: unknown 'query'"),
        (["--lora_rank=8", "--lora_targets=,"], "lora_targets names no matrix"),
        (["--weight_dtype=int8"], "only LoRA adapters can train"),
    ],
)
def test_bad_lora_values_are_one_clear_message(flags, message):
    with pytest.raises(configurator.ConfigError) as error:
        configurator.load_config(["--init_from=gpt2", *flags])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_lora_needs_a_trained_model_to_adapt():
    with pytest.raises(configurator.ConfigError, match="init_from='scratch' has none"):
        configurator.Config(lora_rank=8)


def test_the_configurators_targets_are_the_layers():
    assert configurator.LORA_TARGETS == lora.TARGETS
