"""GPT-2 in Flax NNX, and with a few switches a Llama-style decoder.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `mlp`, `layers`, ...)
as its `out_sharding` metadata; sharding.py maps those names to mesh axes, so this file knows
nothing about devices. The layers are stored stacked (one array per weight with a leading
`layers` axis) and run with lax.scan, so compile time does not grow with depth.

Shape suffixes name the axes: B batch, T time, D model width, N heads, H head size,
F MLP hidden, V vocabulary, L layers, S length of the KV cache; BT is batch and time
flattened into one axis.

GPT-2 is the default. `pos_embedding='rope'`, `norm='rmsnorm'`, `mlp='swiglu'`, `n_kv_head` (grouped-
query attention), `bias=False` and `tie_embeddings=False` give today's architectures; `qk_norm`,
`mlp='relu2'`, `zero_init_proj` and `logit_softcap` are the GPT-2 speedruns' (modded-nanogpt). Each
is a small function or module, here or in layers/blocks.py, picked once by name (ROTATIONS, HEAD_NORMS,
SOFTCAPS; NORMS, MLPS), or a parameter that is there or not (wpe, lm_head_kernel, like the biases);
the forward pass has no branches on them.
`n_experts` > 0 turns the MLPs into a mixture of experts (layers/moe.py). Three more switches change how
the step computes, not the weights: `attention` ('xla', 'einsum' or 'splash': layers/attention.py, or cuDNN's fused kernel),
`quantization` (int8/fp8 operands for the blocks' matmuls, layers/quantization.py) and
`pipeline_stages` (the layer stack as a pipeline over the `stage` mesh axis, layers/pipeline.py).

Packed rows (several examples in one row, pretraining's documents or fine-tuning's conversations)
carry segment ids (B, T): attention never crosses a segment and positions restart at 0 in each,
in every attention path; without them the program is the one it always was.

For generation, `GPT.decode` runs new tokens against a KV cache (layers/kv_cache.py: keys and values
of the tokens seen before); the training forward `GPT.__call__` never touches it. weights/hf.py maps Hugging
Face GPT-2 and Llama-family weights to and from this model's parameter layout.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import pipeline, quantization
from layers.attention import (
    Segments,
    causal_attention,
    permuted_segments,
    position_mask,
    ring_attention,
    same_segment,
    SPLASH_RESIDUALS,
    splash_attention,
    splash_attention_heads_major,
    splash_fits,
)
from layers.blocks import MLPS, NORMS, constrain, dropout, linear, normal, param, residual_init, sequence_axis, splits
from layers.kv_cache import FILLED, KVCache, init_cache
from layers.moe import MoE


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # real vocabulary; logits of padding entries are -inf
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    dtype: str = "float32"  # compute dtype; parameters are always float32
    scan_layers: bool = True
    remat_policy: str = "none"
    pad_vocab_to_multiple: int = 1
    # architecture switches (configurator.py documents and checks them); defaults are GPT-2
    pos_embedding: str = "learned"  # 'learned' (a wpe table) | 'rope' (rotate q and k)
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # 'none' | 'llama3' (Llama 3.1 / 3.2: lower frequencies slowed down)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    norm: str = "layernorm"  # 'layernorm' | 'rmsnorm'
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # 'gelu' | 'swiglu' | 'relu2' (proj(relu(fc(x))²), modded-nanogpt)
    mlp_hidden: int = 0  # 0: see mlp_hidden_size
    n_kv_head: int = 0  # key/value heads; 0 = n_head (multi-head), 1 = multi-query
    tie_embeddings: bool = True  # the output layer is wte (GPT-2), or its own lm_head_kernel
    qk_norm: bool = False  # RMSNorm (no learned scale) on each query and key head, before RoPE
    zero_init_proj: bool = False  # the residual output projections (out_kernel, proj_kernel) start at 0
    logit_softcap: float = 0.0  # > 0: logits = cap·tanh(logits / cap), in float32; 0 = off
    # mixture of experts (MoE below): n_experts > 0 makes the MLPs sparse
    n_experts: int = 0  # experts per sparse layer; 0 = dense MLPs
    experts_per_token: int = 2  # top-k: the experts each token goes to
    n_shared_experts: int = 0  # experts every token goes to as well (DeepSeek), as one wider MLP
    moe_hidden: int = 0  # an expert's hidden width; 0 = mlp_hidden_size
    moe_dense_layers: int = 0  # the first layers keep a dense MLP (DeepSeek: 1-3)
    capacity_factor: float = 1.25  # > 0: an expert takes at most factor·T·k/E tokens of a row; 0 = all
    # how the step computes, not what it learns: a checkpoint works with any of these
    attention: str = "xla"  # training attention: 'xla' | 'einsum' (written out with its backward:
    #                         fastest on CPUs) | 'cudnn' (fused flash kernel, GPU, bf16) | 'splash'
    #                         (Pallas flash kernel, TPU; rows of a multiple of 128 tokens, else 'einsum')
    quantization: str = "none"  # the blocks' dense matmuls: 'none' | 'int8' | 'fp8' (layers/quantization.py)
    context_attention: str = "gather"  # rows split over the mesh's sequence axis: 'gather' (all-gather the
    #                                    keys and values) | 'ring' (pass them round: attention.ring_attention)
    pipeline_stages: int = 1  # > 1: the layer stack runs as a pipeline over the `stage` mesh axis
    pipeline_microbatches: int = 1  # the batch is cut into this many micro-batches for it
    layers_per_stage: int = 0  # 0 = n_layer / stages (GPipe); fewer: the circular schedule
    kv_cache_dtype: str = "auto"  # decoding's KV cache: 'auto' (the compute dtype) | 'bfloat16' | 'float32' |
    #                               'int8' (one float32 scale per token and key/value head)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden_size(self) -> int:
        """mlp_hidden, or by default GPT-2's 4·D (gelu, relu2), or 8/3·D rounded up to a multiple of
        64 (swiglu: its three matrices then hold about as many weights as gelu's two)."""
        default = {"gelu": 4 * self.n_embd, "relu2": 4 * self.n_embd, "swiglu": (8 * self.n_embd // 3 + 63) // 64 * 64}
        return self.mlp_hidden or default[self.mlp]

    @property
    def expert_hidden_size(self) -> int:
        return self.moe_hidden or self.mlp_hidden_size

    @property
    def sparse_layers(self) -> int:
        """Layers with a mixture of experts: all but the first moe_dense_layers (0 when dense)."""
        return self.n_layer - self.moe_dense_layers if self.n_experts else 0


def no_head_norm(x_BxTxNxH, config: GPTConfig):
    return x_BxTxNxH


def rms_head_norm(x_BxTxNxH, config: GPTConfig):
    """qk_norm: each query and key head divided by its root mean square, with no learned scale
    (modded-nanogpt's; OLMo-2 and Qwen3 add one). Scores are then bounded by sqrt(H), so attention
    logits cannot blow up. In float32, like the other norms."""
    x = x_BxTxNxH.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + config.norm_eps)).astype(x_BxTxNxH.dtype)


HEAD_NORMS = {False: no_head_norm, True: rms_head_norm}  # by config.qk_norm


def no_rotation(x_BxTxNxH, position_BxT, config: GPTConfig, token_axis: int = 1):
    """Learned positions: GPT.wpe adds them to the input, queries and keys stay as they are."""
    return x_BxTxNxH


def rope_frequencies(head_size: int, config: GPTConfig) -> np.ndarray:
    """RoPE's H/2 angular frequencies theta^(-2i/H), in float64; with rope_scaling='llama3',
    Llama 3.1's long-context rule: wavelengths shorter than original_context / high_freq_factor
    stay, those longer than original_context / low_freq_factor are slowed down by `factor`,
    and the band between blends the two linearly in original_context / wavelength."""
    freq = 1.0 / config.rope_theta ** (np.arange(0, head_size, 2) / head_size)
    if config.rope_scaling == "none":
        return freq
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    periods_in_context = config.rope_original_context * freq / (2 * np.pi)  # context / wavelength
    blend = np.clip((periods_in_context - low) / (high - low), 0.0, 1.0)  # 0: slow down, 1: keep
    return (1 - blend) * freq / config.rope_scaling_factor + blend * freq


def rope(x, position_BxT, config: GPTConfig, token_axis: int = 1):
    """Rotary position embedding, in the rotate-half layout (Llama's in Hugging Face files):
    the pair of dimensions (i, i + H/2) of every head turns by the angle position·freq_i.
    A query and a key then score by their distance alone. Angles in float32. x is (B, T, heads, H),
    or with token_axis=2 (B, heads, T, H) (splash's layout)."""
    H = x.shape[-1]
    freq = rope_frequencies(H, config).astype(np.float32)  # (H/2,), a constant of the program
    # (B, T) positions, a unit axis where x has its heads, times (H/2,) frequencies
    angle = jnp.expand_dims(position_BxT.astype(jnp.float32), 3 - token_axis)[..., None] * freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ROTATIONS = {"learned": no_rotation, "rope": rope}


class Attention(nnx.Module):
    """Causal self-attention; grouped-query when n_kv_head K < n_head N.

    The N query heads form K groups of G = N/K that share one key and one value head. One
    kernel (D, G+2, K, H) computes them all: for each group, its G query heads, then its key,
    then its value. With G = 1 that is exactly GPT-2's [q | k | v] layout (D, 3, N, H).
    Query head n = k·G + g belongs to group k (jax.nn.dot_product_attention's convention).
    """

    def __init__(self, config: GPTConfig, key):
        D, N, K = config.n_embd, config.n_head, config.kv_heads
        G, H = N // K, D // N
        k_qkv, k_out = jax.random.split(key)
        self.qkv_kernel = param(normal(k_qkv, (D, G + 2, K, H), 0.02), ("embed", "qkv", "heads", "head_dim"))
        self.out_kernel = param(residual_init(k_out, (N, H, D), config), ("heads", "head_dim", "embed"))
        self.qkv_bias = (
            param(jnp.zeros((G + 2, K, H)), ("qkv", "heads", "head_dim")) if (config.bias or config.qkv_bias) else None
        )
        self.out_bias = param(jnp.zeros(D), ("norm",)) if config.bias else None
        self.config = config

    def __call__(self, x_BTxD, batch_size: int, start_B, dropout_key=None, cache=None, segments=None):
        """Row b's T tokens sit at positions start_B[b] + [0, T). Without a cache: causal
        self-attention over them (training: start_B = 0), or with `segments` (packed rows, no
        cache) within each segment, at the segments' positions. With a layer's cache (B, S, K·H), or
        the whole cache in place (KVCache.in_place, one token per row: the kernel): they attend to
        its positions before their own and to each other (causally). Returns
        (output, None), or with a cache (output, their keys and values as the cache stores them),
        which the caller writes into it. An empty cache (S = 0) is a prefill from position 0: the
        training path's attention, which only hands its keys and values on."""
        config = self.config
        D, (_, C, K, H) = x_BTxD.shape[-1], self.qkv_kernel.shape
        G, B, T = C - 2, batch_size, x_BTxD.shape[0] // batch_size
        N = G * K
        position_BxT = start_B[:, None] + jnp.arange(T) if segments is None else segments.position_BxT
        seq_axis, seq_splits = sequence_axis()
        cached = cache is not None and cache.length > 0  # else a prefill: the training path's attention
        ring = config.context_attention == "ring" and not cached and seq_splits > 1 and T % seq_splits == 0
        k_probs, k_out = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        dropping = k_probs is not None and config.dropout > 0  # only the written-out attention drops probabilities
        segment_ids_BxT = None if segments is None else segments.ids_BxT
        out_of_order = segments is not None and not segments.in_order
        # splash takes whole rows of a multiple of 128 tokens: else the written-out attention, or with
        # rows split over `context`, XLA's over the gathered keys and values
        kind = config.attention
        if kind == "splash" and not splash_fits(T):
            kind = "einsum"
        elif kind == "splash" and seq_splits > 1:
            kind = "xla"
        if kind == "splash" and cache is None and not ring and not dropping and config.quantization == "none":
            # training through splash: q, k and v made in the kernel's layout (int8/fp8 go the 2-D way below)
            y_BTxD = self._splash_heads_major(x_BTxD, B, position_BxT, segment_ids_BxT)
            return dropout(y_BTxD, config.dropout, k_out), None
        # One 2-D matmul with the head axis K (the one `tensor` splits) outermost of the output
        # columns: flattening (K, C, H) then splits columns as K is split, so each device multiplies
        # by its own heads' slice (Megatron). Flattening (C, K, H) would gather the whole kernel.
        kernel_DxKxCxH = self.qkv_kernel[...].transpose(0, 2, 1, 3)
        qkv_bias = None if self.qkv_bias is None else self.qkv_bias[...].swapaxes(0, 1).reshape(K * C * H)
        qkv_BTxKCH = linear(x_BTxD, kernel_DxKxCxH.reshape(D, K * C * H), qkv_bias, config.quantization)
        qkv_BxTxKxCxH = constrain(qkv_BTxKCH.reshape(B, T, K, C, H), ("batch", "seq", "heads", None, None))
        q_BxTxNxH = qkv_BxTxKxCxH[:, :, :, :G].reshape(B, T, N, H)  # head k·G + g
        k_BxTxKxH, v_BxTxKxH = qkv_BxTxKxCxH[:, :, :, G], qkv_BxTxKxCxH[:, :, :, G + 1]
        normalize = HEAD_NORMS[config.qk_norm]  # qk_norm: unit RMS per head, before RoPE
        rotate = ROTATIONS[config.pos_embedding]  # RoPE turns q and k by position; GPT-2 does not
        q_BxTxNxH = rotate(normalize(q_BxTxNxH, config), position_BxT, config)
        k_BxTxKxH = rotate(normalize(k_BxTxKxH, config), position_BxT, config)
        new = None if cache is None else cache.encode(k_BxTxKxH, v_BxTxKxH)  # for the cache, as it stores them
        if not ring:  # every query sees keys and values of the whole row: gathered over `context` (MaxText's default)
            k_BxTxKxH, v_BxTxKxH = (constrain(a, ("batch", None, "heads", None)) for a in (k_BxTxKxH, v_BxTxKxH))
        if ring:
            ids_BxT = jnp.zeros_like(position_BxT) if segment_ids_BxT is None else segment_ids_BxT
            y_BxTxNxH = ring_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, position_BxT, ids_BxT, seq_axis)
        elif cached:  # a decode step: the layer's cache before start_B, and the new tokens themselves
            y_BxTxNxH = cache.attend(q_BxTxNxH, new, start_B)
        elif kind == "einsum" or dropping:
            y_BxTxNxH = causal_attention(
                q_BxTxNxH,
                k_BxTxKxH,
                v_BxTxKxH,
                config.dropout,
                k_probs,
                segment_ids_BxT,
                segments.position_BxT if out_of_order else None,
            )
        elif kind == "splash":
            y_BxTxNxH = splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
        elif out_of_order:  # is_causal would compare array indices
            y_BxTxNxH = jax.nn.dot_product_attention(
                q_BxTxNxH,
                k_BxTxKxH,
                v_BxTxKxH,
                implementation=kind,
                mask=position_mask(segments.position_BxT, segment_ids_BxT),
            )
        else:  # cuDNN takes the segments' mask as an additive bias
            mask = None if segments is None else same_segment(segment_ids_BxT, 0, T, T)
            y_BxTxNxH = jax.nn.dot_product_attention(
                q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask, is_causal=True, implementation=kind
            )
        y_BTxD = linear(
            y_BxTxNxH.reshape(B * T, N * H), self.out_kernel.reshape(N * H, D), self.out_bias, config.quantization
        )
        return dropout(y_BTxD, config.dropout, k_out), new

    def _splash_heads_major(self, x_BTxD, batch_size: int, position_BxT, segment_ids_BxT):
        """Attention through splash with q, k and v made in the kernel's (B, heads, T, H) layout by the
        projection itself, and the output projection reading the kernel's output as it is: einsums whose
        dots XLA emits in those layouts, where the (B, T, heads, H) projection needed a transposed copy of
        q, k and v each way (and again in the backward pass and the recompute). Same parameters, same
        products: what differs from the path above is the order of the axes the matmuls write and read."""
        config = self.config
        (D, C, K, H), B = self.qkv_kernel.shape, batch_size
        G, T = C - 2, x_BTxD.shape[0] // B
        x_BxTxD = x_BTxD.reshape(B, T, D)
        kernel_DxCxKxH = self.qkv_kernel[...].astype(x_BTxD.dtype)
        # One dot each for q, k and v (the bias added to its own result): split from one dot's output, k
        # and v were copied apart. The query heads of group k are k·G .. k·G + G - 1: (K, G) flattens
        # to the model's head order.
        q_BxKxGxTxH = jnp.einsum("btd,dgkh->bkgth", x_BxTxD, kernel_DxCxKxH[:, :G])
        k_BxKxTxH, v_BxKxTxH = (jnp.einsum("btd,dkh->bkth", x_BxTxD, kernel_DxCxKxH[:, c]) for c in (G, G + 1))
        if self.qkv_bias is not None:
            bias_CxKxH = self.qkv_bias[...].astype(x_BTxD.dtype)
            q_BxKxGxTxH = q_BxKxGxTxH + bias_CxKxH[:G].swapaxes(0, 1)[:, :, None, :]
            k_BxKxTxH, v_BxKxTxH = k_BxKxTxH + bias_CxKxH[G, :, None, :], v_BxKxTxH + bias_CxKxH[G + 1, :, None, :]
        q_BxNxTxH = q_BxKxGxTxH.reshape(B, K * G, T, H)
        normalize = HEAD_NORMS[config.qk_norm]
        rotate = ROTATIONS[config.pos_embedding]
        # Heads split over `tensor` only where it divides the kv heads: the kernel runs per shard of
        # whole groups, and a query split alone would be gathered back each layer.
        axes = ("batch", "heads" if splits(K, "heads") else None, None, None)
        q_BxNxTxH = constrain(rotate(normalize(q_BxNxTxH, config), position_BxT, config, token_axis=2), axes)
        k_BxKxTxH = constrain(rotate(normalize(k_BxKxTxH, config), position_BxT, config, token_axis=2), axes)
        v_BxKxTxH = constrain(v_BxKxTxH, axes)
        y_BxNxTxH = splash_attention_heads_major(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT)
        y_BxTxD = jnp.einsum("bnth,nhd->btd", y_BxNxTxH, self.out_kernel[...].astype(x_BTxD.dtype))
        y_BTxD = y_BxTxD.reshape(B * T, D)
        return y_BTxD if self.out_bias is None else y_BTxD + self.out_bias[...].astype(x_BTxD.dtype)


