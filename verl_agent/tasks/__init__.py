"""Harbor-format tasks in containers: tasks as data, offline images, one container per trajectory
from a warm pool, a persistent bash and a file editor as tools, and rewards from the task's tests.

    (verl_agent/data/harbor.py reads a task directory as data: task.toml, instruction.md, folders, JSONL rows)
    image.py     build environment/Dockerfile offline, once per content hash (Docker), or find its rootfs (bwrap)
    export.py    task image bundles for hosts without Docker: export where Docker runs, import elsewhere
    pool.py      ContainerPool: warm containers per image from a container runtime (verl_agent.containers)
    shell.py     Shell: one persistent bash over the one stream the runtime opened
    grading.py   after the episode: every agent process gone, tamper and disk checks, test.sh, the reward
    env.py       TaskEnvironment: one trajectory's container shared by its tools
    tools.py     bash, str_replace_editor, submit (tool YAML)
    editor.py    the editor's operations
    interaction.py TaskInteraction: the same world for a BaseInteraction (commands in ```bash blocks)
    runner.py    run one task with the oracle, nop or a model agent; check a folder
    ray_pool.py  one pool actor per Ray node, placed by node affinity
    cli.py       `verl-agent tasks run | check | build-bases | reap | export | import`
    bases.py     the offline base images (debian:bookworm-slim, python:3.12-slim stand-ins)
"""

from verl_agent.data.harbor import HarborTask, TaskConfig, TaskError, find_tasks, load_task

__all__ = ["HarborTask", "TaskConfig", "TaskError", "find_tasks", "load_task"]
