"""verl's built-in tool and interaction class paths, mapped to ours so verl's YAML files load unchanged.

verl-agent never imports verl. A tool or interaction YAML written for verl names classes such as
``verl.tools.sandbox_fusion_tools.SandboxFusionTool``; the registries ask `resolve_verl_class` first:

* a path in ``TOOL_ALIASES`` / ``INTERACTION_ALIASES`` becomes our equivalent (same ``config`` keys,
  same tool schema and reward semantics), also when verl happens to be installed: verl's own
  classes run their work on Ray actors of verl's rollout, which verl-agent does not start;
* a path in ``UNSUPPORTED`` (image tools, ...) raises `VerlNotSupported`;
* any other ``verl.*`` path is imported as is when verl is installed (a tool built on verl's
  BaseTool is adapted), and raises `VerlNotSupported` when it is not.

Nothing here imports anything of ours: the registries add the file and entry to the message.
"""

from __future__ import annotations

import importlib.util

__all__ = ["INTERACTION_ALIASES", "TOOL_ALIASES", "UNSUPPORTED", "VerlNotSupported", "resolve_verl_class"]

TOOL_ALIASES: dict[str, str] = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "verl_agent.tools.sandbox_fusion.SandboxFusionTool",
    "verl.tools.search_tool.SearchTool": "verl_agent.tools.retrieval.RetrievalSearchTool",
    "verl.tools.gsm8k_tool.Gsm8kTool": "verl_agent.tools.gsm8k.Gsm8kTool",
    "verl.tools.mcp_base_tool.MCPBaseTool": "verl_agent.tools.mcp.MCPTool",
    "verl.tools.mcp_search_tool.MCPSearchTool": "verl_agent.tools.mcp.MCPSearchTool",
}
INTERACTION_ALIASES: dict[str, str] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "verl_agent.interactions.gsm8k.Gsm8kInteraction",
}
# verl classes with no equivalent yet, and what they would need.
UNSUPPORTED: dict[str, str] = {
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": "image tools (multi-modal tool responses)",
    "verl.tools.geo3k_tool.Geo3kTool": "the geo3k tool (a multi-modal geometry dataset)",
    "verl.interactions.weather_interaction.WeatherInteraction": "verl's weather demo interaction",
}


class VerlNotSupported(ValueError):
    """A verl class path that verl-agent has no equivalent for (yet)."""


def _supported(kind: str) -> str:
    aliases = TOOL_ALIASES if kind == "tool" else INTERACTION_ALIASES
    return ", ".join(sorted(aliases))


def resolve_verl_class(class_name: str, kind: str) -> str:
    """The class path to import for `class_name` (kind "tool" or "interaction"); raises VerlNotSupported."""
    if not (class_name == "verl" or class_name.startswith("verl.")):
        return class_name
    aliases = TOOL_ALIASES if kind == "tool" else INTERACTION_ALIASES
    if class_name in aliases:
        return aliases[class_name]
    if class_name in UNSUPPORTED:
        raise VerlNotSupported(
            f"{class_name} is not supported yet by verl-agent: {UNSUPPORTED[class_name]}; "
            f"verl {kind}s that load unchanged: {_supported(kind)}"
        )
    if importlib.util.find_spec("verl") is None:
        raise VerlNotSupported(
            f"{class_name} is a verl class and verl is not installed; verl-agent has no equivalent for it yet "
            f"(verl {kind}s that load unchanged: {_supported(kind)}). Install verl to use verl's own class, "
            f"or write a verl_agent BaseTool/BaseInteraction (docs/extending.md)"
        )
    return class_name
