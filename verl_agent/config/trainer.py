"""trainer: steps, checkpoints, validation, workers and their placement, the async modes, logging (read by
`verl_agent.trainer`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from verl_agent.config.base import Section

__all__ = ["TrainerConfig"]


class TrainerConfig(Section):
    project_name: str = "verl_agent"
    experiment_name: str = "run"
    total_epochs: int = Field(1, ge=1)
    total_training_steps: int | None = Field(None, ge=1, description="overrides total_epochs when set")
    logger: list[str] = Field(default_factory=lambda: ["console", "tensorboard"],
                              description="console|tensorboard|wandb|mlflow (wandb, mlflow: optional extras)")
    default_local_dir: str = Field("runs/${trainer.project_name}/${trainer.experiment_name}")
    save_freq: int = Field(-1, description="checkpoint every N steps; -1: only at the end")
    checkpoint_compression: Literal["auto", "none", "zstd"] = Field(
        "auto", description="zstd: store each tensor's most significant bytes (float sign + exponent) zstd-"
        "compressed, the rest as is: bf16 weights and AdamW moments shrink, so saves that wait on the disk get "
        "faster at a CPU cost per byte. auto: zstd where a worker may use 8+ cores and zstandard is installed, "
        "else none")
    test_freq: int = Field(-1, description="validate every N steps; -1: only before/after")
    val_before_train: bool = True
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    n_gpus_per_node: int = Field(0, ge=0, description="0: CPU workers (see num_cpu_workers)")
    nnodes: int = Field(1, ge=1)
    num_cpu_workers: int = Field(2, ge=1, description="FSDP workers when n_gpus_per_node == 0")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ray_address: str | None = Field(None, description="None: $RAY_ADDRESS if set, else start a fresh local Ray; 'auto': join a running cluster")
    seed: int = 0
    log_trajectories: bool = Field(True, description="write every step's trajectories to "
                                   "<run dir>/trajectories/step_N.jsonl (verl-agent view reads them)")
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync", description="sync: roll out a batch, then train on it. one_step_off: batch k+1 rolls out while "
        "batch k trains (weights reach the engine once both are done). async: rollouts run continuously; each "
        "step takes the first groups to finish, at most max_staleness policy versions old")
    max_staleness: int = Field(1, ge=0, description="async: batches fed ahead of training = the largest policy-"
                               "version lag allowed; older groups are dropped (counted) and rolled out again")
    partial_rollout: bool = Field(True, description="async: on a weight update, trajectories pause at a token "
                                  "boundary (hf continuous scheduler, sglang; a turn boundary on engines without "
                                  "Engine.interrupt) and continue "
                                  "under the new weights (each token records its version); false: started "
                                  "trajectories finish under the old weights first")
    placement: Literal["colocated", "split"] = Field(
        "colocated", description="colocated: every train worker holds an engine replica on its own device (it "
        "sleeps during updates). split: trainer.rollout_workers separate Ray actors run the engines (their own "
        "processes and placement group) and train rank 0 streams them the weights after each update")
    rollout_workers: int = Field(1, ge=1, description="split: engine replicas (Ray actors); each batch is "
                                 "sharded over them, their groups are spread over the train ranks")
    rollout_gpus_per_worker: float = Field(1.0, gt=0, description="split, on GPU: GPUs per rollout worker; a "
                                           "fraction below 1 shares a GPU with a train worker, which then takes "
                                           "the rest of it (Ray fractional GPUs)")
    weight_transport: Literal["auto", "collective", "object_store"] = Field(
        "auto", description="split: how train rank 0 sends the weights. auto: by handle to every rollout worker "
        "that can map its memory (same host; on GPU the same card: CUDA IPC; on CPU shared memory in /dev/shm "
        "while it has room), by broadcast in a process group of their own (NCCL between GPUs, gloo on CPU) to "
        "the others. collective: the broadcast to every worker. object_store: Ray's object store for all")
    max_infra_failure_fraction: float = Field(
        0.2, ge=0, le=1, description="stop the run when more than this share of a step's trajectories failed "
        "for infrastructure reasons (engine, sandbox, tool crash, reward fn, interaction)")
    critic_warmup: int = 0
    export_merged_model: bool = Field(False, description="with LoRA: besides the adapter folder <run dir>/hf_model, "
                                      "write the base with the adapters merged in to <run dir>/hf_model_merged")
    profile_steps: list[Annotated[int, Field(ge=1)]] | None = Field(None, description="steps to profile with torch.profiler (rollout "
                                            "to weight sync): each train rank writes <run dir>/profile/"
                                            "step_N_rankR.txt (top ops) and .json.gz (Chrome trace)")

    @property
    def batches_ahead(self) -> int:
        """Batches fed ahead of the one in training: 0 sync, 1 one_step_off, max_staleness async."""
        return {"sync": 0, "one_step_off": 1, "async": self.max_staleness}[self.mode]

    @model_validator(mode="before")
    @classmethod
    def _logger_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("logger"), str):
            data = {**data, "logger": [data["logger"]]}
        return data
