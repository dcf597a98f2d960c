"""What a run leaves in out_dir: never lost, never mixed with another run, never silently wrong
(issue 14's items 1-4, 6, 8 and 9; the test names say which)."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import (
    ONE_DEVICE,
    REPO,
    config_flags,
    logged_losses,
    make_dataset,
    small_config,
    snapshot,
    start_training,
    wait_for_line,
)

import plot
import sample
import sharding
import train
from inference import loader
from weights import checkpoint
from weights.checkpoint import CheckpointError


def main_error(argv, capfd) -> str:
    """train.main's exit message, after checking it is one line and nothing else was printed
    to stderr (no traceback, no library noise)."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    message = str(exit_info.value.code)
    assert "\n" not in message
    assert capfd.readouterr().err == ""
    return message


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    """A finished toy run: checkpoints at steps 4 and 8 and its per-step losses."""
    root = tmp_path_factory.mktemp("run8")
    make_dataset(root / "data")
    config = small_config(root, tensorboard=True)
    losses = dict(train.train(config, ONE_DEVICE))
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == [4, 8]
    return root, config, losses


@pytest.fixture
def copy_of_run8(run8, tmp_path):
    root, config, losses = run8
    shutil.copytree(root, tmp_path / "run", symlinks=True)
    return tmp_path / "run", small_config(tmp_path / "run", tensorboard=True), losses


# ----------------------------------------------------------------------------- 1: reusing an out_dir


def test_reusing_an_out_dir_for_a_fresh_run_is_refused_and_changes_nothing(copy_of_run8, capfd, monkeypatch):
    root, config, _ = copy_of_run8
    before = snapshot(root / "out")
    monkeypatch.chdir(root)  # relative paths, named absolute in the message (issue 33)
    message = main_error(
        config_flags(config) + ["--max_iters=12", "--lr_decay_iters=12", "--out_dir=out", "--data_dir=data"], capfd
    )
    assert message == (
        f"error: out_dir {root / 'out'} holds checkpoints of an earlier run (steps 4, 8): "
        f"continue it with --init_from=resume, choose another --out_dir, or pass "
        f"--overwrite_out_dir=True to delete them and start again"
    )
    assert snapshot(root / "out") == before


def test_reusing_an_out_dir_with_overwrite_starts_a_new_run(copy_of_run8, capsys):
    root, config, first_run = copy_of_run8
    again = small_config(
        root, tensorboard=True, overwrite_out_dir=True, max_iters=6, lr_decay_iters=6, learning_rate=1e-3
    )
    second_run = dict(train.train(again, ONE_DEVICE))
    assert "deleted the earlier run's checkpoints (steps 4, 8)" in capsys.readouterr().out
    assert checkpoint.checkpoint_manager(again, read_only=True).all_steps() == [4, 6]
    assert logged_losses(again.out_dir) == pytest.approx(second_run, abs=1e-6)  # none of run 1's
    assert second_run[1] != pytest.approx(first_run[1], abs=1e-6)


def test_reusing_an_out_dir_a_save_orbax_skips_is_an_error_not_a_message(copy_of_run8):
    root, config, _ = copy_of_run8
    setup = train.make_setup(config, sharding.mesh_from_config(config, ONE_DEVICE), 65)
    state = train.init_state(setup)  # step 0, behind the directory's step 8
    manager = checkpoint.checkpoint_manager(config)
    with pytest.raises(CheckpointError, match="the checkpoint of step 0 was not saved: .* already holds step 8"):
        checkpoint.save(manager, state, {}, None)
    manager.close()
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == [4, 8]


