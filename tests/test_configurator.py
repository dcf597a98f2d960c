"""configurator.py: defaults < config file < --key=value flags, and the errors for bad input."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # configurator.py lives at the repo root

import configurator  # noqa: E402
from configurator import Config, ConfigError, load_config  # noqa: E402

DEFAULTS = Config()


def write(tmp_path, text, name="cfg.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(argv) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load_config(argv)
    return str(excinfo.value)


# --- precedence ---------------------------------------------------------------------------


def test_no_arguments_gives_the_defaults():
    assert load_config([]) == DEFAULTS


def test_file_overrides_defaults_and_flags_override_file(tmp_path):
    path = write(tmp_path, "n_layer = 3\nn_head = 2\nn_embd = 64\nbatch_size = 5\n")
    config = load_config([path, "--batch_size=7"])
    assert config.n_layer == 3 and config.n_head == 2 and config.n_embd == 64  # from the file
    assert config.batch_size == 7  # the flag wins over the file
    assert config.learning_rate == DEFAULTS.learning_rate  # untouched keys keep the default
    assert DEFAULTS.n_layer != 3 and DEFAULTS.batch_size not in (5, 7)


def test_arguments_apply_in_order(tmp_path):
    # A flag before a file is overridden by the file; a later file overrides an earlier one.
    first = write(tmp_path, "batch_size = 5\n", "first.py")
    second = write(tmp_path, "batch_size = 6\n", "second.py")
    assert load_config(["--batch_size=9", first]).batch_size == 5
    assert load_config([first, second]).batch_size == 6
    assert load_config([first, second, "--batch_size=9"]).batch_size == 9


# --- flag parsing -------------------------------------------------------------------------


def test_int_flag_for_float_field_is_stored_as_float():
    config = load_config(["--learning_rate=1", "--grad_clip=0"])
    assert config.learning_rate == 1.0 and type(config.learning_rate) is float
    assert config.grad_clip == 0.0 and type(config.grad_clip) is float


def test_int_in_config_file_for_float_field_is_stored_as_float(tmp_path):
    config = load_config([write(tmp_path, "min_lr = 0\n")])
    assert config.min_lr == 0.0 and type(config.min_lr) is float


def test_bool_int_and_float_flags_parse():
    config = load_config(
        ["--bias=False", "--decay_lr=True", "--max_iters=600_000", "--dropout=0.25", "--learning_rate=3e-4"]
    )
    assert config.bias is False and config.decay_lr is True
    assert config.max_iters == 600_000 and type(config.max_iters) is int
    assert config.dropout == 0.25 and config.learning_rate == 3e-4


def test_string_flags_stay_strings():
    config = load_config(["--dataset=openwebtext", "--out_dir=123", "--data_dir=1.5", "--dtype=bfloat16"])
    assert config.dataset == "openwebtext"
    assert config.out_dir == "123" and type(config.out_dir) is str  # looks like an int
    assert config.data_dir == "1.5"  # looks like a float
    assert config.dtype == "bfloat16"


def test_flag_without_value_is_an_error():
    message = error_of(["--bias"])
    assert "--bias" in message and "--bias=VALUE" in message


# --- unknown keys -------------------------------------------------------------------------


def test_unknown_flag_suggests_close_matches():
    message = error_of(["--batchsize=4"])
    assert "batchsize" in message and "batch_size" in message


def test_unknown_flag_without_close_match_points_to_the_keys():
    message = error_of(["--zzzzqqq=1"])
    assert "zzzzqqq" in message and "configurator.py" in message


def test_unknown_key_in_file_names_file_and_suggests(tmp_path):
    path = write(tmp_path, "n_layers = 4\n")
    message = error_of([path])
    assert path in message and "n_layers" in message and "n_layer" in message.replace("n_layers", "")


# --- wrong types --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, key, expected, given",
    [
        ("--n_layer=1.5", "n_layer", "int", "1.5"),
        ("--dropout=abc", "dropout", "float", "'abc'"),
        ("--bias=1", "bias", "bool", "1"),
        ("--batch_size=True", "batch_size", "int", "True"),  # a bool is not an int here
    ],
)
def test_wrong_type_names_key_expected_type_and_value(flag, key, expected, given):
    message = error_of([flag])
    assert f"'{key}'" in message and f"expects {expected}" in message and given in message


def test_wrong_type_in_file(tmp_path):
    message = error_of([write(tmp_path, "n_head = '4'\n")])
    assert "n_head" in message and "int" in message and "'4'" in message


# --- config files -------------------------------------------------------------------------


def test_missing_file_is_a_one_line_error(tmp_path):
    path = str(tmp_path / "nope.py")
    message = error_of([path])
    assert path in message and "does not exist" in message and "\n" not in message


@pytest.mark.parametrize(
    "text, exc_name",
    [
        ("raise RuntimeError('boom')\n", "RuntimeError"),
        ("n_layer = undefined_name\n", "NameError"),
        ("n_layer = = 2\n", "SyntaxError"),
    ],
)
def test_file_that_raises_is_a_one_line_error(tmp_path, text, exc_name):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_config([path])
    message = str(excinfo.value)
    assert path in message and exc_name in message and "\n" not in message


def test_imports_helpers_and_private_names_in_file_are_ignored(tmp_path):
    path = write(
        tmp_path,
        "import math\nfrom math import sqrt\nfrom collections import OrderedDict\n"
        "_x = 1\n_scale = 3\n"
        "def width(heads):\n    return 16 * heads\n"
        "n_head = _scale\nn_embd = width(n_head)\nn_layer = int(math.sqrt(16))\n",
    )
    config = load_config([path])
    assert (config.n_head, config.n_embd, config.n_layer) == (3, 48, 4)


@pytest.mark.parametrize("path", sorted(str(p) for p in (ROOT / "config").glob("*.py")))
def test_shipped_config_files_load(path):
    config = load_config([path])
    assert isinstance(config, Config) and config != DEFAULTS


def test_shipped_config_files_exist():
    assert len(list((ROOT / "config").glob("*.py"))) >= 2


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, words",
    [
        ("--dtype=float16", ["dtype", "'float16'", "'float32'", "'bfloat16'"]),
        ("--remat_policy=bogus", ["remat_policy", "'bogus'", "'dots_saveable'"]),
        ("--init_from=./no/such/dir", ["init_from", "'./no/such/dir'", "'scratch'", "'resume'", "hub name"]),
        ("--quantization=int4", ["quantization", "'int4'", "'int8'", "'fp8'"]),
        ("--attention=flash", ["attention", "'flash'", "'auto'", "'cudnn'"]),
        ("--optimizer=adam", ["optimizer", "did you mean 'adamw'?"]),
    ],
)
def test_choice_validation(flag, words):
    message = error_of([flag])
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--n_layer=0"], ["n_layer", ">= 1", "0"]),
        (["--batch_size=-2"], ["batch_size", ">= 1", "-2"]),
        (["--dropout=1.0"], ["dropout", "[0, 1)", "1.0"]),
        (["--dropout=-0.1"], ["dropout", "-0.1"]),
        (["--n_embd=100", "--n_head=3"], ["n_embd", "100", "n_head", "3", "divisible"]),
        (["--attention=cudnn"], ["attention='cudnn'", "dtype='bfloat16'", "float32"]),
        (["--context_attention=ring", "--dropout=0.1"], ["context_attention='ring'", "dropout=0"]),
        (["--fsdp_reduce_once=True", "--mesh_context=2"], ["fsdp_reduce_once", "mesh_context=1"]),
    ],
)
def test_range_checks(flags, words):
    message = error_of(flags)
    for word in words:
        assert word in message


def test_range_check_edges_are_accepted():
    config = load_config(["--n_layer=1", "--dropout=0.0", "--n_embd=96", "--n_head=3"])
    assert config.n_layer == 1 and config.dropout == 0.0


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.n_layer = 3


# --- saving, rebuilding, exiting ----------------------------------------------------------


def test_json_round_trip(tmp_path):
    config = load_config(
        [str(ROOT / "config" / "shakespeare_char.py"), "--learning_rate=1", "--bias=False", "--out_dir=123"]
    )
    rebuilt = configurator.config_from_dict(json.loads(configurator.config_to_json(config)))
    assert rebuilt == config
    assert type(rebuilt.learning_rate) is float and type(rebuilt.out_dir) is str


def test_config_from_dict_rejects_unknown_and_mistyped_keys():
    values = json.loads(configurator.config_to_json(DEFAULTS))
    with pytest.raises(ConfigError, match="batch_size"):
        configurator.config_from_dict({**values, "batchsize": 4})
    with pytest.raises(ConfigError, match="n_layer"):
        configurator.config_from_dict({**values, "n_layer": "12"})


def test_load_config_or_exit_exits_with_a_config_error_line():
    with pytest.raises(SystemExit) as excinfo:
        configurator.load_config_or_exit(["--batchsize=4"])
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("config error:")
    assert "batch_size" in message and "\n" not in message


def test_load_config_or_exit_returns_the_config():
    assert configurator.load_config_or_exit(["--n_layer=2"]).n_layer == 2


def test_tokens_per_step():
    config = load_config(["--batch_size=3", "--gradient_accumulation_steps=5", "--block_size=7"])
    assert config.tokens_per_step == 3 * 5 * 7


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--pos_embedding=alibi"], ["pos_embedding", "'alibi'", "'learned'", "'rope'"]),
        (["--norm=batchnorm"], ["norm", "'layernorm'", "'rmsnorm'"]),
        (["--mlp=relu"], ["mlp", "'gelu'", "'swiglu'"]),
        (["--n_head=12", "--n_kv_head=5"], ["n_head (12)", "n_kv_head (5)", "divisible"]),
        (["--n_kv_head=-1"], ["n_kv_head", ">= 0"]),
        (["--n_embd=36", "--n_head=4", "--pos_embedding=rope"], ["rope", "even head size", "9"]),
        (["--rope_theta=0"], ["rope_theta", "> 0"]),
    ],
)
def test_architecture_options_are_checked(flags, words):
    message = error_of(flags)
    for word in words:
        assert word in message


def test_architecture_defaults_are_gpt2_and_every_model_field_is_a_config_key():
    import model

    gpt2 = model.GPTConfig()
    for field in dataclasses.fields(model.GPTConfig):  # train.model_config copies them by name
        # attention: 'auto' is resolved per device; pipeline_stages is the mesh's stage axis;
        # kv_cache_dtype is chosen when a model is loaded for decoding, not trained with
        if field.name not in ("vocab_size", "attention", "pipeline_stages", "kv_cache_dtype"):
            assert getattr(DEFAULTS, field.name) == getattr(gpt2, field.name), field.name
    assert DEFAULTS.attention == "auto" and gpt2.attention == "xla"
    llama = load_config([str(ROOT / "config" / "llama_style_small.py")])
    assert (llama.pos_embedding, llama.norm, llama.mlp) == ("rope", "rmsnorm", "swiglu")
    assert 0 < llama.n_kv_head < llama.n_head


def test_every_key_has_exactly_one_role_and_resuming_keeps_the_model_keys():
    """A key added to Config without a role fails here: what a resumed run does with it must be
    decided, not left to chance (configurator.ROLES)."""
    listed = [key for keys in configurator.ROLES.values() for key in keys]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(Config)), "each key once, in one role"
    import model  # every field that shapes or defines the network is a model or compute key

    for field in dataclasses.fields(model.GPTConfig):
        if hasattr(DEFAULTS, field.name) and field.name not in ("dropout", "lora_dropout"):  # training only
            assert configurator.ROLE[field.name] in ("model", "compute", "run"), field.name
    saved = {**dataclasses.asdict(DEFAULTS), "rope_theta": 500000.0, "dtype": "bfloat16", "learning_rate": 1e-3}
    values = configurator.resume_values({"init_from": "resume", "dtype": "float32"}, saved)
    assert values["rope_theta"] == 500000.0  # model: the checkpoint's
    assert values["dtype"] == "float32"  # compute: as given...
    assert "learning_rate" not in values  # optimizer: as given (here, the default)
    changes = configurator.changes_since(Config(**values), saved)
    assert changes == ["dtype 'bfloat16' -> 'float32'", "learning_rate 0.001 -> 0.0006"]  # ...and said
    with pytest.raises(ConfigError, match=r"rope_theta=10000.0 \(the checkpoint's: 500000.0\).*drop this key"):
        configurator.resume_values({"rope_theta": 10000.0}, saved)


def test_every_config_file_loads_and_the_fast_run_trains_the_default_runs_model_size_on_its_data():
    for path in sorted((ROOT / "config").glob("*.py")):
        load_config([str(path)])
    default = load_config([str(ROOT / "config" / "shakespeare_char.py")])
    fast = load_config([str(ROOT / "config" / "shakespeare_char_fast.py")])
    for key in (
        "dataset",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "batch_size",
        "gradient_accumulation_steps",
        "eval_iters",
    ):  # the same model size, tokens per step and val measurement
        assert getattr(fast, key) == getattr(default, key), key
    assert fast.optimizer == "muon" and fast.max_iters < default.max_iters


# --- values a user could get wrong (issue 14) ---------------------------------------------


def exit_line(argv, cls=Config) -> str:
    """What a script says for argv: one line through SystemExit, never a traceback."""
    with pytest.raises(SystemExit) as excinfo:
        configurator.load_config_or_exit(argv, cls)
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("config error: ") and "\n" not in message
    return message


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--learning_rate=-0.001"], ["'learning_rate'", ">= 0", "-0.001"]),
        (["--beta1=1.0"], ["'beta1'", "[0, 1)", "1.0"]),
        (["--beta2=-0.5"], ["'beta2'", "[0, 1)", "-0.5"]),
        (["--min_lr=0.001"], ["min_lr (0.001)", "learning_rate = 0.0006", "decay_lr=False"]),
        (["--min_lr=-1e-5"], ["min_lr (-1e-05)", "[0, learning_rate"]),
        (
            ["--warmup_iters=100", "--lr_decay_iters=50"],
            ["lr_decay_iters (50)", "warmup_iters (100)", "decay_lr=False"],
        ),
        (["--weight_decay=-0.1"], ["'weight_decay'", ">= 0"]),
        (["--grad_clip=-1"], ["'grad_clip'", ">= 0"]),
        (["--warmup_iters=-1"], ["'warmup_iters'", ">= 0"]),
        (["--lr_decay_iters=-5"], ["'lr_decay_iters'", ">= 0"]),
        (["--keep_best=-1"], ["'keep_best'", ">= 0"]),
        (["--max_iters=-1"], ["'max_iters'", ">= 0"]),
        (["--sample_tokens=-3"], ["'sample_tokens'", ">= 0"]),
        (["--stack_dump_interval=-60"], ["'stack_dump_interval'", ">= 0"]),
        (["--vocab_size=-1"], ["'vocab_size'", ">= 0"]),
        (["--seed=-1"], ["'seed'", ">= 0"]),
        (["--profile_steps=13:10"], ["profile_steps='13:10'", "traces no step", "STOP must be greater"]),
        (["--profile_steps=5:5"], ["profile_steps='5:5'", "traces no step"]),
        (["--max_iters=8", "--profile_steps=6:10"], ["profile_steps='6:10'", "last step (7", "STOP <= max_iters"]),
        (["--out_dir="], ["out_dir must name a directory, e.g. --out_dir=out"]),
        (["--out_dir=   "], ["out_dir must name a directory, e.g. --out_dir=out"]),
        (["--dataset="], ["dataset must name a directory"]),
        (["--process_id=1"], ["process_id (1)", "num_processes - 1 (0)"]),
        (["--num_processes=2"], ["num_processes=2 needs coordinator_address"]),
    ],
)
def test_out_of_range_values_are_one_line_errors_naming_key_and_range(flags, words):
    message = exit_line(flags)
    for word in words:
        assert word in message


def test_infinite_or_nan_float_in_a_config_file_is_refused(tmp_path):
    assert "'learning_rate' must be a finite number, got inf" in exit_line(
        [write(tmp_path, "learning_rate = float('inf')\n")]
    )
    assert "'dropout' must be a finite number, got nan" in exit_line([write(tmp_path, "dropout = float('nan')\n")])


def test_valid_edges_of_the_new_checks_are_accepted():
    config = load_config(
        [
            "--learning_rate=0",
            "--min_lr=0",
            "--beta1=0",
            "--beta2=0.999",
            "--grad_clip=0",
            "--weight_decay=0",
            "--warmup_iters=0",
            "--max_iters=13",
            "--profile_steps=10:13",
        ]
    )
    assert config.profile_steps == "10:13"  # steps 10, 11, 12: the last step of the run is 12
    assert load_config(["--decay_lr=False", "--min_lr=1.0"]).min_lr == 1.0  # unused without decay
    assert load_config(["--num_processes=2", "--process_id=1", "--coordinator_address=h:1"]).process_id == 1
    # test_train.py's small runs
    Config(
        max_iters=8,
        profile_steps="2:4",
        eval_interval=4,
        lr_decay_iters=8,
        min_lr=3e-4,
        learning_rate=3e-3,
        warmup_iters=2,
    )


def test_overwrite_out_dir_is_off_by_default_and_contradicts_resume():
    assert DEFAULTS.overwrite_out_dir is False
    assert load_config(["--overwrite_out_dir=True"]).overwrite_out_dir is True
    assert "would delete the checkpoints that init_from='resume' continues" in error_of(
        ["--overwrite_out_dir=True", "--init_from=resume"]
    )


# --- how a flag is written ----------------------------------------------------------------


@pytest.mark.parametrize(
    "arg, message",
    [
        ("-batch_size=8", "flag '-batch_size=8' has one dash: write --batch_size=8"),
        ("---batch_size=8", "flag '---batch_size=8' has 3 dashes: write --batch_size=8"),
        ("--", "'--' is not a flag: write --KEY=VALUE"),
        ("--=3", "'--=3' is not a flag: write --KEY=VALUE"),
        ("-", "'-' is not a flag: write --KEY=VALUE"),
        ("batch_size=8", "'batch_size=8' is neither a config file nor a flag: write --batch_size=8"),
    ],
)
def test_misspelt_flags_say_how_to_write_them(arg, message):
    assert exit_line([arg]) == f"config error: {message}"


# --- --help -------------------------------------------------------------------------------


def test_help_lists_every_key_with_type_default_and_comment_by_section(capsys):
    with pytest.raises(SystemExit) as excinfo:
        configurator.load_config_or_exit(["--batch_size=4", "-h"])  # anywhere in argv
    assert excinfo.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python ")
    for f in dataclasses.fields(Config):
        assert f"  --{f.name} (" in text, f.name
    assert (
        "  --dataset (str, default 'shakespeare_char')\n"
        "        reads data/<dataset>/{train,val}.bin and meta.json\n" in text
    )
    assert "  --learning_rate (float, default 0.0006)\n" in text
    # the comment line under quantization's goes on with its note (not a section heading), and the
    # note is one paragraph wrapped at 80 columns, not broken where the source's lines end (issue 42)
    assert (
        "  --quantization (str, default 'none')\n"
        "        the blocks' matmuls: 'none' | 'int8' | 'fp8' (e4m3/e5m2; Hopper); a\n"
        "        property of the step: a run may switch it at resume\n\n"
        "architecture: the defaults are GPT-2;" in text
    )
    assert max(map(len, text.splitlines())) <= 80
    headings = ["\ndata and I/O\n", "\nmodel (GPT-2 small", "\noptimizer: AdamW", "\nreliability\n"]
    assert sorted(headings, key=text.index) == headings
    assert text.index("\nreliability\n") < text.index("--nan_policy") < text.index("--overfit_batch")


@dataclasses.dataclass(frozen=True)
class ToolOptions:
    """A tool's own flags."""

    # inputs
    path: str = "in.txt"  # what to read; '#' in a string is not a comment
    count: int = 3
    # output
    verbose: bool = False  # print more
    #                        (and slower)


def test_help_works_for_any_dataclass(capsys):
    with pytest.raises(SystemExit) as excinfo:
        configurator.load_config_or_exit(["--help"], ToolOptions)
    assert excinfo.value.code == 0
    text = capsys.readouterr().out
    assert "\nA tool's own flags.\n" in text
    assert (
        "\ninputs\n  --path (str, default 'in.txt')\n        what to read; '#' in a string is not a "
        "comment\n  --count (int, default 3)\n\noutput\n  --verbose (bool, default False)\n"
        "        print more (and slower)" in text
    )
    assert "--dataset" not in text


def test_help_works_in_a_copy_of_configurator_alone(tmp_path):
    (tmp_path / "configurator.py").write_text((ROOT / "configurator.py").read_text())
    run = subprocess.run(
        [sys.executable, "-c", "import configurator; configurator.load_config_or_exit(['--help'])"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and not run.stderr
    assert "  --compiled_train_step (str, default '')\n        it is used only if" in run.stdout
