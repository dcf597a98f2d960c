"""weights/hf.py: Hugging Face directories in (config.json, safetensors, hub names) and out.

The directories are written here: GPT-2 and Llama / Mistral / Qwen2 tensors by name, as
transformers stores them (each checked against a float64 NumPy forward written from those names,
so that weights/hf.py's layout table is not only checked against itself by the round trips), and
nanomax models exported by weights/hf.py itself; transformers is not needed (the check against it
is in the closing note of the issue, with a separate venv)."""

import dataclasses
import importlib
import json
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_model import _gelu_tanh, _layer_norm, tokens

import configurator
import sharding
import train
from model import GPT, GPTConfig
from weights import checkpoint, hf

GPT2 = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
LLAMA = dataclasses.replace(
    GPT2,
    pos_embedding="rope",
    norm="rmsnorm",
    norm_eps=1e-6,
    mlp="swiglu",
    mlp_hidden=48,
    bias=False,
    rope_theta=500_000.0,
)
MODELS = {
    "gpt2": GPT2,
    "gpt2 padded vocabulary": dataclasses.replace(GPT2, pad_vocab_to_multiple=64),
    "llama gqa tied llama3-rope": dataclasses.replace(
        LLAMA, n_kv_head=2, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_context=64
    ),
    "llama untied": dataclasses.replace(LLAMA, tie_embeddings=False),
    "qwen2 (qkv bias)": dataclasses.replace(LLAMA, n_kv_head=1, qkv_bias=True, tie_embeddings=False),
}


def random_params(config: GPTConfig, seed=0) -> dict:
    """Parameters with every entry random (norm scales and biases too), as NumPy arrays."""
    params = nnx.to_pure_dict(nnx.state(GPT(config, jax.random.key(seed))))
    rng = np.random.default_rng(seed)
    noisy = jax.tree.map(lambda a: np.asarray(a) + 0.1 * rng.standard_normal(a.shape).astype(np.float32), params)
    noisy["wte"][config.vocab_size :] = 0  # padding rows of the vocabulary are not the model's
    if not config.tie_embeddings:
        noisy["lm_head_kernel"][:, config.vocab_size :] = 0
    return noisy


def export(directory, config: GPTConfig, params, dtype="float32", max_shard_bytes=5 << 30) -> str:
    hf.write_model(
        str(directory),
        hf.to_hf_tensors(params, config),
        hf.hf_config(config, dtype, None, None),
        dtype,
        max_shard_bytes,
    )
    return str(directory)


def load(directory, mesh=None, **given) -> tuple:
    """(Config, NumPy params) of a Hugging Face directory, as train.py's init_from loads them."""
    model = hf.read_config(directory)
    values = hf.fill_model_keys({"init_from": str(directory), **given}, model, directory, model.max_context)
    mesh = mesh or sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    config = configurator.Config(batch_size=sharding.batch_shards(mesh), **values)
    setup = train.make_setup(config, mesh, model.keys["vocab_size"])
    return config, jax.tree.map(np.asarray, checkpoint.load_pretrained(setup, str(directory)))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_import_export_import_round_trips_bit_exactly(tmp_path, name):
    config = MODELS[name]
    params = random_params(config)
    first = export(tmp_path / "first", config, params)
    keys = hf.read_config(first).keys
    assert all(keys[k] == getattr(config, k) for k in keys)  # the architecture survives config.json
    loaded_config, loaded = load(first, pad_vocab_to_multiple=config.pad_vocab_to_multiple)
    assert_trees_equal(loaded, params)
    again = export(tmp_path / "again", config, loaded)
    assert sorted(os.listdir(first)) == sorted(os.listdir(again)) == ["config.json", "model.safetensors"]
    assert_trees_equal(load_file(f"{first}/model.safetensors"), load_file(f"{again}/model.safetensors"))


def test_bfloat16_files_and_shards_with_an_index(tmp_path):
    config = MODELS["llama gqa tied llama3-rope"]
    params = random_params(config)
    directory = export(tmp_path / "bf16", config, params, dtype="bfloat16", max_shard_bytes=8_000)
    files = sorted(os.listdir(directory))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    _, loaded = load(directory)
    rounded = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert_trees_equal(loaded, rounded)
    os.remove(f"{directory}/{shards[1]}")
    with pytest.raises(checkpoint.CheckpointError, match=f"names {shards[1]}, which is missing"):
        load(directory)


