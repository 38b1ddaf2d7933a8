"""`HFEngineSettings`: how an `HFEngine` is built, and the one place its defaults live.

Torch-free on purpose: `verl_agent.config.RolloutConfig` takes the defaults of its hf engine keys
from here, and loading a config must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["HFEngineSettings"]

DTYPES = ("float32", "bfloat16", "float16")
LORA_MODES = ("merge", "unmerged")  # engine/runner/lora.py


@dataclass(frozen=True)
class HFEngineSettings:
    """Settings of an `HFEngine` (continuous batching over a slot KV cache).

    device: where the model runs ("cpu", "cuda", "cuda:1", ...).
    dtype: cast the parameters to this dtype (a name in DTYPES or a torch.dtype); None keeps the model's.
    seed: seed of the engine's generator (unseeded sampled requests draw from it).
    stop_on_eos: also stop each request on the model's eos ids (besides its own stop ids).
    max_num_seqs: KV slots: sequences holding a slot at once (running, or an idle session's history).
    max_num_batched_tokens: prompt tokens (rows x padded width) per prefill chunk.
    max_model_len: tokens one slot holds (None: the model's limit, at most 4096).
    gpu_memory_utilization: share of the device's memory (host RAM on CPU) that weights + KV cache may use;
        fewer slots (or shorter ones) when max_num_seqs x max_model_len do not fit.
    kv_cache_bytes: the KV budget in bytes, instead of gpu_memory_utilization.
    cuda_graphs: on CUDA, replay each decode step as a captured CUDA graph (CPU decodes eagerly either way);
        the weights and the KV pool then live at fixed addresses (arena.py), so the graphs survive sleep/wake.
    torch_compile: torch.compile the decode step (then captured as CUDA graphs on CUDA): fewer, fused kernels
        a layer, for a compile per decode shape on first use; the compiled artifacts are kept under
        $VERL_AGENT_CACHE/compile and loaded by later runs (compile_cache.py). None (default): on CUDA, where
        the engine's own decode step runs (engine/runner/decode_step.py: one layer compiled for all, so a compile
        costs seconds); True: also transformers' whole forward for other models; False: never.
    fused_norms: run the model's RMSNorm layers through torch's fused kernel (engine/runner/fused_norms.py): fewer
        kernels a decode step, the same rounding points as the model's own forward; switched only while the
        engine runs the model.
    own_decode_step: run decode steps through the engine's own forward (engine/runner/decode_step.py) where it
        reproduces the model (Llama, Mistral, Qwen2, Qwen3); False: transformers' forward for every model.
    decode_lookahead: launch each decode step before recording the previous one's tokens, from those tokens on
        the device, where the rows stay the same (engine/continuous.py): on a GPU the host's bookkeeping of a
        step overlaps the next step's kernels. Seeded requests draw the same numbers either way (a step's rows
        may differ, as with any change in the batch, in the last bits of their log-probs); False: one step at a
        time.
    share_prompts: a request whose prompt is that of a running one (a GRPO group's samples) copies that one's
        prompt K/V instead of prefilling them (engine/scheduler.py); False: every request prefills its prompt.
    lora_mode: how LoRA adapters sent by `update_weights` apply (engine/runner/lora.py): "merge" into the weights
        (a kept copy of each targeted base weight), or "unmerged" (extra thin matmuls in every forward).
    """

    device: str = "cpu"
    dtype: str | torch.dtype | None = None
    seed: int = 0
    stop_on_eos: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    kv_cache_bytes: int | None = None
    cuda_graphs: bool = True
    torch_compile: bool | None = None
    fused_norms: bool = True
    own_decode_step: bool = True
    decode_lookahead: bool = True
    share_prompts: bool = True
    lora_mode: str = "merge"

    def __post_init__(self) -> None:
        problems = []
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES} (or a torch.dtype), got {self.dtype!r}")
        if self.lora_mode not in LORA_MODES:
            problems.append(f"lora_mode must be one of {LORA_MODES}, got {self.lora_mode!r}")
        if problems:
            raise ValueError("HFEngineSettings: " + "; ".join(problems))
