"""GPT-2 in Flax NNX, and with a few switches a Llama-style decoder.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `mlp`, `layers`, ...) as its
`out_sharding` metadata; sharding.py maps those names to mesh axes, so this file knows nothing about
devices. The layers are stored stacked (one array per weight with a leading `layers` axis) and run
with lax.scan, so compile time does not grow with depth.

Shape suffixes name the axes: B batch, T time, D model width, N heads, K key/value heads, H head size,
V vocabulary, L layers, S the KV cache's capacity; BT is batch and time flattened into one axis.

GPT-2 is the default; `pos_embedding='rope'`, `norm='rmsnorm'`, `mlp='swiglu'`, `n_kv_head`, `bias=False`
and `tie_embeddings=False` give Llama-style models, `n_experts` a mixture of experts. Each switch is a
small function or module in layers/, picked once by name from a table (ROTATIONS, HEAD_NORMS, NORMS,
MLPS, SOFTCAPS, ATTENTION), or a parameter that is there or not (wpe, lm_head_kernel, the biases, the
LoRA adapters beside the blocks' matrices that lora_rank adds: layers/lora.py): the forward pass has no
branches on them. How attention runs (XLA, written out, splash or cuDNN kernels, ring) is chosen once
per traced program by layers/attention.choose_attention; the forward pass reads projection -> norm and
rotation -> attention -> projection whatever runs underneath.

Packed rows (several examples in one row) carry segment ids (B, T): attention never crosses a segment
and positions restart at 0 in each. `GPT.prefill` and `GPT.decode` run tokens for generation against a
KV cache (layers/kv_cache.py); the training forward never touches it.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers import lora, pipeline, quantization
from layers.attention import REMAT_POLICIES, Attend, Segments, choose_attention, permuted_segments
from layers.blocks import HEAD_NORMS, MLPS, NORMS, constrain, linear, residual_init
from layers.embedding import SOFTCAPS, embedding_lookup, logits_matmul
from layers.kv_cache import Filled, InPlaceLayer, KVCache, Prefix, init_cache
from layers.moe import MoE
from layers.params import dropout, normal, param
from layers.rope import ROTATIONS


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
    # LoRA (layers/lora.py): low-rank adapters beside the blocks' dense matrices; 0 = none
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
    lora_targets: str = "all"  # comma-separated lora.TARGETS (q, k, v, o, gate, up, down), or 'all'
    lora_dropout: float = 0.0  # dropout on the adapters' input, in training
    weight_dtype: str = "auto"  # 'int8': the blocks' matrices are quantization.Int8Weight (a LoRA run's frozen
    #                             base), which the projections read in the (B, T, heads, H) layout only

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
        qkv_bias = config.bias or config.qkv_bias
        self.qkv_bias = param(jnp.zeros((G + 2, K, H)), ("qkv", "heads", "head_dim")) if qkv_bias else None
        self.out_bias = param(jnp.zeros(D), ("norm",)) if config.bias else None
        # LoRA adapters (None unless targeted): q's output is the N query heads, k's and v's the K groups
        self.q_lora = lora.adapter(config, "q", key, (D,), ("embed",), (N, H), ("heads", "head_dim"))
        self.k_lora = lora.adapter(config, "k", key, (D,), ("embed",), (K, H), ("heads", "head_dim"))
        self.v_lora = lora.adapter(config, "v", key, (D,), ("embed",), (K, H), ("heads", "head_dim"))
        self.o_lora = lora.adapter(config, "o", key, (N, H), ("heads", "head_dim"), (D,), ("embed",))
        self.config = config

    def __call__(self, x_BTxD, position_BxT, segments: Segments | None, attend: Attend, dropout_key=None):
        """Each row's tokens, at positions position_BxT, attend causally to the row's tokens (of their
        own segment when packed) through `attend`. Returns the output and the keys and values, which a
        prefill stores: (B, T, K, H), or (B, K, T, H) when attend.heads_major."""
        k_probs, k_out = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        k_lora = lora.dropout_key(dropout_key)
        q, k, v = self._qkv(x_BTxD, position_BxT, attend.heads_major, k_lora)
        y = attend(q, k, v, position_BxT, segments, k_probs)
        return dropout(self._out(y, attend.heads_major, k_lora), self.config.dropout, k_out), (k, v)

    def decode(self, x_BTxD, start_B, cache: KVCache | InPlaceLayer):
        """T new tokens per row, at positions start_B[b] + [0, T), against one layer of the cache: its
        positions before start_B[b] and the new tokens themselves (layers/kv_cache.py's attend).
        Returns the output and the new keys and values as the cache stores them."""
        position_BxT = start_B[:, None] + jnp.arange(x_BTxD.shape[0] // start_B.shape[0])
        q, k, v = self._qkv(x_BTxD, position_BxT, heads_major=False)
        new = cache.encode(k, v)
        return self._out(cache.attend(q, new, start_B), heads_major=False), new

    def _qkv(self, x_BTxD, position_BxT, heads_major: bool, lora_key=None):
        """q (B, T, N, H) and k, v (B, T, K, H), or each (B, heads, T, H) when heads_major, with their
        LoRA adapters' outputs added; qk_norm gives q and k unit RMS per head, then RoPE turns them by
        position (GPT-2 does neither)."""
        config = self.config
        project = self._project_heads_major if heads_major else self._project
        q, k, v = project(x_BTxD, *position_BxT.shape)
        adapters = (self.q_lora, self.k_lora, self.v_lora)
        q, k, v = (lora.add(a, x_BTxD, y, lora_key, heads_major) for a, y in zip(adapters, (q, k, v)))
        normalize, rotate = HEAD_NORMS[config.qk_norm], ROTATIONS[config.pos_embedding]
        q, k = (rotate(normalize(a, config), position_BxT, config, token_axis=2 if heads_major else 1) for a in (q, k))
        return q, k, v

    def _project(self, x_BTxD, B: int, T: int):
        """One 2-D matmul with the head axis K (the one `tensor` splits) outermost of the output columns:
        flattening (K, C, H) then splits columns as K is split, so each device multiplies by its own
        heads' slice (Megatron). Flattening (C, K, H) would gather the whole kernel."""
        (D, C, K, H), G = self.qkv_kernel.shape, self.qkv_kernel.shape[1] - 2
        kernel_DxKCH = self.qkv_kernel[...].transpose(0, 2, 1, 3).reshape(D, K * C * H)
        bias = None if self.qkv_bias is None else self.qkv_bias[...].swapaxes(0, 1).reshape(K * C * H)
        qkv_BTxKCH = linear(x_BTxD, kernel_DxKCH, bias, self.config.quantization)
        qkv_BxTxKxCxH = constrain(qkv_BTxKCH.reshape(B, T, K, C, H), ("batch", "seq", "heads", None, None))
        q_BxTxNxH = qkv_BxTxKxCxH[:, :, :, :G].reshape(B, T, K * G, H)  # head k·G + g
        return q_BxTxNxH, qkv_BxTxKxCxH[:, :, :, G], qkv_BxTxKxCxH[:, :, :, G + 1]

    def _project_heads_major(self, x_BTxD, B: int, T: int):
        """q, k and v made in the kernel's (B, heads, T, H) layout by the projection itself: einsums whose
        dots XLA emits in that layout, where the 2-D projection needed a transposed copy of each (and
        again in the backward pass and the recompute). One dot each for q, k and v: split from one
        dot's output, k and v were copied apart."""
        (D, _, K, H), G = self.qkv_kernel.shape, self.qkv_kernel.shape[1] - 2
        x_BxTxD, kernel_DxCxKxH = x_BTxD.reshape(B, T, D), self.qkv_kernel[...].astype(x_BTxD.dtype)
        q_BxKxGxTxH = jnp.einsum("btd,dgkh->bkgth", x_BxTxD, kernel_DxCxKxH[:, :G])
        k_BxKxTxH, v_BxKxTxH = (jnp.einsum("btd,dkh->bkth", x_BxTxD, kernel_DxCxKxH[:, c]) for c in (G, G + 1))
        if self.qkv_bias is not None:
            bias_CxKxH = self.qkv_bias[...].astype(x_BTxD.dtype)
            q_BxKxGxTxH = q_BxKxGxTxH + bias_CxKxH[:G].swapaxes(0, 1)[:, :, None, :]
            k_BxKxTxH, v_BxKxTxH = k_BxKxTxH + bias_CxKxH[G, :, None, :], v_BxKxTxH + bias_CxKxH[G + 1, :, None, :]
        return q_BxKxGxTxH.reshape(B, K * G, T, H), k_BxKxTxH, v_BxKxTxH  # (K, G) flattens to head k·G + g

    def _out(self, y, heads_major: bool, lora_key=None):
        """The output projection (B·T, D) of y (B, T, N, H), or of (B, N, T, H) read as it is, with its
        LoRA adapter's output added (which reads heads-major y as (B, T, N, H))."""
        N, H, D = self.out_kernel.shape
        if heads_major:
            y_BxTxD = jnp.einsum("bnth,nhd->btd", y, self.out_kernel[...].astype(y.dtype)).reshape(-1, D)
            y_BTxD = y_BxTxD if self.out_bias is None else y_BxTxD + self.out_bias[...].astype(y.dtype)
            return lora.add(self.o_lora, y.swapaxes(1, 2).reshape(-1, N * H), y_BTxD, lora_key)
        y_BTxNH = y.reshape(-1, N * H)
        y_BTxD = linear(y_BTxNH, self.out_kernel.reshape(N * H, D), self.out_bias, self.config.quantization)
        return lora.add(self.o_lora, y_BTxNH, y_BTxD, lora_key)


class Block(nnx.Module):
    """One layer: attention, then an MLP, or a mixture of experts when `sparse`."""

    def __init__(self, config: GPTConfig, key, sparse: bool = False):
        k_attn, k_mlp = jax.random.split(key)
        self.ln_1 = NORMS[config.norm](config)
        self.attn = Attention(config, k_attn)
        self.ln_2 = NORMS[config.norm](config)
        self.mlp = MoE(config, k_mlp) if sparse else MLPS[config.mlp](config, k_mlp)
        self.sparse = sparse

    def __call__(self, x_BTxD, position_BxT, segments, attend: Attend, dropout_key=None):
        """(x, the tokens' keys and values, the router stats: MoE's, {} for a dense layer)."""
        k_attn, k_mlp = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        y_BTxD, kv = self.attn(self.ln_1(x_BTxD), position_BxT, segments, attend, k_attn)
        x_BTxD, stats = self._feed_forward(x_BTxD + y_BTxD, position_BxT.shape[0], k_mlp)
        return x_BTxD, kv, stats

    def decode(self, x_BTxD, start_B, cache):
        """(x, the new tokens' keys and values as the cache stores them)."""
        y_BTxD, new = self.attn.decode(self.ln_1(x_BTxD), start_B, cache)
        return self._feed_forward(x_BTxD + y_BTxD, start_B.shape[0])[0], new

    def _feed_forward(self, x_BTxD, batch_size: int, dropout_key=None):
        if self.sparse:
            y_BTxD, stats = self.mlp(self.ln_2(x_BTxD), batch_size, dropout_key)
        else:
            y_BTxD, stats = self.mlp(self.ln_2(x_BTxD), dropout_key), {}
        return constrain(x_BTxD + y_BTxD, ("tokens", "embed_act")), stats


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, key):
        k_wte, k_wpe, k_blocks = jax.random.split(key, 3)
        V, D = config.padded_vocab_size, config.n_embd
        self.wte = param(normal(k_wte, (V, D), 0.02), ("vocab", "embed"))
        self.wpe = (  # RoPE: q and k turn instead
            param(normal(k_wpe, (config.block_size, D), 0.02), ("seq_table", "embed"))
            if config.pos_embedding == "learned"
            else None
        )
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
        sparse = config.sparse_layers > 0
        self.blocks = make_blocks(layer_keys[n_dense:], True) if sparse else make_blocks(layer_keys, False)
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
        segments = None if segment_ids_BxT is None else Segments.of(segment_ids_BxT)
        if order_T is not None:
            segments = permuted_segments(segment_ids_BxT, order_T, B)
        position_BxT = jnp.broadcast_to(jnp.arange(T), (B, T)) if segments is None else segments.position_BxT
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        table_VxD = self._table()
        x_BTxD = self._embed(idx_BxT, table_VxD, None if segments is None else position_BxT)
        x_BTxD = dropout(x_BTxD, config.dropout, k_emb)
        attend = choose_attention(config, T, dropout=dropout_key is not None and config.dropout > 0)
        x_BTxD, stats = self._run_blocks(x_BTxD, position_BxT, segments, attend, k_layers)
        return self.ln_f(x_BTxD), stats, self._output_matrix(table_VxD)

    def head(self, x_NxD, w_DxV):
        """Float32 logits (N, padded vocab) of final-norm outputs, by the matrix features() gave:
        soft-capped if logit_softcap says so; the vocabulary's padding entries -inf."""
        cap, config = self.config.logit_softcap, self.config
        logits_NxV = SOFTCAPS[cap > 0](logits_matmul(x_NxD, w_DxV), cap)
        if config.padded_vocab_size == config.vocab_size:
            return logits_NxV
        return jnp.where(jnp.arange(config.padded_vocab_size) < config.vocab_size, logits_NxV, -jnp.inf)

    def prefill(self, idx_BxT, length: int, last_B=None):
        """Prompts (B, T), right-padded, from position 0 through the training path's attention (a fused
        kernel where config.attention names one). Returns float32 logits (B, padded vocab) of each row's
        token at index last_B[b] (default: the last) and a cache of `length` positions holding the
        prompts' keys and values in its first T."""
        B, T = idx_BxT.shape
        position_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
        attend = choose_attention(self.config, T)
        empty = init_cache(self.config, B, 0)  # no positions: how the cache stores keys and values, for encode

        def layer(block, x_BTxD, number):
            x_BTxD, (k, v), _ = block(x_BTxD, position_BxT, None, attend)
            return x_BTxD, empty.encode(attend.tokens_major(k), attend.tokens_major(v))

        table_VxD = self._table()
        x_BTxD, new = self._run_cached(self._embed(idx_BxT, table_VxD), layer)
        return self._last_logits(x_BTxD, B, table_VxD, last_B), new.padded(length)

    def decode(self, idx_BxT, cache: KVCache, start_B, last_B=None, reads: Prefix | Filled | None = None):
        """Run T new tokens per row, at positions start_B[b] + [0, T), against the cache.

        A decode step is T = 1. The tokens attend to the cache's positions before start_B[b] and to
        each other, reading the cache as `reads` says (layers/kv_cache.py): Prefix(n), its first n
        positions (default: all; the caller that knows every start_B[b] <= n reads no more than it must), or FILLED,
        each block of rows' filled positions through layers/decode_attention.py's kernel (T = 1, one
        device). A step's cache may hold more rows than B: the tokens are its first B rows, and the
        others are neither read nor written. Returns float32 logits (B, padded vocab) of each row's
        token at index last_B[b] (default: the last) and the cache with the new tokens' keys and
        values written in. No dropout; positions must stay below block_size (the caller checks: a
        gather here would clamp silently)."""
        B, T, reads = *idx_BxT.shape, reads or Prefix()
        layer = lambda block, x_BTxD, number: block.decode(x_BTxD, start_B, reads.layer(cache, number, B))
        table_VxD = self._table()
        x_BTxD, new = self._run_cached(self._embed(idx_BxT, table_VxD, start_B[:, None] + jnp.arange(T)), layer)
        return self._last_logits(x_BTxD, B, table_VxD, last_B), cache.write(new, start_B)

    def _embed(self, idx_BxT, table_VxD, position_BxT=None):
        """(B·T, D) token rows in the compute dtype (rounded before the position rows are added, as
        cast_for_inference's weights hold them), plus wpe's rows at each position (GPT-2; default:
        0..T-1 in every row). Activations between the matmuls are 2-D: XLA:CPU's fast matmul path
        wants one contracting dimension, and a weight gradient over (B, T) is 2x slower there."""
        B, T = idx_BxT.shape
        x_BxTxD = embedding_lookup(table_VxD, idx_BxT).astype(self.config.dtype)  # an int8 table's rows are float32
        if self.wpe is not None:
            wpe_xD = self.wpe[...][:T] if position_BxT is None else self.wpe[...][position_BxT]
            x_BxTxD = x_BxTxD + wpe_xD.astype(self.config.dtype)
        return constrain(x_BxTxD.reshape(B * T, -1), ("tokens", "embed_act"))

    def _table(self):
        """wte in the compute dtype, gathered over `fsdp` (it stays split over `tensor` by vocabulary):
        the one copy that the lookup and the tied output layer share, so that under FSDP the table is
        gathered once per step, in the compute dtype. A lookup in a table split by width made XLA
        replicate it on every device. A served int8 table stays int8 (its values and its scales per row)."""
        return constrain(quantization.cast_weight(self.wte[...], self.config.dtype), ("vocab", "embed_act"))

    def _output_matrix(self, table_VxD):
        """The output layer's (D, padded vocab) matrix in the compute dtype (or int8): wte tied, or lm_head_kernel."""
        w_DxV = table_VxD.T if self.lm_head_kernel is None else self.lm_head_kernel[...]
        return quantization.cast_weight(w_DxV, self.config.dtype)

    def _last_logits(self, x_BTxD, B: int, table_VxD, last_B=None):
        """Logits (B, padded vocab) of each row's token at index last_B[b] (default: the last): the
        output layer for B rows only."""
        x_BxTxD = x_BTxD.reshape(B, -1, x_BTxD.shape[-1])
        x_BxD = x_BxTxD[:, -1] if last_B is None else x_BxTxD[jnp.arange(B), last_B]
        return self.head(self.ln_f(x_BxD), self._output_matrix(table_VxD))

    def _stacks(self):
        """The layer stacks in order, each with the number of its first layer."""
        if self.dense_blocks is None:
            return [(self.blocks, 0)]
        return [(self.dense_blocks, 0), (self.blocks, self.config.n_layer - self.config.sparse_layers)]

    def _run_blocks(self, x_BTxD, position_BxT, segments, attend: Attend, dropout_key):
        """Every layer without a cache (training, scoring): remat'd as remat_policy says, pipelined over
        the `stage` axis when pipeline_stages > 1. Returns (x, the sparse layers' router stats)."""
        config = self.config
        keys = None if dropout_key is None else jax.random.split(dropout_key, config.n_layer)
        for blocks, first in self._stacks():
            graphdef, stacked_state = nnx.split(blocks)
            n = jax.tree.leaves(stacked_state)[0].shape[0]
            stack_keys = None if keys is None else keys[first : first + n]

            # the whole batch's positions and segments by default; _pipeline passes each micro-batch's
            def layer(x_BTxD, layer_inputs, position_BxT=position_BxT, segments=segments):
                layer_state, layer_key = layer_inputs
                x_BTxD, _, stats = nnx.merge(graphdef, layer_state)(x_BTxD, position_BxT, segments, attend, layer_key)
                return x_BTxD, stats

            if config.remat_policy != "none":
                layer = jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat_policy])
            if config.pipeline_stages == 1:
                x_BTxD, stats = scan_layers(layer, x_BTxD, (stacked_state, stack_keys), config.scan_layers)
            else:
                x_BTxD, stats = self._pipeline(layer, x_BTxD, position_BxT, segments, stacked_state, stack_keys)
        return x_BTxD, stats

    def _pipeline(self, layer, x_BTxD, position_BxT, segments, stacked_state, keys):
        """A stack run as a pipeline over the `stage` mesh axis (layers/pipeline.py): micro-batch m
        has rows m, m + M, ..., with their positions and segments."""
        config, B = self.config, position_BxT.shape[0]
        M = config.pipeline_microbatches
        micro = lambda a_BxT: a_BxT.reshape(B // M, M, -1).swapaxes(0, 1)
        micro_positions, micro_segments = micro(position_BxT), jax.tree.map(micro, segments)

        def micro_batch_layers(x_NxD, layers, microbatch):
            state, keys = layers
            keys = None if keys is None else jax.vmap(jax.random.fold_in, (0, None))(keys, microbatch)
            positions, segments = micro_positions[microbatch], jax.tree.map(lambda a: a[microbatch], micro_segments)
            step = lambda x, inputs: layer(x, inputs, positions, segments)
            return scan_layers(step, x_NxD, (state, keys), config.scan_layers)

        return pipeline.run(
            micro_batch_layers,
            (stacked_state, keys),
            x_BTxD,
            B,
            stages=config.pipeline_stages,
            microbatches=M,
            layers_per_stage=config.layers_per_stage,
            constrain=constrain,
        )

    def _run_cached(self, x_BTxD, layer):
        """A prefill's or decode step's pass through every layer: layer(block, x, its number) -> (x, the
        layer's new keys and values as the cache stores them). Returns (x, those of every layer,
        stacked (L, B, T, K·H)). The cache is read, never carried, by the layer's number."""
        news = []
        for blocks, first in self._stacks():
            graphdef, stacked_state = nnx.split(blocks)
            numbers = first + jnp.arange(jax.tree.leaves(stacked_state)[0].shape[0])
            step = lambda x, inputs: layer(nnx.merge(graphdef, inputs[0]), x, inputs[1])
            x_BTxD, new = scan_layers(step, x_BTxD, (stacked_state, numbers), self.config.scan_layers)
            news.append(new)
        return x_BTxD, jax.tree.map(lambda *stacks: jnp.concatenate(stacks), *news)


def scan_layers(layer, x, per_layer, scan: bool = True):
    """x through layer(x, this layer's inputs) -> (x, outputs) for each layer of the stacked inputs:
    one lax.scan (a program whose size does not grow with depth), or unrolled (one copy of the layer
    per depth in the program). Returns x and the outputs stacked over the layers."""
    if scan:
        return jax.lax.scan(layer, x, per_layer)
    outputs = []
    for i in range(jax.tree.leaves(per_layer)[0].shape[0]):
        x, layer_outputs = layer(x, jax.tree.map(lambda a: a[i], per_layer))
        outputs.append(layer_outputs)
    return x, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)


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


