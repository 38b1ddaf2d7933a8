"""``search``: query a retrieval service the way verl's SearchTool does (Search-R1's local retriever API).

Loaded by verl's class path ``verl.tools.search_tool.SearchTool`` (verl_agent.verl_compat) or by
``verl_agent.tools.retrieval.RetrievalSearchTool``. The model calls ``search(query_list=[...])``; one
``POST retrieval_service_url`` carries ``{"queries": [...], "topk": k, "return_scores": true}`` and the
service answers ``{"result": [[{"document": {"contents": "Title\\ntext", ...}, "score": s}, ...], ...]}``
(one list per query). The model reads verl's text: ``{"result": "Doc 1 (Title: T)\\ntext\\n\\nDoc 2 ..."}``,
the queries' blocks joined by ``\\n---\\n``.

Config (tool YAML ``config:``), verl's keys:
  retrieval_service_url    required, e.g. http://127.0.0.1:8000/retrieve
  topk                     passages per query (default 3)
  timeout                  seconds per HTTP request (default 30)
  num_workers, rate_limit  cap on requests in flight from this tool object (the smaller one wins;
                           default 120). With ``enable_global_rate_limit: false`` only num_workers
                           counts. verl shares the rate limit over the whole cluster through a Ray
                           actor; here it holds per rollout worker (each has its own tool object).
  max_retries              our extension: retries of a connection error, timeout or HTTP 5xx (default 3)
A ``query_list`` that is missing or not a list of strings is the model's error: it reads an error
text. A service that stays unreachable, answers an error or a malformed body is an infrastructure
failure (ToolUnavailable): that trajectory is kept out of the loss.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolUnavailable
from verl_agent.tools.schema import OpenAIFunctionToolSchema

__all__ = ["RetrievalSearchTool", "format_results"]

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {"type": "array", "items": {"type": "string"},
                               "description": "A list of fully-formed semantic queries."},
            },
            "required": ["query_list"],
        },
    },
}
_RETRY_STATUS = (500, 502, 503, 504)
_RETRY_DELAY = 0.5  # seconds, times the attempt number


def _result(text: str) -> str:
    return json.dumps({"result": text}, ensure_ascii=False)


def format_results(per_query: list[list[dict[str, Any]]]) -> tuple[str, int]:
    """verl's text for the model (first line of a document's contents is its title) and the passage count."""
    blocks, total = [], 0
    for hits in per_query:
        docs = []
        for i, hit in enumerate(hits, 1):
            title, _, text = str(hit["document"]["contents"]).partition("\n")
            docs.append(f"Doc {i} (Title: {title})\n{text}")
        blocks.append("\n\n".join(docs).strip())
        total += len(hits)
    return "\n---\n".join(blocks), total


class RetrievalSearchTool(BaseTool):
    """A stateless client of a retrieval service; one HTTP request per call carries all its queries."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        c = self.config
        self.url = str(c.get("retrieval_service_url") or "")
        if not self.url:
            raise ValueError(f"{self.name}: config 'retrieval_service_url' is required "
                             "(e.g. http://127.0.0.1:8000/retrieve)")
        self.topk = int(c.get("topk", 3))
        self.timeout = float(c.get("timeout", 30))
        self.max_retries = int(c.get("max_retries", 3))
        caps = [int(c.get("num_workers", 120))]
        if c.get("enable_global_rate_limit", True):
            caps.append(int(c.get("rate_limit", 120)))
        if self.topk < 1 or self.timeout <= 0 or self.max_retries < 0 or min(caps) < 1:
            raise ValueError(f"{self.name}: topk, num_workers and rate_limit must be >= 1, timeout > 0 "
                             "and max_retries >= 0")
        self._slots = asyncio.Semaphore(min(caps))
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout),
                                       limits=httpx.Limits(max_connections=min(caps)))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            text = "Error: 'query_list' is missing, empty, or not a list of strings in parameters."
            return ToolResponse(text=_result(text)), 0.0, {"query_count": 0, "status": "bad_arguments"}
        async with self._slots:
            per_query = await self._post(queries)
        if not any(per_query):
            return ToolResponse(text=_result("No search results found.")), 0.0, \
                {"query_count": len(queries), "status": "no_results", "total_results": 0}
        text, total = format_results(per_query)
        return ToolResponse(text=_result(text)), 0.0, \
            {"query_count": len(queries), "status": "success", "total_results": total}

    async def _post(self, queries: list[str]) -> list[list[dict[str, Any]]]:
        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(_RETRY_DELAY * attempt)
            try:
                resp = await self._http.post(self.url, json=payload)
            except httpx.TransportError as e:  # connection refused/reset, timeouts
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code in _RETRY_STATUS:
                last = f"HTTP {resp.status_code}"
                continue
            if resp.status_code != 200:
                raise ToolUnavailable(f"retrieval service {self.url} answered HTTP {resp.status_code}: "
                                      f"{resp.text[:200]}", cause="retrieval_error")
            return self._parse(resp, len(queries))
        raise ToolUnavailable(f"retrieval service {self.url} failed {self.max_retries + 1} times: {last}",
                              cause="retrieval_unavailable")

    def _parse(self, resp: httpx.Response, n: int) -> list[list[dict[str, Any]]]:
        try:
            result = resp.json()["result"]
            ok = isinstance(result, list) and len(result) == n and all(
                isinstance(hits, list) and all(isinstance(h["document"]["contents"], str) for h in hits)
                for hits in result)
        except (ValueError, KeyError, TypeError) as e:
            ok, result = False, f"{type(e).__name__}: {e}"
        if not ok:
            shape = "{'result': [[{'document': {'contents': str}, 'score': float}, ...]]}"
            raise ToolUnavailable(f"retrieval service {self.url} answered a body that is not {shape} with "
                                  f"{n} lists: {str(result)[:200]}", cause="retrieval_error")
        return result

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None
