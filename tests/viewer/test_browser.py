"""The viewer in real headless Chromium: curves, filters, a trajectory with its tool call, token ids, errors.

Screenshots land in test-artifacts/viewer/ (VERL_AGENT_TEST_ARTIFACTS overrides the folder).
"""

from __future__ import annotations

import json

import pytest
from browser import ARTIFACTS, chromium_path, serving
from playwright.sync_api import expect, sync_playwright
from runfactory import METRIC_STEPS

from verl_agent.viewer import write_report


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    pg = browser.new_page(viewport={"width": 1500, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def _open(page, url):
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=15000)


def _series(page, chart, name):
    return page.locator(f"svg[data-title='{chart}'] g.series[data-name='{name}'] circle.pt")


def _first_record(run_dir, file="step_1"):
    return json.loads((run_dir / "trajectories" / f"{file}.jsonl").read_text().splitlines()[0])


def test_curves_trajectory_tool_call_and_token_hover(page, run_dir):
    with serving(run_dir) as url:
        _open(page, url)
        expect(_series(page, "Reward", "rollout/reward/mean")).to_have_count(len(METRIC_STEPS))
        expect(_series(page, "Success rate", "val/success_rate")).to_have_count(2)  # logged at steps 1 and 3 only
        for chart in ("Response length", "Entropy", "KL", "Time per phase (s)", "Infrastructure failures (share)",
                      "Infrastructure failures by cause (count)"):
            expect(page.locator(f"svg[data-title='{chart}']")).to_have_count(1)
        share = page.locator("svg[data-title='Infrastructure failures (share)'] g.series")  # a share, never a count
        expect(share).to_have_count(1)
        expect(share).to_have_attribute("data-name", "rollout/infra_failed")
        expect(page.locator("#steps-count")).to_have_text(f"{len(METRIC_STEPS)} training steps logged")
        expect(page.locator("#global-error .error")).to_have_count(0)

        # Zoom: drag across the middle of the reward chart keeps only step 2 inside the plot.
        box = page.locator("svg[data-title='Reward'] rect.brush-area").bounding_box()
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + box["width"] * 0.3, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.7, y, steps=5)
        page.mouse.up()
        expect(page.locator("#zoom-note")).to_contain_text("steps 1.6")
        page.screenshot(path=str(ARTIFACTS / "curves.png"), full_page=True)

        # Step browser: filters, then the tool-using trajectory.
        page.click(".tab[data-tab='steps']")
        expect(page.locator(".traj-row")).to_have_count(4)
        page.select_option("#f-status", "infra_failure")
        expect(page.locator(".traj-row")).to_have_count(1)
        expect(page.locator(".traj-row")).to_contain_text("tool_timeout")
        page.select_option("#f-status", "")
        page.fill("#f-text", "answer is 401")
        expect(page.locator(".traj-row")).to_have_count(1)
        page.fill("#f-text", "")
        expect(page.locator("#f-tool option[value='calculator']")).to_have_count(1)
        page.select_option("#f-tool", "calculator")
        expect(page.locator(".traj-row")).to_have_count(1)
        page.locator(".traj-row").first.click()

        detail = page.locator("#detail .trajectory")
        expect(detail.locator(".tool-name")).to_have_text("calculator")
        expect(detail.locator(".tool-args")).to_contain_text('"expression": "37 * 12"')
        expect(detail.locator(".role-tool")).to_contain_text("tool result (calculator)")
        expect(detail.locator(".role-tool pre")).to_have_text("444")
        expect(detail.locator(".turn-info").nth(1)).to_contain_text("score 1")
        expect(detail.locator(".stop-line")).to_contain_text("end_of_turn")

        rec = _first_record(run_dir)
        tok = detail.locator(".tok-response .tok.m1").first
        tok.hover()
        tip = page.locator("#tok-tip")
        expect(tip).to_be_visible()
        expect(tip).to_contain_text(f"id {rec['response_ids'][0]} · response pos 0 · mask 1")
        assert int(tok.get_attribute("data-id")) == rec["response_ids"][0]
        assert not tok.inner_text().startswith("[")  # decoded with the run's tokenizer, not a bare id
        n_obs = rec["loss_mask"].count(0)
        expect(detail.locator(".tok-response .tok.m0")).to_have_count(n_obs)
        page.screenshot(path=str(ARTIFACTS / "trajectory.png"), full_page=True)

        # Colour by advantage (the trainer's per-token field): a diverging scale, the value on hover.
        _check_advantage_colours(page, detail, rec)
        page.screenshot(path=str(ARTIFACTS / "advantage.png"), full_page=True)
        page.select_option("#f-tool", "")
        page.locator(".traj-row[data-index='1']").click()  # the wrong answer: below its group's mean
        expect(detail.locator(".uid")).to_have_text("calc:1")
        detail.locator(".tok-mode").select_option("advantage")
        neg = detail.locator(".tok-response .tok.m1").first
        r, _g, b = _rgb(neg)
        assert r > b, (r, b)  # red side of the scale
        neg.hover()
        expect(page.locator("#tok-tip")).to_contain_text("advantage -0.75")
        page.locator(".traj-row[data-index='2']").click()  # infra failure: not in the loss, no advantages
        expect(detail.locator(".error")).to_contain_text("TimeoutError")
        expect(detail.locator("h3", has_text="Tokens")).to_contain_text("none trained (infra_failure: left out of "
                                                                       "the loss)")
        expect(detail.locator(".tok-mode option")).to_have_count(2)

        # Same prompt, step 1 vs step 2, aligned turn by turn.
        page.locator(".traj-row[data-index='0']").click()
        expect(detail.locator(".tool-name")).to_have_text("calculator")
        detail.locator(".compare-btn").click()
        expect(page.locator("#cmp-left .cmp-sample")).to_have_count(1)
        expect(page.locator("#cmp-right .cmp-sample")).to_have_count(1)
        table = page.locator("#cmp-aligned .cmp-table")
        expect(table.locator(".cmp-turn")).to_have_count(2)
        expect(table.locator(".diff")).to_have_count(0)  # the same success at both steps: nothing highlighted
        page.select_option("#cmp-right .cmp-sample", index=1)  # step 2's wrong answer
        expect(table.locator("tr:first-child")).to_contain_text("step_2 · sample 2 of 2")
        outcome = table.locator("tr.cmp-outcome")
        expect(outcome.nth(0).locator("td.delta")).to_have_text("reward -1")
        expect(outcome.nth(0).locator("td.delta")).to_have_class("delta diff worse")
        expect(outcome.nth(1).locator("td.diff")).to_contain_text("policy_failure: wrong_answer")
        turn1, turn2 = table.locator(".cmp-turn").nth(0), table.locator(".cmp-turn").nth(1)
        expect(turn1.locator("td").nth(0).locator(".tool-name")).to_have_text("calculator")
        expect(turn1.locator("td").nth(0).locator(".obs")).to_contain_text("444")
        expect(turn1.locator("td").nth(1)).to_contain_text("The answer is 402.")
        expect(turn1.locator("td").nth(1)).to_have_class("turn-cell calls-differ")
        expect(turn1.locator("td.delta")).to_have_text("score -0.1")
        expect(turn2.locator("td").nth(0)).to_contain_text("The answer is 444.")
        expect(turn2.locator("td.missing")).to_contain_text("no turn 2 (stopped: end_of_turn)")
        expect(turn2.locator("td.delta")).to_have_text("only A")
        page.locator("#cmp-left .cmp-full > details > summary").click()  # the whole trajectory stays one click away
        expect(page.locator("#cmp-left .trajectory .tok-response")).to_have_count(1)
        page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)


