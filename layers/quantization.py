"""Quantized matmuls for training: int8 and fp8 operands, higher-precision accumulation.

    y = matmul(x_NxI, w_IxO, "int8")   # or "fp8", or "none" (x @ w)

int8: each row of x (a token) and each column of w (an output channel) gets its own scale,
max|.| / 127, computed from the values at hand every call (no state to checkpoint). The
operands are rounded to int8, multiplied with int32 accumulation, and the int32 result is
scaled back: y ≈ (x_int8 @ w_int8) · scale_x · scale_w. An outlier therefore only coarsens
its own token's or channel's grid, not the whole tensor's.

fp8: the same with float8 e4m3 for the forward operands and e5m2 (more range, less precision)
for the gradient, one scale per tensor (max|.| / the format's largest value), float32
accumulation. On Hopper GPUs XLA lowers a dot of fp8 operands to cuBLAS's fp8 matmul (not yet
measured here: no GPU so far).

Gradients are straight-through: the backward treats the rounding as the identity. Of the two
backward matmuls, the input gradient (g @ wᵀ) is quantized like the forward, and the weight
gradient (xᵀ @ g, a sum over every token of the batch) stays in the compute dtype: see
`QUANTIZE_WEIGHT_GRADIENT` for the measurement behind that choice.

For serving, `Int8Weight` stores a weight itself as int8, with one float32 scale per output
channel (weight-only: the activations stay in the compute dtype). A matmul reads the int8 values
and scales its output in float32: x @ (q · s) = (x @ q) · s, for s constant down each column. A
token table (V, D) takes one scale per row: its lookup gathers int8 rows and scales each
(Int8Weight.rows), and, transposed (D, V), it is the tied output layer's weight with a scale per
logit.

Stand-alone (jax only): model.py uses it for the dense matmuls of its blocks and its token table.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

MODES = ("none", "int8", "fp8")

# Quantizing the weight gradient too (a sum over all B·T tokens) did not hurt convergence in
# the one run measured (int8, config/shakespeare_char.py, 2000 steps: val 1.7141 vs 1.7174)
# but made the CPU step 1.5-2.4x slower (XLA:CPU has no fast int8 path for that transposed
# product). Off until a GPU measures it paying; flip it to measure again.
QUANTIZE_WEIGHT_GRADIENT = False

INT8_MAX = 127.0
# XLA on a TPU v5e makes a product of fewer rows with int8 weights a multiply-reduce on the vector
# units, which convert the weights to float32 and read them at ~445 GB/s; with 8 rows it is a
# matmul on the matrix unit (GPT-2 decoding one row: 0.436 -> 0.402 ms a token, bench/NOTES.md).
MATRIX_UNIT_ROWS = 8
# A TPU stores int8 arrays in tiles of 32 rows, but XLA makes the lookup of one row (a decode step at
# batch 1) a dynamic slice that wants tiles of 8: a relayout of the whole table every step (GPT-2's 38 MB:
# 856k cycles in XLA:TPU's estimate for a v5e, 36x the output layer's matmul of the same table). Slicing the
# row's whole tile and picking the row in it avoids that; a gather of several rows reads 32-row tiles as they are.
INT8_TILE_ROWS = 32
FORWARD_FP8, GRADIENT_FP8 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _dot(a_NxI, b_IxO, accumulate):
    return jax.lax.dot_general(a_NxI, b_IxO, (((1,), (0,)), ((), ())), preferred_element_type=accumulate)


def quantize_int8(x, axis: int):
    """x ≈ q · scale with q int8 in [-127, 127]; one float32 scale per slice along `axis`
    (the axis the matmul sums over), so scale has x's shape with `axis` of size 1."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)  # an all-zero slice stays zero
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def int8_dot(x_NxI, w_IxO):
    """x @ w from int8 operands (x per row, w per column) with int32 accumulation; float32."""
    qx_NxI, scale_Nx1 = quantize_int8(x_NxI, axis=1)
    qw_IxO, scale_1xO = quantize_int8(w_IxO, axis=0)
    return _dot(qx_NxI, qw_IxO, jnp.int32).astype(jnp.float32) * scale_Nx1 * scale_1xO


