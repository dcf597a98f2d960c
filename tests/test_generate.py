"""inference/generate.py: the KV-cache sampler against recomputation, sampling rules, seeds, stop tokens,
generation past the context, sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
import train
from configurator import Config
from inference import generate

CHARS = "".join(chr(0x100 + i) for i in range(65))  # a 65-symbol character vocabulary
RAGGED = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(10, 35))]  # 3, 9 and 25 tokens


def tiny(devices=None, data=1, tensor=1, **changes):
    """Setup and random parameters of a small model (block 32, vocab 65 padded to 128), with
    weights scaled up so that greedy choices are clear-cut rather than near ties."""
    devices = devices or jax.devices()[:1]
    config = Config(
        **{
            **dict(
                n_layer=2,
                n_head=4,
                n_embd=32,
                block_size=32,
                vocab_size=65,
                pad_vocab_to_multiple=64,
                batch_size=data,
                seed=3,
                tensorboard=False,
            ),
            **changes,
        }
    )
    setup = train.make_setup(config, sharding.make_mesh(data, 1, tensor, devices=devices), 65)
    params = jax.tree.map(lambda a: a * 4, train.init_state(setup)["params"])
    return setup, params


@pytest.fixture(scope="module")
def one_device():
    return tiny()


def greedy_by_recomputing(setup, params, ids, max_new_tokens):
    """The obviously right answer: one row, the full forward pass again for every token, over
    the window generation uses: the prompt, and whenever the context is full, its last
    block_size // 2 tokens (from position 0 again) and those generated since."""
    forward = jax.jit(lambda p, x: nnx.merge(setup.graphdef, p)(x))
    block_size = setup.model_config.block_size
    window, new = list(ids), []
    while len(new) < max_new_tokens:
        if len(window) == block_size:
            window = window[-(block_size // 2) :]
        buffer = np.zeros((1, block_size), np.int32)
        buffer[0, : len(window)] = window
        token = int(np.argmax(forward(params, buffer)[0, len(window) - 1, :65]))
        window.append(token)
        new.append(token)
    return new


def test_greedy_with_the_cache_equals_recomputing_everything(one_device):
    setup, params = one_device
    cached = generate.generate(setup, params, RAGGED, 12, temperature=0)
    recomputed = generate.generate(setup, params, RAGGED, 12, temperature=0, kv_cache=False)
    expected = [greedy_by_recomputing(setup, params, ids, 12) for ids in RAGGED]
    assert cached.tokens == recomputed.tokens == expected
    assert len({tuple(t) for t in cached.tokens}) == 3  # not a degenerate model
    # The 25-token prompt fills the context (32) after 7 new tokens; its last 16 tokens are then
    # a second prompt, whose prefill samples the first of the 5 tokens still wanted.
    assert [len(t) for t in cached.tokens] == [12, 12, 12]
    assert cached.prompt_tokens == 37 + 16 and cached.new_tokens == 36 and cached.decode_tokens == 36 - 4


@pytest.mark.parametrize("changes", [{"dtype": "bfloat16"}, {"quantization": "int8"}], ids=["bf16", "int8"])
def test_greedy_with_the_cache_equals_recomputing_in_bfloat16_and_int8(changes):
    """The decode loop casts the weights to bfloat16 once, before the loop (so the reference
    does too); int8 scales are per token, so a new token quantizes as inside the sequence."""
    setup, params = tiny(**changes)
    cached = generate.generate(setup, params, RAGGED, 12, temperature=0)
    weights = generate.weights_in_compute_dtype(setup.graphdef, params)
    assert weights["wte"].dtype == jnp.dtype(setup.config.dtype)
    assert cached.tokens == [greedy_by_recomputing(setup, weights, ids, 12) for ids in RAGGED]


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn(one_device):
    """A model whose vocabulary (65) is larger than its tokenizer's (say 20: a fine-tune on a
    smaller vocabulary) samples only ids the tokenizer can decode."""
    setup, params = one_device
    wide = generate.generate(setup, params, RAGGED, 12, temperature=2.0, seed=1).tokens
    narrow = generate.generate(setup, params, RAGGED, 12, temperature=2.0, seed=1, vocab=20).tokens
    assert max(max(t) for t in wide) >= 20 and max(max(t) for t in narrow) < 20


def test_prompts_that_leave_no_room_are_refused(one_device):
    setup, params = one_device
    with pytest.raises(ValueError, match="prompt 1 is 32 tokens; the model's context is 32 tokens"):
        generate.generate(setup, params, [[1, 2], list(range(32))], 4)


def test_top_k_1_is_greedy(one_device):
    setup, params = one_device
    greedy = generate.generate(setup, params, RAGGED, 8, temperature=0)
    top1 = generate.generate(setup, params, RAGGED, 8, temperature=1.5, top_k=1, seed=5)
    assert top1.tokens == greedy.tokens


@pytest.mark.parametrize(
    "top_p, top_k, kept",
    [
        (0.3, 0, {3}),
        (0.5, 0, {3, 0}),
        (0.7, 0, {3, 0, 4}),
        (0.9, 0, {3, 0, 4, 2}),
        (1.0, 0, {0, 1, 2, 3, 4}),
        (0.9, 2, {3, 0}),  # top-k first, then top-p among those
    ],
)
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(top_p, top_k, kept):
    probs = np.array([0.25, 0.05, 0.1, 0.4, 0.2])  # sorted: 3 (0.4), 0, 4, 2, 1; mass 0.4, .65, .85, .95, 1
    n = 4000
    logits_BxV = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 1))
    keys_B = jax.random.split(jax.random.key(0), n)
    per_row = lambda value, dtype: jnp.full(n, value, dtype)
    drawn = np.asarray(
        generate.sample_logits(
            logits_BxV, keys_B, per_row(1.0, jnp.float32), per_row(top_k, jnp.int32), per_row(top_p, jnp.float32)
        )
    )
    assert set(drawn.tolist()) == kept
    kept_probs = probs[sorted(kept)] / probs[sorted(kept)].sum()  # renormalized over the kept set
    frequencies = np.bincount(drawn, minlength=5)[sorted(kept)] / n
    np.testing.assert_allclose(frequencies, kept_probs, atol=0.03)
    # Rows with other settings (greedy, unfiltered) beside them draw what they draw alone.
    mixed = generate.sample_logits(
        logits_BxV[:3], keys_B[:3], jnp.array([1.0, 0.0, 1.0]), jnp.array([top_k, 0, 0]), jnp.array([top_p, 1.0, 1.0])
    )
    alone = generate.sample_logits(logits_BxV[2:3], keys_B[2:3], jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1))
    assert mixed.tolist() == [drawn[0], 3, int(alone[0])]