def no_softcap(logits, cap: float):
    return logits


def tanh_softcap(logits, cap: float):
    """logit_softcap (Gemma 2, modded-nanogpt): cap·tanh(logits / cap) squashes every logit into
    (-cap, cap) smoothly, so the output layer cannot make the loss overconfident. Float32 logits in."""
    return cap * jnp.tanh(logits / cap)


SOFTCAPS = {False: no_softcap, True: tanh_softcap}  # by logit_softcap > 0


class Block(nnx.Module):
    """One layer: attention, then an MLP, or a mixture of experts when `sparse`."""

    def __init__(self, config: GPTConfig, key, sparse: bool = False):
        k_attn, k_mlp = jax.random.split(key)
        self.ln_1 = NORMS[config.norm](config)
        self.attn = Attention(config, k_attn)
        self.ln_2 = NORMS[config.norm](config)
        self.mlp = MoE(config, k_mlp) if sparse else MLPS[config.mlp](config, k_mlp)
        self.sparse = sparse

    def __call__(self, x_BTxD, batch_size: int, start_B, dropout_key=None, cache=None, segments=None):
        """(x, the new tokens' keys and values for the cache (None without one), router stats): the
        stats are MoE's, {} for a dense layer."""
        k_attn, k_mlp = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        y_BTxD, new = self.attn(self.ln_1(x_BTxD), batch_size, start_B, k_attn, cache, segments)
        x_BTxD = x_BTxD + y_BTxD
        if self.sparse:
            y_BTxD, stats = self.mlp(self.ln_2(x_BTxD), batch_size, k_mlp)
        else:
            y_BTxD, stats = self.mlp(self.ln_2(x_BTxD), k_mlp), {}
        return constrain(x_BTxD + y_BTxD, ("tokens", "embed_act")), new, stats


