"""data: the prompt files, batch sizes, token budgets and prompt handling (read by `verl_agent.data` and
`rollout.build`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from verl_agent.config.base import Section

__all__ = ["DataConfig"]


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list,
                                   description="JSONL/parquet training files, or folders of Harbor task directories")
    val_files: list[str] = Field(default_factory=list,
                                 description="JSONL/parquet validation files, or folders of Harbor task directories")
    train_file: str | None = Field(None, description="single training file (quick-start spelling of train_files)")
    val_file: str | None = Field(None, description="single validation file (quick-start spelling of val_files)")
    train_batch_size: int = Field(8, ge=1, description="prompts per training step")
    val_batch_size: int | None = Field(None, ge=1, description="prompts per validation batch (None: whole set)")
    max_prompt_length: int = Field(512, ge=1, description="prompt token budget (tool schemas included); "
                                   "longer prompts: see filter_overlong_prompts and truncation")
    max_response_length: int = Field(256, ge=1, description="response token budget over all turns")
    reward_fn: str | None = Field(None, description="'module.func' or 'path/file.py:func'")
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    shuffle: bool = True
    seed: int = 0
    skip_bad_rows: bool = Field(False, description="skip malformed rows (counted and reported) instead of failing")
    filter_overlong_prompts: bool = Field(False, description="drop prompts over max_prompt_length before "
                                          "generation (outcome 'filtered', counted as rollout/filtered)")
    return_raw_chat: bool = Field(True, description="verl's key; messages are always kept (false is refused)")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="prompts over max_prompt_length: error (an infrastructure failure naming the prompt), "
        "or cut the left/right side of the prompt tokens")

    @model_validator(mode="after")
    def _merge_single_files(self) -> DataConfig:
        if self.train_file and self.train_file not in self.train_files:
            self.__dict__["train_files"] = [self.train_file, *self.train_files]
        if self.val_file and self.val_file not in self.val_files:
            self.__dict__["val_files"] = [self.val_file, *self.val_files]
        return self
