"""Harbor tasks as data: one task directory is one sample.

A task directory in Harbor's layout (what ``harbor tasks init`` writes)::

    my-task/
      instruction.md          the prompt
      task.toml               timeouts, resources, verifier env/user
      environment/Dockerfile  the agent's world (environment/ is the build context)
      tests/test.sh           the verifier: writes /logs/verifier/reward.txt or reward.json
      solution/solve.sh       the oracle (optional)

``task.toml`` is read with ``tomllib`` against Harbor's documented schema: the ``harbor`` package
itself needs Python >= 3.12 and does not install on this project's Python, so its task model is not
used. Keys read (everything else, e.g. ``[metadata]``, is kept in ``TaskConfig.metadata``/ignored)::

    version = "1.0"
    [metadata]    free-form (author, difficulty, category, tags)
    [verifier]    timeout_sec (600), env (table of strings), user (the verifier's user; default root)
    [agent]       timeout_sec (600), user (the agent's user; default: the image's USER)
    [environment] build_timeout_sec (600), docker_image (a prebuilt local image instead of the Dockerfile),
                  cpus (1), memory_mb (2048) or memory ("2G"), storage_mb (10240) or storage ("10G"),
                  allow_internet (false), gpus (0: tasks that want GPUs are refused)

A task whose ``allow_internet`` is true is refused unless the caller allows internet explicitly
(``allow_internet=True``, config key ``tasks.allow_internet``); the default is no network at all.
Terminal-Bench's older ``task.yaml`` layout is refused with an error that says how to convert it.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HarborTask", "TaskConfig", "TaskError", "find_tasks", "load_task", "task_sample", "iter_task_samples"]

TASK_FILE = "task.toml"
INSTRUCTION_FILE = "instruction.md"


class TaskError(ValueError):
    """A task directory is malformed or refused; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TaskConfig:
    """The parts of task.toml that change how a task runs."""

    agent_timeout_sec: float = 600.0
    agent_user: str | None = None
    verifier_timeout_sec: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    verifier_user: str | None = None
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    allow_internet: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HarborTask:
    """One loaded task directory."""

    path: Path
    name: str
    instruction: str
    config: TaskConfig

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def _megabytes(value: Any, where: str) -> int:
    """"2G", "512M", "1024" (MB) or a number of MB -> MB."""
    if isinstance(value, bool):
        raise TaskError(f"{where}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise TaskError(f"{where}: cannot read size {value!r} (use e.g. 2048, '512M' or '2G')")
    scale = {"": 1, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}[m.group(2).lower()]
    return max(1, int(float(m.group(1)) * scale))


def _number(table: dict, key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskError(f"{where}: [{key}] must be a positive number, got {value!r}")
    return float(value)


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise TaskError(f"{where}: [{key}] must be a table, got {type(value).__name__}")
    return value


def parse_config(data: dict, where: str) -> TaskConfig:
    """TaskConfig from a parsed task.toml; `where` names the file in errors."""
    verifier, agent = _table(data, "verifier", where), _table(data, "agent", where)
    env = _table(data, "environment", where)
    venv = verifier.get("env", {})
    if not isinstance(venv, dict) or not all(isinstance(v, (str, int, float)) for v in venv.values()):
        raise TaskError(f"{where}: [verifier] env must be a table of strings")
    if env.get("gpus", 0):
        raise TaskError(f"{where}: [environment] gpus = {env['gpus']!r}: tasks that need GPUs are not supported")
    internet = env.get("allow_internet", False)
    if not isinstance(internet, bool):
        raise TaskError(f"{where}: [environment] allow_internet must be true or false, got {internet!r}")
    memory = env.get("memory_mb", env.get("memory", 2048))
    storage = env.get("storage_mb", env.get("storage", 10240))
    for key, table in (("user", verifier), ("user", agent), ("docker_image", env)):
        if table.get(key) is not None and not isinstance(table.get(key), str):
            raise TaskError(f"{where}: {key} must be a string, got {table[key]!r}")
    return TaskConfig(
        agent_timeout_sec=_number(agent, "timeout_sec", 600.0, f"{where}: [agent]"),
        agent_user=agent.get("user"),
        verifier_timeout_sec=_number(verifier, "timeout_sec", 600.0, f"{where}: [verifier]"),
        verifier_env={str(k): str(v) for k, v in venv.items()},
        verifier_user=verifier.get("user"),
        build_timeout_sec=_number(env, "build_timeout_sec", 600.0, f"{where}: [environment]"),
        docker_image=env.get("docker_image") or None,
        cpus=_number(env, "cpus", 1.0, f"{where}: [environment]"),
        memory_mb=_megabytes(memory, f"{where}: [environment] memory_mb"),
        storage_mb=_megabytes(storage, f"{where}: [environment] storage_mb"),
        allow_internet=internet,
        metadata=dict(_table(data, "metadata", where)),
    )


def load_task(path: str | Path, *, allow_internet: bool | None = False) -> HarborTask:
    """Load and check one task directory; raises TaskError naming the file and the problem.

    ``allow_internet=None`` reads a task that asks for internet without refusing it: the dataset loader
    does that, and the container pool refuses it at start unless its config allows internet."""
    root = Path(path).resolve()
    if not root.is_dir():
        raise TaskError(f"{root}: not a task directory")
    toml_path = root / TASK_FILE
    if not toml_path.is_file():
        if (root / "task.yaml").is_file():
            raise TaskError(
                f"{root / 'task.yaml'}: Terminal-Bench's task.yaml layout is not read; convert the task to "
                "Harbor's layout (instruction.md, task.toml, environment/Dockerfile, tests/test.sh, "
                "solution/solve.sh), e.g. with Harbor's Terminal-Bench adapter (`harbor adapters`)")
        raise TaskError(f"{toml_path}: missing (a Harbor task directory holds task.toml and instruction.md)")
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"{toml_path}: invalid TOML: {e}") from None
    config = parse_config(data, str(toml_path))
    if config.allow_internet and allow_internet is False:
        raise TaskError(f"{toml_path}: the task asks for internet access (allow_internet = true); it is refused "
                        "unless you allow it explicitly (tasks.allow_internet=true / --allow-internet)")
    instruction_path = root / INSTRUCTION_FILE
    if not instruction_path.is_file():
        raise TaskError(f"{instruction_path}: missing (the task's prompt)")
    instruction = instruction_path.read_text(encoding="utf-8").strip()
    if not instruction:
        raise TaskError(f"{instruction_path}: empty")
    if config.docker_image is None and not (root / "environment" / "Dockerfile").is_file():
        raise TaskError(f"{root / 'environment' / 'Dockerfile'}: missing (or set [environment] docker_image)")
    if not (root / "tests" / "test.sh").is_file():
        raise TaskError(f"{root / 'tests' / 'test.sh'}: missing (the verifier)")
    return HarborTask(path=root, name=root.name, instruction=instruction, config=config)


def is_task_dir(path: Path) -> bool:
    return (path / TASK_FILE).is_file() or (path / "task.yaml").is_file()


def find_tasks(path: str | Path) -> list[Path]:
    """The task directories of `path`: itself when it is one, else its sub-directories that are, sorted."""
    root = Path(path)
    if is_task_dir(root):
        return [root]
    if not root.is_dir():
        raise TaskError(f"{root}: not a directory")
    found = sorted(p for p in root.iterdir() if p.is_dir() and is_task_dir(p))
    if not found:
        raise TaskError(f"{root}: no task directories (sub-directories with task.toml)")
    return found


def task_sample(task: HarborTask, extra: dict[str, Any] | None = None, uid: str | None = None) -> Any:
    """A Sample for the agent loop: the instruction as the user message; the container tools and
    TaskInteraction find the task through ``task_dir`` in their kwargs."""
    from verl_agent.protocol import Message, Sample

    extra = dict(extra or {})
    kwargs = {"create_kwargs": {"task_dir": str(task.path)}}
    tools_kwargs = {name: kwargs for name in ("bash", "str_replace_editor", "submit")}
    tools_kwargs.update(extra.pop("tools_kwargs", {}) or {})
    prompt = extra.pop("prompt", None)
    messages = [Message(role="user", content=task.instruction)]
    if isinstance(prompt, str) and prompt:  # a system prompt given by the dataset row
        messages.insert(0, Message(role="system", content=prompt))
    return Sample(
        uid=uid or task.name, messages=messages, ground_truth=None,
        data_source=str(extra.pop("data_source", "harbor")), agent_name=str(extra.pop("agent_name", "tool_agent")),
        tools_kwargs=tools_kwargs,
        interaction_kwargs={"task_dir": str(task.path), **(extra.pop("interaction_kwargs", {}) or {})},
        extra_info={"task_dir": str(task.path), "task_name": task.name, **extra},
    )


def iter_task_samples(path: Path) -> Iterator[Any]:
    """Samples of a folder of task directories (or of one task directory), in name order."""
    for d in find_tasks(path):
        yield task_sample(load_task(d, allow_internet=None))


def row_task_sample(row: dict[str, Any], base: Path, where: str) -> Any:
    """One JSONL row ``{"task": "dir", ...}`` -> Sample: a relative dir is taken from `base` (the JSONL's
    folder); the row's other fields go to ``extra_info`` (a string ``prompt`` becomes a system message)."""
    rel = row.get("task")
    if not isinstance(rel, str) or not rel:
        raise TaskError(f"{where}: 'task' must be a task directory path")
    d = Path(rel) if Path(rel).is_absolute() else base / rel
    extra = {k: v for k, v in row.items() if k not in ("task", "uid")}
    try:
        task = load_task(d, allow_internet=None)
    except TaskError as e:
        raise TaskError(f"{where}: {e}") from None
    return task_sample(task, copy.deepcopy(extra), uid=row.get("uid"))
