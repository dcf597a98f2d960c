"""Device mesh, the logical-to-mesh rules table, and host batches -> global arrays.

Six mesh axes, each a different way to split the work:
  stage   split the layer stack into pipeline stages (layers/pipeline.py: micro-batches flow through
          them; only activations travel, between neighbouring stages)
  data    replicate the parameters, split the batch (gradients are all-reduced)
  expert  split a mixture of experts' experts, and the batch elsewhere (tokens travel to
          their experts' devices and back: all-to-all)
  fsdp    split the batch *and* shard parameters/optimizer state (ZeRO-3: all-gather
          weights before use, reduce-scatter gradients)
  context split the sequence: each device holds T / context tokens of every row (activations
          and queries); attention gathers the keys and values over the axis (all-gather), or
          passes them round it (ring attention); the parameters are sharded over fsdp x context
          (the context devices gather them as fsdp's do)
  tensor  split attention heads and MLP hidden units (Megatron: activations all-reduced)
The model names its axes logically (model.py); RULES below is the only place where those
names meet the mesh. Needs only jax/flax/numpy, so it can be copied into another project.
"""

import contextlib
import math
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MESH_AXES = ("stage", "data", "expert", "fsdp", "context", "tensor")

# logical axis name -> mesh axis (or axes, or None = replicated)
RULES = (
    ("batch", ("data", "expert", "fsdp")),
    ("expert_batch", ("data", "fsdp")),  # the rows of the experts' buffers: `expert` splits the experts
    ("vocab", "tensor"),
    # parameters and optimizer state: split over the context devices too (they hold the same weights
    # and gather them as fsdp's do), so a long row's devices don't each keep a copy
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),  # a mixture of experts' expert axis (moe.MoE)
    ("layers", "stage"),  # a pipeline stage holds its layers (contiguous: GPipe; see layers/pipeline.py)
    ("stage", "stage"),  # the pipeline's per-stage activations
    ("qkv", None),
    ("head_dim", None),
    ("norm", None),  # small vectors (layer norms, biases of width n_embd) stay replicated
    ("seq", "context"),  # (B, T) arrays: rows over the batch axes, tokens over context
    ("tokens", ("data", "expert", "fsdp", "context")),  # activations (B*T, D): row-major, so the same split
    ("seq_table", None),
    ("embed_act", None),  # an activation's model width: not sharded between layers
)


class MeshError(ValueError):
    """The mesh shape does not fit the devices or the model; the message says which numbers."""


def resolve_mesh_shape(sizes: dict, n_devices: int) -> dict:
    """{axis: size} with the one size given as -1 filled in so that the product is the device
    count; in MESH_AXES order (an axis left out is 1)."""
    shape = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
    flags = "/".join(f"mesh_{axis}" for axis in MESH_AXES)
    unknown = [axis for axis, n in shape.items() if n == -1]
    if len(unknown) > 1:
        raise MeshError(f"only one of {flags} may be -1, got {shape}")
    if any(n == 0 or n < -1 for n in shape.values()):
        raise MeshError(f"mesh sizes must be >= 1 (or -1 for 'the rest'), got {shape}")
    if unknown:
        known = math.prod(n for n in shape.values() if n != -1)
        if n_devices % known:
            raise MeshError(f"mesh {shape}: {n_devices} devices are not divisible by {known}")
        shape[unknown[0]] = n_devices // known
    if math.prod(shape.values()) != n_devices:
        product = " x ".join(f"{axis}={n}" for axis, n in shape.items())
        raise MeshError(
            f"mesh {product} = {math.prod(shape.values())} devices, but there are {n_devices}; set one of {flags} to -1"
        )
    return shape


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    devices=None,
    dcn: tuple[int, int, int] = (1, 1, 1),
    expert: int = 1,
    dcn_expert: int = 1,
    stage: int = 1,
    dcn_stage: int = 1,
    context: int = 1,
    dcn_context: int = 1,
) -> jax.sharding.Mesh:
    """A (stage, data, expert, fsdp, context, tensor) mesh. `dcn` (data, fsdp, tensor), `dcn_expert` and
    `dcn_stage` multiply each axis across slices (or hosts).

    Within a slice devices talk over the fast interconnect (ICI/NVLink); between slices
    over the data-center network, which is ~10x slower. So the mesh sizes are per slice, and
    `dcn` says how many slices each axis spans: typically only `data` (one gradient
    all-reduce per step crosses the slow network), or `stage` (a pipeline sends only activations).
    """
    devices = jax.devices() if devices is None else devices
    dcn = dict(zip(("data", "fsdp", "tensor"), dcn), expert=dcn_expert, stage=dcn_stage, context=dcn_context)
    dcn_shape = tuple(dcn[axis] for axis in MESH_AXES)
    n_slices = math.prod(dcn_shape)
    if len(devices) % n_slices:
        raise MeshError(f"{len(devices)} devices can't form dcn mesh {dcn} ({n_slices} slices)")
    sizes = resolve_mesh_shape(
        dict(stage=stage, data=data, expert=expert, fsdp=fsdp, context=context, tensor=tensor), len(devices) // n_slices
    )
    ici = tuple(sizes.values())
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if n_slices == 1:
        try:
            return jax.make_mesh(ici, MESH_AXES, axis_types=axis_types, devices=devices)
        except NotImplementedError:  # a TPU torus (e.g. 4x4x4) with an axis of 8: split a physical axis
            grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
            return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)
    # Multi-slice TPU devices know their slice; elsewhere (GPU hosts) a process is a slice.
    by_process = len({getattr(d, "slice_index", 0) for d in devices}) < n_slices
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn_shape, devices, process_is_granule=by_process)
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)


