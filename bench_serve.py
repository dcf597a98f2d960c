"""Latency and throughput of an OpenAI-compatible completions server under load (serve.py's, vLLM's).

    python serve.py --init_from=gpt2 --slots=16 &
    python bench_serve.py                                   # levels of 1, 4 and 16 requests in flight
    python bench_serve.py --concurrency=1,8 --requests=64 --max_tokens=128 --json=serve.json
    python bench_serve.py --url=http://127.0.0.1:8000/v1 --rate=4   # also Poisson arrivals, 4 per second
    python bench_serve.py --uds=/tmp/nanomax.sock            # a server on a unix socket (serve.py --uds)
    python bench_serve.py --concurrency=64 --processes=4     # four client processes share each level

At each --concurrency level, --requests streamed POST /v1/completions go out with at most that
many in flight (each read to its end, so that its connection serves the next); with --rate > 0 one
more level starts them at Poisson arrival times (exponential gaps, seeded) with no bound on those
in flight. Every request records when it was sent, when each chunk carrying text arrived, when it
ended, and its completion tokens (the usage the server sends last, else the chunks with text).
The metrics are vLLM's (benchmarks/serve.py):
TTFT = first token - sent; TPOT = (latency - TTFT) / (tokens - 1), over requests of >= 2 tokens;
ITL = the gaps between consecutive chunks with text; requests/s and output tokens/s over the
level's wall time. One untimed request goes first: it checks the model and warms the connection.

If GET /health reports weight_bytes, kv_bytes_per_token, memory_bandwidth and context (serve.py's
does), the decode roofline those allow is printed first; a 503 there (still compiling) is waited out.
"""

import contextlib
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import httpx2
import numpy as np
import openai

import configurator

ROOFLINE_SLOTS = (1, 8, 16)


@dataclasses.dataclass(frozen=True)
class Options:
    """bench_serve.py's flags."""

    url: str = "http://127.0.0.1:8000/v1"  # the server's OpenAI base URL
    uds: str = ""  # the server's unix socket (serve.py --uds=PATH): requests go there, and --url gives only
    #                their path (/v1) and Host header; '' = connect to --url's host and port
    model: str = ""  # '' = the first id that GET /v1/models lists
    concurrency: str = "1,4,16"  # comma-separated: the most requests in flight at each level
    rate: float = 0.0  # > 0: one more level, its requests starting at Poisson arrivals of this many
    #                    per second, with no bound on those in flight; 0 = no such level
    requests: int = 32  # requests per level
    prompt: str = "\n"  # every request's
    max_tokens: int = 64  # per request; a request may end sooner (end of text, stop strings)
    temperature: float = 0.0  # greedy by default, so that runs compare like with like
    seed: int = 1337  # of the Poisson gaps; request i also sends seed + i
    json: str = ""  # also write the results here as JSON ('' = don't)
    timeout: float = 300.0  # seconds: a request's limit, and the longest wait for /health to say ready
    processes: int = 1  # client processes sharing each level's requests and concurrency (each with its own
    #                     interpreter lock: parsing the chunks holds it)

    def __post_init__(self):
        for key in ("rate", "temperature", "timeout"):
            if not math.isfinite(getattr(self, key)):
                raise configurator.ConfigError(f"--{key} must be a finite number, got {getattr(self, key)}")
        if not self.url.startswith(("http://", "https://")):
            raise configurator.ConfigError(
                f"--url must start with http:// or https:// (e.g. http://127.0.0.1:8000/v1), got {self.url!r}"
            )
        if not all(s.strip().isdigit() and int(s) > 0 for s in self.concurrency.split(",")):
            raise configurator.ConfigError(
                f"--concurrency must be positive integers separated by commas (e.g. 1,4,16), got {self.concurrency!r}"
            )
        for key in ("requests", "max_tokens", "processes"):
            if getattr(self, key) < 1:
                raise configurator.ConfigError(f"--{key} must be >= 1, got {getattr(self, key)}")
        if self.rate < 0 or self.temperature < 0 or self.timeout <= 0:
            raise configurator.ConfigError("--rate and --temperature must be >= 0, --timeout > 0")

    @property
    def levels(self) -> list[int]:
        return [int(s) for s in self.concurrency.split(",")]


class BenchError(Exception):
    """The server or the output file cannot be used; the message says which and why."""


