"""Generation with a KV cache: two compiled programs, and no return to Python between tokens.

  prefill  every prompt through the model in one pass, filling a per-layer KV cache. Prompts
           of different lengths are right-padded, so row b's tokens sit at positions 0, 1, ...
           and its first new token comes from the logits at its own last prompt position.
  decode   a lax.while_loop: feed each row's newest token at its own position, attend to the
           cache, sample the next one. A row stops at the stop token or at the model's context
           length; the loop stops when every row has.

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
from tokenizer import EOT_TEXT


# ----------------------------------------------------------------------------- one token

def sample_logits(logits_BxV, keys_B, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """One token id per row (row b draws with keys_B[b]): greedy at temperature 0, else from
    softmax(logits / temperature) over the top_k most likely tokens, and of those the fewest
    whose probability mass reaches top_p."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits_BxV = logits_BxV / temperature
    draw = jax.vmap(jax.random.categorical)
    if not top_k and top_p >= 1:
        return draw(keys_B, logits_BxV)
    V = logits_BxV.shape[-1]
    logits_BxK, ids_BxK = jax.lax.top_k(logits_BxV, min(top_k or V, V))  # most likely first
    if top_p < 1:
        probs_BxK = jax.nn.softmax(logits_BxK, axis=-1)
        mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK  # 0 for the most likely: kept
        logits_BxK = jnp.where(mass_before_BxK < top_p, logits_BxK, -jnp.inf)
    choice_B = draw(keys_B, logits_BxK)
    return jnp.take_along_axis(ids_BxK, choice_B[:, None], axis=-1)[:, 0]


def _add_token(state: dict, logits_BxV, sampling: tuple):
    """Sample a token for every row still running and append it; update lengths and `done`."""
    B, S = state["tokens"].shape
    rows_B = jnp.arange(B)
    step_key = jax.random.fold_in(state["key"], state["step"])
    # A row's draws depend on (seed, row, step) only: not on the batch size or the mesh.
    keys_B = jax.vmap(jax.random.fold_in, (None, 0))(step_key, rows_B)
    token_B = sample_logits(logits_BxV, keys_B, *sampling)
    adding_B = ~state["done"]
    write_at_B = jnp.where(adding_B, state["length"], S)  # S is out of bounds: finished rows drop it
    tokens_BxS = state["tokens"].at[rows_B, write_at_B].set(token_B, mode="drop")
    length_B = state["length"] + adding_B
    done_B = state["done"] | (token_B == state["stop_id"]) | (length_B >= state["limit"])
    new_state = {**state, "tokens": tokens_BxS, "length": length_B, "done": done_B, "step": state["step"] + 1}
    return new_state, token_B, adding_B


# ----------------------------------------------------------------------------- the programs

def prefill(graphdef, params, prompt_BxP, prompt_len_B, key, stop_id, *, length: int,
            max_new_tokens: int, sampling: tuple, kv_cache: bool) -> dict:
    """Run the prompts (right-padded to P) and sample each row's first new token.

    Returns the generation state: tokens (B, length) so far, their count per row, the
    length at which each row stops, `done`, the KV cache (None without kv_cache), the key,
    the stop token (-1: none).
    """
    gpt = nnx.merge(graphdef, weights_in_compute_dtype(graphdef, params))
    B, P = prompt_BxP.shape
    rows_B = jnp.arange(B)
    tokens_BxS = jnp.zeros((B, length), jnp.int32).at[:, :P].set(prompt_BxP)
    if kv_cache:
        cache = model.init_cache(gpt.config, B, length)
        logits_BxV, cache = gpt.decode(prompt_BxP, cache, jnp.zeros(B, jnp.int32), prompt_len_B - 1)
    else:
        cache = None
        logits_BxV = gpt(tokens_BxS)[rows_B, prompt_len_B - 1]
    state = {"tokens": tokens_BxS, "length": prompt_len_B, "done": jnp.zeros(B, bool),
             "limit": jnp.minimum(prompt_len_B + max_new_tokens, length), "cache": cache,
             "key": key, "step": jnp.zeros((), jnp.int32), "stop_id": stop_id}
    return _add_token(state, logits_BxV[:, :gpt.config.vocab_size], sampling)[0]


