"""The run configuration: a typed tree with verl's key names, loaded from YAML plus `a.b.c=value` overrides.

    cfg = load_config("examples/calculator/config.yaml", ["data.train_batch_size=8", "trainer.logger=[console]"])

Every section is a small pydantic model that forbids unknown keys, so a typo fails fast with the closest
valid key named (`ConfigError`). Keys follow verl wherever the concept is the same, so a verl user's
command line (`actor_rollout_ref.actor.optim.lr=1e-6 algorithm.adv_estimator=grpo ...`) reads as-is.
Keys that verl needs for its own machinery and that mean nothing here (e.g. `tensor_model_parallel_size`,
`gpu_memory_utilization`) are accepted so such command lines parse, and documented as ignored.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_override", "save_config", "all_keys"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and what is wrong."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# ---------------------------------------------------------------- data
class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list, description="JSONL/parquet training files")
    val_files: list[str] = Field(default_factory=list, description="JSONL/parquet validation files")
    train_file: str | None = Field(None, description="single training file (quick-start spelling of train_files)")
    val_file: str | None = Field(None, description="single validation file (quick-start spelling of val_files)")
    train_batch_size: int = Field(8, ge=1, description="prompts per training step")
    val_batch_size: int | None = Field(None, description="prompts per validation batch (None: whole set)")
    max_prompt_length: int = Field(512, ge=1, description="prompt token budget; longer prompts are an error")
    max_response_length: int = Field(256, ge=1, description="response token budget over all turns")
    reward_fn: str | None = Field(None, description="'module.func' or 'path/file.py:func'")
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    shuffle: bool = True
    seed: int = 0
    skip_bad_rows: bool = Field(False, description="skip malformed rows (counted and reported) instead of failing")
    filter_overlong_prompts: bool = Field(False, description="drop prompts over max_prompt_length (counted)")
    return_raw_chat: bool = Field(True, description="accepted for verl compatibility; messages are always kept")
    truncation: Literal["error", "left", "right"] = "error"

    @model_validator(mode="after")
    def _merge_single_files(self) -> DataConfig:
        if self.train_file and self.train_file not in self.train_files:
            self.__dict__["train_files"] = [self.train_file, *self.train_files]
        if self.val_file and self.val_file not in self.val_files:
            self.__dict__["val_files"] = [self.val_file, *self.val_files]
        return self


class CustomRewardFunctionConfig(Section):
    """verl's spelling of the reward function: a file path and a function name."""

    path: str | None = None
    name: str = "compute_score"


# ---------------------------------------------------------------- model / actor
class ModelConfig(Section):
    path: str = Field("tiny", description="HF model id or local path; 'tiny' = the embedded tiny model")
    tokenizer_path: str | None = None
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    use_remove_padding: bool = Field(True, description="pack sequences (no padding compute)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    external_lib: str | None = None


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.0
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    total_training_steps: int | None = None


class PolicyLossConfig(Section):
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"


class FSDPConfig(Section):
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1


class ActorConfig(Section):
    strategy: Literal["fsdp2", "fsdp"] = "fsdp2"
    ppo_mini_batch_size: int = Field(8, ge=1, description="prompts per optimizer step (x rollout.n trajectories)")
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_micro_batch_size: int | None = None
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = Field(4096, ge=1, description="token budget of one micro-batch")
    ppo_epochs: int = Field(1, ge=1)
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["k1", "kl", "abs", "k2", "mse", "low_var_kl", "k3"] = "low_var_kl"
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig)
    shuffle: bool = False


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_micro_batch_size: int | None = None
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig)


# ---------------------------------------------------------------- rollout
class MultiTurnConfig(Section):
    enable: bool = True
    max_assistant_turns: int | None = Field(4, description="None: until the response budget")
    max_user_turns: int | None = Field(4, description="interaction replies allowed; None: unlimited")
    max_parallel_calls: int = Field(1, ge=1, description="tool calls run per turn; extra calls get an error")
    max_tool_response_length: int = Field(256, ge=1, description="characters kept of one tool response")
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_config_path: str | None = None
    interaction_config_path: str | None = None
    format: str | None = Field(None, description="tool-call format: hermes | llama3_json | mistral; None: detect")
    tool_timeout: float = Field(30.0, gt=0, description="seconds one tool call may take")


class ValKwargsConfig(Section):
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False


class SGLangConfig(Section):
    url: str | None = Field(None, description="existing SGLang server (rollout CLI); None: launch one")
    python: str | None = Field(None, description="interpreter of the SGLang environment")
    port: int = Field(30000, description="port of a server the rollout CLI launches (the trainer picks free ports)")
    extra_args: list[str] = Field(default_factory=list, description="appended to `python -m sglang.launch_server`")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of a launched server")


