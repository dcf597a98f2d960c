"""Train a GPT on a device mesh.

    python train.py config/shakespeare_char.py            # the CPU-sized default
    python train.py config/gpt2_124m.py --batch_size=16   # GPT-2 small, as in the paper
    python train.py config/shakespeare_char.py --overfit_batch=True   # sanity check

The core is two pure functions, `train_step(state, batch)` and `eval_step(params, batch)`,
built by `make_train_step` / `make_eval_step` and jitted once with explicit shardings.
compile_aot.py and bench.py build and run exactly these functions.
"""

import ctypes
import dataclasses
import faulthandler
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import checkpoint
import configurator
import sharding
import tokenizer
from checkpoint import CheckpointError
from configurator import Config
from hf_gpt2 import load_hf_gpt2
from model import GPT, GPTConfig, count_params, flops_per_token


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


class DataError(ValueError):
    """A missing or malformed dataset; the message names the file and the prepare script."""


class TrainingError(RuntimeError):
    """Training can't go on (e.g. the loss became NaN); the message says what was kept."""


# ----------------------------------------------------------------------------- data

def dataset_dir(config: Config) -> str:
    return os.path.join(config.data_dir, config.dataset)


def _prepare_hint(config: Config) -> str:
    return f"run `{tokenizer.prepare_command(dataset_dir(config))}`"


def dataset_tokenizer(config: Config) -> tokenizer.Tokenizer | None:
    """The tokenizer in the dataset's meta.json; None where there is none and the config
    gives vocab_size itself."""
    if config.vocab_size and not os.path.exists(os.path.join(dataset_dir(config), "meta.json")):
        return None
    try:
        return tokenizer.load_tokenizer(dataset_dir(config))
    except (OSError, ValueError) as e:
        raise DataError(str(e)) from None


def read_vocab_size(config: Config) -> int:
    """vocab_size from the config, or else from the dataset's meta.json."""
    return config.vocab_size or dataset_tokenizer(config).vocab_size


def open_split(config: Config, split: str, vocab_size: int) -> np.ndarray:
    """Memory-map data/<dataset>/<split>.bin (uint16 tokens) after checking every token."""
    path = os.path.join(dataset_dir(config), f"{split}.bin")
    if not os.path.isfile(path):
        raise DataError(f"{path} not found: {_prepare_hint(config)}")
    n_bytes = os.path.getsize(path)
    if n_bytes == 0 or n_bytes % 2:
        raise DataError(f"{path} has {n_bytes} bytes, not a whole number of uint16 tokens: "
                        f"{_prepare_hint(config)} again")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if len(tokens) < config.block_size + 2:
        raise DataError(f"{path} holds {len(tokens)} tokens, fewer than block_size+2 = "
                        f"{config.block_size + 2}: lower --block_size or add data")
    bad = first_token_at_least(tokens, vocab_size)
    if bad is not None:
        raise DataError(f"{path} holds token id {tokens[bad]} >= vocab_size {vocab_size} (at token "
                        f"{bad:,}): the file does not match meta.json (another tokenizer, or "
                        f"damaged); {_prepare_hint(config)} again")
    return tokens


def first_token_at_least(tokens: np.ndarray, limit: int, chunk: int = 1 << 26) -> int | None:
    """Index of the first token >= limit, or None. Every token is read, a chunk at a time
    (~0.1 s per GB from the page cache), so one bad id can't become a NaN at some step."""
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        if part.max() >= limit:
            return start + int(np.argmax(part >= limit))
    return None


SPLIT_STREAMS = {"train": 0, "val": 1}  # separate random streams per split


