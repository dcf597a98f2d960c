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
