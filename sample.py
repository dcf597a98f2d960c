"""Sample text from a trained model, or from a Hugging Face model (GPT-2, Llama, Mistral, Qwen2).

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3
    python sample.py --init_from=gpt2 --start="Hello, my name is" --top_p=0.9
    python sample.py --init_from=/path/to/Llama-3.2-1B --start="The capital of France is" --temperature=0
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompts.txt   # one prompt per line

The generation itself (prefill + decode in one compiled loop) is generate.py's.
"""

import dataclasses
import os
import sys

import jax

import checkpoint
import configurator
import dataset
import hf
import sharding
import train
from generate import decode_sample, encode_prompt, generate, stop_token_ids, weights_in_compute_dtype
from quantization import MODES as QUANTIZATION_MODES
from tokenizer import gpt2_tokenizer, hf_tokenizer, load_tokenizer, tokenizer_from_description


# What rebuilds a checkpoint's model: its model and compute keys, and where an older checkpoint's
# vocabulary is (newer ones carry it).
MODEL_KEYS = {*configurator.ROLES["model"], *configurator.ROLES["compute"], "data_dir", "dataset"}


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    init_from: str = "resume"  # 'resume' (latest checkpoint in out_dir), or a Hugging Face model:
    #                            a directory or a hub name ('gpt2', 'HuggingFaceTB/SmolLM2-135M')
    out_dir: str = "out"
    start: str = "\n"  # the prompt; FILE:path reads prompts from a file, one per line
    num_samples: int = 3  # samples per prompt
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 200  # 0 = no top-k filtering
    top_p: float = 1.0  # < 1: sample from the fewest tokens whose probability reaches top_p
    stop: str = "eos"  # a sample ends at: 'eos' the tokenizer's end tokens (GPT-2's <|endoftext|>,
    #                    a Hugging Face model's eos_token_id), '' never, else this one token's text
    seed: int = 1337
    stream: bool = False  # print the first sample while it is generated
    kv_cache: bool = True  # False: recompute the whole forward pass for every token (slow; to compare)
    mesh_data: int = 1  # devices splitting the samples
    mesh_tensor: int = 1  # devices splitting the heads (and the KV cache)
    dtype: str = "auto"  # a Hugging Face model's compute dtype (and its weights'): 'auto' = bfloat16 on
    #                      GPUs and TPUs, float32 on CPUs; a checkpoint keeps the one it trained in
    quantization: str = "none"  # the matmuls of the blocks: 'none' | 'int8' | 'fp8', whatever trained it

    def __post_init__(self):
        for key in ("num_samples", "max_new_tokens", "mesh_data", "mesh_tensor"):
            if getattr(self, key) < 1:
                raise configurator.ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.temperature < 0 or self.top_k < 0:
            raise configurator.ConfigError("temperature and top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise configurator.ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        configurator.check_choice("quantization", self.quantization, QUANTIZATION_MODES)
        configurator.check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))


# ----------------------------------------------------------------------------- streaming

class StreamPrinter:
    """Prints one sample's text as its tokens arrive (called from inside the decode loop)."""

    def __init__(self, tok, prompt_ids: list, stop_ids: list):
        self.tok, self.ids, self.stop_ids, self.shown = tok, list(prompt_ids), stop_ids, ""
        self._show()

    def __call__(self, token, added):
        if added and int(token) not in self.stop_ids:
            self.ids.append(int(token))
            self._show()

    def _show(self, final=False):
        text = decode_sample(self.tok, self.ids)
        if text.endswith("\ufffd") and not final:  # half of a multi-byte character: wait for the rest
            return
        print(text[len(self.shown):], end="", flush=True)
        self.shown = text

    def finish(self):
        self._show(final=True)
        print()


# ----------------------------------------------------------------------------- loading

def load_for_inference(out_dir: str, mesh=None, quantization: str = "none"):
    """Setup, parameters, step and tokenizer of the newest intact checkpoint in out_dir. Its
    config and vocabulary come with it, but for how the matmuls and the attention compute:
    those are chosen here, for these devices."""
    mesh = mesh or sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    setups = []

    def abstract_for(meta):
        # Only the keys that describe the model: the rest (init_from may name a directory that is
        # gone by now, a learning rate that a later version checks more strictly) doesn't matter here.
        kept = {k: v for k, v in meta["config"].items() if k in MODEL_KEYS}
        config = configurator.config_from_dict({**kept, "attention": "auto", "quantization": quantization,
                                                "batch_size": sharding.batch_shards(mesh)})
        setups.append(train.make_setup(config, mesh, meta.get("vocab_size") or dataset.read_vocab_size(config)))
        return {"params": setups[-1].abstract_state["params"]}

    manager = checkpoint.checkpoint_manager(configurator.Config(out_dir=out_dir), read_only=True)
    try:
        restored = checkpoint.restore_latest(manager, out_dir, abstract_for, move_damaged=False,
                                             log=lambda line: print(line, file=sys.stderr))
    finally:
        manager.close()
    setup = setups[-1]
    if restored.meta.get("tokenizer"):
        tok = tokenizer_from_description(restored.meta["tokenizer"],
                                         search_dirs=[os.path.join(out_dir, "tokenizer")])
    else:  # checkpoints written before the vocabulary was stored with them
        tok = load_tokenizer(dataset.dataset_dir(setup.config))
        print(f"note: this checkpoint does not carry its vocabulary; using "
              f"{dataset.dataset_dir(setup.config)}/meta.json, which must be the one it was trained on",
              file=sys.stderr)
    return setup, restored.items["params"], restored.step, tok


