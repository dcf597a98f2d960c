"""bench.py runs on a tiny config and its JSON record is self-consistent (no timing asserts)."""

import importlib.util
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest
from test_hf import LLAMA_JSON, write_config

import bench
import configurator
from devices import profile
from model import GPTConfig, flops_per_token
from weights import hf

TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=4",
    "--vocab_size=65",
    "--devices=1",
    "--warmup=1",
]


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_record_is_consistent(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    record = bench.run(TINY + ["--steps=3", "--gradient_accumulation_steps=2", f"--json={out}"])
    assert read_records(out) == [json.loads(json.dumps(record))]  # appended exactly once
    assert record["mode"] == "train" and record["backend"] == "cpu" and record["n_devices"] == 1
    assert record["tokens_per_step"] == 2 * 4 * 32
    assert len(record["step_s"]) == 3 and record["min_s"] == min(record["step_s"])
    assert record["median_s"] == sorted(record["step_s"])[1]
    assert math.isclose(record["tokens_per_s"], record["tokens_per_step"] / record["median_s"])
    assert math.isclose(record["achieved_flops"], record["flops_per_token"] * record["tokens_per_s"])
    assert record["peak_source"].startswith("measured") and record["peak_flops"] > 0
    assert math.isclose(record["mfu"], record["achieved_flops"] / record["peak_flops"])
    assert record["compile_s"] > 0 and math.isfinite(record["final_loss"])
    assert record["mfu_measured"] == record["mfu"]  # on a CPU the peak is the matmul measured in the run
    # MaxText's count: causal attention is half the square, 6·L·T·d fewer FLOPs than the full count
    assert record["flops_per_token"] - record["flops_per_token_causal_half"] == 6 * 2 * 32 * 32
    assert math.isclose(
        record["mfu_causal_half"], record["mfu"] * record["flops_per_token_causal_half"] / record["flops_per_token"]
    )
    assert "measured" in record["measured_peak_source"]
    assert record["peak_memory_bytes"] > 0  # CPU: the compiler's plan, said so
    assert "compiler" in record["memory_source"]
    compiled = record["compiled_memory"]  # the need the pre-flight check uses, its terms beside it
    assert (
        compiled["total"]
        == record["memory_check"]["needed_bytes"]
        == sum(compiled[k] for k in ("arguments", "outputs", "temporaries", "code"))
    )
    # the pre-flight check's numbers, kept in the record and printed before the step ran
    assert record["memory_check"]["needed_bytes"] >= record["peak_memory_bytes"] > 0
    assert record["memory_check"]["available_bytes"] > 0
    table = capsys.readouterr().out
    assert record["memory_check"]["line"] in table
    for label in (
        "ms/step (min / median)",
        "tokens/s",
        "MFU",
        "MFU vs a matmul measured now",
        "attention in full (PaLM, nanoGPT)",
        "causal attention halved (MaxText)",
        "compile",
        "compiled step's need",
    ):
        assert label in table

    bench.run(TINY + ["--steps=2", f"--json={out}"])
    assert len(read_records(out)) == 2  # a second run appends


def test_decode_record_is_consistent(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    record = bench.run(
        TINY + ["--mode=decode", "--decode_batch=1,2", "--prompt_len=4", "--new_tokens=6", "--steps=2", f"--json={out}"]
    )
    assert [r["batch_size"] for r in record["runs"]] == [1, 2]
    printed = capsys.readouterr().out  # each batch's pre-flight memory line, kept in its record
    assert all(r["memory_check"]["needed_bytes"] > 0 and r["memory_check"]["line"] in printed for r in record["runs"])
    itemsize = 4  # float32
    for r in record["runs"]:
        assert r["decode_tokens"] == r["batch_size"] * (6 - 1)  # the first new token is the prefill's
        assert math.isclose(r["step_s"], r["median_s"] / 5)
        assert math.isclose(r["tokens_per_s"], r["decode_tokens"] / r["median_s"])
        cache = r["batch_size"] * (4 + 6 / 2) * 2 * 2 * 32 * itemsize
        assert math.isclose(r["bytes_per_step"], record["weight_bytes"] + cache)
        assert math.isclose(r["roofline_fraction"], r["bytes_per_step"] / r["step_s"] / record["peak_bandwidth"])
        # the prefill: B x 4 prompt tokens, a forward pass each (a third of a train step's FLOPs at T = 4)
        # less the output layer (65 words by 32) for 3 of the 4: it runs for each row's last token only
        assert math.isclose(r["prefill_tokens_per_s"], r["batch_size"] * 4 / r["prefill_s"])
        forward = flops_per_token(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65), 4) / 3
        assert math.isclose(record["prefill_flops_per_token"], forward - 2 * 65 * 32 * 3 / 4)
        assert 0 < r["prefill_mfu"] <= 1
    for label in ("prefill tok/s", "MFU", "MFLOPs per prompt token"):
        assert label in printed


def test_decode_that_cannot_fit_is_refused_before_it_runs(capsys):
    """Batch 1 needs ~200 KiB here, batch 4 ~300 KiB: with 252 KiB, batch 4 is refused before batch 1 runs."""
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ["--mode=decode", "--decode_batch=1,4", "--memory_limit_gib=0.00024", "--json="])
    message = str(e.value)
    assert message.startswith("config error: memory: decoding a batch of 4 needs") and "than the 251.66 KiB" in message
    assert "--decode_batch=2" in message and "--kv_cache_dtype=int8" in message
    assert "ms/token step" not in capsys.readouterr().out  # nothing was timed, batch 1 neither


