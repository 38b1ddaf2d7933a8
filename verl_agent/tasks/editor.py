"""``str_replace_editor``: view, create, str_replace and insert files in the trajectory's container.

Follows the SWE-agent / OpenHands conventions: absolute paths only; ``view`` numbers lines like
``cat -n`` (a ``view_range`` of ``[start, end]``, ``end = -1`` for the end) and lists a directory two
levels deep; ``create`` refuses an existing file; ``str_replace`` needs ``old_str`` to occur exactly
once; ``insert`` puts ``new_str`` after line ``insert_line`` (0 = the top). Edits answer with a
numbered snippet around the change. Every message a wrong call gets is exact (see the constants).

Files move through the trajectory's own shell as base64 (so the agent's user and permissions apply,
and nothing depends on Python in the image), inside a subshell so the shell's cwd and variables stay.
"""

from __future__ import annotations

import base64
import shlex
from typing import Any

from verl_agent.tasks.shell import ShellResult

__all__ = ["COMMANDS", "EDITOR_SCHEMA", "Editor"]

COMMANDS = ("view", "create", "str_replace", "insert")
SNIPPET_LINES = 4
MAX_FILE_BYTES = 4 << 20

EDITOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "str_replace_editor",
        "description": (
            "View, create and edit files. Paths must be absolute.\n"
            "* view: show a file with line numbers (or list a directory two levels deep); view_range=[start, end] "
            "shows part of a file (end=-1: to the end)\n"
            "* create: write a new file with file_text (fails if the file exists)\n"
            "* str_replace: replace old_str, which must occur exactly once in the file, by new_str\n"
            "* insert: insert new_str after line insert_line (0 = at the top)"),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": list(COMMANDS), "description": "The operation."},
                "path": {"type": "string", "description": "Absolute path of the file or directory."},
                "file_text": {"type": "string", "description": "create: the content of the new file."},
                "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
                "new_str": {"type": "string", "description": "str_replace: the replacement; insert: the text."},
                "insert_line": {"type": "integer", "description": "insert: insert after this line (0 = top)."},
                "view_range": {"type": "array", "items": {"type": "integer"},
                               "description": "view: [start, end] line numbers, 1-based; end -1 = to the end."},
            },
            "required": ["command", "path"],
        },
    },
}


def numbered(text: str, start: int = 1) -> str:
    """Lines of `text` numbered like ``cat -n`` from `start`."""
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), start))


class EditorError(Exception):
    """A wrong call: the message is what the model sees."""


