"""Serving without HTTP: decode slots over one KV cache, refilled as requests finish (continuous
batching), in the shape of MaxText's engine (JetStream):

    prefill  one request's prompt, right-padded to a bucket of lengths (powers of two up to
             block_size), through the model into a cache of the bucket's length; samples the
             request's first token
    insert   that cache and token into a free slot: a row of the engine's (L, slots, S, K·H) cache
    step     one new token for every slot at once; a slot nobody uses computes too (the shapes
             never change) and its token is dropped. The step reads the cache's first `attend`
             positions, the smallest of generate.attend_buckets that holds every running slot's
             cached positions

Every program is compiled ahead of time at start-up (a prefill and an insert per prompt bucket,
a step per attend bucket), so serving never compiles. Sampling settings (temperature, top_k, top_p) and keys live
in per-slot arrays, so requests with different settings share one step. A request's i-th token
is drawn with the key fold_in(fold_in(key(seed), i), 0), as inference/generate.py draws its first row's:
what a request gets does not depend on what runs beside it.

The engine's loop runs in a thread of its own. submit() queues a request from any thread; the
request's on_token and on_finish callbacks are called from the engine's thread.
"""

import collections
import dataclasses
import functools
import itertools
import random
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from devices import hardware
from inference import generate
from layers import kv_cache
from layers.blocks import constrain


class EngineError(ValueError):
    """A request the engine cannot take; the message says why (a full queue, a long prompt, ...)."""


class QueueFull(EngineError):
    pass


class ShuttingDown(EngineError):
    pass


FINISH_REASONS = ("stop", "length", "abort")  # a stop token; max_tokens or the context; cancelled or shut down


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list  # token ids
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filtering
    top_p: float = 1.0
    seed: int | None = None  # None: a random one
    stop_ids: tuple = ()  # the request ends at one of these tokens (which is not passed on)
    logprobs: bool = False  # its tokens' log-probabilities wanted (Token.logprob, Token.top); else not computed
    on_token: Callable[["Token"], None] | None = None  # each new token, stop tokens excluded
    on_finish: Callable[[str], None] | None = None  # one of FINISH_REASONS, once, last
    # Kept by the engine:
    id: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    cancelled: bool = False  # set by cancel(): the loop frees its slot at the next step


TOP_LOGPROBS = 5  # alternatives reported with each token (OpenAI's most)


@dataclasses.dataclass(frozen=True)
class Token:
    """A new token and the model's log-probabilities (before temperature and filtering): its own,
    and the TOP_LOGPROBS most likely tokens' as (id, logprob), most likely first; None for a
    request that did not ask for them (Request.logprobs)."""
    id: int
    logprob: float | None
    top: tuple | None


def prompt_buckets(block_size: int, smallest: int = 16) -> list[int]:
    """The padded prompt lengths: powers of two from `smallest`, and block_size last."""
    buckets = [b for b in (2 ** i for i in range(4, 31)) if smallest <= b < block_size]
    return buckets + [block_size]


