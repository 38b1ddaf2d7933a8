"""A local search tool: BM25 over the small corpus shipped with this example (no network).

Search-R1 style: the model searches as often as it needs, several queries in one turn
when a question has several parts, then answers inside <answer>...</answer>.
Here the searches are ordinary tool calls, so any tool-calling model and chat template works.

Tool YAML config: `corpus_path` (JSONL of {"id", "title", "text"}, relative to this file
unless absolute) and `top_k` (passages per query).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from verl_agent.tools import BaseTool, ToolResponse

_WORD = re.compile(r"[a-z0-9]+")

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the encyclopedia of the Velmar Islands. Returns the best matching passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "Keywords, e.g. 'Brask founded'."}},
            "required": ["query"],
        },
    },
}


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 (k1, b) over a list of documents; `search` returns (score, index) best first."""

    def __init__(self, docs: list[str], k1: float = 1.2, b: float = 0.75):
        self.k1, self.b = k1, b
        self.tfs = [Counter(tokenize(d)) for d in docs]
        self.lengths = [sum(tf.values()) for tf in self.tfs]
        self.avg_len = sum(self.lengths) / max(1, len(docs))
        df = Counter(term for tf in self.tfs for term in tf)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def score(self, query: list[str], i: int) -> float:
        tf, norm = self.tfs[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg_len)
        return sum(self.idf.get(t, 0.0) * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in query if t in tf)

    def search(self, query: str, k: int) -> list[tuple[float, int]]:
        terms = tokenize(query)
        scored = [(self.score(terms, i), i) for i in range(len(self.tfs))]
        return sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))[:k]


class SearchTool(BaseTool):
    """search(query): the top_k passages of the corpus by BM25. Stateless, so no create/release needed."""

    def __init__(self, config: dict[str, Any], tool_schema: Any = None):
        super().__init__(config, tool_schema)
        path = Path(self.config.get("corpus_path", "data/corpus.jsonl"))
        path = path if path.is_absolute() else Path(__file__).parent / path
        self.docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        self.top_k = int(self.config.get("top_k", 3))
        self.index = BM25([f"{d['title']} {d['text']}" for d in self.docs])

    def get_openai_tool_schema(self):
        from verl_agent.tools import OpenAIFunctionToolSchema

        return self.tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        hits = self.index.search(parameters["query"], self.top_k)
        if not hits:
            return ToolResponse(text="No results."), 0.0, {"hits": 0}
        lines = [f"[{n}] {self.docs[i]['title']}: {self.docs[i]['text']}" for n, (_, i) in enumerate(hits, 1)]
        return ToolResponse(text="\n".join(lines)), 0.0, {"hits": len(hits)}
