"""The pinned dependency versions (constraints.txt): written from an environment, checked against one.

    python scripts/pins.py --check constraints.txt   # every pinned package installed at its pin (make install)
    python scripts/pins.py --write constraints.txt   # pin what this environment has (make constraints)

What is pinned: every distribution that requirements.txt, torch and megatron-core need in this
environment, their dependencies followed through the installed packages' metadata (the markers that
hold here; no extras), at the installed version. megatron-core's own dependencies are not followed:
it is installed with --no-deps (Makefile). Versions are compared without a local label, so
`torch==2.13.0` is the CPU build here and a CUDA build on a GPU machine.

Standard library and `packaging` only: it runs before anything of the project is importable."""
from __future__ import annotations

import argparse
import os
import re
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ["torch", "megatron-core"]  # installed by the Makefile beside requirements.txt
NOT_FOLLOWED = {"megatron-core"}  # installed with --no-deps
HEADER = """\
# The exact versions the test suite passed with. `make install` installs with them as constraints
# (pip install -c constraints.txt) and then checks the environment against them (scripts/pins.py
# --check): a fresh clone gets these versions or the install stops, naming the difference.
# Every package requirements.txt, torch and megatron-core need, dependencies included (written by
# scripts/pins.py --write). Refresh: `make constraints` (a fresh environment with the newest
# versions requirements.txt allows, its versions written here), then `make clean test`: the suite
# passing on the new pins is what makes them pins.
"""


def requirement_names(path: str) -> list[str]:
    """The distribution names a requirements file asks for (comments and options skipped)."""
    names = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                names.append(Requirement(line).name)
    return names


def closure(roots: list[str]) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and everything they need here."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"pins: {name} is needed but not installed")
        found[name] = dist.version
        if name in NOT_FOLLOWED:
            continue
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def read_pins(path: str) -> dict[str, str]:
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line).groups()
                pins[canonicalize_name(name)] = version
    return pins


def mismatches(pins: dict[str, str]) -> list[str]:
    """One line per pinned package that is missing or at another version here."""
    out = []
    for name, pinned in sorted(pins.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name}: not installed, pinned {pinned}")
            continue
        if Version(installed).public != Version(pinned).public:
            out.append(f"{name}: {installed} installed, pinned {pinned}")
    return out


def pinned_lines(versions: dict[str, str]) -> list[str]:
    return [f"{name}=={Version(v).public}" for name, v in sorted(versions.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", metavar="FILE", help="every package FILE pins is installed at its pin")
    group.add_argument("--write", metavar="FILE", help="write the pins of this environment to FILE")
    parser.add_argument("--requirements", default=os.path.join(ROOT, "requirements.txt"))
    opts = parser.parse_args(argv)
    if opts.check:
        bad = mismatches(read_pins(opts.check))
        for line in bad:
            print(f"pins: {line} ({opts.check})", file=sys.stderr)
        return 1 if bad else 0
    versions = closure(requirement_names(opts.requirements) + ROOTS)
    with open(opts.write, "w") as f:
        f.write(HEADER + "\n".join(pinned_lines(versions)) + "\n")
    print(f"pins: {len(versions)} packages written to {opts.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
