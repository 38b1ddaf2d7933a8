"""Files shaped exactly like verl's: its example tool / interaction YAMLs, its GSM8K parquet rows, a retrieval server.

The YAML texts repeat verl's examples/sglang_multiturn/config/{tool,interaction}_config/*.yaml
(volcengine/verl at b178a3c) key for key and value for value, only the service URLs point at
loopback. The parquet rows have the columns and nesting that verl's
examples/data_preprocess/gsm8k_multiturn_w_tool.py / _w_interaction.py write (through Arrow,
as HF datasets does: nested dicts become struct columns), on a few made-up GSM8K-style problems
(no dataset can be downloaded here).
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]

GSM8K_TOOL_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config: 
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

SANDBOX_TOOL_YAML = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config: 
      sandbox_fusion_url: "{url}/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native

    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]"""

# verl's file spells the array's element schema `item:` (not JSON Schema's `items`); kept as is.
SEARCH_TOOL_YAML = """\
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}/retrieve
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries. The tool will return search results for each query.
          required: 
            - query_list"""

MCP_TOOL_YAML = """\
tools:
  - class_name: verl.tools.mcp_search_tool.MCPSearchTool
    config:
      rate_limit: 120
      timeout: 120
      type: mcp
    mcp:
      mcp_servers_config_path: ./mcp_server.json
      # optional
      tool_selected_list: 
        - tavily_search_tool"""

GSM8K_INTERACTION_YAML = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}"""

INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
               "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after step "
               "by step solving the question, before generate final answer at least once and refine your answer if "
               "necessary. Put your final answer in the format of `#### <answer>`.")
INTERACTION_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                      "You should rethinking carefully if user point out your answer is wrong. "
                      "Put your final answer in the format of `#### <answer>`.")
PROBLEMS = [  # (question, worked answer as in GSM8K's `answer` column)
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 6 pens. How many pens are in 12 boxes?", "6 * 12 = 72\n#### 72"),
    ("Ann had 1,500 dollars and spent 300. How many dollars are left?", "1500 - 300 = 1200\n#### 1,200"),
    ("A class of 30 splits into teams of 5. How many teams are there?", "30 / 5 = 6\n#### 6"),
]


def solution(answer_raw: str) -> str:
    """The ground truth verl's preprocessing extracts: the text after '#### ', commas removed."""
    return answer_raw.split("#### ")[1].replace(",", "")


def gsm8k_rows(kind: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows as verl's gsm8k_multiturn_w_tool.py (kind "tool") or _w_interaction.py ("interaction") makes them."""
    rows = []
    for idx, (question_raw, answer_raw) in enumerate(PROBLEMS):
        question, truth = f"{question_raw} {INSTRUCTION}", solution(answer_raw)
        extra: dict[str, Any] = {"split": split, "index": idx, "answer": answer_raw, "question": question_raw}
        if kind == "tool":
            extra.update(need_tools_kwargs=True,
                         tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                         interaction_kwargs={"query": question, "ground_truth": truth})
        else:
            extra["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": truth}
        system = TOOL_SYSTEM if kind == "tool" else INTERACTION_SYSTEM
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra})
    return rows


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows to parquet through Arrow, as HF datasets' to_parquet writes verl's files: nested dicts become structs."""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


VERL_REWARD_PY = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style scorer (verl's gsm8k strict rule): 1.0 for the right '#### n', 0.0 otherwise."""
    assert data_source == "openai/gsm8k" and extra_info["split"] in ("train", "test"), (data_source, extra_info)
    found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str[-300:])
    return 1.0 if found and found[-1].replace(",", "") == ground_truth else 0.0
'''


class RetrievalServer:
    """examples/search_agent's retrieval server (verl's /retrieve API) under uvicorn on a free loopback port."""

    def __init__(self, app: Any):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RetrievalServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"retrieval server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def write(tmp_path: Path, name: str, text: str, url: str = "") -> Path:
    """`text` (a verl file's content) written to tmp_path/name, with "{url}" replaced by `url`."""
    path = tmp_path / name
    path.write_text(text.replace("{url}", url))
    return path


def load_repo_module(rel: str) -> ModuleType:
    """A module of this repository by path (examples and tests/examples are not packages)."""
    path = REPO / rel
    spec = importlib.util.spec_from_file_location(f"verl_dropin_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
