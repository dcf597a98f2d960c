"""Conversations into a fine-tuning set: train.bin and val.bin (token ids), beside each a loss mask
({split}.mask.bin: 1 on the tokens the model learns to say) and where each conversation starts
({split}.starts.bin), and meta.json with the tokenizer and its chat template.

    python data/chat/prepare.py --input=chats.jsonl --tokenizer=TOKENIZER_DIR --out_dir=data/mychat \\
        [--val_input=FILE] [--val_fraction=0.02] [--block_size=1024] [--overlong=drop|truncate] [--seed=1337]
    python data/chat/prepare.py --hub=HuggingFaceTB/smol-smoltalk --tokenizer=TOKENIZER_DIR \\
        --out_dir=data/smol_smoltalk --block_size=2048

Then fine-tune with --dataset=mychat (config/sft_*.py). --input is a .jsonl, .jsonl.gz or .parquet
file, or a folder of them; each line or row is one conversation, in one of three shapes:
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}   (OpenAI's)
    {"prompt": "...", "completion": "..."}   one user turn and the answer (or two lists of messages)
    {"instruction": "...", "input": "...", "output": "..."}   (Alpaca's; input may be empty or absent)

Each conversation is rendered with the tokenizer's chat template by data/chat_template.py, the code serve.py
renders prompts with (a tokenizer without a template gets data/chat_template.py's default), tokenized whole,
and masked: 1 on the tokens of every assistant turn and its end-of-turn token, 0 on the rest. A
row that is not one of the shapes, has a role other than system, user and assistant, or no
assistant turn stops the script with its file and line (or parquet row). A conversation longer
than block_size + 1 tokens (a row of the batch and its last target) is dropped, or with
--overlong=truncate cut to that length (dropped still if no token to learn is left); the summary
counts them.

Val: the conversations of --val_input, or else each conversation with probability val_fraction
(drawn from a hash of its file's name, its line or row and the seed: nothing else). --hub
downloads a Hugging Face dataset's .parquet files (into the Hugging Face cache; offline, the
cached copy is used), its test* files going to val. An existing dataset in out_dir is replaced
only once the new one is complete.
"""

import argparse
import gzip
import hashlib
import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: data/
from data import chat_template  # noqa: E402
from data import corpus  # noqa: E402
from data.corpus import InputError  # noqa: E402
from data.tokenizer import command_path, gpt2_tokenizer, hf_tokenizer  # noqa: E402
from data.writer import (
    DatasetWriter,
    PrepareError,
    check_out_dir,
    format_prepare_command,  # noqa: E402
    run_prepare_script,
    token_dtype,
)

FORMATS = (".jsonl", ".jsonl.gz", ".parquet")
SHAPES = "{messages}, {prompt, completion} or {instruction, output}"
BATCH_ROWS = 512  # parquet rows in memory at a time


def load_tokenizer(option):
    """GPT-2's BPE or the Hugging Face tokenizer in the folder `option`, checked to fit token files."""
    if option == "gpt2":
        return gpt2_tokenizer()
    try:
        tok = hf_tokenizer(option)
        token_dtype(tok.vocab_size)
    except (ValueError, PrepareError) as e:
        raise InputError(f"--tokenizer {option}: {e}") from None
    return tok


# ---- rows to conversations