def _rgb(locator):
    css = locator.evaluate("e => getComputedStyle(e).backgroundColor")
    return [int(x) for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]


def _check_advantage_colours(page, detail, rec):
    adv = rec["advantages"]
    assert adv[rec["turns"][0]["gen_start"]] == 0.5 and max(adv) == 1.0 and min(adv) == 0.0
    modes = detail.locator(".tok-mode option")
    expect(modes).to_have_text(["colour: loss mask", "colour: rollout log-prob", "colour: advantage"])
    detail.locator(".tok-mode").select_option("advantage")
    trained = detail.locator(".tok-response .tok.m1")
    first, last = trained.first, trained.last  # turn 1 at +0.5, turn 2 at +1.0 (the record's largest)
    (r1, g1, b1), (r2, g2, b2) = _rgb(first), _rgb(last)
    assert b1 > r1 and b2 > r2 and r2 < r1, ((r1, g1, b1), (r2, g2, b2))  # blue, deeper for the larger advantage
    assert detail.locator(".tok-response .tok.m0").first.get_attribute("style") is None  # not trained: not coloured
    expect(detail.locator(".legend-row")).to_contain_text("+1")
    first.hover()
    tip = page.locator("#tok-tip")
    expect(tip).to_contain_text(f"id {rec['response_ids'][0]} · response pos 0 · mask 1")
    expect(tip).to_contain_text("advantage 0.5")
    last.hover()
    expect(tip).to_contain_text("advantage 1 ")


