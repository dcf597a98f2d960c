"""How close int8 serving stays to the float model: docs/serving.md's int8 table, measured on a checkpoint.

    .venv/bin/python bench/int8_agreement.py out-shakespeare-char
    .venv/bin/python bench/int8_agreement.py out-shakespeare-char --prompts=64 --rows=128 --groups=0,64,32

For float, int8 weights as serving holds them (inference.loader.serving_weights: the blocks' matrices
and the token table), an int8 KV cache, and both:
- perplexity and the greedy token after the same prefix, on --rows rows of block_size validation
  tokens, decoded one token at a time through the KV cache (an int8 cache is written and read back);
- greedy agreement over 64 tokens generated freely (inference/generate.py) after --prompts prompts of 16
  validation tokens, spread over the split: the share of new tokens equal to the float model's at
  the same index, so a row counts as lost from its first different token on;
- for each row that diverges, the float model's margin (top logit minus the next) where it does,
  beside the largest logit change int8 makes there, both on the float model's own tokens.
Yardsticks: the same float32 weights computed in bfloat16 (the compute dtype on GPUs and TPUs),
and with --groups, weights rounded to int8 and back with a scale per output channel and per group
of that many input rows (0: the whole input, as int8_weights), computed in float: what finer scales
would give. --dtype=bfloat16 runs everything, the float reference included, in bfloat16.
"""

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from common.model_setup import model_setup  # noqa: E402
from data import dataset  # noqa: E402
from inference import generate  # noqa: E402
from inference import loader  # noqa: E402
from layers import kv_cache  # noqa: E402
from layers import quantization  # noqa: E402

NEW_TOKENS, PROMPT_TOKENS = 64, 16


def logits_along(setup, params, tokens_BxT) -> np.ndarray:
    """Float32 logits (B, T-1, V) after each prefix of the rows, one token at a time through the cache."""

    def run(params, tokens_BxT):
        gpt = nnx.merge(setup.graphdef, generate.weights_in_compute_dtype(setup.graphdef, params))
        B, T = tokens_BxT.shape

        def step(cache, t):
            logits_BxV, cache = gpt.decode(
                jax.lax.dynamic_slice_in_dim(tokens_BxT, t, 1, 1), cache, jnp.full(B, t, jnp.int32)
            )
            return cache, logits_BxV

        logits_TxBxV = jax.lax.scan(step, kv_cache.init_cache(gpt.config, B, T), jnp.arange(T - 1))[1]
        return logits_TxBxV.transpose(1, 0, 2).astype(jnp.float32)

    return np.asarray(jax.jit(run)(params, tokens_BxT))


def perplexity(logits_BxTxV, tokens_BxT) -> float:
    log_p = np.asarray(jax.nn.log_softmax(jnp.asarray(logits_BxTxV), -1))
    return float(np.exp(-np.take_along_axis(log_p, np.asarray(tokens_BxT)[:, 1:, None], -1).mean()))


