"""Config: YAML + dotted overrides, verl key names, and errors that name the key."""

from __future__ import annotations

import pytest

from verl_agent.config import ConfigError, all_keys, load_config, parse_value, save_config

QUICKSTART = [  # the verl quick-start command line, as users paste it
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "data.train_file=data/math_sample.jsonl",
    "data.reward_fn=reward_fn.math_reward_fn",
    "data.max_prompt_length=64",
    "data.max_response_length=32",
    "data.train_batch_size=256",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]


def test_verl_quickstart_command_line_parses():
    cfg = load_config(None, QUICKSTART)
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.data.train_files == ["data/math_sample.jsonl"]
    assert cfg.data.reward_fn == "reward_fn.math_reward_fn"
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 32)
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.critic.optim.lr == pytest.approx(1e-5)
    assert cfg.trainer.logger == ["console"]
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.total_epochs == 15


@pytest.mark.parametrize(
    "text,value",
    [("3", 3), ("-2", -2), ("0.5", 0.5), ("1e-6", 1e-6), ("3E2", 300.0), ("true", True), ("False", False),
     ("null", None), ("None", None), ("[1, 2]", [1, 2]), ("[console,tensorboard]", ["console", "tensorboard"]),
     ("'007'", "007"), ('"a b"', "a b"), ("hello", "hello"), ("a:b", "a:b"), ("path/x.py:fn", "path/x.py:fn")],
)
def test_override_values_are_typed(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_yaml_file_plus_overrides_and_interpolation(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  train_batch_size: 4\ntrainer:\n  experiment_name: exp1\n  logger: [console]\n")
    cfg = load_config(f, ["data.train_batch_size=16", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5"])
    assert cfg.data.train_batch_size == 16
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 5
    assert cfg.trainer.default_local_dir == "runs/verl_agent/exp1"
    out = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(out).model_dump() == cfg.model_dump()


def test_interpolation_like_verl_yaml(tmp_path):
    """References resolve before validation: a whole-value reference keeps its type (verl's
    `prompt_length: ${data.max_prompt_length}`), lists resolve, defaults and chains of references resolve,
    a single file is not listed twice, and a cycle or a missing key is named."""
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  val_files: ['/v/${trainer.project_name}.jsonl']\n"
                 "actor_rollout_ref:\n  rollout:\n    prompt_length: ${data.max_prompt_length}\n")
    cfg = load_config(f, ["data.train_file=/d/${trainer.project_name}/t.jsonl", "data.max_prompt_length=300",
                          "trainer.experiment_name=e_${data.train_batch_size}"])
    assert cfg.actor_rollout_ref.rollout.prompt_length == 300
    assert cfg.data.val_files == ["/v/verl_agent.jsonl"] and cfg.data.train_files == ["/d/verl_agent/t.jsonl"]
    assert cfg.trainer.default_local_dir == "runs/verl_agent/e_8"  # the default's references, through a chain
    with pytest.raises(ConfigError, match=r"refers to itself: trainer.experiment_name -> trainer.project_name"):
        load_config(None, ["trainer.project_name=${trainer.experiment_name}",
                           "trainer.experiment_name=${trainer.project_name}"])
    with pytest.raises(ConfigError, match=r"interpolation \$\{data.nope\} names no key"):
        load_config(None, ["trainer.project_name=${data.nope}"])


def test_unknown_key_names_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown key 'data.train_bach_size'.*did you mean 'data.train_batch_size'"):
        load_config(None, ["data.train_bach_size=3"])
    with pytest.raises(ConfigError, match=r"did you mean 'actor_rollout_ref.rollout.multi_turn.max_assistant_turns'"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.max_assistant_turn=3"])


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"data.train_batch_size='abc'.*valid integer"):
        load_config(None, ["data.train_batch_size=abc"])
    with pytest.raises(ConfigError, match=r"trainer.val_before_train='maybe'.*valid boolean"):
        load_config(None, ["trainer.val_before_train=maybe"])


@pytest.mark.parametrize("bad", ["data.train_batch_size", "=3", "data..x=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="override"):
        load_config(None, [bad])


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(f)


def test_value_where_section_expected():
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["data.train_batch_size=3", "data.train_batch_size.x=1"])


def test_all_keys_lists_nested_verl_keys():
    keys = set(all_keys())
    for k in ["actor_rollout_ref.rollout.multi_turn.tool_config_path", "algorithm.adv_estimator",
              "actor_rollout_ref.actor.clip_ratio_high", "custom_reward_function.path", "trainer.n_gpus_per_node"]:
        assert k in keys


@pytest.mark.parametrize("override, key, hint", [
    ("actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.rollout.mode", "leave it at async"),
    ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.hybrid_engine", "colocated"),
    ("trainer.rollout_workers=2", "trainer.rollout_workers", "only trainer.placement=split"),
    ("trainer.rollout_gpus_per_worker=0.5", "trainer.rollout_gpus_per_worker", "split on GPUs"),
    ("trainer.weight_transport=object_store", "trainer.weight_transport", "only trainer.placement=split"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "tensor_model_parallel_size", "use 1"),
    ("actor_rollout_ref.model.use_remove_padding=false", "use_remove_padding", "packed"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor.ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"),
    ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl", "use_kl_in_reward=true"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "param_offload", "needs GPU workers"),
    ("actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "fsdp_size", "HSDP is not implemented"),
    ("actor_rollout_ref.rollout.response_length=7", "rollout.response_length", "data.max_response_length"),
    ("trainer.logger=[console,neptune]", "trainer.logger", "registered loggers: console, mlflow, tensorboard, wandb"),
    ("trainer.max_staleness=3", "trainer.max_staleness", "only trainer.mode=async uses it"),
    ("trainer.partial_rollout=false", "trainer.partial_rollout", "only trainer.mode=async uses it"),
    ("trainer.resume_from_path=/r/global_step_3", "trainer.resume_from_path", "resume_mode=resume_path uses it"),
    ("trainer.device=cuda", "trainer.device", "set trainer.n_gpus_per_node"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size", "must divide data.train_batch_size (8)"),
])
def test_unimplemented_values_are_refused_naming_the_key(override, key, hint):
    """Every key works or is refused: a non-default value of an unimplemented key is a load-time error."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in str(e.value) and hint in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["data.val_batch_size=-4"], "data.val_batch_size=-4: Input should be greater than or equal to 1"),
    (["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"], "max_assistant_turns=0: Input should be greater"),
    (["trainer.total_training_steps=-3"], "trainer.total_training_steps=-3: Input should be greater"),
    (["actor_rollout_ref.rollout.multi_turn.format=hermse"], "format='hermse': Value error, unknown tool-call format"),
    (["trainer.mode=async", "actor_rollout_ref.actor.old_log_prob_source=rollout"], "the rollout correction"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.param_offload=true"],
     "CPU offload runs on one GPU only (2 workers here)"),
])
def test_values_that_cannot_work_are_refused(overrides, message):
    """Values that used to load and then misbehave quietly (an empty validation, a turn cap of 1, a parser
    error inside a worker, the engine's log-probs weighed against themselves) fail at load, naming the key."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
    # what stays allowed: a mini-batch at least the whole batch (one step), rollout log-probs in sync, aliases
    cfg = load_config(None, ["data.train_batch_size=3", "actor_rollout_ref.actor.old_log_prob_source=rollout",
                             "actor_rollout_ref.rollout.multi_turn.format=qwen"])
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8 and cfg.data.train_batch_size == 3


def test_implemented_verl_values_load():
    cfg = load_config(None, ["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true",
                             "actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "trainer.num_cpu_workers=2",
                             "actor_rollout_ref.rollout.response_length=256", "data.filter_overlong_prompts=true",
                             "data.truncation=left", "algorithm.filter_groups.metric=acc",
                             "actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.actor.shuffle=true"])
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.data.truncation == "left"
    with pytest.raises(ConfigError, match="filter_groups.metric"):
        load_config(None, ["algorithm.filter_groups.metric=bogus"])


def test_one_builder_for_training_and_evaluation():
    """Training and `verl-agent rollout` derive sampling from one function: do_sample=false is greedy in both."""
    from verl_agent.rollout.build import sampling_params

    cfg = load_config(None, ["actor_rollout_ref.rollout.do_sample=false", "data.max_response_length=77",
                             "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
                             "actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    r = cfg.actor_rollout_ref.rollout
    train = sampling_params(r, cfg.data, seed=3)
    val = sampling_params(r, cfg.data, seed=3, validate=True)
    assert (train.temperature, train.seed, train.max_new_tokens) == (0.0, None, 77)
    assert (val.temperature, val.seed, val.max_new_tokens) == (0.7, 3, 77)


def test_profile_steps_are_step_numbers() -> None:
    from verl_agent.config import ConfigError, load_config

    assert load_config(None, ["trainer.profile_steps=[2,5]"]).trainer.profile_steps == [2, 5]
    with pytest.raises(ConfigError, match="profile_steps"):
        load_config(None, ["trainer.profile_steps=[0]"])