# ----------------------------------------------------------------------------- statistics


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100), interpolated linearly as numpy's (and vLLM's); None if empty."""
    return float(np.percentile(values, q)) if len(values) else None


def request_metrics(sent: float, token_times: list[float], end: float, n_tokens: int) -> dict:
    """One request's metrics in seconds, from its clock readings: when it was sent, when each
    chunk with text arrived, when it ended; n_tokens its completion tokens."""
    latency = end - sent
    ttft = token_times[0] - sent if token_times else None
    # a chunk may carry several tokens: TPOT spreads the time after the first over all of them
    tpot = (latency - ttft) / (n_tokens - 1) if ttft is not None and n_tokens >= 2 else None
    return {
        "latency": latency,
        "ttft": ttft,
        "tpot": tpot,
        "output_tokens": n_tokens,
        "itl": [later - earlier for earlier, later in zip(token_times, token_times[1:])],
    }


def spread_ms(seconds: list[float]) -> dict:
    """Mean, median and 99th percentile, in milliseconds (None where there are no values)."""
    if not seconds:
        return {"mean": None, "p50": None, "p99": None}
    ms = [s * 1e3 for s in seconds]
    return {"mean": float(np.mean(ms)), "p50": percentile(ms, 50), "p99": percentile(ms, 99)}


def summarize(metrics: list[dict], wall_seconds: float, errors: list[str] = ()) -> dict:
    """A level's numbers: its successful requests' metrics (request_metrics), the level's wall
    time from the first request sent to the last one ended, and the failed requests' errors."""
    tokens = sum(m["output_tokens"] for m in metrics)
    per_second = (lambda n: n / wall_seconds) if wall_seconds > 0 else (lambda n: None)
    return {
        "ok": len(metrics),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall_seconds,
        "output_tokens": tokens,
        "requests_per_s": per_second(len(metrics)),
        "output_tokens_per_s": per_second(tokens),
        "ttft_ms": spread_ms([m["ttft"] for m in metrics if m["ttft"] is not None]),
        "tpot_ms": spread_ms([m["tpot"] for m in metrics if m["tpot"] is not None]),
        "itl_ms": spread_ms([gap for m in metrics for gap in m["itl"]]),
        "latency_ms": spread_ms([m["latency"] for m in metrics]),
    }


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Start times in seconds of n requests arriving as a Poisson process of `rate` per second:
    the first at 0, then exponential gaps of mean 1/rate."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def decode_roofline(health: dict, slots=ROOFLINE_SLOTS) -> list[dict] | None:
    """The fastest decode step memory bandwidth allows at each slot count, if /health's JSON has
    weight_bytes, kv_bytes_per_token, memory_bandwidth (bytes/s) and context; else None.
    Every step reads the weights and each slot's cache, here full: the most bytes a step reads."""
    keys = ("weight_bytes", "kv_bytes_per_token", "memory_bandwidth", "context")
    values = [health.get(k) for k in keys] if isinstance(health, dict) else []
    if len(values) != len(keys) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values
    ):
        return None
    weight_bytes, kv_bytes_per_token, bandwidth, context = values
    rows = []
    for n in slots:
        step_bytes = weight_bytes + n * context * kv_bytes_per_token
        step_s = step_bytes / bandwidth
        rows.append({"slots": n, "bytes_per_step": step_bytes, "step_s": step_s, "tokens_per_s": n / step_s})
    return rows


# ----------------------------------------------------------------------------- the server


def health_url(base_url: str) -> str:
    """GET /health sits beside /v1, not under it."""
    base = base_url.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/health"


def not_live(response) -> str | None:
    """The reason in a 503 from /health whose body says the server is not live (it won't become ready)."""
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("live") is False:
        return str((body.get("error") or {}).get("message", body))
    return None


def server_health(http: httpx2.Client, base_url: str, timeout: float) -> dict | None:
    """GET /health's JSON once the server is ready; None if it has no such route or no JSON there.
    A 503 (serve.py: the programs are still compiling) is waited out, up to timeout seconds; one that
    says the server is not live (serve.py: its engine failed) is a BenchError with the server's reason."""
    url, deadline, said = health_url(base_url), time.monotonic() + timeout, False
    while True:
        try:
            response = http.get(url, timeout=timeout)
        except httpx2.HTTPError:  # no route there
            return None
        if response.status_code != 503:
            try:
                body = response.json() if response.status_code == 200 else None
            except ValueError:  # not JSON (vLLM's is empty): no roofline
                return None
            return body if isinstance(body, dict) else None
        if (failed := not_live(response)) is not None:
            raise BenchError(f"{url} answers 503, not live: {failed}")
        if time.monotonic() > deadline:
            raise BenchError(f"{url} still answers 503 (not ready) after {timeout:g} s")
        if not said:
            print(f"waiting for {url} to answer 200 (503: the server is starting)", file=sys.stderr)
            said = True
        time.sleep(1.0)


