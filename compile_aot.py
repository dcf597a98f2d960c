"""Compile train.py's train step for hardware that is not here, and know before launch if it fits.

    python compile_aot.py config/gpt2_124m.py --topology=v5e-256 --batch_size=256 --save=step.bin
    python train.py config/gpt2_124m.py --batch_size=256 --compiled_train_step=step.bin  # on the pod

The step is train.py's own (make_setup + jit_train_step), lowered with abstract sharded
inputs (nothing is allocated) and compiled by XLA for the target's devices: cpu:N
(simulated), gpu / gpu:N (this machine's GPUs; N mock hosts), or a TPU slice from libtpu's
description (v5e-256, v6e-64, v4-8, v5p-128, or v5e:16x16; --topology_num_slices=2). The
report puts XLA's memory and FLOP counts next to the arithmetic and says whether the step
fits. --save writes the executable with a fingerprint of what is baked into it; train.py
loads it only into a run that matches.
"""

import dataclasses
import importlib.util
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

import configurator
import sharding
import train
from aot import communication, serve_plan
from data import dataset
from devices import hardware
from devices.hardware import GiB
from devices.memory import compiler_memory, parse_out_of_memory, size
from inference import engine
from layers import lora, pipeline
from model import describe_params, flops_per_token
from training import compiled_step
from training.compiled_step import AotError
from weights import hf


@dataclasses.dataclass(frozen=True)
class Options:
    """compile_aot.py's own flags; every other flag is a train.py config key."""

    topology: str = ""  # cpu:8 | gpu | gpu:2 | v5e-256 | v5e:16x16 | v4-8 | v5p-128 | v6e-64 ...
    topology_num_slices: int = 1  # TPU slices joined by the data-center network
    save: str = ""  # write the compiled step here, for train.py --compiled_train_step
    hbm_gib: float = 0.0  # per-device memory to check against (CPU has no limit; what-ifs)
    # serving (aot/serve_plan.py): inference/engine.py's prefill and decode step instead of the train step
    serve: bool = False
    slots: int = 8  # decode slots: rows of the KV cache, split over the batch mesh axes
    context: int = 0  # tokens per slot; 0 = block_size
    weight_dtype: str = "auto"  # 'auto' (the compute dtype) | 'int8' (weight-only, as sample.py/serve.py;
    #                             with --lora_rank the train step's frozen base, QLoRA-style)
    kv_cache_dtype: str = "auto"  # 'auto' (the compute dtype) | 'bfloat16' | 'float32' | 'int8'
    decode_attention: str = "auto"  # 'auto' | 'xla' | 'pallas': as serve.py's (the kernel on one TPU chip)
    chip: str = ""  # with a cpu:N topology: take HBM and bandwidth of this chip of devices/hardware.py (H100, ...)

    def __post_init__(self):
        configurator.check_choice("weight_dtype", self.weight_dtype, ("auto", "int8"))
        configurator.check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", "bfloat16", "float32", "int8"))
        configurator.check_choice("decode_attention", self.decode_attention, engine.DECODE_ATTENTION)
        if self.slots < 1 or self.context < 0:
            raise configurator.ConfigError(f"slots must be >= 1 and context >= 0, got {self.slots} and {self.context}")


# ----------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it, and what it resolved to
    devices: list
    hbm_bytes: int | None  # per device; None = unknown (CPU)
    peak_flops: float | None  # all devices together
    peak_source: str


def tpu_topology_name(name: str) -> str:
    """'v5e-256' -> 'v5e:16x16', 'v4-8' -> 'v4:2x2x1' (4 chips of 2 cores); 'v5e:4x4' as is."""
    generation, sep, size = name.partition(":") if ":" in name else name.partition("-")
    if generation not in hardware.TPU_GENERATIONS:
        raise AotError(
            f"unknown topology '{name}': use cpu:N, gpu, gpu:N, or a TPU slice of "
            f"{', '.join(hardware.TPU_GENERATIONS)}, e.g. v5e-256 or v5e:16x16"
        )
    chip = hardware.TPU_GENERATIONS[generation]
    dims, cores_per_chip = chip.torus_dims, chip.cores_per_chip
    if sep == ":":
        return name
    chips = int(size) // cores_per_chip if size.isdigit() else 0
    if chips < 1 or chips & (chips - 1) or (dims == 3 and chips < 4):
        raise AotError(
            f"topology '{name}': the size must be a power of two, at least "
            f"{4 * cores_per_chip if dims == 3 else 1} (e.g. {generation}-64), "
            f"or write the shape (e.g. {generation}:{'x'.join(['4'] * dims)})"
        )
    shape = [1] * dims
    for i in range(chips.bit_length() - 1):  # double the sides in turn: 2x2x1, 2x2x2, 2x2x4, ...
        shape[i % dims] *= 2
    return f"{generation}:{'x'.join(map(str, sorted(shape, key=lambda n: (n == 1, n))))}"


