"""Fixtures of the verl drop-in tests: a real retrieval server (verl's /retrieve API) on loopback."""

from __future__ import annotations

import pytest
from verl_files import RetrievalServer, load_repo_module


@pytest.fixture(scope="module")
def retrieval():
    """examples/search_agent/retrieval_server.py's app (BM25 over the Velmar corpus) served by uvicorn."""
    app = load_repo_module("examples/search_agent/retrieval_server.py").make_app()
    with RetrievalServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))
