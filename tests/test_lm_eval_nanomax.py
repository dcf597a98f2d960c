"""evals/lm_eval_nanomax.py: nanomax models inside lm-evaluation-harness. The harness tokenizes the
requests itself (TemplateLM), so equal log-likelihoods here also show that evals/scoring.py encodes
contexts and continuations as the harness does, for a GPT-2 tokenizer (no prefix) and a
Llama-style one (BOS first). Skipped where lm-eval is not installed."""

import dataclasses
import json

import numpy as np
import pytest
import tokenizers

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install -r requirements-eval.txt)"
)
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from test_hf import LLAMA, export, random_hf_gpt2, random_params, write_hf_gpt2  # noqa: E402
from test_serve import start_server  # noqa: E402
from test_tokenizer import BOS, make_tokenizer, tokenizer_json  # noqa: E402

from evals import lm_eval_nanomax  # noqa: E402
from evals import scoring  # noqa: E402
from inference import generate  # noqa: E402

GPT2_VOCAB = 50257
CONTEXTS = ["The quick brown fox", "Hello, world! Hello again", "café ☕ naïve ", "Numbers 12345 and"]
CHOICES = ["jumps over the lazy dog.", "world.", "résumé", "symbols #$%&"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> NanomaxLM over a random model: GPT-2 (tiktoken's GPT-2 BPE, no prefix) and Llama-style."""
    root = tmp_path_factory.mktemp("models")
    gpt2 = write_hf_gpt2(root / "gpt2", random_hf_gpt2(vocab_size=GPT2_VOCAB, n_positions=64), n_head=4)
    vocab = tokenizers.Tokenizer.from_str(tokenizer_json(True)).get_vocab_size(with_added_tokens=True)
    config = dataclasses.replace(LLAMA, vocab_size=vocab, block_size=64)
    llama = export(root / "llama", config, random_params(config))
    make_tokenizer(root / "llama")
    return {
        name: lm_eval_nanomax.NanomaxLM(init_from=str(path), batch_size=8, devices=1)
        for name, path in (("gpt2", gpt2), ("llama", llama))
    }


def requests(pairs, kind="loglikelihood"):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in pairs]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_harness_log_likelihoods_equal_evals_py(models, name):
    lm = models[name]
    pairs = [(c, " " + x) for c in CONTEXTS for x in CHOICES] + [("", " Hello world")]
    harness = lm.loglikelihood(requests(pairs))
    ours_pairs = [scoring.encode_pair(lm.tok, c, x) for c, x in pairs]
    sums, _, greedy = scoring.score_rows(lm.setup, lm.params, scoring.pair_rows(ours_pairs, 64), 8)
    np.testing.assert_allclose([ll for ll, _ in harness], sums, rtol=0, atol=1e-5)
    assert [g for _, g in harness] == list(greedy)
    first = lm.tok.encode(CONTEXTS[0])
    start = {"gpt2": [], "llama": [BOS]}[name]  # GPT-2: nothing before the context; Llama: its BOS
    assert ours_pairs[0][0] == start + first
    assert ours_pairs[-1][0] == [{"gpt2": GPT2_VOCAB - 1, "llama": BOS}[name]]  # an empty context


def test_local_completions_against_serve_py_gives_the_adapters_log_likelihoods(models):
    """The harness's own OpenAI-API model pointed at a running serve.py: it tokenizes through the
    server's /tokenize and scores with echo + logprobs on /v1/completions."""
    lm = models["gpt2"]
    url, process = start_server(f"--init_from={lm.cfg.init_from}", "--slots=2", "--log_interval=0")
    try:
        served_lm = LocalCompletionsAPI(
            base_url=url + "/v1/completions",
            tokenizer_backend="remote",
            model="gpt2",
            max_length=64,
            batch_size=4,
            max_retries=1,
        )
        pairs = [(c, " " + x) for c in CONTEXTS for x in CHOICES[:2]]
        served, direct = served_lm.loglikelihood(requests(pairs)), lm.loglikelihood(requests(pairs))
    finally:
        process.kill()
        process.wait()
    np.testing.assert_allclose([ll for ll, _ in served], [ll for ll, _ in direct], rtol=0, atol=1e-4)
    assert [g for _, g in served] == [g for _, g in direct]


def test_rolling_log_likelihood_of_a_short_text_is_perplexitys(models):
    lm = models["gpt2"]
    text = "The quick brown fox jumps over the lazy dog."
    (rolling,) = lm.loglikelihood_rolling(requests([(text,)], "loglikelihood_rolling"))
    result = scoring.perplexity(lm.setup, lm.params, lm.tok, text)  # one window: the same tokens scored
    assert result["tokens"] == len(lm.tok.encode(text))
    np.testing.assert_allclose(-rolling, result["loss"] * result["tokens"], rtol=1e-6)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(models):
    lm = models["gpt2"]
    out = lm.generate_until(requests([("Hello", {"until": ["e"], "max_gen_toks": 6})], "generate_until"))
    ids = generate.generate(
        lm.setup,
        lm.params,
        [lm.tok.encode("Hello")],
        6,
        temperature=0.0,
        stop_ids=lm.tok.stop_tokens,
        vocab=lm.tok.vocab_size,
    ).tokens[0]
    assert out == [lm.tok.decode(ids).split("e")[0]]


def test_a_local_task_file_runs_through_lm_evals_python_api_offline(models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rng = np.random.default_rng(0)
    data = tmp_path / "toy.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(6):
            f.write(
                json.dumps(
                    {
                        "context": CONTEXTS[i % 4],
                        "choices": list(rng.permutation(CHOICES)),
                        "label": int(rng.integers(0, 4)),
                    }
                )
                + "\n"
            )
    (tmp_path / "toy.yaml").write_text(f"""
task: nanomax_toy
dataset_path: json
dataset_kwargs:
  data_files: {{validation: {data}}}
  cache_dir: {tmp_path / "cache"}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    lm = models["gpt2"]
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["nanomax_toy"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False)
    )
    harness = results["results"]["nanomax_toy"]
    ours = scoring.multiple_choice(lm.setup, lm.params, lm.tok, scoring.read_examples(str(data), "choice"))
    assert (harness["acc,none"], harness["acc_norm,none"]) == (ours["acc"], ours["acc_norm"])
    # Registering 'nanomax' keeps the harness's own models findable (its registry loads them only while empty).
    assert {"nanomax", "hf", "local-completions"} <= set(lm_eval.api.registry.model_registry.keys())
