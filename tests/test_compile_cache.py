"""common/compile_cache.py in processes of their own (JAX opens its cache once per process): a second
process loads what the first compiled, and a folder it can't write or entries it can't read cost one
line each, never the run. serve.py's and sample.py's use of it (and '' turning it off): tests/test_serve.py,
tests/test_sample.py."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A command's use of the module, on two small programs.
SCRIPT = """
import sys
import jax
import jax.numpy as jnp
from common import compile_cache

if warning := compile_cache.use(sys.argv[1]):
    print(warning)
x = jnp.arange(4.0)
print(jax.jit(lambda x: jnp.cumsum(x * 3 + 1))(x).tolist())
print(compile_cache.summary())
"""
RESULT = "[1.0, 5.0, 12.0, 22.0]"


def run(folder) -> list[str]:
    """The lines the script printed (stdout and stderr) with the cache in `folder`."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return (done.stdout + done.stderr).splitlines()


def programs(summary: str) -> tuple[int, str]:
    """(programs, what the parentheses say) of a summary line: '3 programs (3 from the cache)'."""
    count, _, rest = summary.partition(" program")
    return int(count), rest.partition("(")[2].rstrip(")")


def test_a_second_process_loads_the_programs_the_first_compiled(tmp_path):
    first, second = run(tmp_path), run(tmp_path)
    assert first[0] == second[0] == RESULT and len(first) == len(second) == 2
    count, said = programs(first[1])
    assert count >= 1 and said == "0 from the cache"
    assert programs(second[1]) == (count, f"{count} from the cache")
    assert len(list(tmp_path.glob("*-cache"))) == count  # every program written, however quick its compile


def test_a_folder_that_cannot_be_written_is_one_warning_and_no_cache(tmp_path):
    (tmp_path / "a-file").write_text("")
    for folder in (tmp_path / "a-file", tmp_path / "a-file" / "cache"):
        warning, result, summary = run(folder)
        assert warning.startswith(f"warning: --compile_cache={folder}: can't write there")
        assert "compiling without the cache" in warning
        assert result == RESULT and programs(summary)[1] == "compilation cache off"


def test_entries_that_cannot_be_read_are_one_line_and_compiled_again(tmp_path):
    count = programs(run(tmp_path)[1])[0]
    garbage = (b"", b"not a program", os.urandom(3000))  # a write cut short, or another program's bytes
    for i, entry in enumerate(sorted(tmp_path.glob("*-cache"))):
        entry.write_bytes(garbage[i % len(garbage)])
    warning, result, summary = run(tmp_path)  # one line for all of them: no Python warnings, no traceback
    assert warning.startswith(f"warning: the compilation cache {tmp_path} has an entry JAX can't use")
    assert result == RESULT and programs(summary) == (count, "0 from the cache")
