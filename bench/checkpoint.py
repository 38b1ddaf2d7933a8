"""Where a checkpoint's seconds go: disk, device-to-host copy, DCP's writer, ours. Prints a table and one JSON line.

  python bench/checkpoint.py --shape 7b --dir /root/ckpt          # one GPU: Qwen2-7B shape, bf16 + AdamW moments
  python bench/checkpoint.py --shape tiny --device cpu --dir /tmp/ck   # the same on CPU (a smoke run)

The model (random weights, the shape of bench/grpo_step.py) is sharded with the trainer's own `shard` on a
one-rank process group and given AdamW moments by one optimizer step, so the state written is exactly what
the trainer writes: bf16 parameters + two bf16 moments (7B: 45 GB). Then, in one process:

- raw disk: sequential writes of --disk-gb GB by 1 and by 8 threads, fsynced (the ceiling for any writer);
- device-to-host: one 2 GB copy into pageable and into pinned host memory;
- raw state bytes: every tensor of the state copied through a pinned buffer per thread and appended to one of
  8 files, fsynced: no format, no metadata (the floor for writing this state uncompressed, not a checkpoint);
- ours: `checkpoint.save_shards` + `checkpoint.finalize` as the trainer calls them, once per --codecs value
  (`state_files`; none: the raw row's streaming plus an index and a CRC32 per tensor; zstd: the same with
  each tensor's most significant byte plane compressed), then `load_shards` into a perturbed model,
  checking that parameters and moments come back bit-exact;
- each DCP variant picked by --variants (torch.distributed.checkpoint, what the trainer used until
  2026-12-05; variant 0 is its setting): writer threads, torch.save CRC32 on/off, fsync in the writer
  threads or afterwards. After one untimed warm-up save, each writes the full state into a fresh
  directory, is timed to durable (all files fsynced), then deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpo_step import SHAPES, Peaks  # noqa: E402
from verl_agent.trainer.persistence.state_files import write_back  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
# (name, writer threads, torch.save CRC32, fsync inside DCP's writer threads)
VARIANTS = [("threads 8, crc, fsync after (one file at a time)", 8, True, False),
            ("threads 8, crc, fsync in writers", 8, True, True),
            ("threads 8, no crc, fsync in writers", 8, False, True),
            ("threads 16, no crc, fsync in writers", 16, False, True)]


def fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def disk_gbps(root: Path, gb: float, threads: int) -> float:
    """Sequential buffered writes of `gb` GB split over `threads` files, writeback started per 64 MB (as the
    trainer's writer does), fsynced: GB/s to durable."""
    root.mkdir(parents=True, exist_ok=True)
    chunk = bytes(64 << 20)
    per = max(1, int(gb * 1e9 / threads / len(chunk)))

    def write(i: int) -> None:
        with open(root / f"disk_{i}", "wb") as f:
            for _ in range(per):
                write_back(f, memoryview(chunk))
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(write, range(threads)))
    dt = time.perf_counter() - t0
    shutil.rmtree(root)
    return per * threads * len(chunk) / dt / 1e9


def d2h_gbps(pinned: bool) -> float:
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=pinned)
    dst.copy_(src)  # warm up (page faults of a fresh pageable buffer happen here)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    return src.numel() / (time.perf_counter() - t0) / 1e9


