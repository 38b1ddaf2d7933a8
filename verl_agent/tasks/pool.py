"""ContainerPool: trajectory containers from a warm pool per image, each destroyed after its trajectory.

    pool = ContainerPool(warm=2)
    box = await pool.acquire(task)      # a started container with its shell open, ready for commands
    ...                                 # box.shell.run("ls"), grading, ...
    await pool.release(box)             # removed (in the background; close() waits for it)
    await pool.close()

Containers are keyed by their ``ContainerSpec`` (image, user, limits, network): the n samples of a
GRPO group, and tasks whose ``environment/`` is identical, share one key. After a key's first use the
pool keeps ``warm`` started containers of it (their shells already open), so the next acquire only
pops one; starts run in threads, at most ``max_starting`` at once, and never on the event loop. The
warm containers of a key not acquired for ``idle_s`` seconds are removed (a task seen once does not
keep containers for the rest of the run).

Containers come from a container runtime (``verl_agent.containers``: ``docker``, ``bwrap``, or ``auto``:
Docker when a daemon answers, else bwrap). Every container carries the run's labels; the pool reaps
containers of dead owners when it starts and every ``reap_interval_s`` while it lives, and removes its
own on close. A runtime error while starting is raised as ``ContainerError`` (an infrastructure failure).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from verl_agent.containers import (
    LABEL,
    NODE_LABEL,
    OWNER_LABEL,
    RUN_LABEL,
    TASK_LABEL,
    Container,
    ContainerError,
    ContainerSpec,
    Runtime,
    get_runtime,
    owner_id,
)
from verl_agent.data.harbor import HarborTask
from verl_agent.tasks.shell import Shell, ShellError

__all__ = ["ContainerError", "ContainerPool", "TaskContainer"]

logger = logging.getLogger(__name__)


def docker_client() -> Any:
    import docker

    return docker.from_env(timeout=300)


def _has_id(client: Any, ref: str) -> bool:
    import docker.errors

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


@dataclass
class TaskContainer:
    """A started trajectory container with its persistent shell."""

    container: Container
    shell: Shell
    started_s: float = 0.0  # seconds the start took (create + start + shell)
    warm: bool = False  # taken from the warm pool
    task_name: str = ""

    @property
    def id(self) -> str:
        return self.container.id

    @property
    def spec(self) -> ContainerSpec:
        return self.container.spec

    @property
    def user(self) -> str:
        return self.container.user

    @property
    def workdir(self) -> str:
        return self.container.workdir

    @property
    def labels(self) -> dict[str, str]:
        return self.container.labels


class ContainerPool:
    """See the module docstring. Safe to use from several event loops of one process, one at a time."""

    def __init__(self, runtime: Runtime | str = "auto", *, run_id: str | None = None, warm: int = 2,
                 max_starting: int = 4,
                 allow_internet: bool = False, node_id: str | None = None, reap_interval_s: float = 60.0,
                 idle_s: float = 120.0,
                 max_output: int = 16000, pids: int = 512, lifetime_s: int | None = None,
                 shells: bool = True) -> None:
        self.runtime = get_runtime(runtime) if isinstance(runtime, str) else runtime
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.warm, self.allow_internet, self.node_id = warm, allow_internet, node_id
        self.idle_s = idle_s  # warm containers of a spec not acquired for this long are removed
        self._last_used: dict[ContainerSpec, float] = {}
        self.max_output, self.pids, self.lifetime_s = max_output, pids, lifetime_s
        self.shells = shells  # False: the user of a container opens its shell itself (a pool in another process)
        self._starting = threading.Semaphore(max(1, max_starting))
        # removals queue behind two at a time: a burst of them (a batch of trajectories ending together)
        # would otherwise take the daemon's CPU from the trajectories still running
        self._removing = threading.Semaphore(2)
        self._ready: dict[ContainerSpec, collections.deque[TaskContainer]] = collections.defaultdict(collections.deque)
        self._filling: collections.Counter[ContainerSpec] = collections.Counter()
        self._guard = threading.Lock()
        self._removals: set[threading.Thread] = set()
        self.owner = owner_id()
        self.stats = collections.Counter()
        self.closed = False
        self.reaped_at_start = self.runtime.reap()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._housekeeping, args=(reap_interval_s,), daemon=True,
                                        name="verl-agent-tasks-reaper")
        self._reaper.start()

    # -- specs ---------------------------------------------------------------------------------

    def spec_for(self, task: HarborTask, image: str) -> ContainerSpec:
        cfg = task.config
        if cfg.allow_internet and not self.allow_internet:
            from verl_agent.data.harbor import TaskError

            raise TaskError(f"{task.path / 'task.toml'}: the task asks for internet access; refused "
                            "(allow it explicitly: allow_internet=true in the tool config / --allow-internet)")
        lifetime = self.lifetime_s or int(2 * (cfg.agent_timeout_sec + cfg.verifier_timeout_sec) + 3600)
        return ContainerSpec(image=image, user=cfg.agent_user or "", cpus=min(cfg.cpus, self.runtime.ncpu),
                             memory_mb=cfg.memory_mb, storage_mb=cfg.storage_mb, pids=self.pids,
                             network=cfg.allow_internet, lifetime_s=lifetime)

    # -- start / stop (blocking; run in threads) ----------------------------------------------

    def _start(self, spec: ContainerSpec, task_name: str) -> TaskContainer:
        t0 = time.perf_counter()
        labels = {LABEL: "1", RUN_LABEL: self.run_id, OWNER_LABEL: self.owner, TASK_LABEL: task_name}
        if self.node_id:
            labels[NODE_LABEL] = self.node_id
        with self._starting:
            c = self.runtime.start(spec, labels)  # ContainerError: infrastructure
            shell = Shell(self.runtime, c, max_output=self.max_output)
            try:
                if self.shells:
                    shell.open()
            except ShellError as e:
                self._remove(c)
                raise ContainerError(f"starting a container of {spec.image} failed: {e}", e.cause) from e
        self.stats["started"] += 1
        return TaskContainer(c, shell, time.perf_counter() - t0, task_name=task_name)

    def _remove(self, c: Container) -> None:
        self.runtime.destroy(c)
        self.stats["removed"] += 1

    def _remove_later(self, box: TaskContainer) -> None:
        box.shell.close()
        t = threading.Thread(target=self._remove_tracked, args=(box.container,), daemon=True)
        with self._guard:
            self._removals.add(t)
        t.start()

    def _remove_tracked(self, c: Container) -> None:
        try:
            with self._removing:
                self._remove(c)
        finally:
            with self._guard:
                self._removals.discard(threading.current_thread())

    def _fill(self, spec: ContainerSpec, task_name: str) -> None:
        """Start containers until `warm` are ready for `spec` (one thread per missing container)."""
        try:
            box = self._start(spec, task_name)
        except ContainerError as e:
            logger.warning("warm pool: %s", e)
            return
        finally:
            with self._guard:
                self._filling[spec] -= 1
        box.warm = True
        with self._guard:
            if not self.closed:
                self._ready[spec].append(box)
                return
        self._remove_later(box)

    def _refill(self, spec: ContainerSpec, task_name: str) -> None:
        with self._guard:
            missing = self.warm - len(self._ready[spec]) - self._filling[spec]
            if self.closed or missing <= 0:
                return
            self._filling[spec] += missing
        for _ in range(missing):
            threading.Thread(target=self._fill, args=(spec, task_name), daemon=True).start()

    def _housekeeping(self, reap_interval: float) -> None:
        """Every few seconds: drop warm containers of specs idle for idle_s; every reap_interval: reap."""
        last_reap = time.monotonic()
        while not self._stop.wait(min(5.0, reap_interval, self.idle_s / 2)):
            self.evict_idle()
            if time.monotonic() - last_reap >= reap_interval:
                last_reap = time.monotonic()
                with contextlib.suppress(Exception):
                    self.runtime.reap()

    def evict_idle(self) -> int:
        """Remove the warm containers of specs not acquired for idle_s seconds; returns how many."""
        now = time.monotonic()
        with self._guard:
            idle = [s for s, q in self._ready.items() if q and now - self._last_used.get(s, now) > self.idle_s]
            boxes = [b for s in idle for b in self._ready.pop(s)]
        for b in boxes:
            self._remove_later(b)
        self.stats["evicted"] += len(boxes)
        return len(boxes)

    # -- public --------------------------------------------------------------------------------

    async def image_for(self, task: HarborTask) -> str:
        """The image ref the task's containers start from: a local Docker image (built if needed), or for
        bwrap the task's root filesystem in the runtime's image store (exported from a local daemon when
        one answers, else brought with ``verl-agent tasks import``)."""
        return await asyncio.to_thread(self._image_for, task)

    def _image_for(self, task: HarborTask) -> str:
        from verl_agent.tasks.image import ensure_image

        if self.runtime.name == "docker":
            return ensure_image(task, self.runtime.client, allow_internet=self.allow_internet)
        from verl_agent.containers.docker import daemon_answers
        from verl_agent.tasks.export import rootfs_for
        from verl_agent.tasks.image import ImageError

        try:  # the store's index, by the content hash of environment/: no daemon asked
            return rootfs_for(task, self.runtime.images).ref
        except ImageError:
            if not daemon_answers():
                raise
        client = docker_client()  # built and exported once, where a daemon runs
        try:
            return rootfs_for(task, self.runtime.images, client).ref
        finally:
            client.close()

    def has_image(self, task: HarborTask) -> bool:
        """Is the task's image already there (nothing to build or export)?"""
        from verl_agent.tasks.image import environment_hash, image_tag

        if self.runtime.name == "docker":
            client = self.runtime.client
            ref = task.config.docker_image or image_tag(task, client)
            return _has_id(client, ref)
        store = self.runtime.images
        ref = task.config.docker_image or store.task_ref(environment_hash(task.environment_dir))
        return bool(ref) and store.get(ref) is not None

    async def acquire(self, task: HarborTask) -> TaskContainer:
        """A started container for one trajectory of `task` (from the warm pool when one is ready)."""
        if self.closed:
            raise ContainerError("the container pool is closed")
        spec = self.spec_for(task, await self.image_for(task))
        while True:  # a warm container whose shell ended (daemon restarted, container killed) is replaced
            with self._guard:
                self._last_used[spec] = time.monotonic()
                box = self._ready[spec].popleft() if self._ready[spec] else None
            if box is None or not self.shells or box.shell.alive():
                break
            self.stats["warm_dead"] += 1
            self._remove_later(box)
        self._refill(spec, task.name)
        if box is not None:
            self.stats["warm_hits"] += 1
            box.task_name = task.name
            return box
        self.stats["cold_starts"] += 1
        return await asyncio.to_thread(self._start, spec, task.name)

    async def prewarm(self, task: HarborTask, n: int | None = None) -> None:
        """Start warm containers of `task`'s spec until `n` (default `warm`) are ready; wait for them."""
        spec = self.spec_for(task, await self.image_for(task))
        with self._guard:
            self._last_used[spec] = time.monotonic()
            missing = (self.warm if n is None else n) - len(self._ready[spec]) - self._filling[spec]
            self._filling[spec] += max(0, missing)
        for _ in range(max(0, missing)):  # each start waits for one of the max_starting slots
            threading.Thread(target=self._fill, args=(spec, task.name), daemon=True).start()
        while True:
            with self._guard:
                if not self._filling[spec]:
                    self._last_used[spec] = time.monotonic()  # idle from now, not from the start of the wait
                    return
            await asyncio.sleep(0.05)

    async def release(self, box: TaskContainer) -> None:
        """End a trajectory's container: it is removed (never reused)."""
        self._remove_later(box)

    def ready_count(self) -> int:
        with self._guard:
            return sum(len(q) for q in self._ready.values())

    async def close(self) -> None:
        """Remove the warm containers, wait for pending removals, sweep this run's labels."""
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        with self._guard:
            self.closed = True
            boxes = [b for q in self._ready.values() for b in q]
            self._ready.clear()
        self._stop.set()
        for b in boxes:
            b.shell.close()
            self._remove(b.container)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self._guard:
                pending = list(self._removals)
                filling = sum(self._filling.values())
            if not pending and not filling:
                break
            for t in pending:
                t.join(timeout=1)
            if not pending:
                time.sleep(0.05)
        self.runtime.reap(run_id=self.run_id)
