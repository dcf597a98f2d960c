"""data/dataset.py: the token files checked at start-up, and the batch of a step as a pure function."""

import dataclasses
import json
import re

import numpy as np
import pytest
import tokenizers
from test_train import ONE_DEVICE, make_dataset, small_config

import train
from data import dataset
from data.tokenizer import hf_tokenizer
from data.writer import write_dataset
from inference import generate, loader


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


def test_the_last_token_of_a_split_is_a_target(toy):
    """A split of block_size + 1 tokens is one row: its inputs, then its targets up to the last token."""
    config = small_config(toy)
    tokens = np.arange(config.block_size + 1, dtype=np.uint16)
    x, y = dataset.batch_for_step(tokens, config, 0, "train", np.arange(config.batch_size), n_micro=1)
    assert (x[..., 0] == 0).all() and (y[..., -1] == config.block_size).all()


@pytest.mark.parametrize(
    "problem, message",
    [
        ("missing", "not found: run `python data/text/prepare.py --input_dir=YOUR_TEXT --out_dir="),
        ("odd_bytes", "not a whole number of uint16 tokens"),
        ("too_short", "fewer than block_size+1"),
        ("bad_ids", "token id 70 >= vocab_size 65"),
    ],
)
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


def test_a_fine_tuning_set_not_yet_prepared_names_the_chat_prepare_script(tmp_path):
    """packing=True runs on conversations: the dataset it lacks is made by data/chat/prepare.py, not
    data/text/prepare.py, whether meta.json (the tokenizer) or, with vocab_size given, train.bin is missed."""
    out_dir = f"--out_dir={tmp_path / 'data' / 'my_chats'}`"
    chat = "`python data/chat/prepare.py --input=YOUR_CONVERSATIONS.jsonl " + out_dir
    text = "`python data/text/prepare.py --input_dir=YOUR_TEXT " + out_dir
    for keys, missing, command in (
        ({"packing": True}, "meta.json", chat),
        ({"packing": True, "vocab_size": 65}, "train.bin", chat),
        ({}, "meta.json", text),
    ):  # without packing, a text dataset
        with pytest.raises(dataset.DataError) as e:
            train.train(small_config(tmp_path, dataset="my_chats", **keys), ONE_DEVICE)
        assert f"my_chats/{missing} not found" in str(e.value) and str(e.value).endswith(command), str(e.value)


def test_a_val_split_shorter_than_a_row_names_the_val_fraction_to_prepare_with(toy):
    """Issue 42: val.bin of a few tokens; the message names the prepare command with a --val_fraction
    that gives val one row (block_size 16 + 1 tokens) with room to spare."""
    meta = toy / "data" / "toy" / "meta.json"
    meta.write_text(
        json.dumps(
            {
                **json.loads(meta.read_text()),
                "prepare": "python data/text/prepare.py "
                "--input_dir=corpus --out_dir=data/toy --val_fraction=0.0005 --seed=1",
            }
        )
    )
    np.arange(10, dtype=np.uint16).tofile(toy / "data" / "toy" / "val.bin")
    with pytest.raises(dataset.DataError) as e:
        dataset.open_split(small_config(toy), "val", 65)
    assert str(e.value).endswith(
        "fewer than block_size+1 = 17 (one row and its targets): lower --block_size, or "
        "give val a larger share of the documents: `python data/text/prepare.py "
        "--input_dir=corpus --out_dir=data/toy --seed=1 --val_fraction=0.002`"
    )


def test_a_bad_token_id_anywhere_in_the_data_is_found_before_training(tmp_path):
    """Every token is checked, not a sample: in 3M tokens, one bad id at an index that a
    1-in-3 sample would skip."""
    make_dataset(tmp_path / "data", n_train=3_000_000)
    path = tmp_path / "data" / "toy" / "train.bin"
    tokens = np.fromfile(path, np.uint16)
    tokens[2_000_001] = 70
    tokens.tofile(path)
    with pytest.raises(
        dataset.DataError,
        match=r"train.bin holds token id 70 >= vocab_size 65 \(at "
        r"token 2,000,001\)",
    ):
        dataset.open_split(small_config(tmp_path), "train", 65)
    assert dataset.first_token_at_least(tokens, 65, chunk=1000) == 2_000_001  # found in a later chunk
    assert dataset.first_token_at_least(tokens[:2_000_001], 65, chunk=1000) is None


def test_a_vocabulary_over_65536_tokens_trains_resumes_and_samples_from_uint32_files(tmp_path):
    """70,000 words, half the text above id 65,535: the ids survive the file, the batches,
    a resume (same losses as one run) and sampling (decoded by the run's own tokenizer)."""
    words = [f"w{i}" for i in range(70_000)]
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, "w0"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    word_level.decoder = tokenizers.decoders.WordPiece()  # joins the words with spaces
    word_level.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    tok = hf_tokenizer(tok_dir)
    rng = np.random.default_rng(0)
    phrases = rng.integers(60_000, 70_000, size=(8, 16))  # a learnable pattern, high ids
    ids = phrases[rng.integers(0, 8, size=400)].reshape(-1)
    meta = {"kind": "huggingface", "vocab_size": tok.vocab_size, "sha256": tok.sha256, "tokenizer": "tokenizer.json"}
    write_dataset(tmp_path / "data" / "words", ids[:5000], ids[5000:], meta, files=tok.files)
    assert json.loads((tmp_path / "data" / "words" / "meta.json").read_text())["dtype"] == "uint32"

    config = small_config(tmp_path, dataset="words", max_iters=4, eval_interval=2, eval_iters=1, lr_decay_iters=4)
    np.testing.assert_array_equal(dataset.open_split(config, "train", 70_000), ids[:5000])
    whole = train.train(config, ONE_DEVICE)
    first = train.train(dataclasses.replace(config, out_dir=str(tmp_path / "b"), max_iters=2), ONE_DEVICE)
    rest = train.train(dataclasses.replace(config, out_dir=str(tmp_path / "b"), init_from="resume"), ONE_DEVICE)
    assert first + rest == whole

    setup, params, _, run_tok = loader.load_checkpoint(config.out_dir)
    prompt = [int(i) for i in phrases[0, :4]]
    new = generate.generate(setup, params, [prompt], 12, temperature=0).tokens[0]
    assert len(new) == 12 and run_tok.encode(run_tok.decode(prompt + new)) == prompt + new


