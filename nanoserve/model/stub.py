"""The stub model: the Llama model's interface, no weights, logits in microseconds.

Its logits for a row are a deterministic function of (seed, token history): a 64-bit mix of
the seed, the history's length and its last four tokens picks the row's top token and a few
runners-up. To emit what a real model emits, multi-byte fragments included, the top token
usually continues a bigram table built from a small built-in text (English, CJK, emoji with
ZWJ sequences and skin tones) tokenized with the real tokenizer, so a three-token emoji
comes out as its three tokens in order. With probability `eos_prob` per token the top token
is EOS, so finish=stop paths run. With probability `copy_prob` per token it copies instead
(`copied`): it says what followed the last earlier occurrence of the history's longest
ending of at most four tokens, as an agent's answer quotes its prompt, so that speculative
decoding's n-gram proposals are kept at the rate a capacity plan is given
(sim/capacity/acceptance.py). Everything else is -10, so sampling stays on the handful of
candidates, but among them it spreads as a trained model's does: SmolLM2 at temperature 1
gives its top token 45% of the mass on average and draws another token 55% of the time
(768 draws over eight prompts); the candidates' logits below give the top one 48% and
another draw 52%. (They were once 10, 6, 5, 4, 3, 2: 97% on the top token, so sampled
completions that share a history, the n siblings of one request, almost never parted.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.stub_says import Recorded, Scripts, copied
from nanoserve.sampling.seeds import MASK64, mix64, mix64_array
from nanoserve.tokenizer import Tokenizer

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in "
    "blocks, so many sequences share one pool without fragmentation. "
    "日本語のテキストを少し書きます。东京和北京都是大城市。한국어 문장도 있습니다. "
    "Emoji: 😀 🎉 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇯🇵 ❤️ — café, naïve, Ærøskøbing, Straße. "
    "def step(self):\n    return self.schedule()\n"
)
_NUM_CANDIDATES = 6
# From this many rows pick_greedy hashes them as uint64 arrays (numpy wraps at 2**64, as
# the masks do); below, the per-row Python loop is cheaper than the array set-up.
_VECTOR_ROWS = 8
_TAIL = 4  # history tokens the hash reads
_U32, _U3, _LOW32 = np.uint64(32), np.uint64(3), np.uint64(0xFFFFFFFF)
STUB_CONTEXT = 8192  # the stub's context length, as SmolLM2's
_COPY_SALT = 0x2545F4914F6CDD1D  # the copy coin's hash is its own, apart from EOS's bits


def row_hash(length: int, tail: Sequence[int], seed: int) -> int:
    """A row's hash: mix64(mix64(... mix64(seed) ^ length) ^ t ...) over its last tokens,
    with mix64 inlined (a test holds it to nanoserve.sampling.seeds): this runs once per
    simulated token, millions of times in a capacity sweep."""
    m = MASK64
    h = seed & m
    for x in (0, length, *tail):  # the first round is mix64(seed ^ 0)
        h ^= x & m
        h = (h + 0x9E3779B97F4A7C15) & m
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & m
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & m
        h ^= h >> 31
    return h


class StubModel:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_prob: float = 0.0,
        copy_prob: float = 0.0,
        outputs: Mapping[tuple[int, ...], Sequence[int]] | None = None,
        max_position_embeddings: int = STUB_CONTEXT,
        device: str = "cpu",
    ) -> None:
        """`outputs`: recorded output tokens by prompt (stub_says.Recorded), said before
        anything but a prompt's script."""
        if not 0.0 <= eos_prob <= 1.0:
            raise ValueError(f"stub eos_prob must be in [0, 1], got {eos_prob}")
        if not 0.0 <= copy_prob <= 1.0:
            raise ValueError(f"stub copy_prob must be in [0, 1], got {copy_prob}")
        eos = tokenizer.eos_token_ids
        self.config = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=0,
            intermediate_size=0,
            num_layers=0,
            num_heads=0,
            num_kv_heads=0,
            head_dim=0,
            rope_theta=0.0,
            rms_norm_eps=0.0,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=eos,
        )
        self.device = torch.device(device)
        self.eos_prob = eos_prob
        self._eos = eos[0] if eos else 0
        ids = tokenizer.encode(_CORPUS)
        # First successor wins, so the table is a function of the corpus alone.
        self._next: dict[int, int] = {}
        for a, b in zip(ids, ids[1:], strict=False):
            self._next.setdefault(a, b)
        self._vocab_pool = sorted(set(ids))
        self._pool_array = np.array(self._vocab_pool, dtype=np.int64)
        # `_next` as an array over the vocabulary (-1: no successor), for pick_greedy.
        self._next_array = np.full(max(tokenizer.vocab_size, max(ids) + 1), -1, dtype=np.int64)
        for a, b in self._next.items():
            self._next_array[a] = b
        self._eos_cut = int(eos_prob * (1 << 32))
        self.copy_prob = copy_prob
        self._copy_cut = int(copy_prob * (1 << 32))
        self._eos_cut_u64 = np.uint64(self._eos_cut)
        self._pool_len = np.uint64(len(self._pool_array))
        self._values = torch.tensor([10.0, 9.25, 8.75, 8.25, 7.75, 7.25])[:_NUM_CANDIDATES]
        self._scripts = Scripts(tokenizer, self._eos)
        self._recorded = Recorded(outputs) if outputs else None

    # The stub keeps no KV: these exist so it satisfies the Model protocol.
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        return None

    def next_tokens(self, history: Sequence[int], seed: int) -> list[int]:
        """The row's candidates, best first: what its logits rank highest."""
        return self._candidates(history, len(history), seed)

    def _copies(self, h: int) -> bool:
        """The copy coin of a row whose hash is `h`."""
        return self._copy_cut > 0 and (mix64(h ^ _COPY_SALT) & 0xFFFFFFFF) < self._copy_cut

    def _candidates(self, hist: Sequence[int], upto: int, seed: int) -> list[int]:
        """The candidates after hist[:upto], best first."""
        tail = hist[max(0, upto - _TAIL):upto]
        h = row_hash(upto, tail, seed)
        pool = self._vocab_pool
        out: list[int] = []
        if (h & 0xFFFFFFFF) < self._eos_cut:
            out.append(self._eos)
        elif upto and self._copies(h):
            out.append(copied(hist, upto))
        last = tail[-1] if tail else -1
        follow = self._next.get(last)
        # Continue the corpus most of the time (so multi-byte characters complete), jump
        # elsewhere in it otherwise (so outputs differ between histories).
        if follow is not None and (h >> 32) % 4 != 0 and follow not in out:
            out.append(follow)
        x = h
        while len(out) < _NUM_CANDIDATES:
            x = mix64(x)
            t = pool[x % len(pool)]
            if t not in out:
                out.append(t)
        return out[:_NUM_CANDIDATES]

    def _top(self, hist: Sequence[int], upto: int, seed: int) -> int:
        """`_candidates(...)[0]` without the runners-up: the same four cases in order."""
        tail = hist[max(0, upto - _TAIL):upto]
        h = row_hash(upto, tail, seed)
        if (h & 0xFFFFFFFF) < self._eos_cut:
            return self._eos
        if upto and self._copies(h):
            return copied(hist, upto)
        follow = self._next.get(tail[-1] if tail else -1)
        if follow is not None and (h >> 32) % 4 != 0:
            return follow
        pool = self._vocab_pool
        return pool[mix64(h) % len(pool)]

    def pick_greedy(self, batch: ForwardBatch) -> list[int]:
        """The argmax of each row `forward` would return, without building [R, vocab]
        logits: the engine's fast path when every row is plain greedy. Simulation runs
        millions of such rows, and the logits tensor and its argmax were most of a step."""
        rows = self._logits_rows(batch)
        said = self._scripts.said(batch.histories, rows)
        if self._recorded is not None:
            rec = self._recorded
            said = [rec.next_token(batch.histories[r], upto) if said is None or said[k] is None
                    else said[k] for k, (r, upto) in enumerate(rows)]
        if said is None:
            if len(rows) >= _VECTOR_ROWS and all(upto >= _TAIL for _, upto in rows):
                return self._top_array(batch, rows)
            said = [None] * len(rows)
        out: list[int] = []
        for (row, upto), token in zip(rows, said, strict=True):
            hist = batch.histories[row]
            out.append(token if token is not None
                       else self._top(hist, upto, batch.seeds[row]))
        return out

    def _top_array(self, batch: ForwardBatch, rows: list[tuple[int, int]]) -> list[int]:
        """`_top` for every row at once (each row with a full tail of four tokens)."""
        n = len(rows)
        h = np.fromiter((batch.seeds[r] & MASK64 for r, _ in rows), dtype=np.uint64, count=n)
        lengths = np.fromiter((upto for _, upto in rows), dtype=np.uint64, count=n)
        tails = np.array([batch.histories[r][upto - _TAIL : upto] for r, upto in rows],
                         dtype=np.uint64).reshape(n, _TAIL)
        h = mix64_array(h)  # the first round mixes in 0
        h = mix64_array(h ^ lengths)
        for k in range(_TAIL):
            h = mix64_array(h ^ tails[:, k])
        follow = self._next_array[tails[:, -1].astype(np.int64)]
        take_follow = (follow >= 0) & (((h >> _U32) & _U3) != 0)  # (h >> 32) % 4 != 0
        picks = mix64_array(h) % self._pool_len
        pool = self._pool_array[picks.astype(np.int64)]
        out = np.where(take_follow, follow, pool)
        if self._copy_cut:
            coin = (mix64_array(h ^ np.uint64(_COPY_SALT)) & _LOW32) < np.uint64(self._copy_cut)
            for i in np.flatnonzero(coin).tolist():
                row, upto = rows[i]
                out[i] = copied(batch.histories[row], upto)
        if self._eos_cut:  # EOS before a copy, as in _top
            out = np.where((h & _LOW32) < self._eos_cut_u64, self._eos, out)
        return out.tolist()

    def _logits_rows(self, batch: ForwardBatch) -> list[tuple[int, int]]:
        """(row, history length up to and including the token) for each logits index."""
        ends: list[int] = []
        acc = 0
        for q in batch.query_lens:
            acc += q
            ends.append(acc)
        out: list[tuple[int, int]] = []
        r = 0
        for idx in batch.logits_indices:
            while ends[r] <= idx:
                r += 1
            out.append((r, batch.context_lens[r] - (ends[r] - 1 - idx)))
        return out

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        picks: list[list[int]] = []
        rows = self._logits_rows(batch)  # each wanted token's row and its history's length
        for row, upto in rows:
            hist = batch.histories[row]
            cands = self._candidates(hist, upto, batch.seeds[row])
            token = self._scripts.next_token(hist, upto)
            if token is None and self._recorded is not None:
                token = self._recorded.next_token(hist, upto)
            if token is not None:  # first, the rest keep their order
                cands = [token, *[t for t in cands if t != token]][:_NUM_CANDIDATES]
            picks.append(cands)
        logits = torch.full((len(rows), self.config.vocab_size), -10.0)
        cand = torch.tensor(picks, dtype=torch.long).view(len(rows), _NUM_CANDIDATES)
        logits.scatter_(1, cand, self._values.expand(len(rows), -1))
        return logits
