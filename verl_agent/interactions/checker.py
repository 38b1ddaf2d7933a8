"""check_interaction: run the BaseInteraction contract once on a user's interaction.

    from verl_agent.interactions import check_interaction
    check_interaction(MyInteraction({}), replies=["I guess 50", "75"], ground_truth="75")

Runs two instances interleaved (state must not leak between them), checks every
return type, that `finalize_interaction` drops the instance's state, and, for a
GymInteraction, Gymnasium's own `check_env` on a fresh env. Raises
InteractionContractError naming the broken rule; returns one episode's transcript.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl_agent.interactions.base import BaseInteraction
from verl_agent.interactions.errors import InteractionContractError
from verl_agent.interactions.gym import GymInteraction

__all__ = ["check_interaction", "check_interaction_async"]


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise InteractionContractError(msg)


def _check_step(out: Any, where: str) -> tuple[bool, str, float, dict]:
    _expect(isinstance(out, tuple) and len(out) == 4, f"{where} must return (done, text, score, info), got {out!r}")
    done, text, score, info = out
    _expect(isinstance(done, bool), f"{where}: done must be a bool, got {type(done).__name__}")
    _expect(isinstance(text, str), f"{where}: response text must be a str, got {type(text).__name__}")
    _expect(isinstance(score, (int, float)), f"{where}: turn score must be a number, got {score!r}")
    _expect(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
    return out


async def _episode(inter: Any, iid: str, replies: list[str], prompt: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    transcript = []
    for i, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": reply})
        done, text, score, info = _check_step(
            await inter.generate_response(iid, list(messages)), f"generate_response (turn {i + 1})"
        )
        transcript.append({"reply": reply, "done": done, "text": text, "score": score, "info": info})
        if done:
            break
        messages.append({"role": "user", "content": text})
    return transcript


async def check_interaction_async(
    interaction: Any, replies: list[str], prompt: str = "Start.", deterministic: bool = False, **start_kwargs: Any
) -> dict[str, Any]:
    """Check start/generate_response/calculate_score/finalize on two interleaved instances.

    With `deterministic=True` (implied by a `seed` start kwarg) both instances must reply identically.
    """
    _expect(bool(replies), "give at least one assistant reply to check generate_response")
    if isinstance(interaction, GymInteraction):
        from gymnasium.utils.env_checker import check_env

        env = interaction.make_env()
        check_env(getattr(env, "unwrapped", env), skip_render_check=True)
    a = await interaction.start_interaction(None, **start_kwargs)
    b = await interaction.start_interaction("check-fixed-id", **start_kwargs)
    _expect(isinstance(a, str) and a != "", f"start_interaction(None) must return a new instance id, got {a!r}")
    _expect(b == "check-fixed-id", f"start_interaction('check-fixed-id') must return that id, got {b!r}")
    try:
        ta, tb = await asyncio.gather(
            _episode(interaction, a, replies, prompt), _episode(interaction, b, replies, prompt)
        )
        sa = await interaction.calculate_score(a)
        _expect(isinstance(sa, (int, float)), f"calculate_score must return a number, got {sa!r}")
        if deterministic or "seed" in start_kwargs:
            _expect([t["text"] for t in ta] == [t["text"] for t in tb], "two instances with the same inputs diverged")
    finally:
        await interaction.finalize_interaction(a)
        await interaction.finalize_interaction(b)
    if isinstance(interaction, BaseInteraction):
        left = {a, b} & set(interaction.instances)
        _expect(not left, f"finalize_interaction left state behind for {sorted(left)}")
    return {"instance_id": a, "transcript": ta, "score": float(sa)}


def check_interaction(
    interaction: Any, replies: list[str], prompt: str = "Start.", deterministic: bool = False, **start_kwargs: Any
) -> dict[str, Any]:
    """Synchronous check_interaction_async (call that one from inside a running event loop)."""
    return asyncio.run(check_interaction_async(interaction, replies, prompt, deterministic, **start_kwargs))
