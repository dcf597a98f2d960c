"""serve.py --http_workers=N: the HTTP side in N processes, the engine in serve.py's own.

In one process the event loop and the engine's thread share one interpreter lock, and on a host
whose Python is slow (a TPU VM's) the event loop saturates first (docs/tpu.md). With workers, each
worker process runs uvicorn and serving/app.py on the listening socket serve.py made (the kernel
hands each connection to one of them) and talks to the engine's process over two pipes:

    worker -> engine   ("submit", call, request id, the request's fields), ("cancel", request id),
                       ("health", call), ("score", call, prompt ids)
    engine -> worker   ("out", [(request id, item), ...]) once per round of the engine's loop (a
                       decode program's tokens): an item is a token id, a (token id, logprob, top)
                       with log-probabilities, or Finished (the reason, and the engine's times);
                       ("reply", call, result, error), ("state", "ready" | "stopping")

A request's text (detokenizing, stop strings) and its events are the worker's work, as in one process.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import signal
import threading
import time
from typing import NamedTuple

from inference import engine
from serving import app, http_server


class Finished(NamedTuple):
    """A request's end, with the engine's times (perf_counter is one clock for every process here)."""

    reason: str
    first_token_at: float | None
    finished_at: float


def error_fields(e: app.APIError) -> tuple:
    """An APIError as it crosses a pipe (app.APIError(*fields) rebuilds it)."""
    return e.status, e.message, e.param, e.code


# ----------------------------------------------------------------------------- in serve.py's process


class EngineHost:
    """The engine's side of the workers' pipes: their requests go to server.engine, and each worker's
    tokens go back in one message per round of the engine's loop (server.after_tokens)."""

    def __init__(self, cfg, count: int, sock):
        """Start `count` workers on the listening socket `sock`, which this process then closes (so that once
        they are gone, a connection is refused rather than left waiting). serve.py starts them before the
        model loads: they import meanwhile (~5 s on a TPU VM), then wait for connect()."""
        spawn = multiprocessing.get_context("spawn")  # a fork would copy the JAX runtime's threads' state
        self.links, self.processes = [], []  # processes: (process, its inbox, its outbox)
        # A worker ignores Ctrl-C until uvicorn takes it over (an interrupt of its imports would print a
        # traceback); the disposition is inherited across the exec.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for i in range(count):
                from_worker, to_engine = spawn.Pipe(duplex=False)
                from_engine, to_worker = spawn.Pipe(duplex=False)
                process = spawn.Process(
                    target=worker_main, name=f"http-{i}", daemon=True, args=(cfg, sock, to_engine, from_engine)
                )
                process.start()
                to_engine.close(), from_engine.close()  # the worker's ends
                self.processes.append((process, from_worker, to_worker))
        finally:
            signal.signal(signal.SIGINT, interrupt)
        sock.close()

    def connect(self, server) -> None:
        """Serve `server`'s model, now loaded: each worker gets its name, tokenizer, context and creation time
        as its link's first message."""
        server.after_tokens = self.send_tokens
        for process, inbox, outbox in self.processes:
            self.links.append(Link(server, process, inbox, outbox))
            self.links[-1].send(("model", server.name, server.tok, server.context, server.created))

    def send_tokens(self) -> None:
        for link in self.links:
            link.flush()

    def tell(self, state: str) -> None:
        for link in self.links:
            link.send(("state", state))

    def exited(self) -> list:
        """The links whose worker has exited (or been stopped: link.failure says why)."""
        return [link for link in self.links if not link.process.is_alive()]

    def stop_workers(self, timeout: float = 35.0) -> None:
        """SIGTERM to each worker: uvicorn finishes its open responses (the engine's stop ends their
        requests), then exits; one still waiting for connect() just exits."""
        processes = [process for process, _, _ in self.processes]
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for link in self.links:
            link.close()


