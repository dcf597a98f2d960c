"""bench_serve.py's statistics on hand-computed examples (no server)."""

import math

import pytest

import bench_serve


def test_percentile_interpolates_linearly_and_is_none_when_empty():
    assert bench_serve.percentile([4, 1, 3, 2], 50) == 2.5  # halfway between 2 and 3
    assert math.isclose(bench_serve.percentile([1, 2, 3, 4], 99), 3.97)  # at index 0.99 x 3 = 2.97: 3 + 0.97 x (4 - 3)
    assert bench_serve.percentile(list(range(101)), 99) == 99
    assert bench_serve.percentile([], 50) is None


def test_request_metrics_ttft_tpot_and_itl():
    # sent at 10.0; chunks at 10.2, 10.3 and 10.6 carrying 4 tokens; ended at 10.7
    m = bench_serve.request_metrics(10.0, [10.2, 10.3, 10.6], 10.7, 4)
    assert m["ttft"] == pytest.approx(0.2) and m["latency"] == pytest.approx(0.7)
    assert m["tpot"] == pytest.approx((0.7 - 0.2) / 3)
    assert m["itl"] == pytest.approx([0.1, 0.3])
    one = bench_serve.request_metrics(0.0, [0.5], 0.6, 1)
    assert one["tpot"] is None and one["itl"] == []  # TPOT needs a second token


def test_summarize_rates_and_failures():
    metrics = [
        bench_serve.request_metrics(0.0, [0.1, 0.2], 0.3, 2),
        bench_serve.request_metrics(0.0, [0.3, 0.4, 0.5], 0.6, 6),
    ]
    s = bench_serve.summarize(metrics, wall_seconds=2.0, errors=["APITimeoutError: timed out", "later"])
    assert (s["ok"], s["failed"], s["first_error"]) == (2, 2, "APITimeoutError: timed out")
    assert s["requests_per_s"] == 1.0 and s["output_tokens"] == 8 and s["output_tokens_per_s"] == 4.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["p50"] == pytest.approx((200 + 60) / 2)  # 200 ms and (600 - 300) / 5 ms
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # every gap is 100 ms


def test_poisson_offsets_start_at_zero_and_repeat_with_the_seed():
    offsets = bench_serve.poisson_offsets(5, rate=4.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(offsets) == 5
    assert offsets == bench_serve.poisson_offsets(5, rate=4.0, seed=1)


def test_decode_roofline_reads_weights_and_full_caches():
    health = {"weight_bytes": 1000, "kv_bytes_per_token": 10, "memory_bandwidth": 1e6, "context": 50}
    rows = bench_serve.decode_roofline(health, slots=(1, 8))
    assert [r["bytes_per_step"] for r in rows] == [1500, 5000]
    assert rows[1]["step_s"] == pytest.approx(5e-3) and rows[1]["tokens_per_s"] == pytest.approx(1600)
    assert bench_serve.decode_roofline({"status": "ok", "context": 50}) is None
