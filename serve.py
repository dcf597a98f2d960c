"""An OpenAI-compatible HTTP server over inference/engine.py (Starlette on uvicorn): the command, which reads
the config, loads the model, compiles the engine and runs uvicorn; the routes, requests and
replies are serving/app.py's.

    python serve.py --out_dir=out-shakespeare-char              # a trained checkpoint
    python serve.py --init_from=gpt2 --slots=16 --port=8000     # a Hugging Face model
    curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0}'

GET / is the chat page (serving/web/: HTML, CSS and JavaScript, no build step). With --api_key=KEY
(or the environment variable NANOMAX_API_KEY), every /v1 and tokenizer request needs
`Authorization: Bearer KEY` (401 otherwise); / and /health need none.

Routes: POST /v1/completions and POST /v1/chat/completions (with "stream": true, Server-Sent
Events ending in `data: [DONE]`; completions' echo with logprobs scores the prompt's tokens too),
GET /v1/models, GET /health (200 with the engine's numbers once the programs that serve every request
are compiled, the faster variants compiling after; 503 while compiling or stopping, and once the
engine has failed, with why: serve.py then exits 1), and vLLM's
GET /tokenizer_info, POST /tokenize and POST /detokenize, so that lm-evaluation-harness's
local-completions model runs against the server with nothing else.
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad
request, 404 for another model's name, 413 for a body over --max_body_bytes (8 MiB; said before
the body is read), 429 when the queue is full, 503 while starting or stopping or once the engine
has failed. A bad out_dir is one line and no server: the model loads before anything answers (HTTP
workers start first, to import meanwhile, and are stopped). The programs compile in threads: the first
ones while a checkpoint's weights are read, the rest while /health already answers; device work runs
in the engine's thread, never on the event loop. SIGTERM (or Ctrl-C) stops taking requests, ends those
in flight with their text so far (finish_reason "abort"), and exits 0; while it imports and loads the
model, at once. --uds=PATH listens on a unix socket instead of host:port (its mode the umask's, or
--uds_mode's). --http_workers=N runs the HTTP side in N processes beside this one, which keeps the
engine (serving/workers.py), for a host whose one event loop can't keep up with the engine: by default
4 on a TPU or GPU, none on a CPU.
"""

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import re
import signal
import socket
import stat
import sys
import threading
import time


def _leave_at_once(signum, frame) -> None:
    """SIGTERM or Ctrl-C while serve.py imports and loads the model (or a second one as it stops): nothing
    is open, so leave now, with one line. (A KeyboardInterrupt would print a traceback, or vanish: raised
    in JAX's gc callback, Python drops it and the start goes on.) HTTP workers started meanwhile exit as
    their pipe closes; a unix socket left behind is replaced by the next start."""
    sys.stdout.flush()
    os.write(2, f"serve.py: stopped by {signal.Signals(signum).name}\n".encode())
    os._exit(0)


def _leave_at_once_while_starting() -> None:
    """Until the programs compile: serve_with_workers and uvicorn then take these signals over (uvicorn
    gives them back once it has stopped)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _leave_at_once)


if __name__ == "__main__":  # not in the HTTP workers, which import this file as __mp_main__
    _leave_at_once_while_starting()

import jax  # noqa: E402


def _start_devices() -> None:
    """Start the devices' runtime, which takes seconds on a TPU VM (6-8 s on a v5e's), in a thread: it lets
    go of Python's lock, so the modules below import meanwhile (on a v5e, importing jax, starting the
    runtime and importing the rest took 12.6 s one after the other, 9.4 s so). An error is left to the
    main thread's first device call, which says what to do."""
    try:
        jax.devices()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":  # not in the HTTP workers, which import this file as __mp_main__
    threading.Thread(target=_start_devices, name="devices", daemon=True).start()

import numpy as np  # noqa: E402 (imports after the runtime's start: above)

import configurator  # noqa: E402
import sharding  # noqa: E402
from common import compile_cache  # noqa: E402
from devices import memory  # noqa: E402
from evals import scoring  # noqa: E402
from inference import engine, loader  # noqa: E402
from layers.quantization import MODES as QUANTIZATION_MODES  # noqa: E402
from serving import app, auth, http_server, workers  # noqa: E402


