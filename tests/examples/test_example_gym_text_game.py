"""examples/gym_text_game: a user-written Gymnasium env (guess the number) wrapped as an interaction.

The env checker script is run as users run it; the tiny model plays the game for real (plumbing);
a scripted engine plays binary search (a model that knows the game; none can be downloaded here)
so the rewards and terminated/truncated endings are asserted exactly.
"""

from __future__ import annotations

import re

from example_helpers import EXAMPLES, assert_data_reproducible, example_config, load_module, rollout, scripted_engine
from example_helpers import val_samples

from verl_agent.interactions import GymInteraction

NAME = "gym_text_game"


def test_make_data_reproduces_shipped_files(tmp_path):
    assert_data_reproducible(NAME, tmp_path)


def test_env_checker_script_passes(capsys):
    result = load_module(EXAMPLES / NAME / "check_env.py").main()  # runs gymnasium's check_env too
    assert result["score"] == 1.0
    assert [t["done"] for t in result["transcript"]] == [False, False, False, True]
    assert "Correct, it is 11!" in capsys.readouterr().out


async def test_tiny_model_plays_the_game(tiny_engine, tiny_tok, tiny_model_path):
    cfg = example_config(NAME, "data.max_response_length=96", model_path=tiny_model_path)
    batch, loop = await rollout(cfg, tiny_engine, tiny_tok, val_samples(cfg, 2), n=2)
    game = loop.interactions["guess_number"]
    assert isinstance(game, GymInteraction) and len(batch) == 4
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        assert traj.messages[1].content.startswith("I picked a whole number from 1 to 15")  # reset's observation
        assert traj.reward in (0.0, 1.0) and len(traj.turns) >= 1
    assert game.instances == {}  # every env was closed (finalize_interaction)


def _binary_search(text: str, k: int) -> str:
    """Guess like an optimal player, reading the env's hints from the conversation so far."""
    lo, hi = 1, 15
    for guess, word in re.findall(r"(\d+) is too (low|high)", text):
        lo, hi = (max(lo, int(guess) + 1), hi) if word == "low" else (lo, min(hi, int(guess) - 1))
    return f"My guess is {(lo + hi) // 2}."


async def test_binary_search_always_wins_and_bad_guesses_truncate(tiny_tok, tiny_model_path):
    cfg = example_config(NAME, model_path=tiny_model_path)
    samples = val_samples(cfg, 4)
    batch, _ = await rollout(cfg, scripted_engine(tiny_tok, _binary_search), tiny_tok, samples)
    for traj, sample in zip(batch.trajectories, samples):
        assert traj.reward == 1.0 and traj.stop_reason == "interaction_done", traj.messages
        assert traj.messages[-1].content.endswith(f"{sample.interaction_kwargs['secret']}.")
        assert [t.score for t in traj.turns][-1] == 1.0 and len(traj.turns) <= 4
    batch, _ = await rollout(cfg, scripted_engine(tiny_tok, ["no idea"]), tiny_tok, samples[:1])
    traj = batch.trajectories[0]
    assert traj.reward == 0.0 and len(traj.turns) == 4 and traj.stop_reason == "interaction_done"
    assert traj.messages[-2].content == "I found no number in your reply. 1 left."  # then truncated (no reply)
