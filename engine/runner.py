"""Executes a window of requests along its token trie: prefill every node once, checkpoint at branch points,
fork children from checkpoints, and decode with continuous batching.

Work order is depth-first over sibling groups: the children of one checkpoint are prefilled together in one
variable-length step (as far as batch and token limits allow), requests whose prompt ends at a node start decoding
from that node's logits, and decoding sequences (at most `max_batch`) step together between prefill groups.
When the checkpoint budget cannot hold a branch point, its children recompute from the nearest ancestor that has
one (or from scratch), so a tiny budget costs compute, never correctness.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from prefixrun.engine.checkpoints import CheckpointEntry, CheckpointPool
from prefixrun.engine.decode_graphs import DecodeGraphs
from prefixrun.engine.plan import TrieNode, build_trie, distinct_tokens
from prefixrun.engine.request import Request, Result, Usage
from prefixrun.engine.state import ModelState, OutOfStateMemory, StateHandle, pool_unit_bytes
from prefixrun.kernels.sampling import as_seed_array


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 32  # decoding sequences per step (and requests per prefill group)
    max_prefill_tokens: int = 8192  # tokens per prefill step; longer segments take several steps
    block_size: int = 16  # K/V rows per paged block
    state_memory_bytes: int = 1 << 30  # slot + block pools, preallocated once
    checkpoint_budget_bytes: int = 256 << 20  # live + retained checkpoints
    reuse: bool = True  # False: every request prefilled from scratch (the baseline)
    retain_block: int = 256  # also keep block-aligned checkpoints of shared prefixes every this many tokens (0 off)
    run_seed: int = 0  # randomness of requests without a seed
    decode_graphs: bool = True  # replay decode steps as CUDA graphs where the backend can capture them

    def __post_init__(self):
        for name in ("max_batch", "max_prefill_tokens", "block_size", "state_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.checkpoint_budget_bytes < 0 or self.retain_block < 0:
            raise ValueError("checkpoint budget and retain block must be >= 0")


@dataclass
class RunStats:
    requests: int = 0
    prompt_tokens: int = 0
    distinct_prefix_tokens: int = 0
    computed_prompt_tokens: int = 0
    reused_tokens: int = 0
    reused_from_disk_tokens: int = 0
    completion_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_decode_batch: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(eq=False)
class _WorkItem:
    """Bring a state from `base` to the end of `node`: prefill path[base.length:] on top of it.

    base: a pool checkpoint (forked, consuming one pin), an `_Owned` state handed over whole, or None (an empty
    state). After a branch point that could not be checkpointed, consumers recompute from an older base, so the
    tokens to compute may span more than the node's own segment.
    """

    node: TrieNode
    base: "CheckpointEntry | _Owned | None"
    path: list[int]  # the full token prefix up to the node's end

    @property
    def base_length(self) -> int:
        return self.base.length if self.base is not None else 0

    @property
    def todo_tokens(self) -> int:
        return len(self.path) - self.base_length


@dataclass(eq=False)
class _Decoder:
    request: Request
    handle: StateHandle
    detok: object
    tokens: list[int] = field(default_factory=list)
    stop_text: str | None = None  # the text cut before a stop string, once one appeared
    done: str | None = None

    @property
    def seed(self) -> int:
        return self.request.sampling.seed


class Engine:
    """Runs windows of requests on one model; keeps the state pools and retained checkpoints across windows."""

    def __init__(self, model, ops, *, eos_token_ids=(), make_detokenizer: Callable | None = None,
                 options: EngineOptions = EngineOptions(), persist=None):
        self.model, self.ops, self.opts = model, ops, options
        self.eos = frozenset(eos_token_ids)
        self.make_detokenizer = make_detokenizer
        self.persist = persist  # optional persistent checkpoint store adapter (engine/persist.py)
        specs = model.state_specs()
        slot_bytes, block_bytes = pool_unit_bytes(specs, ops, options.block_size)
        ckpt_slots = min(512, options.checkpoint_budget_bytes // max(slot_bytes, 1)) if options.reuse else 0
        num_slots = 2 * options.max_batch + ckpt_slots + 4
        rest = options.state_memory_bytes - num_slots * slot_bytes
        num_blocks = max(8, rest // max(block_bytes, 1)) if block_bytes else 1
        self.state = ModelState(specs, ops, num_slots, int(num_blocks), options.block_size)
        self.pool = CheckpointPool(self.state, options.checkpoint_budget_bytes if options.reuse else 0)
        self.decoder = DecodeGraphs(model, self.state, ops, options.max_batch)
        self.decoder.enabled = self.decoder.enabled and options.decode_graphs
        if persist is not None:
            self.pool.on_evict = lambda e: persist.offer(e.tokens, self.state, e.handle, e.logits)
        self.stats = RunStats()
        self.max_context = model.cfg.max_position_embeddings

    # ---- public -------------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> Iterator[Result]:
        """Run one window; yields each Result as soon as its request finishes."""
        if not requests:
            return
        for r in requests:
            if len(r.prompt_token_ids) + 1 > self.max_context:
                raise ValueError(f"request {r.custom_id}: prompt of {len(r.prompt_token_ids)} tokens leaves no "
                                 f"room in the model context of {self.max_context}")
        prompts = [r.prompt_token_ids for r in requests]
        root = build_trie(prompts, share=self.opts.reuse)
        self.stats.requests += len(requests)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.distinct_prefix_tokens += distinct_tokens(build_trie(prompts)) if not self.opts.reuse \
            else distinct_tokens(root)
        window = _Window(self, requests, root)
        yield from window.execute()

    def close(self):
        """Hand retained checkpoints to the persistent store and free them."""
        for e in list(self.pool.entries.values()):
            if self.persist is not None and e.handle.disk_length < e.length:  # not already on disk as is
                self.persist.offer(e.tokens, self.state, e.handle, e.logits)
        self.pool.clear()
        self.decoder.close()
        if self.persist is not None:
            self.persist.flush()

    def check_invariants(self):
        self.state.check_invariants()
        self.pool.check_invariants()


class _Window:
    """The execution of one window: a depth-first walk of its trie interleaved with decode steps."""

    def __init__(self, engine: Engine, requests: list[Request], root: TrieNode):
        self.e = engine
        self.requests = requests
        self._index_of = {id(r): i for i, r in enumerate(requests)}
        self.computed = [0] * len(requests)  # prompt tokens computed on behalf of each request
        self.decoding: list[_Decoder] = []
        self.finished: list[Result] = []
        # stack of pending work, top = next; children pushed reversed so the first child runs first
        self.stack: list[_WorkItem] = []
        for child in reversed(root.ordered_children()):
            self.stack.append(_WorkItem(child, None, child.tokens))

    # ---- main loop ----------------------------------------------------------------------------------------
    def execute(self) -> Iterator[Result]:
        opts = self.e.opts
        while self.stack or self.decoding:
            if self.decoding and (len(self.decoding) >= opts.max_batch or not self.stack
                                  or not self._room_for_next_group()):
                self._decode_step()
            else:
                self._prefill_group(self._take_group())
            while self.finished:
                yield self.finished.pop(0)

    def _take_group(self) -> list[_WorkItem]:
        """Consecutive stack items from the same checkpoint, within the batch and token limits."""
        opts = self.e.opts
        group = [self.stack.pop()]
        seats = opts.max_batch - len(self.decoding) - len(group[0].node.requests)
        tokens = group[0].todo_tokens
        while self.stack and self.stack[-1].base is group[0].base and not isinstance(group[0].base, _Owned):
            nxt = self.stack[-1]
            n_tok = nxt.todo_tokens
            if seats - len(nxt.node.requests) < 0 or tokens + n_tok > opts.max_prefill_tokens \
                    or len(group) >= opts.max_batch:
                break
            group.append(self.stack.pop())
            seats -= len(nxt.node.requests)
            tokens += n_tok
        return group

    def _room_for_next_group(self) -> bool:
        item = self.stack[-1]
        if len(self.decoding) + len(item.node.requests) > self.e.opts.max_batch:
            return False
        st = self.e.state
        need = st.blocks_for(item.node.end + 1) * (1 + len(item.node.requests)) + 1
        return st.blocks.free_count >= need + self._decode_growth() and st.slots.free_count > \
            len(item.node.requests) + 2

    def _decode_growth(self) -> int:
        """Blocks the current decoders still need to reach their maximum length."""
        st = self.e.state
        return sum(max(0, st.blocks_for(d.handle.length + d.request.sampling.max_tokens - len(d.tokens))
                       - len(d.handle.blocks)) for d in self.decoding)

    # ---- prefill ------------------------------------------------------------------------------------------
    def _start_state(self, item: _WorkItem) -> tuple[StateHandle, list[int], object | None]:
        """The state to prefill from, the tokens left to compute, and the end logits if nothing is left.

        Prefers the longest saved state: the persistent store or a retained checkpoint of an earlier window
        when either reaches further than the item's base."""
        e = self.e
        base_len = item.base_length
        found = None
        if e.opts.reuse:
            entry = e.pool.lookup(item.path, base_len, item.node.end)
            if entry is not None and entry is not item.base and (entry.length < item.node.end or entry.logits is not None):
                found = (e.state.fork(entry.handle), entry.logits if entry.length == item.node.end else None)
                e.pool.stats.restored += 1
            elif e.persist is not None:
                found = e.persist.lookup(item.path, base_len, item.node.end, e.state)
        if found is not None:
            self._drop_base(item)
            handle, logits = found
            return handle, item.path[handle.length:], logits
        if item.base is None:
            return e.state.new_sequence(), item.path, None
        if isinstance(item.base, _Owned):
            return item.base.handle, item.path[base_len:], None
        logits = item.base.logits if base_len == item.node.end else None  # a request ending at its checkpoint
        return e.pool.fork(item.base), item.path[base_len:], logits

    def _drop_base(self, item: _WorkItem):
        """The item was served from a longer saved state: give back what its base held for it."""
        if isinstance(item.base, _Owned):
            self.e.state.release(item.base.handle)
        elif item.base is not None:
            self.e.pool.unpin(item.base)

    def _prefill_group(self, group: list[_WorkItem]):
        e = self.e
        # under memory pressure, retained checkpoints give way before anything fails
        st = e.state
        need_blocks = sum(st.blocks_for(item.node.end) + 1 for item in group) + self._decode_growth()
        if not e.pool.evict_for_state(need_blocks, len(group) + 1):
            if not self.decoding and st.blocks.free_count < sum(st.blocks_for(i.node.end) + 1 for i in group):
                raise OutOfStateMemory(
                    f"a prompt of {group[0].node.end} tokens does not fit the state memory "
                    f"({st.blocks.free_count} of {st.blocks.num_blocks} K/V blocks free); raise --state-memory")
        handles, todos, logits = [], [], []
        for item in group:
            h, todo, lg = self._start_state(item)
            handles.append(h)
            todos.append(todo)
            logits.append(lg)
            self.computed[item.node.carrier] += len(todo)
            e.stats.computed_prompt_tokens += len(todo)
        # run the pieces: each step takes up to max_prefill_tokens over the items that still have tokens
        pending = [i for i, t in enumerate(todos) if t]
        offsets = [0] * len(group)
        t0 = time.perf_counter()
        while pending:
            budget = e.opts.max_prefill_tokens
            batch_idx, pieces = [], []
            for i in pending:
                if budget <= 0:
                    break
                stop = self._piece_end(group[i], handles[i], offsets[i], len(todos[i]), budget)
                batch_idx.append(i)
                pieces.append(todos[i][offsets[i]:stop])
                budget -= stop - offsets[i]
            fb = e.state.prepare_step([handles[i] for i in batch_idx], pieces)
            out = e.model.forward(fb, e.state)  # [B, V] logits of each piece's last token
            e.stats.prefill_steps += 1
            for row, i, piece in zip(range(len(batch_idx)), batch_idx, pieces):
                offsets[i] += len(piece)
                if offsets[i] == len(todos[i]):
                    logits[i] = out[row].copy()
                else:
                    self._maybe_retain(group[i], handles[i], out[row])
            pending = [i for i in pending if offsets[i] < len(todos[i])]
        e.ops.synchronize()
        e.stats.prefill_seconds += time.perf_counter() - t0
        for item, h, lg in zip(group, handles, logits):
            self._finish_node(item, h, lg)

    def _piece_end(self, item: _WorkItem, handle: StateHandle, offset: int, total: int, budget: int) -> int:
        """Where this step's piece of an item stops: the token budget, or a block-aligned retention point of a
        shared prefix (so that its state can be kept for later runs, as the seed cache does)."""
        stop = min(total, offset + budget)
        rb = self.e.opts.retain_block
        shared = item.node.consumers > 1 or len(item.node.children) > 0
        if rb and shared and self.e.opts.reuse:
            pos = handle.length  # tokens already in the state
            aligned = ((pos + (total - offset)) - rb) // rb * rb  # the seed's (end - block) // block * block
            if pos < aligned < pos + (stop - offset):
                stop = offset + (aligned - pos)
        return stop

    def _maybe_retain(self, item: _WorkItem, handle: StateHandle, logits_row):
        """Keep a copy of an intermediate state at a block-aligned point (evictable, for later runs)."""
        e = self.e
        rb = e.opts.retain_block
        if not rb or handle.length % rb or e.persist is None:
            return
        copy = e.state.fork(handle)
        prefix = item.path[:handle.length]
        if e.pool.save(prefix, copy, logits_row.copy(), pins=0, retain=True) is None:
            e.state.release(copy)

    def _finish_node(self, item: _WorkItem, handle: StateHandle, logits):
        """The node's end state is ready: start its requests' decoding and queue its children."""
        e, node = self.e, item.node
        children = node.ordered_children()
        entry = None
        if node.consumers > 1 and e.opts.reuse:
            entry = e.pool.save(item.path, handle, logits, pins=node.consumers, retain=e.persist is not None)
        if entry is not None:
            for child in reversed(children):
                self.stack.append(_WorkItem(child, entry, item.path + child.tokens))
            # requests ending here start decoding now as far as seats allow; the rest wait on the stack (zero
            # tokens to compute, they fork from the checkpoint and take its logits when their turn comes)
            seats = max(0, e.opts.max_batch - len(self.decoding))
            for rid in reversed(node.requests[seats:]):
                self.stack.append(_WorkItem(_single_request_node(node, rid), entry, item.path))
            for rid in node.requests[:seats]:
                self._start_decoding(rid, e.pool.fork(entry), entry.logits)
            return
        if e.persist is not None and node.requests and e.opts.reuse:
            e.persist.offer(item.path, e.state, handle, logits)  # the end of a prompt, for later runs
        # No checkpoint (one consumer, no reuse, or no budget): the state goes to the first consumer whole; the
        # others recompute from this item's base if it is still a live checkpoint, else from scratch.
        fallback = item.base if isinstance(item.base, CheckpointEntry) and \
            e.pool.entries.get(item.base.tokens) is item.base else None
        later: list[_WorkItem] = []
        for rid in node.requests[1:]:  # exact duplicates
            later.append(_WorkItem(_single_request_node(node, rid), fallback, item.path))
        for child in children[0 if node.requests else 1:]:
            later.append(_WorkItem(child, fallback, item.path + child.tokens))
        if fallback is not None:
            fallback.pins += len(later)
        for w in reversed(later):
            self.stack.append(w)
        if node.requests:
            self._start_decoding(node.requests[0], handle, logits)
        elif children:
            self.stack.append(_WorkItem(children[0], _Owned(handle), item.path + children[0].tokens))
        else:
            e.state.release(handle)

    # ---- decode -------------------------------------------------------------------------------------------
    def _start_decoding(self, rid: int, handle: StateHandle, logits):
        req = self.requests[rid]
        dec = _Decoder(req, handle, self.e.make_detokenizer() if self.e.make_detokenizer else None)
        self._accept(dec, self._sample([dec], logits[None] if logits.ndim == 1 else logits)[0])
        if dec.done:
            self._finish(dec)
        else:
            self.decoding.append(dec)

    def _sample(self, decs: list[_Decoder], logits) -> list[int]:
        """One token per decoder from logits [B, V], drawn on the backend for the whole batch at once: the
        random number of a request's n-th token is a function of (its seed, n) only (kernels/sampling.py)."""
        sp = [d.request.sampling for d in decs]
        ids = self.e.ops.sample(logits, np.array([0.0 if s.greedy else s.temperature for s in sp], np.float32),
                                np.array([max(s.top_k, 0) for s in sp], np.int32),
                                np.array([s.top_p for s in sp], np.float32), np.array([s.min_p for s in sp], np.float32),
                                as_seed_array([self._seed_of(d) for d in decs]),
                                np.array([len(d.tokens) for d in decs], np.int64))
        return [int(i) for i in self.e.ops.to_host(ids)]

    def _seed_of(self, d: _Decoder) -> int:
        if d.seed is not None:
            return d.seed
        return zlib.crc32(d.request.custom_id.encode()) ^ (self.e.opts.run_seed * 0x9E3779B1)

    def _decode_step(self):
        e = self.e
        batch = self.decoding[:e.opts.max_batch]
        e.stats.peak_decode_batch = max(e.stats.peak_decode_batch, len(batch))
        t0 = time.perf_counter()
        out = e.decoder.step([d.handle for d in batch], [d.tokens[-1] for d in batch])  # [B, V]
        ids = self._sample(batch, out)
        e.stats.decode_seconds += time.perf_counter() - t0
        e.stats.decode_steps += 1
        for d, tok in zip(batch, ids):
            self._accept(d, tok)
        for d in [d for d in batch if d.done]:
            self.decoding.remove(d)
            self._finish(d)

    def _accept(self, d: _Decoder, tok: int):
        """Append a sampled token and decide whether the request is done (eos, stop id/string, length)."""
        sp = d.request.sampling
        d.tokens.append(tok)
        if (tok in self.e.eos and not sp.ignore_eos) or tok in sp.stop_token_ids:
            d.done = "stop"
            return
        if d.detok is not None:
            d.detok.feed(tok)
            if sp.stop:
                text = d.detok.text
                hits = [text.find(s) for s in sp.stop if s in text]
                if hits:
                    d.stop_text = text[:min(hits)]
                    d.done = "stop"
                    return
        if len(d.tokens) >= sp.max_tokens or d.handle.length + 1 >= self.e.max_context:
            d.done = "length"

    def _finish(self, d: _Decoder):
        e = self.e
        from_disk = min(d.handle.disk_length, len(d.request.prompt_token_ids))
        e.state.release(d.handle)
        idx = self._index_of[id(d.request)]
        if d.detok is None:
            text = ""
        elif d.stop_text is not None:
            text = d.stop_text
        else:
            d.detok.flush()  # bytes held back for an incomplete character
            text = d.detok.text
        prompt_len = len(d.request.prompt_token_ids)
        cached = prompt_len - self.computed[idx]
        e.stats.reused_tokens += cached
        e.stats.reused_from_disk_tokens += from_disk
        e.stats.completion_tokens += len(d.tokens)
        self.finished.append(Result(d.request.custom_id, d.request.index, list(d.tokens), text, d.done,
                                    Usage(prompt_len, len(d.tokens), cached, from_disk)))


class _Owned:
    """Marks a work item whose base state is owned outright (handed over, not a pool checkpoint)."""

    def __init__(self, handle: StateHandle):
        self.handle = handle
        self.length = handle.length


def _single_request_node(node: TrieNode, rid: int) -> TrieNode:
    """A stand-in node for one duplicate request ending at `node` (recomputed when no checkpoint was possible)."""
    return TrieNode(node.start, node.tokens, node.parent, {}, [rid], rid)
