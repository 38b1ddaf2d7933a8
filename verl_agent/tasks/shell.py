"""One persistent bash per trajectory, over one stream the container runtime opened.

The shell is started once by the runtime (``Runtime.open_shell``: a Docker exec socket, or a bwrap
process on a socket pair) and kept: cwd, exported variables, functions and background processes
persist from call to call, and a call costs one write and the reads of its output, nothing new started.

Protocol: each call writes one line::

    jobs -p >JOBS; __va $'<command>' </dev/null 2>&1; printf '\\036VA<token>:%d\\n' $?

The command runs in the shell itself (``eval`` inside the function ``__va``, not a subshell), with
stdin from /dev/null so it cannot swallow the next call, stderr merged into stdout. Being in a
function, ``declare`` without ``-g`` makes a local variable (``export`` and plain assignments persist).
The line that ends the call carries a fresh random token, so output cannot fake the end of a call,
and the exit code. Quoting the command as ``$'...'`` means an unbalanced quote in it is a syntax
error of that call (exit 2), never a hung shell.

Per-call timeout: the runtime's ``interrupt`` sends the shell SIGUSR1, whose trap returns from ``__va``
(ending the rest of the command, shell-builtin loops included), and kills the processes the call
started (children of the shell, minus the background jobs that existed before the call, and all their
descendants); the shell lives on with its cwd and variables and the call reports exit code 137. Should the shell still
not answer (e.g. the command trapped SIGUSR1 itself), it is replaced by a fresh one and the result
says that its state was lost.
Output beyond ``max_output`` characters keeps its head and tail with a marker saying how much was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from dataclasses import dataclass

from verl_agent.containers import CONTAINER_DEAD, Channel, Container, ContainerError, Runtime

__all__ = ["Shell", "ShellError", "ShellResult", "ansi_c_quote"]

JOBS_FILE = "/tmp/.verl_agent_jobs"
_MARK = b"\x1eVA"


# Commands run inside a function so that a timeout can end them: SIGUSR1's trap returns from it.
_PRELUDE = "__va() { eval \"$1\"; }; trap 'return 137 2>/dev/null' USR1"


class ShellError(RuntimeError):
    """The shell's container is gone. ``cause``: ``container_dead`` (infrastructure) or
    ``agent_killed_container`` (the agent ended it: its episode ends with a 0)."""

    def __init__(self, message: str, cause: str = CONTAINER_DEAD) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class ShellResult:
    """One call's outcome."""

    output: str
    exit_code: int
    timed_out: bool = False
    cut_chars: int = 0  # characters of output left out by the cap
    restarted: bool = False  # the shell had to be replaced (its cwd/env/background jobs are gone)
    seconds: float = 0.0
    timeout: float = 0.0  # the limit this call ran under