def test_curves_follow_a_run_that_is_still_training(page, run_dir):
    with serving(run_dir) as url:
        _open(page, url)
        expect(_series(page, "Reward", "rollout/reward/mean")).to_have_count(3)
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 4, "rollout/reward/mean": 0.9}) + "\n")
        expect(_series(page, "Reward", "rollout/reward/mean")).to_have_count(4, timeout=10000)


def test_malformed_lines_are_shown_as_errors(page, broken_run):
    with serving(broken_run) as url:
        _open(page, url)
        expect(page.locator("#metrics-errors .error")).to_contain_text("metrics.jsonl line 4")
        expect(_series(page, "Reward", "rollout/reward/mean")).to_have_count(3)  # the good rows still plot
        page.click(".tab[data-tab='steps']")
        errs = page.locator("#file-errors .error")
        expect(errs).to_have_count(3)
        expect(errs.nth(0)).to_contain_text("line 2: truncated record")
        expect(errs.nth(2)).to_contain_text("no newline")
        expect(page.locator(".traj-row")).to_have_count(4)  # the good records are still listed
        expect(page.locator(".row-error")).to_have_count(2)
        page.screenshot(path=str(ARTIFACTS / "errors.png"), full_page=True)


def test_self_contained_html_report(page, run_dir, tmp_path):
    out = write_report(run_dir, tmp_path / "report.html")
    html = out.read_text()
    assert 'src="static/' not in html and 'href="static/' not in html  # nothing left to fetch
    _open(page, out.as_uri())
    expect(_series(page, "Reward", "rollout/reward/mean")).to_have_count(len(METRIC_STEPS))
    page.click(".tab[data-tab='steps']")
    page.select_option("#f-file", "step_2")
    page.select_option("#f-status", "ok")
    expect(page.locator(".traj-row")).to_have_count(1)
    page.locator(".traj-row").first.click()
    expect(page.locator("#detail .tool-name")).to_have_text("calculator")
    page.locator("#detail .tok-response .tok").first.hover()
    rec = _first_record(run_dir, "step_2")
    expect(page.locator("#tok-tip")).to_contain_text(f"id {rec['response_ids'][0]} ")
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)


def test_segments_of_a_rewritten_context(page, run_dir, tiny_tokenizer):
    """An episode whose context was rewritten (rollout/context.py): each segment is a row with its badge; the
    later one says where the history was rewritten, the earlier one that the episode goes on; each turn
    says how many tokens the model saw."""
    from runfactory import _Builder

    from verl_agent.protocol import RolloutBatch
    from verl_agent.rollout.records import write_records

    first = _Builder(tiny_tokenizer, "corridor:1", "Remember the code 37.").turn("The code is 37.").build(
        1.0, stop="context_rewrite")
    second = _Builder(tiny_tokenizer, "corridor:1", "Remember the code 37.").turn("The code is 37.").build(
        1.0, stop="interaction_done")
    for k, seg in enumerate((first, second)):
        seg.metrics.update(segment=float(k), num_segments=2.0)
    path = run_dir / "trajectories" / "step_1.jsonl"
    write_records(path, RolloutBatch([first, second]), tokenizer=None, step=1, append=False)
    with serving(run_dir) as url:
        _open(page, url)
        page.click(".tab[data-tab='steps']")
        expect(page.locator(".traj-row")).to_have_count(2)
        detail = page.locator("#detail .trajectory")
        page.locator(".traj-row[data-index='1']").click()
        expect(detail.locator(".badge.segment")).to_have_text("segment 2 of 2")
        expect(detail.locator(".rewrite-line")).to_contain_text("context rewritten: segment 2 of 2")
        expect(detail.locator(".turn-info").first).to_contain_text(f"saw {len(second.prompt_ids)} tokens")
        page.locator(".traj-row[data-index='0']").click()
        expect(detail.locator(".badge.segment")).to_have_text("segment 1 of 2")
        expect(detail.locator(".rewrite-line")).to_have_count(0)
        expect(detail.locator(".stop-line")).to_contain_text("context_rewrite (the episode goes on in segment 2 of 2)")