def test_the_seed_decides_the_text(one_device):
    setup, params = one_device
    run = lambda prompts, seed: (
        generate.generate(setup, params, prompts, 10, temperature=1.0, top_k=20, seed=seed).tokens
    )
    first = run(RAGGED, 7)
    assert run(RAGGED, 7) == first
    assert run(RAGGED, 8) != first
    # A row's draws depend on (seed, row, step) only: the other rows don't change its text.
    assert run([RAGGED[0], RAGGED[2], RAGGED[2]], 7)[0] == first[0]


def test_each_row_stops_at_the_stop_token(one_device):
    setup, params = one_device
    free = generate.generate(setup, params, RAGGED[:2], 12, temperature=0).tokens
    stop = free[0][3]  # the 4th new token of row 0
    stopped = generate.generate(setup, params, RAGGED[:2], 12, temperature=0, stop_ids=[stop]).tokens
    cut = lambda row: row[: row.index(stop)] if stop in row else row  # the stop token is not returned
    assert stopped == [cut(row) for row in free]
    assert len(stopped[0]) <= 3


# ----------------------------------------------------------------------------- past the context
# block_size 32, so windows of 16: the 3-token prompt gets 29 tokens in its first segment, then 16
# per segment; the 25-token prompt 7, then 16 per segment.