def rounded_weights(params, group: int):
    """The blocks' kernels (those int8_weights converts) rounded to int8 and back, in float: a scale
    per output channel and per `group` rows of the flattened input (0: all of them)."""

    def convert(path, p):
        module, name = (path[-2].key if len(path) > 1 else None), path[-1].key
        if name not in loader.INT8_KERNELS or not (module == "attn" or (module == "mlp" and p.ndim == 3)):
            return p
        inputs = int(np.prod(p.shape[1 : 1 + loader.INT8_KERNELS[name]]))  # after the layers' axis
        grouped = p.reshape(p.shape[0], inputs // (group or inputs), group or inputs, -1)
        q, scale = quantization.quantize_int8(grouped, axis=2)
        return (q * scale).reshape(p.shape).astype(p.dtype)

    return jax.tree_util.tree_map_with_path(convert, params)


class Reference:
    """The float model's results that every variant is compared with."""

    def __init__(self, setup, params, rows_BxT, prompts):
        self.rows_BxT, self.prompts = rows_BxT, prompts
        self.logits = logits_along(setup, params, rows_BxT)
        self.perplexity = perplexity(self.logits, rows_BxT)
        self.tokens = generate.generate(setup, params, prompts, NEW_TOKENS, temperature=0).tokens
        self.generated_BxT = jnp.asarray([p + t for p, t in zip(prompts, self.tokens)])
        self.generated_logits = logits_along(setup, params, self.generated_BxT)

    def compare(self, name, setup, params) -> str:
        logits = logits_along(setup, params, self.rows_BxT)
        ppl = perplexity(logits, self.rows_BxT)
        same = logits.argmax(-1) == self.logits.argmax(-1)
        tokens = generate.generate(setup, params, self.prompts, NEW_TOKENS, temperature=0).tokens
        agree = np.mean([a == b for want, got in zip(self.tokens, tokens) for a, b in zip(want, got)])
        firsts = {
            b: next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
            for b, (want, got) in enumerate(zip(self.tokens, tokens))
        }
        generated_logits = logits_along(setup, params, self.generated_BxT)
        flips = []
        for b, i in firsts.items():
            if i is not None:  # the logits that chose new token i
                want, got = self.generated_logits[b, PROMPT_TOKENS - 1 + i], generated_logits[b, PROMPT_TOKENS - 1 + i]
                top = np.sort(want)[::-1]
                flips.append(
                    f"row {b} at token {i}: margin {top[0] - top[1]:.4f}, "
                    f"largest logit change {np.abs(got - want).max():.4f}"
                )
        change = np.sqrt(np.mean((logits - self.logits) ** 2))
        row = (
            f"| {name} | {loader.weight_bytes(params):,} B | {loader.kv_bytes_per_token(setup.model_config):,} B "
            f"| {ppl:.4f} ({(ppl / self.perplexity - 1) * 100:+.3f}%) | {same.mean() * 100:.1f}% "
            f"({(~same).sum()} of {same.size}) | {agree * 100:.1f}% ({len(flips)} of {len(tokens)} rows diverge) "
            f"| {change:.4f} |"
        )
        return "\n".join([row] + [f"    {line}" for line in flips])


def main(argv):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("out_dir")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--dtype", default="", help="compute dtype for every run (default: the checkpoint's)")
    parser.add_argument("--groups", default="", help="comma-separated group sizes to try (0: per output channel)")
    args = parser.parse_args(argv)

    setup, params, step, _ = loader.load_checkpoint(args.out_dir)
    int8_kv = loader.load_checkpoint(args.out_dir, kv_cache_dtype="int8")[0]
    in_dtype = lambda s, dtype, kv="auto": model_setup(
        dataclasses.replace(s.config, dtype=dtype), s.mesh, s.model_config.vocab_size, kv
    )
    if args.dtype:
        setup, int8_kv = in_dtype(setup, args.dtype), in_dtype(int8_kv, args.dtype, "int8")
        params = generate.weights_in_compute_dtype(setup.graphdef, params)
    val = np.fromfile(os.path.join(dataset.dataset_dir(setup.config), "val.bin"), np.uint16).astype(np.int32)
    T = setup.model_config.block_size
    rows_BxT = jnp.asarray(val[: args.rows * T].reshape(args.rows, T))
    starts = np.linspace(0, len(val) - 4 * T, args.prompts).astype(int)
    reference = Reference(setup, params, rows_BxT, [val[s : s + PROMPT_TOKENS].tolist() for s in starts])

    print(
        f"{args.out_dir}, step {step}, {sum(p.size for p in jax.tree.leaves(params)):,} parameters, "
        f"{setup.model_config.dtype}; {args.rows} rows of {T} validation tokens, {args.prompts} prompts\n"
    )
    print(
        "| | weights | KV cache per token | perplexity | greedy token after the same prefix "
        f"| {NEW_TOKENS} tokens generated freely | rms logit change |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {setup.model_config.dtype} | {loader.weight_bytes(params):,} B "
        f"| {loader.kv_bytes_per_token(setup.model_config):,} B | {reference.perplexity:.4f} | - | - | - |"
    )
    int8_params = loader.int8_weights(params, vocab_matrices=True)  # as serving_weights holds them
    for name, s, p in (
        ("int8 weights", setup, int8_params),
        ("int8 KV cache", int8_kv, params),
        ("both", int8_kv, int8_params),
    ):
        print(reference.compare(name, s, p))
    if setup.model_config.dtype != "bfloat16":
        print(reference.compare("bfloat16 compute (yardstick)", in_dtype(setup, "bfloat16"), params))
    for group in [int(g) for g in args.groups.split(",") if g]:
        print(
            reference.compare(
                f"int8 weights in float, groups of {group or 'all'} rows", setup, rounded_weights(params, group)
            )
        )


if __name__ == "__main__":
    main(sys.argv[1:])
