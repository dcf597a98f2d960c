"""data/text/prepare.py at scale and data/corpus.py: every input format end to end, the val
rule, uint32 token files, bad shards, resuming after Ctrl-C, bounded memory, and the
FineWeb-Edu / OpenWebText scripts through a fake Hugging Face cache (never the network)."""

import gzip
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # data/ lives at the repo root

from data import corpus  # noqa: E402
from data import tokenizer  # noqa: E402
from data import writer  # noqa: E402
from data.fineweb import prepare as fineweb  # noqa: E402
from data.openwebtext import prepare as openwebtext  # noqa: E402
from data.text import prepare as text_prep  # noqa: E402
from data.text import train_tokenizer  # noqa: E402

EOT = tokenizer.GPT2_EOT
DOCS = [
    f"Document {i}: café ☕ naïve, {'some words ' * (i % 7)}and a quoted <|endoftext|>.\n" * (1 + i % 3)
    for i in range(24)
] + ["", "  leading spaces and\ttabs", "emoji 🚀 and 中文"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


# ---- writing corpora in every format


def write_jsonl_lines(docs, key="text"):
    return "".join(json.dumps({key: d, "id": i}, ensure_ascii=False) + "\n" for i, d in enumerate(docs)).encode()


def write_docs(path: Path, docs, key="text", row_group_size=4):
    """docs as path's format says (a .txt gets the first one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith(".txt"):
        path.write_text(docs[0], encoding="utf-8")
    elif name.endswith(".jsonl"):
        path.write_bytes(write_jsonl_lines(docs, key))
    elif name.endswith(".jsonl.gz"):
        with gzip.open(path, "wb") as f:
            f.write(write_jsonl_lines(docs, key))
    elif name.endswith(".jsonl.zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as f:
            f.write(write_jsonl_lines(docs, key))
    else:
        pq.write_table(pa.table({"id": list(range(len(docs))), key: docs}), path, row_group_size=row_group_size)
    return path


def split_documents(ids, eot=EOT):
    cuts = np.flatnonzero(ids == eot)
    assert len(cuts) == 0 or cuts[-1] == len(ids) - 1  # every document ends with the end token
    return np.split(ids, cuts + 1)[:-1]


def read_dataset(out, dtype="uint16"):
    """(train documents, val documents) as texts, in order."""
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == dtype
    tok = tokenizer.load_tokenizer(out)
    return [
        [tok.decode(d[:-1]) for d in split_documents(np.fromfile(out / f"{s}.bin", dtype=dtype), tok.eot_token)]
        for s in ("train", "val")
    ]


def bins(out):
    return {name: (out / name).read_bytes() for name in ("train.bin", "val.bin")}


def expected_val(files_docs, root, seed=1337, val_fraction=0.3):
    """The documented rule: val when blake2b(FILE \\n POSITION, key=seed) < val_fraction * 2**64."""
    val = []
    for path, docs in files_docs:
        name = path.relative_to(root).as_posix()
        if path.name.endswith(".parquet"):
            positions = range(len(docs))
        elif path.name.endswith(".txt"):
            positions = [0]
        else:  # byte offsets of the lines in the decompressed text
            lines = write_jsonl_lines(docs).splitlines(keepends=True)
            positions = np.cumsum([0] + [len(line) for line in lines[:-1]])
        for position, doc in zip(positions, docs):
            h = int.from_bytes(
                __import__("hashlib")
                .blake2b(f"{name}\n{position}".encode(), digest_size=8, key=str(seed).encode())
                .digest(),
                "big",
            )
            if h < int(val_fraction * 2**64):
                val.append(doc)
    return val


@pytest.mark.parametrize("ext", [".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_each_format_end_to_end(tmp_path, ext):
    root = tmp_path / "in"
    if ext == ".txt":
        files_docs = [(write_docs(root / f"doc{i:02d}.txt", [d]), [d]) for i, d in enumerate(DOCS)]
    else:
        files_docs = [
            (write_docs(root / f"a{ext}", DOCS[:10]), DOCS[:10]),
            (write_docs(root / "sub" / f"b{ext}", DOCS[10:]), DOCS[10:]),
        ]
    summary = text_prep.prepare(root, tmp_path / "out", val_fraction=0.3, num_proc=1)
    train, val = read_dataset(tmp_path / "out")
    want_val = expected_val(files_docs, root)
    assert 0 < len(want_val) < len(DOCS)
    assert val == want_val  # the rule in the docstring, in file order
    assert train == [d for _, docs in files_docs for d in docs if d not in want_val]
    assert (summary["documents"], summary["val_documents"]) == (len(DOCS), len(want_val))
    assert not (tmp_path / "out.parts").exists()  # the work folder goes once the dataset is in place


def test_num_proc_and_piece_size_do_not_change_the_output(tmp_path):
    root = tmp_path / "in"
    for i, ext in enumerate([".jsonl", ".jsonl.gz", ".parquet", ".jsonl.zst", ".txt"]):
        write_docs(root / f"{i}{ext}", DOCS[i * 5 :])
    text_prep.prepare(root, tmp_path / "one", val_fraction=0.2, num_proc=1)
    # Small pieces in a pool of 2, in a process of its own (forking this one, with JAX's threads, could deadlock).
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from data.text import prepare
        s = prepare.prepare({str(root)!r}, {str(tmp_path / "two")!r}, val_fraction=0.2, num_proc=2, piece_bytes=300)
        assert s["pieces"] > 4, s
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "100.0%" in r.stderr and "MB/s" in r.stderr and "tokens/s" in r.stderr and "ETA" in r.stderr
    assert bins(tmp_path / "one") == bins(tmp_path / "two")


def test_a_jsonl_cut_into_pieces_names_the_bad_line(tmp_path):
    lines = write_jsonl_lines(DOCS).splitlines(keepends=True)
    lines[20] = b'{"text": broken\n'
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(corpus.BadFile, match=r"big\.jsonl:21: malformed JSON"):
        text_prep.prepare(tmp_path / "in", tmp_path / "out", num_proc=1, piece_bytes=200)
    # --skip_bad_files: only the piece of the file with that line is left out.
    s = text_prep.prepare(tmp_path / "in", tmp_path / "out", num_proc=1, piece_bytes=200, skip_bad_files=True)
    assert len(s["skipped"]) == 1 and "big.jsonl:21: malformed JSON" in s["skipped"][0]
    assert "; left out its bytes " in s["skipped"][0]
    kept = sum(read_dataset(tmp_path / "out"), [])
    assert DOCS[0] in kept and DOCS[-1] in kept and len(kept) == s["documents"] < len(DOCS) - 1


def test_empty_splits_get_one_document(tmp_path):
    write_docs(tmp_path / "in" / "a.jsonl", DOCS[:2])
    s = text_prep.prepare(tmp_path / "in", tmp_path / "out", val_fraction=1e-12, num_proc=1)
    train, val = read_dataset(tmp_path / "out")
    assert (s["val_documents"], len(val), len(train)) == (1, 1, 1)
    s = text_prep.prepare(tmp_path / "in", tmp_path / "out", val_fraction=1 - 1e-12, num_proc=1)
    assert (s["val_documents"], len(read_dataset(tmp_path / "out")[0])) == (1, 1)


# ---- bigger vocabularies: uint32 token files


def test_a_vocabulary_over_65536_writes_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = len(vocab)
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    docs = ["w1 w69999 w65536", "w65535 w2", "w3 w68000 w66000 w4", "w5"]
    write_docs(tmp_path / "in" / "a.parquet", docs)
    text_prep.prepare(tmp_path / "in", tmp_path / "out", val_fraction=0.3, num_proc=1, tokenizer=tok_dir)
    train, val = read_dataset(tmp_path / "out", dtype="uint32")
    assert sorted(train + val) == sorted(docs)
    ids = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32)
    assert ids.max() == 70_001  # <eos>: past what uint16 holds, like w69999 and w65536


# ---- bad input: one line naming the file


def run_main(script, *args):
    with pytest.raises(SystemExit) as e:
        script.main(list(args))
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_parquet_without_the_text_column(tmp_path):
    write_docs(tmp_path / "in" / "a.parquet", DOCS, key="body")
    message = run_main(text_prep, f"--input_dir={tmp_path / 'in'}", f"--out_dir={tmp_path / 'out'}")
    assert message == (
        f"error: {tmp_path / 'in' / 'a.parquet'} has no column 'text'; its columns: id, body "
        "(choose one with --text_key)"
    )
    text_prep.main(
        [f"--input_dir={tmp_path / 'in'}", f"--out_dir={tmp_path / 'out'}", "--text_key=body", "--num_proc=1"]
    )
    assert sorted(sum(read_dataset(tmp_path / "out"), [])) == sorted(DOCS)


def test_a_val_split_shorter_than_a_row_names_the_val_fraction_that_gives_one(tmp_path, capsys):
    """Issue 42: a small corpus left one document (17 tokens) in val, and nothing said so."""
    write_docs(tmp_path / "in" / "a.jsonl", DOCS * 4)
    text_prep.main([f"--input_dir={tmp_path / 'in'}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1"])
    out = capsys.readouterr().out
    train, val = (
        int(n.replace(",", "")) for n in re.search(r"train: ([\d,]+) tokens, val: ([\d,]+) tokens", out).groups()
    )
    suggested = writer.val_fraction_for(1025, train + val)
    assert (
        f"note: val holds only {val} tokens and training needs block_size + 1 of them (1,025 at GPT-2's "
        f"1024): for more, run again with --val_fraction={suggested:g}" in out
    )
    assert 0.0005 < suggested <= 0.5


def truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_truncated_shards_stop_the_run_or_are_skipped(tmp_path, capsys):
    root, out = tmp_path / "in", tmp_path / "out"
    write_docs(root / "a.jsonl", DOCS[:10])
    truncate(write_docs(root / "b.parquet", DOCS))
    truncate(write_docs(root / "c.jsonl.gz", DOCS * 20))
    truncate(write_docs(root / "d.jsonl.zst", DOCS * 20))
    message = run_main(text_prep, f"--input_dir={root}", f"--out_dir={out}", "--num_proc=1")
    assert message.startswith(f"error: {root / 'b.parquet'}: not a readable parquet file (")
    (root / "b.parquet").unlink()
    message = run_main(text_prep, f"--input_dir={root}", f"--out_dir={out}", "--num_proc=1")
    assert message.startswith(f"error: {root / 'c.jsonl.gz'}: cannot be read to the end (")
    assert not out.exists() and not (tmp_path / "out.parts").exists()

    truncate(write_docs(root / "b.parquet", DOCS))
    text_prep.main([f"--input_dir={root}", f"--out_dir={out}", "--num_proc=1", "--skip_bad_files"])
    printed = capsys.readouterr().out
    for name in ("b.parquet", "c.jsonl.gz", "d.jsonl.zst"):
        assert f"skipped: {root / name}: " in printed
    assert sorted(sum(read_dataset(out), [])) == sorted(DOCS[:10])  # a.jsonl's documents, all of them
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["skipped"]) == 3 and meta["prepare"].endswith("--skip_bad_files=True")


# ---- Ctrl-C, then the same command again


def test_resume_after_an_interruption_skips_finished_pieces(tmp_path, monkeypatch, capsys):
    root = tmp_path / "in"
    for i, ext in enumerate([".jsonl", ".parquet", ".jsonl.gz", ".jsonl", ".jsonl.zst", ".parquet"]):
        write_docs(root / f"{i}{ext}", DOCS[i * 4 : i * 4 + 4])
    piece = 1000  # bytes: a parquet file is a piece, small ones share one
    plan = corpus.plan_pieces(corpus.find_files(root), root, "text", piece)[0]
    first_two = 4 * (len(plan[0]) + len(plan[1]))  # documents in the first two pieces
    assert len(plan) >= 4
    text_prep.prepare(root, tmp_path / "whole", val_fraction=0.3, num_proc=1, piece_bytes=piece)
    capsys.readouterr()

    encode, calls = text_prep.encode_document, []

    def encode_then_ctrl_c(text):
        calls.append(text)
        if len(calls) == first_two + 2:  # in the third piece
            raise KeyboardInterrupt
        return encode(text)

    out, work = tmp_path / "out", tmp_path / "out.parts"
    monkeypatch.setattr(text_prep, "encode_document", encode_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        text_prep.prepare(root, out, val_fraction=0.3, num_proc=1, piece_bytes=piece)
    assert f"kept the 2 of {len(plan)} pieces done in {work}: the same command goes on" in capsys.readouterr().err
    assert len(list(work.glob("*.train.bin"))) == 2 and not list(work.glob("*.tmp"))
    assert not out.exists()

    calls.clear()
    monkeypatch.setattr(text_prep, "encode_document", lambda text: calls.append(text) or encode(text))
    s = text_prep.prepare(root, out, val_fraction=0.3, num_proc=1, piece_bytes=piece)
    assert s["resumed"] == 2 and len(calls) == 24 - first_two  # the finished pieces are not encoded again
    assert f"resuming: 2 of {len(plan)} pieces were done before" in capsys.readouterr().out
    assert bins(out) == bins(tmp_path / "whole")  # byte for byte what one run makes
    assert not work.exists()

    # Parts made with other settings are not used, nor thrown away unasked.
    monkeypatch.setattr(text_prep, "encode_document", encode_then_ctrl_c)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        text_prep.prepare(root, out, val_fraction=0.3, num_proc=1, piece_bytes=piece)
    parts = sorted(work.iterdir())
    with pytest.raises(
        text_prep.InputError,
        match=rf"{work} holds the finished pieces of another preparation, "
        rf"with other settings: finish it with `python data/text/prepare\.py .*--seed=1337`, "
        rf"or delete {work} to start afresh",
    ):
        text_prep.prepare(root, out, val_fraction=0.3, num_proc=1, piece_bytes=piece, seed=7)
    assert sorted(work.iterdir()) == parts
    # A file that changed since: its piece is made again, the other finished one is used.
    write_docs(root / "0.jsonl", DOCS[:3])
    calls.clear()
    monkeypatch.setattr(text_prep, "encode_document", lambda text: calls.append(text) or encode(text))
    s = text_prep.prepare(root, out, val_fraction=0.3, num_proc=1, piece_bytes=piece)
    assert s["resumed"] == 1 and s["documents"] == 23 and not work.exists()


# ---- memory does not grow with the corpus

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were lorem ipsum dolor amet consectetur tempor incididunt"
).split()


def generated_docs(nbytes, seed):
    rng, total = random.Random(seed), 0
    while total < nbytes:
        doc = " ".join(rng.choices(WORDS, k=rng.randint(50, 1500)))
        total += len(doc)
        yield doc


# A small Python runs the script and reports its peak memory: the peak of a child forked
# from this (big) test process would start at this process's size.
MEASURE = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL); _, status, usage = os.wait4(p.pid, 0); "
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)"
)


def peak_rss_mb(*args):
    """Runs data/text/prepare.py in a process of its own; its peak resident memory in MB."""
    r = subprocess.run(
        [sys.executable, "-c", MEASURE, sys.executable, str(ROOT / "data/text/prepare.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    status, kb = map(int, r.stdout.split())
    assert status == 0
    return kb / 1024  # ru_maxrss is in KB on Linux


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_memory_stays_flat_while_the_corpus_grows_8x(tmp_path, ext):
    peaks = []
    for mb in (5, 40):
        docs = list(generated_docs(mb << 20, seed=mb))
        write_docs(tmp_path / f"in{mb}" / f"corpus{ext}", docs, row_group_size=200)
        peaks.append(
            peak_rss_mb(f"--input_dir={tmp_path / f'in{mb}'}", f"--out_dir={tmp_path / f'out{mb}'}", "--num_proc=1")
        )
    assert peaks[1] - peaks[0] < 20, peaks


# ---- FineWeb-Edu and OpenWebText: a fake Hugging Face cache, as huggingface_hub lays it out


def fake_hub_cache(cache: Path, repo_id, revision, files: dict) -> Path:
    """CACHE/datasets--ORG--NAME/{refs/REVISION, blobs/, snapshots/COMMIT/PATH -> blob}."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(COMMIT)
    for i, (name, docs) in enumerate(files.items()):
        blob = write_docs(repo / "blobs" / f"{i:064x}.parquet", docs)
        link = repo / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob.with_suffix(""), link.parent))
        blob.rename(blob.with_suffix(""))  # blobs have no extension
    return repo / "snapshots" / COMMIT


