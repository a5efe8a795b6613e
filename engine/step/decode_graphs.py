"""Decode steps replayed as CUDA graphs at bucketed batch sizes, so decode is not bound by Python.

A decode step has static shapes once its batch size B and block-table width W are fixed, so the whole model
forward for (B, W) is captured once and replayed: each step only writes its packed index arrays into the graph's
static input buffer (one host-to-device copy) and replays. Rows past the real batch are padding: they point at a
scratch state slot and a scratch K/V block, so whatever they compute lands where nobody reads.

The graph samples too (`step_sampled`): the rows' packed sampling parameters go into a second static buffer
and `ops.sample_into` draws every row's next token inside the replay, so a decode step is one index copy, one
parameter copy, one replay and one copy of the token ids back. Rows marked SKIP_DRAW (kernels/sampling.py) are not
drawn: padding rows, and rows with a grammar or logits edits, which the logits-processing stage draws after the
replay (engine/step/logits_processors.py). With `feed`
(engine/step/decode_pipeline.py) rows take their token from an earlier step's ids still on the device (`ops.feed_tokens`
into the graph's token_ids, between the index copy and the replay): the step is queued before those ids reach
the host, and nothing here waits for the device (the copies go through pinned buffers, in stream order).

Speculative verify steps (`rows_step`: every sequence fed the same number R of rows, ModelState.prepare_rows_step)
are captured the same way per (batch bucket, R, table width), once such a shape recurs (its first step runs
eagerly on the same padded batch): the forward with every row's logits and their argmax (greedy parameters),
padding sequences of R rows on the scratch state.

Backends without graph capture (the CPU), and models whose forward cannot be captured (an op that syncs with the
host), fall back to eager steps — same results, only slower.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.step.forward_batch import ForwardBatch, Padding, build_batch
from prefixrun.engine.state.pools import ModelState, StateHandle
from prefixrun.kernels.sampling import SKIP_DRAW


def bucket(n: int) -> int:
    """The power of two at or above n (1 for n <= 1): the sizes decode graphs are captured at (batch, table width),
    and the batch sizes the speculator times steps by (engine/spec/speculator.py)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class _Graph:
    def __init__(self, replay, inputs, params, batch):
        self.replay = replay  # -> (fp32 logits [b, V], int64 token ids [b])
        self.inputs = inputs  # the static packed index buffer the graph reads
        self.params = params  # the static sampling parameters, int32 [8, b] (pack_sampling_params' bits)
        self.batch = batch  # the ForwardBatch of views into `inputs` (token_ids: what `feed` writes)
        self.source = None  # int32 [b]: the feed's source rows (made on a step's first feed)


