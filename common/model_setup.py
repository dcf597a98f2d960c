"""The model a run's config describes, placed on a mesh without allocating it: model.py's GPTConfig
from the config (which attention runs on these devices, the vocabulary, the pipeline stages), the
parameters' shapes and shardings, and the graph that merges with them. train.py builds its train
state on this, inference/loader.py loads weights into it, compile_aot.py and bench.py compile with it.
"""

import dataclasses

import jax
from flax import nnx

import configurator
import sharding
from configurator import Config
from layers import attention
from model import GPT, GPTConfig

# What attention='auto' runs, per platform: the written-out attention on CPUs (the faster step there,
# bench/NOTES.md), cuDNN's fused kernel on NVIDIA GPUs in bfloat16 (XLA's in float32), the Pallas
# splash kernel on TPUs (../shared/TPU.md: 35% MFU where XLA's attention gave 20%).
AUTO_ATTENTION = {
    "cpu": {"float32": "einsum", "bfloat16": "einsum"},
    "gpu": {"float32": "xla", "bfloat16": "cudnn"},
    "tpu": {"float32": "splash", "bfloat16": "splash"},
}
# The kernels that run on one platform only.
ATTENTION_PLATFORM = {"cudnn": ("gpu", "NVIDIA GPUs"), "splash": ("tpu", "TPUs")}


def attention_implementation(config: Config, platform: str) -> str:
    """config.attention for devices of `platform`: 'auto' looked up in AUTO_ATTENTION (XLA's on a
    platform it does not name); a kernel asked for on a platform it cannot run on is an error."""
    needs = ATTENTION_PLATFORM.get(config.attention)
    if needs and needs[0] != platform:
        raise configurator.ConfigError(
            f"attention={config.attention!r} needs {needs[1]}, but this run's devices are "
            f"{platform}; use attention='auto' or 'xla'"
        )
    if config.attention == "auto":
        choice = AUTO_ATTENTION.get(platform, {}).get(config.dtype, "xla")
        return "einsum" if choice == "splash" and attention.splash is None else choice  # a JAX without the kernel
    return config.attention


def model_config(
    config: Config, vocab_size: int, platform: str, stages: int = 1, kv_cache_dtype: str = "auto"
) -> GPTConfig:
    """The model's half of the config, for devices of `platform` ('cpu', 'gpu', 'tpu') and a
    mesh with `stages` pipeline stages; decoding's cache in kv_cache_dtype (not a training key)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)} - {
        "vocab_size",
        "attention",
        "pipeline_stages",
        "kv_cache_dtype",
    }
    return GPTConfig(
        vocab_size=vocab_size,
        attention=attention_implementation(config, platform),
        pipeline_stages=stages,
        kv_cache_dtype=kv_cache_dtype,
        **{k: getattr(config, k) for k in fields},
    )


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """The model on a mesh, without arrays: what generation and evaluation need."""

    config: Config
    model_config: GPTConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    param_shardings: dict  # NamedSharding per parameter
    abstract_params: dict  # ShapeDtypeStruct per parameter, with its sharding

    @property
    def batch_sharding(self):  # (B, T)
        return sharding.batch_sharding(self.mesh)


def model_setup(config: Config, mesh, vocab_size: int, kv_cache_dtype: str = "auto") -> ModelSetup:
    """Shapes and shardings of the model's parameters on `mesh`, derived without allocating them."""
    gpt_config = model_config(config, vocab_size, mesh.devices.flat[0].platform, mesh.shape["stage"], kv_cache_dtype)
    sharding.check_model_fits_mesh(
        mesh,
        n_head=config.n_head,
        n_embd=config.n_embd,
        batch_size=config.batch_size,
        n_kv_head=gpt_config.kv_heads,
        mlp_hidden=gpt_config.mlp_hidden_size,
        n_experts=gpt_config.n_experts,
        n_layer=config.n_layer,
        microbatches=config.pipeline_microbatches,
        layers_per_stage=config.layers_per_stage,
    )
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: GPT(gpt_config, jax.random.key(0))))
    param_shardings = nnx.to_pure_dict(sharding.param_shardings(abstract_params, mesh))
    abstract_params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract_params),
        param_shardings,
    )
    return ModelSetup(config, gpt_config, mesh, graphdef, param_shardings, abstract_params)
