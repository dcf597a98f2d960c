"""The same training run with two attention kernels, step by step: do they learn alike?

    python bench/attention_agreement.py config/shakespeare_char.py --compare=splash,einsum --steps=50 \
        --dtype=float32 --document_masking=True

Each kernel starts from the same parameters and sees the same batches (train.py's own state, train
step and optimizer; the config's model, batch and learning-rate schedule). The batches are random
phrases of tokens repeated in random order, so the loss falls within a few steps, with token 0
starting a document (document_masking=True: attention stays within each). Prints both losses at
every step and the largest difference. Other flags are train.py config keys.
"""

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import configurator  # noqa: E402
import sharding  # noqa: E402
import train  # noqa: E402

DOCUMENT_START = 0


@dataclasses.dataclass(frozen=True)
class Options:
    compare: str = "splash,einsum"  # two attention choices (config key `attention`)
    steps: int = 50


def batches(config, vocab_size: int, steps: int, seed: int = 0) -> np.ndarray:
    """(steps, 2, micro-steps, B, T) int32 inputs and next-token targets: 16 phrases of 24 tokens in
    random order, a quarter of them starting with the document token."""
    rng = np.random.default_rng(seed)
    phrases = rng.integers(1, vocab_size, (16, 24))
    phrases[:4, 0] = DOCUMENT_START
    rows = steps * config.gradient_accumulation_steps * config.batch_size
    need = rows * (config.block_size + 1)
    stream = phrases[rng.integers(0, 16, need // 24 + 1)].reshape(-1)[:need].reshape(rows, -1)
    shape = (steps, config.gradient_accumulation_steps, config.batch_size, config.block_size)
    return np.stack([stream[:, :-1].reshape(shape), stream[:, 1:].reshape(shape)], axis=1).astype(np.int32)


def losses(config, steps: int) -> list[float]:
    vocab_size = config.vocab_size or 65
    mesh = sharding.mesh_from_config(config, jax.devices())
    setup = train.make_setup(config, mesh, vocab_size, DOCUMENT_START)
    print(f"  {config.attention!r} runs {setup.model_config.attention!r} on {jax.devices()[0].device_kind}", flush=True)
    step, state, out = train.jit_train_step(setup), train.init_state(setup), []
    with sharding.activate(mesh):
        for x_y in batches(config, vocab_size, steps):
            batch = tuple(jax.device_put(a, setup.micro_batch_sharding) for a in x_y)
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
    return out


def main(argv: list[str]) -> None:
    options, config = configurator.load_with_options_or_exit(argv, Options)
    kinds = options.compare.split(",")
    if len(kinds) != 2:
        sys.exit(f"config error: --compare takes two attention choices, e.g. splash,einsum; got {options.compare!r}")
    try:
        runs = [losses(dataclasses.replace(config, attention=kind), options.steps) for kind in kinds]
    except configurator.ConfigError as e:  # e.g. splash on a machine without a TPU
        sys.exit(f"config error: {e}")
    print(f"  {'step':>4} {kinds[0]:>10} {kinds[1]:>10} {'difference':>10}")
    for i, (a, b) in enumerate(zip(*runs)):
        print(f"  {i:>4} {a:>10.5f} {b:>10.5f} {a - b:>10.2e}")
    worst = max(abs(a - b) for a, b in zip(*runs))
    print(
        f"attention agreement over {options.steps} steps ({config.dtype}): largest loss difference {worst:.2e}; "
        f"final losses {runs[0][-1]:.5f} ({kinds[0]}) and {runs[1][-1]:.5f} ({kinds[1]}), first {runs[0][0]:.5f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