SHARDS = {f"sample/10BT/{i:03d}_00000.parquet": DOCS[i * 9 : i * 9 + 9] for i in range(3)}


def test_fineweb_from_the_cache_and_from_a_folder(tmp_path, capsys):
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, fineweb.REPO_ID, "main", SHARDS)
    root, files, source = fineweb.shards("10BT", max_shards=2, cache_dir=cache, local_files_only=True)
    assert root == snapshot / "sample/10BT" and [f.name for f in files] == ["000_00000.parquet", "001_00000.parquet"]
    assert source == f"https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/tree/{COMMIT}/sample/10BT"

    out = tmp_path / "fw"
    fineweb.main(
        [
            f"--cache_dir={cache}",
            "--offline",
            "--max_shards=2",
            f"--out_dir={out}",
            "--num_proc=1",
            "--val_fraction=0.2",
        ]
    )
    assert "2 files, 18 documents" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"] == source and meta["prepare"].startswith(
        "python data/fineweb/prepare.py --sample=10BT --max_shards=2 --out_dir="
    )
    assert sorted(sum(read_dataset(out), [])) == sorted(DOCS[:18])

    # The same shards in a plain folder (--input_dir) make the same dataset: names are relative to it.
    folder = tmp_path / "shards"
    for name, docs in list(SHARDS.items())[:2]:
        write_docs(folder / Path(name).name, docs)
    fineweb.main([f"--input_dir={folder}", f"--out_dir={tmp_path / 'fw2'}", "--num_proc=1", "--val_fraction=0.2"])
    assert bins(tmp_path / "fw2") == bins(out)


