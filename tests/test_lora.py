"""LoRA (layers/lora.py, and what train.py, the checkpoints, the loader and export_hf.py do with it): a
fresh adapter changes nothing, merging computes what the adapters compute, only adapters train and
hold optimizer state, checkpoints hold adapters and a record of the base, PEFT's format out and in."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from test_train import ONE_DEVICE, make_dataset, small_config

import bench
import configurator
import eval as eval_command
import export_hf
import model
import sample
import sharding
import train
from configurator import Config
from devices import memory
from inference import loader
from layers import lora
from model import GPT, GPTConfig
from weights import checkpoint, peft

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


def test_targets_the_model_lacks_are_refused_rather_than_training_every_weight():
    config = Config(n_layer=2, n_head=4, n_embd=32, block_size=16, lora_rank=4, lora_targets="gate")
    with pytest.raises(configurator.ConfigError, match="names no matrix this model has"):
        train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 65)


def test_the_configurators_targets_are_the_layers():
    assert configurator.LORA_TARGETS == lora.TARGETS


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A trained nanomax run (8 steps on the toy data) to adapt, the way the quickstart's would be."""
    root = tmp_path_factory.mktemp("lora")
    make_dataset(root / "data")
    config = small_config(root, out_dir=str(root / "base"), max_iters=8)
    train.train(config, ONE_DEVICE)
    return root


def lora_config(root, **overrides):
    values = dict(out_dir=str(root / "lora"), init_from=str(root / "base"), lora_rank=4, learning_rate=1e-2)
    return small_config(root, **(values | overrides))


def test_only_the_adapters_train_and_hold_optimizer_state(base_run):
    config = lora_config(base_run)
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 65)
    base = checkpoint.load_base(setup, config.init_from, setup.base_params)
    state = train.init_state(setup, base)
    start = jax.tree.map(np.asarray, state["params"])
    adapters, frozen = lora.split(start)
    # the frozen base as the forward reads it (float32 here: the compute dtype), equal to the run's weights
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)):
        np.testing.assert_array_equal(a, b)
    adapter_shapes = sorted(a.shape for a in jax.tree.leaves(adapters))
    moments = sorted(a.shape for a in jax.tree.leaves(state["opt_state"]) if a.ndim)
    assert moments == sorted(adapter_shapes * 2)  # AdamW's two moments, of the adapters only

    step = train.jit_train_step(setup)
    for seed in range(3):
        state, _ = step(state, bench.random_batch(setup, 65, seed))
    moved, still = lora.split(jax.tree.map(np.asarray, state["params"]))
    for a, b in zip(jax.tree.leaves(still), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(a, b)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(moved), jax.tree.leaves(adapters), strict=True):
        assert not np.array_equal(a, b), jax.tree_util.keystr(path)


def test_the_frozen_base_is_bfloat16_or_int8_and_the_memory_check_counts_only_the_adapters_state():
    config = Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=32,
        batch_size=2,
        dtype="bfloat16",
    )
    mesh = sharding.make_mesh(devices=ONE_DEVICE)
    full = train.make_setup(config, mesh, 65)
    lora_bf16 = train.make_setup(dataclasses.replace(config, lora_rank=4), mesh, 65)
    lora_int8 = train.make_setup(dataclasses.replace(config, lora_rank=4, weight_dtype="int8"), mesh, 65)
    dtypes = lambda setup: {str(a.dtype) for a in jax.tree.leaves(lora.split(setup.abstract_state["params"])[1])}
    assert dtypes(lora_bf16) == {"bfloat16", "float32"}  # matrices and tables; norm scales and biases
    assert "int8" in dtypes(lora_int8)
    opt_bytes = lambda setup: memory.per_device_bytes(setup.abstract_state["opt_state"])
    adapter_bytes = memory.per_device_bytes(lora.split(lora_bf16.abstract_state["params"])[0])
    assert 0 <= opt_bytes(lora_bf16) - 2 * adapter_bytes < 64  # two moments, and the step counts
    assert opt_bytes(full) > 10 * opt_bytes(lora_bf16)
    needs = [
        memory.needed([train.lower(setup).compile()], "cpu") for setup in (full, lora_bf16, lora_int8)
    ]  # what the pre-flight check compares with the device's memory
    assert needs[0] > needs[1] > needs[2]


