"""data/tokenizer.py's interface for every kind, Hugging Face tokenizers in particular (tiny ones
trained here with the `tokenizers` library), and data/text/prepare.py --tokenizer=DIR."""

import functools
import importlib.util
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from data import tokenizer

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
BOS, EOS, EOT_ID = 0, 1, 2  # ids of SPECIALS: a trainer gives special tokens the first ids
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "café ☕ naïve résumé",
    "Hello, world! Hello again, world.",
    "Numbers 12345 and symbols #$%&",
]
TEXTS = ["café ☕ naïve", "Hello, world!", "unseen words: zebra quokka ✓", " two  spaces\nnewline\t"]
LLAMA_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


@functools.lru_cache(maxsize=None)
def tokenizer_json(bos: bool) -> str:
    """A byte-level BPE of a few hundred tokens; with bos, its post-processor prepends
    <|begin_of_text|> the way Llama 3's does."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS * 5,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", BOS)],
        )
    return tok.to_str(pretty=True)


def make_tokenizer(directory: Path, bos=True, files=None) -> Path:
    """directory with tokenizer.json and the given JSON files (default: a Llama-like
    tokenizer_config.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json(bos), encoding="utf-8")
    for name, content in ({"tokenizer_config.json": LLAMA_CONFIG} if files is None else files).items():
        (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


@pytest.fixture
def tok_dir(tmp_path):
    return make_tokenizer(tmp_path / "tok")


def test_hf_encodes_and_decodes_exactly_as_tokenizers_does(tok_dir):
    tok, ref = tokenizer.hf_tokenizer(tok_dir), tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert (tok.kind, tok.vocab_size) == ("huggingface", ref.get_vocab_size(with_added_tokens=True))
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == ids  # no <|begin_of_text|>: prompts and documents are plain text
        assert tok.decode(ids) == ref.decode(ids) == text
        assert tok.decode(np.array(ids, dtype=np.uint16)) == text
    assert tok.decode([BOS, *tok.encode("café"), EOS]) == "<|begin_of_text|>café<|end_of_text|>"
    # A special token's text is that token in a prompt, and plain text in a document.
    assert tok.encode("a<|end_of_text|>b")[1] == EOS
    assert EOS not in tok.encode_ordinary("a<|end_of_text|>b")
    assert tok.decode(tok.encode_ordinary("a<|end_of_text|>b")) == "a<|end_of_text|>b"
    unpickled = pickle.loads(pickle.dumps(tok))  # as a spawned pool worker gets it
    assert unpickled.encode_ordinary("a<|end_of_text|>b") == tok.encode_ordinary("a<|end_of_text|>b")
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {tok.vocab_size}\)"):
        tok.decode([5, tok.vocab_size])
    assert tok.summary() == f"Hugging Face tokenizer {tok_dir.resolve()} ({tok.vocab_size} tokens)"


def test_gpt2_and_char_have_the_same_interface():
    gpt2, char = tokenizer.gpt2_tokenizer(), tokenizer.char_tokenizer("ab\n")
    assert (gpt2.kind, gpt2.vocab_size, gpt2.eot_token, gpt2.bos_token, gpt2.stop_tokens) == (
        "gpt2",
        50257,
        50256,
        None,
        [50256],
    )
    assert (char.kind, char.vocab_size, char.eot_token, char.bos_token, char.stop_tokens) == ("char", 3, None, None, [])
    assert gpt2.encode_ordinary("<|endoftext|>") != [50256] and gpt2.encode("<|endoftext|>") == [50256]
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 3\): \[3\]"):
        char.decode([0, 3])


@pytest.mark.parametrize(
    "bos, files, expected",
    [
        # Llama 3: tokenizer_config.json names them (a string or {"content": ...}), and the
        # post-processor adds <|begin_of_text|>.
        (True, {"tokenizer_config.json": LLAMA_CONFIG}, (BOS, EOS, [EOS])),
        (
            True,
            {
                "tokenizer_config.json": {
                    "bos_token": {"content": "<|begin_of_text|>"},
                    "eos_token": {"content": "<|eot_id|>", "lstrip": False},
                }
            },
            (BOS, EOT_ID, [EOT_ID]),
        ),
        # A bos_token the post-processor never adds is not wanted (GPT-NeoX names one).
        (False, {"tokenizer_config.json": LLAMA_CONFIG}, (None, EOS, [EOS])),
        # config.json's ids, when tokenizer_config.json names none.
        (True, {"config.json": {"bos_token_id": BOS, "eos_token_id": EOS}}, (BOS, EOS, [EOS])),
        # generation_config.json's stop ids come first; Llama 3 Instruct lists several.
        (
            True,
            {
                "tokenizer_config.json": LLAMA_CONFIG,
                "config.json": {"eos_token_id": EOS},
                "generation_config.json": {"eos_token_id": [EOS, EOT_ID]},
            },
            (BOS, EOS, [EOS, EOT_ID]),
        ),
        (True, {"generation_config.json": {"eos_token_id": EOT_ID}}, (None, EOT_ID, [EOT_ID])),
        (True, {}, (None, None, [])),
    ],
)
def test_special_tokens_from_each_config_file(tmp_path, bos, files, expected):
    tok = tokenizer.hf_tokenizer(make_tokenizer(tmp_path / "tok", bos=bos, files=files))
    assert (tok.bos_token, tok.eot_token, tok.stop_tokens) == expected


