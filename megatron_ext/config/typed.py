"""A capability's options as one typed dataclass: the one place its flags' types, defaults, ranges and
help live. The field's docstring is the flag's --help, megatron's ``ArgumentGroupFactory``
(megatron/training/argument_utils.py) builds the argparse group from the fields, a numeric field's
``Domain`` is checked with every other flag's (config/domains.py ``check_domains`` reads it from the
action), and an instance built in code is refused by the same check, naming the flag.
``add_group_without_torch`` builds the same group without megatron-core, for a --help that imports
no torch (scripts/plan.py).

    @dataclasses.dataclass
    class OffloadOptions(Options):
        PREFIX = "activation_offload_"        # the flags are --activation-offload-<field>
        pool_mb: float = option(1024.0, Domain(float, 0, lo_open=True), "a size in MiB")
        '''Size of the host pool offloaded bytes live in.'''

    add_group(parser, OffloadOptions, "megatron_ext: activation offload")   # capability.add_arguments
    add_group(parser, OffloadOptions, title, flag_prefix="--")  # spelled --pool-mb, the same dests
    opts = OffloadOptions.from_args(args)                                     # the capability's slice
    OffloadOptions(pool_mb=0)   # ConfigError: --activation-offload-pool-mb=0: must be a number > 0 (...)
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import textwrap
import types
import typing

from megatron_ext.config.domains import Domain
from megatron_ext.config.naming import show
from megatron_ext.errors import ConfigError


def option(default=dataclasses.MISSING, domain: Domain | None = None, meaning: str = "", *, default_factory=None,
           **argparse_meta):
    """A field of an options class: its default, the values it accepts (a numeric ``Domain`` and what the
    quantity is), and any argparse keyword the type does not imply (``nargs``, ``metavar``, ``choices``)."""
    metadata = {"domain": domain, "meaning": meaning}
    if argparse_meta:
        metadata["argparse_meta"] = argparse_meta
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class Options:
    """Base of every capability's options: ``PREFIX`` + a field's name is its flag's dest."""

    PREFIX: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        problems = [line for f in dataclasses.fields(self) if (line := refusal(type(self), f, getattr(self, f.name)))]
        if problems:
            raise ConfigError("\n".join(problems))

    @classmethod
    def dest(cls, name: str) -> str:
        return cls.PREFIX + name

    @classmethod
    def flag(cls, name: str) -> str:
        return "--" + cls.dest(name).replace("_", "-")

    @classmethod
    def from_args(cls, args, **overrides):
        """The capability's slice of the parsed arguments (each field from ``args.<PREFIX><name>``)."""
        values = {f.name: getattr(args, cls.dest(f.name)) for f in dataclasses.fields(cls) if f.init}
        return cls(**{**values, **overrides})


def refusal(cls, f: dataclasses.Field, value) -> str | None:
    """The refusal line of one field's value outside its domain, in check_domains' words; None if it is in."""
    domain = f.metadata.get("domain")
    if domain is None or value is None or isinstance(value, (str, bool)) or not domain.refuses(value):
        return None
    meaning = f.metadata.get("meaning")
    return f"{cls.flag(f.name)}={show(value)}: must be {domain}" + (f" ({meaning})" if meaning else "")


def _flag(options_cls, name: str, flag_prefix: str | None, prefix: str | None = None) -> str:
    """A field's flag: ``--<PREFIX><name>``, or ``flag_prefix`` + the name; ``prefix``: megatron's
    word before a store_false flag's name ("no", "disable")."""
    name = name if flag_prefix is not None else options_cls.dest(name)
    name = f"{prefix}_{name}" if prefix else name
    return (flag_prefix or "--") + name.replace("_", "-")


