"""The viewer's HTTP API (FastAPI TestClient) and the `verl-agent view` command line."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from verl_agent.cli import main
from verl_agent.viewer import Run, create_app


def test_api_pages_filters_and_errors(broken_run):
    client = TestClient(create_app(Run(broken_run)))
    assert "verl-agent view" in client.get("/").text
    assert client.get("/static/app.js").status_code == 200
    info = client.get("/api/run").json()
    assert [f["id"] for f in info["files"]] == ["step_1", "step_2", "val_step_2"]
    m = client.get("/api/metrics").json()
    assert len(m["rows"]) == 3 and m["errors"][0]["line"] == 4
    res = client.get("/api/records", params={"file": "step_1", "status": "ok"}).json()
    assert res["matched"] == 1 and res["items"][0]["tools"] == ["calculator"]
    assert [e["line"] for e in res["errors"]] == [2, 4, 7]
    assert client.get("/api/records", params={"file": "step_1", "status": "error"}).json()["matched"] == 2
    rec = client.get("/api/record", params={"file": "step_1", "index": 0}).json()
    assert rec["uid"] == "calc:1" and len(rec["response_tokens"]) == len(rec["response_ids"])
    bad = client.get("/api/record", params={"file": "step_1", "index": 1})
    assert bad.status_code == 422 and "line 2" in bad.json()["detail"]
    missing = client.get("/api/record", params={"file": "step_7", "index": 0})
    assert missing.status_code == 404 and "step_7" in missing.json()["detail"]
    assert client.get("/api/find", params={"file": "step_2", "uid": "calc:1"}).json() == [0, 1]
    assert client.get("/api/tools", params={"file": "step_1"}).json() == {"calculator": 1, "python": 1}


def test_view_text_mode_still_prints_records(run_dir, capsys):
    assert main(["view", str(run_dir / "trajectories" / "step_1.jsonl"), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("== calc:1") == 2 and "[call calculator(" in out


def test_view_errors_are_one_line_and_exit_2(tmp_path, capsys):
    for argv in (["view", str(tmp_path / "nope.jsonl")], ["view", str(tmp_path / "nope"), "--serve"],
                 ["view", str(tmp_path / "nope"), "--html", str(tmp_path / "r.html")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("verl-agent view: error:") and err.count("\n") == 1, err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["view", str(bad)]) == 2


def test_view_html_writes_a_self_contained_report(run_dir, tmp_path, capsys):
    out = tmp_path / "share" / "report.html"
    assert main(["view", str(run_dir), "--html", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    html = out.read_text()
    start = html.index("window.VIEWER_DATA = ") + len("window.VIEWER_DATA = ")
    data = json.loads(html[start : html.index(";</script>", start)].replace("<\\/", "</"))
    assert set(data["files"]) == {"step_1", "step_2", "val_step_2"}
    assert data["files"]["step_1"]["records"]["0"]["response_tokens"]
    assert "<script src=" not in html