class Engine:
    """`slots` requests decode at once; more wait in a queue of at most max_queue."""

    def __init__(self, setup, params, slots: int = 8, max_queue: int = 64, log=print, vocab: int | None = None):
        """vocab: only ids below it are drawn (the tokenizer's size; default the model's vocabulary)."""
        self.config, self.mesh, self.graphdef = setup.model_config, setup.mesh, setup.graphdef
        if slots % sharding.batch_shards(self.mesh):  # the slots are the cache's rows, split like a batch
            raise EngineError(f"slots={slots} is not divisible by the mesh's batch axes (mesh_data = "
                              f"{sharding.batch_shards(self.mesh)}): use a multiple of it")
        self.vocab = generate.drawable_ids(setup, vocab)
        self.slots, self.max_queue, self.log = slots, max_queue, log
        self.context = self.config.block_size
        self.buckets = prompt_buckets(self.context)
        self.params = generate.weights_in_compute_dtype(setup.graphdef, params)
        self.ids = itertools.count(1)
        self.queue: collections.deque = collections.deque()
        self.running: list[Request | None] = [None] * slots
        self.wake = threading.Condition()
        self.accepting, self.stopping, self.failure = True, False, None
        self.tokens_out, self.steps, self.aborted = 0, 0, 0
        # where the loop's time goes (stats(), serve.py's summary line): the step programs (dispatch and
        # the wait for their tokens), handing the tokens out (the callbacks), admitting requests (prefill,
        # insert), and waiting for work
        self.seconds = {"step": 0.0, "tokens": 0.0, "admit": 0.0, "idle": 0.0}
        self.idle_since: float | None = None  # when the loop began its current wait for work
        c = self.config
        self.weight_bytes = sum(a.nbytes for a in jax.tree.leaves(self.params))
        # The cache as built (its dtype, an int8 cache's scales): measured, not derived from the config.
        cache_shape = jax.eval_shape(lambda: kv_cache.init_cache(c, slots, self.context))
        self.kv_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache_shape))
        self.kv_bytes_per_token = self.kv_bytes // (slots * self.context)
        self.memory_bandwidth = hardware.peak_bandwidth(self.mesh.devices.flatten().tolist())[0]
        start = time.perf_counter()
        self._compile()
        self.compile_s = time.perf_counter() - start
        self.compiles_before_serving = _compile_count()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.started = time.perf_counter()  # stats()' counters count from here
        self.thread.start()

    # ------------------------------------------------------------------------- programs

    def _compile(self):
        S, replicated = self.context, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        cfg, graphdef = self.config, self.graphdef
        one = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
        settings = (one(jnp.int32), one(jnp.float32), one(jnp.int32), one(jnp.float32))  # seed, temp, top_k, top_p
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.params)
        with sharding.activate(self.mesh):
            self.state = empty_state_program(cfg, self.slots, S)()
            state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.state)
            active = one(jnp.bool_, (self.slots,))
            # one step per cache prefix it reads: a step reads only the bucket its slots have filled
            self.step_programs = {attend: step_program(graphdef, self.vocab, attend).lower(params, state, active).compile()
                                  for attend in generate.attend_buckets(S)}
            self.step_program = self.step_programs[S]  # reads the whole cache: the largest, for memory checks
            self.prefill_programs, self.insert_programs = {}, {}
            for P in self.buckets:
                prefill = prefill_program(graphdef, self.vocab).lower(
                    params, one(jnp.int32, (1, P)), one(jnp.int32), *settings).compile()
                drawn, prefix = prefill.out_info
                insert = jax.jit(_insert, donate_argnums=0).lower(
                    state, prefix, drawn["token"], one(jnp.int32), one(jnp.int32), *settings, one(jnp.bool_)).compile()
                self.prefill_programs[P], self.insert_programs[P] = prefill, insert

    # ------------------------------------------------------------------------- requests

    def submit(self, request: Request) -> Request:
        """Queue a request (from any thread); EngineError if it can't be taken."""
        if not 0 < len(request.prompt) < self.context:
            raise EngineError(f"the prompt is {len(request.prompt)} tokens; this model's context is "
                              f"{self.context} tokens, with at least one left to generate")
        if request.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {request.max_tokens}")
        with self.wake:
            if not self.accepting:
                raise ShuttingDown(self.failure or "the server is shutting down")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are waiting already (max_queue); try again later")
            request.id, request.submitted_at = next(self.ids), time.perf_counter()
            # Seeds are int32 on the device: any integer is taken modulo 2^31 (inference/generate.py's agree below it).
            request.seed = random.getrandbits(31) if request.seed is None else request.seed % 2 ** 31
            self.queue.append(request)
            self.wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away): its slot is free by the next step."""
        with self.wake:
            request.cancelled = True
            if request in self.queue:
                self.queue.remove(request)
                self._finish(request, "abort")
            self.wake.notify()

    def stop(self) -> None:
        """Take no more requests; the loop ends the queued and running ones ('abort', with their
        text so far) and returns. Does not wait: see shutdown()."""
        with self.wake:
            self.accepting, self.stopping = False, True
            self.wake.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        self.stop()
        self.thread.join(timeout)

    def stats(self) -> dict:
        with self.wake:
            return {"slots": self.slots, "busy": sum(r is not None for r in self.running),
                    "queued": len(self.queue), "tokens": self.tokens_out, "steps": self.steps, "aborted": self.aborted,
                    "seconds": {**self.seconds, "idle": self.seconds["idle"] + (
                        0.0 if self.idle_since is None else time.perf_counter() - self.idle_since)},
                    "compiles_while_serving": _compile_count() - self.compiles_before_serving}

    # ------------------------------------------------------------------------- the loop

    def _loop(self):
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 - a failed device step must not leave requests waiting forever
            self.log(f"engine: stopped by {type(e).__name__}: {e}")
            with self.wake:
                self.accepting, self.failure = False, f"the engine stopped ({type(e).__name__}: {e})"
                ended, self.running = [*self.queue, *filter(None, self.running)], [None] * self.slots
                self.queue.clear()
            for request in ended:
                self._finish(request, "abort")

    def _serve(self):
        while True:
            with self.wake:
                while not self.stopping and not self.queue and not any(self.running):
                    self.idle_since = time.perf_counter()
                    self.wake.wait()
                    self.seconds["idle"] += time.perf_counter() - self.idle_since
                    self.idle_since = None
                if self.stopping:
                    for request in [*self.queue, *filter(None, self.running)]:
                        self._finish(request, "abort")
                    self.queue.clear()
                    self.running = [None] * self.slots
                    return
                admitted = []
                while self.queue and None in self.running:
                    slot = self.running.index(None)
                    self.running[slot] = self.queue.popleft()
                    admitted.append(slot)
            start = time.perf_counter()
            for slot in admitted:  # device work outside the lock: submit() never waits for it
                self._start(slot)
            self.seconds["admit"] += time.perf_counter() - start
            self._step()

    def _start(self, slot: int) -> None:
        request = self.running[slot]
        P = len(request.prompt)
        bucket = next(b for b in self.buckets if b >= P)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :P] = request.prompt
        settings = (np.int32(request.seed), np.float32(request.temperature), np.int32(request.top_k),
                    np.float32(request.top_p))
        drawn, prefix = self.prefill_programs[bucket](self.params, tokens, np.int32(P), *settings)
        self.state = self.insert_programs[bucket](self.state, prefix, drawn["token"], np.int32(slot), np.int32(P),
                                                  *settings, np.bool_(request.logprobs))
        self._take(slot, *_on_host(drawn, 0, request.logprobs))

    def _step(self) -> None:
        active = np.array([r is not None for r in self.running])
        if not active.any():
            return
        # A running request's newest token (fed now) sits at position prompt + tokens so far - 1:
        # the step reads the cached positions before it, in the smallest bucket that holds them.
        newest = max(len(r.prompt) + len(r.tokens) - 1 for r in self.running if r is not None)
        attend = next(b for b in self.step_programs if b >= newest)
        start = time.perf_counter()
        self.state, drawn = self.step_programs[attend](self.params, self.state, active)
        drawn = jax.tree.map(np.asarray, drawn)  # waits for the step: the host needs the tokens to stream them
        tokens = time.perf_counter()
        self.steps += 1
        for slot in np.flatnonzero(active):
            self._take(int(slot), *_on_host(drawn, slot, self.running[slot].logprobs))
        self.seconds["step"] += tokens - start
        self.seconds["tokens"] += time.perf_counter() - tokens

    def _take(self, slot: int, token: int, info: Token) -> None:
        """A slot's new token: pass it on, or end the request (a stop token, its length, a cancel)."""
        request = self.running[slot]
        if request.cancelled:
            return self._free(slot, "abort")
        if token in request.stop_ids:
            return self._free(slot, "stop")
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.tokens.append(token)
        self.tokens_out += 1
        if request.on_token:
            request.on_token(info)
        if len(request.tokens) >= request.max_tokens or len(request.prompt) + len(request.tokens) >= self.context:
            self._free(slot, "length")

    def _free(self, slot: int, reason: str) -> None:
        with self.wake:
            request, self.running[slot] = self.running[slot], None
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason, request.finished_at = reason, time.perf_counter()
        self.aborted += reason == "abort"
        if request.on_finish:
            request.on_finish(reason)


