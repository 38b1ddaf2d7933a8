"""verl_agent/registry.py: one Registry per kind of component, the names the config accepts, and `plugins`."""

from __future__ import annotations

import sys

import pytest

from verl_agent.config import ConfigError, load_config
from verl_agent.registry import CONTAINER_RUNTIMES, LOGGERS, REGISTRIES, REWARD_MANAGERS, Registry, RegistryError


def test_register_get_meta_and_unregister():
    reg: Registry[int] = Registry("widget", "a.widget")
    assert reg.register("one", 1, size=3) == 1

    @reg.register("two")
    def two() -> int:
        return 2

    reg.register("none", None)  # None is an entry (e.g. "the caller handles it"), not "decorate"
    assert reg.get("two") is two and reg.get("none") is None and reg.meta("one") == {"size": 3}
    assert reg.names() == ["none", "one", "two"] and list(reg) == reg.names() and "one" in reg
    with pytest.raises(RegistryError, match="widget 'one' is already registered"):
        reg.register("one", 10)
    assert reg.register("one", 10, replace=True) == 10 and reg.get("one") == 10
    with pytest.raises(RegistryError, match="^a.widget: unknown widget 'three'; registered: none, one, two"):
        reg.get("three")
    assert reg.unregister("one") == 10 and "one" not in reg
    with pytest.raises(RegistryError, match="non-empty string name"):
        reg.register("", 1)


def test_builtins_are_imported_on_first_lookup_and_a_failed_import_is_retried(tmp_path, monkeypatch):
    (tmp_path / "widgets_builtin.py").write_text("from test_registry_reg import REG\nREG.register('w', 1)\n")
    (tmp_path / "test_registry_reg.py").write_text(
        "from verl_agent.registry import Registry\nREG = Registry('widget', None, ('widgets_builtin',))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from test_registry_reg import REG  # type: ignore[import-not-found]

    assert "widgets_builtin" not in sys.modules
    assert REG.names() == ["w"] and "widgets_builtin" in sys.modules
    broken = Registry("gadget", None, ("no_such_module_here",))
    for _ in range(2):  # the error each time, not an empty registry the second time
        with pytest.raises(ModuleNotFoundError):
            broken.names()


def test_every_registry_with_builtins_has_them():
    for reg in REGISTRIES:
        assert bool(reg.names()) == bool(reg.builtins), reg.kind
    assert CONTAINER_RUNTIMES.names() == ["bwrap", "docker"]  # registered by verl_agent.containers


def test_plugins_are_imported_before_the_names_are_checked(tmp_path, monkeypatch):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("from verl_agent.registry import REWARD_MANAGERS\n"
                      "REWARD_MANAGERS.register('constant', lambda data, custom, reward_model: 'built')\n")
    monkeypatch.chdir(tmp_path)
    try:
        cfg = load_config(None, ["plugins=[my_reward.py]", "reward_model.reward_manager=constant"])
        assert cfg.plugins == [str(plugin)]  # absolute: Ray workers validate it from another directory
        from verl_agent.rollout.build import build_reward

        assert build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model) == "built"
    finally:
        REWARD_MANAGERS.unregister("constant")
    with pytest.raises(ConfigError, match=r"plugins\[0\]='no_such_plugin_mod': No module named 'no_such_plugin_mod'"):
        load_config(None, ["plugins=[no_such_plugin_mod]"])
    with pytest.raises(ConfigError, match=r"plugins\[0\]=.*missing.py.*does not exist"):
        load_config(None, ["plugins=[missing.py]"])


def test_a_registered_logger_is_a_valid_trainer_logger_and_is_opened(tmp_path):
    from verl_agent.trainer.tracking.loggers import LoggerRun, open_loggers

    opened: list[LoggerRun] = []

    class Recorder:
        key, run_id, where = "recorder", "r1", "memory"

        def log_metrics(self, step, metrics): ...  # noqa: ANN001, ANN201
        def log_trajectories(self, step, paths): ...  # noqa: ANN001, ANN201
        def close(self): ...  # noqa: ANN201

    LOGGERS.register("recorder", lambda run: opened.append(run) or Recorder())
    try:
        assert load_config(None, ["trainer.logger=[console,recorder]"]).trainer.logger == ["console", "recorder"]
        (lg,) = open_loggers(["console", "recorder"], tmp_path, "p", "e", {"a": 1}, resume=False)
        assert lg.key == "recorder" and opened[0].project == "p" and opened[0].run_id is None
        assert (tmp_path / "loggers.json").read_text() == '{"recorder": "r1"}'  # a resumed run continues it
    finally:
        LOGGERS.unregister("recorder")
    with pytest.raises(ConfigError, match="registered loggers: console, mlflow, tensorboard, wandb"):
        load_config(None, ["trainer.logger=[recorder]"])
