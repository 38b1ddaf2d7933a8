"""`verl-agent eval`: the pass@k estimator against hand-computed numbers, the figures per data_source with
exclusions, and the command on examples/calculator with the tiny model served three ways in one table:
as the config's model, from a trainer checkpoint, and through our OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from verl_agent.protocol import Message, Trajectory
from verl_agent.rollout.evaluation.passk import eval_figures, extract_answer, majority_solved, pass_at_k

CONFIG = "examples/calculator/config.yaml"


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 2, 1 - 3 / 10),        # 1 - C(3,2)/C(5,2)
    (6, 1, 3, 1 - 10 / 20),       # 1 - C(5,3)/C(6,3)
    (10, 3, 1, 0.3),              # pass@1 = c/n
    (4, 0, 4, 0.0),
    (3, 2, 2, 1.0),               # n - c < k: every pair holds a correct sample
    (20, 5, 4, 1 - 1365 / 4845),  # C(15,4)/C(20,4)
])  # fmt: skip
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError, match=f"n={n} c={c} k={k}"):
            pass_at_k(n, c, k)


def test_extract_answer_and_majority():
    assert extract_answer("so \\boxed{1,234.0} is it") == "1234"
    assert extract_answer("steps...\n#### 72") == "72"
    assert extract_answer("The answer is 449. Done") == "449"
    assert extract_answer("\\boxed{x^2}") == "x^2" and extract_answer("no number") is None
    assert majority_solved([("3", False), ("4", True), ("3", False)]) is False  # "3" wins and is wrong
    assert majority_solved([("4", True), ("3", False)]) is True  # a tie goes to the earliest answer
    assert majority_solved([(None, True)]) is False  # nothing to vote with


def _traj(uid: str, reward: float, answer: str, source: str = "calc", outcome: str = "ok",
          cause: str | None = None) -> Trajectory:  # fmt: skip
    return Trajectory(uid=uid, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[], reward=reward,
                      data_source=source, outcome=outcome, cause=cause,  # type: ignore[arg-type]
                      messages=[Message(role="user", content="q"), Message(role="assistant", content=answer)])


def test_figures_per_data_source_exclude_infrastructure_failures():
    bad = dict(outcome="policy_failure", cause="wrong_answer")
    trajs = [
        # calc p1: 3 samples scored (1 correct) + a tool timeout, which is neither success nor failure
        _traj("p1", 0.0, "It is 8.", **bad), _traj("p1", 1.0, "The answer is 7."), _traj("p1", 0.0, "8", **bad),
        _traj("p1", 0.0, "", outcome="infra_failure", cause="tool_timeout"),
        # calc p2: 2 samples, both correct
        _traj("p2", 1.0, "5"), _traj("p2", 1.0, "5.0"),
        # gsm p3: 1 sample scored (< k=2): in pass@1, not in pass@2 / maj@2
        _traj("p3", 1.0, "#### 9", source="gsm"), _traj("p3", 0.0, "", "gsm", "infra_failure", "sandbox_unavailable"),
        # gsm p4: every sample excluded
        _traj("p4", 0.0, "", "gsm", "infra_failure", "reward_error"),
    ]
    figs = eval_figures(trajs, k=2)
    calc, gsm, both = figs["calc"], figs["gsm"], figs["all"]
    assert calc["pass@1"] == pytest.approx((1 / 3 + 1) / 2)
    assert calc["pass@2"] == pytest.approx(((1 - 1 / 3) + 1) / 2)  # p1: 1 - C(2,2)/C(3,2)
    assert calc["maj@2"] == pytest.approx(0.5)  # p1's first two: 8 vs 7, a tie -> 8 (wrong); p2: 5 and 5.0 agree
    assert calc["mean_reward"] == pytest.approx(3 / 5)
    assert calc["outcomes"] == {"infra_failure/tool_timeout": 1, "ok": 3, "policy_failure/wrong_answer": 2}
    assert (gsm["prompts"], gsm["prompts_excluded"], gsm["prompts_short"]) == (2, 1, 1)
    assert gsm["pass@1"] == 1.0 and gsm["pass@2"] is None and gsm["maj@2"] is None
    assert both["samples"] == 9 and both["samples_scored"] == 6
    assert both["pass@1"] == pytest.approx((1 / 3 + 1 + 1) / 3)
    assert both["outcomes"]["infra_failure/reward_error"] == 1


@pytest.fixture
def endpoint(tiny_model_path):
    """Our OpenAI-compatible endpoint serving the tiny model (its own thread and event loop), request sampling on;
    one KV slot, as the local run below, so that both compute every row alone (identical floats)."""
    from verl_agent.config import load_config
    from verl_agent.engine.contract import SamplingParams
    from verl_agent.parsers import get_parser
    from verl_agent.rollout.build import build_rollout
    from verl_agent.rollout.openai.openai_server import OpenAIServer

    cfg = load_config(CONFIG, ["actor_rollout_ref.rollout.max_num_seqs=1", "trainer.device=cpu"])
    ready, box, loop = threading.Event(), {}, asyncio.new_event_loop()

    async def serve():
        parts = build_rollout(cfg, device="cpu", seed=0)
        server = OpenAIServer(parts.engine, parts.tokenizer, get_parser("hermes", parts.tokenizer),
                              use_request_sampling=True, max_prompt_length=4096, max_response_length=1 << 20)
        await server.start()
        box["url"] = server.base_url(server.open_session(SamplingParams(), uid="eval").sid)
        box["stop"] = asyncio.Event()
        ready.set()
        await box["stop"].wait()
        await server.stop()
        await parts.engine.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(120)
    yield box["url"]
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(30)


def _checkpoint(tiny_model_path, run_dir):
    """A trainer checkpoint (state_files shards + completion marker) of the tiny model with scaled weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_agent.config import load_config, save_config
    from verl_agent.trainer.persistence import checkpoint as ckpt

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # tied to the embeddings: both change
    tmp = ckpt.tmp_dir(run_dir, 3)
    ckpt.save_shards(tmp, "actor", model, torch.optim.AdamW(model.parameters()))
    ckpt.finalize(tmp, ckpt.driver_state(3, {}))
    save_config(load_config(CONFIG), run_dir / "config.yaml")
    return model