MAX_SOCKET_PATH = 107  # bytes: Linux's sun_path holds 108, with the closing NUL
AUTO_HTTP_WORKERS = 4  # on a TPU v5e's host: concurrency 64 made 31.4k output tok/s with 0, 38.1k with 2, 39.0k with 4
SCORING_THREADS = 4  # echo's prompt scoring runs the model on these, beside the engine's thread


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    init_from: str = "resume"  # 'resume' (the newest intact checkpoint in out_dir), or a Hugging Face
    #                            model: a directory or a hub name ('gpt2', 'HuggingFaceTB/SmolLM2-135M')
    out_dir: str = "out"
    host: str = "127.0.0.1"  # '0.0.0.0' serves other machines too
    port: int = 8000
    uds: str = ""  # listen on this unix socket instead of host:port (behind a proxy on the same machine, or
    #                where no TCP port may be opened); '' = host:port
    uds_mode: str = ""  # the unix socket's permissions, in octal ('660': its group may connect too; '666':
    #                     anyone on this machine); '' = as the umask leaves a new file (022: only this user)
    slots: int = 8  # requests decoding at once: rows of one KV cache
    max_queue: int = 64  # requests waiting for a slot; past that, 429
    decode_steps: int = engine.DECODE_STEPS  # tokens per slot per decode program: fewer host round trips
    #                                          per token; a new request waits for the one in flight, and a
    #                                          stream's tokens arrive in groups of about this many
    decode_attention: str = "auto"  # a decode step's attention: 'auto' (the kernel on one TPU chip with a bf16 or
    #                                 float32 cache, XLA's elsewhere) | 'pallas' (layers/decode_attention.py's kernel:
    #                                 each block of 8 slots' filled positions; one TPU chip) | 'xla' (the smallest
    #                                 prefix holding every slot's)
    max_body_bytes: int = 8 * 2**20  # a request body past this gets a 413 before it is read whole (8 MiB: a
    #                                  prompt of about 2M tokens of text, or 1M as a JSON list of ids)
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
    http_workers: int = -1  # 0: the HTTP side runs in this process, beside the engine's thread; N: in N processes
    #                         on one socket, each exchanging requests and tokens with the engine here over pipes
    #                         (serving/workers.py: where one event loop can't keep up with the engine); -1 = auto:
    #                         AUTO_HTTP_WORKERS on a TPU or GPU, 0 on a CPU
    exit_after_failure_s: float = 5.0  # once the engine has failed, /health answers 503 with why for this long
    #                                    (a load balancer's probe sees the reason), then serve.py exits 1 for its
    #                                    supervisor to restart it
    memory_check: bool = True  # False: skip the check of the compiled programs against the devices' memory
    memory_limit_gib: float = 0.0  # check against this many GiB per device; 0 = the device's own limit
    compile_cache: str = configurator.default_compile_cache()  # compiled programs are kept in this folder, and
    #                                                            a restart loads them instead of compiling; '' = off

    def __post_init__(self):
        configurator.check_init_from(self.init_from, choices=("resume",))
        if self.exit_after_failure_s < 0:
            raise configurator.ConfigError(f"exit_after_failure_s must be >= 0, got {self.exit_after_failure_s}")
        for key in ("slots", "max_queue", "decode_steps", "mesh_data", "mesh_tensor", "max_body_bytes"):
            if getattr(self, key) < 1:
                raise configurator.ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if len(os.fsencode(self.uds)) > MAX_SOCKET_PATH:
            raise configurator.ConfigError(
                f"--uds={self.uds} is {len(os.fsencode(self.uds))} bytes long; a unix "
                f"socket's path takes at most {MAX_SOCKET_PATH}: choose a shorter one"
            )
        if self.uds_mode and not re.fullmatch("[0-7]{3}", self.uds_mode):
            raise configurator.ConfigError(
                f"uds_mode must be 3 octal digits, as chmod takes them ('660'), got {self.uds_mode!r}"
            )
        if self.http_workers < -1:
            raise configurator.ConfigError(f"http_workers must be >= 0, or -1 (auto), got {self.http_workers}")
        if not 0 < self.port < 65536:
            raise configurator.ConfigError(f"port must be in 1..65535, got {self.port}")
        configurator.check_choice("quantization", self.quantization, ("auto", *QUANTIZATION_MODES))
        configurator.check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))
        configurator.check_choice("weight_dtype", self.weight_dtype, loader.WEIGHT_DTYPES)
        configurator.check_choice("kv_cache_dtype", self.kv_cache_dtype, loader.KV_CACHE_DTYPES)
        configurator.check_choice("decode_attention", self.decode_attention, engine.DECODE_ATTENTION)
        if self.decode_attention == "pallas" and self.mesh_data * self.mesh_tensor > 1:
            raise configurator.ConfigError(
                "decode_attention='pallas' runs on one device: use mesh_data=1 and "
                "mesh_tensor=1, or decode_attention='auto' or 'xla'"
            )
        if self.slots % self.mesh_data:
            raise configurator.ConfigError(
                f"slots={self.slots} is not divisible by mesh_data={self.mesh_data}: "
                f"the slots are split over it; use a multiple of {self.mesh_data}"
            )


