"""Sample text from a trained model, or from a Hugging Face model (GPT-2, Llama, Mistral, Qwen2).

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3
    python sample.py --init_from=gpt2 --start="Hello, my name is" --top_p=0.9
    python sample.py --init_from=/path/to/Llama-3.2-1B --start="The capital of France is" --temperature=0
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompts.txt   # one prompt per line
    python sample.py --out_dir=out-sft-tasks --chat=True --temperature=0   # a conversation: type, it answers
    python sample.py --out_dir=out-sft-tasks --chat=True --messages=chat.json   # the user turns of a file

The generation itself (prefill + decode in one compiled loop) is inference/generate.py's.
"""

import dataclasses
import json
import os
import sys

import configurator
from common import compile_cache
from data import chat_template
from devices import memory
from inference.generate import decode_sample, encode_prompt, generate, stop_token_ids
from inference.loader import (
    KV_CACHE_DTYPES,
    WEIGHT_DTYPES,
    decode_mesh,
    default_dtype,
    load_checkpoint,
    load_hf,
    memory_summary,
    serving_weights,
)
from layers.quantization import MODES as QUANTIZATION_MODES


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
    quantization: str = "auto"  # the matmuls of the blocks: 'auto' (a checkpoint's own; 'none' for a Hugging
    #                             Face model) | 'none' | 'int8' | 'fp8', whatever trained it
    weight_dtype: str = "auto"  # the weights in memory: 'auto' (the compute dtype) | 'int8' (the blocks'
    #                             matrices as int8, a float32 scale per output channel; weight-only)
    kv_cache_dtype: str = "auto"  # the KV cache: 'auto' (the compute dtype) | 'bfloat16' | 'float32' | 'int8'
    #                               (a float32 scale per token and key/value head)
    chat: bool = False  # a conversation, rendered with the model's chat template (as serve.py does): each
    #                     line typed is a user turn, and the assistant's answer streams back; Ctrl-D ends it
    messages: str = ""  # with chat: a JSON file of [{role, content}] whose system messages open the
    #                     conversation and whose user messages are sent in turn, instead of typed ones
    compile_cache: str = configurator.default_compile_cache()  # compiled programs are kept in this folder, and
    #                                                            the next run loads them instead of compiling; '' = off

    def __post_init__(self):
        configurator.check_init_from(self.init_from, choices=("resume",))
        for key in ("num_samples", "max_new_tokens", "mesh_data", "mesh_tensor"):
            if getattr(self, key) < 1:
                raise configurator.ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.temperature < 0 or self.top_k < 0:
            raise configurator.ConfigError("temperature and top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise configurator.ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        configurator.check_choice("quantization", self.quantization, ("auto", *QUANTIZATION_MODES))
        configurator.check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))
        configurator.check_choice("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        configurator.check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.messages and not self.chat:
            raise configurator.ConfigError("--messages is the conversation of --chat=True: add it")


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
        print(text[len(self.shown) :], end="", flush=True)
        self.shown = text

    def finish(self):
        self._show(final=True)
        print()


def read_prompts(start: str) -> list[str]:
    """--start's prompt, or with FILE:path the file's non-empty lines."""
    if not start.startswith("FILE:"):
        return [start]
    path = start[5:]
    try:
        with open(path, encoding="utf-8") as f:
            texts = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--start=FILE:{path}: {getattr(e, 'strerror', None) or e}") from None
    if not texts:
        raise ValueError(f"{path} has no prompts (one per line)")
    return texts


# ----------------------------------------------------------------------------- chat


def read_messages(path: str) -> list[dict]:
    """--messages: a JSON list of {role, content}."""
    try:
        with open(path, encoding="utf-8") as f:
            return chat_template.check_messages(json.load(f))
    except (OSError, ValueError) as e:  # json's and chat's errors are ValueErrors
        raise ValueError(f"--messages={path}: {getattr(e, 'strerror', None) or e}") from None


def typed_turns():
    """Lines typed at the prompt, until Ctrl-D; blank ones are skipped."""
    while True:
        try:
            line = input("user> ")
        except EOFError:
            print()
            return
        if line.strip():
            yield line


def converse(cfg: SampleConfig, setup, params, tok, given=None) -> list[dict]:
    """A conversation: each user turn (typed, or of the messages `given`) and the model's answer to
    all that came before it, streamed. Returns the messages."""
    if given is not None:
        history = [m for m in given if m["role"] == "system"]
        turns = (m["content"] for m in given if m["role"] == "user")
    else:
        history, turns = [], typed_turns()
    stop_ids = stop_token_ids(tok, cfg.stop)
    for n, text in enumerate(turns):
        if given is not None:
            print(f"user> {text}")
        history.append({"role": "user", "content": text})
        prompt = tok.encode(chat_template.render(tok, history))  # a template that wants BOS writes it itself
        print("assistant> ", end="", flush=True)
        stream = StreamPrinter(tok, [], stop_ids)
        out = generate(
            setup,
            params,
            [prompt],
            cfg.max_new_tokens,
            seed=cfg.seed + n,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_ids=stop_ids,
            kv_cache=cfg.kv_cache,
            on_token=stream,
            vocab=tok.vocab_size,
        )
        stream.finish()
        reply = [int(i) for i in out.tokens[0] if int(i) not in stop_ids]
        history.append({"role": "assistant", "content": tok.decode(reply)})
    return history


def main(argv):
    cfg = configurator.load_config_or_exit(argv, SampleConfig)
    if warning := compile_cache.use(cfg.compile_cache):
        print(warning, file=sys.stderr)
    try:
        mesh = decode_mesh(cfg.mesh_data, cfg.mesh_tensor)
        texts = read_prompts(cfg.start)  # before loading: a missing file is not worth the wait
        given = read_messages(cfg.messages) if cfg.messages else None
        if cfg.init_from == "resume":
            setup, params, step, tok = load_checkpoint(cfg.out_dir, mesh, cfg.quantization, cfg.kv_cache_dtype)
            print(f"loaded step {step} from {os.path.abspath(cfg.out_dir)}", file=sys.stderr)
        else:
            setup, params, tok = load_hf(
                cfg.init_from, mesh, cfg.quantization, default_dtype(cfg.dtype), cfg.kv_cache_dtype
            )
            print(f"loaded {cfg.init_from} ({tok.summary()})", file=sys.stderr)
        params = serving_weights(setup, params, cfg.weight_dtype)  # once: bfloat16 halves the memory, int8 again
        print(memory_summary(setup, params), file=sys.stderr)
        # XLA:TPU refuses, while compiling, what cannot fit: one line with the remedies, not its traceback
        rows = 1 if cfg.chat else len(texts) * cfg.num_samples
        refusing = memory.refusing_out_of_memory(
            f"sampling {rows} rows", list(mesh.devices.flat), memory.sampling_remedies(cfg, len(texts)), params
        )
        if cfg.chat:
            with refusing:
                converse(cfg, setup, params, tok, given)
            return
        prompts = [encode_prompt(tok, text) for text in texts for _ in range(cfg.num_samples)]
        stop_ids = stop_token_ids(tok, cfg.stop)
        stream = StreamPrinter(tok, prompts[0], stop_ids) if cfg.stream else None
        with refusing:
            out = generate(
                setup,
                params,
                prompts,
                cfg.max_new_tokens,
                seed=cfg.seed,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                stop_ids=stop_ids,
                kv_cache=cfg.kv_cache,
                on_token=stream,
                vocab=tok.vocab_size,
            )
    except (OSError, ValueError) as e:  # also CheckpointError, sharding.MeshError
        sys.exit(f"error: {e}")
    for i, (ids, new) in enumerate(zip(prompts, out.tokens)):
        if i == 0 and stream is not None:
            stream.finish()  # already on screen, but for a last half character
        else:
            print(decode_sample(tok, ids + new))
        print("---------------")
    rows = len(prompts)
    print(
        f"prefill: {out.prompt_tokens} prompt tokens in {out.prefill_s * 1e3:.1f} ms "
        f"({out.prompt_tokens / out.prefill_s:,.0f} tok/s) | decode: {out.decode_tokens} tokens in "
        f"{out.decode_s:.2f} s ({out.decode_tokens / out.decode_s:,.1f} tok/s, {rows} rows"
        f"{', KV cache' if cfg.kv_cache else ', recomputed'}) | compile {out.compile_s:.1f} s; "
        f"{compile_cache.summary()}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