class Link:
    """One worker: a thread reading its messages, and a thread writing it what waits to be sent (pickling
    and writing off the engine's thread: a slow worker never blocks the engine). What waits is bounded:
    the tokens since the writer last took them go as one message however many rounds they span, and the
    replies are at most the worker's calls in flight (RemoteServer.MAX_CALLS) and two states."""

    def __init__(self, server, process, inbox, outbox):
        self.server, self.process, self.inbox, self.outbox = server, process, inbox, outbox
        self.requests = {}  # the worker's request id -> the engine.Request made for it
        self.failure: str | None = None  # why this link stopped its worker, if it did
        self.wake = threading.Condition()
        self.tokens = []  # (request id, item), not taken by the writer yet
        self.messages = collections.deque()  # replies and states, not taken by the writer yet
        self.open = True
        threading.Thread(target=self._read, name=f"{process.name}-in", daemon=True).start()
        threading.Thread(target=self._write, name=f"{process.name}-out", daemon=True).start()

    def _put(self, item: tuple) -> None:
        with self.wake:
            self.tokens.append(item)

    def flush(self) -> None:
        """Wake the writer for the tokens put since it last took them."""
        with self.wake:
            if self.tokens:
                self.wake.notify()

    def send(self, message: tuple) -> None:
        with self.wake:
            self.messages.append(message)
            self.wake.notify()

    def close(self) -> None:
        with self.wake:
            self.open = False
            self.wake.notify()

    def _write(self):
        while True:
            with self.wake:
                while self.open and not self.tokens and not self.messages:
                    self.wake.wait()
                if not self.open:
                    return
                tokens, self.tokens = self.tokens, []
                messages, self.messages = self.messages, collections.deque()
            try:
                if tokens:
                    self.outbox.send(("out", tokens))
                for message in messages:
                    self.outbox.send(message)
            except OSError:  # the worker is gone
                return

    def _read(self):
        try:
            while True:
                try:
                    kind, *args = self.inbox.recv()
                except (EOFError, OSError):  # the worker exited
                    return
                if kind == "submit":
                    self._submit(*args)
                elif kind == "cancel" and (request := self.requests.get(args[0])) is not None:
                    self.server.cancel(request)
                elif kind == "health":
                    self.send(("reply", args[0], self.server.health_now(), None))
                elif kind == "score":
                    self._score(*args)
                self.flush()  # a cancel may have finished a queued request
        except Exception as e:  # noqa: BLE001 - the worker's calls would wait forever: stop it, and the server
            self.failure = f"the link to the HTTP worker {self.process.name} failed ({type(e).__name__}: {e})"
            print(f"error: {self.failure}; stopping that worker", flush=True)
            self.process.terminate()
        finally:  # the worker's requests stop
            for request in list(self.requests.values()):
                self.server.cancel(request)

    def _submit(self, call: int, rid: int, fields: dict) -> None:
        def token(t: engine.Token):
            self._put((rid, t.id if t.logprob is None else tuple(t)))

        def finish(reason: str):
            self.requests.pop(rid, None)
            self._put((rid, Finished(reason, request.first_token_at, request.finished_at)))

        request = engine.Request(**fields, on_token=token, on_finish=finish)
        self.requests[rid] = request
        try:
            self.server.ready().submit(request)
        except (engine.EngineError, app.APIError) as e:
            self.requests.pop(rid, None)
            e = app.refusal(e) if isinstance(e, engine.EngineError) else e
            return self.send(("reply", call, None, error_fields(e)))
        self.send(("reply", call, request.id, None))

    def _score(self, call: int, ids: list) -> None:
        """The reply once the scoring threads have scored the prompt (the model runs there, not on this
        thread, which the worker's other calls wait on)."""

        def reply(scored: concurrent.futures.Future):
            try:
                self.send(("reply", call, [tuple(t) for t in scored.result()], None))
            except app.APIError as e:
                self.send(("reply", call, None, error_fields(e)))

        try:
            self.server.score_later(ids).add_done_callback(reply)
        except app.APIError as e:  # too many prompts to score already
            self.send(("reply", call, None, error_fields(e)))


# ----------------------------------------------------------------------------- in a worker process

SUBMITTED_FIELDS = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_ids", "logprobs")


