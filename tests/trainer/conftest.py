"""Trainer test fixtures: ONE Ray instance per session (a 2-node test cluster on this machine), calculator data.

Ray starts in 5-15 s on 2 cores, so every trainer test shares it. The cluster has two "nodes"
(ray.cluster_utils.Cluster) so the multi-node test needs no cluster of its own.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
import yaml


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def calc_data(tmp_path_factory) -> tuple[Path, Path]:
    from verl_agent.models.calculator_task import write_calculator_data

    return write_calculator_data(tmp_path_factory.mktemp("calc"), n_train=256, n_test=32, seed=0)


@pytest.fixture(scope="session")
def calc_tools(tmp_path_factory) -> Path:
    from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA

    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    entry = {"class_name": "verl_agent.tools.calculator.CalculatorTool", "config": {},
             "tool_schema": CALCULATOR_TOOL_SCHEMA}
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    return path


@pytest.fixture
def make_cfg(tiny_model_path, calc_data, calc_tools, tmp_path):
    """RunConfig for the calculator task on the tiny model with 2 CPU workers; extra overrides win."""
    from verl_agent.config import load_config

    def make(*overrides: str, run_dir: Path | None = None):
        train, test = calc_data
        base = [
            f"data.train_files=[{train}]", f"data.val_files=[{test}]", "data.train_batch_size=4",
            "data.max_response_length=96", "data.reward_fn=verl_agent.models.calculator_task.calculator_reward",
            f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={calc_tools}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-4", "trainer.num_cpu_workers=2", "trainer.logger=[console,tensorboard]",
            f"trainer.default_local_dir={run_dir or tmp_path / 'run'}", "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
        ]
        return load_config(None, base + list(overrides))

    return make


@pytest.fixture(scope="session")
def dev_model_path(request):
    """A model whose weights do not matter (mechanics tests): $VERL_AGENT_DEV_MODEL or the tiny model."""
    if os.environ.get("VERL_AGENT_DEV_MODEL"):
        return Path(os.environ["VERL_AGENT_DEV_MODEL"])
    return request.getfixturevalue("tiny_model_path")


@pytest.fixture
def random_seqs():
    """Factory of TrainSeqs with random tokens, a masked tool-response hole, and GRPO pairs (uid, score 0/1)."""
    import torch

    from verl_agent.trainer.policy.batch import TrainSeq

    def make(n: int, vocab: int, seed: int = 0) -> list:
        g = torch.Generator().manual_seed(seed)
        out = []
        for i in range(n):
            length, prompt = 12 + 3 * i, 5 + i % 3
            mask = torch.ones(length - prompt)
            mask[2:4] = 0
            out.append(TrainSeq(input_ids=torch.randint(3, vocab, (length,), generator=g).tolist(), prompt_len=prompt,
                                loss_mask=mask, uid=f"u{i // 2}", score=float(i % 2)))
        return out

    return make


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process (FSDP2 needs one), torn down after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
