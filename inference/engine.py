"""Serving without HTTP: decode slots over one KV cache, refilled as requests finish (continuous
batching), in the shape of MaxText's engine (JetStream):

    admit    waiting requests' prompts, right-padded to a bucket of lengths (powers of two up to
             block_size), up to 8 of them (ADMIT_ROWS) in one program: their prefill through the model,
             their first tokens sampled, and their caches written into free slots (rows of the
             engine's (L, slots, S, K·H) cache)
    decode   `decode_steps` new tokens for every slot at once, in one program; a slot nobody uses
             computes too (the shapes never change) and its tokens are dropped, as are a request's
             tokens past its end (a stop token, max_tokens). On one TPU chip each step's attention
             reads each block of 8 slots' filled positions (layers/decode_attention.py's kernel;
             reads_filled_positions); elsewhere the cache's first positions (kv_cache.Prefix), the smallest
             of generate.prefix_buckets that holds every running slot's positions up to the last
             step's. A step runs the first quarter of the slots when every busy one is there
             (requests take the lowest free slot), else all of them

One call makes several tokens per slot because the host's part of a step (a program's dispatch,
fetching its tokens, handing them out) cost about as much as the step itself on a TPU (bench/NOTES.md).

Every program is compiled ahead of time at start-up (an admit per prompt bucket and row count, a
decode per row bucket and attend bucket), so serving never compiles; with compile_later, only those
that serve every request (a decode of all slots over the whole cache, an admit of one prompt of the
largest bucket) before serving, and the faster variants in a thread beside it, each used once compiled
(the same tokens: which program runs a step never changes them). Those first ones compile from the
weights' shapes alone (first_programs), so serve.py compiles them while a checkpoint's weights are
read. Sampling settings (temperature, top_k, top_p) and keys live in per-slot arrays, so requests
with different settings share one step.
A request's i-th token is drawn with the key fold_in(fold_in(key(seed), i), 0), as
inference/generate.py draws its first row's: what a request gets does not depend on what runs
beside it.

The engine's loop runs in a thread of its own. submit() queues a request from any thread; the
request's on_token and on_finish callbacks are called from the engine's thread.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import random
import threading
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from common import compile_cache
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
    cancelled: bool = False  # set by cancel(): the loop frees its slot once the decode program in flight ends


TOP_LOGPROBS = 5  # alternatives reported with each token (OpenAI's most)


class Token(NamedTuple):  # made for every token: 0.38 us here, a frozen dataclass 0.62
    """A new token and the model's log-probabilities (before temperature and filtering): its own,
    and the TOP_LOGPROBS most likely tokens' as (id, logprob), most likely first; None for a
    request that did not ask for them (Request.logprobs)."""

    id: int
    logprob: float | None
    top: tuple | None


def prompt_buckets(block_size: int, smallest: int = 16) -> list[int]:
    """The padded prompt lengths: powers of two from `smallest`, and block_size last."""
    buckets = [b for b in (2**i for i in range(4, 31)) if smallest <= b < block_size]
    return buckets + [block_size]


# Prompts admitted in one program: one, or up to 8 of a bucket (padded with rows that write nothing) where
# 8 x the bucket's length stays within ADMIT_TOKENS, so that a burst of arrivals costs one prefill, not 8.
ADMIT_ROWS, ADMIT_TOKENS = (1, 8), 4096
DECODE_STEPS = 8  # tokens per slot per decode program, by default
# The start-up's programs compiled at once on an accelerator's host, whose cores have nothing else to do
# then (XLA lets go of Python's lock while it compiles). Not on a CPU, where they are the cores the
# compiler already uses: 14 programs on 2 cores took as long or longer 8 at a time (bench/NOTES.md).
COMPILE_THREADS = 8


def admit_rows(bucket: int, slots: int) -> list[int]:
    """The row counts compiled for a prompt bucket (1 always)."""
    return [r for r in ADMIT_ROWS if r == 1 or (r <= slots and r * bucket <= ADMIT_TOKENS)]


DECODE_ATTENTION = ("auto", "xla", "pallas")


def reads_filled_positions(decode_attention: str, mesh, config) -> bool:
    """Whether decode steps attend through the kernel (kv_cache.FILLED: each block of 8 slots' filled
    positions, up to its longest) rather than XLA's attention over a prefix bucket that holds every
    slot's. 'auto': the kernel on one TPU chip, for a bf16 or float32 cache of a multiple of 128
    positions (its blocks). There a whole step measured 2.3x faster than the bucket when one slot
    in 64 was long, and 5-11% slower when every slot was as long; with an int8 cache the attention
    alone measured slower (bench/NOTES.md). 'pallas' runs on one device: a TPU, or a CPU through
    Pallas's interpreter (tests)."""
    if decode_attention not in DECODE_ATTENTION:
        raise EngineError(f"decode_attention={decode_attention!r}: use one of {', '.join(DECODE_ATTENTION)}")
    devices, platform = mesh.devices.size, mesh.devices.flat[0].platform
    if decode_attention == "pallas" and (devices > 1 or platform not in ("tpu", "cpu")):
        raise EngineError(
            f"decode_attention='pallas' runs on one TPU chip (a CPU interprets it, for tests), and "
            f"this mesh has {devices} {platform} device(s): use 'xla' or 'auto'"
        )
    if decode_attention == "auto":
        return devices == 1 and platform == "tpu" and config.kv_cache_dtype != "int8" and config.block_size % 128 == 0
    return decode_attention == "pallas"


