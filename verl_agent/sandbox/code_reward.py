"""Code reward: run a completion's code against test cases in the sandbox; score = pass rate.

Two test styles, as in code RL datasets:
  stdin/stdout   ``{"input": "1 2\\n", "output": "3\\n"}`` -- compare stdout, whitespace-normalised per line
  function call  ``{"fn_name": "add", "args": [1, 2], "expected": 3}`` -- call ``fn_name(*args)`` in Python
The code is the last fenced block of the completion (```python ... ```), or the whole text if none.
Cases run concurrently; one failing, timing out or crashing case never affects the others.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

from verl_agent.sandbox.client import SandboxClient, SandboxUnavailable

__all__ = ["CaseResult", "CodeRewardResult", "extract_code", "score_code"]

_FENCE = re.compile(r"```[ \t]*([\w+#-]*)[ \t]*\n(.*?)```", re.DOTALL)
_CALL_HARNESS = """
import json as _json
_case = _json.loads({case!r})
_got = {fn}(*_case["args"])
print(_json.dumps({{"ok": _got == _case["expected"], "got": repr(_got)[:200]}}))
"""


@dataclass
class CaseResult:
    passed: bool
    status: str  # passed | wrong_answer | runtime_error | timeout | compile_error | sandbox_error
    detail: str = ""


@dataclass
class CodeRewardResult:
    score: float
    cases: list[CaseResult] = field(default_factory=list)


def extract_code(completion: str) -> str:
    blocks = _FENCE.findall(completion)
    return blocks[-1][1] if blocks else completion


def _norm(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


async def _one(client: SandboxClient, code: str, case: dict, language: str, timeout: float) -> CaseResult:
    if "fn_name" in case:
        if language not in ("python", "python3"):
            return CaseResult(False, "sandbox_error", "function-call tests need python")
        payload = json.dumps({"args": case.get("args", []), "expected": case.get("expected")})
        code, stdin = code + "\n" + _CALL_HARNESS.format(case=payload, fn=case["fn_name"]), None
    else:
        stdin = case.get("input", "")
    try:
        resp = await client.run_code(code, language, run_timeout=timeout, stdin=stdin)
    except SandboxUnavailable as e:
        return CaseResult(False, "sandbox_error", str(e))
    if resp.status.value == "SandboxError":
        return CaseResult(False, "sandbox_error", resp.message)
    if resp.run_result is None:
        return CaseResult(False, "compile_error", (resp.compile_result.stderr or "")[-500:] if resp.compile_result else "")
    run = resp.run_result
    if run.status.value == "TimeLimitExceeded":
        return CaseResult(False, "timeout")
    if run.return_code != 0:
        return CaseResult(False, "runtime_error", (run.stderr or "")[-500:])
    if "fn_name" in case:
        try:
            verdict = json.loads((run.stdout or "").strip().splitlines()[-1])
        except (ValueError, IndexError):
            return CaseResult(False, "runtime_error", "no verdict printed")
        return CaseResult(verdict["ok"], "passed" if verdict["ok"] else "wrong_answer", verdict["got"])
    ok = _norm(run.stdout or "") == _norm(case.get("output", ""))
    return CaseResult(ok, "passed" if ok else "wrong_answer", "" if ok else (run.stdout or "")[:200])


async def score_code(completion: str, test_cases: list[dict], *, client: SandboxClient | None = None,
                     url: str = "http://127.0.0.1:8080", language: str = "python", timeout: float = 10.0,
                     extract: bool = True) -> CodeRewardResult:
    """Pass rate of ``completion`` over ``test_cases`` (0.0 when there are none)."""
    if not test_cases:
        return CodeRewardResult(0.0, [])
    code = extract_code(completion) if extract else completion
    own = client is None
    client = client or SandboxClient(url)
    try:
        cases = await asyncio.gather(*(_one(client, code, c, language, timeout) for c in test_cases))
    finally:
        if own:
            await client.aclose()
    return CodeRewardResult(sum(c.passed for c in cases) / len(cases), list(cases))
