"""Executes steps on the backend: a prefill forward over variable-length pieces, a decode step (replayed as a
CUDA graph where the backend can capture one), and sampling the next token of a batch of sequences."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixrun.engine.grammar.masks import TokenMasks
from prefixrun.engine.plan.planner import CHUNK_GRID
from prefixrun.engine.request import TokenLogprob
from prefixrun.engine.step.decode_graphs import DecodeGraphs, greedy_params
from prefixrun.engine.step.logits_processors import LogitsStage
from prefixrun.engine.step.sequence import Sequence
from prefixrun.engine.state.pools import ModelState, StateHandle
from prefixrun.engine.spec.verify import accept_greedy, accept_sampled
from prefixrun.kernels.sampling import as_seed_array, pack_sampling_params, with_skipped_rows

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = (1 << 31) - 1


@dataclass(eq=False)
class DecodeLaunch:
    """A decode step queued on the device: its rows, their fp32 logits [n, V] and sampled ids (backend int64 [n],
    valid until the next step is queued), and the packed sampling parameters they were drawn with."""

    seqs: list[Sequence]
    logits: Any
    ids: Any
    params: np.ndarray  # uint32 [8, n], pack_sampling_params
    staged: np.ndarray  # bool [n]: the rows the graph left undrawn, for the logits-processing stage to draw
    logprobs: Any = None  # set by finish_decode: the rows' logprobs for record_logprobs (None: no row wants them)


class ModelRunner:
    def __init__(self, model, state: ModelState, ops, max_batch: int, *, graphs: bool, run_seed: int,
                 masks: TokenMasks | None = None):
        """`masks`: structured output's masks, sized for the grammars' vocabulary (default: the model's)."""
        self.model, self.state, self.ops = model, state, ops
        self.masks = masks or TokenMasks(ops, (model.cfg.vocab_size + 31) // 32)
        self.stage = LogitsStage(ops, self.masks)
        self.decoder = DecodeGraphs(model, state, ops, max_batch)
        self.decoder.enabled = self.decoder.enabled and graphs
        self.run_seed = run_seed
        self.last_hidden = None  # verify(with_hidden=True): final-normed hidden states [T, D] of its rows
        self.last_row_starts: list[int] = []  # each sequence's first row in those

    def prefill(self, handles: list[StateHandle], pieces: list[list[int]]):
        """Append each piece to its handle's state; returns [B, V] logits of each piece's last token."""
        return self.model.forward(self._prefill_batch(handles, pieces), self.state)

    def _prefill_batch(self, handles: list[StateHandle], pieces: list[list[int]]):
        """A prefill step's batch. Deterministic backends chunk each piece from its first token, so every piece
        must start on the chunk grid (the planner and the executor place them there): else one token would take
        different numbers on different paths, which is what the mode rules out."""
        if self.ops.deterministic:
            off = [h.length for h in handles if h.length % CHUNK_GRID]
            if off:
                raise RuntimeError(f"deterministic prefill from position {off[0]}, off the {CHUNK_GRID}-token grid")
        return self.state.prepare_step(handles, pieces, prefill=True)

    def feed(self, handles: list[StateHandle], pieces: list[list[int]]):
        """Append each piece to its handle's state as decode steps append tokens (not a prefill step: batch-invariant
        kernels compute its rows as they compute decode rows); returns [B, V] logits of each piece's last token."""
        return self.model.forward(self.state.prepare_step(handles, pieces), self.state)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def generated_tokens_as_steps(self) -> bool:
        """Whether generated tokens must be fed back as decode steps, never prefilled (engine/load/config.py)."""
        return self.model.cfg.generated_tokens_as_steps

    def prefill_rows(self, handles: list[StateHandle], pieces: list[list[int]]):
        """`prefill` returning every row's logits [T, V] (the pieces' rows in order): prompt logprobs score them."""
        return self.model.forward(self._prefill_batch(handles, pieces), self.state, all_logits=True)

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """Feed each sequence's last token and sample its next one; both run in the decode graph where the
        backend captures one (rows with a grammar or edits are drawn after it, under their mask: `finish_decode`)."""
        launch = self.launch_decode(seqs, np.full(len(seqs), -1, np.int32), None)
        out = [int(i) for i in self.ops.to_host(self.finish_decode(launch))]
        self.record_logprobs(seqs, out, launch.logprobs)
        return out

    def prepare_decode(self, handles: list[StateHandle]):
        """Get the decode graph of a step over these states ready ahead of it (DecodeGraphs.prepare)."""
        self.decoder.prepare(handles)

    def launch_decode(self, seqs: list[Sequence], source: np.ndarray, previous) -> DecodeLaunch:
        """`decode` queued without waiting for the device: sequence i is fed previous[source[i]] (the token an
        earlier step sampled for it, not yet accepted on the host) where source[i] >= 0, else its last token.
        The step's ids are `finish_decode`'s."""
        ahead = (source >= 0).astype(np.int64)  # tokens each sequence has beyond s.tokens when this one is drawn
        params = pack_sampling_params(*self._sampling_arrays(seqs, ahead))
        staged = self.stage.staged(seqs)  # drawn once, by `finish_decode`, after their masks and edits
        logits, ids = self.decoder.step_sampled(
            [s.handle for s in seqs], [0 if a else s.tokens[-1] for s, a in zip(seqs, ahead)],
            with_skipped_rows(params, staged) if staged.any() else params,
            feed=(source, previous) if ahead.any() else None)
        return DecodeLaunch(seqs, logits, ids, params, staged)

    def finish_decode(self, launch: DecodeLaunch):
        """The launched step's backend int64 ids [n] (valid until the next step is queued: copy them first): the
        graph's draw, and the rows with a mask or edits (which the graph left undrawn) drawn into them after the
        logits-processing stage (engine/step/logits_processors.py). Call it once every row has taken the tokens
        before this step's; a row whose sequence has ended meanwhile (its token is never accepted) is left
        alone. The rows that want logprobs get them (of the raw logits) in `launch.logprobs` for
        `record_logprobs`."""
        raw = launch.logits
        edited = raw.copy() if self._wants_logprobs(launch.seqs) and self.stage.involves(launch.seqs) else raw
        if launch.staged.any():
            self.stage.redraw(launch.seqs, edited, launch.params, drawn=launch.ids)
        ids = launch.ids
        launch.logprobs = self._logprobs_later(launch.seqs, raw, ids)
        return ids

    def verify(self, seqs: list[Sequence], drafts: list[list[int]], with_hidden: bool = False,
               pad_to: int | None = None) -> list[list[int]]:
        """One multi-row step: each sequence is fed its last token then its drafts; returns each sequence's tokens
        (the accepted drafts, then the target's own next token: engine/spec/verify.py). The caller commits
        len(tokens[i]) rows of each (ModelState.commit). `pad_to`: the rows per sequence a replayed graph should
        have where they fit (fewer distinct graphs)."""
        pieces = [[s.tokens[-1]] + list(d) for s, d in zip(seqs, drafts)]
        handles = [s.handle for s in seqs]
        r = max(len(p) for p in pieces)
        if with_hidden:  # the drafter needs every row's hidden state: an eager step returns it
            self.decoder.rows_eager += 1
            out = self.model.forward(self.state.prepare_rows_step(handles, pieces), self.state, all_logits=True,
                                     with_hidden=True)
            logits, self.last_hidden = out  # [T, V], [T, D]
            argmax = self.ops.sample(logits, *greedy_params(logits.shape[0]))
        else:
            # a graph replays R rows per sequence: shorter pieces are padded with rows that are computed and then
            # rejected (never kept: verification reads only a sequence's own drafts), where every sequence has
            # room; R = `pad_to` where it fits (one graph per batch size and width, whatever the drafts' lengths)
            fits = lambda n: self.decoder.can_replay_rows(len(seqs), n) and all(
                n <= s.remaining and s.handle.length + n + 2 <= s.max_context for s in seqs)
            r = max(r, pad_to) if pad_to and fits(max(r, pad_to)) else r
            if fits(r):
                pieces = [p + [p[-1]] * (r - len(p)) for p in pieces]
            logits, argmax = self.decoder.rows_step(handles, pieces)  # [T, V], backend [T]
        starts = np.cumsum([0] + [len(p) for p in pieces])[:-1].tolist()
        self.last_row_starts = starts
        argmax = self.ops.to_host(argmax)  # every row's argmax (the sampler's temperature-0 rows: lowest id on ties)
        tokens = []
        for s, d, start in zip(seqs, drafts, starts):
            sp = s.request.sampling
            if sp.greedy:
                tokens.append(accept_greedy(d, argmax[start:start + len(d) + 1]))
            else:
                rows = self.ops.to_host(logits[start:start + len(d) + 1]).astype(np.float32)  # [k + 1, V]
                tokens.append(accept_sampled(d, rows, sp, self._seed_of(s), len(s.tokens)))
        return tokens

    def sample(self, seqs: list[Sequence], logits) -> list[int]:
        """One token per sequence from logits [B, V], drawn on the backend for the whole batch at once: the
        random number of a request's n-th token is a function of (its seed, n) only (kernels/sampling.py). Rows
        with a mask or edits draw after the logits-processing stage (on a copy: the logits may be a checkpoint's,
        shared); rows that want logprobs record them (of the raw logits)."""
        arrays = self._sampling_arrays(seqs)
        ids = None
        if self.stage.involves(seqs):
            ids = self.stage.redraw(seqs, logits.astype(np.float32), pack_sampling_params(*arrays))
        if ids is None:
            ids = self.ops.sample(logits, *arrays)
        fetch = self._logprobs_later(seqs, logits, ids)
        out = [int(i) for i in self.ops.to_host(ids)]
        self.record_logprobs(seqs, out, fetch)
        return out

    @staticmethod
    def _wants_logprobs(seqs: list[Sequence]) -> bool:
        return any(s.request.sampling.wants_logprobs for s in seqs)

    def _logprobs_later(self, seqs: list[Sequence], logits, ids):
        """Queue the logprobs of the rows that want them (raw logits [B, V], sampled backend ids [B]); returns a
        function giving them on the host (float32 [R, 1 + 2k], kernels/logits_edits.py top_logprobs), or None."""
        rows = [i for i, s in enumerate(seqs) if s.request.sampling.wants_logprobs and not s.done]
        if not rows:
            return None
        k = max(seqs[i].request.sampling.logprob_alternatives for i in rows)
        later = self.ops.to_host_later(self.ops.token_logprobs(logits, self.ops.upload_index(np.array(rows)), ids, k))
        return lambda: (rows, later())

    @staticmethod
    def record_logprobs(seqs: list[Sequence], tokens: list[int], fetch) -> None:
        """Append to each wanting sequence its token's TokenLogprob, before `accept` may end it. `fetch`: what
        `_logprobs_later` returned (None: no row wants them)."""
        if fetch is None:
            return
        rows, table = fetch()  # [R, 1 + 2k]
        k = (table.shape[1] - 1) // 2
        for i, row in zip(rows, table):
            s = seqs[i]
            if s.done:
                continue
            top = tuple((int(row[1 + k + j]), float(row[1 + j])) for j in range(s.request.sampling.logprob_alternatives))
            s.logprobs.append(TokenLogprob(int(tokens[i]), float(row[0]), top))
            s.cumulative_logprob += float(row[0])

    def _sampling_arrays(self, seqs: list[Sequence], ahead: np.ndarray | None = None) -> tuple:
        """Per-row (temperature, top_k, top_p, min_p, seeds, counters), as ops.sample takes them. A row's counter is
        the index of the token being drawn: its tokens so far, plus `ahead[i]` drawn but not yet accepted."""
        sp = [s.request.sampling for s in seqs]
        counters = np.array([len(s.tokens) for s in seqs], np.int64)
        if ahead is not None:
            counters += ahead
        # A request's numbers are unbounded JSON; the arrays are float32 / int32. Clamped, each keeps its meaning:
        # a temperature past float32's range is the flattest distribution (as inf would be, without inf's NaNs),
        # a top_k past the vocabulary (so past int32) is no filter.
        temperatures = np.array([0.0 if p.greedy else p.temperature for p in sp], np.float64)
        return (np.minimum(temperatures, _FLOAT32_MAX).astype(np.float32),
                np.array([min(max(p.top_k, 0), _INT32_MAX) for p in sp], np.int32),
                np.array([p.top_p for p in sp], np.float32), np.array([p.min_p for p in sp], np.float32),
                as_seed_array([self._seed_of(s) for s in seqs]), counters)

    def _seed_of(self, s: Sequence) -> int:
        """The request's seed (without one: derived from its custom_id and the run's seed), plus the sample's index,
        as vLLM seeds its n samples: sample 0 draws as a request with n = 1, sample i as the same request with
        n = 1 and seed + i."""
        seed = s.request.sampling.seed
        if seed is None:
            seed = zlib.crc32(s.request.custom_id.encode()) ^ (self.run_seed * 0x9E3779B1)
        return seed + s.sample

    def close(self):
        self.decoder.close()

