"""Your own text in tokens: writes train.bin, val.bin (uint16, or uint32 for vocabularies over
65,536 tokens) and meta.json.

    python data/text/prepare.py --input_dir=DIR --out_dir=data/mytext [--tokenizer=gpt2|TOKENIZER_DIR] \\
        [--val_fraction=0.0005] [--num_proc=N] [--text_key=text] [--seed=1337] [--skip_bad_files]

Every .txt file under DIR (recursively) is one document; every non-blank line of a .jsonl,
.jsonl.gz or .jsonl.zst file is one, its text in the field --text_key; so is every row of
the column --text_key of a .parquet file (data/corpus.py reads them). Documents go to
train.bin and val.bin in file order (files sorted by path), each followed by an end token.
Then train with --dataset=mytext (the name of the out_dir folder under data/).

--tokenizer=gpt2 (the default): GPT-2 BPE, each document followed by <|endoftext|> (50256).
--tokenizer=DIR: the Hugging Face tokenizer in DIR (tokenizer.json, tokenizer_config.json,
...), each document followed by its end-of-sequence token and, if the tokenizer adds one
itself, started with its beginning-of-sequence token. Its files are copied into out_dir, so
the dataset needs nothing outside it.

The val split, decided document by document with no counting pass: a document is in val
when blake2b(f"{FILE}\\n{POSITION}", key=str(seed), 8 bytes) read as a big-endian integer is
below val_fraction * 2**64. FILE is its file's path relative to DIR (with /), POSITION its
row in a .parquet, the byte offset of its line in the (decompressed) .jsonl, 0 for a .txt.
So the split depends on nothing but the documents, the seed and val_fraction (not on
--num_proc, nor on what was interrupted and resumed). If that puts no document in val, the
one with the smallest hash goes there; if it puts all of them there, the one with the
largest stays in train.

Processes (--num_proc) tokenize pieces of the input, each about 1/64 of it and between 1
and 64 MB (a .jsonl byte range, a run of .parquet row groups, a whole compressed file,
several small files), into part files in OUT_DIR.parts/ beside out_dir; at the end the
parts are joined into out_dir and OUT_DIR.parts/ is removed (until then the tokens take
twice their size on disk). A process holds one bounded batch of documents at a time, so
memory does not grow with the corpus (a .txt file is read whole, though: for a big corpus
use .jsonl or .parquet). Finished parts outlive Ctrl-C, a crash or a bad file: the same
command again tokenizes only the pieces not done yet. A part is reused only if made with
the same tokenizer, seed, val_fraction and text_key from a file of the same size and
modification time; a run with other settings refuses to start beside another's parts.

An existing dataset in out_dir is replaced only when the new one is complete: after a bad
input file, an error or Ctrl-C, the old train.bin, val.bin and meta.json are unchanged.
A file that cannot be read to the end (truncated, corrupt, not UTF-8, malformed JSON) stops
the run with its name; --skip_bad_files leaves out that file's piece instead and lists it.
"""

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from itertools import chain
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: data/ and its tokenizer and writer
from data import corpus  # noqa: E402
from data.corpus import BadFile, InputError  # noqa: E402,F401  (InputError: the errors a user can fix)
from data.tokenizer import command_path, gpt2_tokenizer, hf_tokenizer  # noqa: E402
from data.writer import (
    GPT2_ROW_TOKENS,
    DatasetWriter,
    PrepareError,
    TokenWriter,
    check_out_dir,  # noqa: E402
    format_prepare_command,
    run_prepare_script,
    token_dtype,
    val_fraction_for,
)

PIECE_BYTES = (1 << 20, 64 << 20)  # input per piece, at least and at most: 1/64 of the corpus in between
COPY_TOKENS = 1 << 20  # tokens in memory at a time while parts are joined