def test_every_row_gets_max_new_tokens_past_the_context(one_device):
    setup, params = one_device
    streamed = []
    on_token = lambda token, added: streamed.append(int(token)) if added else None
    misses = generate._compile.cache_info().misses
    out = generate.generate(setup, params, RAGGED, 80, temperature=1.0, seed=4, on_token=on_token)
    assert [len(t) for t in out.tokens] == [80, 80, 80]
    assert generate._compile.cache_info().misses - misses <= 2  # the first segment's shapes, then the rest's
    assert streamed == out.tokens[0]  # row 0 streamed once each, in order, across the segments
    assert len(set(out.tokens[0][48:])) > 5  # sampled, not stuck on one token
    # Prefills: the 3 prompts, then 16-token windows: 4 for the 3- and 9-token prompts (29 or 23
    # new tokens, then 16 a segment), 5 for the 25-token one (7, then 16 a segment).
    assert out.prompt_tokens == 37 + 16 * (4 + 4 + 5) and out.decode_tokens == 240 - (3 + 4 + 4 + 5)
    misses = generate._compile.cache_info().misses
    again = generate.generate(setup, params, RAGGED, 80, temperature=1.0, seed=4, on_token=on_token)
    assert again.tokens == out.tokens
    assert generate._compile.cache_info().misses == misses  # nothing compiled again
    # A row's draws depend on (seed, row, token index): not on the other rows, nor on where the
    # batch's segments begin.
    alone = generate.generate(setup, params, [RAGGED[0], RAGGED[2]], 80, temperature=1.0, seed=4)
    assert alone.tokens[0] == out.tokens[0]


def test_greedy_past_the_context_is_the_forward_pass_over_the_last_window(one_device):
    """Each new token is the argmax of a full forward pass over the tokens generation had in
    view: when the context filled up, the last 16 tokens, and those generated since."""
    setup, params = one_device
    cached = generate.generate(setup, params, RAGGED, 70, temperature=0).tokens
    recomputed = generate.generate(setup, params, RAGGED, 70, temperature=0, kv_cache=False).tokens
    assert cached == recomputed == [greedy_by_recomputing(setup, params, ids, 70) for ids in RAGGED]
    assert all(len(set(row[40:])) > 2 for row in cached)  # not one repeated token past the context


def test_a_stop_token_stops_a_row_in_a_later_segment(one_device):
    setup, params = one_device
    run = lambda **kw: generate.generate(setup, params, RAGGED[:2], 60, temperature=1.0, seed=2, **kw).tokens
    free = run()
    late = [t for t in set(free[0]) if free[0].index(t) >= 29]  # first drawn past row 0's first segment
    assert late
    stop = late[0]
    streamed = []
    stopped = run(stop_ids=[stop], on_token=lambda token, added: streamed.append(int(token)) if added else None)
    cut = lambda row: row[: row.index(stop)] if stop in row else row  # the stop token is not returned
    assert stopped == [cut(row) for row in free]
    assert 29 <= len(stopped[0]) < 60
    assert streamed == stopped[0] + [stop]  # streamed as drawn, stop token included


def prefill_4_rows(setup, params):
    """The generation state after a prefill of 4 rows of 5 tokens (a cache of 16), on setup's mesh."""
    run = jax.jit(
        lambda p, x, n: generate.prefill(
            setup.graphdef,
            p,
            x,
            n,
            jnp.full(4, 4, jnp.int32),
            jnp.zeros(4, jnp.int32),
            jax.random.key(0),
            -1,
            length=16,
            sampling=(0, 0, 1.0),
            kv_cache=True,
            vocab=setup.model_config.vocab_size,
        )
    )
    with sharding.activate(setup.mesh):
        return run(params, jnp.ones((4, 5), jnp.int32), jnp.full(4, 5, jnp.int32))


def test_sharded_sampling_matches_one_device_and_splits_the_cache(one_device):
    setup, params = tiny(jax.devices()[:4], data=2, tensor=2)
    np.testing.assert_array_equal(params["wte"], one_device[1]["wte"])  # the same model, split
    prompts = RAGGED  # 3 rows: padded to 4 for data=2
    sharded = generate.generate(setup, params, prompts, 24, temperature=0)  # past the context, too
    assert sharded.tokens == generate.generate(*one_device, prompts, 24, temperature=0).tokens
    # The cache is split over heads on `tensor` and rows on the batch axes.
    state = prefill_4_rows(setup, params)
    expected = jax.sharding.NamedSharding(
        setup.mesh, jax.sharding.PartitionSpec(None, ("data", "fsdp"), None, "tensor")
    )
    assert state["cache"].k.shape == (2, 4, 16, 4 * 8)  # (L, B, S, heads x head size)
    assert state["cache"].k.sharding.is_equivalent_to(expected, 4)
    assert state["cache"].v.sharding.is_equivalent_to(expected, 4)


