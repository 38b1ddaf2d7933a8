"""Tool YAML in verl's format: classes, functions, files, verl's own tool classes, and load-time errors."""

import sys
import textwrap

import pytest

from verl_agent.protocol import ToolCall
from verl_agent.tools import CalculatorTool, FunctionTool, ToolConfigError, ToolSession, load_tools

CALC = "verl_agent.tools.calculator.CalculatorTool"


def write(tmp_path, text, name="tools.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_verl_format_with_schema_and_native_config(tmp_path):
    p = write(
        tmp_path,
        f"""
        tools:
          - class_name: {CALC}
            config: {{type: native}}
            tool_schema:
              type: function
              function:
                name: calc
                description: Do arithmetic.
                parameters:
                  type: object
                  properties:
                    expression: {{type: string, description: "e.g. 1+2"}}
                  required: [expression]
        """,
    )
    tools = load_tools(p)
    assert list(tools) == ["calc"]
    assert isinstance(tools["calc"], CalculatorTool) and tools["calc"].config == {"type": "native"}
    assert tools["calc"].get_openai_tool_schema().to_openai()["function"]["description"] == "Do arithmetic."


async def test_functions_by_dotted_path_and_by_file(tmp_path, monkeypatch):
    (tmp_path / "mytools_mod.py").write_text(
        textwrap.dedent(
            '''
            from verl_agent.tools import tool

            @tool
            def shout(text: str) -> str:
                """Upper-case the text."""
                return text.upper()

            async def add(a: int, b: int = 1) -> int:
                """Add two integers."""
                return a + b
            '''
        )
    )
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "more.py").write_text('def echo(x: str) -> str:\n    """Echo x."""\n    return x\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    p = write(
        tmp_path,
        f"""
        tools:
          - class_name: mytools_mod.shout
            config: {{flavour: loud}}
          - class_name: mytools_mod.add
          - class_name: extra/more.py:echo
          - {{class_name: {CALC}}}
        """,
    )
    tools = load_tools(p)
    assert list(tools) == ["shout", "add", "echo", "calculator"]
    assert isinstance(tools["add"], FunctionTool) and tools["shout"].config == {"flavour": "loud"}
    async with ToolSession(tools, timeout=5) as s:
        assert (await s.call(ToolCall("shout", {"text": "hi"}))).text == "HI"
        assert (await s.call(ToolCall("add", {"a": 2}))).text == "3"
        assert (await s.call(ToolCall("echo", {"x": "yo"}))).text == "yo"
    sys.modules.pop("mytools_mod", None)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("tools:\n  - class_name: no_such_module.X\n", "tools[0] (no_such_module.X): cannot import 'no_such_module.X'"),
        (f"tools:\n  - class_name: {CALC}Nope\n", f"tools[0] ({CALC}Nope): cannot import"),
        ("tools:\n  - class_name: Calculator\n", "is not a dotted path"),
        ("tools:\n  - class_name: missing.py:f\n", "missing.py does not exist"),
        ("tools:\n  - config: {}\n", "tools[0]: 'class_name' is required"),
        ("tools:\n  - calculator\n", "tools[0]: expected a mapping"),
        (f"tools:\n  - class_name: {CALC}\n    schema: {{}}\n", "unknown key(s) ['schema']"),
        (f"tools:\n  - class_name: {CALC}\n    config: [1]\n", "'config' must be a mapping"),
        (
            f"tools:\n  - class_name: {CALC}\n  - class_name: {CALC}\n",
            "tools[1]: duplicate tool name 'calculator' (also defined by tools[0])",
        ),
        ("tools:\n  - class_name: verl_agent.tools.base.ToolResponse\n", "neither a BaseTool subclass nor a function"),
        ("tools: {calculator: 1}\n", "'tools' must be a list"),
        ("interaction: []\n", "expected a mapping with a list under 'tools'"),
        ("tools: [\n", "invalid YAML"),
        (
            f"tools:\n  - class_name: {CALC}\n    tool_schema: {{type: function, function: {{name: 'a b'}}}}\n",
            f"tools[0] ({CALC}): invalid tool_schema",
        ),
        (
            f"tools:\n  - class_name: {CALC}\n    tool_schema:\n      function:\n        name: c\n"
            "        parameters: {properties: {x: {type: text}}}\n",
            "unknown JSON Schema type 'text'",
        ),
        ("tools:\n  - class_name: verl_agent.tools.base.BaseTool\n", "no tool schema"),
    ],
)
def test_load_errors_name_file_and_entry(tmp_path, body, fragment):
    p = write(tmp_path, body)
    with pytest.raises(ToolConfigError) as e:
        load_tools(p)
    assert str(p) in str(e.value)
    assert fragment in str(e.value)


