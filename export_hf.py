"""Export a nanomax checkpoint as a Hugging Face model directory.

    python export_hf.py --out_dir=out-shakespeare-char --to=exported/shakespeare-char
    python export_hf.py --out_dir=out-llama --to=exported/llama --dtype=bfloat16
    python export_hf.py --out_dir=out-lora --to=exported/adapter --adapter_only=True   # a LoRA run

writes config.json, model.safetensors (or shards with model.safetensors.index.json),
generation_config.json and the tokenizer's files, so that transformers'
AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR) load it (and
vLLM or llama.cpp's converters take it). GPT-2-style models become GPT2LMHeadModel,
Llama-style ones LlamaForCausalLM (Qwen2ForCausalLM with qkv_bias); mixes that transformers
has no class for are refused. Every kind of vocabulary gets a tokenizer.json, so that
`sample.py --init_from=DIR` reads the export with the ids it was trained on: a Hugging Face
run's own files, GPT-2's BPE (also as vocab.json + merges.txt), and a char-level run's character
table as a word-level `tokenizers` model of single characters.

A LoRA run exports merged: its adapters folded into the base's weights, a plain model. With
--adapter_only=True it exports its adapters alone as a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors, weights/peft.py) that `peft.PeftModel.from_pretrained(base, DIR)` loads
onto the base model (base_model_name_or_path: the run's base; a nanomax run as base: export that too).
"""

import dataclasses
import json
import os
import sys

import jax
import numpy as np

import configurator
from data import chat_template
from inference.loader import load_checkpoint
from weights import checkpoint, hf, peft


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    out_dir: str = "out"  # the run: its newest intact checkpoint is exported
    to: str = ""  # the new Hugging Face directory (must not exist, or be empty)
    dtype: str = "float32"  # 'float32' | 'bfloat16': how the weights are stored
    max_shard_gb: float = 5.0  # larger models are split into shards of at most this size
    adapter_only: bool = False  # a LoRA run: write its adapters as a PEFT adapter directory, not the merged model

    def __post_init__(self):
        if not self.to.strip():
            raise configurator.ConfigError("--to must name the directory to write, e.g. --to=exported/my-model")
        configurator.check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        if self.max_shard_gb <= 0:
            raise configurator.ConfigError(f"max_shard_gb must be > 0, got {self.max_shard_gb}")


def export(cfg: ExportConfig, log=print) -> list:
    """Writes cfg.to from the newest intact checkpoint in cfg.out_dir; returns its file names."""
    if jax.process_count() > 1:
        raise hf.HFError("export_hf.py runs as a single process: run it on one host")
    if cfg.adapter_only:
        return export_adapter(cfg, log)
    setup, params, step, tok = load_checkpoint(cfg.out_dir)
    c = setup.model_config
    hf.check_architecture(c)  # before anything is converted
    tensors = hf.to_hf_tensors(jax.tree.map(np.asarray, params), c)
    eos, bos = tok.eot_token, tok.bos_token
    config = hf.hf_config(c, cfg.dtype, eos, bos)

    def add_files(directory):
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": tok.stop_tokens or eos}
        with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(generation, f, indent=2)
        if not tok.save_files(directory):
            log(
                f"note: no tokenizer files written ({tok.summary()} has none): the export holds the "
                f"weights only; sample the run itself with `sample.py --out_dir={cfg.out_dir}`"
            )
        elif tok.chat_template is None:  # serve.py's default template: apply_chat_template gives its ids
            add_chat_template(os.path.join(directory, "tokenizer_config.json"), chat_template.DEFAULT_TEMPLATE)

    files = hf.write_model(cfg.to, tensors, config, cfg.dtype, int(cfg.max_shard_gb * 2**30), add_files)
    n_params = sum(t.size for t in tensors.values())
    log(
        f"exported step {step} of {os.path.abspath(cfg.out_dir)} ({config['architectures'][0]}, {n_params:,} "
        f"parameters, {cfg.dtype}) to {os.path.abspath(cfg.to)}: {', '.join(files)}"
    )
    return files


def export_adapter(cfg: ExportConfig, log=print) -> list:
    """Writes cfg.to as a PEFT adapter directory from the newest intact checkpoint of a LoRA run."""
    setup, adapters, step, _ = load_checkpoint(cfg.out_dir, adapters_only=True)
    c = setup.model_config
    if not c.lora_rank:
        raise configurator.ConfigError(
            f"--adapter_only=True exports a LoRA run's adapters, and {os.path.abspath(cfg.out_dir)} trained the "
            f"whole model (lora_rank=0): leave --adapter_only out to export it"
        )
    base = (checkpoint.newest_meta(cfg.out_dir) or {}).get("lora_base", {}).get("init_from", "")
    tensors, config = peft.to_peft(jax.tree.map(np.asarray, adapters), c, base)
    files = peft.write(cfg.to, tensors, config)
    n_params = sum(t.size for t in tensors.values())
    log(
        f"exported the LoRA adapters of step {step} of {os.path.abspath(cfg.out_dir)} (rank {c.lora_rank} on "
        f"{', '.join(config['target_modules'])}, {n_params:,} parameters) to {os.path.abspath(cfg.to)}: "
        f"{', '.join(files)}; their base: {base}"
    )
    if checkpoint.is_run_dir(base):
        log(f"note: the base is a nanomax run: export it too (export_hf.py --out_dir={base}) for PEFT to load onto")
    return files


def add_chat_template(tokenizer_config: str, template: str) -> None:
    with open(tokenizer_config, encoding="utf-8") as f:
        config = json.load(f)
    with open(tokenizer_config, "w", encoding="utf-8") as f:
        json.dump({**config, "chat_template": template}, f, indent=1)


def main(argv):
    cfg = configurator.load_config_or_exit(argv, ExportConfig)
    try:
        export(cfg)
    except (OSError, ValueError) as e:  # HFError, CheckpointError and ConfigError are ValueErrors
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
