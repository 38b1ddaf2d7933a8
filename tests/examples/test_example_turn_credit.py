"""examples/turn_credit: higher/lower with turn-level credit (grpo_turn, gigpo) so the example cannot rot.

The env's rewards and state keys are asserted exactly with scripted players (binary search wins every
game); the warm start is built with a few SFT steps (the shipped recipe's code path, fast settings);
the example config trains 2 steps with gigpo through the real trainer (Ray, FSDP worker, HF engine,
the tiny model) and its step records carry per-token advantages that are constant within each turn.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import sys
import tempfile

import pytest
from example_helpers import EXAMPLES, assert_data_reproducible, example_config, load_module

from verl_agent.trainer.loop import train

NAME = "turn_credit"
sys.path.insert(0, str(EXAMPLES / NAME))


@functools.cache
def example_module(stem: str):
    """One of the example's scripts, loaded by path: other examples have a make_data or warm_start too."""
    return load_module(EXAMPLES / NAME / f"{stem}.py")


def play(env, secrets, policy) -> float:
    """The total reward of one match with these secrets, guessing policy(lo, hi) each turn."""
    env.reset(options={"secrets": list(secrets)})
    total, done = 0.0, False
    while not done:
        _, r, term, trunc, _ = env.step(str(policy(env.lo, env.hi)))
        total, done = total + r, term or trunc
    return total


def test_make_data_reproduces_shipped_files(tmp_path):
    assert_data_reproducible(NAME, tmp_path)
    kwargs = lambda split: [json.loads(x)["extra_info"]["interaction_kwargs"]  # noqa: E731
                            for x in (EXAMPLES / NAME / "data" / f"{split}.jsonl").read_text().splitlines()]
    test = [tuple(k["secrets"]) for k in kwargs("test")]
    train = kwargs("train")
    assert len(test) == len(set(test)) == 49 and all(len(m) == 4 and all(1 <= s <= 7 for s in m) for m in test)
    # training rows give only a seed: the env (random_secrets) draws each trajectory's match
    assert train == [{"name": "hilo", "seed": i} for i in range(392)]
    for i in range(4):  # evaluation matches: an orthogonal array, every two rounds see every pair of secrets once
        for j in range(i + 1, 4):
            assert len({(m[i], m[j]) for m in test}) == 49


def test_interaction_yaml_plays_the_game_of_make_data():
    import yaml
    md = example_module("make_data")
    GUESSES, HIGH, LOW, ROUNDS = md.GUESSES, md.HIGH, md.LOW, md.ROUNDS

    kwargs = yaml.safe_load((EXAMPLES / NAME / "interaction.yaml").read_text())["interaction"][0]["config"]["env_kwargs"]
    assert (kwargs["low"], kwargs["high"], kwargs["max_guesses"], kwargs["rounds"]) == (LOW, HIGH, GUESSES, ROUNDS)


