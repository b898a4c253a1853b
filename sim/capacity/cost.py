"""The step-cost model: seconds of one engine step, predicted from what the step computed.

A step's time on a CPU (or a GPU at small batch) is close to linear in a handful of work
counts, each with a physical reason:

    seconds = const                      (weights streamed once per step, Python overhead)
            + b * prefill_tokens         (matmuls over every new prompt token)
            + c * prefill_seqs           (per-row gathers, one logits row per finished prompt)
            + d * decode_seqs            (matmuls, sampling and detokenizing one token per row)
            + e * decode_context         (decode attention: a row reads its whole KV)
            + f * prefill_attention      (causal attention of the prefill chunks, pairs)
            + j * prefill_cached_pairs   (of those, the pairs whose keys were cached before
                                          the step: a continuation chunk's, or a prompt's
                                          after a prefix-cache hit; these run another
                                          kernel, a masked SDPA over keys read back from
                                          the blocks, cheaper per pair: a per-pair cost
                                          fitted on fresh prompts alone over-priced a
                                          3584-token prompt's last chunk by 24%)
            + g * batched                (1 when the step multiplies two or more rows by
                                          the weights: a packed gemm, where one row is a
                                          gemv; on this CPU 60 ms at one row, 75 at two)
            + h * tile_rows              (the step's rows when quantized weights multiply
                                          them in nanoserve's tile kernel: more than fit in
                                          registers, fewer than pay for a dequantized
                                          sgemm; a row there costs more than on either side)
            + i * panel_blocks           (the passes over the weights' panels when they
                                          multiply the rows: one per 16 rows on AVX-512,
                                          each dequantizing every weight again, so the
                                          step's time steps up at 17 rows, 33, ...)

Which kernel the rows take depends on the instruction set of the machine the model was
profiled on (nanoserve.model.quant.row_path), recorded as the cost model's machine["isa"]:
a model without it (format 3 and older, profiled before panels) keeps the dispatch it was
fitted to, a tile band from 9 to 127 rows and no panels.

The coefficients are fitted by least squares on relative error (each sample weighted by
1 / its time), since a 5 ms step predicted 5 ms off matters as much as a 500 ms one predicted
500 ms off. `sim profile` measures the samples and writes the model as JSON with the machine
and model it came from; the simulator calls it on each `StepResult`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.engine.outputs import StepResult
from nanoserve.model.panels import X_ROWS
from nanoserve.model.quant import row_path
from sim.files import atomic_write_text

FEATURES = ("const", "prefill_tokens", "prefill_seqs", "decode_seqs", "decode_context",
            "prefill_attention", "batched", "tile_rows", "panel_blocks", "prefill_cached_pairs")
# Format 2 added `batched`, format 3 `tile_rows`, format 4 `panel_blocks` (and
# machine["isa"]) and `prefill_cached_pairs`. An older file is the same law without them,
# so it still loads, with those coefficients 0.
COST_FORMAT = 4
_FORMATS = {1: FEATURES[:6], 2: FEATURES[:7], 3: FEATURES[:8], 4: FEATURES}


def step_features(r: StepResult, isa: str | None = None) -> tuple[float, ...]:
    """The step's work counts, in FEATURES order, with the quantized kernels `isa` runs
    (None: before panels; see the module docstring)."""
    rows = r.num_prefill_tokens + r.num_decode_tokens  # rows through the weight multiplies
    # Counted for every model; a float32 one's fit gives them coefficients near 0.
    path = row_path(rows, isa)
    tile = rows if path == "tile" else 0
    passes = -(-rows // X_ROWS[isa]) if path == "panels" and isa is not None else 0
    return (1.0, float(r.num_prefill_tokens), float(r.num_prefill_seqs),
            float(r.num_decode_tokens), float(r.decode_context), float(r.prefill_attention),
            1.0 if rows >= 2 else 0.0, float(tile), float(passes),
            float(r.prefill_cached_pairs))


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step, linear in `step_features`. `name` is what reports cite."""

    coef: tuple[float, ...]
    name: str = "unnamed"
    model: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    # Bytes of KV one token takes in the real model (all layers, K and V): the GiB a
    # num_blocks means. 0 when unknown.
    kv_bytes_per_token: int = 0
    block_size: int = 16
    fit: dict[str, Any] = field(default_factory=dict)  # held-out error, grid, sample count

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"cost model needs {len(FEATURES)} coefficients "
                             f"({', '.join(FEATURES)}), got {len(self.coef)}")
        if not all(math.isfinite(c) for c in self.coef):
            raise ValueError(f"cost model coefficients must be finite, got {self.coef}")

    def predict(self, features: Sequence[float]) -> float:
        s = sum(c * x for c, x in zip(self.coef, features, strict=True))
        # A fit may put a small negative coefficient on a feature; never a negative step.
        return max(s, 0.0)

    @property
    def isa(self) -> str | None:
        """The instruction set whose kernels the profiled model ran (None: before panels)."""
        isa = self.machine.get("isa")
        return isa if isa in X_ROWS else None

    def __call__(self, result: StepResult) -> float:
        return self.predict(step_features(result, self.isa))

    def kv_gib(self, num_blocks: int, block_size: int | None = None) -> float:
        bs = self.block_size if block_size is None else block_size
        return num_blocks * bs * self.kv_bytes_per_token / 2**30

    def to_dict(self) -> dict[str, Any]:
        return {
            "nanoserve_cost_model": COST_FORMAT,
            "name": self.name,
            "model": self.model,
            "machine": self.machine,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size,
            "formula": "seconds = max(0, sum(coef[k] * feature[k]))",
            "coef": dict(zip(FEATURES, self.coef, strict=True)),
            "fit": self.fit,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> CostModel:
        fmt = d.get("nanoserve_cost_model")
        keys = _FORMATS.get(fmt) if isinstance(fmt, int) else None
        if keys is None:
            raise ValueError(f"not a nanoserve cost model (formats {', '.join(map(str, _FORMATS))}"
                             f"): nanoserve_cost_model = {fmt!r}")
        coef = d.get("coef")
        if not isinstance(coef, Mapping) or set(coef) != set(keys):
            raise ValueError(f"cost model format {fmt} coef must have exactly the keys "
                             f"{', '.join(keys)}")
        return cls(
            coef=tuple(float(coef.get(k, 0.0)) for k in FEATURES),
            name=name or str(d.get("name") or "unnamed"),
            model=str(d.get("model", "")),
            machine=dict(d.get("machine", {})),
            kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)),
            block_size=int(d.get("block_size", 16)),
            fit=dict(d.get("fit", {})),
        )

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")


