"""The repository's layout (DESIGN.md, "The shape"): dependencies point one way, and the
files that say they stand alone really do.

- No import cycles among the top-level modules, counting imports hidden inside functions
  (an import moved into a function to dodge a cycle is still a cycle).
- configurator.py, sharding.py, and model.py (+ layers.py, attention.py, moe.py, kv_cache.py, quantization.py, pipeline.py) work copied alone into an
  empty folder, with the rest of the repo not importable.
"""

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent


# ---- the import graph --------------------------------------------------------------------

def top_level_modules(root: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
    """Module name -> file, for every *.py in the repo root (packages like data/ excluded)."""
    return {p.stem: p for p in sorted(root.glob("*.py"))}


def imported_names(source: str) -> set[str]:
    """First components of every absolute import anywhere in the file: module level, inside
    functions, methods, conditionals and try blocks alike."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Edges a -> b where top-level module a imports top-level module b.

    `from data.x import y` names the data/ package: it is no edge unless a file data.py
    exists at the root (it doesn't). Only the first dotted component is a top-level module,
    so `import model.sub` would still mean model.py.
    """
    return {name: imported_names(path.read_text()) & modules.keys() - {name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a closed path [a, b, ..., a], or None. Deterministic (sorted order)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {node: WHITE for node in graph}
    stack: list[str] = []

    def visit(node):
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            state = color.get(nxt, WHITE)
            if state == GREY:  # back edge: the cycle is the stack from nxt onwards
                return stack[stack.index(nxt):] + [nxt]
            if state == WHITE:
                color.setdefault(nxt, WHITE)
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"train": {"compile_aot", "model"}, "compile_aot": {"train"}, "model": set()}) \
        == ["compile_aot", "train", "compile_aot"]
    assert find_cycle({"train": {"model", "sharding"}, "sample": {"train", "model"},
                       "compile_aot": {"train"}, "model": {"quantization"},
                       "sharding": set(), "quantization": set()}) is None
    assert find_cycle({}) is None


def test_import_graph_counts_imports_inside_functions_and_ignores_packages(tmp_path):
    (tmp_path / "a.py").write_text(textwrap.dedent("""\
        import os
        from data.shakespeare import prepare   # the data/ package, not a module here
        def f():
            if True:
                import b                       # hidden in a function: still an edge
        class C:
            def m(self):
                from c import thing
        """))
    (tmp_path / "b.py").write_text("import a.sub\n")
    (tmp_path / "c.py").write_text("from . import a\n")  # relative: not a top-level edge
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shakespeare.py").write_text("")
    graph = import_graph(top_level_modules(tmp_path))
    assert graph == {"a": {"b", "c"}, "b": {"a"}, "c": set()}
    assert find_cycle(graph) == ["a", "b", "a"]


def test_no_import_cycles_among_the_top_level_modules():
    modules = top_level_modules()
    assert {"train", "model", "configurator", "sharding"} <= modules.keys()
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, (f"import cycle among the top-level modules: {' -> '.join(cycle)} "
                           f"(imports inside functions count; DESIGN.md: dependencies point one way)")


# ---- files that stand alone --------------------------------------------------------------

MARKER = "STANDALONE-OK"

PROVE_ISOLATED = """
try:
    import train
except ImportError:
    pass
else:
    raise SystemExit("the repo is importable from the copy: the test proves nothing")
"""


def run_alone(tmp_path, files, script, extra_env=None):
    """Copy `files` from the repo into the empty tmp_path and run `script` there with the
    repo off the import path; return stdout."""
    for name in files:
        shutil.copy(REPO / name, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra_env or {})
    result = subprocess.run([sys.executable, "-c", PROVE_ISOLATED + textwrap.dedent(script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert MARKER in result.stdout, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_configurator_works_copied_alone_into_an_empty_folder(tmp_path):
    run_alone(tmp_path, ["configurator.py"], f"""
        import configurator
        with open("tiny.py", "w") as f:
            f.write("n_layer = 2\\nn_embd = 96\\ndataset = 'tiny'\\n")
        config = configurator.load_config(["tiny.py", "--batch_size=3", "--dropout=0.25"])
        assert (config.n_layer, config.n_embd, config.dataset) == (2, 96, "tiny"), config
        assert (config.batch_size, config.dropout) == (3, 0.25), config
        assert config.n_head == configurator.Config().n_head  # untouched: the default
        try:
            configurator.load_config(["--no_such_key=1"])
        except configurator.ConfigError:
            pass
        else:
            raise SystemExit("an unknown key was accepted")
        print("{MARKER}")
        """)


def test_sharding_works_copied_alone_into_an_empty_folder(tmp_path):
    run_alone(tmp_path, ["sharding.py"], f"""
        import jax, jax.numpy as jnp
        import sharding
        from jax.sharding import NamedSharding
        mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
        assert dict(mesh.shape) == {{"stage": 1, "data": 2, "expert": 1, "fsdp": 2, "context": 1, "tensor": 2}}, mesh.shape
        # a (batch, mlp) activation: rows over data x fsdp (4), columns over tensor (2)
        spec = sharding.mesh_axes_for(("batch", "mlp"))
        x = jax.device_put(jnp.arange(8 * 6.0).reshape(8, 6), NamedSharding(mesh, spec))
        assert {{s.data.shape for s in x.addressable_shards}} == {{(2, 3)}}, x.sharding
        # a token batch
        tokens = jax.device_put(jnp.zeros((8, 4), jnp.int32), sharding.batch_sharding(mesh))
        assert {{s.data.shape for s in tokens.addressable_shards}} == {{(2, 4)}}
        print("{MARKER}")
        """, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})


def test_model_with_quantization_works_copied_alone_into_an_empty_folder(tmp_path):
    run_alone(tmp_path, ["model.py", "layers.py", "attention.py", "moe.py", "kv_cache.py", "quantization.py", "pipeline.py"], f"""
        import jax, jax.numpy as jnp
        from flax import nnx
        import model, quantization
        config = model.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16,
                                 quantization="int8")
        calls = []
        matmul = quantization.matmul
        def counting_matmul(*args, **kwargs):
            calls.append(args[-1] if len(args) >= 3 else kwargs)
            return matmul(*args, **kwargs)
        quantization.matmul = counting_matmul
        idx = jax.random.randint(jax.random.key(1), (2, 8), 0, config.vocab_size)
        # one jitted call: eager op-by-op dispatch would be several times slower
        logits = nnx.jit(lambda idx: model.GPT(config, jax.random.key(0))(idx))(idx)
        assert logits.shape == (2, 8, config.padded_vocab_size), logits.shape
        assert bool(jnp.isfinite(logits).all())
        assert calls and all(q == "int8" for q in calls), calls  # quantization.py did the matmuls
        print("{MARKER}")
        """)
