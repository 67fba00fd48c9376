"""Config files → typed dataclasses, with ``section.field=value`` overrides.

Every stage describes its settings as nested dataclasses (an attribute docstring per
field, checks in ``__post_init__``). :func:`load_config` builds one from defaults, then a
YAML/JSON file, then command-line overrides (later wins), converting values to the
annotated types. An unknown key, a value of the wrong type, or a failed check raises one
:class:`ConfigError` that names the key and the file.

:func:`describe_config` lists every field of such a dataclass tree (dotted key, type,
default, docstring) and :func:`config_help` renders that list as text for a CLI's ``--help``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
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
            errors[0] if len(errors) == 1 else f"{name} must be {_type_text(hint)}, got {value!r}"
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


# ---------------------------------------------------------------------- describing a config

HELP_HEADING = "config fields (set in the YAML file or as section.field=value):"
REQUIRED = "(required)"
SECTION = "(section)"
COMPUTED = "(computed)"
_PLACEHOLDERS = (REQUIRED, SECTION, COMPUTED)


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One field of a config dataclass tree, ready to print."""

    key: str
    """Dotted key, e.g. ``optimizer.lr``; ``sources[].name`` for a field of a list item."""
    type: str
    """The annotation as text; Literal choices as ``{a, b}``."""
    default: str
    """The default as YAML-like text, or ``(required)``, ``(section)``, ``(computed)``."""
    doc: str
    """The attribute docstring (for a section without one: its class docstring); may be
    empty."""
    section: bool = False
    """True for a nested dataclass (or a list of them), whose fields follow it."""


def describe_config(cls: type) -> list[FieldDoc]:
    """Every init field of dataclass ``cls`` and of its nested sections, depth first, in
    declaration order. A section's entry comes before its fields; the fields of a list of
    dataclasses are listed once, under ``key[].``. Defaults of a section's fields are read
    from the section's default instance, so a parent that changes them is shown correctly."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    return _describe(cls, "", None, ())


def config_help(cls: type, heading: str = HELP_HEADING, width: int = 92) -> str:
    """:func:`describe_config` as text for an argparse epilog: one line per field,
    ``  key: type = default``, its docstring wrapped to ``width`` and indented under it."""
    lines = [heading]
    previous: FieldDoc | None = None
    for item in describe_config(cls):
        if previous is not None and (item.section or previous.key.count(".") > item.key.count(".")):
            lines.append("")
        default = item.default if item.default in _PLACEHOLDERS else f"= {item.default}"
        lines.append(f"  {item.key}: {item.type} {default}")
        lines.extend(_wrap_doc(item.doc, width, indent=6))
        previous = item
    return "\n".join(lines)


def _describe(cls: type, prefix: str, instance: Any, seen: tuple[type, ...]) -> list[FieldDoc]:
    """Entries for the fields of ``cls`` under ``prefix``; ``instance`` (or None) supplies the
    defaults of a section created by its parent's default factory."""
    class_docs = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins over its base's
        if dataclasses.is_dataclass(klass):
            class_docs.update(_source_docs(klass)[1])
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # names only resolvable where the class was defined
        hints = {}
    out: list[FieldDoc] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints.get(f.name, f.type)
        value = getattr(instance, f.name) if instance is not None else _field_default(f)
        sub, many = _section_type(hint)
        sub = None if sub in seen else sub  # a recursive definition is listed once
        doc = class_docs.get(f.name, "") or (_source_docs(sub)[0] if sub else "")
        key = prefix + f.name
        out.append(FieldDoc(key, _type_text(hint), _default_text(value), doc, sub is not None))
        if sub is None:
            continue
        if many:
            out += _describe(sub, key + "[].", None, (*seen, cls))
        else:
            inner = value if dataclasses.is_dataclass(value) else None
            out += _describe(sub, key + ".", inner, (*seen, cls))
    return out


_MISSING_VALUE = object()
_FAILED_FACTORY = object()


def _field_default(f: dataclasses.Field) -> Any:
    """The field's default value; a factory is called for it."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        try:
            return f.default_factory()
        except Exception:
            return _FAILED_FACTORY
    return _MISSING_VALUE


def _default_text(value: Any) -> str:
    if value is _MISSING_VALUE:
        return REQUIRED
    if value is _FAILED_FACTORY:
        return COMPUTED
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return SECTION
    return _format_value(value)


def _format_value(value: Any) -> str:
    """A value as it would be written in YAML flow style: ``null``, ``true``, ``[1, 2]``,
    ``{a: 1}``; strings unquoted unless YAML would read them as something else."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if _plain_string(value) else json.dumps(value)
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{_format_value(k)}: {_format_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return str(value)


def _plain_string(value: str) -> bool:
    """Whether ``value`` can be shown without quotes (YAML reads it back as the same string
    and it cannot be taken for a placeholder or a list separator)."""
    if not value or value != value.strip() or value.startswith("(") or "," in value:
        return False
    try:
        return yaml.safe_load(value) == value
    except yaml.YAMLError:
        return False


def _section_type(hint: Any) -> tuple[type | None, bool]:
    """(dataclass, is_list) when ``hint`` is a dataclass, an optional one, or a list/tuple
    of them; (None, False) otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        return _section_type(present[0]) if len(present) == 1 else (None, False)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, False
    if origin in (list, tuple, Sequence) and args:
        item = args[0]
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            return item, True
    return None, False


def _type_text(hint: Any) -> str:
    """Readable annotation: ``int | None``, ``list[str]``, ``{poly, ee}`` for a Literal."""
    if isinstance(hint, str):
        return hint
    if hint is type(None):
        return "None"
    if hint is Any:
        return "Any"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "{" + ", ".join(_format_value(a) for a in args) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if not args:
            return name
        inner = ", ".join("..." if a is Ellipsis else _type_text(a) for a in args)
        return f"{name}[{inner}]"
    return getattr(hint, "__name__", str(hint))


@functools.cache
def _source_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(class docstring, {field name: attribute docstring}) read from the source of ``cls``
    (a string statement directly after an annotated field); empty without source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return "", {}
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return "", {}
    docs = {}
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return ast.get_docstring(node) or "", docs


_ROLE = re.compile(r":[\w:]+:`(~?)([^`]+)`")


def _wrap_doc(doc: str, width: int, indent: int) -> list[str]:
    """A docstring reflowed to ``width``: paragraphs (split at blank lines) filled, Sphinx
    roles and double backquotes reduced to plain single backquotes."""
    doc = _ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", doc)
    doc = doc.replace("``", "`")
    pad = " " * indent
    lines: list[str] = []
    for paragraph in re.split(r"\n\s*\n", doc.strip()):
        if paragraph.strip():
            lines += textwrap.wrap(
                " ".join(paragraph.split()),
                width=max(width, indent + 20),
                initial_indent=pad,
                subsequent_indent=pad,
                break_on_hyphens=False,
            )
    return lines
