import math

import jax
import numpy as np
import pytest

import sharding
import train
from test_train import make_dataset, small_config

LAYOUTS = {  # (data, fsdp, tensor)
    "data=8": (8, 1, 1),
    "fsdp=8": (1, 8, 1),
    "tensor=2 x fsdp=4": (1, 4, 2),
    "data=2 x fsdp=2 x tensor=2": (2, 2, 2),
}


def sharded_config(tmp_path, data, fsdp, tensor):
    # vocab 64 and width 64 divide evenly, so every named axis really is split
    return small_config(tmp_path, mesh_data=data, mesh_fsdp=fsdp, mesh_tensor=tensor,
                        n_embd=64, n_head=4, max_iters=5, eval_interval=1000,
                        out_dir=str(tmp_path / f"out-{data}-{fsdp}-{tensor}"))


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


def test_fsdp_stores_an_eighth_of_the_parameters_per_device(toy64):
    root, _ = toy64
    config = sharded_config(root, 1, 8, 1)
    mesh = sharding.make_mesh(1, 8, 1)
    state = train.init_state(train.make_setup(config, mesh, 64))
    leaves = jax.tree_util.tree_leaves_with_path(state["params"])
    total = sum(a.nbytes for _, a in leaves)
    per_device = sum(a.addressable_shards[0].data.nbytes for _, a in leaves)
    replicated = {jax.tree_util.keystr(p) for p, a in leaves if a.sharding.is_fully_replicated}
    # Only the width-n_embd vectors (layer norms and output biases) are replicated on purpose.
    assert replicated == {"['blocks']['attn']['out_bias']", "['blocks']['mlp']['proj_bias']",
                          "['blocks']['ln_1']['scale']", "['blocks']['ln_1']['bias']",
                          "['blocks']['ln_2']['scale']", "['blocks']['ln_2']['bias']",
                          "['ln_f']['scale']", "['ln_f']['bias']",
                          "['blocks']['attn']['qkv_bias']", "['blocks']['mlp']['fc_bias']"}
    replicated_bytes = sum(a.nbytes for p, a in leaves if jax.tree_util.keystr(p) in replicated)
    assert per_device == (total - replicated_bytes) // 8 + replicated_bytes
    assert replicated_bytes < 0.02 * total
    opt_leaves = jax.tree.leaves(state["opt_state"])
    assert sum(a.addressable_shards[0].data.nbytes for a in opt_leaves) < 0.15 * sum(
        a.nbytes for a in opt_leaves)  # Adam moments are sharded like the parameters


@pytest.mark.parametrize("shape, n_devices, expected", [
    ((-1, 1, 1), 8, (8, 1, 1)), ((2, -1, 2), 8, (2, 2, 2)), ((1, 4, 2), 8, (1, 4, 2)),
])
def test_resolve_mesh_shape(shape, n_devices, expected):
    assert sharding.resolve_mesh_shape(*shape, n_devices) == expected


@pytest.mark.parametrize("shape, message", [
    ((2, 2, 1), "= 4 devices, but there are 8"),
    ((-1, -1, 1), "only one of"),
    ((3, -1, 1), "8 devices are not divisible by 3"),
])
def test_bad_mesh_shapes_name_the_numbers(shape, message):
    with pytest.raises(sharding.MeshError, match=message):
        sharding.resolve_mesh_shape(*shape, 8)


def test_model_that_does_not_fit_the_mesh(toy64):
    mesh = sharding.make_mesh(1, 2, 4)
    with pytest.raises(sharding.MeshError, match="n_head=2 is not divisible by mesh_tensor=4"):
        sharding.check_model_fits_mesh(mesh, n_head=2, n_embd=64, batch_size=8)
    with pytest.raises(sharding.MeshError, match="batch_size=5 is not divisible by mesh_data x mesh_fsdp"):
        sharding.check_model_fits_mesh(mesh, n_head=4, n_embd=64, batch_size=5)
