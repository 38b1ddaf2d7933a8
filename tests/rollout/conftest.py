"""Fixtures for rollout tests: a small ChatML tokenizer, a random tiny Qwen2, a rollout config."""

from __future__ import annotations

import pytest
import torch


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


def random_qwen2(vocab: int = 96, layers: int = 2, seed: int = 0):
    """A random Qwen2 built from a config (real transformers code, no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def small_model():
    return random_qwen2()
