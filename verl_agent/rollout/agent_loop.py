"""The multi-turn agent loop: one asyncio task per trajectory, token ids as the source of truth.

Per trajectory: encode the prompt once; then repeat
  generate -> append the generated ids verbatim (loss mask 1, rollout log-probs kept)
  -> parse tool calls -> run them (up to max_parallel_calls at once) or ask the interaction
  -> append the token-exact observation ids from `ChatEncoder.encode_observation` (mask 0)
until a stop condition. Nothing is re-tokenized. Trajectories never wait for each
other except inside the engine's batches, so a slow tool blocks only its own trajectory.

Stop reasons (protocol.StopReason): end_of_turn, interaction_done, max_assistant_turns,
max_user_turns, response_budget (data.max_response_length counted over all turns of a segment,
observations included; an observation that does not fit is not appended), max_tokens_per_turn,
max_total_tokens, max_context_length (multi_turn's budgets, each its own reason), engine_length,
prompt_too_long, error; context_rewrite on every segment but the last.

Context (multi_turn.context, rollout/context.py): when an observation would take the context past
its trigger, the strategy rewrites the history and a new segment starts from the rewritten messages
(its own Trajectory: the sample's uid, the episode's reward and outcome). `summarize` first samples a
summary turn, trained in the old segment. The engine session stays, so the engine keeps the K/V of
the prefix both segments share. Interactions always see the whole episode (`_Episode.transcript`).

A tool whose call returns ``episode_done`` in its metrics (``submit``)
ends the episode after that turn (end_of_turn).

Outcome (protocol.Outcome), set on every trajectory: infrastructure failures (the engine
raising, a tool crashing or timing out inside our code, a sandbox that is down, a reward
function or interaction that raises, a prompt over budget with data.truncation=error) end
that trajectory only, with `outcome="infra_failure"`, `cause` and the exception in `error`;
they never become reward. Everything the model did is a policy failure (wrong answer,
malformed tool call, a tool error its call caused, budget exhausted) or `ok`.

Prompts over data.max_prompt_length: `overlong_prompts` = "filter" (outcome "filtered",
nothing generated), "left"/"right" (cut that side of the prompt ids) or "error" (an
infrastructure failure with cause "prompt_too_long").

Reward: interaction.calculate_score if an interaction is attached, else reward_fn, else the
data source's built-in scorer as in verl (reward.DEFAULT_SCORERS: openai/gsm8k), else the
tools' calc_reward. Per-turn scores (Turn.score): the interaction's score of each reply, the sum
of the tools' step rewards of each turn's calls, or a reward function's list (one score per
assistant turn, given the turns' texts in extra_info["assistant_turns"]; the reward is its sum).
An interaction may name the state a turn starts from (info["state_key"]; Turn.state_key).
It sees every reply it would answer, the last one included when max_assistant_turns or
max_user_turns ends the episode (its follow-up message is then dropped), so it scores the final reply.
Tool `release` and interaction `finalize_interaction` always run.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from verl_agent.engine.contract import Engine, SamplingParams
from verl_agent.parsers import decode_reply, split_reasoning
from verl_agent.protocol import SUCCESS_THRESHOLD, Message, RolloutBatch, Sample, Trajectory, Turn
from verl_agent.reward import RewardFunction, default_scorer
from verl_agent.rollout.context import ContextError, ContextStrategy, summary_message
from verl_agent.rollout.observations import run_tool_calls

if TYPE_CHECKING:
    from verl_agent.config import RolloutConfig
    from verl_agent.tools.base import BaseTool

logger = logging.getLogger(__name__)

__all__ = ["AgentLoop", "InfraFailure", "classify", "prompt_text", "score_with_reward_fn"]


def _accepts_session(engine: Any) -> bool:
    """Does engine.generate take `session=` (the Engine contract; older user engines may not)?"""
    try:
        return "session" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


class InfraFailure(Exception):
    """Something outside the model failed; ends one trajectory with outcome "infra_failure"."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


_BUDGET_STOPS = ("response_budget", "engine_length", "max_assistant_turns", "max_user_turns", "max_tokens_per_turn",
                 "max_total_tokens", "max_context_length")


