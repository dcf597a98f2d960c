"""Weights on disk: training checkpoints (Orbax) and Hugging Face models in and out."""
