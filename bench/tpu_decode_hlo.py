"""The decode program as the TPU compiler builds it, without a TPU: compile inference/generate.py's prefill and
decode for one TPU v5e chip on this CPU (libtpu's topology description, as compile_aot.py does) and
list the operations that make arrays of cache size, with their layouts, and XLA's memory analysis.

    pip install --target /tmp/libtpu libtpu==0.0.42.1     # once; not a project dependency
    PYTHONPATH=/tmp/libtpu python bench/tpu_decode_hlo.py 256 [--prompt_len=16] [--kv_cache_dtype=int8] [config flags]

What to look for (issue 52, bench/NOTES.md): a `copy` or a materialised `dynamic-slice` of the cache
inside the loop is bytes a step reads and writes on top of the roofline's, and so is an `entry copy` of
it (into the loop's layout and back, per call); the tiling in a layout (`T(8,128)` on the two minor
axes) says how much the cache is padded in memory. The cache (L, B, S, K·H) should stay
`{3,2,1,0:T(8,128)...}` throughout, (positions, K·H) minor: unpadded, and its one-token write a
`scatter_fusion` in that layout (XLA may print it flattened, [L·B·S, K·H]{1,0}); a scatter in
another layout (layers second-minor: {3,0,2,1}) means a relayout each step. The same libtpu on the
chip built the same program (the temporaries' size and the fusion names agreed with the chip's run).
Writes the optimized HLO of both programs to /tmp/tpu_decode_B*.hlo.
"""

import collections
import dataclasses
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu's lockfile would refuse a second process compiling at the same time
for key, value in (
    ("TPU_SKIP_MDS_QUERY", "1"),
    ("TPU_WORKER_HOSTNAMES", "localhost"),
    ("TPU_HOST_BOUNDS", "1,1,1"),
    ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
):
    os.environ.setdefault(key, value)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import configurator  # noqa: E402
import sharding  # noqa: E402
from common.model_setup import model_setup  # noqa: E402
from inference import generate, loader  # noqa: E402
from weights import hf  # noqa: E402

PROMPT, NEW = 16, 128  # bench.py's decode defaults
SERVING_FLAGS = ("--weight_dtype", "--kv_cache_dtype", "--prompt_len")


def compile_for_v5e(batch: int, flags: list[str]):
    serving = dict(f[2:].split("=", 1) for f in flags if f.split("=")[0] in SERVING_FLAGS)
    prompt = int(serving.get("prompt_len", PROMPT))
    config = configurator.load_config(
        [os.path.join(ROOT, "config/gpt2_124m.py"), *[f for f in flags if f.split("=")[0] not in SERVING_FLAGS]],
        complete=hf.with_model_keys,
    )
    config = dataclasses.replace(config, **loader.SERVING_LAYERS)  # as bench.py's decode and serving run it
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[:1]  # one chip
    mesh = sharding.make_mesh(1, 1, 1, devices=devices)
    setup = model_setup(config, mesh, 50257, serving.get("kv_cache_dtype", "auto"))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.eval_shape(
        lambda p: loader.serving_weights(setup, p, serving.get("weight_dtype", "auto")), setup.abstract_params
    )
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
    inputs = jax.tree.map(
        abstract,
        (
            params,
            jax.ShapeDtypeStruct((batch, prompt), jnp.int32),
            rows,
            rows,
            rows,
            key,
            jax.ShapeDtypeStruct((1,), jnp.int32),
        ),
    )
    length = min(prompt + NEW, config.block_size)
    return config, generate.compile_programs(setup, inputs, length, (0.0, 0, 1.0), True, 50257)


def big_operations(text: str, smallest: int) -> collections.Counter:
    """(where: entry or loop, operation, name, type with layout) of every top-level operation (not inside
    a fusion) whose result has at least `smallest` elements, counted."""
    fused = set(re.findall(r"(?:calls|to_apply)=(%[\w.-]+)", text))
    loop_bodies = set(re.findall(r"body=(%[\w.-]+)", text))
    found, computation = collections.Counter(), None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.-]+) ", line)
        if head and line.rstrip().endswith("{"):
            computation = head.group(1)
            continue
        m = re.match(r"(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\](\{[^}]*\})? ([\w-]+)\(", line.strip())
        if (
            computation in fused
            or not m
            or m.group(5) in ("parameter", "get-tuple-element", "tuple", "bitcast", "while")
        ):
            continue
        if np.prod([int(d) for d in m.group(3).split(",") if d] or [1]) >= smallest:
            name = re.sub(r"\.\d+(\.clone.*)?$", "", m.group(1))
            found[
                (
                    "loop" if computation in loop_bodies else "entry",
                    m.group(5),
                    name,
                    f"{m.group(2)}[{m.group(3)}]{m.group(4) or ''}",
                )
            ] += 1
    return found


def main(argv: list[str]) -> None:
    batch, flags = int(argv[0]), argv[1:]
    config, programs = compile_for_v5e(batch, flags)
    for name, program in zip(("prefill", "decode"), programs):
        with open(f"/tmp/tpu_decode_B{batch}_{name}.hlo", "w") as f:
            f.write(program.as_text())
        m = program.memory_analysis()
        print(
            f"{name}: arguments {m.argument_size_in_bytes / 2**20:,.1f} MiB, temporaries "
            f"{m.temp_size_in_bytes / 2**20:,.1f} MiB, aliased {m.alias_size_in_bytes / 2**20:,.1f} MiB"
        )
    head_size = config.n_embd // config.n_head
    layer_slice = batch * 32 * (config.n_kv_head or config.n_head) * head_size // 2
    print(f"decode: top-level operations on arrays of {layer_slice:,} elements or more (count, where, op, name, type):")
    for (where, op, name, shape), n in big_operations(programs[1].as_text(), layer_slice).most_common():
        print(f"  {n:3d}  {where:5s} {op:22s} {name:40s} {shape}")


if __name__ == "__main__":
    main(sys.argv[1:])
