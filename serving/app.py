"""serve.py's HTTP app: OpenAI's completions and chat completions (whole, or as Server-Sent Events),
the model list, /health, vLLM's tokenizer routes and the chat page (web/), as module-level
handlers over the server object that serve.py puts in the Starlette app's state
(request.app.state.server): a Backend, serve.Server beside the engine in one process or
serving/workers.py's RemoteServer in an HTTP worker process.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad request,
404 for another model's name, 413 for a body over the limit (LimitBody, before it is read whole), 429
when the queue is full, 503 while starting or stopping.
"""

import asyncio
import collections
import dataclasses
import json
import os
import time
import uuid
from typing import Any, Protocol, runtime_checkable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from data import chat_template
from inference import engine, generate
from serving import auth

WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")  # the chat page


@runtime_checkable
class Backend(Protocol):
    """What the routes ask of the server: serve.Server answers beside the engine, workers.RemoteServer
    from an HTTP worker through the engine's process."""

    cfg: Any  # serve.ServeConfig (api_key, max_body_bytes)
    tok: Any  # data/tokenizer.py's
    name: str  # the model's, as clients send it
    context: int
    created: int

    @property
    def stopping(self) -> bool: ...

    def ready(self) -> Any:
        """Nothing if requests can be taken; else an APIError (503: compiling, stopping or failed)."""

    async def submit(self, request: engine.Request) -> None:
        """Hand the request to the engine: its tokens then come through its on_token; an APIError if refused."""

    def cancel(self, request: engine.Request) -> None:
        """Its client is gone: the engine ends it (finish_reason 'abort') after the decode program in flight."""

    async def health(self) -> tuple[int, dict]:
        """GET /health's status and body (health_reply)."""

    async def score_prompt(self, ids: list) -> list:
        """The prompt's engine.Tokens with their log-probabilities (echo with logprobs); an APIError if not."""


class APIError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {
            400: "invalid_request_error",
            404: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def refusal(e: engine.EngineError) -> APIError:
    """The engine's refusal of a request, as the client sees it."""
    if isinstance(e, engine.QueueFull):
        return APIError(429, str(e), code="queue_full")
    if isinstance(e, engine.ShuttingDown):
        return APIError(503, str(e))
    return APIError(400, str(e), "prompt")


def unavailable(stopping: bool) -> APIError:
    return APIError(
        503,
        "the server is shutting down"
        if stopping
        else "the model is still compiling: try again in a moment (GET /health says when)",
    )


def engine_failed(failure: str) -> APIError:
    return APIError(503, f"{failure}; serve.py is exiting", code="engine_failed")


def health_reply(state: str, failure: str | None = None, numbers: dict | None = None) -> tuple[int, dict]:
    """(status, body) of GET /health in each of the server's states: "ok" is 200, live and ready, with
    the engine's numbers; "loading" (compiling) and "stopping" are 503, live but not ready; "failed"
    is 503 and not live (the engine is gone and serve.py exits), the failure in OpenAI's error shape."""
    if state == "ok":
        return 200, {"status": state, "live": True, "ready": True, **numbers}
    error = engine_failed(failure) if state == "failed" else unavailable(stopping=state == "stopping")
    return 503, {"status": state, "live": state != "failed", "ready": False, **error.body()}


# ----------------------------------------------------------------------------- request bodies


@dataclasses.dataclass
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    n: int
    seed: int | None
    stop: list
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no log-probabilities; k: each token's, and its k most likely alternatives


COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
}
# Accepted at their neutral value only: a request that asks for more gets a 400 naming the key.
NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "best_of": 1,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
}
TOP = engine.TOP_LOGPROBS


def _get(body: dict, key: str, kinds, default, check=None, hint: str = ""):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise APIError(400, f"'{key}' must be {hint or ' or '.join(k.__name__ for k in kinds)}, got {value!r}", key)
    if check is not None and not check(value):
        raise APIError(400, f"'{key}' must be {hint}, got {value!r}", key)
    return value


def parse_logprobs(body: dict, chat_mode: bool) -> int | None:
    """Completions: logprobs = k alternatives (or null); chat: logprobs = true, with top_logprobs = k."""
    in_range = (lambda v: 0 <= v <= TOP), f"an integer in [0, {TOP}]"
    if chat_mode:
        if not _get(body, "logprobs", (bool,), False):
            if body.get("top_logprobs"):
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return _get(body, "top_logprobs", (int,), 0, *in_range)
    if body.get("logprobs") is None:
        return None
    return _get(body, "logprobs", (int,), 0, *in_range)


