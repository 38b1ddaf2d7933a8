"""docs/extending.md is run as written: files are created from titled blocks, untitled Python blocks executed."""

import json
import os
import re
import sys
from pathlib import Path

from verl_agent.interactions import check_interaction
from verl_agent.registry import REGISTRIES

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
BLOCK = re.compile(r"```(\w+)(?: title=\"([^\"]+)\")?\n(.*?)```", re.S)


def test_every_snippet_runs(tmp_path, monkeypatch):
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 12
    monkeypatch.chdir(tmp_path)
    # The MCP example starts `python weather_server.py`: the Python running the tests, with the mcp SDK.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    namespaces = []
    before = {reg: set(reg.names()) for reg in REGISTRIES}
    try:
        _run(blocks, tmp_path, namespaces)
    finally:  # the snippets' registrations (estimators, engines, loggers) must not leak into other tests
        for reg, names in before.items():
            for name in set(reg.names()) - names:
                reg.unregister(name)
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["extra_info"]["interaction_kwargs"]["name"] == "word_game"
    shout = next(ns["ShoutInteraction"] for ns in namespaces if "ShoutInteraction" in ns)
    out = check_interaction(shout({"name": "shout"}), ["hello", "HELLO"], deterministic=True)
    assert out["score"] == 1.0 and len(out["transcript"]) == 2
    for name in [m for m in sys.modules if m.startswith("_verl_agent_user_")]:
        del sys.modules[name]


def _run(blocks: list[tuple[str, str, str]], tmp_path: Path, namespaces: list[dict]) -> None:
    """Titled blocks become files, untitled Python blocks run in order."""
    for lang, title, code in blocks:
        if title:
            (tmp_path / title).write_text(code)
            if lang == "json":
                json.loads(code)
        elif lang == "python":
            ns: dict = {"__name__": "doc_snippet"}
            exec(compile(code, f"{DOC}:snippet", "exec"), ns)  # noqa: S102 - our own documentation
            namespaces.append(ns)
