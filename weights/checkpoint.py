"""What a run keeps in out_dir: Orbax checkpoints of the train state, and the lock that makes
one run at a time its only writer.

    out_dir/lock                   held (flock) by the run writing here; the OS releases it when
                                   that process ends, however it ends (kill -9 included)
    out_dir/checkpoints/<step>/    params (a LoRA run's: its adapters), opt_state and meta (step, val loss,
                                   config, vocabulary; a LoRA run's base: where, and its weights' hash):
                                   Orbax writes a temporary folder and renames it when complete
    out_dir/checkpoints-damaged/   steps found unreadable at resume, moved aside, never deleted

The rules: a fresh run never writes into an out_dir that holds another run's checkpoints unless
told to (overwrite_out_dir); a save that Orbax skips is an error, not a message; a damaged
checkpoint is named, and the newest intact one is used instead.
"""

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from configurator import ROLES, Config, ConfigError, resume_values
from weights import hf


class CheckpointError(ValueError):
    """A missing, damaged or incompatible checkpoint, or an out_dir that can't be used; the
    message says what is wrong and what to do."""


def checkpoint_dir(out_dir: str) -> str:
    return os.path.abspath(os.path.join(out_dir, "checkpoints"))


# ----------------------------------------------------------------------------- the out_dir


class OutDirLock:
    """An exclusive flock on out_dir/lock, taken before anything in out_dir is written.

    The lock file is created empty and then left in place: its holder writes who it is into it
    (for the message another run shows), and the kernel drops the lock when the holder exits.
    """

    def __init__(self, out_dir: str):
        out_dir = os.path.abspath(out_dir)  # messages name the folder wherever the command ran
        self.path = os.path.join(out_dir, "lock")
        self.fd = None
        error = None
        if jax.process_index() == 0:  # one writer per run: process 0 speaks for it
            try:
                self._take(out_dir)
            except CheckpointError as e:
                error = e
        if not agree(error is None):  # the other processes stop too, instead of waiting for it
            raise error or CheckpointError(f"process 0 could not use out_dir {out_dir}: see its message")

    def _take(self, out_dir: str) -> None:
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise CheckpointError(f"out_dir {out_dir} is a file, not a directory: choose another --out_dir")
        try:
            os.makedirs(out_dir, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"can't write to out_dir {out_dir} ({e.strerror}): choose another --out_dir, or fix its permissions"
            ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            self.fd = None
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"can't lock {self.path} ({e.strerror})") from None
            raise CheckpointError(
                f"out_dir {out_dir} is in use by another training run "
                f"({self.holder() or 'it holds ' + self.path}): wait for it to "
                f"end, stop it, or choose another --out_dir"
            ) from None

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def claim(self) -> None:
        """Say who holds the lock (once every check has passed and the run really starts)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(
                self.fd,
                f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(),
                0,
            )

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def start_fresh(config: Config, log=print) -> None:
    """A run from scratch (or from pretrained weights) into out_dir: refuse to mix it with the
    checkpoints of an earlier run unless overwrite_out_dir says to delete them."""
    directory = checkpoint_dir(config.out_dir)
    steps = sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []
    if not steps:
        return
    if not config.overwrite_out_dir:
        raise CheckpointError(
            f"out_dir {os.path.abspath(config.out_dir)} holds checkpoints of an earlier run (steps "
            f"{', '.join(map(str, steps))}): continue it with --init_from=resume, choose another "
            f"--out_dir, or pass --overwrite_out_dir=True to delete them and start again"
        )
    if jax.process_index() == 0:
        for name in ("checkpoints", "checkpoints-damaged", "tensorboard"):
            shutil.rmtree(os.path.join(config.out_dir, name), ignore_errors=True)
        log(
            f"overwrite_out_dir: deleted the earlier run's checkpoints (steps "
            f"{', '.join(map(str, steps))}) and TensorBoard events in {os.path.abspath(config.out_dir)}"
        )
    sync("start_fresh")


def committed_steps_text(out_dir: str) -> str:
    """Which checkpoints are complete on disk (a save in flight is not: Orbax renames it into place
    when done), in words, for a message."""
    directory = checkpoint_dir(out_dir)
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []
    if not steps:
        return "no checkpoint had completed"
    if len(steps) == 1:
        return f"the checkpoint of step {steps[0]} is complete and kept"
    return f"the checkpoints of steps {', '.join(map(str, steps))} are complete and kept"


def sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- Orbax


def hide_orbax_echoes() -> None:
    """Orbax reports a failed read or write once to the caller, which turns it into one message,
    and again from its worker threads and event loops (absl errors, "Event loop is closed",
    coroutines never awaited), while training goes on or the interpreter shuts down. Those
    echoes are dropped; everything else still reaches the terminal. Idempotent."""
    if getattr(sys.unraisablehook, "hides_orbax", False):
        return
    previous_unraisable, previous_thread = sys.unraisablehook, threading.excepthook

    def unraisable(info):
        if not _is_orbax_echo(info.exc_value):
            previous_unraisable(info)

    def thread_exception(args):
        if not _is_orbax_echo(args.exc_value):
            previous_thread(args)

    unraisable.hides_orbax = True
    sys.unraisablehook, threading.excepthook = unraisable, thread_exception
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_not_from_orbax)
    # a failed write's serialization coroutines, finalized unawaited at shutdown (a warning, not an exception)
    warnings.filterwarnings("ignore", r"coroutine 'async_serialize.*' was never awaited", RuntimeWarning)


def _is_orbax_echo(exc) -> bool:
    if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
        return True
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _not_from_orbax(record: logging.LogRecord) -> bool:
    return "orbax" not in record.pathname and record.name != "asyncio"


def checkpoint_manager(config: Config, read_only=False) -> ocp.CheckpointManager:
    """Keeps the latest max_to_keep checkpoints plus the keep_best ones by val loss.

    A writer must hold the out_dir lock first: creating one deletes unfinished saves."""
    policies = ocp.checkpoint_managers
    keep = policies.AnyPreservationPolicy(
        [
            policies.LatestN(n=config.max_to_keep),
            policies.BestN(
                get_metric_fn=lambda m: m["val_loss"],
                reverse=True,
                n=config.keep_best,
                keep_checkpoints_without_metrics=False,
            ),
        ]
    )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=keep,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        create=False,
        cleanup_tmp_directories=not read_only,
    )
    hide_orbax_echoes()  # also read_only's two absl warnings about options it sets itself
    return ocp.CheckpointManager(checkpoint_dir(config.out_dir), options=options)


def save(manager, state: dict, meta: dict, val_loss: float | None) -> None:
    """Starts an asynchronous, atomic save of state at its step, with the checksums of what it
    writes in its meta; an error if Orbax declines."""
    step = int(state["step"])
    checksums = {name: checksums_of(state[name]) for name in ("params", "opt_state")}
    with write_errors(manager):  # also reports a failure of the previous async save
        saved = manager.save(
            step,
            metrics=None if val_loss is None else {"val_loss": val_loss},
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(state["params"]),
                opt_state=ocp.args.StandardSave(state["opt_state"]),
                meta=ocp.args.JsonSave({**meta, "step": step, "checksums": checksums}),
            ),
        )
    if not saved:  # Orbax skips a step that is not past the latest one in the directory
        raise CheckpointError(
            f"the checkpoint of step {step} was not saved: {manager.directory} "
            f"already holds step {manager.latest_step()}"
        )


def checksums_of(tree) -> dict:
    """{path: [sum, position-weighted sum]} of every array's bits as unsigned words, modulo 2^32:
    exact integer sums, so any sharding of the array gives the same numbers, and a flipped bit or
    a moved block of bytes changes them."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = _bit_sums([in_device_memory(leaf) for _, leaf in leaves])
    return {jax.tree_util.keystr(path): [int(a), int(b)] for (path, _), (a, b) in zip(leaves, sums)}


