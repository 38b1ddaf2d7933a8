"""Loading: YAML plus `a.b.c=value` overrides, `${a.b}` interpolation, validation into a `RunConfig`, and
errors that name the key (with the closest valid key for a typo); `all_keys` lists the schema."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from verl_agent.config.base import ConfigError
from verl_agent.config.run import RunConfig

__all__ = ["all_keys", "load_config", "parse_override", "parse_value", "save_config"]


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_value(text: str) -> Any:
    """An override's value: int, float (also 1e-6), bool, null, list, mapping or string (quotes optional)."""
    if _FLOAT.match(text) and not re.match(r"^[+-]?\d+$", text):
        return float(text)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None and text.strip().lower() not in ("null", "none", "~", ""):
        return text
    if isinstance(value, str) and text.strip().lower() == "none":
        return None
    return value


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value). Hydra's '+a.b=v' spelling is accepted."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. data.train_batch_size=8)")
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    return key.split("."), parse_value(raw.strip())


def all_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema (used for 'did you mean' and `verl-agent config keys`)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append(key)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(all_keys(ann, key + "."))
    return out


def _set(tree: dict, path: list[str], value: Any, where: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


# keys with no meaning here that a config may still carry: what to do instead of a "did you mean"
_NO_SUCH_SETTING = {
    "actor_rollout_ref.rollout.scheduler": "the hf engine has one scheduler (continuous batching); delete the "
    "key (actor_rollout_ref.rollout.max_num_seqs=1 runs one request at a time)",
}


def _format_errors(err: ValidationError, tree: dict) -> str:
    keys = all_keys()
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not isinstance(p, int) or True)
        if e["type"] == "extra_forbidden" and loc in _NO_SUCH_SETTING:
            lines.append(f"unknown key {loc!r}: {_NO_SUCH_SETTING[loc]}")
        elif e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, keys, n=1, cutoff=0.5)
            if not close:  # try matching the last part within the same section
                section = loc.rsplit(".", 1)[0] + "." if "." in loc else ""
                names = [k for k in keys if k.startswith(section)]
                close = difflib.get_close_matches(loc, names, n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"unknown key {loc!r}{hint}")
        elif not loc:  # a whole-config rule (_refuse_unimplemented): its message names the keys
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            value = e.get("input")
            lines.append(f"{loc}={value!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


_REF = re.compile(r"\$\{([\w.]+)\}")


def _with_defaults(tree: Any, defaults: Any) -> Any:
    if not (isinstance(tree, dict) and isinstance(defaults, dict)):
        return tree
    return {**defaults, **{k: _with_defaults(v, defaults.get(k)) for k, v in tree.items()}}


def _interpolate(root: dict) -> dict:
    """Resolve '${a.b}' references (whole dotted keys, like OmegaConf) anywhere in the tree, lists too.

    A value that is nothing but a reference takes the referenced value with its type (verl's YAML writes
    `prompt_length: ${data.max_prompt_length}`); a reference inside text becomes text; a referenced
    value's own references are resolved.
    """

    def lookup(name: str, chain: tuple[str, ...]) -> Any:
        if name in chain:
            raise ConfigError(f"interpolation ${{{name}}} refers to itself: {' -> '.join((*chain, name))}")
        node: Any = root
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"interpolation ${{{name}}} names no key")
            node = node[part]
        return resolve(node, (*chain, name))

    def resolve(value: Any, chain: tuple[str, ...] = ()) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, chain) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, chain) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        if whole := _REF.fullmatch(value):
            return lookup(whole.group(1), chain)
        return _REF.sub(lambda m: str(lookup(m.group(1), chain)), value)

    return resolve(root)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig. Raises ConfigError."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections (data:, trainer:, ...)")
    for item in overrides:
        keys, value = parse_override(item)
        _set(tree, keys, value, f"override {item!r}")
    tree = _interpolate(_with_defaults(tree, RunConfig().model_dump()))  # defaults can be referenced
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, tree)) from None


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config (what actually ran) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return path
