"""`sim convert`: the Azure LLM inference trace (CSV of sizes) into a virtual-clock trace.

The Azure files (Azure/AzurePublicDataset, CC-BY 4.0; Patel et al., "Splitwise: Efficient
generative LLM inference using phase splitting", ISCA 2024) hold one row per request,
`TIMESTAMP,ContextTokens,GeneratedTokens`, and no text. A replay needs text whose length
under the served tokenizer is exactly ContextTokens, since prompt length is what the
scheduler's token budget and the KV pool see. `PromptSynth` builds it from a fixed pool of
English words that are single tokens both alone and after a space: byte-level BPE splits
text into pre-tokens at spaces before it merges, and never merges across a pre-token, so
"w1 w2 ... wn" is exactly n tokens. Every prompt is still encoded once to prove the count,
because a tokenizer with another pre-tokenizer would silently break that argument.

Prompts are text (not token-id lists) so that the same trace exercises the server's
tokenization path as a real client would. The words of a request are drawn from
`random.Random` seeded by (seed, CSV line): a request's text depends on its own row only, so
two windows (`--start-offset-s`, `--limit`) of one file agree on the rows they share, and
distinct rows almost never share a first KV block (16 words from ~120: no spurious prefix
cache hits).
"""

from __future__ import annotations

import csv
import os
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.tokenizer import Tokenizer
from sim.trace.check import ENGINE_OPTIONAL, ENGINE_REQUIRED, FieldError, check_engine
from sim.trace.format import ClientSpec, Trace, TraceHeader, TraceRequest

AZURE_DATASET = "Azure/AzurePublicDataset"
AZURE_LICENSE = "CC-BY 4.0"
AZURE_CITATION = ('Patel et al., "Splitwise: Efficient generative LLM inference using phase '
                  'splitting", ISCA 2024')
_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")
# Any fixed origin works: only differences of timestamps are used, in integer nanoseconds
# so that "18:15:46.6805900" minus "18:15:46.0000000" is exact.
_ORIGIN = datetime(2000, 1, 1)

# Common lowercase English words; the pool keeps those the tokenizer makes one token of.
_WORDS = """\
the of and to in is it that for on as with was by at be this from or an are not
but have one all had were can will more has its two some time year new would first which when
there people other them could into then only over after most also made years between many well
such may any where state world both these city part those because during each under same while
life through school back work system water place high power found small against group since
often every still form number house early large later without however never three name game
along best land area light order line human point story field music change river"""


class ConvertError(ValueError):
    """A CSV that cannot be converted; the message names the line and the column."""


@dataclass(frozen=True, slots=True)
class AzureRow:
    line: int  # the CSV line, counting the header as line 1
    t_ns: int  # nanoseconds since a fixed origin (only differences mean anything)
    context_tokens: int
    generated_tokens: int


def parse_azure_timestamp(text: str) -> int:
    """`2023-11-16 18:15:46.6805900` -> integer nanoseconds since a fixed origin."""
    m = _TIMESTAMP.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a timestamp like 2023-11-16 18:15:46.6805900: {text!r:.80}")
    whole = datetime.strptime(f"{m[1]} {m[2]}", "%Y-%m-%d %H:%M:%S") - _ORIGIN
    frac = int((m[3] or "").ljust(9, "0"))
    return (whole.days * 86400 + whole.seconds) * 1_000_000_000 + frac


def read_azure_csv(path_or_lines: str | os.PathLike[str] | Iterable[str]) -> list[AzureRow]:
    """The rows of an Azure-format CSV, sorted by time (stably; the published files already
    are). Raises ConvertError naming the line and column of the first bad cell."""
    if isinstance(path_or_lines, str | os.PathLike):
        with open(path_or_lines, encoding="utf-8", newline="") as f:
            return _read_rows(f, Path(path_or_lines).name)
    return _read_rows(path_or_lines, "<csv>")


def _read_rows(lines: Iterable[str], name: str) -> list[AzureRow]:
    reader = csv.reader(lines)
    head = next(reader, None)
    if head is None:
        raise ConvertError(f"{name}: empty; expected the header {','.join(_COLUMNS)}")
    missing = [c for c in _COLUMNS if c not in head]
    if missing:
        raise ConvertError(f"{name} line 1: missing column(s) {', '.join(missing)}; "
                           f"expected {','.join(_COLUMNS)}")
    ts_i, ctx_i, gen_i = (head.index(c) for c in _COLUMNS)
    rows: list[AzureRow] = []
    for cells in reader:
        line = reader.line_num
        if not cells:
            continue
        if len(cells) != len(head):
            raise ConvertError(f"{name} line {line}: {len(cells)} cells, expected {len(head)}")
        try:
            t_ns = parse_azure_timestamp(cells[ts_i])
        except ValueError as exc:
            raise ConvertError(f'{name} line {line}: column "TIMESTAMP": {exc}') from None
        ctx = _count(cells[ctx_i], name, line, "ContextTokens")
        gen = _count(cells[gen_i], name, line, "GeneratedTokens")
        rows.append(AzureRow(line, t_ns, ctx, gen))
    rows.sort(key=lambda r: r.t_ns)
    return rows


