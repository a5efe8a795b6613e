"""A window of tokenized requests -> token trie -> an explicit plan: a tree of tasks, printable and cut-able.

The trie is compressed: each node holds the segment of tokens between two branch points. A node's end state is
checkpointed when more than one consumer (a child segment or a request whose prompt ends there) needs it — at the
exact branching offset, not rounded to a block.

The plan has one `Task` per unit of work. A task brings a state to the end of its node: it starts from its base
task's end state (forked from the base's checkpoint, or handed over whole when the base has a single consumer;
no base = an empty state), computes the tokens in between, then either saves a checkpoint for its consumers
(`saves`), or starts decoding its one request, or hands its state to its one child. Every request ending at a
branch point is a task of its own with no tokens to compute (it forks the checkpoint and takes its logits).

A request that decodes several sequences (n samples) has one decode task per sample, each with no tokens
to compute: its prompt's end is a branch point like any other, so the samples share one prefill and its last
logits. Where those samples are the end's only consumers, the task `fans_out`: they fork its state directly
(no checkpoint in the pool: nothing else will ever want that state).

So each distinct prefix token belongs to exactly one task, and an execution that runs each task's own tokens once
computes exactly `distinct_tokens` prompt tokens. A task's subtree (`Plan.subtree`) is self-contained given its
base's state: the unit a later multi-worker split hands out. The runner executes tasks in a dependency-respecting
order and records what it really did in a `Trace` (engine/plan/trace.py), including every adaptation to the pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# --deterministic: the chunk of the chunked delta rule (64 tokens in every kernel), as a grid of absolute positions.
# A prefill piece then always starts on it, so each chunk is [64 i, min(64 (i + 1), end)) on every path a prompt
# can take: branch checkpoints move down to the grid (`snap_to_grid`) and continuations recompute the tail.
CHUNK_GRID = 64


def chunk_grid(ops) -> int:
    """Where `ops`' prefill pieces must start and states be resumed from: multiples of this (0: anywhere). A
    backend with batch-invariant kernels chunks each prefill piece from its first token."""
    return CHUNK_GRID if ops.deterministic else 0


def resumable(grid: int, end: int):
    """The saved lengths a task ending at `end` may start from (None: any). On a grid a state continues with more
    prefill only from a grid line; at its own end (a prompt's, with its logits) it needs none."""
    return (lambda n: n % grid == 0 or n == end) if grid else None


def grid_stop(grid: int, pos: int, stop: int, first: bool) -> int:
    """Where a prefill piece from `pos` (on the grid) that the budget would end at `stop` (short of its task's end)
    ends on the grid: the line at or below `stop`, else for the step's `first` piece the next line, else `pos`
    (no piece this step)."""
    line = stop // grid * grid
    return line if line > pos else pos + grid if first else pos


@dataclass(eq=False)
class TrieNode:
    start: int  # prompt tokens before this node's segment
    tokens: list[int]  # the segment
    parent: "TrieNode | None" = None
    children: dict[int, "TrieNode"] = field(default_factory=dict)  # first token of the child's segment -> child
    requests: list[int] = field(default_factory=list)  # requests whose whole prompt ends at this node's end

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def consumers(self) -> int:
        """How many continuations need this node's end state: child segments plus requests ending here."""
        return len(self.children) + len(self.requests)

    def ordered_children(self) -> list["TrieNode"]:
        return list(self.children.values())


def build_trie(prompts: list[list[int]], share: bool = True) -> TrieNode:
    """The compressed token trie of `prompts` (indexed by position in the list).

    share=False gives every request its own root child (the no-reuse baseline: nothing is shared, duplicates
    included), so the same executor runs both modes.
    """
    root = TrieNode(0, [])
    for idx, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"request {idx} has an empty prompt")
        if not share:
            leaf = TrieNode(0, list(prompt), root)
            leaf.requests.append(idx)
            root.children[-(idx + 1)] = leaf  # unique keys: never shared
            continue
        node, pos = root, 0
        while pos < len(prompt):
            child = node.children.get(prompt[pos])
            if child is None:
                leaf = TrieNode(pos, list(prompt[pos:]), node)
                node.children[prompt[pos]] = leaf
                node, pos = leaf, len(prompt)
                break
            seg = child.tokens
            n = _common_prefix(seg, prompt, pos)
            if n < len(seg):  # diverges (or ends) inside the segment: split it at the exact offset
                upper = TrieNode(child.start, seg[:n], node)
                node.children[prompt[pos]] = upper
                child.tokens = seg[n:]
                child.start = upper.end
                child.parent = upper
                upper.children[child.tokens[0]] = child
                child = upper
            node, pos = child, pos + n
        node.requests.append(idx)
    return root


