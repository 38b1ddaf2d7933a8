"""Overhead of the OpenAI-compatible recording endpoint. Prints a table and one JSON line.

  python bench/proxy.py                        # 64 concurrent agents x 4 calls, httpx and openai clients
  python bench/proxy.py --agents 256 --turns 8

Each agent runs one calculator conversation of --turns model calls (tool call, tool result,
..., final answer) against a scripted engine that answers instantly, so every millisecond is
ours: HTTP (uvicorn + FastAPI), request validation, history matching, token-exact chat
encoding and recording. Three runs of the same conversations:
  native   the native AgentLoop-style work without HTTP: the recorder driven in-process
  httpx    agents post raw JSON with httpx (the endpoint's cost as a server sees it)
  openai   agents use the official `openai` SDK (adds the SDK's own client-side cost)
  remote   httpx agents in a child process: this process only serves, so its CPU time per call is
           the endpoint's own cost (HTTP parsing, validation, encoding, recording), no client's
"overhead per call" = (time of a run - time of the in-process run) / calls, for the wall time and
for the process's CPU time (server and clients share one event loop, one core: the figure is the
throughput cost, not one request's latency, and it includes the client library's own work). CPU
time is the steadier figure on a shared machine: waiting for a core does not count. Each figure
is the lowest of --repeat runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*37"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


def _setup(turns: int):
    from transformers import AutoTokenizer

    from verl_agent.models.tiny import build_tiny
    from verl_agent.parsers import get_parser
    from verl_agent.rollout.openai.openai_server import OpenAIServer
    from verl_agent.engine.backends.scripted import ScriptedEngine

    tok = AutoTokenizer.from_pretrained(build_tiny())

    engine = ScriptedEngine(tok, lambda ids, sp: CALL, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    server = OpenAIServer(engine, tok, get_parser("hermes"), max_prompt_length=4096, max_response_length=8192)
    return tok, engine, server


async def _agent_httpx(client, messages, turns):
    import httpx  # noqa: F401

    for _ in range(turns):
        r = await client.post("/chat/completions", json={"model": "policy", "messages": messages, "tools": TOOLS})
        msg = r.json()["choices"][0]["message"]
        messages = [*messages, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "444"}]


async def _agent_openai(client, messages, turns):
    for _ in range(turns):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages = [*messages, msg.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "444"}]  # fmt: skip


async def _agent_inprocess(server, sid, messages, turns):
    from verl_agent.rollout.openai.openai_wire import completion_body

    for _ in range(turns):
        req, reply = await server.complete(sid, {"model": "policy", "messages": messages, "tools": TOOLS})
        msg = json.loads(json.dumps(completion_body(reply, req, "x", server.tokenizer)))["choices"][0]["message"]
        messages = [*messages, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "444"}]


class _remote_agents:
    """httpx agents in a child process (`--child`); awaiting this waits for them and keeps their wall time."""

    def __init__(self, urls: list[str], turns: int) -> None:
        self.urls, self.turns, self.wall, self.idle_cpu = urls, turns, 0.0, 0.0

    def __await__(self):
        return self._go().__await__()

    async def _go(self) -> None:
        c0 = time.process_time()
        proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--child", str(self.turns),
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        proc.stdin.write((json.dumps(self.urls) + "\n").encode())
        await proc.stdin.drain()
        await proc.stdout.readline()  # "ready": clients built, imports done
        self.idle_cpu = time.process_time() - c0  # what this process spent while the child started (not the endpoint's)
        t0 = time.perf_counter()
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        self.wall = time.perf_counter() - t0
        assert line.strip() == b"done" and await proc.wait() == 0, line


def _child(turns: int) -> None:
    import httpx

    async def go() -> None:
        urls = json.loads(sys.stdin.readline())
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients = [httpx.AsyncClient(base_url=u, limits=limits) for u in urls]
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        user = [{"role": "user", "content": "What is 12 * 37?"}]
        await asyncio.gather(*(_agent_httpx(c, user, turns) for c in clients))
        print("done", flush=True)
        for c in clients:
            await c.aclose()

    asyncio.run(go())


async def _run(kind: str, agents: int, turns: int) -> tuple[float, float, int]:
    import httpx

    from verl_agent.engine.contract import SamplingParams

    _tok, _engine, server = _setup(turns)
    await server.start()
    recs = [server.open_session(SamplingParams(), uid=str(i)) for i in range(agents)]
    user = [{"role": "user", "content": "What is 12 * 37?"}]
    clients = []
    if kind == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients = [httpx.AsyncClient(base_url=server.base_url(r.sid), limits=limits) for r in recs]
        jobs = [_agent_httpx(c, user, turns) for c in clients]
    elif kind == "openai":
        from openai import AsyncOpenAI

        clients = [AsyncOpenAI(base_url=server.base_url(r.sid), api_key=r.sid, max_retries=0) for r in recs]
        jobs = [_agent_openai(c, user, turns) for c in clients]
    elif kind == "remote":  # the agents run in another process: this process's CPU time is the endpoint's alone
        jobs = [_remote_agents([server.base_url(r.sid) for r in recs], turns)]
    else:
        jobs = [_agent_inprocess(server, r.sid, user, turns) for r in recs]
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*jobs)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if kind == "remote":
        dt, cpu = jobs[0].wall, cpu - jobs[0].idle_cpu  # the window in which the child's agents ran
    for c in clients:
        await (c.aclose() if kind == "httpx" else c.close())
    calls = sum(r.counts["calls"] for r in recs)
    assert calls == agents * turns and all(len(r.segments) == 1 for r in recs), "lost or split sessions"
    await server.stop()
    return dt, cpu, calls


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(int(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", default="inprocess,httpx,openai,remote")
    ap.add_argument("--repeat", type=int, default=3, help="runs per client; the fastest counts (shared CPUs are noisy)")
    a = ap.parse_args()
    asyncio.run(_run("httpx", 8, 2))  # warm-up (imports, template compilation)
    res: dict[str, float] = {"agents": a.agents, "turns": a.turns}
    base: tuple[float, float] | None = None
    print(f"{'client':<10} {'calls':>6} {'wall ms/call':>13} {'overhead':>9} {'cpu ms/call':>12} {'overhead':>9}")
    for kind in a.clients.split(","):
        runs = [asyncio.run(_run(kind, a.agents, a.turns)) for _ in range(a.repeat)]
        calls = runs[0][2]
        wall, cpu = (1000 * min(r[i] for r in runs) / calls for i in (0, 1))
        base = (wall, cpu) if kind == "inprocess" else base
        over = (wall - base[0], cpu - base[1]) if base is not None and kind != "inprocess" else (0.0, 0.0)
        print(f"{kind:<10} {calls:>6} {wall:>13.3f} {over[0]:>9.3f} {cpu:>12.3f} {over[1]:>9.3f}")
        res[f"{kind}_ms_per_call"], res[f"{kind}_cpu_ms_per_call"] = round(wall, 3), round(cpu, 3)
        if kind != "inprocess":
            res[f"{kind}_http_overhead_ms_per_call"] = round(over[0], 3)
            res[f"{kind}_http_overhead_cpu_ms_per_call"] = round(over[1], 3)
    print(json.dumps({"bench": "proxy", **res}))


if __name__ == "__main__":
    main()
