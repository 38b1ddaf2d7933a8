"""`HFEngine`: the embedded transformers engine (CPU default, usable on GPU).

Many agent loops call `generate` at once. Requests queue up; one background
task takes up to `max_batch_size` waiting requests, runs them as one batch in a
worker thread (torch releases the GIL, so the event loop keeps serving tool
calls and other trajectories), and resolves each request's future with its
own row. Requests arriving during a batch form the next one (per-batch
scheduling with early exit: a batch ends when its last row finishes).

On CUDA the decode step runs on a static KV cache with a compiled forward
(`static=True` by default there; see decoding.py and shared/GPU.md).

Memory: `sleep()` drops KV caches and, on an accelerator, moves the weights to
CPU; `wake_up()` moves them back. On CPU there is no device memory to give
back, so `sleep()` only drops caches.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_agent.rollout.decoding import DecodeSettings, StaticState, decode_batch
from verl_agent.rollout.engine import GenerateOutput, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["HFEngine", "EngineClosedError"]


class EngineClosedError(RuntimeError):
    """generate() was called after close()."""


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


def _load(model: str | Path | Any, device: str, dtype: str | torch.dtype | None) -> Any:
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    elif dtype is not None:
        model = model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model.to(device).eval()


def _eos_ids(model: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class HFEngine:
    """Batched async generation on a transformers causal LM; implements `Engine`.

    model: a HF path/id or an already-built model (e.g. the trainer's colocated replica).
    stop_on_eos: also stop each request on the model's eos ids (besides its own stop ids).
    static: static KV cache (fixed shapes); default True on CUDA, False on CPU.
    compile: torch.compile the decode step with CUDA graphs; default = static on CUDA.
    """

    def __init__(
        self,
        model: str | Path | Any,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
        max_batch_size: int = 64,
        stop_on_eos: bool = True,
        static: bool | None = None,
        compile: bool | None = None,
        seed: int = 0,
        sync_every: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"HFEngine: max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.model = _load(model, device, dtype)
        self.max_batch_size = max_batch_size
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        static = self.device.type == "cuda" if static is None else static
        pad = getattr(self.model.config, "pad_token_id", None)
        self.settings = DecodeSettings(
            pad_token_id=int(pad) if pad is not None and 0 <= pad < self.vocab_size else 0,
            eos_token_ids=_eos_ids(self.model),
            stop_on_eos=stop_on_eos,
            static=static,
            compile=(static and self.device.type == "cuda") if compile is None else compile,
            sync_every=sync_every or (8 if static else 1),
            max_length=getattr(self.model.config, "max_position_embeddings", None),
        )
        self._static = StaticState()
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        # One dedicated decode thread: CUDA-graph state (cudagraph trees) is thread-local.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine-decode")
        self._pending: list[_Request] = []
        self._event: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._asleep = False
        self._closed = False
        self.policy_version = 0
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0}

    # -- Engine API ---------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        """Queue one request and wait for its own result (see `Engine`)."""
        if self._closed:
            raise EngineClosedError("HFEngine.generate() called after close()")
        if self._asleep:
            raise RuntimeError("HFEngine.generate() called while asleep: call wake_up() first")
        self._check_prompt(prompt_ids)
        self._ensure_server()
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), sampling, fut))
        assert self._event is not None
        self._event.set()
        return await fut

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters/buffers in place, by name; unknown names raise KeyError."""
        async with self._get_lock():
            await asyncio.to_thread(self._load_weights, list(named_tensors))
        self.policy_version += 1

    async def sleep(self) -> None:
        async with self._get_lock():
            self._static.caches.clear()
            if self.device.type != "cpu":
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self._asleep = True

    async def wake_up(self) -> None:
        async with self._get_lock():
            self.model.to(self.device)
            self._asleep = False

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
            self._server = None
        for r in self._pending:
            if not r.future.done():
                r.future.set_result(GenerateOutput([], [], "abort"))
        self._pending.clear()
        self._static = StaticState()
        self._executor.shutdown(wait=False)

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

    def _ensure_server(self) -> None:
        if self._server is None or self._server.done():
            self._event = asyncio.Event()
            self._server = asyncio.get_running_loop().create_task(self._serve(), name="hf-engine-batcher")

    async def _serve(self) -> None:
        assert self._event is not None
        while True:
            await self._event.wait()
            self._event.clear()
            await asyncio.sleep(0)  # let every task that is ready right now queue its request too
            while self._pending:
                batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]
                del self._pending[: self.max_batch_size]
                if batch:
                    await self._run(batch)

    async def _run(self, batch: list[_Request]) -> None:
        async with self._get_lock():
            try:
                job = functools.partial(
                    decode_batch, self.model, [r.prompt_ids for r in batch], [r.sampling for r in batch],
                    self.settings, self._static, self._generator,
                )  # fmt: skip
                outs = await asyncio.get_running_loop().run_in_executor(self._executor, job)
            except Exception as e:  # one bad batch fails its own requests, never the server
                logger.exception("HFEngine batch of %d failed", len(batch))
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                return
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        for r, out in zip(batch, outs):
            self.stats["generated_tokens"] += len(out.token_ids)
            if not r.future.done():
                r.future.set_result(out)

    def _load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
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
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor.detach().to(device=state[name].device, dtype=state[name].dtype))