def test_decode_roofline_counts_key_value_heads_and_int8(tmp_path):
    """2 key/value heads of 4 (grouped-query) and an int8 cache: the roofline's cache bytes per position
    are 2 x 2 layers x 2 heads x (8 int8 + a float32 scale), not the full width's; int8 weights are read
    as int8."""
    flags = TINY + [
        "--n_head=4",
        "--n_kv_head=2",
        "--mode=decode",
        "--decode_batch=2",
        "--prompt_len=4",
        "--new_tokens=4",
        "--steps=1",
        "--json=",
    ]
    full = bench.run(flags)
    record = bench.run(flags + ["--weight_dtype=int8", "--kv_cache_dtype=int8"])
    assert full["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4 and record["kv_bytes_per_token"] == 2 * 2 * 2 * (8 + 4)
    assert record["weight_bytes"] < 0.7 * full["weight_bytes"]  # the blocks' kernels from 4 bytes to 1
    run = record["runs"][0]
    assert math.isclose(run["bytes_per_step"], record["weight_bytes"] + 2 * (4 + 4 / 2) * 2 * 2 * 2 * (8 + 4))


def test_decode_defaults_fit_the_models_context(tmp_path):
    """block_size 32: the default 128 new tokens would not fit after a 16-token prompt (issue 42)."""
    record = bench.run(TINY + ["--mode=decode", "--decode_batch=1", "--steps=1", "--json="])
    assert [(r["prompt_len"], r["new_tokens"]) for r in record["runs"]] == [(16, 16)]


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--mode=infer", "--mode"),
        ("--decode_batch=1,x", "decode_batch"),
        ("--bogus=1", "unknown config key"),
        ("--mode=decode --new_tokens=20", "--prompt_len + --new_tokens = 16 + 20 leaves no room in block_size 32"),
        ("--json=/no/such/folder/b.jsonl", "the folder /no/such/folder does not exist"),
    ],
)
def test_bad_flags_are_one_line_errors(flag, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + flag.split())
    assert message in str(e.value)


def test_quantized_run_says_plainly_what_this_hardware_gives(tmp_path, capsys):
    record = bench.run(TINY + ["--steps=2", "--quantization=int8", f"--json={tmp_path / 'b.jsonl'}"])
    assert record["config"]["quantization"] == "int8" and record["attention"] == "einsum"
    assert "XLA:CPU has no int8 path faster than float32" in record["quantization_note"]
    assert math.isclose(record["speedup_vs_unquantized"], record["unquantized_median_s"] / record["median_s"])
    table = capsys.readouterr().out
    assert "quantized matmuls" in table and "speed-up vs --quantization=none" in table
    device = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA A100-SXM4-80GB"})
    assert "A100 has 2x" in bench.quantization_note("int8", device)
    assert "no fast fp8 units" in bench.quantization_note("fp8", device)