def test_a_tool_file_that_raises_is_named_every_time_and_a_refusing_constructor_too(tmp_path):
    """A file.py whose code raises gives the same error on every load (not a stale half-run module's
    'no attribute'); a tool constructor that refuses its config is wrapped naming the file and entry."""
    (tmp_path / "broken.py").write_text("import os\nKEY = os.environ['VERL_AGENT_NO_SUCH_VAR']\n")
    p = write(tmp_path, "tools:\n  - class_name: broken.py:Tool\n")
    for _ in range(2):
        with pytest.raises(ToolConfigError, match=r"tools\[0\] \(broken.py:Tool\): cannot import .*importing .*broken.py "
                           r"failed: KeyError: 'VERL_AGENT_NO_SUCH_VAR'"):
            load_tools(p)
    (tmp_path / "picky.py").write_text(
        "from verl_agent.tools import CalculatorTool\n"
        "class Picky(CalculatorTool):\n"
        "    def __init__(self, config, tool_schema=None):\n"
        "        raise ValueError('config.url is required')\n")
    p = write(tmp_path, "tools:\n  - class_name: picky.py:Picky\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \(picky.py:Picky\): cannot build the tool: "
                       r"ValueError: config.url is required"):
        load_tools(p)


def test_missing_file_and_empty_inputs(tmp_path):
    with pytest.raises(ToolConfigError, match="cannot read"):
        load_tools(tmp_path / "nope.yaml")
    assert load_tools(None) == {} and load_tools("") == {}
    assert load_tools(write(tmp_path, "")) == {}
    assert load_tools(write(tmp_path, "tools: []\n")) == {}


VERL_BASE = '''
"""Stand-in for verl.tools.base_tool (verl itself is not installed here): same names and lifecycle."""
import uuid
from pydantic import BaseModel

class OpenAIFunctionPropertySchema(BaseModel):
    type: str
    description: str | None = None

class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]

class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema

class OpenAIFunctionToolSchema(BaseModel):
    type: str
    function: OpenAIFunctionSchema

class ToolResponse(BaseModel):
    text: str | None = None

class BaseTool:
    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
    def get_openai_tool_schema(self):
        return self.tool_schema
    async def create(self, instance_id=None, **kwargs):
        return (instance_id or str(uuid.uuid4())), ToolResponse()
'''

VERL_GSM8K = """
from verl.tools.base_tool import BaseTool, OpenAIFunctionToolSchema, ToolResponse

class Gsm8kTool(BaseTool):
    def __init__(self, config, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._d = {}
    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        iid, _ = await super().create(instance_id)
        self._d[iid] = {"gt": ground_truth, "reward": 0.0}
        return iid, ToolResponse()
    async def execute(self, instance_id, parameters, **kwargs):
        ok = str(parameters.get("answer")) == self._d[instance_id]["gt"]
        self._d[instance_id]["reward"] = 1.0 if ok else 0.0
        return ToolResponse(text=f"Current parsed answer={parameters.get('answer')!r}"), None, {}
    async def calc_reward(self, instance_id, **kwargs):
        return self._d[instance_id]["reward"]
    async def release(self, instance_id, **kwargs):
        del self._d[instance_id]
"""


async def test_a_tool_built_on_verls_base_tool_loads(tmp_path, monkeypatch):
    """verl is not installed here: a stand-in package with verl's module paths and BaseTool API plays it.

    The user's own tool subclasses verl's BaseTool (verl's built-in class paths map to ours instead:
    tests/tools/test_verl_aliases.py)."""
    pkg = tmp_path / "verl" / "tools"
    pkg.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "base_tool.py").write_text(VERL_BASE)
    (tmp_path / "my_verl_tools.py").write_text(VERL_GSM8K)
    monkeypatch.syspath_prepend(str(tmp_path))
    p = write(
        tmp_path,
        """
        tools:
          - class_name: "my_verl_tools.Gsm8kTool"
            config:
              type: native
            tool_schema:
              type: "function"
              function:
                name: "calc_gsm8k_reward"
                description: "A tool for calculating the reward of gsm8k."
                parameters:
                  type: "object"
                  properties:
                    answer:
                      type: "string"
                      description: "The model's answer to the GSM8K math problem, must be a digits"
                  required: ["answer"]
        """,
    )
    try:
        tools = load_tools(p)
        tool = tools["calc_gsm8k_reward"]
        kw = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
        async with ToolSession(tools, kw, timeout=5) as s:
            r = await s.call(ToolCall("calc_gsm8k_reward", {"answer": "72"}))
            assert (r.ok, r.text, r.reward) == (True, "Current parsed answer='72'", 0.0)
            assert await s.calc_reward() == 1.0
        assert tool.inner._d == {}
    finally:
        for m in [m for m in sys.modules if m in ("verl", "my_verl_tools") or m.startswith("verl.")]:
            del sys.modules[m]
