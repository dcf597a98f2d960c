"""Ahead-of-time reports for hardware that is not here: what a step communicates, the serving plan for a target."""
