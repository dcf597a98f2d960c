"""Train a GPT on a device mesh.

    python train.py config/shakespeare_char.py            # the CPU-sized default
    python train.py config/gpt2_124m.py --batch_size=16   # GPT-2 small, as in the paper
    python train.py config/shakespeare_char.py --overfit_batch=True   # sanity check

The core is two pure functions, `train_step(state, batch)` and `eval_step(params, batch)`,
built by `make_train_step` / `make_eval_step` and jitted once with explicit shardings.
compile_aot.py and bench.py build and run exactly these functions.
"""

import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core import spmd

import configurator
import sharding
from common import compile_cache, progress
from common.model_setup import model_setup
from configurator import Config
from data import dataset
from data.tokenizer import model_tokenizer, same_vocabulary, tokenizer_from_description, vocabulary_identity
from devices import hardware, memory
from evals import scoring
from inference import generate
from inference.loader import int8_weights
from layers import attention, embedding, lora
from layers.quantization import Int8Weight
from model import GPT, GPTConfig, cast_for_inference, flops_per_token
from training import compiled_step, monitor
from training.optimizer import groups_summary, learning_rate, make_optimizer, state_shardings
from weights import checkpoint, hf, peft
from weights.checkpoint import CheckpointError


class TrainingError(RuntimeError):
    """Training can't go on (e.g. the loss became NaN); the message says what was kept."""


# ----------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything that describes the computation but holds no arrays."""

    config: Config
    model_config: GPTConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    state_shardings: dict  # {'params', 'opt_state', 'step'} -> NamedSharding trees: where the state
    #                        lives between steps (host memory for what `offload` names)
    abstract_state: dict  # the same tree of ShapeDtypeStructs (with shardings)
    compute_shardings: dict  # the same, all in device memory: where the step computes with it
    document_start: int | None = None  # the id each document starts with, where document_masking splits rows
    base_params: dict | None = None  # a LoRA run: the frozen base's parameters as loaded (float32 structs)

    @property
    def abstract_params(self):  # as common.model_setup.ModelSetup has them (checkpoint.load_pretrained)
        return self.abstract_state["params"]

    @property
    def param_shardings(self):  # in device memory, where evaluations compute (evals.make_scorer)
        return self.compute_shardings["params"]

    @property
    def batch_sharding(self):  # (B, T)
        return sharding.batch_sharding(self.mesh)

    @property
    def micro_batch_sharding(self):  # (micro-steps, B, T): micro-steps are not split
        spec = jax.sharding.PartitionSpec(None, *self.batch_sharding.spec)
        return jax.sharding.NamedSharding(self.mesh, spec)


def make_setup(config: Config, mesh, vocab_size: int, document_start: int | None = None) -> Setup:
    """Shapes and shardings of the train state, derived without allocating it: the model's
    (common/model_setup.py), and the optimizer state's on top. document_start: the id each document of
    the dataset starts with (dataset.document_start), which document_masking needs."""
    if config.document_masking and document_start is None:
        raise configurator.ConfigError(
            "document_masking=True starts a document at each begin-of-text or end-of-text token, and the "
            "dataset has neither (a char-level tokenizer, or no meta.json to name one): prepare the data with "
            "a tokenizer that has them (GPT-2's, a Hugging Face one), or set document_masking=False"
        )
    model = model_setup(config, mesh, vocab_size)
    if config.lora_rank and not lora.has_adapters(model.abstract_params):  # else every weight would train
        raise configurator.ConfigError(
            f"lora_targets={config.lora_targets!r} names no matrix this model has (GPT-2's MLP has no gate; "
            f"a mixture of experts' experts take no adapters): choose among q, k, v, o, up, down"
        )
    param_shardings, abstract_params = frozen_shardings(config, model.param_shardings, model.abstract_params)
    optimizer = make_optimizer(config)
    trainable, _ = lora.split(abstract_params)  # LoRA: only the adapters have optimizer state
    abstract_opt_state = jax.eval_shape(optimizer.init, trainable)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_shardings = state_shardings(optimizer, abstract_opt_state, lora.split(param_shardings)[0], replicated)
    compute = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    shardings = {
        name: jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree)
        if name in offloaded_parts(config, mesh)
        else tree
        for name, tree in compute.items()
    }
    abstract = {"params": abstract_params, "opt_state": abstract_opt_state, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    base = lora.base_of(model.abstract_params) if config.lora_rank else None
    return Setup(
        config, model.model_config, mesh, model.graphdef, optimizer, shardings, abstract, compute, document_start, base
    )


def frozen(config: Config, params):
    """The parameters as a run keeps them: a LoRA run's base frozen as the forward pass reads it, in the
    compute dtype (model.cast_for_inference: the forward computes exactly what it computes on float32
    weights; bfloat16 halves them), its blocks' matrices int8 with weight_dtype='int8' (QLoRA-style);
    the adapters float32. Other runs' as they are."""
    if not config.lora_rank:
        return params
    adapters, base = lora.split(params)
    base = cast_for_inference(base, jnp.dtype(config.dtype))
    return lora.join(adapters, int8_weights(base) if config.weight_dtype == "int8" else base)


def frozen_shardings(config: Config, param_shardings, abstract_params) -> tuple:
    """(shardings, abstract parameters) as `frozen` keeps them. An int8 matrix's values are sharded like
    the matrix; its scales (size 1 on the input axes) only along the output axes."""
    if not config.lora_rank:
        return param_shardings, abstract_params
    shapes = jax.eval_shape(lambda p: frozen(config, p), abstract_params)

    def sharding_of(named, shape):
        if not isinstance(shape, Int8Weight):
            return named
        spec = (*named.spec, *(None,) * (len(shape.q.shape) - len(named.spec)))
        scale_spec = jax.sharding.PartitionSpec(*(a if n > 1 else None for a, n in zip(spec, shape.scale.shape)))
        return Int8Weight(named, jax.sharding.NamedSharding(named.mesh, scale_spec))

    shardings = jax.tree.map(sharding_of, param_shardings, shapes)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    return shardings, abstract


def offloaded_parts(config: Config, mesh) -> tuple:
    """The parts of the train state kept in host memory between steps (offload), where the
    devices can address it; the step brings them to the device and back (a PCIe / host-link
    transfer each way per step, in exchange for their device memory)."""
    parts = {"none": (), "optimizer": ("opt_state",), "params_and_optimizer": ("params", "opt_state")}[config.offload]
    device = mesh.devices.flat[0]
    if parts and "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        raise configurator.ConfigError(
            f"offload={config.offload!r} keeps state in the host's pinned memory, "
            f"which {device.platform} devices here can't address; use offload='none'"
        )
    return parts


