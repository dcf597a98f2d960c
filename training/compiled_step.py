"""The file compile_aot.py --save writes and train.py --compiled_train_step loads: a compiled
train step, with a header saying exactly what it was compiled for.

    MAGIC line | JSON header (config, mesh, devices, JAX version, the program's inputs, outputs
    and hash, the executable's sha256) | the serialized executable

A step is loaded only for the run it was built for; any difference is named.
"""

import dataclasses
import hashlib
import json
import os

import jax
from jax.experimental import serialize_executable


class AotError(ValueError):
    """A topology or compiled step that can't be used; the message names the field and the fix."""


MAGIC = b"nanomax compiled train step v1\n"

# Config keys the compiled step does not depend on. Every other key is checked, including
# the learning-rate schedule, optimizer settings and seed, which are baked into the program.
NOT_IN_PROGRAM = (
    "dataset",
    "data_dir",  # the data; the vocabulary size it implies is checked instead
    "out_dir",
    "init_from",
    "overwrite_out_dir",
    "max_iters",
    "eval_interval",
    "eval_iters",
    "eval_only",
    "eval_tasks",
    "eval_tasks_limit",
    "log_interval",
    "always_save_checkpoint",
    "max_to_keep",
    "tensorboard",
    "sample_tokens",
    "overfit_batch",  # which batch is fed, not what the step does with it
    "mesh_data",
    "mesh_fsdp",
    "mesh_tensor",
    "mesh_expert",
    "mesh_stage",
    "mesh_context",  # the resolved mesh
    "dcn_data",
    "dcn_fsdp",
    "dcn_tensor",
    "dcn_expert",
    "dcn_stage",
    "dcn_context",  # and its devices are checked
    "keep_best",
    "stack_dump_interval",
    "coordinator_address",
    "num_processes",
    "process_id",
    "compiled_train_step",
    "memory_check",
    "memory_limit_gib",  # the pre-flight check before the step, not the step
)


def fingerprint(setup) -> dict:
    """What the program was built for, from the run's setup alone (cheap: nothing lowered)."""
    import jaxlib

    devices = setup.mesh.devices.flatten().tolist()
    config = {k: v for k, v in dataclasses.asdict(setup.config).items() if k not in NOT_IN_PROGRAM}
    return json.loads(
        json.dumps(
            config
            | {
                "vocab_size": setup.model_config.vocab_size,
                "mesh": " x ".join(f"{axis}={n}" for axis, n in setup.mesh.shape.items()),
                "device_kind": devices[0].device_kind,
                "device_count": len(devices),
                "mesh_device_ids": [d.id for d in devices],
                "jax": jax.__version__,
                "jaxlib": jaxlib.__version__,
            }
        )
    )


def program_fingerprint(lowered) -> dict:
    """The step's inputs, outputs and a hash of its program (catches edits to the code)."""

    def describe(tree):
        return [
            f"{jax.tree_util.keystr(path)} {leaf.dtype}{list(leaf.shape)}"
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        ]

    return {
        "inputs": describe(lowered.in_avals),
        "outputs": describe(lowered.out_info),
        "program_sha256": hashlib.sha256(lowered.as_text().encode()).hexdigest(),
    }


def save(compiled, lowered, setup, path: str) -> None:
    """Writes the compiled step, with what it was built for, atomically to path."""
    payload, _, _ = serialize_executable.serialize(compiled)
    header = fingerprint(setup) | program_fingerprint(lowered)
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()  # damage is caught before loading
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(MAGIC + json.dumps(header).encode() + b"\n" + payload)
        os.replace(path + ".tmp", path)
    except OSError as e:  # a full disk, a read-only folder: no half-written file is left behind
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise AotError(f"could not write {path} ({e.strerror}); nothing was saved") from None


def check(path: str, compiled_for: dict, given: dict) -> None:
    differ = []
    for key, value in given.items():
        was = compiled_for.get(key)
        if was == value:
            continue
        if isinstance(value, list) and isinstance(was, list):  # name the first difference
            i = next((i for i, (a, b) in enumerate(zip(was, value)) if a != b), min(len(was), len(value)))
            key, was, value = f"{key}[{i}]", *(x[i] if i < len(x) else "nothing" for x in (was, value))
        if key == "program_sha256":
            differ.append("the program differs (train.py or model.py changed since it was compiled)")
        else:
            differ.append(f"{key} compiled {was}, given {value}")
    if differ:
        raise AotError(
            f"{path} was compiled for another run: {'; '.join(differ)}. Compile it again "
            f"with this config (compile_aot.py --save={path}) or drop --compiled_train_step"
        )


def load(path: str, setup, lower):
    """The saved executable as train_step(state, batch) -> (state, metrics), if it fits this run.
    lower() gives this run's lowered step (train.lower), needed only once the cheap checks pass."""
    try:
        with open(path, "rb") as f:
            magic, header, payload = f.readline(), f.readline(), f.read()
    except FileNotFoundError:
        raise AotError(f"{path} not found: make it with compile_aot.py --save={path}") from None
    if magic != MAGIC and not MAGIC.startswith(magic):
        raise AotError(f"{path} is not a train step saved by compile_aot.py")
    try:
        if magic != MAGIC or not header.endswith(b"\n"):
            raise ValueError("it ends before its header does")
        compiled_for = json.loads(header)
        if not isinstance(compiled_for, dict):
            raise ValueError("its header is not a JSON object")
    except ValueError as e:  # json's errors, bytes that are not UTF-8, and the above
        raise damaged(path, str(e)) from None
    digest = hashlib.sha256(payload).hexdigest()
    if compiled_for.get("payload_sha256", digest) != digest:  # older files carry no checksum
        raise damaged(path, "its executable does not match the checksum in its header")
    check(path, compiled_for, fingerprint(setup))
    lowered = lower()  # seconds, not the minutes of a compile
    check(path, compiled_for, program_fingerprint(lowered))
    devices = setup.mesh.devices.flatten().tolist()  # in the mesh's order, as when it was compiled
    return serialize_executable.deserialize_and_load(
        payload, lowered.in_tree, lowered.out_tree, devices[0].client, execution_devices=devices
    )


def damaged(path: str, why: str) -> AotError:
    return AotError(
        f"{path} is damaged or incomplete ({why}): rebuild it with compile_aot.py "
        f"<this run's config and flags> --save={path}"
    )
