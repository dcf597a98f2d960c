"""Tests of plot.py: the loss and decode plots drawn from a run's events and a bench's JSON."""

import json
import struct

import jax
import pytest

import plot
import train
from test_train import make_dataset, small_config


def test_plot_writes_a_png_of_the_run(tmp_path):
    make_dataset(tmp_path / "data")
    config = small_config(tmp_path, tensorboard=True, max_iters=8, eval_interval=4, sample_tokens=4)
    train.train(config, jax.devices()[:1])
    series = plot.read_scalars(config.out_dir)
    assert [s for s, _ in series["train/loss"]] == list(range(8))
    assert [s for s, _ in series["eval/val_loss"]] == [4, 8]
    path = tmp_path / "loss.png"
    plot.main([config.out_dir, f"--out={path}"])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # from the IHDR chunk
    assert (width, height) == (960, 600)


def test_plot_of_a_run_without_events_is_one_message(tmp_path):
    with pytest.raises(SystemExit, match="tensorboard not found"):
        plot.main([str(tmp_path)])


def test_decode_plot_has_a_line_per_weight_and_cache_dtype(tmp_path):
    runs = lambda ms: [{"batch_size": b, "tokens_per_s": b / (ms * 1e-3), "step_s": ms * 1e-3} for b in (1, 8)]
    records = [
        {"mode": "decode", "weight_dtype": "auto", "kv_cache_dtype": "auto", "runs": runs(2.0)},
        {"mode": "train"},
        {"mode": "decode", "weight_dtype": "int8", "kv_cache_dtype": "int8", "runs": runs(1.0)},
    ]
    jsonl = tmp_path / "bench.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    series = plot.decode_series([str(jsonl)])
    assert series["weights int8, KV int8"] == [(1, 1000.0, 1.0), (8, 8000.0, 1.0)]
    assert list(series) == ["weights auto, KV auto", "weights int8, KV int8"]
    plot.main(["--decode", str(jsonl), f"--out={tmp_path / 'decode.png'}"])
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "train_only.jsonl").write_text(json.dumps({"mode": "train"}) + "\n")
    with pytest.raises(SystemExit, match="no bench.py --mode=decode records"):
        plot.main(["--decode", str(tmp_path / "train_only.jsonl")])
