"""Shared-prefix packing (`trainer/policy/shared_prefix.py`): sequences that share leading tokens run as one
row, the prefix once, and give the same log-probs, losses and gradients as their padded rows.

Cases: a GRPO group (one prompt, n responses); multi-turn trajectories that share the prompt AND the first
response and observation, then diverge; the segments after a context rewrite (a rewritten prompt shared by
the group's later segments, beside the groups' first segments); eager and sdpa attention; a whole update
(micro-batching, loss, optimizer step) with and without sharing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from verl_agent.trainer.policy.actor import MicroBatching, forward_log_probs, micro_batches, update_actor
from verl_agent.trainer.policy.batch import TrainSeq
from verl_agent.trainer.policy.shared_prefix import pack_sequences, packed_batch

CPU = torch.device("cpu")


def _seq(prompt: list[int], response: list[int], uid: str, g: torch.Generator) -> TrainSeq:
    mask = torch.ones(len(response))
    mask[1:3] = 0 if len(response) > 4 else 1  # an observation hole inside the response
    return TrainSeq(input_ids=prompt + response, prompt_len=len(prompt), loss_mask=mask, uid=uid,
                    advantages=torch.randn(len(response), generator=g))


def _tokens(n: int, g: torch.Generator, vocab: int = 200) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def grpo_group(g: torch.Generator, n: int = 4, prompt: int = 40) -> list[TrainSeq]:
    p = _tokens(prompt, g)
    return [_seq(p, _tokens(8 + 3 * i, g), "grpo", g) for i in range(n)]


def multi_turn_group(g: torch.Generator) -> list[TrainSeq]:
    """Prompt, a first response and its observation shared by all; the second turns diverge."""
    p, first = _tokens(36, g), _tokens(12, g)
    seqs = []
    for i in range(3):
        s = _seq(p, first + _tokens(9 + 2 * i, g), "turns", g)
        s.turns = [(0, 8), (12, s.response_len)]
        seqs.append(s)
    return seqs


def segment_groups(g: torch.Generator) -> list[TrainSeq]:
    """First segments share the task; second segments (after a rewrite) share the task and the summary, so
    two packs with different prefixes come out of one group."""
    task, summary = _tokens(34, g), _tokens(10, g)
    first = [_seq(task, _tokens(10 + i, g), "seg", g) for i in range(3)]
    second = [_seq(task + summary, _tokens(7 + i, g), "seg", g) for i in range(2)]
    return first + second


def _model(path, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)


def test_packs_cut_by_shared_prefix_and_budget() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = grpo_group(g, n=4, prompt=40), grpo_group(g, n=2, prompt=50)
    packs = pack_sequences(b + a + [_seq(_tokens(5, g), _tokens(6, g), "solo", g)], min_shared=32)
    by_size = sorted((len(p.seqs), p.prefix_len) for p in packs)
    assert by_size == [(1, 11), (2, 50), (4, 40)]  # a pack of one is its own row: prefix = the whole sequence
    four = next(p for p in packs if len(p.seqs) == 4)
    assert four.num_tokens == 40 + sum(s.response_len for s in a) and four.saved_tokens == 3 * 40
    # below the threshold nothing is shared; a budget splits a group into packs that each share the prompt
    assert all(len(p.seqs) == 1 for p in pack_sequences(a, min_shared=41))
    budget = pack_sequences(a, 32, max_tokens=40 + a[2].response_len + a[3].response_len)  # any 2, no 3
    assert [len(p.seqs) for p in budget] == [2, 2] and all(p.prefix_len == 40 for p in budget)
    # the shared part stops one token before the shortest member's end: an identical copy keeps a suffix
    twins = pack_sequences([a[0], copy.deepcopy(a[0])], 8)
    assert twins[0].prefix_len == a[0].num_tokens - 1 and twins[0].num_tokens == a[0].num_tokens + 1


def test_a_prefix_common_to_all_groups_does_not_merge_them() -> None:
    """A chat template's system turn starts every prompt: the groups still pack by their own whole prompts
    (2 x 7 x 90 tokens saved), not into one pack sharing the template (15 x 40)."""
    g = torch.Generator().manual_seed(5)
    template = _tokens(40, g)
    groups = []
    for uid in "ab":
        prompt = template + _tokens(50, g)
        groups += [_seq(prompt, _tokens(20, g), uid, g) for _ in range(8)]
    packs = pack_sequences(groups, 32, max_tokens=10_000)
    assert sorted((len(p.seqs), p.prefix_len) for p in packs) == [(8, 90), (8, 90)]
    assert sum(p.saved_tokens for p in packs) == 2 * 7 * 90


def test_packed_mask_sees_prefix_and_own_suffix_only() -> None:
    g = torch.Generator().manual_seed(1)
    seqs = grpo_group(g, n=2, prompt=4)
    ids, pos, mask, rows, targets, order = packed_batch(pack_sequences(seqs, 2), CPU)
    (p,) = pack_sequences(seqs, 2)
    s1, s2 = (p.prefix_len, p.prefix_len + order[0].response_len), None
    m = mask[0, 0]
    first_of_2 = s1[1]  # the second suffix's first position
    assert m[first_of_2, : p.prefix_len].all() and not m[first_of_2, s1[0] : s1[1]].any()
    assert m[s1[0] + 2, s1[0] : s1[0] + 3].all() and not m[s1[0] + 2, s1[0] + 3 : s1[1]].any()  # causal suffix
    assert not m[: p.prefix_len, p.prefix_len :].any()  # the prefix sees no suffix
    assert pos[0, first_of_2] == p.prefix_len and pos[0, s1[0]] == p.prefix_len
    # each suffix's first token is predicted by the prefix's last position, once per sequence
    assert (rows == p.prefix_len - 1).sum() == 2 and s2 is None
    assert targets.tolist() == [t for s in order for t in s.input_ids[s.prompt_len :]]


@pytest.mark.parametrize(("case", "attn"), [(grpo_group, "sdpa"), (multi_turn_group, "sdpa"),
                                            (segment_groups, "sdpa"), (grpo_group, "eager")])
def test_log_probs_and_gradients_equal_padded_rows(dev_model_path, case, attn) -> None:
    g = torch.Generator().manual_seed(2)
    seqs = case(g) + grpo_group(g, n=2, prompt=33)  # two groups in one micro-batch
    assert any(len(p.seqs) > 1 for p in pack_sequences(seqs, 32))
    shared, padded = _model(dev_model_path, attn), _model(dev_model_path, attn)
    out = {}
    for name, model, k in (("shared", shared, 32), ("padded", padded, 0)):
        logp, ent = forward_log_probs(model, seqs, 0.8, CPU, with_entropy=True, shared_prefix=k)
        loss = sum((lp * s.advantages * s.loss_mask).sum() + 0.1 * e.sum() for lp, e, s in zip(logp, ent, seqs))
        loss.backward()
        out[name] = (logp, ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    for a, b in zip(out["shared"][0] + out["shared"][1], out["padded"][0] + out["padded"][1]):
        assert_close(a, b, rtol=1e-5, atol=2e-5)
    for n, grad in out["padded"][2].items():  # fp32 rounding of other summation orders: scaled by the tensor
        assert_close(out["shared"][2][n], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=n)


def test_update_with_shared_prefix_equals_padded_update(dev_model_path) -> None:
    """The whole update: packs cut into micro-batches by a token budget, PPO loss, SGD step; same parameters,
    loss and gradient norm, and the tokens the prefixes saved are reported."""
    from verl_agent.config import ActorConfig

    g = torch.Generator().manual_seed(3)
    seqs = grpo_group(g, n=4, prompt=48) + multi_turn_group(g) + segment_groups(g)
    cfg = ActorConfig(grad_clip=100.0, entropy_coeff=0.01)
    a = _model(dev_model_path)
    b = copy.deepcopy(a)
    out = []
    for model, k in ((a, 32), (b, 0)):
        mb = MicroBatching(dynamic=True, max_tokens=160, shared_prefix=k)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        out.append(update_actor(model, opt, copy.deepcopy(seqs), cfg, 1.0, CPU, 1, mb, loss_scale_factor=64))
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-5)
    assert out[0]["pg_loss"] == pytest.approx(out[1]["pg_loss"], rel=1e-4, abs=1e-6)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    total = sum(s.num_tokens for s in seqs)
    assert out[1]["perf/update_tokens"] == total and out[1]["perf/update_tokens_shared"] == 0
    assert out[0]["perf/update_tokens_shared"] > 0.25 * total
    assert out[0]["perf/update_tokens"] == total - out[0]["perf/update_tokens_shared"]


def test_micro_batches_keep_packs_whole_within_budget() -> None:
    g = torch.Generator().manual_seed(4)
    groups = [grpo_group(g, n=4, prompt=40) for _ in range(3)]
    seqs = [s for grp in zip(*groups) for s in grp]  # members interleaved, as a shuffled batch has them
    micro = micro_batches(seqs, MicroBatching(dynamic=True, max_tokens=100, shared_prefix=32))
    assert sorted(id(s) for m in micro for s in m) == sorted(id(s) for s in seqs)
    for m in micro:
        packs = pack_sequences(m, 32)
        assert len(packs) == 1 and packs[0].num_tokens <= 100  # one group's pack, within the budget
    assert len(micro) == 3
    count = micro_batches(seqs, MicroBatching(dynamic=False, per_gpu=4, shared_prefix=32))
    assert [len({s.input_ids[0] for s in m}) for m in count] == [1, 1, 1]  # members kept together


def test_default_packs_for_matmul_bound_models_only(dev_model_path) -> None:
    """actor.shared_prefix_min_tokens None: packed rows from hidden size 2048 up (where the update is
    matmul-bound), padded rows below; a number is taken as given."""
    from transformers import Qwen2Config

    from verl_agent.trainer.policy.policy import shared_prefix_tokens

    small, big = _model(dev_model_path), torch.nn.Module()
    big.config = Qwen2Config(hidden_size=3584)
    big.config._attn_implementation = "sdpa"
    assert small.config.hidden_size < 2048
    assert shared_prefix_tokens(None, small) == 0 and shared_prefix_tokens(None, big) == 32
    assert shared_prefix_tokens(16, small) == 16 and shared_prefix_tokens(0, big) == 0
    # a model without a 4-D mask path keeps padded rows (and micro-batches budgeted as such), with a warning
    flash = _model(dev_model_path)
    flash.config._attn_implementation = "flash_attention_2"
    assert shared_prefix_tokens(32, flash) == 0 and shared_prefix_tokens(None, flash) == 0
