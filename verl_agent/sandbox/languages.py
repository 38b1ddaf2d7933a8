"""How each language is compiled and run inside the sandbox: a source file name and argv lists.

Paths are Debian's (the runner image and the process backend both use the host's /usr): sandboxed
programs run as a non-root user, so they must not depend on an interpreter in root's home.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LANGUAGES", "Language", "available_languages"]


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # file name the code is written to, relative to the work dir
    run: list[str]
    compile: list[str] | None = None
    needs: list[str] = field(default_factory=list)  # absolute paths that must exist for the language to work
    address_limit: bool = True  # False where RLIMIT_AS breaks the runtime (V8 reserves huge address space)


LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in [
        Language("python", "main.py", ["/usr/bin/python3", "-u", "main.py"], needs=["/usr/bin/python3"]),
        Language("python3", "main.py", ["/usr/bin/python3", "-u", "main.py"], needs=["/usr/bin/python3"]),
        Language("bash", "main.sh", ["/bin/bash", "main.sh"], needs=["/bin/bash"]),
        Language("sh", "main.sh", ["/bin/sh", "main.sh"], needs=["/bin/sh"]),
        Language(
            "cpp", "main.cpp", ["./main"], compile=["/usr/bin/g++", "-O2", "-std=c++17", "-o", "main", "main.cpp"],
            needs=["/usr/bin/g++"], address_limit=True,
        ),
        Language("c", "main.c", ["./main"], compile=["/usr/bin/gcc", "-O2", "-o", "main", "main.c", "-lm"],
                 needs=["/usr/bin/gcc"]),
        Language("nodejs", "main.js", ["/usr/bin/node", "main.js"], needs=["/usr/bin/node"], address_limit=False),
    ]
}


def available_languages(root_has: Callable[[str], object] = shutil.which) -> list[str]:
    """Languages whose tools exist on this host (what the process backend can run)."""
    return [name for name, lang in LANGUAGES.items() if all(root_has(p) for p in lang.needs)]
