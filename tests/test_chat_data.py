"""data/chat/prepare.py and chat.tokenize_conversation: conversations to token ids and a loss mask,
rendered with the tokenizer's chat template as transformers renders it; the batches of a
fine-tuning set (data/dataset.py); and the offline chat set (data/chat/make_tasks.py) learned by a
tiny model and asked through serve.py's /v1/chat/completions."""

import concurrent.futures
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from test_serve import free_port
from test_tokenizer import tokenizer_json

import configurator
import sample
import train
from configurator import Config
from data import chat_template, dataset, tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "chat_templates"  # a Llama-3-style and a ChatML-style tokenizer_config.json


def load_script(relpath):
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = load_script("data/chat/prepare.py")
make_tasks = load_script("data/chat/make_tasks.py")

SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "chatml": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
}


def template_tokenizer(directory: Path, style: str) -> Path:
    """test_tokenizer's byte-level BPE (merges, so a token may span a template's seams) with the
    style's special tokens and its tokenizer_config.json from tests/chat_templates; Llama 3's adds
    BOS itself, as the real one does."""
    tok = tokenizers.Tokenizer.from_str(tokenizer_json(bos=style == "llama3"))
    tok.add_special_tokens(SPECIALS[style])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    shutil.copy(TEMPLATES / style / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Hello! Qu'est-ce qu'un café ☕?"},
    {"role": "assistant", "content": "A coffee.\nOften small."},
    {"role": "user", "content": "  And 12 + 30?  "},
    {"role": "assistant", "content": "42"},
]
# Made once with transformers 5.25.0 in a separate venv (never a dependency here):
#   PreTrainedTokenizerFast.from_pretrained(template_tokenizer(DIR, style)).apply_chat_template(MESSAGES)
#   and (MESSAGES[:-1], add_generation_prompt=True): the first PROMPT_LENGTH ids of the conversation's.
PROMPT_LENGTH = {"llama3": 122, "chatml": 119}
EXPECTED = {
    "llama3": [
        0,
        320,
        303,
        85,
        86,
        71,
        79,
        321,
        201,
        201,
        59,
        81,
        87,
        268,
        80,
        85,
        89,
        262,
        312,
        75,
        71,
        72,
        78,
        91,
        16,
        2,
        320,
        87,
        85,
        262,
        321,
        201,
        201,
        272,
        3,
        223,
        51,
        87,
        9,
        71,
        85,
        86,
        15,
        69,
        71,
        319,
        9,
        87,
        80,
        223,
        287,
        260,
        223,
        308,
        246,
        33,
        2,
        320,
        67,
        85,
        85,
        75,
        85,
        86,
        67,
        80,
        86,
        321,
        201,
        201,
        35,
        223,
        69,
        81,
        72,
        72,
        71,
        71,
        16,
        201,
        49,
        72,
        86,
        71,
        80,
        223,
        85,
        79,
        67,
        265,
        16,
        2,
        320,
        87,
        85,
        262,
        321,
        201,
        201,
        35,
        296,
        311,
        223,
        13,
        223,
        21,
        18,
        33,
        2,
        320,
        67,
        85,
        85,
        75,
        85,
        86,
        67,
        80,
        86,
        321,
        201,
        201,
        22,
        20,
        2,
    ],
    "chatml": [
        320,
        303,
        85,
        86,
        71,
        79,
        201,
        59,
        81,
        87,
        268,
        80,
        85,
        89,
        262,
        312,
        75,
        71,
        72,
        78,
        91,
        16,
        321,
        201,
        320,
        87,
        85,
        262,
        201,
        272,
        3,
        223,
        51,
        87,
        9,
        71,
        85,
        86,
        15,
        69,
        71,
        319,
        9,
        87,
        80,
        223,
        287,
        260,
        223,
        308,
        246,
        33,
        321,
        201,
        320,
        67,
        85,
        85,
        75,
        85,
        86,
        67,
        80,
        86,
        201,
        35,
        223,
        69,
        81,
        72,
        72,
        71,
        71,
        16,
        201,
        49,
        72,
        86,
        71,
        80,
        223,
        85,
        79,
        67,
        265,
        16,
        321,
        201,
        320,
        87,
        85,
        262,
        201,
        223,
        223,
        35,
        296,
        311,
        223,
        13,
        223,
        21,
        18,
        33,
        223,
        223,
        321,
        201,
        320,
        67,
        85,
        85,
        75,
        85,
        86,
        67,
        80,
        86,
        201,
        22,
        20,
        321,
        201,
    ],
}


def learned_runs(tok, ids, mask) -> list[str]:
    """The text of each run of tokens with mask 1."""
    runs, run = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(i)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    return runs


