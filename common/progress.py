"""Progress lines of long passes (the trainer's evaluation, the evals' scoring) on stderr, and the
h/m/s format the trainer's log shares with them."""

import sys
import time

import jax


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def show_progress(label: str, done: int, total: int, start: float) -> None:
    """A progress line on stderr, only for passes long enough (> 5 s) to need one."""
    elapsed = time.perf_counter() - start
    if elapsed > 5 and jax.process_index() == 0:
        eta = elapsed / done * (total - done)
        end = "\n" if done == total else ""
        print(f"\r{label} {done}/{total} | ETA {format_seconds(eta)}", end=end, file=sys.stderr, flush=True)