def small_slice_bounds(topology_name: str) -> dict:
    """A slice smaller than a host (v5e:1x1, v5e:2x1: one or two chips on a VM) is one host of exactly
    its chips: libtpu's default host, 2x2x1, does not divide it ('not divisible by the given (or
    default) chips_per_host_bounds')."""
    dims = [int(n) for n in topology_name.partition(":")[2].split("x")]
    if math.prod(dims) >= 4:
        return {}
    return {"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}


def host_topology(topology: str) -> tuple[str, int | None]:
    """'cpu:8' -> ('cpu', 8), 'gpu' -> ('gpu', None); a TPU name -> (name, None)."""
    kind, sep, count = topology.partition(":")
    if kind not in ("cpu", "gpu"):
        return topology, None
    if sep and not (count.isascii() and count.isdigit() and int(count) >= 1):
        raise AotError(
            f"topology '{topology}': the count after '{kind}:' must be a whole number >= 1; "
            f"use cpu:N (N simulated CPU devices), gpu (this machine's GPUs) or gpu:N "
            f"(N mock GPU hosts), e.g. cpu:8"
        )
    return kind, int(count) if sep else None


def configure_jax(topology: str) -> None:
    """Settings that must come before JAX first touches a device (command line only)."""
    kind, count = host_topology(topology)
    if kind == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count or 1)
    elif kind == "gpu" and count:  # N mock hosts, each with this machine's GPUs
        try:
            jax.config.update("mock_num_gpu_processes", count)
        except AttributeError:
            raise AotError(f"JAX {jax.__version__} can't mock GPU hosts: use --topology=gpu") from None
    elif kind != "gpu":  # TPU: abstract devices from libtpu; nothing runs on a TPU here
        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "cpu")
        # Describe this host as a one-host TPU machine, so libtpu doesn't probe for a real one.
        for key, value in (
            ("TPU_SKIP_MDS_QUERY", "1"),
            ("TPU_WORKER_HOSTNAMES", "localhost"),
            ("TPU_HOST_BOUNDS", "1,1,1"),
        ):
            os.environ.setdefault(key, value)


def make_target(topology: str, num_slices: int = 1, hbm_gib: float = 0.0) -> Target:
    """The devices to compile for, with their memory and peak FLOP/s."""
    kind, count = host_topology(topology)
    if kind in ("cpu", "gpu"):
        try:
            devices = jax.devices(kind)
        except RuntimeError:  # no such backend in this process
            devices = []
        wanted = count if kind == "cpu" and count else max(1, len(devices))
        if len(devices) < wanted or num_slices != 1:
            raise AotError(
                f"--topology={topology}: this process has {len(devices)} {kind} devices"
                if num_slices == 1
                else "--topology_num_slices is for TPU slices"
            )
        devices = devices[:wanted]
        hbm = devices[0].memory_stats().get("bytes_limit") if kind == "gpu" else None
        peak, source = hardware.peak_flops(devices)
        name = f"{topology} = {len(devices)} x {devices[0].device_kind}"
    else:
        topology_name = tpu_topology_name(topology)
        if importlib.util.find_spec("libtpu") is None:
            raise AotError(
                f"--topology={topology} needs libtpu to describe TPU devices: pip install "
                f'"jax[tpu]=={jax.__version__}" (docs/compile_aot.md)'
            )
        from jax.experimental import topologies

        chip = hardware.TPU_GENERATIONS[topology_name.partition(":")[0]]
        hbm, chip_flops = chip.hbm_bytes, chip.bf16_flops
        extra = {"chip_config_name": "megacore"} if topology_name.startswith("v4") else {}
        extra |= small_slice_bounds(topology_name)
        devices = topologies.get_topology_desc(
            platform="tpu", topology_name=topology_name, num_slices=num_slices, **extra
        ).devices
        peak = chip_flops * len(devices)
        source = f"{len(devices)} x {chip_flops / 1e12:.0f} TFLOP/s bf16"
        slices = f" x {num_slices} slices" if num_slices > 1 else ""
        name = f"{topology} = {len(devices)} x {devices[0].device_kind} ({topology_name}{slices})"
    return Target(name, list(devices), int(hbm_gib * GiB) if hbm_gib else hbm, peak, source)