def test_shapes_come_from_a_hugging_face_directory(tmp_path):
    """--init_from=DIR: config.json sets the model (no weights are read: random ones are timed)."""
    directory = write_config(tmp_path / "llama", LLAMA_JSON)
    record = bench.run(
        [
            f"--init_from={directory}",
            "--block_size=32",
            "--batch_size=4",
            "--devices=1",
            "--warmup=1",
            "--steps=1",
            "--json=",
        ]
    )
    llama = GPTConfig(**hf.read_config(directory).keys, block_size=32)
    assert llama.n_kv_head == 2 and llama.mlp == "swiglu" and llama.rope_scaling == "none"
    assert record["flops_per_token"] == flops_per_token(llama)


def test_no_config_on_a_cpu_measures_the_quickstart_model_and_says_so(tmp_path, capsys):
    """bench.py's own flags alone leave the model to bench.py: on a CPU the quickstart's."""
    record = bench.run(["--steps=1", "--warmup=0", "--devices=1", f"--json={tmp_path / 'b.jsonl'}"])
    assert record["argv"][0].endswith("config/shakespeare_char.py")
    assert {k: record["config"][k] for k in ("n_layer", "n_embd", "block_size", "batch_size")} == {
        "n_layer": 4,
        "n_embd": 128,
        "block_size": 128,
        "batch_size": 16,
    }  # the quickstart's, not GPT-2's
    printed = capsys.readouterr().out
    assert "bench: no config given on a CPU: benchmarking config/shakespeare_char.py" in printed
    assert record["memory_check"]["line"] in printed


def write_model(tmp_path, name, batch_size) -> str:
    path = tmp_path / name
    path.write_text(
        f"n_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 65\n"
        f"batch_size = {batch_size}\nmemory_limit_gib = 0.01\n"
    )  # batch 64 needs ~23 MiB, 4 ~2 MiB
    return str(path)


def test_a_default_model_that_does_not_fit_gives_way_to_the_next(tmp_path, monkeypatch, capsys):
    big, small = write_model(tmp_path, "big.py", 64), write_model(tmp_path, "small.py", 4)
    monkeypatch.setitem(bench.DEFAULT_MODELS, "cpu", [[big], [small]])
    record = bench.run(["--steps=1", "--warmup=0", "--devices=1", "--json="])
    assert record["argv"][0] == small and record["config"]["batch_size"] == 4
    printed = capsys.readouterr().out
    assert f"bench: {big} does not fit this machine (memory: the train step needs" in printed
    assert f"trying {small}" in printed and "ms/step" in printed
    # The last default refused too: its refusal is the one-line error, with its remedies.
    monkeypatch.setitem(bench.DEFAULT_MODELS, "cpu", [[big], [big]])
    with pytest.raises(SystemExit) as e:
        bench.main(["--steps=1", "--warmup=0", "--devices=1", "--json="])
    assert str(e.value).startswith("config error: memory: the train step needs") and "--batch_size=32" in str(e.value)


