"""Persistent Python kernel: runs INSIDE the sandbox, started by the agent for sessions and Jupyter.

Standard library only. Control: one JSON request per line on the original stdin, one JSON reply per
line on the original stdout (both moved to private fds at start). For each cell, fd 1 and 2 point at
fresh memfds so output of subprocesses and C extensions is captured too, not only ``print``.
Like IPython, a cell whose last statement is an expression "displays" that value's ``repr``.
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


def _read(fd: int, cap: int) -> str:
    size = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, cap) if size else b""
    text = data.decode("utf-8", errors="replace")
    return text + (f"\n...[truncated {size - cap} bytes]" if size > cap else "")


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
        shown = _exec(code, display)
    except BaseException as e:  # noqa: BLE001 - a cell's exception is its result, never the kernel's end
        exc = traceback.TracebackException.from_exception(e)
        exc.stack = traceback.StackSummary.from_list([f for f in exc.stack if f.filename == "<cell>"])
        tb = list(exc.format())
        error = [{"ename": type(e).__name__, "evalue": str(e), "traceback": tb}]
        sys.stderr.write("".join(tb))
    finally:
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
