"""A run directory as the viewer sees it: metrics, trajectory files, records with decoded tokens.

    <run dir>/metrics.jsonl                 one object per step (the trainer's Tracking)
    <run dir>/trajectories/step_N.jsonl     training rollouts of step N (trainer.log_trajectories)
    <run dir>/trajectories/val_step_N.jsonl validation rollouts
    <run dir>/rollout.jsonl                 `verl-agent rollout`

A path to one .jsonl file views that file alone (its folder still supplies config and metrics).
Everything is re-read when it changed on disk, so a page follows a run while it trains.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from verl_agent.protocol import SCORED_OUTCOMES
from verl_agent.viewer.jsonl import JsonlIndex, RecordError
from verl_agent.viewer.query import Filter, facets, select, summary
from verl_agent.viewer.tokens import TokenDecoder

__all__ = ["Run", "RunError"]

INDEX_BUDGET_S = 0.5  # a page query indexes at most this long; the page asks again for the rest
_STEP = re.compile(r"^(val_)?step_(\d+)\.jsonl$")


class RunError(ValueError):
    """The path is not something the viewer can show, or a file/record id is unknown."""


class Run:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise RunError(f"{path}: no such file or directory (a run writes <run dir>/trajectories/step_N.jsonl)")
        self.single = path if path.is_file() else None
        self.run_dir = path.parent if path.is_file() else path
        if self.single is None and self.run_dir.name == "trajectories":
            self.run_dir = self.run_dir.parent
        self.name = self.single.name if self.single else self.run_dir.name
        self.decoder = TokenDecoder(self.run_dir)
        self._indexes: dict[str, JsonlIndex] = {}
        self._metrics_key: tuple[int, int, int] | None = None
        self._metrics: dict[str, Any] = {"rows": [], "keys": [], "errors": []}

    # ---- files --------------------------------------------------------------------------
    def _paths(self) -> dict[str, Path]:
        if self.single is not None:
            return {self.single.stem: self.single}
        out = {p.stem: p for p in sorted((self.run_dir / "trajectories").glob("*.jsonl"))}
        for p in sorted(self.run_dir.glob("*.jsonl")):
            if p.name != "metrics.jsonl":
                out.setdefault(p.stem, p)
        return out

    def index(self, file_id: str, budget_s: float | None = None) -> JsonlIndex:
        paths = self._paths()
        if file_id not in paths:
            raise RunError(f"no trajectory file {file_id!r} in {self.run_dir} (have: {', '.join(paths) or 'none'})")
        if file_id not in self._indexes or self._indexes[file_id].path != paths[file_id]:
            self._indexes[file_id] = JsonlIndex(paths[file_id])
        return self._indexes[file_id].refresh(budget_s)

    def files(self) -> list[dict[str, Any]]:
        """Trajectory files, training steps first in step order, then validation, then others.

        Files not opened yet are listed without being read ("records": None): a long run has
        hundreds of them, and the page opens one at a time.
        """
        out = []
        for fid, path in self._paths().items():
            m = _STEP.match(path.name)
            kind = ("val" if m.group(1) else "train") if m else "other"
            idx = self.index(fid) if fid in self._indexes else None  # unopened files are not read here
            out.append({"id": fid, "kind": kind, "step": int(m.group(2)) if m else None, "bytes": path.stat().st_size,
                        "records": len(idx) if idx else None, "errors": len(idx.all_errors) if idx else None})
        order = {"train": 0, "val": 1, "other": 2}
        return sorted(out, key=lambda f: (order[f["kind"]], f["step"] or 0, f["id"]))

    # ---- metrics ------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """{"rows": [{step, metric: value}], "keys": [...], "errors": [{line, error}], "steps": n} of
        metrics.jsonl; `steps` counts the training steps (not the validation-only row of step 0, nor a step's
        second row for validation after training)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return {"rows": [], "keys": [], "errors": [], "steps": 0}
        st = path.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._metrics_key:
            self._metrics = _read_metrics(path)
            self._metrics_key = key
        return self._metrics

    # ---- trajectories -------------------------------------------------------------------
    def query(self, file_id: str, flt: Filter, offset: int = 0, limit: int = 50) -> dict[str, Any]:
        idx = self.index(file_id, budget_s=INDEX_BUDGET_S)
        hits = select(idx, flt)
        page = hits[offset : offset + limit]
        return finite({"file": file_id, "total": len(idx), "matched": len(hits), "offset": offset,
                       "complete": idx.complete, "indexed_bytes": idx.indexed_bytes, "bytes": idx.size,
                       "items": [summary(idx, i) for i in page], "facets": facets(idx),
                       "errors": [{"line": e.lineno, "error": e.error} for e in idx.all_errors[:200]]})  # fmt: skip

    def tools(self, file_id: str) -> dict[str, int]:
        return facets(self.index(file_id), with_tools=True)["tools"]

    def record(self, file_id: str, i: int) -> dict[str, Any]:
        """The full record of entry i, plus per-token text ("prompt_tokens"/"response_tokens", or None) and
        "in_loss": whether the trainer used it (an infrastructure failure or a filtered prompt has mask-1
        tokens, but never reaches the loss)."""
        idx = self.index(file_id)
        if not 0 <= i < len(idx):
            raise RunError(f"{file_id}: no record {i} (the file has {len(idx)})")
        try:
            rec = idx.record(i)
        except RecordError as e:
            raise RecordError(f"{idx.path.name}: {e}") from None
        rec["_index"], rec["_line"], rec["_file"] = i, idx.entries[i].lineno, file_id
        rec["prompt_tokens"] = self.decoder.decode(rec.get("prompt_ids") or [])
        rec["response_tokens"] = self.decoder.decode(rec.get("response_ids") or [])
        rec["in_loss"] = rec.get("outcome", "ok") in SCORED_OUTCOMES and bool(rec.get("response_ids"))
        return finite(rec)

    def find_uid(self, file_id: str, uid: str) -> list[int]:
        """Entries of `file_id` for prompt `uid` (a GRPO group), for comparing steps."""
        return select(self.index(file_id), Filter(uid=uid))


def finite(obj: Any) -> Any:
    """NaN/inf (which Python's json reads and writes, but browsers' JSON.parse rejects) become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def _read_metrics(path: Path) -> dict[str, Any]:
    rows, errors, keys = [], [], {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append({"line": lineno, "error": f"metrics.jsonl line {lineno}: not JSON: {e}"})
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
                errors.append({"line": lineno, "error": f"metrics.jsonl line {lineno}: no numeric 'step'"})
                continue
            rows.append({k: v for k, v in row.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
            keys.update(dict.fromkeys(k for k in rows[-1] if k != "step"))
    steps = {r["step"] for r in rows if any(k != "step" and not k.startswith("val/") for k in r)}
    return {"rows": rows, "keys": sorted(keys), "errors": errors, "steps": len(steps)}
