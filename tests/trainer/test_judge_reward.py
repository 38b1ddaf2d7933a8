"""One training step with an LLM judge as the reward (reward_model.enable), end to end: real Ray, gloo, FSDP2 and
the tiny model on the calculator task; the judge is a real HTTP server on loopback (tests/judge_helpers.py)
that grades by rule, since a judge model is what cannot run here. Its answers for some prompts have no score
(judge_unparsable: excluded from the loss and counted, never a 0), and for others it fails once with HTTP 500
first (retried, then scored). The rules pick by the reference answer; the seeded data's first batch has
references 62, 7283, 404 and 77140, so both happen.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from judge_helpers import RUBRIC, JudgeServer, grade

from verl_agent.trainer.loop import train

pytestmark = pytest.mark.slow


def _reference(message: str) -> int:
    return int(re.search(r"^Reference: (.*)$", message, re.M).group(1))


def _grader(message: str, seen: int) -> str | int:
    if _reference(message) % 2 == 1:
        return "The answer looks fine to me."  # no score: judge_unparsable
    if _reference(message) % 4 == 0 and seen == 1:
        return 500  # retried
    return grade(message)


def test_one_training_step_with_the_judge_as_reward(ray_cluster, make_cfg, tmp_path):
    with JudgeServer(grader=_grader) as judge:
        cfg = make_cfg("data.reward_fn=null", "data.val_files=[]", "data.max_response_length=48",
                       "actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=1", "trainer.num_cpu_workers=1",
                       "trainer.max_infra_failure_fraction=1.0", "reward_model.enable=true",
                       "reward_model.model.path=judge-model", f"reward_model.judge.api_base={judge.url}",
                       "reward_model.judge.backoff=0.01", run_dir=tmp_path / "run")
        cfg.reward_model.judge.scoring_prompt = RUBRIC
        m = train(cfg).history[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").open()]
    assert len(records) == m["rollout/num_trajectories"] == 8
    assert {r["model"] for r in judge.requests} == {"judge-model"}
    refs = {re.search(r"^Task: (.*)$", r["message"], re.M).group(1): _reference(r["message"]) for r in judge.requests}
    failed = [r for r in records if r["outcome"] == "infra_failure"]
    for r in records:
        task = next(msg["content"] for msg in r["messages"] if msg["role"] == "user")
        if refs[task] % 2 == 1:  # the judge gave no score: an infrastructure failure, not a reward of 0
            assert (r["outcome"], r["cause"]) == ("infra_failure", "judge_unparsable") and "no score" in r["error"]
        else:  # scored (after a retry for % 4 == 0): 10/10 when the reference is in the final answer
            answer = [msg["content"] for msg in r["messages"] if msg["role"] == "assistant"][-1].split("\n")[0]
            assert r["outcome"] != "infra_failure" and r["reward"] == (1.0 if str(refs[task]) in answer else 0.0)
    assert failed and len(failed) < len(records)  # both kinds occurred
    assert m["rollout/infra_failed/judge_unparsable"] == len(failed)
    assert any(n == 2 for msg, n in judge.seen.items() if _reference(msg) % 4 == 0)  # a 500, then the answer
    assert m["train/excluded_trajectories"] == len(failed)
    assert m["train/sequences"] > 0 and math.isfinite(m["actor/pg_loss"])