def mesh_from_config(config, devices=None) -> jax.sharding.Mesh:
    """make_mesh with the sizes a run's config names: mesh_<axis> and dcn_<axis> (configurator.Config)."""
    return make_mesh(
        config.mesh_data,
        config.mesh_fsdp,
        config.mesh_tensor,
        devices,
        dcn=(config.dcn_data, config.dcn_fsdp, config.dcn_tensor),
        expert=config.mesh_expert,
        dcn_expert=config.dcn_expert,
        stage=config.mesh_stage,
        dcn_stage=config.dcn_stage,
        context=config.mesh_context,
        dcn_context=config.dcn_context,
    )


def initialize_distributed(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0) -> None:
    """Join the other processes of a multi-host run (JAX's runtime does the communication).

    Explicit arguments win; otherwise JAX's own cluster detection is used when the
    environment says there are several processes (SLURM, Open MPI, TPU pod slices).
    Must run before anything touches a JAX device.
    """
    if coordinator_address:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif _launched_as_several_processes():
        jax.distributed.initialize()


def _launched_as_several_processes() -> bool:
    env = os.environ
    return (
        int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or "," in env.get("TPU_WORKER_HOSTNAMES", "")
        or "JAX_COORDINATOR_ADDRESS" in env
    )


def check_model_fits_mesh(
    mesh,
    *,
    n_head: int,
    n_embd: int,
    batch_size: int,
    n_kv_head: int = 0,
    mlp_hidden: int = 0,
    n_experts: int = 0,
    n_layer: int = 0,
    microbatches: int = 1,
    layers_per_stage: int = 0,
) -> None:
    """Fail before compiling when the model's sizes can't be split the way the mesh asks.
    n_kv_head and mlp_hidden: 0 = GPT-2's (n_head, 4 * n_embd); n_experts: 0 = dense;
    microbatches and layers_per_stage: the pipeline's, when mesh_stage > 1."""
    tensor, expert = mesh.shape["tensor"], mesh.shape["expert"]
    if expert > 1 and (not n_experts or n_experts % expert):
        raise MeshError(
            f"mesh_expert={expert} splits a mixture of experts' experts, but n_experts={n_experts} "
            f"is not a multiple of it: use a mesh_expert that divides n_experts (or 1)"
        )
    if n_head % tensor:
        raise MeshError(f"n_head={n_head} is not divisible by mesh_tensor={tensor}")
    # model.py keeps each key/value head with its query heads; with fewer key/value heads than tensor
    # devices, every device holds all of them (their projection and cache replicated over tensor).
    if n_kv_head and n_kv_head % tensor and tensor % n_kv_head:
        raise MeshError(
            f"n_kv_head={n_kv_head} is not divisible by mesh_tensor={tensor}, nor mesh_tensor by it: "
            f"tensor splits the groups of query heads that share a key/value head (or replicates "
            f"the key/value heads when there are fewer); use a mesh_tensor that divides n_kv_head "
            f"or a multiple of it"
        )
    mlp_hidden = mlp_hidden or 4 * n_embd
    if mlp_hidden % tensor:
        raise MeshError(f"the MLP width {mlp_hidden} is not divisible by mesh_tensor={tensor}")
    rows, split = batch_shards(mesh), " x ".join(f"mesh_{a}" for a in BATCH_AXES)
    if batch_size % rows:
        raise MeshError(
            f"batch_size={batch_size} is not divisible by {split} = {rows}; use a batch_size "
            f"that is a multiple of {rows}"
        )
    stages = mesh.shape["stage"]
    if stages > 1:
        check_pipeline(stages, n_layer, batch_size, rows, split, microbatches, layers_per_stage)