def test_loading_on_eight_devices_reads_only_each_devices_block(tmp_path, monkeypatch):
    config = dataclasses.replace(MODELS["qwen2 (qkv bias)"], n_embd=64, n_head=8, n_kv_head=2)
    params = random_params(config)
    directory = export(tmp_path / "qwen", config, params)
    reads = []
    read = hf.Weights.read
    monkeypatch.setattr(
        hf.Weights,
        "read",
        lambda self, path, shape, index: (
            reads.append((path, shape, read(self, path, shape, index).shape)) or read(self, path, shape, index)
        ),
    )
    mesh = sharding.make_mesh(1, 4, 2)  # fsdp 4 x tensor 2
    _, loaded = load(directory, mesh)
    assert_trees_equal(loaded, params)
    qkv = [(shape, block) for path, shape, block in reads if path == ("blocks", "attn", "qkv_kernel")]
    assert len(qkv) == 8 and all(np.prod(block) * 8 == np.prod(shape) for shape, block in qkv)


# --- GPT-2 files as transformers writes them ----------------------------------------------------


def random_hf_gpt2(n_layer=2, n_embd=32, vocab_size=65, n_positions=16, seed=0):
    """GPT-2 tensors under Hugging Face's names (no prefix), Conv1D weights stored (in, out)."""
    rng = np.random.default_rng(seed)
    D = n_embd
    normal = lambda *shape, std=0.1: (std * rng.standard_normal(shape)).astype(np.float32)
    t = {
        "wte.weight": normal(vocab_size, D, std=0.3),
        "wpe.weight": normal(n_positions, D),
        "ln_f.weight": 1 + normal(D, std=0.2),
        "ln_f.bias": normal(D),
    }
    for i in range(n_layer):
        t |= {
            f"h.{i}.ln_1.weight": 1 + normal(D, std=0.2),
            f"h.{i}.ln_1.bias": normal(D),
            f"h.{i}.attn.c_attn.weight": normal(D, 3 * D, std=0.2),
            f"h.{i}.attn.c_attn.bias": normal(3 * D),
            f"h.{i}.attn.c_proj.weight": normal(D, D),
            f"h.{i}.attn.c_proj.bias": normal(D),
            f"h.{i}.ln_2.weight": 1 + normal(D, std=0.2),
            f"h.{i}.ln_2.bias": normal(D),
            f"h.{i}.mlp.c_fc.weight": normal(D, 4 * D),
            f"h.{i}.mlp.c_fc.bias": normal(4 * D),
            f"h.{i}.mlp.c_proj.weight": normal(4 * D, D),
            f"h.{i}.mlp.c_proj.bias": normal(D),
        }
    return t


