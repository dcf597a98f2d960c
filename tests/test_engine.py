"""inference/engine.py: the slots' greedy tokens are one device's inference/generate.py tokens, on tensor=4 x
data=2, and with slots at different positions reading different prefixes of the cache."""

import collections
import threading

import numpy as np
import pytest
from test_generate import RAGGED, SHARDED_STYLES, long_context, sharded_model, tiny

from inference import engine, generate, loader
from layers import kv_cache


def engine_tokens(setup, params, prompts, max_tokens):
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None)
    done = threading.Semaphore(0)
    requests = [
        e.submit(engine.Request(ids, max_tokens, temperature=0, on_finish=lambda _: done.release())) for ids in prompts
    ]
    for _ in requests:
        assert done.acquire(timeout=120)
    e.shutdown()
    return [r.tokens for r in requests]


def recording(programs: dict, calls: list) -> dict:
    """The engine's programs (a dict of them by key), each appending its key to `calls` when run."""

    def record(key, program):
        def run(*args):
            calls.append(key)
            return program(*args)

        return run

    return {key: record(key, program) for key, program in programs.items()}


def short_context(style: str):
    """long_context's model with a context of 32: one cache prefix to read and prompt buckets 16 and 32, for
    the tests of what is not about the cache's prefixes (fewer programs to compile)."""
    return tiny(**{"gpt2": {}, "gqa": dict(SHARDED_STYLES["gqa"], n_head=4)}[style])


def test_slots_on_tensor_and_data_decode_as_one_device():
    """A grouped-query model (2 key/value heads, replicated over tensor=4; 8 query heads split)."""
    expected = generate.generate(*sharded_model("gqa", 1, 1), RAGGED, 6, temperature=0).tokens
    setup, params = sharded_model("gqa", 2, 4)
    assert setup.param_shardings["blocks"]["attn"]["out_kernel"].spec[1] == "tensor"  # heads split
    assert engine_tokens(setup, params, RAGGED, 6) == expected  # 3 requests through 2 slots


def test_slots_must_split_evenly_over_the_data_axis():
    with pytest.raises(engine.EngineError, match="slots=3 is not divisible"):
        engine.Engine(*sharded_model("gqa", 2, 4), slots=3)


def test_programs_compiled_from_the_weights_shapes_alone_are_run_by_an_engine_of_their_arguments():
    """first_programs from the weights' shapes (loader.serving_shapes, as serve.py compiles them while a
    checkpoint's weights are read), slots on data=2 and heads on tensor=4: an engine of the same arguments
    runs them, its greedy tokens one device's generate.py's; an engine of other arguments compiles its own."""
    expected = generate.generate(*sharded_model("gqa", 1, 1), RAGGED, 6, temperature=0).tokens
    setup, params = sharded_model("gqa", 2, 4)
    programs = engine.first_programs(setup, loader.serving_shapes(setup), slots=2)
    e = engine.Engine(setup, params, slots=2, log=lambda line: None, compile_later=True, programs=programs)
    assert e.programs is programs and e.step_program is programs.compiled[programs.first[0]]
    assert e.admit_programs[programs.first[1][1:]] is programs.compiled[programs.first[1]]
    done = threading.Semaphore(0)
    requests = [e.submit(engine.Request(ids, 6, temperature=0, on_finish=lambda _: done.release())) for ids in RAGGED]
    for _ in requests:
        assert done.acquire(timeout=120)
    e.shutdown()
    assert [r.tokens for r in requests] == expected
    other = engine.Engine(setup, params, slots=4, log=lambda line: None, compile_later=True, programs=programs)
    other.shutdown()
    assert other.programs is not programs