def ansi_c_quote(text: str) -> str:
    """``text`` as a bash ``$'...'`` word (every byte survives, nothing is expanded)."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif ch == "\n":
            out.append("\\n")
        elif o < 32 or o == 127:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def cap_output(text: str, limit: int, dropped: int = 0) -> tuple[str, int]:
    """Keep the head and tail of ``text`` within ``limit`` characters, with a marker naming the cut;
    ``dropped`` counts output already left out of the middle of ``text`` while it was read."""
    if len(text) <= limit and not dropped:
        return text, 0
    total = len(text) + dropped
    cut = total - min(limit, len(text))
    head = min(limit, len(text)) // 2
    return (f"{text[:head]}\n[... output truncated: {cut} of {total} characters cut ...]\n"
            f"{text[len(text) - (min(limit, len(text)) - head):]}"), cut


class Shell:
    """A persistent bash in a running container; ``await run(cmd, timeout)`` per call, one at a time."""

    def __init__(self, runtime: Runtime, container: Container, *, env: dict[str, str] | None = None,
                 max_output: int = 16000) -> None:  # fmt: skip
        self.runtime, self.container = runtime, container
        self.env = {"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", **(env or {})}
        self.max_output = max_output
        self.pid = 0  # the shell's pid inside the container
        self._channel: Channel | None = None
        self._sock: socket.socket | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._frames = bytearray()  # undecoded frame bytes
        self._dropped = 0  # output bytes of the current call read but not kept (a flood's middle)
        self._lock: asyncio.Lock | None = None
        self.closed = False

    # -- start (blocking: call from a thread) -------------------------------------------------

    def open(self) -> Shell:
        """Start bash and read its pid; blocking (the pool calls it in a thread)."""
        try:
            self._channel = self.runtime.open_shell(self.container, self.env)
        except ContainerError as e:
            raise ShellError(f"starting bash in {self.container.id[:12]} failed: {e}", e.cause) from e
        self._sock = self._channel.sock
        token = secrets.token_hex(8)
        hello = f"printf '\\036VA{token}:%d\\n' $$"
        self._sock.sendall(f"{_PRELUDE}\n{hello}\n".encode())
        self._sock.settimeout(30)
        buf = bytearray()
        marker = _MARK + token.encode() + b":"
        try:
            while marker not in buf or not buf.endswith(b"\n"):
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise ShellError(f"bash in {self.container.id[:12]} exited at start (is bash in the image?): "
                                     f"{bytes(self._demux_all(buf))[-300:]!r}")
                buf += chunk
        except OSError as e:
            raise ShellError(f"bash in {self.container.id[:12]} did not answer: {e}") from e
        text = bytes(self._demux_all(buf))
        self.pid = int(text[text.index(marker) + len(marker):].decode().strip())
        self._sock.settimeout(None)
        return self

    def reopen(self) -> Shell:
        """A new shell in the same container (the old one ends); blocking."""
        self._close_socket()
        self.closed = False
        return self.open()

    def _demux_all(self, buf: bytearray) -> bytearray:
        if self._channel is not None and not self._channel.framed:
            return buf
        out, i = bytearray(), 0
        while i + 8 <= len(buf):
            n = int.from_bytes(buf[i + 4:i + 8], "big")
            out += buf[i + 8:i + 8 + n]
            i += 8 + n
        return out

    # -- calls ---------------------------------------------------------------------------------

    async def _streams(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        if self._reader is None or self._loop is not loop:
            if self._sock is None:
                raise ShellError("the shell is not open")
            self._sock.setblocking(False)
            self._reader, self._writer = await asyncio.open_connection(sock=self._sock, limit=1 << 20)
            if self._loop is not loop:
                self._loop, self._lock = loop, asyncio.Lock()
        return self._reader, self._writer  # type: ignore[return-value]

    async def run(self, command: str, timeout: float = 60.0, limit: int | None = None) -> ShellResult:
        """Run one command in the shell; never raises for the command's own failure (ShellError: infra).
        ``limit`` overrides ``max_output`` for this call (the editor reads whole files through it)."""
        if self.closed:
            raise ShellError("the shell was closed")
        reader, writer = await self._streams()
        assert self._lock is not None
        async with self._lock:
            return await self._run(reader, writer, command, timeout, limit or self.max_output)

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, command: str,
                   timeout: float, limit: int) -> ShellResult:  # fmt: skip
        t0 = time.perf_counter()
        token = secrets.token_hex(8)
        marker = _MARK + token.encode() + b":"
        line = (f"declare -F __va >/dev/null || {{ {_PRELUDE}; }}; "  # gone after an `exec bash`
                f"jobs -p >{JOBS_FILE} 2>/dev/null; __va {ansi_c_quote(command)} </dev/null 2>&1; "
                f"printf '\\036VA{token}:%d\\n' $?\n")
        out = bytearray()
        self._dropped = 0
        try:
            writer.write(line.encode())
            await writer.drain()
            code = await asyncio.wait_for(self._read_until(reader, marker, out, limit), timeout)
            timed_out = restarted = False
        except asyncio.TimeoutError:
            timed_out = True
            code, restarted = await self._interrupt(reader, marker, out, limit)
        except (EOFError, ConnectionError, OSError) as e:  # the command ended the shell (`exit`), or the container died
            await self._restart_after_exit(e)
            text, cut = cap_output(out.decode("utf-8", errors="replace"), limit, self._dropped)
            note = "\n[the shell exited; a new shell was started: cwd, variables and background jobs were reset]"
            return ShellResult(text + note, 0, False, cut, True, time.perf_counter() - t0, timeout)
        text, cut = cap_output(out.decode("utf-8", errors="replace"), limit, self._dropped)
        return ShellResult(text, code, timed_out, cut, restarted, time.perf_counter() - t0, timeout)

    def _take_frames(self) -> bytes:
        """Payloads of the complete frames received so far (stdout and stderr alike)."""
        buf, out, i = self._frames, bytearray(), 0
        if self._channel is not None and not self._channel.framed:
            out = bytes(buf)
            buf.clear()
            return out
        while i + 8 <= len(buf):
            n = int.from_bytes(buf[i + 4:i + 8], "big")
            if i + 8 + n > len(buf):
                break
            out += buf[i + 8:i + 8 + n]
            i += 8 + n
        del buf[:i]
        return bytes(out)

    async def _read_until(self, reader: asyncio.StreamReader, marker: bytes, out: bytearray, limit: int) -> int:
        """Read into `out` until the end-of-call line; returns the exit code. Safe to cancel: bytes read
        are kept in ``self._frames``/``out``, so a later read goes on where this one stopped."""
        keep = 4 * limit + 4096  # bytes kept of a flood: head and tail, the middle is counted only
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                raise EOFError("the shell's stream ended")
            self._frames += chunk
            new = self._take_frames()
            out += new
            at = out.find(marker, max(0, len(out) - len(new) - len(marker)))
            end = out.find(b"\n", at) if at >= 0 else -1
            if end >= 0:
                code = int(out[at + len(marker):end])
                del out[at:]
                return code
            if at < 0 and len(out) > 2 * keep:  # a flood: keep its head and its latest bytes, count the rest
                self._dropped += len(out) - keep
                del out[keep // 2:len(out) - keep // 2]

    async def _interrupt(self, reader: asyncio.StreamReader, marker: bytes, out: bytearray,
                         limit: int) -> tuple[int, bool]:  # fmt: skip
        """Kill the timed-out call's processes; if the shell itself is stuck, replace it."""
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.runtime.interrupt, self.container, self._channel, self.pid, JOBS_FILE)
            return await asyncio.wait_for(self._read_until(reader, marker, out, limit), 3.0), False
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.runtime.end_shell, self.container, self._channel, self.pid)
        self._close_socket()
        await asyncio.to_thread(self.open)
        await self._streams()
        return 137, True

    async def _restart_after_exit(self, why: Exception) -> None:
        """A new shell when the container still stands; ShellError (with its cause) when it does not."""
        self._close_socket()
        try:
            state = await asyncio.to_thread(self.runtime.state, self.container)
        except ContainerError as e:
            raise ShellError(f"the container {self.container.id[:12]} is gone: {e}", e.cause) from e
        except Exception as e:
            raise ShellError(f"the container {self.container.id[:12]} cannot be inspected: {e}") from e
        if not state.running:
            raise ShellError(state.detail, state.cause) from why
        try:
            await asyncio.to_thread(self.open)
        except ShellError:  # it stopped between the look and the open: say why, as above
            state = await asyncio.to_thread(self.runtime.state, self.container)
            if not state.running:
                raise ShellError(state.detail, state.cause) from why
            raise
        await self._streams()

    def _close_socket(self) -> None:
        self._frames.clear()
        self._reader = None
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        elif self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock, self._writer, self._reader, self._channel = None, None, None, None

    def alive(self) -> bool:
        """False once the connection to bash has ended (the container, or the daemon, went away); no waiting."""
        if self.closed or self._sock is None:
            return False
        if self._reader is not None:
            return not self._reader.at_eof()
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Drop the connection (bash sees end of input and exits); the container is removed by its owner."""
        self.closed = True
        self._close_socket()
