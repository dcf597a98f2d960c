"""FineWeb-Edu in tokens: downloads a sample of HuggingFaceFW/fineweb-edu (parquet shards) and
writes train.bin, val.bin and meta.json, about 10B GPT-2 tokens for the 10BT sample.

    python data/fineweb/prepare.py [--sample=10BT|100BT|350BT] [--max_shards=N] \\
        [--out_dir=data/fineweb_edu_10bt] [--tokenizer=gpt2|TOKENIZER_DIR] [--num_proc=N] \\
        [--input_dir=FOLDER] [--cache_dir=DIR] [--offline]

The shards are the files sample/<sample>/*.parquet of the dataset repo, in sorted order
(--max_shards=N: the first N, for a partial run). They are downloaded with huggingface_hub
into the Hugging Face cache (~/.cache/huggingface/hub, or --cache_dir), not streamed with
the `datasets` library: no dependency beyond huggingface_hub (already there for
--init_from); a shard is a file in the cache, downloaded once and, after an interruption,
resumed file by file (a stream starts again from its beginning); processes read shards
side by side; and the same code reads a local folder of the same files offline.

--input_dir=FOLDER: the .parquet (or .jsonl ...) files of FOLDER instead; nothing is
downloaded. Without the network (or with --offline) the cached shards are used; without
them, one message says what to download where.

Everything after the download (formats, the val split, pieces, resuming after Ctrl-C,
bounded memory, --skip_bad_files) is data/text/prepare.py's; see its docstring. Then:
    python train.py config/gpt2_124m.py --dataset=fineweb_edu_10bt
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: data/ and its tokenizer and writer
from data import corpus  # noqa: E402
from data.text import prepare as text_prepare  # noqa: E402

REPO_ID = "HuggingFaceFW/fineweb-edu"
SAMPLES = ("10BT", "100BT", "350BT")
DATA = Path(__file__).resolve().parents[1]  # data/: train.py's --dataset=NAME reads data/NAME


def shards(sample, max_shards=None, input_dir=None, cache_dir=None, local_files_only=False):
    """(root, files, source): the shards to tokenize, the folder their names are relative to,
    and where they came from (for meta.json)."""
    if input_dir is not None:
        return Path(input_dir), corpus.find_files(input_dir, max_shards), str(input_dir)
    folder = f"sample/{sample}"
    snapshot, files = corpus.hub_shards(REPO_ID, folder, "main", max_shards, cache_dir, local_files_only)
    return snapshot / folder, files, f"{corpus.hub_folder_url(REPO_ID, snapshot.name, folder)}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sample", default="10BT", choices=SAMPLES, help="which sample/ folder of the dataset")
    parser.add_argument("--max_shards", type=int, help="only the first N shards (a partial run)")
    parser.add_argument("--input_dir", help="a folder with the shards already: nothing is downloaded")
    parser.add_argument("--cache_dir", help="the Hugging Face cache (default ~/.cache/huggingface/hub)")
    parser.add_argument("--offline", action="store_true", help="use the cached shards only")
    text_prepare.add_common_options(parser, out_dir_required=False)
    args = parser.parse_args(argv)
    text_prepare.check_common_options(args)
    if args.max_shards is not None and args.max_shards < 1:
        raise SystemExit(f"error: --max_shards must be at least 1, got {args.max_shards}")
    out_dir = args.out_dir or DATA / f"fineweb_edu_{args.sample.lower()}"
    text_prepare.prepare_shards(
        __file__,
        args,
        out_dir,
        lambda: shards(args.sample, args.max_shards, args.input_dir, args.cache_dir, args.offline),
        sample=args.sample,
        max_shards=args.max_shards,
        input_dir=Path(args.input_dir) if args.input_dir else None,
    )


if __name__ == "__main__":
    main()
