"""Generation with a KV cache: two compiled programs, and no return to Python between tokens.

  prefill  every prompt through the model in one pass, filling a per-layer KV cache. Prompts
           of different lengths are right-padded, so row b's tokens sit at positions 0, 1, ...
           and its first new token comes from the logits at its own last prompt position.
  decode   a lax.while_loop: feed each row's newest token at its own position, attend to the
           cache, sample the next one. A row stops at the stop token, at its last wanted token
           or when the cache is full; the loop stops when every row has.

Past the model's context (block_size tokens) generation goes on in segments: the last
W = block_size // 2 tokens of each unfinished row become a new prompt, run again at positions
0, 1, ... with a fresh cache (a full one cannot be shifted: learned positions end at block_size,
and RoPE keys were rotated at their old positions). So every new token sees between W and
block_size tokens; each later segment has the same shapes, so its programs compile once.

`setup` is anything with train.py's Setup fields (graphdef, mesh, model_config); this file
needs only the model and the mesh, so train.py (samples at evaluation) and sample.py (the
command line) both build on it.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import model
import sharding
from layers import cache_write
from layers.kv_cache import Prefix

# ----------------------------------------------------------------------------- one token


def sample_logits(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B):
    """One token id per row, each row with its own settings (arrays of B): greedy at temperature 0,
    else drawn with keys_B[b] from softmax(logits / temperature) over the top_k most likely tokens
    (0: all), and of those the fewest whose probability mass reaches top_p. Filtered tokens are
    masked, not removed, so every row draws over the whole vocabulary in its own order: its token
    depends on its own settings and key alone, never on the other rows'."""
    V = logits_BxV.shape[-1]

    def filtered(scaled_BxV):
        sorted_BxV = jax.lax.top_k(scaled_BxV, V)[0]  # most likely first
        rank_V = jnp.arange(V)
        in_top_k_BxV = rank_V < jnp.where(top_k_B > 0, top_k_B, V)[:, None]
        probs_BxV = jax.nn.softmax(jnp.where(in_top_k_BxV, sorted_BxV, -jnp.inf), axis=-1)
        mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # 0 for the most likely: kept
        kept_B = jnp.sum(in_top_k_BxV & (mass_before_BxV < top_p_B[:, None]), axis=-1)
        lowest_kept_Bx1 = jnp.take_along_axis(sorted_BxV, kept_B[:, None] - 1, axis=-1)
        return jnp.where(scaled_BxV >= lowest_kept_Bx1, scaled_BxV, -jnp.inf)

    def drawn():
        scaled_BxV = logits_BxV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        any_filter = jnp.any((top_k_B > 0) | (top_p_B < 1))  # the sort is skipped when no row filters
        scaled_BxV = jax.lax.cond(any_filter, filtered, lambda x: x, scaled_BxV)
        return jax.vmap(jax.random.categorical)(keys_B, scaled_BxV)

    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    # the draw (the scaling, filters and random bits for every logit) is skipped when every row is greedy
    drawn_B = jax.lax.cond(jnp.any(temperature_B > 0), drawn, lambda: greedy_B)
    return jnp.where(temperature_B > 0, drawn_B, greedy_B)


def _add_token(state: dict, logits_BxV, sampling: tuple):
    """Sample a token for every row still running and append it; update lengths and `done`."""
    B, S = state["tokens"].shape
    rows_B = jnp.arange(B)
    # Row b's i-th new token draws with key (seed, i, b): not with the batch size, the mesh
    # or the segment it falls in.
    draw_key = lambda i, b: jax.random.fold_in(jax.random.fold_in(state["key"], i), b)
    keys_B = jax.vmap(draw_key)(state["index"], rows_B)
    token_B = sample_logits(logits_BxV, keys_B, *(jnp.full(B, setting) for setting in sampling))
    adding_B = ~state["done"]
    # A select over the small (B, S) buffer rather than a scatter of B single ids (a loop on TPUs).
    write_here_BxS = adding_B[:, None] & (jnp.arange(S) == state["length"][:, None])  # finished rows write nothing
    tokens_BxS = jnp.where(write_here_BxS, token_B[:, None], state["tokens"])
    length_B = state["length"] + adding_B
    done_B = state["done"] | jnp.isin(token_B, state["stop_ids"]) | (length_B >= state["limit"])
    new_state = {**state, "tokens": tokens_BxS, "length": length_B, "done": done_B, "index": state["index"] + adding_B}
    return new_state, token_B, adding_B


# ----------------------------------------------------------------------------- the programs


