"""The optional experiment trackers behind `trainer.logger`: Weights & Biases and MLflow.

Each gets every step's metrics and that step's trajectory JSONL files (the ones `verl-agent view`
reads): W&B as a table of up to `TABLE_ROWS` trajectories sampled from them, MLflow as artifacts
under ``trajectories/``. Both packages are optional extras, imported only when named.

W&B: project = trainer.project_name, run name = trainer.experiment_name, files under
``<run dir>/wandb``. WANDB_MODE is honoured; when it is unset and no API key is found (WANDB_API_KEY,
or the ~/.netrc entry `wandb login` writes), the run is logged offline instead of prompting, to be
uploaded later with ``wandb sync <run dir>/wandb/offline-run-*``.

MLflow: experiment = trainer.project_name, run name = trainer.experiment_name, tracking URI =
MLFLOW_TRACKING_URI, else the file store ``./mlruns`` under the current directory (MLflow's own
default location). The config goes in as params: flattened dotted keys, values cut to MLflow's limit.

`check_loggers` checks what can be checked without opening a run (the packages, WANDB_MODE, an MLflow file
store's opt-in) before anything starts: `train` calls it before Ray.

A resumed run (same run dir) continues the same W&B / MLflow run: their ids are kept in
``<run dir>/loggers.json``. A tracker that fails while logging a step (a tracking server down) costs a
warning, not the run: metrics.jsonl and the trajectory files hold everything it would have got.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from verl_agent.registry import LOGGERS

__all__ = ["TABLE_ROWS", "ExternalLogger", "LoggerConfigError", "LoggerRun", "MlflowLogger", "WandbLogger",
           "check_loggers", "flatten_params", "open_loggers", "sample_rows"]

logger = logging.getLogger(__name__)

TABLE_ROWS = 16  # trajectories per step in the W&B table: enough to read, small enough to upload every step
_TEXT_CHARS = 4000  # per trajectory in the table (a long one is cut at the end)
_IDS_FILE = "loggers.json"
_MLFLOW_BAD = re.compile(r"[^\w\-. /]")  # MLflow keys: alphanumerics, _ - . space and /


_WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


class LoggerConfigError(ValueError):
    """A tracker named in trainer.logger cannot work as configured; the message says what to set."""


def check_loggers(names: list[str]) -> None:
    """Refuse, before any worker starts, a tracker that would fail when it opens its run; each message names the
    setting to change."""
    import importlib.util

    for name, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")):
        if name in names and importlib.util.find_spec(package) is None:
            extra = "pip install tensorboard" if name == "tensorboard" else f"pip install verl-agent[{name}]"
            raise LoggerConfigError(f"trainer.logger={name} needs the {package} package: {extra}")
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in names and mode and mode not in _WANDB_MODES:
        raise LoggerConfigError(f"trainer.logger=wandb: WANDB_MODE={mode!r} is not a W&B mode; use one of "
                                f"{', '.join(_WANDB_MODES)} (or unset it: offline without an API key)")
    if "mlflow" in names:
        _check_mlflow_store(_mlflow_uri())


def _mlflow_uri() -> str:
    """MLFLOW_TRACKING_URI, else our default: the file store ./mlruns, opted in (MLflow 3 asks for that)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return Path("mlruns").resolve().as_uri()


