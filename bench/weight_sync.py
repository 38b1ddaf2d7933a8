"""Split placement's weight push, train rank 0 -> one RolloutWorker, per trainer.weight_transport.

    python bench/weight_sync.py --model 0.5b                # CPU: shared memory, gloo broadcast, object store
    python bench/weight_sync.py --device cuda --model 0.5b --transports auto object_store
                                                            # one GPU, half each: CUDA IPC vs object store
                                                            # (NCCL cannot join two ranks on one GPU)
    python bench/weight_sync.py --device cuda --model 7b --rollout-gpus 1
                                                            # two GPUs, one each: auto and collective are
                                                            # both the NCCL broadcast, then the object store

One WorkerGroup per trainer.weight_transport (placement split, one train rank, one rollout worker; the same
random Qwen2-shaped model as bench/async_train.py), one untimed push, then --repeat timed pushes, each
checked: the engine must end with the actor's weights. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from async_train import _setup  # noqa: E402  (same model and config as the async bench)


def _actor_digest(worker) -> float:
    """Sum of |w| over the actor's full parameters as the engine receives them, float64 (collective, on the
    train worker through its `run`)."""
    return float(sum(t.detach().double().abs().sum() for bucket in worker.policy.engine_weights()
                     for _, t in bucket))


def _engine_digest(rollout_worker) -> float:
    """Sum of |w| over the rollout worker's engine parameters (`hf` engine), float64."""
    return float(sum(p.detach().double().abs().sum() for p in rollout_worker.host.engine.model.parameters()))


def push(base: list[str], transport: str, repeat: int, rollout_gpus: float | None) -> dict[str, float]:
    import ray

    from verl_agent.config import load_config
    from verl_agent.trainer.workers.controller import WorkerGroup

    cfg = load_config(None, [*base, "trainer.placement=split", f"trainer.weight_transport={transport}",
                             "trainer.num_cpu_workers=1",
                             *([f"trainer.rollout_gpus_per_worker={rollout_gpus}"] if rollout_gpus else [])])
    group = WorkerGroup.create(cfg)
    try:  # auto maps rank 0's memory where it can: shared memory on CPU, CUDA IPC on a shared GPU
        own_card = rollout_gpus is not None and rollout_gpus >= 1
        route = {"auto": "collective" if own_card else "handle", "collective": "collective",
                 "object_store": "object_store"}[transport]
        assert group.routes == [route], f"{transport}: the rollout worker's route is {group.routes}"
        group.sync_weights(version=1)  # untimed: first touch of the staging memory, IPC handles opened
        seconds = []
        for version in range(2, repeat + 2):
            t0 = time.perf_counter()
            group.sync_weights(version=version)
            seconds.append(time.perf_counter() - t0)
        actor, = group.run(_actor_digest)
        engine, = group.run_on_rollouts(_engine_digest)
        if abs(engine - actor) > 1e-6 * actor:
            raise SystemExit(f"{transport}: the engine's weights differ from the actor's ({engine} vs {actor})")
        n_params = group.info[0]["num_parameters"]
    finally:
        group.shutdown()
        ray.shutdown()
    return {"push_s": statistics.median(seconds), "push_s_max": max(seconds), "parameters": n_params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="0.5b", choices=["tiny", "0.5b", "7b"])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--transports", nargs="+", default=["auto", "collective", "object_store"],
                   choices=["auto", "collective", "object_store"])
    p.add_argument("--rollout-gpus", type=float, default=0.5, choices=[0.5, 1.0],
                   help="cuda: the rollout worker's share of a GPU; 0.5 shares the train rank's card (one GPU), "
                        "1 gives it a card of its own (two GPUs: the weights go by NCCL broadcast)")
    args = p.parse_args()
    if args.device == "cuda" and args.rollout_gpus >= 1:
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit(f"--rollout-gpus 1 needs two GPUs, this machine has {torch.cuda.device_count()}")
    tmp = Path(tempfile.mkdtemp(prefix="weight-sync-bench-"))
    shape = argparse.Namespace(device=args.device, model=args.model, batch=1, steps=1, turns=1, max_new=8,
                               latency=[0.01, 0.01], workers=1, n=1)
    base = _setup(shape, tmp)
    gpu = args.device == "cuda"
    itemsize = 2 if gpu and args.model != "tiny" else 4  # bfloat16 on GPU (as async_train), else float32
    rows = {t: push(base, t, args.repeat, args.rollout_gpus if gpu else None) for t in args.transports}
    print(f"\n{'transport':<14}{'push s (median)':>16}{'max s':>8}{'GB/s':>8}")
    for name, r in rows.items():
        r["gb_per_s"] = r["parameters"] * itemsize / r["push_s"] / 1e9
        print(f"{name:<14}{r['push_s']:>16.3f}{r['push_s_max']:>8.3f}{r['gb_per_s']:>8.2f}")
    print(json.dumps({"bench": "weight_sync", "device": args.device, "model": args.model, "args": vars(args),
                      "transports": rows}))


if __name__ == "__main__":
    main()
