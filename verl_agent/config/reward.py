"""custom_reward_function and reward_model: where a trajectory's reward comes from (a reward function, or the
LLM judge of `verl_agent/judge.py`; read by `rollout.build.build_reward`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from verl_agent.config.base import Section
from verl_agent.judge import DEFAULT_SCORE_PATTERN, DEFAULT_SCORING_PROMPT, check_score_pattern, check_scoring_prompt
from verl_agent.registry import REWARD_MANAGERS

__all__ = ["CustomRewardFunctionConfig", "JudgeConfig", "RewardModelConfig", "RewardModelModelConfig"]

# a registered reward manager's name (verl_agent/registry.py); an unknown name's error lists the registered ones
RewardManagerName = Annotated[str, AfterValidator(REWARD_MANAGERS.check)]


class CustomRewardFunctionConfig(Section):
    """verl's spelling of the reward function: a file path and a function name."""

    path: str | None = None
    name: str = "compute_score"


class RewardModelModelConfig(Section):
    """reward_model.model: verl's reward model; here the judge model's name."""

    path: str | None = Field(None, description="the judge's model name, sent as `model` in each request (vLLM and "
                             "SGLang serve a model under its path unless --served-model-name says otherwise)")


class JudgeConfig(Section):
    """reward_model.judge: the judge's endpoint, rubric, score format and request settings (verl_agent/judge.py)."""

    api_base: str | None = Field(None, description="the judge's OpenAI-compatible base URL, e.g. "
                                 "http://127.0.0.1:8000/v1 (requests go to <api_base>/chat/completions)")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="the environment variable holding the bearer "
                                    "token, read in each rollout worker (the key itself stays out of the config "
                                    "and the run's saved copy); unset or null: no token")
    scoring_prompt: str = Field(DEFAULT_SCORING_PROMPT, description="the rubric sent as the user message; "
                                "{prompt}, {response}, {ground_truth}, {data_source} are filled in")
    score_pattern: str = Field(DEFAULT_SCORE_PATTERN, description="regex whose last match's first group is the "
                               "score (default: a 'Score: N' line, '**Score:** N' or JSON \"score\": N)")
    score_range: tuple[float, float] = Field((0.0, 10.0), description="[low, high] of the judge's scale; the "
                                             "score is normalised to [0, 1] and one outside it is unparsable")
    max_concurrent: int = Field(32, ge=1, description="judge requests in flight at once (per rollout worker)")
    max_retries: int = Field(3, ge=0, description="retries of a request answered 429 or 5xx, timed out or "
                             "not connected")
    backoff: float = Field(0.5, ge=0, description="seconds before the first retry, doubling (at most 8); a "
                           "Retry-After header wins")
    timeout: float = Field(60.0, gt=0, description="seconds an attempt may wait to connect, send, or for the next "
                           "bytes of the answer before it is retried")
    max_tokens: int = Field(512, ge=1, description="the judge's answer budget")
    temperature: float = Field(0.0, ge=0)
    cache_size: int = Field(100_000, ge=0, description="scores cached per rollout worker, keyed by a hash of the "
                            "model, settings and rendered rubric; 0: no cache")

    @field_validator("scoring_prompt")
    @classmethod
    def _check_prompt(cls, v: str) -> str:
        return check_scoring_prompt(v)

    @field_validator("score_pattern")
    @classmethod
    def _check_pattern(cls, v: str) -> str:
        check_score_pattern(v)
        return v

    @field_validator("score_range")
    @classmethod
    def _check_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not v[0] < v[1]:
            raise ValueError(f"score_range must be [low, high] with low < high, got {list(v)}")
        return v


class RewardModelConfig(Section):
    """verl's reward_model section: with enable=true an LLM judge gives the reward (verl_agent/judge.py)."""

    enable: bool = Field(False, description="score every trajectory with the judge (instead of a reward function)")
    reward_manager: RewardManagerName = Field(
        "naive", description="how a trajectory's reward is computed; naive: the judge, the reward function or "
        "the tools' and interactions' scores, one call per trajectory (verl_agent/registry.py)")
    model: RewardModelModelConfig = Field(default_factory=RewardModelModelConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
