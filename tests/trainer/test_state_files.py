"""Checkpoint shards (verl_agent/trainer/persistence/state_files.py) with real torch.distributed (gloo) and FSDP2: a state
written by 2 ranks loads bit for bit on 2, on 1 and on 3 ranks (rows come from whichever saved rank holds
them), optimizer moments and param groups included; a flipped byte or a truncated file is refused by name.
Each with and without zstd byte-plane compression."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from verl_agent.trainer.persistence.state_files import load_state, save_state


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_and_optimizer(world: int):
    """A small model (rows not divisible by 2 or 3) sharded over `world` gloo ranks, after one AdamW step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(37, 8), torch.nn.Linear(8, 11), torch.nn.Linear(11, 5, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model(torch.arange(6).unsqueeze(0)).sum().backward()
    opt.step()
    return model, opt, get_state_dict


def _full(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a state as a full plain tensor (gathers DTensors), by flattened path."""
    from verl_agent.trainer.persistence.state_files import _flatten

    return {p: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
            for p, t in _flatten(state) if torch.is_tensor(t)}  # fmt: skip


def _worker(rank: int, world: int, port: int, directory: str, mode: str, codec: str, out) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, opt, get_state_dict = _model_and_optimizer(world)
        msd, osd = get_state_dict(model, opt)
        if mode == "save":
            save_state(Path(directory), {"model": msd, "optim": osd}, rank, world, threads=3, codec=codec)
            full = _full({"model": msd, "optim": osd})
        else:
            from verl_agent.trainer.persistence.state_files import _flatten

            for _, t in _flatten({"model": msd, "optim": osd}):
                if torch.is_tensor(t):  # nothing of the freshly built state (same seed) may survive the load
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
            opt.param_groups[0]["betas"] = (0.0, 0.0)
            state = load_state(Path(directory), {"model": msd, "optim": osd})
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            msd, osd = get_state_dict(model, opt)
            full = _full({"model": msd, "optim": osd})
            full["betas"] = torch.tensor(opt.param_groups[0]["betas"])
        if rank == 0:
            out.put({k: v.tolist() for k, v in full.items()})  # SimpleQueue: written before put returns
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown once the work is done: gloo's threads, still referenced by the
    # device mesh, can abort it ("terminate called without an active exception", seen in CI as SIGABRT).
    os._exit(0)


def _run(world: int, directory: Path, mode: str, codec: str = "none") -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _port(), str(directory), mode, codec, out), nprocs=world,
                       start_method="spawn")
    return out.get()


@pytest.fixture(scope="module", params=["none", "zstd"])
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"shards_{request.param}") / "actor"
    return directory, _run(2, directory, "save", request.param)


@pytest.mark.parametrize("world", [2, 1, 3])
def test_a_state_saved_by_two_ranks_loads_exactly_on_any_number(saved, world):
    directory, want = saved
    got = _run(world, directory, "load")
    assert got.pop("betas") == pytest.approx([0.8, 0.95])  # param groups come back too
    assert sorted(got) == sorted(want)
    assert any("exp_avg_sq" in k for k in got) and any(k.startswith("model/") for k in got)
    for k in want:
        assert got[k] == want[k], k  # bit for bit (lists of Python floats compare exactly)


def test_a_flipped_byte_or_a_truncated_file_is_refused_naming_the_tensor(saved, tmp_path):
    import shutil

    directory, _ = saved
    index = json.loads((directory / "rank0.json").read_text())["tensors"]
    path, entry = max(index.items(), key=lambda kv: kv[1]["nbytes"])
    state = {}  # a plain (one-process) target with the same structure: every tensor as saved
    for p, e in index.items():
        node = state
        *parents, leaf = p.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = torch.zeros(e["global_shape"], dtype=getattr(torch, e["dtype"].removeprefix("torch.")))
    bad = tmp_path / "flipped"
    shutil.copytree(directory, bad)
    with open(bad / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + entry["nbytes"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=f"tensor '{path}' in .*{entry['file']} fails its CRC32"):
        load_state(bad, state)
    if "zstd_frames" in entry:  # a byte of the compressed plane: zstd refuses it, or the CRC32 does
        frame = tmp_path / "frame"
        shutil.copytree(directory, frame)
        with open(frame / entry["file"], "r+b") as f:
            f.seek(entry["offset"] + entry["zstd_frames"][0] // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ValueError, match=f"tensor '{path}' in .*{entry['file']} (fails its CRC32|cannot be "
                           "decompressed|decompresses to)"):
            load_state(frame, state)
    short = tmp_path / "short"
    shutil.copytree(directory, short)
    os.truncate(short / entry["file"], entry["offset"] + 1)
    with pytest.raises(ValueError, match=f"{entry['file']} ends inside tensor '{path}'"):
        load_state(short, state)


def test_zstd_planes_round_trip_every_dtype_across_chunks_and_shrink_floats(tmp_path, monkeypatch):
    """Byte planes are cut per staging chunk: a small chunk size puts several chunks (the last one short) in
    one tensor; bf16 normal values (a few exponents) must shrink, integers and bytes come back as they were."""
    import verl_agent.trainer.persistence.state_files as sf

    monkeypatch.setattr(sf, "STAGING_BYTES", 4096)
    torch.manual_seed(0)
    state = {"w": (torch.randn(3000) * 0.02).bfloat16(), "m": torch.randn(50, 41), "i": torch.arange(-999, 1000),
             "b": torch.rand(777) > 0.5, "u": torch.randint(0, 255, (513,), dtype=torch.uint8), "e": torch.zeros(0)}
    save_state(tmp_path, state, 0, 1, threads=2, codec="zstd")
    index = json.loads((tmp_path / "rank0.json").read_text())["tensors"]
    assert len(index["w"]["zstd_frames"]) == 2 and index["w"]["stored"] < 0.8 * index["w"]["nbytes"]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    monkeypatch.setattr(sf, "STAGING_BYTES", 64 << 20)  # the reader takes the chunk size from the index
    load_state(tmp_path, target)
    for k, v in state.items():
        assert torch.equal(target[k], v), k


def test_auto_codec_follows_the_cores_and_the_package_and_an_unknown_one_is_refused(monkeypatch):
    from verl_agent.trainer.persistence.state_files import resolve_codec

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert resolve_codec("auto") == "zstd"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert resolve_codec("auto") == "none" and resolve_codec("zstd") == "zstd"
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        resolve_codec("lz4")
    import importlib.util

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # an install without zstandard
    assert resolve_codec("auto") == "none"
    with pytest.raises(ImportError, match="needs the zstandard package"):
        resolve_codec("zstd")


def test_a_tied_tensor_is_written_once_and_loads_under_both_names(tmp_path):
    """One process, plain tensors: the embedding/LM-head tie of small models appears under two names."""
    tied, other = torch.randn(50, 4), torch.arange(6, dtype=torch.int32)
    save_state(tmp_path, {"model": {"embed.weight": tied, "head.weight": tied, "step": other}}, 0, 1, threads=2)
    index = json.loads((tmp_path / "rank0.json").read_text())["tensors"]
    assert index["model/embed.weight"] == index["model/head.weight"]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.bin")) == tied.nbytes + other.nbytes
    target = {"model": {"embed.weight": torch.zeros(50, 4), "head.weight": torch.zeros(50, 4),
                        "step": torch.zeros(6, dtype=torch.int32)}}
    load_state(tmp_path, target)
    assert torch.equal(target["model"]["embed.weight"], tied) and torch.equal(target["model"]["head.weight"], tied)
    assert torch.equal(target["model"]["step"], other)
