"""Tests of sharding.py: every mesh layout trains as one device does, checkpoints move between meshes."""

import dataclasses
import math
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from tensorboard.util import tensor_util
from test_train import (
    assert_gradients_close,
    assert_near_in_learning_rates,
    make_dataset,
    make_setup_keeping_gradients,
    masked_step_and_alone,
    small_config,
)

import sharding
import train
from data import dataset
from layers import attention
from training import optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = {  # (data, fsdp, tensor[, context]): between them, every axis split 2 and 4 ways
    "tensor=2 x fsdp=4": (1, 4, 2),
    "data=2 x fsdp=2 x tensor=2": (2, 2, 2),
    "context=4 x fsdp=2": (1, 2, 1, 4),  # the balanced causal layout (attention.balanced_order)
    "data=2 x context=2 x tensor=2, ring attention": (2, 1, 2, 2, "ring"),
}


def sharded_config(tmp_path, data, fsdp, tensor, context=1, context_attention="gather"):
    # vocab 64 and width 64 divide evenly, so every named axis really is split
    return small_config(
        tmp_path,
        mesh_data=data,
        mesh_fsdp=fsdp,
        mesh_tensor=tensor,
        mesh_context=context,
        context_attention=context_attention,
        n_embd=64,
        n_head=4,
        max_iters=5,
        eval_interval=1000,
        out_dir=str(tmp_path / f"out-{data}-{fsdp}-{tensor}"),
    )


