"""evals/scoring.py and eval.py: multiple-choice scores against one forward pass per choice, batching
and devices that change nothing, perplexity windows, the task in training, bad files."""

import json
import math
import urllib.error

import jax
import numpy as np
import pytest
from flax import nnx
from test_generate import tiny
from test_tokenizer import BOS, make_tokenizer
from test_train import ONE_DEVICE, make_dataset, small_config

import eval as eval_cli
import plot
import train
from data.tokenizer import char_tokenizer, gpt2_tokenizer, hf_tokenizer
from evals import scoring

CHARS = " " + "".join(chr(0x101 + i) for i in range(64))  # a space joins context and choice
TOK = char_tokenizer(CHARS)


def text(rng, n) -> str:
    return "".join(CHARS[i] for i in rng.integers(1, 65, n))  # no spaces inside


def write_examples(path, n=6, seed=0, context_len=12, hellaswag=True):
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            context, choices = text(rng, context_len), [text(rng, int(rng.integers(2, 8))) for _ in range(4)]
            label = int(rng.integers(0, 4))
            record = (
                {"ctx": context, "endings": choices, "label": str(label)}
                if hellaswag
                else {"context": context, "choices": choices, "label": label}
            )
            f.write(json.dumps(record) + "\n")
    return str(path)


def reference_sums(setup, params, rows: scoring.Rows) -> list:
    """One forward pass per row, unbatched and unpadded: the summed log-probability of its targets."""
    forward = jax.jit(lambda p, x: nnx.merge(setup.graphdef, p)(x))
    sums = []
    for tokens, start in zip(rows.tokens, rows.start):
        logits = np.asarray(forward(params, np.array([tokens[:-1]])))[0, :, :65].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        sums.append(sum(logp[t - 1, tokens[t]] for t in range(max(start, 1), len(tokens))))
    return sums


def make_spaced_dataset(root):
    """test_train's toy dataset, its 65 symbols renamed to CHARS (a space among them)."""
    make_dataset(root / "data")
    meta = root / "data" / "toy" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "chars": CHARS}))


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_scores_equal_one_forward_pass_per_choice_batched_or_not(model, tmp_path):
    setup, params = model
    examples = scoring.read_examples(write_examples(tmp_path / "hs.jsonl"), "hellaswag")
    rows = scoring.choice_rows(examples, TOK, setup.model_config.block_size)
    assert len(rows.tokens) == 24 and rows.start[0] == 12  # no start token at char level: context first
    reference = reference_sums(setup, params, rows)
    for batch_rows in (1, 5, 32):
        sums, counts, greedy = scoring.score_rows(setup, params, rows, batch_rows)
        np.testing.assert_allclose(sums, reference, rtol=0, atol=1e-5)
        assert list(counts) == [len(t) - s for t, s in zip(rows.tokens, rows.start)]
    assert scoring.multiple_choice(setup, params, TOK, examples, batch_rows=1) == scoring.multiple_choice(
        setup, params, TOK, examples, batch_rows=32
    )


def test_contexts_start_as_lm_evaluation_harness_starts_them(tmp_path):
    """Nothing before a GPT-2 context, BOS before a Llama-style one; an empty context is BOS, else
    <|endoftext|>; a context's trailing space moves to the continuation, which is what follows the
    context's tokens in the encoding of both together. --prefix picks the other convention."""
    gpt2, llama = gpt2_tokenizer(), hf_tokenizer(make_tokenizer(tmp_path / "tok"))
    for tok, start, empty in ((gpt2, [], gpt2.eot_token), (llama, [BOS], BOS)):
        context, ending = scoring.encode_pair(tok, "Hello, world ", "again")
        assert context == start + tok.encode("Hello, world")
        assert context + ending == start + tok.encode("Hello, world again")
        assert scoring.encode_pair(tok, "", " again") == ([empty], tok.encode(" again"))
    rows = scoring.choice_rows([scoring.Example("Hello, world", ("again", "x"), 0, "x:1")], gpt2, 64)
    assert rows.tokens[0] == gpt2.encode("Hello, world again")  # no <|endoftext|> first
    eot = scoring.choice_rows([scoring.Example("Hello, world", ("again", "x"), 0, "x:1")], gpt2, 64, prefix="eot")
    assert eot.tokens[0] == [gpt2.eot_token] + rows.tokens[0]
    assert scoring.encode_pair(llama, "Hello", " again", prefix="none")[0] == llama.encode("Hello")
    with pytest.raises(scoring.EvalError, match="--prefix=bos: this tokenizer has no BOS token"):
        scoring.choice_rows([scoring.Example("Hello", ("a", "b"), 0, "x:1")], gpt2, 64, prefix="bos")