@pytest.mark.parametrize("style", ["gpt2", "gqa"])
def test_slots_at_different_positions_read_their_buckets_and_decode_as_generate(style):
    """Two slots, four requests of different lengths: the slots sit at different positions, and the
    step reads the cache prefix (32, 64 or all 128) that holds the furthest one; each request's greedy
    tokens are generate.py's for it alone."""
    setup, params = long_context(style)
    prompts = [RAGGED[2], RAGGED[0], list(range(3, 43)), RAGGED[1]]  # 25, 3, 40 and 9 tokens
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None)
    prefixes = [kv_cache.Prefix(n) for n in (32, 64, 128)]
    assert list(e.step_programs) == [(p, 2) for p in prefixes]  # (cache reads, rows): 2 slots, one row bucket
    called, calls = dict.fromkeys(e.step_programs, 0), []
    e.step_programs = recording(e.step_programs, calls)
    done = threading.Semaphore(0)
    requests = [e.submit(engine.Request(ids, 50, temperature=0, on_finish=lambda _: done.release())) for ids in prompts]
    for _ in requests:
        assert done.acquire(timeout=120)
    e.shutdown()
    called.update(collections.Counter(calls))
    assert all(called.values()), called  # every bucket served some steps (the 40-token prompt reaches 89)
    expected = [generate.generate(setup, params, [ids], 50, temperature=0).tokens[0] for ids in prompts]
    assert [r.tokens for r in requests] == expected


@pytest.mark.parametrize("style, cache", [("gpt2", "auto"), ("gqa", "int8")])
def test_through_the_attention_kernel_slots_read_their_own_positions_and_decode_as_generate(style, cache):
    """decode_attention='pallas' (Pallas's interpreter here): one decode program whatever the slots'
    positions, and each request's greedy tokens are generate.py's (XLA's attention) for it alone."""
    setup, params = long_context(style)
    setup = loader.model_setup(setup.config, setup.mesh, setup.config.vocab_size, cache)
    prompts = [RAGGED[2], RAGGED[0], list(range(3, 43)), RAGGED[1]]  # 25, 3, 40 and 9 tokens
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None, decode_attention="pallas")
    assert list(e.step_programs) == [(kv_cache.FILLED, 2)]
    done = threading.Semaphore(0)
    requests = [e.submit(engine.Request(ids, 50, temperature=0, on_finish=lambda _: done.release())) for ids in prompts]
    for _ in requests:
        assert done.acquire(timeout=300)
    e.shutdown()
    expected = [generate.generate(setup, params, [ids], 50, temperature=0).tokens[0] for ids in prompts]
    assert [r.tokens for r in requests] == expected


def test_the_attention_kernel_runs_on_one_device_only():
    with pytest.raises(engine.EngineError, match="'pallas' runs on one TPU chip"):
        engine.Engine(*sharded_model("gqa", 2, 4), slots=2, decode_attention="pallas")


def test_log_probabilities_are_computed_for_the_requests_that_ask_whatever_runs_beside_them():
    """A step computes the log-softmax and top-k only when a running slot asked for them: a request
    with logprobs gets the same ones alone as beside a request without (which gets None)."""
    setup, params = sharded_model("gqa", 1, 1)
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None)
    done = threading.Semaphore(0)

    def submit(ids, logprobs):
        tokens = []
        request = e.submit(
            engine.Request(
                ids, 6, temperature=0, logprobs=logprobs, on_token=tokens.append, on_finish=lambda _: done.release()
            )
        )
        return request, tokens

    def wait(n):
        for _ in range(n):
            assert done.acquire(timeout=120)

    alone, alone_tokens = submit(RAGGED[0], True)
    wait(1)
    without, without_tokens = submit(RAGGED[1], False)  # takes slot 0: the asking request is in slot 1
    beside, beside_tokens = submit(RAGGED[0], True)
    wait(2)
    e.shutdown()
    stats = e.stats()
    assert stats["tokens"] == 18 and stats["steps"] >= 10  # 3 x 6 tokens; the first of each from its prefill
    assert all(stats["seconds"][part] > 0 for part in ("step", "tokens", "admit")), stats
    assert beside.tokens == alone.tokens and len(beside_tokens) == 6
    for a, b in zip(alone_tokens, beside_tokens, strict=True):
        assert a.logprob is not None and a.logprob <= 0 and len(a.top) == engine.TOP_LOGPROBS
        assert a.top[0][0] == a.id  # greedy: the drawn token is the most likely
        np.testing.assert_allclose(b.logprob, a.logprob, atol=1e-5)
        np.testing.assert_allclose([lp for _, lp in b.top], [lp for _, lp in a.top], atol=1e-5)
    assert all(t.logprob is None and t.top is None for t in without_tokens)
    assert without.tokens == generate.generate(setup, params, [RAGGED[1]], 6, temperature=0).tokens[0]


