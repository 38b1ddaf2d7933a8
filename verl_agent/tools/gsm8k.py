"""``calc_gsm8k_reward``: the model submits its GSM8K answer and is told whether it is right (verl's Gsm8kTool).

Loaded by verl's class path ``verl.tools.gsm8k_tool.Gsm8kTool`` (verl_agent.verl_compat) or by
``verl_agent.tools.gsm8k.Gsm8kTool``. verl's example YAML gives ``config: {type: native}`` and the
schema (one string parameter ``answer``); without a ``tool_schema`` this one is used. The tool reads
no other ``config`` key, as verl's does not.

Per trajectory (``create_kwargs`` from the row's ``extra_info.tools_kwargs.calc_gsm8k_reward``):
``ground_truth`` is required. Each call stores ``#### <answer>`` and scores it with verl's flexible
GSM8K rule (verl_agent.gsm8k); the step reward is 0.0 when the score went up, else -0.05 (a penalty
for resubmitting without improvement); the model reads ``Current parsed answer='72' reward=1.0``.
``calc_reward`` is the score of the last submission.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl_agent.gsm8k import gsm8k_score
from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.schema import OpenAIFunctionToolSchema

__all__ = ["Gsm8kTool"]

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, "
                       "0.0 if parsed answer is incorrect or not correctly parsed)",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The model's answer, digits only"}},
            "required": ["answer"],
        },
    },
}
NO_IMPROVEMENT_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """Scores submitted GSM8K answers against the row's ground truth; one state per trajectory."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any) -> str:
        if ground_truth is None:  # verl's agent loop passes create_kwargs={...} as one keyword
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(f"{self.name}: needs a ground truth: set extra_info.tools_kwargs.{self.name}"
                             ".create_kwargs.ground_truth in the dataset row")
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self._instances[instance_id]
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state["response"] = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        # verl's wording, which a model trained with verl has learned to read
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], method="flexible")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