def build(shape: str, device: str):
    """The trainer's sharded model + fused AdamW with its moments allocated (one step on zero gradients)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl_agent.trainer.policy.fsdp import shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    cfg = Qwen2Config(**(TINY if shape == "tiny" else SHAPES[shape]))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = shard(model, init_device_mesh(device, (1,)), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def save_variant(path: Path, model, opt, threads: int, crc32: bool, sync_in_writers: bool) -> float:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.serialization.set_crc32_options(crc32)
    try:
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)
        writer = dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=sync_in_writers)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
        fsync_tree(path)
        return time.perf_counter() - t0
    finally:
        torch.serialization.set_crc32_options(True)


def raw_state_save(path: Path, model, opt, threads: int = 8) -> float:
    """Seconds to write the state's bare bytes through a pinned buffer per thread into `threads` files, fsynced."""
    import torch

    moments = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in [*model.parameters(), *moments]]
    cuda = local[0].is_cuda
    path.mkdir(parents=True)

    def write(i: int) -> None:
        stream = torch.cuda.Stream() if cuda else None
        buf = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=cuda)
        with open(path / f"raw_{i}", "wb") as f:
            for t in local[i::threads]:
                flat = t.detach().reshape(-1).view(torch.uint8)
                for off in range(0, flat.numel(), buf.numel()):
                    n = min(buf.numel(), flat.numel() - off)
                    if cuda:
                        with torch.cuda.stream(stream):
                            buf[:n].copy_(flat[off:off + n], non_blocking=True)
                        stream.synchronize()
                    else:
                        buf[:n].copy_(flat[off:off + n])
                    write_back(f, memoryview(buf[:n].numpy()))
            f.flush()
            os.fsync(f.fileno())

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(write, range(threads)))
    return time.perf_counter() - t0


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="7b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dir", type=Path, required=True, help="where to write (the run directory's disk)")
    ap.add_argument("--disk-gb", type=float, default=8.0)
    ap.add_argument("--variants", default="all", help="comma-separated indices into VARIANTS, 'all' or 'none'")
    ap.add_argument("--codecs", default="none,zstd", help="trainer.checkpoint_compression values to time")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the variants (the disk is noisy)")
    args = ap.parse_args()

    import torch

    from verl_agent.trainer.persistence import checkpoint as ckpt

    args.dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"shape": args.shape, "device": args.device, "dir": str(args.dir)}

    def row(label: str, value) -> None:  # printed as measured: a run cut short still says what it got
        print(f"  {label:<58} {value:.2f}" if isinstance(value, float) else f"  {label:<58} {value}", flush=True)

    print(f"checkpoint bench, {args.shape} shape, writing into {args.dir}", flush=True)
    for threads in (1, 8):
        res[f"disk_gbps_{threads}_threads"] = gbps = disk_gbps(args.dir / "disk", args.disk_gb, threads)
        row(f"raw disk, {threads} thread(s), fsynced (GB/s)", gbps)
    if args.device == "cuda":
        for pinned in (False, True):
            res[f"d2h_gbps_{'pinned' if pinned else 'pageable'}"] = gbps = d2h_gbps(pinned)
            row(f"device to host, {'pinned' if pinned else 'pageable'} (GB/s)", gbps)
    t0 = time.perf_counter()
    model, opt = build(args.shape, args.device)
    res["build_s"] = time.perf_counter() - t0
    raw = args.dir / "raw_state"
    shutil.rmtree(raw, ignore_errors=True)
    res["raw_state_s"] = sec = raw_state_save(raw, model, opt)
    res["raw_state_gb"] = size = tree_bytes(raw) / 1e9
    row("raw state bytes, pinned staging, 8 files: s (GB/s)", f"{sec:.1f} ({size / sec:.2f})")
    shutil.rmtree(raw)

    # ours, as the trainer calls it, once per codec; then load into a perturbed model and compare bit for bit
    p0 = next(iter(model.parameters()))
    want_p, want_m = p0.detach().full_tensor().clone(), opt.state[p0]["exp_avg"].full_tensor().clone()
    for codec in args.codecs.split(","):
        run = args.dir / "run"
        shutil.rmtree(run, ignore_errors=True)
        with Peaks(gpu=False, period=0.05) as rss:
            t0 = time.perf_counter()
            tmp = ckpt.tmp_dir(run, 1)
            ckpt.save_shards(tmp, "actor", model, opt, codec)
            final = ckpt.finalize(tmp, {"step": 1})
            res[f"ours_{codec}_save_s"] = time.perf_counter() - t0
        res[f"ours_{codec}_gb"], res[f"ours_{codec}_peak_rss_gb"] = tree_bytes(final) / 1e9, rss.rss / 1e9
        row(f"ours, {codec}: save_shards + finalize, {res[f'ours_{codec}_gb']:.1f} GB: s (peak RSS GB)",
            f"{res[f'ours_{codec}_save_s']:.1f} ({res[f'ours_{codec}_peak_rss_gb']:.1f})")
        with torch.no_grad():
            p0.mul_(0).add_(1)
            opt.state[p0]["exp_avg"].zero_()
        t0 = time.perf_counter()
        ckpt.load_shards(final, "actor", model, opt)
        res[f"ours_{codec}_load_s"] = time.perf_counter() - t0
        res[f"ours_{codec}_load_exact"] = bool(torch.equal(p0.detach().full_tensor(), want_p)
                                               and torch.equal(opt.state[p0]["exp_avg"].full_tensor(), want_m))
        row(f"ours, {codec}: load_shards (s), bit-exact",
            f"{res[f'ours_{codec}_load_s']:.1f}, {res[f'ours_{codec}_load_exact']}")
        shutil.rmtree(run)

    # DCP, after ours: its saves hold the whole state in host memory, which must not warm anything for ours
    picked = (list(range(len(VARIANTS))) if args.variants == "all" else [] if args.variants == "none"
              else [int(i) for i in args.variants.split(",")])
    res["variants"] = []
    if picked:  # DCP's first save pays one-time costs (allocator, page cache); not timed
        warm = args.dir / "warmup"
        res["warmup_s"] = save_variant(warm, model, opt, 8, True, True)
        row("DCP warm-up save, untimed below (s)", res["warmup_s"])
        shutil.rmtree(warm)
    for i in picked * args.repeat:
        name, threads, crc, sync = VARIANTS[i]
        path = args.dir / f"variant_{i}"
        shutil.rmtree(path, ignore_errors=True)
        with Peaks(gpu=False, period=0.05) as rss:
            sec = save_variant(path, model, opt, threads, crc, sync)
        size = tree_bytes(path)
        res["variants"].append({"name": name, "index": i, "seconds": sec, "gb": size / 1e9, "gbps": size / sec / 1e9,
                                "peak_rss_gb": rss.rss / 1e9})
        row(f"DCP {name}: s (GB/s, peak RSS GB)", f"{sec:.1f} ({size / sec / 1e9:.2f}, {rss.rss / 1e9:.1f})")
        shutil.rmtree(path)

    print(json.dumps({"bench": "checkpoint", **res}))


if __name__ == "__main__":
    main()
