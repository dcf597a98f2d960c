"""compile_aot.py --serve: inference/engine.py's prefill and decode step compiled for a target that is not
here, and what serving costs there, before anyone pays for it.

    python compile_aot.py config/llama3_1b.py --serve --topology=v5e-8 --mesh_tensor=8 --mesh_data=1 \
        --slots=32 --context=8192 --kv_cache_dtype=int8

The programs are the engine's own (its empty state, its largest admissions of prompts, a decode of
all slots), lowered with abstract sharded weights, nothing allocated. The report, per chip:
the weights, the KV cache per token and per slot (next to the arithmetic: 2 x layers x KV heads x
head size x bytes per token), the most slots that fit next to the weights and the programs'
temporaries, the decode step's FLOPs and the bytes it reads, the memory-bound step time (those
bytes / the chip's bandwidth, devices/hardware.py) and the tokens/s it allows, and whether it fits.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp

import configurator
import sharding
from common.model_setup import ModelSetup, model_setup
from devices import hardware
from devices.hardware import GiB
from devices.memory import size
from inference import engine, loader
from layers import kv_cache
from layers.quantization import Int8Weight
from model import count_params, flops_per_token


@dataclasses.dataclass
class ServeResult:
    target_name: str
    setup: ModelSetup
    slots: int
    context: int
    weight_dtype: str
    chip_name: str  # whose HBM and bandwidth the numbers use
    hbm: int | None  # per chip
    bandwidth: float | None  # per chip, bytes/s
    weight_bytes: int  # all chips together, as stored (one copy)
    weight_bytes_per_chip: int
    kv_bytes_per_token: int  # one copy, all layers
    cache_bytes_per_chip: int  # the whole (slots, context) cache's share of one chip
    step_memory: dict  # XLA's per-chip bytes of the decode program: arguments, temporaries, peak
    prefill_temporaries: int  # the largest admission's (prompts prefilled into slots), on the same arguments
    oom: str  # XLA's out-of-memory message; '' when it compiled

    @property
    def rows_per_chip(self) -> int:
        return self.slots // sharding.batch_shards(self.setup.mesh)

    @property
    def slot_bytes_per_chip(self) -> int:
        """What one more slot costs a chip that holds it: its (context) row of the cache there."""
        return self.cache_bytes_per_chip // self.rows_per_chip

    @property
    def temporaries(self) -> int:
        """The most that a program adds to its arguments (the weights and the cache): a decode's or
        an admission's."""
        return max(self.step_memory.get("temporaries", 0), self.prefill_temporaries)

    @property
    def needed(self) -> int:
        m = self.step_memory
        admitting = m.get("arguments", 0) + self.prefill_temporaries
        return max(m.get("peak") or m.get("arguments", 0) + m.get("temporaries", 0), admitting)

    @property
    def fits(self) -> bool | None:
        return False if self.oom else None if self.hbm is None else self.needed <= self.hbm

    @property
    def most_slots(self) -> int | None:
        """Slots on the whole mesh: each data shard's chips fill what the weights and the programs'
        temporaries leave with cache rows."""
        if self.hbm is None:
            return None
        free = self.hbm - self.weight_bytes_per_chip - self.temporaries
        return max(free // self.slot_bytes_per_chip, 0) * sharding.batch_shards(self.setup.mesh)

    @property
    def step_bytes_per_chip(self) -> int:
        """A decode step reads every weight and every slot's whole cache (memory-bound decode)."""
        return self.weight_bytes_per_chip + self.cache_bytes_per_chip

    @property
    def step_flops(self) -> float:
        """All chips: training's count per token without the backward (a third): 2 per active weight,
        and attention's QK^T and AV over the whole context, for each slot."""
        return self.slots * flops_per_token(self.setup.model_config, self.context) / 3


def per_device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def abstract_outputs(compiled, lowered):
    """The outputs of a compiled program as sharded ShapeDtypeStructs: the next program's inputs."""
    return jax.tree.map(
        lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
        lowered.out_info,
        compiled.output_shardings,
    )


def serving_params(setup: ModelSetup, weight_dtype: str):
    """The weights as inference.serving_weights holds them, abstract: its shapes, and each parameter's
    sharding (an int8 weight's scales replicated along the input axes they don't have). Not compiled:
    on the target, converting float32 weights may not fit where serving does."""
    shapes = jax.eval_shape(
        functools.partial(loader.serving_weights, setup, weight_dtype=weight_dtype), setup.abstract_params
    )

    def place(param, shape):
        if not isinstance(shape, Int8Weight):
            return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=param.sharding)
        spec = param.sharding.spec + (None,) * (len(shape.shape) - len(param.sharding.spec))
        scale_spec = jax.sharding.PartitionSpec(*(axes if n > 1 else None for axes, n in zip(spec, shape.scale.shape)))
        return Int8Weight(
            jax.ShapeDtypeStruct(shape.q.shape, shape.q.dtype, sharding=param.sharding),
            jax.ShapeDtypeStruct(
                shape.scale.shape, shape.scale.dtype, sharding=jax.sharding.NamedSharding(setup.mesh, scale_spec)
            ),
        )

    return jax.tree.map(place, setup.abstract_params, shapes, is_leaf=lambda x: isinstance(x, Int8Weight))