def keeping_attention(policy):
    """`policy`, and the attention kernel's inputs q, k, v, its output and log-sum-exp kept as well
    (layers/attention.SPLASH_RESIDUALS: a whole forward kernel, and the q, k, v layout work, not to redo
    in the backward pass)."""
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(SPLASH_RESIDUALS)
    )


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": keeping_attention(jax.checkpoint_policies.dots_saveable),
    "dots_with_no_batch_dims_saveable": keeping_attention(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}


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


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, key):
        k_wte, k_wpe, k_blocks = jax.random.split(key, 3)
        V, D = config.padded_vocab_size, config.n_embd
        self.wte = param(normal(k_wte, (V, D), 0.02), ("vocab", "embed"))
        self.wpe = (
            param(normal(k_wpe, (config.block_size, D), 0.02), ("seq_table", "embed"))
            if config.pos_embedding == "learned"
            else None
        )  # RoPE: q and k turn instead
        # GPT-2 ties the output layer to wte; Llama-style models may have their own.
        self.lm_head_kernel = (
            None
            if config.tie_embeddings
            else param(normal(jax.random.fold_in(key, 1), (D, V), 0.02), ("embed", "vocab"))
        )

        # One Block per layer key, stacked: each weight gets a leading `layers` axis. With experts,
        # the first moe_dense_layers are a dense stack of their own (a stack has one shape).
        def make_blocks(layer_keys, sparse: bool):
            return nnx.vmap(lambda k: Block(config, k, sparse), transform_metadata={nnx.PARTITION_NAME: "layers"})(
                layer_keys
            )

        layer_keys, n_dense = jax.random.split(k_blocks, config.n_layer), config.n_layer - config.sparse_layers
        self.dense_blocks = make_blocks(layer_keys[:n_dense], False) if config.sparse_layers and n_dense else None
        self.blocks = (
            make_blocks(layer_keys[n_dense:], True) if config.sparse_layers else make_blocks(layer_keys, False)
        )
        self.ln_f = NORMS[config.norm](config)
        self.config = config

    def __call__(self, idx_BxT, dropout_key=None, segment_ids_BxT=None, order_T=None):
        """Token ids (B, T) -> float32 logits (B, T, padded vocab). Dropout only with a key."""
        return self.forward(idx_BxT, dropout_key, segment_ids_BxT, order_T)[0]

    def forward(self, idx_BxT, dropout_key=None, segment_ids_BxT=None, order_T=None):
        """(logits, router stats): the stats of every sparse layer, stacked (router_stats);
        {} for a dense model. segment_ids_BxT (int32, B x T) packs several examples in a row: equal
        ids are one example, a contiguous run; a token attends only to its own example, whose
        positions start at 0. Each example's logits are then the ones it gets alone (a mixture of
        experts: with capacity_factor 0; a capacity is shared by a row's tokens). order_T (numpy, a
        permutation of range(T)): the rows' tokens (and segment ids) come permuted, array index i
        holding the row's token order_T[i] (context parallelism's balanced_order); logits come in
        the same order."""
        B, T = idx_BxT.shape
        x_BTxD, stats, w_DxV = self.features(idx_BxT, dropout_key, segment_ids_BxT, order_T)
        return self.head(x_BTxD, w_DxV).reshape(B, T, -1), stats

    def features(self, idx_BxT, dropout_key=None, segment_ids_BxT=None, order_T=None):
        """forward() up to the output layer: (the final norm's output (B*T, D), router stats, the output
        layer's matrix (D, padded vocab) in the compute dtype). head() turns any rows of the first into
        logits, so a loss can take them a slice of tokens at a time (train.py's loss_chunks)."""
        config = self.config
        B, T = idx_BxT.shape
        if T > config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {config.block_size}")
        table_VxD = self._table()
        x_BxTxD = self._embed_tokens(idx_BxT, table_VxD)
        segments = None if segment_ids_BxT is None else Segments.of(segment_ids_BxT)
        if order_T is not None:
            segments = permuted_segments(segment_ids_BxT, order_T, B)
        if self.wpe is not None and segments is not None:
            x_BxTxD = x_BxTxD + self.wpe[...][segments.position_BxT].astype(config.dtype)
        elif self.wpe is not None:
            x_BxTxD = x_BxTxD + self.wpe[...][:T].astype(config.dtype)
        # Between the matmuls, activations are 2-D (B*T, D): XLA:CPU's fast matmul path wants
        # one contracting dimension, and a weight gradient over (B, T) is 2x slower there.
        x_BTxD = constrain(x_BxTxD.reshape(B * T, -1), ("tokens", "embed_act"))
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        x_BTxD = dropout(x_BTxD, config.dropout, k_emb)
        x_BTxD, _, stats = self._run_blocks(x_BTxD, B, jnp.zeros(B, jnp.int32), k_layers, segments=segments)
        return self.ln_f(x_BTxD), stats, self._output_matrix(table_VxD)

    def head(self, x_NxD, w_DxV):
        """Float32 logits (N, padded vocab) of final-norm outputs, by the matrix features() gave."""
        return self._mask_padding(self._unembed(x_NxD, w_DxV))

    def decode(self, idx_BxT, cache: KVCache, start_B, last_B=None, attend: int | str | None = None):
        """Run T new tokens per row, at positions start_B[b] + [0, T), against the cache.

        A decode step is T = 1. The tokens attend to the cache's positions before start_B[b] and
        to each other; only the cache's first `attend` positions are read (default: all), so the
        caller that knows every start_B[b] <= attend reads no more than it must. attend=FILLED (T = 1,
        one device) reads each block of rows' filled positions instead, through
        layers/decode_attention.py's kernel: the cheaper step when rows differ in length (a serving
        engine's slots). A step's (T = 1) cache may hold more rows than B: the tokens are its first
        B rows, and the others are neither read nor written (a serving engine's busy slots, when
        they fit a smaller program). Returns float32 logits (B, padded vocab) of each row's token at
        index last_B[b] (default: the last) and the cache with the new tokens' keys and values
        written in. No dropout; positions must stay below block_size (the caller checks: a gather
        here would clamp silently).
        """
        if attend == FILLED and idx_BxT.shape[1] != 1:
            raise ValueError(f"attend={FILLED!r} is for one token per row; got {idx_BxT.shape[1]}")
        logits_BxV, new = self._cached_forward(idx_BxT, cache, start_B, last_B, attend)
        return logits_BxV, cache.write(new, start_B)

    def prefill(self, idx_BxT, length: int, last_B=None):
        """Prompts (B, T), right-padded, from position 0 through the training path's attention
        (config.attention: a fused kernel where there is one), not against a cache. Returns float32
        logits (B, padded vocab) of each row's token at index last_B[b] (default: the last) and a
        cache of `length` positions holding the prompts' keys and values in its first T."""
        B, T = idx_BxT.shape
        empty = init_cache(self.config, B, 0)  # tells each layer to hand on its keys and values
        logits_BxV, new = self._cached_forward(idx_BxT, empty, jnp.zeros(B, jnp.int32), last_B)
        return logits_BxV, new.padded(length)

    def _cached_forward(self, idx_BxT, cache: KVCache, start_B, last_B, attend=None):
        """(logits at last_B, every layer's new keys and values (L, B, T, K·H) as the cache stores them)."""
        config = self.config
        B, T = idx_BxT.shape
        table_VxD = self._table()
        x_BxTxD = self._embed_tokens(idx_BxT, table_VxD)
        if self.wpe is not None:  # per row: any prompt length
            x_BxTxD = x_BxTxD + self.wpe[...][start_B[:, None] + jnp.arange(T)].astype(config.dtype)
        x_BTxD = constrain(x_BxTxD.reshape(B * T, -1), ("tokens", "embed_act"))
        x_BTxD, new, _ = self._run_blocks(x_BTxD, B, start_B, None, cache, attend=attend)
        if T == 1:  # a decode step: each row's one token
            x_BxD = x_BTxD
        else:  # the vocab matmul for B rows only
            last_B = jnp.full((B,), T - 1) if last_B is None else last_B
            x_BxD = x_BTxD.reshape(B, T, -1)[jnp.arange(B), last_B]
        return self.head(self.ln_f(x_BxD), self._output_matrix(table_VxD)), new

    def _table(self):
        """wte in the compute dtype, gathered over `fsdp` (it stays split over `tensor` by vocabulary):
        the one copy that the lookup and the tied output layer share, so that under FSDP the table
        is gathered once per step, in the compute dtype (it was gathered three times: in float32 for
        the lookup, in two layouts for the output layer). A lookup in a table split by width made
        XLA replicate it on every device."""
        return constrain(self.wte[...].astype(self.config.dtype), ("vocab", "embed_act"))

    def _embed_tokens(self, idx_BxT, table_VxD):
        """Rows of the table in the compute dtype: rounded before the position rows are added, as
        weights cast for inference (cast_for_inference) hold them."""
        return embedding_lookup(table_VxD, idx_BxT)

    def _output_matrix(self, table_VxD):
        """The output layer's (D, padded vocab) matrix in the compute dtype: the tied embedding, or
        lm_head_kernel."""
        w_DxV = table_VxD.T if self.lm_head_kernel is None else self.lm_head_kernel[...]
        return w_DxV.astype(table_VxD.dtype)

    def _unembed(self, x_NxD, w_DxV):
        """Float32 logits (N, padded vocab), soft-capped if logit_softcap says so (training and
        decoding alike: both come through here), from operands in the compute dtype (logits_matmul)."""
        logits_NxV = logits_matmul(x_NxD, w_DxV.astype(x_NxD.dtype))
        cap = self.config.logit_softcap
        return SOFTCAPS[cap > 0](logits_NxV, cap)

    def _mask_padding(self, logits_xV):
        """The padding entries of the vocabulary get -inf: the model is exactly GPT-2's."""
        config = self.config
        if config.padded_vocab_size == config.vocab_size:
            return logits_xV
        is_real_token = jnp.arange(config.padded_vocab_size) < config.vocab_size
        return jnp.where(is_real_token, logits_xV, -jnp.inf)

    def _run_blocks(self, x_BTxD, batch_size: int, start_B, dropout_key, cache=None, segments=None, attend=None):
        """The layer stacks in order; with a cache (L, B, S, K·H), each layer reads its slice (the
        first `attend` positions; with attend=FILLED the kernel reads the whole cache in place).
        Returns (x, the new tokens' keys and values of every layer (L, B, T, K·H) when there is a
        cache, else None, the sparse layers' router stats)."""
        config = self.config
        layer_keys = None if dropout_key is None else jax.random.split(dropout_key, config.n_layer)
        if self.dense_blocks is None:
            return self._run_stack(self.blocks, x_BTxD, batch_size, start_B, layer_keys, cache, segments, attend)
        n = config.n_layer - config.sparse_layers  # the dense stack comes first
        part = lambda tree, lo, hi: None if tree is None else jax.tree.map(lambda a: a[lo:hi], tree)
        # the kernel takes the whole cache and a layer number (a slice of the cache would be a copy)
        in_place = attend == FILLED
        stack_cache = lambda lo, hi: cache if in_place else part(cache, lo, hi)
        x_BTxD, dense_new, _ = self._run_stack(
            self.dense_blocks, x_BTxD, batch_size, start_B, part(layer_keys, 0, n), stack_cache(0, n), segments, attend
        )
        x_BTxD, sparse_new, stats = self._run_stack(
            self.blocks,
            x_BTxD,
            batch_size,
            start_B,
            part(layer_keys, n, None),
            stack_cache(n, None),
            segments,
            attend,
            first_layer=n if in_place else 0,
        )
        new = None if cache is None else jax.tree.map(lambda a, b: jnp.concatenate([a, b]), dense_new, sparse_new)
        return x_BTxD, new, stats

    def _run_stack(
        self,
        blocks,
        x_BTxD,
        batch_size: int,
        start_B,
        layer_keys,
        cache,
        segments=None,
        attend=None,
        first_layer: int = 0,
    ):
        """The stack of `blocks`, whose layers are the cache's from first_layer on."""
        config = self.config
        graphdef, stacked_state = nnx.split(blocks)
        # a decode step through the attention kernel reads the whole cache in place (one token per row)
        in_place = attend == FILLED and cache is not None and cache.length > 0
        prefix = None if attend == FILLED else attend

        def one_layer(batch_size: int, start_B, segments):
            def layer(x_BTxD, layer_inputs):
                layer_state, layer_key, layer_index = layer_inputs
                # The cache is read, never carried: the layer's first `attend` positions, sliced in one
                # go so that XLA reads them inside the attention (a slice of the layer's whole cache
                # first was materialised: a copy per layer and step on TPUs).
                if cache is None:
                    layer_cache = None
                elif in_place:
                    layer_cache = cache.in_place(layer_index)
                else:
                    layer_cache = cache.layer(layer_index, prefix, batch_size)
                x_BTxD, new, stats = nnx.merge(graphdef, layer_state)(
                    x_BTxD, batch_size, start_B, layer_key, layer_cache, segments
                )
                return x_BTxD, (new, stats)

            if config.remat_policy == "none" or cache is not None:  # decoding keeps no activations
                return layer
            return jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat_policy])

        def run_layers(x_BTxD, layers, batch_size: int, start_B, segments=None):
            layer = one_layer(batch_size, start_B, segments)
            if config.scan_layers:
                return jax.lax.scan(layer, x_BTxD, layers)
            outputs = []  # unrolled: same stacked weights, one copy of the layer per depth in the program
            for i in range(jax.tree.leaves(layers)[0].shape[0]):
                x_BTxD, layer_outputs = layer(x_BTxD, jax.tree.map(lambda a: a[i], layers))
                outputs.append(layer_outputs)
            return x_BTxD, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)

        if config.pipeline_stages == 1 or cache is not None:  # decoding never pipelines
            layers_here = jax.tree.leaves(stacked_state)[0].shape[0]
            layer_indices = None if cache is None else first_layer + jnp.arange(layers_here)
            x_BTxD, (new, stats) = run_layers(
                x_BTxD, (stacked_state, layer_keys, layer_indices), batch_size, start_B, segments
            )
            return x_BTxD, new, stats

        M = config.pipeline_microbatches
        rows = batch_size // M
        # The micro-batches' segments, as pipeline.run cuts the rows: micro-batch m has rows m, m + M, ...
        micro_segments = (
            None
            if segments is None
            else jax.tree.map(lambda a_BxT: a_BxT.reshape(rows, M, -1).swapaxes(0, 1), segments)
        )

        def micro_batch_layers(x_NxD, layers, microbatch):
            state, keys = layers
            keys = None if keys is None else jax.vmap(jax.random.fold_in, (0, None))(keys, microbatch)
            segments = None if micro_segments is None else jax.tree.map(lambda a: a[microbatch], micro_segments)
            x_NxD, (_, stats) = run_layers(x_NxD, (state, keys, None), rows, start_B[:rows], segments)
            return x_NxD, stats

        x_BTxD, stats = pipeline.run(
            micro_batch_layers,
            (stacked_state, layer_keys),
            x_BTxD,
            batch_size,
            stages=config.pipeline_stages,
            microbatches=config.pipeline_microbatches,
            layers_per_stage=config.layers_per_stage,
            constrain=constrain,
        )
        return x_BTxD, None, stats


