"""The token table in and out: the lookup (its backward sums repeated tokens' gradients in float32),
the output layer's matmul (float32 logits, compute-dtype backward), the logits' soft cap, the
cross-entropy, and the output layer with its cross-entropy taken in slices of tokens (output_layer_loss).
The lookup and the output layer's matmul also take a served int8 table (quantization.Int8Weight).
jax only.
"""

import functools

import jax
import jax.numpy as jnp

from layers.quantization import Int8Weight


def embedding_lookup(table_VxD, idx_BxT):
    """table[idx]; its backward adds up the gradients of repeated tokens in float32 and rounds
    each row's sum to the table's dtype once (a bfloat16 scatter-add would round at every add).
    An int8 table (a scale per row) gives its rows q[idx] · scale[idx] in float32, for serving."""
    if isinstance(table_VxD, Int8Weight):
        return table_VxD.rows(idx_BxT)
    return _lookup(table_VxD, idx_BxT)


@jax.custom_vjp
def _lookup(table_VxD, idx_BxT):
    return table_VxD[idx_BxT]


def _lookup_forward(table_VxD, idx_BxT):
    return table_VxD[idx_BxT], (table_VxD, idx_BxT)


def _lookup_backward(residuals, g_BxTxD):
    table_VxD, idx_BxT = residuals
    grad_VxD = jnp.zeros(table_VxD.shape, jnp.float32).at[idx_BxT].add(g_BxTxD.astype(jnp.float32))
    return grad_VxD.astype(table_VxD.dtype), None


_lookup.defvjp(_lookup_forward, _lookup_backward)


def logits_matmul(x_NxD, w_DxV):
    """x @ w in x's dtype, accumulated and returned in float32: the loss reads unrounded logits (a
    bfloat16 result cast after would round them; on a TPU v5e the float32 result also made the faster
    loss: GPT-2's output layer and loss over 16 x 1024 tokens, forward and backward, 26.7 ms against
    32.5, bench/NOTES.md). Its backward rounds the incoming float32 gradient to x's dtype once, so both
    backward matmuls, about a fifth of GPT-2's matmul work, run in the compute dtype (autodiff would
    run them in float32: slow on GPUs). An int8 w (a scale per logit) multiplies its int8 values and
    scales the float32 logits (Int8Weight.matmul), for serving."""
    if isinstance(w_DxV, Int8Weight):
        return w_DxV.matmul(x_NxD, dtype=jnp.float32)
    return _logits_matmul(x_NxD, w_DxV.astype(x_NxD.dtype))


@jax.custom_vjp
def _logits_matmul(x_NxD, w_DxV):
    return jnp.dot(x_NxD, w_DxV, preferred_element_type=jnp.float32)


def _logits_forward(x_NxD, w_DxV):
    return _logits_matmul(x_NxD, w_DxV), (x_NxD, w_DxV)


def _logits_backward(saved, dlogits_NxV):
    x_NxD, w_DxV = saved
    dlogits_NxV = dlogits_NxV.astype(x_NxD.dtype)
    return dlogits_NxV @ w_DxV.T, x_NxD.T @ dlogits_NxV


_logits_matmul.defvjp(_logits_forward, _logits_backward)


def no_softcap(logits, cap: float):
    return logits


def tanh_softcap(logits, cap: float):
    """logit_softcap (Gemma 2, modded-nanogpt): cap·tanh(logits / cap) squashes every logit into
    (-cap, cap) smoothly, so the output layer cannot make the loss overconfident. Float32 logits in."""
    return cap * jnp.tanh(logits / cap)


SOFTCAPS = {False: no_softcap, True: tanh_softcap}  # by logit_softcap > 0

# Soft-capped logits lie in (-cap, cap): under this cap the sum of their exponentials stays finite in float32
# (e^60 times a vocabulary of up to e^28 entries is under float32's e^88.7).
CAP_WITHOUT_MAX = 60.0


