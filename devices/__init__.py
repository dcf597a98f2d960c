"""Chips' facts (peak FLOP/s, memory, bandwidth) and the pre-flight memory verdict."""