def test_hellaswag_lines_read_as_the_harness_reads_them(tmp_path):
    path = tmp_path / "hs.jsonl"
    path.write_text(
        json.dumps(
            {
                "activity_label": "Roof shingle removal",
                "ctx_a": "A man is sitting on a roof.",
                "ctx_b": "he",
                "ctx": "A man is sitting on a roof. he",
                "label": "1",
                "endings": ["is using wrap.", " [title] Remove the shingles. [step] Use a pry bar."],
            }
        )
    )
    (example,) = scoring.read_examples(str(path), "hellaswag")
    assert example.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert example.choices == ("is using wrap.", " Remove the shingles. Use a pry bar.")  # the harness's own
    (raw,) = scoring.read_examples(str(path), "hellaswag", hellaswag_text="raw")  # build-nanogpt's
    assert raw.context == "A man is sitting on a roof. he" and raw.choices[1].startswith(" [title] Remove")


def test_eight_devices_give_what_one_gives(model, tmp_path):
    setup, params = model
    examples = scoring.read_examples(write_examples(tmp_path / "hs.jsonl", n=5), "hellaswag")
    rows = scoring.choice_rows(examples, TOK, setup.model_config.block_size)
    setup8, _ = tiny(jax.devices(), data=8)
    params8 = jax.device_put(params, setup8.state_shardings["params"])
    one, _, _ = scoring.score_rows(setup, params, rows, 8)
    eight, _, _ = scoring.score_rows(setup8, params8, rows, 8)
    np.testing.assert_allclose(eight, one, rtol=1e-6)  # sums of ~50 log-probabilities in another order


def test_acc_and_acc_norm_worked_by_hand():
    """Per token, 3 examples of 2 choices. Sums and token counts: (-4, 2 tokens) vs (-6, 4): acc
    picks choice 0 (-4 > -6), acc_norm choice 1 (-1.5 > -2); (-3, 3) vs (-1, 1): both pick 1;
    (-2, 1) vs (-9, 9): acc picks 0, acc_norm ties at -1 and takes the first, 0.
    Per character (the harness's), "bb" vs "c" at -5 vs -3: -2.5 > -3 picks 0; counting the space
    before each choice would give -5/3 < -3/2 and pick 1."""
    examples = [scoring.Example("a", ("b", "c"), label, f"x:{i}") for i, label in enumerate((1, 0, 0))]
    sums, counts = np.array([-4.0, -6, -3, -1, -2, -9]), np.array([2, 4, 3, 1, 1, 9])
    assert scoring.accuracy(examples, sums, counts, norm="token") == {"acc": 1 / 3, "acc_norm": 2 / 3, "examples": 3}
    by_char = scoring.accuracy([scoring.Example("a", ("bb", "c"), 0, "x:0")], np.array([-5.0, -3]), np.array([1, 1]))
    assert by_char == {"acc": 0, "acc_norm": 1, "examples": 1}


def test_perplexity_scores_every_token_once_in_half_overlapping_windows(model):
    setup, params = model
    ids = list(np.random.default_rng(1).integers(0, 65, 100))
    rows = scoring.window_rows(ids, 32)
    scored = [
        row_start + begin
        for begin, (row, start) in zip(range(0, 100, 16), zip(rows.tokens, rows.start))
        for row_start in range(max(start, 1), len(row))
    ]
    assert scored == list(range(1, 100))  # each token after the first, once, in order
    assert all(start >= 16 for start in rows.start[1:])  # with at least half a window before it
    assert len(rows.tokens) == 6 and all(len(row) <= 33 for row in rows.tokens)  # begins 0, 16, ..., 80
    text = "".join(CHARS[i] for i in ids)
    result = scoring.perplexity(setup, params, TOK, text)
    nats = -sum(reference_sums(setup, params, rows))
    assert result["tokens"] == 99 and result["bytes"] == len(text.encode())
    assert math.isclose(result["loss"], nats / 99, rel_tol=1e-6)
    assert math.isclose(result["bits_per_byte"], nats / math.log(2) / len(text.encode()), rel_tol=1e-6)
    assert math.isclose(result["perplexity"], math.exp(nats / 99), rel_tol=1e-6)


