"""A model for inference: its setup (config, mesh, shardings; no optimizer), parameters and tokenizer,
from a training checkpoint or a Hugging Face model. sample.py, eval.py, export_hf.py, inference/engine.py
and serve.py load through here, into the model that common/model_setup.py places on the mesh.

    setup, params, step, tok = load_checkpoint("out-shakespeare-char")
    setup, params, tok = load_hf("gpt2", mesh)
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

import configurator
import sharding
from common.model_setup import ModelSetup, model_setup
from configurator import ROLES, Config
from data import dataset
from data.tokenizer import load_tokenizer, model_tokenizer, tokenizer_from_description
from layers import lora
from layers.kv_cache import init_cache
from layers.quantization import Int8Weight
from model import GPTConfig, cast_for_inference
from weights import checkpoint, hf, peft

# What rebuilds a checkpoint's model: its model and compute keys, and where an older checkpoint's
# vocabulary is (newer ones carry it).
MODEL_KEYS = {*ROLES["model"], *ROLES["compute"], "data_dir", "dataset"}


def decode_mesh(data: int = 1, tensor: int = 1):
    """A mesh for generation and serving on the first data x tensor devices: rows (slots) split over
    `data`, heads and the MLP over `tensor`."""
    try:
        jax.devices()
    except RuntimeError as e:  # the platform JAX_PLATFORMS names can't start: JAX's message says which and why
        raise sharding.MeshError(f"the devices could not start: {e}") from None
    if data * tensor > jax.device_count():
        raise sharding.MeshError(
            f"mesh_data x mesh_tensor = {data} x {tensor} devices, but there are {jax.device_count()}: lower them"
        )
    return sharding.make_mesh(data, 1, tensor, devices=jax.devices()[: data * tensor])


def one_device_mesh():
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


# Decoding scans the layers whatever training chose (sample.py and serve.py here, bench.py's decode too): on a
# v5e, GPT-2's decode steps were 12% faster scanned and compiled in 7-26 s a batch, against 24-97 s written out.
SERVING_LAYERS = {"scan_layers": True}


def load_checkpoint(
    out_dir: str,
    mesh=None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    adapters_only: bool = False,
    on_setup=None,
):
    """(setup, parameters, step, tokenizer) of the newest intact checkpoint in out_dir. Its model
    and compute keys and its vocabulary come with it, but for how the matmuls, the attention and the
    layers compute: those are chosen here, for these devices (quantization='auto': as it trained; the
    layers scanned), and the KV cache's dtype. A LoRA run's checkpoint comes with the base its record
    names (refused if that base has changed), its adapters merged into the base's matrices: a plain
    model (adapters_only: its adapters alone, no base read, and the setup of the model with them).
    on_setup(setup, tokenizer) is called as soon as a checkpoint's record says them, before its weights
    are read (serve.py compiles meanwhile): again for an older checkpoint where the newest can't be read
    (only the setup returned is the loaded one's); not for a LoRA run's, whose merged model is another."""
    mesh = mesh or one_device_mesh()
    found = []  # (setup, tokenizer) of each checkpoint tried, newest first: the last one's is restored

    def abstract_for(meta):
        # Only the keys that describe the model: the rest (init_from may name a directory that is
        # gone by now, a learning rate that a later version checks more strictly) doesn't matter here.
        kept = {k: v for k, v in meta["config"].items() if k in MODEL_KEYS}
        matmuls = kept.get("quantization", "none") if quantization == "auto" else quantization
        config = configurator.config_from_dict(
            {
                **kept,
                "attention": "auto",
                "quantization": matmuls,
                **SERVING_LAYERS,
                "batch_size": sharding.batch_shards(mesh),
            }
        )
        setup = model_setup(config, mesh, meta.get("vocab_size") or dataset.read_vocab_size(config), kv_cache_dtype)
        found.append((setup, checkpoint_tokenizer(meta, config, out_dir)))
        merged = meta.get("lora_base") and not adapters_only  # its setup: merged_on_base's, made once read
        if on_setup and not merged:
            on_setup(*found[-1])
        return {"params": lora.split(setup.abstract_params)[0]}  # a LoRA run's: its adapters

    manager = checkpoint.checkpoint_manager(Config(out_dir=out_dir), read_only=True)
    try:
        restored = checkpoint.restore_latest(
            manager, out_dir, abstract_for, move_damaged=False, log=lambda line: print(line, file=sys.stderr)
        )
    finally:
        manager.close()
    (setup, tok), params = found[-1], restored.items["params"]
    if restored.meta.get("lora_base") and not adapters_only:
        setup, params = merged_on_base(setup, params, restored.meta["lora_base"], out_dir)
    return setup, params, restored.step, tok


def checkpoint_tokenizer(meta: dict, config: Config, out_dir: str):
    """The tokenizer a checkpoint's record describes (older checkpoints': their dataset's)."""
    if meta.get("tokenizer"):
        return tokenizer_from_description(meta["tokenizer"], search_dirs=[os.path.join(out_dir, "tokenizer")])
    # checkpoints written before the vocabulary was stored with them
    print(
        f"note: this checkpoint does not carry its vocabulary; using "
        f"{dataset.dataset_dir(config)}/meta.json, which must be the one it was trained on",
        file=sys.stderr,
    )
    return load_tokenizer(dataset.dataset_dir(config))


def merged_on_base(setup: ModelSetup, adapters: dict, record: dict, out_dir: str) -> tuple:
    """(setup, parameters) of a model without adapters: a LoRA checkpoint's adapters merged into the base
    its record names."""
    base = checkpoint.load_base(setup, record["init_from"], lora.base_of(setup.abstract_params))
    checkpoint.check_base(record, base, f"the checkpoint in {os.path.abspath(out_dir)}")
    params = lora.join(adapters, base)
    plain = dataclasses.replace(setup.config, lora_rank=0, weight_dtype="auto")
    plain_setup = model_setup(plain, setup.mesh, setup.model_config.vocab_size, setup.model_config.kv_cache_dtype)
    merged = jax.jit(lambda p: lora.merge(p, setup.model_config), out_shardings=plain_setup.param_shardings)(params)
    return plain_setup, merged


def load_hf(name: str, mesh=None, quantization: str = "none", dtype: str = "float32", kv_cache_dtype: str = "auto"):
    """(setup, parameters, tokenizer) of a Hugging Face model: a directory, or a hub name
    (downloaded into the Hugging Face cache if it is not there yet); or of a PEFT LoRA adapter directory,
    merged into the base model its adapter_config.json names."""
    if peft.is_adapter_dir(name):
        return load_adapter(name, mesh, quantization, dtype, kv_cache_dtype)
    mesh, quantization = mesh or one_device_mesh(), "none" if quantization == "auto" else quantization
    directory = hf.resolve(name)
    model = hf.read_config(directory)
    values = hf.fill_model_keys({"init_from": name}, model, directory, default_block_size=model.max_context)
    config = Config(**values, batch_size=sharding.batch_shards(mesh), quantization=quantization, dtype=dtype)
    setup = model_setup(config, mesh, model.keys["vocab_size"], kv_cache_dtype)
    tok = model_tokenizer(directory, model.model_type, model.keys["vocab_size"])
    if tok is None:
        raise hf.HFError(
            f"{directory} has no tokenizer.json: nanomax needs the model's tokenizer to turn "
            f"prompts into ids. Copy the tokenizer's files (tokenizer.json, tokenizer_config.json) "
            f"into it, or sample the nanomax run it was exported from with --out_dir=RUN "
            f"(--init_from=resume)"
        )
    if tok.vocab_size > model.keys["vocab_size"]:
        raise hf.HFError(
            f"{directory}: the tokenizer has {tok.vocab_size} tokens but the model only "
            f"{model.keys['vocab_size']} (vocab_size in config.json): they are not a pair. Put "
            f"the model's own tokenizer files in {directory}, or sample the nanomax run it was "
            f"exported from with --out_dir=RUN"
        )
    return setup, checkpoint.load_pretrained(setup, directory), tok


def load_adapter(directory: str, mesh=None, quantization="none", dtype="float32", kv_cache_dtype="auto"):
    """(setup, parameters, tokenizer) of a PEFT adapter directory's adapters merged into its base."""
    base = peft.read_config(directory)["base_model_name_or_path"]
    setup, params, tok = load_hf(base, mesh, quantization, dtype, kv_cache_dtype)
    with_adapters = dataclasses.replace(setup.model_config, **peft.lora_keys(directory))
    adapters = peft.from_peft(directory, with_adapters)
    merge = jax.jit(lambda p, a: lora.merge(lora.join(a, p), with_adapters), out_shardings=setup.param_shardings)
    return setup, merge(params, adapters), tok


def default_dtype(dtype: str) -> str:
    """A Hugging Face model's compute dtype for 'auto': bfloat16 on GPUs and TPUs, float32 on CPUs."""
    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


WEIGHT_DTYPES = ("auto", "int8")  # 'auto': the compute dtype
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")  # 'auto': the compute dtype

# The blocks' dense kernels and how many of their axes (after the stacked layers' leading one) a
# matmul sums over: the rest are output channels, each with its own int8 scale.
INT8_KERNELS = {"qkv_kernel": 1, "out_kernel": 2, "fc_kernel": 1, "gate_kernel": 1, "proj_kernel": 1}
# The vocabulary's matrices and the axis (the width) each sums over: a scale per vocabulary entry, wte's
# per row serving both its lookup and, transposed, the tied output layer's logits.
INT8_VOCAB_MATRICES = {"wte": 1, "lm_head_kernel": 0}


def int8_weights(params, vocab_matrices: bool = False) -> dict:
    """Parameters for serving with the blocks' dense kernels stored as int8 (quantization.Int8Weight,
    one scale per output channel), and with vocab_matrices the token table wte and an untied
    lm_head_kernel too (a scale per vocabulary entry: GPT-2's bfloat16 table was 74 of the 162 MiB an
    int8 decode step took in). A LoRA run's frozen base (train.frozen) keeps its table: its loss takes
    the output layer's matrix as an array. wpe, norms, biases and a mixture of experts' experts (their
    kernels have an expert axis) stay as they are. On the parameters' devices, sharded alike."""

    def convert(path, p):
        module, name = (path[-2].key if len(path) > 1 else None), path[-1].key
        if vocab_matrices and module is None and name in INT8_VOCAB_MATRICES:
            return Int8Weight.of(p, (INT8_VOCAB_MATRICES[name],))
        dense = module == "attn" or (module == "mlp" and p.ndim == 3)  # (L, in, out): not experts' (L, E, ...)
        if name not in INT8_KERNELS or not dense:
            return p
        return Int8Weight.of(p, tuple(range(1, 1 + INT8_KERNELS[name])))

    return jax.jit(lambda params: jax.tree_util.tree_map_with_path(convert, params))(params)


def weight_bytes(params) -> int:
    """Bytes the parameters take in memory (an int8 weight's scales included), all devices' shards
    counted once."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))  # arrays or ShapeDtypeStructs


def serving_weights(setup: ModelSetup, params, weight_dtype: str = "auto"):
    """Parameters as decoding reads them, converted once: the matrices in the compute dtype, and with
    weight_dtype='int8' the blocks' dense kernels and the vocabulary's matrices as int8 (int8_weights)."""
    params = cast_for_inference(params, jnp.dtype(setup.model_config.dtype))
    return int8_weights(params, vocab_matrices=True) if weight_dtype == "int8" else params


def serving_shapes(setup: ModelSetup, weight_dtype: str = "auto"):
    """The shapes and shardings serving_weights gives a checkpoint's parameters, from the setup alone
    (before they are read): the restored arrays' shardings, the compute dtype's matrices. None for
    weight_dtype='int8', whose scales' shardings only the conversion itself decides."""
    if weight_dtype == "int8":
        return None
    restored = setup.abstract_params
    dtypes = jax.eval_shape(lambda p: serving_weights(setup, p), restored)  # (eval_shape drops the shardings)
    return jax.tree.map(lambda a, d: jax.ShapeDtypeStruct(a.shape, d.dtype, sharding=a.sharding), restored, dtypes)


def kv_bytes_per_token(config: GPTConfig) -> int:
    """Bytes of KV cache one token takes, in the cache's own layout (an int8 cache's scales included)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.eval_shape(lambda: init_cache(config, 1, 1))))


def memory_summary(setup: ModelSetup, params) -> str:
    """The start-up line of sample.py and serve.py: what the weights and each token's KV cache take."""
    c = setup.model_config
    kv_dtype = c.dtype if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
    int8 = any(isinstance(p, Int8Weight) for p in jax.tree.leaves(params, is_leaf=lambda p: isinstance(p, Int8Weight)))
    int8_table = isinstance(params.get("wte"), Int8Weight)
    n = weight_bytes(params)
    amount = f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"
    int8_parts = "int8 blocks and vocabulary, " if int8_table else "int8 blocks, " if int8 else ""
    return f"weights {amount} ({int8_parts}{c.dtype}), KV cache {kv_bytes_per_token(c):,} bytes per token ({kv_dtype})"
