"""GPU experiments around bench.py, for bench/gpu_check.sh (needs a GPU; not run by the tests).

    python bench/gpu_run.py --check_attention              # cuDNN flash attention works? how fast?
    python bench/gpu_run.py --attention=cudnn config/gpt2_124m.py --batch_size=16 ...   # bench.py
    python bench/gpu_run.py --summary=bench-gpu/bench.jsonl    # one table of every record
    python bench/gpu_run.py --top_ops=bench-gpu/trace            # where a traced step's time went

--attention=cudnn makes jax.nn.dot_product_attention use cuDNN's fused (flash) kernel for
calls that pass no explicit implementation and no mask (training and prefill; the decode
step's masked attention stays on XLA), by wrapping the function for this process only:
model.py is unchanged, so the measured difference tells whether model.py should ask for
cuDNN itself. --decode_weights=compute does the same for sample.py: weights cast to the
compute dtype once before the decode loop. Both choices are recorded in the JSON.
"""

import functools
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


def use_cudnn_attention() -> None:
    xla_attention = jax.nn.dot_product_attention

    @functools.wraps(xla_attention)
    def attention(query, key, value, bias=None, mask=None, *, implementation=None, **kwargs):
        if implementation is None and mask is None and query.dtype in (jnp.bfloat16, jnp.float16):
            implementation = "cudnn"
        return xla_attention(query, key, value, bias, mask, implementation=implementation, **kwargs)

    jax.nn.dot_product_attention = attention


def cast_decode_weights() -> None:
    """sample.decode with every weight matrix cast to the compute dtype once, before the loop.

    model.py casts float32 parameters to the compute dtype where it uses them; inside the
    decode loop that means reading float32 weights for every token (measured on CPU: the loop
    carries f32[50304,768] etc.), twice the bytes of the bf16 roofline. This tries the fix
    without editing sample.py.
    """
    import sample
    from flax import nnx
    original = sample.decode

    def decode(graphdef, params, state, **kwargs):
        dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)
        params = jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, params)
        return original(graphdef, params, state, **kwargs)

    sample.decode = decode


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
        print(f"  {impl:>5}: rel. error vs float32 {err:.1e}, {statistics.median(times) * 1e3:.2f} ms "
              f"(median of 20), ~{flops / statistics.median(times) / 1e12:.0f} TFLOP/s")


def summary(path: str) -> None:
    records = [json.loads(line) for line in open(path)]
    print(f"{'mode':<6} {'attention':<9} {'B':>3} {'remat':<32} {'xla_flags':<28} {'ms/step':>8} "
          f"{'tokens/s':>10} {'MFU':>6} {'peak mem':>9} {'compile':>7}")
    for r in records:
        c = r["config"]
        if r["mode"] == "train":
            mem = f"{r['peak_memory_bytes'] / 2**30:.1f}G" if r["peak_memory_bytes"] else "?"
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "?"
            print(f"train  {r.get('attention', 'default'):<9} {c['batch_size']:>3} {c['remat_policy']:<32} "
                  f"{r['xla_flags'][:28]:<28} {r['median_s'] * 1e3:>8.1f} {r['tokens_per_s']:>10,.0f} "
                  f"{mfu:>6} {mem:>9} {r['compile_s']:>6.0f}s")
        else:
            for run in r["runs"]:
                frac = f"{run['roofline_fraction']:.0%}" if run["roofline_fraction"] is not None else "?"
                what = f"scan_layers={c['scan_layers']}, weights {r.get('decode_weights', 'float32')}"
                print(f"decode {r.get('attention', 'default'):<9} {run['batch_size']:>3} "
                      f"{what:<32} {r['xla_flags'][:28]:<28} "
                      f"{run['step_s'] * 1e3:>8.3f} {run['tokens_per_s']:>10,.0f} {frac:>6} roofline")


def main(argv: list[str]) -> None:
    names = ("--attention", "--check_attention", "--summary", "--decode_weights", "--top_ops")
    own = {a.partition("=")[0]: a.partition("=")[2] for a in argv if a.partition("=")[0] in names}
    rest = [a for a in argv if a.partition("=")[0] not in own]
    if "--summary" in own:
        return summary(own["--summary"])
    if "--top_ops" in own:
        return top_ops(own["--top_ops"])
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {jax.device_count()}")
    if "--check_attention" in own:
        return check_attention()
    attention = own.get("--attention", "default")
    if attention == "cudnn":
        use_cudnn_attention()
    decode_weights = own.get("--decode_weights", "float32")
    if decode_weights == "compute":
        cast_decode_weights()
    import bench
    bench.main(rest, {"attention": attention, "decode_weights": decode_weights})


if __name__ == "__main__":
    main(sys.argv[1:])
