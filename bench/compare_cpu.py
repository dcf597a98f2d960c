"""nanomax against a PyTorch GPT (nanoGPT's CPU recipe) on the same shapes, in one run.

    .venv/bin/python bench/compare_cpu.py                                  # both target shapes
    .venv/bin/python bench/compare_cpu.py --nanogpt=/path/to/nanoGPT/model.py --rounds=8
    .venv/bin/python bench/compare_cpu.py --shapes=small --scan_layers=False   # nanomax flags too

nanomax runs with --base (default config/shakespeare_char.py, the CPU config: its settings such
as scan_layers apply), then the shape, vocab 65 and dropout 0, then any other flag given here.

nanomax's step is train.py's own (through bench.TrainBench); the PyTorch side runs in its own
virtual environment (--torch_python; PyTorch is no nanomax dependency) as a worker process,
either bench/torch_reference.py's model (written for this comparison) or, with --nanogpt,
nanoGPT's own model.py from a checkout you fetched. Float32, eager PyTorch, one micro-step,
AdamW with clipping on both sides, random tokens of a 65-character vocabulary.

The two never run at the same time: rounds alternate which goes first, each times --steps
steps, and each side's min and median over all rounds are compared. The CPU is shared, so
the load average is printed (with a warning when others kept the cores busy); "ok" needs
both the ratio of medians and the ratio of minimums at the target. Each shape's row also gives
the best rate of a 1024x1024 float32 matmul in JAX and in PyTorch, measured in the same run
(the two frameworks' ceilings differ by CPU), and the header names the CPU model and its
vector units (AVX2, AVX-512, AMX): keep one table per CPU model (bench/NOTES.md). A PyTorch
whose matmul runs below 80% of JAX's makes the ratio flatter nanomax: such a row gets "?", not
a verdict. PyTorch's MKL takes its slow generic path on AMD CPUs; --torch_preload=LIB puts a
library in front of the worker only (LD_PRELOAD), such as bench/NOTES.md's one-line MKL shim
that lets MKL use its fast kernels there.
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402

import bench  # noqa: E402
import configurator  # noqa: E402

# name -> (nanoGPT-style shape, target ratio of nanomax's tokens/s over PyTorch's)
SHAPES = {
    "small": (dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12), 1.2),  # nanoGPT's CPU recipe
    "medium": (dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=8), 1.2),  # its baby GPT, batch 8
}
VOCAB = 65  # shakespeare_char
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
OWN_FLAGS = {
    "base": os.path.join(os.path.dirname(HERE), "config", "shakespeare_char.py"),  # the CPU config
    "shapes": "small,medium",
    "rounds": "6",
    "steps": "0",
    "warmup": "3",
    "nanogpt": "",
    "torch_python": "/work/torchvenv/bin/python",
    "torch_preload": "",
    "json": "bench_compare.jsonl",
}


class TorchWorker:
    """bench/torch_reference.py --serve in the PyTorch venv: 'steps K' -> K step times."""

    def __init__(self, python: str, shape: dict, nanogpt: str, preload: str):
        cmd = [python, os.path.join(HERE, "torch_reference.py"), "--serve", f"--vocab_size={VOCAB}"]
        cmd += [f"--{k}={v}" for k, v in shape.items()] + ([f"--nanogpt={nanogpt}"] if nanogpt else [])
        env = os.environ | ({"LD_PRELOAD": preload} if preload else {})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self):
        while True:  # nanoGPT's model prints a line or two of its own: skip anything but JSON
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the PyTorch worker exited ({self.proc.wait()}); run it alone to see why")
            if line.startswith(("{", "[")):
                return json.loads(line)

    def ask(self, command: str):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, n: int) -> list[float]:
        return self.ask(f"steps {n}")

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def cpu_description() -> str:
    """'AMD EPYC (family 26, model 2): avx512f avx512_bf16 avx512_vnni', from /proc/cpuinfo."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU (no /proc/cpuinfo)"
    flags = [f for f in ISA_FLAGS if f in info.get("flags", "").split()]
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}): "
        f"{' '.join(flags) or 'no AVX2'}"
    )


