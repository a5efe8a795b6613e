"""Rotary position settings: config.json's rope fields -> RopeConfig, computed as transformers 5.17 computes them.

Honoured rope types: default, linear, llama3, yarn (with its attention factor) and dynamic. Dynamic NTK rescales
only past max_position_embeddings, which the engine never exceeds (it refuses longer contexts), so it equals
default here. longrope (and any other type) switches frequencies with the length of each forward call — an answer
no prefix cache can reproduce — and is refused.

Where the fields live (transformers' standardisation): `rope_scaling` (legacy) wins over `rope_parameters`; a
top-level `rope_theta` / `partial_rotary_factor` fills what the dict lacks; yarn/llama3 take a top-level
original_max_position_embeddings over the dict's, and default it to max_position_embeddings. Gemma 3 keeps one dict per layer type (legacy:
`rope_scaling` + `rope_theta` for global layers, `rope_local_base_freq` for local ones); a flat dict is refused.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from prefixrun.engine.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
F32 = np.float32


@dataclass(frozen=True)
class NoRotary:
    """Attention without a position embedding (Nemotron-H; Granite 4.0-H without rope): every angle is 0, a rotation
    by cos 1 and sin 0, which leaves q and k exactly as they are, so these layers run the same ops as the others."""

    rotary_dim: int  # the head dim: every dim "rotates" by angle 0
    attention_factor: float = 1.0

    def inverse_frequencies(self) -> np.ndarray:
        return np.zeros(self.rotary_dim // 2, F32)


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # leading dims of each head that rotate (partial rotary); the rest pass through
    rope_type: str = "default"
    factor: float = 1.0  # linear / llama3 / yarn scaling factor
    # llama3 frequency bands
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # transformers multiplies cos and sin by it: rotated q and k dims scale by it

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            why = ("its frequencies switch with the length of each forward call, which a prefix cache cannot "
                   "reproduce" if self.rope_type == "longrope" else "not implemented")
            raise ModelLoadError(f"config.json: rope_type {self.rope_type!r} is not supported ({why}; "
                                 f"supported: {', '.join(ROPE_TYPES)})")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ModelLoadError(f"config.json: rotary dimension {self.rotary_dim} must be even and positive")
        if not self.theta > 0:
            raise ModelLoadError(f"config.json: rope_theta must be positive, got {self.theta!r}")
        if self.rope_type in ("linear", "llama3", "yarn") and not self.factor > 0:
            raise ModelLoadError(f"config.json: rope factor must be positive, got {self.factor!r}")

    def inverse_frequencies(self) -> np.ndarray:
        """[rotary_dim/2] float32 inverse frequencies, computed as transformers computes them: in float32, op by
        op in torch's order, each Python number rounded to float32 where torch rounds it (computed in float64
        they differed by 1-5 ulp, which moved logits by 2e-3 a thousand tokens in)."""
        dim = self.rotary_dim
        exponents = np.arange(0, dim, 2).astype(F32) / F32(dim)  # [dim/2]
        powers = fp32_pow(self.theta, exponents)  # base ** (arange(0, dim, 2).float() / dim)
        if self.rope_type == "yarn":
            return self._yarn(powers)
        inv = F32(1.0) / powers
        if self.rope_type == "linear":
            return inv / F32(self.factor)
        if self.rope_type == "llama3":
            return self._llama3(inv)
        return inv

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        """transformers' _compute_llama3_parameters. `x / tensor` is torch's reciprocal(tensor) * x."""
        omp, low, high = self.original_max_position_embeddings, self.low_freq_factor, self.high_freq_factor
        wavelen = (F32(1.0) / inv) * F32(2 * math.pi)
        low_wavelen, high_wavelen = F32(omp / low), F32(omp / high)
        factor = F32(self.factor)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = ((F32(1.0) / wavelen) * F32(omp) - F32(low)) / F32(high - low)
        smoothed = (F32(1.0) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(F32)

    def _yarn(self, powers: np.ndarray) -> np.ndarray:
        """transformers' _compute_yarn_parameters: interpolated (1 / (factor * p)) for low frequencies,
        extrapolated (1 / p) for high ones, a linear ramp between the dims that rotate beta_slow and beta_fast
        times over the original context."""
        dim, base, omp = self.rotary_dim, self.theta, self.original_max_position_embeddings

        def correction_dim(rotations):
            return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: avoids a division by zero
        extrapolation = F32(1.0) / powers
        interpolation = F32(1.0) / (F32(self.factor) * powers)
        ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
        extrapolation_factor = F32(1.0) - ramp
        return (interpolation * (F32(1.0) - extrapolation_factor) + extrapolation * extrapolation_factor).astype(F32)


def fp32_pow(base: float, exponents: np.ndarray) -> np.ndarray:
    """float32(base) ** exponents (float32), correctly rounded to float32. torch's float32 pow (SLEEF's, within
    1 ulp) is not always correctly rounded, so an element here may still differ from transformers' by an ulp or
    two (one in a hundred on common head sizes); every other step is torch's to the bit."""
    return np.power(np.float64(F32(base)), exponents.astype(np.float64)).astype(F32)