# ----------------------------------------------------------------------------- the server


class Server:
    """The model, its tokenizer and the engine (None until compiled), and the request log."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        imported, start = compile_cache.seconds_since_start(), time.perf_counter()  # the imports, mostly
        mesh = loader.decode_mesh(cfg.mesh_data, cfg.mesh_tensor)  # starts the devices' runtime
        runtime, start = time.perf_counter() - start, time.perf_counter()
        self.early: tuple | None = None  # (setup, a Future of its engine.Programs): compile_while_loading's
        if cfg.init_from == "resume":
            compiling = concurrent.futures.ThreadPoolExecutor(1, "compile-early")
            setup, params, step, self.tok = loader.load_checkpoint(
                cfg.out_dir,
                mesh,
                cfg.quantization,
                cfg.kv_cache_dtype,
                on_setup=functools.partial(self.compile_while_loading, compiling),
            )
            compiling.shutdown(wait=False)  # its thread ends once its programs are compiled
            source = f"step {step} of {cfg.out_dir}"
        else:
            setup, params, self.tok = loader.load_hf(
                cfg.init_from, mesh, cfg.quantization, loader.default_dtype(cfg.dtype), cfg.kv_cache_dtype
            )
            source = cfg.init_from
        self.setup, self.params = setup, loader.serving_weights(setup, params, cfg.weight_dtype)
        self.context = setup.model_config.block_size
        self.name = cfg.model_name or os.path.basename(
            os.path.normpath(cfg.out_dir if cfg.init_from == "resume" else cfg.init_from)
        )
        self.created = int(time.time())
        self.engine: engine.Engine | None = None
        self.memory: dict | None = None  # the start-up memory check's numbers (memory.check)
        self.failure: str | None = None  # why the engine could not start, or stopped
        self.token_scorer = None  # echo with logprobs: made on first use
        self.scoring = concurrent.futures.ThreadPoolExecutor(SCORING_THREADS, "score")
        self.scoring_lock, self.prompts_to_score = threading.Lock(), 0  # queued or being scored
        self.after_tokens = None  # the engine's after_tokens (serving/workers.py's, with HTTP workers)
        self.stopping = False
        print(
            f"loaded {source} as '{self.name}' ({self.tok.summary()}, {setup.model_config.dtype}, "
            f"context {self.context}); {loader.memory_summary(setup, self.params)}; "
            f"{compile_cache.seconds_since_start():.1f} s after start (imports {imported:.1f} s, the devices' "
            f"runtime {runtime:.1f} s, loading {time.perf_counter() - start:.1f} s)",
            flush=True,
        )

    def compile_while_loading(self, pool, setup, tok) -> None:
        """load_checkpoint's on_setup: compile the engine's first programs from the weights' shapes on `pool`
        while the weights are read (the TPU's restore is mostly I/O and C++, which let go of Python's lock)."""
        shapes = loader.serving_shapes(setup, self.cfg.weight_dtype)
        if shapes is None:  # their shardings are known once converted: start_engine compiles them
            return
        c = self.cfg
        arguments = (setup, shapes, c.slots, tok.vocab_size, c.decode_steps, c.decode_attention)
        self.early = setup, pool.submit(engine.first_programs, *arguments)

    def programs_compiled_early(self) -> engine.Programs | None:
        """compile_while_loading's programs, if they were for the setup that loaded (not an older
        checkpoint's, nor a LoRA run's adapters'); an error compiling them is raised here."""
        if self.early is None or self.early[0] is not self.setup:
            return None
        return self.early[1].result()

    def start_engine(self, on_failure=None) -> None:
        """Compile the engine's programs (in a thread: /health answers 503 meanwhile) and check that they
        fit the devices; if they cannot, keep the reason in self.failure and call on_failure. If the
        engine's loop fails later, the same, on_failure exit_after_failure_s later."""
        on_failure = on_failure or (lambda: None)
        start = time.perf_counter()

        def fail(error):
            self.failure = str(error)
            on_failure()

        def engine_failed(failure: str):  # in the engine's thread, which has ended every request
            self.failure = failure
            exit_later = threading.Timer(self.cfg.exit_after_failure_s, on_failure)
            exit_later.daemon = True
            exit_later.start()

        try:  # XLA:TPU refuses, while compiling, programs that cannot fit: the same one line as the check's
            with memory.refusing_out_of_memory(
                "serving",
                list(self.setup.mesh.devices.flat),
                memory.serving_remedies(self.cfg, len(jax.devices())),
                self.params,
            ):
                early = self.programs_compiled_early()
                e = engine.Engine(
                    self.setup,
                    self.params,
                    self.cfg.slots,
                    self.cfg.max_queue,
                    vocab=self.tok.vocab_size,
                    decode_steps=self.cfg.decode_steps,
                    decode_attention=self.cfg.decode_attention,
                    after_tokens=self.after_tokens,
                    on_failure=engine_failed,
                    compile_later=True,  # ready on the programs that serve every request, the faster ones after
                    fits=self.fits if self.cfg.memory_check else None,
                    programs=early,
                )
        except (configurator.ConfigError, engine.EngineError) as error:
            return fail(error)
        if self.cfg.memory_check:
            try:
                self.memory = self.check_memory(e)
            except configurator.ConfigError as error:
                e.shutdown()
                return fail(error)
        self.engine = e
        print(
            f"ready {compile_cache.seconds_since_start():.1f} s after start: {e.slots} slots x {self.context} "
            f"tokens, KV cache {e.kv_bytes / 2**20:,.1f} MiB "
            f"({e.kv_bytes_per_token:,} bytes per token), weights {e.weight_bytes / 2**20:,.1f} MiB; "
            f"{len(e.buckets)} prompt buckets ({', '.join(map(str, e.buckets))}); decode attention: "
            f"{'the kernel' if e.reads_filled else 'XLA over prefix buckets'}; "
            f"compiled {compile_cache.summary()} since start ({time.perf_counter() - start:.1f} s after the load"
            f"{', the first ones beside it' if e.programs is early else ''})"
            f"{f', {e.programs_later} faster ones compile while serving' if e.programs_later else ''}",
            flush=True,
        )

    def check_memory(self, e: engine.Engine) -> dict:
        """memory.check of the engine's programs: each holds the weights and every slot's cache (its
        arguments, donated back); an admission also its prompts' activations."""
        devices = list(e.mesh.devices.flat)
        need = memory.needed([e.step_program, *e.admit_programs.values()], devices[0].platform)
        return memory.check(
            "serving", need, devices, self.cfg.memory_limit_gib, memory.serving_remedies(self.cfg, len(jax.devices()))
        )

    def fits(self, program) -> str | None:
        """Why a program the engine compiled while serving can't run on these devices (check_memory's
        check, of that program alone), or None."""
        devices = list(self.setup.mesh.devices.flat)
        need = memory.needed([program], devices[0].platform)
        remedies = memory.serving_remedies(self.cfg, len(jax.devices()))
        try:
            memory.check("the program", need, devices, self.cfg.memory_limit_gib, remedies, say=lambda line: None)
        except memory.DoesNotFit as e:
            return str(e)
        return None

    def failed(self) -> str | None:
        """Why the engine is gone, once it is: it could not start, its loop failed, or its thread is gone."""
        e = self.engine
        if self.failure or e is None or self.stopping:
            return self.failure
        return e.failure or (None if e.thread.is_alive() else "the engine's thread is gone")

    def ready(self) -> engine.Engine:
        if failure := self.failed():
            raise app.engine_failed(failure)
        if self.stopping or self.engine is None:
            raise app.unavailable(self.stopping)
        return self.engine

    # app.Backend: what serving/app.py's routes ask of a server (serving/workers.py's RemoteServer answers
    # the same from a worker process, through these).
    async def submit(self, request: engine.Request) -> None:
        try:
            self.ready().submit(request)
        except engine.EngineError as e:
            raise app.refusal(e) from None

    def cancel(self, request: engine.Request) -> None:
        if self.engine is not None:
            self.engine.cancel(request)

    async def health(self) -> tuple:
        return self.health_now()

    async def score_prompt(self, ids: list) -> list:
        return await asyncio.wrap_future(self.score_later(ids))

    def score_later(self, ids: list) -> concurrent.futures.Future:
        """prompt_logprobs(ids) on the scoring threads: a future of the Tokens, or of an APIError (a failure
        of the model's is a 500: the request's generations are then cancelled, with or without HTTP
        workers); a 429 at once while max_queue prompts are queued or being scored."""
        with self.scoring_lock:
            if self.prompts_to_score >= self.cfg.max_queue:
                raise app.APIError(
                    429,
                    f"{self.prompts_to_score} prompts are waiting to be scored already (max_queue); try again later",
                    code="queue_full",
                )
            self.prompts_to_score += 1
        return self.scoring.submit(self._score, ids)

    def _score(self, ids: list) -> list:
        try:
            return self.prompt_logprobs(ids)
        except app.APIError:
            raise
        except Exception as e:  # noqa: BLE001 - one error for the request, in OpenAI's shape
            first_line = next(iter(str(e).splitlines()), "")
            raise app.APIError(500, f"scoring the prompt failed ({type(e).__name__}: {first_line})") from None
        finally:
            with self.scoring_lock:
                self.prompts_to_score -= 1

    def health_now(self) -> tuple:
        """(status, body) of GET /health (app.health_reply): 503 while compiling, stopping or once the
        engine has failed, else 200 and the engine's numbers."""
        e = self.engine
        if failure := self.failed():
            return app.health_reply("failed", failure)
        if e is None or self.stopping:
            return app.health_reply("stopping" if self.stopping else "loading")
        return app.health_reply(
            "ok",
            numbers={
                "model": self.name,
                "context": self.context,
                "weight_bytes": e.weight_bytes,
                "kv_bytes_per_token": e.kv_bytes_per_token,
                "memory_bandwidth": e.memory_bandwidth,
                "memory": self.memory,
                **e.stats(),
            },
        )

    def prompt_logprobs(self, ids: list) -> list:
        """The prompt as engine.Tokens, as echo with logprobs reports them (lm-evaluation-harness's
        local-completions scores continuations this way): the first token has no log-probability,
        each later one its own and the engine.TOP_LOGPROBS most likely. The prompt is padded to its engine bucket,
        so there is one program per bucket, compiled on first use. Called on the scoring threads."""
        e = self.ready()
        if self.token_scorer is None:
            self.token_scorer = scoring.make_token_scorer(self.setup, engine.TOP_LOGPROBS)
        length = next(b for b in e.buckets if b >= len(ids))
        tokens_1xL = np.zeros((1, length), np.int32)
        tokens_1xL[0, : len(ids)] = ids
        with sharding.activate(e.mesh):
            picked, (top_logprobs, top_ids) = self.token_scorer(e.params, tokens_1xL)
        picked, top_logprobs, top_ids = (np.asarray(a)[0].tolist() for a in (picked, top_logprobs, top_ids))
        return [engine.Token(ids[0], None, None)] + [
            engine.Token(token, picked[t], tuple(zip(top_ids[t], top_logprobs[t]))) for t, token in enumerate(ids[1:])
        ]


