"""`HFEngine`: the embedded transformers engine (CPU default, usable on GPU).

Many agent loops call `generate` at once. All model work runs on one engine
thread (torch releases the GIL, so the event loop keeps serving tool calls and
other trajectories). Two schedulers:

- ``"continuous"`` (default): a fixed set of KV slots (`max_num_seqs`); a
  request joins at the next engine step (its prompt is prefilled as its own
  chunk, then it decodes with the rest) and a finished request frees its slot
  at once. A request may name a `session` (its trajectory id): when its prompt
  extends that session's previous prompt + response, only the new tokens are
  prefilled. On CUDA the decode step is a replayed CUDA graph. See
  continuous.py, scheduler.py, slots.py, model_runner.py, kv_pool.py.
- ``"batch"``: up to `max_batch_size` waiting requests run as one batch until
  its last row finishes; requests arriving meanwhile form the next batch. On
  CUDA the decode step runs on a static KV cache with a compiled forward
  (`static=True` by default there; see decoding.py and shared/GPU.md).

Memory: `sleep()` drops KV caches and, on an accelerator, moves the weights to
CPU; `wake_up()` moves them back. On CPU there is no device memory to give
back, so `sleep()` only drops caches. `sleep(discard_weights=True)` drops the
weights instead, on any device, for callers that load them all again after
`wake_up()` (the trainer pushes every parameter after each update).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from verl_agent.engine.continuous import ContinuousBatcher, KVCacheOverflowError
from verl_agent.engine.decoding import DecodeSettings, StaticState, decode_batch
from verl_agent.engine.contract import GenerateOutput, SamplingParams
from verl_agent.engine.kv_pool import plan_budget

logger = logging.getLogger(__name__)

__all__ = ["EngineClosedError", "HFEngine", "KVCacheOverflowError"]


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
    elif dtype is not None:  # parameters only: float32 buffers (rotary inv_freq) stay as the trainer has them
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return model.to(device).eval()


def _eos_ids(model: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _refuse_unsupported_attention(config: Any, length: int) -> None:
    """The continuous scheduler's attention (kv_pool.slot_attention) sees every earlier token, unscaled: a
    sliding window shorter than the sequences it will hold, or logit soft-capping, would give other tokens
    and log-probs than the trainer computes. Refused, naming the setting, instead of training on them."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if types:  # per-layer kinds (Gemma2/3, Qwen2 with use_sliding_window)
        sliding = "sliding_attention" in types
    else:  # Mistral-style: a window on every layer when set
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
    if sliding and window is not None and window < length:
        raise ValueError(f"HFEngine: the model attends through a sliding window of {window} tokens, shorter than "
                         f"the {length} the continuous scheduler holds per sequence; use rollout.scheduler=batch "
                         "(the model's own attention) or the sglang engine")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("HFEngine: attention logit soft-capping (attn_logit_softcapping) is not implemented by the "
                         "continuous scheduler; use rollout.scheduler=batch or the sglang engine")


