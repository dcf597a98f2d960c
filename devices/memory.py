"""Will it fit? What XLA's compiled programs need per device against what the devices have.

compile_aot.py asks this of a TPU pod before it is paid for; train.py, bench.py and serve.py ask it
of the machine they run on, before the first step (`preflight`), so that a run too big for it ends
with one line saying what it needs, what there is and what to change, not with the kernel's OOM
killer. `--memory_check=False` skips it; `--memory_limit_gib=N` checks against N GiB per device
instead of the device's own limit (tests set one; so can a user sharing a device).

The need is XLA's own count for the device the program was compiled for: arguments + outputs not
donated + temporaries (+ code). Where XLA refuses to compile (XLA:TPU checks its buffers against the
chip's HBM), `refusing_out_of_memory` turns its RESOURCE_EXHAUSTED into the same one-line refusal,
with the bytes its message names (`parse_out_of_memory`).
"""

import contextlib
import math
import re

import jax

import configurator
from devices.hardware import GiB

WARN_FRACTION = 0.95  # a need above this share of the limit runs, with a warning: XLA's sums are not exact


def size(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def compiler_memory(compiled, platform: str) -> dict:
    """Per-device bytes as XLA's buffer assignment counts them."""
    m = compiled.memory_analysis()
    memory = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes - m.alias_size_in_bytes,  # donated state is reused
        "temporaries": m.temp_size_in_bytes,
        "code": m.generated_code_size_in_bytes,
    }
    memory["total"] = sum(memory.values())  # what the preflight checks, on every backend
    host = (
        m.host_argument_size_in_bytes
        + m.host_temp_size_in_bytes
        + m.host_output_size_in_bytes
        - m.host_alias_size_in_bytes
    )
    if host:  # offload: the state kept in host memory (and its traffic), outside the device's total
        memory["host"] = host
    # XLA's simulated peak is reported, not checked: on a TPU it gave GPT-2 124M's step the same 7.92 GiB
    # whatever the remat policy (the real need moved from 10.6 to 27.9 GiB); XLA:CPU's is not reliable.
    if platform != "cpu" and m.peak_memory_in_bytes:
        memory["peak"] = m.peak_memory_in_bytes
    return memory


