"""Contract tests: every body the `sglang` engine sends validates against SGLang's own request classes.

No server: the payloads are built here by the engine's own builders and validated in the SGLang
venv (its torch differs from ours) with the same pydantic path FastAPI uses for the endpoints,
plus the `SamplingParams(**dict).normalize().verify()` that SGLang's TokenizerManager runs, and its `SafeUnpickler` for the shared tensors.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from sglang_cpu import sglang_python

from verl_agent.engine.backends import sglang_engine as se
from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.tensor_handles import share_cpu

pytestmark = pytest.mark.sglang

# endpoint -> sglang.srt.managers.io_struct class of its body (None: no body)
ENDPOINTS = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/abort_request": "AbortReq",
    "/flush_cache": None, "/health": None, "/health_generate": None, "/server_info": None,
}  # fmt: skip

VALIDATE = r"""
import json, sys
from pydantic import TypeAdapter
from sglang.srt.managers import io_struct
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.common import MultiprocessingSerializer
report = []
for cls_name, body in json.load(open(sys.argv[1])):
    try:
        obj = TypeAdapter(getattr(io_struct, cls_name)).validate_python(body)
        info = {}
        if cls_name == "GenerateReqInput":
            obj.normalize_batch_and_arguments()
            sp = SamplingParams(**obj.sampling_params)  # what TokenizerManager does with the dict
            sp.normalize(None)
            sp.verify(1000)
            info = {"temperature": sp.temperature, "top_k": sp.top_k, "stop": sorted(sp.stop_token_ids or []),
                    "seed": sp.sampling_seed}
        if cls_name == "UpdateWeightsFromTensorReqInput":
            tensors = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
            info = {n: [str(t.dtype), list(t.shape), float(t.double().sum())] for n, t in tensors}
        report.append({"ok": True, **info})
    except Exception as e:
        report.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
print(json.dumps(report))
"""


def validate(tmp_path: Path, bodies: list[tuple[str, dict]]) -> list[dict]:
    path = tmp_path / "bodies.json"
    path.write_text(json.dumps(bodies))
    proc = subprocess.run([sglang_python(), "-c", VALIDATE, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_endpoint_the_engine_calls_is_covered():
    used = set(re.findall(r'_call\("(?:GET|POST)", "(/[a-z_]+)"', Path(se.__file__).read_text()))
    used |= {"/health_generate", "/health"}
    assert used <= set(ENDPOINTS), f"endpoints without a contract: {used - set(ENDPOINTS)}"


def test_payloads_validate_against_sglang_request_classes(tmp_path):
    sps = [
        SamplingParams(temperature=0.0, max_new_tokens=4),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2, 7], seed=11),
        SamplingParams(top_k=0),  # ours: <= 0 means no top-k
    ]
    tensors = [("model.embed_tokens.weight", torch.randn(4, 3)), ("model.norm.weight", torch.ones(3).bfloat16())]
    shared = [(n, share_cpu(t)) for n, t in tensors]  # kept alive until the other process has read them
    bodies = [("GenerateReqInput", se.generate_payload([1, 2, 3], sp)) for sp in sps] + [
        ("UpdateWeightsFromTensorReqInput", se.tensor_payload(shared, tp_size=2, flush=False)),
        ("UpdateWeightFromDiskReqInput", se.disk_payload("/tmp/ckpt")),
        ("ReleaseMemoryOccupationReqInput", se.memory_payload(se.MEMORY_TAGS)),
        ("ResumeMemoryOccupationReqInput", se.memory_payload(["weights"])),
        ("BeginWeightUpdateReqInput", {"selector": "all"}),
        ("EndWeightUpdateReqInput", {}),
        ("AbortReq", se.abort_payload()),
    ]
    report = validate(tmp_path, bodies)
    assert all(r["ok"] for r in report), report
    assert report[0]["top_k"] == 1 and report[0]["seed"] is None  # SGLang turns temperature 0 into top_k=1
    assert report[1]["stop"] == [2, 7] and report[1]["top_k"] == 20 and report[1]["seed"] == 11
    assert report[2]["top_k"] == 1 << 30  # SGLang's "whole vocabulary"
    for name, t in tensors:  # SGLang's SafeUnpickler rebuilt our tensors, values intact
        assert report[3][name] == [str(t.dtype), list(t.shape), pytest.approx(float(t.double().sum()))]


def test_validation_is_real_bad_bodies_are_rejected(tmp_path):
    good = se.generate_payload([1, 2], SamplingParams())
    bad = [
        ("GenerateReqInput", {**good, "sampling_params": {**good["sampling_params"], "bogus": 1}}),
        ("UpdateWeightFromDiskReqInput", {"load_format": None}),
        ("ReleaseMemoryOccupationReqInput", {"tags": "weights"}),
        ("AbortReq", {"abort_all": "maybe"}),
    ]
    assert not any(r["ok"] for r in validate(tmp_path, bad))
