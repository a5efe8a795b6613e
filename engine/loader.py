"""A model directory -> everything a run needs: backend ops, model, tokenizer and generation defaults."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from prefixrun.engine.config import DecoderConfig, load_config
from prefixrun.engine.models import build_model
from prefixrun.engine.models.layers import CausalLM
from prefixrun.engine.tokenizer import GenerationDefaults, Tokenizer
from prefixrun.engine.warmup import model_plan
from prefixrun.engine.weights import CheckpointTensors
from prefixrun.kernels import get_ops


@dataclass
class LoadedModel:
    path: Path
    config: DecoderConfig
    ops: object
    model: CausalLM
    tokenizer: Tokenizer
    defaults: GenerationDefaults
    tensors: CheckpointTensors

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.defaults.eos_token_ids

    def weights_digest(self, memo_dir: Path | None = None) -> str:
        """Content digest of the weights, remembered under `memo_dir` (the cache) so it is computed once."""
        return self.tensors.digest(memo_dir)


@dataclass
class ModelFront:
    """What turns lines into requests, without weights or a device: a run that hands its engine work to worker
    processes loads only this."""

    path: Path
    config: DecoderConfig
    tokenizer: Tokenizer
    defaults: GenerationDefaults


def load_front(model_dir: Path) -> ModelFront:
    model_dir = Path(model_dir)
    config, _ = load_config(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    defaults = GenerationDefaults.from_model_dir(model_dir, config_eos=list(config.eos_token_ids), tokenizer=tokenizer)
    return ModelFront(model_dir, config, tokenizer, defaults)


def load(model_dir: Path, device: str = "auto", dtype: str | None = None, mtp: bool = False, *,
         max_step_tokens: int = 8192, max_batch: int | None = None) -> LoadedModel:
    """`mtp`: load the checkpoint's MTP head too (--speculative mtp; an error when it ships none).
    `max_step_tokens` (tokens per prefill step) and `max_batch` (None: not known yet) bound the GEMM row counts the
    backend may get ready while the weights load (engine/warmup.py)."""
    front = load_front(model_dir)
    model_dir, config, tokenizer, defaults = front.path, front.config, front.tokenizer, front.defaults
    ops = get_ops(device, dtype)
    tensors = CheckpointTensors(model_dir)
    # in the background, while the weights load; the plan (a dry build of the model) is made there too
    ops.prepare_kernels(functools.partial(model_plan, config, tensors, ops.act_dtype, mtp=mtp,
                                          max_step_tokens=max_step_tokens, max_logit_rows=max_batch))
    return LoadedModel(model_dir, config, ops, build_model(config, tensors, ops, mtp), tokenizer, defaults, tensors)