class _Factory:
    """megatron's ArgumentGroupFactory with the options' flags (``_flag``), annotations resolved
    (the factory reads ``Field.type``, a string under ``from __future__ import annotations``), and each
    numeric field's domain kept on its action for config/domains.py."""

    def __new__(cls, options_cls, flag_prefix: str | None = None):
        from megatron.training.argument_utils import ArgumentGroupFactory

        hints = typing.get_type_hints(options_cls)

        class Factory(ArgumentGroupFactory):
            def _format_arg_name(self, config_attr_name, prefix=None):
                return _flag(options_cls, config_attr_name, flag_prefix, prefix)

            def _build_argparse_kwargs_from_field(self, attribute):
                resolved = copy.copy(attribute)
                resolved.type = hints[attribute.name]
                kwargs = super()._build_argparse_kwargs_from_field(resolved)
                kwargs["dest"] = options_cls.dest(attribute.name)
                kwargs["help"] = _escaped(kwargs["help"])
                return kwargs

        return Factory(options_cls)


def _escaped(text: str) -> str:
    """A docstring as argparse's help, which is a %-format."""
    return text.replace("%", "%%")


def add_group(parser, options_cls, title: str, description: str | None = None, flag_prefix: str | None = None):
    """The argparse group of ``options_cls``: one flag per field (help from its docstring), each numeric
    field's action carrying ``domain`` and ``meaning``. The flags are ``--<PREFIX><field>``, or with
    ``flag_prefix`` that and the field's name (``flag_prefix="--"``: ``--top`` for ``plan_top``); the
    dests are ``<PREFIX><field>`` either way, so ``from_args`` reads both spellings."""
    group = _Factory(options_cls, flag_prefix).build_group(parser, title)
    return _with_domains(group, options_cls, description)


def add_group_without_torch(parser, options_cls, title: str, description: str | None = None,
                            flag_prefix: str | None = None):
    """``add_group``'s flags built without megatron-core (whose factory imports torch), for a --help
    that answers at once: the same actions, derived from the fields as megatron's factory derives them
    for the types options use (str, int, float, each optional, a list of one, a Literal, a bool switch);
    a test compares the two for every options class."""
    group = parser.add_argument_group(title=title, description=options_cls.__doc__)
    hints, docs = typing.get_type_hints(options_cls), field_docstrings(options_cls)
    for f in dataclasses.fields(options_cls):
        if not f.init:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kwargs = dict(dest=options_cls.dest(f.name), help=_escaped(docs.get(f.name, "")), default=default)
        names = [_flag(options_cls, f.name, flag_prefix)]
        kind = hints[f.name]
        if typing.get_origin(kind) in (types.UnionType, typing.Union) and typing.get_args(kind)[1] is type(None):
            kind = typing.get_args(kind)[0]  # optional
        if typing.get_origin(kind) is list:
            kind, kwargs["nargs"] = typing.get_args(kind)[0], "+"
        if typing.get_origin(kind) is typing.Literal:
            kwargs["type"], kwargs["choices"] = type(typing.get_args(kind)[0]), typing.get_args(kind)
        elif kind is bool:
            kwargs["action"] = "store_true" if default is False else "store_false"
            if default is not False:
                names = [_flag(options_cls, f.name, flag_prefix, p) for p in ("no", "disable")]
        else:
            kwargs["type"] = kind
        kwargs.update(f.metadata.get("argparse_meta", {}))  # as the factory: these win, arg_names too
        group.add_argument(*kwargs.pop("arg_names", names), **kwargs)
    return _with_domains(group, options_cls, description)


def field_docstrings(options_cls) -> dict:
    """Each field's docstring (the string after its annotated assignment), whitespace collapsed, as
    megatron's factory reads them."""
    out: dict = {}
    for cls in reversed(options_cls.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, Options)) or cls is Options:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                out[a.target.id] = " ".join(inspect.cleandoc(b.value.value).split())
    return out


def _with_domains(group, options_cls, description: str | None):
    if description is not None:
        group.description = description
    by_dest = {options_cls.dest(f.name): f for f in dataclasses.fields(options_cls)}
    for action in group._group_actions:
        f = by_dest.get(action.dest)
        if f is not None:
            action.domain, action.meaning = f.metadata.get("domain"), f.metadata.get("meaning", "")
    return group
