"""Exceptions raised by verl_agent.interactions.

    InteractionError                 base of everything below
    ├── InteractionConfigError       load time: bad YAML, missing class, duplicate name, unknown
    │                                `interaction_kwargs.name`. Also a ValueError; names file and entry.
    └── InteractionContractError     check_interaction found a broken rule of the BaseInteraction
                                     contract. Also an AssertionError.

An exception inside a user's `generate_response` is not wrapped here:
InteractionSession ends that one episode (done=True, info["error"]) and still
finalizes it; other trajectories are unaffected.
"""

from __future__ import annotations


class InteractionError(Exception):
    """Base class of interaction errors."""


class InteractionConfigError(InteractionError, ValueError):
    """The interaction registry or a selection from it is invalid."""


class InteractionContractError(InteractionError, AssertionError):
    """An interaction breaks the BaseInteraction contract (raised by check_interaction)."""
