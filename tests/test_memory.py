"""The pre-flight memory check (memory.py): a step that cannot fit is refused before it runs."""

import os

import pytest

import configurator
import memory
import train
from test_train import make_dataset, small_config

# activations dominate this step, so halving the micro-batch halves most of what it needs
BIG_BATCH = dict(block_size=128, batch_size=16, max_iters=1, eval_iters=1, eval_interval=1)


def step_need(config) -> int:
    setup = train.make_setup(config, train.make_mesh(config), 65)
    return memory.needed([train.lower(setup).compile()], "cpu")


@pytest.fixture(scope="module")
def toy_and_limit(tmp_path_factory):
    """A dataset, and a limit between the needs of the big-batch step and its accumulated twin."""
    root = tmp_path_factory.mktemp("memory")
    make_dataset(root / "data")
    big = step_need(small_config(root, **BIG_BATCH))
    small = step_need(small_config(root, **BIG_BATCH | dict(batch_size=8, gradient_accumulation_steps=2)))
    assert small < big  # the premise: a smaller micro-batch needs less
    return root, (big + small) / 2 / (1 << 30)  # per device, as memory_limit_gib is


def test_a_step_over_the_limit_is_refused_before_it_runs_and_accumulation_fits(toy_and_limit, capsys):
    root, limit_gib = toy_and_limit
    config = small_config(root, **BIG_BATCH, memory_limit_gib=limit_gib)
    with pytest.raises(configurator.ConfigError) as refused:
        train.train(config)
    message = str(refused.value)
    assert "\n" not in message and "needs" in message and "available" in message
    assert "--gradient_accumulation_steps=2" in message and "--memory_check=False" in message
    assert not os.path.exists(config.out_dir)  # refused before anything was written

    accumulated = small_config(root / "acc", **BIG_BATCH | dict(batch_size=8, gradient_accumulation_steps=2),
                               data_dir=config.data_dir, memory_limit_gib=limit_gib)
    assert train.train(accumulated)
    assert "memory: the train step needs" in capsys.readouterr().out

    # and the check can be skipped
    unchecked = small_config(root / "unchecked", **BIG_BATCH, data_dir=config.data_dir,
                             memory_limit_gib=limit_gib, memory_check=False)
    assert train.train(unchecked)