def test_requests_that_arrive_together_are_admitted_together_and_decode_as_alone():
    """Five requests queued before the loop looks: one program admits each prompt bucket's (three of
    16 positions padded to 8 rows, two of 32), and every request's greedy tokens are generate.py's."""
    setup, params = short_context("gqa")
    prompts = [RAGGED[0], RAGGED[1], list(range(40, 60)), RAGGED[2], [7] * 12]  # buckets 16, 16, 32, 32, 16
    e = engine.Engine(setup, params, slots=8, max_queue=8, log=lambda line: None)
    admitted = []
    e.admit_programs = recording(e.admit_programs, admitted)
    done = threading.Semaphore(0)
    with e.wake:  # the loop waits for this lock: it sees all five at once
        requests = [
            e.submit(engine.Request(ids, 6, temperature=0, on_finish=lambda _: done.release())) for ids in prompts
        ]
    for _ in requests:
        assert done.acquire(timeout=120)
    e.shutdown()
    assert sorted(admitted) == [(16, 8), (32, 8)]
    expected = [generate.generate(setup, params, [ids], 6, temperature=0).tokens[0] for ids in prompts]
    assert [r.tokens for r in requests] == expected


def test_requests_end_inside_a_decode_call_at_max_tokens_a_stop_token_and_the_context():
    """With 3 tokens per decode call, requests end between a call's steps: at max_tokens (5), at a stop
    token, and at the context's end (a 120-token prompt in a context of 128); the slot's later tokens
    are dropped, and what each request got is generate.py's, cut where it ended."""
    setup, params = long_context("gpt2")
    greedy = lambda ids, n: generate.generate(setup, params, [ids], n, temperature=0).tokens[0]
    long_prompt = list(range(3, 123))
    stop_at = greedy(RAGGED[1], 10)
    stop_id = next(t for t in stop_at[2:] if t not in stop_at[:2])  # the first token not among the first two
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None, decode_steps=3)
    done = threading.Semaphore(0)
    finish = lambda _: done.release()
    requests = [
        e.submit(engine.Request(RAGGED[0], 5, temperature=0, on_finish=finish)),
        e.submit(engine.Request(RAGGED[1], 10, temperature=0, stop_ids=(stop_id,), on_finish=finish)),
        e.submit(engine.Request(long_prompt, 50, temperature=0, on_finish=finish)),
    ]
    for _ in requests:
        assert done.acquire(timeout=120)
    e.shutdown()
    assert [r.finish_reason for r in requests] == ["length", "stop", "length"]
    assert requests[0].tokens == greedy(RAGGED[0], 5)
    assert requests[1].tokens == stop_at[: stop_at.index(stop_id)]
    assert requests[2].tokens == greedy(long_prompt, 8)  # 128 - 120
    assert e.stats()["tokens"] == 5 + len(requests[1].tokens) + 8


def test_the_next_decode_is_dispatched_before_the_last_ones_tokens_are_handed_out_and_none_past_the_end():
    """With 8 tokens per decode call, a request of 17 tokens (its first from its prefill) takes two calls:
    the second is dispatched before the first's tokens reach the request (the device runs while the host
    hands them out), and no third runs for tokens the request will never take."""
    setup, params = long_context("gpt2")
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None, decode_steps=8)
    events = []

    def recording(program):
        def step(*args):
            events.append("decode")
            return program(*args)

        return step

    e.step_programs = {key: recording(program) for key, program in e.step_programs.items()}
    done = threading.Semaphore(0)
    request = e.submit(
        engine.Request(
            RAGGED[0],
            17,
            temperature=0,
            on_token=lambda token: events.append("token"),
            on_finish=lambda _: done.release(),
        )
    )
    assert done.acquire(timeout=120)
    e.shutdown()
    assert events == ["decode", "token", "decode"] + ["token"] * 16
    assert request.tokens == generate.generate(setup, params, [RAGGED[0]], 17, temperature=0).tokens[0]
    assert e.stats()["steps"] == 16


