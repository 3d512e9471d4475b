"""The machinery of the command line that top-level arguments.py composes (it is the entry points'
argument layer: megatron's flags, this project's, the user's, the recipe merge):

    Parser                a parser whose errors are one-line refusals
    order_help(parser)    --help: this project's groups, the common Megatron flags, megatron's groups
    recipe_values(known, parser, first_read)  the recipe under the command line: --recipe, else the one
                          the --load checkpoint records (as a stage that read --load first hands it on)
    finalize(args, parser)  every check before any compute, in stages (Problems): the values as given,
                          megatron's validate_args, each package's validate (features.py), then what
                          reads all of them (every split's data); --dry-run --load's checkpoint keys are
                          placed after it, by the bring-up (training/run.py check_load)
    print_config(args)    --dry-run's table, each value with its source
    explain(exc, parser)  the one-line refusal for an error megatron raised from a flag after parsing

It reads the command line's own flags, which arguments.py declares: --dry-run, --all, --world-size.
No module of the package imports arguments.py: the entry points hand its parse to each call that
parses (megatron_ext/training/run.py ``Run.from_argv(argv, parse=arguments.parse)``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import re
import warnings

from megatron.training.arguments import validate_args

from megatron_ext.config import domains, megatron_checks, recipes, rules
from megatron_ext.errors import TRACEBACK_ENV, ConfigError
from megatron_ext.platform import target
from megatron_ext import checkpoint
from megatron_ext.training import features


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, raised like every other refusal (not usage + exit 2 per rank)
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):
        """argparse's, but what it does not know is refused one line per flag, each with the closest
        flag there is (argparse would say only ``unrecognized arguments: ...``)."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ConfigError("\n".join(unknown_flags(unknown, self)))
        return parsed


def unknown_flags(tokens: list, parser) -> list[str]:
    """``--lora-rnak 8`` -> ``--lora-rnak=8: no such flag; did you mean --lora-rank?``: each unknown
    flag with the values that follow it, one line each."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    groups: list[list[str]] = []
    for token in tokens:
        if token.startswith("-") and not _number(token) or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    lines = []
    for flag, *values in groups:
        if not flag.startswith("-"):
            lines.append(f"{' '.join([flag, *values])}: not a flag (every value follows its flag: --name value)")
            continue
        flag, eq, inline = flag.partition("=")
        shown = flag + ("=" + " ".join(([inline] if eq else []) + values) if eq or values else "")
        close = difflib.get_close_matches(flag, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "--help lists every flag"
        lines.append(f"{shown}: no such flag; {hint}")
    return lines


def _number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


# The Megatron flags most runs set, listed right after this project's own in --help (megatron's
# several hundred others follow, in megatron's groups).
COMMON_FLAGS = """
    num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention num_query_groups
    seq_length max_position_embeddings num_experts moe_router_topk
    tensor_model_parallel_size pipeline_model_parallel_size expert_model_parallel_size
    context_parallel_size sequence_parallel use_distributed_optimizer
    micro_batch_size global_batch_size train_iters lr min_lr lr_decay_style lr_warmup_iters
    weight_decay clip_grad bf16 seed
    data_path mock_data split tokenizer_type tokenizer_model vocab_size
    save load save_interval finetune log_interval eval_interval eval_iters
    transformer_impl recompute_granularity
