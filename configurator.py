"""Configuration: defaults below, then a plain-Python config file, then --key=value flags.

    python train.py config/shakespeare_char.py --batch_size=32 --dtype=bfloat16

A config file is ordinary Python; every top-level assignment whose name is a Config
field overrides that field. Flags are parsed as Python literals where they can be
(`--dropout=0.1`, `--bias=False`) and kept as strings otherwise (`--dataset=openwebtext`).
Unknown keys and values of the wrong type are errors that name the key and the fix.
Needs only the standard library, so it can be copied into another project as is.
"""

import ast
import dataclasses
import difflib
import inspect
import io
import json
import math
import os
import re
import runpy
import sys
import textwrap
import tokenize
import types
import typing


class ConfigError(ValueError):
    """A mistake in a config file or flag; the message says which key and how to fix it."""


def default_compile_cache() -> str:
    """Where the commands keep compiled programs by default: JAX's own JAX_COMPILATION_CACHE_DIR if set,
    else nanomax/jax in the user's cache directory ($XDG_CACHE_HOME, or ~/.cache)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "nanomax", "jax")


@dataclasses.dataclass(frozen=True)
class Config:
    # data and I/O
    dataset: str = "shakespeare_char"  # reads data/<dataset>/{train,val}.bin and meta.json
    data_dir: str = "data"
    out_dir: str = "out"  # checkpoints, TensorBoard events, the effective config
    init_from: str = "scratch"  # 'scratch' | 'resume' (latest checkpoint in out_dir) | a Hugging Face
    #                             model: a directory, or a hub name ('gpt2', 'HuggingFaceTB/SmolLM2-135M');
    #                             its config.json sets the model keys | another run's out_dir (its newest
    #                             checkpoint) | a PEFT LoRA adapter directory (on the base it names)
    overwrite_out_dir: bool = False  # a fresh run into an out_dir that holds checkpoints: delete
    #                                  them first (else it is refused)
    seed: int = 1337  # the batch and the dropout mask of step s depend only on (seed, s)
    document_masking: bool = False  # rows hold several documents, each opened by the tokenizer's begin-of-text
    #                                 token (else end-of-text): attention stays within one, positions from 0
    packing: bool = False  # a fine-tuning set (data/chat/prepare.py): several conversations per row, each
    #                        attending only to itself; False: one per row, padded
    # model (GPT-2 small by default, as in the paper)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 0  # 0 = take it from the dataset's meta.json
    pad_vocab_to_multiple: int = 1  # 64 pads GPT-2's 50257 to 50304 for faster matmuls
    dropout: float = 0.0  # nanoGPT's: on the embeddings, the attention probabilities and each block's outputs;
    #                      > 0 trains through the written-out attention (XLA's and cuDNN's kernels have none)
    bias: bool = True
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    dtype: str = "float32"  # compute dtype: 'float32' | 'bfloat16'; params stay float32
    scan_layers: bool = True  # run the stacked layers with lax.scan: compile time flat in depth
    remat_policy: str = "none"  # 'none' | 'full' | 'dots_saveable' | 'dots_with_no_batch_dims_saveable'
    attention: str = "auto"  # 'auto' (cuDNN's flash kernel on GPUs in bfloat16, the Pallas splash kernel on
    #                          TPUs, 'einsum' on CPUs, else XLA's) | 'xla' | 'einsum' (written out, with its
    #                          own backward) | 'cudnn' | 'splash'
    loss_chunks: int = 1  # > 1: the output layer and loss take this many slices of tokens at a time, each slice's
    #                       gradients made with its loss, so the (tokens, vocabulary) float32 logits never exist whole
    quantization: str = "none"  # the blocks' matmuls: 'none' | 'int8' | 'fp8' (e4m3/e5m2; Hopper);
    #                             a property of the step: a run may switch it at resume
    # architecture: the defaults are GPT-2; config/llama_style_small.py shows a Llama-style mix
    pos_embedding: str = "learned"  # 'learned' (GPT-2's position table) | 'rope' (rotary, rotate-half)
    rope_theta: float = 10000.0  # RoPE base; Llama 3 uses 500000
    rope_scaling: str = "none"  # 'none' | 'llama3' (Llama 3.1 / 3.2's long-context frequency scaling,
    #                             with the four keys below)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192  # the context length the model was first trained at
    norm: str = "layernorm"  # 'layernorm' (GPT-2) | 'rmsnorm' (Llama; never has a bias)
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # 'gelu' (GPT-2) | 'swiglu' (Llama: gated, three matrices) | 'relu2'
    #                    (modded-nanogpt: proj(relu(fc(x))^2), gelu's two matrices)
    mlp_hidden: int = 0  # MLP hidden units; 0 = 4*n_embd (gelu, relu2) or 8*n_embd/3 rounded up to 64 (swiglu)
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0 = n_head, 1 = multi-query
    tie_embeddings: bool = True  # the output layer is wte (GPT-2) or a separate lm_head_kernel
    # the GPT-2 speedruns' (modded-nanogpt) switches; config/shakespeare_char_fast.py uses them
    qk_norm: bool = False  # RMSNorm, no learned scale, on each query and key head before RoPE/attention
    zero_init_proj: bool = False  # attention's and the MLP's output projections start at zero
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap) (modded-nanogpt: 30 or 15); 0 = off
    # mixture of experts: n_experts > 0 replaces the MLPs by experts (moe.MoE), each of the mlp kind
    n_experts: int = 0  # experts per sparse layer; 0 = dense (the default)
    experts_per_token: int = 2  # top-k routing: each token goes to this many experts
    n_shared_experts: int = 0  # experts every token also goes to (DeepSeek), run as one wider MLP
    moe_hidden: int = 0  # an expert's hidden width; 0 = mlp_hidden's default
    moe_dense_layers: int = 0  # the first layers keep a dense MLP (0 = every layer sparse)
    capacity_factor: float = 1.25  # > 0: an expert takes at most factor*T*k/E tokens of a row, the rest
    #                               skip it; 0 = dropless (every token reaches its experts)
    router_aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Switch; 1.0 when balanced)
    router_z_loss_coef: float = 0.001  # weight of the router z-loss (ST-MoE)
    # LoRA (layers/lora.py): train low-rank adapters beside the blocks' matrices, the base model frozen
    lora_rank: int = 0  # r of every adapter; 0 = off (full fine-tuning)
    lora_alpha: float = 16.0  # adapters' outputs are scaled by lora_alpha / lora_rank (PEFT's convention)
    lora_targets: str = "all"  # which matrices get one: comma-separated q, k, v, o (attention), gate, up,
    #                            down (MLP; GPT-2's c_fc is up, c_proj down), or 'all' (QLoRA's advice)
    lora_dropout: float = 0.0  # dropout on the adapters' input while training (PEFT's lora_dropout)
    weight_dtype: str = "auto"  # the frozen base of a LoRA run: 'auto' (the compute dtype) | 'int8'
    #                             (the blocks' matrices as int8 with a scale per output channel: QLoRA-style)
    # optimizer: AdamW, linear warmup then cosine decay, as nanoGPT/GPT-2
    optimizer: str = "adamw"  # 'adamw' | 'muon' (Muon on the blocks' weight matrices, AdamW with
    #                           learning_rate, weight_decay, beta1, beta2 on embeddings, head, norms, biases)
    batch_size: int = 12  # sequences per micro-step, over all devices
    gradient_accumulation_steps: int = 1  # tokens per step = this * batch_size * block_size
    learning_rate: float = 6e-4
    max_iters: int = 600_000
    weight_decay: float = 0.1  # applied to matrices and embeddings only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    decay_lr: bool = True
    warmup_iters: int = 2000
    lr_decay_iters: int = 600_000
    min_lr: float = 6e-5
    muon_learning_rate: float = 0.02  # optimizer='muon': the peak for its matrices (the schedule as
    #                                   learning_rate's, scaled; min_lr alike)
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum
    muon_weight_decay: float = 0.0  # decoupled, times the Muon learning rate
    # evaluation, logging, checkpoints
    eval_interval: int = 2000
    eval_iters: int = 200
    eval_only: bool = False
    eval_tasks: str = ""  # also scored at every eval: comma-separated 'hellaswag' (downloaded once) or
    #                       'hellaswag:FILE', 'choice:FILE' ({context, choices, label} jsonl), 'perplexity:FILE'
    eval_tasks_limit: int = 0  # examples of each multiple-choice task (0 = all)
    log_interval: int = 1
    always_save_checkpoint: bool = True  # False: save only when val loss improves
    max_to_keep: int = 3  # the latest checkpoints kept, besides the keep_best best ones
    keep_best: int = 1  # the checkpoints with the lowest val loss kept, besides the max_to_keep latest
    # reliability
    nan_policy: str = "stop"  # non-finite loss/grads: 'stop' (exit, keep the last good
    #                           checkpoint) | 'skip_step' (leave the params, count it)
    stack_dump_interval: int = 0  # seconds; >0 dumps every thread's stack to out_dir (hangs)
    profile_steps: str = ""  # 'START:STOP' traces those steps into out_dir/profile
    tensorboard: bool = True
    sample_tokens: int = 0  # print a sample of this many tokens at the end of training
    # sanity check: train on one fixed batch again and again (the loss must go to ~0)
    overfit_batch: bool = False
    # device mesh (per slice): product must equal the devices per slice; -1 takes the rest
    mesh_data: int = -1
    mesh_fsdp: int = 1
    fsdp_reduce_once: bool = False  # with gradient accumulation under fsdp: gather the parameters once and
    #                                 reduce-scatter the gradients once per step, not every micro-step;
    #                                 costs each device the whole parameters and gradient (ZeRO-2's memory)
    mesh_tensor: int = 1
    mesh_expert: int = 1  # splits a mixture of experts' experts (and the batch elsewhere)
    mesh_context: int = 1  # splits each row's tokens (long sequences); attention gathers keys and values
    context_attention: str = "gather"  # with mesh_context > 1: 'gather' (all-gather the keys and values:
    #                                    T/context x T scores per device) | 'ring' (pass them round the
    #                                    devices: T/context x T/context scores at a time)
    mesh_stage: int = 1  # pipeline stages: each holds n_layer / mesh_stage layers (layers/pipeline.py)
    pipeline_microbatches: int = 1  # with mesh_stage > 1: the batch flows through the stages in this
    #                                 many pieces; bubble = (stages-1) / (microbatches+stages-1)
    layers_per_stage: int = 0  # 0 = n_layer / stages (GPipe); fewer: the circular schedule, a piece goes
    #                            round the stages n_layer / (stages * this) times (smaller bubble)
    offload: str = "none"  # keep in host memory between steps: 'none' | 'optimizer' (AdamW/Muon state) |
    #                        'params_and_optimizer' (the float32 parameters too); needs a backend with it
    # multi-slice / multi-host: how many slices each axis spans over the slower network
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_context: int = 1
    dcn_tensor: int = 1
    dcn_expert: int = 1
    dcn_stage: int = 1
    # multi-process start-up; empty = single process, or JAX's detection (SLURM, TPU pods)
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 1
    process_id: int = 0
    # a train step compiled ahead of time (compile_aot.py --save=FILE); '' = compile it here
    compiled_train_step: str = ""  # it is used only if it was built for exactly this run
    # before the first step, compare what the compiled programs need with the devices' memory
    memory_check: bool = True  # False: skip the check (a refusal becomes XLA's or the kernel's OOM)
    memory_limit_gib: float = 0.0  # check against this many GiB per device; 0 = the device's own limit
    # compiled programs kept between runs (JAX's persistent compilation cache)
    compile_cache: str = default_compile_cache()  # a folder: a program compiled once is loaded from here by
    #                                               the next run that needs it; '' = off

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps * self.block_size

    def __post_init__(self):
        """The checks, by group; each raises ConfigError naming the key and the fix."""
        for f in dataclasses.fields(self):  # nan and inf would slip through every check below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"config key '{f.name}' must be a finite number, got {value}")
        self._check_model()
        self._check_optimizer()
        self._check_mesh()
        self._check_data()
        self._check_run()

    def _at_least(self, minimum: int, keys) -> None:
        for key in keys:
            if getattr(self, key) < minimum:
                raise ConfigError(f"config key '{key}' must be >= {minimum}, got {getattr(self, key)}")

    def _check_model(self) -> None:
        """What the weights compute, and the compute keys that say how."""
        self._at_least(1, ("n_layer", "n_head", "n_embd", "block_size", "pad_vocab_to_multiple", "loss_chunks"))
        self._at_least(
            0, ("vocab_size", "n_experts", "n_shared_experts", "moe_hidden", "moe_dense_layers", "capacity_factor")
        )
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check_choice("remat_policy", self.remat_policy, REMAT_POLICIES)
        check_choice("attention", self.attention, ("auto", "xla", "einsum", "cudnn", "splash"))
        check_choice("quantization", self.quantization, ("none", "int8", "fp8"))
        if self.block_size % self.loss_chunks:
            raise ConfigError(
                f"loss_chunks={self.loss_chunks} must divide block_size={self.block_size} (each slice "
                f"takes every loss_chunks-th token of every row): use a divisor of it, e.g. 8"
            )
        if self.attention == "cudnn" and self.dtype != "bfloat16":
            raise ConfigError(
                f"attention='cudnn' needs dtype='bfloat16' (cuDNN's flash attention has no "
                f"float32 kernel); got dtype={self.dtype!r}. Use attention='auto' or 'xla'"
            )
        check_choice("pos_embedding", self.pos_embedding, ("learned", "rope"))
        check_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        check_choice("mlp", self.mlp, ("gelu", "swiglu", "relu2"))
        if self.n_experts > 0:
            self._check_experts()
        self._check_lora()
        if self.logit_softcap < 0:
            raise ConfigError(
                f"logit_softcap must be >= 0 (0 = off; modded-nanogpt uses 30 or 15), got {self.logit_softcap}"
            )
        check_choice("rope_scaling", self.rope_scaling, ("none", "llama3"))
        if self.rope_scaling != "none" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_scaling_factor > 0
            and self.rope_original_context > 0
        ):
            raise ConfigError(
                f"rope_scaling='llama3' needs 0 < rope_low_freq_factor < rope_high_freq_factor "
                f"and rope_scaling_factor, rope_original_context > 0; got "
                f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, "
                f"{self.rope_scaling_factor}, {self.rope_original_context}"
            )
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head < 0 or self.mlp_hidden < 0:
            raise ConfigError(
                f"n_kv_head ({self.n_kv_head}) and mlp_hidden ({self.mlp_hidden}) must be >= 0 (0 = the default)"
            )
        if self.n_kv_head and self.n_head % self.n_kv_head:
            raise ConfigError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head}): "
                f"each key/value head serves an equal group of query heads"
            )
        if self.pos_embedding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"pos_embedding='rope' needs an even head size, got n_embd / n_head = "
                f"{self.n_embd // self.n_head}: RoPE turns pairs of dimensions"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError(f"rope_theta ({self.rope_theta}) and norm_eps ({self.norm_eps}) must be > 0")

    def _check_experts(self) -> None:
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(
                f"experts_per_token must be between 1 and n_experts ({self.n_experts}), got {self.experts_per_token}"
            )
        if not 0 <= self.moe_dense_layers < self.n_layer:
            raise ConfigError(
                f"moe_dense_layers ({self.moe_dense_layers}) must be below n_layer "
                f"({self.n_layer}): at least one layer has the experts"
            )

    def _check_lora(self) -> None:
        targets = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        unknown = [t for t in targets if t not in LORA_TARGETS] if self.lora_targets.strip() != "all" else []
        problem = (
            f"lora_rank must be >= 0 (0 = off), got {self.lora_rank}"
            if self.lora_rank < 0
            else f"lora_alpha must be > 0, got {self.lora_alpha}"
            if self.lora_alpha <= 0
            else f"lora_dropout must be in [0, 1), got {self.lora_dropout}"
            if not 0.0 <= self.lora_dropout < 1.0
            else f"lora_targets: unknown {', '.join(map(repr, unknown))}"
            if unknown
            else "lora_targets names no matrix"
            if not targets
            else None
        )
        if problem:
            raise ConfigError(
                f"{problem}; LoRA takes e.g. --lora_rank=16 --lora_alpha=32 --lora_targets=q,v (targets: "
                f"{', '.join(LORA_TARGETS)}, or 'all') --lora_dropout=0.05"
            )
        check_choice("weight_dtype", self.weight_dtype, ("auto", "int8"))
        if self.lora_rank == 0 and self.weight_dtype != "auto":
            raise ConfigError(
                "weight_dtype='int8' freezes the base model as int8, which only LoRA adapters can train "
                "around: add --lora_rank (e.g. 16), or leave weight_dtype='auto'"
            )

    def _check_optimizer(self) -> None:
        """How training updates the weights: the optimizer, its schedule, dropout, the router's losses."""
        self._at_least(1, ("batch_size", "gradient_accumulation_steps"))
        self._at_least(
            0,
            (
                "warmup_iters",
                "lr_decay_iters",
                "learning_rate",
                "weight_decay",
                "grad_clip",
                "router_aux_loss_coef",
                "router_z_loss_coef",
            ),
        )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        check_choice("optimizer", self.optimizer, ("adamw", "muon"))
        if self.muon_learning_rate <= 0:
            raise ConfigError(f"config key 'muon_learning_rate' must be > 0 (e.g. 0.02), got {self.muon_learning_rate}")
        if self.muon_weight_decay < 0:
            raise ConfigError(f"config key 'muon_weight_decay' must be >= 0, got {self.muon_weight_decay}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"config key 'muon_momentum' must be in [0, 1), got {self.muon_momentum} (e.g. 0.95)")
        for key in ("beta1", "beta2"):  # AdamW's moving averages; at 1 its bias correction divides by 0
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(
                    f"config key '{key}' must be in [0, 1), got {getattr(self, key)} (GPT-2 used beta1=0.9, beta2=0.95)"
                )
        if self.decay_lr and self.lr_decay_iters < self.warmup_iters:
            raise ConfigError(
                f"lr_decay_iters ({self.lr_decay_iters}) is shorter than warmup_iters "
                f"({self.warmup_iters}): the cosine decay would end before the warmup does; "
                f"make lr_decay_iters >= warmup_iters (usually max_iters), or decay_lr=False"
            )
        if self.decay_lr and not 0.0 <= self.min_lr <= self.learning_rate:
            raise ConfigError(
                f"min_lr ({self.min_lr}) must be in [0, learning_rate = {self.learning_rate}]: "
                f"the schedule decays from learning_rate down to min_lr (set min_lr, often "
                f"learning_rate / 10, or decay_lr=False)"
            )

    def _check_mesh(self) -> None:
        """How the devices split the work: the mesh and slice axes, the pipeline, offloading, the processes."""
        self._at_least(
            1,
            (
                "mesh_stage",
                "mesh_context",
                "pipeline_microbatches",
                "dcn_data",
                "dcn_fsdp",
                "dcn_tensor",
                "dcn_expert",
                "dcn_stage",
                "dcn_context",
                "num_processes",
            ),
        )
        self._at_least(0, ("layers_per_stage",))
        check_choice("context_attention", self.context_attention, ("gather", "ring"))
        if self.context_attention == "ring" and (self.dropout > 0 or self.mesh_stage * self.dcn_stage > 1):
            raise ConfigError(
                "context_attention='ring' has no attention dropout and no pipeline stages: "
                "use dropout=0 and mesh_stage=1, or context_attention='gather'"
            )
        check_choice("offload", self.offload, ("none", "optimizer", "params_and_optimizer"))
        if self.fsdp_reduce_once and self.mesh_context * self.dcn_context != 1:
            raise ConfigError(
                "fsdp_reduce_once keeps a whole partial gradient sum per fsdp shard, which the "
                "context axis's devices would have to reduce every micro-step: use it with "
                "mesh_context=1 dcn_context=1, or leave it False"
            )
        if self.mesh_stage * self.dcn_stage > 1 and self.n_experts and self.moe_dense_layers:
            raise ConfigError(
                f"a pipeline (mesh_stage={self.mesh_stage}) runs one stack of equal layers, but "
                f"moe_dense_layers={self.moe_dense_layers} makes two: use moe_dense_layers=0 "
                f"or mesh_stage=1"
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(
                f"process_id ({self.process_id}) must be in 0 .. num_processes - 1 "
                f"({self.num_processes - 1}): processes count from 0"
            )
        if self.num_processes > 1 and not self.coordinator_address:
            raise ConfigError(
                f"num_processes={self.num_processes} needs coordinator_address (host:port "
                f"of process 0); under SLURM or on a TPU pod leave both unset"
            )

    def _check_data(self) -> None:
        """Which tokens the run reads."""
        self._at_least(0, ("seed",))
        for key, example in (("data_dir", "data"), ("dataset", "shakespeare_char")):
            if not getattr(self, key).strip():
                raise ConfigError(f"{key} must name a directory, e.g. --{key}={example}")

    def _check_run(self) -> None:
        """Where the run starts from and writes, how long it runs, how it evaluates, logs and saves."""
        self._at_least(1, ("eval_interval", "eval_iters", "log_interval", "max_to_keep"))
        self._at_least(0, ("max_iters", "keep_best", "sample_tokens", "stack_dump_interval", "eval_tasks_limit"))
        if not self.out_dir.strip():
            raise ConfigError("out_dir must name a directory, e.g. --out_dir=out")
        if self.overwrite_out_dir and self.init_from == "resume":
            raise ConfigError(
                "overwrite_out_dir=True would delete the checkpoints that init_from='resume' "
                "continues: drop one of the two"
            )
        check_init_from(self.init_from)
        check_choice("nan_policy", self.nan_policy, ("stop", "skip_step"))
        for item in filter(None, (part.strip() for part in self.eval_tasks.split(","))):
            kind, _, path = item.partition(":")
            check_choice("eval_tasks", kind, EVAL_TASKS)
            if kind != "hellaswag" and not path:
                raise ConfigError(f"eval_tasks: {kind!r} needs a file, e.g. {kind}:PATH")
        if self.profile_steps and not re.fullmatch(r"\d+:\d+", self.profile_steps):
            raise ConfigError(f"profile_steps must look like START:STOP (e.g. 10:13), got {self.profile_steps!r}")
        if self.profile_steps:
            start, stop = map(int, self.profile_steps.split(":"))
            if stop <= start:
                raise ConfigError(
                    f"profile_steps={self.profile_steps!r} traces no step: STOP must be "
                    f"greater than START ('10:13' traces steps 10, 11 and 12)"
                )
            if stop > self.max_iters:
                raise ConfigError(
                    f"profile_steps={self.profile_steps!r} runs past the last step "
                    f"({self.max_iters - 1}, as max_iters={self.max_iters}): the trace "
                    f"would never be written; choose STOP <= max_iters"
                )


EVAL_TASKS = ("hellaswag", "choice", "perplexity")  # evals/scoring.py's
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # layers/lora.py's TARGETS

# Every key's role, which decides what a run that continues a checkpoint (init_from='resume'), and
# sample.py, eval.py and export_hf.py, do with it:
#   model      what the weights compute: the checkpoint's value; giving another one is an error
#   compute    how a step computes that same model: the checkpoint's unless given, a change said once
#   optimizer  how training updates the weights, and data: which tokens each step sees; both as
#              given, a change from the checkpoint's run said once
#   run        where the run reads and writes, how it evaluates, logs, saves and lays out devices
ROLES = {
    "model": (
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "vocab_size",
        "pad_vocab_to_multiple",
        "bias",
        "qkv_bias",
        "pos_embedding",
        "rope_theta",
        "rope_scaling",
        "rope_scaling_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_context",
        "norm",
        "norm_eps",
        "mlp",
        "mlp_hidden",
        "n_kv_head",
        "tie_embeddings",
        "qk_norm",
        "zero_init_proj",
        "logit_softcap",
        "n_experts",
        "experts_per_token",
        "n_shared_experts",
        "moe_hidden",
        "moe_dense_layers",
        "capacity_factor",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
    ),
    "compute": (
        "dtype",
        "scan_layers",
        "remat_policy",
        "attention",
        "quantization",
        "context_attention",
        "loss_chunks",
        "weight_dtype",
    ),
    "optimizer": (
        "optimizer",
        "batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "weight_decay",
        "beta1",
        "beta2",
        "grad_clip",
        "decay_lr",
        "warmup_iters",
        "lr_decay_iters",
        "min_lr",
        "muon_learning_rate",
        "muon_momentum",
        "muon_weight_decay",
        "dropout",
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "lora_dropout",
    ),
    "data": ("dataset", "data_dir", "seed", "overfit_batch", "document_masking", "packing"),
    "run": (
        "out_dir",
        "init_from",
        "overwrite_out_dir",
        "max_iters",
        "eval_interval",
        "eval_iters",
        "eval_only",
        "eval_tasks",
        "eval_tasks_limit",
        "log_interval",
        "always_save_checkpoint",
        "max_to_keep",
        "keep_best",
        "nan_policy",
        "stack_dump_interval",
        "profile_steps",
        "tensorboard",
        "sample_tokens",
        "mesh_data",
        "mesh_fsdp",
        "mesh_tensor",
        "mesh_expert",
        "mesh_stage",
        "mesh_context",
        "pipeline_microbatches",
        "layers_per_stage",
        "offload",
        "dcn_data",
        "dcn_fsdp",
        "dcn_tensor",
        "dcn_expert",
        "dcn_stage",
        "dcn_context",
        "coordinator_address",
        "num_processes",
        "process_id",
        "compiled_train_step",
        "memory_check",
        "memory_limit_gib",
        "fsdp_reduce_once",
        "compile_cache",
    ),
}
ROLE = {key: role for role, keys in ROLES.items() for key in keys}


def resume_values(given: dict, saved: dict) -> dict:
    """The values of a run that continues a checkpoint whose config was `saved`: the model and
    compute keys that were not given are the checkpoint's; a model key given with another value
    is an error naming both, since the weights would no longer mean what they were trained for."""
    conflicts = [
        f"{k}={given[k]!r} (the checkpoint's: {saved[k]!r})"
        for k in ROLES["model"]
        if k in given and k in saved and given[k] != saved[k]
    ]
    if conflicts:
        raise ConfigError(
            f"{', '.join(conflicts)}: a resumed run keeps the model of its checkpoint; drop "
            f"{'this key' if len(conflicts) == 1 else 'these keys'}, or train the other model "
            f"from the start in another --out_dir"
        )
    inherited = {k: saved[k] for k in ROLES["model"] + ROLES["compute"] if k in saved and k not in given}
    return {**given, **inherited}


def changes_since(config, saved: dict) -> list[str]:
    """'key: old -> new' for each compute, optimizer and data key whose value differs from `saved`
    (a checkpoint's config): what a resumed run says once."""
    keys = ROLES["compute"] + ROLES["optimizer"] + ROLES["data"]
    return [
        f"{k} {saved[k]!r} -> {getattr(config, k)!r}" for k in keys if k in saved and saved[k] != getattr(config, k)
    ]


# A Hugging Face hub model id: 'gpt2', 'gpt2-medium' or 'organisation/model'.
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


def check_init_from(value: str, choices=("scratch", "resume")) -> None:
    """init_from: one of `choices`, a Hugging Face model directory, or a hub name. A name without a
    '/' close to a choice ('scrach') is a typo, said before anything looks for it on the hub."""
    if value in choices or os.path.isdir(value):
        return
    close = [] if "/" in value else difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.75)
    if close:
        raise ConfigError(
            f"config key 'init_from' is {value!r}: did you mean {close[0]!r}? (no directory has "
            f"that name here, and a Hugging Face hub name looks like 'gpt2' or 'org/name')"
        )
    if not HUB_NAME.fullmatch(value):
        raise ConfigError(
            f"config key 'init_from' must be {', '.join(map(repr, choices))}, a Hugging Face "
            f"model directory or a hub name like 'gpt2' or 'org/name'; {value!r} is neither a "
            f"directory nor a hub name"
        )


def check_writable(path: str, key: str) -> None:
    """An output file (--key=path) that can be created or replaced: its folder exists and takes new
    files. Commands check it before their long work, so a typo can't cost the work."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--{key}={path} is a directory: give a file name")
    if not os.path.isdir(folder):
        raise ConfigError(f"--{key}={path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--{key}={path}: this user can't write in {folder}")


def check_choice(key: str, value, choices) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"config key '{key}' must be one of {', '.join(map(repr, choices))}; got {value!r}{hint}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_type(key: str, value, tp):
    """Return value as type tp (int is accepted for float), or raise ConfigError."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"config key '{key}' expects {_type_name(tp)}, got {value!r} "
        f"({type(value).__name__}); e.g. --{key}={_example(tp)}"
    )