def weights_in_compute_dtype(graphdef, params):
    """The matrices (embeddings included) cast to the compute dtype; norm scales and biases kept.

    The model casts float32 weights where it uses them; inside the decode loop that would
    read float32 weights for every token, twice the bytes of a bfloat16 model. Casting once
    (prefill and decode alike) also rounds the embedding rows before the position table is
    added, so bfloat16 samples can differ slightly from a forward pass on float32 weights.
    """
    dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)
    return jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, params)


def decode(graphdef, params, state: dict, *, sampling: tuple, kv_cache: bool, on_token=None) -> dict:
    """Generate until every row is done, in one lax.while_loop. on_token(token, added) is
    called on the host with row 0's token after every step (for streaming)."""
    gpt = nnx.merge(graphdef, weights_in_compute_dtype(graphdef, params))
    rows_B = jnp.arange(state["tokens"].shape[0])

    def one_token(state):
        position_B = state["length"] - 1  # each row's newest token: sampled, not yet run
        if kv_cache:
            newest_Bx1 = state["tokens"][rows_B, position_B][:, None]
            logits_BxV, cache = gpt.decode(newest_Bx1, state["cache"], position_B)
            state = {**state, "cache": cache}
        else:  # the whole (B, length) buffer again; causality hides what lies past each row
            logits_BxV = gpt(state["tokens"])[rows_B, position_B]
        state, token_B, added_B = _add_token(state, logits_BxV[:, :gpt.config.vocab_size], sampling)
        if on_token is not None:
            jax.debug.callback(on_token, token_B[0], added_B[0], ordered=True)
        return state

    return jax.lax.while_loop(lambda state: ~jnp.all(state["done"]), one_token, state)


