"""The atomic writers the data/*/prepare.py scripts share, and their command-line glue.

A dataset is train.bin and val.bin (token ids: uint16 when the vocabulary fits in 16 bits,
else uint32; meta.json's "dtype" says which), meta.json (data/tokenizer.py says what it holds) and, for a Hugging Face tokenizer, that tokenizer's files. Every file goes to
NAME.tmp beside the old one, and all of them are renamed over the old files together
once everything is written, so a bad input, a crash or Ctrl-C leaves the old dataset
exactly as it was.
"""

import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np

from data.tokenizer import HF_FILES, command_path

# The extra files a dataset may have (data/dataset.py reads them): a stale one is removed by name only.
EXTRA_NAMES = tuple(f"{split}.{kind}.bin" for split in ("train", "val") for kind in ("mask", "starts"))


class PrepareError(Exception):
    """Something wrong with a prepare script's input or output folder: one line for the user."""


def token_dtype(vocab_size: int) -> str:
    """'uint16' where every id fits in 16 bits (GPT-2's 50257), else 'uint32' (Llama 3's 128256):
    the smaller file, as long as it can hold the vocabulary."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise PrepareError(f"a vocabulary of {vocab_size:,} tokens does not fit in 32-bit token files")


GPT2_ROW_TOKENS = 1025  # one row of GPT-2's context (1024) and its targets: a val split needs a row at least


def val_fraction_for(tokens: int, total_tokens: int) -> float:
    """A --val_fraction that gives val at least `tokens` of `total_tokens`, with room to spare (documents
    go to val whole, so the share drawn varies): twice the share, rounded up to one digit, at most 0.5."""
    share = min(0.5, 2 * tokens / max(1, total_tokens))
    unit = 10.0 ** math.floor(math.log10(share))
    return min(0.5, float(f"{math.ceil(share / unit - 1e-9) * unit:.1g}"))


def _check_ids(a, dtype: str):
    limit = int(np.iinfo(dtype).max) + 1
    if a.size and (a.min() < 0 or a.max() >= limit):
        raise ValueError(f"token ids must be in [0, {limit}) to fit {dtype}, got [{a.min()}, {a.max()}]")


class TokenWriter:
    """Appends token ids to PATH.tmp as `dtype` ('uint16' or 'uint32'); commit() renames it to PATH.

        with TokenWriter("train.bin") as w:
            w.write(ids)   # any number of times
        w.commit()

    Leaving the block with an exception removes PATH.tmp; PATH stays as it was.
    """

    BUFFER = 1 << 20  # ids kept in memory between writes: small calls stay cheap

    def __init__(self, path, dtype: str = "uint16"):
        self.path, self.dtype = os.fspath(path), dtype
        self.tmp = self.path + ".tmp"
        self.count = 0
        self._buf = []
        self._f = None

    def __enter__(self):
        return self.start()

    def start(self):
        """Opens PATH.tmp (`with` does this)."""
        self._f = open(self.tmp, "wb")
        return self

    def write(self, ids):
        if isinstance(ids, np.ndarray):  # big arrays go straight to disk
            self._flush()
            self._write_array(ids)
            return
        self._buf.extend(ids)
        if len(self._buf) >= self.BUFFER:
            self._flush()

    def _flush(self):
        if self._buf:
            self._write_array(np.array(self._buf, dtype=np.int64))
            self._buf = []

    def _write_array(self, a):
        _check_ids(a, self.dtype)
        a.astype(self.dtype).tofile(self._f)
        self.count += a.size

    def finish(self):
        """Puts every id on disk and closes PATH.tmp, ready for commit()."""
        if self._f is None or self._f.closed:
            return
        self._flush()
        self._f.flush()
        os.fsync(self._f.fileno())  # the data is on disk before the name is
        self._f.close()

    def commit(self):
        self.finish()
        os.replace(self.tmp, self.path)

    def discard(self):
        """Removes PATH.tmp if it is still there; PATH is not touched."""
        if self._f is not None:
            self._f.close()
        Path(self.tmp).unlink(missing_ok=True)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.discard()
            return
        try:
            self.finish()
        except BaseException:  # a bad id in the last buffer, a full disk
            self.discard()
            raise


def _write_json_synced(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _copy_synced(src, dst):
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)
        fout.flush()
        os.fsync(fout.fileno())


def write_tokens(path, ids, dtype: str = "uint16") -> int:
    """Writes ids to path as dtype, atomically. Returns the number of ids written."""
    ids = np.asarray(ids)
    _check_ids(ids, dtype)  # before creating any file
    with TokenWriter(path, dtype) as w:
        w.write(ids)
    w.commit()
    return w.count


def write_meta(out_dir, meta: dict):
    """Writes out_dir/meta.json atomically."""
    path = Path(out_dir) / "meta.json"
    tmp = path.with_name("meta.json.tmp")
    try:
        _write_json_synced(tmp, meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_out_dir(out_dir):
    """Raises PrepareError unless out_dir is, or can be made, a folder we can write in.

    Creates nothing, so it can run before any slow work."""
    existing = Path(out_dir).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    where = f"--out_dir {out_dir}" + ("" if existing == Path(out_dir).absolute() else f": {existing}")
    if not existing.is_dir():
        raise PrepareError(f"{where} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PrepareError(f"{where} is not writable")


def _old_kind(meta_path):
    """(kind, extra file names) of the dataset meta_path describes; (None, []) if none."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, []
    if not isinstance(meta, dict):
        return None, []
    extra = meta.get("extra_files")
    return meta.get("kind"), extra if isinstance(extra, list) else []