def prefill(
    graphdef,
    params,
    prompt_BxP,
    prompt_len_B,
    wanted_B,
    index_B,
    key,
    stop_ids,
    *,
    length: int,
    sampling: tuple,
    kv_cache: bool,
    vocab: int,
) -> dict:
    """Run the prompts (right-padded to P) and sample the first new token of each row that
    wants any: wanted_B[b] more tokens, the first of them its new token number index_B[b].

    Returns the generation state: tokens (B, length) so far, their count per row, the
    length at which each row stops, `done`, the KV cache (None without kv_cache), the key,
    each row's next token index, the stop token (-1: none).
    """
    gpt = nnx.merge(graphdef, weights_in_compute_dtype(graphdef, params))
    B, P = prompt_BxP.shape
    rows_B = jnp.arange(B)
    tokens_BxS = jnp.zeros((B, length), jnp.int32).at[:, :P].set(prompt_BxP)
    if kv_cache:
        logits_BxV, cache = gpt.prefill(prompt_BxP, length, prompt_len_B - 1)
    else:
        cache = None
        logits_BxV = gpt(tokens_BxS)[rows_B, prompt_len_B - 1]
    state = {
        "tokens": tokens_BxS,
        "length": prompt_len_B,
        "done": wanted_B <= 0,
        "limit": jnp.minimum(prompt_len_B + wanted_B, length),
        "cache": cache,
        "key": key,
        "index": index_B,
        "stop_ids": stop_ids,
    }
    return _add_token(state, logits_BxV[:, :vocab], sampling)[0]


def weights_in_compute_dtype(graphdef, params):
    """model.cast_for_inference in the model's compute dtype. The model casts float32 weights where
    it uses them; inside the decode loop that would read float32 weights for every token, twice the
    bytes of a bfloat16 model. Cast once, they compute exactly what the float32 ones compute."""
    return model.cast_for_inference(params, jnp.dtype(nnx.merge(graphdef, params).config.dtype))


def prefix_buckets(length: int, smallest: int = 32) -> list[int]:
    """The cache prefixes a decode step may read: powers of two from `smallest`, and `length` last.
    A step reads the smallest one that holds every row's cached positions, so the bytes it reads
    stay within 2x of the filled cache's, with one compiled step per bucket."""
    return [b for b in (smallest << i for i in range(32)) if b < length] + [length]


def decode(graphdef, params, state: dict, *, sampling: tuple, kv_cache: bool, vocab: int, on_token=None) -> dict:
    """Generate until every row is done, in lax.while_loops: one per prefix_buckets prefix of the
    cache, each running while the rows' positions fit it. on_token(token, added) is called on the
    host with row 0's token after every step (for streaming)."""
    gpt = nnx.merge(graphdef, weights_in_compute_dtype(graphdef, params))
    rows_B = jnp.arange(state["tokens"].shape[0])

    def one_token(state, reads=None):
        position_B = state["length"] - 1  # each row's newest token: sampled, not yet run
        if kv_cache:
            at_position_BxS = jnp.arange(state["tokens"].shape[1]) == position_B[:, None]  # a select, not a gather
            newest_Bx1 = jnp.sum(jnp.where(at_position_BxS, state["tokens"], 0), axis=1, keepdims=True)
            logits_BxV, cache = gpt.decode(newest_Bx1, state["cache"], position_B, reads=reads)
            state = {**state, "cache": cache}
        else:  # the whole (B, length) buffer again; causality hides what lies past each row
            logits_BxV = gpt(state["tokens"])[rows_B, position_B]
        state, token_B, added_B = _add_token(state, logits_BxV[:, :vocab], sampling)
        if on_token is not None:
            jax.debug.callback(on_token, token_B[0], added_B[0], ordered=True)
        return state

    running = lambda state: ~jnp.all(state["done"])
    if not kv_cache:
        return jax.lax.while_loop(running, one_token, state)
    for bucket in prefix_buckets(state["cache"].capacity):
        # a step at position p reads the cached positions before p: the bucket holds them while p <= bucket
        fits = lambda state, bucket=bucket: running(state) & (jnp.max(state["length"] - 1) <= bucket)
        state = jax.lax.while_loop(fits, functools.partial(one_token, reads=Prefix(bucket)), state)
    return state


