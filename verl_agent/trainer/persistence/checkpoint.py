"""Checkpoints: never half-written, verified on load, always resumable.

Layout under ``<run dir>/checkpoints``::

    global_step_4/                  a complete checkpoint (renamed into place last)
        actor/  critic/             model + optimizer: per rank rank{r}_{i}.bin + rank{r}.json (state_files.py)
        extra_rank{r}.pt            per-rank LR scheduler and RNG states
        driver_state.json           step, data position, driver RNG, metrics of the step
        complete.json               the completion marker: every file above with its size (written last)
    global_step_8.tmp/              being written (or left by a crash): ignored, removed on the next save
    latest_checkpointed_iteration.txt   the newest complete step (verl's file name), replaced atomically

A save goes: all ranks write into ``.tmp``; the driver writes its state, fsyncs every
file, writes the marker (fsynced), fsyncs the directories, renames ``.tmp`` into place
(an atomic rename on one filesystem), fsyncs the parent and only then replaces the
"latest" file. A crash or a full disk at any point leaves the previous checkpoint and
"latest" intact. On load, a checkpoint counts only if its marker is there and every
file it lists has its recorded size (a truncated or missing file fails the check);
`find_latest` falls back to the newest checkpoint that passes and says why it skipped
the others. Sizes, not checksums, here: hashing every file would cost a full read per save; the
shards carry a CRC32 per tensor, computed while writing and checked when read.
Multi-node runs need the run directory on storage every node can write.

Both writers stream: `state_files` writes each rank's own shards with several threads
through reused staging buffers (no full state is ever assembled), and `export_hf` gathers the full weights a
bucket at a time on the device and writes safetensors files of ``shard_bytes``,
so host memory holds at most one file's worth of tensors.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from verl_agent.trainer.policy.policy import Policy

__all__ = ["CKPT_DIR", "LATEST", "MARKER", "tmp_dir", "finalize", "discard", "verify", "find_latest",
           "latest_checkpoint", "driver_state", "restore_driver_rng", "save_shards", "load_shards", "save_policy",
           "load_policy", "export_hf", "export_lora", "resolve_checkpoint", "load_checkpoint_model"]

logger = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
LATEST = "latest_checkpointed_iteration.txt"
MARKER = "complete.json"


def tmp_dir(run_dir: Path, step: int) -> Path:
    root = run_dir / CKPT_DIR
    for stale in root.glob("*.tmp"):  # left by an interrupted save
        shutil.rmtree(stale, ignore_errors=True)
    path = root / f"global_step_{step}.tmp"
    path.mkdir(parents=True)
    return path


def finalize(tmp: Path, state: dict[str, Any]) -> Path:
    """Write the driver state and the completion marker, make it all durable, rename into place, point "latest" at it."""
    _write_durable(tmp / "driver_state.json", json.dumps(state))
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync_path(f)
        files[f.relative_to(tmp).as_posix()] = f.stat().st_size
    _write_durable(tmp / MARKER, json.dumps({"step": state["step"], "files": files}))
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [tmp]:
        _fsync_path(d)  # the directory entries of the files, deepest first
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    if final.exists():  # a rerun of a step whose old checkpoint failed verification
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(final.parent)
    latest = final.parent / LATEST
    part = latest.with_suffix(".part")
    _write_durable(part, str(state["step"]))
    os.replace(part, latest)
    _fsync_path(final.parent)
    return final


def discard(tmp: Path) -> None:
    """Remove a checkpoint that failed while being written (frees the space a full disk needs back)."""
    shutil.rmtree(tmp, ignore_errors=True)


def verify(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None when it is (marker present, every listed file intact)."""
    if not path.is_dir():
        return "it does not exist"
    try:
        files = dict(json.loads((path / MARKER).read_text())["files"])
    except FileNotFoundError:
        return f"no completion marker ({MARKER}): it was never finished"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its completion marker {MARKER} is unreadable ({type(e).__name__}: {e})"
    for name, size in files.items():
        try:  # one stat: the checkpoint may be being replaced by a running trainer while another process looks
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is {actual} bytes, {size} when written (truncated or overwritten)"
    return None