def adapter_params(config: GPTConfig) -> int:
    """Parameters of the LoRA adapters (0 without them): what a LoRA run trains."""
    abstract = nnx.eval_shape(lambda: GPT(config, jax.random.key(0)))
    adapters, _ = lora.split(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(adapters)) if config.lora_rank else 0


def describe_params(config: GPTConfig) -> str:
    """'124,475,904 parameters', or for a mixture of experts also the ones a token uses."""
    total = f"{count_params(config):,} parameters"
    return f"{total} ({active_params(config):,} active)" if config.n_experts else total


def flops_per_token(config: GPTConfig, seq_len: int | None = None, causal_half: bool = False) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) + attention scores/values.

    6N counts matmul_params: SwiGLU's third matrix and grouped-query attention's smaller
    key/value projections are in it (relu2 has gelu's two). 12·L·T·D is the attention's QK^T and AV
    over a context of T tokens for n_head query heads of size D / n_head, whatever n_kv_head is:
    the whole T x T square (PaLM's and nanoGPT's count, this project's MFU). causal_half=True counts
    half of it, 6·L·T·D, the keys a causal mask leaves (MaxText's count since 2025).
    Elementwise work is not counted: norms, activations, qk_norm (~3 FLOPs per q/k element) and
    logit_softcap (~3 per logit) are well under 1% of a step's FLOPs. A mixture of experts counts
    its active parameters (the router and the experts_per_token experts a token goes to); its
    one-hot dispatch and combine einsums are overhead, left out like the rest. With LoRA the frozen
    weights count 4 (no weight gradient) and the adapters 6.
    """
    T = seq_len or config.block_size
    used = matmul_params(config) - idle_expert_params(config)
    frozen = used - adapter_params(config) if config.lora_rank else 0
    attention = (6 if causal_half else 12) * config.n_layer * T * config.n_embd
    return 6 * used - 2 * frozen + attention
