"""Evaluations people report: multiple-choice tasks scored by log-likelihood (HellaSwag, and
ARC, PIQA, Winogrande, ... converted to one jsonl form), and the perplexity of any text.

Multiple choice follows lm-evaluation-harness (EleutherAI), so that numbers compare with its
tables: each choice is the continuation " " + choice of the context (the harness's target
delimiter; a context's trailing whitespace moves into the continuation), and context +
continuation are encoded together, the continuation being the tokens after the context's.
What comes first is the tokenizer's own convention ("--prefix=auto"): Llama-style tokenizers
put their BOS token first, GPT-2 puts nothing (the first context token is only context); an
empty context is scored after BOS, else <|endoftext|>. `acc` picks the highest summed
log-probability; `acc_norm` the highest per character of the choice (the harness's), or with
norm='token' per token (as build-nanogpt and llm.c report HellaSwag). HellaSwag's lines are
read as the harness reads them: activity label, ctx_a, ctx_b and endings, cleaned up.

Perplexity: the text's tokens after BOS (else <|endoftext|>), in windows of block_size; each
window after the first moves on by half a window and scores only its new tokens, so every
token after that start is scored once, in later windows with at least block_size / 2 tokens
before it. Reported: the mean loss in nats, its exp (perplexity), and bits per UTF-8 byte
(comparable across tokenizers).

Rows (one per choice, or per window) are scored in batches, padded and masked, with the batch
split over the mesh's batch axes like training; results do not depend on the batch size.
"""

import dataclasses
import json
import math
import os
import re
import tempfile
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configurator
import sharding
from common import progress

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
TASKS = configurator.EVAL_TASKS  # choice: {"context", "choices", "label"} per line
PREFIXES = ("auto", "none", "bos", "eot")  # what a scored text starts after (context_prefix)
HELLASWAG_TEXTS = ("harness", "raw")  # read_examples
HELLASWAG_PARTS = ("activity_label", "ctx_a", "ctx_b")  # what the harness builds a context from


class EvalError(ValueError):
    """A missing or malformed evaluation file, or a model it can't be run on; one line."""


# ----------------------------------------------------------------------------- files


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    choices: tuple
    label: int
    where: str  # FILE:LINE, for messages


def read_examples(path: str, task: str, limit: int = 0, hellaswag_text: str = "harness") -> list:
    """The examples of a jsonl file: HellaSwag's own (ctx, endings, label; with hellaswag_text=
    'harness' its activity label, ctx_a and ctx_b as lm-evaluation-harness builds the text, 'raw'
    ctx and endings as they are, as build-nanogpt and llm.c) or the generic (context, choices,
    label); the first `limit` of them if limit > 0."""
    fields = ("ctx", "endings", "label") if task == "hellaswag" else ("context", "choices", "label")
    examples = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not text
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalError(f"{where}: malformed JSON ({e.msg}, column {e.colno})") from None
                missing = [k for k in fields if not isinstance(record, dict) or k not in record]
                if missing:
                    raise EvalError(
                        f"{where}: no {', '.join(map(repr, missing))} field (a {task} line has {', '.join(fields)})"
                    )
                context, choices, label = (record[k] for k in fields)
                if (
                    task == "hellaswag"
                    and hellaswag_text == "harness"
                    and all(isinstance(record.get(k), str) for k in HELLASWAG_PARTS)
                ):
                    context, choices = harness_hellaswag(record)
                if not (
                    isinstance(choices, list)
                    and len(choices) >= 2
                    and all(isinstance(c, str) for c in choices)
                    and isinstance(context, str)
                ):
                    raise EvalError(
                        f"{where}: {fields[0]} must be a string and {fields[1]} a list of at least two strings"
                    )
                empty = [i for i, c in enumerate(choices) if not c.strip()]
                if empty:  # no tokens to score: its log-likelihood is 0, the highest there is, so it always wins
                    raise EvalError(f"{where}: choice {empty[0]} is empty; every choice needs text to score")
                if isinstance(label, str) and label.isdigit():  # HellaSwag's files write "3"
                    label = int(label)
                if not (isinstance(label, int) and 0 <= label < len(choices)):
                    raise EvalError(f"{where}: label {label!r} is not an index of its {len(choices)} choices")
                examples.append(Example(context, tuple(choices), label, where))
                if len(examples) == limit:
                    break
    except FileNotFoundError:
        hint = " (or leave --data out to download HellaSwag's validation set)" if task == "hellaswag" else ""
        raise EvalError(f"{path} not found: pass --data=FILE.jsonl{hint}") from None
    except UnicodeDecodeError as e:
        raise EvalError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # a directory, no permission
        raise EvalError(f"{path}: {e.strerror}; pass --data=FILE.jsonl") from None
    if not examples:
        raise EvalError(f"{path} has no examples")
    return examples


