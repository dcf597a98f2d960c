"""The README and docs/*.md say what is true (issues 42 and 63), checked without running anything:
every ```bash block and every inline `python ...` is read, and each `python SCRIPT ...` (or
`python -m MODULE ...`) must name files that exist and flags that its script takes; no two training
examples may write into one out_dir (each would stop with "out_dir ... holds checkpoints of an
earlier run" after the quickstart). The README's tables of commands and folders list exactly the
top level's files and folders, every relative link resolves, and no page names a commit of this
repository (history belongs in bench/NOTES.md)."""

import ast
import dataclasses
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from configurator import Config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_KEYS = {f.name for f in dataclasses.fields(Config)}


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def inline_commands(text: str) -> list[str]:
    """Each `python ...` written inline, outside the fenced blocks (the README's table of numbers)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`((?:\S*/)?python3? [^`\n]+)`", prose)


def commands(block: str) -> list[list[str]]:
    """Each simple command of a block as words: continuation lines joined, comments dropped, split
    at &&, ; and |; `[--flag=value]` (an optional flag, as written in the README) kept as the flag."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = [w.strip("[]") for w in lexer]
        command = []
        for word in words + [";"]:
            if word and set(word) <= set(";&|"):
                if command:
                    found.append(command)
                command = []
            else:
                command.append(word)
    return found


def python_scripts(block: str) -> list[tuple[str, list[str]]]:
    """(script, its arguments) of each `python SCRIPT.py ...` (also .venv/bin/python, after srun);
    `python -m a.b ...` is the script a/b.py."""
    runs = []
    for words in commands(block):
        for i, word in enumerate(words[:-1]):
            if re.fullmatch(r"(\S*/)?python3?", word) and words[i + 1].endswith(".py"):
                runs.append((words[i + 1], words[i + 2 :]))
                break
            if (
                re.fullmatch(r"(\S*/)?python3?", word)
                and words[i + 1] == "-m"
                and i + 2 < len(words)
                and words[i + 2] not in ("venv", "pip", "pytest")
            ):  # the repo's modules, not Python's tools
                runs.append((words[i + 2].replace(".", "/") + ".py", words[i + 3 :]))
                break
    return runs


def dataclass_fields(tree: ast.AST, names=None) -> set[str]:
    """The fields of the dataclasses defined in a module (of those named `names`, if given)."""
    return {
        item.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any("dataclass" in ast.unparse(d) for d in node.decorator_list)
        and (names is None or node.name in names)
        for item in node.body
        if isinstance(item, ast.AnnAssign)
    }


