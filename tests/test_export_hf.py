"""A Llama-family directory with its tokenizer, end to end (sample it, prepare data with its
tokenizer, fine-tune it, sample the checkpoint, export it), and export_hf.py's messages."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
import tokenizers
from test_hf import LLAMA, assert_trees_equal, export, load, random_params
from test_tokenizer import load_prepare_script, make_tokenizer
from test_train import make_dataset, small_config

import export_hf
import sample
import train
from configurator import Config
from data import chat_template
from data.tokenizer import hf_tokenizer
from inference import loader
from weights import hf

TEXT = "The quick brown fox jumps over the lazy dog. Hello, world! café ☕ naïve résumé. " * 40


def test_a_llama_directory_with_its_tokenizer_end_to_end(tmp_path, capsys):
    tok_dir = make_tokenizer(tmp_path / "tok")  # a Llama-like tokenizer: <|begin_of_text|> first
    tok = hf_tokenizer(tok_dir)
    config = dataclasses.replace(LLAMA, vocab_size=tok.vocab_size, n_kv_head=2)
    model_dir = export(tmp_path / "llama", config, random_params(config))
    for name in os.listdir(tok_dir):
        shutil.copy(tok_dir / name, os.path.join(model_dir, name))

    # Sample it: the prompt is encoded after <|begin_of_text|>, which is not printed.
    sample.main(
        [f"--init_from={model_dir}", "--start=Hello, world", "--num_samples=1", "--max_new_tokens=8", "--temperature=0"]
    )
    out, err = capsys.readouterr()
    assert out.startswith("Hello, world") and "Hugging Face tokenizer" in err

    # Prepare text with its tokenizer, fine-tune (learning rate 0: the weights stay the loaded ones).
    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):  # a document each: one for train, one for val
        (tmp_path / "corpus" / name).write_text(TEXT, encoding="utf-8")
    load_prepare_script().main(
        [
            f"--input_dir={tmp_path / 'corpus'}",
            f"--out_dir={tmp_path / 'data' / 'mine'}",
            f"--tokenizer={tok_dir}",
            "--num_proc=1",
            "--val_fraction=0.5",
        ]
    )
    run = Config(
        init_from=model_dir,
        data_dir=str(tmp_path / "data"),
        dataset="mine",
        out_dir=str(tmp_path / "out"),
        **hf.read_config(model_dir).keys,
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
    train.train(run, jax.devices()[:1])
    assert os.path.isfile(tmp_path / "out" / "tokenizer" / "tokenizer.json")  # the run keeps its tokenizer

    # The checkpoint samples without the dataset, through the tokenizer it was trained with.
    shutil.rmtree(tmp_path / "data")
    setup, params, _, saved_tok = loader.load_checkpoint(run.out_dir)
    assert saved_tok.describe()["sha256"] == tok.describe()["sha256"]
    _, loaded = load(model_dir, block_size=16)
    assert_trees_equal(jax.tree.map(np.asarray, params), loaded)

    # Export: the same weights, the tokenizer's files, its end token in generation_config.json.
    export_hf.main([f"--out_dir={run.out_dir}", f"--to={tmp_path / 'exported'}"])
    exported = tmp_path / "exported"
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= set(os.listdir(exported))
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == tok.stop_tokens
    assert hf.read_config(str(exported)).keys == hf.read_config(model_dir).keys
    assert_trees_equal(load(str(exported), block_size=16)[1], loaded)


CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65


def test_char_level_export_round_trips_and_bad_requests_are_one_line(tmp_path, capsys):
    """The character table becomes a tokenizer.json (issue 42: the export could not be sampled)."""
    make_dataset(tmp_path / "data")
    meta = tmp_path / "data" / "toy" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "chars": CHARS}))
    config = small_config(tmp_path, max_iters=2, eval_interval=2, pad_vocab_to_multiple=8)
    train.train(config, jax.devices()[:1])
    capsys.readouterr()
    export_hf.main([f"--out_dir={config.out_dir}", f"--to={tmp_path / 'hf'}"])
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel" in out and sorted(os.listdir(tmp_path / "hf")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 65  # padding dropped
    text = "ROMEO:\nO, she doth teach  the torches!\n\n"
    loaded = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert loaded.encode(text).ids == [CHARS.index(c) for c in text] and loaded.decode(loaded.encode(text).ids) == text
    # The export samples as the checkpoint does: the same prompt ids, the same greedy text.
    flags = ["--start=ROMEO: O", "--num_samples=1", "--max_new_tokens=12", "--temperature=0"]
    samples = []
    for source in (f"--out_dir={config.out_dir}", f"--init_from={tmp_path / 'hf'}"):
        sample.main([source, *flags])
        samples.append(capsys.readouterr().out)
    assert samples[0] == samples[1] and samples[0].startswith("ROMEO: O")
    # serve.py's default chat template goes with it: transformers' apply_chat_template gives serve.py's ids.
    exported, original = hf_tokenizer(tmp_path / "hf"), loader.load_checkpoint(config.out_dir)[3]
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "O, she doth"},
        {"role": "user", "content": "teach!"},
    ]
    assert exported.chat_template == chat_template.DEFAULT_TEMPLATE and original.chat_template is None
    assert exported.encode(chat_template.render(exported, messages)) == original.encode(
        chat_template.render(original, messages)
    )

    for flags, words in [
        ([f"--to={tmp_path / 'hf'}"], ["already exists and is not an empty directory"]),
        ([], ["--to must name the directory"]),
        ([f"--to={tmp_path / 'x'}", "--dtype=float16"], ["'dtype' must be one of 'float32', 'bfloat16'"]),
    ]:
        with pytest.raises(SystemExit) as excinfo:
            export_hf.main([f"--out_dir={config.out_dir}", *flags])
        assert all(word in str(excinfo.value) for word in words) and "\n" not in str(excinfo.value)
    assert not os.path.exists(tmp_path / "x")

    mixed = small_config(tmp_path, max_iters=2, eval_interval=2, norm="rmsnorm", out_dir=str(tmp_path / "mixed"))
    train.train(mixed, jax.devices()[:1])
    with pytest.raises(SystemExit, match="mixes gpt2's pos_embedding='learned' with norm='rmsnorm'"):
        export_hf.main([f"--out_dir={mixed.out_dir}", f"--to={tmp_path / 'y'}"])
    assert not os.path.exists(tmp_path / "y") and [p for p in os.listdir(tmp_path) if p.startswith(".y")] == []