def on_device(tree, shardings):
    """`tree` in device memory (a no-op for what is there already); inside a jitted step too."""
    return jax.device_put(tree, shardings)


def init_state(setup: Setup, params=None, adapters=None) -> dict:
    """A fresh train state, created directly in its sharded layout (never whole on one device):
    for `params` (pretrained weights, already sharded) or from a random initialization. A LoRA run's
    adapters start fresh, or as `adapters` (a PEFT adapter's, NumPy arrays) give them."""

    def init(pretrained, adapters):
        params = nnx.to_pure_dict(nnx.state(GPT(setup.model_config, jax.random.key(setup.config.seed))))
        if pretrained is not None:  # with LoRA, adapters on it
            adapters = lora.split(params)[0] if adapters is None else adapters
            params = lora.join(adapters, pretrained) if setup.config.lora_rank else pretrained
        params = frozen(setup.config, params)
        opt_state = setup.optimizer.init(lora.split(params)[0])
        return {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}

    with sharding.activate(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)(params, adapters)


def document_segments(setup: Setup, x_BxT):
    """document_masking: segment ids (B, T) for the model, a new one at each document's first token;
    None without it."""
    if not setup.config.document_masking:
        return None
    return jnp.cumsum(x_BxT == setup.document_start, axis=1, dtype=jnp.int32)


def segment_ids(setup: Setup, x_BxT, packed_BxT=None):
    """The model's segment ids: a packed fine-tuning batch's own, else document_masking's (or None)."""
    return packed_BxT if packed_BxT is not None else document_segments(setup, x_BxT)


def balanced_rows(setup: Setup, x_BxT, y_BxT, segment_ids_BxT):
    """(x, y, segment ids, order) for the model: with context > 1 and T a multiple of 2 x context, the
    rows' tokens permuted into attention.balanced_order (so the `context` split gives every device
    the same causal attention work), and the order for the model's positions and mask; else as
    they are, with order None. Permuting int tokens inside the step moves (B, T) int32s between the
    context devices, nothing beside the activations; the loss, a sum over tokens, is unchanged."""
    context, T = setup.mesh.shape["context"], x_BxT.shape[1]
    if context == 1 or T % (2 * context):
        return x_BxT, y_BxT, segment_ids_BxT, None
    order_T = attention.balanced_order(T, context)
    x_BxT, y_BxT, segment_ids_BxT = (None if a is None else a[:, order_T] for a in (x_BxT, y_BxT, segment_ids_BxT))
    return x_BxT, y_BxT, segment_ids_BxT, order_T


def summed_loss(setup: Setup, params, x_BxT, y_BxT, dropout_key=None, packed_BxT=None):
    """(cross-entropy summed over the batch's targets, how many there are, router stats), the model's
    logits taken whole, or loss_chunks slices of tokens at a time (layers/embedding.output_layer_loss)."""
    x_BxT, y_BxT, ids_BxT, order_T = balanced_rows(setup, x_BxT, y_BxT, segment_ids(setup, x_BxT, packed_BxT))
    gpt = nnx.merge(setup.graphdef, params)
    x_BTxD, stats, w_DxV = gpt.features(x_BxT, dropout_key, ids_BxT, order_T)
    chunks, mc = setup.config.loss_chunks, setup.model_config
    if chunks == 1:
        y_N, cap = y_BxT.reshape(-1), mc.logit_softcap
        shift_N = embedding.lse_shift(x_BTxD, w_DxV, y_N, cap)
        total, count, _ = embedding.summed_cross_entropy(gpt.head(x_BTxD, w_DxV), y_N, cap, shift_N)
    else:
        w_DxV, y_N = w_DxV.astype(x_BTxD.dtype), y_BxT.reshape(-1)
        total, count = embedding.output_layer_loss(x_BTxD, w_DxV, y_N, chunks, mc.logit_softcap, mc.vocab_size)
    return total, count, stats


def cross_entropy(setup: Setup, params, x_BxT, y_BxT, packed_BxT=None):
    """The mean over the batch's targets (0 where it has none)."""
    total, count, _ = summed_loss(setup, params, x_BxT, y_BxT, None, packed_BxT)
    return total / jnp.maximum(count, 1)


