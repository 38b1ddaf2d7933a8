"""Datasets: JSONL and parquet files streamed row by row into `Sample`s.

Two row formats are accepted in the same file:

* simple: ``{"prompt": "2+2=?", "answer": "4"}`` (prompt becomes one user message)
* Harbor task: ``{"task": "path/to/task_dir", ...}`` (relative to the JSONL's folder; the other fields go to
  ``extra_info``); a dataset path that is a folder of task directories also works (verl_agent.tasks)
* verl:   ``{"prompt": [{"role": "user", "content": ...}], "reward_model": {"ground_truth": ...},
  "data_source": ..., "agent_name": ..., "extra_info": {"tools_kwargs": ..., "interaction_kwargs": ...}}``
  (verl's other columns, e.g. ``ability`` and ``reward_model.style``, are not used; ``extra_info`` goes
  to the reward function whole; ``extra_info.need_tools_kwargs`` with empty ``tools_kwargs`` is warned
  about, as verl does)

Files are never loaded whole: JSONL is read line by line and parquet batch by batch, so a file of any size
starts at once. A malformed row raises `DataError` naming the file and line (parquet: row number);
with ``skip_bad_rows`` it is skipped, counted in `StreamingDataset.skipped` and logged.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_agent.protocol import Message, Sample

__all__ = ["DataError", "StreamingDataset", "iter_samples", "load_samples", "row_to_sample"]

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset file or row is malformed; the message names the file and line."""


def _iter_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number starting at 1, parsed row). Streams; never reads the whole file."""
    if not path.is_file():
        raise DataError(f"{path}: dataset file does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    yield lineno, DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})")
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rowno = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                rowno += 1
                yield rowno, row
    else:
        raise DataError(f"{path}: unsupported dataset format {suffix!r} (use .jsonl or .parquet)")


def _messages(prompt: Any, where: str) -> list[Message]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: 'prompt' is empty")
        return [Message(role="user", content=prompt)]
    if isinstance(prompt, (list, tuple)) and prompt:
        try:
            return [Message.from_chat(m, f"{where}: prompt[{i}]") for i, m in enumerate(prompt)]
        except (ValueError, json.JSONDecodeError) as e:
            raise DataError(str(e)) from None
    raise DataError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages, got {prompt!r:.80}")


def _as_dict(value: Any, key: str, where: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):  # parquet writers sometimes store nested dicts as JSON strings
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: '{key}' must be an object, got a non-JSON string") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: '{key}' must be an object, got {type(value).__name__}")
    return value


def row_to_sample(row: Any, where: str, prompt_key: str = "prompt", answer_key: str = "answer") -> Sample:
    """Normalise one row (simple or verl format) into a Sample; `where` is 'file:line' for errors."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise DataError(f"{where}: missing '{prompt_key}' (keys present: {sorted(row)})")
    messages = _messages(row[prompt_key], where)
    extra = _as_dict(row.get("extra_info"), "extra_info", where)
    reward_model = _as_dict(row.get("reward_model"), "reward_model", where)
    if "ground_truth" in reward_model:
        truth = reward_model["ground_truth"]
    elif answer_key in row:
        truth = row[answer_key]
    else:
        truth = row.get("ground_truth")
    tools_kwargs = _as_dict(extra.get("tools_kwargs"), "extra_info.tools_kwargs", where)
    for name, kw in tools_kwargs.items():
        _as_dict(kw, f"extra_info.tools_kwargs.{name}", where)
    if extra.get("need_tools_kwargs") and not tools_kwargs:  # verl's check, a warning there too
        log.warning("%s: extra_info.need_tools_kwargs is true but extra_info.tools_kwargs is empty", where)
    uid = row.get("uid") or extra.get("uid") or where
    return Sample(
        uid=str(uid),
        messages=messages,
        ground_truth=truth,
        data_source=str(row.get("data_source") or "default"),
        agent_name=str(row.get("agent_name") or "tool_agent"),
        tools_kwargs=tools_kwargs,
        interaction_kwargs=_as_dict(extra.get("interaction_kwargs"), "extra_info.interaction_kwargs", where),
        extra_info=extra,
    )


