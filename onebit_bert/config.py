"""Config files → typed dataclasses, with ``section.field=value`` overrides.

Every stage describes its settings as nested dataclasses (a docstring or comment per
field, checks in ``__post_init__``). :func:`load_config` builds one from defaults, then a
YAML/JSON file, then command-line overrides (later wins), converting values to the
annotated types. An unknown key, a value of the wrong type, or a failed check raises one
:class:`ConfigError` that names the key and the file.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from onebit_bert.io import atomic_write_text

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which and why."""


def parse_overrides(overrides: Sequence[str]) -> dict:
    """``["a.b=3", "c=[1, 2]"]`` → ``{"a": {"b": 3}, "c": [1, 2]}`` (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({err})") from None
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a field inside a non-section")
        node[parts[-1]] = value
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A config file as a mapping. A top-level ``base: other.yaml`` (relative to this
    file) is read first and this file's keys are merged over it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML/JSON: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        base_path = (path.parent / base).resolve()
        if base_path in _seen:
            raise ConfigError(f"config file {path}: base {base} includes itself")
        data = _merge(read_config_file(base_path, (*_seen, path.resolve())), data)
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Defaults of ``cls`` ← file at ``path`` ← ``overrides``; returns a checked instance."""
    data = read_config_file(path) if path is not None else {}
    data = _merge(data, parse_overrides(overrides))
    where = f" (in {path})" if path is not None else ""
    try:
        return from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{err}{where}") from None


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, recursively, checking every key and type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        section = f" of {prefix.rstrip('.')}" if prefix else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys{section}: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {err}") from None


def _convert(hint: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, name)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(
            errors[0]
            if len(errors) == 1
            else f"{name}: {value!r} fits none of {[getattr(a, '__name__', str(a)) for a in args]}"
        )
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=name + ".")
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{name} must have {len(args)} items, got {len(value)}")
            pairs = enumerate(zip(args, value, strict=True))
            return tuple(_convert(a, v, f"{name}[{i}]") for i, (a, v) in pairs)
        item = args[0] if args else Any
        items = [_convert(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or hint is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{name} must be one of {list(args)}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    return value


def to_dict(cfg: Any) -> dict:
    """Plain-data view of a config dataclass (for manifests and resolved-config files)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