def test_retention_keeps_the_latest_and_the_best_and_saves_only_improvements(toy):
    """max_to_keep newest plus keep_best lowest val loss; always_save_checkpoint=False saves
    exactly the evaluations that improved the val loss (and the last one)."""
    config = small_config(
        toy,
        max_iters=12,
        lr_decay_iters=12,
        eval_interval=2,
        max_to_keep=2,
        keep_best=1,
        learning_rate=3e-2,
        tensorboard=True,
    )  # a high rate: val loss goes up and down
    train.train(config, ONE_DEVICE)
    val = dict(plot.read_scalars(config.out_dir)["eval/val_loss"])
    best = min(val, key=val.get)
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == sorted({10, 12, best})

    improving = small_config(
        toy,
        out_dir=str(toy / "improving"),
        max_iters=12,
        lr_decay_iters=12,
        eval_interval=2,
        max_to_keep=10,
        learning_rate=3e-2,
        always_save_checkpoint=False,
    )
    train.train(improving, ONE_DEVICE)
    saved = checkpoint.checkpoint_manager(improving, read_only=True).all_steps()
    record, expected = float("inf"), []
    for step in sorted(val):  # the same run (same seed and data) as above: the same losses
        if val[step] < record or step == 12:
            expected.append(step)
        record = min(record, val[step])
    assert saved == expected


# ----------------------------------------------------------------------------- 2: the vocabulary


def rewrite_vocabulary(root, chars):
    meta = root / "data" / "toy" / "meta.json"
    meta.write_text(json.dumps({"kind": "char", "vocab_size": len(chars), "chars": chars}))


def test_samples_use_the_vocabulary_stored_with_the_checkpoint(copy_of_run8, tmp_path, monkeypatch, capsys):
    root, config, _ = copy_of_run8
    trained_chars = json.loads((root / "data" / "toy" / "meta.json").read_text())["chars"]
    rewrite_vocabulary(root, "".join(chr(0x400 + i) for i in range(65)))  # re-prepared since
    *_, tok = loader.load_checkpoint(config.out_dir)
    assert tok.chars == trained_chars
    shutil.rmtree(root / "data")  # and the dataset gone: sampling needs only the checkpoint
    monkeypatch.chdir(tmp_path)  # from another working directory
    sample.main(
        [f"--out_dir={config.out_dir}", f"--start={trained_chars[:3]}", "--num_samples=1", "--max_new_tokens=5"]
    )
    out, err = capsys.readouterr()
    text = out.splitlines()[0]
    assert text.startswith(trained_chars[:3]) and set(text) <= set(trained_chars)
    assert err.startswith("loaded step 8 from") and "WARNING" not in err  # no absl notes


def test_resuming_on_a_dataset_with_another_vocabulary_names_both(copy_of_run8, capfd):
    root, config, _ = copy_of_run8
    rewrite_vocabulary(root, "".join(chr(0x400 + i) for i in range(65)))  # same size, other symbols
    message = main_error(config_flags(config) + ["--init_from=resume", "--max_iters=12"], capfd)
    assert "was trained on a vocabulary of char-level, 65 symbols ('Ā', 'ā'" in message
    assert "meta.json describes char-level, 65 symbols ('Ѐ', 'Ё'" in message


# ----------------------------------------------------------------------------- 3: two runs at once


def test_a_second_run_in_the_same_out_dir_is_refused_at_start(toy_run_in_progress, capfd):
    config, proc = toy_run_in_progress
    message = main_error(config_flags(config), capfd)
    assert message.startswith(f"error: out_dir {config.out_dir} is in use by another training run (pid {proc.pid} on ")
    proc.send_signal(signal.SIGTERM)  # the first run is unharmed: it saves and resumes
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "SIGTERM: saved a checkpoint" in output, output


@pytest.fixture
def toy_run_in_progress(tmp_path):
    make_dataset(tmp_path / "data")
    config = small_config(tmp_path, max_iters=100_000, lr_decay_iters=100_000, eval_interval=1000)
    proc = start_training(config)
    wait_for_line(proc, "step 2 |")
    yield config, proc
    proc.kill()
    proc.wait()


