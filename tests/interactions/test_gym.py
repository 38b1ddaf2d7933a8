"""The Gymnasium face: GuessNumberEnv passes check_env; GymInteraction wraps any text env as an interaction."""

import string

import gymnasium
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

from verl_agent.interactions import (
    GuessNumberEnv,
    GymInteraction,
    InteractionConfigError,
    InteractionSession,
    check_interaction_async,
)
from verl_agent.interactions.guess_number import ENV_ID


def test_guess_number_passes_gymnasium_check_env():
    check_env(GuessNumberEnv(), skip_render_check=True)
    check_env(gymnasium.make(ENV_ID, high=10).unwrapped, skip_render_check=True)


def test_guess_number_game_rules():
    env = GuessNumberEnv(low=1, high=10, max_turns=3)
    obs, info = env.reset(seed=0, options={"secret": 7})
    assert "between 1 and 10" in obs and "3 guesses" in obs and obs in env.observation_space
    assert info == {"low": 1, "high": 10}
    obs, r, term, trunc, _ = env.step("Hmm, between 4 and 5... I'll say 5")  # the last integer is the guess
    assert (obs, r, term, trunc) == ("5 is too low. Guess higher. 2 guesses left.", 0.0, False, False)
    obs, r, term, trunc, _ = env.step("no idea")
    assert obs.startswith("I could not find a number") and (term, trunc) == (False, False)
    obs, r, term, trunc, info = env.step("9")
    assert (r, term, trunc) == (0.0, False, True) and "the number was 7" in obs and info == {"turns": 3}
    env.reset(options={"secret": 2})
    assert env.step("2")[1:4] == (1.0, True, False)
    env.reset(options={"secret": 2})  # a 5000-digit run is no guess (int() would raise: an env crash)
    assert env.step("9" * 5000)[0].startswith("I could not find a number")


def test_seed_determines_the_secret():
    a, b = GuessNumberEnv(), GuessNumberEnv()
    a.reset(seed=123)
    b.reset(seed=123)
    assert a.secret == b.secret and 1 <= a.secret <= 100
    with pytest.raises(ValueError, match="low"):
        GuessNumberEnv(low=5, high=5)


class EchoEnv(gymnasium.Env):
    """A third-party-style text env: rewards repeating the target word, ends after it or 3 steps."""

    def __init__(self, word: str = "hello"):
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=200, charset=string.printable)
        self.word, self.steps, self.closed = word, 0, False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        self.word = (options or {}).get("word", self.word)
        return f"Say {self.word}.", {}

    def step(self, action):
        self.steps += 1
        hit = self.word in action
        return ("yes" if hit else "no"), (1.0 if hit else -0.5), hit, self.steps >= 3 and not hit, {"steps": self.steps}

    def close(self):
        self.closed = True


async def test_adapter_maps_reset_and_step():
    envs = []

    def make():
        envs.append(EchoEnv())
        return envs[-1]

    inter = GymInteraction({"name": "echo"}, env_fn=make)
    async with InteractionSession(inter, {"name": "echo", "seed": 1, "word": "bye"}) as s:
        assert await s.initial_observation() == "Say bye."
        msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "hello"}]
        assert await s.respond(msgs) == (False, "no", -0.5, {"steps": 1, "terminated": False, "truncated": False})
        msgs += [{"role": "user", "content": "no"}, {"role": "assistant", "content": "bye!"}]
        assert await s.respond(msgs) == (True, "yes", 1.0, {"steps": 2, "terminated": True, "truncated": False})
        done, text, score, info = await s.respond(msgs)  # after the end: no env.step, just "done" again
        assert (done, text, score, info["after_done"]) == (True, "", 0.0, True)
        assert await s.score() == 0.5  # score: sum
    assert envs[0].closed and inter.instances == {}


async def test_truncation_and_last_score_mode():
    inter = GymInteraction({"score": "last"}, env_fn=EchoEnv)
    iid = await inter.start_interaction(None)
    for _ in range(3):
        done, _, _, info = await inter.generate_response(iid, [{"role": "assistant", "content": "x"}])
    assert done and info["truncated"] and not info["terminated"]
    assert await inter.calculate_score(iid) == -0.5
    await inter.finalize_interaction(iid)


async def test_adapter_from_env_id_and_dotted_path_with_checker():
    by_id = GymInteraction({"env_id": ENV_ID, "env_kwargs": {"high": 8, "max_turns": 4}})
    out = await check_interaction_async(by_id, ["4", "2", "6", "7"], seed=5)
    assert len(out["transcript"]) >= 1 and all(
        "guess" in t["text"].lower() or "Correct" in t["text"] for t in out["transcript"]
    )
    by_path = GymInteraction({"env": "verl_agent.interactions.guess_number.GuessNumberEnv"})
    out = await check_interaction_async(by_path, ["50"], secret=50, seed=0)
    assert out["transcript"][0]["done"] and out["score"] == 1.0


def test_adapter_config_errors():
    with pytest.raises(InteractionConfigError, match="needs `env_fn`"):
        GymInteraction({})
    with pytest.raises(InteractionConfigError, match="unknown Gymnasium env_id 'Nope-v9'"):
        GymInteraction({"env_id": "Nope-v9"})
    with pytest.raises(InteractionConfigError, match="cannot import env 'no.such.Env'"):
        GymInteraction({"env": "no.such.Env"})
    with pytest.raises(InteractionConfigError, match="'score' must be one of"):
        GymInteraction({"score": "max"}, env_fn=EchoEnv)
