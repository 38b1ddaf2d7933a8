"""The start-up isolation probe shared by both backends: a real sandbox measures each guarantee.

A backend starts one sandbox exactly as it starts a worker, but runs ``PROBE`` in it instead of the
agent. The probe reports ``{guarantee: [ok, detail]}`` as seen from inside; the backend adds what
only the host can see (the process backend's cgroup membership and limits) and ``judge`` refuses
to serve when any guarantee the backend claims does not hold.
"""

from __future__ import annotations

import json

__all__ = ["GUARANTEES", "PROBE", "SCRATCH", "WEAKENINGS", "IsolationError", "check_weaken", "judge", "parse_probe",
           "unclaimed"]

GUARANTEES = ("non_root_uid", "no_network", "read_only_system", "no_capabilities", "own_pid_namespace", "clean_env",
              "memory_limit", "pids_limit", "cpu_limit", "disk_limit", "private_tmp", "only_scratch_writable")
# What the agent wipes after every run (agent.SCRATCH, which cannot import this: it is stdlib-only
# source run inside the sandbox); a test checks that the two agree.
SCRATCH = ("/tmp", "/dev/shm", "/var/tmp", "/dev/mqueue")
# Test-only: what a backend's ``weaken`` may drop, so the security suite can show each attack
# succeeding without the protection it tests. Every guarantee above, plus protections of the run that
# the probe does not measure: the open-file limit, (applied to every job a worker sends) the run's time
# limit, its memory limit and the output cap, the supervisor's isolated mode (``python -I``) and its
# wipe of the scratch dirs after every run, and the kernel's end of a process a cell forks. A guarantee
# kept by several layers is dropped whole, every layer at once (base.SOURCE_WEAKENINGS):
# ``no_leftover_processes`` (the supervisor's kill of every process after a run, its reaping of orphans
# and its report of a survivor, which has the sandbox destroyed), ``no_host_env`` (a clean sandbox
# environment, a non-dumpable supervisor, a fixed environment for every program), ``paths_confined``
# (the server's lexical check of a request's paths and the supervisor's) and ``no_symlink_follow``
# (the supervisor's realpath checks and O_NOFOLLOW).
# A weakened backend does not claim what it dropped; limits are raised to a bounded multiple, never
# removed, so a weakened sandbox cannot take the host down.
WEAKENINGS = GUARANTEES + ("fd_limit", "run_timeout", "run_memory_limit", "output_cap", "isolated_mode",
                           "scratch_wipe", "fork_guard", "no_leftover_processes", "no_host_env", "paths_confined",
                           "no_symlink_follow")
# Removing one of these removes the other with it: a writable root is writable outside scratch; so is
# what root owns in the sandbox (Docker's /dev) to a root uid; a /tmp shared on the host's disk has no size
# limit; the host's environment in the sandbox is not a clean one.
IMPLIED = {"read_only_system": ("only_scratch_writable",), "non_root_uid": ("only_scratch_writable",),
           "private_tmp": ("disk_limit",), "no_host_env": ("clean_env",)}


class IsolationError(RuntimeError):
    """A guarantee of the threat model does not hold on this host; the backend refuses to serve."""