def conversation(row) -> list:
    """The messages of one row, in any of the three shapes; ValueError says what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object with {SHAPES}, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt-completion
            messages = prompt + completion
        elif isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        else:
            raise ValueError("prompt and completion must both be strings, or both lists of messages")
    elif "instruction" in row and "output" in row:
        instruction, extra, output = row["instruction"], row.get("input") or "", row["output"]
        if not all(isinstance(v, str) for v in (instruction, extra, output)):
            raise ValueError("instruction, input and output must be strings")
        messages = [
            {"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")},
            {"role": "assistant", "content": output},
        ]
    else:
        raise ValueError(f"the row has none of {SHAPES} (its keys: {', '.join(map(str, row)) or 'none'})")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in chat_template.ROLES:
            what = f"has role {role!r}" if isinstance(message, dict) else "is not a {role, content} object"
            raise ValueError(f"messages[{i}] {what}: the roles are {', '.join(chat_template.ROLES)}")
    return messages


def read_rows(path):
    """Yields (where, position, row): "FILE:LINE" or "FILE, row N", the line or row, and the row's
    object. Malformed JSON or a file that can't be read raises InputError naming the place."""
    name = str(path)
    if name.endswith(".parquet"):
        try:
            pf = pq.ParquetFile(path)
            columns = [
                c
                for c in ("messages", "prompt", "completion", "instruction", "input", "output")
                if c in pf.schema_arrow.names
            ]
            n = 0
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                for row in batch.to_pylist():
                    yield f"{name}, row {n}", n, row
                    n += 1
        except corpus.READ_ERRORS as e:
            raise InputError(f"{name}: not a readable parquet file ({corpus.first_line(e)})") from None
        return
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                line = line.removeprefix(corpus.BOM) if lineno == 1 else line
                if not line.strip():
                    continue
                where = f"{name}:{lineno}"
                yield where, lineno, corpus.parse_json_line(line, lambda: where)
    except (OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        raise InputError(f"{name}: cannot be read to the end ({corpus.first_line(e)})") from None


def find_files(option) -> list:
    """The chat files --input or --val_input names: a file, or every one under a folder."""
    path = Path(option)
    if path.is_file():
        if not path.name.endswith(FORMATS):
            raise InputError(f"{option} is not a {', '.join(FORMATS)} file")
        return [path]
    if not path.is_dir():
        raise InputError(f"{option} does not exist")
    files = sorted(
        (p for p in path.rglob("*") if p.name.endswith(FORMATS) and p.is_file()),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise InputError(f"no {', '.join(FORMATS)} files under {option}")
    return files


def in_val(seed, path, position, val_fraction) -> bool:
    """The conversation's draw for val: its file's name and its line or row, hashed with the seed."""
    digest = hashlib.blake2b(f"{Path(path).name}\n{position}".encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2**64


# ---- writing


class Split:
    """One split's writers and counts."""

    def __init__(self, ds, name):
        self.tokens, self.mask = getattr(ds, name), ds.extra[f"{name}.mask.bin"]
        self.starts = ds.extra[f"{name}.starts.bin"]
        self.conversations = self.n_tokens = self.learned = self.dropped = self.truncated = 0

    def add(self, ids, mask, capacity, truncate) -> None:
        if len(ids) > capacity:
            if not truncate or not any(mask[:capacity]):
                self.dropped += 1
                return
            ids, mask, self.truncated = ids[:capacity], mask[:capacity], self.truncated + 1
        self.starts.write([self.n_tokens])
        self.tokens.write(ids)
        self.mask.write(mask)
        self.conversations, self.n_tokens, self.learned = (
            self.conversations + 1,
            self.n_tokens + len(ids),
            self.learned + sum(mask),
        )

    def summary(self, name, capacity) -> str:
        line = f"{name}: {self.conversations:,} conversations, {self.n_tokens:,} tokens ({self.learned:,} to learn)"
        if self.dropped:
            line += f"; dropped {self.dropped:,} longer than block_size + 1 = {capacity} tokens"
        if self.truncated:
            line += f"; truncated {self.truncated:,} to their first {capacity} tokens"
        return line


def prepare(
    inputs,
    out_dir,
    tokenizer="gpt2",
    val_inputs=None,
    val_fraction=0.02,
    block_size=1024,
    overlong="drop",
    seed=1337,
    source=None,
    rerun=None,
    log=print,
) -> dict:
    """Renders, tokenizes and masks the conversations of `inputs` (files) into out_dir; val from
    val_inputs (files) or else val_fraction of inputs. Returns the counts. Raises InputError."""
    tok = load_tokenizer(str(tokenizer))
    check_out_dir(out_dir)
    template = tok.chat_template or chat_template.DEFAULT_TEMPLATE
    if tok.chat_template is None:
        log(
            f"note: {tok.summary()} has no chat template: using data/chat_template.py's default (USER: ... ASSISTANT: ...), "
            f"which serve.py uses for it too"
        )
    capacity, truncate = block_size + 1, overlong == "truncate"
    hf = tok.kind == "huggingface"
    extra = {
        f"{s}.{kind}.bin": dtype for s in ("train", "val") for kind, dtype in (("mask", "uint8"), ("starts", "uint64"))
    }
    sources = [(path, None) for path in inputs] + [(path, "val") for path in val_inputs or ()]
    with DatasetWriter(out_dir, token_dtype(tok.vocab_size), extra) as ds:
        splits, seen, start = {"train": Split(ds, "train"), "val": Split(ds, "val")}, 0, time.time()
        for path, forced in sources:
            for where, position, row in read_rows(path):
                try:
                    ids, mask = chat_template.tokenize_conversation(tok, conversation(row))
                except (ValueError, chat_template.ChatError) as e:  # a ChatError is a ValueError too
                    raise InputError(f"{where}: {e}") from None
                split = forced or ("val" if not val_inputs and in_val(seed, path, position, val_fraction) else "train")
                splits[split].add(ids, mask, capacity, truncate)
                seen += 1
                if seen % 10_000 == 0:
                    print(f"\r{seen:,} conversations, {time.time() - start:.0f} s", end="", file=sys.stderr, flush=True)
        if seen >= 10_000:
            print(file=sys.stderr)
        for name, split in splits.items():
            if not split.conversations:
                raise InputError(
                    f"no conversation went to {name} (of {seen:,} read): "
                    + (
                        "raise --val_fraction, or give --val_input"
                        if name == "val"
                        else "give more conversations, or raise --block_size"
                    )
                )
        meta = {
            "kind": tok.kind,
            "vocab_size": tok.vocab_size,
            **({"chars": tok.chars} if tok.kind == "char" else {}),
            **({"sha256": tok.sha256, "tokenizer": "tokenizer.json"} if hf else {}),
            "chat": {
                "template": template,
                "block_size": block_size,
                "overlong": overlong,
                "conversations": {n: s.conversations for n, s in splits.items()},
                "tokens_to_learn": {n: s.learned for n, s in splits.items()},
                "dropped": {n: s.dropped for n, s in splits.items()},
                "truncated": {n: s.truncated for n, s in splits.items()},
            },
            "source": source or ", ".join(map(str, inputs)),
            "prepare": rerun,
        }
        ds.commit(meta, files=tok.files if hf else ())
    for name, split in splits.items():
        log(split.summary(name, capacity))
    return {
        name: {k: getattr(split, k) for k in ("conversations", "n_tokens", "learned", "dropped", "truncated")}
        for name, split in splits.items()
    }


def hub_files(repo_id, folder):
    """(train files, val files) of a Hugging Face dataset's folder: its test* .parquet files are val."""
    try:
        _, files = corpus.hub_shards(repo_id, folder)
    except InputError as e:  # its advice names text/prepare.py's option; this script calls it --input
        raise InputError(str(e).replace("--input_dir=", "--input=")) from None
    val = [f for f in files if f.name.startswith("test")]
    return [f for f in files if f not in val], val


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--input", help="a .jsonl, .jsonl.gz or .parquet file of conversations, or a folder of them")
    parser.add_argument("--hub", help="a Hugging Face dataset of conversations, e.g. HuggingFaceTB/smol-smoltalk")
    parser.add_argument("--hub_folder", default="data", help="the folder of its .parquet files")
    parser.add_argument("--out_dir", required=True, help="where the dataset goes, e.g. data/mychat")
    parser.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2, or the folder of the model's Hugging Face tokenizer (its chat template too)",
    )
    parser.add_argument("--val_input", help="conversations for val (else --val_fraction of --input's)")
    parser.add_argument("--val_fraction", type=float, default=0.02)
    parser.add_argument("--block_size", type=int, default=1024, help="the block_size of the runs it is for")
    parser.add_argument(
        "--overlong",
        choices=("drop", "truncate"),
        default="drop",
        help="what becomes of a conversation longer than block_size + 1 tokens",
    )
    parser.add_argument("--seed", type=int, default=1337, help="seeds the choice of val conversations")
    args = parser.parse_args(argv)
    if (args.input is None) == (args.hub is None):
        raise SystemExit("error: give --input=FILE_OR_FOLDER or --hub=DATASET (one of them)")
    if not 0 < args.val_fraction < 1 or args.block_size < 1:
        raise SystemExit("error: --val_fraction must be between 0 and 1 and --block_size >= 1")
    rerun = format_prepare_command(
        __file__,
        input=Path(args.input) if args.input else None,
        hub=args.hub,
        hub_folder=args.hub_folder if args.hub else None,
        out_dir=Path(args.out_dir),
        # "./" so that a folder named gpt2 is not read as GPT-2
        tokenizer=os.path.join(".", command_path(args.tokenizer)) if args.tokenizer != "gpt2" else None,
        val_input=Path(args.val_input) if args.val_input else None,
        val_fraction=args.val_fraction,
        block_size=args.block_size,
        overlong=args.overlong,
        seed=args.seed,
    )
    t0 = time.time()

    def run():
        if args.hub:
            train, val = hub_files(args.hub, args.hub_folder)
            source = corpus.hub_folder_url(args.hub, "main", args.hub_folder)
        else:
            train, source = find_files(args.input), args.input
            val = find_files(args.val_input) if args.val_input else None
        return prepare(
            train,
            args.out_dir,
            args.tokenizer,
            val or None,
            args.val_fraction,
            args.block_size,
            args.overlong,
            args.seed,
            source,
            rerun,
        )

    run_prepare_script(run, args.out_dir)
    print(f"done in {time.time() - t0:.1f}s -> {args.out_dir}")


if __name__ == "__main__":
    main()