def _example(tp) -> str:
    return {int: "8", float: "0.1", bool: "True", str: "name"}.get(tp, "...")


def _unknown_key(key: str, fields) -> ConfigError:
    close = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "see configurator.py for the keys"
    return ConfigError(f"unknown config key '{key}': {hint}")


def _parse_flag_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as --dataset=openwebtext


HELP_FLAGS = ("--help", "-h")


def load_config(argv: list[str], cls=Config, complete=None):
    """Build a frozen `cls` from config files and --key=value flags (in that order).
    complete(values) -> values, if given, may add keys the given ones imply (train.py: the
    model keys of a pretrained model); it raises ConfigError for a contradiction."""
    field_types = typing.get_type_hints(cls)
    overrides: dict = {}
    for arg in argv:
        if arg in HELP_FLAGS:  # only load_config_or_exit answers it: this is a library call
            raise _unknown_key("help", field_types)
        if arg.startswith("-"):
            key, value = _parse_flag(arg, field_types)
            overrides[key] = value
        else:
            overrides.update(_read_config_file(arg, field_types))
    return cls(**(complete(overrides) if complete else overrides))


def _parse_flag(arg: str, field_types: dict):
    """'--key=value' -> (key, value as the field's type); a mistake says how to write it."""
    dashes = len(arg) - len(arg.lstrip("-"))
    key, sep, text = arg[dashes:].partition("=")
    if not key:
        raise ConfigError(f"'{arg}' is not a flag: write --KEY=VALUE")
    if dashes != 2:
        raise ConfigError(
            f"flag '{arg}' has {'one dash' if dashes == 1 else f'{dashes} dashes'}: write --{arg[dashes:]}"
        )
    if not sep:
        raise ConfigError(f"flag '{arg}' has no value: write --{key}=VALUE")
    if key not in field_types:
        raise _unknown_key(key, field_types)
    value = text if field_types[key] is str else _parse_flag_value(text)
    return key, _check_type(key, value, field_types[key])


