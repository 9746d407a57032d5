"""``DataFile``: a stage field naming a data file (a path, or a file shipped with kvpolicy), and
the switch under which only shipped files may be named (a policy a client sent)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class DataFile:
    """Marks a stage field (``Annotated[str, DataFile("folder")]``) that names a data file: a path,
    or ``builtin:NAME`` for the file ``NAME`` shipped with kvpolicy in ``kvpolicy/policies/<folder>/``.
    An engine that takes policies from clients reads only built-in files for them (``Stage.data_files``:
    vLLM refuses a request whose policy names a file of the server)."""

    folder: str

    PREFIX: ClassVar[str] = "builtin:"

    def resolve(self, value: str, field: str = "") -> str:
        """The file ``value`` (of the stage field ``field``) names: itself, or for ``builtin:NAME``
        the file shipped with kvpolicy. Inside ``DataFile.builtin_only()`` a path is refused before
        anything reads it."""
        if not value.startswith(self.PREFIX):
            if _BUILTIN_ONLY.get():
                raise ValueError(f"{field + ': ' if field else ''}{value!r} is a file of this machine: only kvpolicy's built-in files "
                                 f"(builtin:NAME) may be named here")
            return value
        from importlib.resources import files

        return str(files("kvpolicy") / "policies" / self.folder / value.removeprefix(self.PREFIX))

    @classmethod
    def is_builtin(cls, value: str) -> bool:
        return value.startswith(cls.PREFIX)

    @staticmethod
    @contextmanager
    def builtin_only() -> Iterator[None]:
        """Policies loaded inside read built-in data files only (a policy a client sent)."""
        token = _BUILTIN_ONLY.set(True)
        try:
            yield
        finally:
            _BUILTIN_ONLY.reset(token)


_BUILTIN_ONLY: ContextVar[bool] = ContextVar("kvpolicy_builtin_data_files_only", default=False)