def iter_samples(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    skip_bad_rows: bool = False,
    on_skip: Any = None,
) -> Iterator[Sample]:
    """Stream Samples from one file. Bad rows raise DataError unless skip_bad_rows (then on_skip(err))."""
    path = Path(path)
    if path.is_dir():  # a folder of Harbor tasks (or one task directory): one sample per task
        yield from _task_samples(path)
        return
    for lineno, row in _iter_rows(path):
        where = f"{path}:{lineno}"
        try:
            if isinstance(row, DataError):
                raise row
            if isinstance(row, dict) and "task" in row and prompt_key not in row:
                yield from _task_samples(path.parent, row, where)
            else:
                yield row_to_sample(row, where, prompt_key, answer_key)
        except DataError as e:
            if not skip_bad_rows:
                raise
            log.warning("skipping bad row: %s", e)
            if on_skip is not None:
                on_skip(e)


def _task_samples(path: Path, row: dict | None = None, where: str = "") -> Iterator[Sample]:
    """Harbor task samples (verl_agent.tasks): a task folder, or one JSONL row ``{"task": dir, ...}``."""
    from verl_agent.data.harbor import TaskError, iter_task_samples, row_task_sample

    try:
        yield from ([row_task_sample(row, path, where)] if row is not None else iter_task_samples(path))
    except TaskError as e:
        raise DataError(str(e)) from None


def load_samples(path: str | Path, **kwargs: Any) -> list[Sample]:
    """All samples of a (small) file, e.g. a validation set."""
    return list(iter_samples(path, **kwargs))


@dataclass
class StreamingDataset:
    """Batches of Samples over several files, epoch after epoch, with a resumable position.

    Shuffling uses a bounded buffer (``shuffle_buffer`` samples), so memory stays flat for any file size;
    the order is a pure function of (seed, epoch), which is what makes `state_dict` resumable.
    """

    files: Sequence[str | Path]
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    shuffle: bool = True
    seed: int = 0
    skip_bad_rows: bool = False
    shuffle_buffer: int = 10_000
    epoch: int = 0
    consumed: int = 0  # samples already handed out in the current epoch
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.files:
            raise DataError("no dataset files given (set data.train_files)")

    def _on_skip(self, err: DataError) -> None:
        self.skipped += 1
        if len(self.skip_reasons) < 20:
            self.skip_reasons.append(str(err))

    def _epoch_stream(self, epoch: int) -> Iterator[Sample]:
        rows = (
            s
            for f in self.files
            for s in iter_samples(
                f,
                prompt_key=self.prompt_key,
                answer_key=self.answer_key,
                skip_bad_rows=self.skip_bad_rows,
                on_skip=self._on_skip,
            )
        )
        if not self.shuffle:
            yield from rows
            return
        rng = random.Random(f"{self.seed}:{epoch}")
        buf: list[Sample] = []
        for s in rows:
            buf.append(s)
            if len(buf) >= self.shuffle_buffer:
                yield buf.pop(rng.randrange(len(buf)))
        rng.shuffle(buf)
        yield from buf

    def batches(self, batch_size: int) -> Iterator[list[Sample]]:
        """Endless stream of full batches; an epoch's tail shorter than batch_size rolls into the next.

        A row's uid carries its epoch after the first ("<uid>@epoch2"): one row in two epochs is two
        samples, and a batch that spans the boundary may hold both, which must not share a GRPO group."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pending: list[Sample] = []
        while True:
            produced = 0
            for i, s in enumerate(self._epoch_stream(self.epoch)):
                produced += 1
                if i < self.consumed:
                    continue
                pending.append(replace(s, uid=f"{s.uid}@epoch{self.epoch}") if self.epoch else s)
                self.consumed = i + 1
                if len(pending) == batch_size:
                    yield pending
                    pending = []
            if produced == 0:
                raise DataError(f"dataset {list(map(str, self.files))} has no usable rows (skipped {self.skipped})")
            self.epoch += 1
            self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed, self.seed = state["epoch"], state["consumed"], state["seed"]
