"""LoRA on the actor (actor_rollout_ref.model.lora_rank > 0), through PEFT.

The base model is frozen (bf16 on GPU, or whatever model.dtype says) and holds no optimizer state; the
adapters are fp32 master weights (PEFT's `autocast_adapter_dtype`). The reference policy is the same
model with its adapters switched off (`reference_of`), never a second copy. The engine gets only the
adapter tensors (`engine_adapter_tensors`), named after the base model's layers with B pre-scaled
(engine/runner/lora.py); with one train rank it may read the actor's base tensors instead of holding its own
(shared_weights.py). The HF export is a PEFT adapter folder (`export_adapter`), plus, with
trainer.export_merged_model, the merged full model (`merged_tensors`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from verl_agent.config import ConfigError

__all__ = ["adapter_parameters", "base_name", "engine_adapter_tensors", "engine_name", "export_adapter",
           "lora_scaling", "merged_tensors", "reference_of", "wrap_lora"]

_PEFT_PREFIX = "base_model.model."
_ADAPTER = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")  # PEFT's parameter names carry the adapter's name


def _lora_config(model_cfg: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=model_cfg.target_modules, exclude_modules=model_cfg.exclude_modules, task_type="CAUSAL_LM")


def _check_names(base: nn.Module, model_cfg: Any) -> None:
    """Every module name in a target_modules / exclude_modules list must name a layer of the model (PEFT itself
    only complains when none matches)."""
    names = [n for n, _ in base.named_modules() if n]
    for key in ("target_modules", "exclude_modules"):
        value = getattr(model_cfg, key)
        if not isinstance(value, list):
            continue
        missing = [v for v in value if not any(n == v or n.endswith("." + v) for n in names)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, nn.Linear)})
            raise ConfigError(f"actor_rollout_ref.model.{key}: {missing} name no module of "
                              f"{type(base).__name__}; its linear layers are {linear}")


def wrap_lora(base: nn.Module, model_cfg: Any) -> nn.Module:
    """The PEFT model around `base` (frozen) with the configured adapters: fresh (B = 0, the base's policy), or
    with the weights of model_cfg.lora_adapter_path, which must fit the configuration."""
    from peft import get_peft_model

    _check_names(base, model_cfg)
    try:
        model = get_peft_model(base, _lora_config(model_cfg))
    except ValueError as e:  # e.g. a target regex that matches nothing
        raise ConfigError(f"actor_rollout_ref.model.target_modules={model_cfg.target_modules!r}: {e}") from None
    bad = [n for n, m in model.named_modules()
           if hasattr(m, "lora_A") and not isinstance(m.get_base_layer(), nn.Linear)]
    if bad:
        raise ConfigError(f"actor_rollout_ref.model.target_modules: {bad[:3]} are not linear layers; adapters go on "
                          "linear layers only")
    if model_cfg.lora_adapter_path:
        _load_adapter(model, model_cfg)
    for n, p in model.named_parameters():  # adapters train in fp32 whatever the base's dtype
        if _ADAPTER.search(n) and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def _load_adapter(model: nn.Module, model_cfg: Any) -> None:
    """Load a PEFT adapter folder into the configured adapters: rank, alpha and the adapted layers must match
    the configuration (the config is what the run says it trains; a silent difference would be ignored keys)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    path, key = Path(model_cfg.lora_adapter_path), "actor_rollout_ref.model.lora_adapter_path"
    if not (path / "adapter_config.json").is_file() or not (path / "adapter_model.safetensors").is_file():
        raise ConfigError(f"{key}={str(path)!r}: no adapter_config.json + adapter_model.safetensors there")
    saved = json.loads((path / "adapter_config.json").read_text())
    for name, ours in (("r", model_cfg.lora_rank), ("lora_alpha", model_cfg.lora_alpha)):
        if float(saved.get(name, -1)) != float(ours):
            conf = "lora_rank" if name == "r" else name
            raise ConfigError(f"{key}: the adapter has {name}={saved.get(name)}, but actor_rollout_ref.model.{conf}="
                              f"{ours}")
    result = set_peft_model_state_dict(model, load_file(str(path / "adapter_model.safetensors")))
    missing = [k for k in result.missing_keys if _ADAPTER.search(k)]
    if missing or result.unexpected_keys:
        raise ConfigError(f"{key}: the adapter's layers differ from target_modules / exclude_modules: "
                          f"{len(missing)} configured adapter tensors missing (e.g. {missing[:2]}), "
                          f"{len(result.unexpected_keys)} not configured (e.g. {result.unexpected_keys[:2]})")


def adapter_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The trainable (adapter) parameters, by PEFT name."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def lora_scaling(model: nn.Module) -> float:
    cfg = model.peft_config["default"]
    return float(cfg.lora_alpha) / float(cfg.r)


def engine_name(peft_name: str) -> str:
    """`base_model.model.model.layers.0.q_proj.lora_A.default.weight` -> `model.layers.0.q_proj.lora_A.weight`."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return _ADAPTER.sub(lambda m: f".lora_{m.group(1)}.weight", name)


def engine_adapter_tensors(buckets: Iterator[list[tuple[str, Tensor]]], scaling: float
                           ) -> Iterator[list[tuple[str, Tensor]]]:  # fmt: skip
    """Gathered adapter buckets renamed for the engine, B multiplied by the scaling (engine/runner/lora.py)."""
    for bucket in buckets:
        yield [(engine_name(n), t * scaling if ".lora_B." in n else t) for n, t in bucket]


@contextlib.contextmanager
def reference_of(model: nn.Module) -> Iterator[nn.Module]:
    """The reference policy: `model` with its adapters switched off, i.e. the frozen base bit for bit (each
    adapted layer adds B A x scaled by 0: an exact +0).

    Not PEFT's `disable_adapter()`: a forward that skips the adapters leaves FSDP2 under bf16 mixed
    precision to reduce the next backward's adapter gradients in bf16 into fp32 parameters, which fails."""
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and isinstance(getattr(m, "scaling", None), dict)]
    saved = [dict(m.scaling) for m in layers]
    for m in layers:
        m.scaling = {k: 0.0 for k in m.scaling}
    try:
        yield model
    finally:
        for m, scaling in zip(layers, saved):
            m.scaling = scaling


def export_adapter(model: nn.Module, gathered: dict[str, Tensor], model_path: str, out: Path) -> None:
    """A PEFT adapter folder: adapter_config.json + adapter_model.safetensors (the keys PEFT saves)."""
    from safetensors.torch import save_file

    cfg = model.peft_config["default"]
    cfg.base_model_name_or_path = model_path
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    state = {_ADAPTER.sub(lambda m: f".lora_{m.group(1)}.weight", n): t.detach().cpu().contiguous()
             for n, t in gathered.items()}
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def base_name(peft_name: str) -> str:
    """A base parameter's name in the plain model: `base_model.model.X.base_layer.weight` -> `X.weight`."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def merged_tensors(named: Iterator[tuple[str, Tensor]], adapters: dict[str, Tensor], scaling: float
                   ) -> Iterator[tuple[str, Tensor]]:  # fmt: skip
    """The base parameters (gathered, PEFT names) under their plain names, each targeted weight with
    scaling x B A added (in fp32, then the base's dtype)."""
    for name, t in named:
        if _ADAPTER.search(name):
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len(".base_layer.weight")]
            a = next(v for k, v in adapters.items() if k.startswith(prefix + ".lora_A."))
            b = next(v for k, v in adapters.items() if k.startswith(prefix + ".lora_B."))
            t = (t.float() + scaling * (b.float() @ a.float())).to(t.dtype)
        yield base_name(name), t

