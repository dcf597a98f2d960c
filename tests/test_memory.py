"""The pre-flight memory check (devices/memory.py): a step that cannot fit is refused before it runs."""

import json
import os
import subprocess
import sys

import jax
import pytest
from test_hf import random_hf_gpt2, write_hf_gpt2
from test_train import make_dataset, small_config

import configurator
import sharding
import train
from devices import memory

# activations dominate this step, so halving the micro-batch halves most of what it needs
BIG_BATCH = dict(block_size=128, batch_size=16, max_iters=1, eval_iters=1, eval_interval=1)


def step_need(config) -> int:
    setup = train.make_setup(config, sharding.mesh_from_config(config), 65)
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

    accumulated = small_config(
        root / "acc",
        **BIG_BATCH | dict(batch_size=8, gradient_accumulation_steps=2),
        data_dir=config.data_dir,
        memory_limit_gib=limit_gib,
    )
    assert train.train(accumulated)
    assert "memory: the train step needs" in capsys.readouterr().out

    # and the check can be skipped
    unchecked = small_config(
        root / "unchecked", **BIG_BATCH, data_dir=config.data_dir, memory_limit_gib=limit_gib, memory_check=False
    )
    assert train.train(unchecked)


# Run in a fresh process, so that nothing else in it allocates: the step's need, and how far one step
# (the first after compiling) raises the process's peak resident memory.
MEASURE_ONE_STEP = """
import json, jax, bench, configurator, sharding, train
from devices import memory
config = configurator.Config(n_layer=1, n_embd=128, n_head=4, block_size=256, batch_size=8, vocab_size=8192,
                             mesh_data=1, attention="einsum")
setup = train.make_setup(config, sharding.mesh_from_config(config, jax.devices()[:1]), 8192)
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
    out = subprocess.run(
        [sys.executable, "-c", MEASURE_ONE_STEP],
        capture_output=True,
        text=True,
        cwd=root,
        env=os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.splitlines()[-1])
    measured = m["arguments"] + m["grown"]
    assert m["grown"] > 100 * 2**20, m  # the step's own memory, not noise
    assert 0.5 < m["need"] / measured < 2, m


# ----------------------------------------------------------------------------- when XLA refuses

# XLA's RESOURCE_EXHAUSTED messages as its compilers and allocators write them (abridged).
TPU_USED_AND_TOTAL = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 26.52G of "
    "15.75G hbm. Exceeded hbm capacity by 10.77G.\n\nTotal hbm usage >= 27.02G:\n    reserved        258.00M\n"
    "    program          26.52G\n    arguments       505.43M\n\nOutput size 505.43M; shares 505.43M with "
    "arguments.\n\nProgram hbm requirement 26.52G:\n    global            3.65M\n    scoped            4.50M\n"
    "    HLO temp         26.51G (100.0% utilization: Unpadded (25.21G) Padded (25.21G), 0.0% fragmentation (0B))\n"
)
# as XLA:TPU (jax 0.10.2, a v5e) refused GPT-2 124M at batch 16 without remat, 2026-12-05
TPU_TEMPORARIES = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
    "(26.52G) exceeds available HBM (15.75G)."
)
GPU_ALLOCATION = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28472983552 bytes."
GPU_REQUEST = "RESOURCE_EXHAUSTED: Failed to allocate request for 1.23GiB (1318976384B) on device ordinal 0"
TPU_VMEM = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. "
    "Used 32.42M of 16.00M vmem. Exceeded vmem capacity by 16.42M"
)
G, M = 1 << 30, 1 << 20


@pytest.mark.parametrize(
    "message, sizes",
    [
        (
            TPU_USED_AND_TOTAL,
            {"space": "hbm", "total": int(27.02 * G), "used": int(26.52 * G), "capacity": int(15.75 * G)},
        ),
        (TPU_TEMPORARIES, {"space": "hbm", "temporaries": int(26.52 * G), "capacity": int(15.75 * G)}),
        (GPU_ALLOCATION, {"allocation": 28472983552}),
        (GPU_REQUEST, {"allocation": 1318976384}),
        (TPU_VMEM, {"space": "vmem", "used": int(32.42 * M), "capacity": 16 * M}),
        ("RESOURCE_EXHAUSTED: something else entirely", {}),
    ],
)
def test_xla_out_of_memory_messages_are_read_in_bytes(message, sizes):
    assert memory.parse_out_of_memory(message) == sizes


class FakeDevice:
    platform, device_kind = "tpu", "TPU v5 lite"

    def memory_stats(self):
        return {"bytes_limit": int(15.75 * G)}


@pytest.mark.parametrize(
    "message, line",
    [
        (
            TPU_USED_AND_TOTAL,
            "memory: the train step needs 27.02 GiB per device, more than the 15.75 GiB of hbm "
            "available (XLA:TPU refused it: RESOURCE_EXHAUSTED); try --batch_size=8",
        ),
        # the temporaries alone, so the program's arguments (1 GiB here) are added
        (
            TPU_TEMPORARIES,
            "memory: the train step needs 27.52 GiB per device, more than the 15.75 GiB of hbm available",
        ),
        (
            GPU_ALLOCATION,
            "memory: the train step needs at least 27.52 GiB per device, more than the 15.75 GiB of memory",
        ),
        (
            "RESOURCE_EXHAUSTED: something else entirely",
            "memory: the train step does not fit the device (XLA:TPU: "
            "RESOURCE_EXHAUSTED: something else entirely); try --batch_size=8",
        ),
    ],
)
def test_the_refusal_names_what_xla_says_is_needed(message, line):
    refused = memory.refusal("the train step", message, [FakeDevice()], ["--batch_size=8"], arguments=G)
    assert isinstance(refused, memory.DoesNotFit) and "\n" not in str(refused)  # as the check's own refusal
    assert str(refused).startswith(line), str(refused)


def fake_out_of_memory(monkeypatch, message=TPU_USED_AND_TOTAL):
    """Every compile ends as XLA:TPU's does for a program that cannot fit."""

    def compile_(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError(message)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)


