"""The training data: data/<dataset>/{train,val}.bin (uint16 or uint32 token ids, as meta.json's
"dtype" says) and meta.json, checked once at start-up, and the batch of every step as a pure
function of (seed, step). A fine-tuning set (data/chat/prepare.py; meta.json has "chat") has
beside each split a loss mask, {split}.mask.bin (uint8, 1 on the tokens to learn), and where each
conversation starts, {split}.starts.bin (uint64); its rows are whole conversations, padded.

Every process reads only its own rows of each batch from the memory-mapped file, so a dataset
never has to fit in memory and a resumed or re-sharded run sees exactly the batches of an
uninterrupted one.
"""

import dataclasses
import functools
import json
import os
import re

import numpy as np

from configurator import Config
from data import tokenizer
from data.writer import val_fraction_for


class DataError(ValueError):
    """A missing or malformed dataset; the message names the file and the prepare script."""


def dataset_dir(config: Config) -> str:
    """Absolute, so that messages name the folder wherever the command was run."""
    return os.path.abspath(os.path.join(config.data_dir, config.dataset))


def expects_chat(config: Config) -> bool:
    """Whether the run is for a fine-tuning set even before one exists: packing only packs
    conversations, so messages about a missing dataset name data/chat/prepare.py."""
    return config.packing


def _prepare_hint(config: Config) -> str:
    return f"run `{tokenizer.prepare_command(dataset_dir(config), expects_chat(config))}`"


def dataset_tokenizer(config: Config) -> tokenizer.Tokenizer | None:
    """The tokenizer in the dataset's meta.json; None where there is none and the config
    gives vocab_size itself."""
    if config.vocab_size and not os.path.exists(os.path.join(dataset_dir(config), "meta.json")):
        return None
    try:
        return tokenizer.load_tokenizer(dataset_dir(config), expects_chat(config))
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


