"""GPU experiments around bench.py, for bench/gpu_check.sh (needs a GPU; not run by the tests).

    python bench/gpu_run.py --check_attention              # cuDNN flash attention works? how fast?
    python bench/gpu_run.py --summary=bench-gpu/bench.jsonl    # one table of every record
    python bench/gpu_run.py --top_ops=bench-gpu/trace            # where a traced step's time went

The runs themselves are plain bench.py commands (`--attention=xla|cudnn`, `--quantization=...`
are config keys); this file only adds what bench.py does not need on every machine.
"""

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def top_ops(trace_dir: str, n: int = 40) -> None:
    """The n ops with the most total time in a Perfetto trace (bench.py --profile=DIR)."""
    import collections
    import glob
    import gzip

    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return print(f"no *.trace.json.gz under {trace_dir}")
    events = json.load(gzip.open(sorted(files)[-1]))["traceEvents"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    print(f"top {n} ops of {sorted(files)[-1]} (3 steps; microseconds summed over all threads)")
    for name, us in total.most_common(n):
        print(f"{us / 3 / 1e3:10.3f} ms/step {count[name] // 3:6d}x  {name[:110]}")


def check_attention(B=8, T=1024, N=12, H=64) -> None:
    """cuDNN vs XLA causal attention on bf16 (B, T, N, H): error of outputs and gradients, time."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
    dy = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    ref32 = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)), is_causal=True)
    print(f"causal attention, bf16 (B={B}, T={T}, N={N}, H={H}), forward + backward:")
    for impl in ("xla", "cudnn"):

        def loss(q, k, v):
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            return (y.astype(jnp.float32) * dy.astype(jnp.float32)).sum(), y

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        try:
            (_, y), grads = jax.block_until_ready(step(q, k, v))
        except Exception as e:  # noqa: BLE001  (report any failure of the backend, then go on)
            print(f"  {impl:>5}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            times.append(time.perf_counter() - start)
        err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref32) / jnp.linalg.norm(ref32))
        flops = 4 * B * N * T * T * H / 2 * 3.5  # causal half; backward ~2.5x the forward
        print(
            f"  {impl:>5}: rel. error vs float32 {err:.1e}, {statistics.median(times) * 1e3:.2f} ms "
            f"(median of 20), ~{flops / statistics.median(times) / 1e12:.0f} TFLOP/s"
        )


def summary(path: str) -> None:
    records = [json.loads(line) for line in open(path)]
    print(
        f"{'mode':<6} {'attention':<9} {'quant':<5} {'B':>3} {'remat':<32} {'xla_flags':<28} {'ms/step':>8} "
        f"{'tokens/s':>10} {'MFU':>6} {'peak mem':>9} {'compile':>7}"
    )
    for r in records:
        c = r["config"]
        if r["mode"] == "train":
            mem = f"{r['peak_memory_bytes'] / 2**30:.1f}G" if r["peak_memory_bytes"] else "?"
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "?"
            print(
                f"train  {r['attention']:<9} {c['quantization']:<5} {c['batch_size']:>3} {c['remat_policy']:<32} "
                f"{r['xla_flags'][:28]:<28} {r['median_s'] * 1e3:>8.1f} {r['tokens_per_s']:>10,.0f} "
                f"{mfu:>6} {mem:>9} {r['compile_s']:>6.0f}s"
            )
        else:
            for run in r["runs"]:
                frac = f"{run['roofline_fraction']:.0%}" if run["roofline_fraction"] is not None else "?"
                what = f"scan_layers={c['scan_layers']}"
                print(
                    f"decode {r['attention']:<9} {c['quantization']:<5} {run['batch_size']:>3} "
                    f"{what:<32} {r['xla_flags'][:28]:<28} "
                    f"{run['step_s'] * 1e3:>8.3f} {run['tokens_per_s']:>10,.0f} {frac:>6} roofline"
                )


def main(argv: list[str]) -> None:
    names = ("--check_attention", "--summary", "--top_ops")
    own = {a.partition("=")[0]: a.partition("=")[2] for a in argv if a.partition("=")[0] in names}
    rest = [a for a in argv if a.partition("=")[0] not in own]
    if "--summary" in own:
        return summary(own["--summary"])
    if "--top_ops" in own:
        return top_ops(own["--top_ops"])
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {jax.device_count()}")
    if "--check_attention" in own:
        return check_attention()
    import bench

    bench.main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