def root_cause(e: BaseException) -> str:
    """The innermost exception's text: 'Connection refused' rather than the client's 'Connection error.'."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return str(e) or type(e).__name__


def http_client(options: Options) -> httpx2.Client:
    """The connections: to --url's host and port, or to the unix socket --uds, pooled as the openai
    client's own (up to 1,000 at once, so that a level's requests never wait for a connection)."""
    transport = httpx2.HTTPTransport(uds=options.uds or None, limits=openai.DEFAULT_CONNECTION_LIMITS)
    return openai.DefaultHttpxClient(transport=transport, timeout=options.timeout)


def make_client(options: Options, http: httpx2.Client):
    # No retries: a retried request would hide its failure.
    return openai.OpenAI(
        base_url=options.url, api_key="bench_serve", max_retries=0, timeout=options.timeout, http_client=http
    )


def where(options: Options) -> str:
    return f"{options.url} on the unix socket {options.uds}" if options.uds else options.url


def resolve_model(client, options: Options) -> str:
    """The model to ask for; listing them also tells whether a server is there at all."""
    try:
        ids = [m.id for m in client.models.list().data]
    except openai.APIConnectionError as e:
        raise BenchError(f"no server at {where(options)} ({root_cause(e)})") from None
    except openai.APIStatusError as e:
        raise BenchError(
            f"GET {options.url.rstrip('/')}/models answered {e.status_code}: is --url an "
            f"OpenAI-compatible base URL (ending in /v1)?"
        ) from None
    except openai.OpenAIError as e:
        raise BenchError(f"GET {options.url.rstrip('/')}/models failed: {e}") from None
    if options.model:
        return options.model
    if not ids:
        raise BenchError(f"GET {options.url.rstrip('/')}/models lists no model: give --model")
    return ids[0]


class RequestFailed(Exception):
    """The server answered a completion with an error status; the message has the status and its text."""


AUTHORIZATION = {"Authorization": "Bearer bench_serve"}  # what the openai client sends with api_key="bench_serve"


def error_message(body: bytes) -> str:
    """An OpenAI-shaped error body's message, or the body's first 200 characters."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


FAILURES = (RequestFailed, httpx2.HTTPError, ValueError)  # a request that failed, as its level counts it