def parse_sampling(body: dict, known: set, default_max_tokens: int) -> Sampling:
    for key in body:
        if key not in known | COMMON | NEUTRAL.keys():
            raise APIError(400, f"unknown parameter '{key}'", key)
        if key in NEUTRAL and body[key] not in (NEUTRAL[key], None, [], {}):
            raise APIError(400, f"'{key}' is not supported by this server (only its default)", key)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    options = _get(body, "stream_options", (dict,), {})
    return Sampling(
        max_tokens=_get(body, "max_tokens", (int,), default_max_tokens, lambda v: v >= 1, "an integer >= 1"),
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_get(body, "top_k", (int,), 0, lambda v: v >= 0, "an integer >= 0 (0: no top-k)"),
        n=_get(body, "n", (int,), 1, lambda v: 1 <= v <= 16, "an integer in [1, 16]"),
        seed=_get(body, "seed", (int,), None) if body.get("seed") is not None else None,
        stop=stop,
        stream=_get(body, "stream", (bool,), False),
        include_usage=bool(options.get("include_usage", False)),
        logprobs=parse_logprobs(body, "messages" in known),
    )


# ----------------------------------------------------------------------------- text from tokens


class TextStream:
    """A request's new tokens as text: holds back an unfinished UTF-8 character and any tail that
    could be the start of a stop string; the text ends before the first stop string.

    New tokens cost the decoding of a few tokens, not of all so far: the new text is what a window
    of the last tokens decodes to past what its start decoded to (a tokenizer may decode a token
    differently at the start of a text, as SentencePiece drops a leading space); the window moves
    on once it decodes to whole characters. A decode program's tokens are added together: two
    decodes for all of them (the event loop's largest cost per token was decoding, one token at a
    time). offsets=True also keeps where each token's text starts (for log-probabilities; one more
    decode per token). Once stopped, `counted` is the number of ids up to and including those of the
    stop string (usage counts them; the ids after it were made before the engine heard of the stop)."""

    def __init__(self, tok, stop: list, offsets: bool = False):
        self.tok, self.stop, self.ids, self.sent, self.stopped = tok, stop, [], 0, False
        self.text, self.offsets, self.counted = "", offsets, 0
        self.last_decode = (0, 0, 0, "")  # the last _decode_new's window start, first new id, text position, text
        self.starts = []  # with offsets: where each decoded id's text starts in text (ids of an unfinished character wait)
        self.window_start = self.window_read = 0  # ids[window_start:window_read]: decoded into text already

    def add(self, ids: list) -> str:
        """The text that can be passed on now, with these new ids."""
        self.ids += ids
        self._decode_new(finished=False)
        return self._release_before_stop(finished=False)

    def finish(self) -> str:
        """The rest of the text (up to a stop string in it: the last tokens may complete one)."""
        self._decode_new(finished=True)
        return self._release_before_stop(finished=True)

    def _release_before_stop(self, finished: bool) -> str:
        # A stop string cannot start in the text already sent (what could start one was held back). The
        # text ends at the one completed first (then the earliest), however the tokens were grouped.
        found = [(start + len(s), start) for s in self.stop if (start := self.text.find(s, self.sent)) >= 0]
        if found:
            stop_end, stop_start = min(found)
            self.text, self.stopped, self.counted = self.text[:stop_start], True, self._ids_through(stop_end)
        if found or finished:
            return self._release(len(self.text))
        safe = len(self.text)
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        return self._release(safe)

    def _decode_new(self, finished: bool) -> None:
        """Append the text of the ids not decoded yet: up to the last whole character, unless finished."""
        if self.stopped:
            return
        before = self.tok.decode(self.ids[self.window_start : self.window_read])
        end = len(self.ids)
        after = self.tok.decode(self.ids[self.window_start : end])
        while (
            after.endswith("\ufffd") and not finished and end > self.window_read
        ):  # a character's bytes not all there yet
            end -= 1
            after = self.tok.decode(self.ids[self.window_start : end])
        if end == self.window_read:
            return
        at = len(self.text) - len(before)  # where the window's text starts in text
        if self.offsets:  # each new id where the text of the ids before it stops agreeing with the window's: an id
            #               that starts inside a character (its last bytes) gets where that character starts
            self.starts += [
                at + len(os.path.commonprefix([self.tok.decode(self.ids[self.window_start : k]), after]))
                if k > self.window_read
                else len(self.text)
                for k in range(self.window_read, end)
            ]
        self.last_decode = (self.window_start, self.window_read, at, after)
        self.text += after[len(before) :]
        self.window_start, self.window_read = self.window_read, end

    def _ids_through(self, end: int) -> int:
        """How many ids the text needs to reach position `end`, in the text the last decode added: the
        first count whose decode matches that decode's up to there (a token that ends inside a
        character does not complete it)."""
        window_start, first_new, at, text = self.last_decode
        need = end - at
        for k in range(first_new + 1, self.window_read + 1):
            if len(decoded := self.tok.decode(self.ids[window_start:k])) >= need and decoded[:need] == text[:need]:
                return k
        return self.window_read

    def _release(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def text_starts(tok, ids: list) -> list:
    """Where each id's text starts in tok.decode(ids), as TextStream finds it for a reply's tokens; a few
    ids at a time, so that each decode is of a few ids, not of all before them."""
    stream = TextStream(tok, [], offsets=True)
    for k in range(0, len(ids), 8):
        stream.add(ids[k : k + 8])
    stream.finish()
    return stream.starts


class Generation:
    """One engine request seen from the event loop. Its tokens arrive from the engine's thread in a
    deque, with one wake-up of the event loop for all that arrive before it runs (a decode program's
    tokens come together) rather than one per token."""

    def __init__(self, server, prompt: list, sampling: Sampling, index: int):
        loop, self.arrived, self.ready = asyncio.get_running_loop(), collections.deque(), asyncio.Event()
        self.wake_sent = False  # a wake-up is on its way to the event loop

        def put(item):  # in the engine's thread: an engine.Token, or ("finish", reason)
            self.arrived.append(item)
            if not self.wake_sent:
                self.wake_sent = True
                loop.call_soon_threadsafe(self.ready.set)

        seed = None if sampling.seed is None else sampling.seed + index  # n > 1: each its own
        self.server, self.text = server, TextStream(server.tok, sampling.stop, sampling.logprobs is not None)
        self.request = engine.Request(
            prompt,
            min(sampling.max_tokens, server.context - len(prompt)),
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            seed,
            tuple(server.tok.stop_tokens),
            logprobs=sampling.logprobs is not None,
            on_token=put,
            on_finish=lambda reason: put(("finish", reason)),
        )
        self.finish_reason = None

    async def start(self) -> None:
        """Submit the request to the engine; an APIError if it is refused."""
        await self.server.submit(self.request)

    async def pieces(self):
        """(new text, the engine.Tokens it came from, where each one's text starts in the request's
        text), piece by piece, until the request ends
        (finish_reason is then set). Tokens that arrived while the last piece was being sent go
        out as one piece: when the server falls behind the engine, it sends fewer, longer events.
        A token goes out with the text it starts in, so one held back (it may begin a stop string)
        waits with its text; the tokens of a stop string itself never go out."""
        tokens, piece = [], ""  # the tokens not passed on yet (the i-th of the request is the text's ids[i])
        while True:
            await self.ready.wait()
            self.ready.clear()
            self.wake_sent = False  # before taking what arrived: a token put after this sends a wake-up
            items = [self.arrived.popleft() for _ in range(len(self.arrived))]
            finish = items.pop() if items and not isinstance(items[-1], engine.Token) else None  # always the last
            if items and not self.text.stopped:  # past a stop string the engine is being told to stop
                if self.text.offsets:
                    tokens += items
                piece += self.text.add([token.id for token in items])
                if self.text.stopped:
                    self.server.cancel(self.request)
            if finish:
                piece += self.text.finish()
                self.finish_reason = "stop" if self.text.stopped else finish[1]
                starts = self._starts(len(tokens))
                if self.text.stopped:  # up to the stop string's last token (the text ends before the stop)
                    kept = self.text.counted - (len(self.text.ids) - len(tokens))
                    tokens, starts = tokens[:kept], starts[:kept]
                if piece or tokens:
                    yield piece, tokens, starts
                return
            if piece:
                starts = self._starts(len(tokens))
                passed_on = sum(start < self.text.sent for start in starts)
                yield piece, tokens[:passed_on], starts[:passed_on]
                tokens, piece = tokens[passed_on:], ""

    def _starts(self, pending: int) -> list:
        """Where the texts of the last `pending` ids start (of those decoded)."""
        return self.text.starts[len(self.text.ids) - pending :]

    def cancel(self):
        if self.finish_reason is None:
            self.server.cancel(self.request)

    @property
    def completion_tokens(self) -> int:
        """The tokens of the reply's text and of the stop string that ended it, if one did; not those the
        engine made after it (what usage counts, and the request log)."""
        return self.text.counted if self.text.stopped else len(self.request.tokens)


async def until_disconnected(receive) -> None:
    """Returns once the client has hung up: with the body read, the next message of the request's is that."""
    while (await receive())["type"] != "http.disconnect":
        pass


def log_requests(reply_id: str, generations: list) -> None:
    """A line per choice, by the reply's id (its client sees it), with the tokens usage counts."""
    for i, g in enumerate(generations):
        r, completion = g.request, g.completion_tokens
        ttft = (r.first_token_at - r.submitted_at) * 1e3 if r.first_token_at else float("nan")
        decode_s = (r.finished_at or time.perf_counter()) - (r.first_token_at or r.submitted_at)
        # The decode rate counts the tokens after the first (that one is prefill's): none for one token.
        rate = f", {(completion - 1) / decode_s:,.1f} tok/s" if completion > 1 and decode_s > 0 else ""
        choice = f" choice {i}" if len(generations) > 1 else ""
        # One write with its newline: HTTP worker processes share the log, and unbuffered (PYTHONUNBUFFERED)
        # print() writes the line and its end apart, so that lines from two workers ran together.
        print(
            f"request {reply_id}{choice}: {len(r.prompt)} prompt + {completion} completion tokens, "
            f"ttft {ttft:.0f} ms{rate}, {g.finish_reason}\n",
            end="",
            flush=True,
        )


# ----------------------------------------------------------------------------- the routes


def server_of(request: Request) -> Backend:
    """The server make_app put in the app's state."""
    return request.app.state.server


async def health(request: Request):
    status, body = await server_of(request).health()
    return JSONResponse(body, status_code=status)


async def models(request: Request):
    server = server_of(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": server.name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "nanomax",
                    "max_model_len": server.context,
                    "has_chat_template": server.tok.chat_template is not None,
                }
            ],
        }
    )