@pytest.mark.parametrize("style, end_of_turn", [("llama3", "<|eot_id|>"), ("chatml", "<|im_end|>")])
def test_a_conversation_tokenizes_as_transformers_does_and_masks_the_assistants_turns(tmp_path, style, end_of_turn):
    tok = tokenizer.hf_tokenizer(template_tokenizer(tmp_path / style, style))
    ids, mask = chat_template.tokenize_conversation(tok, MESSAGES)
    assert ids == EXPECTED[style]
    assert tok.encode(chat_template.render(tok, MESSAGES[:-1])) == EXPECTED[style][: PROMPT_LENGTH[style]]  # serve.py's
    # 1 on each assistant turn and its end-of-turn token; 0 on the newline the template writes after it
    assert learned_runs(tok, ids, mask) == ["A coffee.\nOften small." + end_of_turn, "42" + end_of_turn]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def run_prepare(*args) -> str:
    """prepare.py's main; the one line it exits with on an error, else ''."""
    try:
        prepare.main([str(a) for a in args])
    except SystemExit as e:
        return str(e.code)
    return ""


def dataset_bytes(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return template_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", "chatml")


def test_prepare_reads_each_shape_and_keeps_the_tokenizer_and_its_template(tmp_path, chatml_dir, capsys):
    rows = [
        {"messages": MESSAGES},
        {"prompt": "2+2?", "completion": "4"},
        {"instruction": "Translate.", "input": "chat", "output": "cat"},
        {"instruction": "Say hi.", "output": "hi"},
    ]
    as_messages = [MESSAGES] + [
        [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        for u, a in (("2+2?", "4"), ("Translate.\n\nchat", "cat"), ("Say hi.", "hi"))
    ]
    val = tmp_path / "val.parquet"
    pq.write_table(pa.table({"messages": [MESSAGES[1:3], MESSAGES[3:]], "source": ["a", "b"]}), val)
    out = tmp_path / "data" / "chats"
    assert (
        run_prepare(
            f"--input={write_jsonl(tmp_path / 'train.jsonl', rows)}",
            f"--val_input={val}",
            f"--tokenizer={chatml_dir}",
            f"--out_dir={out}",
            "--block_size=256",
        )
        == ""
    )
    assert "train: 4 conversations" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    tok = tokenizer.load_tokenizer(out)  # the dataset's own copy of the tokenizer, with its template
    assert (
        meta["chat"]["template"]
        == tok.chat_template
        == json.loads((TEMPLATES / "chatml" / "tokenizer_config.json").read_text())["chat_template"]
    )
    config = Config(data_dir=str(tmp_path / "data"), dataset="chats", block_size=256)
    for split, conversations in (("train", as_messages), ("val", [MESSAGES[1:3], MESSAGES[3:]])):
        data = dataset.open_chat_split(config, split, tok.vocab_size)
        ends = list(data.starts[1:]) + [len(data.tokens)]
        for start, end, messages in zip(data.starts, ends, conversations, strict=True):
            ids, mask = chat_template.tokenize_conversation(tok, messages)
            assert (list(data.tokens[start:end]), list(data.mask[start:end])) == (ids, mask)


BAD_ROWS = [
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    (
        '{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}',
        "messages[0] has role 'tool': the roles are system, user, assistant",
    ),
    ('{"messages": [{"role": "user", "content": "hi"}, ', "malformed JSON"),
    ('{"text": "hi"}', "the row has none of {messages}, {prompt, completion} or {instruction, output}"),
    ('["hi"]', "a row must be a JSON object"),
    (
        '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}',
        "messages[0].content must be a string",
    ),
]


@pytest.mark.parametrize("bad, words", BAD_ROWS)
def test_a_bad_row_stops_prepare_with_its_file_and_line_and_keeps_the_old_dataset(tmp_path, chatml_dir, bad, words):
    good = {"messages": MESSAGES}
    out = tmp_path / "chats"
    args = [f"--tokenizer={chatml_dir}", f"--out_dir={out}", "--val_fraction=0.5"]
    assert run_prepare(f"--input={write_jsonl(tmp_path / 'ok.jsonl', [good] * 4)}", *args) == ""
    before = dataset_bytes(out)
    path = write_jsonl(tmp_path / "bad.jsonl", [good, bad, good])
    message = run_prepare(f"--input={path}", *args)
    assert message.startswith(f"error: {path}:2: ") and words in message and "\n" not in message
    assert dataset_bytes(out) == before


def test_overlong_conversations_are_dropped_or_truncated_and_counted(tmp_path, chatml_dir, capsys):
    short = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    long_answer = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b" * 80}]}
    long_question = {"messages": [{"role": "user", "content": "a" * 80}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [short, long_answer, long_question, short])
    val = write_jsonl(tmp_path / "v.jsonl", [short])
    for overlong, counts in (("drop", "2 conversations, "), ("truncate", "3 conversations, ")):
        out = tmp_path / overlong
        assert (
            run_prepare(
                f"--input={path}",
                f"--val_input={val}",
                f"--tokenizer={chatml_dir}",
                f"--out_dir={out}",
                "--block_size=99",
                f"--overlong={overlong}",
            )
            == ""
        )
        printed = capsys.readouterr().out
        assert f"train: {counts}" in printed
        if overlong == "drop":
            assert "dropped 2 longer than block_size + 1 = 100 tokens" in printed
        else:  # the long answer keeps its first 100 tokens; nothing of the other's answer is left
            assert "dropped 1 longer" in printed and "truncated 1 to their first 100 tokens" in printed
        data = dataset.open_chat_split(Config(data_dir=str(tmp_path), dataset=overlong, block_size=99), "train", 400)
        assert np.diff(np.append(data.starts, len(data.tokens))).max() <= 100


def test_the_hub_route_offline_is_one_message(tmp_path, chatml_dir, monkeypatch):
    monkeypatch.setattr(prepare.corpus, "hub_reachable", lambda: False)  # as on this machine: no DNS
    monkeypatch.setattr(prepare.corpus.hf_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    message = run_prepare("--hub=HuggingFaceTB/smol-smoltalk", f"--tokenizer={chatml_dir}", f"--out_dir={tmp_path}/x")
    assert message.startswith("error: cannot reach the Hugging Face Hub") and "--input=FOLDER" in message
    assert "smol-smoltalk" in message and "\n" not in message


# ---- the offline chat set, end to end


@pytest.fixture(scope="module")
def tasks_run(tmp_path_factory):
    """data/chat/make_tasks.py's set, prepared and learned as config/sft_tasks.py says."""
    root = tmp_path_factory.mktemp("sft")
    make_tasks.make(root / "tasks")
    assert (
        run_prepare(
            f"--input={root / 'tasks' / 'train.jsonl'}",
            f"--val_input={root / 'tasks' / 'val.jsonl'}",
            f"--tokenizer={root / 'tasks' / 'tokenizer'}",
            "--block_size=128",
            f"--out_dir={root / 'data' / 'chat_tasks'}",
        )
        == ""
    )
    # as docs/finetuning.md's commands, but one short eval (and checkpoint) at the end, and no logs to write
    config = configurator.load_config(
        [
            str(ROOT / "config" / "sft_tasks.py"),
            f"--data_dir={root / 'data'}",
            f"--out_dir={root / 'out'}",
            "--eval_interval=1000",
            "--eval_iters=2",
            "--log_interval=100",
            "--tensorboard=False",
        ]
    )
    start = time.perf_counter()
    train.train(config, jax.devices()[:1])
    print(f"\nsft_tasks: {config.max_iters} steps in {time.perf_counter() - start:.0f} s")
    return root, config.out_dir


def held_out_turns(path: Path, n_conversations: int) -> list[tuple[list, str]]:
    """(the messages before an assistant turn, that turn's words) for each turn of the first conversations."""
    turns = []
    for line in path.read_text().splitlines()[:n_conversations]:
        messages = json.loads(line)["messages"]
        turns += [(messages[:i], m["content"]) for i, m in enumerate(messages) if m["role"] == "assistant"]
    return turns


def test_the_offline_chat_set_is_learned_and_answered_through_serve(tasks_run):
    """>= 95% of the held-out questions answered exactly over HTTP (words never seen in training)."""
    root, out_dir = tasks_run
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "serve.py"),
            f"--out_dir={out_dir}",
            f"--port={port}",
            "--slots=16",
            "--log_interval=0",
            "--model_name=tasks",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while not serving(url):
            assert server.poll() is None and time.time() < deadline, server.stdout.read() if server.poll() else "no 200"
            time.sleep(0.3)
        turns = held_out_turns(root / "tasks" / "val.jsonl", 100)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda turn: ask(url, turn[0]), turns))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    right = sum(reply == (answer, "stop") for reply, (_, answer) in zip(replies, turns))
    print(f"held-out turns answered exactly through /v1/chat/completions: {right}/{len(turns)}")
    assert right >= 0.95 * len(turns), [(r, a) for r, (_, a) in zip(replies, turns) if r != (a, "stop")][:10]


def serving(url) -> bool:
    try:
        return urllib.request.urlopen(url + "/health", timeout=5).status == 200
    except OSError:  # refused while starting, or 503 while the model loads
        return False


def ask(url, messages) -> tuple[str, str]:
    """(the assistant's words, finish reason) for a greedy answer to messages."""
    body = json.dumps({"model": "tasks", "messages": messages, "temperature": 0, "max_tokens": 8}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_sample_chat_streams_each_assistant_turn(tasks_run, tmp_path, capsys):
    root, out_dir = tasks_run
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "upper cat"},
        {"role": "assistant", "content": "(replaced by the model's)"},
        {"role": "user", "content": "7+8"},
    ]
    (tmp_path / "chat.json").write_text(json.dumps(messages))
    sample.main([f"--out_dir={out_dir}", "--chat=True", f"--messages={tmp_path / 'chat.json'}", "--temperature=0"])
    assert capsys.readouterr().out == "user> upper cat\nassistant> CAT\nuser> 7+8\nassistant> 15\n"
