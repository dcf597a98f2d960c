"""Every attention implementation model.py can run, behind one signature, and the table that picks
one (ATTENTION and choose_attention, at the end): causal softmax attention written out, with its own
backward ('einsum': float32 scores, query blocks that skip the score tiles above the diagonal,
grouped-query heads, nanoGPT's dropout on the attention probabilities); XLA's and cuDNN's; JAX's
Pallas splash kernel on TPUs; ring attention for rows split over the context axis. Also the masks
and positions of packed rows (Segments: several examples in one row, told apart by segment ids) and
of rows in context parallelism's balanced order, and the remat policies that keep splash's
residuals. jax, flax and layers/blocks.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd
from jax.ad_checkpoint import checkpoint_name

from layers.blocks import constrain, sequence_axis, splits

try:  # JAX's TPU kernels; a JAX that lacks them (or moved them) leaves 'splash' unavailable, nothing else
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
except ImportError:
    splash = None


def causal_mask(start_B, T: int, S: int):
    """(B, 1, T, S): query t of row b (at position start_B[b] + t) sees keys at positions <= its own."""
    query_position_BxT = start_B[:, None] + jnp.arange(T)
    return (jnp.arange(S) <= query_position_BxT[:, :, None])[:, None]


def segment_positions(segment_ids_BxT):
    """Each token's position within its segment: 0 where a row starts or the id changes (segments
    are contiguous runs of one id), counting up from there."""
    T = segment_ids_BxT.shape[1]
    starts_BxT = jnp.concatenate(
        [jnp.ones_like(segment_ids_BxT[:, :1], bool), segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1
    )
    t_T = jnp.arange(T, dtype=jnp.int32)
    return t_T - jax.lax.cummax(jnp.where(starts_BxT, t_T, 0), axis=1)


def balanced_order(T: int, context: int) -> np.ndarray:
    """The row's token order for context parallelism's causal load balance: T cut into 2 x context
    chunks, and device i (which holds the i-th contiguous 1/context of the array) given chunks i and
    2·context-1-i. Under a causal mask a query at position t sees t + 1 keys, so the work of a chunk
    grows with its index: chunk i and its mirror 2c-1-i together do the same work on every device,
    where contiguous chunks would give the last device 2c-1 times the first one's. (MaxText's
    layout; striping token t to device t mod c balances too, but scatters every document.)"""
    chunks = np.arange(T).reshape(2 * context, T // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)])


def position_mask(position_BxT, segment_ids_BxT):
    """(B, 1, T, T): query t sees key s of its own segment at a position <= its own, for rows whose
    tokens are not in order (balanced_order), where array indices say nothing about positions."""
    visible = position_BxT[:, None, :] <= position_BxT[:, :, None]
    return (visible & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]))[:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Packed rows: ids_BxT (equal ids = one example; each example a contiguous run) and each token's
    position within its example, which the position embedding (wpe or RoPE) uses. in_order=False: the
    row's tokens are permuted (context parallelism's balanced_order), so attention's causal mask
    compares these positions instead of array indices."""

    ids_BxT: jax.Array
    position_BxT: jax.Array
    in_order: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @classmethod
    def of(cls, segment_ids_BxT) -> "Segments":
        ids_BxT = jnp.asarray(segment_ids_BxT, jnp.int32)
        return cls(ids_BxT, segment_positions(ids_BxT))


def permuted_segments(segment_ids_BxT, order_T, batch_size: int) -> Segments:
    """The Segments of rows whose tokens come in order_T (one segment per row without ids): the
    positions are counted in the rows' own order, then permuted as the tokens are."""
    T = len(order_T)
    ids_BxT = (
        jnp.zeros((batch_size, T), jnp.int32) if segment_ids_BxT is None else jnp.asarray(segment_ids_BxT, jnp.int32)
    )
    position_BxT = segment_positions(ids_BxT[:, np.argsort(order_T)])[:, order_T]
    return Segments(ids_BxT, position_BxT, in_order=False)


