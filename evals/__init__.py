"""Evaluations: multiple-choice tasks and perplexity scored like lm-evaluation-harness, and the lm-eval adapter."""
