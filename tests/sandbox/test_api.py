"""Sandbox Fusion API behaviour against real servers (both backends) and the official client."""

from __future__ import annotations

import base64

import httpx
import pytest


def test_ping(server):
    assert httpx.get(f"{server.url}/v1/ping").json() == "pong"


def test_python_success_shape(server, run):
    out = run(server, "import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)", stdin="abc\n")
    assert out["status"] == "Success"
    assert out["compile_result"] is None
    r = out["run_result"]
    assert r["status"] == "Finished" and r["return_code"] == 0
    assert r["stdout"] == "cba\n" and r["stderr"] == "warn\n"
    assert 0 < r["execution_time"] < 10


def test_nonzero_exit_is_failed(server, run):
    out = run(server, "exit 3", language="bash")
    assert out["status"] == "Failed"
    assert out["run_result"]["return_code"] == 3


def test_cpp_compile_and_run(server, run):
    code = "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"
    out = run(server, code, language="cpp", stdin="2 40")
    assert out["status"] == "Success", out
    assert out["compile_result"]["status"] == "Finished" and out["run_result"]["stdout"] == "42\n"


def test_cpp_compile_error_has_no_run(server, run):
    out = run(server, "int main( {", language="cpp")
    assert out["status"] == "Failed"
    assert out["compile_result"]["return_code"] != 0 and "error" in out["compile_result"]["stderr"]
    assert out["run_result"] is None


def test_nodejs(docker_server, run):
    out = run(docker_server, "console.log([1,2,3].map(x => x * 2).join(','))", language="nodejs")
    assert out["run_result"]["stdout"] == "2,4,6\n"


def test_unknown_language_is_sandbox_error_not_500(server, run):
    out = run(server, "print 1", language="cobol")
    assert out["status"] == "SandboxError"
    assert "cobol" in out["message"] and "python" in out["message"]


@pytest.mark.parametrize("body,field", [({"language": "python"}, "code"), ({"code": "x"}, "language"),
                                        ({"code": "x", "language": "python", "run_timeout": "soon"}, "run_timeout")])
def test_malformed_request_422_names_field(process_server, body, field):
    response = httpx.post(f"{process_server.url}/run_code", json=body)
    assert response.status_code == 422
    assert any(field in err["loc"] for err in response.json()["detail"])


def test_files_and_fetch_files(server, run):
    files = {"data/in.txt": base64.b64encode(b"hello").decode()}
    code = "d = open('data/in.txt').read()\nopen('out.bin', 'wb').write(d.upper().encode() + bytes([0, 255]))"
    out = run(server, code, files=files, fetch_files=["out.bin", "missing.txt"])
    assert out["status"] == "Success"
    assert base64.b64decode(out["files"]["out.bin"]) == b"HELLO\x00\xff"
    assert "missing.txt" not in out["files"] and "missing.txt" in out["message"]


def test_binary_output(server, run):
    """Output that is not UTF-8 comes back decoded with replacement characters, not as an error."""
    out = run(server, "import os\nos.write(1, bytes(range(256)) * 64)")
    assert out["status"] == "Success" and "\ufffd" in out["run_result"]["stdout"]
    assert out["run_result"]["stdout"].startswith("".join(map(chr, range(128))))


def test_jupyter_cells_share_one_kernel(server):
    body = {"cells": ["a = 123", "a * 2", "print(a)", "import sys; sys.stderr.write('e')", "raise ValueError('no')"]}
    out = httpx.post(f"{server.url}/run_jupyter", json=body, timeout=60).json()
    cells = out["cells"]
    assert out["status"] == "Failed" and len(cells) == 5
    assert cells[1]["display"] == [{"text/plain": "246"}]
    assert cells[2]["stdout"] == "123\n" and cells[3]["stderr"] == "e"
    assert cells[4]["error"][0]["ename"] == "ValueError"


def test_jupyter_cell_timeout(server):
    body = {"cells": ["x = 1", "while True: pass", "print(x)"], "cell_timeout": 1}
    out = httpx.post(f"{server.url}/run_jupyter", json=body, timeout=60).json()
    assert out["status"] == "Failed" and out["driver"]["status"] == "TimeLimitExceeded"
    assert len(out["cells"]) == 2


