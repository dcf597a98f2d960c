"""JAX's persistent compilation cache for the commands (serve.py, sample.py, train.py): compiled programs
are written to a folder and loaded from it by the next process that compiles the same program for the
same devices, so a restart costs a load instead of a compile. Also the count of what this process
compiled and loaded, for the commands' start-up lines, and the time since the process started.

    warning = compile_cache.use(config.compile_cache)   # '' = off; a folder it can't write: off, and why
    ...                                                 # compile
    print(compile_cache.summary())                      # '14 programs (14 from the cache)'

JAX trusts the cache's contents (a program from it runs as it is): keep the folder to this user, as the
default under ~/.cache is.
"""

import os
import tempfile
import threading
import time
import warnings
from typing import NamedTuple

import jax
from jax.experimental.compilation_cache import compilation_cache

# A program is compiled or loaded from the cache under this event (jax/_src/dispatch.py); a load is
# also reported as a hit (jax/_src/compiler.py). Both names as JAX 0.10.2 records them.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
# JAX's warnings when an entry can't be read (a truncated or foreign file: it compiles the program
# instead) or written (a full disk): multi-line Python warnings, one per program, said once here.
CACHE_WARNINGS = (
    "Error reading persistent compilation cache entry",
    "Error writing persistent compilation cache entry",
)


class Counts(NamedTuple):
    programs: int = 0  # compiled or loaded
    from_cache: int = 0


START = Counts()
_lock = threading.Lock()
_counts = START
_warned = False
_imported_at = time.time()


def counts() -> Counts:
    """The programs this process has compiled or loaded so far."""
    with _lock:
        return _counts


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    global _counts
    if event == COMPILE_EVENT:
        with _lock:
            _counts = _counts._replace(programs=_counts.programs + 1)


def _on_event(event: str, **kwargs) -> None:
    global _counts
    if event == HIT_EVENT:
        with _lock:
            _counts = _counts._replace(from_cache=_counts.from_cache + 1)


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def use(folder: str) -> str | None:
    """Compile through the cache in `folder` from now on ('' = no cache); a folder that can't be made or
    written is not used: returns the one-line warning that says so (None when all is well)."""
    compilation_cache.reset_cache()  # JAX opens its cache once: a process that compiled before (tests) starts anew
    if not folder:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise NotADirectoryError(0, "a file, not a folder")
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # JAX would fail at every write, one warning each
            pass
    except OSError as e:
        jax.config.update("jax_enable_compilation_cache", False)
        why = e.strerror or type(e).__name__
        return f"warning: --compile_cache={folder}: can't write there ({why}); compiling without the cache"
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    # Every program is worth keeping: JAX's defaults skip those compiled in under a second, and a
    # server's dozen small ones add up to many seconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return None


def _one_line_warning(message, category, filename, lineno, file=None, line=None, _show=warnings.showwarning):
    """JAX's warnings about the cache's entries as one line, the first time only; others as before."""
    global _warned
    text = str(message)
    if not text.startswith(CACHE_WARNINGS):
        return _show(message, category, filename, lineno, file, line)
    if not _warned:
        _warned = True
        print(
            f"warning: the compilation cache {jax.config.jax_compilation_cache_dir} has an entry JAX can't use "
            f"({text.split(': ', 1)[-1][:160]}); its program is compiled instead (deleting the folder clears it)",
            flush=True,
        )


warnings.showwarning = _one_line_warning


def summary(since: Counts = START) -> str:
    """'N programs (K from the cache)': those compiled or loaded since counts() was `since` (default: all)."""
    done = counts()
    programs, from_cache = done.programs - since.programs, done.from_cache - since.from_cache
    on = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    where = f"{from_cache} from the cache" if on else "compilation cache off"
    return f"{programs} program{'s' if programs != 1 else ''} ({where})"


def seconds_since_start() -> float:
    """Wall seconds since this process started (Linux's /proc; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _imported_at
