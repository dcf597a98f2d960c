"""Honest throughput and MFU of train.py's train step, or of inference/generate.py's decode loop.

    python bench.py config/gpt2_124m.py --batch_size=16 --gradient_accumulation_steps=1
    python bench.py config/shakespeare_char.py --block_size=64 --batch_size=12 --steps=50
    python bench.py config/gpt2_124m.py --mode=decode --decode_batch=1,32

Train mode builds the state and the step with train.py's own functions (make_setup,
init_state, jit_train_step), compiles it apart (timed), warms up, then times each step to
`block_until_ready` of the new state and metrics. Random tokens: no dataset needed. MFU is
model FLOPs (model.flops_per_token: 6N + 12·L·T·d, attention's whole T x T square as PaLM and nanoGPT
count it; and again 6N + 6·L·T·d, causal attention halved as MaxText counts it) x tokens/s over
hardware.peak_flops: the datasheet dense bf16 peak of the GPU/TPU in use, or on CPU a float32 matmul
measured now; on a GPU/TPU also over a bf16 8192³ matmul measured on the chip in the same run (what
it really does).
Peak memory is the step's real peak per device, said where it comes from (step_peak_memory),
beside the compiled program's need that the pre-flight check uses.

Decode mode runs generate.generate (prefill, then the compiled lax.while_loop over tokens)
with greedy sampling and random weights, at each --decode_batch, and compares the time
per token step with the memory-bandwidth roofline: every step must read the weights (in the
compute dtype) and each row's KV cache up to its position (the filled part, not the whole cache
allocated). The prefill's tokens/s and MFU (its forward FLOPs over the peak) are in the same
table: a long --prompt_len measures the prefill at the chip's compute rate.

Every run appends one JSON record to --json (default bench.jsonl), so runs can be compared.
Other flags are train.py config keys. With no config file and no config key (`python bench.py`,
or only bench.py's own flags), it measures the largest of DEFAULT_MODELS that fits the machine
(GPT-2 124M on an accelerator with the memory; on a CPU the quickstart's model) and says which.
"""

import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

import configurator
import sharding
import train
from common import model_setup
from data import dataset
from devices import hardware, memory
from devices.profile import (
    INSTRUCTION,
    format_step_summary,
    newest_trace,
    operation_lines,
    operation_name,
    step_summary,
)
from inference import generate, loader
from model import active_params, count_params, describe_params, flops_per_token
from training import optimizer
from weights import hf