# ----------------------------------------------------------------------------- device programs

# The jitted programs the engine runs, for whoever lowers them elsewhere (aot/serve_plan.py
# compiles them for a target that is not here); lower each with the shapes its function takes.

def empty_state_program(config, slots: int, length: int):
    """() -> the slots' state (_empty_state) for `slots` slots of `length` positions."""
    return jax.jit(functools.partial(_empty_state, config, slots, length))


def step_program(graphdef, vocab: int, attend: int | None = None):
    """(params, state, active_B) -> (state, drawn): one decode step of every slot, reading the cache's
    first `attend` positions (default all: every slot's newest position must be <= attend); donates
    the state."""
    return jax.jit(functools.partial(_step, graphdef, vocab, attend=attend), donate_argnums=1)


def prefill_program(graphdef, vocab: int):
    """(params, tokens_1xP, length, seed, temperature, top_k, top_p) -> (drawn, the prompt's cache)."""
    return jax.jit(functools.partial(_prefill, graphdef, vocab))


def _empty_state(config, slots: int, length: int) -> dict:
    """The slots' cache and per-slot arrays: newest token and its position, the number of the next
    new token (for its key), the seed, the sampling settings and whether log-probabilities are wanted."""
    zeros = lambda dtype: jnp.zeros((slots,), dtype)
    return {"cache": kv_cache.init_cache(config, slots, length), "token": zeros(jnp.int32),
            "position": zeros(jnp.int32), "index": zeros(jnp.int32), "seed": zeros(jnp.int32),
            "temperature": zeros(jnp.float32), "top_k": zeros(jnp.int32), "top_p": jnp.ones((slots,)),
            "logprobs": zeros(jnp.bool_)}