@pytest.fixture(scope="module")
def toy64(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    make_dataset(root / "data", vocab_size=64)
    config = sharded_config(root, 1, 1, 1)
    reference = [loss for _, loss in train.train(config, jax.devices()[:1])]
    return root, reference


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_loss_curve_equals_one_device(toy64, layout):
    root, reference = toy64
    losses = [loss for _, loss in train.train(sharded_config(root, *LAYOUTS[layout]))]
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fsdp, context", [(8, 1), (2, 4)])  # the context devices split the weights too
def test_fsdp_stores_an_eighth_of_the_parameters_per_device(toy64, fsdp, context):
    root, _ = toy64
    config = sharded_config(root, 1, fsdp, 1, context)
    mesh = sharding.make_mesh(1, fsdp, 1, context=context)
    state = train.init_state(train.make_setup(config, mesh, 64))
    leaves = jax.tree_util.tree_leaves_with_path(state["params"])
    total = sum(a.nbytes for _, a in leaves)
    per_device = sum(a.addressable_shards[0].data.nbytes for _, a in leaves)
    replicated = {jax.tree_util.keystr(p) for p, a in leaves if a.sharding.is_fully_replicated}
    # Only the width-n_embd vectors (layer norms and output biases) are replicated on purpose.
    assert replicated == {
        "['blocks']['attn']['out_bias']",
        "['blocks']['mlp']['proj_bias']",
        "['blocks']['ln_1']['scale']",
        "['blocks']['ln_1']['bias']",
        "['blocks']['ln_2']['scale']",
        "['blocks']['ln_2']['bias']",
        "['ln_f']['scale']",
        "['ln_f']['bias']",
        "['blocks']['attn']['qkv_bias']",
        "['blocks']['mlp']['fc_bias']",
    }
    replicated_bytes = sum(a.nbytes for p, a in leaves if jax.tree_util.keystr(p) in replicated)
    assert per_device == (total - replicated_bytes) // 8 + replicated_bytes
    assert replicated_bytes < 0.02 * total
    opt_leaves = jax.tree.leaves(state["opt_state"])
    assert sum(a.addressable_shards[0].data.nbytes for a in opt_leaves) < 0.15 * sum(
        a.nbytes for a in opt_leaves
    )  # Adam moments are sharded like the parameters


def sizes(data, fsdp, tensor, expert=1, stage=1):
    return dict(stage=stage, data=data, expert=expert, fsdp=fsdp, context=1, tensor=tensor)


@pytest.mark.parametrize(
    "shape, n_devices, expected",
    [  # expected in MESH_AXES order: stage first
        ((-1, 1, 1), 8, (1, 8, 1, 1, 1, 1)),
        ((2, -1, 2), 8, (1, 2, 1, 2, 1, 2)),
        ((1, 4, 2), 8, (1, 1, 1, 4, 1, 2)),
        ((1, 2, 1, -1), 8, (1, 1, 4, 2, 1, 1)),
        ((-1, 2, 1, 1, 2), 8, (2, 2, 1, 2, 1, 1)),
    ],
)
def test_resolve_mesh_shape(shape, n_devices, expected):
    assert tuple(sharding.resolve_mesh_shape(sizes(*shape), n_devices).values()) == expected


@pytest.mark.parametrize(
    "shape, message",
    [
        ((2, 2, 1), "= 4 devices, but there are 8"),
        ((-1, -1, 1), "only one of"),
        ((3, -1, 1), "8 devices are not divisible by 3"),
    ],
)
def test_bad_mesh_shapes_name_the_numbers(shape, message):
    with pytest.raises(sharding.MeshError, match=message):
        sharding.resolve_mesh_shape(sizes(*shape), 8)


def test_model_that_does_not_fit_the_mesh(toy64):
    mesh = sharding.make_mesh(1, 2, 4)
    with pytest.raises(sharding.MeshError, match="n_head=2 is not divisible by mesh_tensor=4"):
        sharding.check_model_fits_mesh(mesh, n_head=2, n_embd=64, batch_size=8)
    with pytest.raises(
        sharding.MeshError, match="batch_size=5 is not divisible by mesh_data x mesh_expert x mesh_fsdp"
    ):
        sharding.check_model_fits_mesh(mesh, n_head=4, n_embd=64, batch_size=5)
    experts_4 = sharding.make_mesh(1, 2, 1, expert=4)
    for n_experts in (0, 6):  # a dense model, or experts that 4 devices can't share evenly
        with pytest.raises(sharding.MeshError, match=f"mesh_expert=4 splits .* n_experts={n_experts}"):
            sharding.check_model_fits_mesh(experts_4, n_head=4, n_embd=64, batch_size=8, n_experts=n_experts)
    sharding.check_model_fits_mesh(experts_4, n_head=4, n_embd=64, batch_size=8, n_experts=8)


def tensorboard_losses(out_dir) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out_dir, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return [float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("train/loss")]


def test_two_processes_match_one_process_and_their_checkpoint_restores(toy64, tmp_path):
    """2 processes x 4 CPU devices, joined by jax.distributed, as a user would launch them."""
    root, one_device = toy64  # 5 steps on one device, of the model these flags configure
    flags = [
        f"--data_dir={root / 'data'}",
        "--dataset=toy",
        "--n_layer=2",
        "--n_head=4",
        "--n_embd=64",
        "--block_size=16",
        "--batch_size=8",
        "--max_iters=2",
        "--learning_rate=3e-3",
        "--warmup_iters=2",
        "--lr_decay_iters=8",
        "--min_lr=3e-4",
        "--eval_interval=2",
        "--eval_iters=2",
        "--log_interval=1",
        "--mesh_data=1",
        "--mesh_fsdp=4",
        "--dcn_data=2",
    ]  # data spans the 2 processes
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = os.environ | {
        "XLA_FLAGS": os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4"),
        "JAX_PLATFORMS": "cpu",
    }
    out_dir = tmp_path / "two-processes"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "train.py",
                *flags,
                f"--out_dir={out_dir}",
                f"--process_id={i}",
                "--num_processes=2",
                f"--coordinator_address=localhost:{port}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "mesh stage=1 x data=2 x expert=1 x fsdp=4 x context=1 x tensor=1" in outputs[0]

    # Their 2 steps, then 3 more resumed in this process on 8 devices from the two-process
    # checkpoint: the 5 steps of one device.
    np.testing.assert_allclose(tensorboard_losses(out_dir), one_device[:2], rtol=0, atol=1e-5)
    one_process = sharded_config(root, 2, 4, 1)
    resumed = train.train(dataclasses.replace(one_process, out_dir=str(out_dir), init_from="resume"))
    np.testing.assert_allclose([l for _, l in resumed], one_device[2:], rtol=0, atol=1e-5)


def test_checkpoint_restores_onto_a_different_mesh(toy64, tmp_path):
    """Saved on fsdp=4 x context=2 (rows in the balanced order inside the step), resumed with
    context=1 on data x fsdp x tensor and on one device: the losses of an uninterrupted run."""
    root, straight = toy64  # 5 steps on one device
    saved = dataclasses.replace(sharded_config(root, 1, 4, 1, context=2), max_iters=2, out_dir=str(tmp_path / "saved"))
    train.train(saved)
    for name, layout in (("2x2x2", (2, 2, 2)), ("one-device", (1, 1, 1))):
        out_dir = shutil.copytree(saved.out_dir, tmp_path / name)  # each resumes from the same step-2 checkpoint
        data, fsdp, tensor = layout
        resumed = dataclasses.replace(
            saved,
            out_dir=str(out_dir),
            init_from="resume",
            max_iters=5,
            mesh_data=data,
            mesh_fsdp=fsdp,
            mesh_tensor=tensor,
            mesh_context=1,
        )
        devices = jax.devices()[: data * fsdp * tensor]
        losses = [l for _, l in train.train(resumed, devices)]
        np.testing.assert_allclose(losses, straight[2:], rtol=0, atol=1e-5)


def test_scanned_layers_keep_the_program_size_flat_in_depth(toy64):
    """With scan_layers the compiled program holds one layer whatever the depth, so compile
    time stays flat; unrolled, it grows with every layer."""
    root, _ = toy64

    def program_size(n_layer, scan_layers):
        config = dataclasses.replace(sharded_config(root, 1, 1, 1), n_layer=n_layer, scan_layers=scan_layers)
        mesh = sharding.make_mesh(devices=jax.devices()[:1])
        setup = train.make_setup(config, mesh, 64)
        batch = jax.ShapeDtypeStruct((1, config.batch_size, config.block_size), np.int32)
        with sharding.activate(mesh):
            lowered = train.jit_train_step(setup).lower(setup.abstract_state, (batch, batch))
        return len(lowered.as_text())

    assert program_size(48, True) < 1.05 * program_size(12, True)
    assert program_size(12, False) > 2 * program_size(3, False)


LLAMA_STYLE = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False, tie_embeddings=False)


