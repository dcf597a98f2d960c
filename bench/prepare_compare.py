"""Data preparation side by side: data/text/prepare.py against build-nanogpt's fineweb.py
approach, on the same local corpus. A benchmark, not a test (minutes, hundreds of MB).

    python bench/prepare_compare.py [--mb=300] [--num_proc=2] [--repeat=2] [--work=/tmp/prepare_compare]

The other approach, rewritten here from its description (not copied): the main process
reads the documents and hands them to multiprocessing.Pool(nprocs).imap(tokenize, docs,
chunksize=16); tokenize puts <|endoftext|> in front of a document's GPT-2 encode_ordinary
ids and returns them as a uint16 array; the main process copies them into a 100M-token
buffer and writes full buffers as .npy shards, the first one named val. Its own default
is nprocs = os.cpu_count() // 2; it runs here with that and with --num_proc.

No network here, so the corpus is made from data/shakespeare's text (data/shakespeare_text.py
says where it comes from): paragraphs shuffled into documents of web-page lengths (log-normal,
median 2.5 KB, like FineWeb's pages), written as .parquet shards (row groups of 1,000
documents) and the same documents as .jsonl shards.

Reported per run: input MB/s (MB of document text over wall time, start-up included),
tokens/s, the CPU time of all its processes (user + system: what it costs, little changed
by other work on the machine, unlike wall time), and peak memory: the most the process
and its pool workers held at once (proportional set size summed over the process tree,
sampled every 0.2 s). The runs take turns --repeat times and the fastest of each counts
(other work only ever slows a run down); the load average before and after says how quiet
the machine was.
"""

import argparse
import json
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # data/: the tokenizer and the Shakespeare text
from data.shakespeare_text import load_shakespeare_text  # noqa: E402
from data.tokenizer import GPT2_EOT, gpt2_encoding  # noqa: E402

SHARD_TOKENS = 100_000_000  # build-nanogpt's shard size
DOCS_PER_ROW_GROUP = 1000


# ---- the corpus