# ----------------------------------------------------------------------------- running it


def summaries(server: Server, stop: threading.Event) -> None:
    """A line every log_interval seconds while requests come: slots busy, queue, tokens/s, and where a
    step's time went: the step program (dispatch and the wait for its tokens), handing the tokens out,
    admitting new requests; the rest of a step's share of the loop's busy time (the interval less its
    waits for work) went elsewhere: to waiting for Python's lock while the HTTP side runs."""
    last = last_time = None
    while not stop.wait(server.cfg.log_interval):
        if server.engine is None:
            continue
        s, now = server.engine.stats(), time.perf_counter()
        if last is None:  # the engine's counters start at zero when it starts
            last = {"tokens": 0, "steps": 0, "seconds": dict.fromkeys(s["seconds"], 0.0)}
            last_time = server.engine.started
        if s["tokens"] != last["tokens"] or s["busy"] or s["queued"]:
            steps, seconds = s["steps"] - last["steps"], now - last_time
            line = (
                f"engine: {s['busy']}/{s['slots']} slots busy, {s['queued']} queued, "
                f"{(s['tokens'] - last['tokens']) / seconds:,.1f} tok/s, {steps / seconds:,.1f} steps/s"
            )
            if steps:
                per_step = {k: (v - last["seconds"][k]) / steps * 1e3 for k, v in s["seconds"].items()}
                line += (
                    f"; a step {seconds / steps * 1e3 - per_step['idle']:.2f} ms busy: the program "
                    f"{per_step['step']:.2f}, tokens out {per_step['tokens']:.2f}, "
                    f"admitting {per_step['admit']:.2f}"
                )
            print(line, flush=True)
        last, last_time = s, now