def in_device_memory(x: jax.Array) -> jax.Array:
    """x, copied to device memory if it lives in host memory (offload): XLA computes on neither mixed."""
    kind = getattr(x.sharding, "memory_kind", None)
    return x if kind in (None, "device") else jax.device_put(x, x.sharding.with_memory_kind("device"))


@jax.jit
def _bit_sums(arrays):
    def sums(x):
        words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
        position = jnp.arange(1, x.size + 1, dtype=jnp.uint32).reshape(x.shape)
        return jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * position, dtype=jnp.uint32)

    return [sums(x) for x in arrays]


def verify(name: str, tree, meta: dict) -> str | None:
    """What is wrong with a restored item, or None: its checksums against the meta's (checkpoints
    from before them: not checked), and for the parameters, values that are not finite."""
    expected = meta.get("checksums", {}).get(name)
    if expected is not None:
        for path, sums in checksums_of(tree).items():
            if expected.get(path) != sums:
                return f"{name}{path} does not match the checksum written with it"
    if name == "params":
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        for (path, _), finite in zip(leaves, _all_finite([in_device_memory(leaf) for _, leaf in leaves])):
            if not finite:
                return f"params{jax.tree_util.keystr(path)} holds values that are not finite (NaN or inf)"
    return None


@jax.jit
def _all_finite(arrays):
    return [jnp.isfinite(x).all() for x in arrays]


