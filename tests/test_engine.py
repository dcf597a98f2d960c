"""inference/engine.py on a mesh: the slots' greedy tokens on tensor=4 x data=2 are one device's inference/generate.py tokens."""

import threading

import pytest
from test_generate import RAGGED, sharded_model

from inference import engine, generate


def engine_tokens(setup, params, prompts, max_tokens):
    e = engine.Engine(setup, params, slots=2, max_queue=8, log=lambda line: None)
    done = threading.Semaphore(0)
    requests = [e.submit(engine.Request(ids, max_tokens, temperature=0, on_finish=lambda _: done.release()))
                for ids in prompts]
    for _ in requests:
        assert done.acquire(timeout=120)
    e.shutdown()
    return [r.tokens for r in requests]


def test_slots_on_tensor_and_data_decode_as_one_device():
    """A grouped-query model (2 key/value heads, replicated over tensor=4; 8 query heads split)."""
    expected = generate.generate(*sharded_model("gqa", 1, 1), RAGGED, 6, temperature=0).tokens
    setup, params = sharded_model("gqa", 2, 4)
    assert setup.param_shardings["blocks"]["attn"]["out_kernel"].spec[1] == "tensor"  # heads split
    assert engine_tokens(setup, params, RAGGED, 6) == expected  # 3 requests through 2 slots


def test_slots_must_split_evenly_over_the_data_axis():
    with pytest.raises(engine.EngineError, match="slots=3 is not divisible"):
        engine.Engine(*sharded_model("gqa", 2, 4), slots=3)