def check_socket_path(path: str) -> None:
    """--uds=PATH can become this server's socket: its folder exists and takes new files, and PATH is
    neither something else's file nor the socket of a server still listening (a socket left by one
    that stopped is replaced, as uvicorn does)."""
    configurator.check_writable(path, "uds")
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise configurator.ConfigError(
            f"--uds={path} exists and is not a socket: serve.py won't replace it; choose another path"
        )
    with socket.socket(socket.AF_UNIX) as probe:
        listening = probe.connect_ex(path) == 0
    if listening:
        raise configurator.ConfigError(
            f"--uds={path}: another server is listening on it; stop that one, or choose another path"
        )


def listen(cfg: ServeConfig) -> socket.socket:
    """The listening socket (uvicorn's or the HTTP workers'). A unix socket's mode is the umask's or
    --uds_mode's (uvicorn would make its own 0666: anyone on the machine could connect)."""
    if cfg.uds:
        if os.path.lexists(cfg.uds):
            os.remove(cfg.uds)  # check_socket_path: a socket left by a server that stopped
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(cfg.uds)
        if cfg.uds_mode:
            os.chmod(cfg.uds, int(cfg.uds_mode, 8))
        if warning := auth.socket_warning(cfg.uds, stat.S_IMODE(os.stat(cfg.uds).st_mode), cfg.api_key):
            print(warning, flush=True)
    else:
        sock = socket.create_server((cfg.host, cfg.port), family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.listen(2048)
    return sock


def http_workers_count(cfg: ServeConfig) -> int:
    """--http_workers, its auto (-1) taking AUTO_HTTP_WORKERS where the engine runs on a TPU or GPU: the first
    of jax_platforms where that is set (JAX_PLATFORMS, or 'tpu,cpu' from `import jax` on a Cloud TPU VM), so
    that the workers need not wait seconds for the TPU runtime's start; else the devices'."""
    if cfg.http_workers != -1:
        return cfg.http_workers
    if jax.config.jax_platforms:
        platform = jax.config.jax_platforms.split(",")[0]
    else:
        try:
            platform = jax.devices()[0].platform  # started during the imports (_start_devices)
        except RuntimeError:  # the devices can't start: Server's mesh says why, in one line
            return 0
    return AUTO_HTTP_WORKERS if platform != "cpu" else 0


def remove_socket(cfg: ServeConfig) -> None:
    """Remove --uds's socket, ours once listening: nobody else listens on it now."""
    if cfg.uds and os.path.exists(cfg.uds):
        os.remove(cfg.uds)


def serve_in_process(server: Server, compile_engine) -> str | None:
    """uvicorn on this process's event loop until SIGTERM or Ctrl-C; why it could not listen, if not."""
    try:
        sock = listen(server.cfg)
    except OSError as e:
        return e.strerror

    def stop():  # the engine ends the open requests, so that their streams end and uvicorn can stop
        server.stopping = True
        if server.engine is not None:
            server.engine.stop()

    uv = http_server.StoppingUvicorn(http_server.uvicorn_config(app.make_app(server)), on_stop=stop)
    compiling = compile_engine(on_failure=lambda: setattr(uv, "should_exit", True))
    try:
        uv.run(sockets=[sock])
    finally:
        compiling.join()  # exiting while XLA compiles aborts the process
    return None


def serve_with_workers(server: Server, compile_engine, host: workers.EngineHost) -> None:
    """The workers of `host` serving HTTP, the engine here, until SIGTERM, Ctrl-C or a worker's exit."""
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    host.connect(server)
    compiling = compile_engine(on_failure=stop.set, then=lambda: host.tell("ready"))
    while not stop.wait(0.5):
        if gone := host.exited():
            exited = f"the HTTP worker {gone[0].process.name} exited (code {gone[0].process.exitcode})"
            server.failure = f"{gone[0].failure or exited}; the server stopped"
            break
    server.stopping = True
    host.tell("stopping")
    if server.engine is not None:
        server.engine.stop()  # ends the open requests, so that the workers' responses end
    host.stop_workers()
    compiling.join()


def main(argv) -> None:
    _leave_at_once_while_starting()  # again: a TPU runtime puts its own SIGTERM handler in while it starts
    cfg = configurator.load_config_or_exit(argv, ServeConfig)
    cfg = dataclasses.replace(cfg, api_key=cfg.api_key or os.environ.get("NANOMAX_API_KEY", ""))
    if warning := compile_cache.use(cfg.compile_cache):
        print(warning, flush=True)
    if cfg.uds:
        try:
            check_socket_path(cfg.uds)  # before the model loads: a typo costs nothing
        except configurator.ConfigError as e:
            sys.exit(f"config error: {e}")
    elif warning := auth.exposure_warning(cfg.host, cfg.port, cfg.api_key):
        print(warning, flush=True)
    address = f"unix socket {cfg.uds}" if cfg.uds else f"http://{cfg.host}:{cfg.port}"
    workers_count, host = http_workers_count(cfg), None
    if workers_count:  # the socket and the workers before the model loads: they import meanwhile
        try:
            sock = listen(cfg)
        except OSError as e:
            sys.exit(f"error: could not listen on {address} ({e.strerror})")
        host = workers.EngineHost(cfg, workers_count, sock)
    try:
        server = Server(cfg)
    except (OSError, ValueError) as e:  # CheckpointError, HFError, MeshError, ConfigError
        if host is not None:
            host.stop_workers()
            remove_socket(cfg)
        sys.exit(f"error: {e}")

    def compile_engine(on_failure, then=lambda: None) -> threading.Thread:
        """Compile the engine's programs in a thread (/health answers 503 meanwhile), then call `then`."""

        def start():
            server.start_engine(on_failure)
            if server.engine is not None:
                then()

        thread = threading.Thread(target=start, name="compile", daemon=True)
        thread.start()
        return thread

    stop_summaries = threading.Event()
    summarizing = threading.Thread(target=summaries, args=(server, stop_summaries), daemon=True)
    if cfg.log_interval > 0:
        summarizing.start()
    in_workers = f"; HTTP in {workers_count} worker process{'es' if workers_count > 1 else ''}" if workers_count else ""
    print(
        f"serving on {address}: the chat page at /, the API at /v1"
        f"{' (API key required)' if cfg.api_key else ''} (GET /health is 200 once compiled){in_workers}",
        flush=True,
    )
    not_listening = None
    try:
        if host is not None:
            serve_with_workers(server, compile_engine, host)
        else:
            not_listening = serve_in_process(server, compile_engine)
    finally:
        stop_summaries.set()
        if summarizing.is_alive():
            summarizing.join()  # a thread that wakes while the interpreter exits aborts the process
        if server.engine is not None:
            server.engine.shutdown()
        if not not_listening:
            remove_socket(cfg)
    if server.failure:
        sys.exit(f"error: {server.failure}")
    if not_listening:
        sys.exit(f"error: could not listen on {address} ({not_listening})")


if __name__ == "__main__":
    main(sys.argv[1:])