def find_latest(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint (or None), and one line per newer checkpoint skipped and why."""
    root = run_dir / CKPT_DIR
    steps = sorted((int(p.name.rsplit("_", 1)[1]), p) for p in root.glob("global_step_*")
                   if p.is_dir() and not p.name.endswith(".tmp") and p.name.rsplit("_", 1)[1].isdigit())
    skipped = []
    latest = root / LATEST
    if latest.is_file():
        named = root / f"global_step_{latest.read_text().strip()}"
        if not named.exists():
            skipped.append(f"{LATEST} names {named.name}, which does not exist")
    for _, path in reversed(steps):
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name} is not a complete checkpoint: {problem}")
    return None, skipped


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None; logs a warning for every newer one it had to skip."""
    path, skipped = find_latest(run_dir)
    for line in skipped:
        logger.warning("%s", line)
    return path


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def driver_state(step: int, data_state: dict, extra: dict | None = None) -> dict[str, Any]:
    """What the driver needs to continue: step, data position and its own RNG (for shuffles/seeds)."""
    py = random.getstate()
    return {"step": step, "data": data_state, "python_rng": [py[0], list(py[1]), py[2]],
            "torch_rng": torch.get_rng_state().tolist(), **(extra or {})}


def restore_driver_rng(state: dict[str, Any]) -> None:
    py = state["python_rng"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the frozen base is the model's own files, so a checkpoint holds the adapters and their moments
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _trainable(model: torch.nn.Module, model_sd: dict, optim_sd: dict, trainable_only: bool) -> tuple[dict, dict]:
    """With `trainable_only`, drop what ignore_frozen_params lets through: a frozen weight tied to another
    (the tied lm_head of the base) is not the trainer's to save."""
    if trainable_only:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in names}
    return model_sd, optim_sd


def save_shards(path: Path, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                codec: str = "none", threads: int | None = None, trainable_only: bool = False) -> None:
    """Collective: every rank writes its shard of model + optimizer state (`state_files`), ``threads`` files
    at once through one staging buffer each, fsynced by the writers; `codec` as trainer.checkpoint_compression.
    ``trainable_only``: the parameters that train (LoRA adapters), not the frozen ones."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from verl_agent.trainer.persistence.state_files import save_state

    model_sd, optim_sd = _trainable(model, *get_state_dict(model, optimizer, options=_options(trainable_only)),
                                    trainable_only)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    save_state(path / name, {"model": model_sd, "optim": optim_sd}, rank, world, threads, codec)


def load_shards(path: Path, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                trainable_only: bool = False) -> None:
    """Collective: load this rank's shard in place (from a checkpoint of any world size; CRC32-checked)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from verl_agent.trainer.persistence.state_files import load_state

    options = _options(trainable_only)
    model_sd, optim_sd = _trainable(model, *get_state_dict(model, optimizer, options=options), trainable_only)
    state = load_state(path / name, {"model": model_sd, "optim": optim_sd})
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)


def save_policy(policy: Policy, path: Path, codec: str, rank: int) -> None:
    """Collective: every rank writes its actor (+ critic) shards and its LR-scheduler and RNG states."""
    from verl_agent.trainer.persistence.state_files import save_object

    save_shards(path, "actor", policy.actor, policy.optim, codec, trainable_only=policy.lora)
    extra = {"sched": policy.sched.state_dict(), "torch_rng": torch.get_rng_state()}
    if policy.critic is not None:
        save_shards(path, "critic", policy.critic, policy.critic_optim, codec)
        extra["critic_sched"] = policy.critic_sched.state_dict()
    save_object(extra, path / f"extra_rank{rank}.pt")
    dist.barrier()


def load_policy(policy: Policy, path: Path, rank: int) -> None:
    """Collective: load what `save_policy` wrote, from a checkpoint of any world size (a rank beyond the
    saved ones takes the last saved rank's scheduler and RNG states)."""
    load_shards(path, "actor", policy.actor, policy.optim, trainable_only=policy.lora)
    saved_ranks = len(list(path.glob("extra_rank*.pt")))
    extra = torch.load(path / f"extra_rank{min(rank, saved_ranks - 1)}.pt", weights_only=False)
    policy.sched.load_state_dict(extra["sched"])
    torch.set_rng_state(extra["torch_rng"])
    if policy.critic is not None:
        load_shards(path, "critic", policy.critic, policy.critic_optim)
        policy.critic_sched.load_state_dict(extra["critic_sched"])


