"""The logits-processing stage: every per-row change to a step's logits before its tokens are drawn, in one place
and one order.

What a request asks for (engine/request.py SamplingParams, vLLM's names) and what the model's generation_config
adds (engine/load/tokenizer.py GenerationDefaults), applied per row with per-row parameters in vLLM v1's order:
  1. the token bitmask: structured output's grammar (engine/grammar/masks.py fills it) AND allowed_token_ids,
     applied by `ops.apply_token_bitmask`;
  2. bans: bad_words (vLLM: a word's token sequences with and without a leading space, matched against the
     generated tokens), min_tokens (EOS and stop_token_ids while fewer tokens than that are generated), the
     model's suppress_tokens (always), begin_suppress_tokens (at the first generated token), min_length (EOS
     while prompt and output are shorter), bad_words_ids (as transformers matches them: against prompt and output)
     and no_repeat_ngram_size (a token that would repeat an n-gram of the prompt and output);
  3. logit_bias (token id -> added to its logit);
  4. penalties: repetition (vLLM and transformers: over prompt AND generated tokens, a positive logit divided by
     it, a negative one multiplied), frequency and presence (OpenAI, vLLM: over generated tokens only).
2-4 are one `LogitsEdits` per step, built here and applied by `ops.process_logits` (kernels/logits_edits.py: the
layout and the reference). A row with none of these is left out, and a step with no such row runs exactly the path
without the stage: its graph's own draw stands (`LogitsStage.redraw` returns None).

When: after a decode step's forward and once the host has accepted every token before the step's (the decode
pipeline queues step n+1's forward, accepts step n's tokens, then finishes step n+1: engine/step/decode_pipeline.py),
so grammars, penalties and bad words see every earlier token; the edited rows are then drawn with the step's own
sampling parameters (the same uniforms), after the graph's replay, in the same stream, into the graph's ids. The
graph's own draw leaves these rows out (their parameters marked SKIP_DRAW, kernels/sampling.py), so every row of a
step is drawn once: a constrained step costs its forward, the masks' upload and apply, and one draw. The host
builds the edits and masks while the device computes the forward.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.grammar.compiler import UNCONSTRAINED
from prefixrun.engine.request import ModelProcessing
from prefixrun.kernels.logits_edits import SEEN, LogitsEdits
from prefixrun.kernels.sampling import with_skipped_rows


class _Entries:
    """A row's adjusted tokens as growable arrays (token, bias, generated count, flags), one entry per token."""

    def __init__(self):
        self.index: dict[int, int] = {}
        self.tokens = np.zeros(16, np.int32)
        self.bias = np.zeros(16, np.float32)
        self.counts = np.zeros(16, np.int32)
        self.flags = np.zeros(16, np.int32)
        self.n = 0

    def at(self, token: int) -> int:
        """The entry of `token` (made if new; call before indexing the arrays: it may grow them)."""
        i = self.index.get(token)
        if i is None:
            if self.n == self.tokens.shape[0]:
                for name in ("tokens", "bias", "counts", "flags"):
                    old = getattr(self, name)
                    setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
            i = self.index[token] = self.n
            self.tokens[i] = token
            self.n += 1
        return i


class _NGrams:
    """no_repeat_ngram_size as transformers applies it: the tokens that, after the last n - 1 of prompt and output,
    would complete an n-gram that already occurs in them."""

    def __init__(self, n: int, prompt_token_ids):
        self.n, self.history = n, []
        self.next: dict[tuple, set[int]] = {}  # (n - 1)-gram -> the tokens that followed it
        for token in prompt_token_ids:
            self.add(int(token))

    def add(self, token: int) -> None:
        self.history.append(token)
        if len(self.history) >= self.n:
            self.next.setdefault(tuple(self.history[len(self.history) - self.n:-1]), set()).add(token)

    def banned(self) -> list[int]:
        if len(self.history) + 1 < self.n:
            return []
        return sorted(self.next.get(tuple(self.history[len(self.history) - self.n + 1:]), ()))