def batch_for_step(tokens: np.ndarray, config: Config, step: int, split: str, rows: np.ndarray,
                   n_micro: int, stream: int = 0):
    """Inputs and targets (n_micro, len(rows), T) for one step: a pure function of (seed, step).

    Every process draws the same global offsets and keeps only its own `rows`, so a
    resumed or re-sharded run sees exactly the batches of an uninterrupted one.
    """
    rng = np.random.default_rng((config.seed, SPLIT_STREAMS[split], stream, step))
    T = config.block_size
    starts = rng.integers(0, len(tokens) - T - 1, size=(n_micro, config.batch_size))[:, rows]
    window = starts[..., None] + np.arange(T + 1)
    seq = tokens[window].astype(np.int32)
    return seq[..., :-1], seq[..., 1:]


# ----------------------------------------------------------------------------- state

def make_mesh(config: Config, devices=None) -> jax.sharding.Mesh:
    return sharding.make_mesh(config.mesh_data, config.mesh_fsdp, config.mesh_tensor, devices,
                              dcn=(config.dcn_data, config.dcn_fsdp, config.dcn_tensor))


def model_config(config: Config, vocab_size: int, platform: str) -> GPTConfig:
    """The model's half of the config, for devices of `platform` ('cpu', 'gpu', 'tpu')."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "attention"}
    return GPTConfig(vocab_size=vocab_size, attention=attention_implementation(config, platform),
                     **{k: getattr(config, k) for k in fields})


def attention_implementation(config: Config, platform: str) -> str:
    """'auto' means cuDNN's fused attention where it exists (NVIDIA GPUs, bfloat16), else XLA's."""
    if config.attention == "cudnn" and platform != "gpu":
        raise configurator.ConfigError(f"attention='cudnn' needs NVIDIA GPUs, but this run's devices are "
                                       f"{platform}; use attention='auto' or 'xla'")
    if config.attention == "auto":
        return "cudnn" if platform == "gpu" and config.dtype == "bfloat16" else "xla"
    return config.attention


def learning_rate(config: Config, step):
    """Linear warmup to learning_rate, cosine decay to min_lr at lr_decay_iters, then flat."""
    if not config.decay_lr:
        return jnp.asarray(config.learning_rate, jnp.float32)
    step = jnp.asarray(step, jnp.float32)
    warmup = config.learning_rate * (step + 1) / (config.warmup_iters + 1)
    progress = (step - config.warmup_iters) / max(1, config.lr_decay_iters - config.warmup_iters)
    cosine = 0.5 * (1 + jnp.cos(math.pi * jnp.clip(progress, 0.0, 1.0)))
    decayed = config.min_lr + cosine * (config.learning_rate - config.min_lr)
    return jnp.where(step < config.warmup_iters, warmup, decayed)


def decays(path, _) -> bool:
    """Weight decay on matrices and embeddings; never on biases or norm scales."""
    name = path[-1].key
    return name.endswith("kernel") or name in ("wte", "wpe")


def make_optimizer(config: Config) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=lambda count: learning_rate(config, count),
        b1=config.beta1, b2=config.beta2, weight_decay=config.weight_decay,
        mask=lambda params: jax.tree_util.tree_map_with_path(decays, params),
    )
    if config.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
    return adamw


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything that describes the computation but holds no arrays."""
    config: Config
    model_config: GPTConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    state_shardings: dict  # {'params', 'opt_state', 'step'} -> NamedSharding trees
    abstract_state: dict  # the same tree of ShapeDtypeStructs (with shardings)

    @property
    def batch_sharding(self):  # (B, T)
        return sharding.batch_sharding(self.mesh)

    @property
    def micro_batch_sharding(self):  # (micro-steps, B, T): micro-steps are not split
        spec = jax.sharding.PartitionSpec(None, *self.batch_sharding.spec)
        return jax.sharding.NamedSharding(self.mesh, spec)