async def completions(request: Request):
    return await complete(request, chat_mode=False)


async def chat_completions(request: Request):
    return await complete(request, chat_mode=True)


async def complete(request: Request, chat_mode: bool):
    """Both completion routes: the body checked, its prompts submitted to the engine, the reply
    whole or streamed."""
    server, generations = server_of(request), []
    try:
        server.ready()
        body = await json_body(request)
        check_model(server, body)
        if chat_mode:
            sampling = parse_sampling(body, {"messages", "logprobs", "top_logprobs"}, default_max_tokens=server.context)
            prompts = [chat_prompt(server, body)]
        else:
            sampling = parse_sampling(body, {"prompt", "echo", "logprobs"}, default_max_tokens=16)
            prompts = completion_prompts(server, body)
        echo = _get(body, "echo", (bool,), False)
        for i, ids in enumerate(prompts):
            if not 0 < len(ids) < server.context:
                raise APIError(
                    400,
                    f"prompt {i} is {len(ids)} tokens; this model's context is "
                    f"{server.context} tokens, with at least one left to generate",
                    "prompt",
                    "context_length_exceeded" if ids else None,
                )
        for ids in prompts:
            for k in range(sampling.n):
                generations.append(Generation(server, ids, sampling, k))
                await generations[-1].start()
        scored = echo and not chat_mode and sampling.logprobs is not None
        prompt_tokens = [await server.score_prompt(ids) if scored else [] for ids in prompts]
    except APIError as e:
        for g in generations:  # a full queue part of the way: none of them runs
            g.cancel()
        return error_response(e)
    reply = Reply(server, chat_mode, generations, prompts, sampling, echo, prompt_tokens)
    if sampling.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream")
    return await reply.whole(request.receive)


