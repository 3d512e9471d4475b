"""A capability's options as one typed dataclass: the one place its flags' types, defaults, ranges and
help live. The field's docstring is the flag's --help, megatron's ``ArgumentGroupFactory``
(megatron/training/argument_utils.py) builds the argparse group from the fields, a numeric field's
``Domain`` is checked with every other flag's (config/domains.py ``check_domains`` reads it from the
action), and an instance built in code is refused by the same check, naming the flag.

    @dataclasses.dataclass
    class OffloadOptions(Options):
        PREFIX = "activation_offload_"        # the flags are --activation-offload-<field>
        pool_mb: float = option(1024.0, Domain(float, 0, lo_open=True), "a size in MiB")
        '''Size of the host pool offloaded bytes live in.'''

    add_group(parser, OffloadOptions, "megatron_ext: activation offload")   # capability.add_arguments
    opts = OffloadOptions.from_args(args)                                     # the capability's slice
    OffloadOptions(pool_mb=0)   # ConfigError: --activation-offload-pool-mb=0: must be a number > 0 (...)
"""
from __future__ import annotations

import copy
import dataclasses
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


class _Factory:
    """megatron's ArgumentGroupFactory with the options' prefix on every flag, annotations resolved
    (the factory reads ``Field.type``, a string under ``from __future__ import annotations``), and each
    numeric field's domain kept on its action for config/domains.py."""

    def __new__(cls, options_cls):
        from megatron.training.argument_utils import ArgumentGroupFactory

        hints = typing.get_type_hints(options_cls)

        class Factory(ArgumentGroupFactory):
            def _format_arg_name(self, config_attr_name, prefix=None):
                return super()._format_arg_name(options_cls.dest(config_attr_name), prefix)

            def _build_argparse_kwargs_from_field(self, attribute):
                resolved = copy.copy(attribute)
                resolved.type = hints[attribute.name]
                kwargs = super()._build_argparse_kwargs_from_field(resolved)
                kwargs["dest"] = options_cls.dest(attribute.name)
                return kwargs

        return Factory(options_cls)


def add_group(parser, options_cls, title: str, description: str | None = None):
    """The argparse group of ``options_cls``: one flag per field (help from its docstring), each numeric
    field's action carrying ``domain`` and ``meaning``."""
    group = _Factory(options_cls).build_group(parser, title)
    if description is not None:
        group.description = description
    by_dest = {options_cls.dest(f.name): f for f in dataclasses.fields(options_cls)}
    for action in group._group_actions:
        f = by_dest.get(action.dest)
        if f is not None:
            action.domain, action.meaning = f.metadata.get("domain"), f.metadata.get("meaning", "")
    return group
