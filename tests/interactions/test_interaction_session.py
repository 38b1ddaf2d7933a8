"""InteractionSession: finalize always runs (errors, cancellation), failures end one episode only."""

import asyncio

import pytest

from verl_agent.interactions import BaseInteraction, InteractionSession
from verl_agent.protocol import Message


class CountingInteraction(BaseInteraction):
    """Counts turns per instance; fails on the word "boom"; sleeps on "slow"."""

    def __init__(self, config=None):
        super().__init__(config)
        self.finalized: list[str] = []

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self.instances[instance_id]
        state["turns"] += 1
        text = messages[-1]["content"]
        if text == "boom":
            raise RuntimeError("env crashed")
        if text == "slow":
            await asyncio.sleep(30)
        state["score"] = float(state["turns"])
        return state["turns"] >= state["kwargs"].get("limit", 2), f"turn {state['turns']}", 0.5, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        self.finalized.append(instance_id)
        await super().finalize_interaction(instance_id)


async def test_lifecycle_kwargs_and_message_objects():
    inter = CountingInteraction({"name": "count"})
    assert inter.name == "count"
    async with InteractionSession(inter, {"name": "count", "limit": 1}) as s:
        assert inter.instances[s.instance_id]["kwargs"] == {"limit": 1}  # "name" is not passed on
        assert await s.initial_observation() is None
        assert await s.respond([Message("user", "q"), Message("assistant", "a")]) == (True, "turn 1", 0.5, {})
        assert await s.score() == 1.0
        iid = s.instance_id
    assert inter.finalized == [iid] and inter.instances == {}


async def test_an_exception_ends_that_episode_only_and_finalizes():
    inter = CountingInteraction()

    async def episode(word):
        async with InteractionSession(inter, {"limit": 5}) as s:
            out = await s.respond([{"role": "assistant", "content": word}])
            return out, s.error

    (bad, err), (good, none) = await asyncio.gather(episode("boom"), episode("fine"))
    assert bad == (True, "", 0.0, {"error": "RuntimeError: env crashed"}) and err == "RuntimeError: env crashed"
    assert good == (False, "turn 1", 0.5, {}) and none is None
    assert len(inter.finalized) == 2 and inter.instances == {}


async def test_finalize_runs_on_cancellation_and_on_user_errors():
    inter = CountingInteraction()
    started = asyncio.Event()

    async def episode():
        async with InteractionSession(inter, {}) as s:
            started.set()
            await s.respond([{"role": "assistant", "content": "slow"}])

    task = asyncio.create_task(episode())
    await started.wait()
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    assert len(inter.finalized) == 1 and inter.instances == {}

    with pytest.raises(KeyError):
        async with InteractionSession(inter, {}):
            raise KeyError("agent loop bug")
    assert len(inter.finalized) == 2 and inter.instances == {}


async def test_hundreds_of_concurrent_episodes_do_not_share_state():
    inter = CountingInteraction()

    async def episode(i):
        async with InteractionSession(inter, {"limit": 1 + i % 3}) as s:
            turns = 0
            while True:
                turns += 1
                done, text, _, _ = await s.respond([{"role": "assistant", "content": str(i)}])
                await asyncio.sleep(0)
                if done:
                    return turns, text, await s.score()

    results = await asyncio.gather(*[episode(i) for i in range(400)])
    assert results == [(1 + i % 3, f"turn {1 + i % 3}", float(1 + i % 3)) for i in range(400)]
    assert inter.instances == {} and len(inter.finalized) == 400


async def test_default_generate_response_says_what_to_override():
    inter = BaseInteraction({})
    iid = await inter.start_interaction()
    with pytest.raises(NotImplementedError, match="BaseInteraction.generate_response"):
        await inter.generate_response(iid, [])
    assert await inter.calculate_score(iid) == 0.0 and await inter.calculate_score("unknown") == 0.0


async def test_a_non_finite_score_is_an_error_not_a_reward():
    """NaN/inf from generate_response or calculate_score ends the episode with an error (the agent loop
    classes it as an infrastructure failure) instead of reaching the advantages."""

    class NanInteraction(CountingInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            return False, "again", float("nan"), {}

        async def calculate_score(self, instance_id, **kwargs):
            return float("inf")

    inter = NanInteraction()
    async with InteractionSession(inter) as s:
        done, text, score, info = await s.respond([Message("assistant", "a")])
        assert done and score == 0.0 and "non-finite score (nan)" in info["error"] == s.error
    async with InteractionSession(inter) as s:
        assert await s.score() == 0.0 and s.error == "calculate_score returned a non-finite score (inf)"
