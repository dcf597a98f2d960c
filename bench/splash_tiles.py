"""Splash attention's time by tile sizes: to fill layers/attention.py's SPLASH_BLOCKS for a head size or a
row length, as its tiles were chosen on a v5e (bench/NOTES.md).

    python bench/splash_tiles.py                                   # GPT-2's prefill: 8 rows x 896 tokens
    python bench/splash_tiles.py --rows=16 --tokens=1024 --backward  # GPT-2's training layer
    python bench/splash_tiles.py --heads=4 --kv_heads=1 --head_size=256 --tokens=2048 --backward

Each candidate (q, kv, kv_compute) that divides the row length the kernel runs (T padded as
attention.splash_length pads it; --pad=N sets SPLASH_PAD) is compiled and timed: the forward, or with
--backward the fused backward's tiles (block_q_dkv, block_kv_dkv, block_kv_dkv_compute) under the
table's forward, forward and backward together. Median of --steps runs, block_until_ready; each
result's largest difference from the first candidate's is printed beside it. Off a TPU Pallas
interprets the kernel: that checks the tool, it does not time anything.
"""

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from layers import attention  # noqa: E402

CANDIDATES = [(q, kv, c) for q, kv, c in itertools.product((256, 512, 1024), (256, 512, 1024), (256, 512)) if c <= kv]


def tiles(text: str) -> list[tuple[int, int, int]]:
    try:
        found = [tuple(int(n) for n in t.split(",")) for t in text.split(";")]
    except ValueError:
        found = []
    if not found or any(len(t) != 3 or min(t) < 1 for t in found):
        raise argparse.ArgumentTypeError(f"want 'q,kv,kv_compute;...' of positive integers, got {text!r}")
    return found


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv_heads", type=int, default=0, help="0: as many as --heads")
    p.add_argument("--head_size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=896)
    p.add_argument("--pad", type=int, default=0, help="SPLASH_PAD for this run (0: the table's)")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--tiles", type=tiles, default=CANDIDATES, help="'q,kv,kv_compute;...' (default: a grid of them)")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if min(args.rows, args.heads, args.head_size, args.tokens, args.steps) < 1 or args.heads % args.kv_heads:
        p.error("sizes must be positive, and --heads a multiple of --kv_heads")
    if args.tokens < attention.SPLASH_MULTIPLE:
        p.error(f"--tokens must be at least {attention.SPLASH_MULTIPLE}: splash takes no shorter rows")
    return args


def program(args, block_sizes):
    """The jitted forward, or forward and backward, at these tiles."""
    forward = lambda q, k, v: attention.splash_attention_heads_major(q, k, v, block_sizes=block_sizes)
    if not args.backward:
        return jax.jit(forward)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.pad:
        attention.SPLASH_PAD = args.pad
    padded = attention.splash_length(args.tokens)
    keys = jax.random.split(jax.random.key(0), 3)
    shape = lambda heads: (args.rows, heads, args.tokens, args.head_size)
    q, k, v = (
        jax.random.normal(key, shape(n), jnp.bfloat16) for key, n in zip(keys, (args.heads, *[args.kv_heads] * 2))
    )
    table = attention.splash_block_sizes(padded, args.head_size)
    print(
        f"{jax.devices()[0].device_kind}: {args.rows} rows x {args.tokens} tokens (run at {padded}), {args.heads} "
        f"heads ({args.kv_heads} kv) of {args.head_size}, {'forward and backward' if args.backward else 'forward'}"
    )
    names = (
        ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")
        if args.backward
        else ("block_q", "block_kv", "block_kv_compute")
    )
    results, first = [], None
    for t in args.tiles:
        if padded % t[0] or padded % t[1] or t[1] % t[2]:
            continue
        run = program(args, dataclasses.replace(table, **dict(zip(names, t))))
        try:
            out = jax.block_until_ready(run(q, k, v))
        except Exception as e:  # a tile the kernel refuses (VMEM, its block rules): say so, go on
            print(f"  {t}: refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready(run(q, k, v))
            times.append(time.perf_counter() - start)
        first = out if first is None else first
        diff = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(first))
        )
        results.append((statistics.median(times) * 1e3, t, diff))
    if not results:
        sys.exit(f"no candidate tile divides the kernel's row length {padded}: give --tiles")
    print(f"  {'ms':>8}  tiles ({', '.join(names)})  largest difference from the first")
    for ms, t, diff in sorted(results):
        print(f"  {ms:8.3f}  {t}  {diff:.3g}")


if __name__ == "__main__":
    main(sys.argv[1:])
