"""Code sandbox with Sandbox Fusion's HTTP API: server, client, backends (docker, process).

Threat model
------------
The code is hostile: written by a model under RL, it may loop, fork, allocate, flood output, fill
disks, probe the network, read secrets, race other runs, or attack the sandbox itself. The server,
the host and other runs are protected; the run itself is not (it may fail any way it likes).

Protected (one adversarial test per line in tests/sandbox/test_security.py, on both backends):
- time: every step has a deadline; the agent (PID 1 of the sandbox's PID namespace) SIGKILLs every
  other process of the sandbox at the deadline and after the main program exits, so setsid, double
  fork and ``nohup &`` children die too; the server has its own deadline and kills the sandbox.
- memory, processes, CPU, disk: per-run RLIMIT_AS; per-sandbox cgroup memory, pids and CPU limits
  (docker always; process backend where cgroup v1 is writable); size-limited tmpfs scratch space;
  read-only system directories and /dev. Output (also a notebook's displayed values and errors) is
  drained while the program runs and capped with a marker.
- network: no interface but loopback (own network namespace); the server's port is unreachable.
- secrets: a clean environment; no host home, no docker socket; the agent is non-dumpable, so
  /proc/1/environ, /proc/1/mem and ptrace are closed to programs of the same uid.
- other runs: one run per sandbox at a time; own PID namespace; after a run (finished or timed
  out), every other process is killed and /tmp, /dev/shm, /var/tmp are wiped (nothing else is
  writable, which the start-up probe checks); a sandbox that may be dirty (a survivor of that kill,
  scratch not wiped, SysV IPC in use, a protocol error or the server-side deadline) is destroyed and
  replaced, never reused.
- file paths: ``files``/``fetch_files`` must stay in the work dir; symlinks are never followed.
- privileges: a non-root uid; docker: ``--cap-drop ALL`` + ``no-new-privileges``; process: an
  unprivileged user namespace (no capabilities on the host).
- the supervisor itself: started as ``python3 -I`` so its import path holds neither its working
  directory (the user-writable /tmp) nor PYTHON* variables: a planted module is never imported.
- measured, not assumed (both backends): at start-up a probe sandbox started exactly like a worker
  checks uid, network, read-only root, capability sets, PID namespace, environment, scratch mounts,
  that nothing outside them is writable, and cgroup limits (docker: from inside; process: membership
  and limits read from the host); a failed guarantee that the backend claims refuses to serve
  (``IsolationError`` naming it).
  ``/v1/health`` shows the result.
- other servers on the host: runner containers (docker) and cgroups (process) carry the server's own
  instance id and a server removes only its own (a restarted server given the same ``instance_id``,
  ``verl-agent sandbox serve --instance-id``, cleans up its predecessor).
- the server: bounded queue (503 + Retry-After when full; the client retries), request body limit, a
  crashed sandbox (even one whose PID 1 was killed) is replaced and its request answered
  ``SandboxError``. The pool is elastic (``min_pool_size`` warm, grown on demand to
  ``max_pool_size``, shrunk to the demand of the last ``pool_idle_timeout`` seconds); running
  sandboxes share the CPU under per-sandbox quotas (no pinning), so concurrent runs time out on
  their own wall-clock deadline, and each response reports ``queue_time`` apart from
  ``execution_time``. See docs/sandbox.md.

Not protected: kernel exploits (containers and namespaces share the host kernel; use gVisor/VMs for
that), covert timing channels between concurrent runs, CPU time stolen from neighbours within the
CPU quota. In a session the same trajectory's calls share one sandbox on purpose. The process
backend without root (or without a writable cgroup v1 hierarchy) has no cgroup limits: it does not
claim them, and ``/v1/health`` lists them as not holding. Session ids are bearer
tokens: whoever holds one may use and close that session, so clients must not share or log them.

Sessions (our extension): a client obtains a session id from the server, never chooses one:
``POST /open_session`` -> ``{"session_id": "<43 url-safe chars, 256 random bits>"}`` (503 +
Retry-After while every one of ``max_sessions`` slots is taken). ``/run_code`` with that
``session_id`` (python) runs in one interpreter kept alive across calls until ``POST /close_session
{"session_id": ...}``, the idle timeout or server shutdown; a timeout or crash inside the session loses
its state (the reply says so) but keeps the id. Any id the server did not issue, or one already
closed, is refused (``SandboxError``: unknown session_id). ``SandboxClient.open_session()`` and the
``code_interpreter`` tool (``enable_session``) do this for you; plain Sandbox Fusion requests
without ``session_id`` are unchanged.
"""

from verl_agent.sandbox.api import (
    CommandRunResult, CommandRunStatus, RunCodeRequest, RunCodeResponse, RunJupyterRequest, RunJupyterResponse,
    RunStatus,
)
from verl_agent.sandbox.client import ClientLimits, SandboxClient, SandboxUnavailable

__all__ = [
    "ClientLimits", "CommandRunResult", "CommandRunStatus", "RunCodeRequest", "RunCodeResponse",
    "RunJupyterRequest", "RunJupyterResponse", "RunStatus", "SandboxClient", "SandboxUnavailable",
]
