"""Named extension points: one `Registry` per kind of component, the single list of names a config key accepts.

    from verl_agent.registry import ADV_ESTIMATORS

    @ADV_ESTIMATORS.register("my_estimator", groups=True)   # the one step: the config now accepts the name
    def my_estimator(inputs): ...

The config checks each named key against its registry when it is loaded (`check`), and the error lists the
registered names. A user's module that registers its own components is named in the config's ``plugins``
list and imported before that check, in every process that validates the config (driver and Ray workers).

Registries sit below every component (this module imports nothing of ours), so the config can hold the
names without importing the components. The built-in entries are registered by the modules named in
`builtins`, imported on the first lookup: a registry is complete when it is read, whoever imports it first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

__all__ = ["ADV_ESTIMATORS", "CONTAINER_RUNTIMES", "CONTEXT_STRATEGIES", "ENGINES", "LOGGERS", "POLICY_LOSSES",
           "REGISTRIES", "REWARD_MANAGERS", "Registry", "RegistryError"]

T = TypeVar("T")
_DECORATE: Any = object()  # register(name) without an object: used as a decorator (None is a valid entry)


class RegistryError(ValueError):
    """An unknown name, or a name registered twice; the message names the registry and the known names."""


class Registry(Generic[T]):
    """Names -> objects of one kind (with optional facts about each, `meta`).

    `kind` is the noun in errors ("advantage estimator"), `key` the config key that takes a name (None
    where no key does yet), `builtins` the modules whose import registers the built-in entries.
    """

    def __init__(self, kind: str, key: str | None, builtins: tuple[str, ...] = ()) -> None:
        self.kind, self.key, self.builtins = kind, key, builtins
        self._items: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._loaded = False

    @overload
    def register(self, name: str, *, replace: bool = False, **meta: Any) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, obj: T, *, replace: bool = False, **meta: Any) -> T: ...

    def register(self, name: str, obj: Any = _DECORATE, *, replace: bool = False, **meta: Any) -> Any:
        """Register `obj` under `name` (or decorate: ``@REG.register(name)``); `meta` is read back by `meta`.

        A name already taken is refused unless `replace` (a user replacing a built-in says so)."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} needs a non-empty string name, got {name!r}")

        def add(item: T) -> T:
            if name in self._items and not replace:
                raise RegistryError(f"{self.kind} {name!r} is already registered (pass replace=True to replace it)")
            self._items[name], self._meta[name] = item, dict(meta)
            return item

        return add if obj is _DECORATE else add(obj)

    def get(self, name: str) -> T:
        """The object registered as `name`; an unknown name raises `RegistryError` naming the config key and
        listing the known names."""
        try:
            self.check(name)
        except RegistryError as e:
            raise RegistryError(f"{self.key}: {e}" if self.key else str(e)) from None
        return self._items[name]

    def meta(self, name: str) -> dict[str, Any]:
        """The facts `name` was registered with (e.g. ``groups=True`` for an estimator that needs groups)."""
        self.check(name)
        return dict(self._meta[name])

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def unregister(self, name: str) -> T:
        """Remove `name` and return its object (a test's temporary entry)."""
        self.check(name)
        self._meta.pop(name)
        return self._items.pop(name)

    def check(self, name: str) -> str:
        """`name` if registered, else a `RegistryError` naming the key and every registered name."""
        if name not in self:
            raise RegistryError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'} "
                                "(register your own in a module listed in the config's `plugins`)")
        return name

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first, so that a builtin module reading this registry while it imports does not recurse
        try:
            for module in self.builtins:
                importlib.import_module(module)
        except BaseException:
            self._loaded = False  # the next lookup tries again and reports the same error
            raise


# The built-in entries live beside the code that uses them; these modules register them on import.
ADV_ESTIMATORS: Registry[Any] = Registry(
    "advantage estimator", "algorithm.adv_estimator", ("verl_agent.trainer.algorithms.advantages",))
POLICY_LOSSES: Registry[Any] = Registry(
    "policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode", ("verl_agent.trainer.algorithms.losses",))
ENGINES: Registry[Any] = Registry("engine", "actor_rollout_ref.rollout.name", ("verl_agent.rollout.build",))
REWARD_MANAGERS: Registry[Any] = Registry(
    "reward manager", "reward_model.reward_manager", ("verl_agent.rollout.build",))
CONTEXT_STRATEGIES: Registry[Any] = Registry(
    "context strategy", "actor_rollout_ref.rollout.multi_turn.context.strategy", ("verl_agent.rollout.context",))
LOGGERS: Registry[Any] = Registry(
    "logger", "trainer.logger", ("verl_agent.trainer.tracking.tracker", "verl_agent.trainer.tracking.loggers"))
# name -> factory(**options) -> Runtime (verl_agent.containers.base); "auto" is not an entry but a choice
CONTAINER_RUNTIMES: Registry[Any] = Registry("container runtime", "runtime (container tools' config)",
                                             ("verl_agent.containers",))

REGISTRIES: tuple[Registry[Any], ...] = (ADV_ESTIMATORS, POLICY_LOSSES, ENGINES, REWARD_MANAGERS, CONTEXT_STRATEGIES,
                                         LOGGERS, CONTAINER_RUNTIMES)