def snap_to_grid(root: TrieNode, grid: int) -> TrieNode:
    """Move every branch point of `root`'s trie down to a multiple of `grid` (in place; returns root).

    A node that continues with more prefill (it has child segments) and ends off the grid ends at the grid line
    below instead, and each continuation (each child, and one leaf for the requests ending there) starts there,
    recomputing the tokens in between; a node with no grid line inside it gives its continuations to its parent.
    Prompt ends stay where they are: from a state there only decoding follows. Siblings may then share first
    tokens, so children are keyed by their order, not by token."""
    stack = [root]
    while stack:
        node = stack.pop()
        kept = [snapped for child in node.ordered_children() for snapped in _snapped(child, grid)]
        node.children = dict(enumerate(kept))
        for child in kept:
            child.parent = node
        stack.extend(kept)
    return root


def _snapped(node: TrieNode, grid: int) -> list[TrieNode]:
    """The nodes that take `node`'s place among its parent's children (node.start is on the grid)."""
    if not node.children or node.end % grid == 0:
        return [node]
    line = node.end // grid * grid
    tail = node.tokens[line - node.start:]  # [line, end): recomputed by every continuation
    moved = node.ordered_children()
    for child in moved:
        child.tokens, child.start = tail + child.tokens, line
    if node.requests:
        moved.append(TrieNode(line, list(tail), requests=node.requests))
    if line > node.start:
        node.tokens, node.requests = node.tokens[:line - node.start], []
        node.children = dict(enumerate(moved))
        return [node]
    return [snapped for child in moved for snapped in _snapped(child, grid)]  # no grid line inside: dissolved


def _common_prefix(seg: list[int], prompt: list[int], pos: int) -> int:
    """How many of seg's tokens prompt[pos:] starts with. List slices compare in C: a whole matching segment is
    one comparison, a divergence is found by bisection (a window's trie walks every prompt token, ~10^5-10^6)."""
    limit = min(len(seg), len(prompt) - pos)
    if seg[:limit] == prompt[pos:pos + limit]:
        return limit
    lo, hi = 0, limit  # seg[:lo] matches, seg[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if seg[lo:mid] == prompt[pos + lo:pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def iter_nodes(root: TrieNode):
    """Pre-order (depth-first, children in insertion order) over all nodes, the root first."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.ordered_children()))


def _first_requests(root: TrieNode) -> dict[int, int]:
    """id(node) -> the lowest request index in the node's subtree (its own requests and its children's)."""
    first: dict[int, int] = {}
    for node in reversed(list(iter_nodes(root))):  # reversed pre-order: every child before its parent
        lowest = [node.requests[0]] if node.requests else []
        first[id(node)] = min(lowest + [first[id(c)] for c in node.children.values()], default=-1)
    return first


def distinct_tokens(root: TrieNode) -> int:
    return sum(len(n.tokens) for n in iter_nodes(root))


@dataclass(eq=False)
class Task:
    """Bring a state to `end` (the end of `path`): from `base`'s end state, compute path[base.end:end].

    After that: `saves` -> checkpoint the state for the consumers (`consumers`: decode tasks, then child tasks);
    else a `request` starts decoding from it, or the single child takes the state over whole.
    """

    id: int
    path: tuple[int, ...]  # the whole token prefix up to this task's end
    base: "Task | None"  # whose end state this task starts from (None: an empty state)
    request: int | None = None  # the request that decodes from this task's end (None for inner tasks)
    sample: int = 0  # which of its request's sequences it decodes
    consumers: list["Task"] = field(default_factory=list)
    carrier: int = -1  # the first request in work order under this task: computed tokens are charged to it

    @property
    def end(self) -> int:
        return len(self.path)

    @property
    def start(self) -> int:
        """Where the plan's own tokens begin (its base's end)."""
        return self.base.end if self.base is not None else 0

    @property
    def saves(self) -> bool:
        """Whether its end state is checkpointed for several consumers (see `fans_out` for the exception)."""
        return len(self.consumers) > 1 and not self.fans_out

    @property
    def fans_out(self) -> bool:
        """Its consumers are the samples of one request, all at its end: each forks its state, no checkpoint."""
        c = self.consumers
        return len(c) > 1 and c[0].request is not None and all(
            t.request == c[0].request and t.end == self.end for t in c)

    @property
    def depth(self) -> int:
        d, t = 0, self.base
        while t is not None:
            d, t = d + 1, t.base
        return d

    def describe(self) -> str:
        base = f"t{self.base.id}" if self.base is not None else "scratch"
        what = f"prefill [{self.start}, {self.end}) from {base}" if self.end > self.start else f"fork {base}"
        if self.saves:
            what += f", save @{self.end} for {len(self.consumers)}"
        if self.fans_out:
            what += f", fork for {len(self.consumers)} samples"
        if self.request is not None:
            what += f", decode r{self.request}" + (f" sample {self.sample}" if self.sample else "")
        return f"t{self.id} {what}"


@dataclass
class Plan:
    """The tasks of one window in depth-first order (a base before its consumers), a task's consumers by the lowest
    request index each holds: the order in which a run that goes depth-first finishes its requests soonest in
    input order."""

    tasks: list[Task]
    roots: list[Task]  # tasks that start from an empty state
    distinct_tokens: int  # the prompt tokens the plan computes once each (grid tails included)
    depth: int  # nodes on the longest root-to-leaf trie path: the bound on live branch checkpoints per level
    grid_tokens: int = 0  # of them, the tails a grid plan recomputes beyond the trie's distinct tokens

    def subtree(self, task: Task) -> list[Task]:
        """`task` and every task that depends on it, in plan order: self-contained given task.base's state."""
        out, stack = [], [task]
        while stack:
            t = stack.pop()
            out.append(t)
            stack.extend(reversed(t.consumers))
        return out

    def dump(self) -> str:
        """One line per task, indented by depth."""
        return "\n".join("  " * t.depth + t.describe() for t in self.tasks)


