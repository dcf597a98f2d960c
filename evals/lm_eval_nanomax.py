"""nanomax models inside lm-evaluation-harness (EleutherAI's `lm_eval`, an optional dependency:
pip install -r requirements-eval.txt).

    python -m evals.lm_eval_nanomax --model_args out_dir=out-gpt2 --tasks hellaswag
    python -m evals.lm_eval_nanomax --model_args init_from=/path/to/SmolLM2-135M --tasks arc_easy,piqa --batch_size 64

takes every flag of the `lm_eval` command (--tasks, --limit, --num_fewshot, --output_path,
--include_path for local task files, --batch_size: rows per forward pass, 32 unless given) and
adds `--model nanomax`. From Python, importing this file registers the model name:
lm_eval.simple_evaluate(model="nanomax", model_args=..., batch_size=32).

model_args: out_dir=DIR (the newest intact checkpoint there) or init_from=NAME|DIR (a Hugging
Face model); dtype, devices, prefix, as eval.py takes them; max_gen_toks (generate_until's
default length, 256 as the harness's own models).

The harness tokenizes (TemplateLM): a context starts with what the tokenizer itself puts first
(prefix=auto: Llama's BOS, nothing for GPT-2), an empty one with BOS else <|endoftext|>; this
file scores the token rows with evals/scoring.py's batched scorer and generates with inference/generate.py, greedy
unless a task asks to sample.
"""

import importlib
import sys

try:
    from lm_eval import utils as lm_utils
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    # The harness's own models ('hf', 'local-completions', ...): its registry looks them up only
    # while it is empty, so they go in before 'nanomax' does.
    importlib.import_module("lm_eval.models")
except ImportError as e:
    raise ImportError(
        f"evals/lm_eval_nanomax.py needs lm-evaluation-harness ({e}): pip install -r requirements-eval.txt"
    ) from None

import numpy as np

import configurator
from evals import loading, scoring
from inference import generate