def host_available_bytes() -> int | None:
    """The host's MemAvailable (Linux): what can be allocated without swapping or an OOM kill."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available(devices, limit_gib: float = 0.0) -> tuple[int | None, str]:
    """(bytes one device may use, where that number comes from). CPU "devices" share the host's
    memory: each gets an equal share of what is available."""
    if limit_gib:
        return int(limit_gib * GiB), "memory_limit_gib"
    if devices[0].platform == "cpu":
        host = host_available_bytes()
        return (None, "unknown") if host is None else (host // len(devices), "the host's available memory")
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"], f"{devices[0].device_kind}'s memory limit"
    return None, "unknown"


class DoesNotFit(configurator.ConfigError):
    """The refusal: what the programs need is more than the devices have (the message says both and
    the remedies); bench.py with no config catches it to try a smaller default model."""


def needed(programs, platform: str) -> int:
    """Per-device bytes of the largest program (they run one at a time on the same arguments): its
    arguments + outputs not donated + temporaries + code, as XLA allocates them for the device."""
    return max(compiler_memory(p, platform)["total"] for p in programs)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs (unsharded ones whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


# ----------------------------------------------------------------------------- when XLA refuses

# A size as XLA writes it: '26.52G', '530.00M', '4.0K', '0B', '1.25GiB', '1318976384B' (binary units).
_SIZE = r"(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?"


def _bytes(number: str, prefix: str) -> int:
    return int(float(number) * 1024 ** " KMGTP".index(prefix.upper() or " "))


def parse_out_of_memory(message: str) -> dict:
    """The sizes XLA's RESOURCE_EXHAUSTED message names, in bytes, under the keys it has of:
    'total' (XLA:TPU's 'Total hbm usage >= 27.02G': program + arguments + reserved), 'used' and
    'capacity' ('Used 26.52G of 15.75G hbm'), 'temporaries' and 'capacity' ('the total memory
    required for HLO temporaries (26.52G) exceeds available HBM (15.75G)'), 'allocation' (XLA:GPU's
    'Out of memory while trying to allocate 28472983552 bytes'), and 'space' ('hbm', 'vmem')."""
    found = {}

    def search(pattern):
        return re.search(pattern.replace("SIZE", _SIZE), message, flags=re.IGNORECASE)

    if m := search(r"memory space (\w+)"):
        found["space"] = m.group(1).lower()
    if m := search(r"Total (\w+) usage\s*>=\s*SIZE"):
        found["total"] = _bytes(*m.group(2, 3))
        found.setdefault("space", m.group(1).lower())
    if m := search(r"Used SIZE of SIZE"):
        found["used"], found["capacity"] = _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4))
    if m := search(r"temporaries\s*\(SIZE\)"):
        found["temporaries"] = _bytes(*m.group(1, 2))
    if m := search(r"exceeds available (\w+)\s*\(SIZE\)"):
        found["capacity"] = _bytes(*m.group(2, 3))
        found.setdefault("space", m.group(1).lower())
    if m := search(r"allocat\w* (\d+) bytes") or search(r"allocat\w* .*?\((\d+)B\)"):
        found["allocation"] = int(m.group(1))
    return found


def is_out_of_memory(error: BaseException) -> bool:
    """XLA's out-of-memory error, raised by a compile (XLA:TPU) or an allocation (XLA:GPU)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def refusal(what: str, message: str, devices, remedies: list[str], arguments: int = 0) -> DoesNotFit:
    """The one-line refusal for a program XLA could not fit: what it needs as XLA's message says
    (plus the program's `arguments` per device where the message counts only temporaries), what
    the device has, and the remedies."""
    sizes = parse_out_of_memory(message)
    compiler = f"XLA:{devices[0].platform.upper()}"
    need = (
        sizes.get("total")
        or sizes.get("used")
        or (sizes["temporaries"] + arguments if "temporaries" in sizes else None)
    )
    at_least = ""
    if need is None and "allocation" in sizes:  # one allocation that failed: the need is more than this
        need, at_least = sizes["allocation"] + arguments, "at least "
    capacity = sizes.get("capacity") or available(devices)[0]
    space = sizes.get("space", "memory")
    try_ = f"try {', or '.join(remedies) or 'a bigger machine'}"
    if need is None:
        first_line = message.strip().splitlines()[0][:200] if message.strip() else "RESOURCE_EXHAUSTED"
        return DoesNotFit(f"memory: {what} does not fit the device ({compiler}: {first_line}); {try_}")
    have = f"the {size(capacity)} of {space}" if capacity else f"the device's {space}"
    return DoesNotFit(
        f"memory: {what} needs {at_least}{size(need)} per device, more than {have} available "
        f"({compiler} refused it: RESOURCE_EXHAUSTED); {try_}"
    )


@contextlib.contextmanager
def refusing_out_of_memory(what: str, devices, remedies: list[str], arguments=()):
    """Compile (or run) inside: XLA's out-of-memory error leaves as refusal()'s one-line
    DoesNotFit (a ConfigError); `arguments`: the program's inputs (arrays or ShapeDtypeStructs with shardings)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if not is_out_of_memory(error):
            raise
        raise refusal(what, str(error), devices, remedies, per_device_bytes(arguments)) from None


def training_remedies(config: configurator.Config, n_devices: int) -> list[str]:
    """The cheapest ways down that the config offers, the same advice as compile_aot.py's."""
    tips = []
    if config.fsdp_reduce_once and config.mesh_fsdp != 1:
        tips.append("--fsdp_reduce_once=False (each device keeps only its share of the parameters and gradient)")
    if config.batch_size > 1:
        tips.append(
            f"--batch_size={config.batch_size // 2} "
            f"--gradient_accumulation_steps={2 * config.gradient_accumulation_steps} (same tokens per step)"
        )
    if config.remat_policy != "full":
        lighter = "dots_with_no_batch_dims_saveable"
        tips.append(f"--remat_policy={'full' if config.remat_policy == lighter else lighter}")
    if config.dtype == "float32":
        tips.append("--dtype=bfloat16")
    if n_devices > 1 and config.mesh_fsdp != -1:
        tips.append(f"--mesh_data=1 --mesh_fsdp=-1 (shard the state over all {n_devices} devices)")
    if config.block_size > 64:
        tips.append(f"--block_size={config.block_size // 2}")
    return tips


def preflight(what: str, programs, devices, limit_gib: float, remedies: list[str], say=print) -> dict:
    """Check `programs` (compiled) fit `devices`; say one line and return the numbers, or raise
    ConfigError (one line: needed, available, remedies) when they cannot fit."""
    return check(what, needed(programs, devices[0].platform), devices, limit_gib, remedies, say)


def check(what: str, need: int, devices, limit_gib: float, remedies: list[str], say=print) -> dict:
    """preflight for a need in bytes per device already summed up."""
    platform = devices[0].platform
    limit, source = available(devices, limit_gib)
    n = len(devices)
    shared = platform == "cpu" and n > 1 and not limit_gib  # all CPU devices draw on one host
    need_text = f"{size(need)} per device x {n} = {size(need * n)}" if shared else f"{size(need)} per device"
    have_text = f"{size(limit * n)}" if shared and limit is not None else size(limit)
    result = {"needed_bytes": need, "available_bytes": limit, "available_from": source, "devices": n}
    if limit is None:
        result["line"] = f"memory: {what} needs {need_text}; available: unknown, not checked"
    elif need > limit:
        raise DoesNotFit(
            f"memory: {what} needs {need_text}, more than the {have_text} available ({source}); "
            f"try {', or '.join(remedies) or 'a bigger machine'} (or --memory_check=False to run anyway)"
        )
    elif need > WARN_FRACTION * limit:
        result["line"] = (
            f"memory: WARNING {what} needs {need_text} of {have_text} available ({source}), "
            f"within {1 - WARN_FRACTION:.0%} of the limit; it may run out"
        )
    else:
        result["line"] = f"memory: {what} needs {need_text} of {have_text} available ({source})"
    say(result["line"])
    return result


def decoding_remedies(batch_size: int, new_tokens: int, weight_dtype: str, kv_cache_dtype: str) -> list[str]:
    """bench.py --mode=decode's ways down: fewer rows, a shorter cache (prompt + new tokens), int8."""
    tips = [f"--decode_batch={batch_size // 2}"] if batch_size > 1 else []
    if new_tokens > 2:
        tips.append(f"--new_tokens={new_tokens // 2}")
    if kv_cache_dtype != "int8":
        tips.append("--kv_cache_dtype=int8")
    if weight_dtype != "int8":
        tips.append("--weight_dtype=int8")
    return tips


def sampling_remedies(cfg, n_prompts: int) -> list[str]:
    """sample.py's ways down (cfg: its SampleConfig): fewer rows at once, fewer new tokens, int8."""
    tips = [f"--num_samples={cfg.num_samples // 2}"] if cfg.num_samples > 1 else []
    if n_prompts > 1:
        tips.append("fewer prompts in --start=FILE:...")
    if cfg.max_new_tokens > 1:
        tips.append(f"--max_new_tokens={cfg.max_new_tokens // 2}")
    if cfg.kv_cache_dtype != "int8":
        tips.append("--kv_cache_dtype=int8")
    if cfg.weight_dtype != "int8":
        tips.append("--weight_dtype=int8")
    return tips


def serving_remedies(cfg, n_devices: int) -> list[str]:
    """serve.py's ways down (cfg: its ServeConfig): the KV cache grows with the slots, the weights
    and the cache shrink in int8, and tensor parallelism splits both."""
    tips = [f"--slots={cfg.slots // 2}"] if cfg.slots > 1 else []
    if cfg.kv_cache_dtype != "int8":
        tips.append("--kv_cache_dtype=int8")
    if cfg.weight_dtype != "int8":
        tips.append("--weight_dtype=int8")
    if n_devices > cfg.mesh_tensor * cfg.mesh_data:
        tips.append(f"--mesh_tensor={n_devices // cfg.mesh_data} (split the weights and cache over more devices)")
    return tips
