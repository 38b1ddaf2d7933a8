"""Memory planning for a train rank: how many tokens one micro-batch may hold, and how much KV the engine may take.

`estimate` is a pure function of the model's shape and the run's sizes: the bytes one rank holds at the peak of
an update, term by term (the process itself, weights, gradients, optimizer state, activations saved for the
backward pass, the vocabulary projection's logits, the engine replica and its KV cache). `plan_memory` (called
once per rank before the first step, collectively) reads what the device has available now and picks the
largest token budget whose estimate fits with a margin; `actor.ppo_max_token_len_per_gpu` stays an upper
bound. A configuration that cannot fit even one sequence of the longest length stops there with a
`MemoryPlanError` naming the keys to change, instead of running into an out-of-memory kill mid-step.

On CPU the host RAM is shared by every rank of the host, their engines and Ray: each rank plans with its
share of what is available, and the engine's KV budget comes out of what the update leaves (it is passed to
the engine as ``kv_cache_bytes``), not from a fixed share of the RAM.

Activations are counted for a Llama/Qwen-style decoder block with SDPA attention (memory linear in the
sequence length) as PyTorch autograd saves them; other architectures are approximated by the same count.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_agent.config import ConfigError
from verl_agent.engine.runner.kv_pool import (
    device_available_bytes, device_memory_bytes, kv_bytes_per_token, share_budget,
)
from verl_agent.trainer.algorithms.advantage_base import needs_critic
from verl_agent.trainer.algorithms.losses import LOGIT_BUFFERS
from verl_agent.trainer.weights.shared_weights import engine_shares_weights

logger = logging.getLogger(__name__)

__all__ = ["MARGIN", "MemoryEstimate", "MemoryPlan", "MemoryPlanError", "ModelShape", "activation_bytes_per_token",
           "estimate", "plan_memory", "process_rss_bytes"]

# Share of the device's total memory the plan leaves free: on CPU for the OS, the driver and Ray's own
# processes and the allocator's slack; on GPU for the caching allocator's fragmentation.
MARGIN = {"cpu": 0.25, "cuda": 0.08}
# Host memory the rollout side of a CPU rank takes while it generates, beyond its tensors: the tokenizer, the
# agent loop and its trajectories, the engine's threads and their allocator arenas. An allowance, not a model;
# in sync mode it is freed before the update.
ROLLOUT_RUNTIME = 192 * 2**20
_GIB = 2**30


class MemoryPlanError(ConfigError):
    """The configuration cannot fit the device's memory; the message names the keys to change.

    ``need``: the estimate (bytes) of the smallest micro-batch the configuration allows; ``room``: what the rank
    could use."""

    def __init__(self, message: str, need: int = 0, room: int = 0) -> None:
        super().__init__(message)
        self.need, self.room = need, room


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: the decoder's sizes and the parameter count."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int

    @classmethod
    def of(cls, config: Any, params: int | None = None) -> ModelShape:
        """From a transformers config; ``params`` defaults to the count a Llama-style model of that shape has."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        h, i, v, n = int(config.hidden_size), int(config.intermediate_size), int(config.vocab_size), int(
            config.num_hidden_layers)
        if params is None:
            attn = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
            head = 0 if getattr(config, "tie_word_embeddings", False) else v * h
            params = v * h + head + n * (attn + 3 * h * i + 2 * h) + h
        return cls(n, h, i, heads, kv_heads, head_dim, v, int(params))