def load_cost_model(path: str | Path) -> CostModel:
    """A cost model from its JSON file; its `name` is the file's name if it has none."""
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a cost model is a JSON object")
    return CostModel.from_dict(d, name=d.get("name") or Path(path).name)


def fit_coefficients(
    xs: Sequence[Sequence[float]], ys: Sequence[float], use: Sequence[str] = FEATURES
) -> tuple[float, ...]:
    """Least squares on relative error over the features named in `use` (the others get 0:
    a grid that never varies a feature cannot fit it). Solved by normal equations in
    float64 with a tiny ridge, so that a feature collinear on the grid does not blow up."""
    cols = [FEATURES.index(u) for u in use]
    k = len(cols)
    # Scale each column to unit size so the ridge treats them alike.
    scale = [max((abs(x[c]) for x in xs), default=1.0) or 1.0 for c in cols]
    ata = [[0.0] * k for _ in range(k)]
    aty = [0.0] * k
    for x, y in zip(xs, ys, strict=True):
        if y <= 0:
            raise ValueError(f"step times must be > 0 s, got {y}")
        w = 1.0 / y  # relative error: divide row and target by y
        row = [x[c] / s * w for c, s in zip(cols, scale, strict=True)]
        for i in range(k):
            aty[i] += row[i] * 1.0
            for j in range(k):
                ata[i][j] += row[i] * row[j]
    for i in range(k):
        ata[i][i] += 1e-9 * (ata[i][i] or 1.0)
    sol = _solve(ata, aty)
    coef = [0.0] * len(FEATURES)
    for c, s, v in zip(cols, scale, sol, strict=True):
        coef[c] = v / s
    return tuple(coef)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (k is at most ten)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            raise ValueError("the profile grid cannot separate the cost model's features")
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


def relative_errors(model: CostModel, xs: Sequence[Sequence[float]],
                    ys: Sequence[float]) -> list[float]:
    """|predicted - measured| / measured for each sample."""
    return [abs(model.predict(x) - y) / y for x, y in zip(xs, ys, strict=True)]