def compare(name: str, flags: dict, nanomax_argv: list[str]) -> dict:
    shape, target = SHAPES[name]
    base = [flags["base"]] if flags["base"] else []
    config = configurator.load_config(
        base + [f"--{k}={v}" for k, v in shape.items()] + [f"--vocab_size={VOCAB}", "--dropout=0.0"] + nanomax_argv
    )
    ours = bench.TrainBench(config, jax.devices()[:1])
    theirs = TorchWorker(flags["torch_python"], shape, flags["nanogpt"], flags["torch_preload"])
    # about 1.5 s of work per side per round unless --steps says otherwise
    warm = int(flags["warmup"])
    probe = ours.run(warm)[-1] if warm else ours.run(1)[0]
    theirs.run(max(1, warm))
    steps = int(flags["steps"]) or max(3, min(50, round(1.5 / probe)))
    matmul = {"jax": bench.hardware.measure_cpu_peak_flops(), "torch": theirs.ask("matmul")["flops"]}
    times = {"nanomax": [], "torch": []}
    load = [os.getloadavg()[0]]
    for r in range(int(flags["rounds"])):
        sides = [("nanomax", ours.run), ("torch", theirs.run)]
        for side, run in sides if r % 2 == 0 else sides[::-1]:
            times[side] += run(steps)
    load.append(os.getloadavg()[0])
    theirs.close()
    s = {side: {"min_s": min(t), "median_s": statistics.median(t), "n": len(t)} for side, t in times.items()}
    tokens = config.tokens_per_step
    return {
        "shape": name,
        **shape,
        "vocab_size": VOCAB,
        "nanomax_flags": nanomax_argv,
        "torch": theirs.info,
        "nanomax_compile_s": ours.compile_s,
        "load_average": load,
        "target": target,
        "nanomax": s["nanomax"] | {"tokens_per_s": tokens / s["nanomax"]["median_s"]},
        "pytorch": s["torch"] | {"tokens_per_s": tokens / s["torch"]["median_s"]},
        "ratio_median": s["torch"]["median_s"] / s["nanomax"]["median_s"],
        "ratio_min": s["torch"]["min_s"] / s["nanomax"]["min_s"],
        "matmul_flops": matmul,
        "step_s": times,
    }


def main(argv: list[str]) -> None:
    bench.hardware.keep_freed_host_memory()  # as train.py runs: before JAX starts its CPU backend
    flags, nanomax_argv = dict(OWN_FLAGS), []
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if key in flags:
            flags[key] = value
        else:
            nanomax_argv.append(arg)
    if flags["torch_preload"] and not os.path.isfile(flags["torch_preload"]):
        sys.exit(f"error: --torch_preload={flags['torch_preload']} is no file: build it as bench/NOTES.md shows")
    if not os.path.exists(flags["torch_python"]):
        sys.exit(
            f"error: no PyTorch python at {flags['torch_python']}: python3 -m venv /work/torchvenv && "
            f"/work/torchvenv/bin/pip install torch==2.13.0 numpy (or pass --torch_python=...)"
        )
    results = [compare(name, flags, nanomax_argv) for name in flags["shapes"].split(",")]
    ref = results[0]["torch"]
    print(
        f"nanomax (jax {jax.__version__}) vs PyTorch {ref['torch']} ({ref['model']}, {ref['threads']} threads), "
        f"CPU x {os.cpu_count()}; float32, one step = fwd + bwd + clip + AdamW"
    )
    print(f"CPU: {cpu_description()}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(
        f"nanomax: {os.path.relpath(flags['base']) if flags['base'] else 'Config defaults'}"
        f"{' ' + ' '.join(nanomax_argv) if nanomax_argv else ''}"
    )
    print(
        f"{'shape':<8} {'L x D, T, B':<16} {'nanomax ms min/med':>19} {'PyTorch ms min/med':>19} "
        f"{'ratio med':>9} {'ratio min':>9} {'target':>7} {'load':>10} {'matmul GFLOP/s JAX/PyTorch':>27}"
    )
    for r in results:
        n, t = r["nanomax"], r["pytorch"]
        ok = "ok" if min(r["ratio_median"], r["ratio_min"]) >= r["target"] else "BELOW"
        if r["matmul_flops"]["torch"] < 0.8 * r["matmul_flops"]["jax"]:
            ok = "?"  # against a handicapped PyTorch: no verdict (the warning below says why)
        print(
            f"{r['shape']:<8} {r['n_layer']}x{r['n_embd']}, {r['block_size']}, {r['batch_size']:<5} "
            f"{n['min_s'] * 1e3:>8.1f} / {n['median_s'] * 1e3:>7.1f} {t['min_s'] * 1e3:>8.1f} / "
            f"{t['median_s'] * 1e3:>7.1f} {r['ratio_median']:>8.2f}x {r['ratio_min']:>8.2f}x "
            f"{r['target']:>5.1f}x {ok:<5} {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} "
            f"{r['matmul_flops']['jax'] / 1e9:>14.0f} / {r['matmul_flops']['torch'] / 1e9:.0f}"
        )
    slowest = min(r["matmul_flops"]["torch"] / r["matmul_flops"]["jax"] for r in results)
    if slowest < 0.8:  # "?" rows
        print(
            f"warning: PyTorch's matmul ran at {slowest:.0%} of JAX's, so the ratios flatter nanomax; on an "
            f"AMD CPU pass --torch_preload with bench/NOTES.md's MKL shim, and compare where the two match"
        )
    busiest = max(max(r["load_average"]) for r in results)
    if busiest > os.cpu_count() + 0.5:  # this run itself keeps about cpu_count threads busy
        print(
            f"warning: load average reached {busiest:.1f} on {os.cpu_count()} cores: other processes "
            f"took CPU time, and PyTorch's spinning threads lose more to that than XLA's; rerun on "
            f"a quiet machine before trusting the ratio"
        )
    if flags["json"]:
        stamp = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "git": bench.git_revision(),
            "argv": argv,
            "torch_preload": flags["torch_preload"],
            "cpu": cpu_description(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }
        with open(flags["json"], "a") as f:
            for r in results:
                f.write(json.dumps(stamp | r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
