"""Faults that live inside one trajectory, loaded by the run through its ordinary extension points.

- `SandboxCalculator`: the calculator tool the tiny model calls, evaluated in the real sandbox
  (a code tool: SandboxFusionTool runs ``print(eval(expression))``); 3 calls in 10 hang forever
  instead (past multi_turn.tool_timeout). Every call and its end are appended to ``config.log``
  so the test can see when the sandbox is in use and what became of each call.
- `reward`: the calculator reward, raising on the prompts whose answer hashes to 0 mod 5.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from pathlib import Path
from typing import Any

from verl_agent.models.calculator_task import calculator_reward
from verl_agent.sandbox.client import ClientLimits, SandboxClient
from verl_agent.tools.errors import ToolUnavailable
from verl_agent.tools.sandbox_fusion import SandboxFusionTool

HANG_EVERY = (1, 4, 7)  # call numbers mod 10 that hang: 30 %


class SandboxCalculator(SandboxFusionTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        self.log = Path(self.config["log"])
        # Few, short retries: an outage must surface as sandbox_unavailable well within tool_timeout.
        self.client = SandboxClient(self.url, ClientLimits(max_retries=1, backoff_base=0.05, connect_timeout=2.0,
                                                           max_concurrency=16, max_connections=16))
        self.calls = self.in_flight = self.max_in_flight = 0

    def _note(self, event: str, n: int) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({"event": event, "call": n, "t": time.time(), "in_flight": self.in_flight,
                                "max_in_flight": self.max_in_flight}) + "\n")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        self.calls += 1
        n = self.calls
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if n % 10 in HANG_EVERY:
                self._note("hang", n)
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self._note("cancelled", n)
                    raise
            self._note("call", n)
            code = f"print(eval({str(parameters.get('expression', ''))!r}))"
            try:
                out = await super().execute(instance_id, {"code": code}, **kwargs)
            except ToolUnavailable:
                self._note("unavailable", n)
                raise
            self._note("ok", n)
            return out
        finally:
            self.in_flight -= 1


def reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    if zlib.crc32(str(ground_truth).encode()) % 5 == 0:
        raise ZeroDivisionError(f"injected reward fault on {ground_truth}")
    return calculator_reward(data_source, solution_str, ground_truth, extra_info)
