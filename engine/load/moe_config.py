"""Config of the MoE hybrids: Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet + gated attention + sparse MoE MLPs).

Both families are HybridConfig plus the sparse-MLP settings. They differ in two places:
- Qwen3-Next stores the linear-attention input projections fused and interleaved per key head
  (`in_proj_qkvz`, `in_proj_ba`) and chooses MoE layers by `decoder_sparse_step` / `mlp_only_layers` (the others
  are dense SwiGLU MLPs of `intermediate_size`); `norm_topk_prob` is a setting.
- Qwen3.5-MoE stores Qwen3.5's split projections, every layer is sparse and the top-k weights are always
  renormalised (its config has no `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`, `intermediate_size`).
Settings transformers reads only for training (`router_aux_loss_coef`, `output_router_logits`,
`attention_dropout`) change no inference result and are accepted as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from prefixrun.engine.load.config import ConfigFields, HybridConfig
from prefixrun.engine.errors import ModelLoadError

QWEN3_NEXT = "Qwen3NextForCausalLM"


@dataclass(frozen=True)
class MoeSettings:
    num_experts: int
    top_k: int  # num_experts_per_tok
    expert_intermediate_size: int  # moe_intermediate_size
    shared_expert_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool  # renormalise the top-k softmax probabilities to sum 1
    sparse_layers: tuple[bool, ...]  # per layer: sparse MoE block (True) or dense MLP of intermediate_size

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelLoadError(f"config.json: {_HF_NAMES[name]} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ModelLoadError(f"config.json: num_experts_per_tok ({self.top_k}) exceeds num_experts "
                                 f"({self.num_experts})")
        v = self.shared_expert_intermediate_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ModelLoadError(f"config.json: shared_expert_intermediate_size must be a non-negative integer, "
                                 f"got {v!r}")


_HF_NAMES = {"num_experts": "num_experts", "top_k": "num_experts_per_tok",
             "expert_intermediate_size": "moe_intermediate_size"}


@dataclass(frozen=True)
class MoeHybridConfig(HybridConfig):
    moe: MoeSettings | None = None  # None: no sparse layer at all (Qwen3-Next with num_experts 0)
    fused_linear_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba layout

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ModelLoadError("config.json: sparse layer pattern does not cover every layer")
        if self.moe is not None and self.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"config.json: hidden_act {self.hidden_act!r} is not supported for MoE experts "
                                 "(silu only)")

    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local) -> MoeHybridConfig:
        """The field reader `f` (with the family's transformers defaults) -> the config."""
        base = super().from_fields(f, common, rope_local)
        qwen3_next = common["architecture"] == QWEN3_NEXT
        num_layers = common["num_layers"]
        num_experts = f.number("num_experts", int)
        if qwen3_next:
            step = f.number("decoder_sparse_step", int)
            f.refuse_unless("decoder_sparse_step", step > 0, "it must be a positive integer")
            dense_only = f.get("mlp_only_layers") or []
            f.refuse_unless("mlp_only_layers", isinstance(dense_only, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in dense_only), "a list of layer indices")
            sparse = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
            norm_topk = f.flag("norm_topk_prob")
        else:  # Qwen3.5-MoE: every layer sparse, top-k weights always renormalised
            f.refuse_unless("num_experts", num_experts > 0, "it must be a positive integer")
            sparse, norm_topk = (True,) * num_layers, True
        moe = None
        if any(sparse):
            moe = MoeSettings(num_experts=num_experts, top_k=f.number("num_experts_per_tok", int),
                              expert_intermediate_size=f.number("moe_intermediate_size", int),
                              shared_expert_intermediate_size=f.number("shared_expert_intermediate_size", int),
                              norm_topk_prob=norm_topk, sparse_layers=sparse)
        return replace(base, moe=moe, fused_linear_projections=qwen3_next)


def moe_tensor_shapes(cfg: MoeHybridConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's tensor names -> shapes (`shapes`, as engine.load.model_maker lists them) rewritten into the MoE
    hybrid's layout as transformers saves it: sparse layers get the router, per-expert and shared-expert weights
    instead of the dense MLP; Qwen3-Next's linear attention gets its fused in_proj_qkvz / in_proj_ba."""
    out = dict(shapes)
    d = cfg.hidden_size
    for n in range(cfg.num_layers):
        lp = f"{cfg.weight_prefix}layers.{n}."
        if cfg.moe is not None and cfg.moe.sparse_layers[n]:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out.pop(f"{lp}mlp.{proj}.weight", None)
            m = lp + "mlp."
            e, i, s = cfg.moe.num_experts, cfg.moe.expert_intermediate_size, cfg.moe.shared_expert_intermediate_size
            out[m + "gate.weight"] = (e, d)
            for x in range(e):
                out.update({f"{m}experts.{x}.gate_proj.weight": (i, d), f"{m}experts.{x}.up_proj.weight": (i, d),
                            f"{m}experts.{x}.down_proj.weight": (d, i)})
            if s:
                out.update({m + "shared_expert.gate_proj.weight": (s, d), m + "shared_expert.up_proj.weight": (s, d),
                            m + "shared_expert.down_proj.weight": (d, s), m + "shared_expert_gate.weight": (1, d)})
        a = lp + "linear_attn."
        if cfg.fused_linear_projections and a + "in_proj_qkv.weight" in out:
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                del out[f"{a}{name}.weight"]
            out[a + "in_proj_qkvz.weight"] = (2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, d)
            out[a + "in_proj_ba.weight"] = (2 * cfg.linear_num_value_heads, d)
    return out
