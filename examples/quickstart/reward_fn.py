"""Quick-start reward: 1.0 when the last number in the answer equals the ground truth."""

import re


def math_reward_fn(generated_text: str, ground_truth: str) -> float:
    numbers = re.findall(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?", generated_text)  # "1,234" is one number
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1].replace(",", "")) == float(ground_truth) else 0.0
    except ValueError:
        return 0.0
