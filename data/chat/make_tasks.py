"""An offline chat set a tiny model learns on a CPU in under half a minute: conversations of one to
three turns where the user asks for a three-letter word in capitals or two digits added, and a
tokenizer for it (bytes, plus ChatML's <|im_start|> and <|im_end|>, with a ChatML chat template).

    python data/chat/make_tasks.py [--out_dir=data/chat/tasks] [--conversations=6000] [--seed=0]
    python data/chat/prepare.py --input=data/chat/tasks/train.jsonl --val_input=data/chat/tasks/val.jsonl \\
        --tokenizer=data/chat/tasks/tokenizer --block_size=128 --out_dir=data/chat_tasks

writes OUT_DIR/train.jsonl and OUT_DIR/val.jsonl (OpenAI's {"messages": [...]}, one conversation
a line) and OUT_DIR/tokenizer/ (tokenizer.json, tokenizer_config.json). val is held out: no word
it asks to capitalize is asked in train, so those answers can't be remembered, only worked out (its
sums of two digits are the same 100 as train's: they are learned as facts).
"""

import argparse
import json
import os
import random
import string
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: data/writer.py
from data.writer import PrepareError, run_prepare_script  # noqa: E402

SPECIALS = ("<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = "Be exact."
LETTERS = string.ascii_lowercase


def byte_tokenizer() -> Tokenizer:
    """One token per byte (no merges), then the two special tokens: 258 tokens that spell any text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def write_tokenizer(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": CHATML,
        "model_max_length": 1024,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")


def question(rng: random.Random) -> tuple[str, str]:
    """(question, answer): a word of three letters to capitalize, or two digits to add."""
    if rng.random() < 0.5:
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        return f"upper {word}", word.upper()
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}", str(a + b)


def conversations(n: int, rng: random.Random, seen: set, new: set | None = None) -> list[dict]:
    """n conversations of 1 to 3 turns, each question added to seen; with `new`, none of whose
    words to capitalize is in `new` (the held-out conversations' words)."""
    result = []
    while len(result) < n:
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.2 else []
        for _ in range(rng.randint(1, 3)):
            text, answer = question(rng)
            while new is not None and text in new and text.startswith("upper"):
                text, answer = question(rng)
            seen.add(text)
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        result.append({"messages": messages})
    return result


def write_jsonl(path: Path, rows: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)


def make(out_dir, n_conversations=6000, val_conversations=200, seed=0) -> None:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out_dir {out_dir} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    rng, held_out = random.Random(seed), set()
    val = conversations(val_conversations, rng, held_out)
    train = conversations(n_conversations, rng, set(), new=held_out)
    write_tokenizer(out / "tokenizer")
    write_jsonl(out / "val.jsonl", val)
    write_jsonl(out / "train.jsonl", train)
    print(
        f"{len(train):,} train and {len(val):,} held-out conversations, and a {byte_tokenizer().get_vocab_size()}"
        f"-token tokenizer with a ChatML template -> {out_dir}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out_dir", default="data/chat/tasks")
    parser.add_argument("--conversations", type=int, default=6000, help="train conversations")
    parser.add_argument("--val_conversations", type=int, default=200, help="held-out conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run_prepare_script(lambda: make(args.out_dir, args.conversations, args.val_conversations, args.seed), args.out_dir)


if __name__ == "__main__":
    main()