def test_llama_style_model_sharded_equals_one_device(toy64):
    """RoPE, RMSNorm, SwiGLU, 2 key/value heads for 4 query heads, untied output, and dropout (the
    attention probabilities' too): tensor=2 x fsdp=4 gives one device's losses, and tensor really
    splits the key/value heads."""
    root, _ = toy64

    def setup_and_losses(data, fsdp, tensor):
        config = dataclasses.replace(sharded_config(root, data, fsdp, tensor), dropout=0.1, **LLAMA_STYLE)
        mesh = sharding.make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor])
        setup = train.make_setup(config, mesh, 64)
        state, train_step = train.init_state(setup), train.jit_train_step(setup)
        tokens, losses = dataset.open_split(config, "train", 64), []
        with sharding.activate(mesh):
            for step in range(4):
                batch = dataset.batch_for_step(tokens, config, step, "train", np.arange(config.batch_size), 1)
                state, metrics = train_step(state, tuple(jax.device_put(a, setup.micro_batch_sharding) for a in batch))
                losses.append(float(metrics["loss"]))
        return setup, losses

    _, one_device = setup_and_losses(1, 1, 1)
    setup, split = setup_and_losses(1, 4, 2)
    np.testing.assert_allclose(split, one_device, rtol=0, atol=1e-5)
    assert one_device[-1] < one_device[0] - 0.1  # it learns
    P = jax.sharding.PartitionSpec
    specs = setup.state_shardings["params"]
    weights = ("fsdp", "context")  # the model width: split over both (context is 1 here)
    assert specs["blocks"]["attn"]["qkv_kernel"].spec == P("stage", weights, None, "tensor", None)  # (L, D, G+2, K, H)
    assert specs["blocks"]["mlp"]["gate_kernel"].spec == P("stage", weights, "tensor")
    assert specs["lm_head_kernel"].spec == P(weights, "tensor")


