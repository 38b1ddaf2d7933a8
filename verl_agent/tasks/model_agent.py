"""``verl-agent tasks run --agent model``: a model works on one task with bash, str_replace_editor and
submit, then the task's tests grade it.

* ``--model`` a local model (a folder, a HF id, ``tiny`` or ``smollm2``): the training agent loop itself
  (``AgentLoop`` on the HF engine, hermes tool-call format), token-exact as in a rollout;
* ``--model http://host:port/v1``: any OpenAI-compatible chat completions server with tool calling
  (``--served-model-name`` names the model; default: the first one the server lists).

Both run the same tools in the same container type and grade the same way as training does.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from verl_agent.data.harbor import HarborTask, task_sample
from verl_agent.tasks.env import using_pool

__all__ = ["TOOLS_YAML", "run_model"]

TOOLS_YAML = {"tools": [{"class_name": f"verl_agent.tasks.tools.{c}", "config": {"type": "native"}}
                        for c in ("BashTool", "EditorTool", "SubmitTool")]}


def _tools_file(folder: Path) -> Path:
    path = folder / "tools.yaml"
    path.write_text(yaml.safe_dump(TOOLS_YAML))
    return path


async def run_model(task: HarborTask, pool: Any, model: str | None, run: Any, *, max_turns: int = 20,
                    served_model_name: str | None = None) -> Any:  # fmt: skip
    """Fill `run` (a runner.TaskRun) from one model episode; infrastructure failures become its outcome."""
    t0 = time.perf_counter()
    with using_pool(pool):
        if model and model.startswith(("http://", "https://")):
            reward, info = await _openai_episode(task, model, served_model_name, max_turns)
        else:
            reward, info = await _local_episode(task, model or "tiny", max_turns)
    run.timings["agent_s"] = time.perf_counter() - t0
    run.agent_output = info.get("transcript", "")
    if info.get("outcome") == "infra_failure":
        run.outcome, run.cause, run.error = "infra_failure", info.get("cause"), info.get("error")
    else:
        run.reward = reward
    run.metrics.update({k: v for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return run


async def _local_episode(task: HarborTask, model: str, max_turns: int) -> tuple[float, dict]:
    from verl_agent.config import load_config
    from verl_agent.rollout.build import build_rollout, sampling_params

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={_tools_file(Path(tmp))}",
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max_turns}",
            "data.max_prompt_length=4096", "data.max_response_length=4096", "trainer.device=auto",
        ])
        parts = build_rollout(cfg)
        try:
            sp = sampling_params(cfg.actor_rollout_ref.rollout, cfg.data, seed=0, validate=True)
            traj = (await parts.agent.run_one(task_sample(task), sp))[-1]
        finally:
            close = getattr(parts.engine, "close", None)
            if close is not None:
                res = close()
                if hasattr(res, "__await__"):
                    await res
    info = {"outcome": traj.outcome, "cause": traj.cause, "error": traj.error, "turns": len(traj.turns),
            "transcript": "\n".join(f"[{m.role}] {m.content}" for m in traj.messages)[-4000:]}
    return traj.reward, info


async def _openai_episode(task: HarborTask, url: str, name: str | None, max_turns: int) -> tuple[float, dict]:
    import httpx

    from verl_agent.protocol import ToolCall
    from verl_agent.tools import ToolSession, load_tools

    with tempfile.TemporaryDirectory() as tmp:
        tools = load_tools(_tools_file(Path(tmp)))
    sample = task_sample(task)
    messages: list[dict[str, Any]] = [m.to_chat() for m in sample.messages]
    base = url.rstrip("/")
    async with httpx.AsyncClient(timeout=600) as http, ToolSession(tools, sample.tools_kwargs, timeout=600) as s:
        name = name or (await http.get(f"{base}/models")).json()["data"][0]["id"]
        for turn in range(max_turns):
            resp = await http.post(f"{base}/chat/completions", json={"model": name, "messages": messages,
                                                                      "tools": s.schemas(), "temperature": 0})
            resp.raise_for_status()
            msg = resp.json()["choices"][0]["message"]
            messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
            calls = msg.get("tool_calls") or []
            if not calls:
                break
            for c in calls:
                args = c["function"].get("arguments") or "{}"
                res = await s.call(ToolCall(c["function"]["name"], json.loads(args) if isinstance(args, str)
                                            else args, c.get("id", "")))
                if res.infra:
                    return 0.0, {"outcome": "infra_failure", "cause": res.infra, "error": res.text}
                messages.append({"role": "tool", "tool_call_id": c.get("id", ""), "content": res.text})
            if any(c["function"]["name"] == "submit" for c in calls):
                break
        try:
            reward = await s.calc_reward()
        except RuntimeError as e:
            cause = getattr(e.__cause__, "cause", None) or "reward_error"
            return 0.0, {"outcome": "infra_failure", "cause": cause, "error": str(e)}
    transcript = "\n".join(f"[{m['role']}] {m.get('content') or m.get('tool_calls')}" for m in messages)
    return reward, {"outcome": "ok", "turns": turn + 1, "transcript": transcript[-4000:]}


