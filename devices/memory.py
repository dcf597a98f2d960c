"""Will it fit? What XLA's compiled programs need per device against what the devices have.

compile_aot.py asks this of a TPU pod before it is paid for; train.py, bench.py and serve.py ask it
of the machine they run on, before the first step (`preflight`), so that a run too big for it ends
with one line saying what it needs, what there is and what to change, not with the kernel's OOM
killer. `--memory_check=False` skips it; `--memory_limit_gib=N` checks against N GiB per device
instead of the device's own limit (tests set one; so can a user sharing a device).
"""


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
    memory = {"arguments": m.argument_size_in_bytes,
              "outputs": m.output_size_in_bytes - m.alias_size_in_bytes,  # donated state is reused
              "temporaries": m.temp_size_in_bytes,
              "code": m.generated_code_size_in_bytes}
    memory["total"] = sum(memory.values())
    host = m.host_argument_size_in_bytes + m.host_temp_size_in_bytes + m.host_output_size_in_bytes - m.host_alias_size_in_bytes
    if host:  # offload: the state kept in host memory (and its traffic), outside the device's total
        memory["host"] = host
    if platform != "cpu" and m.peak_memory_in_bytes:  # XLA:CPU's peak is not reliable
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
    """Per-device bytes of the largest program (they run one at a time on the same arguments)."""
    return max(m.get("peak") or m["total"] for m in (compiler_memory(p, platform) for p in programs))


def training_remedies(config: configurator.Config, n_devices: int) -> list[str]:
    """The cheapest ways down that the config offers, the same advice as compile_aot.py's."""
    tips = []
    if config.fsdp_reduce_once and config.mesh_fsdp != 1:
        tips.append("--fsdp_reduce_once=False (each device keeps only its share of the parameters and gradient)")
    if config.batch_size > 1:
        tips.append(f"--batch_size={config.batch_size // 2} "
                    f"--gradient_accumulation_steps={2 * config.gradient_accumulation_steps} (same tokens per step)")
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
            f"try {', or '.join(remedies) or 'a bigger machine'} (or --memory_check=False to run anyway)")
    elif need > WARN_FRACTION * limit:
        result["line"] = (f"memory: WARNING {what} needs {need_text} of {have_text} available ({source}), "
                          f"within {1 - WARN_FRACTION:.0%} of the limit; it may run out")
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