# vLLM's tokenizer routes, which lm-evaluation-harness's local-completions uses to tokenize on the
# server (tokenizer_backend=remote): the same ids as serve.py's own, no tokenizer files needed.
async def tokenizer_info(request: Request):
    server = server_of(request)
    tok = server.tok
    text = lambda token: None if token is None else tok.decode([token])
    return JSONResponse(
        {
            "tokenizer_class": type(tok).__name__,
            "eos_token": text(tok.eot_token),
            "bos_token": text(tok.bos_token),
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": server.context,
        }
    )


async def tokenize(request: Request):
    server = server_of(request)
    try:
        body = await json_body(request)
        prompt = _get(body, "prompt", (str,), None, hint="a string")
        with_bos = _get(body, "add_special_tokens", (bool,), True)
        tokens = encode(server, prompt, with_bos) if prompt or with_bos else []
    except APIError as e:
        return error_response(e)
    return JSONResponse({"count": len(tokens), "max_model_len": server.context, "tokens": tokens})


async def detokenize(request: Request):
    server = server_of(request)
    try:
        tokens = _get(await json_body(request), "tokens", (list,), None, hint="a list of token ids")
        if not all(isinstance(t, int) and 0 <= t < server.tok.vocab_size for t in tokens):
            raise APIError(400, f"token ids must be in [0, {server.tok.vocab_size})", "tokens")
    except APIError as e:
        return error_response(e)
    return JSONResponse({"prompt": server.tok.decode(tokens)})


