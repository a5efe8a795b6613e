"""A window of tokenized requests -> token trie -> the order of work.

The trie is compressed: each node holds the segment of tokens between two branch points. Its end is where the
whole model state is checkpointed when more than one consumer (a child segment or a request whose prompt ends
there) needs it — at the exact branching offset, not rounded to a block. Work proceeds depth-first, so the live
checkpoints are those of the current node's ancestors that still have pending children: bounded by tree depth.

Every distinct prefix token is one trie position, so an execution that prefills each node's segment once computes
exactly `distinct_tokens` prompt tokens (the least any prefix-reusing engine can do).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class TrieNode:
    start: int  # prompt tokens before this node's segment
    tokens: list[int]  # the segment
    parent: "TrieNode | None" = None
    children: dict[int, "TrieNode"] = field(default_factory=dict)  # first token of the child's segment -> child
    requests: list[int] = field(default_factory=list)  # requests whose whole prompt ends at this node's end
    carrier: int = -1  # the first request (in work order) under this node: its prefill is charged to it

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def consumers(self) -> int:
        """How many continuations need this node's end state: child segments plus requests ending here."""
        return len(self.children) + len(self.requests)

    def ordered_children(self) -> list["TrieNode"]:
        return list(self.children.values())

    def path_tokens(self) -> list[int]:
        parts, node = [], self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return [t for seg in reversed(parts) for t in seg]


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
            # walk the child's segment while it matches
            seg = child.tokens
            n = 0
            limit = min(len(seg), len(prompt) - pos)
            while n < limit and seg[n] == prompt[pos + n]:
                n += 1
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
    _assign_carriers(root)
    return root


def _assign_carriers(root: TrieNode):
    """carrier = the first request reached in work order (own requests before children), bottom-up."""
    for node in reversed(list(iter_nodes(root))):
        if node.requests:
            node.carrier = node.requests[0]
        else:
            node.carrier = next(iter(node.children.values())).carrier if node.children else -1


def iter_nodes(root: TrieNode):
    """Pre-order (depth-first, children in insertion order) over all nodes, the root first."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.ordered_children()))


def distinct_tokens(root: TrieNode) -> int:
    return sum(len(n.tokens) for n in iter_nodes(root))


@dataclass(frozen=True)
class PlanSummary:
    """The ideal plan's figures (what an ample budget achieves)."""

    requests: int
    prompt_tokens: int
    distinct_tokens: int  # trie size: prompt tokens computed once each
    branch_points: tuple[int, ...]  # offsets where a checkpoint is saved (consumers > 1), in work order
    max_live_checkpoints: int  # peak checkpoints alive under depth-first order


def summarize(root: TrieNode, prompts: list[list[int]]) -> PlanSummary:
    branch = []
    peak = 0

    def visit(node: TrieNode, live: int):
        nonlocal peak
        here = live + (1 if node is not root and node.consumers > 1 else 0)
        if node is not root and node.consumers > 1:
            branch.append(node.end)
        peak = max(peak, here)
        kids = node.ordered_children()
        for i, child in enumerate(kids):
            # the checkpoint is released when the last child has forked from it
            visit(child, here - (1 if i == len(kids) - 1 and here > live else 0))

    import sys
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    visit(root, 0)
    return PlanSummary(len(prompts), sum(len(p) for p in prompts), distinct_tokens(root), tuple(branch), peak)