def activation_bytes_per_token(shape: ModelShape, act_bytes: int, grad_ckpt: bool) -> int:
    """Bytes autograd keeps per token of a micro-batch until the backward pass reaches them.

    Per decoder layer and token: the residual stream and the two RMSNorms (6 x hidden), query, attention
    output and its reshaped copy (3 x heads x head_dim), key and value (2 x heads x head_dim: with a padding
    mask transformers repeats grouped K/V heads to every query head before SDPA) and the MLP's gate,
    activation, up and product (4 x intermediate); plus the embedding and the final norm. With
    gradient checkpointing only each layer's input is kept, and one layer is recomputed at a time (its
    activations, their gradients and the autograd temporaries of its backward: about four layers' worth).
    """
    q = shape.heads * shape.head_dim
    layer = 6 * shape.hidden + 5 * q + 4 * shape.intermediate
    outside = 4 * shape.hidden  # embedding output, final norm
    if grad_ckpt:
        return act_bytes * (shape.layers * shape.hidden + 4 * layer + outside)
    return act_bytes * ((shape.layers + 1) * layer + outside)  # + one layer's gradients during the backward


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak, by term (see `estimate`)."""

    runtime: int  # the process itself: interpreter, libraries, Ray's worker (measured, not modelled)
    weights: int  # this rank's shards of the actor (+ ref, critic), and one layer gathered in full
    grads: int
    optimizer: int  # AdamW's two moments
    activations: int  # saved for the backward pass over one micro-batch
    logits: int  # one chunk of fp32 logits over the vocabulary, forward and backward, and the head's fp32 grad
    engine: int  # the engine replica's weights (and its working memory when it generates during the update)
    kv: int  # the engine's KV cache, where it stays allocated during the update

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self) -> str:
        terms = ", ".join(f"{f.name} {getattr(self, f.name) / _GIB:.2f}" for f in fields(self))
        return f"{self.total / _GIB:.2f} GiB ({terms})"


def estimate(shape: ModelShape, tokens: int, *, param_bytes: int = 4, act_bytes: int | None = None,
             grad_ckpt: bool = False, world: int = 1, response_rows: int | None = None, chunk_rows: int = 2048,
             fused_head: bool = True, extra_models: int = 0, trained_extra: int = 0, runtime: int = 0,
             engine_bytes: int = 0, kv_bytes: int = 0, trainable: int | None = None) -> MemoryEstimate:  # fmt: skip
    """Peak bytes of one rank updating on a micro-batch of ``tokens`` padded tokens.

    param_bytes / act_bytes: bytes per parameter (master weights, grads, optimizer state) and per activation
    (the compute dtype; default param_bytes). world: ranks the parameters are sharded over. response_rows:
    rows that reach the vocabulary projection (default: all tokens). fused_head: the log-prob head that never
    materialises [tokens, vocab] logits (`actor.LogProbHead`); otherwise the full logits exist.
    extra_models: further copies of the model held by this rank (the ref model, sharded like the actor);
    trained_extra: of those, how many are trained too (the critic: grads and optimizer state).
    runtime, engine_bytes, kv_bytes: passed through (measured or planned elsewhere).
    trainable: LoRA: of the actor's ``shape.params``, how many train (fp32 adapters with their gradients and
    AdamW moments); the rest is frozen at param_bytes with no gradient and no optimizer state, and no
    reference copy exists (the actor with adapters disabled is the reference). None: every parameter trains.
    """
    act_bytes = param_bytes if act_bytes is None else act_bytes
    shard = -(-shape.params // world)
    layer_params = shape.params // max(shape.layers, 1)
    gathered = 0 if world == 1 else (1 - 1 / world) * (2 * layer_params + shape.vocab * shape.hidden)
    rows = tokens if response_rows is None else min(response_rows, tokens)
    if fused_head:  # one chunk's fp32 buffers; the head's fp32 gradient and one chunk's product added into it
        head_grad = shape.vocab * shape.hidden * (4 + act_bytes) if trainable is None else 0  # LoRA: head frozen
        logits = LOGIT_BUFFERS * min(rows, chunk_rows) * shape.vocab * 4 + head_grad
    else:  # the model's own logits for every token, then fp32 log-softmax of the response rows
        logits = tokens * shape.vocab * act_bytes + 3 * rows * shape.vocab * 4
    weights = (1 + extra_models) * shard * param_bytes + gathered * param_bytes
    grads = (1 + trained_extra) * shard * param_bytes + gathered * param_bytes
    optimizer = (1 + trained_extra) * 2 * shard * param_bytes
    if trainable is not None:  # the actor's own grads and moments: its fp32 adapters' only
        adapters = -(-trainable // world)
        weights += adapters * (4 - param_bytes)
        grads = trained_extra * shard * param_bytes + adapters * 4
        optimizer = trained_extra * 2 * shard * param_bytes + 2 * adapters * 4
    return MemoryEstimate(
        runtime=int(runtime),
        weights=int(weights),
        grads=int(grads),
        optimizer=int(optimizer),
        activations=int(tokens * activation_bytes_per_token(shape, act_bytes, grad_ckpt)),
        logits=int(logits),
        engine=int(engine_bytes),
        kv=int(kv_bytes),
    )


# -------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MemoryPlan:
    """What `plan_memory` decided for this rank."""

    max_tokens: int  # token budget of one micro-batch (padded tokens)
    kv_cache_bytes: int | None  # the colocated hf engine's KV budget (None: the engine sizes it itself)
    peak: MemoryEstimate  # this rank's estimated peak at max_tokens
    room: int  # bytes this rank may reach (its RSS / device memory now plus its share of what is free)

    def describe(self) -> str:
        kv = "engine-sized" if self.kv_cache_bytes is None else f"{self.kv_cache_bytes / _GIB:.2f} GiB"
        return (f"micro-batch budget {self.max_tokens} tokens, KV budget {kv}; estimated peak "
                f"{self.peak.describe()} of {self.room / _GIB:.2f} GiB")


def process_rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _ranks_on_this_host() -> int:
    """Train ranks sharing this host's memory (collective)."""
    if not dist.is_initialized():
        return 1
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names.count(socket.gethostname())