@dataclasses.dataclass(frozen=True)
class Options:
    """bench.py's own flags; every other flag is a train.py config key."""

    mode: str = "train"  # 'train' | 'decode'
    steps: int = 20  # timed train steps, or timed decode runs per batch size
    warmup: int = 3  # untimed steps after compiling
    devices: int = 0  # use the first N devices (0 = all)
    json: str = "bench.jsonl"  # one JSON record per run is appended here ('' = don't)
    decode_batch: str = "1,8"  # decode: comma-separated batch sizes
    prompt_len: int = 16  # decode: prompt tokens per row
    new_tokens: int = 0  # decode: tokens generated per row; 0 = 128, or what fits in block_size
    weight_dtype: str = "auto"  # decode: the weights as sample.py/serve.py hold them: 'auto' | 'int8'; train with
    #                             --lora_rank: the frozen base's (QLoRA)
    kv_cache_dtype: str = "auto"  # decode: 'auto' (the compute dtype) | 'bfloat16' | 'float32' | 'int8'
    profile: str = ""  # trace into this directory (jax.profiler, Perfetto): train: PROFILE_STEPS more steps,
    #                    decode: one more generate call per batch; print the operations that took the most device time
    #                    and, for train, a step's time in matmuls, attention kernels, other operations and idle

    def __post_init__(self):
        if self.mode not in ("train", "decode"):
            raise configurator.ConfigError(f"--mode must be 'train' or 'decode', got {self.mode!r}")
        for key in ("steps", "prompt_len"):
            if getattr(self, key) < 1:
                raise configurator.ConfigError(f"--{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup < 0 or self.devices < 0 or self.new_tokens < 0:
            raise configurator.ConfigError("--warmup, --devices and --new_tokens must be >= 0")
        configurator.check_choice("weight_dtype", self.weight_dtype, loader.WEIGHT_DTYPES)
        configurator.check_choice("kv_cache_dtype", self.kv_cache_dtype, loader.KV_CACHE_DTYPES)
        if not all(s.strip().isdigit() and int(s) > 0 for s in self.decode_batch.split(",")):
            raise configurator.ConfigError(
                f"--decode_batch must be positive integers separated by commas (e.g. 1,8), got {self.decode_batch!r}"
            )


def quantization_note(mode: str, device) -> str:
    """What the hardware can give `mode`, said plainly (MFU is always against the bf16 peak)."""
    if mode == "none":
        return "none"
    if device.platform == "cpu":
        return f"{mode}: XLA:CPU has no {mode} path faster than float32: expect no speed-up (bench/NOTES.md)"
    chip = hardware.chip_of(device.device_kind)
    if chip is None:
        return f"{mode}: unknown {mode} support for '{device.device_kind}'"
    if mode in chip.quantized_speedup:
        return (
            f"{mode}: {chip.kinds[0]} has {chip.quantized_speedup[mode]}x bf16's matmul rate for "
            f"{mode}; MFU is still vs bf16"
        )
    return f"{mode}: {chip.kinds[0]} has no fast {mode} units; expect no speed-up (emulated)"


def bench_vocab_size(config) -> int:
    """The config's or dataset's vocabulary; GPT-2's 50257 when there is neither."""
    if config.vocab_size or os.path.exists(os.path.join(dataset.dataset_dir(config), "meta.json")):
        return dataset.read_vocab_size(config)
    return 50257


def step_peak_memory(devices, step) -> tuple[int | None, str]:
    """The train step's real peak bytes per device (read after the steps ran), and where the figure
    comes from. XLA:TPU keeps a program's temporaries in memory it reserves for the program, outside
    the allocator whose peak_bytes_in_use the backend reports (that peak is the state, the batch and
    the outputs: 1,446 MiB for GPT-2 124M's step at batch 16, whose temporaries are GiBs): on a TPU
    the two add up. Other backends' peak is taken as it is (a GPU's allocator hands out the
    temporaries too; not measured here). CPU backends report none: the compiler's plan stands in."""
    m = step.memory_analysis()
    stats = [d.memory_stats() or {} for d in devices]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    if not peaks:
        if m is None:
            return None, "not reported by this backend"
        return (
            m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes,
            "compiler's plan: arguments + outputs + temporaries; backend reports none",
        )
    if devices[0].platform == "tpu" and m is not None:
        return (
            max(peaks) + m.temp_size_in_bytes,
            f"backend peak_bytes_in_use after the steps, {max(peaks) / 2**20:,.1f} MiB (state, batch, outputs), "
            f"+ the step's temporaries, {m.temp_size_in_bytes / 2**20:,.1f} MiB (compiled memory_analysis), "
            f"which XLA:TPU reserves outside that count",
        )
    return max(peaks), "backend peak_bytes_in_use after the steps"


def random_batch(setup: train.Setup, vocab_size: int, seed: int = 0) -> tuple:
    """(x, y) of shape (micro-steps, B, T), int32 random tokens, sharded as train.py feeds them."""
    config = setup.config
    shape = (config.gradient_accumulation_steps, config.batch_size, config.block_size)
    rng = np.random.default_rng(seed)
    return tuple(
        jax.device_put(rng.integers(0, vocab_size, shape, dtype=np.int32), setup.micro_batch_sharding) for _ in range(2)
    )


# ----------------------------------------------------------------------------- train


class TrainBench:
    """train.py's state and compiled train step on random tokens, ready to be timed."""

    def __init__(self, config, devices):
        self.config, self.devices = config, devices
        self.vocab_size = bench_vocab_size(config)
        self.mesh = sharding.mesh_from_config(config, devices)
        self.setup = train.make_setup(config, self.mesh, self.vocab_size, dataset.config_document_start(config))
        self.peak, self.peak_source = hardware.peak_flops(devices)  # before anything else runs on a CPU
        self.batch = random_batch(self.setup, self.vocab_size)
        remedies = memory.training_remedies(config, len(devices))
        # compiled for the abstract state: checked before it exists; XLA:TPU refuses what cannot fit here
        with (
            sharding.activate(self.mesh),
            memory.refusing_out_of_memory("the train step", devices, remedies, (self.setup.abstract_state, self.batch)),
        ):
            start = time.perf_counter()
            self.step = train.jit_train_step(self.setup).lower(self.setup.abstract_state, self.batch).compile()
            self.compile_s = time.perf_counter() - start
        self.memory_check = (
            memory.preflight("the train step", [self.step], devices, config.memory_limit_gib, remedies)
            if config.memory_check
            else None
        )
        self.state = train.init_state(self.setup)

    def run(self, n: int) -> list[float]:
        """Seconds of each of n steps, each to block_until_ready of the new state and metrics."""
        seconds = []
        with sharding.activate(self.mesh):
            for _ in range(n):
                start = time.perf_counter()
                self.state, self.metrics = jax.block_until_ready(self.step(self.state, self.batch))
                seconds.append(time.perf_counter() - start)
        return seconds

    def result(self, seconds: list[float]) -> dict:
        tokens, median = self.config.tokens_per_step, statistics.median(seconds)
        flops = flops_per_token(self.setup.model_config)
        causal_flops = flops_per_token(self.setup.model_config, causal_half=True)
        tokens_per_s = tokens / median
        peak, peak_source = hardware.best_peak_flops(self.devices, self.peak, flops * tokens_per_s), self.peak_source
        if self.devices[0].platform == "cpu":
            peak_source += ", the best of before and after the timed steps (and of the step itself)"
        memory_bytes, memory_source = step_peak_memory(self.devices, self.step)
        # Measured after the memory is read: the matmul's own arrays (2 x 128 MiB on a chip) would be the
        # allocator's peak for a small model (they were, on the v5e: 259.8 MiB against a 142 MiB state).
        # On a CPU, `peak` is that measurement already.
        measured_peak, measured_source = hardware.measured_peak_flops(self.devices, peak)
        # Muon's Newton-Schulz matmuls: real work, but not the model's; MFU leaves them out
        optimizer_flops = optimizer.flops_per_step(self.setup.abstract_state["params"], self.config)
        return {
            "params": count_params(self.setup.model_config),
            "active_params": active_params(self.setup.model_config),
            "vocab_size": self.vocab_size,
            "mesh": dict(self.mesh.shape),
            "tokens_per_step": tokens,
            "step_s": seconds,
            "min_s": min(seconds),
            "median_s": median,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_best": tokens / min(seconds),
            "flops_per_token": flops,
            "achieved_flops": flops * tokens_per_s,
            "peak_flops": peak,
            "peak_source": peak_source,
            "mfu": flops * tokens_per_s / peak if peak else None,
            "measured_peak_flops": measured_peak,
            "measured_peak_source": measured_source,
            "mfu_measured": flops * tokens_per_s / measured_peak,
            # the same, with causal attention counted as half of the T x T square (MaxText's count)
            "flops_per_token_causal_half": causal_flops,
            "mfu_causal_half": causal_flops * tokens_per_s / peak if peak else None,
            "mfu_measured_causal_half": causal_flops * tokens_per_s / measured_peak,
            "optimizer": self.config.optimizer,
            "optimizer_flops_per_step": optimizer_flops,
            "optimizer_flops_share": optimizer_flops / (optimizer_flops + flops * tokens),
            "peak_memory_bytes": memory_bytes,
            "memory_source": memory_source,
            "compiled_memory": memory.compiler_memory(self.step, self.devices[0].platform),
            "backend_memory_stats": [d.memory_stats() for d in self.devices[:1]],
            "compile_s": self.compile_s,
            "final_loss": float(self.metrics["loss"]),
            "memory_check": self.memory_check,
            "quantization_note": quantization_note(self.config.quantization, self.devices[0]),
        }


def bench_train(config, options: Options, devices) -> dict:
    bench = TrainBench(config, devices)
    bench.run(options.warmup)
    result = bench.result(bench.run(options.steps))
    if options.profile:  # after the timed steps, so tracing costs them nothing
        with jax.profiler.trace(options.profile, create_perfetto_trace=True):
            bench.run(PROFILE_STEPS)
        trace, hlo_text = newest_trace(options.profile), bench.step.as_text()
        result["profile"] = {
            "dir": options.profile,
            "traced": f"{PROFILE_STEPS} traced steps",
            "per": "step",
            "top_operations": top_operations(trace, PROFILE_STEPS, hlo_text),
            "step_summary": step_summary(trace, PROFILE_STEPS, hlo_text),
            "platform": devices[0].platform,
        }
    if config.quantization != "none":  # the speed-up is measured, not assumed: time the float step too
        del bench  # one train state on the devices at a time
        unquantized = TrainBench(dataclasses.replace(config, quantization="none"), devices)
        unquantized.run(options.warmup)
        result["unquantized_median_s"] = statistics.median(unquantized.run(options.steps))
        result["speedup_vs_unquantized"] = result["unquantized_median_s"] / result["median_s"]
    return result


PROFILE_STEPS = 3


def self_times(events) -> list[tuple[object, float]]:
    """(event, ns) of each event of one line without the time of the events inside it (a loop's body
    ops count once, as themselves, not again in the loop)."""
    out, stack = [], []  # stack: (end, index in out) of the open enclosing events
    for event in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        start, end = event.start_ns, event.start_ns + event.duration_ns
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:  # inside the innermost open event: its own time shrinks by this one's
            out[stack[-1][1]][1] -= end - start
        out.append([event, end - start])
        stack.append((end, len(out) - 1))
    return [(event, ns) for event, ns in out]


def hlo_operations(hlo_text: str) -> dict[str, str]:
    """{instruction name: 'shape kind (the JAX operation it came from)'} of a compiled program's HLO text,
    which names the operations as the trace does."""
    described = {}
    for line in hlo_text.splitlines():
        match = INSTRUCTION.match(line)
        if match:
            name, shape, kind, _ = match.groups()
            source = re.search(r'op_name="([^"]*)"', line)
            origin = source.group(1).removeprefix("jit(train_step)/") if source else ""
            described[name] = f"{re.sub(r'{[^}]*}', '', shape)} {kind}" + (f" ({origin})" if origin else "")
    return described


def top_operations(trace: str, steps: int, hlo_text: str = "", n: int = 10) -> list[dict]:
    """The n operations with the most device time in the trace (their own, per step), with their share
    of all the operations' time, how many times a step ran each, and what the program says it is."""
    totals, counts = {}, {}
    profile = jax.profiler.ProfileData.from_file(trace)
    for line in operation_lines(profile):
        for event, ns in self_times(line):
            name = operation_name(event.name)
            totals[name] = totals.get(name, 0.0) + ns
            counts[name] = counts.get(name, 0) + 1
    busy, described = sum(totals.values()) or 1.0, hlo_operations(hlo_text)
    top = sorted(totals, key=totals.get, reverse=True)[:n]
    return [
        {
            "name": name,
            "ms_per_step": totals[name] / steps / 1e6,
            "share": totals[name] / busy,
            "count_per_step": counts[name] / steps,
            "about": described.get(name, ""),
        }
        for name in top
    ]


def format_profile(profile: dict) -> str:
    ops = profile["top_operations"]
    rows = [
        f"  top operations by device time ({profile['traced']}, per {profile['per']}; trace in {profile['dir']}):",
        f"    {'ms/' + profile['per'].split()[-1]:>8} {'share':>6} {'runs/' + profile['per'].split()[-1]:>9}  operation",
    ]
    for op in ops:
        about = op["about"] if len(op["about"]) <= 140 else op["about"][:60] + "..." + op["about"][-77:]
        rows.append(
            f"    {op['ms_per_step']:>8.2f} {op['share']:>6.1%} {op['count_per_step']:>9g}  {op['name']}"
            + (f": {about}" if about else "")
        )
    return "\n".join(rows)


def format_train(r: dict) -> str:
    peak = f"{r['peak_flops'] / 1e12:,.3f} TFLOP/s ({r['peak_source']})" if r["peak_flops"] else r["peak_source"]
    memory = (
        f"{r['peak_memory_bytes'] / 2**20:,.1f} MiB ({r['memory_source']})"
        if r["peak_memory_bytes"] is not None
        else r["memory_source"]
    )
    rows = [
        ("ms/step (min / median)", f"{r['min_s'] * 1e3:,.2f} / {r['median_s'] * 1e3:,.2f}"),
        ("tokens/s (at median; at min)", f"{r['tokens_per_s']:,.0f}; {r['tokens_per_s_best']:,.0f}"),
        (
            "model FLOPs per token",
            f"{r['flops_per_token'] / 1e6:,.2f} M (6N + 12·L·T·d: attention's whole T x T square, as PaLM and "
            f"nanoGPT count it); {r['flops_per_token_causal_half'] / 1e6:,.2f} M (6N + 6·L·T·d: causal attention "
            f"halved, as MaxText counts it)",
        ),
        ("achieved", f"{r['achieved_flops'] / 1e12:,.3f} TFLOP/s (attention in full)"),
        ("peak", peak),
        (
            "MFU",
            f"{r['mfu']:.1%} attention in full (PaLM, nanoGPT); {r['mfu_causal_half']:.1%} causal attention halved "
            f"(MaxText)"
            if r["mfu"] is not None
            else "unknown (no peak for this device)",
        ),
        (
            "MFU vs a matmul measured now",
            f"{r['mfu_measured']:.1%} (in full), {r['mfu_measured_causal_half']:.1%} (halved) of "
            f"{r['measured_peak_flops'] / 1e12:,.3f} TFLOP/s ({r['measured_peak_source']})",
        ),
        (
            "optimizer FLOPs per step",
            f"{r['optimizer_flops_per_step'] / 1e9:,.3f} G = "
            f"{r['optimizer_flops_share']:.1%} of the step's, not in MFU (Newton-Schulz: {optimizer.NS_STEPS} "
            f"x (4·m²·n + 2·m³) per m x n matrix, m <= n)"
            if r["optimizer"] == "muon"
            else f"not counted ({r['optimizer']}: elementwise only)",
        ),
        ("peak memory per device", memory),
        (
            "compiled step's need",
            f"{r['compiled_memory']['total'] / 2**20:,.1f} MiB per device (memory_analysis: "
            f"arguments + outputs not donated + temporaries + code)",
        ),
        ("compile", f"{r['compile_s']:.1f} s"),
        ("quantized matmuls", r["quantization_note"]),
    ]
    if "speedup_vs_unquantized" in r:
        rows.append(
            (
                "speed-up vs --quantization=none",
                f"{r['speedup_vs_unquantized']:.2f}x (median "
                f"{r['median_s'] * 1e3:,.2f} vs {r['unquantized_median_s'] * 1e3:,.2f} ms, timed after it)",
            )
        )
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
    if "profile" not in r:
        return table
    step_flops = r["flops_per_token"] * r["tokens_per_step"]
    summary = format_step_summary(
        r["profile"]["step_summary"], step_flops, r["measured_peak_flops"], r["profile"]["platform"]
    )
    return "\n".join([table, format_profile(r["profile"]), *summary])


# ----------------------------------------------------------------------------- decode


def bench_decode(config, options: Options, devices) -> dict:
    new_tokens = decode_tokens(options, config.block_size)  # before any work: a bad flag fails at once
    vocab_size = bench_vocab_size(config)
    mesh = sharding.mesh_from_config(config, devices)
    setup = train.make_setup(config, mesh, vocab_size)
    bandwidth, bandwidth_source = hardware.peak_bandwidth(devices)
    peak, peak_source = hardware.peak_flops(devices)  # for the prefill's MFU
    params = train.init_state(setup)["params"]
    # Decoding's setup: the same model with its cache in kv_cache_dtype, the weights as sample.py holds them.
    setup = model_setup.model_setup(config, mesh, vocab_size, options.kv_cache_dtype)
    params = loader.serving_weights(setup, params, options.weight_dtype)
    mc = setup.model_config
    # The fewest bytes a token step can read: every weight once, as held (the position table is a
    # lookup of one row), plus each row's cache up to its position: keys and values of the KV heads
    # only (grouped-query attention), an int8 cache's scales included.
    weight_bytes = loader.weight_bytes(params) - (
        loader.weight_bytes(params["wpe"]) if mc.pos_embedding == "learned" else 0
    )
    cache_bytes_per_position = loader.kv_bytes_per_token(mc)
    rng = np.random.default_rng(0)
    P = options.prompt_len
    # A prefill is a forward pass over the prompts: a third of a train step's FLOPs per token (2N +
    # 4·L·P·d, attention counted over the whole P x P square as training's MFU counts it), less the
    # output layer's 2·V·d for all but each row's last token: the only one it runs for.
    output_layer_flops = 2 * mc.padded_vocab_size * mc.n_embd
    prefill_flops_per_token = flops_per_token(mc, P) / 3 - output_layer_flops * (1 - 1 / P)
    # Every batch's programs (those generate() runs) compiled and checked against the memory first,
    # so a batch that cannot fit is refused before any is timed.
    batches = []
    for batch_size in (int(s) for s in options.decode_batch.split(",")):
        prompts = rng.integers(0, vocab_size, (batch_size, P)).tolist()
        what = f"decoding a batch of {batch_size}"
        remedies = memory.decoding_remedies(batch_size, new_tokens, options.weight_dtype, mc.kv_cache_dtype)
        start = time.perf_counter()
        with memory.refusing_out_of_memory(what, devices, remedies, params):
            programs = generate.first_programs(setup, params, prompts, new_tokens, temperature=0.0)
        compile_s = time.perf_counter() - start
        check = (
            memory.preflight(what, programs, devices, config.memory_limit_gib, remedies)
            if config.memory_check
            else None
        )
        batches.append((batch_size, prompts, compile_s, check, programs))
    runs = []
    for batch_size, prompts, compile_s, check, programs in batches:
        run = lambda: generate.generate(setup, params, prompts, new_tokens, temperature=0.0)
        first = run()  # finds the programs compiled above
        out = [run() for _ in range(max(1, min(options.steps, 5)))]
        decode_s = [g.decode_s for g in out]
        steps = new_tokens - 1  # the prefill samples each row's first new token
        step_s = statistics.median(decode_s) / steps
        # Rows hold P+1 .. P+new_tokens-1 cached positions during the decode steps: their mean.
        mean_positions = P + new_tokens / 2
        bytes_per_step = weight_bytes + batch_size * mean_positions * cache_bytes_per_position
        prefill_s = statistics.median(g.prefill_s for g in out)
        prefill_tokens_per_s = batch_size * P / prefill_s
        # On a CPU the peak is measured, and a busy moment makes it low: the best of it, a new one and the achieved rate.
        peak = hardware.best_peak_flops(devices, peak, prefill_tokens_per_s * prefill_flops_per_token)
        runs.append(
            {
                "batch_size": batch_size,
                "prompt_len": P,
                "new_tokens": new_tokens,
                "compile_s": compile_s + first.compile_s,
                "prefill_s": prefill_s,
                "prefill_tokens_per_s": prefill_tokens_per_s,
                "prefill_mfu": prefill_tokens_per_s * prefill_flops_per_token / peak if peak else None,
                "decode_s": decode_s,
                "min_s": min(decode_s),
                "median_s": statistics.median(decode_s),
                "decode_tokens": out[0].decode_tokens,
                "step_s": step_s,
                "tokens_per_s": out[0].decode_tokens / statistics.median(decode_s),
                "bytes_per_step": bytes_per_step,
                "bandwidth": bytes_per_step / step_s,
                "roofline_fraction": bytes_per_step / step_s / bandwidth if bandwidth else None,
                "memory_check": check,
            }
        )
        if options.profile:  # after the timed runs; the prefill's operations are in it too, divided the same way
            directory = os.path.join(options.profile, f"decode_batch{batch_size}")
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                run()
            runs[-1]["profile"] = {
                "dir": directory,
                "traced": "one generate call",
                "per": "token step",
                "top_operations": top_operations(
                    newest_trace(directory), steps, "\n".join(program.as_text() for program in programs)
                ),
            }
    return {
        "params": count_params(mc),
        "vocab_size": vocab_size,
        "mesh": dict(mesh.shape),
        "weight_dtype": options.weight_dtype,
        "kv_cache_dtype": mc.kv_cache_dtype,
        "kv_bytes_per_token": cache_bytes_per_position,
        "weight_bytes": weight_bytes,
        "peak_bandwidth": bandwidth,
        "bandwidth_source": bandwidth_source,
        "prefill_flops_per_token": prefill_flops_per_token,
        "peak_flops": peak,
        "peak_source": peak_source,
        "runs": runs,
    }


def decode_tokens(options: Options, block_size: int) -> int:
    """The tokens each row generates: --new_tokens, or by default 128 cut to what the model's context
    leaves after the prompt (the timed loop runs inside one KV cache of block_size positions)."""
    P = options.prompt_len
    new_tokens = options.new_tokens or min(128, block_size - P)
    if new_tokens < 2 or P + new_tokens > block_size:
        given = f"--prompt_len + --new_tokens = {P} + {new_tokens}" if options.new_tokens else f"--prompt_len={P}"
        raise ValueError(
            f"{given} leaves no room in block_size {block_size} for 2 or more new tokens to time: "
            f"lower --prompt_len" + (" or --new_tokens" if options.new_tokens else "")
        )
    return new_tokens


def format_decode(r: dict) -> str:
    lines = [
        f"  weights read per token step: {r['weight_bytes'] / 2**20:,.1f} MiB ({r['weight_dtype']}), KV cache "
        f"{r['kv_bytes_per_token']:,} bytes per position ({r['kv_cache_dtype']}); peak bandwidth "
        + (
            f"{r['peak_bandwidth'] / 1e9:,.1f} GB/s ({r['bandwidth_source']})"
            if r["peak_bandwidth"]
            else r["bandwidth_source"]
        ),
        f"  prefill: {r['prefill_flops_per_token'] / 1e6:,.1f} MFLOPs per prompt token (2N + 4·L·P·d, the output layer once a row); peak "
        + (f"{r['peak_flops'] / 1e12:,.3f} TFLOP/s ({r['peak_source']})" if r["peak_flops"] else r["peak_source"]),
        f"  {'batch':>5} {'prefill ms':>10} {'prefill tok/s':>13} {'MFU':>6} {'ms/token step':>14} "
        f"{'tokens/s':>10} {'MiB/step':>9} {'GB/s':>8} {'roofline':>8} {'compile s':>9}",
    ]
    for run in r["runs"]:
        fraction = f"{run['roofline_fraction']:.1%}" if run["roofline_fraction"] is not None else "?"
        mfu = f"{run['prefill_mfu']:.1%}" if run["prefill_mfu"] is not None else "?"
        lines.append(
            f"  {run['batch_size']:>5} {run['prefill_s'] * 1e3:>10.1f} {run['prefill_tokens_per_s']:>13,.0f} "
            f"{mfu:>6} {run['step_s'] * 1e3:>14.3f} {run['tokens_per_s']:>10,.1f} "
            f"{run['bytes_per_step'] / 2**20:>9.1f} {run['bandwidth'] / 1e9:>8.1f} {fraction:>8} "
            f"{run['compile_s']:>9.1f}"
        )
    lines += [
        f"  batch {run['batch_size']}:\n" + format_profile(run["profile"]) for run in r["runs"] if "profile" in run
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def git_revision() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev + ("+dirty" if dirty else "")) if rev else "unknown"


QUICKSTART = ["config/shakespeare_char.py"]
# What bench.py measures when no config file or config key is given: the first of these whose
# programs the memory check lets run on this machine. On a CPU only the quickstart's model:
# GPT-2 124M may fit a large host's memory, but one of its steps takes minutes there.
DEFAULT_MODELS = {
    "cpu": [QUICKSTART],
    "accelerator": [
        ["config/gpt2_124m.py", "--gradient_accumulation_steps=1"],  # 16 x 1024 tokens a step
        ["config/gpt2_124m.py", "--batch_size=4", "--gradient_accumulation_steps=1"],
        QUICKSTART,
    ],
}


def default_models(platform: str) -> list[list[str]]:
    return DEFAULT_MODELS["cpu" if platform == "cpu" else "accelerator"]


def names_a_model(argv: list[str]) -> bool:
    """Whether argv has a config file or a config key; bench.py's own flags (--steps, --mode, ...) alone
    leave the model to bench.py."""
    own = {f.name for f in dataclasses.fields(Options)}
    return any(not arg.startswith("--") or arg[2:].partition("=")[0] not in own for arg in argv)


def run(argv: list[str]) -> dict:
    """Benchmark what argv names, or with no config given the largest default model that fits here."""
    if names_a_model(argv):
        return measure(argv)
    device = jax.devices()[0]
    here = os.path.dirname(os.path.abspath(__file__))

    def measure_default(model: list[str]) -> dict:
        if device.platform == "cpu":
            print(
                f"bench: no config given on a CPU: benchmarking {' '.join(model)}, the quickstart's model "
                f"(GPT-2 124M takes minutes a step on a CPU; pass a config, e.g. config/gpt2_124m.py, to "
                f"benchmark it)"
            )
        else:
            print(
                f"bench: no config given on {device.device_kind}: benchmarking {' '.join(model)}, the "
                f"largest of bench.py's default models not yet refused (a smaller one follows if it does "
                f"not fit; pass a config to benchmark another)"
            )
        return measure([os.path.join(here, model[0]), *model[1:], *argv])

    *larger, smallest = default_models(device.platform)
    for model, next_model in zip(larger, [*larger[1:], smallest]):
        try:
            return measure_default(model)
        except memory.DoesNotFit as e:
            print(f"bench: {' '.join(model)} does not fit this machine ({e}); trying {' '.join(next_model)}")
    return measure_default(smallest)


def measure(argv: list[str]) -> dict:
    """Parse flags, benchmark, print the table, append the JSON record."""
    options, config = configurator.load_with_options_or_exit(argv, Options, complete=hf.with_model_keys)
    if config.lora_rank and options.mode == "train":  # --weight_dtype=int8 is then the frozen base's (QLoRA)
        config = dataclasses.replace(config, weight_dtype=options.weight_dtype)
    if options.json:
        configurator.check_writable(options.json, "json")
    devices = jax.devices()[: options.devices or None]
    if options.mode == "train":
        result = bench_train(config, options, devices)
    else:  # the layers as sample.py and serve.py run them
        config = dataclasses.replace(config, **loader.SERVING_LAYERS)
        result = bench_decode(config, options, devices)
    mc = model_setup.model_config(config, result["vocab_size"], devices[0].platform)
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_revision(),
        "argv": argv,
        "mode": options.mode,
        "options": dataclasses.asdict(options),
        "jax": jax.__version__,
        "backend": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "n_devices": len(devices),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "config": {
            k: getattr(config, k)
            for k in (
                "n_layer",
                "n_head",
                "n_embd",
                "block_size",
                "batch_size",
                "gradient_accumulation_steps",
                "dtype",
                "remat_policy",
                "loss_chunks",
                "scan_layers",
                "pad_vocab_to_multiple",
                "dropout",
                "bias",
                "quantization",
            )
        },
        "attention": mc.attention,
        "padded_vocab_size": mc.padded_vocab_size,
    } | result
    what = ("train step" if options.mode == "train" else "decode") + f" of {' '.join(argv) or 'defaults'}"
    print(f"bench: {what}")
    load = f", load average {record['load_average']:.2f}" if record["load_average"] is not None else ""
    print(
        f"  {len(devices)} x {devices[0].device_kind} ({devices[0].platform}, jax {jax.__version__}), "
        f"mesh {' x '.join(f'{a}={n}' for a, n in result['mesh'].items())}{load}"
    )
    print(
        f"  model {describe_params(mc)}, {config.dtype}, remat {config.remat_policy}, "
        f"scan_layers {config.scan_layers}, vocab {mc.padded_vocab_size}, loss_chunks {config.loss_chunks}; "
        + (
            f"{config.gradient_accumulation_steps} x {config.batch_size} x {config.block_size} = "
            f"{config.tokens_per_step:,} tokens/step; {options.steps} timed steps after {options.warmup} "
            f"warm-up"
            if options.mode == "train"
            else f"prompt {options.prompt_len} + {result['runs'][0]['new_tokens']} new tokens per row, greedy"
        )
    )
    print(format_train(result) if options.mode == "train" else format_decode(result))
    if options.json:
        try:
            with open(options.json, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise configurator.ConfigError(
                f"--json={options.json}: could not append the record ({e.strerror})"
            ) from None
        print(f"  appended to {options.json}")
    return record


def main(argv: list[str]) -> None:
    """The command line: a bad flag or config is one line, no traceback."""
    hardware.keep_freed_host_memory()  # as train.py runs: before JAX starts its CPU backend
    try:
        run(argv)
    except configurator.ConfigError as e:
        sys.exit(f"config error: {e}")
    except (ValueError, sharding.MeshError, dataset.DataError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
