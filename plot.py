"""Plot a run's curves from its TensorBoard events: train and val loss vs tokens seen, and
beside them the accuracy of its eval_tasks (e.g. HellaSwag acc_norm) where it has any.

    python plot.py out-shakespeare-char                  # writes out-shakespeare-char/loss.png
    python plot.py out-a out-b --out=compare.png         # several runs on one chart
    python plot.py --decode bench.jsonl --out=decode.png  # bench.py --mode=decode: latency vs throughput
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

    runs = [(os.path.basename(os.path.normpath(d)), read_scalars(d), tokens_per_step(d)) for d in out_dirs]
    task_tags = sorted({tag for _, series, _ in runs for tag in series if tag.endswith("_acc_norm")})
    fig, axes = plt.subplots(1, 2 if task_tags else 1, figsize=(14 if task_tags else 8, 5), dpi=120, squeeze=False)
    loss_ax = axes[0, 0]
    for name, series, tokens in runs:
        for tag, label, style in (("train/loss", "train", "-"), ("eval/val_loss", "val", "o-")):
            if series.get(tag):
                steps, values = zip(*series[tag])
                loss_ax.plot(
                    [s * tokens for s in steps], values, style, markersize=3, linewidth=1, label=f"{name} {label}"
                )
        for tag in task_tags:  # eval_tasks: e.g. eval/hellaswag_acc_norm
            if series.get(tag):
                steps, values = zip(*series[tag])
                axes[0, 1].plot(
                    [s * tokens for s in steps],
                    values,
                    "o-",
                    markersize=3,
                    linewidth=1,
                    label=f"{name} {tag.removeprefix('eval/')}",
                )
    loss_ax.set_ylabel("cross-entropy loss")
    if task_tags:
        axes[0, 1].set_ylabel("accuracy")
    for ax in axes[0]:
        ax.set_xlabel("tokens seen")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def decode_series(paths: list[str]) -> dict:
    """(weights, KV cache) -> [(batch, tokens/s, ms per step)] from bench.py --mode=decode records."""
    series = {}
    for path in paths:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        for r in records:
            if r.get("mode") != "decode":
                continue
            key = f"weights {r.get('weight_dtype', 'auto')}, KV {r.get('kv_cache_dtype', 'auto')}"
            series.setdefault(key, []).extend(
                (run["batch_size"], run["tokens_per_s"], run["step_s"] * 1e3) for run in r["runs"]
            )
    if not series:
        raise ValueError(f"no bench.py --mode=decode records in {', '.join(paths)}")
    return {key: sorted(points) for key, points in series.items()}


def plot_decode(paths: list[str], path: str, title: str = "") -> None:
    """Each series a line through its batch sizes: tokens/s (throughput) against ms per token step
    (each row's latency), the batch written at each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for key, points in decode_series(paths).items():
        batches, throughput, latency = zip(*points)
        ax.plot(throughput, latency, "o-", markersize=4, linewidth=1, label=key)
        for b, x, y in points:
            ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("decode throughput, tokens/s (all rows)")
    ax.set_ylabel("ms per token step (each row's latency)")
    ax.set_title(title or "decode: latency vs throughput by batch (slots)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("out_dirs", nargs="+", help="training output directories (with --decode: bench JSONL files)")
    parser.add_argument("--out", help="PNG file to write (default: <first out_dir>/loss.png)")
    parser.add_argument("--decode", action="store_true", help="plot bench.py --mode=decode records instead")
    parser.add_argument("--title", default="", help="with --decode: the chart's title")
    args = parser.parse_args(argv)
    path = args.out or (
        os.path.splitext(args.out_dirs[0])[0] + "_decode.png"
        if args.decode
        else os.path.join(args.out_dirs[0], "loss.png")
    )
    try:
        if args.decode:
            plot_decode(args.out_dirs, path, args.title)
        else:
            plot(args.out_dirs, path)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