def test_llama_style_sampling_sharded_with_a_grouped_query_cache():
    """RoPE + grouped-query attention: the cache holds the 2 key/value heads (not 4), split over
    tensor; greedy tokens with it equal recomputing the whole forward pass (past the context
    too), on 1 device and on data=2 x tensor=2."""

    def llama_style(devices, data, tensor):
        config = Config(
            n_layer=2,
            n_head=4,
            n_embd=32,
            block_size=32,
            vocab_size=65,
            pad_vocab_to_multiple=64,
            batch_size=data,
            seed=3,
            tensorboard=False,
            pos_embedding="rope",
            norm="rmsnorm",
            mlp="swiglu",
            n_kv_head=2,
            bias=False,
            tie_embeddings=False,
        )
        setup = train.make_setup(config, sharding.make_mesh(data, 1, tensor, devices=devices), 65)
        return setup, jax.tree.map(lambda a: a * 4, train.init_state(setup)["params"])

    setup, params = llama_style(jax.devices()[:1], 1, 1)
    cached = generate.generate(setup, params, RAGGED, 24, temperature=0).tokens  # 2 segments for RAGGED[2]
    assert cached == [greedy_by_recomputing(setup, params, ids, 24) for ids in RAGGED]
    assert len({tuple(t) for t in cached}) == 3
    setup, params = llama_style(jax.devices()[:4], 2, 2)
    assert generate.generate(setup, params, RAGGED, 24, temperature=0).tokens == cached
    state = prefill_4_rows(setup, params)
    assert state["cache"].k.shape == (2, 4, 16, 2 * 8)  # (L, B, S, n_kv_head x H)
    expected = jax.sharding.NamedSharding(
        setup.mesh, jax.sharding.PartitionSpec(None, ("data", "fsdp"), None, "tensor")
    )
    assert state["cache"].k.sharding.is_equivalent_to(expected, 4)


def test_speedrun_switches_greedy_with_the_cache_equals_recomputing():
    """qk_norm (keys are cached normalised), the ReLU² MLP and the logit soft-cap: cached greedy
    tokens equal recomputing (test_model.py compares decode's capped logits themselves)."""
    setup, params = tiny(qk_norm=True, mlp="relu2", logit_softcap=2.0)
    cached = generate.generate(setup, params, RAGGED, 12, temperature=0).tokens
    assert cached == [greedy_by_recomputing(setup, params, ids, 12) for ids in RAGGED]
    assert len({tuple(t) for t in cached}) == 3


SHARDED_STYLES = {
    "gpt2": {},
    "gqa": dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False, tie_embeddings=False),
}


@functools.lru_cache(maxsize=None)
def sharded_model(style: str, data: int, tensor: int):
    """8 query heads (2 key/value heads for 'gqa'), on a data x tensor mesh; the same weights on every mesh."""
    config = Config(
        n_layer=2,
        n_head=8,
        n_embd=64,
        block_size=32,
        vocab_size=65,
        pad_vocab_to_multiple=64,
        batch_size=data,
        seed=3,
        tensorboard=False,
        **SHARDED_STYLES[style],
    )
    setup = train.make_setup(config, sharding.make_mesh(data, 1, tensor, devices=jax.devices()[: data * tensor]), 65)
    return setup, jax.tree.map(lambda a: a * 4, train.init_state(setup)["params"])


