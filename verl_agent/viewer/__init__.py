"""A browser viewer for a run: learning curves, step browser, trajectories with their tokens.

    verl-agent view RUN_DIR --serve [--port 8265]     a live page (FastAPI + uvicorn)
    verl-agent view RUN_DIR --html report.html        the same page as one self-contained file

Modules: jsonl (byte-offset index of a trajectory file, lazy parsing), query (filters), tokens
(per-token text), run (a run directory), server (HTTP API + static page), export (HTML report).
Nothing here imports the trainer; reading a run never writes to it.
"""

from verl_agent.viewer.export import build_report, write_report
from verl_agent.viewer.run import Run, RunError
from verl_agent.viewer.server import create_app, serve

__all__ = ["Run", "RunError", "build_report", "create_app", "serve", "write_report"]