def _memmap(config: Config, name: str, dtype, what: str = "tokens") -> np.ndarray:
    """data/<dataset>/<name> memory-mapped as dtype, after checking it is whole numbers of it."""
    path, dtype = os.path.join(dataset_dir(config), name), np.dtype(dtype)
    if not os.path.isfile(path):
        raise DataError(f"{path} not found: {_prepare_hint(config)}")
    n_bytes = os.path.getsize(path)
    if n_bytes == 0 or n_bytes % dtype.itemsize:
        raise DataError(
            f"{path} has {n_bytes} bytes, not a whole number of {dtype} {what}: {_prepare_hint(config)} again"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _check_ids(config: Config, split: str, tokens: np.ndarray, vocab_size: int) -> None:
    bad = first_token_at_least(tokens, vocab_size)
    if bad is not None:
        raise DataError(
            f"{os.path.join(dataset_dir(config), split + '.bin')} holds token id {tokens[bad]} >= "
            f"vocab_size {vocab_size} (at token {bad:,}): the file does not match meta.json (another "
            f"tokenizer, or damaged); {_prepare_hint(config)} again"
        )


def open_split(config: Config, split: str, vocab_size: int) -> np.ndarray:
    """Memory-map data/<dataset>/<split>.bin after checking every token."""
    tokens = _memmap(config, f"{split}.bin", token_dtype(config))
    if len(tokens) < config.block_size + 1:
        raise DataError(
            f"{os.path.join(dataset_dir(config), split + '.bin')} holds {len(tokens)} tokens, fewer "
            f"than block_size+1 = {config.block_size + 1} (one row and its targets): lower --block_size, "
            + (_more_val_hint(config, len(tokens), tokens.dtype) if split == "val" else "or add data")
        )
    _check_ids(config, split, tokens, vocab_size)
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
        part = tokens[start : start + chunk]
        if part.max() >= limit:
            return start + int(np.argmax(part >= limit))
    return None


SPLIT_STREAMS = {"train": 0, "val": 1}  # separate random streams per split


def batch_for_step(
    tokens: np.ndarray, config: Config, step: int, split: str, rows: np.ndarray, n_micro: int, stream: int = 0
):
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


# ----------------------------------------------------------------------------- fine-tuning sets


def chat_meta(config: Config) -> dict | None:
    """meta.json's "chat" part (data/chat/prepare.py writes it), or None for a text dataset."""
    try:
        with open(os.path.join(dataset_dir(config), "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):  # dataset_tokenizer reports a missing or broken meta.json
        return None
    return meta.get("chat") if isinstance(meta, dict) and isinstance(meta.get("chat"), dict) else None


@dataclasses.dataclass(frozen=True)
class ChatSplit:
    """One split of a fine-tuning set: its tokens, the loss mask (1 = a token to learn to say), and
    the rows a step draws from: (first token, length) of one conversation each, or with packing
    of as many consecutive conversations as fit in block_size + 1 tokens together."""

    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray  # each conversation's first token, increasing from 0
    row_start: np.ndarray
    row_length: np.ndarray

    def __len__(self):  # a split's size in tokens, as a text split's (the start-up summary)
        return len(self.tokens)

    def __getitem__(self, index):  # its tokens, as a text split's (the prompt of a logged sample)
        return self.tokens[index]


def open_chat_split(config: Config, split: str, vocab_size: int) -> ChatSplit:
    """data/<dataset>/<split>.bin, .mask.bin and .starts.bin, checked, and the rows of its batches."""
    tokens = _memmap(config, f"{split}.bin", token_dtype(config))
    mask = _memmap(config, f"{split}.mask.bin", np.uint8, "mask values")
    starts = _memmap(config, f"{split}.starts.bin", np.uint64, "offsets").astype(np.int64)
    where = os.path.join(dataset_dir(config), split)
    if len(mask) != len(tokens) or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= len(tokens):
        raise DataError(
            f"{where}.bin, .mask.bin and .starts.bin do not belong together (damaged, or from "
            f"different runs): {_prepare_hint(config)} again"
        )
    _check_ids(config, split, tokens, vocab_size)
    lengths = np.diff(np.append(starts, len(tokens)))
    too_long = int((lengths > config.block_size + 1).sum())
    if too_long:
        raise DataError(
            f"{where}.bin holds {too_long:,} conversations longer than block_size + 1 = "
            f"{config.block_size + 1} tokens (the longest: {lengths.max():,}): prepare it again with "
            f"--block_size={config.block_size}, or raise block_size"
        )
    first = pack(lengths, config.block_size + 1) if config.packing else np.arange(len(starts))
    row_start = starts[first]
    return ChatSplit(tokens, mask, starts, row_start, np.diff(np.append(row_start, len(tokens))))


def pack(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The first conversation of each row when consecutive conversations fill rows of capacity
    tokens, in order (a row takes the next one while it fits)."""
    first, used = [], capacity
    for i, n in enumerate(lengths.tolist()):
        if used + n > capacity:
            first.append(i)
            used = 0
        used += n
    return np.asarray(first, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, split_stream: int, stream: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng((seed, split_stream, stream, epoch)).permutation(n_rows)


def chat_batch_for_step(
    data: ChatSplit, config: Config, step: int, split: str, rows: np.ndarray, n_micro: int, stream: int = 0
):
    """Inputs and targets (n_micro, len(rows), T) for one step of fine-tuning, and with packing the
    segment ids of the inputs (each conversation one, from 1; padding 0): a pure function of
    (seed, step), as batch_for_step's. Rows are drawn in epochs, each a fresh permutation of all.

    A target < 0 is none: the prompts' tokens, the template's, padding. Each row's first token
    is its first conversation's first, never a target."""
    B, T = config.batch_size, config.block_size
    drawn = step * n_micro * B + np.arange(n_micro * B)  # the step's rows, counted from the first step's
    epoch, index = np.divmod(drawn, len(data.row_start))
    picked = np.empty_like(drawn)
    for e in np.unique(epoch):
        order = _epoch_order(config.seed, SPLIT_STREAMS[split], stream, int(e), len(data.row_start))
        picked[epoch == e] = order[index[epoch == e]]
    picked = picked.reshape(n_micro, B)[:, rows]
    offset_BxT = np.arange(T + 1)
    filled = offset_BxT < data.row_length[picked][..., None]
    window = np.where(filled, data.row_start[picked][..., None] + offset_BxT, 0)
    seq = np.where(filled, data.tokens[window], 0).astype(np.int32)
    is_target = filled[..., 1:] & (data.mask[window[..., 1:]] == 1)
    x, y = seq[..., :-1], np.where(is_target, seq[..., 1:], -1)
    if not config.packing:
        return x, y
    conversation = np.searchsorted(data.starts, window[..., :-1], side="right")  # 1 + its index
    return x, y, np.where(filled[..., :-1], conversation - conversation[..., :1] + 1, 0).astype(np.int32)


def step_batch(data, config: Config, step: int, split: str, rows: np.ndarray, n_micro: int, stream: int = 0):
    """The arrays of one step from either kind of split: a text split's (x, y), a fine-tuning set's
    (x, y[, segment ids])."""
    if isinstance(data, ChatSplit):
        return chat_batch_for_step(data, config, step, split, rows, n_micro, stream)
    return batch_for_step(data, config, step, split, rows, n_micro, stream)
