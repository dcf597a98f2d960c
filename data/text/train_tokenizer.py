"""A byte-level BPE tokenizer of --vocab_size tokens (GPT-2's kind: the 256 bytes, merges learned from
the text, GPT-2's split into words and numbers first, and <|endoftext|> between documents), learned from
the first --max_bytes of a corpus and written as a Hugging Face tokenizer folder that
data/text/prepare.py and data/fineweb/prepare.py take with --tokenizer=OUT_DIR.

    python data/text/train_tokenizer.py --input_dir=DIR --out_dir=data/tokenizer_32k \\
        [--vocab_size=32768] [--max_bytes=1000000000] [--text_key=text]

DIR's documents are read as data/text/prepare.py reads them (data/corpus.py: .txt, .jsonl[.gz|.zst],
.parquet, in file order). For FineWeb-Edu, DIR is the folder of its downloaded shards, e.g. the
snapshot's sample/10BT/ in the Hugging Face cache. The `tokenizers` library does the learning, on all
cores; 1 GB of text takes a few minutes and a few GB of memory.
"""

import argparse
import json
import sys
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: data/
from data import corpus  # noqa: E402
from data.tokenizer import EOT_TEXT  # noqa: E402


def documents(input_dir, text_key: str, max_bytes: int):
    """The corpus's documents in file order, until max_bytes of text (UTF-8) have been given."""
    root, given = Path(input_dir), 0
    pieces, _ = corpus.plan_pieces(corpus.find_files(root), root, text_key, 64 << 20)
    for segment in (seg for piece in pieces for seg in piece):
        for docs, _ in corpus.read_segment(segment, text_key):
            for _, text in docs:
                yield text
                given += len(text.encode("utf-8"))
                if given >= max_bytes:
                    return


def train_tokenizer(texts, vocab_size: int) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split, bytes as characters
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen or not: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save(tok: tokenizers.Tokenizer, out_dir) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT_TEXT, "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--input_dir", required=True, help="a folder of .txt, .jsonl[.gz|.zst] or .parquet files")
    parser.add_argument("--out_dir", required=True, help="where tokenizer.json and tokenizer_config.json go")
    parser.add_argument("--vocab_size", type=int, default=32768, help="tokens, <|endoftext|> and the 256 bytes in")
    parser.add_argument("--max_bytes", type=int, default=10**9, help="learn from this much text at most")
    parser.add_argument("--text_key", default="text", help="the text's field in .jsonl and .parquet files")
    args = parser.parse_args(argv)
    if args.vocab_size < 257 + 1 or args.max_bytes < 1:
        raise SystemExit(
            "error: --vocab_size must be at least 258 (the 256 bytes, <|endoftext|>, one merge) and --max_bytes >= 1"
        )
    try:
        tok = train_tokenizer(documents(args.input_dir, args.text_key, args.max_bytes), args.vocab_size)
    except corpus.InputError as e:
        raise SystemExit(f"error: {e}") from None
    save(tok, args.out_dir)
    print(f"{args.out_dir}: {tok.get_vocab_size():,} tokens (<|endoftext|> = {tok.token_to_id(EOT_TEXT)})")


if __name__ == "__main__":
    main()