def test_key_value_heads_that_tensor_cannot_split_or_replicate_are_one_clear_error(toy64):
    """3 key/value heads on tensor=2: neither divides the other (2 heads on tensor=4 are replicated)."""
    root, _ = toy64
    config = dataclasses.replace(sharded_config(root, 1, 1, 2), **{**LLAMA_STYLE, "n_kv_head": 3}, n_head=6, n_embd=48)
    with pytest.raises(sharding.MeshError, match="n_kv_head=3 is not divisible by mesh_tensor=2, nor"):
        train.make_setup(config, sharding.make_mesh(1, 1, 2, devices=jax.devices()[:2]), 64)


@pytest.mark.parametrize("mode, layout", [("int8", "data=2 x fsdp=2 x tensor=2"), ("fp8", "tensor=2 x fsdp=4")])
def test_quantized_step_sharded_equals_one_device(toy64, mode, layout):
    """Scales of a sharded operand (e.g. the MLP's hidden units split over `tensor`) are
    reduced across devices, so every layout quantizes as one device does: the first step's
    loss agrees to float precision. After a few updates, float sums taken in another order
    round a few values to the neighbouring 8-bit level, so later losses drift apart a little:
    within 1e-4 on AVX-512 CPUs, 1.3e-4 by the fifth fp8 step on an AVX2-only AMD Zen 3."""
    root, _ = toy64

    def losses(data, fsdp, tensor):
        config = dataclasses.replace(
            sharded_config(root, data, fsdp, tensor),
            quantization=mode,
            out_dir=str(root / f"out-{mode}-{data}-{fsdp}-{tensor}"),
        )
        return [loss for _, loss in train.train(config, jax.devices()[: data * fsdp * tensor])]

    one_device, split = losses(1, 1, 1), losses(*LAYOUTS[layout])
    np.testing.assert_allclose(split[0], one_device[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(split, one_device, rtol=1e-3)  # a few values rounded to another 8-bit level


MUON = dict(optimizer="muon", muon_learning_rate=0.03)


def muon_run(root, data, fsdp, tensor, steps=5):
    """(setup, losses, each step's gradients, final state) of `steps` Muon steps on the toy data, on that mesh."""
    config = dataclasses.replace(sharded_config(root, data, fsdp, tensor), **MUON)
    mesh = sharding.make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor])
    setup, gradients = make_setup_keeping_gradients(config, mesh, 64), []
    state, train_step = train.init_state(setup), train.jit_train_step(setup)
    tokens, losses = dataset.open_split(config, "train", 64), []
    with sharding.activate(mesh):
        for step in range(steps):
            batch = dataset.batch_for_step(tokens, config, step, "train", np.arange(config.batch_size), 1)
            state, metrics = train_step(state, tuple(jax.device_put(a, setup.micro_batch_sharding) for a in batch))
            losses.append(float(metrics["loss"]))
            gradients.append(jax.device_get(state["opt_state"].gradients))
    return setup, losses, gradients, state


@pytest.fixture(scope="module")
def muon_one_device(toy64):
    root, _ = toy64
    return muon_run(root, 1, 1, 1)