def training_loss(setup: Setup, params, x_BxT, y_BxT, dropout_key=None, packed_BxT=None, n_targets=None, n_micro=1):
    """(loss to differentiate, (cross-entropy, router stats)) of one micro-batch, as its share of the
    step's: the cross-entropy summed over its targets and divided by n_targets, the step's number
    of targets (default: its own), so that the micro-batches' losses and gradients add up to those
    of the whole step's mean; a micro-batch without targets adds 0. A mixture of experts adds its
    router's load-balancing and z-losses, each averaged over the sparse layers, weighted, and
    divided by n_micro."""
    c = setup.config
    total, count, stats = summed_loss(setup, params, x_BxT, y_BxT, dropout_key, packed_BxT)
    loss = total / (jnp.maximum(count, 1) if n_targets is None else n_targets)
    if not stats:
        return loss, (loss, {})
    stats = jax.tree.map(lambda per_layer: per_layer.mean(0), stats)
    aux = c.router_aux_loss_coef * stats["balance_loss"] + c.router_z_loss_coef * stats["z_loss"]
    return loss + aux / n_micro, (loss, stats)


def shards_kept_apart(setup: Setup) -> tuple[str, ...]:
    """The mesh axes over which the micro-step loop carries per-device partial gradient sums. A
    gradient constrained to the parameters' (replicated over `data`) sharding inside the loop is
    all-reduced every micro-step; kept apart per data shard it is summed on the device and reduced
    once, after the loop, at no cost in memory (each device held the whole replicated sum anyway).
    `fsdp` joins only with fsdp_reduce_once: its gradients are otherwise reduce-scattered each
    micro-step, as the sharded sum is all the memory ZeRO-3 keeps. Mixtures of experts (whose router
    losses are over the whole micro-batch), pipelines and ring attention (JAX cannot vmap its
    shard_map over an axis that the shard_map leaves to the compiler) keep one sum."""
    ring = setup.config.context_attention == "ring" and setup.mesh.shape["context"] > 1
    if setup.config.n_experts or setup.mesh.shape["stage"] > 1 or ring:
        return ()
    axes = ("data", "fsdp") if setup.config.fsdp_reduce_once else ("data",)
    return tuple(axis for axis in axes if setup.mesh.shape[axis] > 1)


def per_shard(micro_step_grads, axes: tuple[str, ...], shards: int):
    """micro_step_grads run on each shard's rows on its own (vmap over `axes`): gradients (shards, ...),
    each a device's partial sum, that no collective reduces. Inside, the model's own constraints split
    the rows over the other batch axes only (with `fsdp` among `axes`, each device computes with the
    whole parameters, gathered once for the loop); each shard draws its own dropout."""
    rules = spmd.get_logical_axis_rules()
    for axis in axes:
        rules = sharding.rules_without(axis, rules)

    def split(a_BxT):
        return None if a_BxT is None else a_BxT.reshape(shards, a_BxT.shape[0] // shards, *a_BxT.shape[1:])

    def run(x_BxT, y_BxT, packed_BxT, key):
        keys = None if key is None else jax.random.split(key, shards)
        with nnx.logical_axis_rules(rules):
            grads_S, (loss_S, router) = jax.vmap(micro_step_grads, spmd_axis_name=axes)(
                split(x_BxT), split(y_BxT), split(packed_BxT), keys
            )
        return grads_S, (loss_S.sum(), router)

    return run


def batch_arrays(config: Config) -> int:
    """How many (micro-steps, B, T) arrays a step's batch has: inputs and targets (< 0: none), and
    with packing the segment ids."""
    return 3 if config.packing else 2


def make_train_step(setup: Setup):
    """train_step(state, (x, y[, segment ids])) -> (state, metrics), each of shape (micro-steps, B, T)."""
    config = setup.config

    def train_step(state, batch):
        x_AxBxT, y_AxBxT, packed_AxBxT = (*batch, None)[:3]
        params = on_device(state["params"], setup.compute_shardings["params"])  # offload: from the host
        # LoRA: gradients, optimizer and updates for the adapters only; the base rides along, frozen
        trainable, frozen_base = lora.split(params)
        base = frozen_base  # as the loss reads it
        step_key = jax.random.fold_in(jax.random.key(config.seed), state["step"])
        grad_fn = jax.value_and_grad(lambda p, *args: training_loss(setup, lora.join(p, base), *args), has_aux=True)
        n_micro = x_AxBxT.shape[0]
        # The loss is the mean over the step's targets, however they fall into micro-batches.
        n_targets = jnp.maximum((y_AxBxT >= 0).sum(), 1)

        kept_apart = shards_kept_apart(setup)
        trainable_shardings, base_shardings = lora.split(setup.compute_shardings["params"])
        grad_shardings = jax.tree.map(lambda s: sharding.without_axes(s, kept_apart), trainable_shardings)

        # With fsdp kept apart the loop computes with whole parameters, gathered here once for every micro-step.
        loop_params = trainable
        if "fsdp" in kept_apart:
            loop_params = jax.lax.with_sharding_constraint(trainable, grad_shardings)
            whole = jax.tree.map(lambda s: sharding.without_axes(s, kept_apart), base_shardings)
            base = jax.lax.with_sharding_constraint(frozen_base, whole)

        def micro_step_grads(x_BxT, y_BxT, packed_BxT, key):
            (_, (loss, router)), grads = grad_fn(loop_params, x_BxT, y_BxT, key, packed_BxT, n_targets, n_micro)
            return jax.lax.with_sharding_constraint(grads, grad_shardings), (loss, router)

        shards = math.prod(setup.mesh.shape[axis] for axis in kept_apart)
        if kept_apart:
            micro_step_grads = per_shard(micro_step_grads, kept_apart, shards)

        def micro_step(grad_sum, inputs):
            x_BxT, y_BxT, packed_BxT, i = inputs
            key = jax.random.fold_in(step_key, i) if config.dropout > 0 or config.lora_dropout > 0 else None
            grads, (loss, router) = micro_step_grads(x_BxT, y_BxT, packed_BxT, key)
            return jax.tree.map(jnp.add, grad_sum, grads), (loss, router)

        # Gradient accumulation as a scan: one compiled loop, not one dispatch per micro-step.
        zeros = jax.tree.map(lambda p: jnp.zeros((shards, *p.shape) if kept_apart else p.shape, p.dtype), loop_params)
        grads, (losses, router) = jax.lax.scan(micro_step, zeros, (x_AxBxT, y_AxBxT, packed_AxBxT, jnp.arange(n_micro)))
        if kept_apart:  # the shards' partial sums, reduced once for the step
            grads = jax.lax.with_sharding_constraint(jax.tree.map(lambda g: g.sum(0), grads), trainable_shardings)
        loss, grad_norm = losses.sum(), optax.tree.norm(grads)
        # Offloaded optimizer state comes to the device only now, after the backward passes.
        old_opt_state = on_device(state["opt_state"], setup.compute_shardings["opt_state"])
        updates, opt_state = setup.optimizer.update(grads, old_opt_state, trainable)
        # A non-finite step leaves parameters and optimizer state as they were, so a NaN
        # can never reach a checkpoint; nan_policy decides whether training goes on.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {
            "params": lora.join(keep_if_bad(optax.apply_updates(trainable, updates), trainable), frozen_base),
            "opt_state": schedules_from(opt_state, keep_if_bad(opt_state, old_opt_state)),
            "step": state["step"] + 1,
        }
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "lr": learning_rate(config, state["step"])}
        if router:  # a mixture of experts: its router's losses, dropped share and load
            metrics["router"] = jax.tree.map(lambda per_micro_step: per_micro_step.mean(0), router)
        return new_state, metrics

    return train_step


