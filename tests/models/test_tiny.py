"""The embedded tiny model: tokenizer, Hugging Face loading, recorded rates, determinism, caching, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_agent.chat import ChatEncoder
from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA
from verl_agent.models.tiny import INFO_FILE, TinySettings, add_cli, build_info, build_tiny, run_cli
from verl_agent.models.tokenizer import SPECIAL_TOKENS, TOOL_TAGS
from verl_agent.protocol import Message

# A few-second recipe for tests of the builder's mechanics (not of the model's quality).
SHRUNK = dataclasses.replace(TinySettings(), hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                             n_train_problems=120, steps=3, batch_size=4, n_eval_problems=4, vocab_size=400)


def test_tokenizer_round_trip_and_special_tokens(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for text in ["What is 37 * 12 + 5?", "  leading and trailing  \n\n", "ünïcode 日本語 🎉\ttab",
                 '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call><|im_end|>']:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for t in (*SPECIAL_TOKENS, *TOOL_TAGS):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t, t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert 300 < len(tok) <= 2048
    # tool tags survive skip_special_tokens (like Qwen2.5), ChatML markers do not
    ids = tok.encode("<|im_start|>x<tool_call>y</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>y</tool_call>"
    assert tok.encode("12345", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "12345"]


def test_loads_with_auto_classes_and_generates_chat(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers <= 4
    enc = ChatEncoder(tok, tools=[CALCULATOR_TOOL_SCHEMA])
    prompt = enc.encode_prompt([Message("user", "What is 37 * 12 + 5?")])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                         eos_token_id=enc.eos_token_ids, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    assert out[-1] in enc.eos_token_ids  # a trained chat model ends its turn
    text = tok.decode(out)
    assert text.startswith(("<tool_call>", "The answer is")), text


def test_built_model_is_a_good_rl_start(tiny_model_path: Path) -> None:
    """Rates measured by the builder (real sampled generation + real calculator on held-out problems)."""
    info = build_info(tiny_model_path)
    assert info["tool_call_rate"] >= 0.30, info
    # "Roughly 10-60 %": recipe 3 measured 42 % on these 128 problems (tool calls: 45 %). Expression copying
    # emerges late in SFT (around step 1250 of 2000; a 1200-step schedule never got there: 6 %), and float
    # differences between machines move that point, so the floor is below 10 %: it still fails a model that
    # never copies (recipe 2 measured 0 % here).
    assert 0.05 <= info["success_rate"] <= 0.60, info
    assert info["success_rate"] <= info["tool_call_rate"] + 0.1, info  # success comes mostly through the tool


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = build_tiny(tmp_path / "a", seed=3, settings=SHRUNK)
    b = build_tiny(tmp_path / "b", seed=3, settings=SHRUNK)
    c = build_tiny(tmp_path / "c", seed=4, settings=SHRUNK)
    sa, sb, sc = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_cache_reuse_force_and_half_built_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_AGENT_CACHE", str(tmp_path))
    path = build_tiny(seed=0, settings=SHRUNK)
    assert path.parent == tmp_path and path.name.startswith("tiny-") and (path / INFO_FILE).exists()
    stamp = (path / INFO_FILE).stat().st_mtime_ns
    assert build_tiny(seed=0, settings=SHRUNK) == path and (path / INFO_FILE).stat().st_mtime_ns == stamp
    other = build_tiny(seed=0, settings=dataclasses.replace(SHRUNK, steps=2))  # changed recipe: new folder
    assert other != path
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # temp build dirs are gone
    (path / INFO_FILE).unlink()  # what a killed build would look like: no record -> rebuilt
    assert build_tiny(seed=0, settings=SHRUNK) == path and (path / INFO_FILE).exists()
    build_tiny(seed=0, force=True, settings=SHRUNK)
    assert (path / INFO_FILE).stat().st_mtime_ns != stamp
    mine = tmp_path.parent / f"{tmp_path.name}-notes"  # a folder of the user's, outside the cache
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a build of ours"):
        build_tiny(out_dir=mine, seed=0, settings=SHRUNK)
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub").is_dir()


def test_cli_prints_both_rates(tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["build-tiny", "--out", str(tiny_model_path)])
    assert run_cli(args) == 0
    out = capsys.readouterr().out
    info = json.loads((tiny_model_path / INFO_FILE).read_text())
    assert f"tool-call rate: {info['tool_call_rate']:.2f}" in out and f"success rate: {info['success_rate']:.2f}" in out


def test_decision_rates_give_the_prior_call_rate() -> None:
    from verl_agent.models.sft_data import decision_rates

    for f, p in [(0.8, 0.35), (0.5, 0.5), (0.3, 0.6)]:
        p_tool, p_direct = decision_rates(f, p)
        assert 0 < p_tool <= 1 and 0 < p_direct <= 1 and max(p_tool, p_direct) == 1.0
        assert f * p_tool / (f * p_tool + (1 - f) * p_direct) == pytest.approx(p)
    assert decision_rates(0.8, 0.35)[0] == pytest.approx(0.35 * 0.2 / (0.8 * 0.65))
    with pytest.raises(ValueError, match="tool_call_prior"):
        decision_rates(0.8, 1.0)


def test_untrained_decision_masks_only_the_first_assistant_token(tiny_model_path: Path) -> None:
    import random

    from verl_agent.models.calculator_task import make_problems
    from verl_agent.models.sft_data import conversation, encode_conversation

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    enc = ChatEncoder(tok, tools=[CALCULATOR_TOOL_SCHEMA])
    msgs = conversation(make_problems(1, seed=0)[0], True, random.Random(0))
    ids, mask = encode_conversation(enc, msgs)
    ids2, mask2 = encode_conversation(enc, msgs, train_decision=False)
    first = mask.index(1)
    assert ids == ids2 and tok.convert_ids_to_tokens(ids[first]) == "<tool_call>"
    assert mask2[first] == 0 and mask2[:first] + mask2[first + 1:] == mask[:first] + mask[first + 1:]
