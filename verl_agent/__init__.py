"""verl-agent: train LLM agents with multi-turn reinforcement learning."""

__version__ = "0.1.0"