class RowProcessing:
    """One sequence's part of the stage. `active` is False for a row with nothing to apply (it is then left out)."""

    def __init__(self, sampling, prompt_token_ids, *, stop_ids=(), eos=(), bad_words=(),
                 model: ModelProcessing = ModelProcessing()):
        """`stop_ids`: what min_tokens holds off (stop_token_ids, and the EOS ids unless ignore_eos); `eos`: the
        model's EOS ids (what its min_length holds off)."""
        sp = sampling
        self.penalties = (float(sp.repetition_penalty), float(sp.frequency_penalty), float(sp.presence_penalty))
        self.counted = sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1
        self.entries = _Entries()
        for token, bias in sp.logit_bias:
            i = self.entries.at(int(token))
            self.entries.bias[i] = bias
        if sp.repetition_penalty != 1:
            for token in np.unique(np.asarray(prompt_token_ids, np.int64)).tolist():
                i = self.entries.at(token)
                self.entries.flags[i] |= SEEN
        self.min_tokens, self.stop_ids = sp.min_tokens, tuple(stop_ids)
        self.bad_words = [tuple(w) for w in bad_words if w]
        self.suppress, self.begin_suppress = model.suppress_tokens, model.begin_suppress_tokens
        self.ngrams = _NGrams(model.no_repeat_ngram_size, prompt_token_ids) if model.no_repeat_ngram_size else None
        self.eos_until = (tuple(eos), model.min_length - len(prompt_token_ids)) if model.min_length else ((), 0)
        self.model_words = [tuple(w) for w in model.bad_words_ids]
        self.reach = max((len(w) - 1 for w in self.model_words), default=0)  # tokens a word's prefix spans
        self.prompt_tail = tuple(int(t) for t in prompt_token_ids[max(0, len(prompt_token_ids) - self.reach):])
        self.allowed = sp.allowed_token_ids
        self._allowed_set = None if self.allowed is None else frozenset(self.allowed)
        self._allowed_words: np.ndarray | None = None
        self.edits = bool(self.entries.n or self.counted or self.min_tokens or self.bad_words or self.suppress
                          or self.begin_suppress or self.ngrams or self.eos_until[1] > 0 or self.model_words)
        self.active = self.edits or self.allowed is not None

    def accepted(self, token: int) -> None:
        """A generated token the host now knows (Sequence.accept)."""
        if self.ngrams is not None:
            self.ngrams.add(int(token))
        if self.counted:
            i = self.entries.at(int(token))
            self.entries.counts[i] += 1
            self.entries.flags[i] |= SEEN

    def permits(self, token: int) -> bool:
        """Whether `token`, as drawn, is one allowed_token_ids allows. A draw outside them means the bans took every
        allowed token (the sampler then draws from all tokens alike): the row cannot go on."""
        return self._allowed_set is None or token in self._allowed_set

    def allowed_words(self, words: int) -> np.ndarray | None:
        """allowed_token_ids as a token bitmask row (int32 [words]), or None: every token allowed."""
        if self.allowed is None:
            return None
        if self._allowed_words is None or self._allowed_words.shape[0] != words:
            bits = np.zeros(words * 32, np.uint8)
            ids = np.asarray(self.allowed, np.int64)
            bits[ids[ids < words * 32]] = 1
            self._allowed_words = np.packbits(bits, bitorder="little").view(np.int32)
        return self._allowed_words

    def bans(self, generated: list[int]) -> list[int]:
        """The tokens banned as the next token after `generated`."""
        made = len(generated)
        banned = list(self.stop_ids) if made < self.min_tokens else []
        banned += self.suppress
        if made == 0:
            banned += self.begin_suppress
        if self.ngrams is not None:
            banned += self.ngrams.banned()
        if made < self.eos_until[1]:
            banned += self.eos_until[0]
        if self.model_words:  # transformers: the word's first tokens may end the prompt
            recent = self.prompt_tail + tuple(generated[max(0, len(generated) - self.reach):])
            banned += [w[-1] for w in self.model_words
                       if len(w) == 1 or (len(recent) >= len(w) - 1 and recent[len(recent) - len(w) + 1:] == w[:-1])]
        for word in self.bad_words:
            before = len(word) - 1  # tokens that must precede its last one (vLLM: among the generated tokens)
            if before <= made and (before == 0 or tuple(generated[-before:]) == word[:before]):
                banned.append(word[-1])
        return banned