def write_hf_gpt2(directory, tensors, n_head, prefix="transformer.", buffers=True, dtype=np.float32, **config_changes):
    """A directory as `GPT2LMHeadModel.save_pretrained` writes it: config.json + model.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n_layer = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("h."))
    V, D = tensors["wte.weight"].shape
    T = tensors["wpe.weight"].shape[0]
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": n_layer,
        "n_head": n_head,
        "n_embd": D,
        "n_positions": T,
        "n_ctx": T,
        "vocab_size": V,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "n_inner": None,
    }
    (directory / "config.json").write_text(json.dumps(config | config_changes))
    files = {prefix + name: array.astype(dtype) for name, array in tensors.items()}
    if buffers:  # what older transformers versions saved too: must be ignored
        for i in range(n_layer):
            files[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((1, 1, T, T), dtype))
            files[f"{prefix}h.{i}.attn.masked_bias"] = np.array(-1e4, dtype)
        files["lm_head.weight"] = tensors["wte.weight"].astype(dtype)  # tied
    save_file(files, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def hf_reference_forward(t, n_head, idx):
    """GPT-2 in float64 NumPy straight from the Hugging Face tensors (not via model.py's layout)."""
    t = {name: np.asarray(a, np.float64) for name, a in t.items()}
    idx = np.asarray(idx)
    B, T = idx.shape
    D = t["wte.weight"].shape[1]
    N, H = n_head, D // n_head
    heads = lambda a: a.reshape(B, T, N, H).transpose(0, 2, 1, 3)  # (B, N, T, H)
    x = t["wte.weight"][idx] + t["wpe.weight"][:T]
    i = 0
    while f"h.{i}.ln_1.weight" in t:
        p = lambda name: t[f"h.{i}.{name}"]
        h = _layer_norm(x, p("ln_1.weight"), p("ln_1.bias"))
        q, k, v = np.split(h @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, axis=-1)
        scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) / np.sqrt(H)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        y = (weights @ heads(v)).transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = _layer_norm(x, p("ln_2.weight"), p("ln_2.bias"))
        h = _gelu_tanh(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
        i += 1
    x = _layer_norm(x, t["ln_f.weight"], t["ln_f.bias"])
    return x @ t["wte.weight"].T


@pytest.mark.parametrize("prefix, dtype", [("transformer.", np.float32), ("", np.float16)])
def test_hf_gpt2_logits_match_a_float64_numpy_forward(tmp_path, prefix, dtype):
    tensors = {k: v.astype(dtype).astype(np.float32) for k, v in random_hf_gpt2(n_positions=24).items()}
    directory = write_hf_gpt2(tmp_path / "gpt2", tensors, n_head=4, prefix=prefix, buffers=bool(prefix), dtype=dtype)
    idx = tokens((2, 16))
    expected = hf_reference_forward(tensors, 4, idx)
    assert np.abs(expected).max() > 1.0  # the weights are big enough for mistakes to show
    # A shorter context (the position table is cut) and a padded vocabulary, as for fine-tuning.
    config, params = load(directory, block_size=16, pad_vocab_to_multiple=64)
    assert params["wpe"].shape == (16, 32) and params["wte"].shape == (128, 32)
    gpt = nnx.merge(train.make_setup(config, sharding.make_mesh(1, 1, 1, jax.devices()[:1]), 65).graphdef, params)
    logits = np.asarray(gpt(idx))
    np.testing.assert_allclose(logits[..., :65], expected, rtol=0, atol=1e-5)


# --- Llama, Mistral and Qwen2 files as transformers writes them ---------------------------------


def random_hf_llama(
    n_layer=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab_size=65, tied=False, qkv_bias=False, seed=0
):
    """Llama-family tensors under Hugging Face's names; nn.Linear weights are stored (out, in)."""
    rng = np.random.default_rng(seed)
    D, F, KH = hidden, intermediate, kv_heads * (hidden // heads)
    normal = lambda *shape, std=0.15: (std * rng.standard_normal(shape)).astype(np.float32)
    t = {"model.embed_tokens.weight": normal(vocab_size, D, std=0.25), "model.norm.weight": 1 + normal(D, std=0.2)}
    if not tied:
        t["lm_head.weight"] = normal(vocab_size, D, std=0.25)
    for i in range(n_layer):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + normal(D, std=0.2),
            p + "self_attn.q_proj.weight": normal(D, D),
            p + "self_attn.k_proj.weight": normal(KH, D),
            p + "self_attn.v_proj.weight": normal(KH, D),
            p + "self_attn.o_proj.weight": normal(D, D),
            p + "post_attention_layernorm.weight": 1 + normal(D, std=0.2),
            p + "mlp.gate_proj.weight": normal(F, D),
            p + "mlp.up_proj.weight": normal(F, D),
            p + "mlp.down_proj.weight": normal(D, F),
        }
        if qkv_bias:
            t |= {
                p + "self_attn.q_proj.bias": normal(D),
                p + "self_attn.k_proj.bias": normal(KH),
                p + "self_attn.v_proj.bias": normal(KH),
            }
    return t


def write_hf_llama(directory, tensors, config: dict) -> str:
    """A directory as `LlamaForCausalLM.save_pretrained` (or Mistral's, Qwen2's) writes it."""
    directory = Path(write_config(directory, config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def llama_inverse_frequencies(head_dim, config: dict) -> np.ndarray:
    """transformers' inv_freq: theta^(-2i/H), and for rope_type 'llama3' its rescaling by wavelength."""
    inv_freq = 1.0 / config.get("rope_theta", 10000.0) ** (np.arange(0, head_dim, 2) / head_dim)
    scaling = config.get("rope_scaling")
    if scaling:
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelength = 2 * np.pi / inv_freq
        scaled = np.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq


def hf_llama_reference_forward(t, config: dict, idx):
    """Llama / Mistral / Qwen2 in float64 NumPy from the Hugging Face tensors and config.json, as
    transformers' modeling_llama computes it: RMSNorm, RoPE on (x[:H/2], x[H/2:]) with rotate_half,
    key/value heads repeated for their query heads (repeat_kv), SwiGLU, logits from lm_head."""
    t = {name: np.asarray(a, np.float64) for name, a in t.items()}
    idx = np.asarray(idx)
    B, T = idx.shape
    D, N = config["hidden_size"], config["num_attention_heads"]
    K, H, eps = config["num_key_value_heads"], D // N, config["rms_norm_eps"]
    rms_norm = lambda x, w: w * (x / np.sqrt((x**2).mean(-1, keepdims=True) + eps))
    angles = np.arange(T)[:, None] * llama_inverse_frequencies(H, config)[None]  # (T, H/2)
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    rotate_half = lambda x: np.concatenate([-x[..., H // 2 :], x[..., : H // 2]], -1)
    rope = lambda x: x * cos + rotate_half(x) * sin  # x: (B, heads, T, H)

    def linear(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    heads = lambda x, n: x.reshape(B, T, n, H).transpose(0, 2, 1, 3)  # (B, n, T, H)
    x = t["model.embed_tokens.weight"][idx]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, t[p + "input_layernorm.weight"])
        q = rope(heads(linear(h, p + "self_attn.q_proj"), N))
        k = rope(heads(linear(h, p + "self_attn.k_proj"), K))
        v = heads(linear(h, p + "self_attn.v_proj"), K)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # query head j reads kv head j // (N/K)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        y = (weights @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + linear(y, p + "self_attn.o_proj")
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, t["model.norm.weight"])
    return x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


LLAMA_FAMILY = {  # name: (config.json beyond the shape, random_hf_llama's switches)
    "llama gqa tied": ({"model_type": "llama", "rope_theta": 10000.0, "tie_word_embeddings": True}, dict(tied=True)),
    "llama3.1 rope scaling": (
        {
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
        {},
    ),
    "mistral without gqa": (
        {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "rope_theta": 1000000.0,
            "sliding_window": None,
        },
        dict(kv_heads=4),
    ),
    "qwen2 qkv biases": (
        {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
        },
        dict(kv_heads=1, qkv_bias=True),
    ),
}


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_hf_llama_family_logits_match_a_float64_numpy_forward(tmp_path, name):
    """The Llama layout table (q/k/v head order, (out, in) transposes, RoPE's half-split pairing)
    against transformers' computation written from the tensor names, not from model.py's layout."""
    extra, switches = LLAMA_FAMILY[name]
    kv_heads = switches.get("kv_heads", 2)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "vocab_size": 65,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    } | extra
    tensors = random_hf_llama(**switches)
    directory = write_hf_llama(tmp_path / "model", tensors, config)
    idx = tokens((2, 16))
    expected = hf_llama_reference_forward(tensors, config, idx)
    assert np.abs(expected).max() > 1.0  # the weights are big enough for mistakes to show
    loaded_config, params = load(directory, block_size=16)
    gpt = nnx.merge(
        train.make_setup(loaded_config, sharding.make_mesh(1, 1, 1, jax.devices()[:1]), 65).graphdef, params
    )
    logits = np.asarray(gpt(idx))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)


# --- config.json ---------------------------------------------------------------------------------

LLAMA_JSON = {
    "model_type": "llama",
    "vocab_size": 65,
    "max_position_embeddings": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def write_config(directory, config: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    Path(directory, "config.json").write_text(json.dumps(config))
    return str(directory)


def test_transformers_4_and_5_config_formats_read_the_same(tmp_path):
    v4 = write_config(tmp_path / "v4", LLAMA_JSON | {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE})
    v5 = write_config(tmp_path / "v5", LLAMA_JSON | {"rope_parameters": LLAMA3_ROPE | {"rope_theta": 500000.0}})
    a, b = hf.read_config(v4), hf.read_config(v5)
    assert a == b and a.keys["rope_scaling"] == "llama3" and a.keys["rope_scaling_factor"] == 32.0
    assert a.keys["rope_theta"] == 500000.0 and a.keys["rope_original_context"] == 8192
    assert a.keys["n_kv_head"] == 2 and a.keys["mlp_hidden"] == 48 and a.max_context == 128
    qwen = hf.read_config(write_config(tmp_path / "qwen", LLAMA_JSON | {"model_type": "qwen2"}))
    assert qwen.keys["qkv_bias"] and not a.keys["qkv_bias"]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "gemma"}, ["model_type 'gemma' is not supported", "gpt2, llama, mistral, qwen2"]),
        ({"num_local_experts": 8}, ["num_local_experts=8", "mixtures of experts"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope scaling type 'yarn'", "'llama3'"]),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["'llama3' lacks or garbles"]),
        ({"attention_bias": True}, ["attention_bias"]),
        ({"hidden_act": "gelu"}, ["hidden_act is 'gelu'"]),
        ({"head_dim": 16}, ["head_dim is 16"]),
        ({"num_hidden_layers": None} | {"hidden_size": None}, []),
    ],
)
def test_unsupported_configs_name_the_key(tmp_path, change, words):
    config = {k: v for k, v in (LLAMA_JSON | change).items() if v is not None}
    directory = write_config(tmp_path, config)
    with pytest.raises(hf.HFError) as excinfo:
        hf.read_config(directory)
    assert str(excinfo.value).startswith(f"{directory}/config.json")
    for word in words or ["lacks num_hidden_layers, hidden_size"]:
        assert word in str(excinfo.value)


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    mistral = hf.read_config(write_config(tmp_path, LLAMA_JSON | {"model_type": "mistral", "sliding_window": 16}))
    assert mistral.max_context == 16
    values = hf.fill_model_keys({}, mistral, str(tmp_path), 1024)
    assert values["block_size"] == 16  # capped by default...
    config = configurator.Config(**values | {"block_size": 32})
    with pytest.raises(hf.HFError, match="block_size 32 is longer than its sliding window"):
        hf.check_config(config, mistral, str(tmp_path))  # ...refused when asked for
    no_window = hf.read_config(
        write_config(tmp_path / "b", LLAMA_JSON | {"model_type": "mistral", "sliding_window": None})
    )
    assert no_window.max_context == 128


def test_flags_that_contradict_config_json_are_one_error(tmp_path, capsys):
    directory = export(tmp_path / "llama", MODELS["llama untied"], random_params(MODELS["llama untied"]))
    with pytest.raises(SystemExit) as excinfo:
        train.main([f"--init_from={directory}", "--n_layer=3", "--norm=layernorm", "--block_size=8"])
    message = str(excinfo.value)
    assert (
        message.startswith(
            "config error: n_layer=3 (config.json: 2), norm='layernorm' (config.json: 'rmsnorm') contradict"
        )
        and "drop these keys" in message
    )
    assert "block_size" not in message  # a shorter context is the user's choice
    values = hf.with_model_keys({"init_from": directory, "n_layer": 2})
    assert values["n_kv_head"] == 0 and values["mlp"] == "swiglu" and values["block_size"] == 16


@pytest.mark.parametrize(
    "damage, words",
    [
        ("drop h.1.mlp.c_fc.bias", ["lack 1 tensors", "h.1.mlp.c_fc.bias"]),
        ("add h.0.attn.c_proj.extra", ["tensors this model does not use", "h.0.attn.c_proj.extra"]),
        ("transpose h.0.attn.c_attn.weight", ["c_attn.weight is F32 (96, 32), expected", "(32, 96)"]),
        ("int h.0.ln_1.weight", ["ln_1.weight is I32", "a float (F32/BF16/F16)"]),
        ("truncate", ["is not a readable safetensors file"]),
        ("pytorch only", ["neither model.safetensors", "pytorch_model.bin is a PyTorch pickle"]),
        ("bad json", ["config.json is not valid JSON"]),
    ],
)
def test_damaged_weights_name_the_file_and_tensor(tmp_path, damage, words):
    tensors = random_hf_gpt2()
    action, _, name = damage.partition(" ")
    if action == "drop":
        del tensors[name]
    elif action == "add":
        tensors[name] = np.zeros(3, np.float32)
    elif action == "transpose":
        tensors[name] = tensors[name].T.copy()
    elif action == "int":
        tensors[name] = tensors[name].astype(np.int32)
    directory = write_hf_gpt2(
        tmp_path / "gpt2", tensors, n_head=4, buffers=False, dtype=np.int32 if action == "int" else np.float32
    )
    if action == "int":  # only that one tensor is an integer
        files = load_file(f"{directory}/model.safetensors")
        save_file(
            {k: v if k.endswith(name) else tensors[k.removeprefix("transformer.")] for k, v in files.items()},
            f"{directory}/model.safetensors",
        )
    elif action == "truncate":
        data = Path(directory, "model.safetensors").read_bytes()
        Path(directory, "model.safetensors").write_bytes(data[: len(data) // 2])
    elif action == "pytorch":
        os.rename(f"{directory}/model.safetensors", f"{directory}/pytorch_model.bin")
    elif action == "bad":
        Path(directory, "config.json").write_text('{"n_layer": 2,')
    with pytest.raises(checkpoint.CheckpointError) if action != "bad" else pytest.raises(hf.HFError) as excinfo:
        load(directory)
    for word in words:
        assert word in str(excinfo.value)


def test_architectures_transformers_lacks_are_refused_before_writing(tmp_path):
    mix = dataclasses.replace(GPT2, norm="rmsnorm")
    with pytest.raises(hf.HFError, match="mixes gpt2's pos_embedding='learned' with norm='rmsnorm'"):
        hf.to_hf_tensors(random_params(mix), mix)
    with pytest.raises(hf.HFError, match="already exists and is not an empty directory"):
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "keep.txt").write_text("mine")
        export(tmp_path / "full", GPT2, random_params(GPT2))
    assert os.listdir(tmp_path / "full") == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["full"]


# --- hub names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, typo, choice",
    [
        ("train", "scrach", "scratch"),
        ("train", "resum", "resume"),
        ("sample", "resme", "resume"),
        ("serve", "Resume", "resume"),
        ("eval", "resum", "resume"),
    ],
)
def test_a_near_miss_of_scratch_or_resume_is_answered_before_the_hub_is_asked(command, typo, choice, monkeypatch):
    """--init_from=scrach is a typo, not a hub model: one line naming the choice, and neither the cache
    nor the hub is looked at (snapshot_download would raise here)."""

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")

    monkeypatch.setattr(hf, "snapshot_download", no_hub)
    main = importlib.import_module(command).main
    with pytest.raises(SystemExit) as excinfo:
        main([f"--init_from={typo}"])
    message = str(excinfo.value)
    assert message.startswith("config error: ") and f"did you mean {choice!r}?" in message and "\n" not in message


def test_hub_names_without_a_slash_are_not_taken_for_typos():
    for name in ("gpt2", "gpt2-medium", "gpt2-xl", "distilgpt2", "resnet", "scratch", "resume"):
        configurator.check_init_from(name)  # no error: these go to the cache or the hub as before
    configurator.check_init_from("org/resum")  # a hub name with its organisation is never a typo of ours
    with pytest.raises(configurator.ConfigError, match="did you mean 'resume'"):
        configurator.check_init_from("resumes", choices=("resume",))  # serve.py, sample.py, eval.py: no 'scratch'


def test_hub_names_resolve_from_the_cache_and_a_missing_one_says_what_to_download(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    export(snapshot, GPT2, random_params(GPT2))
    assert hf.resolve("org/tiny", cache_dir=str(tmp_path), download=False) == str(snapshot)
    assert hf.resolve(str(snapshot)) == str(snapshot)  # a directory is itself
    with pytest.raises(hf.HFError) as excinfo:
        hf.resolve("gpt2-xl", cache_dir=str(tmp_path), download=False)
    assert "gpt2-xl is not in the Hugging Face cache" in str(excinfo.value)
    assert "`hf download gpt2-xl`" in str(excinfo.value) and "--init_from=DIRECTORY" in str(excinfo.value)
