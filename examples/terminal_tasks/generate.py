"""Generate the terminal-task suite: small Harbor-format tasks, procedurally varied, deterministic from a seed.

    python examples/terminal_tasks/generate.py                 # rewrites examples/terminal_tasks/tasks/
    python examples/terminal_tasks/generate.py --seed 1 --out /tmp/suite

Seven families, each task solvable with one to three shell commands:

    count      count lines of a log that contain a term, or all its lines     grep -c / wc -l
    find       the file under a tree that holds a code, or has a name         grep -rl / find
    fixbug     fix a one-line bug in a Python function (a Python test)        sed -i / the editor
    config     write a JSON, .env or INI file that a Python test parses       echo / printf
    rename     rename, prefix or move the files of one extension              for ... mv / mv
    transform  sort, dedupe, head, tail, a CSV column, a word replacement     sort / head / cut / sed
    fs         chmod, mkdir, delete by pattern, write, copy, symlink          chmod / rm / cp / ln

Each family's files come from a few environment *variants*; every task of one variant has the same
``environment/`` (a Dockerfile plus ``app/``, copied to ``/app`` and owned by the non-root user ``agent``),
so a content-hashed image cache builds one image per variant, not one per task. Training tasks use
variants 0 and 1, held-out tasks variant 2 (files the policy never saw), except ``config`` whose
environment is an empty ``/app``. Instructions, tests and the oracle vary per task.

Each task directory: ``instruction.md``, ``task.toml`` (Harbor schema, no internet), ``environment/``,
``tests/test.sh`` (writes 1 or 0 to ``/logs/verifier/reward.txt``), ``solution/solve.sh``. The suite's
``manifest.json`` lists every task with its family, split, variant, oracle commands and the oracle as tool
calls (``warm_start.py`` replays those in the task's container to make the warm-start chats).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "tasks"
TRAIN_VARIANTS, HELDOUT_VARIANTS = (0, 1), (2,)

DEBIAN, PYTHON = "debian:bookworm-slim", "python:3.12-slim"
WORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "olive", "peach", "pear", "plum",
         "lime", "kiwi", "fig", "otter", "tiger", "zebra", "panda", "koala", "camel", "eagle", "raven", "shark",
         "whale", "bison", "moose", "llama", "gecko", "heron", "trout")
CITIES = ("paris", "lima", "oslo", "cairo", "tokyo", "quito", "rome", "dakar", "hanoi", "bern", "doha", "riga")


@dataclass
class Env:
    """A task environment: its base image and the files copied to /app (relative path -> (text, mode))."""

    base: str
    files: dict[str, tuple[str, int]]

    def dockerfile(self) -> str:
        return (f"FROM {self.base}\n"
                "RUN useradd --create-home --uid 1000 agent\n"
                "COPY --chown=agent:agent app/ /app/\n"
                "WORKDIR /app\n")


@dataclass
class Task:
    """One task before it is written: the test is a shell condition, or a Python script that exits 0 on success."""

    family: str
    instruction: str
    solution: list[str]
    check: str = ""  # a bash condition, true when solved
    test_py: str = ""  # or: a Python test run with python3 (exit 0 = solved)
    test_files: dict[str, str] = field(default_factory=dict)
    calls: list[dict] = field(default_factory=list)  # the oracle as tool calls (warm-start chats); default: bash

    def tool_calls(self) -> list[dict]:
        return self.calls or [{"name": "bash", "arguments": {"command": " && ".join(self.solution)}}]


def _lines(items: list[str]) -> str:
    return "".join(f"{x}\n" for x in items)


def _answer_is(value: str) -> str:
    """The answer file holds `value` (whitespace ignored, repeated slashes squeezed)."""
    return f'[ "$(tr -d \'[:space:]\' < /app/answer.txt | tr -s /)" = "{value}" ]'


# ---------------------------------------------------------------- count
LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
SERVICES = ("auth", "billing", "cache", "search", "upload", "mailer")
MESSAGES = ("request ok", "timeout after retry", "connection closed", "user logged out", "job finished",
            "disk almost full", "config reloaded", "slow response", "token expired", "queue is empty")


def count_env(rng: random.Random) -> tuple[Env, list[Task]]:
    n = rng.randint(24, 40)
    log = []
    for i in range(n):
        t = f"{8 + i // 6:02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
        log.append(f"{t} {rng.choice(LEVELS)} {rng.choice(SERVICES)}: {rng.choice(MESSAGES)}")
    tasks = [Task("count", "How many lines does /app/log.txt have? Write only the number to /app/answer.txt.",
                  ["wc -l < /app/log.txt > /app/answer.txt"], _answer_is(str(n)))]
    for term in LEVELS + SERVICES:
        k = sum(term in line for line in log)
        if k:
            tasks.append(Task("count", f"How many lines of /app/log.txt contain `{term}`? "
                                       "Write only the number to /app/answer.txt.",
                              [f"grep -c {term} /app/log.txt > /app/answer.txt"], _answer_is(str(k))))
    return Env(DEBIAN, {"log.txt": (_lines(log), 0o644)}), tasks


# ---------------------------------------------------------------- find
def _code(rng: random.Random) -> str:
    return "ref-" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(4))


def find_env(rng: random.Random) -> tuple[Env, list[Task]]:
    dirs = rng.sample(["docs", "old", "misc", "work", "keep", "todo"], 3)
    names = rng.sample(WORDS, 9)
    files: dict[str, tuple[str, int]] = {}
    tasks = []
    for i, name in enumerate(names):
        rel = f"notes/{dirs[i % 3]}/{name}.txt"
        code = _code(rng)
        body = [" ".join(rng.sample(WORDS, 4)) for _ in range(rng.randint(3, 6))]
        body.insert(rng.randrange(len(body) + 1), f"see {code}")
        files[rel] = (_lines(body), 0o644)
        path = f"/app/{rel}"
        tasks.append(Task("find", f"Exactly one file under /app/notes contains the text `{code}`. "
                                  "Write the full path of that file to /app/answer.txt.",
                          [f"grep -rl {code} /app/notes > /app/answer.txt"], _answer_is(path)))
        tasks.append(Task("find", f"A file named `{name}.txt` is somewhere under /app/notes. "
                                  "Write its full path to /app/answer.txt.",
                          [f"find /app/notes -name {name}.txt > /app/answer.txt"], _answer_is(path)))
    return Env(DEBIAN, files), tasks


# ---------------------------------------------------------------- fixbug
# (name, signature, buggy body line, fixed body line, example call, its value, test cases as Python literals)
FUNCTIONS = (
    ("add", "a, b", "return a - b", "return a + b", "add(2, 3)", "5", "[((2, 3), 5), ((-1, 1), 0), ((10, 5), 15)]"),
    ("area", "w, h", "return w + h", "return w * h", "area(3, 4)", "12", "[((3, 4), 12), ((2, 2), 4), ((5, 1), 5)]"),
    ("is_even", "n", "return n % 2 == 1", "return n % 2 == 0", "is_even(4)", "True",
     "[((4,), True), ((7,), False), ((0,), True)]"),
    ("maximum", "a, b", "return a if a < b else b", "return a if a > b else b", "maximum(3, 7)", "7",
     "[((3, 7), 7), ((9, 2), 9), ((4, 4), 4)]"),
    ("triple", "x", "return x * 2", "return x * 3", "triple(5)", "15", "[((5,), 15), ((0,), 0), ((-2,), -6)]"),
    ("last", "items", "return items[0]", "return items[-1]", "last([1, 2, 3])", "3",
     "[(([1, 2, 3],), 3), ((['a'],), 'a'), (([4, 5],), 5)]"),
    ("square", "x", "return x + x", "return x * x", "square(5)", "25", "[((5,), 25), ((3,), 9), ((-4,), 16)]"),
    ("average", "xs", "return sum(xs) / 2", "return sum(xs) / len(xs)", "average([2, 4, 6])", "4",
     "[(([2, 4, 6],), 4), (([1, 2, 3, 4],), 2.5), (([5],), 5)]"),
    ("count_words", "s", "return len(s)", "return len(s.split())", 'count_words("a b c")', "3",
     "[(('a b c',), 3), (('hello',), 1), (('one two',), 2)]"),
    ("first_char", "s", "return s[-1]", "return s[0]", 'first_char("hello")', '"h"',
     "[(('hello',), 'h'), (('xy',), 'x'), (('q',), 'q')]"),
    ("is_positive", "n", "return n < 0", "return n > 0", "is_positive(5)", "True",
     "[((5,), True), ((-3,), False), ((0,), False)]"),
    ("to_fahrenheit", "c", "return c * 9 / 5 - 32", "return c * 9 / 5 + 32", "to_fahrenheit(100)", "212",
     "[((100,), 212), ((0,), 32), ((-40,), -40)]"),
    ("percent", "part, whole", "return part / whole * 10", "return part / whole * 100", "percent(1, 4)", "25",
     "[((1, 4), 25), ((1, 2), 50), ((3, 3), 100)]"),
)
MODULES = ("mathlib", "helpers", "utils")


def _sed_escape(text: str, replacement: bool = False) -> str:
    specials = "\\/&" if replacement else "\\/.*[]^$"
    return "".join("\\" + c if c in specials else c for c in text)


def fixbug_env(rng: random.Random, variant: int) -> tuple[Env, list[Task]]:
    module = MODULES[variant % len(MODULES)]
    chosen = rng.sample(FUNCTIONS, 7)
    source = "".join(f"def {f[0]}({f[1]}):\n    {f[2]}\n\n\n" for f in chosen).rstrip() + "\n"
    tasks = []
    for name, _, bug, fix, call, value, cases in chosen:
        assert source.count(bug) == 1, (module, bug)
        sed = f"sed -i 's/{_sed_escape(bug)}/{_sed_escape(fix, True)}/' /app/{module}.py"
        test = (f"import sys\nsys.path.insert(0, '/app')\nfrom {module} import {name}\n\n"
                f"for args, want in {cases}:\n"
                f"    got = {name}(*args)\n"
                f"    assert got == want, f'{name}{{args}} = {{got!r}}, expected {{want!r}}'\n"
                "print('ok')\n")
        path = f"/app/{module}.py"
        calls = [{"name": "bash", "arguments": {"command": f"cat {path}"}},
                 {"name": "str_replace_editor", "arguments": {"command": "str_replace", "path": path,
                                                              "old_str": bug, "new_str": fix}}]
        tasks.append(Task("fixbug", f"The function `{name}` in {path} has a one-line bug. "
                                    f"Fix it so that {call} returns {value}.", [sed], test_py=test, calls=calls))
    return Env(PYTHON, {f"{module}.py": (source, 0o644)}), tasks


# ---------------------------------------------------------------- config
CONFIG_VALUES: dict[str, Callable[[random.Random], object]] = {
    "port": lambda r: r.choice([8000, 8080, 8443, 9000, 5000, 3000]),
    "host": lambda r: r.choice(["localhost", "0.0.0.0", "example.org"]),
    "debug": lambda r: r.choice([True, False]),
    "workers": lambda r: r.randint(2, 8),
    "name": lambda r: r.choice(["web", "api", "worker", "proxy"]),
    "timeout": lambda r: r.choice([10, 30, 60]),
    "log_level": lambda r: r.choice(["info", "debug", "warning"]),
}


def _config_task(rng: random.Random) -> Task:
    kind = rng.choice(["json", "env", "ini"])
    keys = rng.sample(sorted(CONFIG_VALUES), 2)
    values = {k: CONFIG_VALUES[k](rng) for k in keys}
    if kind == "json":
        path = f"/app/{rng.choice(['config', 'settings', 'app'])}.json"
        said = " and ".join(f'"{k}" set to {json.dumps(v)}' for k, v in values.items())
        test = (f"import json\n\ngot = json.load(open({path!r}))\nwant = {values!r}\n"
                "assert got == want, f'{got!r} != {want!r}'\nprint('ok')\n")
        return Task("config", f"Create {path} holding a JSON object with {said}.",
                    [f"echo '{json.dumps(values)}' > {path}"], test_py=test)
    text = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}
    if kind == "env":
        path = f"/app/{rng.choice(['.env', 'app.env', 'service.env'])}"
        lines = [f"{k.upper()}={v}" for k, v in text.items()]
        test = (f"got = {{line.strip() for line in open({path!r}) if line.strip()}}\nwant = set({sorted(lines)!r})\n"
                "assert got == want, f'{got!r} != {want!r}'\nprint('ok')\n")
        return Task("config", f"Create {path} with exactly two lines: {lines[0]} and {lines[1]}.",
                    [f"printf '{lines[0]}\\n{lines[1]}\\n' > {path}"], test_py=test)
    path, section = f"/app/{rng.choice(['app', 'server', 'service'])}.ini", rng.choice(["server", "main", "app"])
    said = " and ".join(f"{k} = {v}" for k, v in text.items())
    body = "\\n".join([f"[{section}]", *(f"{k} = {v}" for k, v in text.items())])
    test = (f"import configparser\n\ncp = configparser.ConfigParser()\nassert cp.read({path!r}), 'missing {path}'\n"
            f"got = dict(cp[{section!r}])\nwant = {text!r}\n"
            "assert got == want, f'{got!r} != {want!r}'\nprint('ok')\n")
    return Task("config", f"Create the INI file {path} with a section [{section}] holding {said}.",
                [f"printf '{body}\\n' > {path}"], test_py=test)


def config_env(rng: random.Random) -> tuple[Env, list[Task]]:
    readme = "Configuration files of this service go in /app.\n"
    return Env(PYTHON, {"README.txt": (readme, 0o644)}), [_config_task(rng) for _ in range(40)]


# ---------------------------------------------------------------- rename
def _listing_is(files: list[str]) -> tuple[str, dict[str, str]]:
    check = '[ "$(cd /app/files && find . -type f | LC_ALL=C sort)" = "$(cat /tests/expected.txt)" ]'
    return check, {"expected.txt": _lines(sorted(f"./{f}" for f in files))}


def rename_env(rng: random.Random) -> tuple[Env, list[Task]]:
    exts = ["log", "txt", "csv"]
    names = rng.sample(WORDS, 8)
    files = [f"{n}.{exts[i % 3]}" for i, n in enumerate(names)]
    tasks = []
    for src in exts:
        own = [f for f in files if f.endswith(f".{src}")]
        rest = [f for f in files if f not in own]
        for dst in ("md", "bak", "old", *[e for e in exts if e != src]):
            check, extra = _listing_is(rest + [f"{f[: -len(src)]}{dst}" for f in own])
            tasks.append(Task("rename", f"In /app/files, rename every file ending in .{src} so that it ends in "
                                        f".{dst} instead.",
                              [f'cd /app/files && for f in *.{src}; do mv "$f" "${{f%.{src}}}.{dst}"; done'],
                              check, test_files=extra))
        for prefix in ("old_", "new_", "bak_"):
            check, extra = _listing_is(rest + [prefix + f for f in own])
            tasks.append(Task("rename", f"In /app/files, add the prefix `{prefix}` to the name of every .{src} file.",
                              [f'cd /app/files && for f in *.{src}; do mv "$f" "{prefix}$f"; done'],
                              check, test_files=extra))
        for sub in ("archive", "backup", src + "s"):
            check, extra = _listing_is(rest + [f"{sub}/{f}" for f in own])
            tasks.append(Task("rename", f"Move every .{src} file of /app/files into a new directory /app/files/{sub}.",
                              [f"mkdir -p /app/files/{sub}", f"mv /app/files/*.{src} /app/files/{sub}/"],
                              check, test_files=extra))
    return Env(DEBIAN, {f"files/{f}": (f"data of {f}\n", 0o644) for f in files}), tasks


# ---------------------------------------------------------------- transform
def _file_is(path: str, lines: list[str]) -> tuple[str, dict[str, str]]:
    return f'[ "$(cat {path})" = "$(cat /tests/expected.txt)" ]', {"expected.txt": _lines(lines)}


def transform_env(rng: random.Random) -> tuple[Env, list[Task]]:
    pool = rng.sample(WORDS, 8)
    words = [rng.choice(pool) for _ in range(rng.randint(10, 14))]
    people = [(rng.choice(WORDS), rng.choice(CITIES), str(rng.randint(18, 80))) for _ in range(rng.randint(5, 8))]
    csv = ["name,city,age", *(",".join(p) for p in people)]
    specs = [
        ("Write the lines of /app/words.txt, sorted alphabetically, to /app/sorted.txt.",
         ["sort /app/words.txt > /app/sorted.txt"], "/app/sorted.txt", sorted(words), "sort"),
        ("Write the distinct lines of /app/words.txt, sorted alphabetically, to /app/unique.txt.",
         ["sort -u /app/words.txt > /app/unique.txt"], "/app/unique.txt", sorted(set(words)), "uniq"),
        ("Write the lines of /app/words.txt in reverse alphabetical order to /app/reversed.txt.",
         ["sort -r /app/words.txt > /app/reversed.txt"], "/app/reversed.txt", sorted(words, reverse=True), "rsort"),
        ("Write the city column of /app/people.csv, without the header line, to /app/cities.txt.",
         ["tail -n +2 /app/people.csv | cut -d, -f2 > /app/cities.txt"], "/app/cities.txt",
         [p[1] for p in people], "cities"),
        ("Write the name column of /app/people.csv, without the header line, to /app/names.txt.",
         ["tail -n +2 /app/people.csv | cut -d, -f1 > /app/names.txt"], "/app/names.txt",
         [p[0] for p in people], "names"),
    ]
    for n in (3, 5):
        specs.append((f"Write the first {n} lines of /app/words.txt to /app/top.txt.",
                      [f"head -n {n} /app/words.txt > /app/top.txt"], "/app/top.txt", words[:n], f"head{n}"))
        specs.append((f"Write the last {n} lines of /app/words.txt to /app/bottom.txt.",
                      [f"tail -n {n} /app/words.txt > /app/bottom.txt"], "/app/bottom.txt", words[-n:], f"tail{n}"))
    for old in sorted(set(words))[:4]:
        new = rng.choice([w for w in WORDS if w not in words])
        specs.append((f"In /app/words.txt, replace every `{old}` with `{new}`.",
                      [f"sed -i 's/{old}/{new}/g' /app/words.txt"], "/app/words.txt",
                      [new if w == old else w for w in words], f"replace-{old}"))
    tasks = []
    for instruction, solution, path, want, key in specs:
        check, extra = _file_is(path, want)
        tasks.append(Task("transform", instruction, solution, check, test_files=extra))
    files = {"words.txt": (_lines(words), 0o644), "people.csv": (_lines(csv), 0o644)}
    return Env(DEBIAN, files), tasks


# ---------------------------------------------------------------- fs
def fs_env(rng: random.Random) -> tuple[Env, list[Task]]:
    script, report = rng.choice(["run", "deploy", "backup", "start"]), rng.choice(["report", "summary", "notes"])
    tmp, dat = rng.sample(WORDS, 3), rng.sample(WORDS, 2)
    files = {f"scripts/{script}.sh": ("#!/bin/sh\necho done\n", 0o644), f"data/{report}.txt": ("all good\n", 0o644),
             "releases/v1/VERSION": ("1\n", 0o644), "releases/v2/VERSION": ("2\n", 0o644)}
    files.update({f"cache/{w}.tmp": ("scratch\n", 0o644) for w in tmp})
    files.update({f"cache/{w}.dat": ("keep\n", 0o644) for w in dat})
    kept = " && ".join(f"[ -f /app/cache/{w}.dat ]" for w in dat)
    tasks = [
        Task("fs", f"Make the script /app/scripts/{script}.sh executable.", [f"chmod +x /app/scripts/{script}.sh"],
             f"[ -x /app/scripts/{script}.sh ]"),
        Task("fs", "Delete every file ending in .tmp in /app/cache, and nothing else.", ["rm /app/cache/*.tmp"],
             f'[ -z "$(find /app/cache -name \'*.tmp\')" ] && {kept}'),
        Task("fs", f"Copy /app/data/{report}.txt to /app/backup/{report}.txt.",
             ["mkdir -p /app/backup", f"cp /app/data/{report}.txt /app/backup/{report}.txt"],
             f"cmp -s /app/data/{report}.txt /app/backup/{report}.txt"),
        Task("fs", "Create a symbolic link /app/current that points to /app/releases/v2.",
             ["ln -s /app/releases/v2 /app/current"],
             '[ -L /app/current ] && [ "$(readlink -f /app/current)" = /app/releases/v2 ]'),
    ]
    for a, b in (("out", "reports"), ("build", "logs"), ("var", "run")):
        tasks.append(Task("fs", f"Create the directory /app/{a}/{b}.", [f"mkdir -p /app/{a}/{b}"],
                          f"[ -d /app/{a}/{b} ]"))
    for name, text in (("hello.txt", "hello world"), ("status.txt", "ready"), ("owner.txt", "agent")):
        tasks.append(Task("fs", f"Create /app/{name} containing the single line `{text}`.",
                          [f"echo '{text}' > /app/{name}"], f'[ "$(cat /app/{name})" = "{text}" ]'))
    return Env(DEBIAN, files), tasks


FAMILIES: dict[str, Callable[[random.Random, int], tuple[Env, list[Task]]]] = {
    "count": lambda rng, v: count_env(rng),
    "find": lambda rng, v: find_env(rng),
    "fixbug": fixbug_env,
    "config": lambda rng, v: config_env(rng),
    "rename": lambda rng, v: rename_env(rng),
    "transform": lambda rng, v: transform_env(rng),
    "fs": lambda rng, v: fs_env(rng),
}
SHARED_ENV = {"config"}  # one environment for every split: its tasks differ in what to write, not in files


# ---------------------------------------------------------------- writing
TASK_TOML = """\
version = "1.0"

