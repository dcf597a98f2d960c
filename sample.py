"""Sample text from a trained model.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3

The whole generation is one compiled loop (lax.fori_loop): no return to Python between
tokens. Each step recomputes the forward pass over a fixed (B, prompt + new) buffer;
causal attention makes positions beyond the current one irrelevant.
"""

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

import configurator
import sharding
import train
from tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    out_dir: str = "out"  # the training run whose latest checkpoint is used
    start: str = "\n"  # the prompt; FILE:path reads it from a file
    num_samples: int = 3
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 200  # 0 = no top-k filtering
    seed: int = 1337


def sample_logits(logits_BxV, key, temperature: float, top_k: int):
    """One token per row: greedy at temperature 0, else softmax(logits / T) over the top k."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits_BxV = logits_BxV / temperature
    if top_k:
        kth_largest = jax.lax.top_k(logits_BxV, min(top_k, logits_BxV.shape[-1]))[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_largest, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1)


def generate(graphdef, params, prompt_BxP, max_new_tokens: int, key, *, vocab_size: int,
             temperature: float = 1.0, top_k: int = 0):
    """Prompt (B, P) -> (B, P + max_new_tokens) token ids, in one compiled loop."""
    B, P = prompt_BxP.shape
    tokens_BxT = jnp.zeros((B, P + max_new_tokens), jnp.int32).at[:, :P].set(prompt_BxP)

    def next_token(t, carry):
        tokens_BxT, key = carry
        key, step_key = jax.random.split(key)
        logits_BxV = nnx.merge(graphdef, params)(tokens_BxT)[:, t - 1, :vocab_size]
        token_B = sample_logits(logits_BxV, step_key, temperature, top_k)
        return tokens_BxT.at[:, t].set(token_B), key

    tokens_BxT, _ = jax.lax.fori_loop(P, P + max_new_tokens, next_token, (tokens_BxT, key))
    return tokens_BxT


def sample_text(setup, params, n_tokens: int, prompt: str = "\n", seed: int = 0,
                temperature: float = 0.8, top_k: int = 200, num_samples: int = 1) -> list[str]:
    """Decoded samples from the model described by `setup` (used by train.py and main())."""
    tok = load_tokenizer(train.dataset_dir(setup.config))
    prompt_ids = tok.encode(prompt) if prompt else [tok.eot_token or 0]
    block_size = setup.model_config.block_size
    if len(prompt_ids) >= block_size:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                         f"{block_size}: shorten the prompt")
    n_tokens = min(n_tokens, block_size - len(prompt_ids))
    prompt_BxP = jnp.asarray([prompt_ids] * num_samples, jnp.int32)
    run = jax.jit(generate, static_argnums=(0, 3), static_argnames=("vocab_size", "temperature", "top_k"))
    with sharding.activate(setup.mesh):
        out = run(setup.graphdef, params, prompt_BxP, n_tokens, jax.random.key(seed),
                  vocab_size=setup.model_config.vocab_size, temperature=temperature, top_k=top_k)
    return [tok.decode(row) for row in np.asarray(out)]


def load_for_inference(out_dir: str):
    """Setup and parameters of the latest checkpoint in out_dir (its config comes with it)."""
    manager = train.checkpoint_manager(configurator.Config(out_dir=out_dir), read_only=True)
    meta = train.read_checkpoint_meta(manager, out_dir)
    config = configurator.config_from_dict(meta["config"])
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    setup = train.make_setup(config, mesh, train.read_vocab_size(config))
    params = manager.restore(meta["step"], args=ocp.args.Composite(
        params=ocp.args.StandardRestore(setup.abstract_state["params"])))["params"]
    return setup, params, meta["step"]


def main(argv):
    cfg = configurator.load_config_or_exit(argv, SampleConfig)
    prompt = cfg.start
    try:
        if prompt.startswith("FILE:"):
            with open(prompt[5:], encoding="utf-8") as f:
                prompt = f.read()
        setup, params, step = load_for_inference(cfg.out_dir)
        print(f"loaded step {step} from {cfg.out_dir}", file=sys.stderr)
        start = time.perf_counter()
        texts = sample_text(setup, params, cfg.max_new_tokens, prompt, cfg.seed,
                            cfg.temperature, cfg.top_k, cfg.num_samples)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    for text in texts:
        print(text)
        print("---------------")
    print(f"{cfg.num_samples} x {cfg.max_new_tokens} tokens in {time.perf_counter() - start:.1f} s "
          f"(including compilation)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