def test_env_rewards_and_state_keys():
    from guess_env import HiLoGame

    env = HiLoGame()
    obs, _ = env.reset(options={"secret": 11})
    assert obs == "Guess my number from 1 to 15. 4 guesses left."
    obs, r, term, trunc, info = env.step("8")  # rules out 1..8: 8 of 15 candidates
    assert obs == "Too low. It is from 9 to 15. 3 guesses left." and info["state_key"] == "9-15-3"
    assert r == pytest.approx(0.5 * 8 / 15) and not term and not trunc
    obs, r, term, _, _ = env.step("I say 12")  # rules out 12..15
    assert r == pytest.approx(0.5 * 4 / 15) and obs.startswith("Too high. It is from 9 to 11.")
    obs, r, term, _, _ = env.step("10")
    obs, r, term, _, _ = env.step("11")  # found: 1 + 0.5 x the one candidate left
    assert term and obs == "Correct!" and r == pytest.approx(1 + 0.5 / 15)

    def play(secret: int, policy) -> float:
        env.reset(options={"secret": secret})
        total, done = 0.0, False
        while not done:
            _, r, term, trunc, _ = env.step(str(policy(env.lo, env.hi)))
            total, done = total + r, term or trunc
        return total

    assert all(play(s, lambda lo, hi: (lo + hi) // 2) == pytest.approx(1.5) for s in range(1, 16))
    rng = random.Random(0)
    wins = sum(play(s, lambda lo, hi: rng.randint(lo, hi)) >= 1 for s in range(1, 16) for _ in range(200))
    assert 0.55 < wins / 3000 < 0.65  # the random player the warm start imitates wins ~60 %


def test_two_round_match_rewards_each_guess_and_round():
    """The earlier game of the example: 2 rounds of 1..7 in 3 guesses; each guess scores 0.15 x balance / 2, each won round 1 / 2."""
    from guess_env import HiLoGame, balance

    assert [balance(g, 1, 7) for g in range(0, 9)] == pytest.approx([0, 0, 1 / 3, 2 / 3, 1, 2 / 3, 1 / 3, 0, 0])
    assert balance(6, 6, 7) == balance(7, 6, 7) == balance(3, 3, 3) == 1.0 and balance(None, 1, 7) == 0.0
    env = HiLoGame(low=1, high=7, max_guesses=3, rounds=2, shaping=0.15, scoring="halving")
    obs, _ = env.reset(options={"secrets": [3, 6]})
    assert obs == "Round 1 of 2. Guess my number from 1 to 7. 3 guesses left."
    obs, r, term, trunc, info = env.step("4")  # the middle: balance 1
    assert obs == "Too high. It is from 1 to 3. 2 guesses left." and info["state_key"] == "1:1-3-2"
    assert r == pytest.approx(0.15 / 2) and not term and not trunc
    obs, r, _, _, info = env.step("9")  # outside the interval: 0, and a guess is spent
    assert r == 0.0 and info["state_key"] == "1:1-3-1"
    obs, r, term, trunc, info = env.step("1")  # round 1 lost; round 2 starts from the same state for everyone
    assert obs == "Too low. No guesses left; it was 3. Round 2 of 2. Guess my number from 1 to 7. 3 guesses left."
    assert info["state_key"] == "2:1-7-3" and not term and not trunc and r == 0.0  # balance(1, 1..3) = 0
    obs, r, term, _, info = env.step("6")  # won at once: 1 / 2 + 0.15 x balance(6, 1..7) / 2 (= 1 / 3)
    assert term and obs == "Correct!" and info["state_key"] == "end" and r == pytest.approx((1 + 0.15 / 3) / 2)
    with pytest.raises(ValueError, match="under 1"):
        HiLoGame(low=1, high=7, max_guesses=3, rounds=2, shaping=0.2, scoring="halving")

    pairs = [(a, b) for a in range(1, 8) for b in range(1, 8)]
    assert all(play(env, p, lambda lo, hi: (lo + hi) // 2) >= 1 for p in pairs)  # binary search wins every match
    rng = random.Random(0)
    scores = [play(env, p, lambda lo, hi: rng.randint(lo, hi)) for p in pairs for _ in range(100)]
    won = [s >= 1 for s in scores]
    assert 0.42 < sum(won) / len(won) < 0.50  # the random player the warm start imitates wins ~46 % of matches
    assert max(s for s in scores if s < 1) < 1 <= min(s for s in scores if s >= 1)


def test_four_round_match_of_the_example():
    """The shipped game: 4 rounds of 1..7 in 3 guesses, shaping 0.08; success (reward >= 1) = all 4 rounds won."""
    import yaml
    from guess_env import HiLoGame
    evaluation_matches = example_module("make_data").evaluation_matches

    kwargs = yaml.safe_load((EXAMPLES / NAME / "interaction.yaml").read_text())["interaction"][0]["config"]["env_kwargs"]
    env = HiLoGame(**kwargs)
    obs, _ = env.reset(options={"secrets": [4, 4, 4, 1]})
    assert obs == "Round 1 of 4. Guess my number from 1 to 7. 3 guesses left."
    for k in range(3):  # three rounds won at once
        obs, r, term, _, info = env.step("4")
        assert not term and r == pytest.approx((1 + 0.08) / 4) and info["state_key"] == f"{k + 2}:1-7-3"
    assert obs == "Correct! Round 4 of 4. Guess my number from 1 to 7. 3 guesses left."

    matches = evaluation_matches()
    assert all(play(env, m, lambda lo, hi: (lo + hi) // 2) >= 1 for m in matches)  # binary search wins every match
    rng = random.Random(0)
    scores = [play(env, m, lambda lo, hi: rng.randint(lo, hi)) for m in matches for _ in range(100)]
    assert 0.17 < sum(s >= 1 for s in scores) / len(scores) < 0.25  # the random player wins ~21 % of matches
    assert max(s for s in scores if s < 1) < 1


def test_each_trajectory_draws_its_own_secrets_and_evaluation_matches_stay_fixed():
    """random_secrets: the 8 samples of one training row (one GRPO group, one reset seed) face different
    matches, reproducibly per seed; evaluation rows (secrets given) play exactly their match every time."""
    import asyncio

    import yaml
    from guess_env import HiLoGame
    evaluation_matches = example_module("make_data").evaluation_matches

    from verl_agent.interactions.gym import GymInteraction

    kwargs = yaml.safe_load((EXAMPLES / NAME / "interaction.yaml").read_text())["interaction"][0]["config"]["env_kwargs"]
    assert kwargs["random_secrets"] is True
    interaction = GymInteraction({"name": "hilo"}, env_fn=lambda: HiLoGame(**kwargs))

    async def secrets(n: int, **row) -> list[tuple[int, ...]]:
        ids = [await interaction.start_interaction(None, **row) for _ in range(n)]
        return [tuple(interaction.instances[i]["env"].secrets) for i in ids]

    HiLoGame._draws.clear()
    group = asyncio.run(secrets(8, name="hilo", seed=12345))
    assert len(set(group)) > 1 and all(len(m) == 4 and all(1 <= s <= 7 for s in m) for m in group)
    HiLoGame._draws.clear()
    assert asyncio.run(secrets(8, name="hilo", seed=12345)) == group  # reproducible per seed
    for i, m in enumerate(evaluation_matches()[:5]):  # evaluation: the row's match, for every sample
        assert asyncio.run(secrets(4, name="hilo", secrets=list(m), seed=i)) == [m] * 4
    env = HiLoGame(**{**kwargs, "random_secrets": False})  # without the option a seed fixes the match
    assert len({tuple(env.reset(seed=7) and env.secrets) for _ in range(4)}) == 1


def test_warm_start_builds_and_caches(tmp_path):
    ws = example_module("warm_start")

    w = ws.WarmStart(n_games=16, steps=3, batch_size=4)
    path = ws.warm_start(w, cache=tmp_path)
    info = json.loads((path / "warm_start.json").read_text())
    assert info["settings"]["steps"] == 3 and (path / "config.json").is_file()
    assert ws.warm_start(w, cache=tmp_path) == path  # cached


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        mp = pytest.MonkeyPatch()
        mp.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray")))
        mp.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
        ray.init(address="local", include_dashboard=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    if started:
        ray.shutdown()
        mp.undo()


@pytest.mark.slow
def test_config_trains_with_gigpo_and_records_turn_advantages(ray_local, tiny_model_path, tmp_path):
    cfg = example_config(NAME, "algorithm.adv_estimator=gigpo", "data.train_batch_size=2",
                         "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                         "actor_rollout_ref.rollout.val_kwargs.n=1", "trainer.total_training_steps=2",
                         "trainer.test_freq=-1", "trainer.val_before_train=false",
                         f"trainer.default_local_dir={tmp_path / 'run'}", model_path=tiny_model_path)
    result = train(cfg)
    assert result.steps == 2 and all(math.isfinite(s["actor/pg_loss"]) for s in result.history)
    assert result.history[0]["rollout/infra_failed"] == 0.0 and result.val_after["val/num_trajectories"] == 49
    records = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert len(records) == 8
    for rec in records:
        adv, mask = rec["advantages"], rec["loss_mask"]
        assert len(adv) == len(rec["response_ids"]) and all(a == 0.0 for a, m in zip(adv, mask) if not m)
        for turn in rec["turns"]:  # one value per turn (the turn's advantage)
            assert len(set(adv[turn["gen_start"] : turn["gen_end"]])) <= 1
        assert rec["turns"][0]["state_key"] is None
        assert all(t["state_key"] for t in rec["turns"][1:])  # the env names every later state
    assert not any("advantages" in json.loads(x) for x in
                   (tmp_path / "run" / "trajectories" / "val_step_2.jsonl").read_text().splitlines())