def shapes_of(tree):
    """Each array of a tree (or shape) as a jax.ShapeDtypeStruct with its sharding: what a program is
    lowered for."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def compile_programs(setup, inputs: tuple, length: int, sampling: tuple, kv_cache: bool, vocab: int, on_token=None):
    """The compiled prefill and decode for these input shapes and shardings (cached: another
    call with the same shapes and options compiles nothing)."""
    leaves, treedef = jax.tree.flatten(shapes_of(inputs))
    return _compile(setup.graphdef, setup.mesh, treedef, tuple(leaves), length, sampling, kv_cache, vocab, on_token)


@functools.lru_cache(maxsize=8)
def _compile(graphdef, mesh, treedef, leaves, length, sampling, kv_cache, vocab, on_token):
    params, *inputs = jax.tree.unflatten(treedef, leaves)
    options = dict(sampling=sampling, kv_cache=kv_cache, vocab=vocab)
    with sharding.activate(mesh):
        run_prefill = (
            jax.jit(functools.partial(prefill, graphdef, length=length, **options)).lower(params, *inputs).compile()
        )
        run_decode = (
            jax.jit(functools.partial(decode, graphdef, on_token=on_token, **options), donate_argnums=1)
            .lower(params, run_prefill.out_info)
            .compile()
        )
    return run_prefill, run_decode


def padded_rows(setup, prompts: list) -> list:
    """The prompts, padded up to a multiple of the mesh's batch axes with rows that want nothing."""
    return [list(ids) for ids in prompts] + [[0]] * (-len(prompts) % sharding.batch_shards(setup.mesh))


