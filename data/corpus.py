"""The documents of a corpus: local files read a bounded batch at a time, and Hugging Face
dataset shards downloaded into the Hugging Face cache to be read the same way.

Formats, one document each:
    .txt         the whole file (read whole: a document is tokenized in one go)
    .jsonl       every non-blank line, a JSON object with the text in field `text_key`
    .jsonl.gz    the same, gzip-compressed (the standard library's gzip)
    .jsonl.zst   the same, zstd-compressed (pyarrow's codec, so no extra dependency)
    .parquet     every row of the column `text_key`
Files are UTF-8; a byte order mark at the start of one is not text.

A corpus is cut into pieces that one process reads alone (data/text/prepare.py makes each
piece's tokens once and keeps them, so a piece is also what an interrupted run resumes
by). A piece is a run of segments of about piece_bytes: a segment is a byte range of a
.jsonl, a run of row groups of a .parquet (its metadata knows their sizes, cheaply), or a
whole .txt or compressed .jsonl (a compressed stream cannot be entered in the middle).
Small files share a piece; a big one is several.

Every document has a position in its file that does not depend on that cut: its row in a
.parquet, the byte offset of its line in a (decompressed) .jsonl, 0 for a .txt.
"""

import gzip
import io
import json
import os
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import HfApi
from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from data.writer import PrepareError

FORMATS = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
BOM = b"\xef\xbb\xbf"  # some editors start UTF-8 files with it; it is not text
BATCH_DOCS = 512  # documents in memory at a time per reader, at most ...
BATCH_BYTES = 1 << 20  # ... and about this much text (one document may be bigger)
READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)  # a truncated or corrupt file


class InputError(PrepareError):
    """Something wrong with the user's files or options; ends the script with one line."""


class BadFile(InputError):
    """A file that is not what its name says (truncated, corrupt, not UTF-8, malformed JSON):
    --skip_bad_files leaves its piece out instead of stopping."""


def use_system_allocator():
    """pyarrow's default allocator (mimalloc) keeps some 40 MB of freed pages in a process that
    reads parquet; the system allocator gives them back, so memory stays flat from the start."""
    pa.set_memory_pool(pa.system_memory_pool())


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def format_of(path) -> str | None:
    name = Path(path).name
    return next((ext[1:] for ext in FORMATS if name.endswith(ext)), None)


def find_files(input_dir, max_files=None):
    """The corpus files under input_dir, recursively, sorted by their relative path."""
    root = Path(input_dir)
    if not root.exists():
        raise InputError(f"input directory {input_dir} does not exist")
    if not root.is_dir():
        raise InputError(f"--input_dir {input_dir} is a file, not a folder")
    files = sorted(
        (p for p in root.rglob("*") if format_of(p) and p.is_file()), key=lambda p: p.relative_to(root).as_posix()
    )
    if not files:
        raise InputError(f"no {', '.join(FORMATS[:-1])} or {FORMATS[-1]} files under {input_dir}")
    return files[:max_files]


@dataclass(frozen=True)
class Segment:
    """Part of one file, read from start to end by one process."""

    path: str  # as opened
    name: str  # relative to the input folder, POSIX: what the val draw hashes
    format: str  # "txt", "jsonl", "jsonl.gz", "jsonl.zst" or "parquet"
    start: int  # .jsonl: bytes [start, stop); .parquet: row groups [start, stop); else 0, 1
    stop: int
    size: int  # input bytes it stands for, for the progress line
    first_row: int  # .parquet: the file's row number of row group `start`
    stamp: tuple  # (file size, mtime in ns): a file that changed is read again
    whole: bool  # the segment is all of its file

    def key(self):
        return [self.name, self.format, self.start, self.stop, *self.stamp]

    def left_out(self, why) -> str:
        """A message for leaving this segment out because of why (which names the file)."""
        if self.whole:
            return why
        unit = "row groups" if self.format == "parquet" else "bytes"
        last = self.stop - 1 if self.format == "parquet" else self.stop
        return f"{why}; left out its {unit} {self.start:,} to {last:,}"


def parquet_metadata(path, text_key):
    """path's parquet metadata, checked to hold text in column text_key. Raises BadFile for a
    file pyarrow cannot read (a truncated download), InputError for a missing column."""
    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except READ_ERRORS as e:
        raise BadFile(
            f"{path}: not a readable parquet file ({first_line(e)}): "
            "a truncated download? delete it and download it again"
        ) from None
    if text_key not in schema.names:
        raise InputError(
            f"{path} has no column {text_key!r}; its columns: {', '.join(schema.names)} (choose one with --text_key)"
        )
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise InputError(f"{path}: column {text_key!r} holds {kind}, not text (choose another with --text_key)")
    return meta


