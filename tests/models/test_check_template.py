"""`verl-agent model check-template`: drift named for templates that rewrite earlier turns, none for append-safe ones
(the tiny model's, and the family fixtures of tests/fixtures/templates that keep what they rendered)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from verl_agent.models.check_template import check_template, format_report

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
# fixture -> (detected format, drift kinds); the three that drop reasoning before the last user message drift
EXPECTED = {"qwen3_think": ("hermes", {"dropped reasoning"}), "glm45": ("glm45", {"dropped reasoning"}),
            "harmony": ("harmony", {"dropped reasoning"}), "deepseek_v31": ("deepseek", set()),
            "kimi_k2": ("kimi_k2", set()), "qwen3_coder": ("qwen3_coder", set()),
            "llama4_pythonic": ("llama4_pythonic", set())}  # fmt: skip


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_tiny_model_template_has_no_drift(tok) -> None:
    report = check_template(tok)
    assert report.drifts == [] and report.history == "exact" and report.format == "hermes"
    assert report.full_tokens == report.incremental_tokens > 100 and report.first_token_diff is None


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_family_templates(tok, family: str) -> None:
    t = copy.deepcopy(tok)
    t.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    report = check_template(t)
    fmt, kinds = EXPECTED[family]
    assert report.format == fmt and {d.kind for d in report.drifts} == kinds
    text = format_report(report, t)
    assert f"recommended multi_turn.history={'template' if kinds else 'exact'}" in text
    if kinds:  # the drift is shown where it happens: the earlier turn's reasoning, then the text that replaced it
        assert "I should use the calc" in report.drifts[0].before
        assert "I should use the calc" not in report.drifts[0].after
        assert report.first_token_diff is not None


def test_cli_exit_status_says_whether_it_drifts(tiny_model_path, capsys) -> None:
    from verl_agent.cli import main

    assert main(["model", "check-template", str(tiny_model_path)]) == 0
    assert main(["model", "check-template", str(tiny_model_path), "--chat-template",
                 str(TEMPLATES / "qwen3_think.jinja")]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "DRIFT dropped reasoning" in out and "history=template" in out
