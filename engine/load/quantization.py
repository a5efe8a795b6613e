"""FP8 weight checkpoints: the `quantization_config` a loader honours, and the weights it describes.

Two layouts are read as they are stored:
- Qwen's block FP8 (`quant_method: "fp8"`, transformers' fine-grained FP8): a linear weight [out, in] stored as
  float8_e4m3fn with `<module>.weight_scale_inv` [ceil(out/128), ceil(in/128)] (fp32), one scale per 128 x 128 block;
  the value is fp8 x scale (the name is transformers': it multiplies). Modules in `modules_to_not_convert` stay bf16.
- compressed-tensors' FP8 (`quant_method: "compressed-tensors"`, format `float-quantized`): `<module>.weight_scale`
  [out, 1] per output channel or [1] / [] per tensor; the `ignore` list stays bf16.

Both are one case here: a scale per (block_rows x block_cols) block of the weight, broadcast over the block, the last
block ragged when a dimension is not a multiple of it (a channel scale is a 1 x in block, a tensor scale out x in).
`QuantizedTensors` serves every weight of such a checkpoint to the models; a quantized weight that is uploaded as it
is (`stored`: the linear layers' matrices, experts) passes, as fp8 values and scales (kernels/fp8.py `Fp8Matrix`;
the values as the weights' read-ahead landed them in the backend's memory, like any stored tensor), through
`materialize`, the one place that decides what the backend gets: `ops.upload_rows` dequantises it exactly as
it uploads it (on the GPU in a kernel, into bf16), `ops.upload_linear` (a projection's weight) may keep it FP8 for an
FP8 GEMM (kernels/cuda_fp8.py); `get` gives the fp32 dequantisation to code that reshapes weights on the host.

Everything else (other methods, static activation scales, other bit widths, block sizes, keys not implemented here)
is refused with one line naming it: transformers would run other numbers than the ones computed here.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.mxfp4 import MXFP4
from prefixrun.kernels.fp8 import FP8_DTYPE, Fp8Matrix

BLOCK_FP8 = "fp8"
COMPRESSED_TENSORS = "compressed-tensors"
_BLOCK = (128, 128)  # the block Qwen's checkpoints use and an FP8 GEMM with block scales takes
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))

# keys each layout may carry, with the values that mean what is implemented here (None: any value)
_FP8_KEYS = {"quant_method": None, "fmt": ("e4m3",), "activation_scheme": ("dynamic",), "weight_block_size": None,
             "modules_to_not_convert": None, "dequantize": (False, True), "modules_to_convert": (None,),
             "scale_fmt": (None,)}
_CT_KEYS = {"quant_method": None, "config_groups": None, "format": ("float-quantized",), "ignore": None,
            "kv_cache_scheme": (None,), "quantization_status": ("compressed", "frozen"),
            "global_compression_ratio": None, "version": None, "sparsity_config": (None, {}),
            "transform_config": (None, {})}
# gpt-oss's MXFP4 experts (engine/load/mxfp4.py); `dequantize` is transformers' own load option, which changes
# nothing here (the experts are dequantised exactly either way)
_MXFP4_KEYS = {"quant_method": None, "modules_to_not_convert": None, "dequantize": (False, True)}
_CT_GROUP_KEYS = {"targets": (["Linear"],), "weights": None, "input_activations": None,
                  "output_activations": (None,), "format": (None, "float-quantized")}
_CT_WEIGHT_KEYS = {"num_bits": (8,), "type": ("float",), "strategy": ("channel", "tensor"), "symmetric": (True,),
                   "dynamic": (False,), "group_size": (None,), "block_structure": (None,), "actorder": (None,),
                   "observer": None, "observer_kwargs": None, "zp_dtype": (None,), "scale_dtype": (None,)}
# dynamic per-token FP8 activations (W8A8): the activations are kept at full precision here, the dequantised
# weights being exact, which is what transformers computes when it decompresses such a checkpoint
_CT_INPUT_KEYS = {"num_bits": (8,), "type": ("float",), "strategy": ("token", "tensor"), "symmetric": (True,),
                  "dynamic": (True,), "group_size": (None,), "block_structure": (None,), "actorder": (None,),
                  "observer": None, "observer_kwargs": None, "zp_dtype": (None,), "scale_dtype": (None,)}


@dataclass(frozen=True)
class WeightQuantization:
    """How the checkpoint stores its linear weights. `method` "none": as plain floating-point tensors.

    `scale_suffix`: the scale tensor's name after the module's (`weight_scale_inv` / `weight_scale`); `block`: the
    block of one scale (None: a channel or tensor scale, told by the scale's shape); `unquantized`: the module names
    the config leaves in floating point."""

    method: str = "none"
    scale_suffix: str = ""
    block: tuple[int, int] | None = None
    strategies: tuple[str, ...] = ()
    unquantized: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.method != "none"


NO_QUANTIZATION = WeightQuantization()


def _refuse_unknown(settings: dict, allowed: dict, where: str, source: str):
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{source}: {where} must be an object, got {settings!r}")
    for key, value in settings.items():
        if key not in allowed:
            raise ModelLoadError(f"{source}: {where}.{key} is not supported (such checkpoints are read with "
                                 f"{', '.join(sorted(allowed))})")
        if allowed[key] is not None and value not in allowed[key]:
            raise ModelLoadError(f"{source}: {where}.{key} {json.dumps(value)} is not supported (supported: "
                                 f"{', '.join(json.dumps(v) for v in allowed[key])})")


def _names(value, key: str, source: str) -> tuple[str, ...]:
    value = [] if value is None else value
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ModelLoadError(f"{source}: quantization_config.{key} must be a list of module names, got {value!r}")
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as exc:
                raise ModelLoadError(f"{source}: quantization_config.{key} entry {v!r} is not a valid pattern: "
                                     f"{exc}") from None
    return tuple(value)


def _names_module(pattern: str, module: str) -> bool:
    """Whether a modules_to_not_convert / ignore entry names `module` (stored name, without `.weight`): the module
    itself, a module it is the end of, or a module under it; `re:` entries (compressed-tensors) as a full regex."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern) or module.startswith(pattern + ".")


def parse_quantization(quantization, source: str) -> WeightQuantization:
    """config.json's `quantization_config` -> the layout; anything not implemented is one line naming it."""
    if not quantization:
        return NO_QUANTIZATION
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method == BLOCK_FP8:
        _refuse_unknown(quantization, _FP8_KEYS, "quantization_config", source)
        block = quantization.get("weight_block_size")
        if block != list(_BLOCK):
            raise ModelLoadError(f"{source}: quantization_config.weight_block_size {json.dumps(block)} is not "
                                 f"supported (supported: {list(_BLOCK)})")
        return WeightQuantization(BLOCK_FP8, "weight_scale_inv", _BLOCK, ("block",),
                                  _names(quantization.get("modules_to_not_convert"), "modules_to_not_convert", source))
    if method == COMPRESSED_TENSORS:
        _refuse_unknown(quantization, _CT_KEYS, "quantization_config", source)
        groups = quantization.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ModelLoadError(f"{source}: quantization_config.config_groups must name at least one group")
        strategies = set()
        for name, group in groups.items():
            where = f"quantization_config.config_groups.{name}"
            _refuse_unknown(group, _CT_GROUP_KEYS, where, source)
            if not isinstance(group.get("weights"), dict):
                raise ModelLoadError(f"{source}: {where}.weights must describe the weights' quantization")
            _refuse_unknown(group["weights"], _CT_WEIGHT_KEYS, where + ".weights", source)
            if group.get("input_activations") is not None:
                _refuse_unknown(group["input_activations"], _CT_INPUT_KEYS, where + ".input_activations", source)
            strategies.add(group["weights"].get("strategy"))
        if None in strategies:
            raise ModelLoadError(f"{source}: quantization_config.config_groups: every group's weights need a "
                                 f"strategy (channel or tensor)")
        return WeightQuantization(COMPRESSED_TENSORS, "weight_scale", None, tuple(sorted(strategies)),
                                  _names(quantization.get("ignore"), "ignore", source))
    if method == MXFP4:  # gpt-oss's experts as `*_blocks` + `*_scales`, read by its model (engine/models/gpt_oss.py)
        _refuse_unknown(quantization, _MXFP4_KEYS, "quantization_config", source)
        return WeightQuantization(MXFP4, unquantized=_names(quantization.get("modules_to_not_convert"),
                                                            "modules_to_not_convert", source))
    raise ModelLoadError(f"{source}: quantization_config (quant_method {json.dumps(method)}) is not supported "
                         f"(supported: \"fp8\" with 128 x 128 blocks, \"compressed-tensors\" FP8 per channel or "
                         f"per tensor, \"mxfp4\" gpt-oss experts); give the checkpoint's unquantized (bf16 / fp16 / "
                         f"fp32) weights")


def materialize(m: Fp8Matrix):
    """What a backend upload (`ops.upload_rows`) gets for a quantized weight: the one place that decides between
    keeping FP8 (for an FP8 GEMM with block scales) and dequantised values: the backend gets the fp8 values and
    scales, and its upload decides (`upload_rows`: exactly dequantised into its storage dtype; `upload_linear`: kept
    FP8 where the backend has an FP8 GEMM for them)."""
    return m


def quantize_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A float matrix -> (float8_e4m3fn values, fp32 scales), one scale = block amax / 448 per block (how the
    released block-FP8 checkpoints are made); an all-zero block gets scale 1. Ragged last blocks included."""
    rows, cols = w.shape
    bo, bi = block
    nr, nc = -(-rows // bo), -(-cols // bi)
    padded = np.zeros((nr * bo, nc * bi), np.float32)
    padded[:rows, :cols] = np.abs(w.astype(np.float32))
    amax = padded.reshape(nr, bo, nc, bi).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    full = Fp8Matrix(np.zeros((rows, cols), FP8_DTYPE), scale, block).scale_per_element()
    values = np.clip(w.astype(np.float32) / full, -448.0, 448.0).astype(FP8_DTYPE)
    return values, scale


class QuantizedTensors:
    """A checkpoint view that serves an FP8 checkpoint's weights to the models: a quantized weight through
    `materialize` (validated: its scale's presence, dtype, shape and values), every other tensor as stored. The
    scale tensors are no names of their own; the digest is the stored content's, fp8 values and scales included."""

    def __init__(self, tensors, quantization: WeightQuantization, *, shapes_only: bool = False):
        self._t = tensors
        self.model_dir = tensors.model_dir
        self.files = tensors.files
        self.quantization = quantization
        self._shapes_only = shapes_only
        self._suffix = "." + quantization.scale_suffix if quantization.scale_suffix else None

    def __contains__(self, name: str) -> bool:
        return name in self._t and not self._is_scale(name)

    def names(self) -> list[str]:
        return [n for n in self._t.names() if not self._is_scale(n)]

    def _is_scale(self, name: str) -> bool:
        return self._suffix is not None and name.endswith(self._suffix)

    def digest(self, memo_dir=None, *, remembered_only: bool = False) -> str | None:
        return self._t.digest(memo_dir, remembered_only=remembered_only)

    def shapes_only(self, record: list[str] | None = None) -> QuantizedTensors:
        """The view for a dry build (engine/load/gemm_plan.py), which reads no weight: a quantized weight comes
        back validated but as a zero-stride fp32 placeholder of its shape, not dequantised. `record`: gets the
        names of the tensors the build uploads as stored, in order (weights.CheckpointTensors.shapes_only)."""
        return QuantizedTensors(self._t.shapes_only(record), self.quantization, shapes_only=True)

    def tensor_spans(self, names: list[str]):
        return self._t.tensor_spans(names)

    def read_ahead(self, names: list[str], start_reads) -> None:
        self._t.read_ahead(names, start_reads)

    def wait_read_ahead(self, timeout: float | None = None) -> bool:
        return self._t.wait_read_ahead(timeout)

    def end_read_ahead(self) -> dict | None:
        return self._t.end_read_ahead()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor on the host; a quantized weight exactly dequantised to fp32 (code that slices, stacks or
        de-interleaves weights on the host reads this)."""
        return self._serve(name, shape, Fp8Matrix.dequantize)

    def stored(self, name: str, shape: tuple[int, ...] | None = None):
        """The tensor as a part for `ops.upload_rows`: a quantized weight as `materialize` decides."""
        return self._serve(name, shape, materialize)

    def _serve(self, name: str, shape: tuple[int, ...] | None, quantized):
        weight = self.fp8_weight(name, shape)
        if weight is None:
            return self._t.stored(name, shape) if quantized is materialize else self._t.get(name, shape)
        if quantized is materialize:
            # the fp8 values as the read-ahead landed them (their bytes in the backend's memory), else the mapped
            # ones; asked for in the dry build too, so that its upload order names them and they are read ahead.
            # The scales stay the host's: validated there, and 1/4096 of the values' bytes
            weight = Fp8Matrix(self._t.stored(name, shape), weight.scale, weight.block)
        if self._shapes_only:
            return np.broadcast_to(np.zeros(weight.shape[-1:], np.float32), weight.shape)
        return quantized(weight)

    def fp8_weight(self, name: str, shape: tuple[int, ...] | None = None) -> Fp8Matrix | None:
        """The stored fp8 values and scales of `name`, validated; None when it is stored in floating point."""
        arr = self._t.get(name, shape)
        scale_name = (name[:-len("weight")] + self.quantization.scale_suffix
                      if self.quantization.scale_suffix and name.endswith(".weight") else None)
        has_scale = scale_name is not None and scale_name in self._t
        where = f"{self.model_dir}: tensor {name!r}"
        if arr.dtype == FP8_DTYPE and not self.quantization.active:
            raise ModelLoadError(f"{where} is float8_e4m3fn but config.json has no quantization_config")
        if arr.dtype != FP8_DTYPE:
            if has_scale:
                raise ModelLoadError(f"{where} has a {self.quantization.scale_suffix} but is stored as {arr.dtype}, "
                                     f"not float8_e4m3fn")
            return None
        if not has_scale:
            raise ModelLoadError(f"{where} is float8_e4m3fn but its scale {scale_name or '(none)'!r} is missing")
        listed = next((m for m in self.quantization.unquantized if _names_module(m, name[:-len(".weight")])), None)
        if listed is not None:
            raise ModelLoadError(f"{where} is float8_e4m3fn but quantization_config leaves {listed!r} unquantized")
        if arr.ndim != 2:
            raise ModelLoadError(f"{where} is float8_e4m3fn with shape {arr.shape}; only 2-D weights are quantized")
        scale = self._t.get(scale_name)
        if scale.dtype not in _SCALE_DTYPES:
            raise ModelLoadError(f"{self.model_dir}: scale {scale_name!r} is stored as {scale.dtype}, not a float")
        scale, block = self._scale_and_block(scale, arr.shape, scale_name)
        if not np.isfinite(scale).all() or (scale < 0).any():
            raise ModelLoadError(f"{self.model_dir}: scale {scale_name!r} holds NaN, infinite or negative values")
        return Fp8Matrix(arr, scale, block)

    def _scale_and_block(self, scale: np.ndarray, shape: tuple[int, int], scale_name: str):
        rows, cols = shape
        q = self.quantization
        expected = {}
        if q.block is not None:
            expected[(math.ceil(rows / q.block[0]), math.ceil(cols / q.block[1]))] = q.block
        if "channel" in q.strategies:
            expected[(rows, 1)] = (1, cols)
        if "tensor" in q.strategies:
            expected[(1, 1)] = (rows, cols)
        grid = tuple(scale.shape) if scale.ndim == 2 else (1, 1) if scale.size == 1 and scale.ndim <= 1 else None
        if grid not in expected:
            raise ModelLoadError(f"{self.model_dir}: scale {scale_name!r} has shape {tuple(scale.shape)}, expected "
                                 f"{' or '.join(str(s) for s in expected)} for a weight of shape {tuple(shape)}")
        return scale.astype(np.float32).reshape(grid), expected[grid]


def open_quantized(tensors, quantization: WeightQuantization) -> QuantizedTensors:
    """The checkpoint as the models read it (an fp8 tensor in a checkpoint without quantization_config is refused)."""
    return QuantizedTensors(tensors, quantization)