def schedules_from(new_opt_state, opt_state):
    """opt_state with the learning-rate schedules' counts of new_opt_state. A skipped step keeps the
    moments and Adam's bias correction as they were (no update was applied), but the schedule
    goes on with the step, so the learning rate of step s is always lr(s), the one logged."""
    is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)
    return jax.tree.map(
        lambda kept, new: new if is_schedule(kept) else kept, opt_state, new_opt_state, is_leaf=is_schedule
    )


def make_eval_step(setup: Setup):
    return lambda params, batch: cross_entropy(setup, on_device(params, setup.compute_shardings["params"]), *batch)


def jit_train_step(setup: Setup):
    micro_batches = (setup.micro_batch_sharding,) * batch_arrays(setup.config)
    return jax.jit(
        make_train_step(setup),
        donate_argnums=0,
        in_shardings=(setup.state_shardings, micro_batches),
        out_shardings=(setup.state_shardings, setup.state_shardings["step"]),
    )


def jit_eval_step(setup: Setup):
    return jax.jit(
        make_eval_step(setup),
        in_shardings=(setup.state_shardings["params"], (setup.batch_sharding,) * batch_arrays(setup.config)),
        out_shardings=setup.state_shardings["step"],
    )  # replicated: every host can read it


def batch_struct(setup: Setup) -> tuple:
    """The (x, y[, segment ids]) micro-batches that train.py feeds the step, as abstract arrays."""
    c = setup.config
    shape = (c.gradient_accumulation_steps, c.batch_size, c.block_size)
    x = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.micro_batch_sharding)
    return (x,) * batch_arrays(c)


def lower(setup: Setup):
    """The jitted train step lowered for this run's shapes and shardings (compile_aot.py compiles it)."""
    with sharding.activate(setup.mesh):  # the model's activation constraints need the rules
        return jit_train_step(setup).lower(setup.abstract_state, batch_struct(setup))


# ----------------------------------------------------------------------------- checkpoints


def start_state(setup: Setup, tok, log) -> tuple:
    """(checkpoint manager, train state, the checkpoint's meta or None, a LoRA run's record of its base
    or None): resumed from out_dir, or fresh (from scratch or from pretrained weights) in an out_dir that
    holds no other run. The out_dir lock is held."""
    config = setup.config
    if config.init_from != "resume":
        checkpoint.start_fresh(config, log)
        manager = checkpoint.checkpoint_manager(config)
        if config.init_from == "scratch":
            return manager, init_state(setup), None, None
        # a Hugging Face model or another run's checkpoint: fine-tune it, whole or (LoRA) its adapters,
        # fresh ones or a PEFT adapter directory's
        source = pretrained_model(config.init_from)
        abstract = setup.base_params if config.lora_rank else setup.abstract_params
        pretrained = checkpoint.load_base(setup, source, abstract, log)
        record = checkpoint.base_record(source, pretrained) if config.lora_rank else None
        adapters = peft.from_peft(config.init_from, setup.model_config) if source != config.init_from else None
        return manager, init_state(setup, pretrained, adapters), None, record

    def abstract_for(meta):  # checked from the checkpoint's meta, before its arrays are read
        checkpoint.check_model(checkpoint.saved_config(meta), config)
        check_checkpoint_tokenizer(meta, config, tok)
        check_optimizer_state(setup, meta["config"])
        # a LoRA run's checkpoint holds the adapters: its base is read from where its record says
        return {"params": lora.split(setup.abstract_state["params"])[0], "opt_state": setup.abstract_state["opt_state"]}

    manager = checkpoint.checkpoint_manager(config)
    try:
        restored = checkpoint.restore_latest(manager, config.out_dir, abstract_for, log=log)
        checkpoint.check_steps_left(restored.step, config)
    except BaseException:
        manager.close()
        raise
    record = restored.meta.get("lora_base")
    params = restored.items["params"]
    if record:
        try:
            base = checkpoint.load_base(setup, record["init_from"], setup.base_params, log)
            checkpoint.check_base(record, base, f"the checkpoint in {os.path.abspath(config.out_dir)}")
        except BaseException:
            manager.close()
            raise
        to_state = jax.jit(lambda p: frozen(config, p), out_shardings=setup.state_shardings["params"])
        params = to_state(lora.join(params, base))
    changes = configurator.changes_since(config, restored.meta["config"])
    if changes:
        log(f"resuming step {restored.step} with changes from the checkpoint's run: {', '.join(changes)}")
    step = checkpoint.step_array(restored.step, setup.state_shardings["step"])
    return manager, {**restored.items, "params": params, "step": step}, restored.meta, record