def row_buckets(slots: int, batch_shards: int = 1) -> list[int]:
    """The numbers of slots a decode program runs: a quarter of them (when that is 8 or more), so that
    a light load costs a quarter of a step, and all. All only when the slots are split over devices
    (a program of the first rows would leave the other devices idle)."""
    return [slots // 4, slots] if batch_shards == 1 and slots % 4 == 0 and slots // 4 >= 8 else [slots]


class Programs:
    """An engine's programs for its model and arguments, keyed ("decode", cache reads, rows) and
    ("admit", prompt bucket, rows); traced, lowered and compiled from shapes: the weights' with their
    shardings (their values are never read) and the slots' state's. So they can compile while a
    checkpoint's weights are still being read (serve.py)."""

    def __init__(self, setup, params, slots: int, vocab: int | None, decode_steps: int, decode_attention: str):
        """params: the weights as the engine reads them (generate.weights_in_compute_dtype), arrays or
        jax.ShapeDtypeStructs with shardings; the rest as Engine takes them."""
        config, self.mesh = setup.model_config, setup.mesh
        if slots % sharding.batch_shards(self.mesh):  # the slots are the cache's rows, split like a batch
            raise EngineError(
                f"slots={slots} is not divisible by the mesh's batch axes (mesh_data = "
                f"{sharding.batch_shards(self.mesh)}): use a multiple of it"
            )
        if decode_steps < 1:
            raise EngineError(f"decode_steps must be >= 1, got {decode_steps}")
        self.setup, self.arguments = setup, (slots, vocab, decode_steps, decode_attention)
        self.graphdef, self.vocab = setup.graphdef, generate.drawable_ids(setup, vocab)
        self.slots, self.decode_steps, self.context = slots, decode_steps, config.block_size
        self.buckets = prompt_buckets(self.context)
        self.row_buckets = row_buckets(slots, sharding.batch_shards(self.mesh))
        self.reads_filled = reads_filled_positions(decode_attention, self.mesh, config)
        prefixes = [kv_cache.Prefix(n) for n in generate.prefix_buckets(self.context)]
        self.cache_reads = [kv_cache.FILLED] if self.reads_filled else prefixes  # one decode program each
        # one decode per cache prefix it reads (a step reads only the bucket its slots have filled;
        # the kernel, each block of slots' filled positions) and per number of slots it runs (the
        # busy ones, which take the lowest free slots); an admit per prompt bucket and row count
        self.keys = [("decode", reads, rows) for reads in self.cache_reads for rows in self.row_buckets]
        self.keys += [("admit", P, R) for P in self.buckets for R in admit_rows(P, slots)]
        # those that serve every request: the decode of all slots over the whole cache, an admit of
        # one prompt of the largest bucket
        self.first = [("decode", self.cache_reads[-1], slots), ("admit", self.buckets[-1], 1)]
        with sharding.activate(self.mesh):
            self.empty_state = empty_state_program(config, slots, self.context).lower().compile()
        self.params = generate.shapes_of(params)
        self.state = generate.shapes_of(self.empty_state.out_info)  # as its arrays are (without its layout)
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.compiled: dict = {}  # key -> jax.stages.Compiled

    def made_for(self, setup, params, *arguments) -> bool:
        """Whether these are the programs of Programs(setup, params, *arguments)."""
        return setup is self.setup and arguments == self.arguments and generate.shapes_of(params) == self.params

    def compile(self, keys: list) -> None:
        """Compile the programs of these keys into self.compiled: traced one after another (that holds
        Python's lock), each compiled (or read from the compile cache) in a pool as soon as it is traced,
        while the next is: XLA lets go of the lock."""
        threads = 1 if self.mesh.devices.flat[0].platform == "cpu" else COMPILE_THREADS
        with sharding.activate(self.mesh), concurrent.futures.ThreadPoolExecutor(threads) as pool:
            compiling = {key: pool.submit(self.lowered(key).compile) for key in keys}
            self.compiled.update({key: program.result() for key, program in compiling.items()})

    def lowered(self, key: tuple) -> jax.stages.Lowered:
        """The program of a key, traced and lowered for the engine's arguments (inside sharding.activate)."""
        kind, a, b = key
        if kind == "decode":
            active = jax.ShapeDtypeStruct((self.slots,), jnp.bool_, sharding=self.replicated)
            return decode_program(self.graphdef, self.vocab, self.decode_steps, a, b).lower(
                self.params, self.state, active
            )
        return admit_program(self.graphdef, self.vocab).lower(
            self.params, self.state, *admit_inputs(a, b, self.replicated)
        )


def first_programs(
    setup, params, slots: int = 8, vocab: int | None = None, decode_steps=DECODE_STEPS, decode_attention="auto"
) -> Programs:
    """The programs an Engine of these arguments serves every request with (its compile_later's first
    ones), compiled: params may be the weights' shapes alone, so that they compile while the weights
    are read; Engine(..., programs=) then runs these rather than compiling them again."""
    programs = Programs(setup, params, slots, vocab, decode_steps, decode_attention)
    programs.compile(programs.first)
    return programs


class Engine:
    """`slots` requests decode at once; more wait in a queue of at most max_queue."""

    def __init__(
        self,
        setup,
        params,
        slots: int = 8,
        max_queue: int = 64,
        log=print,
        vocab: int | None = None,
        decode_steps: int = DECODE_STEPS,
        decode_attention: str = "auto",
        after_tokens: Callable | None = None,
        on_failure: Callable[[str], None] | None = None,
        compile_later: bool = False,
        fits: Callable[[object], str | None] | None = None,
        programs: Programs | None = None,
    ):
        """vocab: only ids below it are drawn (the tokenizer's size; default the model's vocabulary).
        decode_steps: tokens per slot per decode program (more: less host work per token; a request
        that ends or arrives waits for the call in flight). decode_attention: one of DECODE_ATTENTION
        (reads_filled_positions). after_tokens: called in the loop's thread after each round of
        on_token and on_finish calls (a decode program's tokens, the admitted requests' first ones,
        the aborts at a stop): where the callbacks only collect, the time to send them on. on_failure:
        called once, from the loop's thread, with self.failure when the loop stops on an error.
        compile_later: compile only the programs that serve every request (_compile) before returning,
        and the faster variants in a thread of their own while serving, each used once it is compiled;
        fits: called there with each of those, says why it can't run here (its memory) or None.
        programs: first_programs' for these arguments (compiled while the weights were read), run
        rather than compiled again; programs made for other arguments or weights are not used."""
        self.config, self.mesh = setup.model_config, setup.mesh
        self.params = generate.weights_in_compute_dtype(setup.graphdef, params)
        arguments = (slots, vocab, decode_steps, decode_attention)
        if programs is None or not programs.made_for(setup, self.params, *arguments):
            programs = Programs(setup, self.params, *arguments)
        self.programs = programs
        self.slots, self.max_queue, self.log, self.decode_steps = slots, max_queue, log, decode_steps
        self.after_tokens = after_tokens or (lambda: None)
        self.on_failure = on_failure or (lambda failure: None)
        self.context, self.buckets, self.row_buckets = programs.context, programs.buckets, programs.row_buckets
        self.reads_filled, self.cache_reads = programs.reads_filled, programs.cache_reads
        self.ids = itertools.count(1)
        self.queue: collections.deque = collections.deque()
        self.running: list[Request | None] = [None] * slots
        self.wake = threading.Condition()
        self.accepting, self.stopping, self.failure = True, False, None
        self.tokens_out, self.steps, self.aborted = 0, 0, 0
        # where the loop's time goes (stats(), serve.py's summary line): the decode programs (dispatch and
        # the wait for their tokens), handing the tokens out (the callbacks), admitting requests (their
        # programs, first tokens), and waiting for work
        self.seconds = {"step": 0.0, "tokens": 0.0, "admit": 0.0, "idle": 0.0}
        self.idle_since: float | None = None  # when the loop began its current wait for work
        c = self.config
        self.weight_bytes = sum(a.nbytes for a in jax.tree.leaves(self.params))
        # The cache as built (its dtype, an int8 cache's scales): measured, not derived from the config.
        cache_shape = jax.eval_shape(lambda: kv_cache.init_cache(c, slots, self.context))
        self.kv_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache_shape))
        self.kv_bytes_per_token = self.kv_bytes // (slots * self.context)
        self.memory_bandwidth = hardware.peak_bandwidth(self.mesh.devices.flatten().tolist())[0]
        later = self._compile(compile_later)
        self.compiles_before_serving, self.compiled_later = compile_cache.counts().programs, 0
        self.programs_later = len(later)  # still to compile, in self.compiling
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.started = time.perf_counter()  # stats()' counters count from here
        self.thread.start()
        self.compiling = threading.Thread(target=self._compile_rest, args=(later, fits), name="engine-compile")
        self.compiling.daemon = True
        if later:
            self.compiling.start()

    # ------------------------------------------------------------------------- programs

    def _compile(self, later: bool) -> list:
        """Compile the programs (those compiled already are not compiled again): all, or with `later`
        only those that serve every request (Programs.first), and make the slots' state; returns the
        keys of those left for _compile_rest."""
        programs = self.programs
        now = programs.first if later else programs.keys
        programs.compile([key for key in now if key not in programs.compiled])
        self.state = programs.empty_state()
        self.step_programs, self.admit_programs = {}, {}
        for key in now:
            self._use(key, programs.compiled[key])
        self.step_program = programs.compiled[programs.first[0]]  # the largest decode: memory checks
        return [key for key in programs.keys if key not in now]

    def _use(self, key: tuple, program) -> None:
        """Let the loop run a compiled program of a key of _compile's: in a new dict, since the loop's
        thread may be reading the old one."""
        if key[0] == "decode":
            self.step_programs = {**self.step_programs, key[1:]: program}
        else:
            self.admit_programs = {**self.admit_programs, key[1:]: program}

    def _compile_rest(self, keys: list, fits) -> None:
        """In its own thread, while the engine serves: compile the programs _compile left, one at a time
        (the first ones serve meanwhile), and let the loop use each as soon as it is ready. One that fails
        or doesn't fit is not used."""
        start, before, used = time.perf_counter(), compile_cache.counts(), 0
        with sharding.activate(self.mesh):
            for key in keys:
                if self.stopping:
                    return
                try:
                    lowered = self.programs.lowered(key)
                    with self.wake:  # stats()' count of programs compiled for requests leaves these out
                        self.compiled_later += 1
                    program = lowered.compile()
                    why = fits(program) if fits else None
                except Exception as e:  # noqa: BLE001 - e.g. XLA:TPU refusing a program that can't fit: serve without it
                    why = f"{type(e).__name__}: {next(iter(str(e).splitlines()), '')}"
                if why:
                    self.log(f"engine: {_program_name(key)} is not used: {why}")
                    continue
                used += 1
                self._use(key, program)
        self.log(
            f"engine: {used} more program{'s' if used != 1 else ''} in use after {time.perf_counter() - start:.1f} s "
            f"in the background ({compile_cache.summary(before)})"
        )

    # ------------------------------------------------------------------------- requests

    def submit(self, request: Request) -> Request:
        """Queue a request (from any thread); EngineError if it can't be taken."""
        if not 0 < len(request.prompt) < self.context:
            raise EngineError(
                f"the prompt is {len(request.prompt)} tokens; this model's context is "
                f"{self.context} tokens, with at least one left to generate"
            )
        if request.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {request.max_tokens}")
        with self.wake:
            if not self.accepting:
                raise ShuttingDown(self.failure or "the server is shutting down")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are waiting already (max_queue); try again later")
            request.id, request.submitted_at = next(self.ids), time.perf_counter()
            # Seeds are int32 on the device: any integer is taken modulo 2^31 (inference/generate.py's agree below it).
            request.seed = random.getrandbits(31) if request.seed is None else request.seed % 2**31
            self.queue.append(request)
            self.wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away): its slot is free once the decode program in flight ends."""
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
        if self.compiling.is_alive():  # it stops after the program it compiles (exiting while XLA compiles aborts)
            self.compiling.join(timeout)

    def stats(self) -> dict:
        with self.wake:
            return {
                "slots": self.slots,
                "busy": sum(r is not None for r in self.running),
                "queued": len(self.queue),
                "tokens": self.tokens_out,
                "steps": self.steps,
                "aborted": self.aborted,
                "seconds": {
                    **self.seconds,
                    "idle": self.seconds["idle"]
                    + (0.0 if self.idle_since is None else time.perf_counter() - self.idle_since),
                },
                # (0 while a program compiles in the background, counted here before XLA counts it)
                "compiles_while_serving": max(
                    0, compile_cache.counts().programs - self.compiles_before_serving - self.compiled_later
                ),
            }

    # ------------------------------------------------------------------------- the loop

    def _loop(self):
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 - a failed device step must not leave requests waiting forever
            self.log(f"engine: stopped by {type(e).__name__}: {e}")
            # One line (XLA's messages run to many): serve.py exits with it, and /health says it.
            first_line = next(iter(str(e).splitlines()), "")
            with self.wake:
                self.accepting, self.failure = False, f"the engine stopped ({type(e).__name__}: {first_line})"
                ended, self.running = [*self.queue, *filter(None, self.running)], [None] * self.slots
                self.queue.clear()
            for request in ended:
                self._finish(request, "abort")
            self.after_tokens()
            self.on_failure(self.failure)

    def _serve(self):
        # A decode program is dispatched before the previous one's tokens are handed out, so the device
        # runs the next program while the host hands out the last one's tokens (the device sat idle
        # while the host worked). in_flight: that previous decode.
        in_flight = None
        while True:
            with self.wake:
                while in_flight is None and not self.stopping and not self.queue and not any(self.running):
                    self.idle_since = time.perf_counter()
                    self.wake.wait()
                    self.seconds["idle"] += time.perf_counter() - self.idle_since
                    self.idle_since = None
                if self.stopping:
                    for request in [*self.queue, *filter(None, self.running)]:
                        self._finish(request, "abort")
                    self.queue.clear()
                    self.running = [None] * self.slots
                    self.after_tokens()
                    return
                admitted = []
                while self.queue and None in self.running:
                    slot = self.running.index(None)
                    self.running[slot] = self.queue.popleft()
                    admitted.append(slot)
            # Device work outside the lock (submit() never waits for it), dispatched before any wait:
            # the admissions, then the decode that starts from their first tokens; the host hands out
            # the previous decode's tokens (they come first on the device) and the first tokens while
            # this decode runs.
            start = time.perf_counter()
            admissions = self._dispatch_admit(admitted)
            admitting = time.perf_counter()
            decoding = self._dispatch_decode(in_flight[0] if in_flight else [])
            dispatched = time.perf_counter()
            if in_flight is not None:
                self._hand_out(*in_flight, dispatched)
            handed_out = time.perf_counter()
            for slots, drawn in admissions:
                for row, slot in enumerate(slots):
                    self._take(slot, *_on_host(drawn, row, self.running[slot].logprobs))
            self.after_tokens()
            self.seconds["admit"] += (admitting - start) + (time.perf_counter() - handed_out)
            in_flight = None if decoding is None else (*decoding, dispatched - admitting)

    def _dispatch_admit(self, slots: list) -> list:
        """Dispatch the programs that admit the requests just put in these slots, each prompt bucket's
        in groups of up to 8; returns [(the group's slots, its first tokens on the device)]."""
        by_bucket = collections.defaultdict(list)
        compiled = sorted({P for P, _ in self.admit_programs})  # yet (the largest bucket's always is)
        for slot in slots:
            by_bucket[next(b for b in compiled if b >= len(self.running[slot].prompt))].append(slot)
        dispatched = []
        for P, waiting in by_bucket.items():
            options = [R for R in admit_rows(P, self.slots) if (P, R) in self.admit_programs]  # compiled yet
            while waiting:
                R = next((r for r in options if r >= len(waiting)), options[-1])
                group, waiting = waiting[:R], waiting[R:]
                requests = [self.running[slot] for slot in group]
                tokens = np.zeros((R, P), np.int32)
                for row, request in enumerate(requests):
                    tokens[row, : len(request.prompt)] = request.prompt
                # rows past the group's are padding: their slot index (self.slots) is out of range: they write nothing
                column = lambda values, dtype, pad: np.array(values + [pad] * (R - len(group)), dtype)
                setting = lambda name, dtype, pad: column([getattr(r, name) for r in requests], dtype, pad)
                self.state, drawn = self.admit_programs[P, R](
                    self.params,
                    self.state,
                    tokens,
                    column([len(r.prompt) for r in requests], np.int32, 1),
                    column(group, np.int32, self.slots),
                    setting("seed", np.int32, 0),
                    setting("temperature", np.float32, 0),
                    setting("top_k", np.int32, 0),
                    setting("top_p", np.float32, 1),
                    setting("logprobs", np.bool_, False),
                )
                dispatched.append((group, drawn))
        return dispatched

    def _dispatch_decode(self, in_flight: list):
        """Dispatch a decode of the running slots that need more tokens than the decode in flight (its
        running requests: in_flight) will give them and are not cancelled (a token handed out frees a
        cancelled one's slot); returns (those requests by slot, the tokens on the device), or None when
        none does."""
        flying = {id(r) for r in in_flight if r is not None}

        def tokens_then(request) -> int:  # its tokens once those on the device are out (a new one's first: 1)
            return max(len(request.tokens), 1) + self.decode_steps * (id(request) in flying)

        def wants_more(request) -> bool:
            tokens = tokens_then(request)
            return tokens < request.max_tokens and len(request.prompt) + tokens < self.context and not request.cancelled

        running = [r if r is not None and wants_more(r) else None for r in self.running]
        if not any(running):
            return None
        # A running request's newest token (fed first) sits at position prompt + tokens so far - 1 (the
        # prompt's length for one just admitted, whose first token is not handed out yet): the steps read
        # the cached positions before their last one, in the smallest bucket that holds them (the
        # kernel reads each block of slots' filled positions).
        if self.reads_filled:
            reads = [kv_cache.FILLED]
        else:
            newest = max(len(r.prompt) + tokens_then(r) - 1 for r in running if r is not None)
            last = min(newest + self.decode_steps - 1, self.context - 1)
            reads = [r for r in self.cache_reads if r.positions >= last]
        busy = max(slot for slot, r in enumerate(running) if r is not None) + 1
        programs = self.step_programs  # the smallest compiled yet (all slots over the whole cache always is)
        program = next(programs[r, n] for r in reads for n in self.row_buckets if n >= busy and (r, n) in programs)
        active = np.array([r is not None for r in running])
        self.state, drawn = program(self.params, self.state, active)
        return running, drawn

    def _hand_out(self, running: list, drawn: dict, dispatch_s: float, waiting_from: float) -> None:
        """A decode's tokens, request by request, to the requests that were running when it was dispatched:
        a request that ended at an earlier step (or before) gets no more. The decode's time is its
        dispatch (dispatch_s) and the wait for its tokens from waiting_from."""
        logprobs = any(r is not None and r.logprobs for r in running)
        drawn = jax.device_get(drawn if logprobs else {"token": drawn["token"]})  # waits for the decode
        tokens = time.perf_counter()
        ids = drawn["token"].tolist()  # (steps, rows) Python ints: one conversion, not one per token
        drawn_at = [{name: values[step] for name, values in drawn.items()} for step in range(self.decode_steps)]
        for slot, request in enumerate(running):  # a request's tokens one after another (they are sent together)
            for step in range(self.decode_steps):
                if request is None or self.running[slot] is not request:
                    break
                token = ids[step][slot]
                self._take(
                    slot,
                    *(_on_host(drawn_at[step], slot, True) if request.logprobs else (token, Token(token, None, None))),
                )
        self.steps += self.decode_steps
        self.seconds["step"] += dispatch_s + tokens - waiting_from
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
        with self.wake:  # cancel() finishes queued requests from other threads
            self.aborted += reason == "abort"
        if request.on_finish:
            request.on_finish(reason)


# ----------------------------------------------------------------------------- device programs

# The jitted programs the engine runs, for whoever lowers them elsewhere (aot/serve_plan.py
# compiles them for a target that is not here); lower each with the shapes its function takes.


def _program_name(key: tuple) -> str:
    """A key of Engine._compile's in words, for the log."""
    kind, a, b = key
    if kind == "admit":
        return f"the admit of {b} prompt(s) of {a} tokens"
    reads = "each block's filled positions" if a == kv_cache.FILLED else f"{a.positions} positions"
    return f"the decode of {b} slots reading {reads}"


def empty_state_program(config, slots: int, length: int):
    """() -> the slots' state (_empty_state) for `slots` slots of `length` positions."""
    return jax.jit(functools.partial(_empty_state, config, slots, length))


def decode_program(graphdef, vocab: int, steps: int = 1, reads=None, rows: int | None = None):
    """(params, state, active_B) -> (state, drawn (steps, rows, ...)): `steps` decode steps of the
    first `rows` slots (default all: every active slot must be one of them), reading the cache as
    `reads` says (kv_cache.Prefix(n): its first n positions, default all, so every active slot's last
    position must be <= n; kv_cache.FILLED: each block of slots' filled positions, through the kernel);
    donates the state."""
    return jax.jit(functools.partial(_decode, graphdef, vocab, steps, reads=reads, rows=rows), donate_argnums=1)


def admit_program(graphdef, vocab: int):
    """(params, state, tokens_RxP, length_R, slot_R, seed_R, temperature_R, top_k_R, top_p_R, logprobs_R)
    -> (state, drawn): R prompts right-padded to P prefilled into their slots (a slot index out of
    range writes nothing); donates the state."""
    return jax.jit(functools.partial(_admit, graphdef, vocab), donate_argnums=1)


def admit_inputs(P: int, R: int, sharding) -> tuple:
    """admit_program's arguments after the params and the state, as shapes: R prompts of P tokens."""
    one = lambda dtype, shape=(R,): jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    i32, f32 = jnp.int32, jnp.float32
    return one(i32, (R, P)), one(i32), one(i32), one(i32), one(f32), one(i32), one(f32), one(jnp.bool_)


def _empty_state(config, slots: int, length: int) -> dict:
    """The slots' cache and per-slot arrays: newest token and its position, the number of the next
    new token (for its key), the seed, the sampling settings and whether log-probabilities are wanted."""
    zeros = lambda dtype: jnp.zeros((slots,), dtype)
    return {
        "cache": kv_cache.init_cache(config, slots, length),
        "token": zeros(jnp.int32),
        "position": zeros(jnp.int32),
        "index": zeros(jnp.int32),
        "seed": zeros(jnp.int32),
        "temperature": zeros(jnp.float32),
        "top_k": zeros(jnp.int32),
        "top_p": jnp.ones((slots,)),
        "logprobs": zeros(jnp.bool_),
    }


def _draw(logits_BxV, seed_B, index_B, temperature_B, top_k_B, top_p_B, logprobs=True) -> dict:
    """Each row's token number index_B[b], with inference/generate.py's key for its row 0, and
    log-probabilities where `logprobs` (a step's: any running slot asked for them), zeros otherwise:
    the log-softmax and top-k over the vocabulary were ~40% of a small model's step on a CPU."""
    keys_B = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), 0))(
        seed_B, index_B
    )
    token_B = generate.sample_logits(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B)
    B, K = token_B.shape[0], min(TOP_LOGPROBS, logits_BxV.shape[-1])

    def computed():
        logprobs_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
        top_logprobs_BxK, top_ids_BxK = jax.lax.top_k(logprobs_BxV, K)
        return {
            "logprob": jnp.take_along_axis(logprobs_BxV, token_B[:, None], -1)[:, 0],
            "top_ids": top_ids_BxK,
            "top_logprobs": top_logprobs_BxK,
        }

    skipped = lambda: {
        "logprob": jnp.zeros(B, logits_BxV.dtype),
        "top_ids": jnp.zeros((B, K), jnp.int32),
        "top_logprobs": jnp.zeros((B, K), logits_BxV.dtype),
    }
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