@pytest.mark.parametrize("layout", ["data=2 x fsdp=2 x tensor=2"])
def test_muon_sharded_equals_one_device(toy64, muon_one_device, layout):
    """Newton-Schulz on matrices split over fsdp and tensor (XLA adds the collectives) gives one
    device's losses and parameters; the momentum is sharded like the parameters."""
    root, _ = toy64
    _, one_losses, one_gradients, one_state = muon_one_device
    setup, losses, gradients, state = muon_run(root, *LAYOUTS[layout])
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
    assert_gradients_close(gradients[0], one_gradients[0], rtol=1e-5)  # from the same parameters
    # the AdamW half's update of a gradient within rounding of 0 goes either way: parameters compare in learning rates
    assert_near_in_learning_rates(state["params"], one_state["params"], optimizer.learning_rate(setup.config, 0))
    assert one_losses[-1] < one_losses[0] - 0.1  # it learns
    muon_state = setup.state_shardings["opt_state"].inner[1].inner_states["muon"].inner_state[0]
    qkv = lambda tree: tree["blocks"]["attn"]["qkv_kernel"]
    assert qkv(muon_state.mu) == qkv(setup.state_shardings["params"])
    assert not jax.tree.leaves(muon_state.mu["wte"])  # AdamW's: no Muon momentum for it


SPEEDRUN = dict(qk_norm=True, mlp="relu2", zero_init_proj=True, logit_softcap=15.0)


def test_speedrun_switches_sharded_equals_one_device(toy64):
    """qk_norm, the ReLU² MLP, zero-initialised projections and the logit soft-cap (on a Llama-style
    model with 2 key/value heads): tensor=2 x fsdp=4 gives one device's losses, and it learns."""
    root, _ = toy64

    def losses(data, fsdp, tensor):
        config = dataclasses.replace(
            sharded_config(root, data, fsdp, tensor),
            **{**LLAMA_STYLE, **SPEEDRUN},
            out_dir=str(root / f"out-speedrun-{data}-{fsdp}-{tensor}"),
        )
        return [loss for _, loss in train.train(config, jax.devices()[: data * fsdp * tensor])]

    one_device, split = losses(1, 1, 1), losses(1, 4, 2)
    np.testing.assert_allclose(split, one_device, rtol=0, atol=1e-5)
    assert one_device[-1] < one_device[0] - 0.1


# A mixture of experts with dropping (capacity 1.25): 4 experts, top-2, the first layer dense.
MOE = dict(n_experts=4, experts_per_token=2, capacity_factor=1.25, moe_dense_layers=1, n_layer=3, max_iters=6)


def moe_losses(root, name, architecture=None, **mesh):
    config = dataclasses.replace(
        sharded_config(root, 1, 1, 1), **MOE, **(architecture or {}), **mesh, out_dir=str(root / f"out-moe-{name}")
    )
    n_devices = math.prod(mesh.get(f"mesh_{a}", 1) for a in ("data", "fsdp", "tensor", "expert"))
    return [loss for _, loss in train.train(config, jax.devices()[:n_devices])]


@pytest.fixture(scope="module")
def moe_one_device(toy64):
    root, _ = toy64
    return {"gelu": moe_losses(root, "one-gelu"), "swiglu": moe_losses(root, "one-swiglu", LLAMA_STYLE)}


def test_moe_sharded_equals_one_device(toy64, moe_one_device):
    """Experts split over `expert` and within an expert over tensor, rows over data, tokens sent to
    them and back: the same 6 losses as one device, and it learns (swiglu on the Llama-style model;
    gelu runs on expert=4 x fsdp=2 and this layout in the checkpoint test below, 3 steps on each)."""
    root, _ = toy64
    split = moe_losses(root, "split-swiglu", LLAMA_STYLE, mesh_expert=2, mesh_tensor=2, mesh_data=2)
    np.testing.assert_allclose(split, moe_one_device["swiglu"], rtol=0, atol=1e-5)
    assert moe_one_device["swiglu"][-1] < moe_one_device["swiglu"][0] - 0.1


