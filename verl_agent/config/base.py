"""What every config section shares: `Section` (unknown keys are refused) and `ConfigError`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "Section"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and what is wrong."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
