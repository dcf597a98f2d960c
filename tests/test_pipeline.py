"""Tests of layers/pipeline.py: the pipeline schedule, pipelined training equal to one device, and host offload."""

import dataclasses
import math
import types

import jax
import numpy as np
import pytest
from test_train import make_dataset, masked_step_and_alone, small_config

import configurator
import model
import sharding
import train
from layers import pipeline


@pytest.mark.parametrize("stages, microbatches, n_repeats", [(2, 4, 1), (4, 4, 1), (4, 8, 1), (2, 4, 4), (4, 4, 2)])
def test_schedule_runs_every_item_once_in_order_with_the_textbook_bubble(stages, microbatches, n_repeats):
    work = pipeline.schedule(stages, microbatches, n_repeats)
    items = n_repeats * microbatches
    for s in range(stages):  # each stage does every item once, in order
        assert list(work[:, s][work[:, s] >= 0]) == list(range(items))
    tick_of = {(s, i): t for t, row in enumerate(work) for s, i in enumerate(row) if i >= 0}
    for i in range(items):
        for s in range(1, stages):  # a stage works on what the stage before it finished
            assert tick_of[(s, i)] > tick_of[(s - 1, i)]
        if i >= microbatches:  # the next repeat starts after the last stage finished the last one
            assert tick_of[(0, i)] > tick_of[(stages - 1, i - microbatches)]
    assert pipeline.bubble_fraction(stages, microbatches, n_repeats) == pytest.approx(
        (stages - 1) / (n_repeats * microbatches + stages - 1)
    )


MOE = dict(n_experts=4, experts_per_token=2, capacity_factor=0.0)


@pytest.mark.parametrize(
    "stages, microbatches, layers_per_stage, experts", [(2, 4, 0, {}), (4, 4, 1, {}), (2, 2, 1, MOE)]
)
def test_pipelined_forward_equals_the_plain_stack(stages, microbatches, layers_per_stage, experts):
    """On one device: the same logits; a mixture of experts' router stats are the micro-batches'
    own, averaged (the balance loss, a product of two means, is each micro-batch's, as with
    gradient accumulation)."""
    config = model.GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=32, **experts)
    idx = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    plain = model.GPT(config, jax.random.key(0))
    logits, stats = plain.forward(idx)
    if experts:  # micro-batch m holds rows m, m + M, ...
        stats = jax.tree.map(
            lambda *each: sum(each) / microbatches,
            *[plain.forward(idx[m::microbatches])[1] for m in range(microbatches)],
        )
    piped = dataclasses.replace(
        config, pipeline_stages=stages, pipeline_microbatches=microbatches, layers_per_stage=layers_per_stage
    )
    piped_logits, piped_stats = jax.jit(lambda i: model.GPT(piped, jax.random.key(0)).forward(i))(idx)
    np.testing.assert_allclose(piped_logits, logits, rtol=0, atol=1e-5)
    assert stats.keys() == piped_stats.keys() and (not experts or stats["load"].shape == (8, 4))
    for name in stats:
        np.testing.assert_allclose(piped_stats[name], stats[name], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- training on 8 CPU devices

LAYOUTS = {  # name -> mesh and pipeline keys; 8 layers, batch 8
    "stage=2 x fsdp=2 x tensor=2, GPipe": dict(mesh_stage=2, mesh_fsdp=2, mesh_tensor=2, pipeline_microbatches=4),
    "stage=2 x fsdp=2 x tensor=2, circular": dict(
        mesh_stage=2, mesh_fsdp=2, mesh_tensor=2, pipeline_microbatches=4, layers_per_stage=2
    ),
    "stage=4 x data=2, GPipe": dict(mesh_stage=4, mesh_data=2, pipeline_microbatches=4),
    "stage=4 x data=2, circular": dict(mesh_stage=4, mesh_data=2, pipeline_microbatches=4, layers_per_stage=1),
}


def config_for(root, name, **keys):
    base = small_config(
        root, n_embd=64, n_head=4, n_layer=8, max_iters=6, eval_interval=1000, out_dir=str(root / name), mesh_data=1
    )
    return dataclasses.replace(base, **keys)


def losses(config):
    n = math.prod(getattr(config, f"mesh_{axis}") for axis in sharding.MESH_AXES)
    return [loss for _, loss in train.train(config, jax.devices()[:n])]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    make_dataset(root / "data", vocab_size=64)
    return root, losses(config_for(root, "one-device"))


# The other two layouts run in test_a_checkpoint_moves_between_stage_counts.
@pytest.mark.parametrize("layout", ["stage=2 x fsdp=2 x tensor=2, circular", "stage=4 x data=2, GPipe"])
def test_pipelined_training_equals_one_device(one_device, layout):
    root, reference = one_device
    np.testing.assert_allclose(losses(config_for(root, layout, **LAYOUTS[layout])), reference, rtol=0, atol=1e-5)
    assert reference[-1] < reference[0] - 0.1


def test_a_checkpoint_moves_between_stage_counts(one_device):
    """Saved by 2 stages, resumed on one device, then on 4 stages: the uninterrupted losses."""
    root, reference = one_device
    chain = [(2, LAYOUTS["stage=2 x fsdp=2 x tensor=2, GPipe"]), (4, {}), (6, LAYOUTS["stage=4 x data=2, circular"])]
    got = []
    for max_iters, keys in chain:
        config = config_for(root, "moved", max_iters=max_iters, init_from="resume" if got else "scratch", **keys)
        got += losses(config)
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5)