def test_moe_experts_are_split_and_a_checkpoint_moves_to_another_expert_layout(toy64, moe_one_device):
    """gelu experts: 3 steps on expert=4 x fsdp=2, saved, and 3 more resumed on expert=2 x tensor=2 x
    data=2 give one device's 6 losses, and it learns."""
    root, _ = toy64
    one_device = moe_one_device["gelu"]
    assert one_device[-1] < one_device[0] - 0.1
    config = dataclasses.replace(
        sharded_config(root, 1, 1, 1),
        **{**MOE, "max_iters": 3},
        mesh_expert=4,
        mesh_fsdp=2,
        out_dir=str(root / "out-moe-moved"),
    )
    setup = train.make_setup(config, sharding.mesh_from_config(config, jax.devices()), 64)
    fc = setup.state_shardings["params"]["blocks"]["mlp"]["fc_kernel"]  # (L, E, D, F)
    assert fc.spec[1] == "expert" and fc.shard_shape((2, 4, 64, 256)) == (2, 1, 32, 256)
    saved = [loss for _, loss in train.train(config, jax.devices())]
    np.testing.assert_allclose(saved, one_device[:3], rtol=0, atol=1e-5)
    resumed = dataclasses.replace(
        config, init_from="resume", max_iters=6, mesh_expert=2, mesh_fsdp=1, mesh_tensor=2, mesh_data=2
    )
    losses = [loss for _, loss in train.train(resumed, jax.devices())]
    np.testing.assert_allclose(losses, one_device[3:], rtol=0, atol=1e-5)


def test_a_mesh_that_the_torus_cannot_factor_splits_a_physical_axis(monkeypatch):
    """jax.make_mesh refuses an axis of 8 on a 4x4x4 TPU torus; the mesh is then built with a
    physical axis split (checked here by making make_mesh refuse on the CPU devices)."""

    def refuse(*args, **kwargs):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 1 of size 8")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    mesh = sharding.make_mesh(1, 2, 1, expert=4)
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "expert": 4, "fsdp": 2, "context": 1, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_document_masking_sharded_trains_on_each_document_as_if_alone(tmp_path):
    """data=2 x fsdp=2 x tensor=2, RoPE and grouped-query attention: the step's loss and gradient norm
    over rows of several documents are the documents' own, each alone on one device."""
    config = dataclasses.replace(sharded_config(tmp_path, 2, 2, 2), n_embd=32, document_masking=True, **LLAMA_STYLE)
    got, expected = masked_step_and_alone(config, sharding.make_mesh(2, 2, 2))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fsdp_reduce_once", [False, True])
def test_accumulation_with_sums_kept_apart_equals_one_device(toy64, fsdp_reduce_once):
    """data=4 x fsdp=2 with 2 micro-steps, where each data shard (and with fsdp_reduce_once each
    fsdp shard too) carries its own partial gradient sum through the micro-steps (train.per_shard),
    takes one device's step: same loss, same parameters."""
    root, _ = toy64
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (2, 2, 8, 16)).astype(np.int32)  # (inputs | targets, micro-steps, B, T)
    results = []
    for data, fsdp in ((1, 1), (4, 2)):
        config = dataclasses.replace(
            sharded_config(root, data, fsdp, 1), gradient_accumulation_steps=2, fsdp_reduce_once=fsdp_reduce_once
        )
        mesh = sharding.make_mesh(data, fsdp, 1, devices=jax.devices()[: data * fsdp])
        setup = make_setup_keeping_gradients(config, mesh, 64)
        if data > 1:
            assert train.shards_kept_apart(setup) == (("data", "fsdp") if fsdp_reduce_once else ("data",))
        with sharding.activate(setup.mesh):
            batch = tuple(jax.device_put(a, setup.micro_batch_sharding) for a in (x, y))
            state, metrics = train.jit_train_step(setup)(train.init_state(setup), batch)
        results.append(
            (state["opt_state"].gradients, state["params"], float(metrics["loss"]), float(metrics["grad_norm"]))
        )
    (one_grads, one, loss_one, norm_one), (sharded_grads, sharded, loss_sharded, norm_sharded) = results
    np.testing.assert_allclose([loss_sharded, norm_sharded], [loss_one, norm_one], rtol=1e-6)
    assert_gradients_close(sharded_grads, one_grads, rtol=1e-5)
    # Adam's first update is ~lr·sign(g): a gradient near 0 flips it, so parameters compare in learning rates
    assert_near_in_learning_rates(sharded, one, optimizer.learning_rate(setup.config, 0))