def chat_dataset(root, lengths, name="chats"):
    """A fine-tuning set as data/chat/prepare.py writes it: conversation c is the tokens 10*c + (0, 1, ...)
    (char-level ids), its second half masked 1 (its 'assistant turn')."""
    out = root / name
    out.mkdir(parents=True)
    for split in ("train", "val"):
        tokens = np.concatenate([10 * c + np.arange(n) for c, n in enumerate(lengths)])
        mask = np.concatenate([np.arange(n) >= n // 2 for n in lengths])
        starts = np.cumsum([0] + list(lengths[:-1]))
        for suffix, values, dtype in (
            ("", tokens, np.uint16),
            (".mask", mask, np.uint8),
            (".starts", starts, np.uint64),
        ):
            values.astype(dtype).tofile(out / f"{split}{suffix}.bin")
    chars = "".join(chr(0x100 + i) for i in range(10 * len(lengths)))
    (out / "meta.json").write_text(
        json.dumps({"kind": "char", "chars": chars, "vocab_size": len(chars), "chat": {"block_size": 8}})
    )
    return 10 * len(lengths)


@pytest.mark.parametrize("packing", [False, True])
def test_fine_tuning_batches_are_whole_conversations_with_targets_only_where_the_mask_says(tmp_path, packing):
    lengths = [5, 9, 3, 7, 2, 4, 6, 9]
    vocab = chat_dataset(tmp_path, lengths)
    config = small_config(
        tmp_path, data_dir=str(tmp_path), dataset="chats", block_size=8, batch_size=2, packing=packing
    )
    assert dataset.chat_meta(config) == {"block_size": 8}
    data = dataset.open_chat_split(config, "train", vocab)
    # rows: one conversation each, or consecutive ones filling 9 tokens (inputs and the last target)
    rows = [[0], [1], [2], [3], [4], [5], [6], [7]] if not packing else [[0], [1], [2], [3, 4], [5], [6], [7]]
    assert [list(data.starts).index(s) for s in data.row_start] == [r[0] for r in rows]
    everything = np.arange(2)
    seen = []
    for step in range(len(rows)):  # 2 steps x 2 micro-batches x 2 rows: every row once per epoch (here 7 or 8 rows)
        arrays = dataset.chat_batch_for_step(data, config, step, "train", everything, n_micro=2)
        assert len(arrays) == (3 if packing else 2)
        for row in zip(*(a.reshape(-1, 8) for a in arrays)):
            x, y = row[:2]
            conversations = [c for c in range(len(lengths)) if 10 * c <= x[0] < 10 * c + 10]
            first = conversations[0]
            members = next(r for r in rows if r[0] == first)
            seen.append(first)
            expected = np.concatenate([10 * c + np.arange(lengths[c]) for c in members])
            is_target = np.concatenate([np.arange(lengths[c]) >= lengths[c] // 2 for c in members])
            n = len(expected)
            np.testing.assert_array_equal(x[:n], expected[:8])
            np.testing.assert_array_equal(x[n:], 0)  # padding
            np.testing.assert_array_equal(y[: n - 1], np.where(is_target[1:], expected[1:], -1))
            np.testing.assert_array_equal(y[n - 1 :], -1)  # no target in the padding
            if packing:  # each conversation a segment of its own, from 1; padding 0
                ids = np.concatenate([np.full(lengths[c], i + 1) for i, c in enumerate(members)])
                np.testing.assert_array_equal(row[2][:n], ids[:8])
                np.testing.assert_array_equal(row[2][n:], 0)
    epoch = len(rows)
    assert sorted(seen[:epoch]) == [r[0] for r in rows]  # an epoch draws each row once
    again = dataset.chat_batch_for_step(data, config, 1, "train", everything, n_micro=2)
    one_row = dataset.chat_batch_for_step(data, config, 1, "train", everything[1:], n_micro=2)
    for a, b, c in zip(dataset.chat_batch_for_step(data, config, 1, "train", everything, n_micro=2), again, one_row):
        np.testing.assert_array_equal(a, b)  # a pure function of (seed, step)
        np.testing.assert_array_equal(a[:, 1:], c)  # a process's rows are a slice of the batch


def test_a_fine_tuning_set_longer_than_the_run_s_block_size_is_refused(tmp_path):
    vocab = chat_dataset(tmp_path, [6, 9, 3])
    config = small_config(tmp_path, data_dir=str(tmp_path), dataset="chats", block_size=4)
    with pytest.raises(
        dataset.DataError,
        match=r"holds 2 conversations longer than block_size \+ 1 = 5 tokens.*"
        r"--block_size=4",
    ):
        dataset.open_chat_split(config, "train", vocab)