def _read_config_file(path: str, field_types: dict) -> dict:
    if not os.path.isfile(path):
        key = path.partition("=")[0]
        if key in field_types:  # 'batch_size=8': a flag without its dashes
            raise ConfigError(f"'{path}' is neither a config file nor a flag: write --{path}")
        raise ConfigError(f"config file '{path}' does not exist (config files live in config/)")
    try:
        namespace = runpy.run_path(path)
    except Exception as e:  # the file is user code: report it as a config problem
        raise ConfigError(f"config file '{path}' raised {type(e).__name__}: {e}") from e
    values = {}
    for key, value in namespace.items():
        if key.startswith("_") or isinstance(
            value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)
        ):
            continue  # imports, helpers and private names are not settings
        if key not in field_types:
            raise ConfigError(f"in {path}: " + str(_unknown_key(key, field_types)))
        values[key] = _check_type(key, value, field_types[key])
    return values


def config_to_json(config) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True)


def config_from_dict(values: dict, cls=Config):
    """Rebuild a config saved with a checkpoint; keys this version does not know are errors."""
    field_types = typing.get_type_hints(cls)
    for key in values:
        if key not in field_types:
            raise _unknown_key(key, field_types)
    return cls(**{k: _check_type(k, v, field_types[k]) for k, v in values.items()})


