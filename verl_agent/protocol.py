"""The data that flows through verl-agent: samples in, trajectories out.

Token ids are the source of truth. A `Trajectory` holds exactly the ids the
engine produced plus the ids appended for tool results and user replies; the
trainer trains on these ids as they are, never on re-tokenized text.

This module imports nothing else from verl_agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

StopReason = Literal[
    "end_of_turn",  # the model answered without a tool call and no interaction is attached
    "interaction_done",  # the interaction said the episode is over
    "max_assistant_turns",
    "max_user_turns",
    "response_budget",  # data.max_response_length exhausted over all turns
    "engine_length",  # the engine hit its own context/length limit
    "max_tokens_per_turn",  # one turn reached multi_turn.max_tokens_per_turn
    "max_total_tokens",  # multi_turn.max_total_tokens (generated + observations, all segments) exhausted
    "max_context_length",  # what the model would see no longer fits multi_turn.max_context_length
    "context_rewrite",  # not the end of the episode: the history was rewritten and the next segment goes on
    "prompt_too_long",  # the prompt exceeds data.max_prompt_length (filtered or refused; nothing generated)
    "error",  # something outside the model failed; see Trajectory.cause and Trajectory.error
]

# How a trajectory ended, for the trainer:
#   ok               the episode ended normally with a successful reward (>= SUCCESS_THRESHOLD)
#   policy_failure   the model's own doing; stays reward signal. Causes: wrong_answer, malformed_tool_call,
#                    tool_error (the agent's call or code failed), budget_exhausted
#   infra_failure    something outside the model failed; never becomes reward: left out of the loss,
#                    counted per cause. Causes: engine_error, tool_crash, tool_timeout, tool_unavailable,
#                    sandbox_unavailable, reward_error, judge_unavailable, judge_unparsable, interaction_error,
#                    prompt_too_long, agent_loop_error,
#                    context_error (a user context strategy raised or returned no valid messages)
#   filtered         dropped on purpose before generation (data.filter_overlong_prompts); not trained on
Outcome = Literal["ok", "policy_failure", "infra_failure", "filtered"]
OUTCOMES: tuple[str, ...] = ("ok", "policy_failure", "infra_failure", "filtered")
SCORED_OUTCOMES: tuple[str, ...] = ("ok", "policy_failure")  # the reward is the model's: reward metrics, the loss
SUCCESS_THRESHOLD = 1.0  # a reward at least this large is a success ("correct answer" = 1.0)


@dataclass
class ToolCall:
    """One function call the model asked for."""

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def to_chat(self) -> dict[str, Any]:
        """OpenAI / Hugging Face chat-template form."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Message:
    """One chat message; `to_chat()` gives the dict Hugging Face chat templates expect."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    # an assistant turn's reasoning (<think> block, harmony's analysis channel), apart from its content;
    # chat templates that render reasoning read it as `reasoning_content`
    reasoning_content: str | None = None

    def to_chat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_chat() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_chat(cls, d: Any, where: str = "message") -> Message:
        """Build from an OpenAI-style dict; raises ValueError naming `where` on bad input."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object with 'role' and 'content', got {type(d).__name__}")
        role = d.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: 'role' must be one of {ROLES}, got {role!r}")
        content = d.get("content") or ""
        if not isinstance(content, str):
            raise ValueError(f"{where}: 'content' must be a string, got {type(content).__name__}")
        calls = []
        for i, c in enumerate(d.get("tool_calls") or []):
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict) or "name" not in fn:
                raise ValueError(f"{where}.tool_calls[{i}]: expected {{'function': {{'name', 'arguments'}}}}")
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                import json

                args = json.loads(args)
            calls.append(ToolCall(name=fn["name"], arguments=args, id=c.get("id", "")))
        reasoning = d.get("reasoning_content", d.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: 'reasoning_content' must be a string, got {type(reasoning).__name__}")
        return cls(role=role, content=content, tool_calls=calls, tool_call_id=d.get("tool_call_id"), name=d.get("name"),
                   reasoning_content=reasoning or None)


@dataclass
class Sample:
    """One dataset row, normalised (simple and verl row formats both map here)."""

    uid: str  # stable id: "<file>:<line>" unless the row gives one; GRPO groups share it
    messages: list[Message]
    ground_truth: Any = None
    data_source: str = "default"
    agent_name: str = "tool_agent"
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (a resumed run re-feeds samples that were in flight when it stopped)."""
        from dataclasses import asdict

        return {**asdict(self), "messages": [m.to_chat() for m in self.messages]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        msgs = [Message.from_chat(m, where=f"sample {d.get('uid')}.messages[{i}]") for i, m in enumerate(d["messages"])]
        return cls(**{**d, "messages": msgs})


@dataclass
class Turn:
    """Boundaries of one assistant turn inside `Trajectory.response_ids`.

    response_ids[gen_start:gen_end] are the model's tokens (mask 1);
    response_ids[gen_end:obs_end] are the tool/user/template tokens appended after it (mask 0).
    """

    gen_start: int
    gen_end: int
    obs_end: int
    num_tool_calls: int = 0
    score: float = 0.0  # per-turn score from tools' step rewards or the interaction
    gen_seconds: float = 0.0
    tool_seconds: float = 0.0
    policy_version: int = 0  # the weights that generated this turn's tokens (the oldest, if they changed)
    state_key: str | None = None  # the state this turn starts from, if the interaction names it (GiGPO's anchor)
    # per generated token, only when weights changed inside the turn (partial rollout at a token boundary)
    token_versions: list[int] | None = None

    def stamp_versions(self, versions: Sequence[int] | None, current: int) -> None:
        """Set the version fields from an engine output's per-token `versions` (None: all `current`)."""
        if not versions:
            self.policy_version, self.token_versions = current, None
            return
        self.policy_version = min(versions)
        self.token_versions = list(versions) if len(set(versions)) > 1 else None


@dataclass
class Trajectory:
    """One multi-turn rollout, as tokens."""

    uid: str  # the Sample uid: trajectories of one GRPO group share it
    prompt_ids: list[int]
    response_ids: list[int]  # everything after the prompt: model tokens and observations
    loss_mask: list[int]  # 1 exactly on model-generated tokens, same length as response_ids
    rollout_logprobs: list[float]  # engine log-prob per response token (0.0 where loss_mask == 0)
    reward: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    stop_reason: StopReason = "end_of_turn"
    messages: list[Message] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    data_source: str = "default"
    policy_version: int = 0  # the weights at the first token; see Turn.policy_version for later turns
    outcome: Outcome = "ok"
    cause: str | None = None  # why it failed (see Outcome); None when ok
    error: str | None = None  # the exception text of an infra failure

    @property
    def trainable(self) -> bool:
        """May this trajectory reach the loss? Infra failures and filtered prompts never do."""
        return self.outcome in SCORED_OUTCOMES and bool(self.response_ids)

    def check(self) -> None:
        """Internal invariants; a failure here is a bug in the agent loop."""
        n = len(self.response_ids)
        assert len(self.loss_mask) == n, (len(self.loss_mask), n)
        assert len(self.rollout_logprobs) == n, (len(self.rollout_logprobs), n)
        for t in self.turns:
            assert 0 <= t.gen_start <= t.gen_end <= t.obs_end <= n, t

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that generated any of its tokens (staleness is measured from it)."""
        return min((t.policy_version for t in self.turns), default=self.policy_version)

    def token_versions(self) -> list[int]:
        """The policy version of every response token (observation tokens: their turn's last version)."""
        out = [self.policy_version] * len(self.response_ids)
        for t in self.turns:
            gen = t.token_versions or [t.policy_version] * (t.gen_end - t.gen_start)
            out[t.gen_start : t.gen_end] = gen
            out[t.gen_end : t.obs_end] = [gen[-1] if gen else t.policy_version] * (t.obs_end - t.gen_end)
        return out


@dataclass
class RolloutBatch:
    """The trajectories of one rollout step (GRPO groups share `uid`)."""

    trajectories: list[Trajectory]

    def __len__(self) -> int:
        return len(self.trajectories)

    def groups(self) -> dict[str, list[int]]:
        """uid -> indices of its trajectories, in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, t in enumerate(self.trajectories):
            out.setdefault(t.uid, []).append(i)
        return out