def test_official_client_sync_and_async(server, run):
    """The `sandbox-fusion` package (0.3.7), pointed at our server with its endpoint setting."""
    import asyncio

    from sandbox_fusion import RunCodeRequest, RunStatus, run_code, run_code_async, set_endpoint

    set_endpoint(server.url)
    resp = run_code(RunCodeRequest(code="print(6 * 7)", language="python"), max_attempts=1)
    assert resp.status == RunStatus.Success and resp.run_result.stdout == "42\n"
    resp = asyncio.run(run_code_async(RunCodeRequest(code="echo hi; exit 1", language="bash"), max_attempts=1))
    assert resp.status == RunStatus.Failed and resp.run_result.stdout == "hi\n"


def open_session(server) -> str:
    response = httpx.post(f"{server.url}/open_session", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def test_sessions_keep_state_until_closed(server, run):
    sid = open_session(server)
    assert run(server, "x = 41\nimport os; os.chdir('/tmp')", session_id=sid)["status"] == "Success"
    out = run(server, "x += 1\nprint(x)", session_id=sid)
    assert out["run_result"]["stdout"] == "42\n"
    err = run(server, "undefined_name", session_id=sid)
    assert err["status"] == "Failed" and "NameError" in err["run_result"]["stderr"]
    assert run(server, "print(x)", session_id=sid)["run_result"]["stdout"] == "42\n"  # error kept the state
    assert httpx.post(f"{server.url}/close_session", json={"session_id": sid}).json() == {"closed": True}
    closed = run(server, "print(x)", session_id=sid)  # a closed id is dead, not silently reopened
    assert closed["status"] == "SandboxError" and "unknown session_id" in closed["message"]
    assert httpx.post(f"{server.url}/close_session", json={"session_id": sid}).json() == {"closed": False}


def test_session_ids_are_issued_by_the_server_and_unguessable(process_server, run):
    ids = {open_session(process_server) for _ in range(3)}
    try:
        assert len(ids) == 3 and all(len(i) >= 43 for i in ids)  # 256 random bits, url-safe
        owner = next(iter(ids))
        assert run(process_server, "secret = 'mine'", session_id=owner)["status"] == "Success"
        for guess in ("traj-1", owner[:-1], owner + "x", owner.upper()):  # chosen or near-miss ids are refused
            out = run(process_server, "print(secret)", session_id=guess)
            assert out["status"] == "SandboxError" and "unknown session_id" in out["message"], out
            assert httpx.post(f"{process_server.url}/close_session", json={"session_id": guess}).json() == {
                "closed": False}
        assert run(process_server, "print(secret)", session_id=owner)["run_result"]["stdout"] == "mine\n"
    finally:
        for sid in ids:
            httpx.post(f"{process_server.url}/close_session", json={"session_id": sid})
    assert len(process_server.service.sessions) == 0
    process_server.wait_idle()


def test_session_timeout_loses_state_with_clear_message(process_server, run):
    sid = open_session(process_server)
    run(process_server, "y = 1", session_id=sid)
    out = run(process_server, "while True: pass", session_id=sid, run_timeout=1)
    assert out["run_result"]["status"] == "TimeLimitExceeded" and "state was lost" in out["run_result"]["stderr"]
    assert "NameError" in run(process_server, "print(y)", session_id=sid)["run_result"]["stderr"]
    httpx.post(f"{process_server.url}/close_session", json={"session_id": sid})


def test_sessions_are_capped(process_server, run):
    cap = process_server.service.settings.max_sessions
    sids = [open_session(process_server) for _ in range(cap)]
    try:
        outs = [run(process_server, "1", session_id=s) for s in sids]
        assert [o["status"] for o in outs] == ["Success"] * cap
        full = httpx.post(f"{process_server.url}/open_session", timeout=30)
        assert full.status_code == 503 and "too many open sessions" in full.json()["message"]
        assert full.headers["retry-after"] == "1"
    finally:
        for s in sids:
            httpx.post(f"{process_server.url}/close_session", json={"session_id": s})
    again = open_session(process_server)  # a slot is free again
    assert httpx.post(f"{process_server.url}/close_session", json={"session_id": again}).json() == {"closed": True}
    process_server.wait_idle()