def export_hf(model: nn.Module, model_path: str, tokenizer_path: str, out_dir: str | Path, rank: int,
              dtype: torch.dtype | None = None, shard_bytes: int = 2 << 30) -> str | None:
    """Collective: write the full (unsharded) model as a Hugging Face folder; rank 0 writes, returns out_dir there.

    Streams: parameters are gathered on the device a bucket at a time (`iter_full_param_buckets`),
    copied to host memory only for the safetensors file being written (at most ``shard_bytes``,
    plus one bucket), then freed. Config and generation config come from ``model_path``, the
    tokenizer from ``tokenizer_path``. ``dtype`` (default: the parameters' own) is what is written,
    and the config says so. Everything lands in ``out_dir.tmp`` first and is renamed into place, so a
    reader never sees a half-written export. Tied weights are written once, as transformers does.
    """
    from verl_agent.trainer.policy.fsdp import iter_full_param_buckets

    buffers = dict(model.named_buffers())
    names = [n for n, _ in model.named_parameters()] + _persistent_buffers(model)
    sizes = {n: (t.numel(), dtype or t.dtype) for n, t in list(model.named_parameters()) + list(buffers.items())}
    gathered = ((n, t) for bucket in iter_full_param_buckets(model, min(shard_bytes, 512 << 20), dtype)
                for n, t in bucket)
    tensors = _chain(gathered, ((n, buffers[n]) for n in names if n in buffers))
    return _write_hf(tensors, names, sizes, set(buffers), (model_path, tokenizer_path), Path(out_dir), rank,
                     dtype or next(model.parameters()).dtype, shard_bytes)


def _write_hf(tensors, names: list[str], sizes: dict[str, tuple[int, torch.dtype]], buffers: set[str],
              sources: tuple[str, str], out: Path, rank: int, dtype: torch.dtype, shard_bytes: int) -> str | None:
    """`export_hf`'s writer: every rank consumes `tensors` (name, full tensor) in `names` order (the gathers
    are collective); rank 0 writes safetensors files of at most `shard_bytes`, the index, config and tokenizer
    (`sources`: model path, tokenizer path) into ``out.tmp`` and renames it into place."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    plan = _plan_files(names, sizes, shard_bytes)
    pending: dict[str, torch.Tensor] = {}
    file_of = {n: f for f, group in plan.items() for n in group}
    left = {f: set(group) for f, group in plan.items()}
    for name, tensor in tensors:
        if rank != 0:
            continue
        pending[name] = tensor.detach().to("cpu", sizes[name][1]).contiguous()
        f = file_of[name]
        left[f].discard(name)
        if not left[f]:  # this file is complete: write it and drop its tensors
            save_file({n: pending.pop(n) for n in plan[f]}, str(tmp / f), metadata={"format": "pt"})
    if rank != 0:
        return None
    if len(plan) > 1:
        total = sum(sizes[n][0] * sizes[n][1].itemsize for n in names if n not in buffers)
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for n, f in sorted(file_of.items())}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _write_configs(sources[0], sources[1], tmp, dtype)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return str(out)


def export_lora(model: nn.Module, model_path: str, tokenizer_path: str, out_dir: str | Path, rank: int,
                merged_dir: str | Path | None = None, shard_bytes: int = 2 << 30) -> str | None:
    """Collective, LoRA: a PEFT adapter folder at `out_dir` (adapter_config.json + adapter_model.safetensors +
    the tokenizer) that `peft.PeftModel.from_pretrained` loads; with `merged_dir` also the base with the
    adapters merged in, as a plain Hugging Face model (streamed like `export_hf`). Rank 0 writes."""
    from transformers import AutoTokenizer

    from verl_agent.trainer.weights import lora
    from verl_agent.trainer.policy.fsdp import iter_full_param_buckets

    adapters = {n: t.detach().cpu().clone() for bucket in
                iter_full_param_buckets(model, params=lora.adapter_parameters(model)) for n, t in bucket}
    if merged_dir is not None:
        _export_merged(model, adapters, (model_path, tokenizer_path), Path(merged_dir), rank, shard_bytes)
    if rank != 0:
        return None
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lora.export_adapter(model, adapters, model_path, tmp)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return str(out)


def _export_merged(model: nn.Module, adapters: dict[str, torch.Tensor], sources: tuple[str, str], out: Path,
                   rank: int, shard_bytes: int) -> None:
    from verl_agent.trainer.weights import lora
    from verl_agent.trainer.policy.fsdp import iter_full_param_buckets

    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    buffers = {lora.base_name(n): b for n, b in model.named_buffers()}
    names = [lora.base_name(n) for n, _ in frozen] + [lora.base_name(n) for n in _persistent_buffers(model)]
    sizes = {lora.base_name(n): (p.numel(), p.dtype) for n, p in frozen}
    sizes.update({n: (b.numel(), b.dtype) for n, b in buffers.items()})
    gathered = ((n, t) for bucket in iter_full_param_buckets(model, min(shard_bytes, 512 << 20), params=frozen)
                for n, t in bucket)
    merged = lora.merged_tensors(gathered, adapters, lora.lora_scaling(model))
    tensors = _chain(merged, ((n, buffers[n]) for n in names if n in buffers))
    _write_hf(tensors, names, sizes, set(buffers), sources, out, rank, frozen[0][1].dtype, shard_bytes)


def _chain(*iterables):
    for it in iterables:
        yield from it


def _persistent_buffers(model: nn.Module) -> list[str]:
    keys = set(model.state_dict().keys())
    return [n for n, _ in model.named_buffers() if n in keys]


def _plan_files(names: list[str], numels: dict[str, tuple[int, torch.dtype]], shard_bytes: int
                ) -> dict[str, list[str]]:  # fmt: skip
    """File name -> tensor names, in order, each file at most shard_bytes (a bigger tensor gets its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    sizes = {n: numel * dtype.itemsize for n, (numel, dtype) in numels.items()}
    for n in names:
        if groups[-1] and size + sizes[n] > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += sizes[n]
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    k = len(groups)
    return {f"model-{i + 1:05d}-of-{k:05d}.safetensors": g for i, g in enumerate(groups)}


def _write_configs(model_path: str, tokenizer_path: str, out: Path, dtype: torch.dtype) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    config.dtype = dtype
    config.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(out)
    except OSError:  # the source has no generation_config.json: neither does the export
        pass
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)


