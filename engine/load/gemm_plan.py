"""The GEMMs a model will compute, known before its weights upload (a kernels/warmup.py KernelPlan for
`ops.prepare_kernels`, which says why a backend wants them).

The shapes come from a dry build: the model family's own build (engine/models) runs on `_ShapeOps`, a stand-in
backend whose uploads return zero-stride placeholders of the right shape and dtype, so fused projections come out
exactly as the real build makes them, with no second description of each family, and the checkpoint is not read
(its tensors are memory-mapped views; only small vectors are touched). Of the model that results:
- the LM head(s) are multiplied with fp32 output (`ops.logits`), for up to `max_logit_rows` rows: a step's
  sequences, a decode batch bucket;
- every other 2-D weight the model holds that was uploaded in the storage dtype is a linear layer (`ops.linear`),
  for up to `max_step_tokens` rows, except the embedding tables (read by `ops.embed`, never multiplied). A MoE router
  counts as linear although the forward multiplies it with fp32 output: its fp32 product stays cold.
Expert weights are 3-D (grouped GEMMs of our own kernels, loaded with their module), so they are not in the plan.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from prefixrun.engine.load.config import DecoderConfig
from prefixrun.engine.models import build_model
from prefixrun.engine.request import DEFAULT_PREFILL_TOKENS
from prefixrun.kernels.warmup import GemmShape, KernelPlan, row_ladder

# logits rows beyond this stay cold unless the run's --max-batch says more (a decode bucket or a prefill group of
# more sequences is rare; the scratch for them grows with the vocabulary: 512 x 152k fp32 = 0.3 GB)
DEFAULT_LOGIT_ROWS = 512


class _ShapeOps:
    """The part of the backend a model build uses (uploads), returning placeholders instead of device arrays:
    np.broadcast_to of one zero row, so a [V, D] stand-in costs D elements. Remembers which uploads were weights
    in the storage dtype (no dtype given: matrices, tables, experts), as opposed to fp32 parameters (norms, gates,
    conv taps, which the layers upload with an explicit dtype even where fp32 is the storage dtype)."""

    max_conv_width = None  # any width here: the real build checks the backend's (a dry build must not fail first)
    max_ssm_state = None  # likewise
    per_channel_decay = True  # likewise (Kimi's KDA asks whether the backend takes a decay per key channel)

    def __init__(self, act_dtype):
        self.act_dtype = act_dtype
        self.stored: dict[int, np.ndarray] = {}  # id -> placeholder of a storage-dtype upload (kept: ids stay unique)
        self.kept: list[np.ndarray] = []  # the others, kept for the same reason
        self.nbytes = 0  # what the real uploads will take on the device

    def _placeholder(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dt = np.dtype(dtype or self.act_dtype)
        a = np.broadcast_to(np.zeros(shape[-1:], dt), shape)
        if dtype is None:
            self.stored[id(a)] = a
        else:
            self.kept.append(a)
        self.nbytes += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return a

    def upload(self, host_array, dtype=None):
        return self._placeholder(tuple(np.shape(host_array)), dtype)

    def upload_rows(self, host_parts, dtype=None):
        shapes = [tuple(np.shape(p)) for p in host_parts]
        return self._placeholder((sum(s[0] for s in shapes),) + shapes[0][1:], dtype)

    def upload_linear(self, host_parts):
        return self.upload_rows(host_parts)

    def upload_mxfp4(self, blocks, scales):
        return self._placeholder(tuple(np.shape(blocks)[:-2]) + (np.shape(blocks)[-2] * 32,), None)

    def upload_permuted(self, part, view_shape, axes):
        return self._placeholder(tuple(view_shape[a] for a in axes), None)


def _held_arrays(root) -> dict[int, np.ndarray]:
    """Every numpy array reachable from the model object through engine.models objects, lists, tuples and dicts."""
    seen, found, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif type(obj).__module__.startswith("prefixrun.engine.models"):
            todo.extend(vars(obj).values())
    return found


def model_plan(cfg: DecoderConfig, tensors, act_dtype, *, mtp: bool = False, max_step_tokens: int = DEFAULT_PREFILL_TOKENS,
               max_logit_rows: int | None = None) -> KernelPlan:
    """The GEMMs of `cfg`'s model (with its MTP head when `mtp`) as the forward runs them on a backend storing
    `act_dtype`: linear layers for 1..max_step_tokens rows, the LM head for 1..max_logit_rows (default
    DEFAULT_LOGIT_ROWS, at most max_step_tokens); and the weights' device bytes. Raises what the build raises."""
    ops = _ShapeOps(act_dtype)
    return _plan_of(build_model(cfg, tensors.shapes_only(), ops, mtp), ops, max_step_tokens, max_logit_rows)


def _plan_of(model, ops: _ShapeOps, max_step_tokens: int = DEFAULT_PREFILL_TOKENS,
             max_logit_rows: int | None = None) -> KernelPlan:
    """model_plan of a model that a dry build on `ops` made."""
    heads = [model.lm_head] + ([model.mtp.lm_head] if model.mtp is not None else [])
    tables = [model.embed_tokens] + ([model.mtp.embed_tokens] if model.mtp is not None else [])
    head_ids = {id(a) for a in heads}
    skip = {id(a) for a in tables} - head_ids
    linear_rows = row_ladder(max_step_tokens)
    logit_rows = row_ladder(min(max_logit_rows or DEFAULT_LOGIT_ROWS, max_step_tokens))
    shapes: dict[tuple[int, int, str], tuple[int, ...]] = {}
    for key, a in _held_arrays(model).items():
        if key not in ops.stored or a.ndim != 2 or key in skip:
            continue
        output = "float32" if key in head_ids else "act"
        shapes[(int(a.shape[0]), int(a.shape[1]), output)] = logit_rows if key in head_ids else linear_rows
    gemms = tuple(GemmShape(n, k, rows, output) for (n, k, output), rows in sorted(shapes.items()))
    return KernelPlan(gemms, ops.nbytes)


def dry_state_specs(cfg: DecoderConfig, tensors, act_dtype, *, mtp: bool = False, kv_cache_dtype: str = "auto"):
    """The state regions (RegionSpecs) of `cfg`'s model, from the same dry build: known before the weights upload
    (the persistent cache's layout key, engine/cache/opening.py). Raises what the build raises."""
    return dry_build(cfg, tensors, act_dtype, mtp=mtp, kv_cache_dtype=kv_cache_dtype)[0]


def dry_build(cfg: DecoderConfig, tensors, act_dtype, *, mtp: bool = False,
              kv_cache_dtype: str = "auto") -> tuple[list, list[str], Callable[..., KernelPlan]]:
    """(the state regions, the names of the tensors the build uploads as stored, in the order it asks for them:
    the order the weights are read ahead in, engine/load/weights.py; `gemms(max_step_tokens, max_logit_rows)`,
    model_plan's KernelPlan from this same dry build, so the warm-up needs no build of its own) from one dry
    build. Raises what the build raises."""
    order: list[str] = []
    ops = _ShapeOps(act_dtype)
    model = build_model(cfg, tensors.shapes_only(order), ops, mtp, kv_cache_dtype)
    return model.state_specs(), order, functools.partial(_plan_of, model, ops)