def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    out_dir = str(tmp_path / "out")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from weights import checkpoint; "
            "checkpoint.OutDirLock(sys.argv[1]).claim(); print('locked', flush=True); "
            "time.sleep(600)",
            out_dir,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(CheckpointError, match="in use by another training run"):
        checkpoint.OutDirLock(out_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    checkpoint.OutDirLock(out_dir).release()  # free again, with no clean-up by anyone


# ----------------------------------------------------------------------------- 4: damage


def remove_array_files(step_dir):
    for path in glob.glob(str(step_dir / "params" / "ocdbt.process_0" / "d" / "*")):
        os.remove(path)


def truncate_array_files(step_dir):
    for path in glob.glob(str(step_dir / "params" / "ocdbt.process_0" / "d" / "*")):
        os.truncate(path, os.path.getsize(path) // 2)


def flip_bits(step_dir):
    """Bytes inside the parameters' data inverted, the file's length unchanged: what a bad disk or
    a bad copy does, and what Orbax reads back without a word."""
    for path in glob.glob(str(step_dir / "params" / "ocdbt.process_0" / "d" / "*")):
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            data = f.read(16)
            f.seek(-len(data), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))


DAMAGE = {
    "missing array files": remove_array_files,
    "truncated array files": truncate_array_files,
    "truncated meta": lambda step_dir: os.truncate(step_dir / "meta" / "metadata", 10),
    "missing params item": lambda step_dir: shutil.rmtree(step_dir / "params"),
    "empty step folder": lambda step_dir: [shutil.rmtree(step_dir), step_dir.mkdir()],
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_latest_checkpoint_resumes_from_the_newest_intact_one(copy_of_run8, damage, capfd):
    root, config, straight = copy_of_run8
    checkpoints = root / "out" / "checkpoints"
    DAMAGE[damage](checkpoints / "8")
    resumed = dict(train.train(small_config(root, init_from="resume", max_iters=10, lr_decay_iters=8), ONE_DEVICE))
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Event loop" not in out + err, err
    assert (
        "warning: damaged checkpoint step 8 (" in out
        and f"moved to {config.out_dir}/checkpoints-damaged; resuming from step 4, the newest intact one" in out
    )
    assert os.path.isdir(root / "out" / "checkpoints-damaged" / "8")  # kept, for a look
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == [4, 8, 10]
    # steps 4..7 again from step 4's state: the losses of the first time
    np.testing.assert_allclose([resumed[s] for s in range(4, 8)], [straight[s] for s in range(4, 8)], rtol=0, atol=1e-6)


def test_a_resume_after_damage_counts_from_the_newest_intact_step(copy_of_run8, capfd):
    """Step 8 damaged, max_iters 6 (issue 42): the run goes on from step 4, where it used to stop at
    "step 8 ... nothing left to train"; the warning names the damaged file whole, never cut."""
    root, _, _ = copy_of_run8
    truncate_array_files(root / "out" / "checkpoints" / "8")
    resumed = dict(train.train(small_config(root, init_from="resume", max_iters=6), ONE_DEVICE))
    assert sorted(resumed) == [4, 5]
    warning = next(line for line in capfd.readouterr().out.splitlines() if line.startswith("warning: damaged"))
    assert re.search(
        r'Error reading "[^"]+" in OCDBT database at local file "[^"]*/out/checkpoints/8/params/": '
        r".+: moved to .*resuming from step 4, the newest intact one$",
        warning,
    ), warning


@pytest.mark.parametrize("damage", [truncate_array_files, flip_bits], ids=["truncated", "flipped bits"])
def test_a_damaged_latest_checkpoint_is_skipped_when_sampling(copy_of_run8, damage, capfd):
    root, config, _ = copy_of_run8
    damage(root / "out" / "checkpoints" / "8")
    _, _, step, _ = loader.load_checkpoint(config.out_dir)
    err = capfd.readouterr().err
    assert step == 4
    assert "warning: damaged checkpoint step 8 (" in err and "using step 4, the newest intact one" in err
    assert "Traceback" not in err
    assert os.path.isdir(root / "out" / "checkpoints" / "8")  # sampling moves nothing


def test_restored_arrays_are_checked_against_their_checksums_and_for_non_finite_parameters():
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    meta = {"checksums": {"params": checkpoint.checksums_of(tree)}}
    assert checkpoint.verify("params", tree, meta) is None and checkpoint.verify("params", tree, {}) is None
    moved = {**tree, "w": tree["w"][::-1]}  # the same values in another order
    assert checkpoint.verify("params", moved, meta) == "params['w'] does not match the checksum written with it"
    nan = {**tree, "b": tree["b"].at[1].set(jnp.nan)}
    assert checkpoint.verify("params", nan, {}) == "params['b'] holds values that are not finite (NaN or inf)"


def test_every_checkpoint_damaged_is_one_message(copy_of_run8, capfd):
    root, config, _ = copy_of_run8
    for step in ("4", "8"):
        truncate_array_files(root / "out" / "checkpoints" / step)
    message = main_error(config_flags(config) + ["--init_from=resume", "--max_iters=10"], capfd)
    assert message.startswith(f"error: every checkpoint in {root / 'out' / 'checkpoints'} is damaged (step 8: ")
    assert "; step 4: " in message


# ----------------------------------------------------------------------------- 6-8: data, values, out_dir


def test_a_run_whose_every_step_was_skipped_saves_no_checkpoint(toy, monkeypatch):
    training_loss = train.training_loss
    monkeypatch.setattr(train, "training_loss", lambda *args: jax.tree.map(lambda a: a * np.nan, training_loss(*args)))
    config = small_config(toy, nan_policy="skip_step")
    with pytest.raises(train.TrainingError, match="every step since step 0 was non-finite and skipped"):
        train.train(config, ONE_DEVICE)
    assert checkpoint.checkpoint_manager(config, read_only=True).all_steps() == []


def test_resuming_a_finished_run_says_there_is_nothing_to_train(run8, capfd):
    root, config, _ = run8
    message = main_error(config_flags(config) + ["--init_from=resume"], capfd)
    assert "is at step 8 and max_iters is 8: nothing left to train. Raise --max_iters" in message


@pytest.mark.parametrize(
    "where, message",
    [
        ("a_file", "is a file, not a directory: choose another --out_dir"),
        ("a_file/below", "can't write to out_dir"),
    ],
)
def test_an_unusable_out_dir_is_one_message_before_compiling(toy, where, message, capfd):
    (toy / "a_file").write_text("not a directory")
    config = small_config(toy, out_dir=str(toy / where))
    assert message in main_error(config_flags(config), capfd)


# ----------------------------------------------------------------------------- 9, 10: messages


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--out_dir={root}/nowhere"],
            "error: no checkpoint in {root}/nowhere/checkpoints: train one first, "
            "or point --out_dir at a run that has one",
        ),
        (
            ["--out_dir={root}/out", "--mesh_data=16"],
            "error: mesh_data x mesh_tensor = 16 x 1 devices, but there are 8: lower them",
        ),
        (
            ["--out_dir={root}/nowhere", "--start=FILE:{root}/prompts.txt"],  # before the checkpoint is looked for
            "error: --start=FILE:{root}/prompts.txt: No such file or directory",
        ),
        (["--out_dir={root}/out", "--start=FILE:{root}"], "error: --start=FILE:{root}: Is a directory"),
    ],
)
def test_sample_errors_name_only_its_own_flags(run8, flags, message, capsys):
    root = run8[0]
    with pytest.raises(SystemExit) as exit_info:
        sample.main([f.format(root=root) for f in flags])
    assert str(exit_info.value.code) == message.format(root=root)
    assert "WARNING" not in capsys.readouterr().err


def test_resuming_with_no_checkpoint_prints_one_line(tmp_path):
    make_dataset(tmp_path / "data")
    config = small_config(tmp_path, init_from="resume")
    run = subprocess.run(
        [sys.executable, "train.py", *config_flags(config)],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 1
    assert (
        run.stderr == f"error: no checkpoint in {tmp_path / 'out' / 'checkpoints'}: train one "
        f"first, or point --out_dir at a run that has one\n"
    )
    assert not os.path.exists(tmp_path / "out")


@pytest.fixture
def toy(tmp_path):
    make_dataset(tmp_path / "data")
    return tmp_path
