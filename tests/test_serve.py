"""serve.py over inference/engine.py: the real server (uvicorn on 127.0.0.1, a free port) on a tiny model
trained here, talked to with the openai client and with raw HTTP."""

import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import httpx2
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import tokenizers
from flax import nnx
from test_hf import random_hf_llama, write_hf_llama
from test_train import small_config

import bench_serve
import serve
import train
from data import chat_template, tokenizer
from inference import engine, generate, loader
from layers import kv_cache
from serving import app, workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:!?., \n"  # the default chat template's too
CHARS = LETTERS + "".join(chr(0x100 + i) for i in range(65 - len(LETTERS)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-layer model trained a few steps on text over a 65-character vocabulary with letters."""
    root = tmp_path_factory.mktemp("serve")
    data = root / "data" / "toy"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    phrases = rng.integers(0, len(CHARS), size=(8, 12))
    for split, n in (("train", 20_000), ("val", 2_000)):
        phrases[rng.integers(0, 8, size=n // 12 + 1)].reshape(-1)[:n].astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps({"kind": "char", "chars": CHARS, "vocab_size": len(CHARS)}))
    config = small_config(root, block_size=32, max_iters=30, eval_interval=30, learning_rate=1e-2)
    train.train(config, jax.devices()[:1])
    return config.out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags, script: str | None = None, compile_cache: str | None = None) -> tuple:
    """(url, process) of serve.py with these flags on a free port, once /health says 200 (`script`: Python
    that runs serve.main in serve.py's place; `compile_cache`: its --compile_cache, a folder that servers of
    the same model and slots share; default the session's, conftest.py's). A thread reads its output as it
    comes (output_of, logged)."""
    port = free_port()
    command = [os.path.join(ROOT, "serve.py")] if script is None else ["-c", script]
    cache = [] if compile_cache is None else [f"--compile_cache={compile_cache}"]
    process = subprocess.Popen(
        [sys.executable, *command, *flags, *cache, f"--port={port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    process.lines = []
    process.reader = threading.Thread(target=lambda: process.lines.extend(process.stdout), daemon=True)
    process.reader.start()
    url = f"http://127.0.0.1:{port}"
    deadline, status = time.time() + 180, None
    while time.time() < deadline and process.poll() is None:
        try:
            status = urllib.request.urlopen(url + "/health", timeout=5).status
            break
        except urllib.error.HTTPError as e:
            assert e.code == 503  # warming up
        except OSError:
            pass
        time.sleep(0.3)
    assert status == 200, output_of(process) if process.poll() is not None else "no 200 from /health"
    return url, process


def output_of(process) -> str:
    """Everything a server of start_server's wrote, once it has exited."""
    process.wait(timeout=60)
    process.reader.join(timeout=10)
    return "".join(process.lines)


def logged(process, words: str) -> str:
    """The first line of a running server's output with these words in it (within 10 s)."""
    deadline = time.time() + 10
    while not (found := [line for line in process.lines if words in line]):
        assert time.time() < deadline, f"no line with {words!r} in {''.join(process.lines)}"
        time.sleep(0.05)
    return found[0]


def stopped(process) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


KEY = "s3cret"  # the servers' API key
BODY_LIMIT = 2**16  # their --max_body_bytes: the 413 test sends about this much
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}


def run_server(run, http_workers: int):
    url, process = start_server(
        f"--out_dir={run}",
        "--slots=4",
        "--max_queue=16",
        "--log_interval=0",
        f"--api_key={KEY}",
        f"--max_body_bytes={BODY_LIMIT}",
        f"--http_workers={http_workers}",
    )
    yield url, process
    stopped(process)


@pytest.fixture(scope="module")
def server(run):
    """The server on the trained run, the HTTP side on the engine's process."""
    yield from run_server(run, 0)


@pytest.fixture(scope="module")
def worker_server(run):
    """The same with the HTTP side in two worker processes (--http_workers, serving/workers.py) that
    exchange requests and tokens with the engine's over pipes. The file's last test stops it."""
    yield from run_server(run, 2)


@pytest.fixture(params=["in-process", "http-workers"])
def either_server(request):
    """For the tests of what the workers change (what crosses the pipes: tokens, log-probabilities, scores,
    refusals, cancels; the API key and the body limit, which the workers apply): server, then worker_server."""
    return request.getfixturevalue("server" if request.param == "in-process" else "worker_server")


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A random model in the Llama layout, wide enough that every token takes a while (67 MB of float32
    weights read per step), with a 256-token context and the character vocabulary: a greedy stream of
    254 tokens lasts seconds, so a client that leaves or a signal sent after its first tokens does so
    mid-stream."""
    directory = tmp_path_factory.mktemp("slow") / "model"
    shape = dict(n_layer=1, hidden=1024, heads=8, kv_heads=8, intermediate=4096, vocab_size=len(CHARS), tied=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": len(CHARS),
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    write_hf_llama(directory, random_hf_llama(**shape), config)
    tokenizer.char_tokenizer(CHARS).save_files(directory)
    return directory


@pytest.fixture(scope="module")
def slow_programs(tmp_path_factory):
    """The compilation cache of the four servers on slow_model with one slot: the programs they compile at
    start-up are the same (no test of theirs counts compilations), so all but the first load them."""
    return str(tmp_path_factory.mktemp("slow-programs"))


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "http-workers"])
def slow_server(slow_model, slow_programs, request):
    """serve.py on slow_model with one slot. Its last test stops it with SIGTERM."""
    url, process = start_server(
        f"--init_from={slow_model}",
        "--slots=1",
        "--log_interval=0",
        f"--http_workers={request.param}",
        compile_cache=slow_programs,
    )
    yield url, process
    stopped(process)


POISON = 666  # the seed of a request whose decode program fails in FAULTY_SERVE

# serve.py with the failures a device can have, raised where the device raises them (XLA's runtime error; no
# request makes a correct engine's step fail, and a flag to fake one would be serving code for tests only):
# a decode program running a request seeded POISON fails, and so does scoring a prompt (echo with logprobs).
FAULTY_SERVE = f"""
import sys
import jax
import serve
from evals import scoring
from inference import engine

def fail(what):
    raise jax.errors.JaxRuntimeError(f"INTERNAL: {{what}} failed on the device\\nthe rest of XLA's message")

use = engine.Engine._use

def use_poisoned(self, key, program):  # every decode program the engine runs, compiled before ready or after
    def run(params, state, active):
        if any(r is not None and r.seed == {POISON} for r in self.running):
            fail("the decode program")
        return program(params, state, active)
    use(self, key, run if key[0] == "decode" else program)

engine.Engine._use = use_poisoned
scoring.make_token_scorer = lambda *args: lambda *args: fail("scoring")
serve.main(sys.argv[1:])
"""


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "http-workers"])
def faulty_server(slow_model, slow_programs, request):
    """A server of FAULTY_SERVE's on slow_model with one slot, in-process and with two HTTP workers. Its last
    test makes its engine fail."""
    url, process = start_server(
        f"--init_from={slow_model}",
        "--slots=1",
        "--log_interval=0",
        "--exit_after_failure_s=2",  # the test probes the failed server within it
        f"--http_workers={request.param}",
        script=FAULTY_SERVE,
        compile_cache=slow_programs,
    )
    yield url, process
    stopped(process)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[0])


@pytest.fixture(scope="module")
def gpt2_vocab_model(tmp_path_factory):
    """A tiny random model with GPT-2's tokenizer, which writes a character outside ASCII as 2 or 3 byte tokens."""
    directory = tmp_path_factory.mktemp("gpt2-vocab") / "model"
    shape = dict(n_layer=1, hidden=16, heads=2, kv_heads=2, intermediate=32, vocab_size=50257, tied=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 50257,
        "max_position_embeddings": 16,  # one prompt bucket to compile
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    write_hf_llama(directory, random_hf_llama(**shape), config)
    tokenizer.gpt2_tokenizer().save_files(directory)
    return directory


def echoed_offsets(client) -> list:
    reply = client.completions.create(model="model", prompt="ⓐb", max_tokens=1, temperature=0, echo=True, logprobs=0)
    assert reply.choices[0].text.startswith("ⓐb")
    return reply.choices[0].logprobs.text_offset


@pytest.fixture(scope="module")
def loaded(run):
    return loader.load_checkpoint(run)


def post(url, body, raw: bytes | None = None):
    """(status, JSON body) of a POST, errors included."""
    request = urllib.request.Request(
        url,
        data=raw if raw is not None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **AUTHORIZED},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_lines(url, body):
    """The non-empty lines of a streamed completion, read as they come over raw HTTP; leaving the
    `with` hangs up."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **AUTHORIZED},
    )
    return urllib.request.urlopen(request, timeout=60)


def lines_of(response):
    return (line for line in (raw.decode().strip() for raw in response) if line)


def streamed_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_greedy_completion_equals_generate_streamed_or_not(client, loaded):
    setup, params, _, tok = loaded
    ids = generate.encode_prompt(tok, "hello world")
    expected = generate.generate(setup, params, [ids], 12, temperature=0).tokens[0]
    whole = client.completions.create(model="out", prompt="hello world", max_tokens=12, temperature=0)
    assert whole.choices[0].text == tok.decode(expected)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 12)
    stream = client.completions.create(model="out", prompt="hello world", max_tokens=12, temperature=0, stream=True)
    assert streamed_text(stream) == (whole.choices[0].text, "length")
    echo = client.completions.create(model="out", prompt="hello world", max_tokens=12, temperature=0, echo=True)
    assert echo.choices[0].text == "hello world" + whole.choices[0].text
    # Any integer is a seed (the device's are int32: taken modulo 2^31)
    assert client.completions.create(model="out", prompt="hi", max_tokens=2, seed=2**40).usage.completion_tokens == 2


def test_eight_concurrent_seeded_streams_each_equal_the_request_alone(client, loaded):
    """Continuous batching on 4 slots: 8 streams at once, each with its own seed and settings, give
    what each gives alone; and a seeded request is what inference/generate.py draws for its first row."""
    setup, params, _, tok = loaded
    settings = [dict(seed=s, temperature=0.5 + s / 8, top_k=(0, 5)[s % 2], top_p=(1.0, 0.9)[s // 4]) for s in range(8)]
    ask = lambda s: streamed_text(
        client.completions.create(  # top_k is an extension: extra_body
            model="out",
            prompt="abc",
            max_tokens=20,
            stream=True,
            seed=s["seed"],
            temperature=s["temperature"],
            top_p=s["top_p"],
            extra_body={"top_k": s["top_k"]},
        )
    )
    alone = [ask(s) for s in settings]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, settings))
    assert together == alone
    assert len({text for text, _ in alone}) > 4  # the settings matter
    s = settings[3]
    expected = generate.generate(
        setup,
        params,
        [generate.encode_prompt(tok, "abc")],
        20,
        seed=s["seed"],
        temperature=s["temperature"],
        top_k=s["top_k"],
        top_p=s["top_p"],
    ).tokens[0]
    assert alone[3][0] == tok.decode(expected)


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(model="out", prompt="abc", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:7]
    cut = full[: full.find(stop)]
    for stream in (False, True):
        reply = client.completions.create(
            model="out", prompt="abc", max_tokens=20, temperature=0, stop=[stop], stream=stream
        )
        assert (streamed_text(reply) if stream else (reply.choices[0].text, reply.choices[0].finish_reason)) == (
            cut,
            "stop",
        )


def test_usage_counts_the_tokens_of_the_text_and_of_the_stop_string_not_past_it(either_server):
    """The tokens of the reply's text and of the stop string that ended it, none that the engine made after
    it in the same decode program: in usage (whole, and the stream's last chunk), in the request log and in
    the logprobs (text_offset runs on past the text through the stop's). One character per token here."""
    url, process = either_server
    client = openai_client(url)
    asked = dict(model="out", prompt="abc", max_tokens=20, temperature=0, logprobs=1)
    full = client.completions.create(**asked).choices[0]
    stop = full.text[3:5]  # two tokens, as the first decode program's tokens arrive (its 8 and 4 more)
    cut = full.text[: full.text.find(stop)]
    counted = len(cut) + len(stop)
    whole = client.completions.create(**asked, stop=stop)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    assert whole.usage.completion_tokens == counted
    assert whole.choices[0].logprobs.tokens == full.logprobs.tokens[:counted]
    assert whole.choices[0].logprobs.text_offset == list(range(counted))
    assert re.search(
        rf"request {whole.id}: \d+ prompt \+ {counted} completion tokens, .*, stop$", logged(process, whole.id)
    )
    stream = list(client.completions.create(**asked, stop=stop, stream=True, stream_options={"include_usage": True}))
    assert (
        "".join(c.choices[0].text for c in stream if c.choices) == cut and stream[-1].usage.completion_tokens == counted
    )
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == full.logprobs.tokens[:counted]
    assert f"{counted} completion tokens" in logged(process, stream[0].id)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="out", messages=messages, max_tokens=20, temperature=0)
    stop = chat.choices[0].message.content[2:4]
    counted = chat.choices[0].message.content.find(stop) + len(stop)
    stopped_chat = client.chat.completions.create(
        model="out", messages=messages, max_tokens=20, temperature=0, stop=stop, logprobs=True
    )
    assert stopped_chat.usage.completion_tokens == len(stopped_chat.choices[0].logprobs.content) == counted


def test_chat_renders_the_template_and_streams_the_role_first(client, server, loaded):
    _, _, _, tok = loaded
    messages = [{"role": "user", "content": "hi there"}]
    ids = tok.encode(chat_template.render(tok, messages))
    as_completion = client.completions.create(model="out", prompt=ids, max_tokens=10, temperature=0)
    reply = client.chat.completions.create(model="out", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == as_completion.choices[0].text
    assert reply.usage.prompt_tokens == len(ids) and reply.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(model="out", messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_are_the_models_own(client, loaded):
    """Completions' logprobs=k and chat's logprobs + top_logprobs=k: the model's log-softmax at
    each step (before temperature), the chosen token's and the k most likely."""
    setup, params, _, tok = loaded
    ids = generate.encode_prompt(tok, "hello")
    logits = nnx.merge(setup.graphdef, params)(jnp.asarray([ids]))[0, -1, : tok.vocab_size]
    expected = np.asarray(jax.nn.log_softmax(logits))
    best = np.argsort(-expected)[:3]
    reply = client.completions.create(model="out", prompt="hello", max_tokens=4, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert lp.tokens[0] == tok.decode([best[0]]) and len(lp.token_logprobs) == 4
    np.testing.assert_allclose(lp.token_logprobs[0], expected[best[0]], atol=1e-4)
    assert list(lp.top_logprobs[0]) == [tok.decode([i]) for i in best]
    np.testing.assert_allclose(list(lp.top_logprobs[0].values()), expected[best], atol=1e-4)
    assert "".join(lp.tokens) == reply.choices[0].text and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    messages = [{"role": "user", "content": "hi"}]
    content = (
        client.chat.completions.create(
            model="out", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
        )
        .choices[0]
        .logprobs.content
    )
    assert len(content) == 4 and all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content
    )  # greedy: the chosen token is the most likely


def test_echo_with_logprobs_scores_the_prompt_and_tokenizer_routes_match(either_server, loaded):
    """echo + logprobs (what lm-evaluation-harness's local-completions asks): every prompt token after
    the first with the model's log-probability of it and the k most likely, then the new tokens; and
    vLLM's /tokenize, /detokenize and /tokenizer_info give serve.py's own ids."""
    setup, params, _, tok = loaded
    url, client = either_server[0], openai_client(either_server[0])
    health = lambda: json.loads(urllib.request.urlopen(url + "/health").read())
    assert health()["compiles_while_serving"] == 0  # the requests so far all ran on the start-up programs
    ids = generate.encode_prompt(tok, "hello world")
    logits = nnx.merge(setup.graphdef, params)(jnp.asarray([ids]))[0, :, : tok.vocab_size]
    expected = np.asarray(jax.nn.log_softmax(logits))
    reply = client.completions.create(
        model="out", prompt="hello world", max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    lp = reply.choices[0].logprobs
    assert lp.tokens == [tok.decode([i]) for i in ids] + [tok.decode([expected[-1].argmax()])]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(
        lp.token_logprobs[1:], [expected[t, i] for t, i in enumerate(ids[1:] + [expected[-1].argmax()])], atol=1e-4
    )
    best = np.argsort(-expected[2])[:2]
    assert list(lp.top_logprobs[3]) == [tok.decode([i]) for i in best]
    assert lp.text_offset == list(range(len(ids) + 1)) and reply.choices[0].text.startswith("hello world")
    assert post(url + "/tokenize", {"prompt": "hello", "add_special_tokens": False})[1]["tokens"] == tok.encode("hello")
    assert post(url + "/detokenize", {"tokens": tok.encode("hello")})[1] == {"prompt": "hello"}
    info = httpx2.get(url + "/tokenizer_info", headers=AUTHORIZED, timeout=10).json()
    assert info["model_max_length"] == 32 and info["eos_token"] is None  # a character vocabulary has none
    assert post(url + "/tokenize", {"prompt": 3})[0] == 400


def test_echoed_offsets_start_where_each_tokens_character_starts(gpt2_vocab_model):
    """'ⓐb' is 4 GPT-2 tokens, ⓐ's 3 bytes and b: the echoed text_offsets are OpenAI's, each token at the
    start of the character its first byte belongs to (0, 0, 0, 1), and the first new token's after them (2).
    (With HTTP workers: test_a_unix_socket_others_may_use_without_a_key_...)"""
    url, process = start_server(f"--init_from={gpt2_vocab_model}", "--slots=1", "--log_interval=0", "--http_workers=0")
    try:
        assert echoed_offsets(openai_client(url)) == [0, 0, 0, 1, 2]
    finally:
        stopped(process)


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        (None, 400, None, "not valid JSON"),
        ({"prompt": "ab", "max_tokens": "x"}, 400, "max_tokens", "an integer >= 1"),
        ({"prompt": "ab", "max_tokens": 0}, 400, "max_tokens", "an integer >= 1"),
        ({"prompt": "ab", "temperature": -1}, 400, "temperature", "[0, 2]"),
        ({"prompt": ""}, 400, "prompt", "empty"),
        ({"prompt": "a" * 40}, 400, "prompt", "context is 32 tokens"),
        ({"prompt": "ab", "frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
        ({"prompt": "ab", "logprobs": 6}, 400, "logprobs", "[0, 5]"),
        ({"prompt": "ab", "top-k": 3}, 400, "top-k", "unknown parameter"),
        ({"prompt": "ab", "model": "gpt-4"}, 404, "model", "does not exist"),
        ({"prompt": "☃"}, 400, "prompt", "can't be encoded"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param, words):
    got, reply = post(server[0] + "/v1/completions", body, raw=b"{not json" if body is None else None)
    assert got == status
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and words in reply["error"]["message"]


def test_a_request_the_queue_cannot_hold_is_429_and_none_of_it_runs(either_server):
    """2 prompts x 16 = 32 generations at once; 4 slots + max_queue 16 hold 20: a 429, and the 20 taken are
    cancelled."""
    url = either_server[0]
    before = wait_until_idle(url)
    got, reply = post(url + "/v1/completions", {"prompt": ["ab", "ba"], "n": 16, "max_tokens": 20})
    assert got == 429 and reply["error"]["code"] == "queue_full" and "max_queue" in reply["error"]["message"]
    assert wait_until_idle(url)["tokens"] - before["tokens"] < 20 * 20


def test_the_api_key_guards_v1_and_the_tokenizer_routes_not_health_or_the_page(either_server):
    url = either_server[0]
    for key in (None, "wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            refused = httpx2.request(method, url + path, json={"prompt": "ab"}, headers=headers, timeout=10)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx2.get(url + "/health").status_code == httpx2.get(url + "/").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in openai_client(url).models.list().data] == ["out"]


def response_of(connection: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP response read off a raw connection."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
        re.search(rb"content-length: (\d+)", data, re.I).group(1)
    ):
        data += connection.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_bodies_over_the_limit_get_413_before_they_are_read(either_server):
    """--max_body_bytes (BODY_LIMIT here): a Content-Length past it is refused before a byte of the
    body is sent, on every route and the chat page's files; a chunked body as soon as the bytes read pass
    it; the openai client, sending all of its body, gets the 413 in OpenAI's shape; a body of exactly
    the limit is served; the server stays healthy."""
    url, limit = either_server[0], BODY_LIMIT
    client = openai_client(url)
    host, port = url.removeprefix("http://").split(":")
    for method, path in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("GET", "/index.html"),
        ("GET", "/health"),
    ):
        with socket.create_connection((host, int(port)), timeout=30) as connection:
            connection.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {limit + 1}\r\n\r\n".encode())
            status, reply = response_of(connection)  # no body was sent: the answer came from the header alone
        assert status == 413 and reply == {
            "error": {
                "message": f"the request body is larger than this server's limit of {limit:,} bytes (serve.py "
                f"--max_body_bytes)",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    with socket.create_connection((host, int(port)), timeout=30) as connection:  # chunked: no length said
        # with the key: else the 401 would come before any of the body was read
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        connection.sendall(head.encode() + b"Transfer-Encoding: chunked\r\n\r\n")
        sent, piece = 0, b"7" * (limit // 16)
        while sent < 64 * limit and not select.select([connection], [], [], 0.01)[0]:  # until an answer comes
            connection.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        # The body never ended (no last, empty chunk was sent): the 413 came once the bytes read passed the limit.
        assert response_of(connection)[0] == 413 and sent > limit
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="out", prompt="a" * limit, max_tokens=2)
    assert refused.value.status_code == 413 and refused.value.body["code"] == "request_too_large"
    body = {"prompt": "ab", "max_tokens": 2, "user": ""}
    body["user"] = "u" * (limit - len(json.dumps(body)))  # "user" is accepted and ignored: the body is exactly limit
    at_limit = json.dumps(body).encode()
    assert len(at_limit) == limit
    with httpx2.Client(timeout=60, headers=AUTHORIZED) as http:
        assert http.post(url + "/v1/completions", content=at_limit).json()["usage"]["completion_tokens"] == 2
        assert http.post(url + "/v1/completions", content=at_limit[:-2] + b'u"}').status_code == 413  # limit + 1
        assert http.get(url + "/health").status_code == 200


def test_models_and_a_disconnect_mid_stream_frees_its_slot(either_server):
    url, client = either_server[0], openai_client(either_server[0])
    assert [m.id for m in client.models.list().data] == ["out"]
    health = lambda: json.loads(urllib.request.urlopen(url + "/health").read())
    aborted, compiles = health()["aborted"], health()["compiles_while_serving"]
    with stream_lines(url, {"prompt": "ab", "max_tokens": 29, "n": 16}) as response:  # 4 rounds of 4 slots
        next(lines_of(response))  # the first token arrived; now hang up
    for _ in range(100):
        now = health()
        if now["busy"] == now["queued"] == 0:
            break
        time.sleep(0.05)
    assert now["busy"] == now["queued"] == 0 and now["aborted"] > aborted
    assert client.completions.create(model="out", prompt="ab", max_tokens=3).usage.completion_tokens == 3
    assert health()["compiles_while_serving"] == compiles  # no program compiled for these requests


def start_uds_server(path: str, *flags) -> tuple:
    """(process, an httpx client over the socket) of serve.py on the unix socket `path` with these flags,
    started with umask 027, once /health says 200."""
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "serve.py"), *flags, "--log_interval=0", f"--uds={path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        umask=0o027,
    )
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=path), timeout=60)
    deadline, status = time.time() + 180, None
    while status != 200 and time.time() < deadline and process.poll() is None:
        try:
            status = http.get("http://localhost/health").status_code
        except httpx2.TransportError:  # the socket is not there yet
            time.sleep(0.3)
    if status != 200:
        http.close()
        stopped(process)
    assert status == 200, process.stdout.read()
    return process, http


def test_a_server_on_a_unix_socket_answers_the_openai_client_and_bench_serve(run, loaded, tmp_path_factory):
    """--uds=PATH: uvicorn listens on the socket (no TCP port), made with the umask's mode (027: this user's and
    its group's to read, this user's alone to connect to; no warning); the openai client over a unix-socket
    transport gets generate.py's greedy tokens, bench_serve.py --uds measures it (also from two client
    processes), a second server on the same path is refused in one line, and SIGTERM ends it with the
    socket file removed."""
    setup, params, _, tok = loaded
    path = str(tmp_path_factory.mktemp("uds") / "serve.sock")
    process, http = start_uds_server(path, f"--out_dir={run}", "--slots=2")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o750
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
        expected = generate.generate(
            setup, params, [generate.encode_prompt(tok, "hello world")], 12, temperature=0
        ).tokens[0]
        reply = client.completions.create(model="out", prompt="hello world", max_tokens=12, temperature=0)
        assert reply.choices[0].text == tok.decode(expected)
        record = bench_serve.run(
            [
                f"--uds={path}",
                "--url=http://localhost/v1",
                "--concurrency=1,2",
                "--requests=3",
                "--max_tokens=4",
                "--prompt=ab",
            ]
        )
        assert [(level["ok"], level["failed"]) for level in record["levels"]] == [(3, 0), (3, 0)]
        assert record["health"]["context"] == 32 and record["levels"][1]["output_tokens"] == 3 * 4
        shared = bench_serve.run(
            [
                f"--uds={path}",
                "--url=http://localhost/v1",
                "--concurrency=3",
                "--requests=5",
                "--max_tokens=4",
                "--prompt=ab",
                "--processes=2",
                "--rate=50",
            ]
        )
        assert [(level["ok"], level["output_tokens"]) for level in shared["levels"]] == [(5, 5 * 4)] * 2
        with pytest.raises(
            bench_serve.BenchError,
            match="the first request failed: RequestFailed: 404: the model 'nope' does not exist",
        ):
            bench_serve.run([f"--uds={path}", "--url=http://localhost/v1", "--model=nope"])
        with pytest.raises(SystemExit) as refused:
            serve.main([f"--out_dir={run}", f"--uds={path}"])
        assert (
            str(refused.value) == f"config error: --uds={path}: another server is listening on it; stop that "
            f"one, or choose another path"
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        output = process.stdout.read()
        assert f"serving on unix socket {path}" in output and "warning" not in output and not os.path.exists(path)
    finally:
        http.close()
        stopped(process)


def test_a_unix_socket_others_may_use_without_a_key_is_warned_of_and_workers_serve_on_it(gpt2_vocab_model, tmp_path):
    """--uds_mode=666 with an HTTP worker: the socket has that mode, start-up warns (no API key), the worker
    answers on it (echoed offsets as in one process: test_echoed_offsets_start_where_...), and SIGTERM ends
    the server with the socket removed."""
    path = str(tmp_path / "serve.sock")
    process, http = start_uds_server(
        path, f"--init_from={gpt2_vocab_model}", "--slots=1", "--http_workers=1", "--uds_mode=666"
    )
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
        assert echoed_offsets(client) == [0, 0, 0, 1, 2]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert (
            f"warning: the unix socket {path} (mode 666) lets its group and every user here use the model without "
            f"an API key" in process.stdout.read()
        )
        assert not os.path.exists(path)
    finally:
        http.close()
        stopped(process)


@pytest.mark.parametrize(
    "name, words",
    [
        ("missing/serve.sock", "the folder {tmp}/missing does not exist"),
        ("a_file", "--uds={tmp}/a_file exists and is not a socket: serve.py won't replace it"),
        (".", "is a directory"),
        ("x" * 100 + ".sock", "a unix socket's path takes at most 107"),
    ],
)
def test_a_bad_socket_path_is_one_line_before_the_model_loads(tmp_path, name, words):
    (tmp_path / "a_file").write_text("not mine to replace")
    with pytest.raises(SystemExit) as e:
        serve.main(["--out_dir=/no/such/run", f"--uds={tmp_path / name}"])  # the run would fail to load next
    message = str(e.value)
    assert message.startswith("config error: ") and words.format(tmp=tmp_path) in message and "\n" not in message
    assert (tmp_path / "a_file").read_text() == "not mine to replace"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder whatever its permissions")
def test_a_socket_folder_this_user_cannot_write_in_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(SystemExit) as e:
        serve.main(["--out_dir=/no/such/run", f"--uds={locked / 'serve.sock'}"])
    assert str(e.value) == f"config error: --uds={locked / 'serve.sock'}: this user can't write in {locked}"


def teacher_forced(setup, params, tokens_BxT) -> tuple[float, np.ndarray]:
    """(perplexity, greedy token at each position (B, T-1)) of the given rows, decoded one token at a time
    through the KV cache (so an int8 cache is written and read back as in serving)."""

    def run(params, tokens_BxT):
        gpt = nnx.merge(setup.graphdef, params)
        B, T = tokens_BxT.shape

        def step(cache, t):
            logits_BxV, cache = gpt.decode(
                jax.lax.dynamic_slice_in_dim(tokens_BxT, t, 1, 1), cache, jnp.full(B, t, jnp.int32)
            )
            target_B = jax.lax.dynamic_index_in_dim(tokens_BxT, t + 1, 1, keepdims=False)
            loss_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), target_B[:, None], 1)[:, 0]
            return cache, (loss_B, jnp.argmax(logits_BxV, axis=-1))

        loss_TxB, greedy_TxB = jax.lax.scan(step, kv_cache.init_cache(gpt.config, B, T), jnp.arange(T - 1))[1]
        return jnp.exp(jnp.mean(loss_TxB)), greedy_TxB.T

    perplexity, greedy_BxT = jax.jit(run)(params, tokens_BxT)
    return float(perplexity), np.asarray(greedy_BxT)


def test_int8_weights_and_kv_cache_agree_with_float(run, loaded):
    """Weight-only int8 as serving holds it (a scale per output channel; the token table's per row) and an
    int8 KV cache (a scale per token and head) give the float model's greedy tokens (>= 95% of 64
    generated; >= 95% of 248 positions of validation text, each after the same prefix) and its
    perplexity (within 1%), in less memory."""
    setup, params, _, tok = loaded
    val = np.fromfile(os.path.join(os.path.dirname(run), "data", "toy", "val.bin"), np.uint16).astype(np.int32)
    prompts = [val[i : i + 6].tolist() for i in (0, 100, 200, 300)]
    rows = jnp.asarray(val[: 8 * 32].reshape(8, 32))
    expected = generate.generate(setup, params, prompts, 64, temperature=0).tokens
    float_ppl, float_greedy = teacher_forced(setup, params, rows)
    int8_params = loader.int8_weights(params, vocab_matrices=True)
    int8_kv, _, _, _ = loader.load_checkpoint(run, kv_cache_dtype="int8")
    for setup_, params_ in ((setup, int8_params), (int8_kv, params), (int8_kv, int8_params)):
        tokens = generate.generate(setup_, params_, prompts, 64, temperature=0).tokens
        agree = np.mean([a == b for want, got in zip(expected, tokens) for a, b in zip(want, got)])
        assert agree >= 0.95, agree
        ppl, greedy = teacher_forced(setup_, params_, rows)
        assert abs(ppl / float_ppl - 1) < 0.01 and np.mean(greedy == float_greedy) >= 0.95
    kernels = lambda p: loader.weight_bytes(p["blocks"]["attn"]) + loader.weight_bytes(p["blocks"]["mlp"])
    assert kernels(int8_params) < 0.3 * kernels(params)  # float32 -> int8 and a scale per output
    assert loader.weight_bytes(int8_params["wte"]) < 0.3 * loader.weight_bytes(params["wte"])  # and per row
    one_token = lambda s: sum(a.nbytes for a in jax.tree.leaves(kv_cache.init_cache(s.model_config, 1, 1)))
    assert one_token(int8_kv) == 2 * 2 * 2 * (16 + 4)  # 2 layers x k, v x 2 heads x (16 int8 + a float32 scale)
    assert one_token(setup) == 2 * 2 * 2 * 16 * 4


def test_server_on_data_and_tensor_with_int8_weights_and_cache_says_its_bytes(run, capsys):
    """serve.py's mesh and int8 keys: the engine's slots split over data=2, heads over tensor=2; its
    greedy tokens are one device's with the same int8 weights and cache; start-up prints the bytes."""
    server = serve.Server(
        serve.ServeConfig(
            out_dir=run, slots=2, mesh_data=2, mesh_tensor=2, weight_dtype="int8", kv_cache_dtype="int8", log_interval=0
        )
    )
    server.start_engine()
    assert isinstance(server, app.Backend)  # what the routes ask of it
    printed = capsys.readouterr().out
    assert "int8 blocks" in printed and "KV cache 160 bytes per token (int8)" in printed, printed
    assert "(160 bytes per token)" in printed  # the engine's measured cache: 2 x 2 layers x 2 heads x (16 + 4)
    assert re.search(r"memory: serving needs [\d.]+ [KMG]i?B per device x 4 = .* of .* available", printed), printed
    setup, params, _, tok = loader.load_checkpoint(run, kv_cache_dtype="int8")
    ids = generate.encode_prompt(tok, "hello world")
    int8_params = loader.serving_weights(setup, params, "int8")  # as the server holds them
    expected = generate.generate(setup, int8_params, [ids], 12, temperature=0).tokens[0]
    finished = concurrent.futures.Future()
    request = server.engine.submit(engine.Request(ids, 12, temperature=0, on_finish=finished.set_result))
    assert finished.result(timeout=120) == "length" and request.tokens == expected
    server.engine.shutdown()


def test_programs_too_big_for_the_memory_end_the_server_with_one_line(run):
    """The start-up check: the compiled programs (~290 KiB) against a 105 KiB limit, refused before any request."""
    port = free_port()
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "serve.py"),
            f"--out_dir={run}",
            "--slots=4",
            "--memory_limit_gib=0.0001",
            "--log_interval=0",
            f"--port={port}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: memory: serving needs [\d.]+ [KM]iB per device, more than the 104.86 KiB available "
        r"\(memory_limit_gib\); try --slots=2, or --kv_cache_dtype=int8, or .*",
        error,
    ), error


def test_programs_xla_cannot_compile_end_the_server_with_one_line(run, monkeypatch):
    """XLA:TPU refuses, while compiling, programs too big for the chip: the server stops with the
    start-up check's one line, the bytes from XLA's message, and its remedies (the compile faked: it
    fails while the checkpoint loads, and start_engine says so)."""

    def compile_(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
            "memory space hbm. Used 18.50G of 15.75G hbm. Exceeded hbm capacity by 2.75G."
        )

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)
    server = serve.Server(serve.ServeConfig(out_dir=run, slots=4, log_interval=0))  # compiles while loading
    stopped = []
    server.start_engine(on_failure=lambda: stopped.append(True))
    assert stopped and server.engine is None
    assert re.fullmatch(
        r"memory: serving needs 18.50 GiB per device, more than the 15.75 GiB of hbm available "
        r"\(XLA:CPU refused it: RESOURCE_EXHAUSTED\); try --slots=2, or --kv_cache_dtype=int8, .*",
        server.failure,
    ), server.failure


def test_a_second_start_loads_its_programs_from_the_cache_and_is_ready_sooner(run, tmp_path):
    """The same server started twice on one --compile_cache: the first compiles its programs, the second
    loads every one of them (the engine's first ones while the checkpoint loads, and those are the ones it
    runs), and its ready line comes sooner after the process started."""
    ready = re.compile(
        r"ready (?P<ready>[\d.]+) s after start: .*; compiled (?P<programs>\d+) programs "
        r"\((?P<loaded>\d+) from the cache\) since start \((?P<compile>[\d.]+) s after the load, "
        r"the first ones beside it\)"
    )

    def start() -> tuple[str, dict]:
        process = start_server(f"--out_dir={run}", "--slots=8", "--log_interval=0", compile_cache=tmp_path)[1]
        line = logged(process, "ready ")
        stopped(process)
        return line, {key: float(value) for key, value in ready.search(line).groupdict().items()}

    (first_line, first), (second_line, second) = start(), start()
    assert first["programs"] >= 6 and first["loaded"] == 0, first_line  # 4 admits, a decode, the empty cache, ...
    assert second["programs"] == second["loaded"] == first["programs"], second_line
    assert second["compile"] < first["compile"] and second["ready"] < first["ready"], (first_line, second_line)


def wait_until_idle(url: str) -> dict:
    """/health's body once no slot is busy and nothing is queued (within 30 s)."""
    deadline = time.time() + 30
    while (health := httpx2.get(url + "/health", timeout=10).json())["busy"] or health["queued"]:
        assert time.time() < deadline, health
        time.sleep(0.05)
    return health


def test_a_whole_reply_whose_client_hangs_up_stops_being_generated(slow_server):
    """Three impatient clients (a 1 s read timeout) of non-streamed requests for 250 tokens on one slot: once
    they leave, the slot is free and the queue empty long before 750 tokens, and every request is aborted."""
    url = slow_server[0]
    before = wait_until_idle(url)
    body = {"prompt": "ab", "max_tokens": 250, "temperature": 0}

    def abandon(_):
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(url + "/v1/completions", json=body, timeout=httpx2.Timeout(60, read=1))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(abandon, range(3)))
    after = wait_until_idle(url)
    generated = after["tokens"] - before["tokens"]
    assert after["aborted"] - before["aborted"] == 3 and generated < body["max_tokens"], (generated, after)


def test_sigterm_ends_streams_with_their_text_so_far_and_exits_0(slow_server):
    """SIGTERM after a stream's first tokens: the stream ends early with finish_reason 'abort', its
    text is every token generated so far (one character each), and the server exits 0."""
    url, process = slow_server
    max_tokens = 254  # the whole context after the prompt: seconds of decoding on this model
    body = {"prompt": "ab", "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}
    with stream_lines(url, body) as response:
        lines = lines_of(response)
        first = [next(lines) for _ in range(3)]  # tokens are flowing
        process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    *chunks, usage = [json.loads(line[6:]) for line in [*first, *rest[:-1]]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    generated = usage["usage"]["completion_tokens"]
    assert 3 <= generated < max_tokens, generated
    assert len("".join(c["choices"][0]["text"] for c in chunks)) == generated
    assert process.wait(timeout=60) == 0
    assert "request" in output_of(process)  # the per-request log line


def test_a_prompt_that_fails_to_score_is_one_error_and_its_generations_stop(faulty_server):
    """Echo with logprobs whose scoring fails: one 500 in OpenAI's shape, the request's two generations (the
    engine runs them while the prompt is scored) cancelled long before their 250 tokens; the server serves on."""
    url = faulty_server[0]
    before = wait_until_idle(url)
    body = {"prompt": "ab", "max_tokens": 250, "n": 2, "echo": True, "logprobs": 1}
    got, reply = post(url + "/v1/completions", body)
    assert got == 500 and reply["error"] == {
        "message": "scoring the prompt failed (JaxRuntimeError: INTERNAL: scoring failed on the device)",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    after = wait_until_idle(url)
    assert after["aborted"] - before["aborted"] == 2 and after["tokens"] - before["tokens"] < 250, after
    assert post(url + "/v1/completions", {"prompt": "ab", "max_tokens": 2})[1]["usage"]["completion_tokens"] == 2


def test_a_failed_engine_makes_health_503_with_why_and_the_server_exit_1_with_one_line(faulty_server):
    """The engine's decode program fails: the request in flight ends, /health is 503 with the failure in
    OpenAI's shape (not live, not ready) while requests get 503, then serve.py exits 1 with one line."""
    url, process = faulty_server
    failure = "the engine stopped (JaxRuntimeError: INTERNAL: the decode program failed on the device)"
    with httpx2.Client(base_url=url, timeout=60) as http:
        healthy = http.get("/health").json()
        assert (healthy["status"], healthy["live"], healthy["ready"]) == ("ok", True, True)
        cut = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 20, "seed": POISON}).json()
        assert cut["choices"][0]["finish_reason"] == "abort"
        health = http.get("/health")
        assert health.status_code == 503 and health.json() == {
            "status": "failed",
            "live": False,
            "ready": False,
            "error": {
                "message": f"{failure}; serve.py is exiting",
                "type": "service_unavailable",
                "param": None,
                "code": "engine_failed",
            },
        }
        refused = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        with pytest.raises(bench_serve.BenchError, match=re.escape(f"answers 503, not live: {failure}")):
            bench_serve.server_health(http, url + "/v1", timeout=60)  # not waited out: it won't become ready
    assert process.wait(timeout=60) == 1
    output = output_of(process)
    assert output.strip().splitlines()[-1] == f"error: {failure}" and "Traceback" not in output, output


def child_processes(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for the signal (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (exited, its exit status not yet collected)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def http_workers(pid: int) -> list[int]:
    """The worker processes serve.py (pid) spawned, from /proc (multiprocessing's resource tracker is a child too)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError):
            continue
        if parent == pid and spawned:
            found.append(int(entry))
    return found


class StandInWorker:
    """A worker process's stand-in for a Link: its name, and whether it was stopped."""

    name, terminated = "http-0", False

    def terminate(self):
        self.terminated = True


class StandInServer:
    def __init__(self):
        self.cancelled = []

    def cancel(self, request):
        self.cancelled.append(request)


def test_a_link_that_fails_reading_its_worker_says_why_and_stops_that_worker(capsys):
    """Any error in the thread that reads a worker's messages (here: a message it can't take apart) is one
    line, the worker is stopped (serve.py then stops, as for a worker that died: link.failure is its
    line) and its requests are cancelled; the worker's calls would otherwise wait forever."""
    inbox, to_engine = multiprocessing.Pipe(duplex=False)
    from_engine, outbox = multiprocessing.Pipe(duplex=False)
    worker, server = StandInWorker(), StandInServer()
    link = workers.Link(server, worker, inbox, outbox)
    link.requests[7] = request = engine.Request([1, 2], 4)
    to_engine.send(("submit", 0))  # no request id, no fields
    deadline = time.time() + 10
    while not worker.terminated:
        assert time.time() < deadline
        time.sleep(0.01)
    failure = (
        "the link to the HTTP worker http-0 failed (TypeError: Link._submit() missing 2 required positional "
        "arguments: 'rid' and 'fields')"
    )
    assert link.failure == failure and capsys.readouterr().out == f"error: {failure}; stopping that worker\n"
    assert server.cancelled == [request]
    link.close()


def test_a_worker_with_too_many_calls_waiting_for_the_engine_refuses_more_with_503():
    """RemoteServer's calls in flight are bounded (so are the replies waiting in the engine's process)."""
    to_engine, from_worker = multiprocessing.Pipe()
    remote = workers.RemoteServer(None, None, "out", 32, 0, to_engine, to_engine)
    remote.state, remote.MAX_CALLS = "ready", 2
    assert isinstance(remote, app.Backend)

    async def three_health_calls():
        remote.attach(asyncio.get_running_loop())
        waiting = [asyncio.ensure_future(remote.health()) for _ in range(2)]
        await asyncio.sleep(0.05)  # both sent, neither answered (nobody reads from_worker)
        with pytest.raises(app.APIError) as refused:
            await asyncio.wait_for(remote.health(), 5)
        for call in waiting:
            call.cancel()
        return refused.value

    refused = asyncio.run(three_health_calls())
    assert refused.status == 503 and "has 2 calls waiting for the engine already" in refused.message
    assert [from_worker.recv()[0] for _ in range(2)] == ["health", "health"]


def test_a_bad_number_of_http_workers_is_one_line():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "serve.py"), "--http_workers=-2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "http_workers must be >= 0, or -1 (auto), got -2" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("http_workers", [0, 2])
def test_a_port_another_program_listens_on_is_one_line(run, http_workers):
    """In one process serve.py listens once the model has loaded; with workers, before it loads (they start
    meanwhile). Either way one line and exit 1: in one process it used to abort (exit 134) as the
    summary line's thread woke while the interpreter exited."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "serve.py"), f"--out_dir={run}", f"--port={port}"]
            + [f"--http_workers={http_workers}", "--slots=2"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not listen on http://127.0.0.1:{port} (Address already in use"), last


@pytest.mark.parametrize("http_workers", [0, 2])
def test_two_ctrl_cs_at_once_stop_the_server_with_exit_0_and_no_traceback(run, http_workers):
    """As a double Ctrl-C does, or coreutils' timeout passing one on (to serve.py and to its process
    group): uvicorn then forces its exit, which cancelled its lifespan task and logged that traceback."""
    url, process = start_server(f"--out_dir={run}", "--slots=2", "--log_interval=0", f"--http_workers={http_workers}")
    try:
        urllib.request.urlopen(url + "/health", timeout=5)
        for _ in range(2):
            process.send_signal(signal.SIGINT)
            time.sleep(0.05)
        out = output_of(process)
        assert process.returncode == 0 and "Traceback" not in out, out
    finally:
        stopped(process)


def test_devices_that_cannot_start_are_one_line(run):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "serve.py"), f"--out_dir={run}", f"--port={free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"JAX_PLATFORMS": "nosuchchip"},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: the devices could not start: "), result.stderr


def test_a_run_that_cannot_load_stops_the_http_workers_started_meanwhile(tmp_path):
    """The workers start before the model loads: a run with no checkpoint is still one line and exit 1, the
    workers stopped and the unix socket removed."""
    sock = tmp_path / "serve.sock"
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "serve.py"), f"--out_dir={tmp_path / 'run'}", f"--uds={sock}"]
        + ["--http_workers=2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    children = set()  # the workers (seen before they run the worker's code, too) and the resource tracker
    while process.poll() is None:
        children |= set(child_processes(process.pid))
    assert process.returncode == 1
    error = process.stderr.read().strip()
    assert (
        error == f"error: no checkpoint in {tmp_path / 'run' / 'checkpoints'}: train one first, or point "
        "--out_dir at a run that has one"
    ), error
    deadline = time.monotonic() + 10  # the resource tracker exits once it sees serve.py gone
    while any(map(running, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children) >= 2 and not any(map(running, children)), children
    assert not sock.exists()


@pytest.mark.parametrize("signum, http_workers", [(signal.SIGINT, 0), (signal.SIGTERM, 2)])
def test_a_stop_while_starting_leaves_at_once_with_one_line(run, signum, http_workers):
    """Ctrl-C or SIGTERM as soon as serve.py catches them (its first lines), while it imports: exit 0 at
    once with one line. A KeyboardInterrupt printed a traceback there, or landed in JAX's gc callback,
    which dropped it, and the server started anyway."""
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "serve.py"), f"--out_dir={run}", f"--port={free_port()}"]
        + [f"--http_workers={http_workers}", "--compile_cache=", "--log_interval=0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not catches(process.pid, signal.SIGTERM) and time.monotonic() < deadline:  # Python catches SIGINT
            time.sleep(0.01)
        process.send_signal(signum)
        output, error = process.communicate(timeout=30)
    finally:
        stopped(process)
    assert process.returncode == 0 and "ready" not in output and "Traceback" not in error, error
    assert error.strip().splitlines()[-1] == f"serve.py: stopped by {signal.Signals(signum).name}", error


def metaspace_tokenizer(directory):
    """A SentencePiece-style tokenizer (spaces as '▁', dropped at the start of a decoded text), trained here."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat, the end", "a dog and a cat"] * 5, trainer)
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    return tokenizer.hf_tokenizer(directory)


