"""The viewer's HTTP face: one static page plus a small JSON API over a `Run`.

    GET /                     the page (static/index.html)
    GET /static/{file}        its script and style
    GET /api/run              run name, trajectory files, whether a tokenizer decodes tokens
    GET /api/metrics          metrics.jsonl rows (the page polls it to follow a training run)
    GET /api/records          one page of a file's trajectories: ?file=&offset=&limit= and filters
    GET /api/tools            tool names used in a file (reads every record's messages once)
    GET /api/record           one whole record: ?file=&index=
    GET /api/find             entries of a file with a given prompt uid: ?file=&uid=

Errors are JSON {"detail": "..."} with 404 (unknown file or index) or 422 (unreadable record).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from verl_agent.viewer.jsonl import RecordError
from verl_agent.viewer.query import Filter
from verl_agent.viewer.run import Run, RunError

__all__ = ["STATIC_DIR", "create_app", "serve"]

STATIC_DIR = Path(__file__).parent / "static"
log = logging.getLogger(__name__)


def create_app(run: Run) -> FastAPI:
    app = FastAPI(title=f"verl-agent view: {run.name}", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    lock = threading.Lock()  # handlers run in a thread pool; a Run's indexes are not thread-safe

    def guarded(fn, *args: Any) -> Any:
        try:
            with lock:
                return fn(*args)
        except RunError as e:
            raise HTTPException(404, str(e)) from None
        except RecordError as e:
            raise HTTPException(422, str(e)) from None

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/run")
    def run_info() -> dict[str, Any]:
        files = guarded(run.files)
        return {"name": run.name, "run_dir": str(run.run_dir), "files": files, "static": False}

    @app.get("/api/metrics")
    def metrics() -> dict[str, Any]:
        return guarded(run.metrics)

    @app.get("/api/records")
    def records(file: str, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500),
                status: str | None = None, cause: str | None = None, min_reward: float | None = None,
                max_reward: float | None = None, tool: str | None = None, text: str | None = None) -> dict[str, Any]:  # fmt: skip
        flt = Filter(status=status or None, cause=cause or None, min_reward=min_reward, max_reward=max_reward,
                     tool=tool or None, text=text or None)  # fmt: skip
        return guarded(run.query, file, flt, offset, limit)

    @app.get("/api/tools")
    def tools(file: str) -> dict[str, int]:
        return guarded(run.tools, file)

    @app.get("/api/record")
    def record(file: str, index: int) -> dict[str, Any]:
        return guarded(run.record, file, index)

    @app.get("/api/find")
    def find(file: str, uid: str) -> list[int]:
        return guarded(run.find_uid, file, uid)

    return app


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8265) -> None:
    """Serve the viewer for `path` until interrupted."""
    import uvicorn

    run = Run(path)
    print(f"verl-agent view: serving {run.run_dir} at http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    uvicorn.run(create_app(run), host=host, port=port, log_level="warning")
