"""`TrainWorker`: one Ray actor per rank, holding the FSDP2 actor (+ ref, + critic) and an engine replica.

Hybrid engine: the engine is a separate plain copy of the policy on the same
device (an HFEngine in this process, or this rank's own SGLang server with
`actor_rollout_ref.rollout.name=sglang`). After every update `sync_weights` all-gathers the sharded parameters
bucket by bucket (`DTensor.full_tensor`) and copies them into the engine in
memory; no file is written. The engine sleeps (drops its caches, and on GPU
moves its weights off the device) during training and wakes up before the
sync.

All methods are plain methods called directly by the controller
(``worker.method.remote(...)``); the collective ones (everything except
`rollout` and `node_address`) must be called on every rank together.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from verl_agent.trainer import checkpoint as ckpt
from verl_agent.trainer.actor import (
    MicroBatching, forward_log_probs, forward_values, micro_batches, update_actor, update_critic,
)
from verl_agent.trainer.batch import TrainSeq
from verl_agent.trainer.fsdp import iter_full_param_buckets, load_causal_lm, make_scheduler, resolve_model_path, shard

logger = logging.getLogger(__name__)

__all__ = ["TrainWorker", "reward_spec"]


def reward_spec(cfg) -> str | None:
    """data.reward_fn, else verl's custom_reward_function.{path,name}, else None (tools/interactions score)."""
    if cfg.data.reward_fn:
        return cfg.data.reward_fn
    if cfg.custom_reward_function.path:
        return f"{cfg.custom_reward_function.path}:{cfg.custom_reward_function.name}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _TimedReward:
    """Wraps a RewardFunction and adds up the seconds spent in it (for the step's time breakdown)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(**kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


@ray.remote
class TrainWorker:
    def __init__(self, cfg: dict, rank: int, world_size: int) -> None:
        from verl_agent.config import RunConfig

        self.cfg = RunConfig.model_validate(cfg)
        self.rank, self.world_size = rank, world_size
        logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        self._loop = asyncio.new_event_loop()  # one loop for the worker's life: the engine's batcher lives on it
        self.critic = self.ref = None

    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port): where rank 0 hosts the process-group rendezvous."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group, build the sharded actor (ref, critic), optimizers and the engine replica."""
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        gpu = self.cfg.trainer.n_gpus_per_node > 0 and self.cfg.trainer.device != "cpu"
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.world_size)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = resolve_model_path(arr.model.path)

        def build(grad_ckpt: bool) -> torch.nn.Module:
            return load_causal_lm(self.model_path, arr.model.dtype, grad_ckpt).to(self.device)

        self.actor = shard(build(arr.model.enable_gradient_checkpointing), self.mesh, self.device.type,
                           arr.actor.fsdp_config.reshard_after_forward)
        self.optim, self.sched = self._optimizer(self.actor, arr.actor.optim)
        if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            self.ref = shard(build(False).eval().requires_grad_(False), self.mesh, self.device.type)
        if cfg.algorithm.adv_estimator == "gae":
            self._build_critic()
        self.mb = MicroBatching(arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu,
                                arr.actor.ppo_micro_batch_size_per_gpu)
        self._build_engine()
        n_params = sum(p.numel() for p in self.actor.parameters())  # DTensor.numel() is the full size
        return {"rank": self.rank, "device": str(self.device), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "num_parameters": int(n_params), "pid": os.getpid()}

    def _optimizer(self, model: torch.nn.Module, optim_cfg) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay,
                                betas=tuple(optim_cfg.betas))
        return opt, make_scheduler(opt, optim_cfg, self.cfg.trainer.total_training_steps or 1)

    def _build_critic(self) -> None:
        from verl_agent.trainer.fsdp import ValueModel

        c = self.cfg.critic
        path = resolve_model_path(c.model.path) if c.model.path else self.model_path
        critic = ValueModel(path, self.cfg.actor_rollout_ref.model.dtype, c.model.enable_gradient_checkpointing)
        self.critic = shard(critic.to(self.device), self.mesh, self.device.type)
        self.critic_optim, self.critic_sched = self._optimizer(self.critic, c.optim)

    def _build_engine(self) -> None:
        from transformers import AutoTokenizer

        from verl_agent.interactions import load_interactions
        from verl_agent.reward import load_reward_fn
        from verl_agent.rollout import AgentLoop, HFEngine
        from verl_agent.tools import load_tools

        arr, data = self.cfg.actor_rollout_ref, self.cfg.data
        if arr.rollout.name == "sglang":
            self.engine = self._launch_sglang()
        else:
            replica = load_causal_lm(self.model_path, arr.rollout.dtype or arr.model.dtype)
            self.engine = HFEngine(replica, device=str(self.device), max_batch_size=arr.rollout.max_batch_size,
                                   seed=self.cfg.trainer.seed + self.rank)
        tok = AutoTokenizer.from_pretrained(arr.model.tokenizer_path or self.model_path)
        mt = arr.rollout.multi_turn
        spec = reward_spec(self.cfg)
        self.reward_timer = _TimedReward(load_reward_fn(spec)) if spec else None
        tools = load_tools(mt.tool_config_path) if mt.enable else {}
        self.agent = AgentLoop(self.engine, tok, arr.rollout, tools=tools,
                               interactions=load_interactions(mt.interaction_config_path),
                               reward_fn=self.reward_timer,
                               max_prompt_length=data.max_prompt_length, max_response_length=data.max_response_length)

    def _launch_sglang(self) -> Any:
        """This rank's own SGLang server on this rank's device (Ray sets CUDA_VISIBLE_DEVICES), on a free port.

        A server URL in the config is refused: every rank pushes its weights into its own replica.
        """
        from verl_agent.rollout.sglang_engine import SGLangEngine

        r = self.cfg.actor_rollout_ref.rollout
        if r.sglang.url:
            raise ValueError("actor_rollout_ref.rollout.sglang.url is for `verl-agent rollout`: the trainer launches "
                             "one SGLang server per worker (leave url unset)")
        extra = list(r.sglang.extra_args)  # on GPU add --enable-memory-saver so that sleep() frees memory
        if "--mem-fraction-static" not in extra:
            extra += ["--mem-fraction-static", str(r.gpu_memory_utilization)]
        engine = SGLangEngine(model_path=self.model_path, python=r.sglang.python, extra_args=extra, env=r.sglang.env)
        self._loop.run_until_complete(engine.start())
        return engine

    # -- rollout -------------------------------------------------------------------------------

    def rollout(self, samples: list, n: int, sampling: dict) -> tuple[list, float, float]:
        """Multi-turn rollouts of this rank's prompts on its engine replica (n per prompt).

        Returns (trajectories, reward seconds, tool seconds); the seconds are summed over trajectories,
        which run concurrently, so they overlap each other and generation. A given seed is offset by
        the rank so ranks never sample alike.
        """
        from verl_agent.rollout import SamplingParams

        if sampling.get("seed") is not None:
            sampling = {**sampling, "seed": sampling["seed"] + self.rank * 1_000_003}
        sp = SamplingParams(max_new_tokens=self.cfg.data.max_response_length, **sampling)
        if not samples:
            return [], 0.0, 0.0
        reward0 = self.reward_timer.seconds if self.reward_timer else 0.0
        trajs = self._loop.run_until_complete(self.agent.run(samples, n, sp)).trajectories
        reward_s = (self.reward_timer.seconds - reward0) if self.reward_timer else 0.0
        return trajs, reward_s, sum(turn.tool_seconds for t in trajs for turn in t.turns)

    # -- training (collective) -----------------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, seqs: list[TrainSeq]) -> list[dict[str, torch.Tensor]]:
        """Per sequence: old log-probs and entropy (actor), ref log-probs, values (critic) where configured."""
        self._loop.run_until_complete(self.engine.sleep())
        temp = self.cfg.actor_rollout_ref.rollout.temperature
        out: list[dict[str, torch.Tensor]] = [{} for _ in seqs]
        index = {id(s): i for i, s in enumerate(seqs)}
        self.actor.eval()
        for micro in micro_batches(seqs, self.mb):
            logp, ent = forward_log_probs(self.actor, micro, temp, self.device, with_entropy=True)
            ref = forward_log_probs(self.ref, micro, temp, self.device)[0] if self.ref is not None else None
            vals = forward_values(self.critic, micro, self.device) if self.critic is not None else None
            for j, s in enumerate(micro):
                d = out[index[id(s)]]
                d["old_log_probs"], d["entropy"] = logp[j].float().cpu(), ent[j].float().cpu()
                if ref is not None:
                    d["ref_log_probs"] = ref[j].float().cpu()
                if vals is not None:
                    d["old_values"] = vals[j].float().cpu()
        return out

    def update(self, seqs: list[TrainSeq], n_minibatches: int, update_actor_now: bool = True) -> dict[str, float]:
        """Critic then actor updates on this rank's shard; one LR-scheduler step each."""
        arr, metrics = self.cfg.actor_rollout_ref, {}
        if self.critic is not None:
            c = self.cfg.critic
            metrics.update(update_critic(self.critic, self.critic_optim, seqs, c, arr.actor.grad_clip, self.device,
                                         n_minibatches, c.ppo_epochs or arr.actor.ppo_epochs, self.mb))
            self.critic_sched.step()
        if update_actor_now:
            metrics.update(update_actor(self.actor, self.optim, seqs, arr.actor, arr.rollout.temperature, self.device,
                                        n_minibatches, self.mb))
            metrics["lr"] = self.sched.get_last_lr()[0]
            self.sched.step()
        return metrics

    def sync_weights(self, bucket_mb: int = 64) -> float:
        """Gather full parameters bucket by bucket and push them into the engine; returns seconds."""
        t0 = time.perf_counter()
        self._loop.run_until_complete(self.engine.wake_up())
        for bucket in iter_full_param_buckets(self.actor, bucket_mb << 20):
            self._loop.run_until_complete(self.engine.update_weights(bucket))
        self.agent.policy_version += 1
        return time.perf_counter() - t0

    def check_sync(self, prompts: list[list[int]], max_new_tokens: int = 16) -> float:
        """Max |engine log-prob - actor log-prob| on tokens the engine samples now (temperature 1)."""
        from verl_agent.rollout import SamplingParams

        sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=1234)
        self._loop.run_until_complete(self.engine.wake_up())
        async def generate_all() -> list:
            return await asyncio.gather(*(self.engine.generate(p, sp) for p in prompts))

        outs = self._loop.run_until_complete(generate_all())
        seqs = [TrainSeq(input_ids=p + o.token_ids, prompt_len=len(p), loss_mask=torch.ones(len(o.token_ids)))
                for p, o in zip(prompts, outs) if o.token_ids]
        self.actor.eval()
        with torch.no_grad():
            logp, _ = forward_log_probs(self.actor, seqs, 1.0, self.device)
        engine = [torch.tensor(o.logprobs) for o in outs if o.token_ids]
        return max(float((a.cpu() - b).abs().max()) for a, b in zip(logp, engine))

    # -- checkpoints / export (collective) --------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        path = Path(path)
        ckpt.save_shards(path, "actor", self.actor, self.optim)
        extra = {"sched": self.sched.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.critic is not None:
            ckpt.save_shards(path, "critic", self.critic, self.critic_optim)
            extra["critic_sched"] = self.critic_sched.state_dict()
        torch.save(extra, path / f"extra_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        path = Path(path)
        ckpt.load_shards(path, "actor", self.actor, self.optim)
        extra = torch.load(path / f"extra_rank{min(self.rank, self._saved_ranks(path) - 1)}.pt", weights_only=False)
        self.sched.load_state_dict(extra["sched"])
        torch.set_rng_state(extra["torch_rng"])
        if self.critic is not None:
            ckpt.load_shards(path, "critic", self.critic, self.critic_optim)
            self.critic_sched.load_state_dict(extra["critic_sched"])
        self.sync_weights()

    @staticmethod
    def _saved_ranks(path: Path) -> int:
        return len(list(path.glob("extra_rank*.pt")))

    def export_hf(self, path: str) -> str | None:
        """Full policy in Hugging Face format (+ tokenizer); rank 0 writes, returns the path there."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"export_hf: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        tmp = Path(f"{path}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok_path = self.cfg.actor_rollout_ref.model.tokenizer_path or self.model_path
        AutoTokenizer.from_pretrained(tok_path).save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)  # a reader never sees a half-written export
        return path

    def shutdown(self) -> None:
        self._loop.run_until_complete(self.engine.close())
        if dist.is_initialized():
            dist.destroy_process_group()
