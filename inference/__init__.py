"""Inference without an optimizer: the model loader, generation (prefill + decode) and the serving engine's slots."""