def test_a_step_xla_cannot_compile_is_refused_before_anything_is_written(toy_and_limit, monkeypatch):
    root, _ = toy_and_limit
    config = small_config(root / "refused", **BIG_BATCH, data_dir=str(root / "data"))
    fake_out_of_memory(monkeypatch)
    with pytest.raises(configurator.ConfigError) as refused:
        train.train(config)
    assert str(refused.value).startswith(
        "memory: the train step needs 27.02 GiB per device, more than the 15.75 GiB "
        "of hbm available (XLA:CPU refused it: RESOURCE_EXHAUSTED); try "
    )
    assert "--batch_size=8 --gradient_accumulation_steps=2" in str(refused.value)
    assert not os.path.exists(config.out_dir)
    # an error of another kind is not an out-of-memory: it stays as it is
    fake_out_of_memory(monkeypatch, "INTERNAL: something broke")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something broke"):
        train.train(config)


# A command run with every compile failing as XLA:TPU fails for a program too big for the chip.
WITH_FAKE_OOM = """
import runpy, sys, jax
message, sys.argv = sys.argv[1], sys.argv[2:]  # python -c THIS MESSAGE SCRIPT FLAGS...
def compile_(self, *args, **kwargs):
    raise jax.errors.JaxRuntimeError(message)
jax.stages.Lowered.compile = compile_
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_commands_refuse_what_xla_cannot_compile_in_one_line(toy_and_limit, tmp_path):
    """train.py, bench.py and sample.py: exit code 1, one line on stderr, no traceback."""
    root, _ = toy_and_limit
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf_dir = write_hf_gpt2(
        tmp_path / "gpt2", random_hf_gpt2(n_layer=1, n_embd=32, vocab_size=50257, n_positions=32), n_head=2
    )
    commands = {
        "train.py": [
            f"--data_dir={root / 'data'}",
            "--dataset=toy",
            f"--out_dir={tmp_path / 'out'}",
            "--n_layer=1",
            "--n_head=2",
            "--n_embd=32",
            "--block_size=16",
            "--batch_size=8",
            "--max_iters=1",
        ],
        "bench.py": [
            "--n_layer=1",
            "--n_head=2",
            "--n_embd=32",
            "--block_size=16",
            "--batch_size=4",
            "--vocab_size=65",
            "--devices=1",
            "--json=",
        ],
        "sample.py": [f"--init_from={hf_dir}", "--start=hello", "--num_samples=2", "--max_new_tokens=4"],
    }
    lines = {}
    for script, flags in commands.items():
        done = subprocess.run(
            [sys.executable, "-c", WITH_FAKE_OOM, TPU_USED_AND_TOTAL, os.path.join(repo, script), *flags],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            env=os.environ | {"PYTHONPATH": repo},
        )
        assert done.returncode == 1 and "Traceback" not in done.stderr, (script, done.stderr[-3000:])
        lines[script] = done.stderr.strip().splitlines()[-1]
        assert "27.02 GiB per device, more than the 15.75 GiB of hbm available (XLA:CPU refused it" in lines[script]
        assert not os.path.exists(tmp_path / "out")
    assert lines["train.py"].startswith("error: memory: the train step needs 27.02 GiB")
    assert lines["bench.py"].startswith("config error: memory: the train step needs 27.02 GiB")
    assert lines["sample.py"].startswith("error: memory: sampling 2 rows needs 27.02 GiB")
    assert "--num_samples=1, or --max_new_tokens=2, or --kv_cache_dtype=int8" in lines["sample.py"]
