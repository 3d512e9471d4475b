"""arguments.py: Megatron's flags, recipes (defaults < recipe < cli), errors before compute, --dry-run."""
from __future__ import annotations

import os
import textwrap

import pytest

import arguments
from megatron_ext.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "tiny_dense.yaml")


def parse(*argv, world_size=None):
    extra = ["--world-size", str(world_size), "--dry-run"] if world_size else []
    return arguments.parse(["--recipe", TINY, "--mock-data", *argv, *extra], exit_on_dry_run=False)


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_precedence_and_sources():
    args = parse("--hidden-size", "128", "--num-attention-heads", "8")
    assert args.hidden_size == 128 and args.config_sources["hidden_size"] == "cli"
    assert args.num_layers == 4 and args.config_sources["num_layers"] == "recipe"
    assert args.adam_beta1 == 0.9 and args.config_sources["adam_beta1"] == "default"


def test_a_parse_leaves_no_default_behind(tmp_path):
    """Every parse lends the process's one built parser its recipe's values as defaults: the next parse,
    and a refused one's, sees megatron's defaults again; a run's default list is its own object."""
    built = {a.dest: a.default for a in arguments.build_parser()._actions}
    first = parse("--hidden-size", "128", "--num-attention-heads", "8")
    with pytest.raises(ConfigError):
        arguments.parse(["--recipe", recipe(tmp_path, "num_layers: 3\nhidden_size: x\n")])
    assert {a.dest: a.default for a in arguments.build_parser()._actions} == built
    assert first.num_layers == 4 and arguments.build_parser().parse_args([]).num_layers is None
    first.cp_comm_type.append("a2a")
    assert parse().cp_comm_type == ["p2p"]


def test_a_flag_added_in_arguments_py_reaches_a_capability(tmp_path, monkeypatch):
    """How a flag of one's own is added: declared in arguments.py's add_arguments (Megatron-LM's
    extra_args_provider), it is a recipe key too and listed with this project's flags in --help; a
    capability reads it as args.<dest> in its hooks (here validate, refusing a value by name before any
    compute), and a Run parses with it, since the entry point handed arguments.parse to the bring-up."""
    import types

    from megatron_ext.training import features
    from megatron_ext.training.run import Run

    def add_arguments(parser):
        group = parser.add_argument_group("megatron_ext: my capability", "a flag of this repository")
        group.add_argument("--my-ratio", type=float, default=None, help="A fraction in (0, 1].")
        return parser

    read = []

    def validate(args):
        read.append(args.my_ratio)
        if args.my_ratio is not None and not 0 < args.my_ratio <= 1:
            raise ConfigError(f"--my-ratio={args.my_ratio}: a fraction in (0, 1]")

    monkeypatch.setattr(arguments, "add_arguments", add_arguments)
    monkeypatch.setattr(arguments, "_BUILT", [])  # the parser is built again, with the flag
    monkeypatch.setattr(features, "CAPABILITIES", (*features.CAPABILITIES, types.SimpleNamespace(validate=validate)))
    assert parse("--my-ratio", "0.5").my_ratio == 0.5 and read == [0.5]
    args = arguments.parse(["--recipe", recipe(tmp_path, f"{open(TINY).read()}\nmy_ratio: 0.25\n"), "--mock-data"],
                           exit_on_dry_run=False)
    assert args.my_ratio == 0.25 and args.config_sources["my_ratio"] == "recipe" and read[-1] == 0.25
    with pytest.raises(ConfigError, match=r"^--my-ratio=2.0: a fraction in \(0, 1\]$"):
        parse("--my-ratio", "2")
    shown = arguments.build_parser().format_help()
    assert shown.index("--my-ratio") < shown.index("Megatron: common flags")
    run = Run.from_argv(["--recipe", TINY, "--mock-data", "--my-ratio", "1"], parse=arguments.parse)
    assert run.args.my_ratio == 1.0 and read[-1] == 1.0


def test_a_run_without_its_argument_layer_fails_at_the_call(monkeypatch):
    """The argument layer is an argument, held nowhere for the process: a call that forgets it is a
    TypeError at the call, before the platform is set up or anything is parsed."""
    from megatron_ext import hf, planner, platform
    from megatron_ext.training import run as runs

    monkeypatch.setattr(platform, "setup", lambda: pytest.fail("got past the call"))
    argv = ["--recipe", TINY, "--mock-data"]
    for call in (lambda: runs.Run.from_argv(argv), lambda: runs.Run.for_model(argv), lambda: runs.main(argv),
                 lambda: hf.export_hf("ckpt", "out"), lambda: hf.import_hf("hf", "ckpt"), lambda: hf.logits("ckpt", [1]),
                 lambda: hf.export_peft("ckpt", "out"), lambda: hf.import_peft("hf", "peft", "ckpt"),
                 lambda: planner.main(argv)):
        with pytest.raises(TypeError, match="parse"):
            call()
    with pytest.raises(TypeError, match=r"^parse=\['--mock-data'\]: the entry point's argument layer"):
        runs.Run.from_argv(argv, parse=["--mock-data"])


