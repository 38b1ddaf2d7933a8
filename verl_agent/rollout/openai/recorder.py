"""Token-exact recording of one agent's chat-completion calls (one `SessionRecorder` per trajectory).

The agent sends whole conversations (OpenAI messages); the model must see, and the trainer
must train on, exactly the token ids the native agent loop would have built. Per call:

1. The first call of a segment encodes the messages with `ChatEncoder.encode_prompt`.
2. A later call whose messages EXTEND the recorded history (the same messages, the assistant
   turns exactly as we returned them, then new tool/user messages, same tools) appends only
   the new messages, encoded with the token-exact `ChatEncoder.encode_observation` (mask 0).
3. Anything else (an edited or dropped message, different tools, or continuing after a reply
   that did not end with an end-of-turn token) closes the segment and starts a new one from
   the full prompt; each segment is trained as its own trajectory (`proxy/history_rewrites`).

The generated ids and engine log-probs are appended verbatim (mask 1). Nothing is re-tokenized.
Requests of one session are serialized by a lock. Validation happens before any state
changes, so a refused request leaves the session as it was.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from verl_agent.chat import ChatEncoder, ChatTemplateError
from verl_agent.parsers import decode_reply, split_reasoning
from verl_agent.protocol import Message, ToolCall, Trajectory, Turn
from verl_agent.engine.contract import GenerateOutput, SamplingParams

__all__ = ["BudgetExceeded", "Reply", "Segment", "SessionRecorder", "message_key"]


class BudgetExceeded(ValueError):
    """The prompt or the conversation no longer fits the token budget (HTTP 400 context_length_exceeded)."""

    def __init__(self, message: str, stop_reason: str) -> None:
        super().__init__(message)
        self.stop_reason = stop_reason


def message_key(m: Message) -> tuple:
    """What must match for a sent message to count as the recorded one (ids included, content None == "")."""
    calls = tuple((c.id, c.name, json.dumps(c.arguments, sort_keys=True)) for c in m.tool_calls)
    return (m.role, m.content or "", calls, m.tool_call_id or None, m.name if m.role == "tool" else None)


class _MemoEncoder(ChatEncoder):
    """A `ChatEncoder` that remembers its last renders. A call's `encode_observation` ends by rendering the
    conversation up to the next generation prompt, and the session's next call starts by rendering exactly
    that again (its history before the new reply): one jinja render of three per call is saved. Keys are
    the message objects themselves, held here, so identity is a safe key (the recorder never mutates them)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        super().__init__(tokenizer, tools=tools)
        self._memo: list[tuple[tuple[Any, ...], bool, str]] = []

    def render(self, messages: Any, add_generation_prompt: bool) -> str:
        key = tuple(messages)
        for k, agp, text in self._memo:
            if agp == add_generation_prompt and len(k) == len(key) and all(a is b for a, b in zip(k, key)):
                return text
        text = super().render(messages, add_generation_prompt)
        self._memo = [*self._memo[-2:], (key, add_generation_prompt, text)]
        return text


@dataclass
class Segment:
    """One trajectory in the making: an unbroken token-exact extension of its first prompt."""

    traj: Trajectory
    encoder: ChatEncoder
    tools_key: str
    history: list[Message] = field(default_factory=list)
    keys: list[tuple] = field(default_factory=list)
    closed: bool = False  # the last reply did not end with an end-of-turn id: nothing can extend it
    last_text: str = ""


@dataclass
class Reply:
    """What one call produced: the assistant message returned to the agent and its tokens."""

    message: Message
    finish_reason: str  # OpenAI's: stop | length | tool_calls
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    malformed: list[str]


