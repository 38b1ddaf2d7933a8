"""Tool registry from YAML in verl's format.

    tools:
      - class_name: verl_agent.tools.calculator.CalculatorTool   # a BaseTool subclass
        config: {type: native}
        tool_schema:                                             # optional when the class has one
          type: function
          function: {name: calculator, description: ..., parameters: {...}}
      - class_name: my_tools.lookup             # a @tool function, or a plain typed function
      - class_name: tools/extra.py:lookup       # a file path (relative to this YAML) and a name

verl's built-in class paths load unchanged (``verl.tools.gsm8k_tool.Gsm8kTool``,
``verl.tools.search_tool.SearchTool``, ``verl.tools.sandbox_fusion_tools.SandboxFusionTool``):
verl_agent.verl_compat maps them to ours; the ones we have no equivalent for (MCP, image tools)
are refused with "not supported yet". ``config.type`` is verl's tool type: ``native`` (or absent);
verl's ``mcp`` type is refused the same way.

Everything is checked at load time: a missing module or class, a bad schema, a
duplicate tool name or an unknown key raises ToolConfigError naming the file and
the entry (index and class_name), before any rollout starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from verl_agent.tools.base import BaseTool
from verl_agent.tools.errors import ToolConfigError
from verl_agent.tools.function_tool import FunctionTool
from verl_agent.tools.schema import OpenAIFunctionToolSchema
from verl_agent.verl_compat import VerlNotSupported, resolve_verl_class

__all__ = ["build_tools", "import_object", "load_tools", "read_yaml_list"]

_ENTRY_KEYS = {"class_name", "config", "tool_schema"}


def import_object(path: str, base_dir: Path | None = None) -> Any:
    """Import "pkg.module.Name" or "file.py:Name" (relative to `base_dir`); raises ImportError/AttributeError
    (an exception while the file or module runs becomes an ImportError naming it)."""
    if ":" in path and path.split(":", 1)[0].endswith(".py"):
        file, name = path.rsplit(":", 1)
        fpath = Path(file) if Path(file).is_absolute() or base_dir is None else base_dir / file
        if not fpath.is_file():
            raise ImportError(f"file {fpath} does not exist")
        mod_name = f"_verl_agent_user_{abs(hash(str(fpath.resolve())))}"
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, fpath)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException as e:
                del sys.modules[mod_name]  # a half-run module must not answer the next load
                raise ImportError(f"running {fpath} failed: {type(e).__name__}: {e}") from e
        return getattr(module, name)
    module_name, _, name = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path like 'package.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise
    except Exception as e:
        raise ImportError(f"importing {module_name} failed: {type(e).__name__}: {e}") from e
    return getattr(module, name)


def _build_one(entry: Any, where: str, base_dir: Path | None) -> BaseTool:
    if not isinstance(entry, Mapping):
        raise ToolConfigError(f"{where}: expected a mapping with 'class_name', got {type(entry).__name__}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ToolConfigError(f"{where}: 'class_name' is required (a dotted import path)")
    where = f"{where} ({class_name})"
    try:
        import_path = resolve_verl_class(class_name, "tool")
    except VerlNotSupported as e:
        raise ToolConfigError(f"{where}: {e}") from None
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ToolConfigError(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
    if "mcp" in entry or config.get("type") == "mcp":
        raise ToolConfigError(f"{where}: verl's MCP tools ('mcp:', config.type: mcp) are not supported yet")
    if config.get("type", "native") != "native":
        raise ToolConfigError(f"{where}: config.type must be 'native' (verl's tool type), got {config['type']!r}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
    try:
        obj = import_object(import_path, base_dir)
    except (ImportError, AttributeError) as e:
        raise ToolConfigError(f"{where}: cannot import {class_name!r}: {e}") from e
    try:
        schema = entry.get("tool_schema")
        schema = OpenAIFunctionToolSchema.model_validate(schema) if schema is not None else None
        return _instantiate(obj, dict(config), schema, where)
    except ValidationError as e:
        raise ToolConfigError(f"{where}: invalid tool_schema:\n{e}") from e
    except ToolConfigError as e:
        raise ToolConfigError(f"{where}: {e}") from e
    except Exception as e:  # the tool's own constructor refused its config
        raise ToolConfigError(f"{where}: creating the tool failed: {type(e).__name__}: {e}") from e


def _instantiate(obj: Any, config: dict, schema: OpenAIFunctionToolSchema | None, where: str) -> BaseTool:
    if isinstance(obj, FunctionTool):
        return obj.with_config(config, schema)
    if inspect.isclass(obj) and issubclass(obj, BaseTool):
        return obj(config, schema)
    if inspect.isclass(obj) and any(c.__name__ == "BaseTool" for c in obj.__mro__):
        # A verl tool (verl.tools.base_tool.BaseTool): same lifecycle, verl's own schema class.
        return _VerlToolAdapter(obj(config, _to_verl_schema(obj, schema)))
    if inspect.isfunction(obj) or inspect.iscoroutinefunction(obj):
        return FunctionTool(obj, config, schema)
    raise ToolConfigError(f"{where}: {obj!r} is neither a BaseTool subclass nor a function")


def _to_verl_schema(cls: type, schema: OpenAIFunctionToolSchema | None) -> Any:
    """verl validates its own pydantic schema class; hand it a plain dict re-parsed by that class."""
    if schema is None:
        return None
    mod = sys.modules.get(cls.__module__)
    verl_schema_cls = getattr(mod, "OpenAIFunctionToolSchema", None)
    return verl_schema_cls.model_validate(schema.to_openai()) if verl_schema_cls else schema


class _VerlToolAdapter(BaseTool):
    """Wraps a tool built on verl's own BaseTool so it speaks our schema type; the lifecycle is identical."""

    def __init__(self, inner: Any):
        self.inner = inner
        schema = inner.get_openai_tool_schema()
        dumped = schema.model_dump(exclude_none=True) if hasattr(schema, "model_dump") else schema
        super().__init__(getattr(inner, "config", {}), OpenAIFunctionToolSchema.model_validate(dumped))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        return await self.inner.create(instance_id, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return await self.inner.execute(instance_id, parameters, **kwargs)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return await self.inner.calc_reward(instance_id, **kwargs)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await self.inner.release(instance_id, **kwargs)


def build_tools(entries: Any, source: str = "<tools>", base_dir: Path | None = None) -> dict[str, BaseTool]:
    """Build tools from a list of verl-style entries; `source` names the file in errors."""
    if not isinstance(entries, list):
        raise ToolConfigError(f"{source}: 'tools' must be a list of entries, got {type(entries).__name__}")
    tools: dict[str, BaseTool] = {}
    first: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tools[{i}]"
        t = _build_one(entry, where, base_dir)
        if t.name in tools:
            raise ToolConfigError(f"{where}: duplicate tool name {t.name!r} (also defined by tools[{first[t.name]}])")
        tools[t.name], first[t.name] = t, i
    return tools


def read_yaml_list(path: Path, key: str, error: type[Exception]) -> list[Any]:
    """The list under `key` of a verl-format YAML file (empty file or empty list: []); errors name the file."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise error(f"{path}: cannot read: {e}") from e
    except yaml.YAMLError as e:
        raise error(f"{path}: invalid YAML: {e}") from e
    if data is None:
        return []
    if not isinstance(data, Mapping) or key not in data:
        raise error(f"{path}: expected a mapping with a list under {key!r} (verl format)")
    return data[key] or []


def load_tools(yaml_path: str | Path | None) -> dict[str, BaseTool]:
    """Load a verl tool YAML (`tools: [{class_name, config, tool_schema}]`); None or "" gives no tools."""
    if not yaml_path:
        return {}
    path = Path(yaml_path)
    return build_tools(read_yaml_list(path, "tools", ToolConfigError), str(path), path.parent)