def check_checkpoint_tokenizer(meta: dict, config: Config, tok, out_dir: str = "") -> None:
    """The dataset's tokenizer is the vocabulary the checkpoint (in out_dir: by default the run's) was
    trained on."""
    saved = meta.get("tokenizer")  # absent in checkpoints older than the check
    if saved and tok and vocabulary_identity(saved) != vocabulary_identity(tok.describe()):
        raise CheckpointError(
            f"the checkpoint in {os.path.abspath(out_dir or config.out_dir)} was trained on a vocabulary of "
            f"{tokenizer_from_description(saved).summary()}, but "
            f"{dataset.dataset_dir(config)}/meta.json describes {tok.summary()}: resume with the dataset "
            f"it was trained on, or train this one from the start in another --out_dir"
        )


def check_optimizer_state(setup: Setup, saved: dict) -> None:
    """The checkpoint's optimizer state has the tree this run's optimizer makes. Another optimizer,
    or grad_clip switched between 0 and > 0, makes another tree, which Orbax could only call damage:
    name the keys whose checkpoint value would make the saved tree."""
    config = setup.config
    saved = {k: saved.get(k, getattr(Config, k)) for k in configurator.ROLES["optimizer"]}  # older: defaults

    def tree_with(keys):  # the optimizer state's tree had the run these keys of the checkpoint
        try:
            changed_config = dataclasses.replace(config, **{k: saved[k] for k in keys})
        except configurator.ConfigError:  # not a config on its own: can't tell
            return ours
        return jax.tree.structure(
            jax.eval_shape(make_optimizer(changed_config).init, lora.split(setup.abstract_state["params"])[0])
        )

    ours = jax.tree.structure(setup.abstract_state["opt_state"])
    changed = [k for k in configurator.ROLES["optimizer"] if saved[k] != getattr(config, k)]
    if not changed or tree_with(changed) == ours:
        return
    culprits = [k for k in changed if tree_with([k]) != ours] or changed
    raise CheckpointError(
        f"the checkpoint in {os.path.abspath(config.out_dir)} holds the state of another optimizer than this "
        f"run's ("
        + "; ".join(f"{k}: checkpoint {saved[k]!r}, config {getattr(config, k)!r}" for k in culprits)
        + "): resume with the checkpoint's values, or start the new optimizer in another --out_dir (the "
        "weights carry over through export_hf.py and --init_from=EXPORTED_DIR where export_hf.py can export "
        "the model)"
    )


# ----------------------------------------------------------------------------- the loop


def estimate_losses(eval_step, params, splits: dict, setup: Setup, rows) -> dict:
    """Mean loss over eval_iters fixed batches of each split (the same batches every eval)."""
    config = setup.config
    losses = {}
    for split, tokens in splits.items():
        total, start = 0.0, time.perf_counter()
        for i in range(config.eval_iters):
            arrays = dataset.step_batch(tokens, config, i, split, rows, n_micro=1, stream=1)
            batch = tuple(
                sharding.global_batch(a[0], setup.batch_sharding, (config.batch_size, config.block_size))
                for a in arrays
            )
            total += eval_step(params, batch)
            if (i + 1) % 10 == 0 or i + 1 == config.eval_iters:
                total = float(total)  # wait here now and then, so the progress line is honest
                progress.show_progress(f"eval {split}", i + 1, config.eval_iters, start)
        losses[split] = float(total) / config.eval_iters
    return losses