# Runs as PID 1 of a container started with the runner's flags; prints {guarantee: [ok, detail]}.
# Nothing leaves the container: the network check only connects when lo is the sole interface
# (then the connect fails at once with ENETUNREACH).
PROBE = r'''
import errno, json, os, socket, sys
want = json.loads(sys.argv[1])
r = {}
r["non_root_uid"] = (0 not in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()), f"uid {os.getuid()}")
names = sorted(n for _, n in socket.if_nameindex())
net = names == ["lo"]
if net:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("203.0.113.1", 80))
        net = False
    except OSError as e:
        net = e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
    finally:
        s.close()
r["no_network"] = (net, f"interfaces {names}")
r["read_only_system"] = (bool(os.statvfs("/").f_flag & os.ST_RDONLY), "root mount read-only flag")
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
caps = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if k in status}
r["no_capabilities"] = (len(caps) == 5 and all(int(v, 16) == 0 for v in caps.values())
                        and status.get("NoNewPrivs", "").strip() == "1", f"{caps} NoNewPrivs={status.get('NoNewPrivs', '?').strip()}")
r["own_pid_namespace"] = (os.getpid() == 1, f"pid {os.getpid()}")
env = [e.split(b"=", 1)[0].decode() for e in open("/proc/self/environ", "rb").read().split(b"\0") if e]
# names only: PATH, HOSTNAME, HOME (docker), PWD (bwrap) carry no secret; anything else is a leak
extra = sorted(set(env) - {"PATH", "HOSTNAME", "HOME", "PWD"})
r["clean_env"] = (not extra, f"extra variables {extra}")
def first(*paths):
    for p in paths:
        try:
            return open(p).read().split()[0]
        except OSError:
            pass
    return None
if want.get("cgroups_inside", True):
    mem = first("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max")
    r["memory_limit"] = (mem is not None and mem.isdigit() and int(mem) <= want["memory"], f"memory limit {mem}")
    pids = first("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids.max")
    r["pids_limit"] = (pids is not None and pids.isdigit() and int(pids) <= want["pids"], f"pids.max {pids}")
    cpu = first("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max")
    r["cpu_limit"] = (cpu is not None and cpu.lstrip("-").isdigit() and int(cpu) > 0, f"cpu quota {cpu}")
tmp = {}
for d in ("/tmp", "/var/tmp"):
    st = os.statvfs(d)
    tmp[d] = st.f_blocks * st.f_frsize
mounts = {line.split()[1]: line.split()[2] for line in open("/proc/mounts")}
r["disk_limit"] = (all(0 < v <= want["tmp"] for v in tmp.values()), f"scratch sizes {tmp}")
r["private_tmp"] = (all(mounts.get(d) == "tmpfs" for d in tmp) and os.access("/tmp", os.W_OK), f"mounts {[mounts.get(d) for d in tmp]}")
# Anything writable outside the wiped scratch dirs would outlive a run: in every mount that is not
# read-only, try to create a file in each directory (os.access is not enough: devpts says W_OK, then
# refuses) and look for writable regular files.
scratch, writable, me = tuple(want["scratch"]), [], f".verl-probe-{os.getpid()}"
def kept(path, dev):
    try:
        return os.lstat(path).st_dev == dev and path not in scratch  # another mount is checked on its own line
    except OSError:
        return False
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    mnt = fields[4].encode().decode("unicode_escape")
    if (mnt.startswith(("/proc", "/sys")) or "ro" in fields[5].split(",") or not os.path.isdir(mnt)
            or any(mnt == d or mnt.startswith(d + "/") for d in scratch)):
        continue
    dev = os.stat(mnt).st_dev
    for d, dirs, files in os.walk(mnt):
        dirs[:] = [x for x in dirs if kept(os.path.join(d, x), dev)]
        writable += [os.path.join(d, f) for f in files if os.path.isfile(os.path.join(d, f))
                     and not os.path.islink(os.path.join(d, f)) and os.access(os.path.join(d, f), os.W_OK)]
        try:
            os.close(os.open(os.path.join(d, me), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError:
            continue
        os.unlink(os.path.join(d, me))
        writable.append(d)
r["only_scratch_writable"] = (not writable, f"writable outside {list(scratch)}: {writable[:10]}")
print(json.dumps(r), flush=True)
if want.get("hold"):
    sys.stdin.read()  # stay alive until the host has looked at us from outside
'''


def parse_probe(stdout: str) -> dict[str, tuple[bool, str]]:
    """The probe's JSON line; ``ValueError`` when it printed none."""
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("the probe printed nothing")
    return {k: (bool(v[0]), str(v[1])) for k, v in json.loads(lines[-1]).items()}


def check_weaken(backend: str, weaken: frozenset[str] | set[str]) -> frozenset[str]:
    """``weaken`` as a frozenset; ``ValueError`` naming any name that is not in ``WEAKENINGS``."""
    unknown = sorted(set(weaken) - set(WEAKENINGS))
    if unknown:
        raise ValueError(f"{backend} backend: weaken={unknown} unknown; choose from {list(WEAKENINGS)}")
    return frozenset(weaken)


def unclaimed(weaken: frozenset[str]) -> set[str]:
    """The guarantees a backend weakened by ``weaken`` does not claim: those, and what they imply."""
    return set(weaken).union(*(IMPLIED.get(w, ()) for w in weaken))


def judge(backend: str, found: dict[str, tuple[bool, str]], claimed: set[str]) -> dict[str, tuple[bool, str]]:
    """Raise ``IsolationError`` naming every claimed guarantee that failed (or was not measured)."""
    missing = {k: "not measured" for k in claimed if k not in found}
    failed = {**{k: d for k, (ok, d) in found.items() if k in claimed and not ok}, **missing}
    if failed:
        names = ", ".join(f"{k} ({detail})" for k, detail in sorted(failed.items()))
        raise IsolationError(f"{backend} backend: isolation guarantee failed at start-up: {names}; refusing to serve")
    return found
