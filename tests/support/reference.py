"""The reference oracle's recorded outputs, and the rule for comparing a greedy run to them.

`tests/fixtures/reference_smollm2.json` is written by `scripts/make_reference.py`: for each
prompt, Hugging Face transformers' LlamaForCausalLM (loaded through transformers' own GGUF
reader, not through our converter) decodes 32 tokens greedily with EOS ignored, and records
at every generated position the margin between its top two logits and its top five.

Greedy decoding is exact only up to float rounding: two implementations that differ in the
last bits of a logit may pick different tokens where the top two are (nearly) tied, and from
there the sequences legitimately part. `compare_greedy` therefore demands identical tokens,
except that a first divergence where the reference margin is under NEAR_TIE is accepted and
ends the comparison.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "reference_smollm2.json"
NEAR_TIE = 1e-3
MAX_NEW_TOKENS = 32


@dataclass(frozen=True, slots=True)
class RefCase:
    name: str
    text: str
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]  # [32] the reference's greedy continuation
    margins: tuple[float, ...]  # [32] top-1 minus top-2 logit at each generated position
    top5: tuple[tuple[tuple[int, float], ...], ...]  # [32][5] (token id, logit), best first


def load_reference(path: Path = FIXTURE) -> list[RefCase]:
    data = json.loads(path.read_text())
    return [
        RefCase(
            name=c["name"],
            text=c["text"],
            prompt_ids=tuple(c["prompt_ids"]),
            tokens=tuple(c["tokens"]),
            margins=tuple(c["margins"]),
            top5=tuple(tuple((int(i), float(v)) for i, v in pos) for pos in c["top5"]),
        )
        for c in data["cases"]
    ]


def compare_greedy(case: RefCase, token_ids: Sequence[int]) -> tuple[list[str], list[int]]:
    """(problems, near_tie_positions) for a greedy continuation of `case.prompt_ids`."""
    for i, (want, got) in enumerate(zip(case.tokens, token_ids, strict=False)):
        if want == got:
            continue
        if case.margins[i] < NEAR_TIE:
            return [], [i]  # a legitimate split; what follows depends on the split
        return [
            f"{case.name}: token {i} is {got}, reference {want} "
            f"(reference margin {case.margins[i]:.4g}, top-5 {list(case.top5[i])})"
        ], []
    if len(token_ids) != len(case.tokens):
        return [f"{case.name}: {len(token_ids)} tokens, reference {len(case.tokens)}"], []
    return [], []


@torch.inference_mode()
def hf_greedy(model: Any, prompt_ids: Sequence[int], max_new_tokens: int = MAX_NEW_TOKENS
              ) -> dict[str, Any]:
    """Greedy decode with a transformers causal LM, EOS ignored: tokens, margins, top-5.

    A plain loop over the model's KV cache rather than `generate()`, so no generation
    config (EOS, repetition penalty, min length) can bend the logits we record.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt_ids)])
    tokens: list[int] = []
    margins: list[float] = []
    top5: list[list[tuple[int, float]]] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        values, indices = logits.float().topk(5)
        token = int(logits.argmax())  # the first of equal maxima, as our sampler picks
        tokens.append(token)
        margins.append(float(values[0] - values[1]))
        top5.append([(int(i), float(v)) for i, v in zip(indices, values, strict=True)])
        ids = torch.tensor([[token]])
    return {"tokens": tokens, "margins": margins, "top5": top5}