def test_a_lora_checkpoint_holds_the_adapters_and_the_base_record_and_resumes_exactly(base_run):
    straight = train.train(lora_config(base_run, out_dir=str(base_run / "straight"), lora_dropout=0.1), ONE_DEVICE)
    first = train.train(lora_config(base_run, max_iters=4, lora_dropout=0.1), ONE_DEVICE)
    meta = checkpoint.newest_meta(str(base_run / "lora"))
    base_meta = checkpoint.newest_meta(str(base_run / "base"))
    assert meta["lora_base"]["init_from"] == str(base_run / "base")
    saved = set(meta["checksums"]["params"])  # every array the checkpoint holds, by path
    assert saved and all("lora_a" in p or "lora_b" in p for p in saved)
    assert len(saved) < len(base_meta["checksums"]["params"])
    resumed = configurator.load_config(
        [f"--out_dir={base_run / 'lora'}", "--init_from=resume", f"--data_dir={base_run / 'data'}", "--dataset=toy"]
        + [f"--{k}={getattr(lora_config(base_run), k)}" for k in RUN_KEYS]
        + ["--lora_dropout=0.1"],
        complete=train.complete_config,
    )
    assert resumed.lora_rank == 4 and resumed.n_embd == 32  # from the checkpoint
    rest = train.train(resumed, ONE_DEVICE)
    assert [s for s, _ in first + rest] == list(range(8))
    np.testing.assert_allclose([l for _, l in first + rest], [l for _, l in straight], rtol=0, atol=1e-6)


RUN_KEYS = ("batch_size", "max_iters", "learning_rate", "warmup_iters", "lr_decay_iters", "min_lr")
RUN_KEYS += ("eval_interval", "eval_iters", "tensorboard")


def test_a_resume_against_a_changed_base_is_refused_in_one_line(base_run, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(base_run / "base", base)
    train.train(lora_config(base_run, out_dir=str(tmp_path / "lora"), init_from=str(base), max_iters=2), ONE_DEVICE)
    # the base trains on: its newest checkpoint is another model now
    train.train(
        small_config(base_run, out_dir=str(base), init_from="resume", max_iters=10, lr_decay_iters=10), ONE_DEVICE
    )
    resumed = lora_config(base_run, out_dir=str(tmp_path / "lora"), init_from="resume", max_iters=4)
    with pytest.raises(checkpoint.CheckpointError) as error:
        train.train(resumed, ONE_DEVICE)
    message = str(error.value)
    assert "holds LoRA adapters trained on the base model at" in message and str(base) in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- out and in


LLAMA_KEYS = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=2, bias=False)


@pytest.fixture(scope="module")
def llama_lora_run(base_run):
    """A Llama-style base (GQA: 4 query heads, 2 key/value heads) and a LoRA run on it, 4 steps each."""
    base = small_config(base_run, out_dir=str(base_run / "llama-base"), max_iters=4, **LLAMA_KEYS)
    train.train(base, ONE_DEVICE)
    lora = dict(out_dir=str(base_run / "llama-lora"), init_from=base.out_dir, lora_targets="q,v,o,gate,down")
    train.train(lora_config(base_run, max_iters=4, **lora, **LLAMA_KEYS), ONE_DEVICE)
    return base_run / "llama-lora"