def quantize_fp8(x, dtype):
    """x ≈ q · scale with q in the float8 `dtype`; one float32 scale for the whole tensor."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    q = jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype)
    return q, scale


def fp8_dot(x_NxI, w_IxO, x_dtype=FORWARD_FP8, w_dtype=FORWARD_FP8):
    """x @ w from float8 operands (one scale each) with float32 accumulation; float32."""
    qx_NxI, scale_x = quantize_fp8(x_NxI, x_dtype)
    qw_IxO, scale_w = quantize_fp8(w_IxO, w_dtype)
    return _dot(qx_NxI, qw_IxO, jnp.float32) * (scale_x * scale_w)


def quantized_dot(mode, a, b, fp8_dtypes=(FORWARD_FP8, FORWARD_FP8)):
    """float32 a @ b from 8-bit operands: int8, or fp8 in the given formats for a and b."""
    return int8_dot(a, b) if mode == "int8" else fp8_dot(a, b, *fp8_dtypes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _quantized_matmul(x_NxI, w_IxO, mode):
    return quantized_dot(mode, x_NxI, w_IxO).astype(x_NxI.dtype)


def _forward(x_NxI, w_IxO, mode):
    return _quantized_matmul(x_NxI, w_IxO, mode), (x_NxI, w_IxO)


def _backward(mode, residuals, g_NxO):
    x_NxI, w_IxO = residuals
    dx_NxI = quantized_dot(mode, g_NxO, w_IxO.T, (GRADIENT_FP8, FORWARD_FP8))
    if QUANTIZE_WEIGHT_GRADIENT:
        dw_IxO = quantized_dot(mode, x_NxI.T, g_NxO, (FORWARD_FP8, GRADIENT_FP8))
    else:
        dw_IxO = _dot(x_NxI.T, g_NxO, jnp.float32)
    return dx_NxI.astype(x_NxI.dtype), dw_IxO.astype(w_IxO.dtype)


_quantized_matmul.defvjp(_forward, _backward)


def matmul(x_NxI, w_IxO, mode: str = "none"):
    """x @ w in x's dtype; with mode 'int8' or 'fp8' from quantized operands (see the top)."""
    if mode == "none":
        return x_NxI @ w_IxO
    return _quantized_matmul(x_NxI, w_IxO, mode)


# ----------------------------------------------------------------------------- int8 weights for serving


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A weight as int8 values q and a float32 scale per output channel: w ≈ q · scale, where scale
    has q's shape with the input axes (those a matmul sums over, leading) of size 1. It stands in
    for the weight's array in a model's parameters: layers.linear multiplies with it (weight[...]),
    model.py reshapes it (weight.reshape) as it reshapes a kernel, the heads-major projection's
    einsums cast it (weight.astype: dequantized), and layers/embedding.py looks up a token table's
    rows (weight.rows) and takes the logits by its transpose (weight.T, float32 matmul)."""

    q: jax.Array
    scale: jax.Array

    @classmethod
    def of(cls, w, input_axes: tuple) -> "Int8Weight":
        q, scale = quantize_int8(w, axis=input_axes)
        return cls(q, scale)

    @property
    def shape(self):
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("an Int8Weight is used whole (weight[...]), not indexed")
        return self

    def reshape(self, *shape) -> "Int8Weight":
        """q reshaped; the scale's output axes become the trailing axes of `shape` that hold them."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        outputs, kept = math.prod(self.scale.shape), len(shape)
        while kept > 0 and math.prod(shape[kept - 1 :]) <= outputs:
            kept -= 1
        return Int8Weight(self.q.reshape(shape), self.scale.reshape((1,) * kept + tuple(shape[kept:])))

    def astype(self, dtype) -> jax.Array:
        """The weight q · scale as a plain array in `dtype`: for the einsums that take it whole (a
        forward pass without a cache through splash, which projects q, k and v heads-major)."""
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)

    def transpose(self, *axes) -> "Int8Weight":
        """q's axes reordered, and the scale's with them (it has q's rank)."""
        return Int8Weight(self.q.transpose(*axes), self.scale.transpose(*axes))

    @property
    def T(self) -> "Int8Weight":
        return self.transpose()

    def rows(self, idx):
        """q[idx] · scale[idx] in float32, (*idx.shape, D): the rows of a (V, D) table with a scale per
        row, gathered as int8 and scaled each by its own (the table is never dequantized whole)."""
        (V, D), R = self.q.shape, INT8_TILE_ROWS
        if self.scale.shape != (V, 1):
            raise ValueError(f"rows() takes a (V, D) table with a scale per row, not scales {self.scale.shape}")
        if idx.size == 1 and V % R == 0:  # one row: its tile of R rows, the others zeroed and summed away
            tile_xRxD = self.q.reshape(V // R, R, D)[idx // R]
            is_row_xRx1 = jnp.arange(R)[:, None] == (idx % R)[..., None, None]
            q_xD = jnp.where(is_row_xRx1, tile_xRxD, 0).sum(-2, dtype=jnp.int32)
        else:
            q_xD = self.q[idx]
        return q_xD.astype(jnp.float32) * self.scale[idx]

    def matmul(self, x_NxI, mode: str = "none", dtype=None):
        """x @ w in `dtype` (default x's): the int8 values cast to x's dtype (exact: |q| <= 127), the
        product kept in float32, scaled by the float32 scale and rounded to `dtype` once (in bfloat16,
        rounding the product and the scale first added 9% to the logits' rms change from int8 on the
        quickstart)."""
        rows = x_NxI.shape[0]
        if rows < MATRIX_UNIT_ROWS:  # decoding a row or a few: zero rows added, then dropped
            padded_NxI = jnp.pad(x_NxI, ((0, MATRIX_UNIT_ROWS - rows), (0, 0)))
            return self.matmul(padded_NxI, mode, dtype)[:rows]
        q = self.q.astype(x_NxI.dtype)
        if mode == "none":
            y = jnp.matmul(x_NxI, q, preferred_element_type=jnp.float32)
        else:
            y = quantized_dot(mode, x_NxI, q)
        return (y * self.scale).astype(dtype or x_NxI.dtype)


def cast_weight(w, dtype):
    """A weight in the compute dtype: an array cast to it, an Int8Weight as it is (its matmul and its
    rows read the int8 values and scale them; astype would write a dequantized copy)."""
    return w if isinstance(w, Int8Weight) else w.astype(dtype)
