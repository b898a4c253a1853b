"""The field's public request traces: Mooncake, Alibaba (Qwen/Bailian), BurstGPT, Azure.

Each publishes one row per request with its arrival time and its input and output lengths,
and no text; two of them also name the prompt's prefix blocks:

  mooncake  JSONL `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`,
            hash_ids naming 512-token blocks (kvcache-ai/Mooncake, FAST'25 release)
  alibaba   JSONL, Mooncake's fields plus chat_id, parent_chat_id, turn and type, timestamp
            in seconds, 16-token blocks (alibaba-edu/qwen-bailian-usagetraces-anon)
  burstgpt  CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`,
            seconds (HPMLL/BurstGPT); later releases insert Session ID and Elapsed time,
            so columns are found by name
  azure     CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, the 2023 and 2024 releases
            (Azure/AzurePublicDataset; sim.load.azure reads it)

`read_public_trace` gives every format the same rows (`TraceRow`), sorted by arrival, with
times in seconds from the first row. A row that cannot be a request (BurstGPT logs failed
calls with 0 response tokens, and some rows with 0 request tokens) is dropped and counted
under its reason, never silently; a malformed row is an error naming its line and field.
`window` cuts a time window and rescales time (`--start`, `--duration`, `--speedup`, as
GuideLLM's and vLLM's replay modes do).

`implied_hit_rate` is the prefix-cache hit rate the trace itself implies: the share of
prompt tokens that lie in a leading run of blocks some earlier request already had, as an
unbounded cache would serve them. It is what a planner's produced hit rate is held to.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nanoserve.tokenizer import Tokenizer
from sim.load.azure import ConvertError, PromptSynth, default_engine, read_azure_csv
from sim.trace.format import ClientSpec, Trace, TraceHeader, TraceRequest

FORMATS = ("mooncake", "alibaba", "burstgpt", "azure")
# Tokens per hash_ids block, as each format's publisher defines it.
BLOCK_TOKENS = {"mooncake": 512, "alibaba": 16}
_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_SOURCES = {
    "mooncake": "kvcache-ai/Mooncake (FAST25-release/traces), Apache-2.0",
    "alibaba": "alibaba-edu/qwen-bailian-usagetraces-anon, Apache-2.0",
    "burstgpt": "HPMLL/BurstGPT, CC-BY 4.0",
    "azure": "Azure/AzurePublicDataset, CC-BY 4.0",
}


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int  # the file's line (a CSV's header is line 1)
    at_s: float  # seconds after the trace's first row
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None  # prefix blocks, in formats that have them


@dataclass(frozen=True, slots=True)
class PublicTrace:
    format: str
    rows: tuple[TraceRow, ...]
    source: str  # the file, for reports
    block_tokens: int | None  # tokens per hash_ids block (None: no prefix structure)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows left out

    def describe(self) -> dict[str, Any]:
        """What a report says of the trace it planned on."""
        return {"format": self.format, "file": self.source,
                "format_origin": _SOURCES[self.format],
                "rows": len(self.rows), "dropped": dict(sorted(self.dropped.items())),
                "span_s": self.rows[-1].at_s if self.rows else 0.0,
                "block_tokens": self.block_tokens,
                "implied_prefix_hit_rate": (implied_hit_rate(self.rows, self.block_tokens)
                                            if self.block_tokens else None)}


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of a file, from its first line: a JSON object's keys or a CSV header."""
    with open(path, encoding="utf-8", newline="") as f:
        first = next((line for line in f if line.strip()), "")
    name = Path(path).name
    if first.lstrip().startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{name} line 1: not JSON ({exc.msg})") from None
        if "nanoserve_trace" in obj:
            return "nanoserve"
        if "parent_chat_id" in obj or "chat_id" in obj:
            return "alibaba"
        if "hash_ids" in obj or "input_length" in obj:
            return "mooncake"
        raise ConvertError(f"{name} line 1: a JSON object with none of the known formats' "
                           "keys (input_length and hash_ids, chat_id, nanoserve_trace)")
    head = next(csv.reader([first]), [])
    if all(c in head for c in _AZURE_COLUMNS):
        return "azure"
    if all(c in head for c in _BURSTGPT_COLUMNS):
        return "burstgpt"
    raise ConvertError(f"{name} line 1: not a known trace header; expected JSONL (Mooncake, "
                       f"Alibaba) or a CSV with {','.join(_AZURE_COLUMNS)} (Azure) or "
                       f"{','.join(_BURSTGPT_COLUMNS)} (BurstGPT); name it with --trace-format")