class HFEngine:
    """Batched async generation on a transformers causal LM; implements `Engine`.

    model: a HF path/id or an already-built model (e.g. the trainer's colocated replica).
    stop_on_eos: also stop each request on the model's eos ids (besides its own stop ids).
    scheduler: "continuous" (slots, sessions, CUDA-graph decode on CUDA) or "batch" (per-batch, as before).
    max_batch_size: "batch": requests decoded together; "continuous": slots when max_num_seqs is None.
    max_num_seqs: "continuous": sequences holding a KV slot at once (running or idle sessions).
    max_num_batched_tokens: "continuous": prompt tokens (rows x padded width) per prefill chunk.
    max_model_len: "continuous": tokens one slot holds (default: the model's limit, at most 4096).
    gpu_memory_utilization: "continuous": share of the device's memory (host RAM on CPU) that weights +
        KV cache may use; fewer slots (or shorter ones) when max_num_seqs x max_model_len do not fit.
    kv_cache_bytes: "continuous": the KV budget in bytes, instead of gpu_memory_utilization.
    static: "batch": static KV cache (fixed shapes); default True on CUDA, False on CPU.
    compile: "batch": torch.compile the decode step with CUDA graphs; "continuous": capture the decode
        step as CUDA graphs. Default: on CUDA.
    torch_compile: "continuous": torch.compile the decode step's forward (then captured as CUDA graphs on
        CUDA): fewer, fused kernels a layer, for a compile per decode shape on first use.
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
        scheduler: Literal["continuous", "batch"] = "continuous",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        torch_compile: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"HFEngine: max_batch_size must be >= 1, got {max_batch_size}")
        if scheduler not in ("continuous", "batch"):
            raise ValueError(f"HFEngine: scheduler must be 'continuous' or 'batch', got {scheduler!r}")
        if torch_compile and scheduler != "continuous":
            raise ValueError("HFEngine: torch_compile (rollout.enable_torch_compile) is for the continuous scheduler; "
                             "the batch scheduler compiles its static decode step on CUDA by itself (compile=)")
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
        # One dedicated decode thread: CUDA-graph state (cudagraph trees) is thread-local. On CUDA it launches
        # on a high-priority stream of its own: while the trainer trains on the default stream (async modes),
        # a decode step neither queues behind the update's kernels nor waits for them when it reads its tokens.
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights just loaded
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine-decode",
                                            initializer=self._enter_stream)
        self._pending: list[_Request] = []
        self._event: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._asleep = False
        self._discarded: dict[str, tuple[torch.nn.Parameter, torch.Size]] = {}  # name -> (param, shape) until reloaded
        self._closed = False
        self.policy_version = 0
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0}
        self._busy_s = 0.0
        self.scheduler = scheduler
        self._batcher: ContinuousBatcher | None = None
        if scheduler == "continuous":
            limit = self.settings.max_length or 4096
            budget = plan_budget(
                self.model, max_num_seqs or max_batch_size, min(max_model_len or min(limit, 4096), limit),
                gpu_memory_utilization, kv_cache_bytes,
            )  # fmt: skip
            _refuse_unsupported_attention(self.model.config, budget.length)
            logger.info("HFEngine continuous batching: %s", budget.describe())
            self._batcher = ContinuousBatcher(
                self.model, budget, pad_id=self.settings.pad_token_id, cache_kw=_cache_kw(self.model),
                cuda_graphs=self.device.type == "cuda" if compile is None else compile,
                max_num_batched_tokens=max_num_batched_tokens, generator=self._generator, compile_decode=torch_compile,
            )  # fmt: skip

    # -- Engine API ---------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None,
        on_token: Callable[[int, float], None] | None = None,
    ) -> GenerateOutput:
        """Queue one request and wait for its own result (see `Engine`); `session` enables KV reuse.
        `on_token`: "continuous" calls it after every engine step; "batch" only when the batch is done."""
        if self._closed:
            raise EngineClosedError("HFEngine.generate() called after close()")
        if self._asleep:
            raise RuntimeError("HFEngine.generate() called while asleep: call wake_up() first")
        if self._discarded:
            raise RuntimeError(f"HFEngine.generate(): {len(self._discarded)} parameters (e.g. "
                               f"{next(iter(self._discarded))!r}) were discarded by sleep(discard_weights=True) "
                               "and not loaded again by update_weights")
        self._check_prompt(prompt_ids)
        if self._batcher is not None:
            return await self._generate_continuous(list(prompt_ids), sampling, session, on_token)
        self._ensure_server()
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), sampling, fut))
        assert self._event is not None
        self._event.set()
        out = await fut
        for t, lp in zip(out.token_ids, out.logprobs) if on_token is not None else ():
            on_token(t, lp)
        return out

    async def release_session(self, session: str) -> None:
        """The trajectory `session` has ended: free its KV slot (a running request keeps it until done)."""
        if self._batcher is not None and not self._closed:
            self._batcher.submit(("release", session), self._executor)

    async def interrupt(self) -> bool:
        """End every request in flight at the next token boundary ("abort", with the tokens sampled so far),
        ahead of a weight update; "continuous" only ("batch" returns False: its batches run to the end)."""
        if self._batcher is None or self._closed:
            return False
        self._batcher.submit(("interrupt", ""), self._executor)
        return True

    def metrics(self) -> dict[str, float]:
        """Counters since construction, as `engine/<name>` floats (busy_s: seconds inside forward + sampling)."""
        if self._batcher is None:
            out = {**self.stats, "busy_s": self._busy_s}
        else:
            b = self._batcher
            out = {**b.counters, **b.sched.counters, "busy_s": b.runner.busy_s,
                   "sessions_evicted": b.sched.table.evicted, "sessions_idle": b.sched.table.n_idle,
                   "kv_slots": b.budget.slots, "kv_tokens_per_slot": b.budget.length,
                   "cuda_graphs": len(b.runner.graphs), "graph_captures": b.runner.captures,
                   "graph_capture_s": b.runner.capture_s}  # fmt: skip
        return {f"engine/{k}": float(v) for k, v in out.items()}

    async def capture_graphs(self) -> int:
        """Capture every decode-step CUDA graph now rather than on first use; returns how many exist."""
        if self._batcher is None:
            return 0
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._batcher.runner.capture_all)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters/buffers in place, by name; unknown names raise KeyError.

        Idle sessions' K/V were computed by the old weights, so they are dropped."""
        async with self._get_lock():
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._load_weights, list(named_tensors)
            )
        self.policy_version += 1

    async def sleep(self, discard_weights: bool = False) -> None:
        """Free the KV caches and the weights' device memory: the weights move to the host, or with
        `discard_weights` are dropped (no copy: a 7B model's 15 GB took 8.7 s to move on an H100 box); then
        `generate` refuses until `update_weights` has replaced every parameter again."""
        async with self._get_lock():
            if self._batcher is not None:
                await asyncio.get_running_loop().run_in_executor(self._executor, self._batcher.free_memory)
            self._static.caches.clear()
            if discard_weights:
                for name, p in self.model.named_parameters():  # tied parameters appear once
                    self._discarded.setdefault(name, (p, p.shape))
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            elif self.device.type != "cpu":
                self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._asleep = True

    async def wake_up(self) -> None:
        async with self._get_lock():
            for p, shape in self._discarded.values():
                if p.shape != shape:  # room for update_weights to fill
                    p.data = torch.empty(shape, dtype=p.dtype, device=self.device)
            self.model.to(self.device)
            if self._stream is not None:  # moved on this thread's stream; the decode thread reads them on its own
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            self._asleep = False

    async def close(self) -> None:
        self._closed = True
        if self._batcher is not None:
            self._batcher.closed = True
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self._batcher.serve)  # aborts whatever is left
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
    async def _generate_continuous(self, prompt: list[int], sampling: SamplingParams, session: str | None,
                                   on_token: Callable[[int, float], None] | None):  # fmt: skip
        assert self._batcher is not None
        stops = set(self.settings.eos_token_ids) if self.settings.stop_on_eos else set()
        seq = self._batcher.make_seq(prompt, sampling, session, stops, asyncio.get_running_loop(), on_token)
        self._batcher.submit(seq, self._executor)
        return await seq.future

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
        try:
            await self._decode(batch)
        finally:  # cancelled (close() while the batch runs): its callers get "abort" rather than wait forever
            for r in batch:
                if not r.future.done():
                    r.future.set_result(GenerateOutput([], [], "abort"))

    async def _decode(self, batch: list[_Request]) -> None:
        async with self._get_lock():
            t0 = time.perf_counter()
            try:
                job = functools.partial(
                    decode_batch, self.model, [r.prompt_ids for r in batch], [r.sampling for r in batch],
                    self.settings, self._static, self._generator,
                )  # fmt: skip
                outs = await asyncio.get_running_loop().run_in_executor(self._executor, job)
                self._busy_s += time.perf_counter() - t0
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

    def _enter_stream(self) -> None:
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)

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
        if self._batcher is not None:
            self._batcher.drop_sessions()


def _cache_kw(model: Any) -> str:
    """The forward's cache keyword: `cache` since transformers 5.2x, `past_key_values` before."""
    import inspect

    try:
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"
