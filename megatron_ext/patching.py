"""Reversible patches of code we do not own: the record type of the CPU-only shims
(megatron_ext/platform/cpu_shims/) and of the seams (megatron_ext/seams/).

A record names the upstream sites it covers and knows how to install and remove itself, so a test
can take one away and prove it is needed, or install and remove it and prove the original is back.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, List


@dataclass
class Patch:
    name: str
    upstream: List[str]  # "megatron/...py:line" for every call site it covers
    why: str
    install: Callable[[], Callable[[], None]]  # returns its own uninstaller
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self._undo is not None

    def apply(self) -> None:
        if self._undo is None:
            self._undo = self.install()

    def remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    @contextlib.contextmanager
    def applied(self):
        """Active inside the block; removed after it unless it was active before."""
        was = self.active
        self.apply()
        try:
            yield
        finally:
            if not was:
                self.remove()

    @contextlib.contextmanager
    def without(self):
        """Removed inside the block; applied again after it if it was active before."""
        was = self.active
        self.remove()
        try:
            yield
        finally:
            if was:
                self.apply()


def set_attr(obj, name, value) -> Callable[[], None]:
    """setattr, returning the undo (for a class, only the class's own attribute is restored)."""
    missing = object()
    old = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)

    setattr(obj, name, value)

    def undo():
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)

    return undo


def undo_all(undos: List[Callable[[], None]]) -> Callable[[], None]:
    def undo():
        for u in reversed(undos):
            u()

    return undo
