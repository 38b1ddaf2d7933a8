"""Check the game before training: Gymnasium's env checker plus verl-agent's interaction checker.

    python examples/gym_text_game/check_env.py

Plays one scripted episode (binary search) through the interaction exactly as the
trainer will, on two interleaved instances, and prints the transcript.
"""

from __future__ import annotations

from pathlib import Path

from gymnasium.utils.env_checker import check_env

from verl_agent.interactions import check_interaction, load_interactions

HERE = Path(__file__).parent


def main() -> dict:
    game = load_interactions(HERE / "interaction.yaml")["guess_number"]
    check_env(game.make_env(), skip_render_check=True)  # check_interaction runs it too; shown for clarity
    result = check_interaction(game, ["8", "I guess 12", "10", "11"], prompt="Let's play.", secret=11, seed=0)
    for turn in result["transcript"]:
        print(f"model: {turn['reply']!r:14} env: {turn['text']!r}  reward {turn['score']}")
    print(f"score {result['score']}")
    return result


if __name__ == "__main__":
    main()
