"""aot/communication.py, and what the compiled train step communicates on 8 simulated devices
(counted by compile_aot.collectives from the program after SPMD partitioning)."""

import dataclasses
import re
import types

import pytest
from test_train import make_dataset, small_config

import compile_aot
import train
from aot import communication

VOCAB = 96  # a width no other weight has: the embedding table is the only (96, 64) matrix


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The step compiled on 8 devices for each layout the checks read."""
    root = tmp_path_factory.mktemp("comm")
    make_dataset(root / "data", vocab_size=64)
    base = small_config(root, n_layer=2, n_embd=64, n_head=4, batch_size=8, mesh_data=1)
    meshes = {
        "data": dict(mesh_data=8),
        "data, 4 micro-steps": dict(mesh_data=8, gradient_accumulation_steps=4),
        "fsdp": dict(mesh_fsdp=8, dtype="bfloat16"),
        "fsdp, 4 micro-steps": dict(mesh_fsdp=8, gradient_accumulation_steps=4),
        "fsdp, 4 micro-steps, reduced once": dict(mesh_fsdp=8, gradient_accumulation_steps=4, fsdp_reduce_once=True),
        "tensor x data": dict(mesh_data=2, mesh_tensor=4),
        # rows of 64 tokens: the keys and values gathered are half of what it moves
        "context": dict(mesh_context=8, remat_policy="full", block_size=64),
        "context, ring": dict(mesh_context=8, remat_policy="full", block_size=64, context_attention="ring"),
    }
    target = compile_aot.make_target("cpu:8")
    return {
        name: compile_aot.compile_step(dataclasses.replace(base, **flags), target, VOCAB)
        for name, flags in meshes.items()
    }


def expected_bytes(r) -> dict:
    """What the scaling book predicts for the compiled step r."""
    return communication.expected(r.setup, train.shards_kept_apart(r.setup))


def test_tensor_parallel_step_gathers_no_weights(layouts):
    """Megatron's layout: every projection multiplies by the device's own heads' or hidden units'
    slice, so tensor=4 x data=2 only all-reduces (activations, and the gradients over data)."""
    assert "all-gather" not in layouts["tensor x data"].collectives
    assert "all-reduce" in layouts["tensor x data"].collectives


def test_accumulated_gradients_are_reduced_once_per_step(layouts):
    one = layouts["data"].collectives["all-reduce"][0]
    four = layouts["data, 4 micro-steps"].collectives["all-reduce"][0]
    assert abs(four - one) < 1024  # the same gradients (the micro-steps' losses are a few scalars more)


def test_fsdp_reduce_once_gathers_and_reduces_once_per_step_not_per_micro_step(layouts):
    """Under fsdp each micro-step gathers the parameters and reduces their gradients; with
    fsdp_reduce_once the step gathers them once and reduces once (XLA:CPU all-reduces where a
    TPU reduce-scatters), for the whole parameters and gradient on every device."""
    per_micro_step = layouts["fsdp, 4 micro-steps"].collectives
    once = layouts["fsdp, 4 micro-steps, reduced once"].collectives
    for kind in ("all-gather", "all-reduce"):
        assert once[kind][0] < per_micro_step[kind][0] / 3, (kind, once[kind], per_micro_step[kind])
    r = layouts["fsdp, 4 micro-steps, reduced once"]
    assert 0.8 < once["all-gather"][0] / expected_bytes(r)["all-gather"] < 1.2


def test_fsdp_gathers_the_embedding_table_once(layouts):
    """The lookup and the tied output layer share one gathered copy of wte (it was gathered three
    times: in float32 for the lookup, and in two layouts for the output layer and its backward)."""
    gathers = [
        line
        for line in layouts["fsdp"].compiled.as_text().splitlines()
        if re.search(r"= \S+\[(96,64|64,96)\]\S* all-gather(-start)?\(", line)
    ]
    assert len(gathers) == 1, gathers


@pytest.mark.parametrize(
    "layout, kind",
    [
        ("data", "all-reduce"),
        ("fsdp", "all-gather"),
        ("tensor x data", "all-reduce"),
        ("context", "all-gather"),  # weights, and keys and values twice (remat)
        ("context, ring", "collective-permute"),
    ],
)  # keys and values round the ring
def test_compiled_bytes_are_what_the_scaling_book_expects(layouts, layout, kind):
    r = layouts[layout]
    compiled, expected = r.collectives[kind][0], expected_bytes(r)[kind]
    assert 0.8 < compiled / expected < 1.2, (compiled, expected)
    table = compile_aot.report(r).split("communication per device per step")[1]
    assert re.search(rf"{kind} +{communication.mib(compiled)} +{communication.mib(expected)}", table)


def test_time_at_the_interconnect_and_the_verdict():
    """An H100's NVLink: 900 GB/s both ways, 450 one way; an all-reduce moves its bytes twice."""
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    lines = communication.table({"all-reduce": (450e6, 3)}, {"all-reduce": 450e6}, h100, compute_seconds=1e-3)
    assert re.search(r"all-reduce +429\.15 MiB +429\.15 MiB +1\.00 +2\.00 ms", "\n".join(lines))
    assert "verdict: communication-bound" in lines[-1] and "(2.00x)" in lines[-1]
    lines = communication.table({"all-reduce": (450e6, 3)}, {}, h100, compute_seconds=5e-3)
    assert "verdict: compute-bound" in lines[-1]
    cpu = types.SimpleNamespace(device_kind="cpu")
    assert "no interconnect bandwidth known for cpu" in communication.table({}, {}, cpu, None)[-1]
