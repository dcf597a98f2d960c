"""Tests of compile_aot.py: ahead-of-time compiles for a topology that is not here, its report, fits verdict and saved steps."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_train import make_dataset, small_config

import compile_aot
import sharding
import train
from configurator import Config
from model import count_params
from training import compiled_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = dict(
    n_embd=64,
    n_head=4,
    batch_size=8,
    gradient_accumulation_steps=2,
    max_iters=4,
    eval_interval=1000,
    mesh_data=1,
    mesh_fsdp=8,
)  # parameters really split 8 ways


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The command line compiles for cpu:8 in its own process and saves the step."""
    root = tmp_path_factory.mktemp("aot")
    make_dataset(root / "data", vocab_size=64)
    config = small_config(root, **FLAGS)
    path = str(root / "step.bin")
    defaults = Config()
    flags = [
        f"--{f.name}={getattr(config, f.name)}"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(defaults, f.name)
    ]
    # It makes its own 8 devices; the suite's other XLA flags stay.
    env = os.environ | {"XLA_FLAGS": os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")}
    run = subprocess.run(
        [sys.executable, "compile_aot.py", "--topology=cpu:8", f"--save={path}", "--hbm_gib=0.0005", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return root, config, path, run


@pytest.fixture(scope="module")
def result(compiled):
    """Compiled in this process for two of the eight devices, parameters split 2 ways."""
    root, config, _, _ = compiled
    config = dataclasses.replace(config, mesh_fsdp=2)
    return compile_aot.compile_step(config, compile_aot.make_target("cpu:2"), 64)


def random_state(setup, seed=0):
    """A train state in the step's shardings, without compiling an initializer."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: jax.device_put(np.abs(rng.normal(0, 0.02, a.shape)).astype(a.dtype), a.sharding), setup.abstract_state
    )


def test_command_line_reports_and_saves(compiled):
    _, _, path, run = compiled
    assert run.returncode == 1, run.stderr[-2000:]  # 512 KiB of memory: does not fit (the step needs ~1 MiB)
    assert (
        "train step for cpu:8 = 8 x cpu, mesh stage=1 x data=1 x expert=1 x fsdp=8 x context=1 x tensor=1" in run.stdout
    )
    assert "verdict: DOES NOT FIT" in run.stdout and "--remat_policy=" in run.stdout
    assert os.path.getsize(path) > 10_000 and f"saved {path}" in run.stdout


def test_loaded_step_gives_the_losses_of_the_jitted_step(compiled, monkeypatch):
    root, config, path, _ = compiled
    jitted = train.train(dataclasses.replace(config, out_dir=str(root / "jit")))
    loads, load = [], compiled_step.load
    monkeypatch.setattr(compiled_step, "load", lambda *args: loads.append(1) or load(*args))
    loaded = train.train(dataclasses.replace(config, out_dir=str(root / "aot"), compiled_train_step=path))
    assert loads == [1] and [s for s, _ in loaded] == [0, 1, 2, 3]
    np.testing.assert_allclose([l for _, l in loaded], [l for _, l in jitted], rtol=0, atol=1e-6)


def test_step_saved_and_loaded_in_process_on_two_of_the_devices(result, tmp_path):
    compiled_step.save(result.compiled, result.lowered, result.setup, str(tmp_path / "two.bin"))
    config = result.setup.config
    setup = train.make_setup(config, sharding.mesh_from_config(config, jax.devices()[:2]), 64)
    loaded = compiled_step.load(str(tmp_path / "two.bin"), setup, lambda: train.lower(setup))
    assert isinstance(loaded, jax.stages.Compiled)  # not compiled again
    x = jax.device_put(np.arange(2 * 8 * 16).reshape(2, 8, 16) % 64, setup.micro_batch_sharding)
    with sharding.activate(setup.mesh):
        (want_state, want), (got_state, got) = (
            step(random_state(setup), (x, x)) for step in (train.jit_train_step(setup), loaded)
        )
    assert float(got["loss"]) == float(want["loss"]) and float(got["grad_norm"]) == float(want["grad_norm"])
    np.testing.assert_array_equal(got_state["params"]["wte"], want_state["params"]["wte"])


def test_report_numbers_agree_with_the_arrays(result):
    setup, e, m = result.setup, result.estimate, result.memory
    state = random_state(setup)
    one_device = lambda tree: sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))
    assert e["parameters"] == one_device(state["params"])
    assert e["parameters"] + e["AdamW moments"] == one_device(state)
    # Sharded weights hold half of 4 B per parameter each; the small vectors are replicated.
    replicated = sum(a.nbytes for a in jax.tree.leaves(state["params"]) if a.sharding.is_fully_replicated)
    assert e["parameters"] == (count_params(setup.model_config) * 4 - replicated) // 2 + replicated
    assert m["arguments"] == e["parameters"] + e["AdamW moments"] + e["batch"]
    assert e["batch"] == 2 * 2 * (8 // 2) * 16 * 4  # x and y, 2 micro-steps, 4 of 8 rows, int32
    tokens = 8 * 2 * 16
    assert result.flops == pytest.approx(train.flops_per_token(setup.model_config) * tokens)
    assert 0.9 < result.xla_flops / result.flops < 1.3  # plus softmax, norms, the optimizer
    assert result.fits is None and "no memory limit known" in compile_aot.report(result)


def test_collectives_count_every_trip_of_the_loops_they_sit_in(result):
    """Every weight split over fsdp is gathered at least once a step, and the gathers inside the
    scanned layers and the micro-step loop count once per trip, not once as the text has them."""
    params, shardings = result.setup.abstract_state["params"], result.setup.state_shardings["params"]
    split = sum(
        a.size * 4 for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)) if not s.is_fully_replicated
    )
    gathered, count = result.collectives["all-gather"]
    assert split <= gathered < 16 * split, (gathered, split)
    assert count > result.compiled.as_text().count(" all-gather(")
    assert "all-reduce" in result.collectives or "reduce-scatter" in result.collectives  # the gradients
    assert "collectives per device per step (results, loops counted): all-gather" in compile_aot.report(result)


def test_collectives_of_nested_loops_and_async_pairs():
    hlo = """%inner (p: f32[]) -> f32[] {
  %a = f32[4,8]{1,0} all-gather(%p), dimensions={0}
}
%outer (p: f32[]) -> f32[] {
  %w = (s32[], f32[]) while(%t), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %s = (bf16[16], bf16[32]) all-gather-start(%p), dimensions={0}
  %d = bf16[32]{0} all-gather-done(%s)
}
%c2 (p: (s32[], f32[])) -> pred[] {
  %n = s32[]{:T(128)} constant(2)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}
ENTRY %main (p: f32[]) -> f32[] {
  %w2 = (s32[], f32[]) while(%t), condition=%c2, body=%outer
  %r = f32[10]{0:T(128)} all-reduce(%p), to_apply=%add
}"""
    # the outer loop's 2 trips as XLA:TPU states them: only in its condition, counter < 2
    assert compile_aot.collectives(hlo) == {"all-gather": (2 * 3 * 128 + 2 * 64, 8), "all-reduce": (40, 1)}


def test_data_parallel_holds_all_parameters_on_each_device(compiled):
    root, config, _, _ = compiled
    config = dataclasses.replace(config, mesh_data=8, mesh_fsdp=1)
    setup = train.make_setup(config, sharding.mesh_from_config(config), 64)
    assert compile_aot.estimate_memory(setup)["parameters"] == count_params(setup.model_config) * 4


def test_too_small_memory_is_reported_as_does_not_fit(result):
    small = dataclasses.replace(result, target=dataclasses.replace(result.target, hbm_bytes=1 << 20))
    text = compile_aot.report(small)
    assert small.fits is False
    assert f"DOES NOT FIT, needs {compile_aot.size(result.memory['total'])} of 1.00 MiB" in text
    assert "--remat_policy=dots_with_no_batch_dims_saveable" in text
    assert "--batch_size=4 --gradient_accumulation_steps=4" in text  # the same tokens per step
    big = dataclasses.replace(result, target=dataclasses.replace(result.target, hbm_bytes=1 << 40))
    assert big.fits and "verdict: fits" in compile_aot.report(big)


def test_context_splits_the_estimated_activations_and_is_suggested_for_one_row_per_device(compiled):
    """mesh_context=4 leaves each device a quarter of every row's tokens (each query still sees all
    T keys); a step with one row per device that does not fit is offered the context split."""
    root, config, _, _ = compiled

    def setup(context, batch_size=8):
        c = dataclasses.replace(config, mesh_fsdp=2, mesh_context=context, batch_size=batch_size)
        return train.make_setup(c, sharding.mesh_from_config(c, jax.devices()[: 2 * context]), 64)

    assert (
        compile_aot.estimate_memory(setup(1))["activations"] == 4 * compile_aot.estimate_memory(setup(4))["activations"]
    )
    one_row = setup(1, batch_size=2)
    r = compile_aot.Result(
        compile_aot.make_target("cpu:2"),
        one_row,
        None,
        None,
        0.0,
        {"total": 1 << 30},
        "",
        compile_aot.estimate_memory(one_row),
        0.0,
        None,
        {},
    )
    split = "--mesh_context=2 --mesh_fsdp=1 --batch_size=1 --gradient_accumulation_steps=4"  # same tokens per step
    assert any(tip.endswith(split) for tip in compile_aot.suggestions(r))


def test_xla_out_of_memory_messages_are_parsed():
    assert compile_aot.oom_memory(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        "required for HLO temporaries (58.64G) exceeds available HBM "
        "(15.75G).",
        arguments=2 << 30,
    ) == {"arguments": 2 << 30, "temporaries": int(58.64 * 2**30), "total": int(58.64 * 2**30) + (2 << 30)}
    assert compile_aot.oom_memory(
        "Ran out of memory in memory space hbm. Used 17.20G of 15.48G hbm. Exceeded hbm capacity by 1.72G.", arguments=0
    ) == {"total": int(17.2 * 2**30)}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(batch_size=16), "batch_size compiled 8, given 16"),
        (dict(learning_rate=1e-3), "learning_rate compiled 0.003, given 0.001"),  # baked into the program
        (
            dict(mesh_data=8, mesh_fsdp=1),
            "mesh compiled stage=1 x data=1 x expert=1 x fsdp=8 x context=1 x tensor=1, given stage=1 x data=8 x expert=1 x fsdp=1 x context=1 x tensor=1",
        ),
    ],
)
def test_a_different_run_is_refused_naming_the_field(compiled, change, message):
    root, config, path, _ = compiled
    config = dataclasses.replace(config, **change)
    with pytest.raises(compile_aot.AotError, match=message):
        setup = train.make_setup(config, sharding.mesh_from_config(config), 64)
        compiled_step.load(path, setup, lambda: train.lower(setup))


def test_another_jax_version_is_refused(compiled, tmp_path):
    root, config, path, _ = compiled
    with open(path, "rb") as f:
        magic, header, payload = f.readline(), json.loads(f.readline()), f.read()
    header["jax"] = "0.4.1"
    (tmp_path / "old.bin").write_bytes(magic + json.dumps(header).encode() + b"\n" + payload)
    setup = train.make_setup(config, sharding.mesh_from_config(config), 64)
    with pytest.raises(compile_aot.AotError, match=f"jax compiled 0.4.1, given {jax.__version__}"):
        compiled_step.load(str(tmp_path / "old.bin"), setup, lambda: train.lower(setup))


def test_changed_code_is_refused(compiled, monkeypatch):
    root, config, path, _ = compiled
    original = train.training_loss
    monkeypatch.setattr(train, "training_loss", lambda *args: jax.tree.map(lambda a: 2 * a, original(*args)))
    with pytest.raises(compile_aot.AotError, match="the program differs"):
        setup = train.make_setup(config, sharding.mesh_from_config(config), 64)
        compiled_step.load(path, setup, lambda: train.lower(setup))


def test_keys_left_out_of_the_fingerprint_do_not_change_the_program(compiled):
    root, config, _, _ = compiled
    fields = {f.name: f.type for f in dataclasses.fields(config)}
    assert set(compiled_step.NOT_IN_PROGRAM) <= set(fields)
    mesh_keys = {"mesh_data", "mesh_fsdp", "mesh_tensor", "dcn_data", "dcn_fsdp", "dcn_tensor"}
    changed = {}  # the resolved mesh is checked instead of the mesh keys
    for key in set(compiled_step.NOT_IN_PROGRAM) - mesh_keys:
        value = getattr(config, key)
        # init_from: a directory (as a Hugging Face one is), since 'resume' contradicts overwrite_out_dir;
        # eval_tasks: a task that exists (its file is read by train(), not by the step)
        changed[key] = (
            str(root)
            if key == "init_from"
            else "hellaswag:x.jsonl"
            if key == "eval_tasks"
            else not value
            if isinstance(value, bool)
            else value * 2 + 1
            if isinstance(value, (int, float))
            else value + "x"
        )
    other = dataclasses.replace(config, **changed)
    mesh = sharding.mesh_from_config(config)
    fingerprints = [
        compiled_step.program_fingerprint(train.lower(train.make_setup(c, mesh, 64))) for c in (config, other)
    ]
    assert fingerprints[0] == fingerprints[1], f"one of {sorted(changed)} changes the program"


@pytest.mark.parametrize(
    "name, topology",
    [
        ("v5e-256", "v5e:16x16"),
        ("v5e-8", "v5e:2x4"),
        ("v6e-64", "v6e:8x8"),
        ("v5e-1", "v5e:1x1"),
        ("v4-8", "v4:2x2x1"),
        ("v4-32", "v4:2x2x4"),
        ("v5p-128", "v5p:4x4x4"),
        ("v5p:2x2x1", "v5p:2x2x1"),
    ],
)
def test_tpu_names(name, topology):
    assert compile_aot.tpu_topology_name(name) == topology


def test_a_slice_smaller_than_a_host_is_one_host_of_its_chips():
    """libtpu's default host (2x2x1) does not divide v5e:1x1 or v5e:2x1: those name their own bounds
    (checked with libtpu 0.0.42.1: v5e-1 and v6e-1 compile; CI has no libtpu)."""
    assert compile_aot.small_slice_bounds("v5e:1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert compile_aot.small_slice_bounds("v5e:2x1") == {"chips_per_host_bounds": (2, 1, 1)}
    assert compile_aot.small_slice_bounds("v5e:2x2") == {} and compile_aot.small_slice_bounds("v4:2x2x1") == {}


@pytest.mark.parametrize(
    "name, message",
    [
        ("v7x-8", "unknown topology 'v7x-8'"),
        ("v5e-12", "must be a power of two"),
        ("v4-4", "must be a power of two, at least 8"),
        ("cpu:64", "this process has 8 cpu devices"),
    ],
)
def test_bad_topologies(name, message):
    with pytest.raises(compile_aot.AotError, match=message):
        compile_aot.make_target(name)


def test_tpu_without_libtpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(compile_aot.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(compile_aot.AotError, match=r'needs libtpu .*pip install "jax\[tpu\]=='):
        compile_aot.make_target("v5e-4")


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (docs/compile_aot.md)"
)


@needs_libtpu
def test_tpu_topology_fits_and_too_big_does_not(compiled):
    root, config, _, _ = compiled
    target = compile_aot.make_target("v5e-8")
    assert len(target.devices) == 8 and target.hbm_bytes == 16 * 2**30
    ok = compile_aot.compile_step(config, target, 64)
    assert ok.fits and ok.memory["peak"] <= ok.memory["total"]
    big = dataclasses.replace(
        config,
        n_layer=4,
        n_embd=4096,
        n_head=32,
        block_size=128,
        mesh_fsdp=1,
        mesh_data=8,
        gradient_accumulation_steps=1,
    )
    oom = compile_aot.compile_step(big, target, 50257)
    assert oom.fits is False and oom.compiled is None and oom.memory["total"] > target.hbm_bytes
    assert "DOES NOT FIT" in compile_aot.report(oom) and "--mesh_fsdp=-1" in compile_aot.report(oom)


@pytest.mark.parametrize("mode, operand", [("int8", "s8["), ("fp8", "f8e4m3fn[")])
def test_quantized_step_compiles_ahead_of_time_with_8_bit_operands(compiled, mode, operand):
    root, config, _, _ = compiled
    config = dataclasses.replace(config, mesh_fsdp=2, quantization=mode)
    r = compile_aot.compile_step(config, compile_aot.make_target("cpu:2"), 64)
    assert not r.oom and operand in r.compiled.as_text()


@needs_libtpu
def test_quantized_step_compiles_for_a_tpu(compiled):
    root, config, _, _ = compiled
    r = compile_aot.compile_step(dataclasses.replace(config, quantization="int8"), compile_aot.make_target("v5e-8"), 64)
    assert r.fits and "s8[" in r.compiled.as_text()


@pytest.mark.parametrize("topology", ["cpu:abc", "cpu:0", "cpu:-2", "cpu:", "gpu:x"])
def test_a_bad_device_count_is_one_line_naming_the_accepted_forms(topology):
    with pytest.raises(SystemExit) as excinfo:  # refused before JAX is configured
        compile_aot.main([f"--topology={topology}"])
    message = excinfo.value.code
    assert (
        message.startswith(
            f"error: topology '{topology}': the count after '{topology[:3]}:' must be a whole number >= 1; use cpu:N"
        )
        and "gpu:N" in message
        and "\n" not in message
    )
    with pytest.raises(compile_aot.AotError, match="must be a whole number >= 1"):
        compile_aot.make_target(topology)


def test_a_save_path_that_cannot_be_written_is_refused_before_compiling(tmp_path):
    for path, words in ((tmp_path / "no" / "step.bin", "does not exist"), (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as excinfo:
            compile_aot.main(["--topology=cpu:1", f"--save={path}"])
        assert excinfo.value.code == f"error: --save={path}" + (
            f": the folder {path.parent} {words}" if words == "does not exist" else f" {words}: give a file name"
        )
    assert os.listdir(tmp_path) == []  # no .tmp left behind


def spoiled(data: bytes, how: str) -> bytes:
    magic = compiled_step.MAGIC
    header_end = data.index(b"\n", len(magic)) + 1
    return {
        "empty": b"",
        "cut in the first line": data[:10],
        "cut in the header": data[: header_end - 20],
        "header not JSON": magic + b"{garbage" + data[header_end - 1 :],
        "header not UTF-8": magic + b'{"jax": "\xff"}\n' + data[header_end:],
        "header not an object": magic + b"[1, 2]\n" + data[header_end:],
        "executable cut short": data[:-100],
        "executable corrupted": data[:-100] + bytes(100),
    }[how]


@pytest.mark.parametrize(
    "how, why",
    [
        ("empty", "it ends before its header does"),
        ("cut in the first line", "it ends before its header does"),
        ("cut in the header", "it ends before its header does"),
        ("header not JSON", "Expecting property name"),
        ("header not UTF-8", "can't decode byte 0xff"),
        ("header not an object", "its header is not a JSON object"),
        ("executable cut short", "its executable does not match the checksum in its header"),
        ("executable corrupted", "its executable does not match the checksum in its header"),
    ],
)
def test_a_damaged_or_truncated_step_file_says_rebuild_it(compiled, tmp_path, how, why):
    root, config, path, _ = compiled
    bad = tmp_path / "bad.bin"
    bad.write_bytes(spoiled(open(path, "rb").read(), how))
    setup = train.make_setup(config, sharding.mesh_from_config(config), 64)
    with pytest.raises(compile_aot.AotError) as excinfo:
        compiled_step.load(str(bad), setup, lambda: train.lower(setup))
    message = str(excinfo.value)
    assert message.startswith(f"{bad} is damaged or incomplete (") and why in message
    assert message.endswith(f"): rebuild it with compile_aot.py <this run's config and flags> --save={bad}")
    assert "\n" not in message


def test_help_lists_the_options_and_the_config_keys(capsys):
    with pytest.raises(SystemExit) as excinfo:
        compile_aot.main(["--topology=cpu:8", "--help"])
    text = capsys.readouterr().out
    assert excinfo.value.code == 0
    assert "compile_aot.py's own flags" in text and "  --topology (str, default '')\n        cpu:8 | gpu" in text
    assert "  --batch_size (int, default 12)" in text


def test_report_gives_the_pipeline_bubble_and_the_step_time_with_it(compiled):
    root, config, _, _ = compiled
    config = dataclasses.replace(
        config, n_layer=4, mesh_fsdp=1, mesh_stage=2, pipeline_microbatches=4, gradient_accumulation_steps=1
    )
    r = compile_aot.compile_step(config, compile_aot.make_target("cpu:2"), 64)
    text = compile_aot.report(r)
    assert "pipeline: 2 stages x 4 micro-batches (GPipe); bubble 20.0% of each stage's time" in text
    at_peak = r.flops / r.target.peak_flops / (1 - 1 / 5) * 1e3
    assert f"at 100% MFU with the pipeline's bubble ({r.target.peak_source}): {at_peak:,.1f} ms" in text
    assert r.collectives["collective-permute"][1] > 0  # the stages hand activations on