class RemoteServer:
    """In a worker: app.Backend, what serving/app.py's routes ask of the server, answered by the engine's process.
    The worker's engine.Requests are kept here, their tokens filled in as they arrive and their times
    (for the request log) from the engine's at the end."""

    MAX_CALLS = 1024  # calls waiting for their reply (a submit's, /health's, a score's); past that, 503

    def __init__(self, cfg, tok, name, context, created, to_engine, from_engine):
        self.cfg, self.tok, self.name, self.context, self.created = cfg, tok, name, context, created
        self.to_engine, self.from_engine = to_engine, from_engine
        self.state = "loading"
        self.requests = {}  # id -> engine.Request, until it finishes
        self.ids = {}  # engine.Request -> id
        self.calls = {}  # call -> the future its reply resolves
        self.counter = itertools.count()
        self.loop = None
        self.engine_gone = lambda: None  # called if the engine's process goes away

    @property
    def stopping(self) -> bool:
        return self.state == "stopping"

    def attach(self, loop) -> None:
        self.loop = loop
        loop.add_reader(self.from_engine.fileno(), self._receive)

    def ready(self) -> None:
        if self.state != "ready":
            raise app.unavailable(self.stopping)

    async def _call(self, kind: str, *args):
        if len(self.calls) >= self.MAX_CALLS:  # the engine's process is behind: their replies would pile up there
            raise app.APIError(
                503, f"this HTTP worker has {len(self.calls)} calls waiting for the engine already; try again later"
            )
        call = next(self.counter)
        self.calls[call] = future = self.loop.create_future()
        try:
            self.to_engine.send((kind, call, *args))
            result, error = await future
        except OSError:  # the engine's process is gone; this worker is stopping
            raise app.unavailable(stopping=True) from None
        finally:
            self.calls.pop(call, None)
        if error is not None:
            raise app.APIError(*error)
        return result

    async def submit(self, request: engine.Request) -> None:
        self.ready()
        rid = next(self.counter)
        self.requests[rid], self.ids[request] = request, rid  # its tokens may come before the reply
        request.submitted_at = time.perf_counter()
        try:
            request.id = await self._call("submit", rid, {k: getattr(request, k) for k in SUBMITTED_FIELDS})
        except app.APIError:
            self.requests.pop(rid, None)
            self.ids.pop(request, None)
            raise

    def cancel(self, request: engine.Request) -> None:
        if request.finish_reason is None and (rid := self.ids.get(request)) is not None:
            with contextlib.suppress(OSError):  # the engine's process is gone: nothing to cancel
                self.to_engine.send(("cancel", rid))

    async def health(self) -> tuple:
        if self.state != "ready":
            return app.health_reply(self.state)
        return await self._call("health")

    async def score_prompt(self, ids: list) -> list:
        return [engine.Token(*t) for t in await self._call("score", ids)]

    def _receive(self) -> None:
        """The engine's messages that have arrived (the event loop calls this when the pipe is readable)."""
        try:
            while self.from_engine.poll():
                self._handle(*self.from_engine.recv())
        except (EOFError, OSError):  # the engine's process is gone
            self.loop.remove_reader(self.from_engine.fileno())
            self.state = "stopping"
            for rid in list(self.requests):
                self._finish(rid, Finished("abort", None, time.perf_counter()))
            for future in self.calls.values():
                if not future.done():
                    future.set_result((None, error_fields(app.unavailable(stopping=True))))
            self.engine_gone()

    def _handle(self, kind: str, *args) -> None:
        if kind == "out":
            for rid, item in args[0]:
                request = self.requests.get(rid)
                if request is None:
                    continue
                if isinstance(item, Finished):
                    self._finish(rid, item)
                    continue
                token = engine.Token(item, None, None) if isinstance(item, int) else engine.Token(*item)
                request.tokens.append(token.id)
                request.on_token(token)
        elif kind == "reply":
            future = self.calls.get(args[0])  # None: its request's task was cancelled
            if future is not None and not future.done():
                future.set_result(args[1:])
        elif kind == "state":
            self.state = args[0]

    def _finish(self, rid: int, end: Finished) -> None:
        request = self.requests.pop(rid)
        self.ids.pop(request, None)
        request.finish_reason, request.first_token_at, request.finished_at = end
        request.on_finish(end.reason)


class WorkerUvicorn(http_server.StoppingUvicorn):
    """A worker's uvicorn on the shared socket: it reads the engine's pipe on its event loop."""

    def __init__(self, config, remote: RemoteServer):
        super().__init__(config, on_stop=lambda: setattr(remote, "state", "stopping"))
        self.remote = remote

    async def startup(self, sockets=None):
        self.remote.attach(asyncio.get_running_loop())
        await super().startup(sockets)


def worker_main(cfg, sock, to_engine, from_engine) -> None:
    try:
        _, name, tok, context, created = from_engine.recv()  # the engine's first message (EngineHost.connect)
    except EOFError:  # serve.py stopped before its model loaded: it said why
        return
    remote = RemoteServer(cfg, tok, name, context, created, to_engine, from_engine)
    uv = WorkerUvicorn(http_server.uvicorn_config(app.make_app(remote)), remote)
    remote.engine_gone = lambda: setattr(uv, "should_exit", True)
    uv.run(sockets=[sock])
