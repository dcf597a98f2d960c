"""An OpenAI-compatible HTTP server over engine.py (Starlette on uvicorn).

    python serve.py --out_dir=out-shakespeare-char              # a trained checkpoint
    python serve.py --init_from=gpt2 --slots=16 --port=8000     # a Hugging Face model
    curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0}'

GET / is the chat page (web/: HTML, CSS and JavaScript, no build step). With --api_key=KEY (or the
environment variable NANOMAX_API_KEY), every /v1 and tokenizer request needs `Authorization:
Bearer KEY` (401 otherwise); / and /health need none.

Routes: POST /v1/completions and POST /v1/chat/completions (with "stream": true, Server-Sent
Events ending in `data: [DONE]`; completions' echo with logprobs scores the prompt's tokens too),
GET /v1/models, GET /health (503 until the engine's programs are compiled, then 200 with the
engine's numbers), and vLLM's GET /tokenizer_info, POST /tokenize and POST /detokenize, so that
lm-evaluation-harness's local-completions model runs against the server with nothing else. Errors have OpenAI's shape, {"error": {"message",
"type", "param", "code"}}: 400 for a bad request, 404 for another model's name, 429 when the queue
is full, 503 while starting or stopping. The model loads before the server listens (a bad
out_dir is one line, no server); the programs compile in a thread while /health already answers;
device work runs in the engine's thread, never on the event loop. SIGTERM (or Ctrl-C) stops
taking requests, ends those in flight with their text so far (finish_reason "abort"), and exits 0.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import uuid

import jax
import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

import configurator
import sharding
from data import chat_template
from devices import memory
from evals import scoring
from inference import engine, generate, loader
from layers.quantization import MODES as QUANTIZATION_MODES
from serving import auth

WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving", "web")  # the chat page


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    init_from: str = "resume"  # 'resume' (the newest intact checkpoint in out_dir), or a Hugging Face
    #                            model: a directory or a hub name ('gpt2', 'HuggingFaceTB/SmolLM2-135M')
    out_dir: str = "out"
    host: str = "127.0.0.1"  # '0.0.0.0' serves other machines too
    port: int = 8000
    slots: int = 8  # requests decoding at once: rows of one KV cache
    max_queue: int = 64  # requests waiting for a slot; past that, 429
    model_name: str = ""  # the id clients send as "model"; '' = out_dir's or init_from's last part
    dtype: str = "auto"  # a Hugging Face model's compute dtype: 'auto' = bfloat16 on GPUs and TPUs,
    #                      float32 on CPUs; a checkpoint keeps the one it trained in
    quantization: str = "auto"  # the blocks' matmuls: 'auto' (a checkpoint's own; 'none' for a Hugging Face
    #                             model) | 'none' | 'int8' | 'fp8'
    weight_dtype: str = "auto"  # the weights in memory: 'auto' (the compute dtype) | 'int8' (the blocks'
    #                             matrices as int8, a float32 scale per output channel; weight-only)
    kv_cache_dtype: str = "auto"  # the KV cache: 'auto' (the compute dtype) | 'bfloat16' | 'float32' | 'int8'
    #                               (a float32 scale per token and key/value head: about half of bfloat16's bytes)
    log_interval: float = 10.0  # seconds between summary lines while busy (0 = none)
    mesh_data: int = 1  # devices splitting the slots (each holds slots / mesh_data rows of the KV cache)
    mesh_tensor: int = 1  # devices splitting the heads, the MLP and the KV cache's key/value heads
    api_key: str = ""  # if set, /v1 requests need 'Authorization: Bearer <api_key>'; '' = NANOMAX_API_KEY's, or none
    memory_check: bool = True  # False: skip the check of the compiled programs against the devices' memory
    memory_limit_gib: float = 0.0  # check against this many GiB per device; 0 = the device's own limit

    def __post_init__(self):
        for key in ("slots", "max_queue", "mesh_data", "mesh_tensor"):
            if getattr(self, key) < 1:
                raise configurator.ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0 < self.port < 65536:
            raise configurator.ConfigError(f"port must be in 1..65535, got {self.port}")
        configurator.check_choice("quantization", self.quantization, ("auto", *QUANTIZATION_MODES))
        configurator.check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))
        configurator.check_choice("weight_dtype", self.weight_dtype, loader.WEIGHT_DTYPES)
        configurator.check_choice("kv_cache_dtype", self.kv_cache_dtype, loader.KV_CACHE_DTYPES)
        if self.slots % self.mesh_data:
            raise configurator.ConfigError(f"slots={self.slots} is not divisible by mesh_data={self.mesh_data}: "
                                           f"the slots are split over it; use a multiple of {self.mesh_data}")


class APIError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
          "stream_options", "user"}
# Accepted at their neutral value only: a request that asks for more gets a 400 naming the key.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "best_of": 1, "suffix": None,
           "tools": None, "tool_choice": None, "response_format": None}
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
        stop=stop, stream=_get(body, "stream", (bool,), False),
        include_usage=bool(options.get("include_usage", False)), logprobs=parse_logprobs(body, "messages" in known))


# ----------------------------------------------------------------------------- text from tokens

class TextStream:
    """A request's new tokens as text: holds back an unfinished UTF-8 character and any tail that
    could be the start of a stop string; the text ends before the first stop string."""

    def __init__(self, tok, stop: list):
        self.tok, self.stop, self.ids, self.sent, self.stopped = tok, stop, [], 0, False
        self.text = ""

    def add(self, token: int) -> str:
        """The text that can be passed on now."""
        self.ids.append(token)
        self.text = self.tok.decode(self.ids)
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            return self._release(len(self.text))
        safe = len(self.text.rstrip("\ufffd"))  # a character whose bytes are not all there yet
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._release(safe)

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class Generation:
    """One engine request seen from the event loop: its tokens arrive on an asyncio queue."""

    def __init__(self, server: "Server", prompt: list, sampling: Sampling, index: int):
        loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item)
        seed = None if sampling.seed is None else sampling.seed + index  # n > 1: each its own
        self.server, self.text = server, TextStream(server.tok, sampling.stop)
        self.request = engine.Request(prompt, min(sampling.max_tokens, server.context - len(prompt)),
                                      sampling.temperature, sampling.top_k, sampling.top_p, seed,
                                      tuple(server.tok.stop_tokens), on_token=put,
                                      on_finish=lambda reason: put(("finish", reason)))
        self.finish_reason = None
        try:
            server.engine.submit(self.request)
        except engine.QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        except engine.ShuttingDown as e:
            raise APIError(503, str(e)) from None
        except engine.EngineError as e:
            raise APIError(400, str(e), "prompt") from None

    async def pieces(self):
        """(new text, the engine.Tokens it came from), piece by piece, until the request ends
        (finish_reason is then set)."""
        tokens = []
        while True:
            item = await self.queue.get()
            if isinstance(item, tuple):
                self.finish_reason = "stop" if self.text.stopped else item[1]
                rest = self.text.finish()
                if rest or tokens:
                    yield rest, tokens
                return
            if self.text.stopped:
                continue  # past a stop string: the engine is being told to stop
            tokens.append(item)
            piece = self.text.add(item.id)
            if self.text.stopped:
                self.server.engine.cancel(self.request)
            if piece:
                yield piece, tokens
                tokens = []

    def cancel(self):
        if self.finish_reason is None:
            self.server.engine.cancel(self.request)

    @property
    def completion_tokens(self) -> int:
        return len(self.request.tokens)


# ----------------------------------------------------------------------------- the server

class Server:
    """The model, its tokenizer and the engine (None until compiled), and the request log."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        mesh = loader.decode_mesh(cfg.mesh_data, cfg.mesh_tensor)
        if cfg.init_from == "resume":
            setup, params, step, self.tok = loader.load_checkpoint(cfg.out_dir, mesh, cfg.quantization,
                                                                      cfg.kv_cache_dtype)
            source = f"step {step} of {cfg.out_dir}"
        else:
            setup, params, self.tok = loader.load_hf(cfg.init_from, mesh, cfg.quantization,
                                                        loader.default_dtype(cfg.dtype), cfg.kv_cache_dtype)
            source = cfg.init_from
        self.setup, self.params = setup, loader.serving_weights(setup, params, cfg.weight_dtype)
        self.context = setup.model_config.block_size
        self.name = cfg.model_name or os.path.basename(os.path.normpath(
            cfg.out_dir if cfg.init_from == "resume" else cfg.init_from))
        self.created = int(time.time())
        self.engine: engine.Engine | None = None
        self.memory: dict | None = None  # the start-up memory check's numbers (memory.check)
        self.failure: str | None = None  # why the engine could not start
        self.token_scorer = None  # echo with logprobs: made on first use
        self.stopping = False
        print(f"loaded {source} as '{self.name}' ({self.tok.summary()}, {setup.model_config.dtype}, "
              f"context {self.context}); {loader.memory_summary(setup, self.params)}", flush=True)

    def start_engine(self, on_failure=None) -> None:
        """Compile the engine's programs (in a thread: /health answers 503 meanwhile) and check that they
        fit the devices; if they cannot, keep the reason in self.failure and call on_failure."""
        e = engine.Engine(self.setup, self.params, self.cfg.slots, self.cfg.max_queue, vocab=self.tok.vocab_size)
        if self.cfg.memory_check:
            try:
                self.memory = self.check_memory(e)
            except configurator.ConfigError as error:
                e.shutdown()
                self.failure = str(error)
                if on_failure is not None:
                    on_failure()
                return
        self.engine = e
        print(f"ready: {e.slots} slots x {self.context} tokens, KV cache {e.kv_bytes / 2**20:,.1f} MiB "
              f"({e.kv_bytes_per_token:,} bytes per token), weights {e.weight_bytes / 2**20:,.1f} MiB; "
              f"{len(e.buckets)} prompt buckets ({', '.join(map(str, e.buckets))}) compiled in {e.compile_s:.1f} s",
              flush=True)

    def check_memory(self, e: engine.Engine) -> dict:
        """memory.check of the engine's programs: a decode step holds the weights and every slot's
        cache (its arguments); a prompt's prefill runs beside that cache, which it does not take."""
        devices = list(e.mesh.devices.flat)
        platform = devices[0].platform
        cache_bytes = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(e.state))
        need = max(memory.needed([e.step_program, *e.insert_programs.values()], platform),
                   memory.needed(e.prefill_programs.values(), platform) + cache_bytes)
        return memory.check("serving", need, devices, self.cfg.memory_limit_gib,
                            memory.serving_remedies(self.cfg, len(jax.devices())))

    def ready(self) -> engine.Engine:
        if self.stopping:
            raise APIError(503, "the server is shutting down")
        if self.engine is None:
            raise APIError(503, "the model is still compiling: try again in a moment (GET /health says when)")
        return self.engine

    def prompt_logprobs(self, ids: list) -> list:
        """The prompt as engine.Tokens, as echo with logprobs reports them (lm-evaluation-harness's
        local-completions scores continuations this way): the first token has no log-probability,
        each later one its own and the TOP most likely. The prompt is padded to its engine bucket,
        so there is one program per bucket, compiled on first use. Called off the event loop."""
        e = self.ready()
        if self.token_scorer is None:
            self.token_scorer = scoring.make_token_scorer(self.setup, TOP)
        length = next(b for b in e.buckets if b >= len(ids))
        tokens_1xL = np.zeros((1, length), np.int32)
        tokens_1xL[0, :len(ids)] = ids
        with sharding.activate(e.mesh):
            picked, (top_logprobs, top_ids) = self.token_scorer(e.params, tokens_1xL)
        picked, top_logprobs, top_ids = (np.asarray(a)[0].tolist() for a in (picked, top_logprobs, top_ids))
        return [engine.Token(ids[0], None, None)] + [
            engine.Token(token, picked[t], tuple(zip(top_ids[t], top_logprobs[t]))) for t, token in enumerate(ids[1:])]

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.name:
            raise APIError(404, f"the model '{model}' does not exist; this server has '{self.name}'", "model",
                           "model_not_found")

    def log_request(self, generations: list) -> None:
        for g in generations:
            r = g.request
            ttft = (r.first_token_at - r.submitted_at) * 1e3 if r.first_token_at else float("nan")
            decode_s = (r.finished_at or time.perf_counter()) - (r.first_token_at or r.submitted_at)
            # The decode rate counts the tokens after the first (that one is prefill's): none for one token.
            rate = (f", {(len(r.tokens) - 1) / decode_s:,.1f} tok/s" if len(r.tokens) > 1 and decode_s > 0
                    else "")
            print(f"request {r.id}: {len(r.prompt)} prompt + {len(r.tokens)} completion tokens, "
                  f"ttft {ttft:.0f} ms{rate}, {g.finish_reason}", flush=True)