def file_segments(path, name, text_key, piece_bytes):
    """The segments of one file, each about piece_bytes or less where the format can be cut."""
    st = os.stat(path)
    fmt, stamp = format_of(path), (st.st_size, st.st_mtime_ns)
    if fmt == "jsonl":
        starts = range(0, st.st_size, piece_bytes)
        return [
            Segment(
                str(path),
                name,
                fmt,
                a,
                min(a + piece_bytes, st.st_size),
                min(piece_bytes, st.st_size - a),
                0,
                stamp,
                len(starts) == 1,
            )
            for a in starts
        ]
    if fmt != "parquet":
        return [Segment(str(path), name, fmt, 0, 1, st.st_size, 0, stamp, True)]
    meta = parquet_metadata(path, text_key)
    segments, start, row, size = [], 0, 0, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if size >= piece_bytes or g == meta.num_row_groups - 1:
            segments.append(
                Segment(
                    str(path), name, fmt, start, g + 1, size, row, stamp, start == 0 and g == meta.num_row_groups - 1
                )
            )
            row += sum(meta.row_group(i).num_rows for i in range(start, g + 1))
            start, size = g + 1, 0
    return segments


def plan_pieces(files, root, text_key, piece_bytes, skip_bad=False):
    """(pieces, bad): the files cut into pieces (lists of segments, in file order), and a
    message for each unreadable file left out when skip_bad (else BadFile is raised)."""
    pieces, bad, current, size = [], [], [], 0
    for path in files:
        try:
            segments = file_segments(path, Path(path).relative_to(root).as_posix(), text_key, piece_bytes)
        except BadFile as e:
            if not skip_bad:
                raise
            bad.append(str(e))
            continue
        for seg in segments:
            if current and size + seg.size > piece_bytes:
                pieces.append(current)
                current, size = [], 0
            current.append(seg)
            size += seg.size
    if current:
        pieces.append(current)
    return pieces, bad


# ---- reading a segment: batches of (position, text)


def read_segment(seg, text_key):
    """Yields (docs, done): docs a list of (position, text), done the input bytes of seg read
    so far (seg.size at the end). Raises BadFile naming the file (and line or row)."""
    try:
        if seg.format == "parquet":
            yield from _parquet_batches(seg, text_key)
        elif seg.format == "txt":
            yield [(0, _utf8(_read_txt(seg.path), seg.path))], seg.size
        else:
            yield from _jsonl_batches(seg, text_key)
    except READ_ERRORS as e:
        if isinstance(e, FileNotFoundError | PermissionError):  # the user's to fix, not a bad file
            raise
        raise BadFile(
            f"{seg.path}: cannot be read to the end ({first_line(e)}): a truncated or corrupt file? get it again"
        ) from None


def _read_txt(path):
    with open(path, "rb") as f:
        return f.read().removeprefix(BOM)


def _utf8(raw: bytes, where) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _parquet_batches(seg, text_key):
    # buffer_size streams a column chunk page by page instead of reading it whole;
    # use_threads=False: each process is one of --num_proc, not a thread pool of its own.
    pf = pq.ParquetFile(seg.path, buffer_size=1 << 20, pre_buffer=False)
    rows = sum(pf.metadata.row_group(g).num_rows for g in range(seg.start, seg.stop))
    row = seg.first_row
    for batch in pf.iter_batches(
        batch_size=BATCH_DOCS, row_groups=range(seg.start, seg.stop), columns=[text_key], use_threads=False
    ):
        texts = batch.column(0).to_pylist()
        if None in texts:
            raise BadFile(f"{seg.path}, row {row + texts.index(None)}: {text_key!r} is null, not text")
        yield list(enumerate(texts, row)), seg.size * (row + len(texts) - seg.first_row) // max(rows, 1)
        row += len(texts)


def _open_lines(seg):
    """(binary line reader, raw file) for a .jsonl segment; raw.tell() is the input read."""
    raw = open(seg.path, "rb")
    if seg.format == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw), raw
    if seg.format == "jsonl.zst":
        return io.BufferedReader(pa.CompressedInputStream(raw, "zstd"), 1 << 20), raw
    raw.seek(max(seg.start - 1, 0))
    if seg.start > 0:  # a line belongs to the segment it starts in: finish the one before
        raw.readline()
    return raw, raw


def _jsonl_batches(seg, text_key):
    lines, raw = _open_lines(seg)
    ranged = seg.format == "jsonl"  # else the whole (compressed) file
    with raw, lines:
        offset = raw.tell() if ranged else 0  # of the next line, in the decompressed text
        lineno = 1 if offset == 0 else None  # counted only when an error needs it
        batch, size = [], 0
        while not ranged or offset < seg.stop:
            line = lines.readline()
            if not line:
                break
            text = line.removeprefix(BOM) if offset == 0 else line
            if text.strip():
                batch.append((offset, _parse_record(text, text_key, (seg.path, offset, lineno))))
                size += len(line)
            offset += len(line)
            lineno = lineno and lineno + 1
            if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
                yield batch, min(offset - seg.start if ranged else raw.tell(), seg.size)
                batch, size = [], 0
        yield batch, seg.size


def _where(path, offset, lineno):
    """FILE:LINE for a message; a line number not counted yet is counted now."""
    if lineno is None:
        with open(path, "rb") as f:
            lineno = 1 + sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(min(1 << 20, offset - f.tell())), b""))
    return f"{path}:{lineno}"