def resolve_checkpoint(path: Path) -> Path:
    """The complete checkpoint `path` names (itself, or a run dir's newest), whose run's config.yaml is there;
    raises naming what is missing."""
    path = Path(path)
    if not (path / MARKER).exists():
        latest, skipped = find_latest(path)
        if latest is None:
            raise FileNotFoundError(f"{path}: not a checkpoint (no {MARKER}) nor a run dir with a complete one"
                                    + (f" ({'; '.join(skipped)})" if skipped else ""))
        path = latest
    problem = verify(path)
    if problem:
        raise ValueError(f"{path}: incomplete checkpoint: {problem}")
    run_config = path.parent.parent / "config.yaml"
    if not run_config.is_file():
        raise FileNotFoundError(f"{path}: the run's {run_config.name} is not at {run_config} (it names the model)")
    return path


def load_checkpoint_model(path: Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, str]:
    """A trainer checkpoint's actor as a Hugging Face model on the CPU, in one process: `path` is a checkpoint
    (``global_step_N``) or a run dir (its newest complete checkpoint). Returns (model, base model path): the
    architecture and tokenizer come from the run's ``config.yaml`` (actor_rollout_ref.model)."""
    from transformers import AutoModelForCausalLM

    from verl_agent.config import load_config
    from verl_agent.rollout.build import import_external_lib, resolve_model_path
    from verl_agent.trainer.persistence.state_files import load_state

    path = resolve_checkpoint(path)
    model_cfg = load_config(str(path.parent.parent / "config.yaml")).actor_rollout_ref.model
    import_external_lib(model_cfg)
    base = resolve_model_path(model_cfg.path)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype or torch.float32,
                                                 trust_remote_code=model_cfg.trust_remote_code)
    load_state(path / "actor", {"model": model.state_dict()})  # fills the parameters in place, CRC-checked
    return model.eval(), resolve_model_path(model_cfg.tokenizer_path or model_cfg.path)