def test_openwebtext_from_the_converted_parquet_revision(tmp_path):
    cache = tmp_path / "hub"
    shards = {f"plain_text/train/{i:04d}.parquet": DOCS[i * 9 : i * 9 + 9] for i in range(3)}
    snapshot = fake_hub_cache(cache, openwebtext.REPO_ID, openwebtext.REVISION, shards)
    assert (cache / "datasets--Skylion007--openwebtext/refs/refs/convert/parquet").is_file()
    root, files, _ = openwebtext.shards(cache_dir=cache, local_files_only=True)
    assert root == snapshot / "plain_text/train" and len(files) == 3
    out = tmp_path / "owt"
    openwebtext.main([f"--cache_dir={cache}", "--offline", f"--out_dir={out}", "--num_proc=1"])
    assert sorted(sum(read_dataset(out), [])) == sorted(DOCS[:27])


class NoNetwork:
    """Stands in for huggingface_hub.HfApi where the Hub cannot be reached."""

    def list_repo_tree(self, *args, **kwargs):
        raise ConnectionError("[Errno -3] Temporary failure in name resolution")


def test_no_network_and_no_cache_is_one_message(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "hub_reachable", lambda: False)  # as on this machine: no DNS
    empty = tmp_path / "empty_cache"
    message = run_main(fineweb, f"--cache_dir={empty}", f"--out_dir={tmp_path / 'out'}")
    assert message == (
        f"error: cannot reach the Hugging Face Hub (huggingface.co is unreachable) and the cache {empty} "
        f"has no copy of "
        "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/tree/main/sample/10BT: download its .parquet "
        "files into a folder and pass --input_dir=FOLDER, or run again where huggingface.co is reachable"
    )
    assert "offline mode" in run_main(openwebtext, f"--cache_dir={empty}", "--offline", f"--out_dir={tmp_path / 'o'}")
    monkeypatch.setattr(corpus, "hub_reachable", lambda: True)  # a connection, then a failing request
    monkeypatch.setattr(corpus, "HfApi", NoNetwork)
    assert "cannot reach the Hugging Face Hub (ConnectionError: [Errno -3] Temporary failure" in run_main(
        fineweb, f"--cache_dir={empty}", f"--out_dir={tmp_path / 'out'}"
    )
    # Without the network the cache serves, but not with fewer shards than asked for.
    fake_hub_cache(tmp_path / "hub", fineweb.REPO_ID, "main", SHARDS)
    assert "holds 3 of the .parquet files" in run_main(
        fineweb, f"--cache_dir={tmp_path / 'hub'}", "--max_shards=5", f"--out_dir={tmp_path / 'out'}"
    )
    assert fineweb.shards("10BT", cache_dir=tmp_path / "hub")[1][-1].name == "002_00000.parquet"


