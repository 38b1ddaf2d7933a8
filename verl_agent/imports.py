"""Import an object named by a dotted path or by a file path: the one loader behind tools,
interactions, agent functions and reward functions.

    "pkg.module.Name"  or  "pkg.module:Name"     an importable module (the current directory included)
    "path/to/file.py:Name"                       a Python file, relative to `base_dir` (default: the cwd)

A file is loaded once per resolved path and kept in ``sys.modules``; a file whose code raises is removed
again, so the next load runs it afresh and reports the same error instead of a half-run module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["import_module", "import_object", "is_file_spec", "lazy_attributes"]


def lazy_attributes(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A package's module-level ``__getattr__`` (PEP 562) that imports ``names[attr]`` (a module path) on first
    access of `attr`, so importing the package does not load its heavy modules (torch, ray, transformers)."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def is_file_spec(path: str) -> bool:
    """Whether `path` names "file:Name" (the part before the last ':' ends in .py or holds a '/')."""
    file_part, sep, _ = path.rpartition(":")
    return bool(sep) and (file_part.endswith(".py") or "/" in file_part or os.sep in file_part)


def import_object(path: str, base_dir: Path | None = None) -> Any:
    """The object `path` names. Raises ImportError (missing file or module, or an exception while its code
    runs, named with its type and message) or AttributeError (the module has no such name)."""
    if is_file_spec(path):
        file_part, _, name = path.rpartition(":")
        fpath = Path(file_part)
        if not fpath.is_absolute() and base_dir is not None:
            fpath = base_dir / fpath
        module, where = _load_file(fpath), str(fpath)
    else:
        module_name, _, name = path.replace(":", ".").rpartition(".")
        if not module_name or not name:
            raise ImportError(f"{path!r} is not a dotted path like 'package.module.Name' or a 'file.py:Name'")
        module, where = _import_module(module_name), f"module {module_name!r}"
    if not hasattr(module, name):
        raise AttributeError(f"{where} has no attribute {name!r}")
    return getattr(module, name)


def import_module(spec: str, base_dir: Path | None = None) -> ModuleType:
    """The module `spec` names: "pkg.module" (importable) or "path/to/file.py" (relative to `base_dir`, default the
    cwd). Raises ImportError as `import_object` does."""
    if spec.endswith(".py"):
        fpath = Path(spec)
        return _load_file(base_dir / fpath if base_dir is not None and not fpath.is_absolute() else fpath)
    if not spec or not all(part.isidentifier() for part in spec.split(".")):
        raise ImportError(f"{spec!r} is not a dotted module path like 'package.module' or a 'path/file.py'")
    return _import_module(spec)


def _load_file(fpath: Path) -> ModuleType:
    if not fpath.is_file():
        raise ImportError(f"file {fpath} does not exist")
    mod_name = f"_verl_agent_user_{abs(hash(str(fpath.resolve())))}"
    module = sys.modules.get(mod_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(mod_name, fpath)
    if spec is None or spec.loader is None:
        raise ImportError(f"{fpath} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[mod_name]  # a half-run module must not answer the next load
        if not isinstance(e, (Exception, SystemExit)):
            raise
        raise ImportError(f"importing {fpath} failed: {type(e).__name__}: {e}") from e
    return module


def _import_module(module_name: str) -> ModuleType:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")  # user modules next to the config resolve as they do under `python -m`
    try:
        return importlib.import_module(module_name)
    except ImportError:
        raise
    except Exception as e:  # the module's own code raised while importing
        raise ImportError(f"importing {module_name} failed: {type(e).__name__}: {e}") from e