def make_corpus(work: Path, mb: int, shards=4, seed=0):
    """work/parquet/*.parquet and work/jsonl/*.jsonl with the same documents. Returns
    (documents, bytes of text). Made once; a later run with the same --mb reuses it."""
    stamp = work / f"corpus-{mb}mb.json"
    if stamp.is_file():
        return tuple(json.loads(stamp.read_text()))
    for sub in ("parquet", "jsonl"):
        shutil.rmtree(work / sub, ignore_errors=True)
        (work / sub).mkdir(parents=True)
    text, _ = load_shakespeare_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    target, per_shard = mb * 10**6, mb * 10**6 // shards
    n_docs = n_bytes = 0
    for shard in range(shards):
        docs, size = [], 0
        while size < per_shard:
            length = min(max(int(rng.lognormvariate(np.log(2500), 1.0)), 200), 100_000)
            parts, n = [], 0
            while n < length:
                parts.append(rng.choice(paragraphs))
                n += len(parts[-1]) + 2
            doc = "\n\n".join(parts)
            docs.append(doc)
            size += len(doc.encode())
        pq.write_table(
            pa.table({"text": docs}), work / "parquet" / f"{shard:03d}.parquet", row_group_size=DOCS_PER_ROW_GROUP
        )
        with open(work / "jsonl" / f"{shard:03d}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        n_docs, n_bytes = n_docs + len(docs), n_bytes + size
    print(f"corpus: {n_docs:,} documents, {n_bytes / 1e6:,.0f} MB of text (target {target / 1e6:,.0f} MB), in {work}")
    stamp.write_text(json.dumps([n_docs, n_bytes]))
    return n_docs, n_bytes


# ---- build-nanogpt's approach, rewritten


def nanogpt_tokenize(text):
    ids = [GPT2_EOT]  # build-nanogpt puts the end token in front of each document
    ids.extend(gpt2_encoding().encode_ordinary(text))
    a = np.array(ids)
    assert (0 <= a).all() and (a < 2**16).all(), "token ids must fit uint16"
    return a.astype(np.uint16)


def parquet_texts(folder):
    for path in sorted(Path(folder).glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
            yield from batch.column(0).to_pylist()


def run_nanogpt(folder, out_dir, nprocs):
    """build-nanogpt's fineweb.py loop on the .parquet shards of folder. Returns tokens written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpt2_encoding()  # built before the fork, as tiktoken.get_encoding at import would be
    total, shard, count = 0, 0, 0
    buffer = np.empty((SHARD_TOKENS,), dtype=np.uint16)
    with multiprocessing.Pool(nprocs) as pool:
        for ids in pool.imap(nanogpt_tokenize, parquet_texts(folder), chunksize=16):
            while len(ids):  # a document that does not fit ends this shard and starts the next
                take = min(len(ids), SHARD_TOKENS - count)
                buffer[count : count + take] = ids[:take]
                count, ids = count + take, ids[take:]
                if count == SHARD_TOKENS:
                    np.save(out_dir / f"shard_{'val' if shard == 0 else 'train'}_{shard:06d}", buffer)
                    shard, total, count = shard + 1, total + count, 0
        if count:
            np.save(out_dir / f"shard_{'val' if shard == 0 else 'train'}_{shard:06d}", buffer[:count])
            total += count
    return total


# ---- measuring a run


def tree_pss(root_pid):
    """Memory of root_pid and all its descendants now: the sum of their proportional set sizes
    (a page that n processes share counts 1/n in each: forked workers share the parent's)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [child for child, parent in parents.items() if parent == pid and child not in tree]
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            pass  # gone meanwhile
    return total


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # of every waited-for descendant
    return usage.ru_utime + usage.ru_stime


def measure(cmd):
    """(seconds, CPU seconds, peak memory of the process tree in bytes) of running cmd to the end."""
    t0, cpu0 = time.time(), children_cpu()
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_pss(child.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = child.communicate()[0]
    seconds, cpu = time.time() - t0, children_cpu() - cpu0
    done.set()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"error: {' '.join(map(str, cmd))} failed:\n{output[-2000:]}")
    return seconds, cpu, peak[0]


def main():
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--mb", type=int, default=300, help="MB of document text in the corpus")
    parser.add_argument("--num_proc", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=2, help="rounds of all runs; the fastest of each counts")
    parser.add_argument("--work", default="/tmp/prepare_compare", help="corpus and outputs go here")
    parser.add_argument("--nanogpt", nargs=3, metavar=("FOLDER", "OUT", "NPROCS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nanogpt:  # one measured run of the other approach, in a process of its own
        folder, out, nprocs = args.nanogpt
        print(run_nanogpt(folder, out, int(nprocs)))
        return

    work = Path(args.work)
    n_docs, n_bytes = make_corpus(work, args.mb)
    prepare = [sys.executable, "data/text/prepare.py", "--val_fraction=0.0005"]
    own_default = max(1, (os.cpu_count() or 1) // 2)
    runs = [
        (
            f"data/text/prepare.py, parquet, --num_proc={args.num_proc}",
            prepare
            + [f"--input_dir={work / 'parquet'}", f"--out_dir={work / 'out_parquet'}", f"--num_proc={args.num_proc}"],
            work / "out_parquet",
        ),
        (
            f"data/text/prepare.py, jsonl, --num_proc={args.num_proc}",
            prepare
            + [f"--input_dir={work / 'jsonl'}", f"--out_dir={work / 'out_jsonl'}", f"--num_proc={args.num_proc}"],
            work / "out_jsonl",
        ),
        (
            "data/text/prepare.py, parquet, --num_proc=1",
            prepare + [f"--input_dir={work / 'parquet'}", f"--out_dir={work / 'out_parquet1'}", "--num_proc=1"],
            work / "out_parquet1",
        ),
        (
            f"build-nanogpt approach, parquet, nprocs={args.num_proc}",
            [
                sys.executable,
                __file__,
                "--nanogpt",
                str(work / "parquet"),
                str(work / "out_nanogpt"),
                str(args.num_proc),
            ],
            work / "out_nanogpt",
        ),
    ]
    if own_default != args.num_proc:
        runs.append(
            (
                f"build-nanogpt approach, parquet, nprocs={own_default} (its default here)",
                [
                    sys.executable,
                    __file__,
                    "--nanogpt",
                    str(work / "parquet"),
                    str(work / "out_nanogpt1"),
                    str(own_default),
                ],
                work / "out_nanogpt1",
            )
        )
    print(
        f"{os.cpu_count()} CPU cores; {n_docs:,} documents, {n_bytes / 1e6:,.0f} MB of text; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    best = {}  # name -> (seconds, CPU seconds, tokens, peak)
    for _ in range(args.repeat):
        for name, cmd, out in runs:
            shutil.rmtree(out, ignore_errors=True)
            seconds, cpu, peak = measure(cmd)
            tokens = sum(
                np.load(p, mmap_mode="r").size if p.suffix == ".npy" else p.stat().st_size // 2
                for p in out.iterdir()
                if p.suffix in (".bin", ".npy")
            )
            shutil.rmtree(out, ignore_errors=True)
            old = best.get(name, (float("inf"), float("inf"), 0, 0))
            best[name] = (min(old[0], seconds), min(old[1], cpu), tokens, max(old[3], peak))
            print(f"  {name}: {seconds:.1f} s, {cpu:.1f} CPU s", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print(
        "| run | seconds | input MB/s | tokens/s | CPU seconds | MB per CPU second | peak memory (PSS, all processes) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (seconds, cpu, tokens, peak) in best.items():
        print(
            f"| {name} | {seconds:.1f} | {n_bytes / 1e6 / seconds:.1f} | {tokens / seconds / 1e6:.2f}M | {cpu:.1f} "
            f"| {n_bytes / 1e6 / cpu:.1f} | {peak / 2**20:,.0f} MB |"
        )


if __name__ == "__main__":
    main()