def serving_setup(
    config: configurator.Config, devices, vocab_size: int, context: int, kv_cache_dtype: str
) -> ModelSetup:
    """The model on the training mesh keys' mesh, with the engine's context as its block size."""
    mesh = sharding.mesh_from_config(config, devices)
    config = dataclasses.replace(
        config, block_size=context or config.block_size, batch_size=sharding.batch_shards(mesh)
    )
    return model_setup(config, mesh, vocab_size, kv_cache_dtype)


def chip_numbers(target, chip: str, hbm_gib: float) -> tuple[str, int | None, float | None]:
    """(name, HBM, bandwidth) per chip: of `chip` in devices/hardware.py's table if given (a what-if for
    programs compiled on CPU devices), else of the target's devices (a TPU slice by its generation:
    libtpu calls a v5p chip 'TPU v5')."""
    devices = target.devices
    found = hardware.chip_of(chip or devices[0].device_kind)
    if not chip:
        found = next((c for gen, c in hardware.TPU_GENERATIONS.items() if f"({gen}:" in target.name), found)
    if chip and found is None:
        raise configurator.ConfigError(
            f"--chip={chip} is not in devices/hardware.py's table: use one of "
            f"{', '.join(c.kinds[0] for c in hardware.CHIPS)}"
        )
    if found is None:  # this CPU: no HBM; its measured bandwidth, shared by the simulated devices
        return devices[0].device_kind, int(hbm_gib * GiB) or None, hardware.peak_bandwidth(devices)[0] / len(devices)
    return found.kinds[0], int(hbm_gib * GiB) or found.hbm_bytes, found.hbm_bandwidth


def compile_serving(
    config: configurator.Config,
    target,
    vocab_size: int,
    slots: int,
    context: int = 0,
    weight_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    chip: str = "",
    hbm_gib: float = 0.0,
    decode_attention: str = "auto",
) -> ServeResult:
    """Lower and compile the engine's programs for `target` (compile_aot.Target)."""
    setup = serving_setup(config, target.devices, vocab_size, context, kv_cache_dtype)
    c, mesh = setup.model_config, setup.mesh
    if slots % sharding.batch_shards(mesh):
        raise configurator.ConfigError(
            f"slots={slots} is not divisible by the mesh's batch axes "
            f"({sharding.batch_shards(mesh)}): use a multiple of it"
        )
    reads = kv_cache.FILLED if engine.reads_filled_positions(decode_attention, mesh, c) else None  # as the engine's
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    one = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    oom, step_memory, prefill_temporaries = "", {}, 0
    with sharding.activate(mesh):
        params = serving_params(setup, weight_dtype)
        lowered = engine.empty_state_program(c, slots, c.block_size).lower()
        state = abstract_outputs(lowered.compile(), lowered)
        try:
            step = (
                engine.decode_program(setup.graphdef, c.vocab_size, engine.DECODE_STEPS, reads)
                .lower(params, state, one(jnp.bool_, (slots,)))
                .compile()
            )
            step_memory = xla_memory(step, target.devices[0].platform)
            # the admissions with the most tokens: one prompt of the whole context, and the most rows of a bucket
            widest = max(
                ((P, R) for P in engine.prompt_buckets(c.block_size) for R in engine.admit_rows(P, slots)),
                key=lambda bucket_rows: (bucket_rows[1], bucket_rows[0]),
            )
            for P, R in {(c.block_size, 1), widest}:
                inputs = engine.admit_inputs(P, R, replicated)
                admit = engine.admit_program(setup.graphdef, c.vocab_size).lower(params, state, *inputs).compile()
                prefill_temporaries = max(prefill_temporaries, admit.memory_analysis().temp_size_in_bytes)
        except Exception as e:  # XLA:TPU refuses a program that can't fit; anything else is a bug
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            oom = str(e).strip().splitlines()[0]
            # XLA:TPU's message: '... the total memory required for HLO temporaries (21.59G) exceeds ...'
            if found := re.search(r"temporaries \(([\d.]+)([KMGT]?)\)", oom):
                step_memory = {
                    "arguments": per_device_bytes((params, state)),
                    "temporaries": int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " ")),
                }
    chip_name, hbm, bandwidth = chip_numbers(target, chip, hbm_gib)
    return ServeResult(
        target.name,
        setup,
        slots,
        c.block_size,
        weight_dtype,
        chip_name,
        hbm,
        bandwidth,
        weight_bytes=loader.weight_bytes(params),
        weight_bytes_per_chip=per_device_bytes(params),
        kv_bytes_per_token=loader.kv_bytes_per_token(c),
        cache_bytes_per_chip=per_device_bytes(state["cache"]),
        step_memory=step_memory,
        prefill_temporaries=prefill_temporaries,
        oom=oom,
    )