def test_online_download_takes_the_first_shards(tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path / "hub", fineweb.REPO_ID, "main", SHARDS)
    asked = {}

    class Hub:
        def list_repo_tree(self, repo_id, path_in_repo, revision, repo_type):
            asked["tree"] = (repo_id, path_in_repo, revision, repo_type)
            return [type("RepoFile", (), {"path": name}) for name in [*SHARDS, "sample/10BT/README.md"]]

    def snapshot_download(repo_id, **kwargs):
        asked["download"] = kwargs
        return str(snapshot)

    monkeypatch.setattr(corpus, "HfApi", Hub)
    monkeypatch.setattr(corpus, "snapshot_download", snapshot_download)
    monkeypatch.setattr(corpus, "hub_reachable", lambda: True)
    root, files, _ = fineweb.shards("10BT", max_shards=2, cache_dir=tmp_path / "hub")
    assert asked["tree"] == ("HuggingFaceFW/fineweb-edu", "sample/10BT", "main", "dataset")
    assert asked["download"] == {
        "repo_type": "dataset",
        "revision": "main",
        "cache_dir": tmp_path / "hub",
        "allow_patterns": list(SHARDS)[:2],
    }
    assert files == [snapshot / name for name in list(SHARDS)[:2]]


def test_every_prepare_help_gives_its_description_whole():
    for script in sorted(ROOT.glob("data/*/prepare.py")):
        help_text = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, check=True
        ).stdout
        description = " ".join(help_text.split("\n\n")[1].split())  # after the usage lines
        assert description.endswith("."), (script, description)


def test_a_tokenizer_learned_from_a_corpus_prepares_it_and_gives_back_its_text(tmp_path, capsys):
    root = tmp_path / "in"
    write_docs(root / "a.parquet", DOCS)
    train_tokenizer.main([f"--input_dir={root}", f"--out_dir={tmp_path / 'tok'}", "--vocab_size=300"])
    tok = tokenizer.hf_tokenizer(tmp_path / "tok")
    assert tok.vocab_size == 300 and tok.decode([tok.eot_token]) == "<|endoftext|>"
    assert "300 tokens" in capsys.readouterr().out
    assert tok.decode(tok.encode_ordinary("never seen: Ωμέγα 🚀")) == "never seen: Ωμέγα 🚀"  # bytes underneath
    text_prep.prepare(root, tmp_path / "out", val_fraction=0.3, num_proc=1, tokenizer=str(tmp_path / "tok"))
    train, val = read_dataset(tmp_path / "out")
    assert sorted(train + val) == sorted(DOCS)
    # --max_bytes: the documents up to the one that reaches it
    sizes = [len(d.encode()) for d in train_tokenizer.documents(root, "text", 200)]
    assert sum(sizes) >= 200 > sum(sizes[:-1])
