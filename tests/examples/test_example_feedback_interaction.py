"""examples/feedback_interaction: math answers judged by MathFeedbackInteraction, "try again" until right.

The tiny model runs the example for real (plumbing). A scripted engine stands in for a model
that follows the protocol exactly (no such model can be downloaded here), so the retry path,
the per-turn scores and the turn penalty are asserted with known numbers.
"""

from __future__ import annotations

from example_helpers import assert_data_reproducible, example_config, rollout, scripted_engine, tool_call, val_samples

from verl_agent.rollout.records import trajectory_record

NAME = "feedback_interaction"
SCORES = {0.0, 0.5, 0.75, 1.0}  # max_turns 3, turn_penalty 0.25


def test_make_data_reproduces_shipped_files(tmp_path):
    assert_data_reproducible(NAME, tmp_path)


async def test_tiny_model_gets_feedback_turns(tiny_engine, tiny_tok, tiny_model_path):
    cfg = example_config(NAME, "data.max_response_length=160", model_path=tiny_model_path)
    batch, loop = await rollout(cfg, tiny_engine, tiny_tok, val_samples(cfg, 2), n=2)
    assert len(batch) == 4 and set(loop.tools) == {"calculator"} and set(loop.interactions) == {"math_feedback"}
    judged = 0
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        traj.check()
        assert traj.reward in SCORES
        replies = [m.content for m in traj.messages if m.role == "user"][1:]
        assert all(r.startswith("Your answer is") for r in replies)
        judged += len(replies) + (traj.stop_reason == "interaction_done")
    assert judged >= 4  # every trajectory had its answers judged
    assert loop.interactions["math_feedback"].instances == {}  # finalize_interaction ran for each


async def test_wrong_then_right_answer_scores_with_turn_penalty(tiny_tok, tiny_model_path):
    cfg = example_config(NAME, model_path=tiny_model_path)
    sample = val_samples(cfg, 1)[0]
    truth = sample.interaction_kwargs["ground_truth"]
    replies = [tool_call("calculator", '{"expression": "1 + 1"}'), "The answer is 2.", f"The answer is {truth}."]
    batch, loop = await rollout(cfg, scripted_engine(tiny_tok, replies), tiny_tok, [sample])
    traj = batch.trajectories[0]
    assert traj.error is None and traj.stop_reason == "interaction_done"
    assert [m.role for m in traj.messages[2:]] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert traj.messages[3].content == "2"  # the calculator ran
    assert traj.messages[5].content.startswith("Your answer is incorrect. Please check your work and try again")
    assert [t.score for t in traj.turns] == [0.0, 0.0, 0.75]  # per-turn: tool turn, wrong answer, right on 2nd try
    assert traj.reward == 0.75
    record = trajectory_record(traj, tiny_tok)  # what `verl-agent rollout` writes: per-turn scores are logged
    assert [t["score"] for t in record["turns"]] == [0.0, 0.0, 0.75]