def same_segment(segment_ids_BxT, start: int, end: int, S: int):
    """(B, 1, end - start, S): query t in [start, end) and key s < S belong to the same segment."""
    return (segment_ids_BxT[:, start:end, None] == segment_ids_BxT[:, None, :S])[:, None]


def causal_attention(
    q_BxTxNxH,
    k_BxTxKxH,
    v_BxTxKxH,
    dropout_rate: float = 0.0,
    dropout_key=None,
    segment_ids_BxT=None,
    position_BxT=None,
):
    """Causal softmax attention written out ('einsum'), with its backward: scores in float32, heads shared
    by groups of G = N / K query heads (grouped-query: keys and values repeated per group). With a
    dropout_key, attention probabilities are dropped at dropout_rate (nanoGPT's attn_dropout). With
    segment ids (B, T), a query sees only the keys of its own segment. With positions (B, T) as well
    (tokens out of order: balanced_order), the causal mask compares them, over one T x T block."""
    G = q_BxTxNxH.shape[2] // k_BxTxKxH.shape[2]
    k_BxTxNxH, v_BxTxNxH = (jnp.repeat(x, G, axis=2) if G > 1 else x for x in (k_BxTxKxH, v_BxTxKxH))
    key = dropout_key if dropout_rate > 0 else None
    return _attend(
        q_BxTxNxH * q_BxTxNxH.shape[-1] ** -0.5, k_BxTxNxH, v_BxTxNxH, key, segment_ids_BxT, position_BxT, dropout_rate
    )


def attention_keep_mask(key, rate: float, shape_BxNxTxS):
    """Which attention probabilities survive dropout: drawn from the key alone, so the backward pass
    draws the same mask again instead of keeping it."""
    return jax.random.bernoulli(key, 1.0 - rate, shape_BxNxTxS)


