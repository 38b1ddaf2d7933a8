"""The inference engine: the `Engine` contract; the engines that meet it (`backends/`: HF, SGLang, scripted);
the HF engine's machinery (continuous batching over a slot KV cache, the model runner, its memory); and
tensor handles for weight transfer.

Heavy modules (torch, transformers) load on first attribute access.
"""

from __future__ import annotations

from verl_agent.engine.contract import Engine, EngineContractError, GenerateOutput, SamplingParams, check_engine
from verl_agent.engine.settings import HFEngineSettings
from verl_agent.imports import lazy_attributes

__all__ = [
    "Engine",
    "EngineContractError",
    "GenerateOutput",
    "HFEngine",
    "HFEngineSettings",
    "SGLangEngine",
    "SamplingParams",
    "ScriptedEngine",
    "check_engine",
]

_LAZY = {
    "HFEngine": "verl_agent.engine.backends.hf_engine",
    "SGLangEngine": "verl_agent.engine.backends.sglang_engine",
    "ScriptedEngine": "verl_agent.engine.backends.scripted",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
