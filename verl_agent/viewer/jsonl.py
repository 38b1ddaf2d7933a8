"""Lazy, paged access to a trajectory JSONL file through byte offsets.

A run's `trajectories/step_N.jsonl` can hold thousands of records of thousands of tokens each
(gigabytes). Opening one must not parse it: `JsonlIndex.refresh()` only finds the
line boundaries (memchr over an mmap) and reads each record's *head* -- the scalar keys that
`records.trajectory_record` writes before "messages" (uid, step, reward, stop_reason, outcome,
cause, error), a few hundred bytes. Messages and turns ("details") are parsed when a page is
shown or a tool/text filter asks for them; token arrays only when one record is opened.

The file may grow while the trainer writes (`refresh()` indexes only the new bytes). A line that
is not JSON, or a last line without its newline, becomes a `LineError` that the page shows.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Entry", "JsonlIndex", "LineError", "RecordError"]

_MESSAGES_KEY = b', "messages": '
_HEAVY_KEYS = (b', "prompt_text": ', b', "prompt_ids": ')
_HEAD_SCAN = 64 * 1024  # the scalar keys sit in the first bytes; a record laid out differently is parsed whole


class RecordError(ValueError):
    """A line of the file is not a trajectory record (its message names file and line)."""


@dataclass
class LineError:
    lineno: int  # 1-based
    error: str


@dataclass
class Entry:
    """One indexed line: where it is, and the record's scalar head (or why it has none)."""

    lineno: int
    offset: int
    length: int  # bytes, without the newline
    head: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    details: dict[str, Any] | None = None  # tools, turns, snippet, search text: filled on demand


class JsonlIndex:
    """Line offsets and record heads of one JSONL file; `refresh()` picks up appended lines."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries: list[Entry] = []  # one per non-blank complete line
        self.errors: list[LineError] = []
        self._end = 0  # bytes indexed (always just after a newline)
        self._lineno = 0
        self._ino: int | None = None
        self._tail_error: LineError | None = None
        self.size = 0  # file size at the last refresh

    # ---- indexing -------------------------------------------------------------------------
    def refresh(self, budget_s: float | None = None) -> JsonlIndex:
        """Index lines appended since the last call (re-index if the file was replaced or cut).

        With `budget_s`, stop after about that long and leave the rest for the next call
        (`complete` tells): a large cold file is slow to read, and the first page must not wait.
        """
        st = self.path.stat()
        if st.st_ino != self._ino or st.st_size < self._end:
            self.__init__(self.path)
            self._ino = st.st_ino
        self.size = st.st_size
        self._tail_error = None
        if st.st_size == self._end or st.st_size == 0:
            return self
        deadline = None if budget_s is None else time.monotonic() + budget_s
        with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos, size = self._end, len(mm)
            while pos < size:
                if deadline is not None and self._lineno % 64 == 0 and time.monotonic() > deadline:
                    break
                nl = mm.find(b"\n", pos)
                if nl < 0:  # no newline yet: a writer may be mid-line, or the file was cut short
                    self._tail_error = LineError(
                        self._lineno + 1, f"line {self._lineno + 1}: truncated line (no newline at the end of the file)")
                    break
                self._lineno += 1
                if nl > pos and mm[pos:nl].strip():
                    self._add(mm, pos, nl - pos)
                pos = nl + 1
                self._end = pos
        return self

    def _add(self, mm: mmap.mmap, offset: int, length: int) -> None:
        entry = Entry(self._lineno, offset, length)
        head_bytes = mm[offset : offset + min(length, _HEAD_SCAN)]
        tail = mm[max(offset, offset + length - 16) : offset + length]
        try:
            entry.head = _parse_head(head_bytes, tail, lambda: mm[offset : offset + length], self._lineno)
        except RecordError as e:
            entry.error = str(e)
            self.errors.append(LineError(self._lineno, entry.error))
        self.entries.append(entry)

    @property
    def indexed_bytes(self) -> int:
        return self._end

    @property
    def complete(self) -> bool:
        """Has every complete line been indexed? (A trailing line without newline never is.)"""
        return self._end == self.size or self._tail_error is not None

    @property
    def all_errors(self) -> list[LineError]:
        return self.errors + ([self._tail_error] if self._tail_error else [])

    def __len__(self) -> int:
        return len(self.entries)

    # ---- reading --------------------------------------------------------------------------
    def raw(self, i: int) -> bytes:
        e = self.entries[i]
        with self.path.open("rb") as f:
            return os.pread(f.fileno(), e.length, e.offset)

    def record(self, i: int) -> dict[str, Any]:
        """The whole record of entry `i`; RecordError (file:line) if it is not valid."""
        e = self.entries[i]
        return _loads_record(self.raw(i), e.lineno)

    def details(self, i: int) -> dict[str, Any]:
        """Messages-level facts of entry `i` (cached): tools used, turns, first prompt, searchable text (contents,
        reasoning, tool calls)."""
        e = self.entries[i]
        if e.details is None:
            e.details = _details(self.raw(i), e.lineno) if e.error is None else {}
        return e.details


def _loads_record(raw: bytes, lineno: int) -> dict[str, Any]:
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RecordError(f"line {lineno}: not a JSON record: {err}") from None
    if not isinstance(rec, dict) or "uid" not in rec or "messages" not in rec:
        raise RecordError(f"line {lineno}: not a trajectory record (needs 'uid' and 'messages')")
    return rec


def _parse_head(head: bytes, tail: bytes, whole: Callable[[], bytes], lineno: int) -> dict[str, Any]:
    """The keys before "messages", parsed from a few hundred bytes; the whole line as a fallback."""
    if not tail.rstrip().endswith(b"}"):
        raise RecordError(f"line {lineno}: truncated record (the line does not end with '}}')")
    cut = head.find(_MESSAGES_KEY)
    if cut > 0:
        try:
            obj = json.loads(head[:cut] + b"}")
            if isinstance(obj, dict) and "uid" in obj:
                return obj
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # not the layout trajectory_record writes: parse the whole line below
    rec = _loads_record(whole(), lineno)
    return {k: v for k, v in rec.items() if k not in ("messages", "turns", "metrics") and not _heavy(k)}


def _heavy(key: str) -> bool:
    return key.startswith(("prompt_", "response_")) or key in ("loss_mask", "rollout_logprobs")


def _details(raw: bytes, lineno: int) -> dict[str, Any]:
    """Parse up to the token arrays (messages, turns, metrics) and keep what lists and filters need."""
    cut = min((p for p in (raw.find(k) for k in _HEAVY_KEYS) if p > 0), default=-1)
    try:
        rec = json.loads(raw[:cut] + b"}") if cut > 0 else json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return {"error": f"line {lineno}: not a JSON record: {err}", "tools": [], "text": ""}
    msgs = rec.get("messages") or []
    tools = sorted({(c.get("function") or {}).get("name", "?") for m in msgs for c in (m.get("tool_calls") or [])})
    first_user = next((m.get("content") or "" for m in msgs if m.get("role") == "user"), "")
    text = "\n".join(
        [m.get("content") or "" for m in msgs]
        + [m["reasoning_content"] for m in msgs if isinstance(m.get("reasoning_content"), str)]
        + [json.dumps(c.get("function"), ensure_ascii=False) for m in msgs for c in (m.get("tool_calls") or [])]
        + [rec.get("error") or "", str(rec.get("uid", ""))]
    )
    return {"tools": tools, "num_turns": len(rec.get("turns") or []), "num_messages": len(msgs),
            "prompt": first_user[:200], "text": text.lower()}  # fmt: skip
