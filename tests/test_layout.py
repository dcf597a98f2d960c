"""The repository's layout (README, "Where things live"): the top level holds the design card's
files and the commands, everything else sits in a folder named for its concern; dependencies
point one way, and the files that say they stand alone really do.

- Only the design card's files (model, sharding, configurator, train, sample, compile_aot) and
  commands (files with a `__main__` block) at the top level.
- No folder imports a top-level command: what two commands share lives in a folder (or in
  model.py, sharding.py, configurator.py), never in one of them.
- No import cycles among the modules, top level and folders alike, counting imports hidden
  inside functions (an import moved into a function to dodge a cycle is still a cycle).
- configurator.py, sharding.py, and model.py with its layers/ folder work copied alone into an
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
DESIGN_CARD = {"model", "sharding", "configurator", "train", "sample", "compile_aot"}
SKIPPED_FOLDERS = {"tests", "bench", "config", "docs"}  # not modules the program imports


# ---- the import graph --------------------------------------------------------------------


def repo_modules(root: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every *.py at the top level and in its folders
    (`layers/attention.py` -> `layers.attention`; a folder's __init__.py is the folder)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if (len(parts) > 1 and parts[0] in SKIPPED_FOLDERS) or parts[0].startswith("."):
            continue  # bench/'s scripts are skipped, bench.py (a command) is not
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        modules[".".join(parts)] = path
    return modules


def imported_modules(source: str, known) -> set[str]:
    """The repo modules a file imports anywhere in it (module level, inside functions, methods,
    conditionals and try blocks alike): `import a.b` and `from a.b import c` name `a.b`, and
    `from a import b` names `a.b` when that is a module, else `a`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in known else node.module)
    found = set()
    for name in names:  # the longest known prefix: `import layers.attention.x` is layers.attention
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                found.add(".".join(parts[:n]))
                break
    return found


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Edges a -> b where module a imports module b. A folder's __init__ is an edge of its own
    only where code imports the folder itself."""
    return {name: imported_modules(path.read_text(), modules.keys()) - {name} for name, path in modules.items()}


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
                return stack[stack.index(nxt) :] + [nxt]
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
    assert find_cycle({"train": {"compile_aot", "model"}, "compile_aot": {"train"}, "model": set()}) == [
        "compile_aot",
        "train",
        "compile_aot",
    ]
    assert (
        find_cycle(
            {
                "train": {"model", "sharding"},
                "sample": {"train", "model"},
                "compile_aot": {"train"},
                "model": {"quantization"},
                "sharding": set(),
                "quantization": set(),
            }
        )
        is None
    )
    assert find_cycle({}) is None


def test_import_graph_counts_imports_inside_functions_and_follows_folders(tmp_path):
    (tmp_path / "a.py").write_text(
        textwrap.dedent("""\
        import os
        from pkg import leaf                  # a module in a folder
        def f():
            if True:
                import b                       # hidden in a function: still an edge
        class C:
            def m(self):
                from c import thing
        """)
    )
    (tmp_path / "b.py").write_text("import a.sub\n")
    (tmp_path / "c.py").write_text("from . import a\n")  # relative: no edge
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "leaf.py").write_text("from pkg.other import x\n")
    (tmp_path / "pkg" / "other.py").write_text("import c\n")
    graph = import_graph(repo_modules(tmp_path))
    assert graph == {
        "a": {"b", "c", "pkg.leaf"},
        "b": {"a"},
        "c": set(),
        "pkg": set(),
        "pkg.leaf": {"pkg.other"},
        "pkg.other": {"c"},
    }
    assert find_cycle(graph) == ["a", "b", "a"]


def test_no_import_cycles_among_the_modules():
    modules = repo_modules()
    assert {"train", "model", "configurator", "sharding", "layers.attention", "inference.engine"} <= modules.keys()
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, (
        f"import cycle: {' -> '.join(cycle)} (imports inside functions count; dependencies point one way)"
    )


def is_command(path: pathlib.Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def top_level_commands(modules: dict[str, pathlib.Path], root: pathlib.Path = REPO) -> set[str]:
    return {name for name, path in modules.items() if path.parent == root and is_command(path)}


def folder_imports_of_commands(root: pathlib.Path = REPO) -> list[str]:
    """'a.b imports c' for each module in a folder that imports a top-level command (anywhere in it)."""
    modules = repo_modules(root)
    graph, commands = import_graph(modules), top_level_commands(modules, root)
    return sorted(f"{name} imports {command}" for name in modules if "." in name for command in graph[name] & commands)


def test_the_command_check_finds_a_folder_importing_a_command(tmp_path):
    (tmp_path / "cmd.py").write_text('import lib\nif __name__ == "__main__":\n    pass\n')
    (tmp_path / "lib.py").write_text("")  # a top-level module that is no command: fine to import
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "part.py").write_text("import lib\ndef f():\n    from cmd import x\n")
    (tmp_path / "pkg" / "other.py").write_text("from pkg import part\n")
    assert folder_imports_of_commands(tmp_path) == ["pkg.part imports cmd"]


def test_no_folder_imports_a_top_level_command():
    """A folder holds the parts the commands compose; a part that imported a command (train.py,
    serve.py, ...) would pull in a whole program, and what it wanted belongs in a folder."""
    assert {"train", "serve", "compile_aot"} <= top_level_commands(repo_modules())
    wrong = folder_imports_of_commands()
    assert wrong == [], f"folders import commands: {'; '.join(wrong)} (move what they share into a folder)"


def test_the_top_level_holds_the_design_card_and_commands_only():
    """A module that is neither a design-card file nor a command belongs in the folder of its
    concern (layers/, data/, weights/, training/, inference/, evals/, serving/, devices/, aot/)."""
    strays = [
        path.name
        for name, path in repo_modules().items()
        if "." not in name and path.parent == REPO and name not in DESIGN_CARD and not is_command(path)
    ]
    assert strays == [], f"not commands, yet at the top level: {strays}"


def test_model_and_its_layers_import_only_jax_flax_numpy_and_the_standard_library():
    allowed = {"jax", "flax", "numpy", "layers"} | set(sys.stdlib_module_names)
    for path in [REPO / "model.py", *sorted((REPO / "layers").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        roots = {
            alias.name.partition(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        roots |= {
            node.module.partition(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        }
        assert roots <= allowed, f"{path.relative_to(REPO)} imports {sorted(roots - allowed)}"


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
    """Copy `files` (and folders) from the repo into the empty tmp_path and run `script` there
    with the repo off the import path; return stdout."""
    for name in files:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra_env or {})
    result = subprocess.run(
        [sys.executable, "-c", PROVE_ISOLATED + textwrap.dedent(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert MARKER in result.stdout, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_configurator_works_copied_alone_into_an_empty_folder(tmp_path):
    run_alone(
        tmp_path,
        ["configurator.py"],
        f"""
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
        """,
    )


def test_sharding_works_copied_alone_into_an_empty_folder(tmp_path):
    run_alone(
        tmp_path,
        ["sharding.py"],
        f"""
        import types
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
        # a run's mesh from anything with the config's mesh_/dcn_ fields: configurator is not needed
        sizes = {{f"mesh_{{axis}}": 1 for axis in sharding.MESH_AXES}} | {{"mesh_fsdp": 4, "mesh_tensor": 2}}
        run = types.SimpleNamespace(**sizes, **{{f"dcn_{{axis}}": 1 for axis in sharding.MESH_AXES}})
        assert dict(sharding.mesh_from_config(run).shape) == dict(mesh.shape, data=1, fsdp=4), mesh.shape
        print("{MARKER}")
        """,
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )


def test_model_with_its_layers_folder_works_copied_alone_into_an_empty_folder(tmp_path):
    run_alone(
        tmp_path,
        ["model.py", "layers"],
        f"""
        import jax, jax.numpy as jnp
        from flax import nnx
        import model
        from layers import quantization
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
        assert calls and all(q == "int8" for q in calls), calls  # layers/quantization.py did the matmuls
        print("{MARKER}")
        """,
    )