def own_options(script: str) -> set[str]:
    """The flags a script defines: the fields of its dataclasses and of those it imports from the
    repo (eval.py's EvalConfig lives in evals/loading.py), argparse's options, and the keys of an
    OWN_FLAGS dict (bench/compare_cpu.py's)."""
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    keys = set(re.findall(r"add_argument\(\s*\"--(\w+)\"", source)) | dataclass_fields(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "OWN_FLAGS":
            keys |= {key.value for key in node.value.keys}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = ROOT / (node.module.replace(".", "/") + ".py")
            if module.is_file():
                keys |= dataclass_fields(ast.parse(module.read_text()), {alias.name for alias in node.names})
    return keys


def harness_options() -> set[str]:
    """lm_eval's command-line flags, which evals/lm_eval_nanomax.py passes on (its own come from lm-eval)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        pytest.skip("lm-eval is not installed (pip install -r requirements-eval.txt): its flags are unknown")
    cli = Path(spec.origin).parent / "_cli"
    return {key for f in cli.glob("*.py") for key in re.findall(r"add_argument\(\s*\"--(\w+)\"", f.read_text())}


def takes_config(script: str) -> bool:
    """train.py, and the commands that pass the flags they don't know on to train.py's Config."""
    source = (ROOT / script).read_text()
    return script == "train.py" or "load_with_options_or_exit" in source or "OWN_FLAGS" in source


def config_file_value(path: str, key: str):
    namespace = {}
    exec(compile((ROOT / path).read_text(), path, "exec"), namespace)
    return namespace.get(key)


PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
RUNS_BY_PAGE = {
    page: [run for block in bash_blocks(text) + inline_commands(text) for run in python_scripts(block)]
    for page, text in PAGES.items()
}
RUNS = [run for runs in RUNS_BY_PAGE.values() for run in runs]
EXAMPLES = [run for text in PAGES.values() for block in bash_blocks(text) for run in python_scripts(block)]
IDS = [f"{page}: {' '.join([s, *a])}"[:90] for page, runs in RUNS_BY_PAGE.items() for s, a in runs]


def test_the_readme_and_the_docs_have_the_commands_this_test_reads():
    readme = {script for script, _ in RUNS_BY_PAGE["README.md"]}
    assert {"train.py", "sample.py"} <= readme and any(script.startswith("data/") for script in readme)
    scripts = {script for script, _ in RUNS}
    assert {
        "train.py",
        "sample.py",
        "export_hf.py",
        "eval.py",
        "bench.py",
        "compile_aot.py",
        "serve.py",
        "evals/lm_eval_nanomax.py",
    } <= scripts


def test_every_docs_page_is_linked_from_the_readme():
    unlinked = [page for page in PAGES if page.startswith("docs/") and f"]({page})" not in PAGES["README.md"]]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("script, args", RUNS, ids=IDS)
def test_every_command_names_files_that_exist_and_flags_its_script_takes(script, args):
    if script.startswith(("/", "..")):  # a checkout elsewhere (nanoGPT's model.py)
        return
    assert (ROOT / script).is_file(), f"{script} does not exist"
    keys = own_options(script) | (CONFIG_KEYS if takes_config(script) else set()) | {"help"}
    if script == "evals/lm_eval_nanomax.py":
        keys |= harness_options()
    for arg in args:
        if arg.startswith("--"):
            key = arg[2:].partition("=")[0]
            assert key in keys, f"{script} has no option --{key}"
            value = arg.partition("=")[2]
            if value.endswith(".py") and not value.startswith(("/", "..")):
                assert (ROOT / value).is_file(), f"{arg}: {value} does not exist"
        elif arg.endswith(".py"):
            assert (ROOT / arg).is_file(), f"config file {arg} does not exist"


def test_no_two_training_examples_share_an_out_dir():
    """A resumed run continues an earlier example's out_dir; the same command twice is one run."""
    out_dirs, seen, resumed = {}, set(), []
    for script, args in EXAMPLES:
        if script != "train.py" or tuple(args) in seen:
            continue
        seen.add(tuple(args))
        flags = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
        files = [a for a in args if a.endswith(".py")]
        out_dir = flags.get("out_dir") or next(
            (config_file_value(f, "out_dir") for f in reversed(files) if config_file_value(f, "out_dir")),
            Config.out_dir,
        )
        command = " ".join(["train.py", *args])
        if flags.get("init_from") == "resume":
            resumed.append((out_dir, command))
        else:
            assert out_dir not in out_dirs, f"{command!r} and {out_dirs.get(out_dir)!r} both write to {out_dir}"
            out_dirs[out_dir] = command
    for out_dir, command in resumed:
        assert out_dir in out_dirs, f"{command!r} resumes {out_dir}, which no example above trains"


def table_first_column(text: str, heading: str) -> set[str]:
    """The code names in the first column of the table under a `## heading` of the README."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def git(*args: str, stdin: str = "") -> str | None:
    """A git command's output in this checkout, or None where there is no git repository."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return None
    return done.stdout if done.returncode == 0 else None


def test_the_readme_lists_exactly_the_top_levels_files_and_folders():
    readme = PAGES["README.md"]
    assert table_first_column(readme, "Commands") == {p.name for p in ROOT.glob("*.py")}
    tracked = git("ls-files")
    if tracked is None:
        pytest.skip("not a git checkout: which folders are the repository's own is unknown")
    folders = {path.split("/")[0] + "/" for path in tracked.splitlines() if "/" in path and not path.startswith(".")}
    assert table_first_column(readme, "Where things live") == folders


def test_every_relative_link_resolves():
    broken = [
        f"{page}: {target}"
        for page, text in PAGES.items()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text)
        if "://" not in target and not ((ROOT / page).parent / target).exists()
    ]
    assert broken == []


def test_no_page_names_a_commit_of_this_repository():
    words = {word for text in PAGES.values() for word in re.findall(r"\b[0-9a-f]{7,40}\b", text)}
    candidates = sorted(word for word in words if re.search("[a-f]", word) and re.search("[0-9]", word))
    answer = git("cat-file", "--batch-check", stdin="\n".join(candidates) + "\n")
    if answer is None:
        pytest.skip("not a git checkout: commits cannot be told from other hex words")
    commits = [word for word, line in zip(candidates, answer.splitlines()) if line.split()[1:2] == ["commit"]]
    assert commits == [], f"commit hashes in README.md or docs/ (their history belongs in bench/NOTES.md): {commits}"


def test_the_readme_stays_short():
    assert len(PAGES["README.md"].splitlines()) <= 220, (
        "README.md is a guide: details go to docs/, history to bench/NOTES.md"
    )