def wait(manager) -> None:
    with write_errors(manager):
        manager.wait_until_finished()


@contextlib.contextmanager
def write_errors(manager):
    """A failed write (e.g. a full disk) becomes one message. Orbax renames a checkpoint
    into place only once it is complete, so the earlier ones are untouched."""
    try:
        yield
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        reason = "No space left on device" if "No space left" in str(e) else str(e).split("\n")[0][:300]
        manager.reload()  # forget the step that failed
        latest = manager.latest_step()
        kept = (
            "no checkpoint had completed before it"
            if latest is None
            else f"the latest complete checkpoint (step {latest}) is intact"
        )
        raise CheckpointError(f"writing a checkpoint failed ({reason}); {kept}") from e


# ----------------------------------------------------------------------------- restoring


@dataclasses.dataclass
class Restored:
    step: int
    meta: dict  # step, val_loss, config, vocab_size, tokenizer (None before they were stored)
    items: dict  # 'params' (and 'opt_state') as arrays in the requested shardings


def restore_latest(manager, out_dir: str, abstract_for, log=print, move_damaged=True) -> Restored:
    """The newest checkpoint that reads back whole.

    abstract_for(meta) is called with a checkpoint's meta before any of its arrays is read: it
    checks the checkpoint suits the run (its CheckpointError is final) and returns the dict of
    ShapeDtypeStruct trees to restore into, with their shardings ('params' and, to resume
    training, 'opt_state'). An unreadable step is named and skipped for the next older one;
    when training (move_damaged) it is moved to out_dir/checkpoints-damaged, so that the
    resumed run's saves are not refused for lying behind it.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise CheckpointError(no_checkpoint_message(out_dir))
    damaged = []
    for step in steps:
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict) or "config" not in meta:
                raise ValueError("its meta item has no config")
        except Exception as e:  # Orbax and TensorStore raise many types for one unreadable file
            damaged.append((step, describe_damage(e)))
            continue
        abstract = abstract_for(meta)
        reason = "unreadable on another process"
        try:
            items = manager.restore(
                step,
                args=ocp.args.Composite(**{name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()}),
            )
            items = {name: items[name] for name in abstract}
            problems = list(filter(None, (verify(name, tree, meta) for name, tree in items.items())))
            readable, reason = not problems, (problems or [reason])[0]
        except Exception as e:
            if "is not compatible with the stored shape" in str(e):  # not damage: another model
                raise CheckpointError(
                    f"step {step} in {manager.directory} holds arrays of other "
                    f"shapes than this run's model ({str(e).split('. ')[0]}): "
                    f"the vocabulary or the model config differs"
                ) from None
            readable, reason = False, describe_damage(e)
        if not agree(readable):  # a collective: every process must come here for every step
            damaged.append((step, reason))
            continue
        if damaged:
            report_damage(manager, out_dir, damaged, step, log, move_damaged)
        return Restored(step, meta, items)
    listed = "; ".join(f"step {s}: {why}" for s, why in damaged)
    raise CheckpointError(
        f"every checkpoint in {manager.directory} is damaged ({listed}): "
        f"start again without --init_from=resume in another --out_dir"
    )


def no_checkpoint_message(out_dir: str) -> str:
    return f"no checkpoint in {checkpoint_dir(out_dir)}: train one first, or point --out_dir at a run that has one"


def agree(ok: bool) -> bool:
    """True only if `ok` holds on every process (e.g. each read its own part of a checkpoint)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


DAMAGE_MARKERS = ("DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION", "Truncated")  # TensorStore's


def describe_damage(e: Exception) -> str:
    """What failed, in whole sentences (a cut message can hide the file's name): the first
    TensorStore status line of the error or of the errors that caused it, which names the file,
    else the error's first sentence."""
    if isinstance(e, KeyError) and "not found in the checkpoint" in str(e):
        return str(e).strip("'\"").split(". Available")[0].replace('Item "', 'item "')
    if isinstance(e, json.JSONDecodeError):
        return f"a truncated or invalid JSON file ({e.msg})"
    chain = [e]
    while len(chain) < 10 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for error in chain:
        line = str(error).split("\n")[0]
        for marker in DAMAGE_MARKERS:
            if marker in line:
                return re.sub(r"\s*\[source locations=.*?\]", "", line[line.index(marker) :]).rstrip()
    return f"{type(e).__name__}: {str(e).split(chr(10))[0].split('. ')[0].rstrip('.')}"