class DecodeGraphs:
    def __init__(self, model, state: ModelState, ops, max_batch: int):
        self.model, self.state, self.ops = model, state, ops
        self.max_batch = max_batch
        self.enabled = ops.can_capture_graphs
        self.rows_enabled = True  # off once a multi-row step failed to capture (e.g. a ring layer's host sync)
        self.graphs: dict[tuple, _Graph] = {}  # (batch bucket, table width, shared prefixes) or ("rows", b, R, W)
        self.scratch: StateHandle | None = None
        self.captures = 0
        self.replays = 0
        self.rows_captures = 0  # of those, verify steps' graphs
        self.rows_eager = 0  # verify steps run eagerly (a shape's first time, or no graph possible)
        self._rows_seen: set[tuple] = set()  # verify step shapes run once: captured when they recur

    def _padding(self, rows: int, tokens: int = 1) -> Padding:
        """Padding rows up to `rows` of `tokens` tokens each, on a scratch state of one block (made on first use)."""
        if self.scratch is None:
            h = self.state.new_sequence()
            self.state.reserve(h, 1)
            h.length = 1
            self.scratch = h
        return Padding(rows=rows, slot=self.scratch.slot, block=self.scratch.blocks[0], tokens=tokens)

    @property
    def replays_rows(self) -> bool:
        """Whether verify steps run as graphs (of the same rows for every sequence) at all."""
        return self.enabled and self.rows_enabled

    def can_replay_rows(self, sequences: int, rows: int) -> bool:
        """Whether a multi-row step of `sequences` sequences of `rows` rows each can run as a graph: padding
        sequences must fit the scratch block, and every real row but the last of each sequence a snapshot row."""
        return (self.enabled and self.rows_enabled and rows <= self.state.block_size
                and sequences * (rows - 1) <= self.state.snapshot_capacity)

    def rows_step(self, handles: list[StateHandle], pieces: list[list[int]]):
        """A speculative verify step (ModelState.prepare_rows_step; `commit` follows): (fp32 logits [T, V] of every
        row, backend int64 argmax [T]). Replayed as a graph when every piece has the same length and
        `can_replay_rows`; eager otherwise."""
        st, ops = self.state, self.ops
        n, r = len(handles), len(pieces[0]) if pieces else 1
        if not (pieces and all(len(p) == r for p in pieces) and self.can_replay_rows(n, r)):
            self.rows_eager += 1
            logits = self.model.forward(st.prepare_rows_step(handles, pieces), st, all_logits=True)
            return logits, ops.sample(logits, *greedy_params(logits.shape[0]))
        b = bucket(n)
        width = bucket(max(st.blocks_for(h.length + r) for h in handles))
        host = st.rows_step_arrays(handles, pieces, table_width=width, pad=self._padding(b, r) if b > n else None)
        key = ("rows", b, r, width)
        graph = self.graphs.get(key)
        if graph is None:
            # a capture costs a warm-up forward and the capture itself (~2 eager steps): worth it for a shape
            # that recurs, not for one that occurs once (drafts that keep failing make verify steps rare)
            graph = self._capture(host, rows=r) if key in self._rows_seen else None
            if graph is None:
                if key in self._rows_seen:  # this model's multi-row step cannot be captured: eager from now on
                    self.rows_enabled = False  # (decode keeps its graphs)
                self._rows_seen.add(key)
                self.rows_eager += 1
                logits = self.model.forward(host.to_backend(ops.upload_index), st, all_logits=True)[:n * r]
                return logits, ops.sample(logits, *greedy_params(n * r))
            self.rows_captures += 1
            self.graphs[key] = graph
        ops.write_index(graph.inputs, host.pack())
        self.replays += 1
        logits, ids = graph.replay()
        return logits[:n * r], ids[:n * r]

    def close(self):
        """Release the scratch state (the captured graphs stay; they read their inputs afresh every step)."""
        if self.scratch is not None:
            self.state.release(self.scratch)
            self.scratch = None

    def step(self, handles: list[StateHandle], tokens: list[int]):
        """One decode token per handle; returns fp32 logits [len(handles), V]."""
        return self.step_sampled(handles, tokens, None)[0]

    def step_sampled(self, handles: list[StateHandle], tokens: list[int], params, feed=None):
        """One decode token per handle and the next token sampled from its logits: (fp32 logits [n, V], backend
        int64 token ids [n]). params: the rows' sampling parameters packed as kernels/sampling.py
        pack_sampling_params makes them (uint32 [8, n]); None: no sampling (ids None).
        feed: None, or (source int32 [n] on the host, previous: backend int64 ids of an earlier step): rows with
        source[i] >= 0 take previous[source[i]] as their token on the device (their `tokens` entry is ignored),
        so the step can be queued before the earlier step's ids reach the host. Nothing here waits for the device
        (the returned ids are the graph's output buffer: copy them before its next replay is queued)."""
        st = self.state
        if not self.enabled:
            batch = st.prepare_step(handles, [[t] for t in tokens])
            if feed is not None:
                self.ops.feed_tokens(batch.token_ids, self.ops.upload_index(feed[0]), feed[1])
            return self._eager(batch, params)
        n = len(handles)
        b = bucket(n)
        width = bucket(max(st.blocks_for(h.length + 1) for h in handles))
        host = st.step_arrays(handles, [[t] for t in tokens], table_width=width,
                              pad=self._padding(b) if b > n else None)
        key = (b, width, host.shared is not None)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(host)
            if graph is None:  # this model cannot be captured: eager from now on
                self.enabled = False
                batch = host.to_backend(self.ops.upload_index)
                if feed is not None:
                    self.ops.feed_tokens(batch.token_ids, self.ops.upload_index(_padded_source(feed[0], b)),
                                         feed[1])
                logits = self.model.forward(batch, st)[:n]
                return logits, None if params is None else self._draw(logits, params)
            self.graphs[key] = graph
        self.ops.write_index(graph.inputs, host.pack())
        if feed is not None:  # after the index copy, before the replay: the token ids of the fed rows
            if graph.source is None:
                graph.source = self.ops.upload_index(np.full(b, -1, np.int32))
            self.ops.write_index(graph.source, _padded_source(feed[0], b))
            self.ops.feed_tokens(graph.batch.token_ids, graph.source, feed[1])
        if params is not None:
            padded = np.zeros((8, b), np.uint32)
            padded[1, n:] = SKIP_DRAW  # padding rows: nobody reads their token
            padded[:, :n] = params
            self.ops.write_index(graph.params, padded.view(np.int32))
        self.replays += 1
        logits, ids = graph.replay()
        return logits[:n], None if params is None else ids[:n]

    def prepare(self, handles: list[StateHandle]):
        """Capture ahead the graph a decode step of these handles (their first max_batch, one new token each)
        will replay, if there is none yet: the executor calls this while a prefill's work is still queued, so the
        capture's host time (~40 ms at 4b-like shapes, the device idle meanwhile when the step captures it)
        overlaps the device. Nothing is reserved or advanced: a block a sequence's new token will take is stood
        in for by the scratch block (beyond every sequence's cached keys, so the shared-prefix groups are the
        step's own). A guess: if the step that comes has another shape (a sequence ended at its first token),
        it captures its own graph when it runs."""
        handles = handles[:self.max_batch]
        if not (self.enabled and handles):
            return
        st = self.state
        n, b = len(handles), bucket(len(handles))
        width = bucket(max(st.blocks_for(h.length + 1) for h in handles))
        pad = self._padding(b)
        blocks = [list(h.blocks) + [pad.block] * max(0, st.blocks_for(h.length + 1) - len(h.blocks))
                  for h in handles]
        like = build_batch([h.length for h in handles], blocks, [h.slot for h in handles], [[0]] * n,
                           st.block_size, table_width=width, pad=pad if b > n else None, group=st.has_paged)
        key = (b, width, like.shared is not None)
        if key not in self.graphs:
            graph = self._capture(like)
            if graph is not None:  # else the step itself finds out (and turns graphs off)
                self.graphs[key] = graph

    def _eager(self, batch: ForwardBatch, params):
        logits = self.model.forward(batch, self.state)
        return logits, None if params is None else self._draw(logits, params)

    def _draw(self, logits, params: np.ndarray):
        """An eager step's draw: backend int64 ids [n] of the rows not marked SKIP_DRAW in `params` (uint32 [8, n]);
        the skipped rows' entries are 0 until the logits-processing stage draws them."""
        ids = self.ops.zeros((params.shape[1],), np.int64)
        return self.ops.sample_into(logits, self.ops.upload_index(params.view(np.int32)), ids)

    def _capture(self, like: ForwardBatch, rows: int | None = None) -> _Graph | None:
        """A graph of the model's step over batches laid out as the host batch `like` (same rows, table width and
        groups). Warm-up (kernel compilation, cuBLAS binding) runs on a batch of padding rows only, which touches
        nothing but scratch; the capture itself executes nothing, so the real step runs exactly once: at the first
        replay. `rows`: a multi-row step of that many rows per sequence (every row's logits and argmax)."""
        b, width = like.slots.shape[0], like.block_tables.shape[1]
        t = b * (rows or 1)
        warm = self.state.step_arrays([], [], table_width=width, pad=self._padding(b, rows or 1),
                                      snapshot_rows=[] if rows else None)
        inputs = self.ops.upload_index(warm.pack())
        params = self.ops.upload_index(np.zeros((8, t), np.int32))  # greedy until a step writes its rows
        ids = self.ops.zeros((t,), np.int64)
        batch = like.views(inputs)

        def step():
            logits = self.model.forward(batch, self.state, all_logits=rows is not None)
            return logits, self.ops.sample_into(logits, params, ids)

        try:
            step()
            graph = self.ops.capture(step, warmup=0)
        except Exception:
            return None
        self.captures += 1
        return _Graph(graph.replay, inputs, params, batch)


def _padded_source(source, rows: int) -> np.ndarray:
    """A feed's source rows padded to a graph's batch size (padding rows keep their token): int32 [rows]."""
    out = np.full(rows, -1, np.int32)
    out[:len(source)] = source
    return out


def greedy_params(n: int) -> tuple:
    """ops.sample's parameters for n greedy rows (every row's argmax)."""
    return (np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32),
            np.zeros(n, np.uint64), np.zeros(n, np.int64))
