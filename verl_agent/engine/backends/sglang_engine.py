"""`sglang` engine: drives a real SGLang server through its native HTTP API (tested with 0.5.23).

Either attach to a running server (``SGLangEngine(url)``) or launch ``python -m
sglang.launch_server`` here (``SGLangEngine(model_path=...)``, usually with the interpreter of a
separate venv, since SGLang pins its own torch). Endpoints used: ``/generate`` (input_ids in,
output ids + log-probs out), ``/begin_weight_update`` + ``/update_weights_from_tensor`` +
``/end_weight_update`` (tensors shared by handle: CUDA IPC on a GPU, shared memory on CPU),
``/update_weights_from_disk`` (fallback, or a server on another host with a shared disk),
``/release_memory_occupation`` / ``/resume_memory_occupation``, ``/abort_request`` (`interrupt`:
every request in flight returns its tokens so far), ``/flush_cache``, ``/health``,
``/health_generate``, ``/server_info``. The request bodies are built by the module-level
``*_payload`` functions; tests validate each against SGLang's own ``io_struct`` classes.

Errors: `SGLangError` (endpoint, HTTP status, body; or the log tail when our server died).
Bad input a user can trigger (token id outside the vocabulary, unknown weight name) raises
``ValueError`` before anything is sent: SGLang 0.5.23 crashes on an out-of-range token id.
Seeds: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference`` (CUDA).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from verl_agent.engine.contract import GenerateOutput, SamplingParams
from verl_agent.engine.tensor_handles import dumps_by_handle, share_cpu

__all__ = [
    "SGLangEngine", "SGLangError", "SUPPORTED_SGLANG_VERSIONS",
    "abort_payload", "generate_payload", "tensor_payload", "disk_payload", "memory_payload",
    "parse_generate_response",
]  # fmt: skip

logger = logging.getLogger(__name__)
SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants.GPU_MEMORY_ALL_TYPES


class SGLangError(RuntimeError):
    """An SGLang request failed; carries the endpoint, HTTP status and response body."""

    def __init__(self, endpoint: str, status: int | None, body: str) -> None:
        super().__init__(f"SGLang {endpoint} failed (status {status}): {body[:2000]}")
        self.endpoint, self.status, self.body = endpoint, status, body


def generate_payload(prompt_ids: Sequence[int], sampling: SamplingParams) -> dict[str, Any]:
    """Body of ``POST /generate`` (sglang GenerateReqInput + SamplingParams)."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return {"input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": True}


def parse_generate_response(data: Mapping[str, Any]) -> GenerateOutput:
    """Turn a ``/generate`` response into a `GenerateOutput`; raises SGLangError on a bad shape."""
    try:
        ids = [int(t) for t in data["output_ids"]]
        meta = data["meta_info"]
        pairs = meta["output_token_logprobs"]
        finish = (meta.get("finish_reason") or {}).get("type")
    except (KeyError, TypeError, AttributeError) as e:
        raise SGLangError("/generate", 200, f"unexpected response shape ({e!r}): {json.dumps(data)[:500]}") from e
    if [int(p[1]) for p in pairs] != ids:
        raise SGLangError("/generate", 200, f"logprob token ids {[p[1] for p in pairs]} != output_ids {ids}")
    reason = finish if finish in ("stop", "length") else "abort"
    return GenerateOutput(token_ids=ids, logprobs=[float(p[0]) for p in pairs], finish_reason=reason)


def abort_payload() -> dict[str, Any]:
    """Body of ``POST /abort_request`` (sglang AbortReq): every request in flight."""
    return {"abort_all": True}


def tensor_payload(named_tensors: list[tuple[str, torch.Tensor]], tp_size: int = 1, flush: bool = True) -> dict:
    """Body of ``POST /update_weights_from_tensor``: tensors pickled by handle, base64 per TP rank.

    CUDA tensors travel as CUDA IPC handles; CPU tensors must already be in shared memory (pass
    `share_cpu` clones). The caller keeps them alive until the reply. One pickle per TP rank: each
    unpickle releases the reference its pickle took on the shared memory.
    """
    blobs = [base64.b64encode(dumps_by_handle(named_tensors)).decode() for _ in range(tp_size)]
    return {"serialized_named_tensors": blobs, "flush_cache": flush}


