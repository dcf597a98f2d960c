"""Pipeline parallelism: the layer stack split into stages that micro-batches flow through.

The batch is cut into M micro-batches, the stack of L layers into S stages on the `stage`
mesh axis. Every tick each stage runs its layers on the micro-batch in front of it and hands
the result to the next stage, so after S - 1 ticks of filling all stages work at once:

    tick       0    1    2    3    4          GPipe, S = 2 stages, M = 4 micro-batches
    stage 0   m0   m1   m2   m3    .          (the idle slots are the "bubble":
    stage 1    .   m0   m1   m2   m3           (S-1) / (M+S-1) of each stage's time)

Circular (interleaved) schedule: with layers_per_stage P < L / S, stage s holds layers
[r·S·P + s·P, r·S·P + s·P + P) for each repeat r < R = L / (S·P), and a micro-batch goes round
the stages R times; the bubble shrinks to (S-1) / (R·M + S-1).

It is written as one program over all stages (no shard_map): a vmap over the stage axis runs
every stage's layers at once, and shifting the stages' outputs by one is the only traffic
between them (XLA makes it a collective permute over `stage`). Parameters keep the model's
(L, ...) layout, split over `stage` by their leading axis, so a checkpoint does not depend on
the stage count. Idle slots compute on stale activations and their results are dropped.
Needs only jax.
"""

import jax
import jax.numpy as jnp
import numpy as np


def repeats(n_layers: int, stages: int, layers_per_stage: int = 0) -> int:
    """How many times a micro-batch goes round the stages (1 = GPipe)."""
    return n_layers // (stages * (layers_per_stage or n_layers // stages))


def schedule(stages: int, microbatches: int, n_repeats: int = 1) -> np.ndarray:
    """(ticks, stages): the item each stage works on at each tick, -1 when idle. Item i is
    micro-batch i % M on its repeat i // M; stage s takes item t - s at tick t."""
    items = n_repeats * microbatches
    item_TxS = np.arange(items + stages - 1)[:, None] - np.arange(stages)
    return np.where((item_TxS >= 0) & (item_TxS < items), item_TxS, -1)


def bubble_fraction(stages: int, microbatches: int, n_repeats: int = 1) -> float:
    """The share of the stages' ticks spent idle (filling and draining the pipeline)."""
    return float((schedule(stages, microbatches, n_repeats) < 0).mean())


def run(
    layers_fn,
    stack,
    x_BTxD,
    batch_size: int,
    *,
    stages: int,
    microbatches: int,
    layers_per_stage: int = 0,
    constrain=lambda x, axes: x,
):
    """Run the (L, ...) `stack` of layers over x (B·T, D) as a pipeline of `stages` stages.

    layers_fn(x_NxD, layers, microbatch) runs a slice of the stack (leading axis: its layers)
    on one micro-batch's activations and returns (x_NxD, per-layer outputs with that leading
    axis). Returns (x (B·T, D), per-layer outputs (L, ...) averaged over the micro-batches).
    `constrain(x, logical axes)` pins shardings (layers.constrain); the stage axis is 'stage'.
    """
    S, M = stages, microbatches
    L = jax.tree.leaves(stack)[0].shape[0]
    R = repeats(L, S, layers_per_stage)
    P = L // (S * R)
    stack_RxSxP = jax.tree.map(lambda a: a.reshape(R, S, P, *a.shape[1:]), stack)

    # Micro-batch m holds rows m, m + M, m + 2M, ...: every device's share of the batch rows
    # is split evenly between the micro-batches, so cutting them moves no data.
    BT, D = x_BTxD.shape
    T, rows = BT // batch_size, batch_size // M
    micro_MxNxD = x_BTxD.reshape(rows, M, T, D).swapaxes(0, 1).reshape(M, rows * T, D)
    micro_MxNxD = constrain(micro_MxNxD, (None, "batch", "embed_act"))

    def one_stage(x_NxD, stage_stack_RxP, repeat, microbatch):
        repeat = repeat if R > 1 else 0  # GPipe: a static index, no gather of the stage's weights
        layers = jax.tree.map(lambda a: a[repeat], stage_stack_RxP)
        return layers_fn(x_NxD, layers, microbatch)

    all_stages = jax.vmap(one_stage, in_axes=(0, 1, 0, 0), spmd_axis_name="stage")

    def tick(carry, work):
        micro_MxNxD, last_SxNxD, out_sum = carry
        t, item_S = work  # stage s works on item_S[s]: micro-batch item % M on repeat item // M
        valid_S = item_S >= 0
        item_S = jnp.maximum(item_S, 0)
        # Stage 0 takes micro-batch t mod M (fresh, or back from the last stage for the next
        # repeat: it left there at tick t - M + S - 1 < t, as M >= S when R > 1); stage s > 0
        # takes what stage s - 1 made last tick.
        in_SxNxD = jnp.concatenate([micro_MxNxD[t % M][None], last_SxNxD[:-1]])
        in_SxNxD = constrain(in_SxNxD, ("stage", "batch", "embed_act"))
        out_SxNxD, outputs = all_stages(in_SxNxD, stack_RxSxP, item_S // M, item_S % M)
        done = item_S[-1] % M  # the last stage's result goes back to its micro-batch's slot
        micro_MxNxD = micro_MxNxD.at[done].set(jnp.where(valid_S[-1], out_SxNxD[-1], micro_MxNxD[done]))
        out_sum = jax.tree.map(  # per-layer outputs of the real (not idle) slots, summed
            lambda total, o: total.at[item_S // M, jnp.arange(S)].add(
                jnp.where(valid_S.reshape(-1, *[1] * (o.ndim - 1)), o, 0)
            ),
            out_sum,
            outputs,
        )
        return (micro_MxNxD, out_SxNxD, out_sum), None

    # The per-layer outputs' shapes, from one abstract stage run.
    _, abstract = jax.eval_shape(layers_fn, micro_MxNxD[0], jax.tree.map(lambda a: a[0, 0], stack_RxSxP), 0)
    out_sum = jax.tree.map(lambda a: jnp.zeros((R, S, *a.shape), a.dtype), abstract)
    last_SxNxD = jnp.zeros((S, *micro_MxNxD.shape[1:]), micro_MxNxD.dtype)
    work_TxS = schedule(S, M, R)
    (micro_MxNxD, _, out_sum), _ = jax.lax.scan(
        tick, (micro_MxNxD, last_SxNxD, out_sum), (jnp.arange(len(work_TxS)), jnp.asarray(work_TxS))
    )
    x_BTxD = micro_MxNxD.reshape(M, rows, T, D).swapaxes(0, 1).reshape(BT, D)
    return x_BTxD, jax.tree.map(lambda total: (total / M).reshape(L, *total.shape[3:]), out_sum)