def load_tokenizer_option(option):
    """The tokenizer --tokenizer names ("gpt2" or a Hugging Face tokenizer folder), checked to
    fit this script before any input is read."""
    if option == "gpt2":
        return gpt2_tokenizer()
    try:
        tok = hf_tokenizer(option)
    except ValueError as e:
        raise InputError(f"--tokenizer: {e}") from None
    try:
        token_dtype(tok.vocab_size)  # refuses one too big for the token files
    except PrepareError as e:
        raise InputError(f"--tokenizer {option}: {e}") from None
    if tok.eot_token is None:
        raise InputError(
            f"--tokenizer {option} has no end-of-sequence token to separate documents: "
            "give one in its generation_config.json or config.json (eos_token_id) or "
            "tokenizer_config.json (eos_token)"
        )
    return tok


def val_hash(seed, name, position) -> int:
    """The document's draw for the val split (see the top of this file)."""
    digest = hashlib.blake2b(f"{name}\n{position}".encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big")


# ---- tokenizing one piece (in a pool worker, or in this process for --num_proc=1)

_tok = None  # the tokenizer encode_document uses
_job = None  # dict: work folder, dtype, seed, val threshold, text_key, skip_bad
_counters = None  # (input bytes, tokens) done in this run, shared with the progress line
_redraw = None  # in this process: draws the progress line after a batch


def start_worker(tok, job, counters):
    """Pool workers leave Ctrl-C to the parent, which cleans up and says one line. Everything
    comes as arguments because a spawned (not forked) worker starts empty."""
    global _tok, _job, _counters
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    corpus.use_system_allocator()
    _tok, _job, _counters = tok, job, counters


def encode_document(text):
    """The ids of one document: [bos] text eot (GPT-2: text <|endoftext|>)."""
    ids = _tok.encode_ordinary(text)  # a document that quotes a special token is still text
    ids.append(_tok.eot_token)
    return ids if _tok.bos_token is None else [_tok.bos_token, *ids]


def report(nbytes, ntokens):
    """Adds to the progress line's counts (negative: takes back)."""
    for counter, n in zip(_counters, (nbytes, ntokens)):
        with counter.get_lock():
            counter.value += n
    if _redraw:
        _redraw()


class PieceParts:
    """WORK/ID.train.bin and WORK/ID.val.bin of one piece, and the record that vouches for them:
    how many documents each holds, and, for each split, the document that would change split
    if the other one ended up empty: [hash, file, position, offset in the part, length]."""

    def __init__(self, work, pid, dtype):
        self.files = {split: TokenWriter(work / f"{pid}.{split}.bin", dtype) for split in ("train", "val")}
        self.tokens = {"train": 0, "val": 0}
        self.pending = {"train": [], "val": []}  # id lists not written yet
        self.record = {"documents": 0, "val_documents": 0, "lowest_train": None, "highest_val": None}

    def __enter__(self):
        for f in self.files.values():
            f.start()
        return self

    def add(self, split, ids, doc_hash, name, position):
        doc = [doc_hash, name, position, self.tokens[split], len(ids)]
        key, better = ("lowest_train", doc.__lt__) if split == "train" else ("highest_val", doc.__gt__)
        if self.record[key] is None or better(self.record[key]):
            self.record[key] = doc
        self.pending[split].append(ids)
        self.tokens[split] += len(ids)
        self.record["documents"] += 1
        self.record["val_documents"] += split == "val"

    def flush(self) -> int:
        """Writes the pending documents; returns how many tokens they had."""
        written = 0
        for split, lists in self.pending.items():
            n = sum(map(len, lists))
            if n:
                self.files[split].write(np.fromiter(chain.from_iterable(lists), np.int64, count=n))
            lists.clear()
            written += n
        return written

    def commit(self) -> dict:
        for f in self.files.values():
            f.commit()
        return {**self.record, "train_tokens": self.tokens["train"], "val_tokens": self.tokens["val"]}

    def __exit__(self, exc_type, exc, tb):
        for f in self.files.values():  # after an error: removes the .tmp files
            f.__exit__(exc_type, exc, tb)


class LeaveOut(Exception):
    """A bad segment, with --skip_bad_files: the piece is made again without it."""

    def __init__(self, index, why):
        super().__init__(why)
        self.index, self.why = index, why


def tokenize_piece(task):
    """Tokenizes one piece into WORK/ID.train.bin and WORK/ID.val.bin, then writes WORK/ID.json
    (last, so it vouches for both). Returns that record."""
    pid, segments = task
    left_out = {}  # segment index -> why
    while True:
        try:
            record = _tokenize_segments(pid, segments, left_out)
            break
        except LeaveOut as e:
            left_out[e.index] = e.why
    record["left_out"] = sorted(left_out.values())
    _write_json(Path(_job["work"]) / f"{pid}.json", record)
    return record


def _tokenize_segments(pid, segments, left_out):
    told = [0, 0]  # (bytes, tokens) this attempt added to the progress line: taken back if it fails

    def tell(nbytes, ntokens):
        report(nbytes, ntokens)
        told[0], told[1] = told[0] + nbytes, told[1] + ntokens

    with PieceParts(Path(_job["work"]), pid, _job["dtype"]) as parts:
        for index, seg in enumerate(segments):
            if index in left_out:
                tell(seg.size, 0)
                continue
            read = 0
            try:
                for docs, done in corpus.read_segment(seg, _job["text_key"]):
                    for position, text in docs:
                        h = val_hash(_job["seed"], seg.name, position)
                        parts.add(
                            "val" if h < _job["threshold"] else "train", encode_document(text), h, seg.name, position
                        )
                    tell(done - read, parts.flush())
                    read = done
            except BadFile as e:
                if not _job["skip_bad"]:
                    raise
                report(-told[0], -told[1])
                raise LeaveOut(index, seg.left_out(str(e))) from None
        return parts.commit()


def _write_json(path, obj):
    tmp = Path(f"{path}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- the work folder of part files


def work_dir(out_dir) -> Path:
    out = Path(out_dir).resolve()
    return out.with_name(out.name + ".parts")


def piece_id(settings, segments) -> str:
    key = json.dumps([settings, [seg.key() for seg in segments]])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def finished_pieces(work: Path, settings: dict, rerun: str, ids) -> dict:
    """{id: record} of the pieces of ids a previous run finished in work (made if need be).
    Refuses to start beside the parts of a run with other settings. Parts of pieces not in
    ids (a file changed or came since) stay until the dataset is complete: going back to the
    old files would use them again."""
    manifest = work / "run.json"
    if manifest.is_file():
        try:
            earlier = json.loads(manifest.read_text(encoding="utf-8"))
        except ValueError:
            earlier = {}  # cut short while being written: nothing was made under it yet
        if earlier and earlier.get("settings") != settings:
            raise InputError(
                f"{work} holds the finished pieces of another preparation, with other settings: "
                f"finish it with `{earlier.get('prepare')}`, or delete {work} to start afresh"
            )
    work.mkdir(parents=True, exist_ok=True)
    _write_json(manifest, {"settings": settings, "prepare": rerun})
    wanted, done = set(ids), {}
    for path in work.iterdir():
        pid = path.name.split(".")[0]
        if path.name.endswith(".tmp"):  # a part cut short
            path.unlink()
        elif pid in wanted and path.name.endswith(".json"):
            try:
                done[pid] = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                path.unlink()  # not written to the end: make the piece again
    return done


class Progress:
    """One line on stderr: share of the input read, MB/s, tokens/s, ETA."""

    def __init__(self, total, already, counters, every=0.5):
        self.total, self.already, self.counters, self.every = total, already, counters, every
        self.start = self.last = time.time()
        self.drawn = False

    def draw(self, force=False):
        now = time.time()
        if not force and now - self.last < self.every:
            return
        self.last = now
        done, tokens = (c.value for c in self.counters)
        elapsed = max(now - self.start, 1e-9)
        frac = (self.already + done) / max(self.total, 1)
        eta = (self.total - self.already - done) / (done / elapsed) if done > 0 else 0.0
        sys.stderr.write(
            f"\r[{'#' * int(30 * frac):<30}] {100 * frac:5.1f}% {(self.already + done) / 1e6:,.1f}/"
            f"{self.total / 1e6:,.1f} MB, {done / 1e6 / elapsed:.2f} MB/s, {tokens / 1e6 / elapsed:.2f}M "
            f"tokens/s, {_mmss(elapsed)} elapsed, ETA {_mmss(eta)} "
        )
        sys.stderr.flush()
        self.drawn = True

    def end(self):
        if self.drawn:  # ends the bar's line, so an error message gets a line of its own
            sys.stderr.write("\n")
            self.drawn = False


def _mmss(seconds):
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"


def run_pieces(todo, num_proc, job, progress, counters):
    """Tokenizes the pieces of todo, num_proc at a time. Yields each one's (id, record)."""
    global _job, _counters, _redraw
    if num_proc == 1 or len(todo) == 1:
        corpus.use_system_allocator()
        _job, _counters, _redraw = job, counters, progress.draw
        try:
            for task in todo:
                yield task[0], tokenize_piece(task)
        finally:
            _redraw = None
        return
    with multiprocessing.Pool(min(num_proc, len(todo)), start_worker, (_tok, job, counters)) as pool:
        results = pool.imap_unordered(_tokenize_task, todo)
        for _ in todo:
            while True:
                try:
                    yield results.next(timeout=0.2)
                    break
                except multiprocessing.TimeoutError:
                    progress.draw()
        # leaving the block terminates the workers, also after an error or Ctrl-C


def _tokenize_task(task):
    return task[0], tokenize_piece(task)


# ---- joining the parts into one dataset


def copy_tokens(path, writer, dtype, skip=None):
    """Appends the ids in path to writer, a bounded chunk at a time, leaving out the range
    skip = (offset, length) if given."""
    n = os.path.getsize(path) // np.dtype(dtype).itemsize
    cuts = [(0, n)] if skip is None else [(0, skip[0]), (skip[0] + skip[1], n)]
    with open(path, "rb") as f:
        for a, b in cuts:
            f.seek(a * np.dtype(dtype).itemsize)
            for start in range(a, b, COPY_TOKENS):
                writer.write(np.fromfile(f, dtype, count=min(COPY_TOKENS, b - start)))


def read_tokens(path, dtype, offset, length):
    with open(path, "rb") as f:
        f.seek(offset * np.dtype(dtype).itemsize)
        return np.fromfile(f, dtype, count=length)


def join_parts(ds, work, ids, records, dtype):
    """Writes the parts into ds in piece order; moves one document if a split would be empty.
    Returns (documents, val documents)."""
    n_docs = sum(records[pid]["documents"] for pid in ids)
    n_val = sum(records[pid]["val_documents"] for pid in ids)
    moved, leaves = None, None  # (piece id, [hash, name, position, offset, length]), and the split it leaves
    if n_val == 0:
        moved = min(
            ((pid, records[pid]["lowest_train"]) for pid in ids if records[pid]["lowest_train"]), key=lambda m: m[1]
        )
        leaves, n_val = "train", 1
    elif n_val == n_docs:
        moved = max(
            ((pid, records[pid]["highest_val"]) for pid in ids if records[pid]["highest_val"]), key=lambda m: m[1]
        )
        leaves, n_val = "val", n_val - 1
    for pid in ids:
        for split, writer in (("train", ds.train), ("val", ds.val)):
            skip = moved[1][3:] if moved and moved[0] == pid and split == leaves else None
            copy_tokens(work / f"{pid}.{split}.bin", writer, dtype, skip)
    if moved:  # the split it joins is empty otherwise: the document is all of it
        pid, (_, _, _, offset, length) = moved
        (ds.val if leaves == "train" else ds.train).write(
            read_tokens(work / f"{pid}.{leaves}.bin", dtype, offset, length)
        )
    return n_docs, n_val


def prepare(
    input_dir,
    out_dir,
    val_fraction=0.0005,
    num_proc=1,
    text_key="text",
    seed=1337,
    tokenizer="gpt2",
    skip_bad_files=False,
    files=None,
    source=None,
    rerun=None,
    piece_bytes=None,
):
    """Tokenizes input_dir (or the given files under it) into out_dir. Returns a summary dict.
    Raises InputError. source and rerun go to meta.json (the prepare scripts that download
    say where from, and their own command).

    out_dir's old dataset, if any, is replaced only once the new one is complete."""
    global _tok
    _tok = load_tokenizer_option(str(tokenizer))
    dtype = token_dtype(_tok.vocab_size)
    files = corpus.find_files(input_dir) if files is None else files
    check_out_dir(out_dir)
    for f in files:  # an unreadable file fails now, not hours in
        open(f, "rb").close()
    if piece_bytes is None:  # enough pieces to keep every process busy to the end, few enough to be cheap
        piece_bytes = min(max(sum(os.path.getsize(f) for f in files) // 64, PIECE_BYTES[0]), PIECE_BYTES[1])
    pieces, bad = corpus.plan_pieces(files, input_dir, text_key, piece_bytes, skip_bad_files)
    hf = _tok.kind == "huggingface"
    rerun = rerun or format_prepare_command(
        __file__,
        input_dir=Path(input_dir),
        out_dir=Path(out_dir),
        # "./" so that a folder named gpt2 is not read as GPT-2
        tokenizer=os.path.join(".", command_path(_tok.dir)) if hf else None,
        val_fraction=val_fraction,
        text_key=text_key,
        seed=seed,
        skip_bad_files=skip_bad_files or None,
    )
    # What the parts depend on: a piece made with other settings is another piece.
    settings = {
        "tokenizer": [_tok.kind, _tok.vocab_size, _tok.sha256 if hf else None, _tok.eot_token, _tok.bos_token],
        "dtype": dtype,
        "seed": seed,
        "val_fraction": val_fraction,
        "text_key": text_key,
    }
    ids = [piece_id(settings, p) for p in pieces]
    work = work_dir(out_dir)
    records = finished_pieces(work, settings, rerun, ids)
    todo = [(pid, p) for pid, p in zip(ids, pieces) if pid not in records]
    if records:
        print(f"resuming: {len(records)} of {len(pieces)} pieces were done before, in {work}")

    size = {pid: sum(seg.size for seg in p) for pid, p in zip(ids, pieces)}
    counters = (multiprocessing.Value("q", 0), multiprocessing.Value("q", 0))
    progress = Progress(sum(size.values()), sum(size[pid] for pid in records), counters)
    job = {
        "work": str(work),
        "dtype": dtype,
        "seed": seed,
        "threshold": int(val_fraction * 2**64),
        "text_key": text_key,
        "skip_bad": skip_bad_files,
    }
    try:
        for pid, record in run_pieces(todo, max(1, num_proc), job, progress, counters):
            records[pid] = record
            progress.draw()
        if todo:
            progress.draw(force=True)
    except KeyboardInterrupt:
        progress.end()
        print(
            f"kept the {len(records)} of {len(pieces)} pieces done in {work}: the same command goes on from there",
            file=sys.stderr,
        )
        raise
    finally:
        progress.end()
        if not records:  # nothing worth keeping
            shutil.rmtree(work, ignore_errors=True)

    skipped = bad + [why for pid in ids for why in records[pid]["left_out"]]
    n_docs = sum(records[pid]["documents"] for pid in ids)
    if n_docs < 2:
        raise InputError(
            f"found {n_docs} document{'s' * (n_docs != 1)} under {input_dir}: need at least 2 for train and val"
        )
    meta = {"kind": _tok.kind, "vocab_size": _tok.vocab_size}
    if hf:  # its files are copied in with the tokens; the sha256 says they still match
        meta.update(sha256=_tok.sha256, tokenizer="tokenizer.json")
    with DatasetWriter(out_dir, dtype) as ds:
        n_docs, n_val = join_parts(ds, work, ids, records, dtype)
        meta.update(
            source=str(source or input_dir),
            documents={"train": n_docs - n_val, "val": n_val},
            prepare=rerun,
            **({"skipped": skipped} if skipped else {}),
        )
        ds.commit(meta, files=_tok.files if hf else ())
    shutil.rmtree(work, ignore_errors=True)
    return {
        "files": len(files),
        "documents": n_docs,
        "val_documents": n_val,
        "train_tokens": ds.train.count,
        "val_tokens": ds.val.count,
        "pieces": len(pieces),
        "resumed": len(pieces) - len(todo),
        "skipped": skipped,
    }


def add_common_options(parser, out_dir_required=True):
    """The options every script that ends in prepare() shares."""
    parser.add_argument(
        "--out_dir", required=out_dir_required, help="where train.bin, val.bin, meta.json go, e.g. data/mytext"
    )
    parser.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2, or a Hugging Face tokenizer folder (tokenizer.json, ...); ./gpt2 names a folder",
    )
    parser.add_argument("--val_fraction", type=float, default=0.0005)
    parser.add_argument("--num_proc", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--text_key", default="text", help="the text field of each .jsonl record / .parquet column")
    parser.add_argument("--seed", type=int, default=1337, help="seeds the choice of val documents")
    parser.add_argument(
        "--skip_bad_files",
        nargs="?",
        const=True,
        default=False,
        type=_true_or_false,
        help="leave out (and list) the pieces of files that cannot be read, instead of stopping",
    )


def _true_or_false(value):
    if value not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")
    return value == "True"


def check_common_options(args):
    if not 0 < args.val_fraction < 1:
        raise SystemExit(f"error: --val_fraction must be between 0 and 1, got {args.val_fraction}")


def print_summary(s, out_dir, t0):
    print(f"{s['files']} files, {s['documents']:,} documents ({s['val_documents']:,} in val)")
    print(f"train: {s['train_tokens']:,} tokens, val: {s['val_tokens']:,} tokens -> {out_dir}")
    if s["val_tokens"] < GPT2_ROW_TOKENS:  # a run evaluates on rows of block_size + 1 val tokens
        fraction = val_fraction_for(GPT2_ROW_TOKENS, s["train_tokens"] + s["val_tokens"])
        print(
            f"note: val holds only {s['val_tokens']:,} tokens and training needs block_size + 1 of them "
            f"({GPT2_ROW_TOKENS:,} at GPT-2's 1024): for more, run again with --val_fraction={fraction:g}"
        )
    for why in s["skipped"]:
        print(f"skipped: {why}")
    print(f"done in {time.time() - t0:.1f}s")


def prepare_shards(script, args, out_dir, find_shards, **script_options):
    """The end of a downloading prepare script (data/fineweb, data/openwebtext): its re-run
    command (its own options, then the common ones), then prepare() on the shards that
    find_shards() returns as (root, files, source), and the summary."""
    rerun = format_prepare_command(
        script,
        **script_options,
        out_dir=Path(out_dir),
        # "./" so that a folder named gpt2 is not read as GPT-2
        tokenizer=None if args.tokenizer == "gpt2" else os.path.join(".", command_path(args.tokenizer)),
        val_fraction=args.val_fraction,
        text_key=args.text_key,
        seed=args.seed,
        skip_bad_files=args.skip_bad_files or None,
    )
    t0 = time.time()

    def run():
        root, files, source = find_shards()
        return prepare(
            root,
            out_dir,
            args.val_fraction,
            max(1, args.num_proc),
            args.text_key,
            args.seed,
            args.tokenizer,
            args.skip_bad_files,
            files=files,
            source=source,
            rerun=rerun,
        )

    print_summary(run_prepare_script(run, out_dir), out_dir, t0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--input_dir", required=True, help="folder of .txt / .jsonl[.gz|.zst] / .parquet files")
    add_common_options(parser)
    args = parser.parse_args(argv)
    check_common_options(args)
    t0 = time.time()
    s = run_prepare_script(
        lambda: prepare(
            args.input_dir,
            args.out_dir,
            args.val_fraction,
            max(1, args.num_proc),
            args.text_key,
            args.seed,
            args.tokenizer,
            args.skip_bad_files,
        ),
        args.out_dir,
    )
    print_summary(s, args.out_dir, t0)


if __name__ == "__main__":
    main()
