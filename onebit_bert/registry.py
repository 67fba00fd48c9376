"""One small registry for every extension point: optimizers, strategies, recipes, codecs.

A :class:`Registry` maps a name to a frozen spec (a dataclass with a ``name`` field) in
registration order. It is a read-only :class:`~collections.abc.Mapping`, so ``name in
REGISTRY``, ``REGISTRY[name]`` and iteration work as on a dict; entries are added with
:meth:`Registry.register` and looked up with :meth:`Registry.get`, whose error names the
config key and every registered choice (``get(name, None)`` returns None instead, as a
dict's).

Each extension point keeps its spec dataclass (what an entry declares) in its own module
and creates one registry here, e.g.::

    OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer", key="optimizer.name")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

S = TypeVar("S")
_REQUIRED: Any = object()
"""``get``'s default when none is given: a missing name raises."""


class Registry(Mapping[str, S], Generic[S]):
    """Named specs of one kind, in registration order."""

    def __init__(
        self,
        kind: str,
        key: str | None = None,
        reserved: Mapping[str, str] | None = None,
        extra_choices: tuple[str, ...] = (),
        hint: str = "",
    ):
        self.kind = kind
        """What an entry is, in messages ("optimizer", "strategy", "codec")."""
        self.key = key or f"{kind}.name"
        """The config key whose value is looked up (for error messages)."""
        self.reserved = dict(reserved or {})
        """Names no entry may take, with the reason."""
        self.extra_choices = tuple(extra_choices)
        """Values the key accepts besides the entries (listed first in errors, e.g. auto)."""
        self.hint = hint
        """Appended to the error for an unknown name (how to add one)."""
        self._entries: dict[str, S] = {}

    # -------------------------------------------------------------------- the Mapping
    def __getitem__(self, name: str) -> S:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"

    # -------------------------------------------------------------------- changes
    def register(self, spec: S, replace: bool = False) -> S:
        """Add ``spec`` under ``spec.name`` (``replace``: over an entry of that name)."""
        name = spec.name  # type: ignore[attr-defined]
        if name in self.reserved:
            raise ValueError(f"{self.kind} name {name} is reserved ({self.reserved[name]})")
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name} is already registered")
        self._entries[name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Remove an entry (tests that register a toy one); a missing name is ignored."""
        self._entries.pop(name, None)

    # -------------------------------------------------------------------- lookups
    def choices(self) -> tuple[str, ...]:
        """Every value the config key accepts."""
        return (*self.extra_choices, *self._entries)

    def get(self, name: str, default: Any = _REQUIRED) -> S:  # type: ignore[override]
        """The entry for ``name``; a clear error naming the key and its choices. With a
        ``default`` given, a missing name returns it instead (as a dict's ``get``)."""
        if name in self._entries:
            return self._entries[name]
        if default is not _REQUIRED:
            return default
        hint = f" ({self.hint})" if self.hint else ""
        raise ValueError(
            f"{self.key} {name!r} is not a registered {self.kind}; choose one of "
            f"{', '.join(self.choices())}{hint}"
        )

    def names(self, predicate: Callable[[S], bool] | None = None) -> tuple[str, ...]:
        """The registered names, or those whose entry satisfies ``predicate``."""
        return tuple(n for n, s in self._entries.items() if predicate is None or predicate(s))
