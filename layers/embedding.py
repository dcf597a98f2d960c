"""The token table in and out: the lookup (its backward sums repeated tokens' gradients in float32),
the output layer's matmul (float32 logits, compute-dtype backward) and the logits' soft cap. jax only.
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def embedding_lookup(table_VxD, idx_BxT):
    """table[idx]; its backward adds up the gradients of repeated tokens in float32 and rounds
    each row's sum to the table's dtype once (a bfloat16 scatter-add would round at every add)."""
    return table_VxD[idx_BxT]


def _lookup_forward(table_VxD, idx_BxT):
    return table_VxD[idx_BxT], (table_VxD, idx_BxT)


def _lookup_backward(residuals, g_BxTxD):
    table_VxD, idx_BxT = residuals
    grad_VxD = jnp.zeros(table_VxD.shape, jnp.float32).at[idx_BxT].add(g_BxTxD.astype(jnp.float32))
    return grad_VxD.astype(table_VxD.dtype), None


embedding_lookup.defvjp(_lookup_forward, _lookup_backward)


@jax.custom_vjp
def logits_matmul(x_NxD, w_DxV):
    """x @ w accumulated and returned in float32: the loss reads unrounded logits (a bfloat16 result
    cast after would round them; on a TPU v5e the float32 result also made the faster loss: GPT-2's
    output layer and loss over 16 x 1024 tokens, forward and backward, 26.7 ms against 32.5,
    bench/NOTES.md). Its backward rounds the incoming float32 gradient to x's dtype once, so both
    backward matmuls, about a fifth of GPT-2's matmul work, run in the compute dtype (autodiff would
    run them in float32: slow on GPUs)."""
    return jnp.dot(x_NxD, w_DxV, preferred_element_type=jnp.float32)


def _logits_forward(x_NxD, w_DxV):
    return logits_matmul(x_NxD, w_DxV), (x_NxD, w_DxV)


def _logits_backward(saved, dlogits_NxV):
    x_NxD, w_DxV = saved
    dlogits_NxV = dlogits_NxV.astype(x_NxD.dtype)
    return dlogits_NxV @ w_DxV.T, x_NxD.T @ dlogits_NxV


logits_matmul.defvjp(_logits_forward, _logits_backward)


def no_softcap(logits, cap: float):
    return logits


def tanh_softcap(logits, cap: float):
    """logit_softcap (Gemma 2, modded-nanogpt): cap·tanh(logits / cap) squashes every logit into
    (-cap, cap) smoothly, so the output layer cannot make the loss overconfident. Float32 logits in."""
    return cap * jnp.tanh(logits / cap)


SOFTCAPS = {False: no_softcap, True: tanh_softcap}  # by logit_softcap > 0
