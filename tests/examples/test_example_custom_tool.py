"""examples/custom_tool: a @tool function and a BaseTool subclass from the example folder, via YAML.

The tiny model runs the example for real (plumbing: it does not know these tools). A scripted
engine stands in for a model that uses them (none can be downloaded here), so the whole lifecycle
with per-sample tools_kwargs is asserted: create (stock) -> execute (prices, cart) -> calc_reward
(order) -> release.
"""

from __future__ import annotations

import json

from example_helpers import EXAMPLES, assert_data_reproducible, example_config, rollout, scripted_engine, tool_call
from example_helpers import val_samples

from verl_agent.tools import FunctionTool, check_tool, load_tools

NAME = "custom_tool"


def test_make_data_reproduces_shipped_files(tmp_path):
    assert_data_reproducible(NAME, tmp_path)


def test_tools_load_from_yaml_with_schemas():
    tools = load_tools(EXAMPLES / NAME / "tools.yaml")
    assert set(tools) == {"price_of", "add_to_cart"} and isinstance(tools["price_of"], FunctionTool)
    params = tools["price_of"].get_openai_tool_schema().to_openai()["function"]["parameters"]
    assert params["required"] == ["item"] and "prices" not in params["properties"]  # hidden from the model
    check_tool(tools["add_to_cart"], {"item": "apple", "quantity": 1})


async def test_tiny_model_runs_with_the_tools(tiny_engine, tiny_tok, tiny_model_path):
    cfg = example_config(NAME, "data.max_response_length=96", model_path=tiny_model_path)
    batch, loop = await rollout(cfg, tiny_engine, tiny_tok, val_samples(cfg, 2), n=2)
    assert len(batch) == 4
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        assert '"name": "add_to_cart"' in tiny_tok.decode(traj.prompt_ids)  # both schemas are in the prompt
        assert 0.0 <= traj.reward <= 1.0
    assert loop.tools["add_to_cart"].carts == {}  # release ran for every trajectory


def _shopper(text: str, k: int) -> str:
    """Check two prices in one turn, then fill the cart from the request, then answer."""
    request = text.split("Please buy ", 1)[1].split(", then", 1)[0]
    lines = [part.split(" ", 1) for part in request.split(" and ")]
    if k == 0:
        return "\n".join(tool_call("price_of", json.dumps({"item": item})) for _, item in lines)
    if k <= len(lines):
        n, item = lines[k - 1]
        return tool_call("add_to_cart", json.dumps({"item": item, "quantity": int(n)}))
    return "Done: everything is in the cart."


async def test_full_lifecycle_with_per_sample_kwargs(tiny_tok, tiny_model_path):
    cfg = example_config(NAME, model_path=tiny_model_path)
    samples = val_samples(cfg, 4)
    batch, loop = await rollout(cfg, scripted_engine(tiny_tok, _shopper), tiny_tok, samples)
    for traj, sample in zip(batch.trajectories, samples):
        assert traj.error is None and traj.stop_reason == "end_of_turn"
        order = sample.tools_kwargs["add_to_cart"]["calc_reward_kwargs"]["order"]
        prices = sample.tools_kwargs["price_of"]["execute_kwargs"]["prices"]
        tool_texts = [m.content for m in traj.messages if m.role == "tool"]
        for i, item in enumerate(order):  # execute_kwargs reached the @tool's hidden parameter
            assert tool_texts[i].endswith(f"${prices[item]:.2f} each")
        assert tool_texts[-1].startswith("Added") and traj.turns[0].num_tool_calls == len(order)
        assert traj.reward == 1.0  # calc_reward against this row's order
    assert loop.tools["add_to_cart"].carts == {}
    # Ask for more than the row's stock (create_kwargs) and for the wrong item: the reward drops.
    sample = samples[0]
    item = next(iter(sample.tools_kwargs["add_to_cart"]["calc_reward_kwargs"]["order"]))
    stock = sample.tools_kwargs["add_to_cart"]["create_kwargs"]["stock"][item]
    greedy = [tool_call("add_to_cart", json.dumps({"item": item, "quantity": stock + 1})), "Sorry."]
    batch, _ = await rollout(cfg, scripted_engine(tiny_tok, greedy), tiny_tok, [sample])
    traj = batch.trajectories[0]
    assert traj.messages[-2].content == f"Only {stock} {item} left in stock." and traj.reward == 0.0