def make_setup(config: Config, mesh, vocab_size: int) -> Setup:
    """Shapes and shardings of the train state, derived without allocating it."""
    gpt_config = model_config(config, vocab_size, mesh.devices.flat[0].platform)
    sharding.check_model_fits_mesh(mesh, n_head=config.n_head, n_embd=config.n_embd,
                                   batch_size=config.batch_size, n_kv_head=gpt_config.kv_heads,
                                   mlp_hidden=gpt_config.mlp_hidden_size)
    abstract_model = nnx.eval_shape(lambda: GPT(gpt_config, jax.random.key(0)))
    graphdef, abstract_params = nnx.split(abstract_model)
    param_shardings = nnx.to_pure_dict(sharding.param_shardings(abstract_params, mesh))
    abstract_params = nnx.to_pure_dict(abstract_params)
    optimizer = make_optimizer(config)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt_state,
                                          param_shardings, transform_non_params=lambda _: replicated)
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    abstract = {"params": abstract_params, "opt_state": abstract_opt_state,
                "step": jax.ShapeDtypeStruct((), jnp.int32)}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return Setup(config, gpt_config, mesh, graphdef, optimizer, shardings, abstract)


def init_state(setup: Setup) -> dict:
    """A fresh train state, created directly in its sharded layout (never whole on one device)."""
    def init():
        model = GPT(setup.model_config, jax.random.key(setup.config.seed))
        params = nnx.to_pure_dict(nnx.state(model))
        return {"params": params, "opt_state": setup.optimizer.init(params),
                "step": jnp.zeros((), jnp.int32)}

    with sharding.activate(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)()


def cross_entropy(setup: Setup, params, x_BxT, y_BxT, dropout_key=None):
    logits_BxTxV = nnx.merge(setup.graphdef, params)(x_BxT, dropout_key)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, y_BxT).mean()


def make_train_step(setup: Setup):
    """train_step(state, (x, y)) -> (state, metrics), with x, y of shape (micro-steps, B, T)."""
    config = setup.config

    def train_step(state, batch):
        x_AxBxT, y_AxBxT = batch
        params = state["params"]
        step_key = jax.random.fold_in(jax.random.key(config.seed), state["step"])
        grad_fn = jax.value_and_grad(lambda p, x, y, k: cross_entropy(setup, p, x, y, k))

        def micro_step(grad_sum, inputs):
            x_BxT, y_BxT, i = inputs
            key = jax.random.fold_in(step_key, i) if config.dropout > 0 else None
            loss, grads = grad_fn(params, x_BxT, y_BxT, key)
            grads = jax.lax.with_sharding_constraint(grads, setup.state_shardings["params"])
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        # Gradient accumulation as a scan: one compiled loop, not one dispatch per micro-step.
        zeros = jax.tree.map(jnp.zeros_like, params)
        n_micro = x_AxBxT.shape[0]
        grad_sum, losses = jax.lax.scan(micro_step, zeros, (x_AxBxT, y_AxBxT, jnp.arange(n_micro)))
        grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
        loss, grad_norm = losses.mean(), optax.tree.norm(grads)
        updates, opt_state = setup.optimizer.update(grads, state["opt_state"], params)
        # A non-finite step leaves parameters and optimizer state as they were, so a NaN
        # can never reach a checkpoint; nan_policy decides whether training goes on.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {"params": keep_if_bad(optax.apply_updates(params, updates), params),
                     "opt_state": keep_if_bad(opt_state, state["opt_state"]),
                     "step": state["step"] + 1}
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                   "lr": learning_rate(config, state["step"])}
        return new_state, metrics

    return train_step


def make_eval_step(setup: Setup):
    return lambda params, batch: cross_entropy(setup, params, *batch)


def jit_train_step(setup: Setup):
    micro_batches = setup.micro_batch_sharding
    return jax.jit(make_train_step(setup), donate_argnums=0,
                   in_shardings=(setup.state_shardings, (micro_batches, micro_batches)),
                   out_shardings=(setup.state_shardings, setup.state_shardings["step"]))


def jit_eval_step(setup: Setup):
    return jax.jit(make_eval_step(setup),
                   in_shardings=(setup.state_shardings["params"], (setup.batch_sharding,) * 2),
                   out_shardings=setup.state_shardings["step"])  # replicated: every host can read it


