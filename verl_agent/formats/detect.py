"""Which tool-call format a chat template speaks, read from the template's own text.

Each family's template writes its call syntax into the prompt (to render earlier calls, or to teach the
model the format), so a marker found in the template names the format. The most specific markers are
looked for first: Qwen3-Coder and GLM-4.5 also use ``<tool_call>``, which alone means hermes.
"""

from __future__ import annotations

__all__ = ["TEMPLATE_MARKERS", "format_from_template"]

# (format, markers that must all appear in the template), most specific first
TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>")),
    ("deepseek", ("｜DSML｜",)),
    ("deepseek", ("tool▁calls▁begin",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("glm45", ("<arg_key>", "<arg_value>")),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("llama4_pythonic", ("<|python_start|>",)),
    ("llama4_pythonic", ("[func_name1(",)),
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|python_tag|>",)),
)


def format_from_template(template: str | None) -> str | None:
    """The format `template` (a chat template's Jinja source) renders calls in; None when it tells nothing."""
    if not template:
        return None
    for fmt, markers in TEMPLATE_MARKERS:
        if all(m in template for m in markers):
            return fmt
    return None