# ----------------------------------------------------------------------------- compile


def compile_step(config: configurator.Config, target: Target, vocab_size: int) -> "Result":
    """Lower and compile train.py's step for the target; running out of memory is a result too."""
    n_slices = len({getattr(d, "slice_index", 0) or 0 for d in target.devices})
    dcn = [getattr(config, f"dcn_{axis}") for axis in sharding.MESH_AXES]
    if n_slices > 1 and math.prod(dcn) != n_slices:
        raise AotError(
            f"the topology has {n_slices} slices: set dcn_stage x dcn_data x dcn_expert x dcn_fsdp x "
            f"dcn_tensor to {n_slices} (e.g. --dcn_data={n_slices})"
        )
    mesh = sharding.mesh_from_config(config, target.devices)
    setup = train.make_setup(config, mesh, vocab_size, dataset.config_document_start(config))
    estimate = estimate_memory(setup)
    start = time.perf_counter()
    lowered = train.lower(setup)
    try:
        compiled, oom = lowered.compile(), ""
        memory = compiler_memory(compiled, target.devices[0].platform)
    except Exception as e:  # XLA:TPU refuses a program that can't fit; anything else is a bug
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        compiled, oom = None, str(e).strip()
        arguments = (
            estimate["parameters"]
            + estimate[state_terms(config)[0]]
            + estimate["batch"]
            - estimate["in host memory (offload)"]
        )
        memory = oom_memory(oom, arguments)
    seconds = time.perf_counter() - start
    return Result(
        target,
        setup,
        lowered,
        compiled,
        seconds,
        memory,
        oom,
        estimate,
        flops_per_step(setup),
        xla_flops_per_step(setup),
        collectives(compiled.as_text()) if compiled else {},
    )


def oom_memory(message: str, arguments: int) -> dict:
    """XLA:TPU's out-of-memory message as memory terms (memory.parse_out_of_memory reads it): its
    total where it counts one ('Used 17.2G of 15.75G hbm'), else the temporaries it names ('... the
    total memory required for HLO temporaries (58.64G) exceeds available HBM (15.75G)') + `arguments`."""
    sizes = parse_out_of_memory(message)
    if total := sizes.get("total") or sizes.get("used"):
        return {"total": total}
    if "temporaries" in sizes:
        return {"arguments": arguments, "temporaries": sizes["temporaries"], "total": arguments + sizes["temporaries"]}
    return {}


# ----------------------------------------------------------------------------- the estimate


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (shape / shards x itemsize)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def activation_bytes(policy: str, D, N, T, t, s, qkv, mlp, mlp_in) -> float:
    """Bytes per token of one layer's activations kept for the backward pass, on one device.

    D width, N heads, T context, t = mesh_tensor (it splits heads and MLP units, not the width
    between layers), s = bytes of the compute dtype; qkv = query+key+value width, mlp = width
    of the MLP's hidden activations (gelu: fc out and gelu out, 2F; swiglu: 3F), mlp_in = of
    its input matmuls' outputs (F; 2F). XLA keeps the attention scores (B·N·T² per layer) in
    float32, in several copies (scores, masked, softmax). Fitted to XLA:TPU's buffers for
    GPT-2 124M: within ~20% for every policy, in bfloat16 and float32.
    """
    scores = N * T / t * 4
    return {
        "none": (6 * D + (qkv + D + mlp) / t) * s + 3 * scores,  # everything
        "dots_saveable": (3 * D + (qkv + D + mlp_in) / t) * s + 2 * scores,  # matmul outputs
        "dots_with_no_batch_dims_saveable": (3 * D + (qkv + mlp_in) / t) * s,  # weight matmuls
        "full": D * s,  # the layer's input only
    }[policy]


