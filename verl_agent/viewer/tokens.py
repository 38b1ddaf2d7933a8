"""Per-token text for the token view, with the run's own tokenizer when it can be found locally.

Where to look, in order: <run dir>/hf_model (the trainer's exported model), then the run's
config.yaml `actor_rollout_ref.model.tokenizer_path` or `.model.path` ('tiny' = the embedded model).
Only local files are read (no hub download from a viewer); with no tokenizer the page shows ids.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

__all__ = ["TokenDecoder", "tokenizer_dir"]

log = logging.getLogger(__name__)


def tokenizer_dir(run_dir: Path) -> str | None:
    """The folder or model id whose tokenizer decoded this run, if the run says so."""
    if (run_dir / "hf_model" / "tokenizer.json").exists():
        return str(run_dir / "hf_model")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        return None
    try:
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
        model = (cfg.get("actor_rollout_ref") or {}).get("model") or {}
    except (yaml.YAMLError, AttributeError) as e:
        log.warning("viewer: cannot read %s: %s", cfg_path, e)
        return None
    path = model.get("tokenizer_path") or model.get("path")
    if path in ("tiny", "smollm2"):  # the built-in names resolve to cached folders
        from verl_agent.rollout.build import resolve_model_path

        path = resolve_model_path(path)
    return path


class TokenDecoder:
    """`decode(ids) -> list[str] | None`: one string per id, loaded lazily, None when unavailable."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._tok: Any = None
        self._loaded = False
        self.source: str | None = None

    def _load(self) -> None:
        self._loaded = True
        try:
            path = tokenizer_dir(self.run_dir)
        except (OSError, RuntimeError, ValueError, ImportError) as e:  # the viewer still shows ids
            log.warning("viewer: no tokenizer (%s); showing token ids", e)
            return
        if not path:
            return
        file = Path(path) / "tokenizer.json"
        try:
            if file.exists():  # the fast path: the tokenizers library alone, no transformers import
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(file))
            else:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.source = path
        except (OSError, RuntimeError, ValueError, ImportError) as e:  # a foreign tokenizer must not break the page
            log.warning("viewer: cannot load the tokenizer at %s (%s); showing token ids", path, e)

    def decode(self, ids: list[int]) -> list[str] | None:
        if not self._loaded:
            self._load()
        if self._tok is None:
            return None
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]
