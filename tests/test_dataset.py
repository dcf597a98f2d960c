"""dataset.py: the token files checked at start-up, and the batch of a step as a pure function."""

import re

import numpy as np
import pytest

import dataset
import train
from test_train import ONE_DEVICE, make_dataset, small_config


@pytest.fixture
def toy(tmp_path):
    make_dataset(tmp_path / "data")
    return tmp_path


def test_batch_is_a_pure_function_of_seed_and_step(toy):
    config = small_config(toy)
    tokens = dataset.open_split(config, "train", 65)
    all_rows = np.arange(config.batch_size)
    x1, y1 = dataset.batch_for_step(tokens, config, 5, "train", all_rows, n_micro=2)
    x2, _ = dataset.batch_for_step(tokens, config, 5, "train", all_rows, n_micro=2)
    x3, _ = dataset.batch_for_step(tokens, config, 6, "train", all_rows, n_micro=2)
    half, _ = dataset.batch_for_step(tokens, config, 5, "train", all_rows[4:], n_micro=2)
    assert x1.shape == (2, 8, 16)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[:, 4:], half)  # a process's rows are a slice of the batch
    np.testing.assert_array_equal(x1[..., 1:], y1[..., :-1])  # targets are inputs shifted by one
    assert not np.array_equal(x1, x3)


@pytest.mark.parametrize("problem, message", [
    ("missing", "not found: run `python data/text/prepare.py --input_dir=YOUR_TEXT --out_dir="),
    ("odd_bytes", "not a whole number of uint16 tokens"),
    ("too_short", "fewer than block_size+2"),
    ("bad_ids", "token id 70 >= vocab_size 65"),
])
def test_bad_data_is_one_clear_error(toy, problem, message):
    path = toy / "data" / "toy" / "train.bin"
    if problem == "missing":
        path.unlink()
    elif problem == "odd_bytes":
        path.write_bytes(path.read_bytes() + b"x")
    elif problem == "too_short":
        np.arange(10, dtype=np.uint16).tofile(path)
    else:
        np.full(100, 70, dtype=np.uint16).tofile(path)
    with pytest.raises(dataset.DataError, match=re.escape(message)):
        train.train(small_config(toy), ONE_DEVICE)


def test_a_bad_token_id_anywhere_in_the_data_is_found_before_training(tmp_path):
    """Every token is checked, not a sample: in 3M tokens, one bad id at an index that a
    1-in-3 sample would skip."""
    make_dataset(tmp_path / "data", n_train=3_000_000)
    path = tmp_path / "data" / "toy" / "train.bin"
    tokens = np.fromfile(path, np.uint16)
    tokens[2_000_001] = 70
    tokens.tofile(path)
    with pytest.raises(dataset.DataError, match=r"train.bin holds token id 70 >= vocab_size 65 \(at "
                                              r"token 2,000,001\)"):
        dataset.open_split(small_config(tmp_path), "train", 65)
    assert dataset.first_token_at_least(tokens, 65, chunk=1000) == 2_000_001  # found in a later chunk
    assert dataset.first_token_at_least(tokens[:2_000_001], 65, chunk=1000) is None
