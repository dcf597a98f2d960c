"""Your own text in tokens: writes train.bin, val.bin (uint16) and meta.json.

    python data/text/prepare.py --input_dir=DIR --out_dir=data/mytext [--tokenizer=gpt2|TOKENIZER_DIR] \\
        [--val_fraction=0.0005] [--num_proc=N] [--text_key=text] [--seed=1337]

Every .txt file under DIR (recursively) is one document, read whole; every non-blank
line of a .jsonl file is one document, its text in the field --text_key. Files are
UTF-8, with or without a byte order mark. A seeded random val_fraction of the documents
(at least one) goes to val.bin, the rest to train.bin, in file order. Tokens are streamed
to disk, so the corpus need not fit in memory.
Then train with --dataset=mytext (the name of the out_dir folder under data/).

--tokenizer=gpt2 (the default): GPT-2 BPE, each document followed by <|endoftext|> (50256).
--tokenizer=DIR: the Hugging Face tokenizer in DIR (tokenizer.json, tokenizer_config.json,
...), each document followed by its end-of-sequence token and, if the tokenizer adds one
itself, started with its beginning-of-sequence token. Its files are copied into out_dir, so
the dataset needs nothing outside it. Token files are uint16: at most 65536 tokens for now.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: tokenizer.py, dataset_writer.py
from dataset_writer import (UINT16_IDS, DatasetWriter, PrepareError, check_out_dir,  # noqa: E402
                            format_prepare_command, run_prepare_script)
from tokenizer import command_path, gpt2_tokenizer, hf_tokenizer  # noqa: E402

BOM = b"\xef\xbb\xbf"  # some editors start UTF-8 files with it; it is not text


class InputError(PrepareError):
    """Something wrong with the user's files; ends the script with a one-line message."""


def load_tokenizer_option(option):
    """The tokenizer --tokenizer names ("gpt2" or a Hugging Face tokenizer folder), checked to
    fit this script before any input is read."""
    if option == "gpt2":
        return gpt2_tokenizer()
    try:
        tok = hf_tokenizer(option)
    except ValueError as e:
        raise InputError(f"--tokenizer: {e}") from None
    if tok.vocab_size > UINT16_IDS:
        raise InputError(f"--tokenizer {option} has {tok.vocab_size} tokens; token files are uint16 "
                         f"(ids < {UINT16_IDS}) for now: choose a tokenizer with at most {UINT16_IDS}")
    if tok.eot_token is None:
        raise InputError(f"--tokenizer {option} has no end-of-sequence token to separate documents: "
                         "give one in its generation_config.json or config.json (eos_token_id) or "
                         "tokenizer_config.json (eos_token)")
    return tok


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


_tok = None  # the tokenizer encode_document uses: set by prepare(), and in pool workers by start_worker


def start_worker(tok):
    """Pool workers leave Ctrl-C to the parent, which cleans up and says one line. The
    tokenizer comes as an argument because a spawned (not forked) worker starts empty."""
    global _tok
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _tok = tok


def encode_document(job):
    """The ids of one document: [bos] text eot (GPT-2: text <|endoftext|>)."""
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
    ids = _tok.encode_ordinary(text)  # a document that quotes a special token is still text
    ids.append(_tok.eot_token)
    return ids if _tok.bos_token is None else [_tok.bos_token, *ids]


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


def prepare(input_dir, out_dir, val_fraction=0.0005, num_proc=1, text_key="text", seed=1337,
            tokenizer="gpt2"):
    """Tokenizes input_dir into out_dir. Returns a summary dict. Raises InputError.

    out_dir's old dataset, if any, is replaced only once the new one is complete."""
    global _tok
    _tok = load_tokenizer_option(str(tokenizer))
    files = find_files(input_dir)
    check_out_dir(out_dir)
    n_docs = count_documents(files)
    if n_docs < 2:
        raise InputError(f"found {n_docs} document under {input_dir}: need at least 2 for train and val")
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    val_docs = set(np.random.default_rng(seed).choice(n_docs, size=n_val, replace=False).tolist())

    with DatasetWriter(out_dir) as ds:
        pool = multiprocessing.Pool(num_proc, start_worker, (_tok,)) if num_proc > 1 else None
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
        hf = _tok.kind == "huggingface"
        rerun = format_prepare_command(__file__, input_dir=Path(input_dir), out_dir=Path(out_dir),
                                       # "./" so that a folder named gpt2 is not read as GPT-2
                                       tokenizer=os.path.join(".", command_path(_tok.dir)) if hf else None,
                                       val_fraction=val_fraction, text_key=text_key, seed=seed)
        meta = {"kind": _tok.kind, "vocab_size": _tok.vocab_size}
        if hf:  # its files are copied in with the tokens; the sha256 says they still match
            meta.update(sha256=_tok.sha256, tokenizer="tokenizer.json")
        ds.commit({**meta, "source": str(input_dir), "documents": {"train": n_docs - n_val, "val": n_val},
                   "prepare": rerun}, files=_tok.files if hf else ())
    return {"files": len(files), "documents": n_docs, "val_documents": n_val,
            "train_tokens": ds.train.count, "val_tokens": ds.val.count}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_dir", required=True, help="folder of .txt / .jsonl files")
    parser.add_argument("--out_dir", required=True, help="where train.bin, val.bin, meta.json go, e.g. data/mytext")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2, or a Hugging Face tokenizer folder (tokenizer.json, ...); ./gpt2 names a folder")
    parser.add_argument("--val_fraction", type=float, default=0.0005)
    parser.add_argument("--num_proc", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--text_key", default="text", help="the text field of each .jsonl record")
    parser.add_argument("--seed", type=int, default=1337, help="seeds the choice of val documents")
    args = parser.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        raise SystemExit(f"error: --val_fraction must be between 0 and 1, got {args.val_fraction}")
    t0 = time.time()
    s = run_prepare_script(lambda: prepare(args.input_dir, args.out_dir, args.val_fraction,
                                           max(1, args.num_proc), args.text_key, args.seed, args.tokenizer),
                           args.out_dir)
    print(f"{s['files']} files, {s['documents']:,} documents ({s['val_documents']:,} in val)")
    print(f"train: {s['train_tokens']:,} tokens, val: {s['val_tokens']:,} tokens -> {args.out_dir}")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
