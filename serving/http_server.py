"""uvicorn as serve.py runs it, in its own process (the HTTP side beside the engine) and in each HTTP
worker (serving/workers.py): uvicorn_config, StoppingUvicorn.
"""

import contextlib
import signal

import uvicorn


def uvicorn_config(app) -> uvicorn.Config:
    """How serve.py and its HTTP workers run uvicorn: warnings only, 30 s for open requests to end at a
    stop, and no lifespan task (the app has no startup or shutdown hooks; a second Ctrl-C or SIGTERM,
    as coreutils' timeout sends, cancelled that task and uvicorn logged its traceback)."""
    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30, lifespan="off")


class StoppingUvicorn(uvicorn.Server):
    """uvicorn whose SIGTERM and Ctrl-C first call on_stop (serve.py's stops the engine, whose open
    requests then end with their text so far, so that graceful shutdown completes) and which then
    returns, for exit code 0 (uvicorn's own raises the signal again once stopped)."""

    def __init__(self, config, on_stop):
        super().__init__(config)
        self.on_stop = on_stop

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def handle_exit(self, sig, frame):
        self.on_stop()
        super().handle_exit(sig, frame)