@pytest.mark.parametrize("style, cache", [("gpt2", "auto"), ("gqa", "int8")])
def test_a_light_load_runs_only_the_first_quarter_of_the_slots(style, cache):
    """32 slots: while the busy slots are among the first 8, an 8-row program decodes them (the
    cache's other rows, and an int8 cache's scales, left out); once the 9th slot is busy, the 32-row
    one runs. Every request's greedy tokens are generate.py's alone."""
    setup, params = short_context(style)
    setup = loader.model_setup(setup.config, setup.mesh, setup.config.vocab_size, cache)
    e = engine.Engine(setup, params, slots=32, max_queue=16, log=lambda line: None)
    assert e.row_buckets == [8, 32]
    calls = []  # (cache reads, rows) of each decode
    e.step_programs = recording(e.step_programs, calls)
    prompts = [RAGGED[i % 3] for i in range(10)]
    done = threading.Semaphore(0)
    submit = lambda ids: e.submit(engine.Request(ids, 6, temperature=0, on_finish=lambda _: done.release()))
    first = [submit(ids) for ids in prompts[:2]]
    for _ in first:
        assert done.acquire(timeout=120)
    light = [rows for _, rows in calls]
    with e.wake:  # ten at once: slots 0-9
        rest = [submit(ids) for ids in prompts]
    for _ in rest:
        assert done.acquire(timeout=120)
    e.shutdown()
    ran = [rows for _, rows in calls]
    assert set(light) == {8} and 32 in ran[len(light) :]
    expected = {i: generate.generate(setup, params, [RAGGED[i]], 6, temperature=0).tokens[0] for i in range(3)}
    assert [r.tokens for r in first + rest] == [expected[i % 3] for i in [0, 1, *range(10)]]


def test_compiled_later_the_faster_programs_take_over_one_by_one_and_the_tokens_stay_generates():
    """compile_later: the engine serves at once on the decode over the whole cache and the largest prompt
    bucket's admit while the smaller prefixes and buckets compile beside it; each is used once compiled,
    one that does not fit (fits says why) never is, and every request's greedy tokens are generate.py's."""
    setup, params = long_context("gpt2")
    prompts = [RAGGED[2], RAGGED[0], list(range(3, 43)), RAGGED[1]]  # 25, 3, 40 and 9 tokens
    gate, checked, lines = threading.Event(), [], []

    def fits(program):  # holds the background back until the first requests are done; refuses the first
        gate.wait(timeout=120)
        checked.append(program)
        return "too big" if len(checked) == 1 else None

    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lines.append, compile_later=True, fits=fits)
    whole, prefixes = kv_cache.Prefix(128), [kv_cache.Prefix(n) for n in (32, 64)]
    assert (list(e.step_programs), e.programs_later) == ([(whole, 2)], 5)
    assert list(e.admit_programs) == [(128, 1)]
    done = threading.Semaphore(0)

    def run():
        requests = [
            e.submit(engine.Request(ids, 50, temperature=0, on_finish=lambda _: done.release())) for ids in prompts
        ]
        for _ in requests:
            assert done.acquire(timeout=120)
        return [r.tokens for r in requests]

    on_the_first = run()
    gate.set()
    e.compiling.join(timeout=120)
    assert list(e.step_programs) == [(whole, 2), (prefixes[1], 2)]  # 32's refused
    assert sorted(e.admit_programs) == [(16, 1), (32, 1), (64, 1), (128, 1)]
    assert "engine: the decode of 2 slots reading 32 positions is not used: too big" in lines, lines
    called = []
    e.step_programs, e.admit_programs = recording(e.step_programs, called), recording(e.admit_programs, called)
    on_all = run()
    e.shutdown()
    assert lines[-1].startswith("engine: 4 more programs in use after "), lines
    assert {(prefixes[1], 2), (16, 1), (32, 1), (64, 1)} <= set(called) and (128, 1) not in called
    assert e.stats()["compiles_while_serving"] == 0
    expected = [generate.generate(setup, params, [ids], 50, temperature=0).tokens[0] for ids in prompts]
    assert on_the_first == on_all == expected