def query_blocks(T: int) -> list[tuple[int, int]]:
    """[(start, end)] of the query blocks: block queries see keys [0, end) only, so the scores above
    the diagonal blocks are never computed (a quarter to three eighths of them; on XLA:CPU, where
    these small batched matmuls are slow, that beat one T x T block at every T measured, 64 to 1024)."""
    n = 1 if T < 32 else 2 if T <= 128 else 4
    bounds = [round(i * T / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, dropout_key, segment_ids_BxT, position_BxT, dropout_rate: float):
    return _attend_fwd(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, dropout_key, segment_ids_BxT, position_BxT, dropout_rate)[0]


def _dropped(p_BxNxCxS, keep_mask, start: int, end: int, rate: float):
    """The probabilities of query block [start, end) after dropout (unchanged without a mask)."""
    if keep_mask is None:
        return p_BxNxCxS
    return jnp.where(keep_mask[:, :, start:end, :end], p_BxNxCxS / (1.0 - rate), 0.0)


def _blocks(T: int, position_BxT):
    """The query blocks: one T x T block when the tokens are out of order (position_BxT given)."""
    return query_blocks(T) if position_BxT is None else [(0, T)]


def _attend_fwd(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, dropout_key, segment_ids_BxT, position_BxT, dropout_rate):
    # einsums straight on the projection's (B, T, N, H) layout: no transposed copies of q, k, v
    (B, T, N, _), S = q_BxTxNxH.shape, k_BxSxNxH.shape[1]
    keep_BxNxTxS = None if dropout_key is None else attention_keep_mask(dropout_key, dropout_rate, (B, N, T, S))
    outputs, probabilities = [], []
    for start, end in _blocks(T, position_BxT):
        s_BxNxCxS = jnp.einsum(
            "btnh,bsnh->bnts", q_BxTxNxH[:, start:end], k_BxSxNxH[:, :end], preferred_element_type=jnp.float32
        )
        visible = causal_mask(jnp.full(B, start), end - start, end)
        if position_BxT is not None:  # out of order: compare positions (and segments), not indices
            visible = position_mask(position_BxT, segment_ids_BxT)
        elif segment_ids_BxT is not None:  # packed rows: not the keys of other segments either
            visible = visible & same_segment(segment_ids_BxT, start, end, end)
        s_BxNxCxS = jnp.where(visible, s_BxNxCxS, -jnp.inf)
        p_BxNxCxS = jnp.exp(s_BxNxCxS - s_BxNxCxS.max(-1, keepdims=True))
        p_BxNxCxS = p_BxNxCxS / p_BxNxCxS.sum(-1, keepdims=True)
        used_BxNxCxS = _dropped(p_BxNxCxS, keep_BxNxTxS, start, end, dropout_rate)
        outputs.append(jnp.einsum("bnts,bsnh->btnh", used_BxNxCxS.astype(v_BxSxNxH.dtype), v_BxSxNxH[:, :end]))
        probabilities.append(p_BxNxCxS)
    o_BxTxNxH = jnp.concatenate(outputs, axis=1)
    return o_BxTxNxH, (q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, probabilities, o_BxTxNxH, dropout_key, position_BxT)


def _attend_bwd(dropout_rate, saved, do_BxTxNxH):
    """Softmax's backward needs rowsum(dP * P), which equals rowsum(dO * O) (FlashAttention's
    trick): a (B, T, N) reduction over H instead of one over the (B, N, T, T) scores. With dropout
    P is the dropped P' = P * mask / (1 - rate) in O and dV, and dP = dP' * mask / (1 - rate); the
    trick still holds, as rowsum(dP * P) = rowsum(dP' * P'). Masked scores (causal, other segments)
    have P = 0, so dS = P * (dP - delta) is 0 there without the mask."""
    q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, probabilities, o_BxTxNxH, dropout_key, position_BxT = saved
    (B, T, N, _), S = q_BxTxNxH.shape, k_BxSxNxH.shape[1]
    keep_BxNxTxS = None if dropout_key is None else attention_keep_mask(dropout_key, dropout_rate, (B, N, T, S))
    dtype, blocks = q_BxTxNxH.dtype, _blocks(T, position_BxT)
    delta_BxNxT = jnp.einsum("btnh,btnh->bnt", do_BxTxNxH, o_BxTxNxH, preferred_element_type=jnp.float32)
    dq_blocks, dk_blocks, dv_blocks = [], [0] * len(blocks), [0] * len(blocks)
    for i, ((start, end), p_BxNxCxS) in enumerate(zip(blocks, probabilities)):
        do_BxCxNxH = do_BxTxNxH[:, start:end]
        used_BxNxCxS = _dropped(p_BxNxCxS, keep_BxNxTxS, start, end, dropout_rate)
        dv_BxSxNxH = jnp.einsum("bnts,btnh->bsnh", used_BxNxCxS.astype(dtype), do_BxCxNxH)
        dp_BxNxCxS = jnp.einsum("btnh,bsnh->bnts", do_BxCxNxH, v_BxSxNxH[:, :end], preferred_element_type=jnp.float32)
        dp_BxNxCxS = _dropped(dp_BxNxCxS, keep_BxNxTxS, start, end, dropout_rate)
        ds_BxNxCxS = (p_BxNxCxS * (dp_BxNxCxS - delta_BxNxT[:, :, start:end, None])).astype(dtype)
        dq_blocks.append(jnp.einsum("bnts,bsnh->btnh", ds_BxNxCxS, k_BxSxNxH[:, :end]))
        dk_BxSxNxH = jnp.einsum("bnts,btnh->bsnh", ds_BxNxCxS, q_BxTxNxH[:, start:end])
        for j, (key_start, key_end) in enumerate(blocks[: i + 1]):  # keys [0, end), by block
            dk_blocks[j] += dk_BxSxNxH[:, key_start:key_end]
            dv_blocks[j] += dv_BxSxNxH[:, key_start:key_end]
    return (*(jnp.concatenate(parts, axis=1) for parts in (dq_blocks, dk_blocks, dv_blocks)), None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def ring_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, segment_ids_BxT, mesh_axis: str = "context"):
    """Causal attention with the row's tokens split over `mesh_axis` (ring attention): each device
    keeps its queries and its own keys and values, and the key/value blocks travel round the ring
    (ppermute), one step per device, while a running softmax (the largest score, the sum of
    exponentials, the weighted values) takes in each block. Scores exist one T/C x T/C block at a
    time, not T/C x T as when keys and values are all-gathered. The mask compares positions and
    segments (the tokens may be in balanced_order). Each step is rematerialised in the backward
    pass, so it keeps only the blocks and running sums, not the scores. Other mesh axes stay with
    the compiler (batch, heads)."""
    C = jax.sharding.get_abstract_mesh().shape[mesh_axis]
    G = q_BxTxNxH.shape[2] // k_BxTxKxH.shape[2]
    tokens = jax.sharding.PartitionSpec(None, mesh_axis)
    to_next = [(i, (i + 1) % C) for i in range(C)]  # the ring

    def local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, segment_ids_BxT):
        (B, T, N, H), K = q_BxTxNxH.shape, k_BxTxKxH.shape[2]
        q_BxTxKxGxH = (q_BxTxNxH * H**-0.5).reshape(B, T, K, G, H)  # query head k·G + g uses key head k

        @jax.checkpoint
        def take_in(carry, _):
            k_BxSxKxH, v_BxSxKxH, key_position_BxS, key_segment_BxS, max_BxKxGxT, sum_BxKxGxT, o_BxKxGxTxH = carry
            s_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
            visible = (
                (key_position_BxS[:, None, :] <= position_BxT[:, :, None])
                & (key_segment_BxS[:, None, :] == segment_ids_BxT[:, :, None])
            )[:, None, None]
            s_BxKxGxTxS = jnp.where(visible, s_BxKxGxTxS, -jnp.inf)
            # the first block is the device's own: every query sees itself there, so the max is finite after it
            new_max = jnp.maximum(max_BxKxGxT, s_BxKxGxTxS.max(-1))
            p_BxKxGxTxS = jnp.exp(s_BxKxGxTxS - new_max[..., None])
            rescale = jnp.exp(max_BxKxGxT - new_max)
            sum_BxKxGxT = sum_BxKxGxT * rescale + p_BxKxGxTxS.sum(-1)
            o_BxKxGxTxH = o_BxKxGxTxH * rescale[..., None] + jnp.einsum(
                "bkgts,bskh->bkgth", p_BxKxGxTxS.astype(v_BxSxKxH.dtype), v_BxSxKxH, preferred_element_type=jnp.float32
            )
            passed = [
                jax.lax.ppermute(a, mesh_axis, to_next)
                for a in (k_BxSxKxH, v_BxSxKxH, key_position_BxS, key_segment_BxS)
            ]
            return (*passed, new_max, sum_BxKxGxT, o_BxKxGxTxH), None

        # the running values start from q's own layout (one per device, split as q is)
        o_BxKxGxTxH = jnp.zeros_like(q_BxTxKxGxH, jnp.float32).transpose(0, 2, 3, 1, 4)
        sum_BxKxGxT = o_BxKxGxTxH[..., 0]
        start = (k_BxTxKxH, v_BxTxKxH, position_BxT, segment_ids_BxT, sum_BxKxGxT - jnp.inf, sum_BxKxGxT, o_BxKxGxTxH)
        (*_, sum_BxKxGxT, o_BxKxGxTxH), _ = jax.lax.scan(take_in, start, length=C)
        o_BxKxGxTxH = o_BxKxGxTxH / sum_BxKxGxT[..., None]
        return o_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q_BxTxNxH.dtype)

    return jax.shard_map(local, in_specs=(tokens,) * 5, out_specs=tokens, axis_names={mesh_axis})(
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, segment_ids_BxT
    )


