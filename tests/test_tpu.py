"""On the TPU chip (issue 51): training, decoding, checkpoints and the memory verdict, each against
the CPU or against XLA:TPU itself. Skipped elsewhere; on a TPU VM, in one process (one program
holds the chip):

    NANOMAX_TEST_PLATFORM=tpu python -m pytest -n 0 -m tpu

The CPU's side runs in a subprocess with JAX_PLATFORMS=cpu, since this process holds the chip.
"""

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_train import make_dataset, small_config

import bench
import configurator
import train
from devices import memory
from inference import generate, loader

pytestmark = pytest.mark.tpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, RESUMED_STEPS = 20, 4
PROMPTS, NEW_TOKENS = [[1, 2, 3, 4, 5], [40, 41, 42]], 24

# The CPU's side: the same run from scratch; the chip's checkpoint restored (its parameters and a
# greedy decode from it); that checkpoint resumed for a few steps, written on the CPU.
ON_CPU = """
import dataclasses, json, sys
import jax, numpy as np
import train
from configurator import Config
from inference import generate, loader

args = json.loads(sys.argv[1])
config = Config(**args["config"])
flat = lambda params: {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
losses = [loss for _, loss in train.train(dataclasses.replace(config, out_dir=args["cpu_out_dir"]))]
setup, params, step, _ = loader.load_checkpoint(config.out_dir)
np.savez(args["restored"], **flat(params))
greedy = generate.generate(setup, params, args["prompts"], args["new_tokens"], temperature=0).tokens
train.train(dataclasses.replace(config, init_from="resume", max_iters=config.max_iters + args["resumed_steps"]))
_, resumed, resumed_step, _ = loader.load_checkpoint(config.out_dir)
np.savez(args["resumed"], **flat(resumed))
print(json.dumps({"platform": jax.devices()[0].platform, "losses": losses, "restored_step": step,
                  "greedy": [list(map(int, t)) for t in greedy], "resumed_step": resumed_step}))
"""