def cast_for_inference(params, dtype):
    """Parameters as the forward pass computes with them, cast once: the weight matrices and the
    embedding tables in the compute dtype (where the forward pass rounds them, at each use), the norm
    scales, the biases and a mixture of experts' router kept in float32 (which it uses as they are,
    or casts itself). A forward pass on the result computes exactly what it computes on the float32
    parameters, and a decode loop reads half the bytes at bfloat16. Works on the parameters' pure
    dict (nnx.to_pure_dict), stacked layers included."""

    def cast(path, p):
        name = path[-1].key
        is_matrix = name in ("wte", "wpe") or (name.endswith("_kernel") and name != "router_kernel")
        return p.astype(dtype) if is_matrix and not isinstance(p, quantization.Int8Weight) else p

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=lambda p: isinstance(p, quantization.Int8Weight))


def count_params(config: GPTConfig) -> int:
    """Number of parameters, computed from shapes only (nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: GPT(config, jax.random.key(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def matmul_params(config: GPTConfig) -> int:
    """Parameters that multiply activations: all but the lookup tables, i.e. wpe, and wte when
    the output layer is its own lm_head_kernel (tied, wte counts once, as the output layer).
    Norm scales and biases are in, as nanoGPT counts them (they are ~0.1%)."""
    lookups = (config.block_size * config.n_embd if config.pos_embedding == "learned" else 0) + (
        0 if config.tie_embeddings else config.padded_vocab_size * config.n_embd
    )
    return count_params(config) - lookups


def idle_expert_params(config: GPTConfig) -> int:
    """Expert weights a token does not use: the n_experts - experts_per_token experts it is not
    routed to, in every sparse layer (0 for a dense model)."""
    matrices = 3 if config.mlp == "swiglu" else 2
    idle = config.n_experts - config.experts_per_token
    return config.sparse_layers * idle * matrices * config.n_embd * config.expert_hidden_size


def active_params(config: GPTConfig) -> int:
    """Parameters one token uses (a mixture of experts' 'active parameters'; all of a dense model)."""
    return count_params(config) - idle_expert_params(config)


def describe_params(config: GPTConfig) -> str:
    """'124,475,904 parameters', or for a mixture of experts also the ones a token uses."""
    total = f"{count_params(config):,} parameters"
    return f"{total} ({active_params(config):,} active)" if config.n_experts else total


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) + attention scores/values.

    6N counts matmul_params: SwiGLU's third matrix and grouped-query attention's smaller
    key/value projections are in it (relu2 has gelu's two). 12·L·T·D is the attention's QK^T and AV
    over a context of T tokens for n_head query heads of size D / n_head, whatever n_kv_head is.
    Elementwise work is not counted: norms, activations, qk_norm (~3 FLOPs per q/k element) and
    logit_softcap (~3 per logit) are well under 1% of a step's FLOPs. A mixture of experts counts
    its active parameters (the router and the experts_per_token experts a token goes to); its
    one-hot dispatch and combine einsums are overhead, left out like the rest.
    """
    T = seq_len or config.block_size
    return 6 * (matmul_params(config) - idle_expert_params(config)) + 12 * config.n_layer * T * config.n_embd
