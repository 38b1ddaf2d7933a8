"""Interaction YAML in verl's format, selection by interaction_kwargs.name, load-time errors."""

import sys
import textwrap

import pytest

from verl_agent.interactions import (
    GymInteraction,
    InteractionConfigError,
    MathFeedbackInteraction,
    load_interactions,
    select_interaction,
)

MATH = "verl_agent.interactions.math_feedback.MathFeedbackInteraction"
GUESS = "verl_agent.interactions.guess_number.GuessNumberEnv"


def write(tmp_path, text):
    p = tmp_path / "interaction.yaml"
    p.write_text(textwrap.dedent(text))
    return p


async def test_load_and_select(tmp_path):
    p = write(
        tmp_path,
        f"""
        interaction:
          - name: math
            class_name: {MATH}
            config: {{max_turns: 4}}
          - name: guess
            class_name: {GUESS}
            config: {{env_kwargs: {{high: 10}}, score: last}}
          - class_name: verl_agent.interactions.gym.GymInteraction
            config: {{name: guess_by_id, env_id: verl_agent/GuessNumber-v0}}
        """,
    )
    inters = load_interactions(p)
    assert list(inters) == ["math", "guess", "guess_by_id"]
    assert isinstance(inters["math"], MathFeedbackInteraction) and inters["math"].max_turns == 4
    guess = inters["guess"]
    assert isinstance(guess, GymInteraction) and guess.score_mode == "last" and guess.make_env().high == 10
    assert select_interaction(inters, {"name": "guess", "seed": 1}) is guess
    assert select_interaction(inters, {}) is None and select_interaction(inters, None) is None
    with pytest.raises(
        InteractionConfigError, match="'nope' is not registered; known: \\['guess', 'guess_by_id', 'math'\\]"
    ):
        select_interaction(inters, {"name": "nope"})
    with pytest.raises(InteractionConfigError, match="has no 'name'"):
        select_interaction(inters, {"ground_truth": "1"})
    assert select_interaction({"math": inters["math"]}, {"ground_truth": "1"}) is inters["math"]


def test_default_name_follows_verl(tmp_path, monkeypatch):
    (tmp_path / "my_inter.py").write_text(
        "class Gsm8kInteraction:\n"
        "    def __init__(self, config): self.config = config\n"
        "    async def start_interaction(self, instance_id=None, **kw): return instance_id\n"
        "    async def generate_response(self, instance_id, messages, **kw): return True, '', 0.0, {}\n"
        "    async def calculate_score(self, instance_id, **kw): return 0.0\n"
        "    async def finalize_interaction(self, instance_id, **kw): pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    p = write(
        tmp_path,
        "interaction:\n  - class_name: my_inter.Gsm8kInteraction\n"
        "  - class_name: my_inter.py:Gsm8kInteraction\n    name: file\n",
    )
    inters = load_interactions(p)
    assert list(inters) == ["gsm8k", "file"] and inters["gsm8k"].config == {"name": "gsm8k"}
    sys.modules.pop("my_inter", None)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("interaction:\n  - class_name: nope.Missing\n", "interaction[0] (nope.Missing): cannot import"),
        ("interaction:\n  - name: x\n", "interaction[0]: 'class_name' is required"),
        ("interaction:\n  - math\n", "expected a mapping"),
        (f"interaction:\n  - class_name: {MATH}\n    kwargs: {{}}\n", "unknown key(s) ['kwargs']"),
        (f"interaction:\n  - class_name: {MATH}\n    config: 3\n", "'config' must be a mapping"),
        (
            f"interaction:\n  - {{name: a, class_name: {MATH}}}\n  - {{name: a, class_name: {GUESS}}}\n",
            "interaction[1]: duplicate interaction name 'a' (also defined by interaction[0])",
        ),
        (f"interaction:\n  - class_name: {MATH}\n    config: {{max_turns: 0}}\n", "cannot build the interaction: "),
        ("interaction:\n  - class_name: verl_agent.interactions.base.last_assistant_text\n", "is not a class"),
        (
            "interaction:\n  - class_name: verl_agent.interactions.errors.InteractionError\n",
            "neither a BaseInteraction",
        ),
        ("interaction: {a: 1}\n", "'interaction' must be a list"),
        ("tools: []\n", "expected a mapping with a list under 'interaction'"),
        ("interaction: [\n", "invalid YAML"),
    ],
)
def test_load_errors_name_file_and_entry(tmp_path, body, fragment):
    p = write(tmp_path, body)
    with pytest.raises(InteractionConfigError) as e:
        load_interactions(p)
    assert str(p) in str(e.value) and fragment in str(e.value)


def test_missing_and_empty(tmp_path):
    with pytest.raises(InteractionConfigError, match="cannot read"):
        load_interactions(tmp_path / "nope.yaml")
    assert load_interactions(None) == {} and load_interactions(write(tmp_path, "")) == {}
