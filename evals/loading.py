"""What eval.py and the lm-eval adapter share: the evaluation's settings and the model they load
(a checkpoint or a Hugging Face model, split over the chosen devices)."""

import dataclasses

import jax

import configurator
import sharding
from evals import scoring
from inference.loader import default_dtype, load_checkpoint, load_hf


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    init_from: str = "resume"  # 'resume' (newest intact checkpoint in out_dir) or a Hugging Face model
    out_dir: str = "out"
    task: str = "hellaswag"  # 'hellaswag' | 'choice' ({context, choices, label} jsonl) | 'perplexity' (text)
    data: str = ""  # the task's file; '' with hellaswag: its validation set, downloaded once
    limit: int = 0  # only the first N examples of hellaswag or choice (0 = all)
    norm: str = "char"  # acc_norm per 'char' of the choice (lm-evaluation-harness) or per 'token' (build-nanogpt)
    hellaswag_text: str = "harness"  # 'harness' ("label: ctx_a Ctx_b", cleaned up) or 'raw' (ctx: build-nanogpt)
    prefix: str = "auto"  # before a context: 'auto' (the tokenizer's own: Llama's BOS; GPT-2 none) | none | bos | eot
    batch_size: int = 32  # rows (choices or windows) per forward pass, over all devices
    dtype: str = "auto"  # a Hugging Face model's compute dtype: 'auto' = bfloat16 on GPUs/TPUs, else float32
    devices: int = 0  # split the rows over the first N devices (0 = all)

    def __post_init__(self):
        configurator.check_init_from(self.init_from, choices=("resume",))
        configurator.check_choice("task", self.task, scoring.TASKS)
        if self.task == "perplexity" and self.limit:
            raise configurator.ConfigError(
                "--limit counts the examples of hellaswag and choice; perplexity "
                "scores the whole --data file: cut the file to score less"
            )
        configurator.check_choice("norm", self.norm, ("char", "token"))
        configurator.check_choice("prefix", self.prefix, scoring.PREFIXES)
        configurator.check_choice("hellaswag_text", self.hellaswag_text, scoring.HELLASWAG_TEXTS)
        configurator.check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))
        for key in ("limit", "devices"):
            if getattr(self, key) < 0:
                raise configurator.ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.batch_size < 1:
            raise configurator.ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.task != "hellaswag" and not self.data:
            raise configurator.ConfigError(f"--task={self.task} needs --data=FILE")


def load_model(cfg: EvalConfig):
    """(setup, params, tokenizer, what was loaded) for cfg.init_from, on the chosen devices."""
    devices = jax.devices()[: cfg.devices or jax.device_count()]
    if cfg.devices > jax.device_count():
        raise scoring.EvalError(f"--devices={cfg.devices}, but there are {jax.device_count()}")
    mesh = sharding.make_mesh(len(devices), 1, 1, devices=devices)
    if cfg.init_from == "resume":
        setup, params, step, tok = load_checkpoint(cfg.out_dir, mesh)
        return setup, params, tok, f"step {step} of {cfg.out_dir}"
    setup, params, tok = load_hf(cfg.init_from, mesh, dtype=default_dtype(cfg.dtype))
    return setup, params, tok, cfg.init_from
