"""A decode step of GPT-2 124M (random bf16 weights) with its rows at mixed lengths: XLA's attention
over the prefix bucket that holds the longest row (what inference/generate.py reads) against the
Pallas kernel that reads each block of rows' filled positions (kv_cache.FILLED: what the serving
engine reads on one TPU chip). Milliseconds per step, timed with block_until_ready.

    python bench/decode_attention_mixed.py          # on the chip: about 2 minutes with its compiles
    python bench/decode_attention_mixed.py small    # a 2-layer model on a CPU (the kernel interpreted)

docs/tpu.md has the v5e's numbers.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import model  # noqa: E402
from inference import generate  # noqa: E402
from layers.kv_cache import FILLED, Prefix, init_cache  # noqa: E402

STEPS = 30
# (rows, cache positions, most rows' length, the longer rows' length): one row in 64 is long
SHAPES = ((64, 1024, 100, 900), (256, 512, 100, 450), (64, 256, 80, 80), (256, 256, 80, 80), (256, 256, 144, 144))
SMALL_SHAPES, SMALL_MODEL = ((8, 256, 20, 200),), dict(n_layer=2, n_head=2, n_embd=128)


def step_ms(config, lengths: list[int], reads) -> float:
    graphdef, params = nnx.split(model.GPT(config, jax.random.key(0)))
    params = model.cast_for_inference(nnx.to_pure_dict(params), jnp.bfloat16)
    B, S = len(lengths), config.block_size
    cache, start_B, token_Bx1 = init_cache(config, B, S), jnp.array(lengths, jnp.int32), jnp.zeros((B, 1), jnp.int32)
    step = jax.jit(lambda p, c: nnx.merge(graphdef, p).decode(token_Bx1, c, start_B, reads=reads), donate_argnums=1)
    logits, cache = step(params, cache)  # compiles
    jax.block_until_ready(cache)
    start = time.perf_counter()
    for _ in range(STEPS):  # the same positions each time: a step's cost, not a generation
        logits, cache = step(params, cache)
    jax.block_until_ready((logits, cache))
    return (time.perf_counter() - start) / STEPS * 1e3


def main(argv: list[str]) -> None:
    small = argv[:1] == ["small"]
    for B, S, short, long in SMALL_SHAPES if small else SHAPES:
        config = model.GPTConfig(block_size=S, dtype="bfloat16", **(SMALL_MODEL if small else {}))
        cases = (
            {"all as long": [short] * B}
            if short == long
            else {
                "all as long": [short] * B,
                "one row in 64 longer": [long if b % 64 == 0 else short for b in range(B)],
            }
        )
        for name, lengths in cases.items():
            bucket = next(b for b in generate.prefix_buckets(S) if b >= max(lengths))
            xla, kernel = step_ms(config, lengths, Prefix(bucket)), step_ms(config, lengths, FILLED)
            print(
                f"rows {B}, cache {S}, {name} (longest {max(lengths)}, mean {np.mean(lengths):.0f}): "
                f"XLA over {bucket} positions {xla:.3f} ms, the kernel {kernel:.3f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
