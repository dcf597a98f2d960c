"""Watching a training run: the log (stdout and TensorBoard), step timing, the profiler
window, preemption signals and hang diagnostics. train.py's loop uses these;
none of them changes what is computed.
"""

import faulthandler
import math
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

import configurator
from common.progress import format_seconds
from configurator import Config
from model import adapter_params, count_params, describe_params, flops_per_token


class Logger:
    """stdout on process 0, plus TensorBoard scalars and text under out_dir (no TensorFlow)."""

    def __init__(self, config: Config):
        self.is_main = jax.process_index() == 0
        self.writer = self.text_writer = None
        if self.is_main and config.tensorboard:
            from tensorboard.summary import Writer
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            logdir = os.path.join(config.out_dir, "tensorboard")
            self.writer = Writer(logdir)
            self.text_writer = EventFileWriter(logdir, filename_suffix=".text")

    def print(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def scalars(self, step: int, values: dict):
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, float(value), step)
            self.writer.flush()

    def text(self, step: int, tag: str, text: str):
        """A text summary, shown in TensorBoard's Text tab."""
        if self.text_writer:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.util import tensor_util

            plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
            value = summary_pb2.Summary.Value(
                tag=tag,
                metadata=summary_pb2.SummaryMetadata(plugin_data=plugin),
                tensor=tensor_util.make_tensor_proto(np.array(text, dtype=object)),
            )
            self.text_writer.add_event(
                event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value]))
            )
            self.text_writer.flush()

    def close(self):
        if self.writer:
            self.writer.close()
            self.text_writer.close()


class Preemption:
    """SIGTERM/SIGINT: finish the step, save, exit 0. A second Ctrl-C exits at once.

    On several hosts the signal may reach only some of them, so the processes agree
    (an all-gather of one flag) before anyone stops.
    """

    def __init__(self, kept=lambda: ""):
        """kept() says, on a second Ctrl-C, which checkpoints are kept."""
        self.signal_name, self.kept = None, kept
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            print(f"second Ctrl-C: stopped at once, without saving; {self.kept()}", file=sys.stderr, flush=True)
            os._exit(130)  # immediate: committed checkpoints are complete, partial ones ignored
        self.signal_name = signal.Signals(signum).name
        again = "; Ctrl-C again stops at once without saving" if signum == signal.SIGINT else ""
        # os.write: print could re-enter a write this handler interrupted
        os.write(2, f"{self.signal_name}: finishing this step, then saving{again}\n".encode())

    def requested(self) -> bool:
        if jax.process_count() == 1:
            return self.signal_name is not None
        flags = multihost_utils.process_allgather(np.array(self.signal_name is not None))
        return bool(np.any(flags))

    def close(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class StackDumps:
    """Hang diagnostics: every process writes all Python thread stacks to out_dir, every
    stack_dump_interval seconds and whenever it receives SIGUSR1."""

    def __init__(self, config: Config):
        self.file = None
        if config.stack_dump_interval:
            self.file = open(os.path.join(config.out_dir, f"stacks-process{jax.process_index()}.txt"), "a")
            faulthandler.register(signal.SIGUSR1, file=self.file, all_threads=True)
            faulthandler.dump_traceback_later(config.stack_dump_interval, repeat=True, file=self.file)

    def close(self):
        if self.file:
            faulthandler.cancel_dump_traceback_later()
            self.file.close()


class StepClock:
    """Seconds per training step between log lines; compiling and evaluating are kept out."""

    def __init__(self, step: int, max_iters: int):
        self.started = self.last_time = time.perf_counter()
        self.last_step, self.max_iters, self.compile_seconds = step, max_iters, 0.0

    def restart(self, step: int) -> None:
        now = time.perf_counter()
        if not self.compile_seconds:
            self.compile_seconds = now - self.last_time
        self.last_time, self.last_step = now, step

    def seconds_per_step(self, step: int) -> float | None:
        if step == self.last_step:
            return None
        now = time.perf_counter()
        seconds = (now - self.last_time) / (step - self.last_step)
        self.last_time, self.last_step = now, step
        return seconds

    def elapsed(self) -> str:
        return format_seconds(time.perf_counter() - self.started)

    def eta(self, step: int, seconds_per_step: float) -> str:
        return format_seconds((self.max_iters - step) * seconds_per_step)


def parse_profile_steps(text: str) -> tuple[int | None, int | None]:
    """'10:13' -> (10, 13): trace steps 10, 11 and 12. Checked by the configurator."""
    if not text:
        return None, None
    start, stop = text.split(":")
    return int(start), int(stop)


def print_summary(log, setup, splits: dict, peak: str) -> None:
    """What is about to run: the config, devices and mesh, model size, memory, data, peak."""
    config = setup.config
    if log.is_main:  # every key goes to out_dir/config.json and TensorBoard's Text tab
        print(
            f"config (the keys that differ from the defaults; all of them in "
            f"{os.path.abspath(os.path.join(config.out_dir, 'config.json'))}):"
        )
        configurator.print_config(config, changed_only=True)
    log.text(0, "config", f"```\n{configurator.config_to_json(config)}\n```")
    mesh = setup.mesh
    log.print(
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, mesh "
        + " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    )
    log.print(
        f"model: {describe_params(setup.model_config)}, "
        f"{flops_per_token(setup.model_config) / 1e6:,.2f} MFLOP/token (train), vocab "
        f"{setup.model_config.vocab_size} (padded {setup.model_config.padded_vocab_size})"
    )
    if config.lora_rank:
        trained, total = adapter_params(setup.model_config), count_params(setup.model_config)
        base = "int8 blocks" if config.weight_dtype == "int8" else config.dtype
        log.print(
            f"LoRA: rank {config.lora_rank} on {config.lora_targets}: {trained:,} parameters train "
            f"({trained / total:.2%} of the model), the base frozen in {base}"
        )
    state_bytes = sum(
        math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(setup.abstract_state)
    )
    whole_step = " (the whole step's need is on the memory line below)" if config.memory_check else ""
    log.print(f"parameters and optimizer state: {state_bytes / 2**20:,.1f} MiB per device{whole_step}")
    log.print(
        f"data: {len(splits['train']):,} train / {len(splits['val']):,} val tokens; "
        f"{config.tokens_per_step:,} tokens per step"
    )
    if hasattr(splits["train"], "row_start"):  # a fine-tuning set (dataset.ChatSplit)
        train = splits["train"]
        log.print(
            f"fine-tuning: {len(train.starts):,} train conversations in {len(train.row_start):,} rows "
            f"({'packed' if config.packing else 'one a row'}), {int(train.mask.sum()):,} tokens to learn"
        )
    log.print(f"peak: {peak}")
    resuming = " (resuming its latest checkpoint)" if config.init_from == "resume" else ""
    log.print(f"writing to {os.path.abspath(config.out_dir)}{resuming}")
