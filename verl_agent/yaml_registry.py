"""verl-format YAML registries: a list of ``{class_name, config, ...}`` entries -> objects by name.

The tool and interaction registries differ only in the keys an entry may hold, the checks of their
own, and how the imported object becomes a tool or an interaction. Walking the list, checking each
entry, resolving verl's class paths, importing, refusing duplicate names and the error wording
(``<file>: <section>[<index>] (<class_name>): <what is wrong>``) live here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

from verl_agent.imports import import_object
from verl_agent.verl_compat import VerlNotSupported, resolve_verl_class

__all__ = ["Entry", "YamlRegistry", "read_config_file", "read_yaml_list"]

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One checked entry: `where` names the file, the index and the class for error messages."""

    where: str
    fields: Mapping[str, Any]
    class_name: str
    import_path: str  # class_name, or ours for verl's built-in class paths
    config: dict[str, Any]
    base_dir: Path | None = None  # the YAML file's folder: relative paths in the entry resolve there


@dataclass(frozen=True)
class YamlRegistry(Generic[T]):
    """How one kind of object is built from its YAML section.

    `make(obj, entry)` turns the imported object into a `T` with a ``name`` attribute (or a list of them: one
    entry may stand for several, like the tools of an MCP server); raising `error`
    (message without the entry prefix) or any other exception is reported naming the file and entry.
    `check(entry)` runs before the unknown-key check, for refusals more specific than "unknown key".
    """

    section: str  # the YAML key holding the list: "tools", "interaction"
    kind: str  # "tool" / "interaction": verl_compat's kind and the noun in errors
    keys: frozenset[str]
    error: type[Exception]
    make: Callable[[Any, Entry], T | list[T]]
    check: Callable[[Entry], None] | None = None

    def load(self, yaml_path: str | Path | None) -> dict[str, T]:
        """Build from the YAML file at `yaml_path` (relative file specs resolve next to it); None or "" -> {}."""
        if not yaml_path:
            return {}
        path = Path(yaml_path)
        return self.build(read_yaml_list(path, self.section, self.error), str(path), path.parent)

    def build(self, entries: Any, source: str, base_dir: Path | None = None) -> dict[str, T]:
        """Build every entry in order; `source` names the file in errors; a repeated name is refused."""
        if not isinstance(entries, list):
            raise self.error(f"{source}: {self.section!r} must be a list of entries, got {type(entries).__name__}")
        out: dict[str, T] = {}
        first: dict[str, int] = {}
        for i, raw in enumerate(entries):
            where = f"{source}: {self.section}[{i}]"
            built = self._build_one(raw, where, base_dir)
            for obj in built if isinstance(built, list) else [built]:
                name = obj.name  # type: ignore[attr-defined]
                if name in out:
                    raise self.error(f"{where}: duplicate {self.kind} name {name!r} "
                                     f"(also defined by {self.section}[{first[name]}])")
                out[name], first[name] = obj, i
        return out

    def _build_one(self, raw: Any, where: str, base_dir: Path | None) -> T | list[T]:
        entry = self._entry(raw, where, base_dir)
        try:
            obj = import_object(entry.import_path, base_dir)
        except (ImportError, AttributeError) as e:
            raise self.error(f"{entry.where}: cannot import {entry.class_name!r}: {e}") from e
        try:
            return self.make(obj, entry)
        except self.error as e:
            raise self.error(f"{entry.where}: {e}") from e
        except Exception as e:  # the object's own constructor refused its config
            raise self.error(f"{entry.where}: cannot build the {self.kind}: {type(e).__name__}: {e}") from e

    def _entry(self, raw: Any, where: str, base_dir: Path | None = None) -> Entry:
        if not isinstance(raw, Mapping):
            raise self.error(f"{where}: expected a mapping with 'class_name', got {type(raw).__name__}")
        class_name = raw.get("class_name")
        if not isinstance(class_name, str) or not class_name:
            raise self.error(f"{where}: 'class_name' is required (a dotted import path or 'file.py:Name')")
        where = f"{where} ({class_name})"
        try:
            import_path = resolve_verl_class(class_name, self.kind)
        except VerlNotSupported as e:
            raise self.error(f"{where}: {e}") from None
        config = raw.get("config") or {}
        if not isinstance(config, Mapping):
            raise self.error(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
        entry = Entry(where, raw, class_name, import_path, dict(config), base_dir)
        if self.check is not None:
            self.check(entry)
        unknown = set(raw) - self.keys
        if unknown:
            raise self.error(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(self.keys)}")
        return entry


def read_config_file(path: Path, error: type[Exception], parse: Callable[[str], Any] = yaml.safe_load,
                     fmt: str = "YAML", what: str = "") -> Any:  # fmt: skip
    """`parse` of the file's text (YAML, or e.g. `json.loads`); a file that cannot be read or parsed raises `error`
    naming it (``<what><path>: cannot read / invalid <fmt>: ...``)."""
    try:
        return parse(path.read_text())
    except OSError as e:
        raise error(f"{what}{path}: cannot read: {e}") from e
    except (yaml.YAMLError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise error(f"{what}{path}: invalid {fmt}: {e}") from e


def read_yaml_list(path: Path, key: str, error: type[Exception]) -> list[Any]:
    """The list under `key` of a verl-format YAML file (empty file or empty list: []); errors name the file."""
    data = read_config_file(path, error)
    if data is None:
        return []
    if not isinstance(data, Mapping) or key not in data:
        raise error(f"{path}: expected a mapping with a list under {key!r} (verl format)")
    return data[key] or []
