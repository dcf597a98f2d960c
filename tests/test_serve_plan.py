"""aot/serve_plan.py (compile_aot.py --serve): the engine's programs compiled for a mesh of 4 CPU devices, their
weight and KV cache sizes against the arithmetic, and the report."""

import subprocess
import sys

import pytest

import compile_aot
from aot import serve_plan
from configurator import Config
from model import count_params

# 2 key/value heads of 16 (4 query heads) on tensor=2, slots on data=2.
MODEL = dict(
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    block_size=64,
    vocab_size=256,
    pos_embedding="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    tie_embeddings=False,
    dtype="bfloat16",
    mesh_data=2,
    mesh_fsdp=1,
    mesh_tensor=2,
)


@pytest.mark.parametrize("kv_cache_dtype, per_head", [("auto", 16 * 2), ("int8", 16 + 4)])
def test_sizes_equal_the_arithmetic(kv_cache_dtype, per_head):
    config = Config(**MODEL)
    r = serve_plan.compile_serving(
        config, compile_aot.make_target("cpu:4"), 256, slots=4, context=32, kv_cache_dtype=kv_cache_dtype, chip="H100"
    )
    kv_per_token = 2 * 2 * 2 * per_head  # keys and values x layers x KV heads x (bytes of a head, + a scale)
    assert r.kv_bytes_per_token == kv_per_token
    assert r.cache_bytes_per_chip == 4 // 2 * 32 * kv_per_token // 2  # 2 of the 4 slots, 1 of the 2 KV heads
    weights = count_params(r.setup.model_config) * 2  # bfloat16
    assert abs(r.weight_bytes / weights - 1) < 0.01
    assert weights / 2 < r.weight_bytes_per_chip < weights  # the matrices split over tensor, the norms not
    assert r.fits and r.step_memory["temporaries"] > 0
    assert r.prefill_temporaries > 0 and r.temporaries == max(r.step_memory["temporaries"], r.prefill_temporaries)
    assert r.most_slots == (80 * 10**9 - r.weight_bytes_per_chip - r.temporaries) // (32 * kv_per_token // 2) * 2
    text = serve_plan.serve_report(r)
    assert f"KV per token    {kv_per_token:,} B (analytic {kv_per_token:,} B)" in text
    assert "verdict: fits" in text and "tokens/s" in text


def test_the_attention_kernel_on_several_devices_is_one_line():
    """--decode_attention=pallas plans the kernel, which runs on one device: one line, no traceback."""
    flags = [f"--{key}={value}" for key, value in MODEL.items()]
    run = subprocess.run(
        [
            sys.executable,
            "compile_aot.py",
            "--topology=cpu:4",
            "--serve=True",
            "--slots=4",
            "--decode_attention=pallas",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: decode_attention='pallas' runs on one TPU chip")