def clean_hellaswag(text: str) -> str:
    """lm-evaluation-harness's clean-up of HellaSwag's text: WikiHow's [title] and [step] marks out."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def harness_hellaswag(record: dict) -> tuple:
    """(context, choices) of a line of HellaSwag's own file, as the harness builds them:
    "Activity: ctx_a Ctx_b", the endings cleaned up the same way."""
    context = f"{record['activity_label']}: {record['ctx_a']} {record['ctx_b'].capitalize()}"
    if not isinstance(record["endings"], list) or not all(isinstance(e, str) for e in record["endings"]):
        return record["ctx"], record["endings"]  # the checks below name the problem
    return clean_hellaswag(context), [clean_hellaswag(e) for e in record["endings"]]


def hellaswag_file(cache_dir: str | None = None) -> str:
    """HellaSwag's validation set (10,042 examples), downloaded once into the cache."""
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "nanomax")
    path = os.path.join(cache_dir, "hellaswag_val.jsonl")
    if os.path.isfile(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(HELLASWAG_URL, timeout=30) as response:
            out.write(response.read())
        os.replace(tmp, path)  # never a half file under the real name
    except OSError as e:
        os.unlink(tmp)
        raise EvalError(
            f"could not download HellaSwag ({e}): fetch {HELLASWAG_URL} where there is a network "
            f"and pass --data=FILE, or put it at {path}"
        ) from None
    return path


# ----------------------------------------------------------------------------- rows


@dataclasses.dataclass(frozen=True)
class Rows:
    """Token rows to score: row i is tokens[i], and its targets from index start[i] on count."""

    tokens: list
    start: list
    truncated: int  # rows whose beginning was cut to fit the context


def context_prefix(tok, prefix: str = "auto") -> list:
    """The tokens a context starts after: 'auto' = what the tokenizer itself puts first (Llama's
    BOS; nothing for GPT-2, whose Hugging Face tokenizer adds none), 'none', or the 'bos' / 'eot'
    token by name."""
    if prefix == "auto":
        return [] if tok.bos_token is None else [tok.bos_token]
    if prefix == "none":
        return []
    token = tok.bos_token if prefix == "bos" else tok.eot_token
    if token is None:
        raise EvalError(f"--prefix={prefix}: this tokenizer has no {prefix.upper()} token; use --prefix=auto or none")
    return [token]


def text_start(tok, prefix: str = "auto") -> list:
    """What a text with no context is scored after (an empty context, perplexity's text): the
    harness's prefix token, BOS else <|endoftext|> ('auto'; nothing at char level), or as asked."""
    if prefix != "auto":
        return context_prefix(tok, prefix)
    first = tok.bos_token if tok.bos_token is not None else tok.eot_token
    return [] if first is None else [first]


def encode_pair(tok, context: str, continuation: str, prefix: str = "auto") -> tuple:
    """(context ids, continuation ids) the way lm-evaluation-harness's loglikelihood makes them:
    the context's trailing whitespace moves to the continuation; context + continuation are
    encoded as one text and the continuation is what follows the context's own tokens. An empty
    context is the start token, unless the continuation already begins with it."""
    if not context:
        ids, start = tok.encode(continuation), text_start(tok, prefix)
        return (start, ids) if start and ids[:1] != start else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    start = context_prefix(tok, prefix)
    context_ids = start + tok.encode(context)
    return context_ids, (start + tok.encode(context + continuation))[len(context_ids) :]


def choice_rows(examples: list, tok, block_size: int, prefix: str = "auto") -> Rows:
    """A row per (example, choice): context + " " + choice (the continuation scored)."""
    context_prefix(tok, prefix)  # a prefix this tokenizer lacks: said once, not per example
    pairs, where = [], []
    for example in examples:
        try:
            pairs += [encode_pair(tok, example.context, " " + c, prefix) for c in example.choices]
        except ValueError as e:  # e.g. characters outside a char-level vocabulary
            raise EvalError(f"{example.where}: {e}") from None
        where += [example.where] * len(example.choices)
    return pair_rows(pairs, block_size, where)


def pair_rows(pairs: list, block_size: int, where: list | None = None) -> Rows:
    """A row per (context ids, continuation ids), cut from the left to fit block_size + 1 tokens
    (the model sees block_size of them: the last is only a target)."""
    tokens, start, truncated = [], [], 0
    for i, (context, ending) in enumerate(pairs):
        if not ending or len(ending) > block_size:
            raise EvalError(
                f"{where[i] if where else f'request {i}'}: a continuation of {len(ending)} tokens "
                f"does not fit the model's context of {block_size} + 1"
            )
        row = (context + ending)[-(block_size + 1) :]
        truncated += len(row) < len(context) + len(ending)
        tokens.append(row)
        start.append(len(row) - len(ending))
    return Rows(tokens, start, truncated)


def window_rows(ids: list, block_size: int) -> Rows:
    """Perplexity's windows: block_size + 1 tokens each, half a window apart."""
    stride, tokens, start, scored = max(block_size // 2, 1), [], [], 1  # token 0 is never a target
    for begin in range(0, max(len(ids) - 1, 1), stride):
        row = ids[begin : begin + block_size + 1]
        tokens.append(row)
        start.append(scored - begin)
        scored = begin + len(row)
        if scored >= len(ids):
            break
    return Rows(tokens, start, 0)


# ----------------------------------------------------------------------------- scoring


def make_scorer(setup):
    """score(params, tokens_BxL, mask_BxL) -> (summed log-probability of the masked targets,
    their count, whether each is the most likely token) per row; token t+1 is the target of
    position t."""
    vocab = setup.model_config.vocab_size

    def score(params, tokens_BxL, mask_BxL):
        logits_BxTxV = nnx.merge(setup.graphdef, params)(tokens_BxL[:, :-1])[..., :vocab]
        logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
        target_BxT = tokens_BxL[:, 1:]
        picked_BxT = jnp.take_along_axis(logp_BxTxV, target_BxT[..., None], axis=-1)[..., 0]
        mask_BxT = mask_BxL[:, 1:]
        greedy_BxT = jnp.argmax(logits_BxTxV, axis=-1) == target_BxT
        return (jnp.where(mask_BxT, picked_BxT, 0.0).sum(-1), mask_BxT.sum(-1), (greedy_BxT | ~mask_BxT).all(-1))

    batch = setup.batch_sharding
    replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
    return jax.jit(
        score, in_shardings=(setup.param_shardings, batch, batch), out_shardings=(replicated, replicated, replicated)
    )


def make_token_scorer(setup, top: int):
    """token_logprobs(params, tokens_BxL) -> (log-probability of each token after the first, B x L-1;
    the `top` most likely tokens at each of those positions as (log-probabilities, ids), B x L-1 x top):
    the prompt's scores that an OpenAI completion with echo and logprobs reports."""
    vocab = setup.model_config.vocab_size

    def token_logprobs(params, tokens_BxL):
        logits_BxTxV = nnx.merge(setup.graphdef, params)(tokens_BxL[:, :-1])[..., :vocab]
        logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
        picked_BxT = jnp.take_along_axis(logp_BxTxV, tokens_BxL[:, 1:, None], axis=-1)[..., 0]
        return picked_BxT, jax.lax.top_k(logp_BxTxV, top)

    return jax.jit(token_logprobs)


def score_rows(setup, params, rows: Rows, batch_rows: int = 32, label: str = "", scorer=None) -> tuple:
    """(log-probability sums, target counts, whether all targets are the most likely tokens) of
    every row, as NumPy arrays. Batches are padded to a multiple of the mesh's batch axes and
    their length to a multiple of 64 (few shapes, few compiles); padding is masked out."""
    scorer = scorer or make_scorer(setup)
    split = sharding.batch_shards(setup.mesh)
    B = -(-batch_rows // split) * split
    local = sharding.local_batch_rows(setup.batch_sharding, B)
    sums, counts, greedy, started = [], [], [], time.perf_counter()
    with sharding.activate(setup.mesh):
        for first in range(0, len(rows.tokens), B):
            chunk = rows.tokens[first : first + B]
            L = min(-(-max(map(len, chunk)) // 64) * 64, setup.model_config.block_size + 1)
            tokens, mask = np.zeros((B, L), np.int32), np.zeros((B, L), bool)
            for i, row in enumerate(chunk):
                tokens[i, : len(row)] = row
                mask[i, max(rows.start[first + i], 1) : len(row)] = True
            batch = [sharding.global_batch(a[local], setup.batch_sharding, (B, L)) for a in (tokens, mask)]
            total, count, argmax = scorer(params, *batch)
            sums.append(np.asarray(total)[: len(chunk)])
            counts.append(np.asarray(count)[: len(chunk)])
            greedy.append(np.asarray(argmax)[: len(chunk)])
            if label:
                progress.show_progress(label, min(first + B, len(rows.tokens)), len(rows.tokens), started)
    return np.concatenate(sums).astype(np.float64), np.concatenate(counts), np.concatenate(greedy)


def multiple_choice(
    setup,
    params,
    tok,
    examples: list,
    norm: str = "char",
    batch_rows: int = 32,
    label: str = "",
    scorer=None,
    prefix: str = "auto",
) -> dict:
    """acc, acc_norm (per character or per token) and the example count of a multiple-choice set."""
    rows = choice_rows(examples, tok, setup.model_config.block_size, prefix)
    sums, counts, _ = score_rows(setup, params, rows, batch_rows, label, scorer)
    return {**accuracy(examples, sums, counts, norm), "truncated": rows.truncated}


def accuracy(examples: list, sums, counts, norm: str = "char") -> dict:
    """The picks from each choice's summed log-probability and token count (a row per choice, in
    order): acc by the sum, acc_norm by the sum per character of the choice (the harness's: the
    delimiting space not counted) or per token. Ties: the first."""
    correct = correct_norm = offset = 0
    for example in examples:
        n = len(example.choices)
        total, length = sums[offset : offset + n], counts[offset : offset + n]
        if norm == "char":
            length = np.array([len(c) for c in example.choices])
        correct += int(np.argmax(total)) == example.label
        correct_norm += int(np.argmax(total / length)) == example.label
        offset += n
    return {"acc": correct / len(examples), "acc_norm": correct_norm / len(examples), "examples": len(examples)}


def perplexity(
    setup, params, tok, text: str, batch_rows: int = 32, label: str = "", scorer=None, prefix: str = "auto"
) -> dict:
    """Loss (nats per token), perplexity and bits per byte of `text` under the model."""
    start = text_start(tok, prefix)
    try:
        ids = start + tok.encode(text)
    except ValueError as e:
        raise EvalError(f"the text can't be encoded with this model's tokenizer: {e}") from None
    if len(ids) < 2:
        raise EvalError("the text is too short to score: it needs at least one token after the first")
    sums, counts, _ = score_rows(
        setup, params, window_rows(ids, setup.model_config.block_size), batch_rows, label, scorer
    )
    nats, n = -float(sums.sum()), int(counts.sum())
    n_bytes = len(text.encode("utf-8"))
    return {
        "loss": nats / n,
        "perplexity": math.exp(nats / n),
        "bits_per_byte": nats / math.log(2) / n_bytes,
        "tokens": n,
        "bytes": n_bytes,
    }


def summary(name: str, result: dict) -> str:
    """The one line a result is reported as."""
    if "acc" in result:
        cut = f", {result['truncated']} rows cut from the left to fit" if result["truncated"] else ""
        return f"{name}: acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f} ({result['examples']} examples{cut})"
    return (
        f"{name}: loss {result['loss']:.4f} perplexity {result['perplexity']:.2f} bits/byte "
        f"{result['bits_per_byte']:.4f} ({result['tokens']:,} tokens, {result['bytes']:,} bytes)"
    )


# ----------------------------------------------------------------------------- in training


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # as logged: the kind, or kind_2 for a second one of the same kind
    kind: str
    path: str
    examples: tuple = ()  # multiple choice
    text: str = ""  # perplexity


def load_tasks(spec: str, limit: int = 0) -> list:
    """The tasks of config key eval_tasks ('hellaswag:FILE,perplexity:FILE'), read and checked
    now so that a bad file fails before training starts."""
    tasks = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, path = item.partition(":")
        if kind == "hellaswag" and not path:
            path = hellaswag_file()
        name = kind if kind not in [t.kind for t in tasks] else f"{kind}_{len(tasks) + 1}"
        if kind == "perplexity":
            try:
                with open(path, encoding="utf-8-sig") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise EvalError(f"eval_tasks: perplexity file {path}: {e}") from None
            tasks.append(Task(name, kind, path, text=text))
        else:
            tasks.append(Task(name, kind, path, examples=tuple(read_examples(path, kind, limit))))
    return tasks


def run_task(task: Task, setup, params, tok, scorer=None) -> dict:
    if task.kind == "perplexity":
        return perplexity(setup, params, tok, task.text, scorer=scorer, label=f"eval {task.name}")
    return multiple_choice(setup, params, tok, list(task.examples), scorer=scorer, label=f"eval {task.name}")


def headline(task: Task, result: dict) -> str:
    """The part of training's eval line for this task."""
    if task.kind == "perplexity":
        return f"{task.name} bits/byte {result['bits_per_byte']:.4f}"
    return f"{task.name} acc_norm {result['acc_norm']:.4f}"


def log_values(task: Task, result: dict) -> dict:
    """TensorBoard scalars of a result: eval/hellaswag_acc_norm, eval/perplexity_bpb, ..."""
    if task.kind == "perplexity":
        return {f"eval/{task.name}_loss": result["loss"], f"eval/{task.name}_bpb": result["bits_per_byte"]}
    return {f"eval/{task.name}_acc": result["acc"], f"eval/{task.name}_acc_norm": result["acc_norm"]}