[metadata]
author_name = "verl-agent examples/terminal_tasks/generate.py"
difficulty = "easy"
category = "{family}"
tags = ["terminal_tasks", "{family}", "{split}"]

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 180.0
user = "agent"

[environment]
build_timeout_sec = 300.0
cpus = 1
memory_mb = 512
storage_mb = 1024
allow_internet = false
"""


def _test_sh(task: Task, name: str) -> str:
    cond = task.check or "python3 /tests/test_task.py"
    return ("#!/bin/bash\n"
            f"# Verifier of {name}: reward 1 when the task is done, else 0.\n"
            "mkdir -p /logs/verifier\n"
            f"if {cond}; then\n  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def write_task(root: Path, name: str, split: str, task: Task, env: Env) -> None:
    _write(root / "instruction.md", task.instruction + "\n")
    _write(root / "task.toml", TASK_TOML.format(family=task.family, split=split))
    _write(root / "environment" / "Dockerfile", env.dockerfile())
    for rel, (text, mode) in env.files.items():
        _write(root / "environment" / "app" / rel, text, mode)
    _write(root / "tests" / "test.sh", _test_sh(task, name), 0o755)
    if task.test_py:
        _write(root / "tests" / "test_task.py", task.test_py)
    for rel, text in task.test_files.items():
        _write(root / "tests" / rel, text)
    _write(root / "solution" / "solve.sh", "#!/bin/bash\nset -e\n" + _lines(task.solution), 0o755)


def plan(seed: int = 0, train_per_family: int = 7, heldout_per_family: int = 3) -> list[dict]:
    """Every task of the suite, in order: name, split, family, variant, the Task and its Env.

    No instruction appears twice in the suite: a held-out task is never a training task with other files.
    """
    out = []
    for family, make in FAMILIES.items():
        seen: set[str] = set()
        for split, variants, count in (("train", TRAIN_VARIANTS, train_per_family),
                                       ("heldout", HELDOUT_VARIANTS, heldout_per_family)):
            pools = []
            for v in variants:
                env_v = 0 if family in SHARED_ENV else v
                env, tasks = make(random.Random(f"{seed}:{family}:env:{env_v}"), env_v)
                random.Random(f"{seed}:{family}:{split}:{v}").shuffle(tasks)
                pools.append([(env_v, env, t) for t in tasks])
            picked = []
            for i in range(max(map(len, pools))):  # round robin over the variants
                for pool in pools:
                    if i < len(pool) and pool[i][2].instruction not in seen and len(picked) < count:
                        seen.add(pool[i][2].instruction)
                        picked.append(pool[i])
            if len(picked) < count:
                raise ValueError(f"family {family!r} has only {len(picked)} distinct {split} tasks, {count} asked")
            out += [{"split": split, "family": family, "variant": v, "task": t, "env": env} for v, env, t in picked]
    for family in FAMILIES:
        for number, e in enumerate(e for e in out if e["family"] == family):
            e["name"] = f"{family}-{number:02d}"
    return out


def generate(out: Path = DEFAULT_OUT, seed: int = 0, train_per_family: int = 7, heldout_per_family: int = 3) -> dict:
    """Write the suite under out/train and out/heldout (replacing them) and out/manifest.json; returns the manifest."""
    out = Path(out)
    for split in ("train", "heldout"):
        if (out / split).exists():
            shutil.rmtree(out / split)
    entries = []
    for e in plan(seed, train_per_family, heldout_per_family):
        write_task(out / e["split"] / e["name"], e["name"], e["split"], e["task"], e["env"])
        entries.append({"name": e["name"], "path": f"{e['split']}/{e['name']}", "split": e["split"],
                        "family": e["family"], "variant": e["variant"], "base": e["env"].base,
                        "instruction": e["task"].instruction, "solution": e["task"].solution,
                        "tool_calls": e["task"].tool_calls()})
    manifest = {"seed": seed, "train": sum(e["split"] == "train" for e in entries),
                "heldout": sum(e["split"] == "heldout" for e in entries), "tasks": entries}
    _write(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-per-family", type=int, default=7)
    parser.add_argument("--heldout-per-family", type=int, default=3)
    args = parser.parse_args(argv)
    m = generate(args.out, args.seed, args.train_per_family, args.heldout_per_family)
    families = sorted({t["family"] for t in m["tasks"]})
    print(f"{m['train']} training and {m['heldout']} held-out tasks in {args.out} ({len(families)} families: "
          f"{', '.join(families)})")


if __name__ == "__main__":
    main()