def flat(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


@pytest.fixture(scope="module")
def chip_run(tmp_path_factory):
    """A short float32 run trained on the chip (its matmuls in bf16 passes, XLA:TPU's default), its
    losses and its checkpoint's parameters as restored on the chip."""
    root = tmp_path_factory.mktemp("tpu")
    make_dataset(root / "data")
    config = small_config(
        root,
        n_layer=2,
        n_head=4,
        n_embd=128,
        block_size=64,
        batch_size=16,
        max_iters=STEPS,
        lr_decay_iters=STEPS,
        eval_interval=1000,
        eval_iters=1,
        dtype="float32",
    )
    assert jax.devices()[0].platform == "tpu"
    losses = [loss for _, loss in train.train(config)]
    setup, params, step, _ = loader.load_checkpoint(config.out_dir)
    assert step == STEPS
    return config, losses, setup, params


@pytest.fixture(scope="module")
def cpu_side(chip_run, tmp_path_factory):
    config = chip_run[0]
    where = tmp_path_factory.mktemp("cpu")
    args = {
        "config": dataclasses.asdict(config),
        "cpu_out_dir": str(where / "out"),
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "resumed_steps": RESUMED_STEPS,
        "restored": str(where / "restored.npz"),
        "resumed": str(where / "resumed.npz"),
    }
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    done = subprocess.run(
        [sys.executable, "-c", ON_CPU, json.dumps(args)], capture_output=True, text=True, cwd=REPO, env=env, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["platform"] == "cpu"
    return result | {"restored": dict(np.load(args["restored"])), "resumed": dict(np.load(args["resumed"]))}


def test_training_losses_on_the_chip_match_the_cpus_within_bf16_tolerance(chip_run, cpu_side):
    _, chip_losses, _, _ = chip_run
    cpu_losses = cpu_side["losses"]
    assert len(chip_losses) == len(cpu_losses) == STEPS
    assert cpu_losses[-1] < cpu_losses[0] - 0.3  # it learns: the comparison is not of a flat line
    # a few bf16 roundings (2^-8 each) apart: XLA:TPU multiplies float32 matrices in bf16 passes
    np.testing.assert_allclose(chip_losses, cpu_losses, rtol=2e-2)


def test_a_checkpoint_written_on_the_chip_restores_on_the_cpu_and_back(chip_run, cpu_side):
    config, _, _, chip_params = chip_run
    assert cpu_side["restored_step"] == STEPS
    chip = flat(chip_params)
    assert chip.keys() == cpu_side["restored"].keys()
    for key, value in chip.items():  # bit for bit: a checkpoint moves bytes, not numbers
        np.testing.assert_array_equal(cpu_side["restored"][key], value, err_msg=key)
    # and back: the CPU resumed the chip's run and saved; the chip restores what the CPU wrote
    assert cpu_side["resumed_step"] == STEPS + RESUMED_STEPS
    _, resumed, step, _ = loader.load_checkpoint(config.out_dir)
    assert step == STEPS + RESUMED_STEPS
    resumed = flat(resumed)
    assert any(not np.array_equal(resumed[k], chip[k]) for k in chip)  # the CPU's steps changed them
    for key, value in resumed.items():
        np.testing.assert_array_equal(value, cpu_side["resumed"][key], err_msg=key)


def test_greedy_decode_on_the_chip_equals_the_cpus(chip_run, cpu_side):
    _, _, setup, params = chip_run
    with jax.default_matmul_precision("highest"):  # float32 products, as the CPU computes them
        tokens = generate.generate(setup, params, PROMPTS, NEW_TOKENS, temperature=0).tokens
    assert [list(map(int, t)) for t in tokens] == cpu_side["greedy"]
    assert all(len(t) == NEW_TOKENS for t in tokens)


# A step big enough for its temporaries to be most of its need (the logits of 16 x 512 tokens
# over 8,192 ids, two layers' activations), small enough to compile in seconds.
MEDIUM = dict(
    n_layer=2,
    n_head=8,
    n_embd=512,
    block_size=512,
    batch_size=16,
    gradient_accumulation_steps=1,
    vocab_size=8192,
    dtype="bfloat16",
    remat_policy="none",
    mesh_data=1,
)


def allocator_bytes(device) -> tuple[int, int]:
    """(bytes in use now, the most ever in use) by the device's allocator: the process's, not a step's."""
    stats = device.memory_stats()
    return stats["bytes_in_use"], stats["peak_bytes_in_use"]


def test_a_step_that_fits_prints_its_compiled_need_and_its_real_peak_is_within_15_percent(capsys):
    """The real peak is the allocator's (the state, the batch, the outputs) plus the temporaries that
    XLA:TPU reserves outside it (bench.step_peak_memory). The allocator's counters are the process's (the
    chip's tests share one): what earlier tests left in use is subtracted, so the order doesn't matter."""
    devices = jax.devices()[:1]
    gc.collect()  # arrays of earlier tests that only a cycle keeps
    in_use_before, peak_before = allocator_bytes(devices[0])
    step = bench.TrainBench(configurator.Config(**MEDIUM), devices)
    printed = capsys.readouterr().out
    m = step.step.memory_analysis()
    compiled = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    need = step.memory_check["needed_bytes"]
    assert f"memory: the train step needs {memory.size(need)} per device of " in printed, printed
    assert abs(need / compiled - 1) < 0.15, (need, compiled)
    step.run(3)
    in_use, peak_after = allocator_bytes(devices[0])
    # Above the high-water mark of before, all of the new one is this step's. Below it, the counter can't
    # tell: what the step holds once it has run (donated state, batch, outputs) is its allocator peak.
    allocator_peak = (peak_after if peak_after > peak_before else in_use) - in_use_before
    peak = allocator_peak + m.temp_size_in_bytes
    with capsys.disabled():
        print(
            f"\n{printed.strip()}\ncompiled {compiled / 2**20:,.1f} MiB; real peak {peak / 2**20:,.1f} MiB "
            f"(allocator {allocator_peak / 2**20:,.1f} MiB + temporaries {m.temp_size_in_bytes / 2**20:,.1f} MiB); "
            f"in use before {in_use_before / 2**20:,.1f} MiB, peak before {peak_before / 2**20:,.1f} MiB, "
            f"after {peak_after / 2**20:,.1f} MiB"
        )
    assert abs(peak / compiled - 1) < 0.15, (peak, compiled, allocator_peak, in_use_before, peak_before, peak_after)
    del step
    # the need moves with the remat policy, as the step's real need does
    full = bench.TrainBench(configurator.Config(**MEDIUM | dict(remat_policy="full")), devices)
    assert full.memory_check["needed_bytes"] < 0.95 * need, (full.memory_check["needed_bytes"], need)


def test_gpt2_124m_at_batch_16_scanned_without_remat_is_refused_in_one_line(monkeypatch, capsys):
    """Its layers scanned (the config writes them out) it needs more than the chip's ~16 GiB: the scan
    stacks every layer's saved activations. Either XLA:TPU refuses to compile it (its message's
    bytes are the need) or it compiles and its memory analysis is the need: both routes end in the
    pre-flight check's one line with the need and the remedies (the route has moved with the
    attention's layout: XLA refused it at 620015b, it compiles at 6dc2d3a)."""
    messages = []
    refusal = memory.refusal
    monkeypatch.setattr(
        memory, "refusal", lambda what, message, *a: messages.append(message) or refusal(what, message, *a)
    )
    argv = [
        os.path.join(REPO, "config", "gpt2_124m.py"),
        "--batch_size=16",
        "--gradient_accumulation_steps=1",
        "--scan_layers=True",
        "--remat_policy=none",
        "--json=",
    ]
    with pytest.raises(configurator.ConfigError) as refused:
        bench.run(argv)
    line = str(refused.value)
    with capsys.disabled():
        print("\nbench.py", *argv[1:], "->", line, sep="\n")
        if messages:
            print("XLA's message began:", *messages[0].splitlines()[:14], sep="\n")
    assert "\n" not in line, line
    found = re.fullmatch(
        r"memory: the train step needs ([\d.]+) GiB per device, more than the ([\d.]+) GiB "
        r"(?:of (?:hbm|memory) )?available \((?:XLA:TPU refused it: RESOURCE_EXHAUSTED|"
        r"TPU v5 lite's memory limit)\); try (.*)",
        line,
    )
    assert found, line
    assert float(found.group(1)) > float(found.group(2)) > 10  # the chip's ~16 GiB, and more than it
    assert "--remat_policy=dots_with_no_batch_dims_saveable" in found.group(3)
    assert "--batch_size=8 --gradient_accumulation_steps=2" in found.group(3)
