"""One registry per extension point: a name maps to a plugin class and its config class.

Each plugin lives in one file, declares a pydantic config whose discriminator field (`method`,
`backend`, `kind`…) is a `Literal` of its name, and registers itself once. The recipe builds its
tagged unions from these registries, so adding a plugin is adding one file and one import line.
Plugin modules must import heavy libraries (torch, transformers) inside functions, so that
`kiln validate` stays instant.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Generic, TypeVar, Union

from pydantic import BaseModel, Field

from kiln.core.errors import BadInput

T = TypeVar("T")


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Available: {', '.join(sorted(choices))}."


class Registry(Generic[T]):
    def __init__(self, what: str, discriminator: str):
        self.what = what
        self.discriminator = discriminator
        self._plugins: dict[str, type[T]] = {}
        self._configs: dict[str, type[BaseModel]] = {}

    def register(self, name: str, config: type[BaseModel]):
        """Class decorator: `@QUANTIZERS.register("gptq", GPTQConfig)`."""

        def deco(cls: type[T]) -> type[T]:
            if name in self._plugins:
                raise RuntimeError(f"{self.what} '{name}' registered twice")
            self._plugins[name] = cls
            self._configs[name] = config
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def names(self) -> list[str]:
        return sorted(self._plugins)

    def get(self, name: str) -> type[T]:
        if name not in self._plugins:
            raise BadInput(f"Unknown {self.what} '{name}'.{did_you_mean(name, self.names())}")
        return self._plugins[name]

    def config(self, name: str) -> type[BaseModel]:
        self.get(name)
        return self._configs[name]

    def create(self, config: BaseModel, **kwargs: Any) -> T:
        return self.get(getattr(config, self.discriminator))(config, **kwargs)  # type: ignore[call-arg]

    def config_union(self) -> Any:
        """The tagged union of every registered config, for use as a recipe field type."""
        configs = tuple(self._configs[n] for n in self.names())
        if len(configs) == 1:
            return configs[0]
        return Annotated[Union[configs], Field(discriminator=self.discriminator)]  # noqa: UP007
