"""Writes docs/flags.md from the configuration's tables (megatron_ext/config): every numeric flag's
domain, the cross-field rules, the choice flags and megatron's own checks mapped to flags.

    python scripts/flags_doc.py > docs/flags.md      (a test keeps the page equal to its source)
"""
from __future__ import annotations

import functools
import sys


from megatron_ext.config import ledger  # noqa: E402
from megatron_ext.config.domains import FAMILIES  # noqa: E402
from megatron_ext.config.megatron_checks import FIELD_FLAGS, SITES  # noqa: E402
from megatron_ext.config.naming import flag_of  # noqa: E402
from megatron_ext.config.rules import RULES  # noqa: E402


def markdown(parser) -> str:
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    flags = functools.partial(flag_of, actions)
    out = [
        "# Flags: what each accepts",
        "",
        "Generated from the tables of `megatron_ext/config/` by `python scripts/flags_doc.py > docs/flags.md` (a test keeps",
        "this page equal to its source). `train.py --dry-run` refuses a value outside its domain or a",
        "combination below before any compute, as one line naming the flags, their values and what is",
        "allowed. A flag left unset (no default) is not checked.",
        "",
        "## Numeric flags, by family",
        "",
        "| family | allowed | meaning | flags |",
        "|---|---|---|---|",
    ]
    for fam in FAMILIES:
        names = ", ".join(f"`{flags(d)}`" for d in sorted(fam.flags, key=flags))
        out.append(f"| {fam.name} | {fam.domain} | {fam.meaning} | {names} |")
    # a typed options class's flag carries its domain on its action (config/typed.py)
    typed = sorted((a for a in actions.values() if getattr(a, "domain", None)), key=lambda a: flags(a.dest))
    out += ["", "## Numeric options of the capabilities", "",
            "Declared with their flag in each capability's options class (`megatron_ext/config/typed.py`); an",
            "options object built in code is refused by the same check, naming the flag.", "",
            "| flag | allowed | meaning |", "|---|---|---|"]
    out += [f"| `{flags(a.dest)}` | {a.domain} | {a.meaning} |" for a in typed]
    out += ["", "## Cross-field rules, in the order they are checked", "",
            "| # | family | flags | rule |", "|---|---|---|---|"]
    for i, rule in enumerate(RULES, 1):
        stage = " (after megatron's defaults)" if rule.stage == "resolved" else ""
        names = ", ".join(f"`{flags(d)}`" for d in (*rule.flags, *rule.context))
        out.append(f"| {i} | {rule.family}{stage} | {names} | {rule.allowed} |")
    out += ["", "Platform rules ask `megatron_ext.config.rules.target(args)`: the machine running the check, or the",
            "target a `--dry-run` names with `--platform cuda [--assume-te | --assume-no-te] [--assume-apex]`.", "",
            "## Choice flags", "", "| flag | choices |", "|---|---|"]
    for dest, action in sorted(actions.items(), key=lambda kv: flags(kv[0])):
        if action.choices is not None and action.option_strings:
            choices = ", ".join(f"`{c}`" for c in (str(getattr(c, "name", c)) for c in action.choices))
            out.append(f"| `{flags(dest)}` | {choices} |")
    out += ["", "## megatron's own checks", "",
            "megatron's `validate_args` and the config classes' `__post_init__` check more; each such",
            "check is reported with the flags its condition reads (config fields are mapped back to",
            "their flags). These conditions name no flag directly and are mapped by their source text:",
            "", "| condition | flags |", "|---|---|"]
    for condition, dests in SITES.items():
        out.append(f"| `{condition}` | {', '.join(f'`{flags(d)}`' for d in dests)} |")
    out += ["", "| config field | flags |", "|---|---|"]
    for name, dests in FIELD_FLAGS.items():
        out.append(f"| `{name}` | {', '.join(f'`{flags(d)}`' for d in dests)} |")
    out += ledger_markdown(flags, set(actions))
    return "\n".join(out) + "\n"


def _grouped(kind, key) -> dict:
    groups: dict = {}
    for dest, entry in ledger.LEDGER.items():
        if isinstance(entry, kind):
            groups.setdefault(key(entry), []).append(dest)
    return groups


def ledger_markdown(flags, present: set) -> list[str]:
    """Every flag of megatron's parser, from megatron_ext/config/ledger.py: honoured (and what reads
    it), refused (and why), or without effect here (and why)."""
    names = lambda dests: ", ".join(f"`{flags(d)}`" for d in sorted(dests, key=flags))  # noqa: E731
    counts = {kind: sum(isinstance(e, kind) for d, e in ledger.LEDGER.items() if d in present)
              for kind in (ledger.Honoured, ledger.Refused, ledger.NoEffect)}
    out = ["", "## Every Megatron flag: what it does here", "",
           f"The ledger (`megatron_ext/config/ledger.py`) classifies each of the {sum(counts.values())} flags of "
           f"megatron's parser: {counts[ledger.Honoured]} honoured, {counts[ledger.Refused]} refused before any "
           f"compute, {counts[ledger.NoEffect]} without effect here. A test fails when megatron adds a flag the "
           "ledger does not classify, when an honoured flag is not read where it says, or when a refused one is "
           "not refused.", "", "### Honoured, and the code that reads them", "",
           "A megatron config class: its from-args builder copies the flag into the field of that name, and "
           "megatron-core's modules read the config, as under Megatron-LM's pretrain_gpt.py.", "",
           "| read by | flags |", "|---|---|"]
    for where, dests in sorted(_grouped(ledger.Honoured, lambda e: e.where).items()):
        out.append(f"| `{where}` | {names(dests)} |")
    out += ["", "### Refused before any compute", "",
            "`check_not_here`: refused whenever set to anything but the default, as "
            "`error: --flag=value: not in this loop: why`.", "", "| refused by | why | flags |", "|---|---|---|"]
    for (where, why), dests in _grouped(ledger.Refused, lambda e: (e.where, e.why)).items():
        out.append(f"| `{where.rpartition('.')[2]}` | {why or 'its own line, naming the flag'} | {names(dests)} |")
    out += ["", "### Without effect here", "", "| why | flags |", "|---|---|"]
    for why, dests in _grouped(ledger.NoEffect, lambda e: e.why).items():
        out.append(f"| {why} | {names(dests)} |")
    return out


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog="python scripts/flags_doc.py > docs/flags.md").parse_args(argv)
    from megatron_ext import platform

    platform.setup()  # megatron.training.arguments needs the Python 3.11 backfill
    import arguments

    sys.stdout.write(markdown(arguments.build_parser()))


if __name__ == "__main__":
    main()
