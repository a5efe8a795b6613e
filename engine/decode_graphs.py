"""Decode steps replayed as CUDA graphs at bucketed batch sizes, so decode is not bound by Python.

A decode step has static shapes once its batch size B and block-table width W are fixed, so the whole model
forward for (B, W) is captured once and replayed: each step only writes its packed index arrays into the graph's
static input buffer (one host-to-device copy) and replays. Rows past the real batch are padding: they point at a
scratch state slot and a scratch K/V block, so whatever they compute lands where nobody reads.

The graph samples too (`step_sampled`): the rows' packed sampling parameters go into a second static buffer
(padding rows: zeros, i.e. greedy) and `ops.sample_into` draws every row's next token inside the replay, so a decode
step is one index copy, one parameter copy, one replay and one copy of the token ids back.

Backends without graph capture (the CPU), and models whose forward cannot be captured (an op that syncs with the
host), fall back to eager steps — same results, only slower.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.batch import ForwardBatch, Padding
from prefixrun.engine.state import ModelState, StateHandle
from prefixrun.kernels.sampling import unpack_sampling_params


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class _Graph:
    def __init__(self, replay, inputs, params):
        self.replay = replay  # -> (fp32 logits [b, V], int64 token ids [b])
        self.inputs = inputs  # the static packed index buffer the graph reads
        self.params = params  # the static sampling parameters, int32 [8, b] (pack_sampling_params' bits)


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
        return self.step_sampled(handles, tokens, None)[0]

    def step_sampled(self, handles: list[StateHandle], tokens: list[int], params):
        """One decode token per handle and the next token sampled from its logits: (fp32 logits [n, V], backend
        int64 token ids [n]). params: the rows' sampling parameters packed as kernels/sampling.py
        pack_sampling_params makes them (uint32 [8, n]); None: no sampling (ids None)."""
        st = self.state
        if not self.enabled:
            return self._eager(st.prepare_step(handles, [[t] for t in tokens]), params)
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
                logits = self.model.forward(host.to_backend(self.ops.upload_index), st)[:n]
                return logits, None if params is None else self.ops.sample(logits, *unpack_sampling_params(params))
            self.graphs[key] = graph
        self.ops.write_index(graph.inputs, host.pack())
        if params is not None:
            padded = np.zeros((8, b), np.uint32)  # padding rows: temperature 0, greedy
            padded[:, :n] = params
            self.ops.write_index(graph.params, padded.view(np.int32))
        self.replays += 1
        logits, ids = graph.replay()
        return logits[:n], None if params is None else ids[:n]

    def _eager(self, batch: ForwardBatch, params):
        logits = self.model.forward(batch, self.state)
        return logits, None if params is None else self.ops.sample(logits, *unpack_sampling_params(params))

    def _capture(self, like: ForwardBatch) -> _Graph | None:
        """A graph of the model's step over batches laid out as the host batch `like` (same rows, table width and
        groups). Warm-up (kernel compilation, cuBLAS binding) runs on a batch of padding rows only, which touches
        nothing but scratch; the capture itself executes nothing, so the real step runs exactly once: at the first
        replay."""
        b, width = like.slots.shape[0], like.block_tables.shape[1]
        warm = self.state.step_arrays([], [], table_width=width, pad=self._padding(b))
        inputs = self.ops.upload_index(warm.pack())
        params = self.ops.upload_index(np.zeros((8, b), np.int32))  # greedy until a step writes its rows
        ids = self.ops.zeros((b,), np.int64)
        batch = like.views(inputs)

        def step():
            logits = self.model.forward(batch, self.state)
            return logits, self.ops.sample_into(logits, params, ids)

        try:
            step()
            graph = self.ops.capture(step, warmup=0)
        except Exception:
            return None
        self.captures += 1
        return _Graph(graph.replay, inputs, params)