class LogitsStage:
    """A step's masks and edits for its rows, applied through the backend, and the rows drawn again."""

    def __init__(self, ops, masks):
        """`masks`: engine/grammar/masks.py TokenMasks (the grammars' bitmasks and the step's device buffers)."""
        self.ops, self.masks = ops, masks
        self.steps = 0  # steps drawn again under the stage
        self._edits_buffer = None  # device int32, grown to the largest step's packed edits (written in place)

    @staticmethod
    def involves(seqs) -> bool:
        """Whether any of these sequences has a mask or an edit for the stage."""
        return any(s.processing.active or s.grammar.constrained for s in seqs)

    @staticmethod
    def staged(seqs) -> np.ndarray:
        """bool [n]: the rows the stage draws (a mask or an edit), fixed for a sequence's whole life: a decode step
        leaves them out of its graph's draw (kernels/sampling.py SKIP_DRAW) and `redraw` draws them."""
        return np.fromiter((s.processing.active or s.grammar.constrained for s in seqs), bool, len(seqs))

    def redraw(self, seqs, logits, params: np.ndarray, drawn=None):
        """Backend int64 ids [n]: each row's token drawn from `logits` [n, V] (fp32, edited in place) after the
        stage, with its packed sampling parameters `params` (uint32 [8, n], pack_sampling_params); None when no
        row has anything for the stage (logits untouched). A row whose sequence has ended (its token is never
        accepted) is left alone. `drawn`: the step's ids where its graph drew every row but the `staged` ones;
        those are drawn into it in place, so each row is drawn once. Without it every row is drawn, into a
        buffer the next redraw reuses."""
        if not self.involves(seqs):  # the common step: nothing to build
            return None
        live = [s if not s.done else None for s in seqs]
        mask = self.masks.host_masks([s.grammar if s is not None else UNCONSTRAINED for s in live])
        mask = self._with_allowed(live, mask)
        edits = self.edits(live)
        if mask is None and edits is None:
            return None
        ops = self.ops
        mask_buffer, packed, ids = self.masks.buffers(len(seqs))
        if mask is not None:
            ops.write_index(mask_buffer, mask)
            ops.apply_token_bitmask(logits, mask_buffer)
            self.masks.steps += 1
        if edits is not None:
            ops.process_logits(logits, self._device_edits(edits.pack()))
        if drawn is not None:  # the graph drew the rest: only the live staged rows here
            params = with_skipped_rows(params, ~self.staged(seqs) | np.array([s is None for s in live]))
            ids = drawn
        ops.write_index(packed, np.ascontiguousarray(params, np.uint32).view(np.int32))
        self.steps += 1
        return ops.sample_into(logits, packed, ids)

    def _device_edits(self, packed: np.ndarray):
        """The packed edits on the device: written into a buffer kept across steps (through the backend's pinned
        step copies, in stream order: the host never waits for the queued forward), grown when a step needs more."""
        n = packed.shape[0]
        if self._edits_buffer is None or self._edits_buffer.shape[0] < n:
            self._edits_buffer = self.ops.upload_index(np.zeros(max(n, 2 * (0 if self._edits_buffer is None else
                                                                           self._edits_buffer.shape[0])), np.int32))
        view = self._edits_buffer[:n]
        self.ops.write_index(view, packed)
        return view

    def _with_allowed(self, live, mask: np.ndarray | None) -> np.ndarray | None:
        """The grammars' mask (None: none) AND each row's allowed_token_ids."""
        words = self.masks.words
        for r, s in enumerate(live):
            allowed = s.processing.allowed_words(words) if s is not None else None
            if allowed is not None:
                if mask is None:
                    mask = np.full((len(live), words), -1, np.int32)
                mask[r] &= allowed
        return mask

    @staticmethod
    def edits(seqs) -> LogitsEdits | None:
        """The edits of a step whose row i is seqs[i] (None: a row left alone); None when no row has any."""
        if not any(s is not None and s.processing.edits for s in seqs):
            return None
        b = len(seqs)
        entry_counts, ban_counts = np.zeros(b + 1, np.int64), np.zeros(b + 1, np.int64)
        penalties = np.zeros((3, b), np.float32)
        penalties[0] = 1.0
        parts, bans = [], []
        for r, s in enumerate(seqs):
            if s is None or not s.processing.edits:
                continue
            p, e = s.processing, s.processing.entries
            parts.append((e.tokens[:e.n], e.bias[:e.n], e.counts[:e.n], e.flags[:e.n]))
            entry_counts[r + 1] = e.n
            banned = p.bans(s.tokens)
            bans += banned
            ban_counts[r + 1] = len(banned)
            penalties[:, r] = p.penalties
        cat = lambda i, dtype: np.concatenate([x[i] for x in parts]).astype(dtype) if parts else np.zeros(0, dtype)
        return LogitsEdits(np.cumsum(entry_counts).astype(np.int32), np.cumsum(ban_counts).astype(np.int32),
                           penalties, cat(0, np.int32), cat(1, np.float32), cat(2, np.int32), cat(3, np.int32),
                           np.array(bans, np.int32))


def needs_plain_steps(seqs) -> bool:
    """Whether a decode step over `seqs` must be a plain one (no speculation): a row has a grammar, other logits
    processing or wants logprobs, none of which a speculative verify step applies."""
    return LogitsStage.involves(seqs) or any(s.request.sampling.wants_logprobs for s in seqs)