@pytest.mark.parametrize(
    "model, fsdp, context, tensor, context_attention",
    [("gpt2", 1, 8, 1, "gather"), ("llama", 2, 2, 2, "gather"), ("gpt2", 1, 8, 1, "ring"), ("llama", 2, 2, 2, "ring")],
)
def test_context_parallel_trains_on_each_document_as_if_alone(
    tmp_path, model, fsdp, context, tensor, context_attention
):
    """mesh_context splits each row's tokens (keys and values gathered, or passed round the ring): with
    document masking, the step's loss and gradient norm are the documents' own, each alone on one device
    (GPT-2 with all 8 devices on context; RoPE and grouped-query attention with context=2 x fsdp=2 x
    tensor=2)."""
    config = dataclasses.replace(
        sharded_config(tmp_path, 1, fsdp, tensor),
        n_embd=32,
        document_masking=True,
        mesh_context=context,
        context_attention=context_attention,
        **(LLAMA_STYLE if model == "llama" else {}),
    )
    mesh = sharding.make_mesh(1, fsdp, tensor, context=context)
    assert tuple(sharding.batch_sharding(mesh).spec) == (("data", "expert", "fsdp"), "context")  # tokens split
    got, expected = masked_step_and_alone(config, mesh)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_balanced_order_gives_each_context_device_the_same_causal_work():
    """Counted in numpy: with the row cut in 2 x context chunks and device i holding chunks i and
    2c-1-i, every device's queries see the same number of keys (contiguous chunks: the last
    device's see 2c-1 times the first's)."""
    T = 64
    for context in (2, 4, 8):
        order_T = attention.balanced_order(T, context)
        assert sorted(order_T) == list(range(T))
        keys_seen = (order_T + 1).reshape(context, -1).sum(1)  # query at position t sees t + 1 keys
        assert len(set(keys_seen)) == 1 and keys_seen.sum() == T * (T + 1) // 2, (context, keys_seen)
        contiguous = (np.arange(T) + 1).reshape(context, -1).sum(1)
        assert contiguous[-1] > contiguous[0]


def test_context_parallel_splits_the_activations(tmp_path):
    """The step's temporary memory (mostly activations) per device with the row's 512 tokens split over
    context=8: 0.23 of one device's (the ideal 1/8, plus gathered keys and values, the weights'
    gradients, and the balanced layout's one T/8 x T block of scores per device, where one device
    skips the score tiles above the diagonal); 0.19 with contiguous chunks, before the balance. Ring
    attention, whose scores are one T/8 x T/8 block at a time, needs less still."""

    def temp_bytes(context, context_attention="gather"):
        config = small_config(
            tmp_path,
            block_size=512,
            batch_size=1,
            mesh_data=1,
            mesh_context=context,
            context_attention=context_attention,
        )
        mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:context], context=context)
        setup = train.make_setup(config, mesh, 64)
        return train.lower(setup).compile().memory_analysis().temp_size_in_bytes

    gathered = temp_bytes(8)
    assert gathered < 0.25 * temp_bytes(1)
    assert temp_bytes(8, "ring") < 0.7 * gathered
