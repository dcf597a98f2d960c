"""Where a token is: rotary position embedding (RoPE, Llama's) turns each query and key head by its
position, or nothing does (GPT-2's learned positions are added to the input by model.GPT.wpe). Picked
by config.pos_embedding from ROTATIONS. `config` is a model.GPTConfig (read by name). jax and numpy only.
"""

import jax.numpy as jnp
import numpy as np


def no_rotation(x_BxTxNxH, position_BxT, config, token_axis: int = 1):
    """Learned positions: GPT.wpe adds them to the input, queries and keys stay as they are."""
    return x_BxTxNxH


def rope_frequencies(head_size: int, config) -> np.ndarray:
    """RoPE's H/2 angular frequencies theta^(-2i/H), in float64; with rope_scaling='llama3',
    Llama 3.1's long-context rule: wavelengths shorter than original_context / high_freq_factor
    stay, those longer than original_context / low_freq_factor are slowed down by `factor`,
    and the band between blends the two linearly in original_context / wavelength."""
    freq = 1.0 / config.rope_theta ** (np.arange(0, head_size, 2) / head_size)
    if config.rope_scaling == "none":
        return freq
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    periods_in_context = config.rope_original_context * freq / (2 * np.pi)  # context / wavelength
    blend = np.clip((periods_in_context - low) / (high - low), 0.0, 1.0)  # 0: slow down, 1: keep
    return (1 - blend) * freq / config.rope_scaling_factor + blend * freq


def rope(x, position_BxT, config, token_axis: int = 1):
    """Rotary position embedding, in the rotate-half layout (Llama's in Hugging Face files):
    the pair of dimensions (i, i + H/2) of every head turns by the angle position·freq_i.
    A query and a key then score by their distance alone. Angles in float32. x is (B, T, heads, H),
    or with token_axis=2 (B, heads, T, H) (splash's layout)."""
    H = x.shape[-1]
    freq = rope_frequencies(H, config).astype(np.float32)  # (H/2,), a constant of the program
    # (B, T) positions, a unit axis where x has its heads, times (H/2,) frequencies
    angle = jnp.expand_dims(position_BxT.astype(jnp.float32), 3 - token_axis)[..., None] * freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ROTATIONS = {"learned": no_rotation, "rope": rope}  # by config.pos_embedding