""".split()


def order_help(parser) -> None:
    """--help order: this project's groups, the common Megatron flags, then megatron's groups. Only
    the listing moves: which group an action is shown in does not change how it parses."""
    for action in parser._actions:  # a few megatron help strings carry a bare '%', which breaks --help
        if action.help:  # (one already escaped, '%%', stays: help is a %-format)
            action.help = re.sub(r"(?<!%)%(?![(%])", "%%", action.help)
    common = parser.add_argument_group("Megatron: common flags")
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    for dest in COMMON_FLAGS:
        action = by_dest[dest]
        for g in parser._action_groups:
            if action in g._group_actions and g is not common:
                g._group_actions.remove(action)
                action.megatron_group = g.title  # what reads megatron's groups still finds it there
        common._group_actions.append(action)
    groups = parser._action_groups
    ours = [g for g in groups if (g.title or "").startswith(("megatron_ext", "planner")) or g is parser._optionals]
    rest = [g for g in groups if g not in ours and g is not common]
    parser._action_groups[:] = ours + [common] + rest


def flag_actions(parser) -> dict:
    """dest -> the first action declaring it (its flag is the one refusals name)."""
    found = {}
    for a in parser._actions:
        if a.option_strings and a.dest not in ("help", argparse.SUPPRESS):
            found.setdefault(a.dest, a)
    return found


def explicit_cli_dests(parser, argv) -> set:
    """The dests the command line set, found by parsing with every default suppressed."""
    saved = {a: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, d in saved.items():
            a.default = d


def recipe_values(known, parser, first_read=None) -> tuple[dict, str | None]:
    """(the recipe's values through the parser's actions, the path of the recorded one or None): --recipe,
    else the recipe the --load checkpoint records (checkpoint/recipe.py ``recorded``: --ckpt-step's, or
    the newest that has one, else the one beside them; a moved directory's tokenizer paths moved onto the
    copy beside it). ``first_read``: what a stage that read --load before the parse found
    (checkpoint/dirs.py FirstRead): its listing and the recipe it read are used, not read again."""
    first = first_read if first_read is not None and first_read.covers(known.load, known.ckpt_step) else None
    path, recorded = known.recipe, None
    if path is None and known.load:
        if first is not None:
            path = recorded = first.recipe if first.recorded else None
        else:
            path = recorded = checkpoint.recorded_recipe(known.load, known.ckpt_step)
    if not path:
        return {}, None
    raw = first.recipe_values if first is not None and first.recipe == path else recipes.read(path)
    values = recipes.resolve(raw, parser, path)
    return (checkpoint.relocate_recipe(values, recorded) if recorded else values), recorded


def _fit_defaults_to_platform(args) -> None:
    """Platform-dependent defaults (transformer-engine, fusions, norms) for the machine this runs on
    or the --platform target of a --dry-run: megatron_ext/platform/target.py."""
    target.fit_defaults(args)


# Alternatives: when both are set at different precedence (recipe vs cli), the higher one wins.
# Iteration- and sample-based lengths go as groups: a recipe's iteration schedule gives way to
# --train-samples/--lr-*-samples on the command line (and the other way round).
_UNSET = {"mock_data": False, "data_path": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0}
_ALTERNATIVES = (
    (("mock_data",), ("data_path",)),
    (("train_iters", "lr_decay_iters", "lr_warmup_iters"), ("train_samples", "lr_decay_samples", "lr_warmup_samples")),
)


def _one_data_source(args) -> None:
    """--mock-data / --data-path, and iteration- / sample-based lengths, are alternatives."""
    rank = {"default": 0, "recipe": 1, "cli": 2}

    def level(group):
        return max(rank[args.config_sources[d]] for d in group if getattr(args, d) != _UNSET.get(d))

    for a, b in _ALTERNATIVES:
        if not any(getattr(args, d) != _UNSET.get(d) for d in a) or not any(getattr(args, d) != _UNSET.get(d) for d in b):
            continue
        ra, rb = level(a), level(b)
        if ra == rb:
            continue
        losers, winner = (b, a[0]) if ra > rb else (a, b[0])
        for d in losers:
            if getattr(args, d) != _UNSET.get(d):
                setattr(args, d, _UNSET.get(d))
                args.config_sources[d] = "cleared by --" + winner.replace("_", "-")


class Problems:
    """The refusals of one stage of checks, each check on its own, so that every problem of the
    stage is reported at once (one line each). A stage runs only when the one before it found
    nothing: its checks read what the earlier ones accepted (megatron's validate_args derives
    sizes from the given values; each package's validate reads what validate_args derived)."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, lines) -> None:
        for line in ([lines] if isinstance(lines, str) else lines):
            if line not in self.lines:
                self.lines.append(line)

    @contextlib.contextmanager
    def check(self):
        """A refusal is kept; a failure of another kind after a refusal of this stage is taken as
        its consequence (a package reading what a refused one would have set) and dropped."""
        try:
            yield
        except ConfigError as e:
            self.add(str(e).splitlines())
        except Exception:
            if not self.lines:
                raise

    def raise_any(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))


def finalize(args, parser, first_read=None) -> None:
    """Everything megatron's validate_args and config classes check, plus ours, before any compute,
    in stages (Problems): every problem of the first stage that finds any is reported. ``parser``:
    the one that parsed ``args`` (its actions name the flags refusals name). ``first_read``: what a
    stage that read --load before the parse found (checkpoint/dirs.py FirstRead), kept as
    ``args.first_read`` for the checks and the load that would read --load again (ckpt_dirs.handed)."""
    from megatron_ext.training import data

    if first_read is not None:
        args.first_read = first_read
        args.config_sources["first_read"] = "read of --load before the run"
    actions = flag_actions(parser)
    given = Problems()  # the values as given: each check on its own
    launcher_world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size is None:
        args.world_size = launcher_world
    elif not args.dry_run and args.world_size != launcher_world:
        given.add(f"--world-size={args.world_size}: the launcher started {launcher_world} processes")
    args.rank = int(os.environ.get("RANK", "0"))
    outside = domains.check_domains(args, actions)
    given.add(list(outside.values()))
    with given.check():
        _fit_defaults_to_platform(args)
    _one_data_source(args)
    if not args.mock_data and not args.data_path:
        given.add("no training data: give --data-path PREFIX (see scripts/prepare_data.py) or --mock-data")
    given.add(rules.check_not_here(args, actions, refused=outside))
    given.add(rules.check_rules(args, actions, "given", refused=outside))
    for before_validate in features.each("before_validate"):
        with given.check():
            before_validate(args)
    given.raise_any()
    world_size_holder = args.world_size
    values = {k: copy.copy(v) for k, v in vars(args).items()}
    platform_target = rules.target(args)
    with contextlib.redirect_stdout(io.StringIO()), _megatron_refusals(args, actions), \
            target.device_answers(platform_target, args.launch_env):  # a --platform target's GPU answers
        validate_args(args)  # prints every argument on rank 0
    args.world_size = world_size_holder
    _mark_megatron_changes(args, values)
    resolved = Problems()  # what reads megatron's results: each rule, each package's validate
    resolved.add(rules.check_rules(args, actions, "resolved"))
    for validate in features.each("validate"):  # training's: tokenizer (padded vocab), train_iters from --train-samples, ...
        with resolved.check():
            validate(args)
    resolved.raise_any()
    settled = Problems()  # what reads every package's settled values (the tokenizer, the iterations)
    with settled.check():
        data.validate(args)  # every split's data, through the package that brings it (features.py datasets)
    settled.raise_any()
    args.config_sources.setdefault("padded_vocab_size", "derived (the tokenizer's vocabulary, padded)")
    if args.config_sources.get("padded_vocab_size") == "default":
        args.config_sources["padded_vocab_size"] = "derived (the tokenizer's vocabulary, padded)"
    with _megatron_refusals(args, actions), target.device_answers(platform_target, args.launch_env):
        args.megatron_configs_checked = build_configs(args)
    args.config_sources["megatron_configs_checked"] = "derived (built at parse time)"
    _LAST["args"] = args  # explain() names these values for refusals raised after parsing


