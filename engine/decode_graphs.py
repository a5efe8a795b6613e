"""Decode steps replayed as CUDA graphs at bucketed batch sizes, so decode is not bound by Python.

A decode step has static shapes once its batch size B and block-table width W are fixed, so the whole model
forward for (B, W) is captured once and replayed: each step only writes its packed index arrays into the graph's
static input buffer (one host-to-device copy) and replays. Rows past the real batch are padding: they point at a
scratch state slot and a scratch K/V block, so whatever they compute lands where nobody reads.

Backends without graph capture (the CPU), and models whose forward cannot be captured (an op that syncs with the
host), fall back to eager steps — same results, only slower.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.state import ForwardBatch, ModelState, StateHandle, batch_views, pack_step_arrays


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class _Graph:
    def __init__(self, replay, inputs):
        self.replay = replay
        self.inputs = inputs  # the static packed index buffer the graph reads


class DecodeGraphs:
    def __init__(self, model, state: ModelState, ops, max_batch: int):
        self.model, self.state, self.ops = model, state, ops
        self.max_batch = max_batch
        self.enabled = ops.can_capture_graphs
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}  # (batch bucket, table width, shared prefixes)
        self.scratch: StateHandle | None = None
        self.captures = 0
        self.replays = 0

    def _scratch(self) -> StateHandle:
        if self.scratch is None:
            h = self.state.new_sequence()
            self.state.reserve(h, 1)
            h.length = 1
            self.scratch = h
        return self.scratch

    def close(self):
        """Release the scratch state (the captured graphs stay; they read their inputs afresh every step)."""
        if self.scratch is not None:
            self.state.release(self.scratch)
            self.scratch = None

    def step(self, handles: list[StateHandle], tokens: list[int]):
        """One decode token per handle; returns fp32 logits [len(handles), V]."""
        st = self.state
        if not self.enabled:
            return self.model.forward(st.prepare_step(handles, [[t] for t in tokens]), st)
        n = len(handles)
        b = _bucket(n)
        width = _bucket(max(st.blocks_for(h.length + 1) for h in handles))
        arrays = self._pad(st.step_arrays(handles, [[t] for t in tokens], table_width=width, groups=False), n, b)
        st.add_shared_groups(arrays)  # after padding: padding rows are groups of their own
        key = (b, width, "shared_order" in arrays)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(arrays)
            if graph is None:  # this model cannot be captured: eager from now on
                self.enabled = False
                return self.model.forward(_eager_batch(arrays, self.ops), st)[:n]
            self.graphs[key] = graph
        self.ops.write_index(graph.inputs, pack_step_arrays(arrays))
        self.replays += 1
        return graph.replay()[:n]

    def _pad(self, arrays: dict, n: int, b: int) -> dict:
        if n == b:
            return arrays
        s = self._scratch()
        pad = b - n
        bs = self.state.block_size
        out = dict(arrays)
        out["token_ids"] = np.concatenate([arrays["token_ids"], np.zeros(pad, np.int32)])
        out["positions"] = np.concatenate([arrays["positions"], np.zeros(pad, np.int32)])
        out["cu_seqlens"] = np.arange(b + 1, dtype=np.int32)
        out["slots"] = np.concatenate([arrays["slots"], np.full(pad, s.slot, np.int32)])
        tables = np.zeros((b, arrays["block_tables"].shape[1]), np.int32)
        tables[:n] = arrays["block_tables"]
        tables[n:, 0] = s.blocks[0]
        out["block_tables"] = tables
        out["context_lens"] = np.concatenate([arrays["context_lens"], np.ones(pad, np.int32)])
        out["kv_write_index"] = np.concatenate([arrays["kv_write_index"], np.full(pad, s.blocks[0] * bs, np.int32)])
        out["last_token_index"] = np.arange(b, dtype=np.int32)
        return out

    def _capture(self, arrays: dict) -> _Graph | None:
        b = len(arrays["slots"])
        # Warm up (kernel compilation, cuBLAS binding) on a batch of padding rows only, which touches nothing but
        # scratch; the capture itself executes nothing, so the real step runs exactly once: at the first replay.
        warm = self._pad({k: v[:0] for k, v in arrays.items() if not k.startswith("shared_")}, 0, b)
        self.state.add_shared_groups(warm)
        inputs = self.ops.upload_index(pack_step_arrays(warm))
        views = batch_views(inputs, arrays)
        batch = ForwardBatch(**views, host_cu_seqlens=arrays["cu_seqlens"], host_context_lens=arrays["context_lens"])
        try:
            self.model.forward(batch, self.state)
            graph = self.ops.capture(lambda: self.model.forward(batch, self.state), warmup=0)
        except Exception:
            return None
        self.captures += 1
        return _Graph(graph.replay, inputs)


def _eager_batch(arrays: dict, ops) -> ForwardBatch:
    from prefixrun.engine.state import batch_from_host

    return batch_from_host(arrays, ops.upload_index)
