"""BaseInteraction: an environment that answers the model, one object serving many trajectories.

Contract (what the framework calls, and when) — verl's async API
-----------------------------------------------------------------
1. ``instance_id = await start_interaction(instance_id, **interaction_kwargs)``
   once per trajectory. ``interaction_kwargs`` is the dataset row's
   ``extra_info.interaction_kwargs`` without ``name`` (which picked this
   interaction), e.g. ``ground_truth``. Returns the id (a fresh uuid if None was given).
2. ``done, text, turn_score, info = await generate_response(instance_id, messages)``
   after each assistant turn. ``messages`` is the whole conversation so far as
   OpenAI-style dicts, ending with the model's message. ``text`` is sent back as
   the next user message unless ``done``; ``turn_score`` is that turn's score.
3. ``score = await calculate_score(instance_id)`` once, at the end: the
   trajectory's reward.
4. ``await finalize_interaction(instance_id)`` exactly once per start, also when
   the trajectory failed or was cancelled (InteractionSession guarantees it).
   Drop the instance's state here.

Optional: ``initial_observation(instance_id) -> str | None``: a first user message
the framework appends after the dataset prompt (Gymnasium-style envs return the
``reset`` observation here). Default None.

Keep per-trajectory state in ``self.instances[instance_id]``, never on ``self``
directly: calls of different trajectories interleave. For the Gymnasium face
(``reset``/``step``) see ``verl_agent.interactions.gym``. Check a subclass with
``verl_agent.interactions.check_interaction``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["BaseInteraction", "InteractionSession"]

logger = logging.getLogger(__name__)


class BaseInteraction:
    """Base class of interactions; override `generate_response` (and the other hooks as needed)."""

    def __init__(self, config: dict[str, Any] | None = None):
        self.config: dict[str, Any] = dict(config or {})
        self.name: str = str(self.config.get("name") or type(self).__name__)
        self.instances: dict[str, Any] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Create per-trajectory state (default: the kwargs, a turn counter and a score)."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        self.instances[instance_id] = {"kwargs": kwargs, "turns": 0, "score": 0.0}
        return instance_id

    async def initial_observation(self, instance_id: str) -> str | None:
        """A first user message to append after the dataset prompt, or None (the default)."""
        return None

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """React to the model's last message: (done, reply text, turn score, info). Override this."""
        raise NotImplementedError(f"{type(self).__name__}.generate_response is not implemented")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The trajectory's reward (default: the instance state's "score", else 0.0)."""
        state = self.instances.get(instance_id)
        return float(state.get("score", 0.0)) if isinstance(state, dict) else 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the per-trajectory state; called once per start, also after errors and cancellation."""
        self.instances.pop(instance_id, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def last_assistant_text(messages: Sequence[dict[str, Any]]) -> str:
    """Content of the last assistant message ("" if there is none)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content") or "")
    return ""


class InteractionSession:
    """One trajectory's use of an interaction: start on enter, finalize on exit (always, shielded).

        async with InteractionSession(interaction, sample.interaction_kwargs) as s:
            first = await s.initial_observation()
            done, text, score, info = await s.respond(messages)
            reward = await s.score()

    An exception in the interaction ends that episode (done=True, info["error"])
    instead of propagating; cancellation propagates.
    """

    def __init__(self, interaction: Any, interaction_kwargs: dict[str, Any] | None = None):
        self.interaction = interaction
        self.kwargs = {k: v for k, v in (interaction_kwargs or {}).items() if k != "name"}
        self.instance_id: str | None = None
        self.error: str | None = None
        self.cause: str | None = None  # an exception's own `cause` attribute (e.g. "verifier_timeout"), if any

    async def __aenter__(self) -> InteractionSession:
        iid = await self.interaction.start_interaction(str(uuid.uuid4()), **self.kwargs)
        self.instance_id = iid[0] if isinstance(iid, tuple) else iid
        return self

    async def initial_observation(self) -> str | None:
        fn = getattr(self.interaction, "initial_observation", None)
        return await fn(self.instance_id) if fn is not None else None

    async def respond(self, messages: Sequence[Any]) -> tuple[bool, str, float, dict[str, Any]]:
        msgs = [m.to_chat() if hasattr(m, "to_chat") else m for m in messages]
        try:
            done, text, score, info = await self.interaction.generate_response(self.instance_id, msgs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.cause = self.cause or getattr(e, "cause", None)
            return self._failed(f"{type(e).__name__}: {e}")
        value = float(score or 0.0)
        if not math.isfinite(value):
            return self._failed(f"generate_response returned a non-finite score ({value})")
        return bool(done), str(text or ""), value, dict(info or {})

    def _failed(self, error: str) -> tuple[bool, str, float, dict[str, Any]]:
        self.error = error
        logger.warning("interaction %r failed: %s", getattr(self.interaction, "name", "?"), error)
        return True, "", 0.0, {"error": error}

    async def score(self) -> float:
        try:
            value = float(await self.interaction.calculate_score(self.instance_id) or 0.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
            self.cause = self.cause or getattr(e, "cause", None)
            logger.warning("interaction calculate_score failed: %s", e)
            return 0.0
        if not math.isfinite(value):
            self.error = self.error or f"calculate_score returned a non-finite score ({value})"
            return 0.0
        return value

    async def __aexit__(self, *exc: Any) -> None:
        if self.instance_id is not None:
            await asyncio.shield(self._finalize())

    async def _finalize(self) -> None:
        iid, self.instance_id = self.instance_id, None
        try:
            await self.interaction.finalize_interaction(iid)
        except Exception:
            logger.exception("interaction finalize_interaction(%s) failed", iid)
