"""What a sharded train step communicates, against what the scaling book predicts for its mesh.

compile_aot.py counts the collectives of the compiled program (compile_aot.collectives: result
bytes per device per step, loops counted); `expected` gives the textbook figure for the same
mesh and `table` puts the two side by side, with the time each kind takes at the chips'
interconnect bandwidth beside the step's compute time, and says which of the two bounds it.
"""

import math

import jax
import jax.numpy as jnp

import sharding
from devices import hardware

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def expected(setup, kept_apart: tuple[str, ...]) -> dict:
    """{kind: bytes per device per step} that the scaling book's account of train.py's step (a
    train.Setup) predicts, counted as compile_aot.collectives counts the compiled program.
    kept_apart: the mesh axes whose gradients the step sums on each device over its micro-steps and
    reduces once (train.shards_kept_apart).
      data    one all-reduce of the gradients (the device's share of them), after the micro-steps
      fsdp    each micro-step gathers the parameters forward and again backward (the embedding
              table once: the lookup and the tied output layer share it) and reduce-scatters
              the gradients (result: the device's shard); with fsdp in kept_apart
              (fsdp_reduce_once) the step gathers them once and reduce-scatters once
      tensor  per layer two all-reduces of the activations forward and two backward, plus one
              each for the vocabulary-split lookup and the output layer's input gradient
      expert  per sparse layer two all-to-alls of the routed tokens forward and two backward
      context as fsdp for the parameters (split over fsdp x context), and per layer an all-gather
              of the row's keys and values forward (again in the backward with remat) and a
              reduce-scatter of their gradients (result: the device's tokens); with ring attention
              collective-permutes of the same keys and values (and back of their gradients)
    Parameters move in the dtype they are stored in, activations in the compute dtype."""
    c, mesh, A = setup.config, setup.mesh.shape, setup.config.gradient_accumulation_steps
    params = setup.abstract_state["params"]
    shard = device_bytes(params)
    table = params["wte"].size * params["wte"].dtype.itemsize // mesh["tensor"]
    rows = c.batch_size // sharding.batch_shards(setup.mesh)
    activation = rows * c.block_size // mesh["context"] * c.n_embd * jnp.dtype(c.dtype).itemsize
    bytes_of = {}
    if mesh["data"] > 1:
        bytes_of["all-reduce"] = shard
    if mesh["fsdp"] * mesh["context"] > 1:  # parameters are split over both (sharding.RULES)
        gathered = shard * mesh["fsdp"] * mesh["context"]  # the device's (tensor-split) share of every parameter
        if "fsdp" in kept_apart:  # fsdp_reduce_once (context is 1 with it)
            bytes_of["all-gather"], bytes_of["reduce-scatter"] = gathered, shard
        else:
            bytes_of["all-gather"] = A * (2 * gathered - (table if c.tie_embeddings else 0))
            bytes_of["reduce-scatter"] = A * shard
    if mesh["tensor"] > 1:
        bytes_of["all-reduce"] = bytes_of.get("all-reduce", 0) + A * (4 * c.n_layer + 2) * activation
    if mesh["context"] > 1:
        kv_heads = setup.model_config.kv_heads
        keys_values = rows * c.block_size * 2 * kv_heads * (c.n_embd // c.n_head) * jnp.dtype(c.dtype).itemsize
        keys_values //= mesh["tensor"]  # `tensor` splits the heads
        passes = 2 if c.remat_policy != "none" else 1  # the forward, and remat's re-run
        if c.context_attention == "ring":  # each device's block goes all the way round, and its gradient too
            ring = A * c.n_layer * (passes + 1) * keys_values
            bytes_of["collective-permute"] = bytes_of.get("collective-permute", 0) + ring
        else:
            bytes_of["all-gather"] = bytes_of.get("all-gather", 0) + A * c.n_layer * passes * keys_values
            bytes_of["reduce-scatter"] = (
                bytes_of.get("reduce-scatter", 0) + A * c.n_layer * keys_values // mesh["context"]
            )
    if mesh["expert"] > 1:
        routed = activation * c.experts_per_token * (c.capacity_factor or 1.0)
        bytes_of["all-to-all"] = A * 4 * (c.n_layer - c.moe_dense_layers) * routed
    return bytes_of


def mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def table(compiled: dict, expected_bytes: dict, device, compute_seconds: float | None) -> list[str]:
    """Report lines: per kind the compiled bytes ({kind: (bytes, count)}) beside the expected ones,
    their ratio and, where the chip's interconnect is known, the time at its bandwidth (one way,
    not overlapped with compute; an all-reduce moves its bytes twice: reduce-scatter + all-gather),
    then that time against the compute time at 100% MFU: which bounds the step."""
    chip = hardware.chip_of(device.device_kind)
    one_way = chip.interconnect / 2 if chip and chip.interconnect else None
    lines = [
        "",
        "communication per device per step (compiled: result bytes, loops counted; expected: the "
        "scaling book's account of the mesh)",
        f"  {'collective':<20}{'compiled':>12}{'expected':>12}{'ratio':>8}{'time':>12}",
    ]
    seconds = 0.0
    for kind in KINDS:
        got, want = compiled.get(kind, (0, 0))[0], expected_bytes.get(kind, 0)
        if not got and not want:
            continue
        wire = 2 * got if kind == "all-reduce" else got
        seconds += wire / one_way if one_way else 0.0
        ratio = f"{got / want:.2f}" if want else "-"
        when = f"{wire / one_way * 1e3:.2f} ms" if one_way else "-"
        lines.append(f"  {kind:<20}{mib(got):>12}{mib(want):>12}{ratio:>8}{when:>12}")
    if expected_bytes.get("reduce-scatter") and "reduce-scatter" not in compiled:
        lines.append(
            "  (no reduce-scatter: XLA all-reduced the gradients and kept each device's slice, as XLA:CPU does)"
        )
    if not one_way:
        lines.append(f"  no interconnect bandwidth known for {device.device_kind}: no times")
        return lines
    lines.append(
        f"  at {one_way / 1e9:.0f} GB/s one way per chip ({chip.kinds[0]}: half of its links' both-way "
        f"total), not overlapped: {seconds * 1e3:.2f} ms per step"
    )
    if compute_seconds:
        bound = "communication" if seconds > compute_seconds else "compute"
        lines.append(
            f"  verdict: {bound}-bound: communication {seconds * 1e3:.2f} ms against compute "
            f"{compute_seconds * 1e3:.2f} ms at 100% MFU ({seconds / compute_seconds:.2f}x)"
        )
    return lines
