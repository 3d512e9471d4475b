"""--help without importing torch or megatron-core: a command's help text, rendered once and kept in
a cache file named after what it depends on (the installed megatron-core and torch, this package's
sources and the entry script with the files beside it that it names, the Python version, the
terminal width). Rendering train.py's help
builds megatron's parser, which imports megatron-core (seconds); reading the cache takes milliseconds.

    if "-h" in argv or "--help" in argv:
        helptext.show("train", __file__, render)      # prints and exits

The cache lives in $XDG_CACHE_HOME/megatron_ext (default ~/.cache/megatron_ext); where it cannot be
written the help is rendered each time."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from importlib import metadata
from typing import Callable

PACKAGE = os.path.dirname(os.path.abspath(__file__))


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_ext")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def key(entry: str | list[str]) -> str:
    """What the rendered text depends on: a changed source file (`entry`: the script, or it and the
    files it reads its flags from), an upgrade, another terminal width each give another key (and so
    a fresh render)."""
    parts = [sys.version, _version("megatron-core"), _version("torch"), str(shutil.get_terminal_size().columns)]
    sources = [os.path.abspath(path) for path in ([entry] if isinstance(entry, str) else entry)]
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        sources += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    for path in sources:
        st = os.stat(path)
        parts.append(f"{os.path.relpath(path, PACKAGE)} {st.st_size} {st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def text(name: str, entry: str | list[str], render: Callable[[], str]) -> str:
    """The help text of command `name` (entry: its script file, or the files it depends on), from the
    cache or rendered now."""
    path = os.path.join(cache_dir(), f"{name}-{key(entry)}.txt")
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        pass
    rendered = render()
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        for stale in os.listdir(cache_dir()):  # this command's texts for sources that changed since
            if stale.startswith(f"{name}-") and stale.endswith(".txt"):
                os.remove(os.path.join(cache_dir(), stale))
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w") as f:
            f.write(rendered)
        os.replace(partial, path)  # whole or not at all: another command may read it meanwhile
    except OSError:
        pass  # an unwritable cache: rendered again next time
    return rendered


def show(name: str, entry: str | list[str], render: Callable[[], str]) -> None:
    sys.stdout.write(text(name, entry, render))
    sys.exit(0)