def state_terms(config: configurator.Config) -> tuple[str, str]:
    """The estimate's names for the optimizer's state and for its update, after what they hold."""
    if config.optimizer == "muon":  # one momentum per block matrix; AdamW's two moments for the rest
        return "Muon momentum + AdamW moments", "Muon update"
    return "AdamW moments", "AdamW update"


def estimate_memory(setup: train.Setup) -> dict:
    """Per-device bytes, term by term, from the shapes alone (nothing compiled)."""
    c, m, mesh = setup.config, setup.model_config, setup.mesh.shape
    # per device and micro-step; `context` splits each row's tokens (every query still sees T keys,
    # all at once, or a T / context block at a time round the ring)
    tokens = c.batch_size // (mesh["data"] * mesh["fsdp"]) * c.block_size // mesh["context"]
    kv_heads, swiglu, F = m.kv_heads, m.mlp == "swiglu", m.mlp_hidden_size
    keys_seen = c.block_size // (mesh["context"] if c.context_attention == "ring" else 1)  # at a time
    widths = dict(
        D=c.n_embd,
        N=c.n_head,
        T=keys_seen,
        t=mesh["tensor"],
        s=jnp.dtype(c.dtype).itemsize,
        qkv=(c.n_head + 2 * kv_heads) * (c.n_embd // c.n_head),
        mlp=(3 if swiglu else 2) * F,
        mlp_in=(2 if swiglu else 1) * F,
    )
    params = per_device_bytes(setup.abstract_state["params"])  # 4 B per parameter / its shards
    trained = per_device_bytes(lora.split(setup.abstract_state["params"])[0])  # LoRA: the adapters only
    logits = 2 * tokens * m.padded_vocab_size / mesh["tensor"] * 4  # float32, + their gradient
    rerun = activation_bytes("none", **widths) * tokens if c.remat_policy != "none" else 0
    state, update = state_terms(c)
    # A pipeline stage keeps its layers' activations for every tick it runs, idle ones included.
    layers_kept = c.n_layer / mesh["stage"] / (1 - bubble(setup))
    on_host = sum(per_device_bytes(setup.abstract_state[part]) for part in train.offloaded_parts(c, setup.mesh))
    return {
        "parameters": params,
        state: per_device_bytes(setup.abstract_state) - params,  # AdamW 8 B per parameter, Muon 4
        "batch": per_device_bytes(train.batch_struct(setup)),
        "gradients": trained * (2 if c.gradient_accumulation_steps > 1 else 1),  # + the running sum
        "activations": int(layers_kept * activation_bytes(c.remat_policy, **widths) * tokens),
        # live at different times: the loss's backward, then one remat'd layer's re-run
        "logits or a re-run layer": int(max(logits, rerun)),
        # the update and the new moments (Muon: new momentum, its orthogonalised copy and
        # Newton-Schulz's products), before they replace the old
        update: 3 * trained,
        "in host memory (offload)": on_host,  # part of the two state terms above, not on the device
    }


def bubble(setup: train.Setup) -> float:
    """The pipeline's idle share of each stage's time (0 without one)."""
    c, stages = setup.config, setup.mesh.shape["stage"]
    if stages == 1:
        return 0.0
    return pipeline.bubble_fraction(
        stages, c.pipeline_microbatches, pipeline.repeats(c.n_layer, stages, c.layers_per_stage)
    )


def estimated_temporaries(e: dict, config: configurator.Config) -> int:
    """The backward pass and the optimizer update (with one gradient tree, the size of the trained
    parameters: all, or a LoRA run's adapters) come one after the other: the larger counts."""
    gradient = min(e["parameters"], e["gradients"])
    return max(e["gradients"] + e["activations"] + e["logits or a re-run layer"], gradient + e[state_terms(config)[1]])


def flops_per_step(setup: train.Setup) -> float:
    """Model FLOPs of one step over all devices: (6N + 12·L·T·d) per token (model.py)."""
    return flops_per_token(setup.model_config) * setup.config.tokens_per_step


def xla_flops_per_step(setup: train.Setup) -> float | None:
    """XLA's own count of the step's global program. Its cost analysis counts a loop body once,
    so it analyses the same step with the layers unrolled, and the micro-step loop is counted
    by hand. It runs on this host's CPU (TPU and GPU clients analyse only compiled programs):
    lowered for one CPU device, the global program is the same."""
    one_device = {f"{kind}_{axis}": 1 for kind in ("mesh", "dcn") for axis in sharding.MESH_AXES}
    config = dataclasses.replace(setup.config, scan_layers=False, **one_device)
    try:
        mesh = sharding.mesh_from_config(config, jax.devices("cpu")[:1])
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return None
    one_device_setup = train.make_setup(config, mesh, setup.model_config.vocab_size, setup.document_start)
    cost = train.lower(one_device_setup).cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return cost["flops"] * setup.config.gradient_accumulation_steps


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo_text: str) -> dict:
    """{kind: (bytes, count)}: the collectives one device runs in a step of the compiled program,
    by the size of their results, each times the trip counts of the loops around it (scanned
    layers, micro-steps). An async pair (all-gather-start / -done) counts once, at its -done."""
    lines_of, computation = {}, None  # computation name -> its lines
    for line in hlo_text.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            computation = header.group(1)
        lines_of.setdefault(computation, []).append(line)
    loops, ops = {}, []  # loops: body computation -> (its caller, trip count)
    for computation, lines in lines_of.items():
        for line in lines:
            loop = re.search(r"\bwhile\(.*\bcondition=%([^,\s]+), body=%([^,\s]+)", line)
            if loop:
                loops[loop.group(2)] = (computation, _trip_count(line, lines_of.get(loop.group(1), [])))
            op = re.search(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(-done)?\(", line)
            if op:
                ops.append((computation, op.group(2), _result_bytes(op.group(1))))
    totals = {}
    for computation, kind, nbytes in ops:
        times = 1
        while computation in loops:
            computation, trips = loops[computation]
            times *= trips
        total, count = totals.get(kind, (0, 0))
        totals[kind] = (total + nbytes * times, count + times)
    return totals


def _trip_count(while_line: str, condition_lines: list) -> int:
    """XLA:CPU and GPU annotate a loop's trip count; XLA:TPU leaves it in the condition, which
    for a scan is `counter < N` against one integer constant (1 if neither says)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_line)
    if known:
        return int(known.group(1))
    bounds = [int(n) for line in condition_lines for n in re.findall(r"s32\[\]\S* constant\((\d+)\)", line)]
    is_less_than = any("direction=LT" in line for line in condition_lines)
    return bounds[0] if len(bounds) == 1 and is_less_than else 1


def _result_bytes(hlo_type: str) -> int:
    """Bytes of an HLO result type such as 'f32[64,128]{0,1}' or '(bf16[8], s32[])'."""
    total = 0
    for dtype, dims in re.findall(r"([a-z]+[0-9a-z]*)\[([\d,]*)\]", hlo_type):
        bits = re.match(r"[a-z]+?(\d+)", dtype)
        total += math.prod(int(d) for d in dims.split(",") if d) * (int(bits.group(1)) // 8 if bits else 1)
    return total


# ----------------------------------------------------------------------------- the report


@dataclasses.dataclass
class Result:
    target: Target
    setup: train.Setup
    lowered: object
    compiled: object  # None when XLA ran out of memory
    seconds: float
    memory: dict  # the compiler's per-device bytes (after an OOM: what its message says)
    oom: str  # XLA's out-of-memory message; '' when it compiled
    estimate: dict  # estimate_memory()
    flops: float  # analytic, one step, all devices
    xla_flops: float | None
    collectives: dict  # collectives(): {kind: (bytes, count)} per device per step

    @property
    def needed(self) -> int:
        """Per-device bytes: arguments + outputs not donated + temporaries + code, as XLA allocates
        them (its simulated peak is reported, not used: on a TPU it did not move with the remat policy)."""
        return self.memory.get("total")

    @property
    def fits(self) -> bool | None:  # None: the device's memory is unknown
        if self.oom:
            return False
        return None if self.target.hbm_bytes is None else self.needed <= self.target.hbm_bytes


def report(r: Result) -> str:
    setup, c, e, m = r.setup, r.setup.config, r.estimate, r.memory
    mesh = " x ".join(f"{axis}={n}" for axis, n in setup.mesh.shape.items())
    lines = [
        f"train step for {r.target.name}, mesh {mesh}",
        f"model {describe_params(setup.model_config)}, {c.dtype}, remat {c.remat_policy}; "
        f"{c.batch_size} x {c.block_size} tokens x {c.gradient_accumulation_steps} micro-steps = "
        f"{c.tokens_per_step:,} tokens per step",
        f"{'compiled' if r.compiled else 'XLA ran out of memory'} in {r.seconds:.1f} s",
        "",
        f"{'memory per device':<40}{'compiler':>12}{'estimate':>12}",
    ]
    state = e["parameters"] + e[state_terms(c)[0]] + e["batch"] - e["in host memory (offload)"]
    rows = [
        ("arguments: train state + batch", m.get("arguments"), state),
        ("outputs not donated to the arguments", m.get("outputs"), 0),
        ("temporaries: gradients, activations", m.get("temporaries"), estimated_temporaries(e, c)),
        ("generated code", m.get("code"), None),
        ("total", m.get("total"), state + estimated_temporaries(e, c)),
    ]
    if "peak" in m:
        rows.append(("peak (XLA's simulation of the buffers)", m["peak"], None))
    if c.offload != "none":
        rows.append(("host memory (offload)", m.get("host"), e["in host memory (offload)"]))
    lines += [f"  {label:<38}{size(got):>12}{size(est):>12}" for label, got, est in rows]
    lines.append(
        "  estimate by term, largest first: "
        + ", ".join(f"{k} {size(v)}" for k, v in sorted(e.items(), key=lambda kv: -kv[1]) if v)
    )
    stages, idle = setup.mesh.shape["stage"], bubble(setup)
    if stages > 1:
        R = pipeline.repeats(c.n_layer, stages, c.layers_per_stage)
        schedule = "GPipe" if R == 1 else f"circular: {R} rounds of {c.n_layer // (stages * R)} layers per stage"
        lines.append(
            f"pipeline: {stages} stages x {c.pipeline_microbatches} micro-batches ({schedule}); "
            f"bubble {idle:.1%} of each stage's time; memory per device is one stage's"
        )
    hbm = r.target.hbm_bytes
    if r.oom:
        lines.append(f"verdict: DOES NOT FIT in {size(hbm)} per device; XLA: {r.oom.splitlines()[0]}")
    elif hbm is None:
        lines.append(
            f"verdict: no memory limit known for {r.target.devices[0].device_kind} "
            f"(pass --hbm_gib=16 to check against one)"
        )
    elif r.fits:
        lines.append(f"verdict: fits, {size(r.needed)} of {size(hbm)} per device ({size(hbm - r.needed)} to spare)")
    else:
        lines.append(
            f"verdict: DOES NOT FIT, needs {size(r.needed)} of {size(hbm)} per device ({size(r.needed - hbm)} over)"
        )
    if r.fits is False:
        lines += ["to fit, try:"] + [f"  {s}" for s in suggestions(r)]
    A = c.gradient_accumulation_steps
    lines += ["", "compute per step, all devices", f"  analytic (6N + 12·L·T·d per token)   {r.flops:.3e} FLOP"]
    if r.xla_flops:
        lines.append(
            f"  XLA cost analysis                    {r.xla_flops:.3e} FLOP "
            f"({r.xla_flops / r.flops:.2f}x; layers unrolled, x{A} micro-steps, remat "
            f"recompute and non-matmul work included)"
        )
    if r.target.peak_flops:
        seconds = r.flops / r.target.peak_flops / (1 - idle)  # idle pipeline stages add time, not FLOPs
        with_bubble = " with the pipeline's bubble" if idle else ""
        lines.append(
            f"  at 100% MFU{with_bubble} ({r.target.peak_source}): {seconds * 1e3:,.1f} ms per step, "
            f"{c.tokens_per_step / seconds:,.0f} tokens/s; at 40% MFU "
            f"{seconds / 0.4 * 1e3:,.1f} ms"
        )
    else:
        lines.append(f"  peak FLOP/s: {r.target.peak_source}")
    if r.compiled:
        moved = ", ".join(f"{kind} {size(nbytes)} x{count}" for kind, (nbytes, count) in r.collectives.items())
        lines.append(f"collectives per device per step (results, loops counted): {moved or 'none'}")
        lines += communication.table(
            r.collectives,
            communication.expected(r.setup, train.shards_kept_apart(r.setup)),
            r.target.devices[0],
            r.flops / r.target.peak_flops if r.target.peak_flops else None,
        )
    return "\n".join(lines)


def suggestions(r: Result) -> list[str]:
    """What would shrink the largest terms, largest first."""
    c, mesh, e = r.setup.config, r.setup.mesh.shape, r.estimate
    rows = c.batch_size // (mesh["data"] * mesh["fsdp"])
    state = e["parameters"] + e[state_terms(c)[0]]
    tips = []
    if rows > 1:
        tips.append(
            (
                e["activations"] + e["logits or a re-run layer"],
                f"a smaller batch per device ({rows} rows now), same tokens per step: "
                f"--batch_size={c.batch_size // 2} "
                f"--gradient_accumulation_steps={2 * c.gradient_accumulation_steps}",
            )
        )
    if rows == 1 and mesh["fsdp"] % 2 == 0 and c.block_size % (4 * mesh["context"]) == 0:
        tips.append(
            (
                e["activations"] + e["logits or a re-run layer"],
                f"split each row's tokens over twice as many devices, same tokens per step: "
                f"--mesh_context={2 * mesh['context']} --mesh_fsdp={mesh['fsdp'] // 2} "
                f"--batch_size={c.batch_size // 2} "
                f"--gradient_accumulation_steps={2 * c.gradient_accumulation_steps}",
            )
        )
    if c.remat_policy != "full":
        lighter = "dots_with_no_batch_dims_saveable"
        lighter = "full" if c.remat_policy == lighter else lighter
        tips.append((e["activations"], f"recompute more in the backward pass: --remat_policy={lighter}"))
    if mesh["data"] > 1:
        tips.append(
            (
                state + e["gradients"] + e[state_terms(c)[1]],
                f"shard parameters, gradients and optimizer state over all "
                f"{mesh['data'] * mesh['fsdp']} devices (now {size(state)} per device): "
                f"--mesh_data=1 --mesh_fsdp=-1",
            )
        )
    tips.append((0, "more chips: a bigger topology"))
    return [tip for _, tip in sorted(tips, key=lambda t: -t[0])]


# ----------------------------------------------------------------------------- command line


def aot_vocab_size(config: configurator.Config) -> int:
    if config.vocab_size or os.path.exists(os.path.join(dataset.dataset_dir(config), "meta.json")):
        return dataset.read_vocab_size(config)
    print(
        f"note: {dataset.dataset_dir(config)}/meta.json not found; compiling for GPT-2's "
        f"vocab_size 50257 (set --vocab_size to choose)"
    )
    return 50257


def main(argv: list[str]) -> None:
    options, config = configurator.load_with_options_or_exit(argv, Options, complete=hf.with_model_keys)
    if config.lora_rank and not options.serve:  # --weight_dtype=int8 is then the frozen base's (QLoRA)
        config = dataclasses.replace(config, weight_dtype=options.weight_dtype)
    if not options.topology:
        sys.exit("error: --topology is required: cpu:8, gpu, gpu:2, v5e-256, v5e:16x16, v4-8, ...")
    try:
        if options.save:
            configurator.check_writable(options.save, "save")
        configure_jax(options.topology)
        target = make_target(options.topology, options.topology_num_slices, options.hbm_gib)
        vocab_size = aot_vocab_size(config)
        if options.serve:
            served = serve_plan.compile_serving(
                config,
                target,
                vocab_size,
                options.slots,
                options.context,
                options.weight_dtype,
                options.kv_cache_dtype,
                options.chip,
                options.hbm_gib,
                options.decode_attention,
            )
            print(serve_plan.serve_report(served))
            sys.exit(1 if served.fits is False else 0)
        result = compile_step(config, target, vocab_size)
    except (AotError, configurator.ConfigError, sharding.MeshError, dataset.DataError, engine.EngineError) as e:
        sys.exit(f"error: {e}")
    print(report(result))
    if options.save and result.compiled is not None:
        try:
            compiled_step.save(result.compiled, result.lowered, result.setup, options.save)
        except AotError as e:
            sys.exit(f"error: {e}")
        print(
            f"\nsaved {options.save} ({size(os.path.getsize(options.save))}); train with it: "
            f"python train.py <same config and flags> --compiled_train_step={options.save}"
        )
    elif options.save:
        print("\nnot saved: nothing was compiled")
    if result.fits is False:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
