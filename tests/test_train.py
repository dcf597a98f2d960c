import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import sharding
import train
from configurator import Config

ONE_DEVICE = jax.devices()[:1]


def make_dataset(root, name="toy", vocab_size=65, n_train=20_000, n_val=2_000, seed=0):
    """A dataset directory like the prepare scripts write, with a learnable pattern."""
    rng = np.random.default_rng(seed)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        # repeating phrases of random tokens: structured enough for the loss to fall
        phrases = rng.integers(0, vocab_size, size=(8, 16))
        tokens = phrases[rng.integers(0, 8, size=n // 16 + 1)].reshape(-1)[:n]
        tokens.astype(np.uint16).tofile(out / f"{split}.bin")
    kind = {"kind": "gpt2"} if vocab_size == 50257 else {"kind": "char", "chars": "".join(
        chr(0x100 + i) for i in range(vocab_size))}
    (out / "meta.json").write_text(json.dumps({**kind, "vocab_size": vocab_size}))
    return str(root)


def small_config(tmp_path, **overrides) -> Config:
    values = dict(data_dir=str(tmp_path / "data"), dataset="toy", out_dir=str(tmp_path / "out"),
                  n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=8, max_iters=8,
                  learning_rate=3e-3, warmup_iters=2, lr_decay_iters=8, min_lr=3e-4,
                  eval_interval=4, eval_iters=2, log_interval=1, tensorboard=False)
    return Config(**(values | overrides))


@pytest.fixture
def toy(tmp_path):
    make_dataset(tmp_path / "data")
    return tmp_path


def test_overfit_single_batch_on_gpt2_vocab(tmp_path):
    make_dataset(tmp_path / "data", vocab_size=50257)
    config = small_config(tmp_path, overfit_batch=True, max_iters=60, n_embd=64, batch_size=4,
                          learning_rate=1e-2, warmup_iters=5, lr_decay_iters=60, min_lr=1e-3,
                          eval_interval=1000, weight_decay=0.0)
    losses = [loss for _, loss in train.train(config, ONE_DEVICE)]
    assert abs(losses[0] - math.log(50257)) < 0.3
    assert losses[-1] < 0.1


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(toy):
    common = dict(dropout=0.1, gradient_accumulation_steps=2)
    straight = train.train(small_config(toy, out_dir=str(toy / "a"), **common), ONE_DEVICE)
    first = train.train(small_config(toy, out_dir=str(toy / "b"), max_iters=4, **common), ONE_DEVICE)
    rest = train.train(small_config(toy, out_dir=str(toy / "b"), init_from="resume", **common),
                       ONE_DEVICE)
    assert [s for s, _ in first + rest] == list(range(8))
    np.testing.assert_allclose([l for _, l in first + rest], [l for _, l in straight],
                               rtol=0, atol=1e-6)
    assert straight[-1][1] < straight[0][1]


def test_tensorboard_events_and_saved_config(toy):
    config = small_config(toy, tensorboard=True)
    train.train(config, ONE_DEVICE)
    events = EventAccumulator(os.path.join(config.out_dir, "tensorboard"))
    events.Reload()
    tags = events.Tags()["tensors"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "eval/val_loss"):
        assert tag in tags
    steps = [e.step for e in events.Tensors("train/loss")]
    assert steps == sorted(steps) and len(steps) == config.max_iters
    saved = json.loads(open(os.path.join(config.out_dir, "config.json")).read())
    assert saved["n_layer"] == 2 and saved["dataset"] == "toy"


def test_batch_is_a_pure_function_of_seed_and_step(toy):
    config = small_config(toy)
    tokens = train.open_split(config, "train", 65)
    all_rows = np.arange(config.batch_size)
    x1, y1 = train.batch_for_step(tokens, config, 5, "train", all_rows, n_micro=2)
    x2, _ = train.batch_for_step(tokens, config, 5, "train", all_rows, n_micro=2)
    x3, _ = train.batch_for_step(tokens, config, 6, "train", all_rows, n_micro=2)
    half, _ = train.batch_for_step(tokens, config, 5, "train", all_rows[4:], n_micro=2)
    assert x1.shape == (2, 8, 16)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[:, 4:], half)  # a process's rows are a slice of the batch
    np.testing.assert_array_equal(x1[..., 1:], y1[..., :-1])  # targets are inputs shifted by one
    assert not np.array_equal(x1, x3)


def test_learning_rate_schedule():
    config = Config(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lr = lambda step: float(train.learning_rate(config, step))
    assert lr(0) == pytest.approx(1 / 11)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)  # half way through the cosine
    assert lr(110) == pytest.approx(0.1) and lr(10_000) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices_and_embeddings(toy):
    setup = train.make_setup(small_config(toy), sharding.make_mesh(devices=ONE_DEVICE), 65)
    mask = jax.tree_util.tree_map_with_path(train.decays, setup.abstract_state["params"])
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["['wte']"] and flat["['blocks']['mlp']['fc_kernel']"]
    assert flat["['blocks']['attn']['qkv_kernel']"] and flat["['wpe']"]
    assert not flat["['blocks']['mlp']['fc_bias']"] and not flat["['ln_f']['scale']"]
    assert not flat["['blocks']['ln_1']['bias']"]


@pytest.mark.parametrize("problem, message", [
    ("missing", "not found: run `python data/toy/prepare.py`"),
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
    with pytest.raises(train.DataError, match=re.escape(message)):
        train.train(small_config(toy), ONE_DEVICE)


def test_resume_errors_name_the_problem(toy):
    with pytest.raises(train.CheckpointError, match="no checkpoint"):
        train.train(small_config(toy, init_from="resume"), ONE_DEVICE)
    train.train(small_config(toy, max_iters=4), ONE_DEVICE)
    with pytest.raises(train.CheckpointError, match="n_layer: checkpoint 2, config 3"):
        train.train(small_config(toy, init_from="resume", n_layer=3), ONE_DEVICE)


def test_command_line_errors_exit_with_one_line(toy):
    script = os.path.join(os.path.dirname(__file__), "..", "train.py")
    run = lambda *args: subprocess.run([sys.executable, script, *args], capture_output=True,
                                       text=True, timeout=120)
    bad_key = run("--batchsize=3")
    assert bad_key.returncode != 0
    assert bad_key.stderr.strip() == "config error: unknown config key 'batchsize': did you mean batch_size, block_size?"
    no_data = run(f"--data_dir={toy / 'nowhere'}", "--dataset=toy")
    assert no_data.returncode != 0 and "Traceback" not in no_data.stderr
    assert "run `python data/toy/prepare.py` first" in no_data.stderr