def test_the_peft_export_has_peft_names_and_shapes_and_the_merged_export_loads_back_equal(llama_lora_run, tmp_path):
    export_hf.export(
        export_hf.ExportConfig(out_dir=str(llama_lora_run), to=str(tmp_path / "adapter"), adapter_only=True)
    )
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == [
        "mlp.down_proj",
        "mlp.gate_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    assert config["base_model_name_or_path"] == str(llama_lora_run.parent / "llama-base")
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "np") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    D, F, H = 32, 128, 8  # width, SwiGLU's default hidden (8/3·32 rounded up to 64s), head size
    layer = "base_model.model.model.layers.1."
    expected = {
        "self_attn.q_proj": (D, 4 * H),  # (in, out): 4 query heads
        "self_attn.v_proj": (D, 2 * H),  # 2 key/value heads
        "self_attn.o_proj": (4 * H, D),
        "mlp.gate_proj": (D, F),
        "mlp.down_proj": (F, D),
    }
    for module, (n_in, n_out) in expected.items():
        assert shapes[f"{layer}{module}.lora_A.weight"] == [4, n_in]
        assert shapes[f"{layer}{module}.lora_B.weight"] == [n_out, 4]
    assert len(shapes) == 2 * 2 * len(expected)  # two layers, A and B

    export_hf.export(export_hf.ExportConfig(out_dir=str(llama_lora_run), to=str(tmp_path / "merged")))
    setup, params, _, _ = loader.load_checkpoint(str(llama_lora_run))
    assert not lora.has_adapters(params) and setup.model_config.lora_rank == 0
    exported_setup, exported, _ = loader.load_hf(str(tmp_path / "merged"))
    tokens = TOKENS % 65
    np.testing.assert_array_equal(
        nnx.merge(setup.graphdef, params)(tokens), nnx.merge(exported_setup.graphdef, exported)(tokens)
    )
    # sample.py, eval.py and serve.py load an adapter directory onto its Hugging Face base, merged
    export_hf.export(
        export_hf.ExportConfig(out_dir=str(llama_lora_run.parent / "llama-base"), to=str(tmp_path / "base"))
    )
    config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    adapter_setup, adapted, _ = loader.load_hf(str(tmp_path / "adapter"))
    np.testing.assert_allclose(
        nnx.merge(adapter_setup.graphdef, adapted)(tokens),
        nnx.merge(setup.graphdef, params)(tokens),
        rtol=1e-5,
        atol=1e-5,
    )
    # the adapter directory as init_from: the same adapters on the same base
    values = train.complete_config(
        {
            "init_from": str(tmp_path / "adapter"),
            "data_dir": str(llama_lora_run.parent / "data"),
            "dataset": "toy",
            "out_dir": str(tmp_path / "again"),
            "batch_size": 8,
        }
    )
    again = Config(**values)
    assert (again.lora_rank, again.lora_targets, again.n_kv_head) == (4, "q,v,o,gate,down", 2)
    train_setup = train.make_setup(again, sharding.make_mesh(devices=ONE_DEVICE), 65)
    base = checkpoint.load_base(train_setup, train.pretrained_model(again.init_from), train_setup.base_params)
    state = train.init_state(train_setup, base, peft.from_peft(again.init_from, train_setup.model_config))
    np.testing.assert_allclose(
        nnx.merge(train_setup.graphdef, state["params"])(tokens),
        nnx.merge(setup.graphdef, params)(tokens),
        rtol=1e-5,
        atol=1e-5,
    )


