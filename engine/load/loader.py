"""A model directory -> everything a run needs: backend ops, model, tokenizer and generation defaults."""
from __future__ import annotations

import functools
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.load.config import DecoderConfig
from prefixrun.engine.load.hf_config import load_config
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.request import DEFAULT_PREFILL_TOKENS
from prefixrun.engine.models import build_model
from prefixrun.engine.models.layers import CausalLM
from prefixrun.engine.load.tokenizer import GenerationDefaults, Tokenizer
from prefixrun.engine.load.gemm_plan import dry_build, dry_state_specs, model_plan
from prefixrun.engine.load.quantization import open_quantized
from prefixrun.engine.load.weights import CheckpointTensors
from prefixrun.engine.startup import NO_CLOCK
from prefixrun.kernels import get_ops, start_weight_reads


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

    def weights_digest(self, memo_dir: Path | None = None, *, remembered_only: bool = False) -> str | None:
        """Content digest of the weights, remembered under `memo_dir` (the cache) so it is computed once
        (`remembered_only`: the remembered one or None, nothing hashed)."""
        return self.tensors.digest(memo_dir, remembered_only=remembered_only)

    def state_specs(self):
        return self.model.state_specs()


@dataclass
class ModelFront:
    """What turns lines into requests, without weights or a device: a run that hands its engine work to worker
    processes loads only this."""

    path: Path
    config: DecoderConfig
    tokenizer: Tokenizer
    defaults: GenerationDefaults


def refuse_special_files(model_dir: Path) -> None:
    """A FIFO, a device or a socket among the model folder's files (config.json, *.safetensors, tokenizer.json ...)
    is one clear error: opening a FIFO waits for a writer forever, and a device may read without end."""
    try:
        names = sorted(os.listdir(model_dir))
    except OSError:
        return  # load_config says what is wrong with the folder
    for name in names:
        path = Path(model_dir) / name
        try:
            mode = path.stat().st_mode  # through a link: what would be opened
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
                else "not a regular file"
            raise ModelLoadError(f"{path}: {kind}, not a model file (a model folder holds regular files)")


