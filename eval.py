"""Evaluate a checkpoint or a Hugging Face model: HellaSwag (or any multiple-choice jsonl) and
perplexity. evals/scoring.py does the work; this is its command line.

    python eval.py --out_dir=out-gpt2 --task=hellaswag                 # downloads HellaSwag val once
    python eval.py --init_from=gpt2 --task=hellaswag --data=hellaswag_val.jsonl --limit=500
    python eval.py --out_dir=out-shakespeare-char --task=perplexity --data=data/shakespeare_char/input.txt
    python eval.py --init_from=/path/to/SmolLM2-135M --task=choice --data=arc_easy.jsonl   # {context, choices, label}

prints one line: `hellaswag: acc A acc_norm B (N examples)`.

Scoring follows lm-evaluation-harness (see evals/scoring.py), so the numbers compare with its tables:
no token before a GPT-2 context, the BOS token before a Llama-style one (--prefix=auto);
acc_norm per character of the choice. --prefix=eot puts <|endoftext|> first; build-nanogpt's
and llm.c's HellaSwag ("completion style") is --norm=token --hellaswag_text=raw.
"""

import sys
import time

import configurator
from evals import scoring
from evals.loading import EvalConfig, load_model
from inference.generate import weights_in_compute_dtype


def main(argv):
    cfg = configurator.load_config_or_exit(argv, EvalConfig)
    try:
        setup, params, tok, what = load_model(cfg)
        params = weights_in_compute_dtype(setup.graphdef, params)
        start = time.perf_counter()
        if cfg.task == "perplexity":
            try:
                with open(cfg.data, encoding="utf-8-sig") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise scoring.EvalError(f"--data={cfg.data}: {e}") from None
            result = scoring.perplexity(setup, params, tok, text, cfg.batch_size, label=cfg.task, prefix=cfg.prefix)
        else:
            path = cfg.data or scoring.hellaswag_file()
            examples = scoring.read_examples(path, cfg.task, cfg.limit, cfg.hellaswag_text)
            result = scoring.multiple_choice(
                setup, params, tok, examples, cfg.norm, cfg.batch_size, label=cfg.task, prefix=cfg.prefix
            )
    except (OSError, ValueError) as e:  # EvalError, CheckpointError, HFError
        sys.exit(f"error: {e}")
    print(f"{what}, {setup.model_config.dtype}, {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(scoring.summary(cfg.task, result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
