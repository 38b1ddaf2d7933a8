"""check_interaction names the broken rule of a user's interaction."""

import pytest

from verl_agent.interactions import (
    BaseInteraction,
    InteractionContractError,
    check_interaction,
    check_interaction_async,
)


class Good(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "ok", 1.0, {}


def broken(result=None, leak=False, shared=False):
    class B(BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            if shared:  # state on self instead of per instance: the two checked instances diverge
                self.n = getattr(self, "n", 0) + 1
                return True, str(self.n), 0.0, {}
            return result

        async def finalize_interaction(self, instance_id, **kwargs):
            if not leak:
                await super().finalize_interaction(instance_id)

    return B({})


def test_good_interaction_passes():
    out = check_interaction(Good({}), ["hi"])
    assert out["transcript"] == [{"reply": "hi", "done": True, "text": "ok", "score": 1.0, "info": {}}]


@pytest.mark.parametrize(
    "inter, fragment",
    [
        (broken(result=(True, "x", 0.0)), "must return (done, text, score, info)"),
        (broken(result=(1, "x", 0.0, {})), "done must be a bool"),
        (broken(result=(True, None, 0.0, {})), "response text must be a str"),
        (broken(result=(True, "x", "1", {})), "turn score must be a number"),
        (broken(result=(True, "x", 0.0, None)), "info must be a dict"),
        (broken(result=(True, "x", 0.0, {}), leak=True), "finalize_interaction left state behind"),
        (broken(shared=True), "two instances with the same inputs diverged"),
    ],
)
async def test_broken_rules_are_named(inter, fragment):
    with pytest.raises(InteractionContractError) as e:
        await check_interaction_async(inter, ["a"], deterministic=True)
    assert fragment in str(e.value)
