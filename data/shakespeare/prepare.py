"""Shakespeare in GPT-2 BPE tokens: writes train.bin, val.bin (uint16) and meta.json.

    python data/shakespeare/prepare.py [--input=FILE] [--out_dir=DIR]

The whole text is one document (no <|endoftext|>); the first 90% of the tokens are
train, the rest val. See data/shakespeare_text.py for where the text comes from.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: data/ and its tokenizer and writer
from data.shakespeare_text import text_to_prepare  # noqa: E402
from data.tokenizer import GPT2_VOCAB_SIZE, gpt2_encoding  # noqa: E402
from data.writer import run_prepare_script, write_dataset  # noqa: E402


def prepare(text, out_dir, val_fraction=0.1, source=None, command=None):
    """Tokenizes text with GPT-2 BPE into out_dir. Returns a summary dict."""
    ids = gpt2_encoding().encode_ordinary(text)
    n_train = int(len(ids) * (1 - val_fraction))
    meta = {"kind": "gpt2", "vocab_size": GPT2_VOCAB_SIZE}
    if source:
        meta["source"] = source
    if command:  # how to make it again, for "rerun ..." hints
        meta["prepare"] = command
    write_dataset(out_dir, ids[:n_train], ids[n_train:], meta)
    return {
        "chars": len(text),
        "vocab_size": GPT2_VOCAB_SIZE,
        "train_tokens": n_train,
        "val_tokens": len(ids) - n_train,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--input", help="a local text file to use instead of Shakespeare")
    parser.add_argument("--out_dir", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    t0 = time.time()

    def run():
        text, source, command = text_to_prepare(__file__, args.input, args.out_dir)
        return prepare(text, args.out_dir, source=source, command=command)

    s = run_prepare_script(run, args.out_dir)
    print(f"{s['chars']:,} characters -> {s['train_tokens'] + s['val_tokens']:,} GPT-2 tokens")
    print(f"train: {s['train_tokens']:,} tokens, val: {s['val_tokens']:,} tokens -> {args.out_dir}")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