class SessionRecorder:
    """Records the calls of one agent run; `segments` become trajectories (see the module docstring)."""

    def __init__(self, sid: str, tokenizer: Any, parser: Any, sampling: SamplingParams, *, uid: str,
                 max_prompt_length: int, max_response_length: int, policy_version: int = 0) -> None:  # fmt: skip
        self.sid, self.tokenizer, self.parser, self.sampling = sid, tokenizer, parser, sampling
        self.uid, self.policy_version = uid, policy_version
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.segments: list[Segment] = []
        self.counts: Counter[str] = Counter()
        self.infra: tuple[str, str] | None = None  # (cause, message) of an endpoint/engine failure
        self.stop_reason: str | None = None  # set when a budget ran out
        self.lock = asyncio.Lock()
        self.closed = False
        self.prompt_tail: list[int] = []  # the last ids of the latest call's prompt (streams read it)
        self._eos = set(ChatEncoder(tokenizer).eos_token_ids)

    # -- prompt --------------------------------------------------------------------------------
    def prepare(self, messages: list[Message], tools: list[dict] | None) -> tuple[Segment, list[int], list[int]]:
        """(segment, ids to append, full prompt ids) for a call; nothing is stored until `commit`."""
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and self._extends(seg, messages, tools_key):
            new = messages[len(seg.history):]
            try:
                obs = list(seg.encoder.encode_observation(seg.history, new))
            except ChatTemplateError:  # the parsed assistant message did not render as generated
                # an empty reply stands in as a space, as in the native loop (AgentLoop._encode_observation)
                raw = [*seg.history[:-1], Message(role="assistant", content=seg.last_text or " ")]
                obs = list(seg.encoder.encode_observation(raw, new))
            left = self.max_response_length - len(seg.traj.response_ids)
            if len(obs) >= left:  # as the native loop: never cut an observation, leave room for a reply
                raise BudgetExceeded(f"the conversation needs {len(obs)} more tokens but only {left} of "
                                     f"data.max_response_length={self.max_response_length} are left", "response_budget")
            return seg, obs, seg.traj.prompt_ids + seg.traj.response_ids + obs
        encoder = _MemoEncoder(self.tokenizer, tools=tools)
        ids = list(encoder.encode_prompt(messages))
        limit = self.max_prompt_length + (self.max_response_length if self.segments else 0)
        if len(ids) > limit:
            raise BudgetExceeded(f"the prompt has {len(ids)} tokens > {limit} (data.max_prompt_length"
                                 f"{' + data.max_response_length' if self.segments else ''})", "prompt_too_long")
        history = list(messages)  # shared: the trajectory's messages are the segment's history
        traj = Trajectory(uid=self.uid, prompt_ids=ids, response_ids=[], loss_mask=[], rollout_logprobs=[],
                          messages=history, policy_version=self.policy_version)  # fmt: skip
        return Segment(traj, encoder, tools_key, history, [message_key(m) for m in messages]), [], ids

    def _extends(self, seg: Segment, messages: list[Message], tools_key: str) -> bool:
        n = len(seg.history)
        return (not seg.closed and tools_key == seg.tools_key and len(messages) > n
                and [message_key(m) for m in messages[:n]] == seg.keys)  # fmt: skip

    def budget(self, seg: Segment) -> int:
        return self.max_response_length - len(seg.traj.response_ids)

    # -- record --------------------------------------------------------------------------------
    def commit(self, seg: Segment, obs: list[int], new: list[Message], out: GenerateOutput,
               parse_tools: bool, allowed: str | None, stop: list[str], version: int = 0,
               forced: list[int] | None = None, required: bool = False) -> Reply:  # fmt: skip
        """Store the observation and the generation (made by policy `version`); build the assistant message
        returned to the agent. `forced`: ids the reply was made to start with (`forced_ids`); they are
        recorded as context (mask 0: the prompt on a first turn, the observation otherwise), not as generated.
        `required` / `allowed`: the reply must call a tool / only function `allowed` (else it is returned as text)."""
        if not self.segments or self.segments[-1] is not seg:
            if self.segments:
                self.counts["history_rewrites"] += 1
            self.segments.append(seg)
        traj, forced = seg.traj, forced or []
        if obs:
            seg.history += new
            seg.keys += [message_key(m) for m in new]
        if traj.turns:
            traj.response_ids += obs + forced
            traj.loss_mask += [0] * (len(obs) + len(forced))
            traj.rollout_logprobs += [0.0] * (len(obs) + len(forced))
            traj.turns[-1].obs_end = len(traj.response_ids)
        else:
            traj.prompt_ids += forced
        ids, lps, finish = list(out.token_ids), [float(x) for x in out.logprobs], out.finish_reason
        ids, lps, finish, cut = self._apply_stop_strings(ids, lps, finish, stop)
        start = len(traj.response_ids)
        traj.response_ids += ids
        traj.loss_mask += [1] * len(ids)
        traj.rollout_logprobs += lps
        turn = Turn(gen_start=start, gen_end=len(traj.response_ids), obs_end=len(traj.response_ids))
        turn.stamp_versions(out.versions[: len(ids)] if out.versions else None, version)
        traj.turns.append(turn)
        parser = self.parser  # as StreamText decodes: the format's markers (reasoning, calls) kept
        head = decode_reply(self.tokenizer, forced, parser) if forced else ""
        seg.last_text = decode_reply(self.tokenizer, forced + ids, parser)
        text = seg.last_text if cut is None else head + cut
        seg.closed = not ids or ids[-1] not in self._eos
        if finish == "length":
            self.stop_reason = "response_budget" if self.budget(seg) <= 0 else "engine_length"
        message, malformed = self._message(text, parse_tools, allowed, len(traj.turns), required, seg.encoder.tools)
        seg.history.append(message)
        seg.keys.append(message_key(message))
        self.counts["calls"] += 1
        self.counts["malformed_calls"] += len(malformed)
        self.counts["tool_calls"] += len(message.tool_calls)
        reason = "length" if finish == "length" else "tool_calls" if message.tool_calls else "stop"
        return Reply(message, reason, ids, lps, len(traj.prompt_ids) + start, malformed)

    def _apply_stop_strings(self, ids: list[int], lps: list[float], finish: str, stop: list[str]
                            ) -> tuple[list[int], list[float], str, str | None]:  # fmt: skip
        """Cut the reply after the first token that completes a stop string (OpenAI's `stop`)."""
        if not stop:
            return ids, lps, finish, None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [text.find(s) for s in stop if s and s in text]
        if not hits:
            return ids, lps, finish, None
        pos = min(hits)
        for k in range(1, len(ids) + 1):  # the shortest prefix of tokens whose text reaches the stop string
            if len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) > pos:
                return ids[:k], lps[:k], "stop", text[:pos]
        return ids, lps, finish, text[:pos]

    def _message(self, text: str, parse_tools: bool, allowed: str | None, turn: int,
                 required: bool = False, tools: list[dict] | None = None) -> tuple[Message, list[str]]:  # fmt: skip
        """The assistant message: parsed tool calls (OpenAI ids minted here), or the text when a call is malformed
        or `tool_choice` is not met (no call although `required`, or a call of another function than `allowed`).
        The reasoning is kept apart (`reasoning_content`) in every case."""
        reasoning, answer = split_reasoning(self.parser, text)
        if not parse_tools or self.parser is None:
            return Message(role="assistant", content=answer.strip() if reasoning else answer,
                           reasoning_content=reasoning or None), []  # fmt: skip
        parsed = self.parser.parse(text, tools)
        calls = parsed.tool_calls
        if parsed.errors:
            return Message(role="assistant", content=answer.strip(), reasoning_content=reasoning or None), parsed.errors
        wrong = not calls if required or allowed is not None else False
        if wrong or allowed is not None and any(c.name != allowed for c in calls):
            self.counts["tool_choice_violations"] += 1
            want = f"a call of {allowed!r}" if allowed is not None else "a tool call"
            return Message(role="assistant", content=answer.strip(), reasoning_content=reasoning or None), \
                [f"tool_choice asked for {want}"]
        calls = [ToolCall(name=c.name, arguments=c.arguments, id=c.id or f"call_{self.sid}_{turn}_{i}")
                 for i, c in enumerate(calls)]  # fmt: skip
        return Message(role="assistant", content=parsed.content, tool_calls=calls,
                       reasoning_content=parsed.reasoning or None), []

    def sampling_for(self, seg: Segment, max_tokens: int | None, overrides: dict[str, float],
                     reserve: int = 0, obs: int = 0) -> SamplingParams:  # fmt: skip
        """The session's sampling for its next call (a seed per call, counted over the whole session: for one
        segment exactly the native loop's per-turn seeds), capped by the budget less the response tokens this
        call adds before its reply: `obs` observation ids (from `prepare`, not yet committed) and `reserve`
        forced ids. Nothing left ends the trajectory (BudgetExceeded "response_budget"), as in the native loop."""
        left = self.budget(seg) - obs - (reserve if seg.traj.turns else 0)
        if left <= 0:
            raise BudgetExceeded(f"data.max_response_length={self.max_response_length} is used up", "response_budget")
        cap = min(self.sampling.max_new_tokens, left, max_tokens or left)
        stops = sorted(set(self.sampling.stop_token_ids) | self._eos)
        calls = sum(len(s.traj.turns) for s in self.segments)
        return replace(self.sampling.for_turn(calls), max_new_tokens=cap, stop_token_ids=stops, **overrides)