# ----------------------------------------------------------------------------- speed

# Dense bf16 peak FLOP/s per chip, from the vendors' datasheets.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v4": 275e12,
              "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
              "TPU v6e": 918e12}


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


def peak_flops(devices) -> tuple[float | None, str]:
    """Peak FLOP/s of all `devices` together, and where the number comes from."""
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":  # simulated CPU devices share the host's cores
        return measure_cpu_peak_flops(), "measured f32 matmul on this host"
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops * len(devices), f"{name} datasheet bf16 x {len(devices)}"
    return None, f"unknown peak for '{kind}'"


# ----------------------------------------------------------------------------- checkpoints

def start_state(setup: Setup, tok, log) -> tuple:
    """(checkpoint manager, train state): resumed from out_dir, or fresh (from scratch or from
    pretrained weights) in an out_dir that holds no other run. The out_dir lock is held."""
    config = setup.config
    if config.init_from != "resume":
        checkpoint.start_fresh(config, log)
        manager = checkpoint.checkpoint_manager(config)
        state = init_state(setup)
        if config.init_from != "scratch":  # a Hugging Face GPT-2 directory: fine-tune it
            state["params"] = load_pretrained(setup)
        return manager, state
    def abstract_for(meta):
        check_resumable(meta, config, tok)
        return {k: setup.abstract_state[k] for k in ("params", "opt_state")}

    manager = checkpoint.checkpoint_manager(config)
    try:
        restored = checkpoint.restore_latest(manager, config.out_dir, abstract_for, log=log)
    except BaseException:
        manager.close()
        raise
    step = checkpoint.step_array(restored.step, setup.state_shardings["step"])
    return manager, {**restored.items, "step": step}


def check_resumable(meta: dict, config: Config, tok) -> None:
    """The checkpoint's model and vocabulary are this run's, and it has steps left to train."""
    checkpoint.check_model_shape(meta["config"], config)
    saved = meta.get("tokenizer")  # absent in checkpoints older than the check
    if saved and tok and saved != tok.describe():
        raise CheckpointError(
            f"the checkpoint in {config.out_dir} was trained on a vocabulary of "
            f"{tokenizer.tokenizer_from_description(saved).summary()}, but "
            f"{dataset_dir(config)}/meta.json describes {tok.summary()}: resume with the dataset "
            f"it was trained on, or train this one from the start in another --out_dir")
    if meta["step"] >= config.max_iters and not config.eval_only:
        raise CheckpointError(
            f"the checkpoint in {config.out_dir} is at step {meta['step']} and max_iters is "
            f"{config.max_iters}: nothing left to train. Raise --max_iters (and --lr_decay_iters) "
            f"to train on, or evaluate it with --eval_only=True")


def checkpoint_meta(setup: Setup, tok) -> dict:
    """Stored with every checkpoint: enough to sample from it without the dataset."""
    return {"config": dataclasses.asdict(setup.config), "vocab_size": setup.model_config.vocab_size,
            "tokenizer": tok.describe() if tok else None}


def load_pretrained(setup: Setup) -> dict:
    """Parameters from the Hugging Face GPT-2 directory config.init_from, in this run's shardings."""
    try:
        params = load_hf_gpt2(setup.config.init_from, setup.model_config)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"init_from={setup.config.init_from}: {e}") from None
    return checkpoint.place(params, setup.state_shardings["params"])


# ----------------------------------------------------------------------------- the loop

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
                tag=tag, metadata=summary_pb2.SummaryMetadata(plugin_data=plugin),
                tensor=tensor_util.make_tensor_proto(np.array(text, dtype=object)))
            self.text_writer.add_event(event_pb2.Event(
                wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value])))
            self.text_writer.flush()

    def close(self):
        if self.writer:
            self.writer.close()
            self.text_writer.close()


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def show_progress(label: str, done: int, total: int, start: float) -> None:
    """A progress line on stderr, only for passes long enough (> 5 s) to need one."""
    elapsed = time.perf_counter() - start
    if elapsed > 5 and jax.process_index() == 0:
        eta = elapsed / done * (total - done)
        end = "\n" if done == total else ""
        print(f"\r{label} {done}/{total} | ETA {format_seconds(eta)}", end=end, file=sys.stderr, flush=True)