def test_describe_rebuilds_the_tokenizer(tmp_path, tok_dir):
    for tok in (tokenizer.char_tokenizer("ab\n"), tokenizer.gpt2_tokenizer(), tokenizer.hf_tokenizer(tok_dir)):
        description = json.loads(json.dumps(tok.describe()))  # it is stored as JSON
        again = tokenizer.tokenizer_from_description(description)
        assert (again.kind, again.describe(), again.encode("ab\n")) == (tok.kind, description, tok.encode("ab\n"))
    description = tokenizer.hf_tokenizer(tok_dir).describe()
    sha256 = tokenizer.hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert description == {
        "kind": "huggingface",
        "vocab_size": description["vocab_size"],
        "sha256": sha256,
        "dir": str(tok_dir.resolve()),
    }

    # search_dirs first, in order, skipping folders whose tokenizer.json is another one.
    copy, other, empty = tmp_path / "copy", make_tokenizer(tmp_path / "other", bos=False), tmp_path / "empty"
    shutil.copytree(tok_dir, copy)
    empty.mkdir()
    found = tokenizer.tokenizer_from_description(description, search_dirs=[empty, other, copy])
    assert found.describe()["dir"] == str(copy.resolve())
    shutil.rmtree(tok_dir)  # gone from where it was loaded: found in search_dirs only
    assert tokenizer.tokenizer_from_description(description, [copy]).sha256 == sha256
    (copy / "tokenizer.json").write_text(tokenizer_json(bos=False))  # changed
    with pytest.raises(ValueError) as e:
        tokenizer.tokenizer_from_description(description, search_dirs=[copy, other])
    assert str(e.value) == (
        f"no tokenizer.json with sha256 {sha256} in {copy}, {other}, {tok_dir.resolve()}: "
        "the tokenizer files changed or are gone"
    )
    with pytest.raises(ValueError, match="not a tokenizer description"):
        tokenizer.tokenizer_from_description({"kind": "huggingface", "vocab_size": 5})