def disk_payload(path: str | os.PathLike, load_format: str | None = None) -> dict[str, Any]:
    """Body of ``POST /update_weights_from_disk`` (sglang UpdateWeightFromDiskReqInput)."""
    return {"model_path": str(path), "load_format": load_format, "flush_cache": True}


def memory_payload(tags: Iterable[str]) -> dict[str, Any]:
    """Body of ``/release_memory_occupation`` and ``/resume_memory_occupation``."""
    return {"tags": list(tags)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangEngine:
    """`Engine` over an SGLang server. ``await start()`` (or any call) waits until it is healthy.

    url: attach to this server. Otherwise launch one for ``model_path`` with ``python`` (default
    $SGLANG_PYTHON or this interpreter), ``extra_args`` appended to the command line and ``env``
    added to the environment; its output goes to ``log_path``. ``weight_sync`` picks the default
    of `update_weights`: "tensor" (same host) or "disk" (``disk_dir`` must be visible to the server).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        model_path: str | os.PathLike | None = None,
        launch: bool = True,
        python: str | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        weight_sync: str = "tensor",
        bucket_bytes: int = 512 << 20,
        disk_dir: str | None = None,
        request_timeout: float = 600.0,
        startup_timeout: float = 300.0,
        startup_retries: int = 1,
    ) -> None:
        if weight_sync not in ("tensor", "disk"):
            raise ValueError(f"SGLangEngine weight_sync must be 'tensor' or 'disk', got {weight_sync!r}")
        self.weight_sync, self.bucket_bytes, self.disk_dir = weight_sync, bucket_bytes, disk_dir
        self._timeout, self._startup_timeout, self._startup_retries = request_timeout, startup_timeout, startup_retries
        self.model_path = str(model_path) if model_path is not None else None
        self.process: subprocess.Popen | None = None
        self.log_path: str | None = None
        if url is None:
            if not launch or self.model_path is None:
                raise ValueError("SGLangEngine needs url=... (attach) or model_path=... with launch=True")
            port = port or _free_port()
            url = f"http://{host}:{port}"
            self._launch_args = (python or os.environ.get("SGLANG_PYTHON", sys.executable), host, extra_args, env)
            self._launch(self._launch_args[0], host, port, extra_args, env)
        self.url = url.rstrip("/")
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._info: dict[str, Any] | None = None
        self._vocab_size: int | None = None
        self._param_names: set[str] | None = None
        self._released: set[str] = set()

    def _launch(self, python: str, host: str, port: int, extra: Sequence[str], env: Mapping[str, str] | None) -> None:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", host,
               "--port", str(port), "--skip-tokenizer-init", *extra]  # fmt: skip
        fd, self.log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
        logger.info("launching SGLang: %s (log %s)", " ".join(cmd), self.log_path)
        # Own session: close() ends exactly this server's process group (it forks schedulers).
        self.process = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
        os.close(fd)

    def _relaunch(self) -> None:
        """A launch that never became healthy (SGLang 0.5.23 on CPU once hung for minutes while loading a
        tiny model): stop it and launch again on a fresh port, once per `startup_retries`."""
        logger.warning("SGLang server at %s not healthy after %s s; relaunching. Log tail:\n%s", self.url,
                       self._startup_timeout, self._log_tail(1500))
        self._startup_retries -= 1
        self.shutdown()
        python, host, extra, env = self._launch_args
        port = _free_port()
        self.url, self._client = f"http://{host}:{port}", None
        self._launch(python, host, port, extra, env)

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not os.path.exists(self.log_path):
            return ""
        return Path(self.log_path).read_text(errors="replace")[-n:]

    def _http(self) -> httpx.AsyncClient:
        """One client per event loop (pytest gives each test its own loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # SGLang's uvicorn closes idle keep-alive connections after 5 s, httpx's default expiry is also
            # 5 s: a call after a long idle gap (an actor update) could reuse a connection the server is
            # closing and fail with ReadError. Expiring ours first removes the race.
            limits = httpx.Limits(keepalive_expiry=1.0)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=self._timeout, limits=limits)
            self._client_loop = loop
        return self._client

    async def _call(self, method: str, endpoint: str, payload: dict | None = None, ok_404: bool = False) -> Any:
        if self.process is not None and self.process.poll() is not None:
            raise SGLangError(endpoint, None, f"server exited with {self.process.returncode}:\n{self._log_tail()}")
        try:
            resp = await self._http().request(method, endpoint, json=payload)
        except httpx.HTTPError as e:
            died = self.process is not None and self.process.poll() is not None
            raise SGLangError(endpoint, None, f"{e!r}\n{self._log_tail() if died else ''}") from e
        if resp.status_code == 404 and ok_404:
            return None
        body = resp.text
        data = resp.json() if body and resp.headers.get("content-type", "").startswith("application/json") else body
        if resp.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise SGLangError(endpoint, resp.status_code, body)
        return data

    async def start(self) -> None:
        """Wait until ``/health`` answers 200, then read the server's settings (vocab, TP size)."""
        if self._info is not None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._startup_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangError("launch", None, f"server exited with {self.process.returncode}:\n{self._log_tail()}")
            try:
                if (await self._http().get("/health", timeout=5.0)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if loop.time() > deadline:
                if self.process is None or self._startup_retries < 1:
                    raise SGLangError("/health", None, f"not healthy after {self._startup_timeout} s\n{self._log_tail()}")
                self._relaunch()
                deadline = loop.time() + self._startup_timeout
            await asyncio.sleep(1.0)
        info = await self._call("GET", "/server_info")
        self._info = info if isinstance(info, dict) else {}
        self.model_path = self.model_path or self._info.get("model_path")
        self._read_model_files()
        version = self._info.get("version")
        if version not in SUPPORTED_SGLANG_VERSIONS:
            logger.warning("SGLang %s at %s; tested versions: %s", version, self.url, SUPPORTED_SGLANG_VERSIONS)

    def _read_model_files(self) -> None:
        """Vocab size and weight names from the checkpoint, when this host can read it."""
        root = Path(self.model_path or "")
        if not (root / "config.json").is_file():
            logger.warning("cannot read %s/config.json: token ids and weight names are not checked", root)
            return
        config = json.loads((root / "config.json").read_text())
        self._vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        from safetensors import safe_open

        names: set[str] = set()
        for f in root.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                names.update(sf.keys())
        if names and config.get("tie_word_embeddings"):
            names.add("lm_head.weight")
        self._param_names = names or None

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> GenerateOutput:
        # `session` is accepted and not needed: SGLang's radix cache already reuses the KV of any prompt
        # prefix it has seen, a session's previous turn included.
        await self.start()
        if not prompt_ids:
            raise ValueError("SGLangEngine.generate: prompt_ids is empty")
        if self._vocab_size is not None:
            bad = [(i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < self._vocab_size]
            if bad:
                raise ValueError(f"SGLangEngine.generate: token ids outside vocab [0, {self._vocab_size}): {bad[:5]}")
        data = await self._call("POST", "/generate", generate_payload(prompt_ids, sampling))
        return parse_generate_response(data)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], method: str | None = None) -> None:
        """Replace parameters by Hugging Face name, via shared tensors or a checkpoint on disk."""
        await self.start()
        method = method or self.weight_sync
        if "weights" in self._released:  # the weights' memory must be back before writing into it
            await self._call("POST", "/resume_memory_occupation", memory_payload(["weights"]))
            self._released.discard("weights")
        if method == "disk":
            await self._update_from_disk(list(named_tensors))
        elif method == "tensor":
            await self._update_from_tensors(named_tensors)
        else:
            raise ValueError(f"SGLangEngine.update_weights: method must be 'tensor' or 'disk', got {method!r}")

    def _check_names(self, names: Iterable[str]) -> None:
        if self._param_names is not None:
            unknown = sorted(set(names) - self._param_names)
            if unknown:
                raise ValueError(f"SGLangEngine.update_weights: unknown weight names {unknown[:5]} for {self.model_path}")

    async def _update_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tp = int(self._info.get("tp_size", 1) or 1) if self._info else 1
        buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, t in named_tensors:
            self._check_names([name])
            if size and size + t.numel() * t.element_size() > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, share_cpu(t)))
            size += t.numel() * t.element_size()
        # 0.5.23 requires a begin/end session around tensor loads; older servers have no such endpoint.
        has_session = await self._call("POST", "/begin_weight_update", {"selector": "all"}, ok_404=True) is not None
        try:
            for i, bucket in enumerate(buckets):
                payload = tensor_payload(bucket, tp_size=tp, flush=i == len(buckets) - 1)
                await self._call("POST", "/update_weights_from_tensor", payload)
        finally:
            if has_session:
                await self._call("POST", "/end_weight_update", {})

    async def _update_from_disk(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        self._check_names(n for n, _ in named_tensors)
        if self.model_path is None or not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"SGLangEngine disk update needs the model's config.json; cannot read {self.model_path}")
        tmp = tempfile.mkdtemp(prefix="sglang-weights-", dir=self.disk_dir)
        try:
            tensors, seen = {}, set()
            for n, t in named_tensors:  # tied weights (embed_tokens / lm_head) are one tensor: save it once
                key = (t.data_ptr(), tuple(t.shape))
                if key not in seen:
                    seen.add(key)
                    tensors[n] = t.detach().to("cpu").contiguous()
            await asyncio.to_thread(save_file, tensors, os.path.join(tmp, "model.safetensors"))
            for name in ("config.json", "generation_config.json"):
                if (Path(self.model_path) / name).is_file():
                    shutil.copy(Path(self.model_path) / name, tmp)
            await self.update_weights_from_disk(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def update_weights_from_disk(self, path: str | os.PathLike, load_format: str | None = None) -> None:
        """Load weights from a checkpoint directory the server can read."""
        await self.start()
        await self._call("POST", "/update_weights_from_disk", disk_payload(path, load_format))

    async def interrupt(self) -> bool:
        """End every request in flight at its next token boundary (``/abort_request`` with abort_all): each
        ``/generate`` returns the tokens and log-probs it has, finish_reason "abort" (see `Engine`). Every
        request on the server ends: the trainer owns its server; do not call it on a shared one."""
        await self.start()
        await self._call("POST", "/abort_request", abort_payload())
        return True

    async def release_session(self, session: str) -> None:
        """Nothing to free: the radix cache evicts prefixes least-recently-used on its own."""

    async def sleep(self, discard_weights: bool = False) -> None:
        """Release the weights' and KV cache's memory (GPU: needs ``--enable-memory-saver``). The release is
        the same either way: whether the server keeps a host copy of its weights is its own setting
        (``--enable-weights-cpu-backup``), so `discard_weights` changes nothing here."""
        await self.start()
        await self._call("POST", "/release_memory_occupation", memory_payload(MEMORY_TAGS))
        self._released = set(MEMORY_TAGS)

    async def wake_up(self) -> None:
        await self.start()
        if self._released:
            tags = [t for t in MEMORY_TAGS if t in self._released]
            await self._call("POST", "/resume_memory_occupation", memory_payload(tags))
            self._released.clear()

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    async def health(self, generate: bool = False) -> bool:
        """True when the server answers ``/health`` (or ``/health_generate``: it runs one token)."""
        try:
            await self._call("GET", "/health_generate" if generate else "/health")
        except SGLangError:
            return False
        return True

    async def close(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        await asyncio.to_thread(self.shutdown)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the server we launched (its whole process group); no-op when attached."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            self._stop(proc, timeout)
        if self.log_path is not None:
            Path(self.log_path).unlink(missing_ok=True)

    @staticmethod
    def _stop(proc: subprocess.Popen, timeout: float) -> None:
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                logger.warning("SGLang server %d ignored %s", proc.pid, sig.name)
            except ProcessLookupError:
                return