# Splash's tiles by head size: (query block, key block, key block per compute step) of the forward and
# of the fused backward kernel (dq, dk and dv in one pass: ~1 ms a layer faster than the two kernels at
# GPT-2's shape). Each the fastest of those probed on a TPU v5e, one layer at a time (bench/NOTES.md):
# GPT-2's heads (64) at T=1024 took 4.0 ms forward and backward, against 5.0 with 512 everywhere and
# 8.6 with XLA's attention; Llama-style heads (128, GQA 16/8) at T=2048 6.2 ms, XLA's 24.3. Longer
# forward tiles for GPT-2's heads sped up the kernel alone but neither a training step nor a prefill.
# A block longer than T is cut to T; one that does not divide T is halved until it does.
SPLASH_BLOCKS = {
    64: dict(forward=(512, 512, 512), backward=(1024, 1024, 1024)),
    128: dict(forward=(1024, 1024, 512), backward=(1024, 1024, 512)),
    256: dict(forward=(1024, 1024, 256), backward=(512, 512, 512)),
}
SPLASH_MULTIPLE = 128  # the kernel's key blocks are multiples of the TPU's 128 lanes
# Rows longer than this go to the kernel padded to a multiple of it, so that its tiles stay this long
# (896 tokens would otherwise be cut to tiles of 128, each grid step's fixed cost ~0.45 us against
# ~0.03 us of products for GPT-2's heads: a v5e's prefill of 8 x 896 spent 25 of its 38.5 ms there).
# Causal: the padding's keys come after every real query, which never sees them.
SPLASH_PAD = 512
# Queries, keys and values of heads narrower than the 128 lanes go to the kernel as (H, T) tiles
# (SEQ_MINOR): as (T, H) each row is padded to 128 lanes in memory (GPT-2's 64: twice their bytes, in the
# layers' saved activations too). On a TPU v5e, keys and values so took GPT-2's layer from 4.03 to 3.84 ms;
# queries too, a GPT-2 step from 139.2 to 137.9 ms and its memory from 12.5 to 11.9 GiB (bench/NOTES.md).
# The name of splash's inputs and residuals (q, k, v, its output and log-sum-exp: B·T·(2N + 2K + 1)·H
# values a layer, about), which model.py's remat policies keep: recomputing them would run the forward
# kernel again in the backward pass (a GPT-2 124M step's profile on a TPU v5e showed it twice a layer,
# ~10 ms of a 179 ms step), and the projections' bias adds and q's scaling.
SPLASH_RESIDUALS = "splash_residuals"