@register_model("nanomax")
class NanomaxLM(TemplateLM):
    """A nanomax checkpoint or Hugging Face model as the harness's LM: loglikelihood (the harness's
    own, over tok_encode and _loglikelihood_tokens below), loglikelihood_rolling, generate_until."""

    def __init__(
        self,
        out_dir: str = "out",
        init_from: str = "resume",
        batch_size=32,
        dtype: str = "auto",
        devices=0,
        prefix: str = "auto",
        max_gen_toks=256,
        max_batch_size=None,
        device=None,
        **unused,
    ):
        super().__init__()
        if unused:
            raise configurator.ConfigError(
                f"nanomax model_args: unknown {', '.join(sorted(unused))}; known: "
                f"out_dir, init_from, dtype, devices, prefix, max_gen_toks"
            )
        batch_size = 32 if str(batch_size).startswith("auto") else int(batch_size)  # no automatic search
        self.cfg = loading.EvalConfig(
            init_from=init_from,
            out_dir=out_dir,
            batch_size=batch_size,
            dtype=dtype,
            devices=int(devices),
            prefix=prefix,
        )
        self.setup, params, self.tok, self.what = loading.load_model(self.cfg)
        self.params = generate.weights_in_compute_dtype(self.setup.graphdef, params)
        self.scorer = scoring.make_scorer(self.setup)  # one compiled program per batch shape, kept
        self.block_size = self.setup.model_config.block_size
        self.max_gen_toks = int(max_gen_toks)
        scoring.context_prefix(self.tok, prefix)  # a prefix this tokenizer lacks fails now

    # --- what TemplateLM asks for

    @property
    def eot_token_id(self):
        return self.tok.eot_token

    @property
    def prefix_token_id(self):
        """The token an empty context (and each rolling text) is scored after: the harness needs one."""
        start = scoring.text_start(self.tok, self.cfg.prefix) or scoring.text_start(self.tok)
        if not start:
            raise scoring.EvalError(
                "this tokenizer has neither a BOS nor an end-of-text token, which the harness "
                "scores a text's first token after (empty contexts, loglikelihood_rolling)"
            )
        return start[0]

    @property
    def max_length(self) -> int:
        return self.block_size

    @property
    def tokenizer_name(self) -> str:
        return f"nanomax-{self.tok.kind}-{self.tok.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list:
        """As a Hugging Face tokenizer: the tokenizer's own first token (per prefix) unless asked not to."""
        start = [] if add_special_tokens is False else scoring.context_prefix(self.tok, self.cfg.prefix)
        return start + self.tok.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list:
        """requests: ((context, continuation), context ids, continuation ids) -> (log-probability, greedy)."""
        if not requests:
            return []
        rows = scoring.pair_rows([(context, ending) for _, context, ending in requests], self.block_size)
        sums, _, greedy = self.score(rows)
        answers = [(float(s), bool(g)) for s, g in zip(sums, greedy)]
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
        """The log-likelihood of each whole text in the harness's disjoint windows: each token scored
        once, the first after the prefix token. As the harness's Hugging Face model does, the text is
        encoded with the tokenizer's own first token, so a Llama-style one scores BOS after BOS."""
        pairs, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.block_size,
                context_len=1,
            )
            for window in map(lm_utils.make_disjoint_window, windows):
                pairs.append(window)
                owner.append(i)
        sums = self.score(scoring.pair_rows(pairs, self.block_size))[0] if pairs else np.zeros(0)
        totals = np.zeros(len(requests))
        np.add.at(totals, np.array(owner, dtype=int), sums)
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list:
        """Greedy text after each context (sampled where a task sets do_sample), cut at the first
        of its `until` strings; a batch per set of generation settings."""
        out = [None] * len(requests)
        groups = {}
        for i, req in enumerate(requests):
            context, options = req.args
            groups.setdefault(repr(sorted(options.items())), []).append((i, context, options))
        for group in groups.values():
            options = dict(group[0][2])
            until = options.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(options.pop("temperature", 0.0)) if options.pop("do_sample", False) else 0.0
            # The harness keeps the last max_length - max_gen_toks context tokens; inference/generate.py goes on
            # past the context in windows, so keep at least half of it.
            keep = max(self.block_size - max_new, self.block_size // 2)
            for first in range(0, len(group), self.cfg.batch_size):
                chunk = group[first : first + self.cfg.batch_size]
                prompts = [self.tok_encode(context)[-keep:] or [self.prefix_token_id] for _, context, _ in chunk]
                result = generate.generate(
                    self.setup,
                    self.params,
                    prompts,
                    max_new,
                    temperature=temperature,
                    stop_ids=self.tok.stop_tokens,
                    vocab=self.tok.vocab_size,
                )
                for (i, _, _), new in zip(chunk, result.tokens):
                    text = self.tok.decode(new)
                    for stop in until:
                        text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def score(self, rows: scoring.Rows) -> tuple:
        """evals.score_rows over rows taken longest first (fewer padded tokens), in their order."""
        order = sorted(range(len(rows.tokens)), key=lambda i: -len(rows.tokens[i]))
        ordered = scoring.Rows([rows.tokens[i] for i in order], [rows.start[i] for i in order], rows.truncated)
        results = scoring.score_rows(self.setup, self.params, ordered, self.cfg.batch_size, scorer=self.scorer)
        back = np.argsort(order)
        return tuple(r[back] for r in results)


def main(argv) -> None:
    """The `lm_eval` command with this model registered: `--model nanomax` unless another is named,
    and 32 rows a batch unless --batch_size says (the harness's default is 1)."""
    sys.argv = [
        "lm_eval",
        *(["--model", "nanomax"] if "--model" not in argv else []),
        *(["--batch_size", "32"] if not {"--batch_size", "-b"} & set(argv) else []),
        *argv,
    ]
    try:
        cli_evaluate()
    except (OSError, ValueError) as e:  # EvalError, ConfigError, CheckpointError, HFError
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