class _Stop(Exception):
    """Ends a trajectory with a stop reason (control flow inside `_Episode`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Episode:
    """Mutable state of one trajectory while it runs."""

    traj: Trajectory
    messages: list[Message]
    encoder: Any
    session: Any = None
    interaction: Any = None  # an InteractionSession (started; finalized by the exit stack)
    assistant_turns: int = 0
    user_turns: int = 0
    last_text: str = ""
    pending: Any = None  # ParseResult of the last assistant turn (None without tools)
    state_key: str | None = None  # the interaction's info["state_key"] for the next turn (Turn.state_key)
    engine_session: str | None = None  # names this trajectory to the engine (KV reuse across its turns)
    counts: dict[str, float] = field(default_factory=lambda: {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0})
    transcript: list[Message] = field(default_factory=list)  # the whole episode (= messages until a rewrite)
    head: int = 0  # messages of the task (kept by every built-in context strategy)
    segments: list[Trajectory] = field(default_factory=list)  # earlier segments (ended by a context rewrite)
    total_tokens: int = 0  # generated + observation tokens over all segments (multi_turn.max_total_tokens)
    caps: dict[str, int] = field(default_factory=dict)  # this turn's token caps by the stop reason they give
    summaries: int = 0
    rewrites_skipped: int = 0  # rewrites due that the strategy could not make (no room, or nothing to shorten)

    def add(self, *new: Message) -> None:
        """Append to the context and, once a rewrite has split them, to the transcript."""
        self.messages.extend(new)
        if self.transcript is not self.messages:
            self.transcript.extend(new)

    def all_segments(self) -> list[Trajectory]:
        return [*self.segments, self.traj]


class AgentLoop:
    """Runs multi-turn rollouts of `samples` on `engine`; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        rollout_cfg: RolloutConfig,
        tools: dict[str, BaseTool] | None = None,
        interactions: dict[str, Any] | None = None,
        reward_fn: RewardFunction | None = None,
        max_prompt_length: int = 512,
        max_response_length: int = 256,
        overlong_prompts: str = "error",
    ) -> None:
        from verl_agent.parsers import get_parser

        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = rollout_cfg
        self.mt = rollout_cfg.multi_turn
        self.tools = dict(tools or {}) if self.mt.enable else {}
        self.interactions = dict(interactions or {})
        self.reward_fn = reward_fn
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        if overlong_prompts not in ("error", "filter", "left", "right"):
            raise ValueError(f"overlong_prompts must be error, filter, left or right, got {overlong_prompts!r}")
        self.overlong_prompts = overlong_prompts
        # built without tools too: the reasoning of a reply is separated by its format
        self.parser = get_parser(self.mt.format, tokenizer) if tokenizer is not None else None
        self.policy_version = 0
        self._engine_sessions = _accepts_session(engine)
        self.context = ContextStrategy(self.mt.context, tokenizer)
        # the summary request's tokens with a margin for its chat template (the trigger and the room use it)
        self._summary_request = len(tokenizer.encode(self.mt.context.summary_prompt)) + 16
        if self.context.name == "summarize":
            self.mt.check_summary_room(self._summary_request)  # config load checked it without the prompt's tokens
        self._warned_skip = False
        self._tool_block_tokens: dict[tuple[str, ...], int] = {}  # tool names -> their schemas' prompt tokens
        self._warned_filter = False

    async def run(self, samples: list[Sample], n: int, sampling: SamplingParams) -> RolloutBatch:
        """n trajectories per sample (GRPO groups share the sample uid), all concurrently, in sample order."""
        if n < 1:
            raise ValueError(f"AgentLoop.run: n must be >= 1, got {n}")
        jobs = []
        for i, sample in enumerate(samples):
            for k in range(n):
                sp = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i * n + k)
                jobs.append(self.run_one(sample, sp))
        return RolloutBatch(trajectories=[t for segs in await asyncio.gather(*jobs) for t in segs])

    async def run_one(self, sample: Sample, sampling: SamplingParams) -> list[Trajectory]:
        """One episode -> its segments as trajectories (one unless the context was rewritten); never raises
        for a failure of the model, a tool, an interaction, a context strategy or the engine."""
        traj = Trajectory(uid=sample.uid, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[])
        traj.data_source, traj.policy_version = sample.data_source, self.policy_version
        start = time.perf_counter()
        ep = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                ep = await self._start(sample, traj, stack)
                try:
                    await self._turns(ep, sampling)
                except _Stop as stop:
                    ep.traj.stop_reason = stop.reason  # type: ignore[assignment]
                if ep.traj.stop_reason != "prompt_too_long":
                    reward = await self._reward(ep, sample)
                    for t in ep.all_segments():
                        t.reward = reward
        except Exception as e:  # one failing trajectory never kills the others
            cause = e.cause if isinstance(e, (InfraFailure, ContextError)) else "agent_loop_error"
            level = logging.WARNING if isinstance(e, (InfraFailure, ContextError)) else logging.ERROR
            logger.log(level, "trajectory %s: infrastructure failure (%s): %s", sample.uid, cause, e,
                       exc_info=level == logging.ERROR)
            for t in ep.all_segments() if ep is not None else [traj]:
                t.stop_reason = "prompt_too_long" if cause == "prompt_too_long" else "error"
                t.outcome, t.cause, t.error, t.reward = "infra_failure", cause, f"{type(e).__name__}: {e}", 0.0
        else:
            self._classify(ep.traj, ep)
            for t in ep.segments:
                t.outcome, t.cause = ep.traj.outcome, ep.traj.cause
        segs = ep.all_segments() if ep is not None else [traj]
        if len(segs) > 1:
            self._segment_metrics(ep)
        if ep is not None and self.context.enabled:  # also where no rewrite happened: that is when it matters
            ep.traj.metrics["context/rewrites_skipped"] = float(ep.rewrites_skipped)
        for t in segs:
            t.metrics["seconds"] = time.perf_counter() - start
            t.check()
        return segs

    def _classify(self, traj: Trajectory, ep: _Episode) -> None:
        classify(traj, ep.counts)

    # -- setup ---------------------------------------------------------------------------------

    async def _start(self, sample: Sample, traj: Trajectory, stack: contextlib.AsyncExitStack) -> _Episode:
        from verl_agent.chat import ChatEncoder
        from verl_agent.tools import ToolSession

        session = None
        if self.tools:
            session = ToolSession(self.tools, sample.tools_kwargs, timeout=self.mt.tool_timeout)
            await stack.enter_async_context(session)
        encoder = ChatEncoder(self.tokenizer, tools=session.schemas() if session else None)
        ep = _Episode(traj=traj, messages=list(sample.messages), encoder=encoder, session=session)
        if self._engine_sessions:  # released when the trajectory ends, however it ends
            ep.engine_session = f"{sample.uid}/{uuid.uuid4().hex}"
            stack.push_async_callback(self.engine.release_session, ep.engine_session)
        traj.messages = ep.transcript = ep.messages
        await self._start_interaction(ep, sample, stack)
        ep.head = len(ep.messages)
        traj.prompt_ids = self._fit_prompt(list(encoder.encode_prompt(ep.messages)), session)
        return ep

    def _fit_prompt(self, ids: list[int], session: Any = None) -> list[int]:
        """Apply the overlong-prompt policy; an empty list means "filtered" (see the module docstring)."""
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if self.overlong_prompts == "left":
            return ids[len(ids) - limit :]
        if self.overlong_prompts == "right":
            return ids[:limit]
        if self.overlong_prompts == "filter":
            if not self._warned_filter:  # filtered prompts never reach the loss: say once why they go
                self._warned_filter = True
                logger.warning("a prompt of %d tokens > data.max_prompt_length=%d is filtered out%s; later ones "
                               "are filtered silently", len(ids), limit, self._tool_share(session))
            return []
        raise InfraFailure("prompt_too_long", f"prompt has {len(ids)} tokens > data.max_prompt_length={limit}"
                           f"{self._tool_share(session)}; set data.filter_overlong_prompts=true or "
                           "data.truncation=left|right")

    def _tool_share(self, session: Any) -> str:
        """How much of a prompt the tool schemas take (the chat template renders all of them into it): the
        usual cause of prompts that outgrow data.max_prompt_length once tools are added."""
        if session is None:
            return ""
        from verl_agent.rollout.tool_budget import tool_tokens

        schemas = session.schemas()
        key = tuple(sorted(s["function"]["name"] for s in schemas))
        if key not in self._tool_block_tokens:  # one measure per tool set, not per prompt
            self._tool_block_tokens[key] = tool_tokens(self.tokenizer, schemas)
        return (f", {self._tool_block_tokens[key]} of them the schemas of {len(schemas)} tools "
                "(`verl-agent tools list CONFIG` shows each tool's share)")

    async def _start_interaction(self, ep: _Episode, sample: Sample, stack: contextlib.AsyncExitStack) -> None:
        """Attach the interaction named by interaction_kwargs["name"] (or the only one configured)."""
        from verl_agent.interactions.base import InteractionSession
        from verl_agent.interactions.registry import select_interaction

        interaction = select_interaction(self.interactions, sample.interaction_kwargs)
        if interaction is None:
            return
        try:
            ep.interaction = await stack.enter_async_context(InteractionSession(interaction, sample.interaction_kwargs))
            first = await ep.interaction.initial_observation()
        except Exception as e:
            raise InfraFailure(getattr(e, "cause", None) or "interaction_error",
                               f"interaction failed to start: {type(e).__name__}: {e}") from e
        if first:
            ep.messages.append(Message(role="user", content=str(first)))

    # -- turns ---------------------------------------------------------------------------------

    async def _turns(self, ep: _Episode, sampling: SamplingParams) -> None:
        if not ep.traj.prompt_ids:
            raise _Stop("prompt_too_long")
        stop_ids = sorted(set(sampling.stop_token_ids) | set(ep.encoder.eos_token_ids))
        max_turns = self.mt.max_assistant_turns if self.mt.enable else 1
        while True:
            ep.caps = self._caps(ep)
            sp = replace(sampling.for_turn(ep.assistant_turns + ep.summaries),
                         max_new_tokens=min(sampling.max_new_tokens, *ep.caps.values()), stop_token_ids=stop_ids)
            turn = await self._generate(ep, sp)
            if max_turns is not None and ep.assistant_turns >= max_turns and self._wants_more(ep):
                if ep.interaction is not None and not self._calls_tools(ep):
                    await self._ask_interaction(ep, turn)  # it scores the final reply; its follow-up is dropped
                raise _Stop("max_assistant_turns")
            new = await self._observe(ep, turn)
            if self.mt.history == "template":
                obs = self._template_observation(ep, new)
                if obs is None:  # the template rewrote the history: this turn's context starts a segment
                    self._template_segment(ep, new)
                    continue
            else:
                obs = self._encode_observation(ep, new)
            if self._rewrite_due(ep, len(obs)) and await self._rewrite(ep, new, len(obs), sampling, stop_ids):
                continue
            self._check_fits(ep, len(obs))
            ep.add(*new)
            self._append_context(ep, obs)
            turn.obs_end = len(ep.traj.response_ids)

    def _caps(self, ep: _Episode) -> dict[str, int]:
        """The budgets' caps on the next turn's tokens, keyed by the stop reason each gives; raises _Stop when
        one has nothing left. data.max_response_length counts one segment's response (today's budget)."""
        traj, mt = ep.traj, self.mt
        caps = {"response_budget": self.max_response_length - len(traj.response_ids)}
        if mt.max_tokens_per_turn is not None:
            caps["max_tokens_per_turn"] = mt.max_tokens_per_turn
        if mt.max_total_tokens is not None:
            caps["max_total_tokens"] = mt.max_total_tokens - ep.total_tokens
        if mt.max_context_length is not None:
            caps["max_context_length"] = mt.max_context_length - len(traj.prompt_ids) - len(traj.response_ids)
        for reason, left in caps.items():
            if left <= 0:
                raise _Stop(reason)
        return caps

    def _check_fits(self, ep: _Episode, n_obs: int) -> None:
        """Never cut an observation: one that leaves no room for a reply ends the episode (its budget's reason)."""
        traj, mt = ep.traj, self.mt
        if n_obs >= self.max_response_length - len(traj.response_ids):
            raise _Stop("response_budget")
        if mt.max_total_tokens is not None and n_obs >= mt.max_total_tokens - ep.total_tokens:
            raise _Stop("max_total_tokens")
        if mt.max_context_length is not None and \
                n_obs >= mt.max_context_length - len(traj.prompt_ids) - len(traj.response_ids):
            raise _Stop("max_context_length")

    @staticmethod
    def _append_context(ep: _Episode, ids: list[int], mask: int = 0, logprobs: list[float] | None = None) -> None:
        traj = ep.traj
        traj.response_ids += ids
        traj.loss_mask += [mask] * len(ids)
        traj.rollout_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        ep.total_tokens += len(ids)

    # -- context strategies (rollout/context.py) -------------------------------------------------

    def _rewrite_due(self, ep: _Episode, n_obs: int) -> bool:
        """Rewrite once the context with this observation passes the trigger, or the segment cannot take it."""
        if not self.context.enabled:
            return False
        traj, mt, cfg = ep.traj, self.mt, self.mt.context
        ctx = len(traj.prompt_ids) + len(traj.response_ids) + n_obs
        trigger = cfg.trigger_length
        if trigger is None:  # room for a turn, and for the summary turn too (its prompt with a margin for the template)
            limit = mt.max_context_length
            trigger = limit - (mt.max_tokens_per_turn or limit // 4)
            if self.context.name == "summarize":
                trigger -= cfg.summary_max_tokens + self._summary_request
        return ctx > trigger or n_obs >= self.max_response_length - len(traj.response_ids)

    async def _rewrite(self, ep: _Episode, new: list[Message], n_obs: int, sampling: SamplingParams,
                       stop_ids: list[int]) -> bool:  # fmt: skip
        """Start a new segment from the rewritten context and the observation `new` (its `n_obs` tokens count
        towards max_total_tokens once); False when the strategy leaves the context as it was (the observation
        is then appended as usual, budgets permitting)."""
        context = [*ep.messages, *new]
        if self.context.name == "summarize":
            summary = await self._summarize(ep, sampling, stop_ids)
            if summary is None:
                return self._skipped(ep, "no room left for the summary turn")
            rewritten = [*ep.messages[: ep.head], summary_message(summary), *new]
        else:
            rewritten = await self.context.rewrite(context, ep.head)
            if [m.to_chat() for m in rewritten] == [m.to_chat() for m in context]:
                return self._skipped(ep, "it left the context as it was")
        if self.mt.max_total_tokens is not None and n_obs >= self.mt.max_total_tokens - ep.total_tokens:
            raise _Stop("max_total_tokens")
        transcript = [*ep.transcript, *new] if ep.transcript is not ep.messages else context
        self._new_segment(ep, rewritten)
        ep.total_tokens += n_obs
        ep.transcript = transcript
        return True

    def _skipped(self, ep: _Episode, why: str) -> bool:
        """A rewrite was due and the strategy could not make it: counted (context/rewrites_skipped) and logged
        once per agent loop, since the episode then runs into its budget without a word otherwise."""
        ep.rewrites_skipped += 1
        if not self._warned_skip:
            self._warned_skip = True
            logger.warning("context strategy %s could not rewrite the history of trajectory %s: %s (counted in "
                           "rollout/context/rewrites_skipped)", self.context.name, ep.traj.uid, why)
        return False

    async def _summarize(self, ep: _Episode, sampling: SamplingParams, stop_ids: list[int]) -> str | None:
        """The summary turn: the summary prompt after the last reply, then the policy's summary (a trained turn of
        this segment; not an assistant turn of the episode). None when the segment has no room for it."""
        cfg, traj = self.mt.context, ep.traj
        request = Message(role="user", content=cfg.summary_prompt)
        obs = self._encode_observation(ep, [request])
        caps = self._caps(ep)
        # the request is context, not generated: it counts against the context budgets, not max_tokens_per_turn
        room = min(cfg.summary_max_tokens,
                   *(left - len(obs) for why, left in caps.items() if why != "max_tokens_per_turn"))
        if room < 1:
            return None
        transcript = ep.transcript if ep.transcript is not ep.messages else list(ep.messages)
        ep.messages.append(request)
        ep.transcript = transcript  # the summary exchange is context only, not part of the episode
        self._append_context(ep, obs)
        traj.turns[-1].obs_end = len(traj.response_ids)
        sp = replace(sampling.for_turn(ep.assistant_turns + ep.summaries), max_new_tokens=room,
                     stop_token_ids=stop_ids)  # fmt: skip
        ep.summaries += 1
        out, _ = await self._sample(ep, sp)
        text = decode_reply(self.tokenizer, out.token_ids, None)
        ep.messages.append(Message(role="assistant", content=text))
        return text

    def _new_segment(self, ep: _Episode, messages: list[Message]) -> None:
        """End the current segment (stop reason context_rewrite) and start one from `messages`; the engine
        session stays, so the engine keeps the K/V of the prefix the two share (the task, at least)."""
        ids = list(ep.encoder.encode_prompt(messages))
        limit = self.mt.max_context_length or self.max_prompt_length + self.max_response_length
        if len(ids) >= limit:
            raise _Stop("max_context_length")
        old = ep.traj
        old.stop_reason = "context_rewrite"
        ep.segments.append(old)
        ep.traj = Trajectory(uid=old.uid, prompt_ids=ids, response_ids=[], loss_mask=[], rollout_logprobs=[],
                             messages=list(messages), data_source=old.data_source,
                             policy_version=self.policy_version)  # fmt: skip
        ep.messages = ep.traj.messages

    def _template_observation(self, ep: _Episode, new: list[Message]) -> list[int] | None:
        """history=template: the ids that the template's rendering of the whole history (with `new`) adds after the
        segment's ids, or None when that rendering does not start with them (earlier reasoning dropped, a
        re-tokenized reply, any rewrite): the model at deployment would see the rendering, not our ids."""
        ids = list(ep.encoder.encode_prompt([*ep.messages, *new]))
        current = ep.traj.prompt_ids + ep.traj.response_ids
        if len(ids) > len(current) and ids[: len(current)] == current:
            return ids[len(current):]
        return None

    def _template_segment(self, ep: _Episode, new: list[Message]) -> None:
        """history=template: the next turn's context is the template's rendering of the history; it is trained
        as a segment of its own (the transcript keeps the whole episode, as for a context rewrite)."""
        context = [*ep.messages, *new]
        transcript = [*ep.transcript, *new] if ep.transcript is not ep.messages else context
        seen = len(ep.traj.prompt_ids) + len(ep.traj.response_ids)
        self._new_segment(ep, context)
        ep.total_tokens += max(0, len(ep.traj.prompt_ids) - seen)  # what the rendering adds (max_total_tokens)
        ep.transcript = transcript

    def _encode_observation(self, ep: _Episode, new: list[Message]) -> list[int]:
        """Observation ids after the last assistant turn.

        The parsed assistant message normally renders exactly as generated; when it does not
        (e.g. an unparsable call left no content), the raw generated text stands in for it:
        only the text after its end-of-turn token is used, so either gives the same ids. An empty
        reply (only the end-of-turn token) stands in as a space: ChatML templates in the Qwen2.5
        style render an empty assistant message without the generation prompt's newline, which
        is no longer a prefix of what was generated.
        """
        from verl_agent.chat import ChatTemplateError

        try:
            return list(ep.encoder.encode_observation(ep.messages, new))
        except ChatTemplateError:
            raw = [*ep.messages[:-1], Message(role="assistant", content=ep.last_text or " ")]
            return list(ep.encoder.encode_observation(raw, new))

    async def _sample(self, ep: _Episode, sp: SamplingParams) -> tuple[Any, Turn]:
        """One engine call on the segment's ids; its tokens are appended verbatim (mask 1) as a new Turn."""
        traj = ep.traj
        t0 = time.perf_counter()
        try:
            kwargs = {"session": ep.engine_session} if ep.engine_session else {}
            out = await self.engine.generate(traj.prompt_ids + traj.response_ids, sp, **kwargs)
        except Exception as e:
            raise InfraFailure("engine_error", f"engine.generate failed: {type(e).__name__}: {e}") from e
        if out.finish_reason == "abort":
            raise InfraFailure("engine_error", "the engine aborted the request")
        start = len(traj.response_ids)
        self._append_context(ep, list(out.token_ids), 1, [float(x) for x in out.logprobs])
        turn = Turn(gen_start=start, gen_end=len(traj.response_ids), obs_end=len(traj.response_ids),
                    state_key=ep.state_key)
        # out.versions: per token (rollout/stream.py); without them the version is read after the call,
        # as weights change only while no generate call is in flight
        turn.stamp_versions(out.versions, self.policy_version)
        turn.gen_seconds = time.perf_counter() - t0
        traj.turns.append(turn)
        return out, turn

    async def _generate(self, ep: _Episode, sp: SamplingParams) -> Turn:
        out, turn = await self._sample(ep, sp)
        ep.assistant_turns += 1
        ep.last_text = decode_reply(self.tokenizer, out.token_ids, self.parser)
        if self.tools and self.parser is not None:
            parsed = self.parser.parse(ep.last_text, ep.encoder.tools)
            reasoning, content = parsed.reasoning, parsed.content
        else:
            parsed = None
            reasoning, content = split_reasoning(self.parser, ep.last_text)
            content = content.strip() if reasoning else content
        # the reasoning tokens stay in the trajectory as generated (mask 1: trained); the message keeps it apart
        ep.add(Message(role="assistant", content=content, tool_calls=parsed.tool_calls if parsed else [],
                       reasoning_content=reasoning or None))
        ep.pending = parsed
        if out.finish_reason == "length":  # the smallest cap this turn reached names the stop; else the engine's
            hit = [(left, reason) for reason, left in ep.caps.items() if len(out.token_ids) >= left]
            raise _Stop(min(hit)[1] if hit else "engine_length")
        return turn

    @staticmethod
    def _calls_tools(ep: _Episode) -> bool:
        """Did the last reply call tools (or try to)? Then tools answer it, not the interaction."""
        return bool(ep.pending and (ep.pending.tool_calls or ep.pending.errors))

    def _wants_more(self, ep: _Episode) -> bool:
        return self._calls_tools(ep) or ep.interaction is not None

    async def _observe(self, ep: _Episode, turn: Turn) -> list[Message]:
        """The next observation: tool results, or the interaction's reply; raises _Stop when there is none."""
        parsed = ep.pending
        if self._calls_tools(ep):
            res = await run_tool_calls(
                ep.session, parsed.tool_calls, parsed.errors, max_parallel_calls=self.mt.max_parallel_calls,
                max_chars=self.mt.max_tool_response_length, truncate_side=self.mt.tool_response_truncate_side,
            )  # fmt: skip
            turn.num_tool_calls, turn.score, turn.tool_seconds = res.num_calls, res.reward, res.seconds
            ep.counts["tool_calls"] += res.num_calls
            ep.counts["tool_errors"] += res.num_errors
            ep.counts["malformed_calls"] += len(parsed.errors)
            _add_tool_metrics(ep.traj.metrics, res.metrics)
            if res.infra is not None:
                raise InfraFailure(*res.infra)
            if any(m.get("episode_done") for m in res.metrics):  # e.g. a `submit` tool: the episode ends here
                raise _Stop("end_of_turn")
            return res.messages
        if ep.interaction is None:
            raise _Stop("end_of_turn")
        done, reply = await self._ask_interaction(ep, turn)
        if self.mt.max_user_turns is not None and ep.user_turns >= self.mt.max_user_turns:
            raise _Stop("max_user_turns")  # asked anyway, so that its score is of the final reply
        if done:
            raise _Stop("interaction_done")
        ep.user_turns += 1
        return [Message(role="user", content=reply)]

    async def _ask_interaction(self, ep: _Episode, turn: Turn) -> tuple[bool, str]:
        """Show the interaction the reply just generated: (done, its reply); the turn gets its score."""
        t0 = time.perf_counter()
        done, reply, score, info = await ep.interaction.respond(ep.transcript)
        turn.score, turn.tool_seconds = float(score), time.perf_counter() - t0
        ep.state_key = None if info.get("state_key") is None else str(info["state_key"])
        if ep.interaction.error:
            raise InfraFailure(ep.interaction.cause or "interaction_error",
                               f"interaction failed: {ep.interaction.error}")
        return done, str(reply)

    @staticmethod
    def _segment_metrics(ep: _Episode) -> None:
        """Each segment numbers itself and counts its own turns and tokens; the episode's counts (tool calls,
        user turns, rewrites) stay on the last segment only, so that batch sums count each episode once."""
        segs = ep.all_segments()
        for i, t in enumerate(segs):
            t.metrics.update(segment=float(i), num_segments=float(len(segs)), num_turns=float(len(t.turns)),
                             response_length=float(len(t.response_ids)), num_model_tokens=float(t.num_model_tokens))
            if t is not ep.traj:
                t.metrics.update(num_user_turns=0.0, num_tool_calls=0.0, num_tool_errors=0.0)
        ep.traj.metrics.update({"context/rewrites": float(len(segs) - 1), "context/summary_turns": float(ep.summaries),
                                "context/total_tokens": float(ep.total_tokens)})

    # -- reward --------------------------------------------------------------------------------

    async def _reward(self, ep: _Episode, sample: Sample) -> float:
        traj = ep.traj
        traj.metrics.update(
            num_turns=float(ep.assistant_turns), num_user_turns=float(ep.user_turns),
            num_tool_calls=ep.counts["tool_calls"], num_tool_errors=ep.counts["tool_errors"],
            response_length=float(len(traj.response_ids)), num_model_tokens=float(traj.num_model_tokens),
        )  # fmt: skip
        if ep.interaction is not None:
            score = float(await ep.interaction.score())
            if ep.interaction.error:
                raise InfraFailure(ep.interaction.cause or "interaction_error",
                                   f"interaction calculate_score failed: {ep.interaction.error}")
            return score
        reward_fn = self.reward_fn or default_scorer(sample.data_source)
        if reward_fn is not None:
            return await score_with_reward_fn(reward_fn, self.tokenizer, sample, ep.all_segments(), ep.last_text)
        if ep.session is not None:
            try:
                reward = float(await ep.session.calc_reward())
            except RuntimeError as e:  # a tool's own cause (e.g. verifier_timeout) when it gives one
                raise InfraFailure(getattr(e.__cause__, "cause", None) or "reward_error", str(e)) from e
            traj.metrics.update(ep.session.reward_metrics)  # e.g. a verifier's named rewards
            return reward
        return 0.0


def _add_tool_metrics(into: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """Sum the calls' namespaced numeric metrics (a "/" in the name, e.g. MCP's mcp/retried) into the trajectory's;
    the rollout metrics then log their total over the batch (rollout/mcp/retried)."""
    for metrics in calls:
        for key, value in metrics.items():
            if "/" in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                into[key] = into.get(key, 0.0) + float(value)


def prompt_text(messages: list[Message]) -> str:
    """A sample's prompt as plain text for a scorer: a lone user message as it is, else "role: content" lines."""
    if len(messages) == 1 and messages[0].role == "user":
        return messages[0].content or ""
    return "\n\n".join(f"{m.role}: {m.content or ''}" for m in messages)


def classify(traj: Trajectory, counts: dict[str, float]) -> None:
    """ok / policy failure (with its cause) for a trajectory that ended without an infrastructure failure;
    `counts`: its tool_calls, tool_errors and malformed_calls."""
    if traj.stop_reason == "prompt_too_long":
        traj.outcome, traj.cause = "filtered", "prompt_too_long"
    elif traj.reward >= SUCCESS_THRESHOLD:
        traj.outcome, traj.cause = "ok", None
    elif traj.stop_reason in _BUDGET_STOPS:
        traj.outcome, traj.cause = "policy_failure", "budget_exhausted"
    elif counts["malformed_calls"]:
        traj.outcome, traj.cause = "policy_failure", "malformed_tool_call"
    elif counts["tool_errors"]:
        traj.outcome, traj.cause = "policy_failure", "tool_error"
    else:
        traj.outcome, traj.cause = "policy_failure", "wrong_answer"


async def score_with_reward_fn(reward_fn: RewardFunction, tokenizer: Any, sample: Sample, trajs: list[Trajectory],
                               solution_str: str, texts: list[str] | None = None) -> float:  # fmt: skip
    """The reward from a reward function (verl's arguments) for the assistant turns of `trajs`, in order: their
    texts go in extra_info["assistant_turns"] and the sample's prompt in extra_info["prompt"] (unless the row
    has its own); a per-turn list (res.turn_scores) sets each turn's score and its sum is the reward. Raises
    InfraFailure for a failed call (the scorer's cause, else reward_error) or a list of the wrong length.
    `texts`: the turns' texts when the trajectories hold no tokens (a loop over a chat API), else decoded."""
    turns = [(traj, t) for traj in trajs for t in traj.turns]
    if texts is None:
        texts = [tokenizer.decode(traj.response_ids[t.gen_start : t.gen_end], skip_special_tokens=True)
                 for traj, t in turns]  # fmt: skip
    extra_info = {"prompt": prompt_text(sample.messages), **sample.extra_info, "assistant_turns": texts}
    res = await reward_fn.acall(data_source=sample.data_source, solution_str=solution_str,
                                ground_truth=sample.ground_truth, extra_info=extra_info)
    if getattr(res, "error", None):
        raise InfraFailure(getattr(res, "cause", None) or "reward_error", res.error)
    per_turn = getattr(res, "turn_scores", None)
    if per_turn is not None:  # a list per turn: the turns' scores, and their sum is the reward
        if len(per_turn) != len(turns):
            raise InfraFailure("reward_error", f"the reward function returned {len(per_turn)} per-turn "
                               f"scores for {len(turns)} assistant turns")
        for (_, turn), value in zip(turns, per_turn):
            turn.score = float(value)
    return float(getattr(res, "score", res))