def splash_fits(T: int) -> bool:
    """Whether the splash kernel takes rows of T tokens (else the caller writes attention out): rows of
    at least one 128-lane tile; shorter ones are cheaper written out than padded."""
    return splash is not None and T >= SPLASH_MULTIPLE


def splash_length(T: int) -> int:
    """The row length the kernel runs rows of T tokens at: T padded to a multiple of 128, or past
    SPLASH_PAD tokens to a multiple of SPLASH_PAD."""
    multiple = SPLASH_MULTIPLE if T <= SPLASH_PAD else SPLASH_PAD
    return -(-T // multiple) * multiple


def splash_block_sizes(T: int, head_size: int):
    """SPLASH_BLOCKS' tiles for rows of T tokens (a head size not in the table takes 128's), and the
    layout of queries, keys and values (SEQ_MINOR below 128 lanes)."""
    table = SPLASH_BLOCKS.get(head_size, SPLASH_BLOCKS[128])

    def fit(block: int) -> int:
        block = min(block, T)
        while T % block:
            block //= 2
        return block

    (q, kv, kv_step), (q_bwd, kv_bwd, kv_step_bwd) = (
        (fit(a), fit(b), fit(c)) for a, b, c in (table["forward"], table["backward"])
    )
    layout = splash.QKVLayout.SEQ_MINOR if head_size < 128 else splash.QKVLayout.HEAD_DIM_MINOR
    return splash.BlockSizes(
        block_q=q,
        block_kv=kv,
        block_kv_compute=kv_step,
        block_q_dkv=q_bwd,
        block_kv_dkv=kv_bwd,
        block_kv_dkv_compute=kv_step_bwd,
        use_fused_bwd_kernel=True,
        q_layout=layout,
        k_layout=layout,
        v_layout=layout,
    )


def splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT=None, block_sizes=None):
    """splash_attention_heads_major on the projection's (B, T, heads, H) layout: one transposed copy
    of q, k and v into the kernel's layout, and of the output out of it."""
    q_BxNxTxH, k_BxKxTxH, v_BxKxTxH = (a.transpose(0, 2, 1, 3) for a in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))
    return splash_attention_heads_major(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT, block_sizes).transpose(
        0, 2, 1, 3
    )