def test_accelerator_defaults_go_from_gpt2_124m_down_to_the_quickstart():
    """Every default parses, and each is smaller than the one before (fewer tokens x parameters a step)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    models = bench.default_models("tpu")
    assert models[0][0] == "config/gpt2_124m.py" and models[-1] == bench.default_models("cpu")[-1]
    work = []
    for model in models:
        config = configurator.load_config([os.path.join(root, model[0]), *model[1:]])
        work.append(config.tokens_per_step * config.n_layer * config.n_embd**2)
    assert work == sorted(work, reverse=True) and len(set(work)) == len(work)
    assert not bench.names_a_model(["--steps=1", "--mode=decode", "--json="])
    assert all(bench.names_a_model(argv) for argv in (["config/gpt2_124m.py"], ["--batch_size=4"], ["-h"]))


def test_profile_prints_the_steps_top_operations_read_back_from_its_trace(tmp_path, capsys):
    record = bench.run(TINY + ["--steps=1", f"--profile={tmp_path / 'trace'}", "--json="])
    ops = record["profile"]["top_operations"]
    assert 0 < len(ops) <= 10 and all(op["ms_per_step"] > 0 for op in ops)
    assert [op["ms_per_step"] for op in ops] == sorted((op["ms_per_step"] for op in ops), reverse=True)
    assert 0 < sum(op["share"] for op in ops) <= 1 + 1e-9
    # each is an operation of the compiled step: its shape and the JAX operation it came from
    assert all(re.match(r"\(?[a-z0-9]+\[[0-9,]*\]", op["about"]) for op in ops), ops
    printed = capsys.readouterr().out
    assert "top operations by device time (3 traced steps" in printed
    assert all(op["name"] in printed for op in ops)
    # where a step goes: the kinds add up to the traced time; a CPU runs no kernel, its attention is matmuls
    summary = record["profile"]["step_summary"]
    kinds = [summary[f"{kind}_ms"] for kind in ("matmul", "attention", "other", "idle")]
    assert math.isclose(sum(kinds), summary["ms_per_step"]) and summary["attention_ms"] == 0
    assert summary["matmul_ms"] > 0 and summary["matmul_flops_per_step"] > 0 and summary["kernels"] == []
    assert summary["operations_not_in_the_program"] == 0
    assert "where a step goes (3 traced steps" in printed and "no kernel on this cpu" in printed


def test_an_operations_own_time_leaves_out_the_operations_inside_it():
    event = lambda name, start, duration: type("Event", (), {"name": name, "start_ns": start, "duration_ns": duration})
    loop, first, second, after = event("while", 0, 100), event("a", 10, 30), event("b", 50, 20), event("c", 100, 5)
    own = {e.name: ns for e, ns in bench.self_times([after, second, loop, first])}
    assert own == {"while": 50, "a": 30, "b": 20, "c": 5}
    # a TPU's trace names an event by the instruction's whole text, a CPU's by its name
    assert (
        bench.operation_name(
            "%fusion.156 = (f32[], bf16[50304,768]{1,0:T(8,128)(2,1)}) fusion(f32[50304,768] %scatter), kind=kOutput"
        )
        == "fusion.156"
    )
    assert bench.operation_name("ynn_fusion.1") == "ynn_fusion.1"


def test_decode_profile_prints_each_batchs_top_operations_per_token_step(tmp_path, capsys):
    record = bench.run(
        TINY
        + [
            "--mode=decode",
            "--decode_batch=1,2",
            "--steps=1",
            "--new_tokens=4",
            f"--profile={tmp_path / 'trace'}",
            "--json=",
        ]
    )
    for run in record["runs"]:
        ops = run["profile"]["top_operations"]
        assert 0 < len(ops) <= 10 and all(op["ms_per_step"] > 0 for op in ops)
        assert run["profile"]["dir"].endswith(f"decode_batch{run['batch_size']}")
        assert 0 < sum(op["share"] for op in ops) <= 1 + 1e-9
    printed = capsys.readouterr().out
    assert printed.count("top operations by device time (one generate call, per token step") == 2


def test_a_step_summary_counts_its_programs_matmul_flops_per_run(tmp_path):
    M, K, N = 64, 128, 32

    def program(x_MxK, w_KxK, v_KxN):  # three runs of one matmul in a loop, then another
        x_MxK = jax.lax.fori_loop(0, 3, lambda i, x_MxK: jnp.tanh(x_MxK @ w_KxK), x_MxK)
        return x_MxK @ v_KxN

    args = (jnp.ones((M, K)), jnp.ones((K, K)), jnp.ones((K, N)))
    compiled = jax.jit(program).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(compiled(*args))
    summary = profile.step_summary(profile.newest_trace(str(tmp_path)), 2, compiled.as_text())
    assert summary["matmul_flops_per_step"] == 3 * 2 * M * K * K + 2 * M * K * N
    kinds = [summary[f"{kind}_ms"] for kind in ("matmul", "attention", "other", "idle")]
    assert math.isclose(sum(kinds), summary["ms_per_step"]) and summary["matmul_ms"] > 0


def test_a_tpus_convolutions_count_the_multiply_adds_of_the_dots_they_stand_for():
    # XLA:TPU's GPT-2 step (bench/tpu_train_hlo.py): the q/k/v projection btd,dgkh->bkgth, whose batch
    # of 16 rows is a window of 16 sliding over 15 positions of padding on each side of 1
    shapes = {"w": "bf16[768,12,64,1]{0,2,1,3:T(8,128)(2,1)}", "x": "bf16[16,1024,768,1]{2,1,3,0:T(8,128)(2,1)}"}
    rest = "%w, %x), window={size=16x1 pad=15_15x0_0 rhs_reversal=1x0}, dim_labels=f1b0_0oi1->1b0f, metadata={}"
    out = "bf16[12,64,16,1024]{1,3,0,2:T(8,128)(2,1)}"
    assert profile.matmul_flops("convolution", out, rest, shapes) == 2 * (16 * 1024) * 768 * (12 * 64)
    # the output layer's input gradient: (tokens, vocabulary) x (vocabulary, width), no window
    shapes = {"g": "bf16[16384,50304]{1,0}", "w": "bf16[50304,768]{1,0}"}
    rest = "%g, %w), dim_labels=bf_io->bf, metadata={}"
    assert profile.matmul_flops("convolution", "bf16[16384,768]{1,0}", rest, shapes) == 2 * 16384 * 50304 * 768
    # a real sliding window (3 taps, no padding: 8 - 3 + 1 outputs) counts each tap
    shapes = {"x": "f32[2,8,4]", "k": "f32[3,4,5]"}
    rest = "%x, %k), window={size=3}, dim_labels=b0f_0io->b0f"
    assert profile.matmul_flops("convolution", "f32[2,6,5]", rest, shapes) == 2 * 2 * 6 * 5 * 4 * 3


def test_pallas_kernels_are_attention_and_xlas_own_custom_calls_are_not():
    hlo = """ENTRY %main.1 (p.1: bf16[16,12,1024,64], i.1: s32[16384]) -> bf16[16,12,1024,64] {
  %p.1 = bf16[16,12,1024,64]{3,2,1,0} parameter(0)
  %i.1 = s32[16384]{0} parameter(1)
  %splash_mha_fwd_residuals.6 = (bf16[16,12,1024,64]{3,2,1,0}) custom-call(%p.1), custom_call_target="tpu_custom_call"
  %custom-call.3 = s32[16384]{0} custom-call(%i.1), custom_call_target="AssumeGatherIndicesInBound"
  ROOT %get-tuple-element.1 = bf16[16,12,1024,64]{3,2,1,0} get-tuple-element(%splash_mha_fwd_residuals.6), index=0
}"""
    described = profile.classify_operations(hlo)
    assert described["splash_mha_fwd_residuals.6"] == ("attention", 0, "splash_mha_fwd_residuals")
    assert described["custom-call.3"] == described["get-tuple-element.1"] == ("other", 0, "")


def test_splash_tiles_times_each_tiling_and_every_one_computes_the_same_attention(capsys):
    """bench/splash_tiles.py (the kernel interpreted on the CPU): each candidate that divides the padded
    row is run, the others skipped, and every tiling's output (and gradients) equals the first's."""
    spec = importlib.util.spec_from_file_location("splash_tiles", os.path.join("bench", "splash_tiles.py"))
    splash_tiles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(splash_tiles)
    for flags in ([], ["--backward", "--kv_heads=1"]):
        small = [
            "--rows=1",
            "--heads=2",
            "--tokens=200",
            "--steps=1",
            "--tiles=128,128,128;256,128,128;256,256,128;512,512,512",
        ]
        splash_tiles.main(small + flags)
        rows = re.findall(r"^ +[\d.]+  \((\d+), (\d+), (\d+)\)  ([\d.e-]+)$", capsys.readouterr().out, re.M)
        assert sorted(tuple(map(int, r[:3])) for r in rows) == [(128, 128, 128), (256, 128, 128), (256, 256, 128)]
        assert max(float(r[3]) for r in rows) < 2e-2
    with pytest.raises(SystemExit):
        splash_tiles.main(["--tiles=1,2"])
    assert "want 'q,kv,kv_compute;...'" in capsys.readouterr().err
