"""The Mamba2 mixer of Nemotron-H and Granite 4.0-H, written against kernel ops only.

in_proj -> [z (gate) I, xBC conv_dim, dt H]; xBC -> causal depthwise conv (+ bias) + SiLU from the conv history;
x [H, P], B, C [G, N] -> the selective scan from the SSM state (kernels/mamba_reference.py) + D x; the gated RMSNorm
(x * silu(z), normalised in `norm_groups` groups) -> out_proj. I = H * P, conv_dim = I + 2 G N.

State, both slot regions snapshotted per row of a speculative step: the last conv_kernel - 1 conv inputs
(`layers.{i}.conv`, [conv_dim, K-1], like Gated DeltaNet's conv history) and the SSM state per head
(`layers.{i}.ssm`, fp32 [H, P, N], as transformers keeps it).

Weights as transformers names them under the mixer's prefix: in_proj.weight [I + conv_dim + H, D] (.bias when
proj_bias), conv1d.weight [conv_dim, 1, K] (.bias when conv_bias), A_log, D, dt_bias [H], norm.weight [I],
out_proj.weight [D, I] (.bias when proj_bias).
"""
from __future__ import annotations

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.mamba_config import Mamba2Settings
from prefixrun.engine.models.layers import WeightLoader
from prefixrun.engine.state.pools import ForwardBatch, ModelState, RegionSpec


class Mamba2Mixer:
    def __init__(self, m: Mamba2Settings, hidden_size: int, eps: float, load: WeightLoader, prefix: str, layer: int):
        d, i, c, h = hidden_size, m.intermediate, m.conv_dim, m.num_heads
        self.m, self.eps = m, eps
        limit = load.ops.max_ssm_state
        if limit is not None and m.state_size > limit:
            raise ModelLoadError(f"config.json: {m.state_field} = {m.state_size}; the {load.ops.display_name} Mamba2 "
                                 f"kernels run state sizes up to {limit} (--device cpu runs any)")
        self.in_proj = load.matrix(prefix + "in_proj.weight", (i + c + h, d))
        self.conv_weight = load.conv_weight(prefix + "conv1d.weight", c, m.conv_kernel, m.conv_field)
        self.conv_bias = load.vector(prefix + "conv1d.bias", (c,)) if m.conv_bias else None
        self.a_log = load.vector(prefix + "A_log", (h,))
        self.d_skip = load.vector(prefix + "D", (h,))
        self.dt_bias = load.vector(prefix + "dt_bias", (h,))
        self.norm_weight = load.vector(prefix + "norm.weight", (i,))
        self.out_proj = load.matrix(prefix + "out_proj.weight", (d, i))
        self.in_bias = self.out_bias = None
        if m.proj_bias:
            self.in_bias = load.bias([prefix + "in_proj.bias"], [i + c + h])
            self.out_bias = load.bias([prefix + "out_proj.bias"], [d])
        self.conv_region = f"layers.{layer}.conv"
        self.ssm_region = f"layers.{layer}.ssm"

    def state_specs(self) -> list[RegionSpec]:
        m = self.m
        return [RegionSpec(self.conv_region, False, (m.conv_dim, m.conv_kernel - 1), "act", snapshot=True),
                RegionSpec(self.ssm_region, False, (m.num_heads, m.head_dim, m.state_size), "float32",
                           snapshot=True)]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        m = self.m
        t, i, c = x.shape[0], m.intermediate, m.conv_dim
        proj = ops.linear(x, self.in_proj)  # [T, I + conv_dim + H]
        if self.in_bias is not None:
            proj = ops.add(proj, self.in_bias)
        rows = batch.snapshot_rows  # a speculative step: every row's state also goes to its snapshot row
        conv_state = state.arrays[self.conv_region]
        if rows is None:
            xbc = ops.causal_conv1d(proj[:, i:i + c], self.conv_weight, conv_state, batch.slots, batch.cu_seqlens,
                                    bias=self.conv_bias)  # [T, conv_dim]
        else:
            xbc = ops.causal_conv1d_rows(proj[:, i:i + c], self.conv_weight, conv_state, batch.slots,
                                         batch.cu_seqlens, state.snapshots[self.conv_region], rows,
                                         bias=self.conv_bias)
        gn = m.n_groups * m.state_size
        xs = xbc[:, :i].reshape(t, m.num_heads, m.head_dim)
        b = xbc[:, i:i + gn].reshape(t, m.n_groups, m.state_size)
        cc = xbc[:, i + gn:].reshape(t, m.n_groups, m.state_size)
        dt = proj[:, i + c:]  # [T, H]
        limit = m.dt_limit if batch.prefill else m.step_dt_limit  # engine/load/mamba_config.py
        args = (xs, dt, b, cc, self.a_log, self.dt_bias, self.d_skip, limit, state.arrays[self.ssm_region],
                batch.slots, batch.cu_seqlens)
        if rows is None:
            y = ops.ssd_scan(*args)  # [T, H, P]
        else:
            y = ops.ssd_scan_rows(*args, state.snapshots[self.ssm_region], rows)
        y = ops.gated_group_rms_norm(y.reshape(t, i), proj[:, :i], self.norm_weight, self.eps, i // m.norm_groups)
        out = ops.linear(y, self.out_proj)  # [T, D]
        return out if self.out_bias is None else ops.add(out, self.out_bias)