def segment_inputs(
    setup, params, prompt_ids: list, wanted_B, new_B, max_new_tokens: int, seed: int, stop_ids
) -> tuple[tuple, int]:
    """A segment's inputs on the devices, for prompts prompt_ids (one per padded row), and its
    length S (prompt and new tokens, rounded up to whole windows; at most the context)."""
    mesh, batch = setup.mesh, sharding.batch_sharding(setup.mesh)
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch.spec[0]))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    P = max(len(ids) for ids in prompt_ids)
    prompt_BxP = np.zeros((len(prompt_ids), P), np.int32)
    for b, ids in enumerate(prompt_ids):
        prompt_BxP[b, : len(ids)] = ids
    prompt_len_B = np.array([len(ids) for ids in prompt_ids], np.int32)
    inputs = (
        params,
        jax.device_put(prompt_BxP, batch),
        jax.device_put(prompt_len_B, rows_sharding),
        jax.device_put(wanted_B, rows_sharding),
        jax.device_put(new_B, rows_sharding),
        jax.device_put(jax.random.key(seed), replicated),
        jax.device_put(np.array([*stop_ids] or [-1], np.int32), replicated),
    )  # [-1]: no stop id
    # whole windows of positions, which a TPU's cache write takes in place (layers/cache_write.py), within the context
    window = cache_write.WINDOW
    return inputs, min(-(-(P + max_new_tokens) // window) * window, setup.model_config.block_size)


def drawable_ids(setup, vocab: int | None) -> int:
    """How many ids sampling may draw: the tokenizer's `vocab` where the model's vocabulary is larger."""
    return min(vocab or setup.model_config.vocab_size, setup.model_config.vocab_size)


def first_programs(
    setup,
    params,
    prompts: list,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids=(),
    kv_cache: bool = True,
    vocab: int | None = None,
):
    """The compiled prefill and decode that generate() runs first for these arguments (compiled
    here once; generate reuses them): what a memory check needs before generating."""
    rows = padded_rows(setup, prompts)
    wanted_B = np.where(np.arange(len(rows)) < len(prompts), max_new_tokens, 0).astype(np.int32)
    inputs, S = segment_inputs(
        setup, params, rows, wanted_B, np.zeros(len(rows), np.int32), max_new_tokens, 0, stop_ids
    )
    return compile_programs(setup, inputs, S, (temperature, top_k, top_p), kv_cache, drawable_ids(setup, vocab))


@dataclasses.dataclass
class Generation:
    tokens: list  # the new tokens of each prompt, without the stop token
    prompt_tokens: int  # tokens through the prefills: the prompts, and past the context each window
    new_tokens: int  # stop tokens included
    decode_tokens: int  # new tokens from the decode loops (a row's first in each segment is the prefill's)
    compile_s: float  # all summed over the segments
    prefill_s: float
    decode_s: float


def generate(
    setup,
    params,
    prompts: list,
    max_new_tokens: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids=(),
    kv_cache: bool = True,
    on_token=None,
    vocab: int | None = None,
) -> Generation:
    """max_new_tokens new tokens for each prompt (a list of token-id lists), fewer where one
    ends at one of the stop_ids; in one batch, and past the context in segments (module docstring).
    Only ids below `vocab` are drawn (the tokenizer's size, where the model's vocabulary is larger:
    ids the tokenizer can't decode never come out); default: the model's vocabulary.

    The batch is padded up to a multiple of the mesh's batch axes with rows that want no
    tokens. Compilation is timed apart from the prefill and the decode, and each ends with the
    result on the host.
    """
    block_size = setup.model_config.block_size
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) < block_size:
            raise ValueError(
                f"prompt {i} is {len(ids)} tokens; the model's context is {block_size} "
                f"tokens, with at least one left to generate: shorten the prompt"
            )
    rows = padded_rows(setup, prompts)
    new_B = np.zeros(len(rows), np.int32)  # new tokens so far, stop tokens included
    running_B = (np.arange(len(rows)) < len(prompts)) & (max_new_tokens > 0)
    window = max(block_size // 2, 1)
    sampling = (temperature, top_k, top_p)
    drawable = drawable_ids(setup, vocab)
    prompt_tokens = decode_tokens = 0
    compile_s = prefill_s = decode_s = 0.0

    prompt_ids = rows  # the first segment's prompts
    while running_B.any():
        wanted_B = np.where(running_B, max_new_tokens - new_B, 0).astype(np.int32)
        inputs, S = segment_inputs(setup, params, prompt_ids, wanted_B, new_B, max_new_tokens, seed, stop_ids)
        prompt_len_B = np.array([len(ids) for ids in prompt_ids], np.int32)
        start = time.perf_counter()
        run_prefill, run_decode = compile_programs(setup, inputs, S, sampling, kv_cache, drawable, on_token)
        compile_s += time.perf_counter() - start
        start = time.perf_counter()
        state = jax.block_until_ready(run_prefill(*inputs))
        prefill_s += time.perf_counter() - start
        if on_token is not None and running_B[0]:  # row 0's first token here came from the prefill
            on_token(int(state["tokens"][0, prompt_len_B[0]]), True)
        start = time.perf_counter()
        state = run_decode(params, state)
        tokens_BxS, length_B = np.asarray(state["tokens"]), np.asarray(state["length"])
        decode_s += time.perf_counter() - start

        for b in np.flatnonzero(running_B):
            new = tokens_BxS[b, prompt_len_B[b] : length_B[b]].tolist()
            rows[b] += new
            new_B[b] += len(new)
            running_B[b] = new_B[b] < max_new_tokens and new[-1] not in stop_ids
            prompt_tokens += int(prompt_len_B[b])
            decode_tokens += len(new) - 1
        # Past the context: the next prompts are the last `window` tokens of each row (a
        # finished row's too, to keep the shapes; it wants no more).
        prompt_ids = [ids[-window:] for ids in rows]

    new_tokens = []
    for b, ids in enumerate(prompts):
        new = rows[b][len(ids) :]
        new_tokens.append(new[:-1] if new and new[-1] in stop_ids else new)
    return Generation(new_tokens, prompt_tokens, int(new_B.sum()), decode_tokens, compile_s, prefill_s, decode_s)


# ----------------------------------------------------------------------------- text


def encode_prompt(tok, text: str) -> list:
    """Token ids of a prompt, after the tokenizer's begin-of-text token if it has one (Llama);
    an empty prompt starts from that, or from <|endoftext|> (GPT-2), or from id 0 (chars)."""
    start = [] if tok.bos_token is None else [tok.bos_token]
    return start + tok.encode(text) if text else start or [tok.eot_token or 0]


def decode_sample(tok, ids) -> str:
    """The text of prompt + sample, without the begin-of-text token encode_prompt put first."""
    ids = list(ids)
    return tok.decode(ids[1:] if tok.bos_token is not None and ids[:1] == [tok.bos_token] else ids)


def stop_token_ids(tok, stop: str) -> list:
    """The ids a sample ends at: 'eos' = the tokenizer's end tokens (GPT-2's <|endoftext|>, the
    eos_token_id of a Hugging Face model; none at char level), '' = none, else one token's text."""
    if stop == "eos":
        return list(tok.stop_tokens)
    if not stop:
        return []
    try:
        ids = tok.encode(stop)
    except ValueError:  # characters outside a char-level vocabulary
        ids = []
    if len(ids) != 1:
        raise ValueError(
            f"--stop={stop!r} is {len(ids) or 'not'} tokens in this vocabulary; "
            f"it must be exactly one (or 'eos', or '' for none)"
        )
    return ids


def sample_text(
    setup,
    params,
    tok,
    n_tokens: int,
    prompt: str = "\n",
    seed: int = 0,
    temperature: float = 0.8,
    top_k: int = 200,
    num_samples: int = 1,
    top_p: float = 1.0,
) -> list[str]:
    """Prompt + sample texts from the model described by `setup` (train.py's eval samples)."""
    ids = encode_prompt(tok, prompt)
    out = generate(
        setup,
        params,
        [ids] * num_samples,
        n_tokens,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=stop_token_ids(tok, "eos"),
        vocab=tok.vocab_size,
    )
    return [decode_sample(tok, ids + new) for new in out.tokens]