def _agree_min(value: int) -> int:
    """The smallest value over all ranks (collective), so that every rank decides alike."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _fusable_head(model: nn.Module) -> bool:
    head, conf = getattr(model, "lm_head", None), getattr(model, "config", None)
    return (isinstance(head, nn.Linear) and head.bias is None and not getattr(conf, "final_logit_softcapping", None)
            and not getattr(conf, "logit_scale", None))


def longest_sequence(cfg: Any, config: Any) -> int:
    """Tokens of one engine slot (`RunConfig.slot_tokens`, at most the model's limit)."""
    limit = int(getattr(config, "max_position_embeddings", None) or 4096)
    return min(cfg.slot_tokens, limit)


def longest_trained(cfg: Any, config: Any) -> int:
    """Tokens of the longest sequence a step can train on: a whole conversation is at most
    data.max_prompt_length + data.max_response_length (observations count against the response budget),
    and at most one engine slot."""
    return min(longest_sequence(cfg, config), cfg.data.max_prompt_length + cfg.data.max_response_length)


@dataclass(frozen=True)
class _Inputs:
    """Everything `plan_memory` reads from the config, the model and the device."""

    shape: ModelShape
    kw: dict  # `estimate` keywords that do not depend on the micro-batch
    room: int
    longest: int  # tokens of one engine slot
    trained: int  # tokens of the longest trained sequence
    engine_bytes: int  # the engine replica's weights (0 when it reads the actor's)
    engine_transient: int  # its working memory while it generates (`engine_working_bytes`)
    kv_full: int  # KV of every slot filled to its end
    kv_min: int  # KV of one slot of the longest length
    kv_share: int  # what rollout.gpu_memory_utilization gives the engine on this device
    engine_sleeps: bool  # the engine frees its KV while the actor trains
    drops_weights: bool = False  # ... and its own weights, whose memory the update may use (on a GPU)
    generates_in_update: bool = False  # the async modes: the engine keeps generating while the actor trains
    has_engine: bool = False  # a colocated hf engine, whose KV is planned here


def _inputs(cfg: Any, actor: nn.Module, device: torch.device, loaded: list[nn.Module]) -> _Inputs:
    from verl_agent.trainer.workers.rollout_worker import engine_slots

    arr, r, t = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout, cfg.trainer
    config = actor.config
    shape = ModelShape.of(config, params=sum(p.numel() for p in actor.parameters()))  # DTensor numel: full size
    param_bytes = next(actor.parameters()).element_size()
    cuda = device.type == "cuda"
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = 1 if cuda else _ranks_on_this_host()
    now = torch.cuda.memory_allocated(device) if cuda else process_rss_bytes()
    held = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for m in loaded for p in m.parameters())
    free = device_available_bytes(device) - MARGIN[device.type] * device_memory_bytes(device)
    critic = needs_critic(cfg.algorithm.adv_estimator)
    lora = arr.model.lora_rank > 0
    kw = dict(param_bytes=param_bytes, act_bytes=2 if cuda and param_bytes == 4 else param_bytes,
              trainable=sum(p.numel() for p in actor.parameters() if p.requires_grad) if lora else None,
              grad_ckpt=arr.model.enable_gradient_checkpointing, world=world, fused_head=_fusable_head(actor),
              extra_models=(len(loaded) - 1) + int(critic), trained_extra=int(critic),
              runtime=max(0, now - held))
    longest = longest_sequence(cfg, config)
    engine = working = kv_full = kv_share = kv_min = 0
    has_engine = t.placement == "colocated" and r.name == "hf"  # sglang servers and split rollout workers: their own
    shares = has_engine and engine_shares_weights(cfg, device.type, world)
    if has_engine:
        slots = r.max_num_seqs or engine_slots(cfg, world)
        dtype = getattr(torch, r.dtype or arr.model.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        engine = (shape.params + _engine_lora_extra(actor, r.engine_lora_mode(device.type))) * size
        if shares:  # it reads the actor's tensors: LoRA's adapters only
            engine = sum(p.numel() for p in actor.parameters() if p.requires_grad) * size if lora else 0
        working = engine_working_bytes(shape, slots, r.max_num_batched_tokens, dtype)
        working += 0 if cuda else ROLLOUT_RUNTIME
        bpt = kv_bytes_per_token(config, dtype)
        kv_full, kv_min = slots * (longest + 1) * bpt, (longest + 1) * bpt
        kv_share = share_budget(engine, shape.vocab, slots, r.gpu_memory_utilization, device, sharers=local)
    sleeps = t.mode == "sync" and r.free_cache_engine
    return _Inputs(shape, kw, now + int(free / local), longest, longest_trained(cfg, config), engine, working,
                   kv_full, kv_min, kv_share, sleeps, drops_weights=sleeps and cuda and not shares,
                   generates_in_update=t.mode != "sync", has_engine=has_engine)


def _engine_lora_extra(actor: nn.Module, mode: str) -> int:
    """Elements the engine holds beyond the model with LoRA: merged, a copy of every targeted base weight
    (engine/runner/lora.py; the adapters themselves are counted in the model's parameters either way)."""
    if mode != "merge":
        return 0
    return sum(m.base_layer.weight.numel() for m in actor.modules()
               if hasattr(m, "lora_A") and hasattr(m, "base_layer"))


def engine_working_bytes(shape: ModelShape, slots: int, prefill_tokens: int, dtype: torch.dtype) -> int:
    """What the hf engine allocates beside weights and KV while it generates: one layer's activations of a
    prefill chunk (no autograd: nothing is kept across layers) and fp32 logits, probabilities and sampling
    temporaries of a decode step over every slot."""
    layer = 4 * shape.hidden + 2 * shape.intermediate + 2 * shape.kv_heads * shape.head_dim
    return prefill_tokens * layer * torch.empty((), dtype=dtype).element_size() + 3 * slots * shape.vocab * 4


def _fail(what: str, need: MemoryEstimate, room: int, keys: str) -> MemoryPlanError:
    return MemoryPlanError(f"memory plan: {what} does not fit: estimated {need.describe()}, but this rank can use "
                           f"{room / _GIB:.2f} GiB (its share of the memory available now, less a margin of "
                           f"{MARGIN['cpu']:.0%} of host RAM on CPU, {MARGIN['cuda']:.0%} of GPU memory). Change: "
                           f"{keys}", need.total, room)


_SMALLER = ("actor_rollout_ref.model.enable_gradient_checkpointing=true, a smaller "
            "actor_rollout_ref.rollout.max_model_len or data.max_response_length, fewer workers per host "
            "(trainer.num_cpu_workers), or actor_rollout_ref.model.dtype=bfloat16")


def _kv_budget(p: _Inputs) -> int:
    """The engine's KV bytes: its configured share, cut to what the rollout phase (actor weights and optimizer
    state beside the engine) and, when the engine stays awake, an update of one longest sequence leave."""
    if not p.has_engine:
        return 0
    base = estimate(p.shape, 0, **p.kw)
    cap = p.room - (base.runtime + base.weights + base.optimizer + p.engine_bytes + p.engine_transient)
    if not p.engine_sleeps:
        cap = min(cap, p.room - estimate(p.shape, p.trained, **p.kw, engine_bytes=_engine_in_update(p)).total)
    return min(p.kv_share, cap, p.kv_full)


def _engine_in_update(p: _Inputs) -> int:
    """Engine bytes while the actor trains: its weights, and its working memory only when it keeps generating
    (the async modes); in sync mode the rollout's working memory is freed before the update reuses it. On a
    GPU a sleeping engine has dropped its weights and the caching allocator hands the update's freed blocks
    to the weight sync, so none count (the rollout phase's check in `_kv_budget` counts them); on CPU the
    host's allocator keeps the update's peak until it is trimmed, so the weights count."""
    if p.drops_weights:
        return 0
    return p.engine_bytes + (p.engine_transient if p.generates_in_update else 0)


def _largest_fit(p: _Inputs, kv: int, upper: int) -> int:
    """The largest token count <= upper whose estimate fits the room (0 if not even one token)."""
    def fits(tokens: int) -> bool:
        return estimate(p.shape, tokens, **p.kw, engine_bytes=_engine_in_update(p), kv_bytes=kv).total <= p.room

    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_memory(cfg: Any, actor: nn.Module, device: torch.device, loaded: list[nn.Module] | None = None
                ) -> MemoryPlan:  # fmt: skip
    """This rank's micro-batch token budget and the colocated engine's KV budget (collective: call on all ranks
    after the actor, and the ref model if any, are built and before the engine is).

    ``loaded``: the models this rank holds now (default: the actor alone); the critic of GAE and the engine
    are counted as still to come. Raises `MemoryPlanError` when one sequence of the longest length (or, with
    actor.use_dynamic_bsz=false, ppo_micro_batch_size_per_gpu of them) does not fit.
    """
    a = cfg.actor_rollout_ref.actor
    if dist.is_initialized():
        dist.barrier()  # every rank on the host has loaded its models before anyone reads the free memory
    p = _inputs(cfg, actor, device, loaded or [actor])
    kv = _kv_budget(p)
    kv_in_update = 0 if p.engine_sleeps else kv
    need_tokens = p.trained * (1 if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu)
    fit = _largest_fit(p, kv_in_update, max(a.ppo_max_token_len_per_gpu, need_tokens)) if kv >= p.kv_min else -1
    fit = _agree_min(fit)  # every rank raises alike, or none does
    if fit < need_tokens:
        need = estimate(p.shape, need_tokens, **p.kw, engine_bytes=_engine_in_update(p), kv_bytes=max(kv_in_update, 0))
        if fit < 0:
            raise _fail(f"the engine's KV cache for one slot of {p.longest} tokens beside the actor", need,
                        p.room, _SMALLER)
        if a.use_dynamic_bsz:
            raise _fail(f"a micro-batch of one sequence of the longest length ({p.trained} tokens)", need, p.room,
                        _SMALLER)
        raise _fail(f"a micro-batch of {a.ppo_micro_batch_size_per_gpu} sequences of up to {p.trained} tokens",
                    need, p.room, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, or "
                    "actor_rollout_ref.actor.use_dynamic_bsz=true; or " + _SMALLER)
    tokens = min(fit, a.ppo_max_token_len_per_gpu) if a.use_dynamic_bsz else need_tokens
    plan = MemoryPlan(max_tokens=min(fit, a.ppo_max_token_len_per_gpu), room=p.room,
                      kv_cache_bytes=kv if p.has_engine and device.type == "cpu" else None,
                      peak=estimate(p.shape, tokens, **p.kw, engine_bytes=_engine_in_update(p), kv_bytes=kv_in_update))
    logger.info("memory plan: %s", plan.describe())
    return plan
