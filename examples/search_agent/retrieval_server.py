"""A retrieval service with the API of verl's / Search-R1's local retriever, over this example's corpus (BM25).

    python examples/search_agent/retrieval_server.py --port 8000     # then POST /retrieve

Request: ``{"queries": [...], "topk": 3, "return_scores": true}``; answer: ``{"result": [[{"document":
{"id", "contents": "Title\\ntext"}, "score": s}, ...], ...]}``, one list per query (without scores
when ``return_scores`` is false). A verl search tool YAML (``class_name: verl.tools.search_tool.SearchTool``,
``retrieval_service_url: http://127.0.0.1:8000/retrieve``) then works against it unchanged: see
tools_verl.yaml next to this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

HERE = Path(__file__).resolve().parent


def _bm25_class() -> type:
    """retriever.BM25 of this folder (examples are not packages)."""
    spec = importlib.util.spec_from_file_location("search_agent_retriever", HERE / "retriever.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BM25


class QueryRequest(BaseModel):
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def make_app(corpus_path: str | Path = HERE / "data" / "corpus.jsonl", default_topk: int = 3) -> FastAPI:
    """The FastAPI app: BM25 over a JSONL corpus of {"id", "title", "text"}."""
    docs = [json.loads(line) for line in Path(corpus_path).read_text().splitlines() if line.strip()]
    index = _bm25_class()([f"{d['title']} {d['text']}" for d in docs])
    app = FastAPI()
    app.state.requests = []  # what clients sent, for tests and debugging

    @app.post("/retrieve")
    def retrieve(req: QueryRequest) -> dict[str, Any]:
        app.state.requests.append(req.model_dump())
        result = []
        for query in req.queries:
            hits = index.search(query, req.topk or default_topk)
            found = [{"id": docs[i]["id"], "contents": f"{docs[i]['title']}\n{docs[i]['text']}"} for _, i in hits]
            result.append([{"document": d, "score": s} for d, (s, _) in zip(found, hits)] if req.return_scores
                          else found)
        return {"result": result}

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(HERE / "data" / "corpus.jsonl"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--topk", type=int, default=3)
    args = ap.parse_args(argv)
    uvicorn.run(make_app(args.corpus, args.topk), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