def load_hf(name: str, mesh, quantization: str = "none", dtype: str = "float32"):
    """Setup, parameters and tokenizer of a Hugging Face model: a directory, or a hub name
    (downloaded into the Hugging Face cache if it is not there yet)."""
    directory = hf.resolve(name)
    model = hf.read_config(directory)
    values = hf.fill_model_keys({"init_from": name}, model, directory, default_block_size=model.max_context)
    config = configurator.Config(**values, batch_size=sharding.batch_shards(mesh),
                                 quantization=quantization, dtype=dtype)
    setup = train.make_setup(config, mesh, model.keys["vocab_size"])
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        tok = hf_tokenizer(directory)
    elif model.model_type == "gpt2":  # GPT-2 directories from before tokenizer.json
        tok = gpt2_tokenizer()
    else:
        raise hf.HFError(f"{directory} has no tokenizer.json: nanomax needs the model's tokenizer to "
                         f"turn prompts into ids")
    if tok.vocab_size > model.keys["vocab_size"]:
        raise hf.HFError(f"{directory}: the tokenizer has {tok.vocab_size} tokens but the model only "
                         f"{model.keys['vocab_size']} (vocab_size in config.json): they are not a pair")
    return setup, checkpoint.load_pretrained(setup, directory), tok


def main(argv):
    cfg = configurator.load_config_or_exit(argv, SampleConfig)
    try:
        if cfg.mesh_data * cfg.mesh_tensor > jax.device_count():
            raise ValueError(f"mesh_data x mesh_tensor = {cfg.mesh_data} x {cfg.mesh_tensor} devices, "
                             f"but there are {jax.device_count()}: lower them")
        mesh = sharding.make_mesh(cfg.mesh_data, 1, cfg.mesh_tensor,
                                  devices=jax.devices()[:cfg.mesh_data * cfg.mesh_tensor])
        if cfg.init_from == "resume":
            setup, params, step, tok = load_for_inference(cfg.out_dir, mesh, cfg.quantization)
            print(f"loaded step {step} from {cfg.out_dir}", file=sys.stderr)
        else:
            dtype = cfg.dtype if cfg.dtype != "auto" else (
                "float32" if jax.default_backend() == "cpu" else "bfloat16")
            setup, params, tok = load_hf(cfg.init_from, mesh, cfg.quantization, dtype)
            print(f"loaded {cfg.init_from} ({tok.summary()})", file=sys.stderr)
        params = weights_in_compute_dtype(setup.graphdef, params)  # once: bfloat16 halves the memory
        texts = [cfg.start]
        if cfg.start.startswith("FILE:"):
            with open(cfg.start[5:], encoding="utf-8") as f:
                texts = [line for line in f.read().splitlines() if line.strip()]
            if not texts:
                raise ValueError(f"{cfg.start[5:]} has no prompts (one per line)")
        prompts = [encode_prompt(tok, text) for text in texts for _ in range(cfg.num_samples)]
        stop_ids = stop_token_ids(tok, cfg.stop)
        stream = StreamPrinter(tok, prompts[0], stop_ids) if cfg.stream else None
        out = generate(setup, params, prompts, cfg.max_new_tokens, seed=cfg.seed,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop_ids=stop_ids,
                       kv_cache=cfg.kv_cache, on_token=stream)
    except (OSError, ValueError) as e:  # also CheckpointError, sharding.MeshError
        sys.exit(f"error: {e}")
    for i, (ids, new) in enumerate(zip(prompts, out.tokens)):
        if i == 0 and stream is not None:
            stream.finish()  # already on screen, but for a last half character
        else:
            print(decode_sample(tok, ids + new))
        print("---------------")
    rows = len(prompts)
    print(f"prefill: {out.prompt_tokens} prompt tokens in {out.prefill_s * 1e3:.1f} ms "
          f"({out.prompt_tokens / out.prefill_s:,.0f} tok/s) | decode: {out.decode_tokens} tokens in "
          f"{out.decode_s:.2f} s ({out.decode_tokens / out.decode_s:,.1f} tok/s, {rows} rows"
          f"{', KV cache' if cfg.kv_cache else ', recomputed'}) | compile {out.compile_s:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