def _admit(
    graphdef,
    vocab: int,
    params,
    state,
    tokens_RxP,
    length_R,
    slot_R,
    seed_R,
    temperature_R,
    top_k_R,
    top_p_R,
    logprobs_R,
):
    """Prefill R prompts through the training path's attention, draw each one's first token (its
    number 0), and make each slot's row of the cache start with its prompt's, its newest token the
    drawn one at position length, its next one number 1."""
    gpt = nnx.merge(graphdef, params)
    P = tokens_RxP.shape[1]
    logits_RxV, prefix = gpt.prefill(tokens_RxP, P, last_B=length_R - 1)
    drawn = _draw(
        logits_RxV[:, :vocab],
        seed_R,
        jnp.zeros_like(seed_R),
        temperature_R,
        top_k_R,
        top_p_R,
        logprobs=jnp.any(logprobs_R),
    )
    # keys and values (and an int8 cache's scales), (L, R, P, ...) into (L, slots, S, ...)
    put = lambda big, small: big.at[:, slot_R, :P].set(small.astype(big.dtype), mode="drop")
    at = lambda name, values: state[name].at[slot_R].set(values, mode="drop")
    return _pinned(
        {
            "cache": jax.tree.map(put, state["cache"], prefix),
            "token": at("token", drawn["token"]),
            "position": at("position", length_R),
            "index": at("index", jnp.ones_like(length_R)),
            "seed": at("seed", seed_R),
            "temperature": at("temperature", temperature_R),
            "top_k": at("top_k", top_k_R),
            "top_p": at("top_p", top_p_R),
            "logprobs": at("logprobs", logprobs_R),
        }
    ), drawn