@pytest.mark.parametrize("style", SHARDED_STYLES)
def test_greedy_on_tensor_8_and_tensor_4_x_data_2_equals_one_device(style):
    """Heads and the MLP split over tensor, rows over data; 2 key/value heads on tensor=8 or 4 are
    replicated (their cache too), the 8 query heads split."""
    one = generate.generate(*sharded_model(style, 1, 1), RAGGED, 20, temperature=0).tokens
    assert len({tuple(t) for t in one}) == 3
    for data, tensor in ((1, 8), (2, 4)):
        setup, params = sharded_model(style, data, tensor)
        assert generate.generate(setup, params, RAGGED, 20, temperature=0).tokens == one, (data, tensor)
        state = prefill_4_rows(setup, params)
        heads = "tensor" if style == "gpt2" else None  # 2 key/value heads can't be split 8 or 4 ways
        expected = jax.sharding.NamedSharding(
            setup.mesh, jax.sharding.PartitionSpec(None, ("data", "fsdp") if data > 1 else None, None, heads)
        )
        assert state["cache"].k.sharding.is_equivalent_to(expected, 4), state["cache"].k.sharding


# ----------------------------------------------------------------------------- the decode step's cost


def long_context(style: str):
    """A tiny model with a context of 128 (attend buckets 32, 64, then the segment's length), GPT-2 or
    grouped-query (2 key/value heads for 4 query heads, RoPE)."""
    return tiny(block_size=128, **{"gpt2": {}, "gqa": dict(SHARDED_STYLES["gqa"], n_head=4)}[style])


@pytest.mark.parametrize("style", ["gpt2", "gqa"])
def test_greedy_across_prefix_buckets_equals_recomputing(style):
    """The decode step reads only the cache's first `attend` positions, in buckets that grow as the
    rows do (32, 64, then all 85 = 25 + 60), and writes each token after the layer stack: its greedy
    tokens are the full forward pass's (what the step that wrote the cache inside every layer and
    read all of it gave: the tests above held it to the same reference)."""
    setup, params = long_context(style)
    assert generate.prefix_buckets(25 + 60) == [32, 64, 85]
    cached = generate.generate(setup, params, RAGGED, 60, temperature=0).tokens
    assert cached == [greedy_by_recomputing(setup, params, ids, 60) for ids in RAGGED]
    assert len({tuple(t) for t in cached}) == 3


def test_the_decode_program_writes_the_cache_in_place():
    """In the compiled decode loop, the only operations that make an array of the cache's shape are
    the scatters that write each step's tokens: no copy of the cache per step or per layer (the layer
    scan reads its slices; the old step carried the cache through it and updated it layer by layer)."""
    setup, params = long_context("gpt2")
    _, decode = generate.first_programs(setup, params, [[1, 2, 3]] * 4, 20, temperature=0)
    cache_shape = "f32[2,4,24,32]"  # (layers, rows, 3 + 20 positions in whole windows of 8, 4 heads x head size 8)
    made = []  # (instruction name, operation) of each array of the cache's shape
    for line in decode.as_text().splitlines():
        name, _, rest = line.strip().removeprefix("ROOT ").partition(" = ")
        if rest.startswith(cache_shape + "{"):
            made.append((name, rest.split("(")[0].split()[-1]))
    plumbing = {"parameter", "get-tuple-element", "tuple", "while", "bitcast"}
    writes = [(name, op) for name, op in made if op not in plumbing]
    # XLA:CPU wraps a scatter in a fusion of its own (%wrapped_scatter)
    assert writes and all("scatter" in name for name, op in writes), writes


def test_sampling_draws_no_random_bits_when_every_row_is_greedy():
    """Greedy rows (temperature 0) take the argmax; the draw over every logit is skipped unless a
    row samples, and a sampling row beside greedy ones still draws."""
    logits_BxV = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    keys_B = jax.random.split(jax.random.key(0), 2)
    settings = lambda *t: (jnp.array(t, jnp.float32), jnp.zeros(2, jnp.int32), jnp.ones(2))
    sample = jax.jit(generate.sample_logits)
    assert sample(logits_BxV, keys_B, *settings(0.0, 0.0)).tolist() == [1, 0]
    text = sample.lower(logits_BxV, keys_B, *settings(0.0, 0.0)).as_text()
    assert "conditional" in text or "case" in text  # the draw sits behind a branch
    drawn = {int(sample(logits_BxV, jax.random.split(jax.random.key(s), 2), *settings(0.0, 5.0))[1]) for s in range(20)}
    assert len(drawn) > 1  # row 1 samples, row 0 stays greedy
    assert {
        int(sample(logits_BxV, jax.random.split(jax.random.key(s), 2), *settings(0.0, 5.0))[0]) for s in range(5)
    } == {1}