def logsumexp(logits_NxV, cap: float, shift_N=None):
    """log Σ exp(logits) over the last axis, in one pass over the logits where it can be: logits soft-capped
    by a cap up to CAP_WITHOUT_MAX need no shift, and others take shift_N where given (lse_shift).
    Either way the sum's shift is known before the logits are, so on a TPU v5e the sum fuses into the
    output layer's matmul and the separate pass over the float32 logits goes (21 ms of the record config's
    874 ms step; 4 ms of GPT-2's, bench/NOTES.md). Otherwise the usual form: each row's max first."""
    if 0 < cap <= CAP_WITHOUT_MAX:
        return jnp.log(jnp.exp(logits_NxV).sum(-1))
    if shift_N is not None:
        return shifted_logsumexp(logits_NxV, jax.lax.stop_gradient(shift_N))
    return jax.nn.logsumexp(logits_NxV, axis=-1)


@jax.custom_vjp
def shifted_logsumexp(logits_NxV, shift_N):
    """shift + log Σ exp(logits - shift) per row. A shift that is one of the row's logits (give or take
    rounding) makes that term 1, so the sum cannot underflow; it overflows only where another logit
    exceeds the shift by ~88 (a loss of ~88), and then all rows take the max-shifted form instead."""
    lse_N = shift_N + jnp.log(jnp.exp(logits_NxV - shift_N[:, None]).sum(-1))
    return jax.lax.cond(jnp.isfinite(lse_N).all(), lambda: lse_N, lambda: jax.nn.logsumexp(logits_NxV, axis=-1))


def _shifted_forward(logits_NxV, shift_N):
    lse_N = shifted_logsumexp(logits_NxV, shift_N)
    return lse_N, (logits_NxV, lse_N)


def _shifted_backward(saved, g_N):
    logits_NxV, lse_N = saved  # d lse / d logits = softmax, whatever the shift
    return g_N[:, None] * jnp.exp(logits_NxV - lse_N[:, None]), jnp.zeros_like(lse_N)


shifted_logsumexp.defvjp(_shifted_forward, _shifted_backward)


def lse_shift(x_NxD, w_DxV, y_N, cap: float = 0.0):
    """logsumexp's shift for the logits x @ w (soft-capped by cap > 0): each row's logit of its target (of
    token 0 where the target is < 0, none), as the matmul computes it but apart from it, a row-wise dot with
    the target's column of w, in float32. None where the cap makes a shift needless."""
    if 0 < cap <= CAP_WITHOUT_MAX:
        return None
    w_NxD = w_DxV.astype(x_NxD.dtype).T[jnp.maximum(y_N, 0)]
    return SOFTCAPS[cap > 0](jnp.einsum("nd,nd->n", x_NxD, w_NxD, preferred_element_type=jnp.float32), cap)