def print_config(config, changed_only: bool = False) -> None:
    """Each key = value; with changed_only, only the keys whose value is not the default."""
    fields = [
        f for f in dataclasses.fields(config) if not changed_only or _default_text(f) != repr(getattr(config, f.name))
    ]
    width = max((len(f.name) for f in fields), default=0)
    for f in fields:
        print(f"  {f.name:<{width}} = {getattr(config, f.name)!r}")


def load_config_or_exit(argv: list[str], cls=Config, complete=None):
    """For scripts: --help prints the keys and exits; a bad config prints one line and exits
    with status 1, no traceback."""
    if any(arg in HELP_FLAGS for arg in argv):
        print(help_text(cls))
        sys.exit(0)
    try:
        return load_config(argv, cls, complete)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def load_with_options_or_exit(argv: list[str], options_cls, cls=Config, complete=None) -> tuple:
    """For scripts with options of their own beside the config (compile_aot.py, bench.py):
    --KEY=VALUE flags naming a field of options_cls go there, the rest build cls."""
    if any(arg in HELP_FLAGS for arg in argv):
        print(help_text(options_cls, cls))
        sys.exit(0)
    keys = {f.name for f in dataclasses.fields(options_cls)}
    ours = [a for a in argv if a.startswith("--") and a[2:].partition("=")[0] in keys]
    return (
        load_config_or_exit(ours, options_cls),
        load_config_or_exit([a for a in argv if a not in ours], cls, complete),
    )


