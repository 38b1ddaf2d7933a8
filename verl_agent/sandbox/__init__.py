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
  read-only system directories. Output is drained while the program runs and capped with a marker.
- network: no interface but loopback (own network namespace); the server's port is unreachable.
- secrets: a clean environment; no host home, no docker socket; the agent is non-dumpable, so
  /proc/1/environ, /proc/1/mem and ptrace are closed to programs of the same uid.
- other runs: one run per sandbox at a time; own PID namespace; after a run, leftovers are killed
  and /tmp, /dev/shm, /var/tmp are wiped; a sandbox that may be dirty (timeout, survivors,
  SysV IPC in use, protocol error) is destroyed and replaced, never reused.
- file paths: ``files``/``fetch_files`` must stay in the work dir; symlinks are never followed.
- privileges: a non-root uid; docker: ``--cap-drop ALL`` + ``no-new-privileges``; process: an
  unprivileged user namespace (no capabilities on the host).
- the supervisor itself: started as ``python3 -I`` so its import path holds neither its working
  directory (the user-writable /tmp) nor PYTHON* variables: a planted module is never imported.
- measured, not assumed (docker): at start-up a probe container with the runner's exact flags checks
  uid, network, read-only root, capability sets, PID namespace, environment and cgroup limits; a
  failed guarantee refuses to serve (``IsolationError`` naming it). ``/v1/health`` shows the result.
- other servers on the host: runner containers carry the server's own instance id and a server
  removes only its own (a restarted server given the same ``instance_id`` cleans up its predecessor).
- the server: bounded queue (503 + Retry-After when full), request body limit, a crashed sandbox is
  replaced and its request answered ``SandboxError``.

Not protected: kernel exploits (containers and namespaces share the host kernel; use gVisor/VMs for
that), covert timing channels between concurrent runs, CPU time stolen from neighbours within the
CPU quota. In a session the same trajectory's calls share one sandbox on purpose. The process
backend without root has no cgroup limits: ``/v1/health`` lists which guarantees hold (its values
are derived from its configuration; only the docker backend probes them). Session ids are bearer
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
