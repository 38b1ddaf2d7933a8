"""verl's own tool and interaction YAML files load unchanged: built-in class paths map to ours, the rest is refused."""

from __future__ import annotations

import sys

import pytest
from verl_files import GSM8K_INTERACTION_YAML, GSM8K_TOOL_YAML, MCP_TOOL_YAML, SANDBOX_TOOL_YAML, SEARCH_TOOL_YAML
from verl_files import write

from verl_agent.interactions import InteractionConfigError, load_interactions
from verl_agent.interactions.gsm8k import Gsm8kInteraction
from verl_agent.tools import ToolConfigError, load_tools
from verl_agent.tools.gsm8k import Gsm8kTool
from verl_agent.tools.retrieval import RetrievalSearchTool
from verl_agent.tools.sandbox_fusion import SandboxFusionTool


def test_verl_is_not_installed_here():
    """The aliases are what make these files load: there is no verl to import."""
    import importlib.util

    assert importlib.util.find_spec("verl") is None


def test_verls_tool_yamls_load_as_our_tools(tmp_path):
    gsm8k = load_tools(write(tmp_path, "gsm8k.yaml", GSM8K_TOOL_YAML))["calc_gsm8k_reward"]
    assert type(gsm8k) is Gsm8kTool and gsm8k.config == {"type": "native"}
    assert gsm8k.get_openai_tool_schema().function.parameters.required == ["answer"]

    sandbox = load_tools(write(tmp_path, "sb.yaml", SANDBOX_TOOL_YAML, "http://127.0.0.1:9"))["code_interpreter"]
    assert type(sandbox) is SandboxFusionTool
    assert (sandbox.url, sandbox.timeout, sandbox.language, sandbox.memory_mb) == ("http://127.0.0.1:9", 30.0,
                                                                                    "python", 1024)
    assert sandbox.client.limits.max_concurrency == 10  # min(num_workers, rate_limit)

    search = load_tools(write(tmp_path, "search.yaml", SEARCH_TOOL_YAML, "http://127.0.0.1:9"))["search"]
    assert type(search) is RetrievalSearchTool
    assert (search.url, search.topk, search.timeout) == ("http://127.0.0.1:9/retrieve", 3, 30.0)
    assert search._slots._value == 120
    # verl's file writes `item:` for the array's element schema; it is kept (and shown to the model) as written
    prop = search.get_openai_tool_schema().function.parameters.properties["query_list"]
    assert prop.type == "array" and prop.to_dict()["item"] == {"type": "string"}


def test_verls_interaction_yaml_loads_as_ours(tmp_path):
    inters = load_interactions(write(tmp_path, "inter.yaml", GSM8K_INTERACTION_YAML))
    assert list(inters) == ["gsm8k"] and type(inters["gsm8k"]) is Gsm8kInteraction
    assert inters["gsm8k"].config == {"name": "gsm8k"}
    unnamed = write(tmp_path, "unnamed.yaml", "interaction:\n  - class_name: verl.interactions.gsm8k_interaction."
                                              "Gsm8kInteraction\n")
    assert list(load_interactions(unnamed)) == ["gsm8k"]  # verl's default name: class name minus "Interaction"


def test_rate_limit_counts_only_with_enable_global_rate_limit(tmp_path):
    text = SANDBOX_TOOL_YAML.replace("enable_global_rate_limit: true", "enable_global_rate_limit: false")
    text = text.replace("num_workers: 10", "num_workers: 4").replace("rate_limit: 10", "rate_limit: 2")
    tool = load_tools(write(tmp_path, "sb.yaml", text, "http://127.0.0.1:9"))["code_interpreter"]
    assert tool.client.limits.max_concurrency == 4
    tool = load_tools(write(tmp_path, "sb2.yaml", text.replace("false", "true"), "http://127.0.0.1:9"))
    assert tool["code_interpreter"].client.limits.max_concurrency == 2


@pytest.mark.parametrize("class_name, fragment", [
    ("verl.tools.image_zoom_in_tool.ImageZoomInTool", "image tools"),
    ("verl.tools.geo3k_tool.Geo3kTool", "geo3k"),
])
def test_verl_tools_without_an_equivalent_are_refused_by_name_and_file(tmp_path, class_name, fragment):
    text = GSM8K_TOOL_YAML.replace("verl.tools.gsm8k_tool.Gsm8kTool", class_name)
    path = write(tmp_path, "tool_config.yaml", text)
    with pytest.raises(ToolConfigError) as err:
        load_tools(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: tools[0] ({class_name}): {class_name} is not supported yet")
    assert fragment in msg and "verl.tools.search_tool.SearchTool" in msg  # what does load


def test_unknown_verl_paths_and_mcp_entries_are_refused(tmp_path):
    path = write(tmp_path, "t.yaml", GSM8K_TOOL_YAML.replace("gsm8k_tool.Gsm8kTool", "new_tool.NewTool"))
    with pytest.raises(ToolConfigError, match=r"t.yaml: tools\[0\] \(verl.tools.new_tool.NewTool\): .* verl is not "
                                              r"installed; verl-agent has no equivalent for it yet"):
        load_tools(path)
    ours = "verl_agent.tools.gsm8k.Gsm8kTool"
    mcp = write(tmp_path, "m.yaml", MCP_TOOL_YAML.replace("verl.tools.mcp_search_tool.MCPSearchTool", ours))
    with pytest.raises(ToolConfigError, match=r"m.yaml: tools\[0\] .*config.type: mcp needs an MCP tool class"):
        load_tools(mcp)
    odd = write(tmp_path, "o.yaml", GSM8K_TOOL_YAML.replace("type: native", "type: remote"))
    with pytest.raises(ToolConfigError, match=r"o.yaml: tools\[0\] .*config.type must be 'native' or 'mcp'.*'remote'"):
        load_tools(odd)
    weather = write(tmp_path, "i.yaml", GSM8K_INTERACTION_YAML.replace("gsm8k_interaction.Gsm8kInteraction",
                                                                       "weather_interaction.WeatherInteraction"))
    with pytest.raises(InteractionConfigError, match=r"i.yaml: interaction\[0\] .*WeatherInteraction is not "
                                                     r"supported yet.*gsm8k_interaction.Gsm8kInteraction"):
        load_interactions(weather)


def test_aliases_win_over_an_installed_verl(tmp_path, monkeypatch):
    """With a `verl` package importable, verl's built-in paths still give ours; other verl paths import verl's."""
    pkg = tmp_path / "verl" / "interactions"
    pkg.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "gsm8k_interaction.py").write_text("raise ImportError('verl itself must not be imported')\n")
    (pkg / "echo.py").write_text(
        "class EchoInteraction:\n"
        "    def __init__(self, config): self.config = config\n"
        "    async def start_interaction(self, instance_id=None, **kw): return instance_id\n"
        "    async def generate_response(self, instance_id, messages, **kw): return True, '', 0.0, {}\n"
        "    async def calculate_score(self, instance_id, **kw): return 0.0\n"
        "    async def finalize_interaction(self, instance_id, **kw): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        text = GSM8K_INTERACTION_YAML + "\n  - class_name: verl.interactions.echo.EchoInteraction\n"
        inters = load_interactions(write(tmp_path, "i.yaml", text))
        assert type(inters["gsm8k"]) is Gsm8kInteraction and type(inters["echo"]).__name__ == "EchoInteraction"
    finally:
        for m in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[m]
