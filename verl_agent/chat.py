"""Chat templates as token ids: the prompt, and token-exact increments for later turns.

A multi-turn trajectory is built by appending ids: the prompt, then what the
model generated (ending with its end-of-turn token), then the ids of the tool
results / user replies plus the next generation prompt, and so on. Earlier
turns are never re-tokenized. For this to equal what the chat template would
produce for the whole conversation, two things must hold, and `ChatEncoder`
checks both and raises `ChatTemplateError` when they do not:

1. Prefix stability: rendering the history and then the history plus new
   messages must only append text (templates that rewrite earlier turns, e.g.
   Qwen3 stripping old ``<think>`` blocks, break this).
2. A clean boundary: the assistant turn ends with an end-of-turn token that is
   a special (added) token, so the tokenizer never merges text across it.

Tool schemas (OpenAI function format) are rendered by the template itself via
``apply_chat_template(..., tools=...)``, as Hugging Face templates do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_agent.protocol import Message

__all__ = ["ChatEncoder", "ChatTemplateError", "END_OF_TURN_TOKENS"]

# Tokens that end an assistant turn in common templates (ChatML, Llama 3, Phi, Gemma, Llama 2 / Mistral, Llama 4,
# gpt-oss's harmony: <|call|> after a tool call, <|return|> after the final answer).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|eot|>",
                      "<|call|>", "<|return|>")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact incremental encoding."""


def _as_chat(m: Message | dict[str, Any]) -> dict[str, Any]:
    return m if isinstance(m, dict) else m.to_chat()


def _tool_dict(t: Any) -> dict[str, Any]:
    if isinstance(t, dict):
        return t
    if hasattr(t, "model_dump"):  # pydantic schema objects (OpenAIFunctionToolSchema)
        return t.model_dump(exclude_none=True)
    raise TypeError(f"tools: expected OpenAI tool schema dicts, got {type(t).__name__}")


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatEncoder:
    """Encodes conversations with a tokenizer's chat template, turn by turn, token-exactly.

    Invariant (tested for several templates): ``encode_prompt(h0) + gen_ids_1 +
    encode_observation(h1, new_1) + gen_ids_2 + ...`` equals the tokenization of
    the template rendering of the whole conversation, when each ``gen_ids_k`` is
    what the template renders for that assistant message (`encode_assistant`).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template to a Jinja string"
            )
        self.tokenizer = tokenizer
        self.tools = [_tool_dict(t) for t in tools] if tools else None
        self._added = set(tokenizer.get_added_vocab())

    # ---- rendering -------------------------------------------------------------------------
    def render(self, messages: Sequence[Message | dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (with this encoder's tools)."""
        try:
            return self.tokenizer.apply_chat_template(
                [_as_chat(m) for m in messages],
                tools=self.tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # jinja raises many types; name the template step that failed
            raise ChatTemplateError(f"chat template failed on {len(messages)} messages: {type(e).__name__}: {e}") from e

    def encode_text(self, text: str) -> list[int]:
        """Token ids of already-rendered template text (no extra BOS/EOS: the template has them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- public API ------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end an assistant turn: the tokenizer's eos plus known end-of-turn special tokens."""
        ids: list[int] = []
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            ids.append(int(eos))
        vocab = self.tokenizer.get_added_vocab()
        # harmony's <|end|> closes one message of a turn (its analysis), not the turn
        harmony = "<|channel|>" in vocab and "<|return|>" in vocab
        for tok in END_OF_TURN_TOKENS:
            if harmony and tok == "<|end|>":
                continue
            if tok in vocab and vocab[tok] not in ids:
                ids.append(int(vocab[tok]))
        return ids

    def encode_prompt(self, messages: Sequence[Message | dict[str, Any]]) -> list[int]:
        """Ids of the conversation so far plus the generation prompt (add_generation_prompt=True)."""
        if not messages:
            raise ValueError("encode_prompt: messages is empty")
        return self.encode_text(self.render(messages, add_generation_prompt=True))

    def encode_assistant(self, history: Sequence[Message | dict[str, Any]], message: Message | dict[str, Any]) -> list[int]:
        """Ids the template renders for assistant `message` after `history`'s generation prompt,
        up to and including its end-of-turn token: what a model trained on this template generates."""
        prompt = self.render(history, add_generation_prompt=True)
        full = self.render([*history, message], add_generation_prompt=False)
        self._check_prefix(prompt, full, "the generation prompt", len(history))
        rest = full[len(prompt):]
        return self.encode_text(rest[: self._end_of_turn(rest, "the assistant message")])

    def encode_observation(
        self, history: Sequence[Message | dict[str, Any]], new: Sequence[Message | dict[str, Any]]
    ) -> list[int]:
        """Ids to append right after the model's last turn (which ended with its end-of-turn token):
        the template's closing text, the `new` (tool / user) messages and the next generation prompt.

        `history` ends with that assistant message. Raises ChatTemplateError if the template
        rewrites earlier turns when messages are appended.
        """
        if not history or _as_chat(history[-1]).get("role") != "assistant":
            raise ValueError("encode_observation: history must end with the assistant message just generated")
        if not new:
            raise ValueError("encode_observation: no new messages to append")
        before = self.render(history[:-1], add_generation_prompt=True)
        done = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *new], add_generation_prompt=True)
        self._check_prefix(before, done, "the generation prompt", len(history) - 1)
        self._check_prefix(done, after, "the history", len(history))
        cut = len(before) + self._end_of_turn(done[len(before):], "the last assistant message")
        return self.encode_text(after[cut:])

    # ---- checks ----------------------------------------------------------------------------
    @staticmethod
    def _check_prefix(prefix: str, full: str, what: str, n: int) -> None:
        if not full.startswith(prefix):
            i = _first_difference(prefix, full)
            raise ChatTemplateError(
                f"chat template is not prefix-stable: appending messages after {n} messages changes {what} "
                f"at char {i}: {prefix[max(0, i - 30): i + 30]!r} became {full[max(0, i - 30): i + 30]!r}; "
                "incremental token-exact encoding is impossible with this template"
            )

    def _end_of_turn(self, text: str, what: str) -> int:
        """Index just past the first end-of-turn token in `text` (which must be a special token)."""
        hits = []
        for tid in self.eos_token_ids:
            tok = self.tokenizer.convert_ids_to_tokens(tid)
            if tok in self._added and tok in text:
                hits.append((text.index(tok), tok))
        if not hits:
            names = [self.tokenizer.convert_ids_to_tokens(t) for t in self.eos_token_ids]
            raise ChatTemplateError(
                f"{what} does not end with an end-of-turn special token (looked for {names} in {text[-60:]!r}); "
                "without one, tokens could merge across turns"
            )
        pos, tok = min(hits)
        return pos + len(tok)