def test_gpt2s_fused_c_attn_exports_as_one_adapter_and_imports_exactly(base_run, tmp_path):
    """q and v adapters of a GPT-2 model: one c_attn adapter of rank 2r, B block-diagonal, alpha doubled."""
    out = tmp_path / "gpt2-lora"
    train.train(lora_config(base_run, out_dir=str(out), lora_targets="q,v,down", max_iters=2), ONE_DEVICE)
    export_hf.export(export_hf.ExportConfig(out_dir=str(out), to=str(tmp_path / "adapter"), adapter_only=True))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["attn.c_attn", "mlp.c_proj"] and config["fan_in_fan_out"] is True
    assert config["rank_pattern"] == {"attn.c_attn": 8} and config["alpha_pattern"] == {"attn.c_attn": 32.0}
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "np") as f:
        b = f.get_tensor("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight")
        assert f.get_slice("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight").get_shape() == [8, 32]
    assert b.shape == (96, 8) and not b[32:64].any() and not b[:32, 4:].any() and not b[64:, :4].any()
    setup, adapters, _, _ = loader.load_checkpoint(str(out), adapters_only=True)
    base = checkpoint.load_base(setup, str(base_run / "base"), lora.base_of(setup.abstract_params))
    keys = peft.lora_keys(str(tmp_path / "adapter"))
    assert keys == {"lora_rank": 8, "lora_alpha": 16.0, "lora_targets": "q,k,v,down"}
    imported_config = dataclasses.replace(setup.model_config, **keys)
    imported = peft.from_peft(str(tmp_path / "adapter"), imported_config)
    ours = lora.merge(lora.join(adapters, base), setup.model_config)
    theirs = lora.merge(lora.join(imported, base), imported_config)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_adapters_are_sharded_like_their_matrices_and_train_the_same_on_a_mesh():
    """fsdp splits A's input and B's output rows as it splits the matrix's, tensor splits heads and MLP units;
    three steps on data=2 x fsdp=2 x tensor=2 give the one device's losses."""
    config = Config(n_layer=2, n_embd=64, block_size=32, batch_size=8, lora_rank=4, learning_rate=1e-2, **LLAMA_KEYS)
    mesh = sharding.mesh_from_config(dataclasses.replace(config, mesh_data=2, mesh_fsdp=2, mesh_tensor=2))
    specs = {
        jax.tree_util.keystr(path): tuple(a.sharding.spec)
        for path, a in jax.tree_util.tree_leaves_with_path(
            lora.split(train.make_setup(config, mesh, 65).abstract_state["params"])[0]
        )
    }
    assert specs["['blocks']['attn']['q_lora']['lora_a']"] == ("stage", ("fsdp", "context"), None)
    assert specs["['blocks']['attn']['v_lora']['lora_b']"] == ("stage", None, "tensor", None)
    assert specs["['blocks']['mlp']['down_lora']['lora_a']"] == ("stage", "tensor", None)
    assert specs["['blocks']['mlp']['down_lora']['lora_b']"] == ("stage", None, ("fsdp", "context"))

    def losses(mesh):
        setup = train.make_setup(config, mesh, 65)
        state, step = train.init_state(setup), train.jit_train_step(setup)
        batch = bench.random_batch(setup, 65)
        out = []
        for _ in range(3):
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return out

    np.testing.assert_allclose(losses(mesh), losses(sharding.make_mesh(devices=ONE_DEVICE)), rtol=1e-5)


def test_sample_and_eval_run_a_lora_checkpoint_as_its_merged_export(llama_lora_run, tmp_path, capsys):
    export_hf.export(export_hf.ExportConfig(out_dir=str(llama_lora_run), to=str(tmp_path / "merged")))
    text = tmp_path / "text.txt"
    text.write_text("".join(chr(0x100 + i % 65) for i in range(0, 200, 3)))
    capsys.readouterr()
    outputs = []
    for source in (f"--out_dir={llama_lora_run}", f"--init_from={tmp_path / 'merged'}"):
        sample.main([source, "--start=\u0100\u0101", "--num_samples=1", "--max_new_tokens=8", "--temperature=0"])
        eval_command.main([source, "--task=perplexity", f"--data={text}", "--batch_size=2"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "perplexity: loss" in outputs[0]


def test_qlora_trains_adapters_on_an_int8_base(base_run, tmp_path, capsys):
    """weight_dtype='int8': the base's block matrices int8 (QLoRA-style), its logits within int8's rounding of
    the float32 base's, and the adapters train on it."""
    config = lora_config(base_run, out_dir=str(tmp_path / "qlora"), weight_dtype="int8", max_iters=6, eval_interval=6)
    history = train.train(config, ONE_DEVICE)
    assert "the base frozen in int8 blocks" in capsys.readouterr().out
    plain = train.train(
        lora_config(base_run, out_dir=str(tmp_path / "plain"), max_iters=6, eval_interval=6), ONE_DEVICE
    )
    assert all(np.isfinite(loss) for _, loss in history)
    assert 0 < abs(history[0][1] - plain[0][1]) < 0.02  # int8's rounding, no more
    _, adapters, _, _ = loader.load_checkpoint(config.out_dir, adapters_only=True)
    assert all(np.abs(pair["lora_b"]).max() > 0 for pair in adapters["blocks"]["attn"].values())
