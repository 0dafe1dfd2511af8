"""Name -> class registries for operators (what rule files name) and the ops they dispatch to."""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of classes. Registering a name twice is a bug and raises."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str):
        def decorate(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self._items[name]} and {obj})")
            self._items[name] = obj
            return obj

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def name_of(self, obj: T) -> str | None:
        return next((n for n, o in self._items.items() if o is obj), None)


# Injected modules that replace a Hugging Face module (what `replace: class:` names).
OPERATORS: Registry[type] = Registry("operator")
# Compute backends an injected linear / experts module dispatches to by phase (`prefill_op`, `generate_op`).
LINEAR_OPS: Registry[type] = Registry("linear op")
EXPERT_OPS: Registry[type] = Registry("experts op")


def register_operator(name: str):
    return OPERATORS.register(name)
