"""The pre-flight memory check (devices/memory.py): a step that cannot fit is refused before it runs."""

import json
import os
import subprocess
import sys

import pytest
from test_train import make_dataset, small_config

import configurator
import train
from devices import memory

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


# Run in a fresh process, so that nothing else in it allocates: the step's need, and how far one step
# (the first after compiling) raises the process's peak resident memory.
MEASURE_ONE_STEP = """
import json, jax, bench, configurator, memory, train
config = configurator.Config(n_layer=1, n_embd=128, n_head=4, block_size=256, batch_size=8, vocab_size=8192,
                             mesh_data=1, attention="einsum")
setup = train.make_setup(config, train.make_mesh(config, jax.devices()[:1]), 8192)
step = train.jit_train_step(setup).lower(setup.abstract_state, bench.random_batch(setup, 8192)).compile()
state, batch = train.init_state(setup), bench.random_batch(setup, 8192)
status = lambda field: int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # Linux: the peak RSS starts again from the current RSS
before = status("VmRSS:")
jax.block_until_ready(step(state, batch))
print(json.dumps({"need": memory.needed([step], "cpu"), "grown": status("VmHWM:") - before,
                  "arguments": sum(a.nbytes for a in jax.tree.leaves((state, batch)))}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_the_estimate_of_a_small_step_is_within_2x_of_its_measured_peak():
    """The need devices/memory.py checks (XLA's arguments + outputs + temporaries) against the memory the step
    really holds at its peak: its arguments (the state and batch, resident before it starts) plus
    what the process's peak RSS grows by while it runs. The step's temporaries (~220 MiB: the
    logits of 8 x 256 tokens over 8,192 ids and their gradient) dominate both."""
    flags = os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", MEASURE_ONE_STEP], capture_output=True, text=True, cwd=root,
                         env=os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.splitlines()[-1])
    measured = m["arguments"] + m["grown"]
    assert m["grown"] > 100 * 2**20, m  # the step's own memory, not noise
    assert 0.5 < m["need"] / measured < 2, m