def make_plan(prompts: list[list[int]], share: bool = True, samples: list[int] | None = None,
              grid: int = 0) -> Plan:
    """The plan of a window: one task per trie node, plus one decode task per request ending at a branch point.
    `samples[i]`: the sequences request i decodes (default 1), each a decode task of its own. `grid` > 0: branch
    points on multiples of it (`snap_to_grid`; the plan's distinct tokens then count the recomputed tails)."""
    root = build_trie(prompts, share)
    ideal = distinct_tokens(root)
    if grid:
        snap_to_grid(root, grid)
    samples = [1] * len(prompts) if samples is None else samples
    tasks: list[Task] = []
    roots: list[Task] = []

    def new(path, base, request=None, sample=0) -> Task:
        t = Task(len(tasks), tuple(path), base, request, sample)
        tasks.append(t)
        if base is None:
            roots.append(t)
        else:
            base.consumers.append(t)
        return t

    first = _first_requests(root)
    # iterative pre-order over (node or request ending at the base, base task, path): deep tries must not hit the
    # recursion limit. A node's continuations (its child segments and the requests that end there and fork it) go
    # by the lowest input line each holds, so results in input order can be written from the start of a run.
    stack = [(child, None, child.tokens) for child in reversed(root.ordered_children())]
    while stack:
        node, base, path = stack.pop()
        if isinstance(node, int):  # a request ending at a branch point: each of its samples forks its base's state
            for i in range(samples[node]):
                new(path, base, node, i)
            continue
        ends = sum(samples[rid] for rid in node.requests)  # the decode tasks ending here
        single_request = node.requests[0] if len(node.children) + ends == 1 and node.requests else None
        task = new(path, base, single_request)
        if len(node.children) + ends > 1:  # a branch point (the samples of one request ending here included)
            after = [(rid, rid, task.path) for rid in node.requests] + \
                [(first[id(child)], child, list(path) + child.tokens) for child in node.ordered_children()]
            for _, item, item_path in sorted(after, key=lambda a: a[0], reverse=True):
                stack.append((item, task, item_path))
        else:
            for child in node.ordered_children():  # one child: the state is handed over whole
                stack.append((child, task, list(path) + child.tokens))
    # creation order is depth-first: consumers come after their base, so carriers resolve bottom-up in reverse
    for t in reversed(tasks):
        t.carrier = t.request if t.request is not None else (t.consumers[0].carrier if t.consumers else -1)
    depth = max((t.depth + 1 for t in tasks if t.end > t.start), default=0)
    computed = distinct_tokens(root)
    return Plan(tasks, roots, computed, depth, computed - ideal)
