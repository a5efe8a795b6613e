"""Decode steps replayed as CUDA graphs at bucketed batch sizes, so decode is not bound by Python.

A decode step has static shapes once its batch size B and block-table width W are fixed, so the whole model
forward for (B, W) is captured once and replayed: each step only writes its packed index arrays into the graph's
static input buffer (one host-to-device copy) and replays. Rows past the real batch are padding: they point at a
scratch state slot and a scratch K/V block, so whatever they compute lands where nobody reads.

Backends without graph capture (the CPU), and models whose forward cannot be captured (an op that syncs with the
host), fall back to eager steps — same results, only slower.
"""
from __future__ import annotations

from prefixrun.engine.batch import ForwardBatch, Padding
from prefixrun.engine.state import ModelState, StateHandle


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

    def _padding(self, rows: int) -> Padding:
        """Padding rows up to `rows`, on a scratch state of one token (made on first use)."""
        if self.scratch is None:
            h = self.state.new_sequence()
            self.state.reserve(h, 1)
            h.length = 1
            self.scratch = h
        return Padding(rows=rows, slot=self.scratch.slot, block=self.scratch.blocks[0])

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
        host = st.step_arrays(handles, [[t] for t in tokens], table_width=width,
                              pad=self._padding(b) if b > n else None)
        key = (b, width, host.shared is not None)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(host)
            if graph is None:  # this model cannot be captured: eager from now on
                self.enabled = False
                return self.model.forward(host.to_backend(self.ops.upload_index), st)[:n]
            self.graphs[key] = graph
        self.ops.write_index(graph.inputs, host.pack())
        self.replays += 1
        return graph.replay()[:n]

    def _capture(self, like: ForwardBatch) -> _Graph | None:
        """A graph of the model's step over batches laid out as the host batch `like` (same rows, table width and
        groups). Warm-up (kernel compilation, cuBLAS binding) runs on a batch of padding rows only, which touches
        nothing but scratch; the capture itself executes nothing, so the real step runs exactly once: at the first
        replay."""
        b, width = like.slots.shape[0], like.block_tables.shape[1]
        warm = self.state.step_arrays([], [], table_width=width, pad=self._padding(b))
        inputs = self.ops.upload_index(warm.pack())
        batch = like.views(inputs)
        try:
            self.model.forward(batch, self.state)
            graph = self.ops.capture(lambda: self.model.forward(batch, self.state), warmup=0)
        except Exception:
            return None
        self.captures += 1
        return _Graph(graph.replay, inputs)