def test_a_long_context_is_cut_from_the_left_and_counted(model, tmp_path):
    setup, params = model
    examples = scoring.read_examples(write_examples(tmp_path / "long.jsonl", n=2, context_len=40), "hellaswag")
    rows = scoring.choice_rows(examples, TOK, 32)
    assert rows.truncated == 8 and all(len(row) == 33 for row in rows.tokens)
    result = scoring.multiple_choice(setup, params, TOK, examples)
    assert "8 rows cut from the left to fit" in scoring.summary("hellaswag", result)


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"ctx": "ab", "endings": ["c", "d"], "label": 2}', ["x.jsonl:2", "label 2 is not an index of its 2 choices"]),
        ('{"ctx": "ab", "endings": ["c", "d"]', ["x.jsonl:2", "malformed JSON"]),
        ('{"context": "ab", "choices": ["c", "d"], "label": 0}', ["x.jsonl:2", "no 'ctx', 'endings' field"]),
        ('{"ctx": "ab", "endings": "cd", "label": 0}', ["x.jsonl:2", "a list of at least two strings"]),
        ('{"ctx": "ab", "endings": ["c", " "], "label": 0}', ["x.jsonl:2", "choice 1 is empty"]),  # it would always win
    ],
)
def test_bad_lines_are_named(tmp_path, line, words):
    path = tmp_path / "x.jsonl"
    path.write_text('{"ctx": "ab", "endings": ["c", "d"], "label": 0}\n' + line + "\n")
    with pytest.raises(scoring.EvalError) as excinfo:
        scoring.read_examples(str(path), "hellaswag")
    assert all(word in str(excinfo.value) for word in words)


def test_command_line_and_its_one_line_errors(tmp_path, monkeypatch, capsys):
    make_spaced_dataset(tmp_path)
    config = small_config(tmp_path, max_iters=2, eval_interval=2)
    train.train(config, ONE_DEVICE)
    capsys.readouterr()
    data = write_examples(tmp_path / "c.jsonl", n=3, context_len=6, hellaswag=False)
    result = eval_cli.main([f"--out_dir={config.out_dir}", "--task=choice", f"--data={data}", "--devices=1"])
    assert (
        capsys.readouterr().out == f"choice: acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f} (3 examples)\n"
    )

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(scoring.urllib.request, "urlopen", offline)
    monkeypatch.setenv("HOME", str(tmp_path))
    for flags, words in [
        (["--task=hellaswag"], ["could not download HellaSwag", "pass --data=FILE"]),
        (["--task=choice", f"--data={tmp_path / 'nope.jsonl'}"], ["nope.jsonl not found"]),
        (["--task=choice", f"--data={tmp_path}"], ["Is a directory; pass --data=FILE.jsonl"]),
        (["--task=perplexity"], ["--task=perplexity needs --data=FILE"]),
        (["--task=perplexity", "--data=x.txt", "--limit=5"], ["--limit counts the examples", "cut the file"]),
        (["--task=choice", f"--data={data}", "--prefix=bos"], ["--prefix=bos: this tokenizer has no BOS token"]),
        (
            ["--task=choice", f"--data={write_examples(tmp_path / 'hs.jsonl', n=1)}"],  # HellaSwag's form
            ["no 'context', 'choices' field"],
        ),
    ]:
        with pytest.raises(SystemExit) as excinfo:
            eval_cli.main([f"--out_dir={config.out_dir}", "--devices=1", *flags])
        assert all(word in str(excinfo.value) for word in words) and "\n" not in str(excinfo.value)
    assert not list(tmp_path.glob(".cache/nanomax/*"))  # no half-downloaded file left


def test_eval_tasks_in_training_are_logged_and_plotted(tmp_path, capsys):
    make_spaced_dataset(tmp_path)
    data = write_examples(tmp_path / "hs.jsonl", n=4)
    (tmp_path / "t.txt").write_text(text(np.random.default_rng(2), 80), encoding="utf-8")
    config = small_config(
        tmp_path,
        max_iters=2,
        eval_interval=1,
        tensorboard=True,
        eval_tasks=f"hellaswag:{data},perplexity:{tmp_path / 't.txt'}",
    )
    train.train(config, ONE_DEVICE)
    lines = [line for line in capsys.readouterr().out.splitlines() if " | val loss " in line]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 2"]  # every eval_interval
    assert all(" | hellaswag acc_norm " in line and " | perplexity bits/byte " in line for line in lines)
    series = plot.read_scalars(config.out_dir)
    assert [s for s, _ in series["eval/hellaswag_acc_norm"]] == [1, 2] and "eval/perplexity_bpb" in series
    plot.main([config.out_dir, f"--out={tmp_path / 'p.png'}"])
    assert (tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(scoring.EvalError, match="missing.jsonl not found"):
        train.train(small_config(tmp_path, out_dir=str(tmp_path / "o2"), eval_tasks="choice:missing.jsonl"), ONE_DEVICE)
