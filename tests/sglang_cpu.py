"""Where the SGLang test environment is, and how to start SGLang on CPU with the test-only shims.

The SGLang venv is built by scripts/setup_sglang.sh (default .venv-sglang at the repository root,
or $SGLANG_VENV). Without it, SGLang tests are skipped on a developer machine and FAIL in CI
(CI=true), so a broken setup can never pass as "skipped". Importable from any test folder
(tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "tests" / "sglang_shims"
# Flags that make SGLang 0.5.23 run on CPU with a tiny model (see docs/sglang.md).
CPU_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
    "--max-total-tokens", "4096", "--mem-fraction-static", "0.3",
]  # fmt: skip
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SHIMS)}


def sglang_python() -> str:
    """The SGLang venv's interpreter; skips (or fails in CI) when the venv is absent."""
    venv = Path(os.environ.get("SGLANG_VENV") or ROOT / ".venv-sglang")
    python = venv / "bin" / "python"
    if (venv / ".verl_agent_sglang_stamp").is_file() and python.exists():
        return str(python)
    reason = f"SGLang venv {venv} is missing: run scripts/setup_sglang.sh"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)