def _count(cell: str, name: str, line: int, column: str) -> int:
    # A prompt of 0 tokens cannot be sent and max_tokens 0 generates nothing, so both >= 1.
    try:
        value = int(cell)
    except ValueError:
        value = 0
    if value < 1:
        raise ConvertError(f'{name} line {line}: column "{column}": must be an integer >= 1, '
                           f"got {cell!r:.80}")
    return value


class PromptSynth:
    """Text of an exact token count under one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pool = [w for w in dict.fromkeys(_WORDS.split())
                     if len(tokenizer.encode(w)) == 1 and len(tokenizer.encode(" " + w)) == 1]
        if len(self.pool) < 32:
            raise ConvertError(f"only {len(self.pool)} of the pool's words are single tokens "
                               "under this tokenizer; cannot synthesise exact-length prompts")

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """`n_tokens` random pool words joined by spaces: exactly `n_tokens` tokens, alone or
        after a space following other such text."""
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        return " ".join(rng.choices(self.pool, k=n_tokens))

    def check(self, text: str, n_tokens: int) -> str:
        """`text`, once its encoding is proved to be `n_tokens` long."""
        got = len(self.tokenizer.encode(text))
        if got != n_tokens:
            raise ConvertError(f"synthesised text encodes to {got} tokens, not {n_tokens}; "
                               "this tokenizer breaks the single-token-word construction")
        return text


def default_engine(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The header's engine settings for a generated trace: EngineConfig's defaults (with the
    stub's pool size, since a trace needs a concrete num_blocks), then `overrides`, checked
    by the loader's own rules. Keys in the format's order, so overrides' order is moot."""
    cfg = EngineConfig()
    engine: dict[str, Any] = {"block_size": cfg.block_size, "num_blocks": cfg.stub_num_blocks,
                              "max_num_seqs": cfg.max_num_seqs,
                              "max_num_batched_tokens": cfg.max_num_batched_tokens,
                              "seed": cfg.seed}
    engine.update(overrides or {})
    try:
        check_engine(engine)
    except FieldError as exc:
        raise ConvertError(f'field "{exc.field}": {exc.message}') from None
    known = ENGINE_REQUIRED + ENGINE_OPTIONAL
    order = [k for k in known if k in engine] + sorted(k for k in engine if k not in known)
    return {k: engine[k] for k in order}


def convert_azure(
    rows: list[AzureRow],
    tokenizer: Tokenizer,
    *,
    source: str = "<csv>",
    limit: int | None = None,
    start_offset_s: float = 0.0,
    model: str = "stub",
    stream: bool = False,
    seed: int = 0,
    engine: Mapping[str, Any] | None = None,
) -> Trace:
    """Rows from `start_offset_s` after the first row on, at most `limit` of them, as a
    virtual-clock trace whose at_s counts from the first row kept."""
    if start_offset_s < 0:
        raise ConvertError(f"start_offset_s must be >= 0, got {start_offset_s}")
    if limit is not None and limit < 1:
        raise ConvertError(f"limit must be >= 1, got {limit}")
    kept = rows
    if rows and start_offset_s:
        cut = rows[0].t_ns + round(start_offset_s * 1e9)
        kept = [r for r in rows if r.t_ns >= cut]
    kept = kept[:limit]
    if not kept:
        raise ConvertError(f"{source}: no rows at or after {start_offset_s} s")
    synth = PromptSynth(tokenizer)
    t0 = kept[0].t_ns
    requests = []
    for i, row in enumerate(kept, start=1):
        rng = random.Random(f"nanoserve-convert:{seed}:{row.line}")
        prompt = synth.check(synth.text(row.context_tokens, rng), row.context_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": row.generated_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        requests.append(TraceRequest(f"r{i}", "/v1/completions", body, ClientSpec(),
                                     at_s=(row.t_ns - t0) / 1e9))
    note = (f"{len(kept)} requests converted from {source} (CSV lines {kept[0].line}-"
            f"{kept[-1].line}, from {start_offset_s:g} s after its first row); source "
            f"{AZURE_DATASET}, {AZURE_LICENSE}; cite {AZURE_CITATION}")
    origin = {"dataset": AZURE_DATASET, "file": source, "license": AZURE_LICENSE,
              "citation": AZURE_CITATION, "first_line": kept[0].line,
              "start_offset_s": start_offset_s, "seed": seed}
    header = TraceHeader("virtual", model, default_engine(engine), note,
                         extra={"source": origin})
    return Trace(header, tuple(requests))