def _yarn_attention_factor(params: dict, factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def _number(params: dict, key: str, source: str, default=None) -> float:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelLoadError(f"{source}: rope parameter {key} must be a number, got {json.dumps(v)}")
    return float(v)


def rope_from_params(params: dict, *, head_dim: int, max_position_embeddings: int, partial_rotary: bool,
                     source: str) -> RopeConfig:
    """One standardised rope dict -> RopeConfig. `partial_rotary`: whether the family's attention applies
    partial_rotary_factor (Qwen3.5 does; Llama/Qwen3/Gemma 3 rotate whole heads and cannot apply a partial
    table, so there a partial factor is refused for the types that would use it)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ModelLoadError(f"{source}: rope_type must be a string, got {json.dumps(rope_type)}")
    partial = _number(params, "partial_rotary_factor", source, 1.0)
    rotary_dim = head_dim if partial == 1.0 else int(head_dim * partial)  # exact for any head_dim
    if not partial_rotary:
        # transformers' default rope of these families ignores partial_rotary_factor; the scaled types honour it
        # but then apply a table narrower than the head, which fails in transformers itself
        if rope_type in ("default", "dynamic") or rotary_dim == head_dim:
            rotary_dim = head_dim
        else:
            given = json.dumps(params.get("partial_rotary_factor"))
            raise ModelLoadError(f"{source}: partial_rotary_factor = {given} "
                                 f"is not supported with rope_type {rope_type!r} for this architecture "
                                 "(it rotates whole heads)")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ModelLoadError(f"{source}: head_dim = {head_dim} with partial_rotary_factor = {json.dumps(partial)} "
                             f"gives a rotary dimension of {rotary_dim}; it must be even and positive")
    kw: dict = dict(theta=_number(params, "rope_theta", source), rotary_dim=rotary_dim, rope_type=rope_type)
    if rope_type in ("linear", "dynamic", "llama3", "yarn"):
        kw["factor"] = _number(params, "factor", source)
    omp = params.get("original_max_position_embeddings", max_position_embeddings)
    if rope_type == "llama3":
        kw.update(low_freq_factor=_number(params, "low_freq_factor", source),
                  high_freq_factor=_number(params, "high_freq_factor", source),
                  original_max_position_embeddings=int(_number(dict(v=omp), "v", source)))
    if rope_type == "yarn":
        kw.update(original_max_position_embeddings=int(_number(dict(v=omp), "v", source)),
                  beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                  truncate=bool(params.get("truncate", True)),
                  attention_factor=_yarn_attention_factor(params, kw["factor"]))
    return RopeConfig(**kw)


# the rope settings a family's transformers config takes when config.json gives none (GptOssConfig: yarn)
_FAMILY_ROPE = {"gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096}}


def parse_rope(text: dict, family: str, *, head_dim: int, max_position_embeddings: int, defaults: dict,
               source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """(rope of the full-attention layers, rope of Gemma 3's sliding layers or None) from the text settings."""
    theta = text.get("rope_theta", defaults["rope_theta"])
    partial = text.get("partial_rotary_factor", defaults.get("partial_rotary_factor"))
    common = dict(head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                  partial_rotary=family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"), source=source)

    def standardised(params, rope_theta):
        if not isinstance(params or {}, dict):
            raise ModelLoadError(f"{source}: rope parameters must be an object, got {json.dumps(params)}")
        params = dict(params or {})
        params.setdefault("rope_theta", rope_theta)
        if partial is not None:
            params.setdefault("partial_rotary_factor", partial)
        return params

    if family == "gemma3":
        # one dict per layer type; a flat dict (rope_type, rope_theta, ... at its top) is no Gemma 3 config:
        # transformers cannot load it, and read here its settings would be dropped without a word
        per_type = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        flat = sorted(k for k in per_type if k not in ("full_attention", "sliding_attention"))
        if flat:
            raise ModelLoadError(f"{source}: rope_parameters holds {', '.join(flat)} at its top level; Gemma 3 "
                                 f"takes one object per layer type: {{\"full_attention\": {{...}}, "
                                 f"\"sliding_attention\": {{...}}}}")
        full = per_type.get("full_attention") or {}
        local = per_type.get("sliding_attention") or {}
        if text.get("rope_scaling"):
            full = {**standardised(full, theta), **text["rope_scaling"]}
        full = standardised(full, theta)
        local = standardised(local, text.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
        return rope_from_params(full, **common), rope_from_params(local, **common)
    params = standardised(text.get("rope_scaling") or text.get("rope_parameters") or _FAMILY_ROPE.get(family), theta)
    if text.get("original_max_position_embeddings") is not None and \
            params.get("rope_type", params.get("type")) in ("llama3", "yarn"):
        # a top-level value is the pretraining length and wins over the one inside the rope settings, as
        # transformers' standardisation has it (Phi-3 and others save it there)
        params["original_max_position_embeddings"] = text["original_max_position_embeddings"]
    return rope_from_params(params, **common), None