class DatasetWriter:
    """train.bin, val.bin, meta.json (and tokenizer files) of one dataset, written as *.tmp
    beside the old files; commit(meta, files) renames them all over the old ones, meta.json last.

        with DatasetWriter(out_dir) as ds:
            ds.train.write(ids)   # and ds.val.write(ids), any number of times
            ds.commit(meta, files=tok.files)   # files: a Hugging Face tokenizer's, or none

    Leaving the block without commit() (a bad input, an exception, Ctrl-C) removes the
    temporaries, and the old dataset stays byte for byte as it was. extra={name: dtype} adds files
    written alike, ds.extra[name] (a fine-tuning set's loss mask); meta.json lists them.
    """

    def __init__(self, out_dir, dtype: str = "uint16", extra=None):
        self.out_dir, self.dtype = Path(out_dir), dtype
        self.train = TokenWriter(self.out_dir / "train.bin", dtype)
        self.val = TokenWriter(self.out_dir / "val.bin", dtype)
        # Files of numbers beside the tokens, {name: dtype} (a fine-tuning set's loss mask), written alike.
        self.extra = {name: TokenWriter(self.out_dir / name, kind) for name, kind in (extra or {}).items()}
        self.meta_path = self.out_dir / "meta.json"
        self.meta_tmp = self.out_dir / "meta.json.tmp"
        self._copies = []  # (NAME.tmp, NAME) of the files commit() copies in

    def __enter__(self):
        check_out_dir(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            for writer in self._writers():
                writer.start()
        except BaseException:
            self._discard()
            raise
        return self

    def _writers(self):
        return [self.train, self.val, *self.extra.values()]

    def commit(self, meta: dict, files=()):
        """files are copied into the dataset under their own names (a Hugging Face tokenizer's)."""
        for writer in self._writers():
            writer.finish()
        for src in map(Path, files):
            dst = self.out_dir / src.name
            self._copies.append((dst.with_name(dst.name + ".tmp"), dst))
            _copy_synced(src, self._copies[-1][0])
        extra_files = {"extra_files": sorted(self.extra)} if self.extra else {}
        _write_json_synced(self.meta_tmp, {**meta, "dtype": self.dtype, **extra_files})  # how to read the files
        # Tokenizer files an old Hugging Face dataset left and the new one lacks would be read
        # with the new tokenizer.json; without such a dataset those names are not ours to remove.
        # Likewise the extra files an old dataset names and the new one lacks.
        old_kind, old_extra = _old_kind(self.meta_path)
        stale = (
            {self.out_dir / name for name in HF_FILES} - {dst for _, dst in self._copies}
            if old_kind == "huggingface"
            else set()
        )
        stale |= {self.out_dir / name for name in old_extra if name in EXTRA_NAMES} - {
            self.out_dir / name for name in self.extra
        }
        # All that can fail is done; only renames are left. meta.json leaves first and comes
        # back last, so no meta.json ever vouches for a mix of old and new files.
        self.meta_path.unlink(missing_ok=True)
        for writer in self._writers():
            writer.commit()
        for tmp, dst in self._copies:
            os.replace(tmp, dst)
        for path in stale:
            path.unlink(missing_ok=True)
        os.replace(self.meta_tmp, self.meta_path)

    def _discard(self):
        for writer in self._writers():
            writer.discard()
        for tmp, _ in self._copies:
            tmp.unlink(missing_ok=True)
        self.meta_tmp.unlink(missing_ok=True)

    def __exit__(self, exc_type, exc, tb):
        self._discard()  # after commit() there is nothing left to remove


def write_dataset(out_dir, train_ids, val_ids, meta: dict, files=()):
    """Writes a whole dataset; an old one in out_dir is replaced only once all of it is written."""
    train_ids, val_ids = np.asarray(train_ids), np.asarray(val_ids)
    dtype = token_dtype(meta["vocab_size"])
    _check_ids(train_ids, dtype)  # before creating any file
    _check_ids(val_ids, dtype)
    with DatasetWriter(out_dir, dtype) as ds:
        ds.train.write(train_ids)
        ds.val.write(val_ids)
        ds.commit(meta, files)
    return ds.train.count, ds.val.count


# ---- for the prepare scripts' command lines


def format_prepare_command(script, **options):
    """`python SCRIPT --key=value ...`, quoted for a shell at the repo root, for meta.json's
    "prepare" field. Options that are None are left out; os.PathLike values are paths."""
    words = ["python", command_path(script)]
    for key, value in options.items():
        if value is not None:
            words.append(f"--{key}={command_path(value) if isinstance(value, os.PathLike) else value}")
    return " ".join(shlex.quote(word) for word in words)


def _describe_os_error(e):
    return str(e) if e.filename is None else f"{e.filename}: {e.strerror or e}"


def run_prepare_script(run, out_dir):
    """Returns run(). Errors a user can cause end the script with one line and status 1, not
    a traceback; Ctrl-C ends it with status 130."""
    try:
        return run()
    except PrepareError as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:  # an unreadable input file, a full disk, ...
        raise SystemExit(f"error: {_describe_os_error(e)}") from None
    except KeyboardInterrupt:
        left = (
            f"the existing dataset in {out_dir} is unchanged"
            if (Path(out_dir) / "meta.json").is_file()
            else f"no dataset was written to {out_dir}"
        )
        print(f"interrupted: {left}", file=sys.stderr)
        raise SystemExit(130) from None