HELP_WIDTH = 80  # columns: a terminal's default


def help_text(*classes) -> str:
    """How to run the script, then each class's fields: type, default and the comment that
    follows it in the source, under the source's section comments. A note is one paragraph,
    wrapped anew at HELP_WIDTH columns (not where the source's comment lines happened to end)."""
    lines = [
        f"usage: python {os.path.basename(sys.argv[0])} [CONFIG_FILE.py ...] [--KEY=VALUE ...]",
        *_wrap(
            "Every key starts at its default below; config files (Python assignments, KEY = VALUE) "
            "and --KEY=VALUE flags then set keys, in the order given: the last one wins."
        ),
    ]
    for cls in classes:
        hints = typing.get_type_hints(cls)
        defaults = {f.name: _default_text(f) for f in dataclasses.fields(cls)}
        doc, fields = _documented_fields(cls)
        if doc:
            lines += ["", *_wrap(doc)]
        section = None
        for heading, name, note in fields:
            if heading != section:
                lines += ["", *_wrap(heading)] if heading else [""]
                section = heading
            lines.append(f"  --{name} ({_type_name(hints[name])}, default {defaults[name]})")
            lines += _wrap(" ".join(note), indent=8)
    return "\n".join(lines)


def _wrap(text: str, indent: int = 0) -> list[str]:
    return textwrap.wrap(
        text,
        HELP_WIDTH,
        initial_indent=" " * indent,
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "none: required"


def _documented_fields(cls) -> tuple[str, list]:
    """(docstring, [(section heading, field name, note lines)]) read from the source of cls.

    A comment after a field is its note, and comment lines right under it whose text is
    indented ('#      more') go on with the note; any other comment on a line of its own
    heads the fields below it. Read from the source, so it works for any dataclass.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        classdef = ast.parse(source).body[0]
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):  # no source (made at run time)
        return "", [("", name, []) for name in names]
    comments = {
        tok.start[0]: (tok.string[1:], not tok.line[: tok.start[1]].strip())  # (text, alone)
        for tok in tokens
        if tok.type == tokenize.COMMENT
    }
    nodes = {
        node.lineno: node
        for node in classdef.body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in names
    }

    def continues_note(line) -> bool:  # a comment on a line of its own, its text indented
        return line in comments and comments[line][1] and comments[line][0].startswith("  ")

    found, section, heading, continued = [], "", [], set()
    for line in sorted(comments.keys() | nodes.keys()):
        if line in nodes:
            end, note = nodes[line].end_lineno, []
            if end in comments and not comments[end][1]:
                note.append(comments[end][0].strip())
                while continues_note(end + 1):
                    end += 1
                    note.append(comments[end][0].strip())
                    continued.add(end)
            if heading:
                section, heading = " ".join(heading), []
            found.append((section, nodes[line].target.id, note))
        elif comments[line][1] and line not in continued:
            heading.append(comments[line][0].strip())
    seen = {name for _, name, _ in found}
    found += [("", name, []) for name in names if name not in seen]  # e.g. from a base class
    return ast.get_docstring(classdef) or "", found