def compile_programs(setup, inputs: tuple, length: int, max_new_tokens: int, sampling: tuple,
                     kv_cache: bool, on_token=None):
    """The compiled prefill and decode for these input shapes and shardings (cached: another
    call with the same shapes and options compiles nothing)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), inputs)
    leaves, treedef = jax.tree.flatten(abstract)
    return _compile(setup.graphdef, setup.mesh, treedef, tuple(leaves), length, max_new_tokens, sampling,
                    kv_cache, on_token)


@functools.lru_cache(maxsize=8)
def _compile(graphdef, mesh, treedef, leaves, length, max_new_tokens, sampling, kv_cache, on_token):
    params, *inputs = jax.tree.unflatten(treedef, leaves)
    with sharding.activate(mesh):
        run_prefill = jax.jit(functools.partial(
            prefill, graphdef, length=length, max_new_tokens=max_new_tokens, sampling=sampling,
            kv_cache=kv_cache)).lower(params, *inputs).compile()
        run_decode = jax.jit(functools.partial(
            decode, graphdef, sampling=sampling, kv_cache=kv_cache, on_token=on_token),
            donate_argnums=1).lower(params, run_prefill.out_info).compile()
    return run_prefill, run_decode


@dataclasses.dataclass
class Generation:
    tokens: list  # the new tokens of each prompt, without the stop token
    hit_context: list  # True where a sample stopped at the model's context length
    prompt_tokens: int
    new_tokens: int  # stop tokens included
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens(self) -> int:  # each sample's first new token comes from the prefill
        return self.new_tokens - len(self.tokens)


def generate(setup, params, prompts: list, max_new_tokens: int, *, seed: int = 0,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_id: int | None = None,
             kv_cache: bool = True, on_token=None) -> Generation:
    """Up to max_new_tokens new tokens for each prompt (a list of token-id lists), in one batch.

    The batch is padded with copies up to a multiple of the mesh's batch axes. Compilation
    is timed apart from the prefill and the decode, and each ends with the result on the host.
    """
    block_size = setup.model_config.block_size
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) < block_size:
            raise ValueError(f"prompt {i} is {len(ids)} tokens; the model's context is {block_size} "
                             f"tokens, with at least one left to generate: shorten the prompt")
    split = setup.mesh.shape["data"] * setup.mesh.shape["fsdp"]
    rows = list(prompts) + [prompts[-1]] * (-len(prompts) % split)
    P = max(len(ids) for ids in rows)
    S = min(P + max_new_tokens, block_size)
    prompt_BxP = np.zeros((len(rows), P), np.int32)
    for b, ids in enumerate(rows):
        prompt_BxP[b, :len(ids)] = ids
    prompt_len_B = np.array([len(ids) for ids in rows], np.int32)
    mesh, batch = setup.mesh, sharding.batch_sharding(setup.mesh)
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch.spec[0]))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    inputs = (params, jax.device_put(prompt_BxP, batch), jax.device_put(prompt_len_B, rows_sharding),
              jax.device_put(jax.random.key(seed), replicated),
              jax.device_put(np.int32(-1 if stop_id is None else stop_id), replicated))
    start = time.perf_counter()
    run_prefill, run_decode = compile_programs(setup, inputs, S, max_new_tokens, (temperature, top_k, top_p),
                                               kv_cache, on_token)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    state = jax.block_until_ready(run_prefill(*inputs))
    prefill_s = time.perf_counter() - start
    if on_token is not None:  # the first token of row 0 came from the prefill
        on_token(int(state["tokens"][0, prompt_len_B[0]]), True)
    start = time.perf_counter()
    state = run_decode(params, state)
    tokens_BxS, length_B = np.asarray(state["tokens"]), np.asarray(state["length"])
    decode_s = time.perf_counter() - start

    new_tokens, hit_context = [], []
    for b, ids in enumerate(prompts):
        new = tokens_BxS[b, len(ids):length_B[b]].tolist()
        stopped = bool(new) and new[-1] == stop_id
        new_tokens.append(new[:-1] if stopped else new)
        hit_context.append(not stopped and length_B[b] == block_size and len(new) < max_new_tokens)
    return Generation(new_tokens, hit_context, sum(len(ids) for ids in prompts),
                      int(sum(length_B[b] - len(ids) for b, ids in enumerate(prompts))),
                      compile_s, prefill_s, decode_s)


# ----------------------------------------------------------------------------- text

def encode_prompt(tok, text: str) -> list:
    """Token ids of a prompt; an empty prompt starts from <|endoftext|> (or id 0 at char level)."""
    return tok.encode(text) if text else [tok.eot_token or 0]


def stop_token_id(tok, stop: str) -> int | None:
    """The id of the stop token, or None when there is none to stop at."""
    if not stop:
        return None
    try:
        ids = tok.encode(stop)
    except ValueError:  # characters outside a char-level vocabulary
        ids = []
    if len(ids) == 1:
        return ids[0]
    if stop == EOT_TEXT:  # the default, and this vocabulary has no such token: run to the end
        return None
    raise ValueError(f"--stop={stop!r} is {len(ids) or 'not'} tokens in this vocabulary; "
                     f"it must be exactly one")


def sample_text(setup, params, tok, n_tokens: int, prompt: str = "\n", seed: int = 0,
                temperature: float = 0.8, top_k: int = 200, num_samples: int = 1,
                top_p: float = 1.0) -> list[str]:
    """Prompt + sample texts from the model described by `setup` (train.py's eval samples)."""
    ids = encode_prompt(tok, prompt)
    out = generate(setup, params, [ids] * num_samples, n_tokens, seed=seed, temperature=temperature,
                   top_k=top_k, top_p=top_p, stop_id=stop_token_id(tok, EOT_TEXT))
    return [tok.decode(ids + new) for new in out.tokens]
