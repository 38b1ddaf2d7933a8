"""TaskInteraction: a Harbor task as a BaseInteraction, for models that write commands as text.

    interaction:
      - name: harbor
        class_name: verl_agent.tasks.interaction.TaskInteraction
        config: {timeout: 60, max_output_chars: 16000}

Each assistant reply's first fenced ```bash (or ```sh) block runs in the trajectory's persistent shell
and its output (with the exit code) is the next user message; a reply with no block ends the episode
(the agent is done), as do the task's agent time limit and the turn limits. The score is the task's
test result (grading after the episode, as with the tools). The dataset row's ``interaction_kwargs``
carry ``task_dir`` (a task folder in data.train_files gives it). Use this or the container tools for a
dataset, not both: each starts its own container. A failure of the container or the verifier ends the
trajectory as an infrastructure failure with its cause (``container_dead``, ``verifier_error``, ...).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from verl_agent.interactions.base import BaseInteraction, last_assistant_text
from verl_agent.tasks.env import POOL_KEYS, attach, detach, get_env
from verl_agent.tasks.tools import format_result

__all__ = ["TaskInteraction", "first_command"]

_BLOCK = re.compile(r"```(?:bash|sh|shell)\s*\n(.*?)```", re.DOTALL)
INTRO = ("You are in a Linux container. To run a command, reply with one ```bash block; its output comes back. "
         "Reply without a block when the task is done.")


def first_command(text: str) -> str | None:
    m = _BLOCK.search(text)
    return m.group(1).strip() if m else None


class TaskInteraction(BaseInteraction):
    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        unknown = set(self.config) - {"name", "timeout", "intro", *POOL_KEYS}
        if unknown:
            raise ValueError(f"TaskInteraction: unknown config key(s) {sorted(unknown)}")
        self.timeout = float(self.config.get("timeout", 60))
        self.intro = self.config.get("intro", INTRO)
        self.pool_options = {k: self.config[k] for k in POOL_KEYS if k in self.config}

    async def start_interaction(self, instance_id: str | None = None, task_dir: str | None = None,
                                **kwargs: Any) -> str:  # fmt: skip
        if not task_dir:
            raise ValueError("TaskInteraction: interaction_kwargs has no task_dir (load Harbor tasks as data)")
        iid = instance_id or str(uuid.uuid4())
        self.instances[iid] = {"commands": 0}
        await attach(iid, task_dir, **self.pool_options)
        return iid

    async def initial_observation(self, instance_id: str) -> str | None:
        return self.intro or None

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:  # fmt: skip
        env = get_env(instance_id)
        command = first_command(last_assistant_text(messages))
        refused = env.refusal()
        if command is None or refused:
            env.submitted = True
            return True, refused or "", 0.0, {}
        res = await env.run(command, self.timeout)  # ContainerError: an infrastructure failure
        self.instances[instance_id]["commands"] += 1
        return False, format_result(res), 0.0, {"exit_code": res.exit_code}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return (await get_env(instance_id).grade()).reward

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.instances.pop(instance_id, None)
        await detach(instance_id)