def _draw(logits_BxV, seed_B, index_B, temperature_B, top_k_B, top_p_B, logprobs=True) -> dict:
    """Each row's token number index_B[b], with inference/generate.py's key for its row 0, and
    log-probabilities where `logprobs` (a step's: any running slot asked for them), zeros otherwise:
    the log-softmax and top-k over the vocabulary were ~40% of a small model's step on a CPU."""
    keys_B = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), 0))(
        seed_B, index_B)
    token_B = generate.sample_logits(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B)
    B, K = token_B.shape[0], min(TOP_LOGPROBS, logits_BxV.shape[-1])

    def computed():
        logprobs_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
        top_logprobs_BxK, top_ids_BxK = jax.lax.top_k(logprobs_BxV, K)
        return {"logprob": jnp.take_along_axis(logprobs_BxV, token_B[:, None], -1)[:, 0],
                "top_ids": top_ids_BxK, "top_logprobs": top_logprobs_BxK}

    skipped = lambda: {"logprob": jnp.zeros(B, logits_BxV.dtype), "top_ids": jnp.zeros((B, K), jnp.int32),
                       "top_logprobs": jnp.zeros((B, K), logits_BxV.dtype)}
    return {"token": token_B, **jax.lax.cond(logprobs, computed, skipped)}


def _on_host(drawn: dict, row: int, logprobs: bool) -> tuple:
    """(token id, Token) of one row of _draw's arrays, fetched to the host (np.asarray first:
    indexing a jax.Array would compile a program); the log-probabilities only where wanted."""
    token = int(np.asarray(drawn["token"])[row])
    if not logprobs:
        return token, Token(token, None, None)
    drawn = {k: np.asarray(v)[row] for k, v in drawn.items()}
    top = tuple(zip(drawn["top_ids"].tolist(), drawn["top_logprobs"].tolist()))
    return token, Token(token, float(drawn["logprob"]), top)


def _prefill(graphdef, vocab: int, params, tokens_1xP, length, seed, temperature, top_k, top_p):
    """(_draw's first token (1,) and its log-probabilities, the prompt's cache (L, 1, P, K·H)) for a
    prompt right-padded to P."""
    gpt = nnx.merge(graphdef, params)
    logits_1xV, cache = gpt.prefill(tokens_1xP, tokens_1xP.shape[1], last_B=(length - 1)[None])
    row = lambda x: x[None]
    drawn = _draw(logits_1xV[:, :vocab], row(seed), jnp.zeros(1, jnp.int32), row(temperature),
                  row(top_k), row(top_p))
    return drawn, cache


def _insert(state, prefix, token_1, slot, length, seed, temperature, top_k, top_p, logprobs) -> dict:
    """The slot's row of the cache starts with the prompt's; its newest token is the prefill's (at
    position `length`), its next one is token number 1."""
    put = lambda big, small: jax.lax.dynamic_update_slice(big, small.astype(big.dtype), (0, slot, 0, 0))
    cache = jax.tree.map(put, state["cache"], prefix)  # keys and values (and an int8 cache's scales)
    return {**state, "cache": cache, "token": state["token"].at[slot].set(token_1[0]),
            "position": state["position"].at[slot].set(length),
            "index": state["index"].at[slot].set(1), "seed": state["seed"].at[slot].set(seed),
            "temperature": state["temperature"].at[slot].set(temperature),
            "top_k": state["top_k"].at[slot].set(top_k), "top_p": state["top_p"].at[slot].set(top_p),
            "logprobs": state["logprobs"].at[slot].set(logprobs)}


def _step(graphdef, vocab: int, params, state, active_B, attend: int | None = None):
    """Feed each slot's newest token, sample the next; slots not in use keep their place (their
    positions, stale, stay inside the cache: what they compute is dropped)."""
    gpt = nnx.merge(graphdef, params)
    logits_BxV, cache = gpt.decode(state["token"][:, None], state["cache"], state["position"], attend=attend)
    drawn = _draw(logits_BxV[:, :vocab], state["seed"], state["index"], state["temperature"],
                  state["top_k"], state["top_p"], logprobs=jnp.any(state["logprobs"] & active_B))
    step = active_B.astype(jnp.int32)
    # The per-slot arrays stay replicated, as _empty_state made them (the programs were compiled for that).
    replicated = lambda x_B: constrain(x_B, (None,))
    return {**state, "cache": cache, "token": replicated(jnp.where(active_B, drawn["token"], state["token"])),
            "position": replicated(state["position"] + step), "index": replicated(state["index"] + step)}, drawn


def _compile_count() -> int:
    return _COMPILES[0]


_COMPILES = [0]  # XLA compilations in this process, counted through jax.monitoring


def _count_compile(event: str, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