def _no_ids(messages: list[dict]) -> list[dict]:
    """The messages without tool-call ids (the server names its calls; the native loop's parser does not)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if "tool_calls" in m:
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


def test_eval_command_puts_config_model_checkpoint_and_endpoint_in_one_table(endpoint, tiny_model_path, tmp_path,
                                                                             capsys):  # fmt: skip
    from verl_agent.cli import main
    from verl_agent.trainer.persistence.checkpoint import load_checkpoint_model

    trained = _checkpoint(tiny_model_path, tmp_path / "run")
    loaded, tokenizer = load_checkpoint_model(tmp_path / "run")  # a run dir: its newest checkpoint
    weights = loaded.get_input_embeddings().weight
    assert tokenizer == str(tiny_model_path) and (weights == trained.get_input_embeddings().weight).all()

    val = tmp_path / "val.jsonl"
    val.write_text("".join(open("examples/calculator/data/test.jsonl").readlines()[:3]))
    out = tmp_path / "eval"
    rc = main(["eval", CONFIG, "--k", "2", "--n", "2", "--model", "tiny", "--model", str(tmp_path / "run"),
               "--model", endpoint, "--out", str(out), f"data.val_files=[{val}]", "trainer.device=cpu",
               "actor_rollout_ref.rollout.max_num_seqs=1"])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert (result["k"], result["n"], result["prompts"]) == (2, 2, 3)
    local, ckpt_run, served = (m["figures"]["default"] for m in result["models"])
    for figs in (local, ckpt_run, served):
        assert figs["samples_scored"] == 6 and sum(figs["outcomes"].values()) == 6
        assert set(figs) >= {"pass@1", "pass@2", "maj@2", "mean_reward"}
    # the endpoint gets the same prompts, tools and per-turn seeds: the same episodes as the native loop
    recs = [[json.loads(line) for line in open(m["trajectories"])] for m in result["models"]]
    assert [(r["reward"], _no_ids(r["messages"])) for r in recs[0]] == [(r["reward"], _no_ids(r["messages"]))
                                                                         for r in recs[2]]  # fmt: skip
    assert local == served and any(len(r["messages"]) > 2 for r in recs[0])  # a tool round trip happened
    assert recs[2][0]["prompt_ids"] == []  # no token ids through a chat API
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert header == ["data_source", "figure", "tiny", str(tmp_path / "run"), endpoint]
    row = next(line.split() for line in table.splitlines() if line.split()[:2] == ["default", "pass@2"])
    assert row[2:] == [f"{figs['pass@2']:.4f}" for figs in (local, ckpt_run, served)]


def test_unreachable_or_failing_server_is_counted_as_infrastructure_failure_never_a_reward(tmp_path, capsys):
    """Nothing listens on the port, or a server answers 503: every episode is an infra failure (endpoint_error),
    excluded from pass@k."""
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from verl_agent.cli import main

    class Overloaded(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")

        def log_message(self, *args):
            pass

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    server = ThreadingHTTPServer(("127.0.0.1", 0), Overloaded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    val = tmp_path / "val.jsonl"
    val.write_text("".join(open("examples/calculator/data/test.jsonl").readlines()[:2]))
    out = tmp_path / "eval"
    try:
        busy = f"http://127.0.0.1:{server.server_port}/v1"
        assert main(["eval", CONFIG, "--k", "2", "--model", dead, "--model", busy, "--served-model-name", "m",
                     "--out", str(out), f"data.val_files=[{val}]"]) == 0  # fmt: skip
    finally:
        server.shutdown()
    for i, error in enumerate(["ConnectError", "answered 503: overloaded"]):
        figs = json.loads((out / "result.json").read_text())["models"][i]["figures"]["default"]
        assert figs["outcomes"] == {"infra_failure/endpoint_error": 4}
        assert (figs["prompts_excluded"], figs["samples_scored"], figs["pass@1"], figs["pass@2"]) == (2, 0, None, None)
        recs = [json.loads(line) for line in (out / f"trajectories_{i}.jsonl").open()]
        assert all(r["reward"] == 0.0 and error in r["error"] for r in recs)
    assert main(["eval", CONFIG, "--k", "3", "--n", "2"]) == 2  # k > n: refused before any rollout
    assert "--k 3 needs 1 <= k <= n" in capsys.readouterr().err
    (tmp_path / "crashed" / "checkpoints" / "global_step_2").mkdir(parents=True)  # a save that never finished
    assert main(["eval", CONFIG, "--model", "tiny", "--model", str(tmp_path / "crashed")]) == 2
    assert "global_step_2 is not a complete checkpoint: no completion marker" in capsys.readouterr().err
