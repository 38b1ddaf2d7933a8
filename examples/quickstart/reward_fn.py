"""Quick-start reward: 1.0 when the last number in the answer equals the ground truth."""

import re


def math_reward_fn(generated_text: str, ground_truth: str) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", generated_text)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1]) == float(ground_truth) else 0.0
    except ValueError:
        return 0.0