def xla_memory(compiled, platform: str) -> dict:
    m = compiled.memory_analysis()
    memory = {"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes}
    if platform != "cpu" and m.peak_memory_in_bytes:  # XLA:CPU's peak is not reliable
        memory["peak"] = m.peak_memory_in_bytes
    return memory


def analytic_kv_bytes_per_token(config) -> int:
    """2 (keys, values) x layers x KV heads x head size x bytes, + an int8 cache's float32 scales."""
    H = config.n_embd // config.n_head
    dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    per_head = H * jnp.dtype(dtype).itemsize + (4 if dtype == "int8" else 0)
    return 2 * config.n_layer * config.kv_heads * per_head


def serve_report(r: ServeResult) -> str:
    c, mesh = r.setup.model_config, r.setup.mesh
    layout = " x ".join(f"{axis}={n}" for axis, n in mesh.shape.items() if n > 1) or "one device"
    analytic_weights = count_params(c) * jnp.dtype(c.dtype).itemsize
    kv_dtype = c.dtype if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
    lines = [
        f"serving on {r.target_name}, mesh {layout}; numbers per chip for {r.chip_name}",
        f"model {count_params(c):,} parameters, compute {c.dtype}, weights {r.weight_dtype}, "
        f"KV cache {kv_dtype}; {r.slots} slots x {r.context} tokens of context",
        f"  weights         {size(r.weight_bytes)} in all ({size(analytic_weights)} at {c.dtype}: "
        f"parameters x bytes), {size(r.weight_bytes_per_chip)} per chip",
        f"  KV per token    {r.kv_bytes_per_token:,} B (analytic {analytic_kv_bytes_per_token(c):,} B); "
        f"per slot {size(r.kv_bytes_per_token * r.context)}, {size(r.slot_bytes_per_chip)} of it per chip "
        f"that holds the slot",
        f"  cache per chip  {size(r.cache_bytes_per_chip)} ({r.rows_per_chip} slots)",
    ]
    if r.oom:
        lines.append(f"  XLA: {r.oom}")
    else:
        m = r.step_memory
        lines.append(
            f"  decode step     arguments {size(m['arguments'])} + temporaries {size(m['temporaries'])}"
            + (f", peak {size(m['peak'])}" if "peak" in m else "")
            + f"; admitting prompts: temporaries {size(r.prefill_temporaries)}"
        )
    if r.most_slots is not None:
        lines.append(
            f"  most slots      {r.most_slots} ({size(r.hbm)} HBM per chip - weights - the programs' temporaries)"
        )
    lines.append(
        f"  per decode step {r.step_flops:.3e} FLOP (all chips), {size(r.step_bytes_per_chip)} read per chip "
        f"(weights + every slot's full cache)"
    )
    if r.bandwidth:
        seconds = r.step_bytes_per_chip / r.bandwidth
        lines.append(
            f"  memory-bound    {seconds * 1e3:.2f} ms per step at {r.bandwidth / 1e9:,.0f} GB/s per chip: "
            f"{r.slots / seconds:,.0f} tokens/s, {1 / seconds:,.1f} tokens/s per slot"
        )
    verdict = {
        True: f"fits: {size(r.needed)} of {size(r.hbm)} per chip",
        None: "fits: unknown (no HBM size; pass --hbm_gib or --chip)",
        False: f"DOES NOT FIT: {size(r.needed)} of {size(r.hbm)} per chip",
    }
    lines.append(f"verdict: {verdict[r.fits]}")
    return "\n".join(lines)
