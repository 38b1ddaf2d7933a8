"""Persistent Python kernel: runs INSIDE the sandbox, started by the agent for sessions and Jupyter.

Standard library only. Control: one JSON request per line on the original stdin, one JSON reply per
line on the original stdout (both moved to private fds at start). For each cell, fd 1 and 2 point at
fresh memfds so output of subprocesses and C extensions is captured too, not only ``print``.
Like IPython, a cell whose last statement is an expression "displays" that value's ``repr``.
Everything a reply carries from the cell (output, display, error text) is capped at the request's ``cap``
bytes here, inside the sandbox. A process the cell forks ends with the cell (``os._exit``), whatever it
does: only the kernel itself ever replies.
"""

import ast
import json
import os
import sys
import traceback

CTL_IN = os.fdopen(os.dup(0), "r")
CTL_OUT = os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
NS = {"__name__": "__main__", "__builtins__": __builtins__}
KERNEL_PID = os.getpid()


def _read(fd: int, cap: int) -> str:
    size = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, cap) if size else b""
    text = data.decode("utf-8", errors="replace")
    return text + (f"\n...[truncated {size - cap} bytes]" if size > cap else "")


def _clip(text: str, cap: int) -> str:
    """``text`` cut to its first ``cap`` UTF-8 bytes, with a marker."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= cap:
        return text
    return data[:cap].decode("utf-8", errors="ignore") + f"\n...[truncated {len(data) - cap} bytes]"


def _clip_lines(lines: list, cap: int) -> list:
    """A traceback's last lines (the error is at the end) within about ``cap`` bytes, with a marker."""
    total = sum(len(x.encode("utf-8", errors="replace")) for x in lines)
    if total <= cap:
        return lines
    kept, left = [], cap
    for line in reversed(lines):
        size = len(line.encode("utf-8", errors="replace"))
        if size > left:
            kept += [] if kept else [_clip(line, cap)]  # one huge last line (the message): its head
            break
        kept.append(line)
        left -= size
    return [f"...[traceback truncated: {total} bytes, about {cap} kept]\n"] + kept[::-1]


def _child_exit(e: BaseException | None) -> None:
    """End a process the cell forked as a forked script would end; never let it reply as the kernel."""
    status = 0
    try:
        if isinstance(e, SystemExit):
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        elif e is not None:
            traceback.print_exception(e)
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status & 0xFF)


def _exec(code: str, display: bool) -> list:
    tree = ast.parse(code, "<cell>", "exec")
    last = None
    if display and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), NS)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), NS)
        if value is not None:
            return [{"text/plain": repr(value)}]
    return []


def run_cell(code: str, cap: int, display: bool) -> dict:
    fds = [os.memfd_create("out"), os.memfd_create("err")]
    saved = [os.dup(1), os.dup(2)]
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    shown, error = [], []
    try:
        shown = [{k: _clip(v, cap) for k, v in d.items()} for d in _exec(code, display)]
    except BaseException as e:  # noqa: BLE001 - a cell's exception is its result, never the kernel's end
        if os.getpid() != KERNEL_PID:
            _child_exit(e)
        exc = traceback.TracebackException.from_exception(e)
        exc.stack = traceback.StackSummary.from_list([f for f in exc.stack if f.filename == "<cell>"])
        tb = list(exc.format())
        sys.stderr.write("".join(tb))
        error = [{"ename": type(e).__name__, "evalue": _clip(str(e), cap), "traceback": _clip_lines(tb, cap)}]
    finally:
        if os.getpid() != KERNEL_PID:
            _child_exit(None)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    reply = {"stdout": _read(fds[0], cap), "stderr": _read(fds[1], cap), "display": shown, "error": error}
    for fd in fds + saved:
        os.close(fd)
    return reply


def main() -> None:
    os.chdir(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
    for line in CTL_IN:
        req = json.loads(line)
        reply = run_cell(req["code"], int(req.get("cap", 1 << 20)), bool(req.get("display", False)))
        CTL_OUT.write(json.dumps(reply) + "\n")
        CTL_OUT.flush()


if __name__ == "__main__":
    main()