class Editor:
    """The editor's operations over a `run(command) -> ShellResult` callable (the trajectory's shell)."""

    def __init__(self, run: Any) -> None:
        self._run = run

    async def __call__(self, p: dict[str, Any]) -> str:
        try:
            return await self._dispatch(p)
        except EditorError as e:
            return f"Error: {e}"

    async def _sh(self, script: str) -> ShellResult:
        return await self._run(f"( {script} )")

    async def _kind(self, path: str) -> str:
        q = shlex.quote(path)
        res = await self._sh(f"if [ -d {q} ]; then echo dir; elif [ -f {q} ]; then echo file; "
                             f"elif [ -e {q} ]; then echo other; else echo none; fi")
        return res.output.strip()

    async def _read(self, path: str) -> str:
        q = shlex.quote(path)
        res = await self._sh(f"s=$(wc -c < {q}) || exit 3; [ \"$s\" -le {MAX_FILE_BYTES} ] || exit 4; base64 -w0 {q}")
        if res.exit_code == 4:
            raise EditorError(f"The file {path} is larger than {MAX_FILE_BYTES} bytes; view it with bash instead.")
        if res.exit_code != 0 or res.cut_chars:
            raise EditorError(f"Could not read {path}: {res.output.strip()[-300:]}")
        try:
            return base64.b64decode(res.output.strip()).decode("utf-8")
        except UnicodeDecodeError:
            raise EditorError(f"The file {path} is not UTF-8 text; use bash for binary files.") from None

    async def _write(self, path: str, text: str) -> None:
        q = shlex.quote(path)
        data = base64.b64encode(text.encode()).decode()
        res = await self._sh(f"mkdir -p -- \"$(dirname -- {q})\" && printf %s {data} | base64 -d > {q}")
        if res.exit_code != 0:
            raise EditorError(f"Could not write {path}: {res.output.strip()[-300:]}")

    async def _dispatch(self, p: dict[str, Any]) -> str:
        command, path = p.get("command"), p.get("path")
        if command not in COMMANDS:
            raise EditorError(f"Unrecognized command {command!r}. The allowed commands are: {', '.join(COMMANDS)}")
        if not isinstance(path, str) or not path.startswith("/"):
            raise EditorError(f"The path {path} is not an absolute path, it should start with `/`.")
        kind = await self._kind(path)
        if command == "create":
            return await self._create(path, kind, p.get("file_text"))
        if kind == "none":
            raise EditorError(f"The path {path} does not exist. Please provide a valid path.")
        if kind == "dir" and command != "view":
            raise EditorError(f"The path {path} is a directory and only the `view` command can be used on "
                              "directories.")
        if command == "view":
            return await self._view(path, kind, p.get("view_range"))
        if command == "str_replace":
            return await self._replace(path, p.get("old_str"), p.get("new_str") or "")
        return await self._insert(path, p.get("insert_line"), p.get("new_str"))

    async def _create(self, path: str, kind: str, text: Any) -> str:
        if text is None:
            raise EditorError("Parameter `file_text` is required for command: create.")
        if kind != "none":
            raise EditorError(f"File already exists at: {path}. Cannot overwrite files using command `create`.")
        await self._write(path, str(text))
        return f"File created successfully at: {path}"

    async def _view(self, path: str, kind: str, view_range: Any) -> str:
        if kind == "dir":
            if view_range:
                raise EditorError("The `view_range` parameter is not allowed when `path` points to a directory.")
            res = await self._sh(f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' | sort")
            return (f"Here's the files and directories up to 2 levels deep in {path}, excluding hidden items:\n"
                    f"{res.output}")
        text = await self._read(path)
        lines = text.split("\n")
        if not view_range:
            return f"Here's the result of running `cat -n` on {path}:\n{numbered(text)}\n"
        if not isinstance(view_range, list) or len(view_range) != 2 or not all(isinstance(x, int) for x in view_range):
            raise EditorError("Invalid `view_range`. It should be a list of two integers.")
        start, end = view_range
        n = len(lines)
        if not 1 <= start <= n:
            raise EditorError(f"Invalid `view_range`: {view_range}. Its first element `{start}` should be within the "
                              f"range of lines of the file: [1, {n}]")
        if end != -1 and not start <= end <= n:
            raise EditorError(f"Invalid `view_range`: {view_range}. Its second element `{end}` should be -1 or "
                              f"within [{start}, {n}]")
        part = "\n".join(lines[start - 1:] if end == -1 else lines[start - 1:end])
        return f"Here's the result of running `cat -n` on {path}:\n{numbered(part, start)}\n"

    async def _replace(self, path: str, old: Any, new: str) -> str:
        if old is None or old == "":
            raise EditorError("Parameter `old_str` is required for command: str_replace.")
        text = await self._read(path)
        count = text.count(old)
        if count == 0:
            raise EditorError(f"No replacement was performed, old_str `{old}` did not appear verbatim in {path}.")
        if count > 1:
            lines = [i + 1 for i, line in enumerate(text.split("\n")) if old.split("\n")[0] in line]
            raise EditorError(f"No replacement was performed. Multiple occurrences of old_str `{old}` in lines "
                              f"{lines}. Please ensure it is unique.")
        at_line = text.split(old)[0].count("\n")
        new_text = text.replace(old, new)
        await self._write(path, new_text)
        return (f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
                f"{self._snippet(new_text, at_line, new.count(chr(10)))}\n"
                "Review the changes and make sure they are as expected. Edit the file again if necessary.")

    async def _insert(self, path: str, line: Any, new: Any) -> str:
        if new is None:
            raise EditorError("Parameter `new_str` is required for command: insert.")
        if not isinstance(line, int) or isinstance(line, bool):
            raise EditorError("Parameter `insert_line` is required for command: insert.")
        text = await self._read(path)
        lines = text.split("\n")
        if not 0 <= line <= len(lines):
            raise EditorError(f"Invalid `insert_line` parameter: {line}. It should be within the range of lines of "
                              f"the file: [0, {len(lines)}]")
        new_lines = str(new).split("\n")
        new_text = "\n".join(lines[:line] + new_lines + lines[line:])
        await self._write(path, new_text)
        return (f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of the edited "
                f"file:\n{self._snippet(new_text, line, len(new_lines) - 1)}\n"
                "Review the changes and make sure they are as expected (correct indentation, no duplicate lines, "
                "etc). Edit the file again if necessary.")

    @staticmethod
    def _snippet(text: str, first: int, extra: int) -> str:
        """Numbered lines around the edit at 0-based line `first` spanning `extra` more lines."""
        lines = text.split("\n")
        start = max(0, first - SNIPPET_LINES)
        end = min(len(lines), first + extra + SNIPPET_LINES + 1)
        return numbered("\n".join(lines[start:end]), start + 1)
