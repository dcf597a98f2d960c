"""The pre-flight memory check (memory.py): a step that cannot fit is refused before it runs."""

import json
import os
import subprocess
import sys

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


PEAK_SCRIPT = r"""
import json, resource, sys
import jax, numpy as np
import memory, train
from configurator import Config
config = Config(n_layer=4, n_head=4, n_embd=256, block_size=256, batch_size=16, vocab_size=4096)
setup = train.make_setup(config, train.make_mesh(config, jax.devices()[:1]), 4096)
step = train.lower(setup).compile()
estimate = memory.needed([step], "cpu")
# the high-water mark after the compile: what the state and the step allocate lifts it
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
state = train.init_state(setup)
x = jax.device_put(np.zeros((1, 16, 256), np.int32), setup.micro_batch_sharding)
state, _ = step(state, (x, x))
jax.block_until_ready(state)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"estimate": estimate, "measured": peak - before}))
"""


def test_the_estimate_is_within_2x_of_the_measured_peak_on_cpu():
    """What XLA says the step needs against how far the process's peak resident memory rose while
    it created the state and ran one step (in a fresh process, one CPU device; ~0.8 GiB: large
    next to the runtime's own ~0.5 GiB, so the allocator's slack is a small share)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    # Twice: the first run fills the compilation cache (conftest's), so the second loads the program
    # and its compile's own peak does not hide the state's and the step's.
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.returncode == 0, out.stderr[-2000:]
    numbers = json.loads(out.stdout.strip().splitlines()[-1])
    assert numbers["estimate"] / 2 <= numbers["measured"] <= numbers["estimate"] * 2, numbers
