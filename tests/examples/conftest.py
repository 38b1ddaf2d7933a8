"""Fixtures of the example tests: the tiny model's tokenizer and a fresh HF engine per test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture
async def tiny_engine(tiny_model_path):
    """The tiny model on the HF engine, one per test."""
    from verl_agent.engine.backends.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_path), device="cpu", max_num_seqs=16)
    yield engine
    await engine.close()
