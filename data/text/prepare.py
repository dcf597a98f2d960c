"""Your own text in GPT-2 BPE tokens: writes train.bin, val.bin (uint16) and meta.json.

    python data/text/prepare.py --input_dir=DIR --out_dir=data/mytext \\
        [--val_fraction=0.0005] [--num_proc=N] [--text_key=text] [--seed=1337]

Every .txt file under DIR (recursively) is one document, read whole; every non-blank
line of a .jsonl file is one document, its text in the field --text_key. Files are
UTF-8, with or without a byte order mark. Each document is followed by <|endoftext|>
(50256). A seeded random val_fraction of the documents (at least one) goes to val.bin,
the rest to train.bin, in file order. Tokens are streamed to disk, so the corpus need
not fit in memory.
Then train with --dataset=mytext (the name of the out_dir folder under data/).

An existing dataset in out_dir is replaced only when the new one is complete: after a bad
input file, an error or Ctrl-C, the old train.bin, val.bin and meta.json are unchanged.
"""

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: tokenizer.py
from tokenizer import (GPT2_EOT, GPT2_VOCAB_SIZE, DatasetWriter, PrepareError,  # noqa: E402
                       check_out_dir, format_prepare_command, gpt2_encoding, run_prepare_script)

BOM = b"\xef\xbb\xbf"  # some editors start UTF-8 files with it; it is not text


class InputError(PrepareError):
    """Something wrong with the user's files; ends the script with a one-line message."""


def find_files(input_dir):
    root = Path(input_dir)
    if not root.exists():
        raise InputError(f"input directory {input_dir} does not exist")
    if not root.is_dir():
        raise InputError(f"--input_dir {input_dir} is a file, not a folder")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise InputError(f"no .txt or .jsonl files under {input_dir}")
    return files


def jsonl_lines(path):
    """Yields (line number, bytes) for each non-blank line of a .jsonl file."""
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if lineno == 1:
                line = line.removeprefix(BOM)
            if line.strip():
                yield lineno, line


def count_documents(files):
    # One cheap pass first, so the val documents can be drawn up front and the progress
    # bar knows its total. It opens every file, so an unreadable one fails before any work.
    n = 0
    for f in files:
        if f.suffix == ".txt":
            open(f, "rb").close()
            n += 1
        else:
            n += sum(1 for _ in jsonl_lines(f))
    return n


def iter_documents(files, text_key):
    """Yields (where, raw bytes, text_key or None): parsing happens in the workers."""
    for f in files:
        if f.suffix == ".txt":
            yield str(f), f.read_bytes().removeprefix(BOM), None
        else:
            for lineno, line in jsonl_lines(f):
                yield f"{f}:{lineno}", line, text_key


def batches(docs, max_docs=1024, max_bytes=64 << 20):
    """Groups documents for the pool: bounds memory (Pool.imap alone would read the whole
    corpus ahead of the workers) while keeping every worker busy."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if len(batch) >= max_docs or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_document(job):
    """GPT-2 ids of one document, followed by <|endoftext|>."""
    where, raw, text_key = job
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if text_key is not None:
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: malformed JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict) or text_key not in record:
            raise InputError(f"{where}: no {text_key!r} field (choose another with --text_key)")
        text = record[text_key]
        if not isinstance(text, str):
            raise InputError(f"{where}: field {text_key!r} is {type(text).__name__}, not a string")
    ids = gpt2_encoding().encode_ordinary(text)
    ids.append(GPT2_EOT)
    return ids


class Progress:
    """A one-line progress bar with ETA on stderr."""

    def __init__(self, total, every=0.2):
        self.total, self.every = total, every
        self.start = self.last = time.time()
        self.drawn = False

    def update(self, done, tokens, force=False):
        now = time.time()
        if not force and now - self.last < self.every:
            return
        self.last = now
        frac = done / max(self.total, 1)
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {100 * frac:5.1f}% {done:,}/{self.total:,} docs, "
                         f"{tokens / 1e6:.2f}M tokens, {_mmss(elapsed)} elapsed, ETA {_mmss(eta)} ")
        sys.stderr.flush()
        self.drawn = True

    def end(self):
        if self.drawn:  # ends the bar's line, so an error message gets a line of its own
            sys.stderr.write("\n")


def _mmss(seconds):
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"


def ignore_sigint():
    """Pool workers leave Ctrl-C to the parent, which cleans up and says one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def prepare(input_dir, out_dir, val_fraction=0.0005, num_proc=1, text_key="text", seed=1337):
    """Tokenizes input_dir into out_dir. Returns a summary dict. Raises InputError.

    out_dir's old dataset, if any, is replaced only once the new one is complete."""
    files = find_files(input_dir)
    check_out_dir(out_dir)
    n_docs = count_documents(files)
    if n_docs < 2:
        raise InputError(f"found {n_docs} document under {input_dir}: need at least 2 for train and val")
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    val_docs = set(np.random.default_rng(seed).choice(n_docs, size=n_val, replace=False).tolist())

    gpt2_encoding()  # build it once here: forked workers inherit it
    with DatasetWriter(out_dir) as ds:
        pool = multiprocessing.Pool(num_proc, initializer=ignore_sigint) if num_proc > 1 else None
        progress = Progress(n_docs)
        done = tokens = 0
        try:
            for batch in batches(iter_documents(files, text_key)):
                encoded = pool.imap(encode_document, batch, chunksize=16) if pool else map(encode_document, batch)
                for ids in encoded:
                    (ds.val if done in val_docs else ds.train).write(ids)
                    done += 1
                    tokens += len(ids)
                    progress.update(done, tokens)
            progress.update(done, tokens, force=True)
        finally:
            progress.end()
            if pool:
                pool.terminate()
        rerun = format_prepare_command(__file__, input_dir=Path(input_dir), out_dir=Path(out_dir),
                                       val_fraction=val_fraction, text_key=text_key, seed=seed)
        ds.commit({"kind": "gpt2", "vocab_size": GPT2_VOCAB_SIZE, "source": str(input_dir),
                   "documents": {"train": n_docs - n_val, "val": n_val}, "prepare": rerun})
    return {"files": len(files), "documents": n_docs, "val_documents": n_val,
            "train_tokens": ds.train.count, "val_tokens": ds.val.count}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_dir", required=True, help="folder of .txt / .jsonl files")
    parser.add_argument("--out_dir", required=True, help="where train.bin, val.bin, meta.json go, e.g. data/mytext")
    parser.add_argument("--val_fraction", type=float, default=0.0005)
    parser.add_argument("--num_proc", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--text_key", default="text", help="the text field of each .jsonl record")
    parser.add_argument("--seed", type=int, default=1337, help="seeds the choice of val documents")
    args = parser.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        raise SystemExit(f"error: --val_fraction must be between 0 and 1, got {args.val_fraction}")
    t0 = time.time()
    s = run_prepare_script(lambda: prepare(args.input_dir, args.out_dir, args.val_fraction,
                                           max(1, args.num_proc), args.text_key, args.seed),
                           args.out_dir)
    print(f"{s['files']} files, {s['documents']:,} documents ({s['val_documents']:,} in val)")
    print(f"train: {s['train_tokens']:,} tokens, val: {s['val_tokens']:,} tokens -> {args.out_dir}")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