def report_damage(manager, out_dir, damaged: list, intact_step: int, log, move: bool) -> None:
    names = ", ".join(f"step {s} ({why})" for s, why in damaged)
    if not move:
        log(f"warning: damaged checkpoint {names}; using step {intact_step}, the newest intact one")
        return
    aside = os.path.join(os.path.abspath(out_dir), "checkpoints-damaged")
    if jax.process_index() == 0:
        os.makedirs(aside, exist_ok=True)
        for step, _ in damaged:
            target = os.path.join(aside, str(step))
            if os.path.exists(target):
                target += f".{int(time.time())}"
            os.replace(os.path.join(str(manager.directory), str(step)), target)
    sync("report_damage")
    manager.reload()
    log(
        f"warning: damaged checkpoint {names}: moved to {aside}; resuming from step "
        f"{intact_step}, the newest intact one"
    )


def check_steps_left(step: int, config: Config) -> None:
    """The checkpoint restored (the newest intact one: a damaged newer one does not count) leaves
    steps to train."""
    if step >= config.max_iters and not config.eval_only:
        raise CheckpointError(
            f"the newest intact checkpoint in {os.path.abspath(config.out_dir)} is at step {step} and "
            f"max_iters is {config.max_iters}: nothing left to train. Raise --max_iters (and --lr_decay_iters) "
            f"to train on, or evaluate it with --eval_only=True"
        )


def checkpoint_meta(setup, tok) -> dict:
    """Stored with every checkpoint: enough to sample from it without the dataset."""
    return {
        "config": dataclasses.asdict(setup.config),
        "vocab_size": setup.model_config.vocab_size,
        "tokenizer": tok.describe() if tok else None,
    }


def saved_config(meta: dict) -> dict:
    """A checkpoint's config, with the vocabulary size its model has (the config may say 0: the dataset's)."""
    return {**meta["config"], "vocab_size": meta.get("vocab_size") or meta["config"].get("vocab_size", 0)}


# The model keys of the base model a LoRA run adapts (the others say what its adapters are).
BASE_MODEL_KEYS = tuple(k for k in ROLES["model"] if not k.startswith("lora_"))


def check_model(saved_values: dict, config: Config, keys=ROLES["model"]) -> None:
    """Every model key of the run equals the checkpoint's (train.py's command line takes them from
    there; a run started another way must give the same)."""
    saved = {k: saved_values.get(k, getattr(Config, k)) for k in keys}  # older checkpoints: defaults
    ours = {k: getattr(config, k) for k in keys}
    ours["vocab_size"] = config.vocab_size or saved["vocab_size"]  # 0: the dataset's, checked with its tokenizer
    differ = [f"{k}: checkpoint {saved[k]!r}, config {ours[k]!r}" for k in keys if saved[k] != ours[k]]
    if differ:
        raise CheckpointError(
            "the checkpoint's model differs from the config ("
            + "; ".join(differ)
            + "): leave these keys out, and a resumed run takes them from its checkpoint"
        )


def with_checkpoint_keys(values: dict) -> dict:
    """configurator's `complete` hook for init_from='resume': the model and compute keys not given
    come from the newest checkpoint in out_dir (configurator.resume_values). For init_from=another
    run's out_dir (a base to fine-tune), the base model's keys not given come from its checkpoint."""
    init_from = values.get("init_from", "scratch")
    if init_from != "resume" and not is_run_dir(init_from):
        return values
    saved = newest_saved_config(values.get("out_dir", Config.out_dir) if init_from == "resume" else init_from)
    if saved is None or init_from == "resume":
        return values if saved is None else resume_values(values, saved)
    base = {k: v for k, v in saved.items() if k in BASE_MODEL_KEYS}
    conflicts = [f"{k}={values[k]!r} (its: {base[k]!r})" for k in base if k in values and values[k] != base[k]]
    if conflicts:
        raise ConfigError(
            f"init_from={init_from} fine-tunes that run's model, and {', '.join(conflicts)} would be another "
            f"one: drop {'this key' if len(conflicts) == 1 else 'these keys'}"
        )
    return {**base, **values}