def splash_attention_heads_major(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT=None, block_sizes=None):
    """Causal attention through JAX's Pallas splash kernel (flash attention on TPUs: no T x T scores in
    memory, the tiles above the diagonal skipped), forward and backward, on the kernel's own layout
    (B, heads, T, H) in and out; grouped-query as the kernel does it (query head n reads key head
    n // G, this model's layout), and with segment ids a query sees only its own segment's keys. Under a
    mesh it runs per shard (shard_map): rows split as the logical 'batch' axis says, heads as 'heads'
    says where that divides the key/value heads, each device's whole rows (the caller sends rows split
    over `context` elsewhere). Rows are padded to splash_length. Off a TPU (tests) the kernel runs in
    Pallas's interpret mode: correct, slow."""
    T, H = q_BxNxTxH.shape[2], q_BxNxTxH.shape[3]
    if (padded := splash_length(T)) != T:
        pad = [(0, 0), (0, 0), (0, padded - T), (0, 0)]
        q_BxNxTxH, k_BxKxTxH, v_BxKxTxH = (jnp.pad(a, pad) for a in (q_BxNxTxH, k_BxKxTxH, v_BxKxTxH))
        ids_BxT = None if segment_ids_BxT is None else jnp.pad(segment_ids_BxT, pad[1:3])
        y = splash_attention_heads_major(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, ids_BxT, block_sizes)
        return y[:, :, :T]
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    interpret = (device.platform if device is not None else jax.default_backend()) != "tpu"
    blocks = block_sizes or splash_block_sizes(T, H)
    ids_BxT = jnp.zeros((q_BxNxTxH.shape[0], T), jnp.int32) if segment_ids_BxT is None else segment_ids_BxT
    local = functools.partial(_splash_local, blocks=blocks, interpret=interpret, segmented=segment_ids_BxT is not None)
    free_axes = [] if mesh.empty else [a for a in mesh.axis_names if a not in mesh.manual_axes]
    if not any(mesh.shape[a] > 1 for a in free_axes):
        return local(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, ids_BxT)
    rules = dict(spmd.get_logical_axis_rules() or ())

    def split(logical: str, *dims: int):
        """The mesh axes of rule `logical` (those of the shard_map) if their product divides every dim."""
        axes = rules.get(logical) or ()
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in free_axes)
        n = int(np.prod([mesh.shape[a] for a in axes]))
        return axes if axes and all(d % n == 0 for d in dims) else None

    rows, heads = split("batch", q_BxNxTxH.shape[0]), split("heads", q_BxNxTxH.shape[1], k_BxKxTxH.shape[1])
    P = jax.sharding.PartitionSpec
    qkv, ids = P(rows, heads, None, None), P(rows, None)
    return jax.shard_map(
        local, in_specs=(qkv, qkv, qkv, ids), out_specs=qkv, axis_names=set(free_axes), check_vma=False
    )(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, ids_BxT)