def train(config: Config, devices=None) -> list[tuple[int, float]]:
    """Run training as configured (on `devices`, default all); returns (step, loss) per logged step."""
    # Everything that can be wrong with the input is checked before anything is written.
    tok = dataset.dataset_tokenizer(config)
    vocab_size = config.vocab_size or tok.vocab_size
    check_pretrained_tokenizer(config, tok)
    if tok is not None and tok.vocab_size > vocab_size:  # e.g. a dataset made with another tokenizer
        raise dataset.DataError(
            f"{dataset.dataset_dir(config)}: its tokenizer ({tok.summary()}) has more "
            f"tokens than the model's vocab_size {vocab_size}: prepare the data with "
            f"the model's tokenizer, or raise vocab_size"
        )
    chat = dataset.chat_meta(config) is not None  # a fine-tuning set: conversations and a loss mask
    # Packing text is a mistake; with no dataset yet, opening train.bin below says to run data/chat/prepare.py.
    if config.packing and not chat and os.path.isfile(os.path.join(dataset.dataset_dir(config), "train.bin")):
        raise dataset.DataError(
            f"packing=True packs the conversations of a fine-tuning set, and "
            f"{dataset.dataset_dir(config)} holds text: prepare one with data/chat/prepare.py "
            f"(for text, document_masking=True keeps documents apart)"
        )
    if config.document_masking and chat:
        raise dataset.DataError(
            f"document_masking=True splits text into its documents, and "
            f"{dataset.dataset_dir(config)} is a fine-tuning set: use packing=True instead"
        )
    open_split = dataset.open_chat_split if chat else dataset.open_split
    splits = {s: open_split(config, s, vocab_size) for s in ("train", "val")}
    tasks = scoring.load_tasks(config.eval_tasks, config.eval_tasks_limit)  # read now: a bad file fails early
    if tasks and tok is None:
        raise scoring.EvalError("eval_tasks need the dataset's tokenizer, and this dataset has no meta.json")
    if config.lora_rank and config.init_from == "scratch":
        raise configurator.ConfigError(
            "lora_rank > 0 trains adapters on a frozen model, and init_from='scratch' has none: set --init_from "
            "to a trained model (a Hugging Face directory or hub name, or a nanomax run's out_dir)"
        )
    mesh = sharding.mesh_from_config(config, devices)
    setup = make_setup(config, mesh, vocab_size, dataset.document_start(tok))
    train_step, eval_step = jit_train_step(setup), jit_eval_step(setup)
    if config.compiled_train_step:  # built by compile_aot.py; refused unless made for this run
        train_step = compiled_step.load(config.compiled_train_step, setup, lambda: lower(setup))
    memory_line = ""
    if config.memory_check:  # compile now (the step runs this program) and refuse what cannot fit
        devices, remedies = list(mesh.devices.flat), memory.training_remedies(config, mesh.size)
        if not config.compiled_train_step:  # XLA:TPU refuses what cannot fit here: the same one line
            with memory.refusing_out_of_memory(
                "the train step", devices, remedies, (setup.abstract_state, batch_struct(setup))
            ):
                train_step = lower(setup).compile()
        memory_line = memory.preflight(
            "the train step", [train_step], devices, config.memory_limit_gib, remedies, say=lambda line: None
        )["line"]
    if config.init_from == "resume" and not os.path.isdir(checkpoint.checkpoint_dir(config.out_dir)):
        raise CheckpointError(checkpoint.no_checkpoint_message(config.out_dir))
    lock = checkpoint.OutDirLock(config.out_dir)  # the one run writing to out_dir, or an error
    try:
        return train_loop(setup, splits, tok, lock, train_step, eval_step, tasks, memory_line)
    finally:
        lock.release()


def check_pretrained_tokenizer(config: Config, tok) -> None:
    """A fine-tuned model reads the dataset's ids as its own tokenizer's: they must be the same
    vocabulary (a model whose tokenizer is unknown, without tokenizer.json, is taken as it is)."""
    if config.init_from in ("scratch", "resume") or tok is None:
        return
    source = pretrained_model(config.init_from)
    if checkpoint.is_run_dir(source):  # another run's checkpoint: its vocabulary is in its meta
        check_checkpoint_tokenizer(checkpoint.newest_meta(source) or {}, config, tok, source)
        return
    directory = hf.resolve(source)
    pretrained = hf.read_config(directory)
    theirs = model_tokenizer(directory, pretrained.model_type, pretrained.keys["vocab_size"])
    if theirs is not None and not same_vocabulary(tok, theirs):
        raise dataset.DataError(
            f"init_from={config.init_from} reads ids with {theirs.summary()}, but {dataset.dataset_dir(config)}"
            f"/meta.json describes {tok.summary()}: the model would read the data as other tokens. Prepare the "
            f"data with the model's tokenizer (data/text/prepare.py --tokenizer={directory})"
        )


def train_loop(
    setup: Setup, splits: dict, tok, lock, train_step, eval_step, tasks=(), memory_line: str = ""
) -> list[tuple[int, float]]:
    """Evaluate every eval_interval steps (and at the end), save, train, log; stop at max_iters
    or on a signal. The out_dir lock is held."""
    config = setup.config
    manager, state, resumed, base = start_state(setup, tok, print if jax.process_index() == 0 else lambda *a: None)
    lock.claim()
    run = Run(setup, splits, tok, manager, state, tasks, best_val=best_val_loss(resumed), base=base)
    monitor.print_summary(run.log, setup, splits, run.peak_text)
    if memory_line:  # the pre-flight check's numbers, on stdout and in TensorBoard's text
        run.log.print(memory_line)
        run.log.text(0, "memory", memory_line)
    if config.optimizer == "muon":
        run.log.print(groups_summary(setup.abstract_state["params"]))
    if jax.process_index() == 0:
        _write_atomically(os.path.join(config.out_dir, "config.json"), configurator.config_to_json(config))
        if tok.kind == "huggingface":  # checkpoints name the tokenizer by hash; its files live here
            tok.save_files(os.path.join(config.out_dir, "tokenizer"))
    stack_dumps = monitor.StackDumps(config)
    preemption = monitor.Preemption(kept=lambda: checkpoint.committed_steps_text(config.out_dir))
    try:
        with sharding.activate(setup.mesh):
            while True:
                last = run.step >= config.max_iters
                if run.step % config.eval_interval == 0 and run.step > run.start_step or last or config.eval_only:
                    val_loss = run.evaluate(eval_step)
                    if config.eval_only:
                        break
                    run.save_if_due(val_loss, last)
                    run.clock.restart(run.step)  # evaluation and saving are not billed to training steps
                if last:
                    break
                metrics = run.train_one_step(train_step)
                if run.step % config.log_interval == 0 or run.step == config.max_iters:
                    run.log_step(metrics)
                if preemption.requested():
                    run.save_and_wait(None)
                    run.log.print(
                        f"{preemption.signal_name}: saved a checkpoint at step {run.step}; "
                        f"continue with --init_from=resume"
                    )
                    break
        checkpoint.wait(manager)
    finally:
        preemption.close()
        manager.close()
        run.log.close()
        stack_dumps.close()
    if config.sample_tokens and tok and jax.process_count() == 1 and not preemption.signal_name:
        print("sample:\n" + sample_for_log(setup, run.device_params(), splits, tok))
    return run.history