def estimate_losses(eval_step, params, splits: dict, setup: Setup, rows) -> dict:
    """Mean loss over eval_iters fixed batches of each split (the same batches every eval)."""
    config = setup.config
    losses = {}
    for split, tokens in splits.items():
        total, start = 0.0, time.perf_counter()
        for i in range(config.eval_iters):
            x, y = batch_for_step(tokens, config, i, split, rows, n_micro=1, stream=1)
            batch = tuple(sharding.global_batch(a[0], setup.batch_sharding, (config.batch_size,
                          config.block_size)) for a in (x, y))
            total += eval_step(params, batch)
            if (i + 1) % 10 == 0 or i + 1 == config.eval_iters:
                total = float(total)  # wait here now and then, so the progress line is honest
                show_progress(f"eval {split}", i + 1, config.eval_iters, start)
        losses[split] = float(total) / config.eval_iters
    return losses


class Preemption:
    """SIGTERM/SIGINT: finish the step, save, exit 0. A second Ctrl-C exits at once.

    On several hosts the signal may reach only some of them, so the processes agree
    (an all-gather of one flag) before anyone stops.
    """

    def __init__(self):
        self.signal_name = None
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            os._exit(130)  # immediate: committed checkpoints are complete, partial ones ignored
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        if jax.process_count() == 1:
            return self.signal_name is not None
        flags = multihost_utils.process_allgather(np.array(self.signal_name is not None))
        return bool(np.any(flags))

    def close(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def start_stack_dumps(config: Config):
    """Hang diagnostics: every process writes all Python thread stacks to out_dir, every
    stack_dump_interval seconds and whenever it receives SIGUSR1."""
    if not config.stack_dump_interval:
        return None
    os.makedirs(config.out_dir, exist_ok=True)
    dump = open(os.path.join(config.out_dir, f"stacks-process{jax.process_index()}.txt"), "a")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    faulthandler.dump_traceback_later(config.stack_dump_interval, repeat=True, file=dump)
    return dump


def train(config: Config, devices=None) -> list[tuple[int, float]]:
    """Run training as configured (on `devices`, default all); returns (step, loss) per logged step."""
    # Everything that can be wrong with the input is checked before anything is written.
    tok = dataset_tokenizer(config)
    vocab_size = config.vocab_size or tok.vocab_size
    splits = {s: open_split(config, s, vocab_size) for s in ("train", "val")}
    mesh = make_mesh(config, devices)
    setup = make_setup(config, mesh, vocab_size)
    train_step, eval_step = jit_train_step(setup), jit_eval_step(setup)
    if config.compiled_train_step:  # built by compile_aot.py; refused unless made for this run
        import compile_aot
        train_step = compile_aot.load_train_step(config.compiled_train_step, setup)
    if config.init_from == "resume" and not os.path.isdir(checkpoint.checkpoint_dir(config.out_dir)):
        raise CheckpointError(checkpoint.no_checkpoint_message(config.out_dir))
    lock = checkpoint.OutDirLock(config.out_dir)  # the one run writing to out_dir, or an error
    try:
        return train_loop(setup, splits, tok, lock, train_step, eval_step)
    finally:
        lock.release()


def train_loop(setup: Setup, splits: dict, tok, lock, train_step, eval_step) -> list[tuple[int, float]]:
    config, mesh = setup.config, setup.mesh
    manager, state = start_state(setup, tok, print if jax.process_index() == 0 else lambda *a: None)
    lock.claim()
    log = Logger(config)
    peak, peak_source = peak_flops(mesh.devices.flatten().tolist())
    print_summary(log, config, setup, splits, f"{peak / 1e12:.2f} TFLOP/s ({peak_source})"
                  if peak else peak_source)
    flops_token = flops_per_token(setup.model_config)
    if jax.process_index() == 0:
        _write_atomically(os.path.join(config.out_dir, "config.json"),
                          configurator.config_to_json(config))
    stack_dump_file = start_stack_dumps(config)
    preemption = Preemption()

    rows = sharding.local_batch_rows(setup.batch_sharding, config.batch_size)
    n_micro = config.gradient_accumulation_steps
    micro_shape = (n_micro, config.batch_size, config.block_size)
    history, best_val, n_skipped = [], float("inf"), 0
    pending_finite = []  # per-step "loss and gradients were finite" flags, read at log time
    start_step = step = int(state["step"])
    clock = StepClock(step, config.max_iters)
    profile_start, profile_stop = parse_profile_steps(config.profile_steps)

    meta = checkpoint_meta(setup, tok)

    def save(val_loss: float | None) -> None:
        if n_skipped == step - start_step:  # the parameters never changed: nothing worth keeping
            raise TrainingError(
                f"every step since step {start_step} was non-finite and skipped "
                f"(nan_policy=skip_step), so no checkpoint was saved. Check the data and lower "
                f"learning_rate")
        checkpoint.save(manager, state, meta | {"val_loss": val_loss}, val_loss)

    def check_finite():
        nonlocal n_skipped
        if not pending_finite:
            return
        finite = np.asarray(jnp.stack(pending_finite))
        first_bad = step - len(pending_finite) + int(np.argmin(finite))
        pending_finite.clear()
        if finite.all():
            return
        if config.nan_policy == "stop":
            raise TrainingError(
                f"non-finite loss or gradient norm at step {first_bad}; nothing from that step "
                f"on was saved (latest checkpoint: step {manager.latest_step()}). Lower "
                f"learning_rate, check the data, or use --nan_policy=skip_step")
        n_skipped += int((~finite).sum())

    try:
        with sharding.activate(mesh):
            while True:
                last = step >= config.max_iters
                if (step % config.eval_interval == 0 and step > start_step) or last or config.eval_only:
                    check_finite()
                    losses = estimate_losses(eval_step, state["params"], splits, setup, rows)
                    log.print(f"step {step} | train loss {losses['train']:.4f} | val loss {losses['val']:.4f}")
                    log.scalars(step, {"eval/train_loss": losses["train"], "eval/val_loss": losses["val"]})
                    if config.sample_tokens and tok and jax.process_count() == 1:
                        log.text(step, "samples", sample_for_log(setup, state["params"], splits, tok))
                    if config.eval_only:
                        break
                    if (losses["val"] < best_val or config.always_save_checkpoint or last) and step > start_step:
                        best_val = min(best_val, losses["val"])
                        log.print(f"saving checkpoint at step {step}")
                        save(losses["val"])
                    clock.restart(step)  # evaluation and saving are not billed to training steps
                if last:
                    break
                data_step = 0 if config.overfit_batch else step
                x, y = batch_for_step(splits["train"], config, data_step, "train", rows, n_micro)
                batch = tuple(sharding.global_batch(a, setup.micro_batch_sharding, micro_shape)
                              for a in (x, y))
                if step == profile_start:
                    jax.profiler.start_trace(os.path.join(config.out_dir, "profile"))
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, metrics = train_step(state, batch)
                pending_finite.append(metrics["finite"])
                step += 1
                if step == profile_stop:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    log.print(f"profile of steps {profile_start}..{profile_stop - 1} written to "
                              f"{config.out_dir}/profile (open it with TensorBoard's profile tab)")
                if step == start_step + 1:  # the first call compiles: keep it out of the step times
                    jax.block_until_ready(metrics)
                    clock.restart(step)
                if step % config.log_interval == 0 or step == config.max_iters:
                    check_finite()
                    loss, lr = float(metrics["loss"]), float(metrics["lr"])  # waits for the step
                    line = f"step {step - 1} | loss {loss:.4f} | lr {lr:.2e} | "
                    scalars = {"train/loss": loss, "train/lr": lr}
                    seconds = clock.seconds_per_step(step)
                    if seconds is None:  # only the compiling step since the last restart
                        line += f"compile + first step {clock.compile_seconds:.1f} s"
                    else:
                        tokens_per_s = config.tokens_per_step / seconds
                        mfu = flops_token * tokens_per_s / peak if peak else float("nan")
                        line += (f"{seconds * 1e3:.1f} ms | {tokens_per_s:,.0f} tok/s | mfu {mfu:.1%} | "
                                 f"{clock.elapsed()} elapsed, ETA {clock.eta(step, seconds)}")
                        scalars |= {"train/grad_norm": metrics["grad_norm"], "train/step_ms": seconds * 1e3,
                                    "train/tokens_per_sec": tokens_per_s, "train/mfu": mfu}
                    if n_skipped:
                        line += f" | skipped {n_skipped} non-finite steps"
                    log.print(line)
                    log.scalars(step - 1, scalars | {"train/skipped_steps": n_skipped})
                    history.append((step - 1, loss))
                if preemption.requested():
                    check_finite()
                    save(None)
                    checkpoint.wait(manager)
                    log.print(f"{preemption.signal_name}: saved a checkpoint at step {step}; "
                              f"continue with --init_from=resume")
                    break
        checkpoint.wait(manager)
    finally:
        preemption.close()
        manager.close()
        log.close()
        if stack_dump_file:
            faulthandler.cancel_dump_traceback_later()
            stack_dump_file.close()
    if config.sample_tokens and tok and jax.process_count() == 1 and not preemption.signal_name:
        print("sample:\n" + sample_for_log(setup, state["params"], splits, tok))
    return history


def sample_for_log(setup: Setup, params, splits: dict, tok) -> str:
    import sample  # sample.py imports this file: import it only when needed
    prompt = tok.decode(splits["val"][:1])  # one token, which every vocabulary can encode
    return sample.sample_text(setup, params, setup.config.sample_tokens, prompt, tokenizer=tok)[0]


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


def print_summary(log, config: Config, setup: Setup, splits: dict, peak: str) -> None:
    if log.is_main:
        print("config:")
        configurator.print_config(config)
    mesh = setup.mesh
    log.print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, mesh "
              + " x ".join(f"{a}={n}" for a, n in mesh.shape.items()))
    log.print(f"model: {count_params(setup.model_config):,} parameters, "
              f"{flops_per_token(setup.model_config) / 1e6:,.2f} MFLOP/token (train), vocab "
              f"{setup.model_config.vocab_size} (padded {setup.model_config.padded_vocab_size})")
    state_bytes = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                      for a in jax.tree.leaves(setup.abstract_state))
    log.print(f"memory per device: {state_bytes / 2**20:,.1f} MiB of parameters and optimizer "
              f"state, plus activations (compile_aot.py reports the compiler's total)")
    log.print(f"data: {len(splits['train']):,} train / {len(splits['val']):,} val tokens; "
              f"{config.tokens_per_step:,} tokens per step")
    log.print(f"peak: {peak}")
    resuming = " (resuming its latest checkpoint)" if config.init_from == "resume" else ""
    log.print(f"writing to {config.out_dir}{resuming}")


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> None:
    import compile_aot  # it imports this file, so not at the top; needed for its error type
    keep_freed_host_memory()
    config = configurator.load_config_or_exit(argv)
    try:
        sharding.initialize_distributed(config.coordinator_address, config.num_processes,
                                        config.process_id)
        train(config)
    except (configurator.ConfigError, DataError, CheckpointError, TrainingError, sharding.MeshError,
            compile_aot.AotError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
