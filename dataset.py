"""The training data: data/<dataset>/{train,val}.bin (uint16 or uint32 token ids, as meta.json's
"dtype" says) and meta.json, checked
once at start-up, and the batch of every step as a pure function of (seed, step).

Every process reads only its own rows of each batch from the memory-mapped file, so a dataset
never has to fit in memory and a resumed or re-sharded run sees exactly the batches of an
uninterrupted one.
"""

import json
import os
import re

import numpy as np

import tokenizer
from configurator import Config
from dataset_writer import val_fraction_for


class DataError(ValueError):
    """A missing or malformed dataset; the message names the file and the prepare script."""


def dataset_dir(config: Config) -> str:
    """Absolute, so that messages name the folder wherever the command was run."""
    return os.path.abspath(os.path.join(config.data_dir, config.dataset))


def _prepare_hint(config: Config) -> str:
    return f"run `{tokenizer.prepare_command(dataset_dir(config))}`"


def dataset_tokenizer(config: Config) -> tokenizer.Tokenizer | None:
    """The tokenizer in the dataset's meta.json; None where there is none and the config
    gives vocab_size itself."""
    if config.vocab_size and not os.path.exists(os.path.join(dataset_dir(config), "meta.json")):
        return None
    try:
        return tokenizer.load_tokenizer(dataset_dir(config))
    except (OSError, ValueError) as e:
        raise DataError(str(e)) from None


def document_start(tok: tokenizer.Tokenizer | None) -> int | None:
    """The id each document starts with, where document_masking starts a segment: the begin-of-text
    token (Llama's prepared data: <bos> text <eot>), else the end-of-text token (GPT-2's: text
    <|endoftext|>, which opens the next document as a sample from nothing starts); None for a
    char-level vocabulary, which has neither."""
    if tok is None:
        return None
    return tok.bos_token if tok.bos_token is not None else tok.eot_token


def config_document_start(config: Config) -> int | None:
    """document_start of the config's dataset; GPT-2's where there is no meta.json and the vocabulary
    is GPT-2's (bench.py and compile_aot.py assume it then)."""
    if not os.path.exists(os.path.join(dataset_dir(config), "meta.json")):
        return tokenizer.GPT2_EOT if config.vocab_size in (0, tokenizer.GPT2_VOCAB_SIZE) else None
    return document_start(dataset_tokenizer(config))


def read_vocab_size(config: Config) -> int:
    """vocab_size from the config, or else from the dataset's meta.json."""
    return config.vocab_size or dataset_tokenizer(config).vocab_size


def token_dtype(config: Config) -> np.dtype:
    """meta.json's "dtype": uint16 where it has none (datasets from before uint32 existed, or
    none at all when the config gives vocab_size)."""
    try:
        with open(os.path.join(dataset_dir(config), "meta.json"), encoding="utf-8") as f:
            return np.dtype(json.load(f).get("dtype", "uint16"))  # load_tokenizer checked it
    except FileNotFoundError:
        return np.dtype(np.uint16)


def open_split(config: Config, split: str, vocab_size: int) -> np.ndarray:
    """Memory-map data/<dataset>/<split>.bin after checking every token."""
    path = os.path.join(dataset_dir(config), f"{split}.bin")
    if not os.path.isfile(path):
        raise DataError(f"{path} not found: {_prepare_hint(config)}")
    n_bytes, dtype = os.path.getsize(path), token_dtype(config)
    if n_bytes == 0 or n_bytes % dtype.itemsize:
        raise DataError(f"{path} has {n_bytes} bytes, not a whole number of {dtype} tokens: "
                        f"{_prepare_hint(config)} again")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) < config.block_size + 1:
        raise DataError(f"{path} holds {len(tokens)} tokens, fewer than block_size+1 = "
                        f"{config.block_size + 1} (one row and its targets): lower --block_size, "
                        + (_more_val_hint(config, len(tokens), dtype) if split == "val" else "or add data"))
    bad = first_token_at_least(tokens, vocab_size)
    if bad is not None:
        raise DataError(f"{path} holds token id {tokens[bad]} >= vocab_size {vocab_size} (at token "
                        f"{bad:,}): the file does not match meta.json (another tokenizer, or "
                        f"damaged); {_prepare_hint(config)} again")
    return tokens


def _more_val_hint(config: Config, val_tokens: int, dtype: np.dtype) -> str:
    """How to get a val split of one row: the prepare command again with a larger --val_fraction,
    where its script splits by document (data/text and the downloading ones), else more data."""
    command = tokenizer.prepare_command(dataset_dir(config))
    if not re.search(r"data/(text|fineweb|openwebtext)/prepare\.py", command):
        return "or add data"
    train_path = os.path.join(dataset_dir(config), "train.bin")
    train_tokens = os.path.getsize(train_path) // dtype.itemsize if os.path.isfile(train_path) else 0
    fraction = val_fraction_for(config.block_size + 1, train_tokens + val_tokens)
    command = re.sub(r" --val_fraction=\S+", "", command) + f" --val_fraction={fraction:g}"
    return f"or give val a larger share of the documents: `{command}`"


def first_token_at_least(tokens: np.ndarray, limit: int, chunk: int = 1 << 26) -> int | None:
    """Index of the first token >= limit, or None. Every token is read, a chunk at a time
    (~0.1 s per GB from the page cache), so one bad id can't become a NaN at some step."""
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        if part.max() >= limit:
            return start + int(np.argmax(part >= limit))
    return None


SPLIT_STREAMS = {"train": 0, "val": 1}  # separate random streams per split


def batch_for_step(tokens: np.ndarray, config: Config, step: int, split: str, rows: np.ndarray,
                   n_micro: int, stream: int = 0):
    """Inputs and targets (n_micro, len(rows), T) for one step: a pure function of (seed, step).

    Every process draws the same global offsets and keeps only its own `rows`, so a
    resumed or re-sharded run sees exactly the batches of an uninterrupted one.
    """
    rng = np.random.default_rng((config.seed, SPLIT_STREAMS[split], stream, step))
    T = config.block_size
    # A row starting at s reads tokens s .. s+T: every start up to len - T - 1, so the last token is a target too.
    starts = rng.integers(0, len(tokens) - T, size=(n_micro, config.batch_size))[:, rows]
    window = starts[..., None] + np.arange(T + 1)
    seq = tokens[window].astype(np.int32)
    return seq[..., :-1], seq[..., 1:]