def test_save_files(tmp_path):
    src = make_tokenizer(
        tmp_path / "src",
        files={
            "tokenizer_config.json": LLAMA_CONFIG,
            "special_tokens_map.json": {"bos_token": "<|begin_of_text|>"},
            "generation_config.json": {"eos_token_id": [EOS, EOT_ID]},
            "config.json": {"vocab_size": 320},
        },
    )
    assert tokenizer.hf_tokenizer(src).save_files(tmp_path / "out" / "hf") is True
    saved = sorted(p.name for p in (tmp_path / "out" / "hf").iterdir())
    assert saved == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]  # no .tmp left
    for name in saved:
        assert (tmp_path / "out" / "hf" / name).read_bytes() == (src / name).read_bytes()
    tok = tokenizer.hf_tokenizer(src)
    (src / "tokenizer.json").write_text(tokenizer_json(bos=False))
    with pytest.raises(ValueError, match=r"tokenizer\.json changed since it was loaded"):
        tok.save_files(tmp_path / "late")

    # Every kind writes a tokenizer.json that reads text as it does (issue 42): char level too.
    chars = tokenizer.char_tokenizer("\n ab\t")
    assert chars.save_files(tmp_path / "char") is True
    as_hf = tokenizer.hf_tokenizer(tmp_path / "char")
    assert as_hf.encode("a b\n\n\tba ") == chars.encode("a b\n\n\tba ") and tokenizer.same_vocabulary(chars, as_hf)

    gpt2 = tmp_path / "gpt2"
    assert tokenizer.gpt2_tokenizer().save_files(gpt2) is True
    assert sorted(p.name for p in gpt2.iterdir()) == [
        "merges.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    text = "Hello world, it's café time.\n\n  <|endoftext|>"
    as_hf = tokenizer.hf_tokenizer(gpt2)
    assert as_hf.encode(text) == tokenizer.gpt2_tokenizer().encode(text) and as_hf.stop_tokens == [50256]
    assert json.loads((gpt2 / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 1024,
    }
    # vocab.json + merges.txt are GPT-2's BPE: the same ids as tiktoken's, read with `tokenizers`.
    bpe = tokenizers.Tokenizer(models.BPE.from_file(str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = "Hello world, it's café time."
    assert bpe.encode(text).ids == tokenizer.gpt2_tokenizer().encode(text)


def one_line_error(call, *args) -> str:
    with pytest.raises(ValueError) as e:
        call(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_tokenizer_folders_are_named(tmp_path, tok_dir):
    hf = tokenizer.hf_tokenizer
    assert one_line_error(hf, tmp_path / "nope") == f"{tmp_path / 'nope'} has no tokenizer.json: no such folder"
    (tmp_path / "empty").mkdir()
    assert one_line_error(hf, tmp_path / "empty").startswith(
        f"{tmp_path / 'empty'} has no tokenizer.json: give the folder"
    )
    path = tok_dir / "tokenizer.json"
    path.write_text("{not json")
    assert one_line_error(hf, tok_dir).startswith(f"{path} is not valid JSON (")
    path.write_bytes(b"\xff\xfe")
    assert one_line_error(hf, tok_dir).startswith(f"{path} is not valid JSON (")
    path.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    assert one_line_error(hf, tok_dir).startswith(f"{path} is not a tokenizer that tokenizers ")

    make_tokenizer(tok_dir)
    config = tok_dir / "tokenizer_config.json"
    for content, message in [
        ("{oops", f"{config} is not valid JSON ("),
        ("[1, 2]", f"{config} must hold a JSON object, got list"),
        (json.dumps({"eos_token": "</s>"}), f"{config}: eos_token '</s>' is not a token of tokenizer.json"),
        (json.dumps({"bos_token": 7}), f"{config}: bos_token 7 is not a token of tokenizer.json"),
    ]:
        config.write_text(content)
        assert one_line_error(hf, tok_dir).startswith(message)
    config.unlink()
    generation = tok_dir / "generation_config.json"
    for value in (10**6, "2", [1, True], -1):
        generation.write_text(json.dumps({"eos_token_id": value}))
        assert one_line_error(hf, tok_dir).startswith(f"{generation}: eos_token_id must be an id or a list of ids")
    generation.unlink()
    (tok_dir / "config.json").write_text(json.dumps({"bos_token_id": [0]}))
    assert one_line_error(hf, tok_dir).startswith(f"{tok_dir / 'config.json'}: bos_token_id must be an id in [0, ")


# ---- datasets made with a Hugging Face tokenizer: data/text/prepare.py --tokenizer=DIR


def load_prepare_script():
    spec = importlib.util.spec_from_file_location("prep_text_hf", ROOT / "data/text/prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


text_prep = load_prepare_script()
DOCS = [
    "First document: café ☕ naïve.\n",
    "Second one quotes <|end_of_text|> as text.",
    "Third, with\nlines.\n",
    "Fourth and last.",
]


def make_corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    for i, doc in enumerate(DOCS):
        (root / f"{i}.txt").write_text(doc, encoding="utf-8")
    return root


def documents(ids, tok) -> list[str]:
    """The texts between <|begin_of_text|> ... <|end_of_text|>, checking that framing."""
    cuts = np.flatnonzero(ids == tok.eot_token)
    assert len(cuts) and cuts[-1] == len(ids) - 1
    docs = np.split(ids, cuts + 1)[:-1]
    assert all(d[0] == tok.bos_token for d in docs)
    return [tok.decode(d[1:-1]) for d in docs]


def dataset_files(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_text_prepare_with_a_hf_tokenizer(tmp_path, tok_dir, capsys):
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, EOT_ID]}))
    out = tmp_path / "out"
    text_prep.main(
        [
            f"--input_dir={make_corpus(tmp_path / 'in')}",
            f"--out_dir={out}",
            f"--tokenizer={tok_dir}",
            "--val_fraction=0.3",
            "--num_proc=1",
        ]
    )
    assert "4 documents (2 in val)" in capsys.readouterr().out  # the seeded val draw picks 2
    files = dataset_files(out)
    assert sorted(files) == [
        "generation_config.json",
        "meta.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train.bin",
        "val.bin",
    ]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert files[name] == (tok_dir / name).read_bytes()
    meta = json.loads(files["meta.json"])
    tok = tokenizer.load_tokenizer(out)  # from the dataset's own copy
    assert {k: meta[k] for k in ("kind", "vocab_size", "sha256", "tokenizer")} == {
        "kind": "huggingface",
        "vocab_size": tok.vocab_size,
        "tokenizer": "tokenizer.json",
        "sha256": tokenizer.hf_tokenizer(tok_dir).sha256,
    }
    assert f"--tokenizer={tok_dir.resolve()}" in meta["prepare"]
    assert (tok.dir, tok.bos_token, tok.stop_tokens) == (out.resolve(), BOS, [EOS, EOT_ID])
    train, val = (np.fromfile(out / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    assert sorted(documents(train, tok) + documents(val, tok)) == sorted(DOCS)

    # The recorded command, run again from the repo root with pool workers (in a process of
    # its own: forking this one, with JAX's threads, could deadlock), makes the same dataset.
    r = subprocess.run(
        [sys.executable, *meta["prepare"].split()[1:], "--num_proc=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "100.0%" in r.stderr and "Warning" not in r.stderr
    assert dataset_files(out) == files

    # The dataset's copy must be the tokenizer the ids were made with.
    (out / "tokenizer.json").write_text(tokenizer_json(bos=False))
    with pytest.raises(ValueError) as e:
        tokenizer.load_tokenizer(out)
    assert str(e.value).startswith(f"{out / 'tokenizer.json'} has sha256 ")
    assert str(e.value).endswith(f"the tokenizer changed since the dataset was made; rerun `{meta['prepare']}`")
    (out / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found, though meta\.json names it: rerun"):
        tokenizer.load_tokenizer(out)


def test_a_dataset_keeps_only_its_own_tokenizer_files(tmp_path, tok_dir):
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": EOT_ID}))
    corpus, out = make_corpus(tmp_path / "in"), tmp_path / "out"
    text_prep.prepare(corpus, out, val_fraction=0.3, tokenizer=tok_dir)
    before = dataset_files(out)
    # A failed run leaves every file as it was, the tokenizer's too.
    (corpus / "bad.jsonl").write_text('{"text": broken\n')
    with pytest.raises(text_prep.InputError, match="malformed JSON"):
        text_prep.prepare(corpus, out, val_fraction=0.3, tokenizer=make_tokenizer(tmp_path / "other", bos=False))
    assert dataset_files(out) == before
    (corpus / "bad.jsonl").unlink()
    # A tokenizer without generation_config.json: the old one must not outlive its dataset.
    (tok_dir / "generation_config.json").unlink()
    text_prep.prepare(corpus, out, val_fraction=0.3, tokenizer=tok_dir)
    assert "generation_config.json" not in dataset_files(out)
    assert tokenizer.load_tokenizer(out).stop_tokens == [EOS]
    text_prep.prepare(corpus, out, val_fraction=0.3)  # and GPT-2 after it leaves no tokenizer files
    assert sorted(dataset_files(out)) == ["meta.json", "train.bin", "val.bin"]


def run_main(*args) -> str:
    with pytest.raises(SystemExit) as e:
        text_prep.main(list(args))
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_text_prepare_refuses_tokenizers_it_cannot_use(tmp_path, tok_dir, monkeypatch):
    out, nowhere = f"--out_dir={tmp_path / 'out'}", f"--input_dir={tmp_path / 'no_input'}"
    big = tokenizer.hf_tokenizer(tok_dir)
    big.vocab_size = 2**32 + 1  # more ids than uint32 token files hold (Llama 3's 128,256 fit)
    monkeypatch.setattr(text_prep, "hf_tokenizer", lambda directory: big)
    # Refused before the input is looked at (there is none).
    assert run_main(nowhere, out, f"--tokenizer={tok_dir}") == (
        f"error: --tokenizer {tok_dir}: a vocabulary of 4,294,967,297 tokens does not fit in 32-bit token files"
    )
    monkeypatch.undo()
    (tok_dir / "tokenizer_config.json").unlink()
    assert run_main(nowhere, out, f"--tokenizer={tok_dir}").startswith(
        f"error: --tokenizer {tok_dir} has no end-of-sequence token to separate documents"
    )
    assert (
        run_main(nowhere, out, f"--tokenizer={tmp_path / 'nope'}")
        == f"error: --tokenizer: {tmp_path / 'nope'} has no tokenizer.json: no such folder"
    )
    assert not (tmp_path / "out").exists()
    r = subprocess.run(
        [sys.executable, str(ROOT / "data/text/prepare.py"), nowhere, out, f"--tokenizer={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.startswith(f"error: --tokenizer: {tmp_path} has no tokenizer.json: ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_hf_meta_is_named(tmp_path, tok_dir):
    text_prep.prepare(make_corpus(tmp_path / "in"), tmp_path / "out", val_fraction=0.3, tokenizer=tok_dir)
    meta_path = tmp_path / "out" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for field, value, message in [
        ("sha256", "abc", "'sha256' must be 64 lowercase hex digits"),
        ("tokenizer", "../tok/tokenizer.json", "'tokenizer' must be the dataset's own"),
        ("tokenizer", "vocab.json", "'tokenizer' must be the dataset's own"),
        ("vocab_size", 7, r"vocab_size is 7 but .*tokenizer\.json has \d+ tokens"),
    ]:
        meta_path.write_text(json.dumps({**meta, field: value}))
        with pytest.raises(ValueError, match=rf"{message}.*: rerun `python data/text/prepare\.py"):
            tokenizer.load_tokenizer(tmp_path / "out")