def test_pipelined_experts_split_over_expert_and_fsdp_equal_the_pipeline_alone(one_device):
    """A mixture of experts (capacity 1.25) through 2 stages: its experts split 2 ways and its
    batch 2 more give the losses of the two stages alone (both pipelined: the balance loss is
    the micro-batches' own)."""
    root, _ = one_device
    moe = dict(n_layer=4, n_experts=4, experts_per_token=2, capacity_factor=1.25, mesh_stage=2, pipeline_microbatches=2)
    alone = losses(config_for(root, "moe-stages", **moe))
    split = losses(config_for(root, "moe-split", **moe, mesh_expert=2, mesh_fsdp=2))
    np.testing.assert_allclose(split, alone, rtol=0, atol=1e-5)
    assert alone[-1] < alone[0] - 0.1


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(mesh_stage=3), "n_layer=8 is not divisible by mesh_stage=3"),
        (dict(mesh_stage=2, layers_per_stage=3), "layers_per_stage=3: n_layer=8 is not a multiple of"),
        (
            dict(mesh_stage=4, layers_per_stage=1, pipeline_microbatches=2),
            "needs pipeline_microbatches >= mesh_stage=4",
        ),
        (
            dict(mesh_stage=2, mesh_data=2, pipeline_microbatches=8),
            "batch_size=8 can't be cut into pipeline_microbatches=8",
        ),
    ],
)
def test_a_pipeline_that_does_not_fit_is_one_clear_error(tmp_path, keys, message):
    config = config_for(tmp_path, "bad", **keys)
    n = math.prod(getattr(config, f"mesh_{axis}") for axis in sharding.MESH_AXES)
    with pytest.raises(sharding.MeshError, match=message):
        train.make_setup(config, sharding.mesh_from_config(config, jax.devices()[:n]), 64)


def test_pipeline_with_dense_first_layers_is_refused():
    with pytest.raises(configurator.ConfigError, match="moe_dense_layers=1 makes two"):
        configurator.Config(mesh_stage=2, n_experts=4, moe_dense_layers=1)


# ---------------------------------------------------------------------- host offload


@pytest.mark.parametrize("offload", ["optimizer", "params_and_optimizer"])
def test_offloaded_state_lives_on_the_host_and_trains_like_one_device(one_device, offload):
    root, reference = one_device
    config = config_for(root, f"offload-{offload}", mesh_fsdp=8, offload=offload)
    np.testing.assert_allclose(losses(config), reference, rtol=0, atol=1e-5)
    setup = train.make_setup(config, sharding.mesh_from_config(config), 64)
    state = train.init_state(setup)
    state, _ = train.jit_train_step(setup)(state, tuple(np.zeros((2, 1, 8, 16), np.int32)))
    kinds = {name: {a.sharding.memory_kind for a in jax.tree.leaves(state[name])} for name in ("params", "opt_state")}
    assert kinds == {
        "params": {"pinned_host" if offload == "params_and_optimizer" else "device"},
        "opt_state": {"pinned_host"},
    }
    resumed = dataclasses.replace(config, init_from="resume", max_iters=8, offload="none")  # back on the device
    assert len(losses(resumed)) == 2


def test_offload_without_host_memory_is_one_clear_error():
    device = types.SimpleNamespace(platform="gpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    mesh = types.SimpleNamespace(devices=np.array([device]))
    with pytest.raises(configurator.ConfigError, match="offload='optimizer' keeps state in the host's pinned memory"):
        train.offloaded_parts(configurator.Config(offload="optimizer"), mesh)


def test_pipelined_packed_rows_equal_the_plain_stack_circular():
    """Segment ids follow their rows into the micro-batches (m holds rows m, m + M, ...; each row packed
    differently here) through the circular schedule: the same logits as the plain stack's."""
    config = model.GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, pos_embedding="rope")
    idx = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    ids = np.cumsum(np.arange(16)[None] % np.array([[3], [5], [16], [7]]) == 0, axis=1)
    piped = dataclasses.replace(config, pipeline_stages=2, pipeline_microbatches=2, layers_per_stage=1)
    forward = lambda c, segments: model.GPT(c, jax.random.key(0))(idx, segment_ids_BxT=segments)
    plain, piped, unsegmented = jax.jit(lambda: (forward(config, ids), forward(piped, ids), forward(config, None)))()
    np.testing.assert_allclose(piped, plain, rtol=0, atol=1e-5)
    assert np.abs(unsegmented - plain).max() > 1e-3


def test_document_masking_pipelined_and_sharded_trains_on_each_document_as_if_alone(tmp_path):
    """stage=2 x fsdp=2 x tensor=2 (GPipe, 4 micro-batches): the step's loss and gradient norm over rows
    of several documents are the documents' own, each alone on one device."""
    config = small_config(
        tmp_path,
        n_head=4,
        mesh_stage=2,
        mesh_fsdp=2,
        mesh_tensor=2,
        mesh_data=1,
        pipeline_microbatches=4,
        document_masking=True,
    )
    got, expected = masked_step_and_alone(config, sharding.mesh_from_config(config))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
