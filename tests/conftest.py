"""Shared fixtures: the embedded tiny model (built once per machine and cached), a small ChatML tokenizer,
a random tiny Qwen2, a rollout config."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_helpers import random_qwen2


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Path of the embedded tiny model (built on first use, then cached; no downloads)."""
    from verl_agent.models.tiny import build_tiny

    return Path(build_tiny())


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The project's ChatML tokenizer recipe, trained in well under a second on a small corpus."""
    from verl_agent.models.tokenizer import train_tokenizer

    corpus = [
        "What is 12 * 37? The answer is 444. Let me use the calculator tool first.",
        '{"name": "calculator", "arguments": {"expression": "12*37"}}',
        "You are a helpful assistant. Tools: call functions with JSON. Error: something went wrong.",
        "Please try again. Correct! Wrong answer, the result is different. Hello world.",
    ] * 20
    return train_tokenizer(corpus, vocab_size=400)


@pytest.fixture
def rollout_cfg():
    from verl_agent.config import RolloutConfig

    return RolloutConfig()


@pytest.fixture(scope="module")
def small_model():
    return random_qwen2()