class Run:
    """The loop's state between steps: the train state and step, what is logged, the best
    validation loss, the non-finite steps, and the decisions about them."""

    def __init__(
        self, setup: Setup, splits: dict, tok, manager, state: dict, tasks=(), best_val=float("inf"), base=None
    ):
        self.setup, self.config, self.splits, self.tok, self.manager = setup, setup.config, splits, tok, manager
        self.tasks, self.scorer = tasks, scoring.make_scorer(setup) if tasks else None
        self.state = state
        self.step = self.start_step = int(state["step"])
        self.log = monitor.Logger(self.config)
        self.clock = monitor.StepClock(self.step, self.config.max_iters)
        self.peak, source = hardware.peak_flops(setup.mesh.devices.flatten().tolist())
        self.peak_text = f"{self.peak / 1e12:.2f} TFLOP/s ({source})" if self.peak else source
        self.flops_per_token = flops_per_token(setup.model_config)
        self.rows = sharding.local_batch_rows(setup.batch_sharding, self.config.batch_size)
        self.profile_start, self.profile_stop = monitor.parse_profile_steps(self.config.profile_steps)
        self.meta = checkpoint.checkpoint_meta(setup, tok) | ({"lora_base": base} if base else {})
        self.history, self.best_val, self.n_skipped = [], best_val, 0
        self.pending_finite = []  # per-step "loss and gradients were finite" flags, read at log time

    def device_params(self):
        """The parameters in device memory, for evals and samples (offload keeps them on the host)."""
        return on_device(self.state["params"], self.setup.compute_shardings["params"])

    def evaluate(self, eval_step) -> float:
        """Train and val loss and the eval_tasks (printed and logged, with a sample if asked);
        returns the val loss."""
        self.check_finite()
        # A CPU's peak is measured again at each evaluation (not billed to the steps); MFU uses the best.
        self.peak = hardware.best_peak_flops(self.setup.mesh.devices.flatten().tolist(), self.peak)
        losses = estimate_losses(eval_step, self.state["params"], self.splits, self.setup, self.rows)
        line = f"step {self.step} | train loss {losses['train']:.4f} | val loss {losses['val']:.4f}"
        values = {"eval/train_loss": losses["train"], "eval/val_loss": losses["val"]}
        for task in self.tasks:
            result = scoring.run_task(task, self.setup, self.device_params(), self.tok, self.scorer)
            line += " | " + scoring.headline(task, result)
            values |= scoring.log_values(task, result)
        self.log.print(line)
        self.log.scalars(self.step, values)
        if self.config.sample_tokens and self.tok and jax.process_count() == 1:
            self.log.text(self.step, "samples", sample_for_log(self.setup, self.device_params(), self.splits, self.tok))
        return losses["val"]

    def save_if_due(self, val_loss: float, last: bool) -> None:
        """At the end, and after an evaluation: always, or when val loss improved."""
        if self.step == self.start_step:
            return
        if val_loss < self.best_val or self.config.always_save_checkpoint or last:
            self.best_val = min(self.best_val, val_loss)
            checkpoint.wait(self.manager)  # the previous save is complete before this one is announced
            self.log.print(f"saving checkpoint at step {self.step}")
            self.save(val_loss)

    def save(self, val_loss: float | None) -> None:
        """Starts an asynchronous save of the state at this step."""
        if self.n_skipped == self.step - self.start_step:  # the parameters never changed
            raise TrainingError(
                f"every step since step {self.start_step} was non-finite and skipped "
                f"(nan_policy=skip_step), so no checkpoint was saved. Check the data and lower "
                f"learning_rate"
            )
        best = min(self.best_val, float("inf") if val_loss is None else val_loss)
        meta = self.meta | {"val_loss": val_loss, "best_val_loss": best if math.isfinite(best) else None}
        # a LoRA run saves its adapters (and their optimizer state); the base is named in meta['lora_base']
        checkpoint.save(self.manager, {**self.state, "params": lora.split(self.state["params"])[0]}, meta, val_loss)

    def save_and_wait(self, val_loss: float | None) -> None:
        self.check_finite()
        self.save(val_loss)
        checkpoint.wait(self.manager)

    def train_one_step(self, train_step) -> dict:
        config, step = self.config, self.step
        n_micro = config.gradient_accumulation_steps
        arrays = dataset.step_batch(
            self.splits["train"], config, 0 if config.overfit_batch else step, "train", self.rows, n_micro
        )
        shape = (n_micro, config.batch_size, config.block_size)
        batch = tuple(sharding.global_batch(a, self.setup.micro_batch_sharding, shape) for a in arrays)
        if step == self.profile_start:
            jax.profiler.start_trace(os.path.join(config.out_dir, "profile"))
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            self.state, metrics = train_step(self.state, batch)
        self.pending_finite.append(metrics["finite"])
        self.step = step = step + 1
        if step == self.profile_stop:
            jax.block_until_ready(self.state)
            jax.profiler.stop_trace()
            self.log.print(
                f"profile of steps {self.profile_start}..{self.profile_stop - 1} written to "
                f"{os.path.abspath(config.out_dir)}/profile (open it with TensorBoard's profile tab)"
            )
        if step == self.start_step + 1:  # the first call compiles: keep it out of the step times
            jax.block_until_ready(metrics)
            self.clock.restart(step)
            if step % config.log_interval and step != config.max_iters:  # else log_step says it
                self.log.print(f"step {step - 1} | {self.compile_note()}")
        return metrics

    def compile_note(self) -> str:
        return f"compile + first step {self.clock.compile_seconds:.1f} s; {compile_cache.summary()}"

    def log_step(self, metrics: dict) -> None:
        """One line for the last step: loss, learning rate, time, throughput, MFU, ETA."""
        self.check_finite()
        step = self.step
        loss, lr = float(metrics["loss"]), float(metrics["lr"])  # waits for the step
        line = f"step {step - 1} | loss {loss:.4f} | lr {lr:.2e} | "
        scalars = {"train/loss": loss, "train/lr": lr}
        seconds = self.clock.seconds_per_step(step)
        if seconds is None:  # only the compiling step since the last restart
            line += self.compile_note()
        else:
            tokens_per_s = self.config.tokens_per_step / seconds
            achieved = self.flops_per_token * tokens_per_s
            if self.peak and achieved > self.peak:  # a CPU peak measured at a busy moment: measure again
                self.peak = hardware.best_peak_flops(self.setup.mesh.devices.flatten().tolist(), self.peak, achieved)
                self.clock.restart(step)  # the measurement is not billed to the next steps
            mfu = achieved / self.peak if self.peak else float("nan")
            line += (
                f"{seconds * 1e3:.1f} ms | {tokens_per_s:,.0f} tok/s | mfu {mfu:.1%} | "
                f"{self.clock.elapsed()} elapsed, ETA {self.clock.eta(step, seconds)}"
            )
            scalars |= {
                "train/grad_norm": metrics["grad_norm"],
                "train/step_ms": seconds * 1e3,
                "train/tokens_per_sec": tokens_per_s,
                "train/mfu": mfu,
            }
        if "router" in metrics:
            r = {k: np.asarray(v) for k, v in metrics["router"].items()}
            busiest = r["load"].max() * len(r["load"])  # 1.0: every expert gets its share
            line += f" | experts: busiest x{busiest:.2f}, dropped {r['dropped']:.1%}"
            scalars |= {
                "moe/balance_loss": r["balance_loss"],
                "moe/z_loss": r["z_loss"],
                "moe/dropped": r["dropped"],
                "moe/busiest_expert_load": busiest,
            }
        if self.n_skipped:
            line += f" | skipped {self.n_skipped} non-finite steps"
        self.log.print(line)
        self.log.scalars(step - 1, scalars | {"train/skipped_steps": self.n_skipped})
        self.history.append((step - 1, loss))

    def check_finite(self) -> None:
        """Reads the finite flags of the steps since the last look: nan_policy decides."""
        if not self.pending_finite:
            return
        finite = np.asarray(jnp.stack(self.pending_finite))
        first_bad = self.step - len(self.pending_finite) + int(np.argmin(finite))
        self.pending_finite.clear()
        if finite.all():
            return
        if self.config.nan_policy == "stop":
            raise TrainingError(
                f"non-finite loss or gradient norm at step {first_bad}; nothing from that step "
                f"on was saved ({latest_checkpoint(self.manager)}). Lower "
                f"learning_rate, check the data, or use --nan_policy=skip_step"
            )
        self.n_skipped += int((~finite).sum())


