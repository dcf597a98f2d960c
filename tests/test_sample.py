"""sample.py: the command line on Hugging Face files and on a trained checkpoint."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from test_hf import load, random_hf_gpt2, write_hf_gpt2
from test_train import make_dataset, small_config

import sample
import train
from common.model_setup import model_setup
from configurator import Config
from data.tokenizer import gpt2_tokenizer
from inference import loader
from weights import checkpoint

CHARS = "".join(chr(0x100 + i) for i in range(65))  # a 65-symbol character vocabulary
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_command_line_on_hugging_face_files_with_a_prompt_file(tmp_path, capsys):
    hf_dir = write_hf_gpt2(
        tmp_path / "gpt2", random_hf_gpt2(n_layer=2, n_embd=32, vocab_size=50257, n_positions=64), n_head=4
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\n\nThe quick brown fox jumps over the lazy\n")
    sample.main(
        [
            f"--init_from={hf_dir}",
            f"--start=FILE:{prompts}",
            "--num_samples=2",
            "--max_new_tokens=6",
            "--temperature=0",
            "--stream=True",
        ]
    )
    out, err = capsys.readouterr()
    samples = out.split("---------------\n")[:-1]
    assert len(samples) == 4  # 2 prompts (the empty line is skipped) x 2 samples
    assert samples[0].startswith("Hello, my name is") and samples[2].startswith("The quick brown fox")
    # Greedy, so the same twice: the first was streamed from inside the loop, the second printed.
    assert samples[0] == samples[1] and samples[2] == samples[3]
    n_prompt = 2 * len(gpt2_tokenizer().encode("Hello, my name isThe quick brown fox jumps over the lazy"))
    assert f"prefill: {n_prompt} prompt tokens" in err and "tok/s" in err and "decode:" in err
    with pytest.raises(SystemExit, match="config.json is missing"):
        sample.main([f"--init_from={tmp_path}", "--start=hi"])


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_fine_tune_from_hugging_face_files_then_sample_the_checkpoint(tmp_path, capsys, lora_rank):
    """train.py's init_from=<dir>: with learning rate 0 the saved parameters are the loaded ones (LoRA: the
    checkpoint's adapters, merged at load into the base its record names, change nothing)."""
    tensors = random_hf_gpt2(n_layer=2, n_embd=32, vocab_size=65, n_positions=32)
    hf_dir = write_hf_gpt2(tmp_path / "hf", tensors, n_head=4)
    data = tmp_path / "data" / "chars"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 65, 2000).astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps({"kind": "char", "vocab_size": 65, "chars": CHARS}))
    config = Config(
        init_from=hf_dir,
        data_dir=str(tmp_path / "data"),
        dataset="chars",
        quantization="int8",
        lora_rank=lora_rank,
        out_dir=str(tmp_path / "out"),
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=16,
        batch_size=2,
        max_iters=1,
        learning_rate=0.0,
        min_lr=0.0,
        warmup_iters=0,
        eval_interval=1,
        eval_iters=1,
        tensorboard=False,
    )
    train.train(config, jax.devices()[:1])
    if lora_rank:  # the checkpoint names its base, and holds the adapters only
        meta = checkpoint.newest_meta(config.out_dir)
        assert meta["lora_base"]["init_from"] == hf_dir and all("lora_" in p for p in meta["checksums"]["params"])
    setup, params, step, tok = loader.load_checkpoint(config.out_dir)
    assert setup.model_config.quantization == "none"  # trained quantized or not: chosen when sampling
    _, loaded = load(hf_dir, block_size=16)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    capsys.readouterr()
    sample.main(
        [
            "--init_from=resume",
            f"--out_dir={config.out_dir}",
            f"--start={CHARS[:4]}",
            "--num_samples=1",
            "--max_new_tokens=20",
            "--quantization=int8",
        ]
    )
    out, err = capsys.readouterr()
    assert out.startswith(CHARS[:4]) and len(out.split("\n")[0]) == 24  # on past the context (16)


def test_a_second_run_loads_its_programs_from_the_compile_cache_and_an_empty_one_is_off(tmp_path):
    """sample.py twice on one --compile_cache, in processes of their own: the second loads every program the
    first compiled, and says so; --compile_cache= compiles them all again. The text is the same each time."""
    hf_dir = write_hf_gpt2(
        tmp_path / "gpt2", random_hf_gpt2(n_layer=1, n_embd=32, vocab_size=50257, n_positions=32), n_head=4
    )

    def sample_with(cache: str) -> tuple[str, int, str]:
        flags = ["--start=Hello", "--num_samples=1", "--max_new_tokens=4", "--temperature=0"]
        done = subprocess.run(
            [sys.executable, "sample.py", f"--init_from={hf_dir}", *flags, f"--compile_cache={cache}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        programs, said = re.search(r"compile [\d.]+ s; (\d+) programs \((.*)\)$", done.stderr).groups()
        return done.stdout, int(programs), said

    text, programs, said = sample_with(str(tmp_path / "cache"))
    assert text.startswith("Hello") and programs >= 2 and said == "0 from the cache"
    assert sample_with(str(tmp_path / "cache")) == (text, programs, f"{programs} from the cache")
    assert sample_with("") == (text, programs, "compilation cache off")


def test_a_checkpoint_trained_with_its_layers_written_out_is_loaded_with_them_scanned(tmp_path):
    """How the layers run is chosen at load, as the attention is: scanned, so that decode programs
    compile in a time flat in depth. The logits are those of the model as it trained."""
    make_dataset(tmp_path / "data")
    config = small_config(tmp_path, n_layer=3, scan_layers=False, max_iters=1, eval_interval=1, eval_iters=1)
    train.train(config, jax.devices()[:1])
    assert checkpoint.newest_meta(config.out_dir)["config"]["scan_layers"] is False
    setup, params, _, _ = loader.load_checkpoint(config.out_dir)
    assert setup.model_config.scan_layers
    as_trained = model_setup(dataclasses.replace(setup.config, scan_layers=False), setup.mesh, 65)
    idx = np.random.default_rng(1).integers(0, 65, (2, 16))
    scanned = nnx.merge(setup.graphdef, params)(idx)
    written_out = nnx.merge(as_trained.graphdef, params)(idx)
    np.testing.assert_allclose(scanned, written_out, rtol=0, atol=1e-5)
