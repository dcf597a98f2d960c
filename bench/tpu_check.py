"""Splash against the written-out attention on a TPU, compiled (not interpreted), in float32 at full
matmul precision: forward and gradients, causal and packed rows, GPT-2's and Llama's head sizes
(tests/test_attention.py has the same check as a test marked tpu; this runs without pytest).

    python bench/tpu_check.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from layers import attention  # noqa: E402


def check(H: int, segmented: bool, B=2, T=1024, N=4, K=2) -> str:
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (B, T, N, H))
    k, v = (jax.random.normal(key, (B, T, K, H)) for key in (kk, kv))
    ids = (
        jnp.asarray([[0] * (37 + 50 * b) + [1] * (T - 37 - 50 * b) for b in range(B)], jnp.int32) if segmented else None
    )
    loss = lambda f: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1, 2)))
    with jax.default_matmul_precision("float32"):
        ours = loss(lambda q, k, v: attention.splash_attention(q, k, v, ids))(q, k, v)
        theirs = loss(lambda q, k, v: attention.causal_attention(q, k, v, segment_ids_BxT=ids))(q, k, v)
    loss_error = abs(float(ours[0]) - float(theirs[0])) / abs(float(theirs[0]))
    grad_errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours[1], theirs[1])]
    return (
        f"H={H} {'packed' if segmented else 'causal'}: loss relative error {loss_error:.2e}, gradients' "
        f"largest error / largest value dq {grad_errors[0]:.2e} dk {grad_errors[1]:.2e} dv {grad_errors[2]:.2e}"
    )


if __name__ == "__main__":
    print(f"splash vs written-out attention, float32, on {jax.devices()[0].device_kind}")
    for H in (64, 128):
        for segmented in (False, True):
            print("  " + check(H, segmented), flush=True)