def make_app(server: Server) -> Starlette:

    async def health(request: HTTPRequest):
        if server.engine is None or server.stopping:
            return JSONResponse({"status": "stopping" if server.stopping else "loading"}, status_code=503)
        e = server.engine
        return JSONResponse({"status": "ok", "model": server.name, "context": server.context,
                             "weight_bytes": e.weight_bytes, "kv_bytes_per_token": e.kv_bytes_per_token,
                             "memory_bandwidth": e.memory_bandwidth, "memory": server.memory, **e.stats()})

    async def models(request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": server.name, "object": "model", "created": server.created, "owned_by": "nanomax",
             "max_model_len": server.context, "has_chat_template": server.tok.chat_template is not None}]})

    async def completions(request: HTTPRequest):
        return await handle(request, chat_mode=False)

    async def chat_completions(request: HTTPRequest):
        return await handle(request, chat_mode=True)

    async def handle(request: HTTPRequest, chat_mode: bool):
        generations = []
        try:
            server.ready()
            body = await json_body(request)
            server.check_model(body)
            if chat_mode:
                sampling = parse_sampling(body, {"messages", "logprobs", "top_logprobs"},
                                          default_max_tokens=server.context)
                prompts = [chat_prompt(body)]
            else:
                sampling = parse_sampling(body, {"prompt", "echo", "logprobs"}, default_max_tokens=16)
                prompts = completion_prompts(body)
            echo = _get(body, "echo", (bool,), False)
            for i, ids in enumerate(prompts):
                if not 0 < len(ids) < server.context:
                    raise APIError(400, f"prompt {i} is {len(ids)} tokens; this model's context is "
                                        f"{server.context} tokens, with at least one left to generate", "prompt",
                                   "context_length_exceeded" if ids else None)
            for ids in prompts:
                for k in range(sampling.n):
                    generations.append(Generation(server, ids, sampling, k))
            scored = echo and not chat_mode and sampling.logprobs is not None
            prompt_tokens = [await asyncio.to_thread(server.prompt_logprobs, ids) if scored else []
                             for ids in prompts]
        except APIError as e:
            for g in generations:  # a full queue part of the way: none of them runs
                g.cancel()
            return error_response(e)
        reply = Reply(server, chat_mode, generations, prompts, sampling, echo, prompt_tokens)
        if sampling.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        return await reply.whole()

    # vLLM's tokenizer routes, which lm-evaluation-harness's local-completions uses to tokenize on the
    # server (tokenizer_backend=remote): the same ids as serve.py's own, no tokenizer files needed.
    async def tokenizer_info(request: HTTPRequest):
        tok = server.tok
        text = lambda token: None if token is None else tok.decode([token])
        return JSONResponse({"tokenizer_class": type(tok).__name__, "eos_token": text(tok.eot_token),
                             "bos_token": text(tok.bos_token), "pad_token": None,
                             "chat_template": tok.chat_template, "model_max_length": server.context})

    async def tokenize(request: HTTPRequest):
        try:
            body = await json_body(request)
            prompt = _get(body, "prompt", (str,), None, hint="a string")
            with_bos = _get(body, "add_special_tokens", (bool,), True)
            tokens = encode(prompt, with_bos) if prompt or with_bos else []
        except APIError as e:
            return error_response(e)
        return JSONResponse({"count": len(tokens), "max_model_len": server.context, "tokens": tokens})

    async def detokenize(request: HTTPRequest):
        try:
            tokens = _get(await json_body(request), "tokens", (list,), None, hint="a list of token ids")
            if not all(isinstance(t, int) and 0 <= t < server.tok.vocab_size for t in tokens):
                raise APIError(400, f"token ids must be in [0, {server.tok.vocab_size})", "tokens")
        except APIError as e:
            return error_response(e)
        return JSONResponse({"prompt": server.tok.decode(tokens)})

    async def json_body(request: HTTPRequest) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    def completion_prompts(body: dict) -> list:
        prompt = body.get("prompt")
        is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in p)
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
                out.append(encode(p, with_bos=True))
            else:
                if not all(0 <= t < server.tok.vocab_size for t in p):
                    raise APIError(400, f"token ids must be in [0, {server.tok.vocab_size})", "prompt")
                out.append(list(p))
        return out

    def chat_prompt(body: dict) -> list:
        try:
            text = chat_template.render(server.tok, body.get("messages"))
        except chat_template.ChatError as e:
            raise APIError(400, str(e), "messages") from None
        return encode(text, with_bos=False)  # a template that wants BOS writes it itself

    def encode(text: str, with_bos: bool) -> list:
        try:
            return generate.encode_prompt(server.tok, text) if with_bos else server.tok.encode(text)
        except (ValueError, KeyError) as e:
            raise APIError(400, f"the prompt can't be encoded with this model's vocabulary ({e})", "prompt") from None

    keyed = [Middleware(auth.RequireKey, key=server.cfg.api_key)] if server.cfg.api_key else []
    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info), Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Mount("/", StaticFiles(directory=WEB_DIR, html=True))], middleware=keyed)  # GET / is web/index.html


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

    def choice(self, i: int, text: str, finish_reason, tokens=(), offset=0, first=False, streaming=False) -> dict:
        logprobs = self.logprobs(tokens, offset)
        if not self.chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not streaming:
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, tokens, offset: int) -> dict | None:
        """OpenAI's logprobs of these tokens: chat's list of {token, logprob, bytes, top_logprobs},
        or completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
        k = self.sampling.logprobs
        if k is None:
            return None
        text = lambda i: self.server.tok.decode([i])
        if self.chat:
            entry = lambda i, lp: {"token": text(i), "logprob": lp, "bytes": list(text(i).encode())}
            return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top[:k]]}
                                for t in tokens]}
        offsets = [offset + sum(len(text(t.id)) for t in tokens[:j]) for j in range(len(tokens))]
        return {"tokens": [text(t.id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.top is None else {text(i): lp for i, lp in t.top[:k]} for t in tokens],
                "text_offset": offsets}

    async def whole(self):
        texts, tokens = [""] * len(self.generations), [[] for _ in self.generations]

        async def collect(i, g):
            async for piece, piece_tokens in g.pieces():
                texts[i] += piece
                tokens[i] += piece_tokens

        try:
            await asyncio.gather(*(collect(i, g) for i, g in enumerate(self.generations)))
        finally:
            for g in self.generations:
                g.cancel()
        self.server.log_request(self.generations)
        choices = [self.choice(i, self.prefix(i) + t, g.finish_reason, self.echoed(i) + tokens[i],
                               0 if self.echoed(i) else len(self.prefix(i)))
                   for i, (g, t) in enumerate(zip(self.generations, texts))]
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created,
                             "model": self.server.name, "choices": choices, "usage": self.usage()})

    async def events(self):
        """SSE: a chunk per piece of text of any choice, a last chunk per choice with its
        finish_reason, usage if asked, then [DONE]. An error after the start is a data event."""
        chunk = lambda **fields: "data: " + json.dumps({
            "id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.server.name, **fields}) + "\n\n"
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, g):
            try:
                first, offset = True, len(self.prefix(i))
                if self.echo:
                    await queue.put((i, self.prefix(i), None, self.echoed(i), 0, False))
                async for piece, tokens in g.pieces():
                    await queue.put((i, piece, None, tokens, offset, first))
                    first, offset = False, offset + len(piece)
                await queue.put((i, "", g.finish_reason, [], offset, first))
            except Exception as e:  # noqa: BLE001 - reaches the client as an error event
                await queue.put((i, None, str(e), [], 0, False))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            open_choices = len(self.generations)
            while open_choices:
                i, text, finish, tokens, offset, first = await queue.get()
                if text is None:
                    yield "data: " + json.dumps(APIError(500, f"generation failed: {finish}").body()) + "\n\n"
                    open_choices -= 1
                    continue
                yield chunk(choices=[self.choice(i, text, finish, tokens, offset, first, streaming=True)])
                open_choices -= finish is not None
            if self.sampling.include_usage:
                yield chunk(choices=[], usage=self.usage())
            yield "data: [DONE]\n\n"
            self.server.log_request(self.generations)
        finally:  # also when the client went away: the engine frees the slots at its next step
            for g in self.generations:
                g.cancel()
            for t in tasks:
                t.cancel()


# ----------------------------------------------------------------------------- running it

class UvicornServer(uvicorn.Server):
    """uvicorn, but SIGTERM / Ctrl-C first tells the engine to end its requests, so that open
    streams finish (with their text so far) and uvicorn's graceful shutdown can complete."""

    def __init__(self, config, server: Server):
        super().__init__(config)
        self.nanomax = server

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGTERM and Ctrl-C stop the server, which then exits 0 (uvicorn's own would raise the
        signal again once stopped, so that the process ends killed by it)."""
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def handle_exit(self, sig, frame):
        self.nanomax.stopping = True
        if self.nanomax.engine is not None:
            self.nanomax.engine.stop()
        super().handle_exit(sig, frame)


def summaries(server: Server, stop: threading.Event) -> None:
    """A line every log_interval seconds while requests come: slots busy, queue, tokens/s."""
    last_tokens, last_time = 0, time.perf_counter()
    while not stop.wait(server.cfg.log_interval):
        if server.engine is None:
            continue
        s, now = server.engine.stats(), time.perf_counter()
        if s["tokens"] != last_tokens or s["busy"] or s["queued"]:
            print(f"engine: {s['busy']}/{s['slots']} slots busy, {s['queued']} queued, "
                  f"{(s['tokens'] - last_tokens) / (now - last_time):,.1f} tok/s", flush=True)
        last_tokens, last_time = s["tokens"], now


def main(argv) -> None:
    cfg = configurator.load_config_or_exit(argv, ServeConfig)
    cfg = dataclasses.replace(cfg, api_key=cfg.api_key or os.environ.get("NANOMAX_API_KEY", ""))
    if warning := auth.exposure_warning(cfg.host, cfg.port, cfg.api_key):
        print(warning, flush=True)
    try:
        server = Server(cfg)
    except (OSError, ValueError) as e:  # CheckpointError, HFError, MeshError, ConfigError
        sys.exit(f"error: {e}")
    app = make_app(server)
    uv = UvicornServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                      timeout_graceful_shutdown=30), server)
    def stop_serving():
        uv.should_exit = True

    threading.Thread(target=server.start_engine, args=(stop_serving,), name="compile", daemon=True).start()
    stop_summaries = threading.Event()
    if cfg.log_interval > 0:
        threading.Thread(target=summaries, args=(server, stop_summaries), daemon=True).start()
    print(f"serving on http://{cfg.host}:{cfg.port}: the chat page at /, the API at /v1"
          f"{' (API key required)' if cfg.api_key else ''} (GET /health is 200 once compiled)", flush=True)
    try:
        uv.run()
    finally:
        stop_summaries.set()
        if server.engine is not None:
            server.engine.shutdown()
    if server.failure:
        sys.exit(f"error: {server.failure}")
    if not uv.started:
        sys.exit(f"error: could not listen on {cfg.host}:{cfg.port} (in use, or not an address here)")


if __name__ == "__main__":
    main(sys.argv[1:])
