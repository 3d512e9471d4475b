"""The configuration's tables, read by ``arguments.parse`` before any compute:

    recipes.py           YAML recipes through the parser's own actions (a key accepts what its flag does)
    domains.py           every numeric flag -> the values it accepts
    typed.py             a capability's options as one typed dataclass (group, defaults, ranges, slice)
    rules.py             cross-field rules, in the order they are checked
    megatron_checks.py   megatron's own asserts and errors -> the flags they check
    naming.py            how a refusal names flags and values
    command_line.py      the parser's machinery and the checks in stages (on a floor above the packages
                         whose checks it calls: tests/test_house.py)

Every refusal is one line naming the flags with their values, then what is allowed.
``scripts/flags_doc.py`` writes docs/flags.md from these tables."""
