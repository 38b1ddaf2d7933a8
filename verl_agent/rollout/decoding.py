"""One batch of requests through a Hugging Face causal LM: left-padded prefill, then step-wise decoding.

Two cache strategies share the same loop:

- dynamic (default, CPU): a `DynamicCache` that grows each step; eager forward.
- static (GPU fast path, see shared/GPU.md): a `StaticCache` of fixed shape
  [batch bucket, heads, length bucket, dim] and a `torch.compile`d decode step
  (CUDA graphs via mode "reduce-overhead"). Shapes never change during decoding:
  the 2-D padding mask covers the whole cache length from the start (causality
  hides the future positions), and batch/length are rounded up to buckets so
  that a few compiled graphs serve all batches.

Rows that finish keep running (static shapes) but their tokens are discarded;
the batch ends when every row has finished.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_agent.rollout.engine import GenerateOutput, SamplingParams
from verl_agent.rollout.sampling import RowParams, sample

logger = logging.getLogger(__name__)


@dataclass
class DecodeSettings:
    pad_token_id: int
    eos_token_ids: list[int]  # added to every request's stop ids when stop_on_eos
    stop_on_eos: bool = True
    static: bool = False  # static KV cache, fixed shapes
    compile: bool = False  # torch.compile the decode step (CUDA graphs); needs static
    length_bucket: int = 128
    sync_every: int = 1  # check "all finished" every k steps (each check is a device sync)
    max_length: int | None = None  # model context limit


@dataclass
class StaticState:
    """Static caches and the compiled decode call, kept across batches (reused shapes => no recompiles)."""

    caches: dict[tuple[int, int], Any] = field(default_factory=dict)
    compiled: Any = None


def _bucket(n: int, step: int) -> int:
    return -(-n // step) * step


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int, device: torch.device):
    """Left-pad prompts to `width`; returns (ids [B, width], mask [B, width], lengths [B])."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), mask.to(device), lengths.to(device)


def _stop_table(params: Sequence[SamplingParams], s: DecodeSettings, device: torch.device) -> torch.Tensor:
    extra = s.eos_token_ids if s.stop_on_eos else []
    rows = [sorted(set(p.stop_token_ids) | set(extra)) or [-1] for p in params]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def decode_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    s: DecodeSettings,
    state: StaticState,
    generator: torch.Generator | None,
) -> list[GenerateOutput]:
    """Run one batch to completion; outputs are in the order of `prompts`."""
    device = next(model.parameters()).device
    real = len(prompts)
    prompts, params = list(prompts), list(params)
    width = max(len(p) for p in prompts)
    limits = [p.max_new_tokens for p in params]
    if s.max_length is not None:
        limits = [max(1, min(n, s.max_length - len(p))) for n, p in zip(limits, prompts)]
    max_new = max(limits)
    if s.static:  # pad the batch with 1-token dummy rows up to a power-of-two bucket
        extra = _pow2(real) - real
        prompts += [[s.pad_token_id]] * extra
        params += [SamplingParams(temperature=0.0, max_new_tokens=1)] * extra
        limits += [1] * extra
    ids, mask, lengths = left_pad(prompts, s.pad_token_id, width, device)
    rows = RowParams.build(params, device)
    stops = _stop_table(params, s, device)
    limit_t = torch.tensor(limits, dtype=torch.long, device=device)
    with torch.no_grad():
        step_fn, logits = _prefill(model, ids, mask, width + max_new, s, state)
        toks, lps = [], []
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        n_gen = torch.zeros(len(prompts), dtype=torch.long, device=device)
        for step in range(max_new):
            tok, lp = sample(logits, rows, generator)
            toks.append(tok)
            lps.append(lp)
            n_gen = torch.where(finished, n_gen, n_gen + 1)
            finished |= (tok[:, None] == stops).any(-1) | (n_gen >= limit_t)
            if step + 1 == max_new or ((step + 1) % s.sync_every == 0 and bool(finished.all())):
                break
            logits = step_fn(torch.where(finished, s.pad_token_id, tok), lengths + step, width + step)
    return _collect(torch.stack(toks, 1), torch.stack(lps, 1), n_gen, stops, real)


def _collect(toks, lps, n_gen, stops, real: int) -> list[GenerateOutput]:
    toks_l, lps_l, n_l, stops_l = toks.cpu().tolist(), lps.float().cpu().tolist(), n_gen.tolist(), stops.tolist()
    outs = []
    for i in range(real):
        t, lp = toks_l[i][: n_l[i]], lps_l[i][: n_l[i]]
        reason = "stop" if t and t[-1] in stops_l[i] else "length"
        outs.append(GenerateOutput(token_ids=t, logprobs=lp, finish_reason=reason))
    return outs


def _prefill(model, ids, mask, total: int, s: DecodeSettings, state: StaticState):
    """Prefill the prompt; returns (decode step function, last-position logits [B, V])."""
    from transformers import DynamicCache, StaticCache

    batch, width = ids.shape
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    use_cache_position = _accepts(model, "cache_position")
    cache_kw = "cache" if _accepts(model, "cache") else "past_key_values"  # renamed in transformers 5.2x
    if s.static:
        length = _bucket(total, s.length_bucket)
        cache = state.caches.get((batch, length))
        if cache is None:
            cache = StaticCache(config=model.config, max_cache_len=length)
            state.caches[(batch, length)] = cache
        cache.reset()
        attn = torch.cat([mask, torch.ones(batch, length - width, dtype=mask.dtype, device=mask.device)], 1)
        if s.compile and state.compiled is None:
            state.compiled = _compile(model)
        forward = state.compiled if s.compile else model
    else:
        cache = DynamicCache(config=model.config)
        attn = torch.cat([mask, torch.ones(batch, total - width, dtype=mask.dtype, device=mask.device)], 1)
        forward = model
    kw: dict[str, Any] = {"cache_position": torch.arange(width, device=ids.device)} if use_cache_position else {}
    out = model(
        input_ids=ids, attention_mask=attn if s.static else mask, position_ids=pos,
        use_cache=True, logits_to_keep=1, **{cache_kw: cache}, **kw,
    )  # fmt: skip
    logits = out.logits[:, -1]

    def step(tok: torch.Tensor, positions: torch.Tensor, offset: int) -> torch.Tensor:
        kw = {"cache_position": torch.tensor([offset], device=tok.device)} if use_cache_position else {}
        if s.compile:
            torch.compiler.cudagraph_mark_step_begin()
        m = attn if s.static else attn[:, : offset + 1]
        o = forward(
            input_ids=tok[:, None], attention_mask=m, position_ids=positions[:, None],
            use_cache=True, **{cache_kw: cache}, **kw,
        )  # fmt: skip
        logits = o.logits[:, -1].float()
        return logits.clone() if s.compile else logits  # CUDA-graph outputs are overwritten by the next replay

    return step, logits


def _compile(model: Any) -> Any:
    logger.info("compiling the decode step (static cache, mode=reduce-overhead); the first batch is slow")
    return torch.compile(model.__call__, mode="reduce-overhead", fullgraph=False)