def check_pipeline(
    stages: int, n_layer: int, batch_size: int, rows: int, split: str, microbatches: int, layers_per_stage: int
) -> None:
    if n_layer % stages:
        raise MeshError(
            f"n_layer={n_layer} is not divisible by mesh_stage={stages}: each pipeline stage "
            f"holds as many layers; use a mesh_stage that divides n_layer"
        )
    per_stage = layers_per_stage or n_layer // stages
    if n_layer % (stages * per_stage):
        raise MeshError(
            f"layers_per_stage={layers_per_stage}: n_layer={n_layer} is not a multiple of "
            f"mesh_stage x layers_per_stage = {stages * per_stage}; use a divisor of "
            f"{n_layer // stages} (or 0 for GPipe)"
        )
    if per_stage < n_layer // stages and microbatches < stages:
        raise MeshError(
            f"the circular pipeline (layers_per_stage={layers_per_stage} < n_layer / mesh_stage) "
            f"needs pipeline_microbatches >= mesh_stage={stages}, got {microbatches}"
        )
    if batch_size % (rows * microbatches):
        raise MeshError(
            f"batch_size={batch_size} can't be cut into pipeline_microbatches={microbatches} "
            f"of rows split {split} = {rows} ways; use a batch_size that is a multiple of "
            f"{rows * microbatches}"
        )


BATCH_AXES = dict(RULES)["batch"]


def batch_shards(mesh) -> int:
    """How many ways the batch is split: its rows go to data x expert x fsdp device groups."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def mesh_axes_for(logical_axes, rules=RULES):
    """PartitionSpec over mesh axes for a tuple of logical names."""
    table = dict(rules)
    return PartitionSpec(*(table[name] if name is not None else None for name in logical_axes))


def param_shardings(abstract_state, mesh, rules=RULES):
    """NamedShardings for an nnx.State of parameters, from their logical `out_sharding` metadata.

    A dimension that the mesh axes do not divide evenly (e.g. a vocabulary of 65 over
    tensor=2) is left replicated rather than padded: correct, just not split.
    """
    logical_specs = nnx.get_partition_spec(abstract_state)

    def to_sharding(spec: PartitionSpec, leaf) -> NamedSharding:
        axes = []
        for dim, mesh_axis in zip(leaf.shape, mesh_axes_for(spec, rules)):
            size = math.prod(mesh.shape[a] for a in _as_tuple(mesh_axis))
            axes.append(mesh_axis if dim % size == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*axes))

    return jax.tree.map(to_sharding, logical_specs, abstract_state, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _as_tuple(mesh_axis) -> tuple:
    if mesh_axis is None:
        return ()
    return mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)


def rules_without(mesh_axis: str, rules) -> tuple:
    """`rules` with `mesh_axis` taken out of every entry: inside a vmap with spmd_axis_name=mesh_axis,
    which splits the mapped dimension over it, no inner constraint may use it again."""
    return tuple((name, tuple(a for a in _as_tuple(axes) if a != mesh_axis) or None) for name, axes in rules)


def without_axes(named: NamedSharding, mesh_axes: tuple[str, ...]) -> NamedSharding:
    """`named` replicated over `mesh_axes`: each device holds what it held, whole along those axes."""
    spec = [tuple(a for a in _as_tuple(entry) if a not in mesh_axes) or None for entry in named.spec]
    return NamedSharding(named.mesh, PartitionSpec(*spec), memory_kind=named.memory_kind)


def batch_sharding(mesh) -> NamedSharding:
    """Token batches (B, T): rows split over every axis that splits the batch."""
    return NamedSharding(mesh, mesh_axes_for(("batch", "seq")))


@contextlib.contextmanager
def activate(mesh, rules=RULES):
    """Inside: jit sees `mesh`, and layers.constrain() resolves logical names with `rules`."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def local_batch_rows(sharding: NamedSharding, global_batch: int) -> np.ndarray:
    """The rows of a (B, ...) global batch that this process's devices hold, in order."""
    rows = set()
    tokens = len(sharding.device_set)  # any row length that `context` divides
    for index in sharding.addressable_devices_indices_map((global_batch, tokens)).values():
        rows.update(range(global_batch)[index[0]])
    return np.array(sorted(rows))


def global_batch(local_rows: np.ndarray, sharding: NamedSharding, global_shape) -> jax.Array:
    """Join every process's rows (from local_batch_rows) into one global jax.Array."""
    return jax.make_array_from_process_local_data(sharding, local_rows, global_shape)