def read_public_trace(path: str | os.PathLike[str], fmt: str | None = None) -> PublicTrace:
    """Every request row of the file, sorted by arrival (stably), times from the first."""
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ConvertError(f"trace format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    name = Path(path).name
    dropped: dict[str, int] = {}
    if fmt == "azure":
        rows = [TraceRow(r.line, r.t_ns / 1e9, r.context_tokens, r.generated_tokens)
                for r in read_azure_csv(path)]
    else:
        with open(path, encoding="utf-8", newline="") as f:
            reader = _jsonl(f, name, fmt) if fmt in BLOCK_TOKENS else _burstgpt(f, name)
            rows = list(_keep(reader, dropped))
    rows.sort(key=lambda r: r.at_s)
    t0 = rows[0].at_s if rows else 0.0
    rows = [replace(r, at_s=r.at_s - t0) for r in rows]
    return PublicTrace(fmt, tuple(rows), str(path), BLOCK_TOKENS.get(fmt), dropped)


def _keep(rows: Iterable[TraceRow | str], dropped: dict[str, int]) -> Iterator[TraceRow]:
    for r in rows:
        if isinstance(r, str):
            dropped[r] = dropped.get(r, 0) + 1
        else:
            yield r


def _jsonl(lines: Iterable[str], name: str, fmt: str) -> Iterator[TraceRow | str]:
    # Mooncake's timestamps are milliseconds, the Alibaba traces' seconds.
    unit = 1e-3 if fmt == "mooncake" else 1.0
    block = BLOCK_TOKENS[fmt]
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{name} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ConvertError(f"{name} line {n}: expected a JSON object")
        at = _number(obj, "timestamp", name, n)
        inp = _integer(obj, "input_length", name, n)
        out = _integer(obj, "output_length", name, n)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            raise ConvertError(f'{name} line {n}: field "hash_ids": must be a list of integers')
        if inp < 1:
            yield "input_length 0"
            continue
        if out < 1:
            yield "output_length 0"
            continue
        if len(ids) * block < inp:
            raise ConvertError(f'{name} line {n}: field "hash_ids": {len(ids)} blocks of '
                               f"{block} tokens cannot hold input_length {inp}")
        yield TraceRow(n, at * unit, inp, out, tuple(ids))


def _burstgpt(lines: Iterable[str], name: str) -> Iterator[TraceRow | str]:
    reader = csv.reader(lines)
    head = next(reader, None) or []
    missing = [c for c in _BURSTGPT_COLUMNS if c not in head]
    if missing:
        raise ConvertError(f"{name} line 1: missing column(s) {', '.join(missing)}")
    for cells in reader:
        n = reader.line_num
        if not cells:
            continue
        if len(cells) != len(head):
            raise ConvertError(f"{name} line {n}: {len(cells)} cells, expected {len(head)}")
        row = dict(zip(head, cells, strict=True))
        at = _number(row, "Timestamp", name, n)
        inp = _integer(row, "Request tokens", name, n)
        out = _integer(row, "Response tokens", name, n)
        # A failed call is logged with 0 response tokens: a request the replay cannot make.
        if out < 1:
            yield "response tokens 0 (a failed call)"
        elif inp < 1:
            yield "request tokens 0"
        else:
            yield TraceRow(n, at, inp, out)


def _number(obj: dict[str, Any], key: str, name: str, line: int) -> float:
    value = obj.get(key)
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConvertError(f'{name} line {line}: field "{key}": must be a number, '
                           f"got {value!r:.40}") from None
    if not x >= 0 or x == float("inf"):
        raise ConvertError(f'{name} line {line}: field "{key}": must be >= 0, got {value!r}')
    return x


def _integer(obj: dict[str, Any], key: str, name: str, line: int) -> int:
    value = obj.get(key)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # a CSV's cells are text
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConvertError(f'{name} line {line}: field "{key}": must be an integer >= 0, '
                           f"got {value!r:.40}")
    return value


def window(trace: PublicTrace, *, start_s: float = 0.0, duration_s: float | None = None,
           speedup: float = 1.0) -> PublicTrace:
    """Rows arriving in [start_s, start_s + duration_s) of the trace's own time, re-based to
    0 and compressed by `speedup` (2: twice as fast)."""
    if start_s < 0:
        raise ConvertError(f"--start must be >= 0 s, got {start_s}")
    if duration_s is not None and not duration_s > 0:
        raise ConvertError(f"--duration must be > 0 s, got {duration_s}")
    if not speedup > 0:
        raise ConvertError(f"--speedup must be > 0, got {speedup}")
    end = float("inf") if duration_s is None else start_s + duration_s
    kept = [r for r in trace.rows if start_s <= r.at_s < end]
    if not kept:
        raise ConvertError(f"{trace.source}: no rows in [{start_s:g} s, {end:g} s)")
    t0 = kept[0].at_s
    rows = tuple(replace(r, at_s=(r.at_s - t0) / speedup) for r in kept)
    return replace(trace, rows=rows)


def implied_hit_rate(rows: Sequence[TraceRow], block_tokens: int | None) -> float:
    """Prompt tokens an unbounded prefix cache serves, over all prompt tokens (module doc).
    A request's hit is its longest leading run of blocks that an earlier request's leading
    run already held, as tokens, and never its whole prompt: a server computes at least
    the last token, to have logits to sample from."""
    if not block_tokens:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in rows:
        ids = r.hash_ids or ()
        k = 0
        while k < len(ids) and ids[:k + 1] in seen:
            k += 1
        seen.update(ids[:i] for i in range(k + 1, len(ids) + 1))
        hit += min(k * block_tokens, r.input_tokens - 1)
        total += r.input_tokens
    return hit / total if total else 0.0


def text_trace(trace: PublicTrace, tokenizer: Tokenizer, *, model: str = "stub",
               stream: bool = True, seed: int = 0, prefixes: bool = True) -> Trace:
    """The rows as a virtual-clock nanoserve trace of text prompts (for `sim bench --trace`,
    which sends text as a client does), prefix-faithful as workload.public_workload is: a
    block is `block_tokens` single-token words drawn from (seed, hash id), so prompts that
    share blocks share those tokens exactly (sim.load.azure.PromptSynth's construction)."""
    synth = PromptSynth(tokenizer)
    size = trace.block_tokens
    blocks: dict[int, list[str]] = {}
    requests = []
    for i, row in enumerate(trace.rows, start=1):
        words: list[str] = []
        if prefixes and size is not None and row.hash_ids is not None:
            for h in row.hash_ids:
                if len(words) >= row.input_tokens:
                    break
                if h not in blocks:
                    rng = random.Random(f"nanoserve-block:{seed}:{h}")
                    blocks[h] = synth.text(size, rng).split(" ")
                words += blocks[h]
        else:
            rng = random.Random(f"nanoserve-row:{seed}:{row.line}")
            words = synth.text(row.input_tokens, rng).split(" ")
        prompt = synth.check(" ".join(words[:row.input_tokens]), row.input_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": row.output_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        requests.append(TraceRequest(f"r{i}", "/v1/completions", body, ClientSpec(),
                                     at_s=row.at_s))
    note = (f"{len(requests)} requests from {trace.source} ({trace.format}; "
            f"{_SOURCES[trace.format]})")
    header = TraceHeader("virtual", model, default_engine(), note,
                         extra={"source": trace.describe()})
    return Trace(header, tuple(requests))