def _splash_local(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, ids_BxT, blocks, interpret: bool, segmented: bool):
    """One device's rows and heads: the kernel is built for these shapes (its causal mask's tile
    map is numpy, made once per trace) and mapped over the rows."""
    _, N, T, H = q_BxNxTxH.shape
    mask = splash.MultiHeadMask([splash.CausalMask((T, T))] * N)
    kernel = splash.make_splash_mha(
        mask,
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
        residual_checkpoint_name=SPLASH_RESIDUALS,
    )
    q_BxNxTxH = q_BxNxTxH * jnp.asarray(H**-0.5, q_BxNxTxH.dtype)  # XLA fuses it into q's producer
    # The kernel's inputs are kept with its residuals (REMAT_POLICIES below): then the backward pass reads
    # them as they are, not the projection's outputs to add the bias and scale to again.
    q_BxNxTxH, k_BxKxTxH, v_BxKxTxH = (checkpoint_name(a, SPLASH_RESIDUALS) for a in (q_BxNxTxH, k_BxKxTxH, v_BxKxTxH))

    def row(q_NxTxH, k_KxTxH, v_KxTxH, ids_T):
        return kernel(q_NxTxH, k_KxTxH, v_KxTxH, splash.SegmentIds(q=ids_T, kv=ids_T) if segmented else None)

    return jax.vmap(row)(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, ids_BxT)


# ---- one signature, one table ---------------------------------------------------------------
# Every implementation: (q, k, v, position_BxT, segments, dropout_key, dropout_rate) -> y, causal, with
# q (B, T, N, H) and k, v (B, T, K, H) (grouped-query when K < N), or all in the kernel's (B, heads, T, H)
# layout for those in HEADS_MAJOR. position_BxT: each token's position; segments: packed rows' Segments
# or None; only the written-out attention drops probabilities (choose_attention sends dropout there).


def whole_rows(k_BxTxKxH, v_BxTxKxH):
    """Keys and values of the whole row on every device: all-gathered over the `context` axis that splits
    the row's tokens (MaxText's default); each query block then attends to all of them."""
    return (constrain(a, ("batch", None, "heads", None)) for a in (k_BxTxKxH, v_BxTxKxH))


def xla_attention(
    q_BxTxNxH,
    k_BxTxKxH,
    v_BxTxKxH,
    position_BxT,
    segments=None,
    dropout_key=None,
    dropout_rate=0.0,
    implementation="xla",
):
    """jax.nn.dot_product_attention: XLA's attention, or cuDNN's fused flash kernel (GPU, bfloat16)."""
    k_BxTxKxH, v_BxTxKxH = whole_rows(k_BxTxKxH, v_BxTxKxH)
    T = q_BxTxNxH.shape[1]
    if segments is not None and not segments.in_order:  # is_causal would compare array indices
        mask = position_mask(segments.position_BxT, segments.ids_BxT)
        return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask, implementation=implementation)
    mask = None if segments is None else same_segment(segments.ids_BxT, 0, T, T)  # cuDNN takes it as a bias
    return jax.nn.dot_product_attention(
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask, is_causal=True, implementation=implementation
    )


def einsum_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, segments=None, dropout_key=None, dropout_rate=0.0):
    """causal_attention (written out, with its backward; the only one that drops probabilities)."""
    k_BxTxKxH, v_BxTxKxH = whole_rows(k_BxTxKxH, v_BxTxKxH)
    ids_BxT = None if segments is None else segments.ids_BxT
    out_of_order = segments is not None and not segments.in_order
    return causal_attention(
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, dropout_rate, dropout_key, ids_BxT, position_BxT if out_of_order else None
    )


def splash_tokens_major(
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, segments=None, dropout_key=None, dropout_rate=0.0
):
    """Splash on the (B, T, heads, H) layout: the path of prefills and int8/fp8 projections."""
    k_BxTxKxH, v_BxTxKxH = whole_rows(k_BxTxKxH, v_BxTxKxH)
    return splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, None if segments is None else segments.ids_BxT)