class RolloutConfig(Section):
    name: Literal["hf", "sglang"] = "hf"
    mode: Literal["sync", "async"] = "async"
    n: int = Field(1, ge=1, description="trajectories per prompt (GRPO group size)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    do_sample: bool = True
    max_batch_size: int = Field(64, ge=1, description="hf engine: requests decoded together")
    prompt_length: int | None = None
    response_length: int | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_micro_batch_size: int | None = None
    tensor_model_parallel_size: int = Field(1, description="accepted for verl compatibility; ignored by hf")
    gpu_memory_utilization: float = Field(0.5, description="accepted for verl compatibility; used by sglang")
    free_cache_engine: bool = True
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    val_kwargs: ValKwargsConfig = Field(default_factory=ValKwargsConfig)
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)


class ActorRolloutRefConfig(Section):
    hybrid_engine: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ref: RefConfig = Field(default_factory=RefConfig)


# ---------------------------------------------------------------- critic / algorithm / trainer
class CriticModelConfig(Section):
    path: str | None = Field(None, description="None: same as actor_rollout_ref.model.path")
    enable_gradient_checkpointing: bool = False


class CriticConfig(Section):
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_micro_batch_size: int | None = None
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int | None = None


class KLCtrlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


class FilterGroupsConfig(Section):
    enable: bool = False
    metric: str = "score"


class AlgorithmConfig(Section):
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "kl", "abs", "k2", "mse", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)


class TrainerConfig(Section):
    project_name: str = "verl_agent"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: int | None = Field(None, description="overrides total_epochs when set")
    logger: list[str] = Field(default_factory=lambda: ["console", "tensorboard"], description="console|tensorboard")
    default_local_dir: str = Field("runs/${trainer.project_name}/${trainer.experiment_name}")
    save_freq: int = Field(-1, description="checkpoint every N steps; -1: only at the end")
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
    log_trajectories: bool = True
    critic_warmup: int = 0

    @model_validator(mode="before")
    @classmethod
    def _logger_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("logger"), str):
            data = {**data, "logger": [data["logger"]]}
        return data


class RunConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    custom_reward_function: CustomRewardFunctionConfig = Field(default_factory=CustomRewardFunctionConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.default_local_dir)


# ---------------------------------------------------------------- loading
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_value(text: str) -> Any:
    """An override's value: int, float (also 1e-6), bool, null, list, mapping or string (quotes optional)."""
    if _FLOAT.match(text) and not re.match(r"^[+-]?\d+$", text):
        return float(text)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None and text.strip().lower() not in ("null", "none", "~", ""):
        return text
    if isinstance(value, str) and text.strip().lower() == "none":
        return None
    return value


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value). Hydra's '+a.b=v' spelling is accepted."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. data.train_batch_size=8)")
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    return key.split("."), parse_value(raw.strip())


def all_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema (used for 'did you mean' and `verl-agent config keys`)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append(key)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(all_keys(ann, key + "."))
    return out


def _set(tree: dict, path: list[str], value: Any, where: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError, tree: dict) -> str:
    keys = all_keys()
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not isinstance(p, int) or True)
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, keys, n=1, cutoff=0.5)
            if not close:  # try matching the last part within the same section
                section = loc.rsplit(".", 1)[0] + "." if "." in loc else ""
                names = [k for k in keys if k.startswith(section)]
                close = difflib.get_close_matches(loc, names, n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"unknown key {loc!r}{hint}")
        else:
            value = e.get("input")
            lines.append(f"{loc}={value!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _interpolate(tree: dict, root: dict) -> dict:
    """Resolve '${a.b}' references in string values (only whole dotted keys, like OmegaConf)."""

    def lookup(m: re.Match) -> str:
        node: Any = root
        for part in m.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"interpolation ${{{m.group(1)}}} names no key")
            node = node[part]
        return str(node)

    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _interpolate(v, root)
        elif isinstance(v, str):
            out[k] = re.sub(r"\$\{([\w.]+)\}", lookup, v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig. Raises ConfigError."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections (data:, trainer:, ...)")
    for item in overrides:
        keys, value = parse_override(item)
        _set(tree, keys, value, f"override {item!r}")
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, tree)) from None
    resolved = _interpolate(cfg.model_dump(), cfg.model_dump())
    return RunConfig.model_validate(resolved)


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config (what actually ran) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return path
