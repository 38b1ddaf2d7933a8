"""str_replace_editor in the trajectory's container: SWE-agent/OpenHands conventions and exact messages."""

from __future__ import annotations

import pytest
from task_helpers import needs_docker

from verl_agent.tasks.editor import Editor
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]


async def test_editor_commands_and_messages(pool, count_task):
    box = await pool.acquire(load_task(count_task))
    try:
        ed = Editor(lambda cmd: box.shell.run(cmd, 30, limit=8 << 20))
        await box.shell.run("cd /tmp")
        assert await ed({"command": "view", "path": "app/input.txt"}) == (
            "Error: The path app/input.txt is not an absolute path, it should start with `/`.")
        assert await ed({"command": "view", "path": "/app/nope"}) == (
            "Error: The path /app/nope does not exist. Please provide a valid path.")
        assert await ed({"command": "view", "path": "/app/input.txt"}) == (
            "Here's the result of running `cat -n` on /app/input.txt:\n     1\thello\n     2\tworld\n     3\t\n")
        assert await ed({"command": "create", "path": "/app/input.txt", "file_text": "x"}) == (
            "Error: File already exists at: /app/input.txt. Cannot overwrite files using command `create`.")
        body = "def f():\n    return 1\n\ndef g():\n    return 1\n"
        assert await ed({"command": "create", "path": "/app/src/m.py", "file_text": body}) == (
            "File created successfully at: /app/src/m.py")
        assert (await box.shell.run("cat /app/src/m.py; pwd")).output == body + "/tmp\n"  # cwd untouched
        assert await ed({"command": "str_replace", "path": "/app/src/m.py", "old_str": "return 2",
                         "new_str": "x"}) == (
            "Error: No replacement was performed, old_str `return 2` did not appear verbatim in /app/src/m.py.")
        assert await ed({"command": "str_replace", "path": "/app/src/m.py", "old_str": "return 1",
                         "new_str": "x"}) == (
            "Error: No replacement was performed. Multiple occurrences of old_str `return 1` in lines [2, 5]. "
            "Please ensure it is unique.")
        out = await ed({"command": "str_replace", "path": "/app/src/m.py", "old_str": "def g():\n    return 1",
                        "new_str": "def g():\n    return 2"})
        assert out.startswith("The file /app/src/m.py has been edited. Here's the result of running `cat -n` on a "
                              "snippet of /app/src/m.py:\n")
        assert "     5\t    return 2" in out and out.endswith("Edit the file again if necessary.")
        assert await ed({"command": "insert", "path": "/app/src/m.py", "insert_line": 9, "new_str": "#"}) == (
            "Error: Invalid `insert_line` parameter: 9. It should be within the range of lines of the file: [0, 6]")
        out = await ed({"command": "insert", "path": "/app/src/m.py", "insert_line": 0, "new_str": "import os"})
        assert "     1\timport os\n     2\tdef f():" in out
        assert (await box.shell.run("head -2 /app/src/m.py")).output == "import os\ndef f():\n"
        assert await ed({"command": "view", "path": "/app/src/m.py", "view_range": [5, 6]}) == (
            "Here's the result of running `cat -n` on /app/src/m.py:\n     5\tdef g():\n     6\t    return 2\n")
        assert (await ed({"command": "view", "path": "/app"})).splitlines() == [
            "Here's the files and directories up to 2 levels deep in /app, excluding hidden items:",
            "/app", "/app/input.txt", "/app/src", "/app/src/m.py"]
        assert await ed({"command": "str_replace", "path": "/app", "old_str": "a"}) == (
            "Error: The path /app is a directory and only the `view` command can be used on directories.")
        big = "line\n" * 20000  # 100 KB: beyond the bash output cap, still read whole
        await ed({"command": "create", "path": "/app/big.txt", "file_text": big})
        out = await ed({"command": "view", "path": "/app/big.txt", "view_range": [19999, -1]})
        assert out.endswith(" 19999\tline\n 20000\tline\n 20001\t\n")
    finally:
        await pool.release(box)