def load_front(model_dir: Path) -> ModelFront:
    model_dir = Path(model_dir)
    refuse_special_files(model_dir)
    config, _ = load_config(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    defaults = GenerationDefaults.from_model_dir(model_dir, config_eos=list(config.eos_token_ids), tokenizer=tokenizer,
                                                 vocab_size=config.vocab_size)
    return ModelFront(model_dir, config, tokenizer, defaults)


_READS_WAIT_S = 60.0  # a digest waits for the weights' reads at most this long (a load that never ends)


@dataclass
class Loading:
    """A load under way: what is known before the weights upload (the front, the backend, the checkpoint's files),
    so that work needing only that (the persistent cache's key and its read-ahead: engine/cache/opening.py) can
    run on another thread while `finish` uploads the weights on this one."""

    front: ModelFront
    ops: object
    tensors: CheckpointTensors
    mtp: bool
    kv_cache_dtype: str = "auto"  # how attention K/V rows are stored (--kv-cache-dtype)
    _specs: list | None = field(default=None, init=False, repr=False)
    weight_reads: dict | None = field(default=None, init=False)  # what the read-ahead did (ReadFigures.as_dict)
    digest_seconds: float | None = field(default=None, init=False)  # the weights' hashing, where no memo held it
    _reads_done: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    @property
    def path(self) -> Path:
        return self.front.path

    @property
    def config(self) -> DecoderConfig:
        return self.front.config

    def weights_digest(self, memo_dir: Path | None = None, *, remembered_only: bool = False) -> str | None:
        """As LoadedModel's. Hashing (no memo holds the digest) first waits for the weights' reads: both read every
        byte of the files on most cores, and the reads are what the run waits for (run beside them, the reads of a
        4b-like model fell from 22 to 6.6 GB/s)."""
        remembered = self.tensors.digest(memo_dir, remembered_only=True)
        if remembered is not None or remembered_only:
            return remembered
        self._reads_done.wait(_READS_WAIT_S)
        started = time.perf_counter()
        try:
            return self.tensors.digest(memo_dir)
        finally:
            self.digest_seconds = round(time.perf_counter() - started, 4)

    def wait_weight_reads(self, timeout: float = _READS_WAIT_S) -> bool:
        """Wait until the weights' read-ahead has read its last byte (at once where none runs; at most `timeout`
        seconds). Other bulk reads of the host's files (the persistent cache's read-ahead) start then: beside the
        weights' reads they share the memory bandwidth and the interpreter's lock with them, and it is the weights
        the load waits for. False when `timeout` passed first."""
        return self.tensors.wait_read_ahead(timeout)

    def state_specs(self):
        """The state regions the model will have, from a dry build (no weight is uploaded; engine/load/gemm_plan.py)."""
        if self._specs is None:
            self._specs = dry_state_specs(self.config, self.tensors, self.ops.act_dtype, mtp=self.mtp,
                                          kv_cache_dtype=self.kv_cache_dtype)
        return self._specs

    def start_reads(self, plan: tuple | None, early=None) -> None:
        """Read the weights into the backend's memory in the order the build will upload them. `plan`: (act dtype,
        state regions, upload order, GEMM plan function) of a dry build made before the backend existed (`dry_plan`; its regions are
        `state_specs`' where its act dtype is the backend's), None where it failed (the build reports why);
        `early`: the reads started already (kernels/__init__.py start_weight_reads), None: started here."""
        if plan is None:
            self.weight_reads = {"error": "no read-ahead: the dry build failed (the build says why)"}
            return
        act, specs, order, _ = plan
        if np.dtype(act) == np.dtype(self.ops.act_dtype):
            self._specs = specs
        self.tensors.read_ahead(order, (lambda spans: early) if early is not None else self.ops.read_weights)

    def finish(self) -> LoadedModel:
        """Upload the weights: the loaded model."""
        f = self.front
        try:
            model = build_model(f.config, self.tensors, self.ops, self.mtp, self.kv_cache_dtype)
        finally:
            self.weight_reads = self.tensors.end_read_ahead() or self.weight_reads
            self._reads_done.set()
        return LoadedModel(f.path, f.config, self.ops, model, f.tokenizer, f.defaults, self.tensors)


def dry_plan(config: DecoderConfig, tensors, act_dtype, mtp: bool, kv_cache_dtype: str = "auto") -> tuple | None:
    """(act_dtype, state regions, the names the build uploads as stored in its order, its GEMMs' plan function)
    of a dry build (engine/load/gemm_plan.py); None where it fails (the real build raises it again, as the user's
    error)."""
    try:
        specs, order, gemms = dry_build(config, tensors, act_dtype, mtp=mtp, kv_cache_dtype=kv_cache_dtype)
    except Exception:  # noqa: BLE001 - see above
        return None
    return act_dtype, specs, order, gemms


def start_load(model_dir: Path, device: str = "auto", dtype: str | None = None, mtp: bool = False, *,
               max_step_tokens: int = DEFAULT_PREFILL_TOKENS, max_batch: int | None = None,
               front: ModelFront | None = None, deterministic: bool = False, kv_cache_dtype: str = "auto",
               clock=NO_CLOCK) -> Loading:
    """The load's first part (see `load`): the front (`front`: loaded already), the checkpoint's files opened, the
    weights' reads started (on a GPU coming up early, as soon as its context is: kernels/device_start.py), the
    backend (with batch-invariant kernels where `deterministic`), its kernels getting ready in the background.
    `kv_cache_dtype`: how attention K/V rows are stored (engine/state/kv_dtype.py). `clock`: marks the phases
    (engine/startup.py)."""
    front = front or load_front(model_dir)
    clock.mark("weights_plan")
    tensors = open_quantized(CheckpointTensors(front.path), front.config.quantization)
    act = np.float32 if device == "cpu" or dtype == "float32" else ml_dtypes.bfloat16  # the backend's, presumably
    plan = dry_plan(front.config, tensors, act, mtp, kv_cache_dtype)
    spans = tensors.tensor_spans(plan[2]) if plan is not None else None
    clock.mark("device")  # the reads' start waits for the GPU's bring-up (its context and ring, or CuPy's)
    early = start_weight_reads(device, spans) if spans is not None else None
    try:
        ops = get_ops(device, dtype, deterministic)
    except BaseException:
        if early is not None:
            early.close()
        raise
    clock.mark("weights_plan")
    # in the background, while the weights load; its GEMMs' plan from the dry build above where that one built for
    # the backend's dtype (a build of its own there would run Python beside the weights' reads, which starves them)
    if plan is not None and np.dtype(plan[0]) == np.dtype(ops.act_dtype):
        kernel_plan = functools.partial(plan[3], max_step_tokens, max_batch)
    else:
        kernel_plan = functools.partial(model_plan, front.config, tensors, ops.act_dtype, mtp=mtp,
                                        max_step_tokens=max_step_tokens, max_logit_rows=max_batch)
    ops.prepare_kernels(kernel_plan)
    loading = Loading(front, ops, tensors, mtp, kv_cache_dtype)
    loading.start_reads(plan, early)
    return loading


def load(model_dir: Path, device: str = "auto", dtype: str | None = None, mtp: bool = False, *,
         max_step_tokens: int = DEFAULT_PREFILL_TOKENS, max_batch: int | None = None, front: ModelFront | None = None,
         deterministic: bool = False, kv_cache_dtype: str = "auto") -> LoadedModel:
    """`mtp`: load the checkpoint's MTP head too (--speculative mtp; an error when it ships none).
    `max_step_tokens` (tokens per prefill step) and `max_batch` (None: not known yet) bound the GEMM row counts the
    backend may get ready while the weights load (engine/load/gemm_plan.py). `deterministic`: batch-invariant
    kernels (--deterministic)."""
    return start_load(model_dir, device, dtype, mtp, max_step_tokens=max_step_tokens, max_batch=max_batch,
                      front=front, deterministic=deterministic, kv_cache_dtype=kv_cache_dtype).finish()