# ----------------------------------------------------------------------------- prompts


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def check_model(server, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != server.name:
        raise APIError(
            404, f"the model '{model}' does not exist; this server has '{server.name}'", "model", "model_not_found"
        )


def completion_prompts(server, body: dict) -> list:
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise APIError(400, "'prompt' must be a string, a list of strings, or token ids", "prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "the prompt is empty", "prompt")
            out.append(encode(server, p, with_bos=True))
        else:
            if not all(0 <= t < server.tok.vocab_size for t in p):
                raise APIError(400, f"token ids must be in [0, {server.tok.vocab_size})", "prompt")
            out.append(list(p))
    return out


def chat_prompt(server, body: dict) -> list:
    try:
        text = chat_template.render(server.tok, body.get("messages"))
    except chat_template.ChatError as e:
        raise APIError(400, str(e), "messages") from None
    return encode(server, text, with_bos=False)  # a template that wants BOS writes it itself


def encode(server, text: str, with_bos: bool) -> list:
    try:
        return generate.encode_prompt(server.tok, text) if with_bos else server.tok.encode(text)
    except (ValueError, KeyError) as e:
        raise APIError(400, f"the prompt can't be encoded with this model's vocabulary ({e})", "prompt") from None


class BodyTooLarge(Exception):
    """Raised from LimitBody's receive, through the app, back to LimitBody."""


class LimitBody:
    """ASGI middleware: a request whose body is over max_bytes gets a 413 in OpenAI's shape without
    being read whole: at once when its Content-Length says so, else (a chunked body) as soon as the
    bytes read pass the limit. Outside every route, so the chat page's files too."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.refuse(scope, receive, send)
        received, responded = 0, False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def watching_send(message):
            nonlocal responded
            responded = responded or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge:
            if responded:  # cannot happen with these routes (each reads its body before answering)
                raise
            await self.refuse(scope, receive, send)

    async def refuse(self, scope, receive, send):
        too_large = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes:,} "
            f"bytes (serve.py --max_body_bytes)",
            code="request_too_large",
        )
        await error_response(too_large)(scope, receive, send)


def make_app(server: Backend) -> Starlette:
    """The app over `server`, kept in app.state for the handlers. Bodies over
    --max_body_bytes get a 413 (LimitBody); with an API key, /v1 and the tokenizer's routes need it
    (auth.RequireKey); GET / is web/index.html."""
    limit = [Middleware(LimitBody, max_bytes=server.cfg.max_body_bytes)]
    keyed = [Middleware(auth.RequireKey, key=server.cfg.api_key)] if server.cfg.api_key else []
    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Mount("/", StaticFiles(directory=WEB_DIR, html=True)),
        ],
        middleware=limit + keyed,
    )
    app.state.server = server
    return app


# ----------------------------------------------------------------------------- replies


class Reply:
    """A completion's answer, whole or as Server-Sent Events, in OpenAI's shapes."""

    def __init__(self, server, chat_mode, generations, prompts, sampling, echo, prompt_tokens):
        self.server, self.chat, self.generations, self.prompts = server, chat_mode, generations, prompts
        self.prompt_tokens = prompt_tokens  # per prompt: its engine.Tokens when echoed with logprobs
        self.sampling, self.echo = sampling, echo and not chat_mode
        self.id = ("chatcmpl-" if chat_mode else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat_mode else "text_completion"
        self.created = int(time.time())

    def usage(self) -> dict:
        prompt = sum(len(self.prompts[i // self.sampling.n]) for i in range(len(self.generations)))
        completion = sum(g.completion_tokens for g in self.generations)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def prefix(self, i: int) -> str:
        return self.server.tok.decode(self.prompts[i // self.sampling.n]) if self.echo else ""

    def echoed(self, i: int) -> list:
        """The prompt's engine.Tokens that choice i's logprobs start with (echo and logprobs)."""
        return self.prompt_tokens[i // self.sampling.n] if self.echo else []

    def echoed_offsets(self, i: int) -> list:
        """Where each echoed prompt token's text starts in the choice's text (it begins with the prompt)."""
        return text_starts(self.server.tok, self.prompts[i // self.sampling.n]) if self.echoed(i) else []

    def choice(self, i: int, text: str, finish_reason, tokens=(), offsets=(), first=False, streaming=False) -> dict:
        logprobs = self.logprobs(tokens, offsets)
        if not self.chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not streaming:
            return {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, tokens, offsets) -> dict | None:
        """OpenAI's logprobs of these tokens: chat's list of {token, logprob, bytes, top_logprobs},
        or completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset: `offsets`,
        where each token's text starts in the choice's text)."""
        k = self.sampling.logprobs
        if k is None:
            return None
        text = lambda i: self.server.tok.decode([i])
        if self.chat:
            entry = lambda i, lp: {"token": text(i), "logprob": lp, "bytes": list(text(i).encode())}
            return {
                "content": [
                    {**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top[:k]]} for t in tokens
                ]
            }
        return {
            "tokens": [text(t.id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.top is None else {text(i): lp for i, lp in t.top[:k]} for t in tokens],
            "text_offset": list(offsets),
        }

    async def whole(self, receive):
        """The reply once every choice has ended; nothing if the client hangs up first (`receive`, the
        request's, says so): its generations are cancelled then, as a stream's are."""
        texts, tokens = [""] * len(self.generations), [[] for _ in self.generations]
        offsets = [self.echoed_offsets(i) for i in range(len(self.generations))]

        async def collect(i, g):
            async for piece, piece_tokens, starts in g.pieces():
                texts[i] += piece
                tokens[i] += piece_tokens
                offsets[i] += [len(self.prefix(i)) + start for start in starts]

        collecting = asyncio.gather(*(collect(i, g) for i, g in enumerate(self.generations)))
        hung_up = asyncio.ensure_future(until_disconnected(receive))
        try:
            await asyncio.wait((collecting, hung_up), return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                collecting.cancel()
                return Response(status_code=499)  # nobody reads it ("client closed request", as nginx logs it)
            collecting.result()  # its error, if any
        finally:
            hung_up.cancel()
            for g in self.generations:
                g.cancel()
        log_requests(self.id, self.generations)
        choices = [
            self.choice(i, self.prefix(i) + t, g.finish_reason, self.echoed(i) + tokens[i], offsets[i])
            for i, (g, t) in enumerate(zip(self.generations, texts))
        ]
        return JSONResponse(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.server.name,
                "choices": choices,
                "usage": self.usage(),
            }
        )

    async def events(self):
        """SSE: a chunk per piece of text of any choice, a last chunk per choice with its
        finish_reason, usage if asked, then [DONE]. An error after the start is a data event."""
        chunk = lambda **fields: (
            "data: "
            + json.dumps(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.server.name,
                    **fields,
                }
            )
            + "\n\n"
        )
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, g):
            try:
                first = True
                if self.echo:
                    await queue.put((i, self.prefix(i), None, self.echoed(i), self.echoed_offsets(i), False))
                async for piece, tokens, starts in g.pieces():
                    offsets = [len(self.prefix(i)) + start for start in starts]
                    await queue.put((i, piece, None, tokens, offsets, first))
                    first = False
                await queue.put((i, "", g.finish_reason, [], [], first))
            except Exception as e:  # noqa: BLE001 - reaches the client as an error event
                await queue.put((i, None, str(e), [], [], False))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            open_choices = len(self.generations)
            while open_choices:
                i, text, finish, tokens, offsets, first = await queue.get()
                if text is None:
                    yield "data: " + json.dumps(APIError(500, f"generation failed: {finish}").body()) + "\n\n"
                    open_choices -= 1
                    continue
                yield chunk(choices=[self.choice(i, text, finish, tokens, offsets, first, streaming=True)])
                open_choices -= finish is not None
            if self.sampling.include_usage:
                yield chunk(choices=[], usage=self.usage())
            yield "data: [DONE]\n\n"
            log_requests(self.id, self.generations)
        finally:  # also when the client went away: the engine frees the slots after its decode program in flight
            for g in self.generations:
                g.cancel()
            for t in tasks:
                t.cancel()
