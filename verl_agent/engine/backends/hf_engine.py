"""`HFEngine`: the embedded transformers engine (CPU default, usable on GPU).

Many agent loops call `generate` at once. All model work runs on one engine
thread (torch releases the GIL, so the event loop keeps serving tool calls and
other trajectories). Scheduling is continuous: a fixed set of KV slots
(`max_num_seqs`); a request joins at the next engine step (its prompt is
prefilled as its own chunk, then it decodes with the rest) and a finished
request frees its slot at once. A request may name a `session` (its trajectory
id): when its prompt extends that session's previous prompt + response, only
the new tokens are prefilled. On CUDA the decode step is a replayed CUDA graph.
See engine/continuous.py, scheduler.py, slots.py, model_runner.py, kv_pool.py.

Memory: `sleep()` drops KV caches and, on an accelerator, moves the weights to
CPU; `wake_up()` moves them back. On CPU there is no device memory to give
back, so `sleep()` only drops caches. `sleep(discard_weights=True)` drops the
weights instead, on any device, for callers that load them all again after
`wake_up()` (the trainer pushes every parameter after each update).
With decode graphs the weights and the KV pool live in fixed-address arenas
(arena.py): sleep gives their memory back, wake takes it again at the same
addresses, and the recorded graphs replay without being recorded again.
Weights borrowed from another model (`BORROWED_WEIGHTS`: the colocated trainer's tensors) are never moved,
parked or dropped: `sleep()` frees the KV caches alone, whatever it is asked.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from verl_agent.engine.runner.arena import ParamArena
from verl_agent.engine.continuous import ContinuousBatcher, KVCacheOverflowError
from verl_agent.engine.contract import GenerateOutput, SamplingParams
from verl_agent.engine.runner.decode_step import fusion_groups
from verl_agent.engine.runner.kv_pool import plan_budget
from verl_agent.engine.runner.lora import apply_adapters, split_adapter_tensors
from verl_agent.engine.runner.model_runner import GraphCapture
from verl_agent.engine.settings import HFEngineSettings

logger = logging.getLogger(__name__)

__all__ = ["BORROWED_WEIGHTS", "EngineClosedError", "HFEngine", "HFEngineSettings", "KVCacheOverflowError"]

# set to True on a model whose parameters point at another model's tensors (the engine must not move them)
BORROWED_WEIGHTS = "verl_agent_borrowed_weights"


class EngineClosedError(RuntimeError):
    """generate() was called after close()."""


def _load(model: str | Path | Any, device: str, dtype: str | torch.dtype | None, fixed: bool) -> tuple[Any, Any]:
    """The model on `device`, cast to `dtype`; fixed: its parameters in a `ParamArena` (returned, or None
    where the driver refuses one), moved there one at a time, each layer's fusable projections back to back."""
    model = _cast(model, dtype)
    params = ParamArena.adopt(model, torch.device(device), fusion_groups(model)) if fixed else None
    return model.to(device).eval(), params


def _cast(model: str | Path | Any, dtype: str | torch.dtype | None) -> Any:
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    elif dtype is not None:  # parameters only: float32 buffers (rotary inv_freq) stay as the trainer has them
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return model


