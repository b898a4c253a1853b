"""Routers: which replica of a fleet takes each arriving request.

One implementation serves both sides of `sim validate`: the simulated fleet
(sim/capacity/fleet.py) and the measured one (sim/capacity/measured.py) hand the same
`Router` each arrival's prompt, the replicas' loads at that moment and the arrival time, and
place the request where it says. A router never sees a replica: its policy is a function of
what it was shown and of its own state (a counter, an affinity map, prefix trees).

`cache_aware` follows SGLang's router, sglang-router 0.1.4 (sgl-project/sglang:
docs/router/router.md, "Cache-Aware Load-Balancing Router", for the policy and its defaults;
sgl-router/src/router.rs, `select_generate_worker`, and src/tree.rs for the details; the later
sgl-router/src/policies/cache_aware.rs keeps the same logic). It keeps an approximate radix
tree per replica of the prompts it sent there, instead of asking the replicas what they hold.
The fleet is *imbalanced* when max_load - min_load > balance_abs_threshold and max_load >
min_load * balance_rel_threshold; then the request goes to the least loaded replica (load:
requests in flight there, which SGLang counts from its choice to the response's end). When
balanced, the longest prefix match over all trees decides: if matched / len(prompt) >
cache_threshold the request goes to a replica with that match, else to the replica whose tree
is smallest (the most free cache). Either way the prompt is inserted into the chosen replica's
tree. The defaults are that release's: 0.5, 32, 1.0001, eviction every 60 s down to 2**24.

Where this differs from SGLang, and why:
- Token ids, not characters. SGLang matches the request's text to skip tokenizing; the
  simulator has only token ids (synthetic prompts are random tokens whose text is noise), so
  trees, matches and sizes count tokens. The match rate differs from SGLang's only by the
  partial token at the end of a match; max_tree_size counts tokens where SGLang counts
  characters.
- Ties are broken by the lowest replica index (SGLang takes whichever its concurrent map
  yields first), so a run is a pure function of its inputs.
- Eviction runs on the arrival clock, not a wall-clock thread: at the first arrival at or
  after each multiple of `eviction_interval_s`, every tree larger than `max_tree_size` drops
  its least recently used leaves until it fits. "Recently" is the order of the arrivals that
  inserted through a node (SGLang also refreshes the matched path of a lookup; here only the
  chosen replica's insert does). With the default size no simulated run comes near it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

ROUTERS = ("round_robin", "least_loaded", "prefix_affinity", "cache_aware")


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2**24  # tokens per replica's tree

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0, "
                             f"got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1, "
                             f"got {self.balance_rel_threshold}")
        if not self.eviction_interval_s > 0:
            raise ValueError(f"eviction_interval_s must be > 0, got {self.eviction_interval_s}")
        if self.max_tree_size < 0:
            raise ValueError(f"max_tree_size must be >= 0, got {self.max_tree_size}")


class _Node:
    __slots__ = ("children", "key", "last", "order", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last: int, order: int
                 ) -> None:
        self.key = key  # the tokens on the edge into this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by the first token of the child's key
        self.last = last  # the arrival that last inserted through here (LRU)
        self.order = order  # creation order: breaks LRU ties canonically


class PrefixTree:
    """A radix tree over token ids: one replica's approximate prefix cache. `size` is the
    number of tokens on its edges (SGLang's per-tenant character count)."""

    def __init__(self) -> None:
        self.root = _Node((), None, 0, 0)
        self.size = 0
        self._made = 0

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` some inserted sequence shares."""
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            common = _common(child.key, tokens, i)
            i += common
            if common < len(child.key):
                break
            node = child
        return i

    def insert(self, tokens: Sequence[int], tick: int) -> None:
        """Add `tokens`, marking every node on its path as used at `tick`."""
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = self._new(tuple(tokens[i:]), node, tick)
                node.children[tokens[i]] = leaf
                self.size += n - i
                return
            common = _common(child.key, tokens, i)
            if common < len(child.key):  # split the edge: node -> mid -> child
                mid = self._new(child.key[:common], node, child.last)
                child.key = child.key[common:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            child.last = tick
            i += common
            node = child

    def evict(self, max_size: int) -> None:
        """Drop least recently used leaves until `size` <= `max_size`."""
        if self.size <= max_size:
            return
        heap = [(leaf.last, leaf.order, leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, parent.order, parent))

    def _new(self, key: tuple[int, ...], parent: _Node, tick: int) -> _Node:
        self._made += 1
        return _Node(key, parent, tick, self._made)

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out


def _common(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """The length of the common prefix of `key` and `tokens[start:]`."""
    if tuple(tokens[start:start + len(key)]) == key:  # the usual case: one C-speed compare
        return len(key)
    n = 0
    for a, b in zip(key, tokens[start:start + len(key)], strict=False):
        if a != b:
            break
        n += 1
    return n


class Router:
    """Places arrivals on `replicas` replicas by the policy `kind` (one of ROUTERS).
    `key_tokens`: prefix_affinity's key, the first KV block."""

    def __init__(self, kind: str, replicas: int, key_tokens: int,
                 cache_aware: CacheAwareConfig | None = None) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {kind!r}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.kind = kind
        self.replicas = replicas
        self.key_tokens = key_tokens
        self.config = cache_aware or CacheAwareConfig()
        self.trees = [PrefixTree() for _ in range(replicas)]
        self._next = 0
        self._affinity: dict[tuple[int, ...], int] = {}
        self._arrivals = 0
        self._next_eviction = self.config.eviction_interval_s

    def pick(self, prompt_ids: Sequence[int], loads: Sequence[int], now: float) -> int:
        """The replica for an arrival at `now` with `prompt_ids`, given each replica's load
        (requests in flight there, this one not counted)."""
        if len(loads) != self.replicas:
            raise ValueError(f"loads: one per replica ({self.replicas}), got {len(loads)}")
        if self.kind == "round_robin":
            index = self._next % self.replicas
            self._next += 1
            return index
        if self.kind == "prefix_affinity":
            # Requests that share their first KV block go where that block is cached;
            # a new first block goes to the least loaded replica and stays there.
            key = tuple(prompt_ids[: self.key_tokens])
            if key not in self._affinity:
                self._affinity[key] = _least(loads)
            return self._affinity[key]
        if self.kind == "cache_aware":
            return self._cache_aware(prompt_ids, loads, now)
        return _least(loads)

    def _cache_aware(self, prompt: Sequence[int], loads: Sequence[int], now: float) -> int:
        c = self.config
        if now >= self._next_eviction:
            for tree in self.trees:
                tree.evict(c.max_tree_size)
            self._next_eviction = (now // c.eviction_interval_s + 1) * c.eviction_interval_s
        hi, lo = max(loads), min(loads)
        if hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold:
            index = _least(loads)
        else:
            matched = [t.match(prompt) for t in self.trees]
            best = max(matched)
            if prompt and best / len(prompt) > c.cache_threshold:
                index = matched.index(best)
            else:
                index = min(range(self.replicas), key=lambda i: (self.trees[i].size, i))
        self._arrivals += 1
        self.trees[index].insert(prompt, self._arrivals)
        return index


def _least(loads: Sequence[int]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))
