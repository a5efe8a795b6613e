"""Rotary position settings: config.json's rope fields -> RopeConfig, computed as transformers 5.17 computes them.

Honoured rope types: default, linear, llama3, yarn (with its attention factor) and dynamic. Dynamic NTK rescales
only past max_position_embeddings, which the engine never exceeds (it refuses longer contexts), so it equals
default here. longrope (and any other type) switches frequencies with the length of each forward call — an answer
no prefix cache can reproduce — and is refused.

Where the fields live (transformers' standardisation): `rope_scaling` (legacy) wins over `rope_parameters`; a
top-level `rope_theta` / `partial_rotary_factor` fills what the dict lacks; yarn/llama3 default
original_max_position_embeddings to max_position_embeddings. Gemma 3 keeps one dict per layer type (legacy:
`rope_scaling` + `rope_theta` for global layers, `rope_local_base_freq` for local ones).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from prefixrun.engine.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


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

    def inverse_frequencies(self) -> list[float]:
        """[rotary_dim/2] inverse frequencies, as transformers computes them (fp32 by the caller)."""
        dim, half = self.rotary_dim, self.rotary_dim // 2
        inv = [1.0 / (self.theta ** (2 * i / dim)) for i in range(half)]
        if self.rope_type == "linear":
            return [f / self.factor for f in inv]
        if self.rope_type == "llama3":
            return self._llama3(inv)
        if self.rope_type == "yarn":
            return self._yarn(inv)
        return inv

    def _llama3(self, inv: list[float]) -> list[float]:
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen > low_wavelen:
                out.append(f / self.factor)
            elif wavelen < high_wavelen:
                out.append(f)
            else:
                smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor)
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out

    def _yarn(self, inv: list[float]) -> list[float]:
        """Interpolated (f / factor) for low frequencies, extrapolated (f) for high ones, a linear ramp between
        the dims that rotate beta_slow and beta_fast times over the original context."""
        dim, base, omp = self.rotary_dim, self.theta, self.original_max_position_embeddings

        def correction_dim(rotations):
            return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: avoids a division by zero
        out = []
        for i, f in enumerate(inv):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1.0 - ramp
            out.append((f / self.factor) * (1 - extrapolation) + f * extrapolation)
        return out


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
    rotary_dim = int(head_dim * partial)
    if not partial_rotary:
        # transformers' default rope of these families ignores partial_rotary_factor; the scaled types honour it
        # but then apply a table narrower than the head, which fails in transformers itself
        if rope_type in ("default", "dynamic") or rotary_dim == head_dim:
            rotary_dim = head_dim
        else:
            raise ModelLoadError(f"{source}: partial_rotary_factor = {json.dumps(params['partial_rotary_factor'])} "
                                 f"is not supported with rope_type {rope_type!r} for this architecture "
                                 "(it rotates whole heads)")
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
        # one dict per layer type; flat keys in rope_parameters are ignored, as Gemma3TextConfig ignores them
        per_type = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        full = per_type.get("full_attention") or {}
        local = per_type.get("sliding_attention") or {}
        if text.get("rope_scaling"):
            full = {**standardised(full, theta), **text["rope_scaling"]}
        full = standardised(full, theta)
        local = standardised(local, text.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
        return rope_from_params(full, **common), rope_from_params(local, **common)
    params = text.get("rope_scaling") or text.get("rope_parameters")
    return rope_from_params(standardised(params, theta), **common), None
