"""Math feedback interaction: answer extraction from messy outputs, try-again loop, per-turn scores."""

import asyncio

import pytest

from verl_agent.interactions import MathFeedbackInteraction, check_interaction_async
from verl_agent.interactions.math_feedback import answers_match, extract_answer


@pytest.mark.parametrize(
    "text, answer",
    [
        ("So the total is \\boxed{72}.", "72"),
        ("First \\boxed{3}, no wait: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("The answer is 1,250.", "1,250"),
        ("Answer: $-3.5", "-3.5"),
        ("<think>maybe 10? or 12</think> I'd say 14 apples", "14"),
        ("no digits here", None),
        ("", None),
        ("The ratio is 3/4", "3/4"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "answer, truth, same",
    [("72", "72", True), ("72.0", 72, True), ("1,250", "1250", True), ("3/4", "0.75", True), ("0.33", "1/3", False),
     ("0.3333333", "1/3", True), ("71", "72", False), ("x+1", "X+1", True), (None, "1", False), ("1/0", "1", False)],
)  # fmt: skip
def test_answers_match(answer, truth, same):
    assert answers_match(answer, truth) is same


def convo(*replies):
    msgs = [{"role": "user", "content": "Natalia sold clips... How many?"}]
    for r in replies:
        msgs.append({"role": "assistant", "content": r})
        msgs.append({"role": "user", "content": "feedback"})
    return msgs[:-1]


async def test_try_again_then_success_with_turn_penalty():
    inter = MathFeedbackInteraction({"name": "math", "max_turns": 3, "turn_penalty": 0.25})
    iid = await inter.start_interaction(None, ground_truth="72")
    done, text, score, info = await inter.generate_response(iid, convo("I think it is 70."))
    assert (done, score, info["correct"], info["turn"]) == (False, 0.0, False, 1)
    assert "incorrect" in text and "try again" in text and "2 attempts left" in text
    done, text, score, info = await inter.generate_response(iid, convo("70", "Oh, \\boxed{72}"))
    assert (done, text, score, info["correct"]) == (True, "Your answer is correct.", 0.75, True)
    assert await inter.calculate_score(iid) == 0.75
    await inter.finalize_interaction(iid)
    assert inter.instances == {}


async def test_ends_after_max_turns():
    inter = MathFeedbackInteraction({"max_turns": 2, "incorrect_score": -0.1})
    iid = await inter.start_interaction("a", ground_truth=5)
    assert (await inter.generate_response(iid, convo("4")))[0] is False
    done, text, score, _ = await inter.generate_response(iid, convo("4", "6"))
    assert (done, score) == (True, -0.1) and "No attempts left" in text
    assert await inter.calculate_score(iid) == -0.1


async def test_concurrent_instances_and_checker():
    inter = MathFeedbackInteraction({"max_turns": 3})

    async def episode(i):
        iid = await inter.start_interaction(None, ground_truth=str(i))
        await asyncio.sleep(0)
        r1 = await inter.generate_response(iid, convo(str(i + 1)))
        r2 = await inter.generate_response(iid, convo(str(i + 1), f"#### {i}"))
        s = await inter.calculate_score(iid)
        await inter.finalize_interaction(iid)
        return r1[0], r2[0], s

    results = await asyncio.gather(*[episode(i) for i in range(300)])
    assert results == [(False, True, 1.0)] * 300 and inter.instances == {}
    out = await check_interaction_async(inter, ["7", "42"], ground_truth="42", deterministic=True)
    assert out["score"] == 1.0 and [t["done"] for t in out["transcript"]] == [False, True]


async def test_config_and_kwargs_errors():
    with pytest.raises(ValueError, match="max_turns"):
        MathFeedbackInteraction({"max_turns": 0})
    with pytest.raises(ValueError, match="needs 'ground_truth'"):
        await MathFeedbackInteraction({}).start_interaction(None)