# The completions are streamed with httpx directly, not through the openai client: that client stops
# reading at "data: [DONE]" and closes the connection (the body's end is not read yet), so every request
# would open a new one, and it builds a model object per chunk. Through the same server on a TPU VM's
# host, concurrency 64: 21,656 tok/s through the openai client, 28,017 like this (docs/tpu.md).
def stream_completion(http: httpx2.Client, options: Options, model: str, seed: int, max_tokens: int) -> dict:
    """One streamed completion, timed, read to its end (so its connection serves the next); raises
    RequestFailed, httpx2's error or ValueError (a chunk that is not JSON) if it fails."""
    body = {
        "model": model,
        "prompt": options.prompt,
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    token_times, usage_tokens, done_at = [], None, None
    with http.stream("POST", options.url.rstrip("/") + "/completions", json=body, headers=AUTHORIZATION) as reply:
        if reply.status_code != 200:
            raise RequestFailed(f"{reply.status_code}: {error_message(reply.read())}")
        for line in reply.iter_lines():
            arrived = time.perf_counter()  # before any work on the chunk
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":  # the request's end, as the openai client sees it (the body's end follows)
                done_at = arrived
                continue
            chunk = json.loads(data)
            if not isinstance(chunk, dict) or chunk.get("error"):
                raise RequestFailed(f"an error event: {error_message(data.encode())}")
            choices = chunk.get("choices") or [{}]
            if choices[0].get("text"):
                token_times.append(arrived)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
    end = done_at or time.perf_counter()
    return request_metrics(sent, token_times, end, len(token_times) if usage_tokens is None else usage_tokens)


def run_level(
    clients, options: Options, model: str, concurrency: int | None, offsets: list[float] | None = None
) -> dict:
    """options.requests requests, at most `concurrency` in flight (None: no bound), each sent at
    once or, given offsets, at its offset in seconds from the level's start. clients: an httpx
    client, or a pool of client processes (--processes) that share the requests and the concurrency."""
    if not isinstance(clients, ProcessPoolExecutor):
        outcomes, start, end = send(clients, options, model, list(range(options.requests)), concurrency, offsets)
    else:
        n = min(options.processes, concurrency or options.requests, options.requests)
        # Process p runs up to share[p] requests at once, and takes requests in proportion to it.
        share = [None] * n if concurrency is None else [concurrency // n + (p < concurrency % n) for p in range(n)]
        turns = [p for r in range(share[0] or 1) for p in range(n) if (share[p] or 1) > r]  # share[0] is the most
        indices = [[i for i in range(options.requests) if turns[i % len(turns)] == p] for p in range(n)]
        start_at = time.perf_counter() + 0.1  # every process's clock: perf_counter is the system's monotonic clock
        shares = [
            clients.submit(
                _send_share,
                model,
                indices[p],
                share[p],
                None if offsets is None else [offsets[i] for i in indices[p]],
                start_at,
            )
            for p in range(n)
            if indices[p]
        ]
        results = [s.result() for s in shares]
        outcomes = [o for share_outcomes, _, _ in results for o in share_outcomes]
        start, end = start_at, max(r[2] for r in results)
    return summarize(
        [o for o in outcomes if isinstance(o, dict)], end - start, [o for o in outcomes if isinstance(o, str)]
    )


def send(
    http: httpx2.Client,
    options: Options,
    model: str,
    indices: list[int],
    concurrency: int | None,
    offsets: list[float] | None,
    start_at: float | None = None,
) -> tuple[list, float, float]:
    """Requests number `indices` (their seeds), at most `concurrency` in flight, each at once or at its
    offset from start_at (default now); returns (each one's metrics or error, start, end)."""

    def one(i: int):
        try:
            return stream_completion(http, options, model, options.seed + i, options.max_tokens)
        except FAILURES as e:
            return f"{type(e).__name__}: {e}"

    # Threads, not asyncio: httpx's client is thread-safe, a pool of `concurrency` workers bounds the
    # requests in flight exactly, and each waits on its own socket, so a chunk is timed when it
    # arrives; one event loop would time it only once the loop got round to it.
    with ThreadPoolExecutor(max_workers=concurrency or len(indices)) as pool:
        time.sleep(max(0.0, (start_at or 0.0) - time.perf_counter()))
        start = start_at or time.perf_counter()
        futures = []
        for k, i in enumerate(indices):
            if offsets is not None:
                time.sleep(max(0.0, start + offsets[k] - time.perf_counter()))
            futures.append(pool.submit(one, i))
        outcomes = [f.result() for f in futures]
    return outcomes, start, time.perf_counter()


_process: dict = {}  # a client process's options, http client and start barrier, set when it starts


def _start_client_process(options: Options, model: str, everyone) -> None:
    http = http_client(options)
    with contextlib.suppress(*FAILURES):  # untimed: connects (a failure shows in the levels)
        stream_completion(http, options, model, options.seed, min(2, options.max_tokens))
    _process.update(options=options, http=http, everyone=everyone)


def _wait_for_every_process(_) -> None:
    _process["everyone"].wait(_process["options"].timeout)


def _send_share(
    model: str, indices: list[int], concurrency: int | None, offsets: list[float] | None, start_at: float
) -> tuple[list, float, float]:
    return send(_process["http"], _process["options"], model, indices, concurrency, offsets, start_at)


def client_processes(options: Options, model: str) -> ProcessPoolExecutor:
    """--processes client processes, each with its own connections (started fresh: a fork would copy
    this process's threads' locks), every one started and connected before any level is timed."""
    spawn = multiprocessing.get_context("spawn")
    everyone = spawn.Barrier(options.processes)
    pool = ProcessPoolExecutor(
        options.processes, mp_context=spawn, initializer=_start_client_process, initargs=(options, model, everyone)
    )
    # each of these waits for all the others, so every process runs one (the pool starts them as needed)
    list(pool.map(_wait_for_every_process, range(options.processes)))
    return pool


# ----------------------------------------------------------------------------- output


def level_name(level: dict) -> str:
    return f"c={level['concurrency']}" if level["concurrency"] else f"rate={level['rate']:g}/s"


def format_table(levels: list[dict]) -> str:
    def pair(spread: dict) -> str:
        return "-" if spread["p50"] is None else f"{spread['p50']:.1f} / {spread['p99']:.1f}"

    def number(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"  {'level':>11} {'ok/failed':>9} {'req/s':>7} {'out tok/s':>9} {'TTFT p50/p99 ms':>17} "
        f"{'TPOT p50/p99 ms':>17} {'ITL p50/p99 ms':>17}"
    ]
    for r in levels:
        ok_failed = f"{r['ok']}/{r['failed']}"
        lines.append(
            f"  {level_name(r):>11} {ok_failed:>9} {number(r['requests_per_s'], '.2f'):>7} "
            f"{number(r['output_tokens_per_s'], ',.1f'):>9} {pair(r['ttft_ms']):>17} "
            f"{pair(r['tpot_ms']):>17} {pair(r['itl_ms']):>17}"
        )
    lines += [
        f"  {level_name(r)}: {r['failed']} failed, the first with {r['first_error']}" for r in levels if r["failed"]
    ]
    return "\n".join(lines)


def format_roofline(health: dict, rows: list[dict]) -> str:
    lines = [
        f"  decode roofline from GET /health: weights {health['weight_bytes'] / 2**20:,.1f} MiB, "
        f"KV cache {health['kv_bytes_per_token']:,.0f} bytes/token x context {health['context']:,.0f}, "
        f"bandwidth {health['memory_bandwidth'] / 1e9:,.1f} GB/s; every slot's cache full, "
        f"the most a step reads",
        f"  {'slots':>11} {'MiB/step':>9} {'ms/step':>9} {'tokens/s':>10}",
    ]
    lines += [
        f"  {r['slots']:>11} {r['bytes_per_step'] / 2**20:>9,.1f} {r['step_s'] * 1e3:>9.3f} {r['tokens_per_s']:>10,.1f}"
        for r in rows
    ]
    return "\n".join(lines)


def check_writable(path: str) -> None:
    """Before the run, so that a long run is not lost to a typo in --json."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise BenchError(
            f"cannot write --json={path}: "
            + ("it is a directory" if os.path.isdir(path) else f"{folder} is not a writable directory")
        )


def write_json(path: str, record: dict) -> None:
    """Through FILE.tmp and a rename, so that FILE is never half written."""
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise BenchError(f"cannot write --json={path}: {e.strerror or e}") from None


# ----------------------------------------------------------------------------- main


def run(argv: list[str]) -> dict:
    """Parse flags, find the server and model, run each level, print the table, write the JSON."""
    options = configurator.load_config_or_exit(argv, Options)
    if options.json:
        check_writable(options.json)
    http = http_client(options)
    client = make_client(options, http)
    model = resolve_model(client, options)
    health = server_health(http, options.url, options.timeout)
    roofline = decode_roofline(health)
    try:  # untimed: a wrong model or parameter is one error here, not a table of failures
        stream_completion(http, options, model, options.seed, min(2, options.max_tokens))
    except FAILURES as e:
        raise BenchError(f"the first request failed: {type(e).__name__}: {e}") from None
    print(
        f"bench_serve: {model} at {where(options)}; {options.requests} requests per level, prompt "
        f"{options.prompt!r}, max_tokens {options.max_tokens}, temperature {options.temperature:g}"
        + (f", {options.processes} client processes" if options.processes > 1 else "")
    )
    if roofline:
        print(format_roofline(health, roofline))
    levels = []
    with contextlib.ExitStack() as stack:
        clients = stack.enter_context(client_processes(options, model)) if options.processes > 1 else http
        for concurrency in options.levels:
            levels.append({"concurrency": concurrency, "rate": None} | run_level(clients, options, model, concurrency))
        if options.rate > 0:
            offsets = poisson_offsets(options.requests, options.rate, options.seed)
            levels.append(
                {"concurrency": None, "rate": options.rate} | run_level(clients, options, model, None, offsets)
            )
    print(format_table(levels))
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "options": dataclasses.asdict(options),
        "model": model,
        "health": health,
        "roofline": roofline,
        "levels": levels,
    }
    if options.json:
        write_json(options.json, record)
        print(f"  written to {options.json}")
    return record


def main(argv: list[str]) -> None:
    """The command line: a bad flag, no server or an unwritable --json is one line, no traceback."""
    try:
        run(argv)
    except BenchError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