def splash_heads_major(
    q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, position_BxT, segments=None, dropout_key=None, dropout_rate=0.0
):
    """Splash with q, k and v made in its (B, heads, T, H) layout by the projection itself (training)."""
    # Heads split over `tensor` only where it divides the kv heads: the kernel runs per shard of whole
    # groups, and a query split alone would be gathered back each layer.
    axes = ("batch", "heads" if splits(k_BxKxTxH.shape[1], "heads") else None, None, None)
    q_BxNxTxH, k_BxKxTxH, v_BxKxTxH = (constrain(a, axes) for a in (q_BxNxTxH, k_BxKxTxH, v_BxKxTxH))
    ids_BxT = None if segments is None else segments.ids_BxT
    return splash_attention_heads_major(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, ids_BxT)


def ring(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, segments=None, dropout_key=None, dropout_rate=0.0):
    """ring_attention over the mesh axis that splits the rows' tokens."""
    ids_BxT = jnp.zeros_like(position_BxT) if segments is None else segments.ids_BxT
    return ring_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, ids_BxT, sequence_axis()[0])


ATTENTION = {  # by name: config.attention's choices, and the two that the rules below pick themselves
    "xla": xla_attention,
    "cudnn": functools.partial(xla_attention, implementation="cudnn"),
    "einsum": einsum_attention,
    "splash": splash_tokens_major,
    "splash_heads_major": splash_heads_major,
    "ring": ring,
}


HEADS_MAJOR = {"splash_heads_major"}


@dataclasses.dataclass(frozen=True)
class Attend:
    """The attention implementation that one traced program runs, by its name in ATTENTION. heads_major:
    it takes q, k, v and gives y in the (B, heads, T, H) layout, which the projections then make and read."""

    name: str
    dropout_rate: float = 0.0

    @property
    def heads_major(self) -> bool:
        return self.name in HEADS_MAJOR

    def tokens_major(self, a):
        """q, k, v or y of this implementation's layout in the (B, T, heads, H) one."""
        return a.swapaxes(1, 2) if self.heads_major else a

    def __call__(self, q, k, v, position_BxT, segments=None, dropout_key=None):
        return ATTENTION[self.name](q, k, v, position_BxT, segments, dropout_key, dropout_rate=self.dropout_rate)


def choose_attention(config, T: int, dropout: bool = False) -> Attend:
    """config.attention where it can run rows of T tokens on this mesh, else what can: ring attention
    when context_attention='ring' and the `context` axis splits the rows; the written-out attention when
    attention probabilities are dropped (dropout: a training step with a key) or splash cannot take T
    (under 128 tokens, or no kernel in this JAX); XLA's for splash over rows split by `context`.
    Splash runs heads-major (training and prefill: the projections make that layout, so only the keys
    and values a prefill caches are transposed), but with int8/fp8 projections or int8 weights (a LoRA
    run's frozen base) on the (B, T, heads, H) one."""
    seq_axis, seq_splits = sequence_axis()
    if config.context_attention == "ring" and seq_splits > 1 and T % seq_splits == 0:
        return Attend("ring")
    name = config.attention
    if dropout or (name == "splash" and not splash_fits(T)):
        return Attend("einsum", config.dropout)
    if name == "splash" and seq_splits > 1:
        return Attend("xla")
    if name == "splash" and config.quantization == "none" and config.weight_dtype != "int8":
        return Attend("splash_heads_major")
    return Attend(name, config.dropout)


def keeping_attention(policy):
    """`policy`, and the attention kernel's inputs q, k, v, its output and log-sum-exp kept as well
    (SPLASH_RESIDUALS: a whole forward kernel, and the q, k, v layout work, not to redo in the backward
    pass)."""
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(SPLASH_RESIDUALS)
    )


REMAT_POLICIES = {  # by config.remat_policy ('none': no rematerialisation)
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": keeping_attention(jax.checkpoint_policies.dots_saveable),
    "dots_with_no_batch_dims_saveable": keeping_attention(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}
