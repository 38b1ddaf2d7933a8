"""A reasoning model's thoughts in the viewer: carried by the API, searchable, and folded above the answer.

The page is checked without a browser: the scripts the server serves are run in Node against a minimal DOM
(elements, attributes, text), and the tree they build is inspected.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from runfactory import reasoning_batch

from verl_agent.rollout.records import write_records
from verl_agent.viewer import Run, create_app
from verl_agent.viewer.export import build_report

FIRST = "Multiplication: better ask the calculator."
SECOND = "The calculator said 444; that is the product."

# Just enough DOM for traj.js / compare.js: they build trees with createElement, setAttribute and appendChild.
_DOM = r"""
const vm = require("vm");
class El {
  constructor(tag) { this.tag = tag; this.className = ""; this.attrs = {}; this.children = []; this.style = {};
    this.classList = { add: (c) => { this.className += " " + c; } }; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  append(...cs) { for (const c of cs) this.appendChild(typeof c === "string" ? new Txt(c) : c); }
  replaceChildren(...cs) { this.children = []; this.append(...cs); }
  addEventListener() {}
}
class Txt { constructor(t) { this.text = t; } }
const ser = (n) => n instanceof Txt ? { text: n.text }
  : { tag: n.tag, cls: n.className, attrs: n.attrs, children: n.children.map(ser) };
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const document = { createElement: (t) => new El(t), createTextNode: (t) => new Txt(t), getElementById: () => null,
                   body: new El("body") };
const ctx = vm.createContext({ document, window: {} });
for (const code of input.scripts) vm.runInContext(code, ctx);
ctx.rec = input.record;
const out = { conversation: vm.runInContext("renderConversation(rec)", ctx),
              aligned: vm.runInContext("renderAligned(rec, rec, ['A', 'B'])", ctx) };
process.stdout.write(JSON.stringify({ conversation: ser(out.conversation), aligned: ser(out.aligned) }));
"""


@pytest.fixture
def reasoning_run(tmp_path: Path, tiny_tokenizer) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("actor_rollout_ref:\n  model:\n    path: tiny\n    tokenizer_path: null\n")
    write_records(run / "trajectories" / "step_1.jsonl", reasoning_batch(tiny_tokenizer), step=1)
    return run


def _text(node: dict[str, Any]) -> str:
    return node.get("text", "") + "".join(_text(c) for c in node.get("children", ()))


def _find(node: dict[str, Any], cls: str) -> list[dict[str, Any]]:
    here = [node] if cls in node.get("cls", "").split() else []
    return here + [m for c in node.get("children", ()) for m in _find(c, cls)]


def test_api_carries_reasoning_and_the_text_filter_searches_it(reasoning_run):
    client = TestClient(create_app(Run(reasoning_run)))
    rec = client.get("/api/record", params={"file": "step_1", "index": 0}).json()
    assistant = [m for m in rec["messages"] if m["role"] == "assistant"]
    assert [m.get("reasoning_content") for m in assistant] == [FIRST, SECOND]
    assert assistant[1]["content"] == "The answer is 444."  # the answer without its <think> block
    # the thought's tokens are model tokens: decoded in the token view and trained
    gen = rec["response_tokens"][: rec["turns"][0]["gen_end"]]
    assert "<think>" in "".join(gen) and set(rec["loss_mask"][: rec["turns"][0]["gen_end"]]) == {1}
    found = client.get("/api/records", params={"file": "step_1", "text": "better ask the CALCULATOR"}).json()
    assert found["matched"] == 1 and found["items"][0]["uid"] == "think:1"


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the page's scripts")
def test_served_page_folds_reasoning_above_the_answer(reasoning_run):
    client = TestClient(create_app(Run(reasoning_run)))
    page = client.get("/").text
    served = re.findall(r'<script src="(static/[\w.]+)"></script>', page)
    # the renderers only: app.js starts the page (fetches, timers)
    scripts = [client.get(f"/{src}").text for src in ("static/traj.js", "static/compare.js")]
    assert {"static/traj.js", "static/compare.js"} <= set(served) and all(scripts)
    rec = client.get("/api/record", params={"file": "step_1", "index": 0}).json()
    out = subprocess.run(["node", "-e", _DOM], input=json.dumps({"scripts": scripts, "record": rec}),
                         capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    trees = json.loads(out.stdout)

    msgs = [m for m in trees["conversation"]["children"] if "role-assistant" in m["cls"].split()]
    assert len(msgs) == 2
    for msg, thought in zip(msgs, (FIRST, SECOND)):
        [fold] = _find(msg, "reasoning")
        assert fold["tag"] == "details" and "open" not in fold["attrs"]  # folded until clicked
        summary, body = fold["children"]
        assert summary["tag"] == "summary" and "reasoning" in _text(summary)
        assert _text(body) == thought
        kinds = [c["cls"] for c in msg["children"]]
        assert kinds.index("reasoning") < kinds.index("tool-call" if msg is msgs[0] else "content")  # above
    assert _text(msgs[1]["children"][-1]) == "The answer is 444."
    assert SECOND not in _text(_find(msgs[1], "content")[0])  # not repeated in the answer

    folds = _find(trees["aligned"], "reasoning")  # the step comparison folds it too: 2 turns x 2 sides
    assert [_text(f["children"][1]) for f in folds] == [FIRST, FIRST, SECOND, SECOND]


def test_html_report_embeds_reasoning_and_the_fold(reasoning_run):
    html = build_report(Run(reasoning_run))
    assert SECOND in html and "function reasoningEl" in html and 'class: "reasoning"' in html