def _check_mlflow_store(uri: str) -> None:
    """MLflow 3 refuses its file store (a file: URI or a plain path) unless MLFLOW_ALLOW_FILE_STORE is true."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    is_file = scheme in ("", "file") or (len(scheme) == 1 and uri[1:3] in (":\\", ":/"))  # a Windows drive letter
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    if is_file and not allowed:
        raise LoggerConfigError(
            f"trainer.logger=mlflow: MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow 3 refuses "
            "('filesystem tracking backend is in maintenance mode'): set MLFLOW_ALLOW_FILE_STORE=true, or use a "
            "database store, e.g. MLFLOW_TRACKING_URI=sqlite:///mlflow.db (or unset MLFLOW_TRACKING_URI: ./mlruns, "
            "opted in)")


class ExternalLogger(Protocol):
    key: str  # its trainer.logger name
    run_id: str
    where: str  # where to look at the run, for the end-of-run summary

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_trajectories(self, step: int, paths: list[Path]) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggerRun:
    """What a logger registered in `LOGGERS` is built from: ``factory(run) -> ExternalLogger``."""

    run_dir: Path
    project: str  # trainer.project_name
    experiment: str  # trainer.experiment_name
    config: dict[str, Any] | None  # the run config as a dict
    run_id: str | None  # the id it gave this run dir before (a resumed run continues it), else None


def _require(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"trainer.logger={name} needs the {name} package: pip install verl-agent[{name}] "
                          f"({e})") from e


def open_loggers(names: list[str], run_dir: Path, project: str, experiment: str, config: dict[str, Any] | None,
                 resume: bool) -> list[ExternalLogger]:  # fmt: skip
    """The registered loggers `names` asks for (those registered as None are the Tracker's own)."""
    ids_path = run_dir / _IDS_FILE
    ids = json.loads(ids_path.read_text()) if resume and ids_path.exists() else {}
    out: list[ExternalLogger] = []
    for name in names:
        factory = LOGGERS.get(name)
        if factory is not None:
            out.append(factory(LoggerRun(run_dir, project, experiment, config, ids.get(name))))
    if out:
        ids.update({lg.key: lg.run_id for lg in out})
        ids_path.write_text(json.dumps(ids))
    return out


def _has_wandb_key() -> bool:
    """An API key wandb would find without asking: WANDB_API_KEY, an identity token, or ~/.netrc's entry."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return bool(host and netrc.netrc().authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def sample_rows(path: Path, k: int, seed: int) -> list[dict[str, Any]]:
    """Up to k trajectory records of `path`, a uniform sample in file order (a reservoir of lines: only the
    chosen ones are parsed, as a step's file holds every token id of every trajectory)."""
    rng, chosen = random.Random(seed), []
    with path.open(encoding="utf-8") as f:
        for seen, (lineno, line) in enumerate(((n, ln) for n, ln in enumerate(f) if ln.strip()), 1):
            if len(chosen) < k:
                chosen.append((lineno, line))
            elif (j := rng.randrange(seen)) < k:
                chosen[j] = (lineno, line)
    out = []
    for lineno, line in sorted(chosen):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash while writing it
            logger.warning("%s:%d: not a JSON record; left out of the W&B table", path, lineno + 1)
    return out


class WandbLogger:
    """Metrics per step and a `wandb.Table` of sampled trajectories (see the module docstring)."""

    key = "wandb"
    COLUMNS = ["step", "file", "uid", "data_source", "reward", "outcome", "cause", "stop_reason", "turns", "text"]

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict[str, Any] | None,
                 run_id: str | None = None) -> None:  # fmt: skip
        self.wandb = _require("wandb")
        mode = os.environ.get("WANDB_MODE") or (None if _has_wandb_key() else "offline")
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            logger.info("W&B: no API key found; logging offline under %s/wandb (upload later with `wandb sync`)",
                        run_dir)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=project, name=experiment, dir=str(run_dir), config=config, mode=mode,
                                   id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id
        self.where = (f"offline run {self.run_id}; upload: wandb sync {Path(self.run.dir).parent}"
                      if mode == "offline" else str(self.run.url or self.run_id))  # fmt: skip

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_trajectories(self, step: int, paths: list[Path]) -> None:
        from verl_agent.rollout.records import format_record

        tables = {}
        for path in paths:  # training rollouts and validation in tables of their own
            rows = [[step, path.name, rec["uid"], rec.get("data_source"), rec.get("reward"), rec.get("outcome"),
                     rec.get("cause"), rec.get("stop_reason"), len(rec.get("turns", [])),
                     format_record(rec)[:_TEXT_CHARS]]
                    for rec in sample_rows(path, TABLE_ROWS, seed=step)]  # fmt: skip
            if rows:
                key = "val/trajectories" if path.name.startswith("val_") else "trajectories"
                tables[key] = self.wandb.Table(columns=self.COLUMNS, data=rows)
        if tables:
            self.run.log(tables, step=step)

    def close(self) -> None:
        self.run.finish()


def flatten_params(config: dict[str, Any], max_value: int) -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"}; lists as JSON; each value cut to `max_value` characters."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
            return
        text = node if isinstance(node, str) else json.dumps(node, default=str)
        out[_MLFLOW_BAD.sub("_", prefix)] = text[:max_value]

    if config:
        walk(config, "")
    return out


class MlflowLogger:
    """Metrics per step, the config as params, trajectory JSONL files as artifacts (see the module docstring)."""

    key = "mlflow"

    def __init__(self, project: str, experiment: str, config: dict[str, Any] | None,
                 run_id: str | None = None) -> None:  # fmt: skip
        _require("mlflow")
        from mlflow.tracking import MlflowClient

        uri = _mlflow_uri()
        self.client, self.uri = MlflowClient(tracking_uri=uri), uri
        if run_id is not None and (missing := self._missing(run_id)):
            logger.warning("MLflow: run %s (from loggers.json) is not in %s (%s); starting a new run", run_id, uri,
                           missing)
            run_id = None
        fresh = run_id is None
        if fresh:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
        self.run_id: str = run_id
        self.where = f"run {run_id} at {uri}"
        if fresh:
            self._log_params(config or {})
        logger.info("MLflow: run %s in experiment %r at %s", run_id, project, uri)

    def _missing(self, run_id: str) -> str | None:
        """Why run `run_id` cannot be continued, or None (the file store raises a bare Exception for a lost root)."""
        try:
            self.client.get_run(run_id)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _log_params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        except ImportError:  # the limits of older releases
            MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH = 500, 100
        params = [Param(k, v) for k, v in flatten_params(config, MAX_PARAM_VAL_LENGTH).items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_BAD.sub("_", k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's per-batch metric limit
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_trajectories(self, step: int, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), artifact_path="trajectories")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@LOGGERS.register("wandb")
def wandb_logger(run: LoggerRun) -> ExternalLogger:
    return WandbLogger(run.run_dir, run.project, run.experiment, run.config, run_id=run.run_id)


@LOGGERS.register("mlflow")
def mlflow_logger(run: LoggerRun) -> ExternalLogger:
    return MlflowLogger(run.project, run.experiment, run.config, run_id=run.run_id)