def _decode(graphdef, vocab: int, steps: int, params, state, active_B, reads=None, rows: int | None = None):
    """`steps` times: feed each of the first `rows` slots' newest token, sample the next. An active
    slot stops moving at the cache's last position (its request ends there: what it computes after
    is dropped), and slots not in use keep their place (their positions, stale, stay inside the
    cache); the slots past `rows` are not touched."""
    gpt = nnx.merge(graphdef, params)
    last, B = state["cache"].capacity - 1, active_B.shape[0]
    R = rows or B
    first = lambda x_B: x_B[:R]
    padded = lambda x_R: jnp.pad(x_R, (0, B - R))  # back to every slot's: the rows past R do not move

    def step(state, _):
        # a free slot reads nothing (its last request's position would have the kernel read that far)
        position_R = jnp.where(first(active_B), jnp.minimum(first(state["position"]), last), 0)
        logits_RxV, cache = gpt.decode(first(state["token"])[:, None], state["cache"], position_R, reads=reads)
        drawn = _draw(
            logits_RxV[:, :vocab],
            *map(first, (state["seed"], state["index"], state["temperature"], state["top_k"], state["top_p"])),
            logprobs=jnp.any(first(state["logprobs"] & active_B)),
        )
        moving_B = padded(first(active_B & (state["position"] <= last)))
        step_B = moving_B.astype(jnp.int32)
        return _pinned(
            {
                **state,
                "cache": cache,
                "token": jnp.where(moving_B, padded(drawn["token"]), state["token"]),
                "position": state["position"] + step_B,
                "index": state["index"] + step_B,
            }
        ), drawn

    state, drawn = jax.lax.scan(step, state, length=steps)
    return _pinned(state), drawn


def _pinned(state: dict) -> dict:
    """The state laid out as _empty_state made it (every program was compiled for that layout): the
    cache split as kv_cache.init_cache splits it, the per-slot arrays replicated."""
    axes = kv_cache.cache_axes(state["cache"].kv_heads)
    return {
        name: jax.tree.map(lambda a: constrain(a, axes), value) if name == "cache" else constrain(value, (None,))
        for name, value in state.items()
    }
