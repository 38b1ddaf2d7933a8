"""`verl-agent view RUN --html report.html`: the same page as one self-contained file.

The page's style and scripts are inlined and the data is embedded as JSON (window.VIEWER_DATA);
static/api.js then answers the page's questions from it instead of the server. Only the first
`max_records` trajectories of each file are embedded (with their tokens), so a report of a large
run stays a shareable size; the page says how many of each file it holds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from verl_agent.viewer.jsonl import RecordError
from verl_agent.viewer.query import summary
from verl_agent.viewer.run import Run, finite
from verl_agent.viewer.server import STATIC_DIR

__all__ = ["build_report", "write_report"]

_SCRIPT = re.compile(r'<script src="static/([\w.]+)"></script>')
_STYLE = re.compile(r'<link rel="stylesheet" href="static/([\w.]+)">')


def _inline_json(obj: Any) -> str:
    # "</" would end the <script> element early; "<!--" could open an HTML comment.
    return json.dumps(obj, ensure_ascii=False).replace("</", "<\\/").replace("<!--", "<\\!--")


def report_data(run: Run, max_records: int = 200) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for f in run.files():
        idx = run.index(f["id"])
        rows, records = [], {}
        for i in range(min(len(idx), max_records)):
            row = summary(idx, i)
            row["text"] = idx.details(i).get("text", "")
            rows.append(row)
            try:
                records[i] = run.record(f["id"], i)
            except RecordError as e:
                records[i] = {"_error": str(e)}
        files[f["id"]] = {"total": len(idx), "rows": rows, "records": records,
                          "errors": [{"line": e.lineno, "error": e.error} for e in idx.all_errors[:200]]}  # fmt: skip
    info = {"name": run.name, "run_dir": str(run.run_dir), "files": run.files(), "static": True}
    return finite({"run": info, "metrics": run.metrics(), "files": files})


def build_report(run: Run, max_records: int = 200) -> str:
    """The page as one HTML string with everything inlined."""
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    data = f"<script>window.VIEWER_DATA = {_inline_json(report_data(run, max_records))};</script>\n"
    page = _STYLE.sub(lambda m: f"<style>\n{(STATIC_DIR / m.group(1)).read_text(encoding='utf-8')}</style>", page)
    first = True

    def script(m: re.Match[str]) -> str:
        nonlocal first
        code = (STATIC_DIR / m.group(1)).read_text(encoding="utf-8").replace("</script", "<\\/script")
        out = (data if first else "") + f"<script>\n{code}</script>"
        first = False
        return out

    return _SCRIPT.sub(script, page)


def write_report(path: str | Path, out: str | Path, max_records: int = 200) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_report(Run(path), max_records), encoding="utf-8")
    return out