def is_run_dir(path: str) -> bool:
    """A nanomax run's out_dir (it has checkpoints/), as init_from may name one to fine-tune."""
    return os.path.isdir(os.path.join(path, "checkpoints"))


def newest_meta(out_dir: str) -> dict | None:
    """The meta stored with the newest checkpoint that reads back, None if there is none. Read as the
    plain JSON file Orbax's JsonSave writes: this runs before JAX starts (a multi-process run may not
    touch JAX before jax.distributed.initialize)."""
    directory = checkpoint_dir(out_dir)
    steps = (
        sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True) if os.path.isdir(directory) else []
    )
    for step in steps:
        try:
            with open(os.path.join(directory, str(step), "meta", "metadata"), encoding="utf-8") as f:
                meta = json.load(f)
            saved_config(meta)
            return meta
        except (OSError, ValueError, KeyError, TypeError):
            continue  # damaged: restore_latest names it, and takes the next one
    return None


def newest_saved_config(out_dir: str) -> dict | None:
    """The config stored with the newest checkpoint whose meta reads back, None if there is none."""
    meta = newest_meta(out_dir)
    return None if meta is None else saved_config(meta)


def load_pretrained(setup, directory: str, abstract_params=None) -> dict:
    """Parameters from the Hugging Face model in `directory`, in the run's shardings (of
    abstract_params: by default the setup's): each process reads from the files only the blocks its
    devices hold, so the whole model is never on one device (nor, unless replicated, in one process)."""
    try:
        model = hf.read_config(directory)
        # vocab_size=0 in the config means "the dataset's": the model's own is compared
        hf.check_config(dataclasses.replace(setup.config, vocab_size=setup.model_config.vocab_size), model, directory)
        as_stored = dataclasses.replace(
            setup.model_config,
            vocab_size=model.keys["vocab_size"],
            pad_vocab_to_multiple=1,
            block_size=model.max_context,
        )
        weights = hf.Weights(directory, as_stored)
    except (OSError, hf.HFError) as e:
        raise CheckpointError(f"init_from={setup.config.init_from}: {e}") from None

    def load(path, abstract):
        path = tuple(k.key for k in path)
        return jax.make_array_from_callback(
            abstract.shape, abstract.sharding, lambda index: weights.read(path, abstract.shape, index)
        )

    return jax.tree_util.tree_map_with_path(load, setup.abstract_params if abstract_params is None else abstract_params)


# ----------------------------------------------------------------------------- a LoRA run's base


def load_base(setup, init_from: str, abstract_params: dict, log=print) -> dict:
    """The float32 parameters (abstract_params: their shapes and shardings, no adapters) of the model a
    run fine-tunes: the newest checkpoint of a nanomax run's out_dir, or a Hugging Face model."""
    if not is_run_dir(init_from):
        return load_pretrained(setup, hf.resolve(init_from), abstract_params)

    def abstract_for(meta):
        saved = saved_config(meta)
        if saved.get("lora_rank"):
            raise CheckpointError(
                f"init_from={init_from} is a LoRA run: export its merged model with export_hf.py and fine-tune "
                f"that (LoRA on LoRA is not built)"
            )
        check_model(saved, setup.config, BASE_MODEL_KEYS)
        return {"params": abstract_params}

    manager = checkpoint_manager(Config(out_dir=init_from), read_only=True)
    try:
        restored = restore_latest(manager, init_from, abstract_for, log=log, move_damaged=False)
    finally:
        manager.close()
    return restored.items["params"]


def base_hash(params: dict) -> str:
    """A fingerprint of a model's weights: sha256 of their exact bit sums (checksums_of), the same
    whatever the sharding and whichever files or checkpoint they were read from."""
    text = json.dumps(sorted(checksums_of(params).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def base_record(init_from: str, params: dict) -> dict:
    """What a LoRA run's checkpoints say of the base its adapters were trained on."""
    where = init_from if not os.path.isdir(init_from) else os.path.abspath(init_from)
    return {"init_from": where, "hash": base_hash(params)}


def check_base(record: dict, params: dict, what: str) -> None:
    """The base loaded for a LoRA checkpoint is the one its adapters were trained on."""
    found = base_hash(params)
    if found != record["hash"]:
        raise CheckpointError(
            f"{what} holds LoRA adapters trained on the base model at {record['init_from']} with weights "
            f"{record['hash']}, but the weights there now are {found}: restore that base, or train new "
            f"adapters on this one in another --out_dir"
        )


def step_array(step: int, sharding) -> jax.Array:
    return jax.device_put(jnp.asarray(step, jnp.int32), sharding)
