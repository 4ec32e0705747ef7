"""A search candidate's `grid`: options to try in every combination, expanded when the recipe loads.

    candidates:
      - name: llama-q8_0
        optimize: {method: gguf, type: q8_0}
        engine: {backend: llama_cpp, threads: 2}
        grid:
          engine.speculative: [null, {type: ngram-simple, ngram_n: 3, ngram_m: 8}]
          engine.cache_type_k: [f16, q8_0]

becomes four ordinary candidates, `llama-q8_0.spec-none.k-f16` ... `llama-q8_0.spec-ngram-simple.k-q8_0`,
before the recipe is validated: the search (pipeline/search/search.py: cheap checks first, elimination) and every
stage see them as if each were written out, and the resolved recipe a run saves lists them so. A path is
`engine.<option>` or `optimize.<option>` (deeper parts, `engine.speculative.ngram_n`, reach into an option);
each value is checked against the section's own config class here, so a bad path or value is named as the
user wrote it, not by the index of a candidate they never wrote.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

from pydantic import BaseModel, ValidationError

import kiln.engine  # noqa: F401 - registers the engine backends
import kiln.optimize  # noqa: F401 - registers the quantization methods
from kiln.core.registry import did_you_mean
from kiln.engine.base import BACKENDS
from kiln.optimize.base import QUANTIZERS

# How an option is named in a candidate's name: the levers' short forms, else the option itself.
SHORT = {"speculative": "spec", "cache_type_k": "k", "cache_type_v": "v", "cache_type": "kv", "cache_reuse": "reuse"}
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")  # what CandidateSection.name does not allow


def expand_grids(data: dict[str, Any]) -> dict[str, Any]:
    """The raw recipe with every candidate that has a `grid` replaced by one candidate per combination."""
    listed = data.get("candidates")
    if not isinstance(listed, list) or not any(isinstance(c, dict) and c.get("grid") is not None for c in listed):
        return data
    out: list[Any] = []
    for i, entry in enumerate(listed):
        if isinstance(entry, dict) and entry.get("grid") is not None:
            out.extend(_expand(entry, f"candidates.{i}"))
        else:
            out.append(entry)
    return {**data, "candidates": out}


def _expand(entry: dict[str, Any], where: str) -> list[dict[str, Any]]:
    grid = entry["grid"]
    if entry.get("champion"):
        raise ValueError(f"{where}.grid: the champion is served as the registry recorded it; put the grid on a "
                         "candidate of its own")
    if not isinstance(grid, dict) or not grid:
        raise ValueError(f"{where}.grid: a mapping of option paths to lists of values, e.g. "
                         "{engine.cache_type_k: [f16, q8_0]}")
    base = {k: v for k, v in entry.items() if k != "grid"}
    if any(str(path).startswith("engine.") for path in grid) and not isinstance(base.get("engine"), dict):
        base["engine"] = {"backend": "torch"}  # CandidateSection's default engine, now with options set
    axes = []
    for path, values in grid.items():
        at = f"{where}.grid.{path}"
        _check_path(base, str(path), at)
        if not isinstance(values, list) or not values:
            raise ValueError(f"{at}: a list of the values to try, e.g. [f16, q8_0]")
        for value in values:
            _check(_with(base, path, value), path.split(".")[0], f"{at}: value {value!r}")
        axes.append([(path, v, label) for v, label in zip(values, _labels(path, values, at), strict=True)])
    out = []
    for combination in itertools.product(*axes):
        candidate = base
        for path, value, _ in combination:
            candidate = _with(candidate, path, value)
        candidate["name"] = ".".join([str(base.get("name", "")), *(label for _, _, label in combination)])
        for section in {path.split(".")[0] for path in grid}:
            _check(candidate, section, f"{where}.grid: {candidate['name']}")
        out.append(candidate)
    return out


def _config_class(entry: dict[str, Any], section: str) -> type[BaseModel] | None:
    """The config class `entry`'s section validates with; None when its plugin name is unknown (the
    recipe's own validation then says so, with its "did you mean")."""
    body = entry.get(section) if isinstance(entry.get(section), dict) else {}
    registry, key, default = (BACKENDS, "backend", "torch") if section == "engine" else (QUANTIZERS, "method", None)
    name = body.get(key, default)
    return registry.config(name) if name in registry.names() else None


def _check_path(entry: dict[str, Any], path: str, at: str) -> None:
    parts = path.split(".")
    if parts[0] not in ("engine", "optimize") or len(parts) < 2 or "" in parts:
        raise ValueError(f"{at}: a grid path is engine.<option> or optimize.<option> (e.g. engine.cache_type_k)")
    cls = _config_class(entry, parts[0])
    if cls is not None and parts[1] not in cls.model_fields:
        options = sorted(cls.model_fields)
        raise ValueError(f"{at}: '{parts[1]}' is not an option of this candidate's {parts[0]} ({cls.__name__})."
                         f"{did_you_mean(parts[1], options)} Options: {', '.join(options)}")


def _check(entry: dict[str, Any], section: str, what: str) -> None:
    """`entry`'s section validates with its own config class; else a ValueError that starts with `what`."""
    cls = _config_class(entry, section)
    if cls is None:
        return
    try:
        cls.model_validate(entry.get(section) or {})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) + ': ' if x['loc'] else ''}"
                             f"{x['msg'].removeprefix('Value error, ')}" for x in e.errors())
        raise ValueError(f"{what}: {problems}") from None


def _with(entry: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `entry` with `value` at the dotted `path` (sections and options made as needed)."""
    out = copy.deepcopy(entry)
    node = out
    *parents, last = path.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)
    return out


def _labels(path: str, values: list[Any], at: str) -> list[str]:
    """A name part per value, `<option>-<value>`: a mapping by its type (or kind, method, backend), and by
    every field when two of one type would share a name."""
    option = path.split(".")[-1]
    short = SHORT.get(option, option)
    labels = [_label(v, full=False) for v in values]
    if len(set(labels)) < len(labels):
        labels = [_label(v, full=True) for v in values]
    if len(set(labels)) < len(labels):
        raise ValueError(f"{at}: values repeat ({', '.join(sorted({x for x in labels if labels.count(x) > 1}))})")
    return [_UNSAFE.sub("_", f"{short}-{label}") for label in labels]


def _label(value: Any, full: bool) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        tag = next((str(value[k]) for k in ("type", "kind", "method", "backend") if k in value), None)
        rest = [f"{k}{_label(v, full)}" for k, v in value.items() if k not in ("type", "kind", "method", "backend")]
        return "-".join([tag] if tag and not full else [*([tag] if tag else []), *rest]) or "default"
    if isinstance(value, list):
        return "-".join(_label(v, full) for v in value) or "empty"
    return str(value)
