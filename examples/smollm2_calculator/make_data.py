"""Write the calculator problems for SmolLM2 (verl row format) with a system prompt that shows one tool call.

SmolLM2-135M-Instruct was never trained on tool calls: with only the template's tool list it answers from
"mental math" and never calls the calculator (greedy, 6 of 6 held-out problems). One worked call in the
system prompt makes the format reachable by sampling; RL then has to learn when and how to use it.
"""

import argparse
from pathlib import Path

from verl_agent.models.calculator_task import write_calculator_data

SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. Never do arithmetic in your head: call the calculator "
    "with the whole expression, exactly like this:\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 37 + 5"}}\n</tool_call>\n'
    "When the result comes back, reply: The answer is <result>."
)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--n-train", type=int, default=2048)
    ap.add_argument("--n-test", type=int, default=256)
    a = ap.parse_args()
    train, test = write_calculator_data(a.out, a.n_train, a.n_test, seed=0, fmt="verl", system_prompt=SYSTEM_PROMPT)
    print(f"wrote {train} and {test}")
