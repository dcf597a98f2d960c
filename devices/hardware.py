"""What the devices can do: one table of accelerator chips from the vendors' datasheets, the
CPU's rates measured here, and the host allocator setting the command lines start with.

train.py (MFU in the log), compile_aot.py (memory verdicts and step-time estimates) and
bench.py (MFU against the datasheet and against a matmul measured in the same run, and the decode
roofline) all read these numbers from here.
"""

import ctypes
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    kinds: tuple[str, ...]  # how JAX's device_kind names it (matched case-insensitively, as a part)
    bf16_flops: float  # dense bf16 matmul FLOP/s
    hbm_bytes: int  # device memory
    hbm_bandwidth: float  # bytes/s
    interconnect: float | None  # bytes/s per chip over all its links, both ways (NVLink / ICI); None = not known
    quantized_speedup: dict  # dense int8 / fp8 matmul rate over bf16's: where quantization can pay
    tpu_generation: str = ""  # TPU slices only: the name in v5e-256, v5e:16x16, ...
    torus_dims: int = 0  # TPU slices only: 2-D or 3-D torus
    cores_per_chip: int = 1  # TPU slices only: TensorCores, as Cloud's slice names count them


CHIPS = [
    Chip(("H100",), 989e12, 80 * 10**9, 3.35e12, 900e9, {"int8": 2, "fp8": 2}),
    Chip(("H200",), 989e12, 141 * 10**9, 4.8e12, 900e9, {"int8": 2, "fp8": 2}),
    Chip(("A100",), 312e12, 80 * 10**9, 2.0e12, 600e9, {"int8": 2}),  # the 80 GB part
    Chip(("TPU v4",), 275e12, 32 * GiB, 1.2e12, 300e9, {}, "v4", 3, 2),  # ICI: Cloud TPU v4 docs, 2,400 Gbps
    Chip(("TPU v5 lite", "TPU v5e"), 197e12, 16 * GiB, 819e9, 200e9, {"int8": 2}, "v5e", 2, 1),
    Chip(("TPU v5p",), 459e12, 95 * GiB, 2.765e12, 1.2e12, {"int8": 2}, "v5p", 3, 2),
    Chip(("TPU v6 lite", "TPU v6e"), 918e12, 32 * GiB, 1.64e12, 400e9, {"int8": 2}, "v6e", 2, 1),
]

TPU_GENERATIONS = {chip.tpu_generation: chip for chip in CHIPS if chip.tpu_generation}


def chip_of(device_kind: str) -> Chip | None:
    """The table's entry for a device, or None (CPU, or a chip this table does not know)."""
    for chip in CHIPS:
        if any(kind.lower() in device_kind.lower() for kind in chip.kinds):
            return chip
    return None


def peak_flops(devices) -> tuple[float | None, str]:
    """Peak FLOP/s of all `devices` together, and where the number comes from."""
    if devices[0].platform == "cpu":  # simulated CPU devices share the host's cores
        return measure_cpu_peak_flops(), "measured f32 matmul on this host"
    chip = chip_of(devices[0].device_kind)
    if chip is None:
        return None, f"unknown peak for '{devices[0].device_kind}'"
    return chip.bf16_flops * len(devices), f"{chip.kinds[0]} datasheet bf16 x {len(devices)}"


def measured_peak_flops(devices, peak: float | None = None) -> tuple[float, str]:
    """Peak FLOP/s of all `devices` together as measured here and now, and how: on CPUs `peak` when
    given (peak_flops measures it), on accelerators a bf16 8192³ matmul on the first device."""
    if devices[0].platform == "cpu":
        return peak or measure_cpu_peak_flops(), "measured f32 matmul on this host"
    n = 8192
    return (
        measure_matmul_flops(devices[0], n, jnp.bfloat16) * len(devices),
        f"bf16 {n}³ matmul measured on this {devices[0].device_kind} now x {len(devices)}",
    )


def measure_matmul_flops(device, n: int, dtype, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul on `device`: the best of `repeats` (after one to compile)."""
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def best_peak_flops(devices, peak: float | None, achieved: float = 0.0) -> float | None:
    """On CPUs the peak is a measured matmul rate and a busy moment makes one measurement low (and
    MFU high): the best of `peak`, a new measurement and `achieved`, a rate the run itself reached
    (so MFU never passes 100%). A datasheet peak comes back as it is."""
    return max(peak, measure_cpu_peak_flops(), achieved) if devices[0].platform == "cpu" else peak


def peak_bandwidth(devices) -> tuple[float | None, str]:
    """Memory bandwidth of all `devices` together, and where the number comes from."""
    if devices[0].platform == "cpu":  # simulated CPU devices share the host's memory
        return measure_cpu_bandwidth(), "measured streaming copy on this host"
    chip = chip_of(devices[0].device_kind)
    if chip is None:
        return None, f"unknown bandwidth for '{devices[0].device_kind}'"
    return chip.hbm_bandwidth * len(devices), f"{chip.kinds[0]} datasheet x {len(devices)}"


def measure_cpu_peak_flops() -> float:
    """The host's float32 matmul rate: the honest ceiling for MFU on CPU. The best of 20 runs
    (~5 ms each), so that other processes on a loaded machine don't make the peak look low."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def measure_cpu_bandwidth() -> float:
    """Bytes/s of a streaming pass (read 256 MiB, write 256 MiB) on this host: the CPU's roofline."""
    # In place (donated): a fresh 256 MiB output per call would time the kernel's page faults.
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    x = scale(jnp.ones((64 << 20,), jnp.float32)).block_until_ready()
    nbytes, best = x.nbytes, float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x = scale(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def keep_freed_host_memory() -> None:
    """Make glibc keep the memory XLA:CPU frees instead of handing it back to the OS every step.

    A step's temporaries are allocated on XLA's worker threads and freed at its end; by default
    glibc unmaps emptied per-thread heaps and mmaps big blocks, so the next step page-faults its
    whole working set in again (measured: ~950 MiB of faults, ~30% of a 6-layer/384 step on 2
    cores; bench/NOTES.md). One arena, no mmap and no trimming keep it. It has to run before JAX
    starts its backend (threads pick their arena on first use), so the command lines (train.py,
    bench.py) call it first thing; it slows compiling by ~20%, so the tests do without.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # from <malloc.h>
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, -1)  # -1: never
