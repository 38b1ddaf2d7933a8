"""`TrainWorker`: one Ray actor per rank, holding the FSDP2 actor (+ ref, + critic), an engine replica and its data.

Data stays where it was made: `feed` starts this rank's rollouts on its engine (a
`RolloutHost`: the engine and a `RolloutStream` on an event-loop thread, so rollouts keep
running while the actor trains), `take` keeps the finished groups of a step and answers with
per-trajectory summaries (scalars); with trainer.placement=split the groups come from the
rollout workers instead (`take_parts`, see rollout_worker.py); `compute_log_probs`, `compute_advantages` and
`update` work on them in place and answer with metrics. GRPO groups are whole on one
rank (the controller shards prompts, the n samples of a prompt run here), so group
advantages are local; batch-wide statistics come from all-reduces.

Hybrid engine: the engine is a separate plain copy of the policy on the same device
(an HFEngine in this process, or this rank's own SGLang server). After every update
`sync_weights` gathers the sharded parameters bucket by bucket and copies them into the
engine in memory. With rollout.free_cache_engine the engine sleeps (drops caches; on GPU
its weights leave the device) while the actor trains.

Every method except `node_address`, `feed`, `take`, `take_parts` and `validate` is collective: call it on all ranks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from verl_agent.protocol import Sample, Trajectory
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.metrics import TrajectorySummary
from verl_agent.rollout.stream import Group
from verl_agent.engine.tensor_handles import HandleStaging, dumps_by_handle, flat_specs, memory_key
from verl_agent.trainer import checkpoint as ckpt
from verl_agent.trainer.actor import (
    MicroBatching, forward_log_probs, forward_values, micro_batches, reduce_op, update_actor, update_critic,
)
from verl_agent.trainer.batch import TrainSeq
from verl_agent.trainer.fsdp import iter_full_param_buckets, load_causal_lm, make_scheduler, shard
from verl_agent.trainer.memory import plan_memory
from verl_agent.trainer.prepare import (
    GROUP_ESTIMATORS, apply_rollout_correction, assign_advantages, filter_groups, log_prob_metrics, train_seqs,
)
from verl_agent.trainer.rollout_worker import RolloutHost, RolloutResult, log_trajectories, rollout_result
from verl_agent.trainer.state_files import save_object

logger = logging.getLogger(__name__)

__all__ = ["TrainWorker", "RolloutResult", "AdvantageResult", "old_log_probs_from_actor", "pause_drains"]


@dataclass
class AdvantageResult:
    metrics: dict[str, float]
    kl: float  # batch mean of the per-sequence KL in the reward (for the adaptive KL controller)
    sequences: int  # sequences of the whole batch that enter the update


def old_log_probs_from_actor(actor_cfg, n_minibatches: int, kl_in_reward: bool) -> bool:
    """Does PPO's old log-prob need its own actor forward pass? (actor.old_log_prob_source)

    auto: only when the batch is not trained in one optimizer step (several epochs or
    mini-batches), or when the in-reward KL needs it; otherwise the update uses its own
    log-probs, detached (ratio 1: the same gradient, one forward pass fewer). That holds in the
    async modes too: the old policy of decoupled PPO is the actor before this update, whatever
    weights the engine sampled with, and the rollout correction's weight pi_old / pi_engine is
    then taken inside the update (`update_actor(rollout_is=...)`).
    """
    src = actor_cfg.old_log_prob_source
    if src == "actor":
        return True
    if src == "rollout":
        return False
    return actor_cfg.ppo_epochs > 1 or n_minibatches > 1 or kl_in_reward


def rollout_is_level(cfg) -> str:
    """algorithm.rollout_correction.rollout_is with auto resolved: token in the async modes, none in sync."""
    level = cfg.algorithm.rollout_correction.rollout_is
    if level == "auto":
        return "none" if cfg.trainer.mode == "sync" else "token"
    return level


def pause_drains(cfg) -> bool:
    """Does a weight update let started trajectories finish first? one_step_off, or partial_rollout=false."""
    return cfg.trainer.mode == "one_step_off" or not cfg.trainer.partial_rollout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote
class TrainWorker:
    def __init__(self, cfg: dict, rank: int, world_size: int) -> None:
        from verl_agent.config import RunConfig

        self.cfg = RunConfig.model_validate(cfg)
        self.rank, self.world_size = rank, world_size
        logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        self.rollout: RolloutHost | None = None  # colocated: this rank's engine replica (split: none)
        self.critic = self.ref = None
        self.trajs: list[Trajectory] = []  # this rank's trajectories of the current step
        self._step = 0  # the step they belong to
        self._pending: list[int] = []  # positions in self.trajs whose records wait for their advantages
        self.version = 0  # policy version of the engine's weights (the step whose update it holds)
        self.seqs: list[TrainSeq] = []  # ... those that may be trained on, as training sequences
        self._rollout_is_in_update: tuple[str, float] | None = None  # (level, cap) when the update weighs them
        self.staging = HandleStaging()  # split placement, rank 0: CPU buckets shared with rollout workers
        self.weight_group: Any = None  # split placement, rank 0: the WeightGroup, when a worker is routed there

    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port): where rank 0 hosts the process-group rendezvous."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group, build the sharded actor (ref, critic), optimizers and the rollout parts."""
        from torch.distributed.device_mesh import init_device_mesh

        from verl_agent.rollout.build import import_external_lib, resolve_model_path

        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        gpu = cfg.trainer.n_gpus_per_node > 0 and cfg.trainer.device != "cpu"
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.world_size)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        torch.manual_seed(cfg.trainer.seed)
        import_external_lib(arr.model)
        self.model_path = resolve_model_path(arr.model.path)

        def build(grad_ckpt: bool, offload: bool) -> torch.nn.Module:
            model = load_causal_lm(self.model_path, arr.model.dtype, grad_ckpt, arr.model.trust_remote_code)
            return model if offload else model.to(self.device)  # offloaded shards stay on the host

        fc = arr.actor.fsdp_config
        self.actor = shard(build(arr.model.enable_gradient_checkpointing, fc.param_offload), self.mesh,
                           self.device.type, fc.reshard_after_forward, fc.param_offload)
        self.optim, self.sched = self._optimizer(self.actor, arr.actor.optim)
        if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            rc = arr.ref.fsdp_config
            self.ref = shard(build(False, rc.param_offload).eval().requires_grad_(False), self.mesh,
                             self.device.type, rc.reshard_after_forward, rc.param_offload)
        a = arr.actor
        # the micro-batch token budget and the engine's KV budget that fit this device (collective)
        self.memory = plan_memory(cfg, self.actor, self.device, [m for m in (self.actor, self.ref) if m is not None])
        self.mb = MicroBatching(a.use_dynamic_bsz, self.memory.max_tokens, a.ppo_micro_batch_size_per_gpu)
        if cfg.algorithm.adv_estimator == "gae":
            self._build_critic()
        self.mb_log_prob = MicroBatching(a.use_dynamic_bsz, self.memory.max_tokens,
                                         arr.rollout.log_prob_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu)
        self.mb_ref = MicroBatching(a.use_dynamic_bsz, self.memory.max_tokens,
                                    arr.ref.log_prob_micro_batch_size_per_gpu or self.mb_log_prob.per_gpu)
        if cfg.trainer.placement == "colocated":
            self.rollout = RolloutHost(cfg, self.rank, self.model_path, self.device, shards=self.world_size,
                                       kv_cache_bytes=self.memory.kv_cache_bytes)
            self.tokenizer = self.rollout.tokenizer
        else:
            from verl_agent.rollout.build import load_tokenizer

            self.tokenizer = load_tokenizer(arr.model)
        n_params = sum(p.numel() for p in self.actor.parameters())  # DTensor.numel() is the full size
        return {"rank": self.rank, "device": str(self.device), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "memory": memory_key(self.device),
                "num_parameters": int(n_params), "pid": os.getpid(), "memory_plan": {
                    "max_tokens": self.memory.max_tokens, "peak_estimate": self.memory.peak.total,
                    "activations": self.memory.peak.activations}}

    def _optimizer(self, model: torch.nn.Module, optim_cfg) -> tuple[torch.optim.Optimizer, Any]:
        # fused AdamW on GPU: no temporary the size of the weights (the foreach default needs one)
        opt = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay,
                                betas=tuple(optim_cfg.betas), fused=self.device.type == "cuda" and not
                                self.cfg.actor_rollout_ref.actor.fsdp_config.param_offload)
        return opt, make_scheduler(opt, optim_cfg, self.cfg.trainer.total_training_steps or 1)

    def _build_critic(self) -> None:
        from verl_agent.rollout.build import resolve_model_path
        from verl_agent.trainer.fsdp import ValueModel

        c = self.cfg.critic
        path = resolve_model_path(c.model.path) if c.model.path else self.model_path
        critic = ValueModel(path, self.cfg.actor_rollout_ref.model.dtype, c.model.enable_gradient_checkpointing)
        self.critic = shard(critic.to(self.device), self.mesh, self.device.type)
        self.critic_optim, self.critic_sched = self._optimizer(self.critic, c.optim)
        self.mb_critic = MicroBatching(self.mb.dynamic, self.mb.max_tokens, c.ppo_micro_batch_size_per_gpu)

    # -- rollout -------------------------------------------------------------------------------

    def feed(self, samples: list[Sample], n: int, sampling: SamplingParams, batch: int) -> None:
        """Start rollouts of this rank's prompts of batch `batch` (n per prompt); returns at once.

        A seed is offset by the rank so ranks never sample alike.
        """
        self._host().feed(samples, n, sampling, batch)

    def take(self, k: int, step: int, min_version: int) -> RolloutResult:
        """Wait for k finished groups at most `current version - min_version` versions old and keep them
        for this step's training; answers with their summaries. Stale groups are rolled out again."""
        host = self._host()
        groups, dropped = host.take(k, min_version)
        result = rollout_result(groups, dropped, host)
        result.counts.update(self._keep(groups, step))
        return result

    def take_parts(self, step: int, parts: list) -> dict[str, float]:
        """Split placement: keep the groups of `parts` (object refs from RolloutWorker.take) for this step."""
        return self._keep([g for part in ray.get(parts) for g in part], step)

    def _keep(self, groups: list[Group], step: int) -> dict[str, float]:
        """This step's trajectories and training sequences; returns what the failure rules left out."""
        trajs = [t for g in groups for t in g.trajectories]
        self.trajs = trajs
        self.seqs, counts = train_seqs(trajs, self.cfg.algorithm.adv_estimator in GROUP_ESTIMATORS)
        self._step = step
        # Records: what cannot reach the loss now (a stopped step still shows its failures), the rest with
        # their advantages from compute_advantages.
        self._pending = sorted(s.extra["trajectory"] for s in self.seqs)
        self._log([t for i, t in enumerate(trajs) if i not in set(self._pending)], f"step_{step}.jsonl", step)
        return counts

    def validate(self, samples: list[Sample], n: int, sampling: SamplingParams, step: int) -> RolloutResult:
        """Held-out rollouts (in chunks of data.val_batch_size over all ranks); nothing is kept for training."""
        if not samples:
            return RolloutResult()
        vbs = self.cfg.data.val_batch_size
        trajs = self._host().validate(samples, n, sampling, -(-vbs // self.world_size) if vbs else None)
        self._log(trajs, f"val_step_{step}.jsonl", step)
        return RolloutResult(summaries=[TrajectorySummary.of(t) for t in trajs])

    def _host(self) -> RolloutHost:
        if self.rollout is None:
            raise RuntimeError("trainer.placement=split: rollouts run on the RolloutWorkers, not on train ranks")
        return self.rollout

    def _log(self, trajs: list[Trajectory], name: str, step: int, seqs: list[TrainSeq] | None = None,
             only: list[int] | None = None) -> None:
        """trainer.log_trajectories for this rank's trajectories (see rollout_worker.log_trajectories).

        With `seqs` (training), each trajectory that reached the loss carries its per-token advantages;
        `only`: the positions in `trajs` to write.
        """
        if not self.cfg.trainer.log_trajectories or not trajs or (only is not None and not only):
            return
        advs: list = [None] * len(trajs)
        for s in seqs or []:
            if "trajectory" in s.extra and s.advantages is not None:
                advs[s.extra["trajectory"]] = s.advantages.tolist()
        keep = range(len(trajs)) if only is None else only
        log_trajectories(self.cfg, self.tokenizer, [trajs[i] for i in keep], name, step, [advs[i] for i in keep])

    def set_sequences(self, seqs: list[TrainSeq]) -> None:
        """Train on these sequences instead of rolled-out ones (offline data; tests)."""
        self.trajs, self.seqs, self._pending = [], list(seqs), []

    # -- training (collective) -----------------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, n_minibatches: int) -> dict[str, float]:
        """Per sequence: old log-probs and entropy (actor, unless the on-policy shortcut applies), ref
        log-probs and values (critic) where configured. Returns batch-wide metrics (the same on every rank)."""
        cfg = self.cfg
        arr = cfg.actor_rollout_ref
        if self.rollout is not None and arr.rollout.free_cache_engine and cfg.trainer.mode == "sync":
            self.rollout.sleep()  # async modes keep generating; split engines have their own memory
        temp = self.agent_temperature
        from_actor = old_log_probs_from_actor(arr.actor, n_minibatches, cfg.algorithm.use_kl_in_reward)
        level = rollout_is_level(cfg)  # decided from the config alone: the same on every rank
        self._rollout_is_in_update = (level, cfg.algorithm.rollout_correction.rollout_is_threshold) \
            if level != "none" and not from_actor else None
        if from_actor:
            self.actor.eval()
            for micro in micro_batches(self.seqs, self.mb_log_prob):
                logp, ent = forward_log_probs(self.actor, micro, temp, self.device, with_entropy=True)
                for s, lp, e in zip(micro, logp, ent):
                    s.old_log_probs, s.extra["entropy"] = lp.float().cpu(), e.float().cpu()
        elif arr.actor.old_log_prob_source == "rollout":
            for s in self.seqs:
                s.old_log_probs = s.rollout_log_probs
        if self.ref is not None:
            for micro in micro_batches(self.seqs, self.mb_ref):
                for s, lp in zip(micro, forward_log_probs(self.ref, micro, temp, self.device)[0]):
                    s.ref_log_probs = lp.float().cpu()
        if self.critic is not None:
            for micro in micro_batches(self.seqs, self.mb_critic):
                for s, v in zip(micro, forward_values(self.critic, micro, self.device)):
                    s.old_values = v.float().cpu()
        return log_prob_metrics(self.seqs, reduce_op)

    @property
    def agent_temperature(self) -> float:
        """The temperature the engine sampled with (0 = greedy: log-probs of the raw logits)."""
        r = self.cfg.actor_rollout_ref.rollout
        return r.temperature if r.do_sample else 0.0

    def compute_advantages(self, kl_coef: float) -> AdvantageResult:
        """algorithm.adv_estimator on this rank's sequences (+ DAPO group filtering); batch-wide metrics."""
        algo = self.cfg.algorithm
        metrics, kl = assign_advantages(self.seqs, algo, kl_coef, reduce_op)
        level = rollout_is_level(self.cfg)
        if level != "none" and self._rollout_is_in_update is None:
            metrics.update(apply_rollout_correction(self.seqs, level, algo.rollout_correction.rollout_is_threshold,
                                                    reduce_op))
        if algo.filter_groups.enable:
            self.seqs, metrics["train/kept_group_fraction"] = filter_groups(self.seqs, algo.filter_groups.metric,
                                                                            reduce_op)
        n = int(reduce_op(torch.tensor([len(self.seqs)], dtype=torch.float64))[0])
        self._log(self.trajs, f"step_{self._step}.jsonl", self._step, self.seqs, only=self._pending)
        self._pending = []
        return AdvantageResult(metrics=metrics, kl=kl, sequences=n)

    def update(self, n_minibatches: int, step: int, update_actor_now: bool = True) -> dict[str, float]:
        """Critic then actor updates on this rank's sequences; one LR-scheduler step each."""
        arr, metrics = self.cfg.actor_rollout_ref, {}
        norm = self.cfg.data.max_response_length  # seq-mean-token-sum-norm's constant divisor (verl's padded width)
        seqs = list(self.seqs)
        if arr.actor.shuffle:  # the same order on a rerun: seeded by (seed, step, rank)
            random.Random(f"{self.cfg.trainer.seed}:{step}:{self.rank}").shuffle(seqs)
        if self.critic is not None:
            c = self.cfg.critic
            metrics.update(update_critic(self.critic, self.critic_optim, seqs, c, arr.actor.grad_clip, self.device,
                                         n_minibatches, c.ppo_epochs or arr.actor.ppo_epochs, self.mb_critic,
                                         loss_scale_factor=norm))
            self.critic_sched.step()
        if update_actor_now:
            metrics.update(update_actor(self.actor, self.optim, seqs, arr.actor, self.agent_temperature, self.device,
                                        n_minibatches, self.mb, loss_scale_factor=norm,
                                        rollout_is=self._rollout_is_in_update))
            metrics["lr"] = self.sched.get_last_lr()[0]
            self.sched.step()
        self.seqs = []
        return metrics

    def sync_weights(self, version: int) -> float:
        """Gather full parameters bucket by bucket and push them into the engine as policy `version`; seconds.

        Rollouts in flight pause first (at a token boundary, or for one_step_off and partial_rollout=false
        after they finish under the old weights), so no forward pass ever sees half-updated weights.
        """
        t0 = time.perf_counter()
        host = self._host()
        host.pause(drain=pause_drains(self.cfg))
        try:
            for bucket in iter_full_param_buckets(self.actor, self._bucket_bytes(), dtype=self._engine_dtype()):
                host.load(bucket)
            self.version = version
        finally:
            host.resume(self.version)
        return time.perf_counter() - t0

    def join_weight_group(self, addr: str, port: int, size: int) -> None:
        """Rank 0, split placement: host the `WeightGroup` that rollout workers on other GPUs or hosts join."""
        from verl_agent.trainer.weight_group import WeightGroup

        self.weight_group = WeightGroup(addr, port, 0, size, self.device)

    def push_weights(self, version: int, rollout_workers: list, routes: list[str]) -> float:
        """Split placement: stream the full parameters to every RolloutWorker (already paused); seconds.

        Collective (every rank gathers); rank 0 sends each bucket and waits until every rollout worker has
        loaded it before gathering the next, by the worker's route (`controller.weight_routes`): "handle"
        (CUDA IPC, or on CPU one shared-memory staging buffer when /dev/shm has room; else the object
        store), "collective" (one broadcast in the `WeightGroup`), "object_store" (put once, on the host).
        """
        t0 = time.perf_counter()
        for bucket in iter_full_param_buckets(self.actor, self._bucket_bytes(), dtype=self._engine_dtype()):
            if self.rank != 0:
                continue
            shared = self.staging.pack(bucket) if "handle" in routes and self.staging.fits(bucket) else None
            calls, members, far = [], [], []
            for worker, route in zip(rollout_workers, routes, strict=True):
                if route == "handle" and shared is not None:  # one pickle per receiver: each takes a reference
                    calls.append(worker.load_weights_by_handle.remote(dumps_by_handle(shared)))
                else:
                    (members if route == "collective" else far).append(worker)
            if far:
                ref = ray.put([(name, t.detach().cpu()) for name, t in bucket])
                calls += [w.load_weights.remote(ref) for w in far]
            if members:
                specs, total = flat_specs(bucket)
                receivers = [w.load_weights_broadcast.remote(specs, total) for w in members]
                self.weight_group.send(bucket, specs, total, receivers)
                calls += receivers
            ray.get(calls)
        self.version = version
        return time.perf_counter() - t0

    def _engine_dtype(self) -> torch.dtype:
        arr = self.cfg.actor_rollout_ref
        return getattr(torch, arr.rollout.dtype or arr.model.dtype)  # the replica's dtype: cast on the device

    def _bucket_bytes(self) -> int:
        return (512 if self.device.type == "cuda" else 64) << 20

    def weights_digest(self) -> float:
        """Sum of |w| over the full parameters as the engines receive them, in float64 (collective; tests)."""
        total = 0.0
        for bucket in iter_full_param_buckets(self.actor, self._bucket_bytes(), dtype=self._engine_dtype()):
            total += float(sum(t.detach().double().abs().sum() for _, t in bucket))
        return total

    def check_sync(self, prompts: list[list[int]], max_new_tokens: int = 16) -> float:
        """Max |engine log-prob - actor log-prob| on tokens the engine samples now (temperature 1)."""
        sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=1234)
        host = self._host()
        host.run(host.engine.wake_up())

        async def generate_all() -> list:
            return await asyncio.gather(*(host.engine.generate(p, sp) for p in prompts))

        outs = host.run(generate_all())
        seqs = [TrainSeq(input_ids=p + o.token_ids, prompt_len=len(p), loss_mask=torch.ones(len(o.token_ids)))
                for p, o in zip(prompts, outs) if o.token_ids]
        self.actor.eval()
        with torch.no_grad():
            logp, _ = forward_log_probs(self.actor, seqs, 1.0, self.device)
        engine = [torch.tensor(o.logprobs) for o in outs if o.token_ids]
        return max(float((a.cpu() - b).abs().max()) for a, b in zip(logp, engine))

    # -- profiling (trainer.profile_steps) --------------------------------------------------------

    def start_profile(self) -> None:
        """torch.profiler over everything this rank does (CUDA kernels included) until stop_profile."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()

    def stop_profile(self, out_dir: str, step: int) -> str:
        """Write the top ops (by self device time on GPU, self CPU time on CPU) and the Chrome trace."""
        prof, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        out = Path(out_dir) / f"step_{step}_rank{self.rank}"
        out.parent.mkdir(parents=True, exist_ok=True)
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        out.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
        prof.export_chrome_trace(str(out.with_suffix(".json.gz")))
        return str(out.with_suffix(".txt"))

    # -- checkpoints / export (collective) --------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        path = Path(path)
        codec = self.cfg.trainer.checkpoint_compression
        ckpt.save_shards(path, "actor", self.actor, self.optim, codec)
        extra = {"sched": self.sched.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.critic is not None:
            ckpt.save_shards(path, "critic", self.critic, self.critic_optim, codec)
            extra["critic_sched"] = self.critic_sched.state_dict()
        save_object(extra, path / f"extra_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str, step: int) -> None:
        """Load the checkpoint of `step` (its driver state's step: the engine's policy version from here on)."""
        path = Path(path)
        ckpt.load_shards(path, "actor", self.actor, self.optim)
        saved_ranks = len(list(path.glob("extra_rank*.pt")))
        extra = torch.load(path / f"extra_rank{min(self.rank, saved_ranks - 1)}.pt", weights_only=False)
        self.sched.load_state_dict(extra["sched"])
        torch.set_rng_state(extra["torch_rng"])
        if self.critic is not None:
            ckpt.load_shards(path, "critic", self.critic, self.critic_optim)
            self.critic_sched.load_state_dict(extra["critic_sched"])
        self.version = step  # not parsed from the folder name: resume_from_path may name it anything
        if self.rollout is not None:  # split: the driver pushes the weights to the rollout workers
            self.sync_weights(self.version)

    def export_hf(self, path: str) -> str | None:
        """Full policy in Hugging Face format (+ tokenizer), streamed; rank 0 writes and returns the path."""
        tok_path = self.cfg.actor_rollout_ref.model.tokenizer_path or self.model_path
        return ckpt.export_hf(self.actor, self.model_path, str(tok_path), path, self.rank)

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
        if dist.is_initialized():
            dist.destroy_process_group()