def summed_cross_entropy(logits_NxV, y_N, cap: float = 0.0, shift_N=None):
    """(cross-entropy summed over the targets, how many there are, each row's log-sum-exp): a target < 0
    is none (a fine-tuning set's prompt tokens, padding) and adds exactly 0, whatever its logits. `cap`:
    the logit_softcap the logits were capped with; shift_N: lse_shift's (either makes the log-sum-exp one
    pass)."""
    is_target_N = y_N >= 0
    lse_N = logsumexp(logits_NxV, cap, shift_N)
    target_N = jnp.take_along_axis(logits_NxV, jnp.where(is_target_N, y_N, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(is_target_N, lse_N - target_N, 0.0).sum(), is_target_N.sum(), lse_N


def _slices(a_NxK, chunks: int):
    """(chunks, N / chunks, ...) of a's rows: slice c holds rows c, c + chunks, c + 2·chunks, ... (so
    every device that holds a share of the rows keeps its share of each slice)."""
    return a_NxK.reshape(a_NxK.shape[0] // chunks, chunks, *a_NxK.shape[1:]).swapaxes(0, 1)


def _unslice(a_CxMxK):
    return a_CxMxK.swapaxes(0, 1).reshape(-1, *a_CxMxK.shape[2:])


def _slice_loss(x_MxD, w_DxV, y_M, cap: float, vocab_size: int):
    """(the summed cross-entropy, how many targets, its float32 gradient by x @ w) of one slice of tokens:
    the output layer as model.GPT.head takes it, a target < 0 adding exactly 0."""
    z_MxV = jnp.dot(x_MxD, w_DxV, preferred_element_type=jnp.float32)
    capped_MxV = SOFTCAPS[cap > 0](z_MxV, cap)
    V = w_DxV.shape[1]
    logits_MxV = capped_MxV if V == vocab_size else jnp.where(jnp.arange(V) < vocab_size, capped_MxV, -jnp.inf)
    total, count, lse_M = summed_cross_entropy(logits_MxV, y_M, cap, lse_shift(x_MxD, w_DxV, y_M, cap))
    is_target_M = y_M >= 0
    # d(lse - logits[y]) / dlogits = softmax - one-hot, through the cap's tanh: 1 - tanh² (from the capped
    # logits before the padding's -inf, which would make 0·inf)
    onehot_MxV = jnp.arange(V) == y_M[:, None]
    dlogits_MxV = jnp.where(is_target_M[:, None], jnp.exp(logits_MxV - lse_M[:, None]) - onehot_MxV, 0.0)
    if cap > 0:
        dlogits_MxV = dlogits_MxV * (1.0 - jnp.square(capped_MxV / cap))
    return total, count, dlogits_MxV


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def output_layer_loss(x_NxD, w_DxV, y_N, chunks: int, cap: float, vocab_size: int):
    """(cross-entropy summed over the targets, how many there are) of the logits x @ w (float32, soft-capped
    when cap > 0, the padding entries past vocab_size -inf), a target < 0 being none, taken `chunks`
    slices of tokens at a time: only one slice's float32 logits exist at a time. Under differentiation
    each slice's gradients by x and w are made in the same pass as its loss (the logits once, never
    recomputed nor kept) and scaled by the loss's cotangent in the backward pass."""
    total, count, _ = _sliced(x_NxD, w_DxV, y_N, chunks, cap, vocab_size, with_grads=False)
    return total, count


def _sliced(x_NxD, w_DxV, y_N, chunks, cap, vocab_size, with_grads: bool):
    """The slices' summed loss, target count and (with_grads) the float32 gradients of the summed loss
    by x (N, D) and w (D, V), the latter added up over the slices."""

    def add_slice(sums, slice_):
        x_MxD, y_M = slice_
        total, count, dlogits_MxV = _slice_loss(x_MxD, w_DxV, y_M, cap, vocab_size)
        if not with_grads:
            return (sums[0] + total, sums[1] + count, sums[2]), None
        # both matmuls in the compute dtype, accumulated in float32 (logits_matmul's backward rounds alike)
        dlogits_MxV = dlogits_MxV.astype(x_MxD.dtype)
        dx_MxD = jnp.dot(dlogits_MxV, w_DxV.T, preferred_element_type=jnp.float32)
        dw_DxV = sums[2] + jnp.dot(x_MxD.T, dlogits_MxV, preferred_element_type=jnp.float32)
        return (sums[0] + total, sums[1] + count, dw_DxV), dx_MxD

    zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    dw_DxV = jnp.zeros(w_DxV.shape, jnp.float32) if with_grads else jnp.zeros((), jnp.float32)
    (total, count, dw_DxV), dx_CxMxD = jax.lax.scan(
        add_slice, (*zero, dw_DxV), (_slices(x_NxD, chunks), _slices(y_N, chunks))
    )
    return total, count, (_unslice(dx_CxMxD), dw_DxV) if with_grads else None


def _output_layer_loss_forward(x_NxD, w_DxV, y_N, chunks, cap, vocab_size):
    total, count, grads = _sliced(x_NxD, w_DxV, y_N, chunks, cap, vocab_size, with_grads=True)
    # two scalars carry x's and w's dtypes to the backward pass (residuals must be arrays)
    return (total, count), (grads, jnp.zeros((), x_NxD.dtype), jnp.zeros((), w_DxV.dtype))


def _output_layer_loss_backward(chunks, cap, vocab_size, saved, cotangents):
    (dx_NxD, dw_DxV), x_like, w_like = saved
    g = cotangents[0]  # the count is an integer: no gradient
    return (g * dx_NxD).astype(x_like.dtype), (g * dw_DxV).astype(w_like.dtype), None


output_layer_loss.defvjp(_output_layer_loss_forward, _output_layer_loss_backward)
