"""Plot a run's loss curves from its TensorBoard events: train and val loss vs tokens seen.

    python plot.py out-shakespeare-char                  # writes out-shakespeare-char/loss.png
    python plot.py out-a out-b --out=compare.png         # several runs on one chart
"""

import argparse
import json
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util


def read_scalars(out_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] for every scalar in the run's event files (a resumed run adds
    files; a step logged twice keeps one value)."""
    logdir = os.path.join(out_dir, "tensorboard")
    if not os.path.isdir(logdir):
        raise FileNotFoundError(f"{logdir} not found: train with --tensorboard=True first")
    events = EventAccumulator(logdir, size_guidance={"tensors": 0})  # 0 = keep every point
    events.Reload()
    series = {}
    for tag in events.Tags()["tensors"]:
        values = {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in events.Tensors(tag)}
        if all(v.dtype.kind == "f" for v in values.values()):  # scalars, not text samples
            series[tag] = sorted((step, float(v)) for step, v in values.items())
    return series


def tokens_per_step(out_dir: str) -> int:
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    return config["batch_size"] * config["gradient_accumulation_steps"] * config["block_size"]


def plot(out_dirs: list[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for out_dir in out_dirs:
        series, tokens = read_scalars(out_dir), tokens_per_step(out_dir)
        name = os.path.basename(os.path.normpath(out_dir))
        for tag, label, style in (("train/loss", "train", "-"), ("eval/val_loss", "val", "o-")):
            if series.get(tag):
                steps, values = zip(*series[tag])
                ax.plot([s * tokens for s in steps], values, style, markersize=3,
                        linewidth=1, label=f"{name} {label}")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", help="training output directories")
    parser.add_argument("--out", help="PNG file to write (default: <first out_dir>/loss.png)")
    args = parser.parse_args(argv)
    path = args.out or os.path.join(args.out_dirs[0], "loss.png")
    try:
        plot(args.out_dirs, path)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
