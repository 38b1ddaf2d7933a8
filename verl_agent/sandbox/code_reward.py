"""Code reward: run a completion's code against test cases in the sandbox; score = pass rate.

Two test styles, as in code RL datasets:
  stdin/stdout   ``{"input": "1 2\\n", "output": "3\\n"}`` -- compare stdout, whitespace-normalised per line
  function call  ``{"fn_name": "add", "args": [1, 2], "expected": 3}`` -- call ``fn_name(*args)`` in Python; the
                 return value must be plain JSON data equal to the expected value (numbers by value, so 3.0
                 is 3, but bool is not a number; a tuple counts as a list; no other types)
The code is the last fenced block of the completion (```python ... ```), or the whole text if none.
Cases run concurrently; one failing, timing out or crashing case never affects the others.

A sandbox that cannot be reached or fails (``SandboxError``) is not the completion's doing: ``score_code``
raises ``SandboxUnavailable`` instead of scoring it, and the reward path reports the sample as failed.

Function-call verdicts cannot be forged by the code under test. The program run is a fixed harness that
reads the case from stdin (a random per-call nonce, the expected value, the solution's source), makes
itself non-dumpable, and only then runs the solution in a child process whose stdout is /dev/null and
which never sees the nonce or the expected value; the child sends back the JSON of the return value,
the harness compares it and prints the verdict tagged with the nonce. So printing a verdict and
exiting, an ``__eq__`` that always says True, or reading the answer from the source file cannot pass.
Residual threat: the solution runs as the harness's uid, so where the harness cannot make itself
non-dumpable (no ctypes) and ptrace between such processes is allowed (YAMA ptrace_scope 0), or where
the sandbox grants CAP_SYS_PTRACE (e.g. a Sandbox Fusion deployment running code as root), it could
read the nonce from the harness's memory through /proc. It can always kill the harness: never a pass.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from dataclasses import dataclass, field

from verl_agent.sandbox.api import DEFAULT_URL
from verl_agent.sandbox.client import SandboxClient, SandboxUnavailable

__all__ = ["CaseResult", "CodeRewardResult", "SandboxUnavailable", "extract_code", "score_code"]

_FENCE = re.compile(r"```[ \t]*([\w+#-]*)[ \t]*\n(.*?)```", re.DOTALL)
# The child: runs the solution with an empty stdin, calls the function, writes the return value's JSON
# (plain data of exact built-in types only) to the fd the harness gave it.
_CHILD = r"""
import json, linecache, os, sys
job = json.loads(sys.stdin.readline())
out = os.fdopen(int(sys.argv[1]), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
src = job["code"]
linecache.cache["<solution>"] = (len(src), None, src.splitlines(True), "<solution>")
ns = {"__name__": "__main__", "__builtins__": __builtins__}
exec(compile(src, "<solution>", "exec"), ns)
got = eval(job["fn"], ns)(*job["args"])
def plain(x):
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t in (list, tuple):
        return [plain(v) for v in x]
    if t is dict and all(type(k) is str for k in x):
        return {k: plain(v) for k, v in x.items()}
    raise TypeError(t.__name__)
try:
    value = json.dumps(plain(got))
except (TypeError, ValueError, RecursionError):
    value = None
try:
    shown = repr(got)[:200]
except Exception as e:
    shown = f"<repr raised {type(e).__name__}>"
out.write(json.dumps({"value": value, "type": type(got).__name__, "repr": shown}))
"""
# The harness (the program the sandbox runs): takes the case from stdin before any solution code
# exists in a process, and is the only one that knows the nonce and the expected value.
_CALL_HARNESS = r"""
import json, os, subprocess, sys
del sys.path[0]  # the solution can write to this directory: nothing is ever imported from it
try:  # non-dumpable: a process of the same uid cannot read this one's memory or fds through /proc
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
job = json.loads(sys.stdin.readline())
nonce, expected = job.pop("nonce"), job.pop("expected")
r, w = os.pipe()
child = subprocess.Popen([sys.executable, "-u", "-c", CHILD, str(w)], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, pass_fds=(w,))
os.close(w)
try:
    child.stdin.write(json.dumps(job).encode() + b"\n")
    child.stdin.close()
except BrokenPipeError:
    pass
with os.fdopen(r, "rb") as f:
    data = f.read()
code = child.wait()
if code != 0:
    sys.exit(f"the solution exited with code {code}")
try:
    res = json.loads(data)
except ValueError:
    sys.exit("the solution exited before the function returned")
def same(a, b):  # both plain JSON data: == as Python has it, except that a bool is not a number
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    number = (int, float)
    if isinstance(a, number) and isinstance(b, number) and (type(a) is bool) == (type(b) is bool):
        return a == b
    return type(a) is type(b) and a == b
ok = res["value"] is not None and same(json.loads(res["value"]), expected)
got = res["repr"] if res["value"] is not None else f"{res['repr']} (type {res['type']} is not plain JSON data)"
print(nonce + json.dumps({"ok": ok, "got": got}), flush=True)
""".replace("CHILD", repr(_CHILD))


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
    nonce = None
    if "fn_name" in case:
        if language not in ("python", "python3"):
            return CaseResult(False, "sandbox_error", "function-call tests need python")
        nonce = secrets.token_hex(16)
        stdin = json.dumps({"nonce": nonce, "expected": case.get("expected"), "fn": case["fn_name"],
                            "args": case.get("args", []), "code": code}) + "\n"
        code = _CALL_HARNESS
    else:
        stdin = case.get("input", "")
    resp = await client.run_code(code, language, run_timeout=timeout, stdin=stdin)  # SandboxUnavailable: raised
    if resp.status.value == "SandboxError":  # the sandbox failed, not the code: no score for it
        raise SandboxUnavailable(f"sandbox error: {resp.message or 'no message'}")
    if resp.run_result is None:
        return CaseResult(False, "compile_error", (resp.compile_result.stderr or "")[-500:] if resp.compile_result else "")
    run = resp.run_result
    if run.status.value == "TimeLimitExceeded":
        return CaseResult(False, "timeout")
    if run.return_code != 0:
        return CaseResult(False, "runtime_error", (run.stderr or "")[-500:])
    if nonce is not None:
        verdicts = [line[len(nonce):] for line in (run.stdout or "").splitlines() if line.startswith(nonce)]
        try:
            verdict = json.loads(verdicts[-1])
        except (ValueError, IndexError):
            verdict = None
        if not (isinstance(verdict, dict) and type(verdict.get("ok")) is bool and isinstance(verdict.get("got"), str)):
            return CaseResult(False, "runtime_error", "no verdict printed")
        return CaseResult(verdict["ok"], "passed" if verdict["ok"] else "wrong_answer", verdict["got"])
    ok = _norm(run.stdout or "") == _norm(case.get("output", ""))
    return CaseResult(ok, "passed" if ok else "wrong_answer", "" if ok else (run.stdout or "")[:200])


async def score_code(completion: str, test_cases: list[dict], *, client: SandboxClient | None = None,
                     url: str = DEFAULT_URL, language: str = "python", timeout: float = 10.0,
                     extract: bool = True) -> CodeRewardResult:
    """Pass rate of ``completion`` over ``test_cases`` (0.0 when there are none).

    Raises ``SandboxUnavailable`` when the sandbox could not run a case (unreachable, overloaded through
    every retry, or answering ``SandboxError``): an infrastructure failure is never a score."""
    if not test_cases:
        return CodeRewardResult(0.0, [])
    code = extract_code(completion) if extract else completion
    own = client is None
    client = client or SandboxClient(url)
    try:
        # every case ends before the client closes; then the first infrastructure failure is raised
        cases = await asyncio.gather(*(_one(client, code, c, language, timeout) for c in test_cases),
                                     return_exceptions=True)
    finally:
        if own:
            await client.aclose()
    for case in cases:
        if isinstance(case, BaseException):
            raise case
    return CodeRewardResult(sum(c.passed for c in cases) / len(cases), list(cases))