def parse_json_line(line: bytes, where):
    """The JSON value on one line of a .jsonl file; BadFile naming where() (FILE:LINE) if it is not
    UTF-8 or not JSON. `where` is called only then: counting lines can cost a read of the file."""
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadFile(f"{where()}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BadFile(f"{where()}: malformed JSON ({e.msg}, column {e.colno})") from None


def _parse_record(line: bytes, text_key, at) -> str:
    record = parse_json_line(line, lambda: _where(*at))
    if not isinstance(record, dict) or text_key not in record:
        raise InputError(f"{_where(*at)}: no {text_key!r} field (choose another with --text_key)")
    text = record[text_key]
    if not isinstance(text, str):
        raise BadFile(f"{_where(*at)}: field {text_key!r} is {type(text).__name__}, not a string")
    return text


# ---- Hugging Face dataset shards


def hub_folder_url(repo_id, revision, folder):
    return f"https://huggingface.co/datasets/{repo_id}/tree/{quote(revision, safe='')}/{folder}"


def hub_reachable(timeout=5.0) -> bool:
    """Whether a connection to the Hub (or the mirror HF_ENDPOINT names) opens at all."""
    url = urlparse(hf_constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_shards(repo_id, folder, revision="main", max_shards=None, cache_dir=None, local_files_only=False):
    """(snapshot folder, files): the .parquet files in `folder` of the Hub dataset repo_id at
    revision, sorted, the first max_shards of them if given, downloaded into the Hugging Face
    cache (cache_dir, default ~/.cache/huggingface/hub) unless they are there already.

    Files go one by one into the cache, so a download that stops resumes where it stopped.
    Without the network (or with local_files_only, or HF_HUB_OFFLINE=1) the cached copy is
    used; without one, InputError says what to download where."""
    folder, cache = folder.strip("/"), cache_dir or hf_constants.HF_HUB_CACHE
    url = hub_folder_url(repo_id, revision, folder)
    why = "offline mode"
    if not local_files_only and not hub_reachable():  # else huggingface_hub retries for ~25 s, loudly
        local_files_only, why = True, f"{urlparse(hf_constants.ENDPOINT).hostname} is unreachable"
    if not local_files_only:
        try:
            names = sorted(
                f.path
                for f in HfApi().list_repo_tree(repo_id, path_in_repo=folder, revision=revision, repo_type="dataset")
                if f.path.endswith(".parquet")
            )
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
            raise InputError(
                f"{url} not found ({type(e).__name__}): see the dataset's files at "
                f"{hub_folder_url(repo_id, revision, '')}"
            ) from None
        except OfflineModeIsEnabled:
            why = "HF_HUB_OFFLINE is set"
        except Exception as e:  # no network, the Hub down, ...: the cache may have it
            why = f"{type(e).__name__}: {first_line(e)}"
        else:
            if not names:
                raise InputError(f"no .parquet files in {url}: check the dataset's files on the Hub")
            names = names[:max_shards]
            print(f"downloading {len(names)} files of {url} into {cache} (kept there; a rerun resumes)")
            try:
                path = Path(
                    snapshot_download(
                        repo_id, repo_type="dataset", revision=revision, allow_patterns=names, cache_dir=cache_dir
                    )
                )
            except Exception as e:
                raise InputError(
                    f"download from {url} stopped ({type(e).__name__}: {first_line(e)}): run the same "
                    f"command again to resume it, or pass --input_dir=FOLDER with its .parquet files"
                ) from None
            return path, [path / name for name in names]
    return cached_shards(repo_id, folder, revision, max_shards, cache_dir, why)


def cached_shards(repo_id, folder, revision, max_shards, cache_dir, why):
    """hub_shards from the Hugging Face cache alone."""
    cache, url = cache_dir or hf_constants.HF_HUB_CACHE, hub_folder_url(repo_id, revision, folder)
    missing = None
    try:
        path = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=[f"{folder}/*.parquet"],
            local_files_only=True,
        )
    except IncompleteSnapshotError as e:  # the cache knows the full list, and has only part of it
        path, missing = e.snapshot_path, first_line(e)
    except (LocalEntryNotFoundError, OSError, ValueError):
        path = None
    files = sorted((Path(path) / folder).glob("*.parquet")) if path else []
    if not files:
        raise InputError(
            f"cannot reach the Hugging Face Hub ({why}) and the cache {cache} has no copy of {url}: "
            f"download its .parquet files into a folder and pass --input_dir=FOLDER, or run again "
            f"where huggingface.co is reachable"
        )
    if len(files) < (max_shards or 0) or (missing and max_shards is None):
        raise InputError(
            f"cannot reach the Hugging Face Hub ({why}) and the cache {cache} holds {len(files)} of the "
            f".parquet files of {url}: run again where huggingface.co is reachable, pass "
            f"--max_shards={len(files)}, or --input_dir=FOLDER with all of them"
        )
    print(f"offline ({why}): using the {len(files[:max_shards])} files of {url} in {cache}")
    return Path(path), files[:max_shards]