def test_megatron_flags_keep_their_meaning():
    args = parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", world_size=4)
    assert args.data_parallel_size == 1  # computed by megatron's own validate_args
    assert args.ffn_hidden_size == 256 and args.swiglu is True


def test_flag_spelling_keys_in_recipes(tmp_path):
    base = open(TINY).read()
    args = arguments.parse(["--recipe", recipe(tmp_path, base), "--mock-data"], exit_on_dry_run=False)
    assert args.add_bias_linear is False  # `disable_bias_linear: true` sets the store_false dest


def test_unknown_key_suggests_the_closest(tmp_path):
    path = recipe(tmp_path, "num_layer: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'num_layer'.*did you mean 'num_layers'"):
        arguments.parse(["--recipe", path, "--mock-data"], exit_on_dry_run=False)


@pytest.mark.parametrize(
    "text,match",
    [
        ("num_layers: two\n", r"'num_layers' \(--num-layers\) expects int"),
        ("num_layers: 2.5\n", r"'num_layers' \(--num-layers\) expects int"),
        ("swiglu: 1\n", r"'swiglu' \(--swiglu\) expects true or false"),
        ("lr: [1, 2]\n", r"'lr' \(--lr\) expects a single value"),
        ("moe_token_dispatcher_type: teleport\n", r"expects one of"),
    ],
)
def test_wrong_types_name_key_and_flag(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        arguments.parse(["--recipe", recipe(tmp_path, text), "--mock-data"], exit_on_dry_run=False)


def test_yaml_scientific_notation_is_a_float(tmp_path):
    path = recipe(tmp_path, open(TINY).read() + "min_lr: 1e-5\n")
    assert arguments.parse(["--recipe", path, "--mock-data"], exit_on_dry_run=False).min_lr == 1e-5


@pytest.mark.parametrize(
    "argv,world,match",
    [
        (["--tensor-model-parallel-size", "3"], 4, r"world size \(4\) is not divisible"),
        (["--lr-warmup-iters", "500"], None, r"--lr-warmup-iters=500"),
        (["--transformer-impl", "transformer_engine"], None, r"--transformer-impl=transformer_engine"),
        (["--recipe", "nope.yaml"], None, r"--recipe=nope.yaml: no such file"),
    ],
)
def test_bad_flags_fail_before_compute(argv, world, match):
    with pytest.raises(ConfigError, match=match):
        parse(*argv, world_size=world)


def test_no_data_source_is_an_error(tmp_path):
    text = "\n".join(l for l in open(TINY).read().splitlines() if not l.startswith(("data_path", "split")))
    with pytest.raises(ConfigError, match="no training data"):
        arguments.parse(["--recipe", recipe(tmp_path, text)], exit_on_dry_run=False)


def test_mock_data_on_the_cli_replaces_the_recipe_data_path():
    args = parse()
    assert args.mock_data and args.data_path is None
    assert args.config_sources["data_path"] == "cleared by --mock-data"


def test_real_run_refuses_a_world_size_the_launcher_did_not_start(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="--world-size=2: the launcher started 1"):
        arguments.parse(["--recipe", TINY, "--mock-data", "--world-size", "2"], exit_on_dry_run=False)


def test_dry_run_prints_sources_and_exits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        arguments.parse(["--recipe", TINY, "--mock-data", "--dry-run", "--all", "--hidden-size", "96",
                         "--num-attention-heads", "4"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "resolved configuration" in out
    lines = {l.split()[0]: l for l in out.splitlines()[1:] if l.strip()}
    assert lines["hidden_size"].endswith("[cli]") and "96" in lines["hidden_size"]
    assert lines["num_layers"].endswith("[recipe]")
    assert lines["adam_beta1"].endswith("[default]")
    assert "default (off: CPU)" in lines["bias_swiglu_fusion"]


def test_cpu_fusion_defaults_are_switched_off_but_explicit_requests_are_kept(tmp_path):
    args = parse()
    assert args.bias_swiglu_fusion is False and args.apply_rope_fusion is False
    path = recipe(tmp_path, open(TINY).read() + "apply_rope_fusion: true\n")
    with pytest.raises(Exception, match="apply_rope_fusion"):  # explicit: megatron refuses it without TE
        arguments.parse(["--recipe", path, "--mock-data"], exit_on_dry_run=False)


@pytest.mark.parametrize("name", ["tiny_dense.yaml", "tiny_moe.yaml"])
def test_tiny_recipes_dry_run(name):
    args = arguments.parse(["--recipe", os.path.join(ROOT, "recipes", name), "--dry-run", "--mock-data"],
                           exit_on_dry_run=False)
    assert args.train_iters > 0


def test_dry_run_shows_what_was_set_and_labels_megatrons_changes(capsys):
    """Without --all: only values the recipe, the command line, the platform or megatron set; a value
    megatron's validate_args changed is labelled megatron, with what it was and who set it."""
    args = arguments.parse(["--recipe", TINY, "--mock-data", "--dry-run", "--sequence-parallel"], exit_on_dry_run=False)
    out = capsys.readouterr().out
    lines = {l.split()[0]: l for l in out.splitlines()[1:] if l.strip() and not l.strip().startswith("...")}
    assert args.sequence_parallel is False  # TP=1: megatron turns it off
    assert lines["sequence_parallel"].endswith("[megatron (was True, cli)]")
    assert lines["num_layers"].endswith("[recipe]") and lines["dry_run"].endswith("[cli]")
    assert lines["data_parallel_size"].endswith("[megatron]")
    assert "default (off: CPU)" in lines["bias_swiglu_fusion"]
    assert "adam_beta1" not in lines and len(lines) < 80
    hidden = len(vars(args)) - 1 - len(lines)
    assert f"... {hidden} more at their defaults or derived by megatron: --dry-run --all lists every value" in out


def test_a_load_without_checkpoint_is_refused_unless_asked_for(tmp_path):
    """A mistyped --load would train from fresh weights: refused in one line, before any compute,
    unless --allow-missing-checkpoint, or --load is --save (a job's first run; not with --finetune).
    megatron's --exit-on-missing-checkpoint refuses even that."""
    empty, missing, run = tmp_path / "empty", tmp_path / "missing", str(tmp_path / "run")
    empty.mkdir()
    lines = {}
    for name, argv in {
        "empty": ["--load", str(empty)],
        "finetune": ["--finetune", "--load", str(empty)],
        "missing": ["--load", str(missing), "--save", run, "--save-interval", "5"],
        "finetune into save": ["--finetune", "--load", run, "--save", run, "--save-interval", "5"],
        "exit": ["--load", run, "--save", run, "--save-interval", "5", "--exit-on-missing-checkpoint"],
    }.items():
        with pytest.raises(ConfigError) as e:
            parse(*argv)
        lines[name] = str(e.value)
    assert lines["empty"] == (f"--load={empty}: no checkpoint there (no iter_N directory); name a checkpoint "
                              "directory, or pass --allow-missing-checkpoint to start from fresh weights")
    assert lines["finetune"].startswith(f"--finetune --load={empty}: no checkpoint there")
    assert lines["missing"].startswith(f"--load={missing}: no such directory;")
    assert lines["finetune into save"].startswith(f"--finetune --load={run}: no such directory;")
    assert lines["exit"] == f"--load={run}: no checkpoint there (--exit-on-missing-checkpoint)"
    assert parse("--load", str(empty), "--allow-missing-checkpoint").allow_missing_checkpoint
    assert parse("--finetune", "--load", str(empty), "--allow-missing-checkpoint").finetune
    assert parse("--load", run, "--save", run, "--save-interval", "5").load == run


def test_every_problem_of_a_stage_at_once_from_the_command_line(tmp_path):
    """`python train.py --dry-run --world-size 8` without a launcher: every problem in the values
    as given, one `error:` line each, exit 1, nothing else printed (no warning, no traceback); the
    same command fixed prints its configuration and nothing on stderr. One interpreter runs both."""
    import subprocess
    import sys

    bad = ["--recipe", TINY, "--dry-run", "--world-size", "8", "--save", str(tmp_path / "run"),
           "--data-path", str(tmp_path / "nothing"), "--num-layers", "0", "--tensor-model-parallel-size", "3"]
    good = ["--recipe", TINY, "--mock-data", "--dry-run", "--world-size", "8", "--tensor-model-parallel-size", "2"]
    script = ("import runpy, sys\n"
              f"for argv in ({bad!r}, {good!r}):\n"
              "    sys.argv = ['train.py', *argv]\n"
              "    try:\n"
              "        runpy.run_path('train.py', run_name='__main__')\n"
              "    except SystemExit as e:\n"
              "        print(f'exit {e.code}', file=sys.stderr, flush=True)\n"
              "        print('---', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MEGATRON_EXT_VERBOSE")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.stderr.splitlines() == [
        "error: --num-layers=0: must be an integer >= 1 (model size)",
        "error: --world-size=8, --tensor-model-parallel-size=3, --pipeline-model-parallel-size=1, "
        "--context-parallel-size=1: the world size must be a multiple of TP x PP x CP (world size (8) is not "
        "divisible by 3)",
        "error: --world-size=8, --expert-tensor-parallel-size=None, --expert-model-parallel-size=1, "
        "--pipeline-model-parallel-size=1: the world size must be a multiple of expert-TP x EP x PP (expert-TP "
        "defaults to TP)",
        "error: --num-attention-heads=4, --tensor-model-parallel-size=3: TP must divide the number of attention heads",
        f"error: --save={tmp_path / 'run'}, --save-interval=None: --save needs --save-interval",
        f"error: --data-path={tmp_path / 'nothing'}: each dataset prefix needs PREFIX.bin and PREFIX.idx "
        f"(scripts/prepare_data.py writes them) (not found: {tmp_path / 'nothing'})",
        "exit 1",
        "exit 0",
    ], out.stderr
    refused_out, config_out = out.stdout.split("---\n")[:2]
    assert refused_out == "" and config_out.startswith("resolved configuration")
    assert "tensor_model_parallel_size" in config_out and "data_parallel_size                  4" in config_out


def test_help_lists_ours_and_the_common_flags_first_and_reads_a_cached_text(tmp_path, monkeypatch):
    """--help: usage on one line, this project's groups, then the common Megatron flags, then
    megatron's groups. Once rendered, `train.py --help` prints the cached text without importing
    torch or megatron-core; a changed source file is another cache key."""
    import subprocess
    import sys

    from megatron_ext import helptext

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    rendered = arguments.build_parser().format_help()
    titles = [line[:-1] for line in rendered.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert rendered.splitlines()[0] == "usage: " + arguments.USAGE
    common = titles.index("Megatron: common flags")
    assert all(t.startswith("megatron_ext") or t == "options" for t in titles[:common]) and len(titles[:common]) > 3
    assert "network size" in titles[common + 1:] and "--num-layers" in rendered.split("Megatron: common flags:")[1][:400]
    entry = [os.path.join(ROOT, "train.py"), os.path.join(ROOT, "arguments.py")]  # train.py's flags are arguments.py's
    assert helptext.text("train", entry, lambda: rendered) == rendered  # rendered once, kept
    probe = ("import runpy, sys\nsys.argv = ['train.py', '--help']\n"
             "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('imported:', sorted(m for m in ('torch', 'megatron') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), "COLUMNS": "100"})
    assert out.stdout == rendered and out.stderr == "imported: []\n"
    before = helptext.key(entry)
    (tmp_path / "entry.py").write_text("")
    assert helptext.key(str(tmp_path / "entry.py")) != before
    (tmp_path / "arguments.py").write_text("")  # a flag added to arguments.py: another text
    assert helptext.key([entry[0], str(tmp_path / "arguments.py")]) != before


def test_quiet_drops_the_listed_third_party_noise_only(monkeypatch, caplog):
    import logging
    import warnings

    from megatron_ext import errors

    monkeypatch.delenv(errors.VERBOSE_ENV, raising=False)
    gpt = logging.getLogger("megatron.core.models.gpt.gpt_model")
    filters, level = list(gpt.filters), logging.getLogger("megatron").level
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert errors.quiet(["--recipe", "r.yaml"]) is True
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", UserWarning)  # another kind
            warnings.warn("a real problem", FutureWarning)
            with caplog.at_level(logging.WARNING):
                gpt.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
                gpt.warning("a real problem in the model")
        assert [str(w.message) for w in seen] == ["`torch.distributed.all_gather_into_tensor` is deprecated.",
                                                  "a real problem"]
        assert [r.getMessage() for r in caplog.records] == ["a real problem in the model"]
        assert errors.quiet(["--verbose"]) is False
    finally:
        gpt.filters[:] = filters
        logging.getLogger("megatron").setLevel(level)