def _eos_ids(model: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _pad_id(model: Any, vocab_size: int) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None and 0 <= pad < vocab_size else 0


def _refuse_unsupported_attention(config: Any, length: int) -> None:
    """The slot attention (kv_pool.slot_attention) sees every earlier token, unscaled: a sliding window
    shorter than the sequences a slot holds, or logit soft-capping, would give other tokens and log-probs
    than the trainer computes. Refused, naming the setting, instead of training on them."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if types:  # per-layer kinds (Gemma2/3, Qwen2 with use_sliding_window)
        sliding = "sliding_attention" in types
    else:  # Mistral-style: a window on every layer when set
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
    if sliding and window is not None and window < length:
        raise ValueError(f"HFEngine: the model attends through a sliding window of {window} tokens, shorter than "
                         f"the {length} one KV slot holds; set rollout.max_model_len <= {window} "
                         "or use the sglang engine (rollout.name=sglang)")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("HFEngine: attention logit soft-capping (attn_logit_softcapping) is not implemented by "
                         "the slot attention; use the sglang engine (rollout.name=sglang)")


def _with_overrides(settings: HFEngineSettings | None, overrides: dict[str, Any]) -> HFEngineSettings:
    settings = settings or HFEngineSettings()
    names = [f.name for f in fields(HFEngineSettings)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"HFEngine: unknown settings {unknown}; HFEngineSettings has {names}")
    return replace(settings, **overrides) if overrides else settings


class HFEngine:
    """Continuously batched async generation on a transformers causal LM; implements `Engine`.

    model: a HF path/id or an already-built model (e.g. the trainer's colocated replica).
    settings: see `HFEngineSettings`; keyword arguments override single fields of it
        (`HFEngine(model, stop_on_eos=False, max_model_len=128)`).
    graph_capture: records decode steps instead of CUDA graphs (`model_runner.GraphCapture`); for tests
        of the graph path on CPU.
    """

    def __init__(self, model: str | Path | Any, settings: HFEngineSettings | None = None, *,
                 graph_capture: GraphCapture | None = None, **overrides: Any) -> None:  # fmt: skip
        s = self.settings = _with_overrides(settings, overrides)
        self.device = torch.device(s.device)
        self._graph_capture = graph_capture
        graphs = graph_capture is not None or (s.cuda_graphs and self.device.type == "cuda")
        # weights borrowed from another model (the trainer's) stay where they are: an arena would copy them, and
        # as they never move, the graphs that read them stay valid across a sleep without one
        self._borrowed = bool(getattr(model, BORROWED_WEIGHTS, False))
        self.model, self._params = _load(model, s.device, s.dtype, fixed=graphs and not self._borrowed)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self._stops = frozenset(_eos_ids(self.model)) if s.stop_on_eos else frozenset()
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(s.seed)
        # One dedicated decode thread: CUDA-graph state is thread-local. On CUDA it launches on a high-priority
        # stream of its own: while the trainer trains on the default stream (async modes), a decode step
        # neither queues behind the update's kernels nor waits for them when it reads its tokens.
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights just loaded
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine-decode",
                                            initializer=self._enter_stream)
        self._lock: asyncio.Lock | None = None
        self._asleep = False
        self._discarded: dict[str, tuple[torch.nn.Parameter, torch.Size]] = {}  # name -> (param, shape) until reloaded
        self._closed = False
        self.policy_version = 0
        self._batcher = self._build_batcher()

    def _build_batcher(self) -> ContinuousBatcher:
        s = self.settings
        limit = getattr(self.model.config, "max_position_embeddings", None) or 4096
        length = min(s.max_model_len or min(limit, 4096), limit)
        budget = plan_budget(self.model, s.max_num_seqs, length, s.gpu_memory_utilization, s.kv_cache_bytes)
        _refuse_unsupported_attention(self.model.config, budget.length)
        logger.info("HFEngine continuous batching: %s", budget.describe())
        batcher = ContinuousBatcher(
            self.model, budget, pad_id=_pad_id(self.model, self.vocab_size), cache_kw=_cache_kw(self.model),
            cuda_graphs=s.cuda_graphs, max_num_batched_tokens=s.max_num_batched_tokens, generator=self._generator,
            compile_decode=s.torch_compile, fused_norms=s.fused_norms, capture=self._graph_capture,
            own_decode_step=s.own_decode_step, decode_lookahead=s.decode_lookahead, share_prompts=s.share_prompts,
        )  # fmt: skip
        batcher.runner.fixed_weights = self._params is not None or self._borrowed
        return batcher

    # -- Engine API ---------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None,
        on_token: Callable[[int, float], None] | None = None,
    ) -> GenerateOutput:
        """Queue one request and wait for its own result (see `Engine`); `session` enables KV reuse.
        `on_token` is called with each (token, log-prob) right after the engine step that sampled it."""
        if self._closed:
            raise EngineClosedError("HFEngine.generate() called after close()")
        if self._asleep:
            raise RuntimeError("HFEngine.generate() called while asleep: call wake_up() first")
        if self._discarded:
            raise RuntimeError(f"HFEngine.generate(): {len(self._discarded)} parameters (e.g. "
                               f"{next(iter(self._discarded))!r}) were discarded by sleep(discard_weights=True) "
                               "and not loaded again by update_weights")
        self._check_prompt(prompt_ids)
        seq = self._batcher.make_seq(list(prompt_ids), sampling, session, self._stops,
                                     asyncio.get_running_loop(), on_token)
        self._batcher.submit(seq, self._executor)
        return await seq.future

    async def release_session(self, session: str) -> None:
        """The trajectory `session` has ended: free its KV slot (a running request keeps it until done)."""
        if not self._closed:
            self._batcher.submit(("release", session), self._executor)

    async def interrupt(self) -> bool:
        """End every request in flight at the next token boundary ("abort", with the tokens sampled so far),
        ahead of a weight update. False once closed."""
        if self._closed:
            return False
        self._batcher.submit(("interrupt", ""), self._executor)
        return True

    def metrics(self) -> dict[str, float]:
        """Counters since construction and gauges, as `engine/<name>` floats (busy_s: prefill_s + decode_s, the
        engine thread's time in prefill chunks and decode steps; see continuous.py)."""
        b = self._batcher
        out = {**b.counters, **b.sched.counters, "busy_s": b.runner.busy_s,
               "sessions_evicted": b.sched.table.evicted, "sessions_idle": b.sched.table.n_idle,
               "kv_slots": b.budget.slots, "kv_tokens_per_slot": b.budget.length,
               "cuda_graphs": len(b.runner.graphs), "graph_captures": b.runner.captures,
               "graph_capture_s": b.runner.capture_s,
               "compile_cache_loaded": b.runner.compile_cache.loaded if b.runner.compile_cache else 0}  # fmt: skip
        return {f"engine/{k}": float(v) for k, v in out.items()}

    async def capture_graphs(self) -> int:
        """Capture every decode-step CUDA graph now rather than on first use; returns how many exist."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._batcher.runner.capture_all)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters/buffers in place, by name; unknown names raise KeyError.
        LoRA adapter tensors (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight`` pre-scaled) are applied as
        settings.lora_mode says (engine/runner/lora.py).

        Idle sessions' K/V were computed by the old weights, so they are dropped."""
        async with self._get_lock():
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._load_weights, list(named_tensors)
            )
        self.policy_version += 1

    async def sleep(self, discard_weights: bool = False) -> None:
        """Free the KV caches and the weights' device memory: the weights move to the host, or with
        `discard_weights` are dropped (no copy, for callers that push every parameter again); then
        `generate` refuses until `update_weights` has replaced every parameter again. Borrowed weights stay
        (the module docstring)."""
        async with self._get_lock():
            await asyncio.get_running_loop().run_in_executor(self._executor, self._free, discard_weights)
            self._asleep = True

    def _free(self, discard_weights: bool) -> None:
        self._batcher.free_memory()
        if not self._borrowed:  # borrowed: another model's tensors, moving or emptying them would end the sharing
            self._free_weights(discard_weights)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _free_weights(self, discard_weights: bool) -> None:
        if discard_weights:
            for name, p in self.model.named_parameters():  # tied parameters appear once
                self._discarded.setdefault(name, (p, p.shape))
        if self._params is not None and (discard_weights or self.device.type != "cpu"):
            self._params.park(keep=not discard_weights)  # same addresses at wake: graphs stay valid
        elif discard_weights:
            for p, _ in self._discarded.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        elif self.device.type != "cpu":
            self.model.to("cpu")

    async def wake_up(self) -> None:
        async with self._get_lock():
            await asyncio.get_running_loop().run_in_executor(self._executor, self._restore)
            self._asleep = False

    def _restore(self) -> None:
        """On the decode thread, so that its stream orders the copies before the next step."""
        if self.device.type == "cuda":  # the arenas take memory from the driver, not from torch's cache: give the
            torch.cuda.empty_cache()  # blocks a colocated trainer freed back first, as its allocations reused them
        if self._borrowed:  # `_free` left them where they are
            return
        if self._params is not None:
            self._params.restore()
        for p, shape in self._discarded.values():
            if p.shape != shape:  # room for update_weights to fill
                p.data = torch.empty(shape, dtype=p.dtype, device=self.device)
        self.model.to(self.device)

    async def close(self) -> None:
        """Abort every request still queued or running (finish "abort") and stop the decode thread."""
        self._closed = True
        self._batcher.closed = True
        await asyncio.get_running_loop().run_in_executor(self._executor, self._batcher.serve)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._drop_memory)
        self._executor.shutdown(wait=False)

    def _drop_memory(self) -> None:
        """The KV pool and the graphs go now. The parameters stay where they are, usable by whoever shares
        the model: their arena lives as long as they do, like any tensor's memory."""
        self._batcher.runner.free(keep_graphs=False)
        self._params = None

    # -- internals ------------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("HFEngine.generate: prompt_ids is empty")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"HFEngine.generate: prompt_ids contain ids outside [0, {self.vocab_size}): {bad[:5]}")

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _enter_stream(self) -> None:
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)

    def _load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        named, adapters = split_adapter_tensors(named)
        if self._stream is not None and adapters:
            torch.cuda.synchronize(self.device)
        if adapters and (installed := apply_adapters(self.model, adapters, self.settings.lora_mode)):
            # captured without these adapters' matmuls: capture again
            self._batcher.runner.drop_graphs(f"adapters installed in {installed} layers")
        state = self.model.state_dict()
        unknown = [n for n, _ in named if n not in state]
        if unknown:
            raise KeyError(
                f"HFEngine.update_weights: unknown parameter names {unknown[:5]} (model has e.g. {list(state)[:3]})"
            )
        for name, tensor in named:
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"HFEngine.update_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(state[name].shape)}"
                )
        if self._stream is not None:  # the tensors come from another thread's stream: wait until they are written
            torch.cuda.synchronize(self.device)
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor.detach().to(device=state[name].device, dtype=state[name].dtype))
        if self._stream is not None:  # ... and the caller may free or overwrite them once we return
            self._stream.synchronize()
        if self._discarded:  # a tied parameter is loaded under either of its names
            params = dict(self.model.named_parameters(remove_duplicate=False))
            loaded = {id(params[name]) for name, _ in named if name in params}
            self._discarded = {n: v for n, v in self._discarded.items() if id(v[0]) not in loaded}
        self._batcher.drop_sessions()


def _cache_kw(model: Any) -> str:
    """The forward's cache keyword: `cache` in newer transformers releases, `past_key_values` in older ones."""
    try:
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"