@pytest.mark.parametrize("kind", ["gpt2", "metaspace"])
def test_text_streamed_token_by_token_is_the_whole_decode(kind, tmp_path):
    """TextStream decodes a window of the last tokens, not all of them: the pieces still add up to
    decode(all ids), with no half character (GPT-2 splits '☕' and '日本' into byte tokens) and no
    space lost where a SentencePiece decoder drops the first one of a text."""
    tok = tokenizer.gpt2_tokenizer() if kind == "gpt2" else metaspace_tokenizer(tmp_path / "tok")
    text = "café ☕ naïve 日本 done" if kind == "gpt2" else "the cat sat on the mat and a dog"
    ids = tok.encode(text)
    stream = app.TextStream(tok, [], offsets=True)
    pieces = [stream.add([i]) for i in ids] + [stream.finish()]
    one_by_one = stream.starts
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # streamed, not all at the end
    # a decode program's tokens come together: in twos, the same text, and a piece ends at the last
    # whole character it has (GPT-2's second pair ends inside '☕': its 'é' still goes out)
    stream = app.TextStream(tok, [], offsets=True)
    pieces = [stream.add(ids[k : k + 2]) for k in range(0, len(ids), 2)] + [stream.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    if kind == "gpt2":
        assert pieces[:2] == ["caf", "é"], pieces
    assert stream.starts == one_by_one and len(one_by_one) == len(ids)


def test_text_stream_ends_before_a_stop_string_that_spans_tokens():
    tok = tokenizer.gpt2_tokenizer()
    stream = app.TextStream(tok, ["quick brown", "zebra"])
    pieces = [stream.add([i]) for i in tok.encode("The quick brown fox jumps")]
    assert "".join(pieces) + stream.finish() == "The " and stream.stopped
    stream = app.TextStream(tok, ["quick brown", "zebra"])
    assert stream.add(tok.encode("The quick brown fox jumps")) + stream.finish() == "The " and stream.stopped


def test_of_two_stop_strings_the_text_ends_at_the_one_completed_first_however_tokens_are_grouped():
    """'hello world' with stops 'o' and 'lo w': 'o' completes first, though 'lo w' starts earlier; tokens
    that arrive one at a time or together (one decode program's) give the same text."""
    tok = tokenizer.gpt2_tokenizer()
    ids = tok.encode("hello world")
    one_at_a_time = app.TextStream(tok, ["o", "lo w"])
    alone = "".join(one_at_a_time.add([i]) for i in ids) + one_at_a_time.finish()
    together = app.TextStream(tok, ["o", "lo w"])
    assert alone == together.add(ids) + together.finish() == "hell"


def test_a_stop_string_completed_by_tokens_that_end_inside_a_character_still_stops():
    """The request ends (max_tokens) after ' \\xe2\\x80', the first bytes of '“': finish() decodes the
    held-back tokens and still ends the text before the stop string they complete."""
    tok = tokenizer.gpt2_tokenizer()
    ids = tok.encode("Hello “quoted”")[:2]
    assert tok.decode(ids) == "Hello \ufffd"  # the last token ends inside a character
    stream = app.TextStream(tok, [" "])
    assert "".join(stream.add([i]) for i in ids) + stream.finish() == "Hello" and stream.stopped


def test_a_stop_string_counts_the_tokens_through_its_last_character_however_they_are_grouped():
    """GPT-2 writes '“' as two byte tokens: a stop string ending in it counts both, and not the tokens after."""
    tok = tokenizer.gpt2_tokenizer()
    ids = tok.encode("Hello “quoted” world")
    through_stop = next(k for k in range(len(ids)) if tok.decode(ids[:k]).startswith("Hello “"))
    assert tok.decode(ids[: through_stop - 1]).endswith("\ufffd")  # the character's first token alone
    one_at_a_time, together = app.TextStream(tok, ["o “"]), app.TextStream(tok, ["o “"])
    assert "".join(one_at_a_time.add([i]) for i in ids) + one_at_a_time.finish() == "Hell"
    assert together.add(ids) + together.finish() == "Hell"
    assert one_at_a_time.counted == together.counted == through_stop


class ByteTokens:
    """A tokenizer whose ids are byte strings (a byte-level model can emit half a character)."""

    pieces = [b"x", b"\xc3", b"STOP", b"\xa9"]

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_text_stream_knows_where_each_token_starts_across_an_unfinished_character():
    """The text of 'x', a lone lead byte, 'STOP' is 'x\\ufffd' + the stop string: the stop's token
    starts at 2, past the text kept, though it was decoded together with the lead byte; a token that
    completes a character starts where that character does."""
    stream = app.TextStream(ByteTokens(), ["STOP"], offsets=True)
    for i in (0, 1, 2):
        stream.add([i])
    assert stream.stopped and stream.text == "x\ufffd" and stream.starts == [0, 1, 2]
    stream = app.TextStream(ByteTokens(), ["STOP"], offsets=True)
    assert "".join(stream.add([i]) for i in (0, 1, 3)) + stream.finish() == "xé" and stream.starts == [0, 1, 1]
    stream = app.TextStream(ByteTokens(), ["STOP"], offsets=True)  # together
    assert stream.add([0, 1, 3]) + stream.finish() == "xé" and stream.starts == [0, 1, 1]


def test_an_http_worker_that_dies_stops_the_server_with_one_line(worker_server):
    """One of two workers killed: the server stops (the other worker too) with one line naming it, exit code 1.
    The last test of worker_server (it stops it)."""
    process = worker_server[1]
    try:
        killed, other = http_workers(process.pid)
        os.kill(killed, signal.SIGKILL)
        assert process.wait(timeout=60) == 1
    finally:
        stopped(process)
    output = output_of(process)
    assert re.search(r"error: the HTTP worker http-\d exited \(code -9\); the server stopped", output), output
    assert "Traceback" not in output
    assert not os.path.exists(f"/proc/{other}")