def build_configs(args) -> list:
    """megatron's TransformerConfig, DDP and optimizer configs from the arguments, as the model build
    will make them: their __post_init__ checks run here, before any compute. Nothing is allocated.
    Not the TransformerConfig where a --platform target assumes a transformer-engine this machine
    lacks: its checks probe the installed version, which would answer for this machine."""
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    from megatron_ext import fp8

    built = []
    with contextlib.redirect_stdout(io.StringIO()):
        if not (rules.target(args).te and not target.te_importable()):
            # as training/model.py builds it: FP8 on the local spec is megatron_ext.fp8's, not the config's
            built.append(type(core_transformer_config_from_args(fp8.config_args(args))).__name__)
        built.append(type(get_megatron_ddp_config(args)).__name__)
        built.append(type(get_megatron_optimizer_config(args)[0]).__name__)
    return built


_LAST: dict = {}


@contextlib.contextmanager
def _megatron_refusals(args, actions):
    """megatron's own refusals (bare asserts included) as one line naming the flags."""
    try:
        with warnings.catch_warnings():  # without a launcher megatron warns that it guessed rank 0
            warnings.filterwarnings("ignore", message="Could not determine rank")
            yield
    except (AssertionError, ValueError, RuntimeError, NotImplementedError) as e:
        if isinstance(e, ConfigError):
            raise
        line = megatron_checks.explain(e, args, actions)
        if line is None:
            raise
        raise ConfigError(line) from None


def explain(exc: BaseException, parser) -> str | None:
    """The one-line refusal for an exception megatron raised from a flag after parsing (model
    build, checkpoint load), or None: then it is not about a flag and keeps its traceback."""
    if isinstance(exc, ConfigError):
        return str(exc)
    line = megatron_checks.explain(exc, _LAST.get("args"), flag_actions(parser), strict=True)
    return line and f"{line}; {TRACEBACK_ENV}=1 shows the traceback"


def _mark_megatron_changes(args, given: dict) -> None:
    """A value megatron's validate_args set or changed is labelled so, not with the source it had."""
    for key, value in vars(args).items():
        if key in ("config_sources", "first_read"):  # what the run is told, not a value it resolves
            continue
        if key not in given:
            args.config_sources[key] = "megatron"
            continue
        try:
            same = bool(given[key] == value)
        except Exception:  # noqa: BLE001 - values that do not compare (tensors, dtypes vs str)
            same = given[key] is value
        if not same:
            was = args.config_sources.get(key, "default")
            args.config_sources[key] = "megatron" if was == "default" else f"megatron (was {given[key]!r}, {was})"


# Derived values worth seeing without --all.
_DERIVED = ("data_parallel_size", "virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size",
            "ffn_hidden_size", "moe_ffn_hidden_size", "kv_channels", "padded_vocab_size", "params_dtype",
            "world_size")


def _shown(key: str, source: str, value) -> bool:
    """Not a plain default, nor a value megatron derived from defaults (unless a size worth seeing)."""
    return source not in ("default", "megatron") or (key in _DERIVED and source != "default" and value is not None)


def print_config(args) -> None:
    keys = [k for k in sorted(vars(args)) if k != "config_sources"]
    source = {k: args.config_sources.get(k, "derived") for k in keys}
    shown = keys if args.all else [k for k in keys if _shown(k, source[k], getattr(args, k))]
    width = max(len(k) for k in shown)
    print("resolved configuration (value  [source]):" if args.all else
          "resolved configuration: what the recipe, the command line, the platform or megatron set (value  [source]):")
    for key in shown:
        print(f"  {key:<{width}} {getattr(args, key)!r}  [{source[key]}]")
    if not args.all:
        print(f"  ... {len(keys) - len(shown)} more at their defaults or derived by megatron: --dry-run --all lists every value")