def latest_checkpoint(manager) -> str:
    latest = manager.latest_step()
    return "no checkpoint has completed yet" if latest is None else f"latest checkpoint: step {latest}"


def best_val_loss(meta: dict | None) -> float:
    """The lowest validation loss of the run a checkpoint belongs to (checkpoints from before it was
    stored: their own), so that a resumed run with always_save_checkpoint=False saves only past it."""
    if meta is None:
        return float("inf")
    best = meta.get("best_val_loss", meta.get("val_loss"))
    return float("inf") if best is None else float(best)


def sample_for_log(setup: Setup, params, splits: dict, tok) -> str:
    prompt = tok.decode(splits["val"][:1])  # one token, which every vocabulary can encode
    return generate.sample_text(setup, params, tok, setup.config.sample_tokens, prompt)[0]


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def complete_config(values: dict) -> dict:
    """configurator's `complete` hook for training: the model keys not given come from a Hugging Face
    model's config.json (init_from=DIR or a hub name), or from the checkpoint resumed or fine-tuned;
    for a PEFT adapter directory, from its base, and the LoRA keys from the adapter."""
    init_from = values.get("init_from", "scratch")
    if not peft.is_adapter_dir(init_from):
        return checkpoint.with_checkpoint_keys(hf.with_model_keys(values))
    adapter = peft.lora_keys(init_from)
    conflicts = [f"{k}={values[k]!r} (its: {v!r})" for k, v in adapter.items() if k in values and values[k] != v]
    if conflicts:
        raise configurator.ConfigError(
            f"init_from={init_from} is a LoRA adapter, and {', '.join(conflicts)} would be another: drop "
            f"{'this key' if len(conflicts) == 1 else 'these keys'} (its adapter_config.json sets them)"
        )
    base = {**values, **adapter, "init_from": pretrained_model(init_from)}
    return {**checkpoint.with_checkpoint_keys(hf.with_model_keys(base)), "init_from": init_from}


def pretrained_model(init_from: str) -> str:
    """The model init_from fine-tunes: a PEFT adapter directory's base, or what it names itself."""
    return peft.read_config(init_from)["base_model_name_or_path"] if peft.is_adapter_dir(init_from) else init_from


def main(argv: list[str]) -> None:
    hardware.keep_freed_host_memory()
    config = configurator.load_config_or_exit(argv, complete=complete_config)
    if warning := compile_cache.use(config.compile_cache):
        print(warning, flush=True)
    try:
        sharding.initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
        train(config)
    except (
        configurator.ConfigError,
        dataset.DataError,
        CheckpointError,
        TrainingError,
        sharding.MeshError,
        compiled_step.AotError,
        scoring.EvalError,
    ) as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk or a read-only folder outside a checkpoint's write (the lock, logs)
        where = f"writing {e.filename}" if e.filename else "writing to out_dir"
        sys.exit(
            f"error: {where} failed ({e.strerror or e}); free space or choose another --out_dir (the "
            f"checkpoints written before are intact)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
