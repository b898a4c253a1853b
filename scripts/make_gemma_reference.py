"""Write the embedded Gemma 3 270M's reference fixtures from transformers reading the same
GGUF file (`gguf_file=`, float32), never from our converted folder:

- tests/fixtures/reference_gemma3.json: greedy continuations (32 tokens, EOS ignored) of 16
  prompts, 4 of them longer than the model's 512-token sliding window, in the format of
  reference_smollm2.json (tests/support/reference.py reads both);
- tests/fixtures/gemma3_tokenizer.json: transformers' ids for 500 strings (every script of
  the SmolLM2 prompts, emoji, code, runs of spaces, tabs and newlines, special tokens), as
  its tokenizer built from the file's own metadata makes them, <bos> included.

    .venv/bin/python scripts/make_gemma_reference.py    # about 3 minutes on 2 idle cores
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]

import torch  # noqa: E402
import transformers  # noqa: E402
from make_reference import _PROMPTS, _case_json  # noqa: E402
from support.reference import MAX_NEW_TOKENS, NEAR_TIE, hf_greedy  # noqa: E402

from nanoserve.model.loader import file_sha256, gemma_gguf_path  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
REFERENCE = FIXTURES / "reference_gemma3.json"
TOKENIZER = FIXTURES / "gemma3_tokenizer.json"
# The short prompts (SmolLM2's ChatML ones left out: a base model), and four past the
# window: the whole set joined and cut at these token counts.
_SHORT = ("en_short", "en_story", "en_question", "fr_accents", "de_umlauts", "ru_cyrillic",
          "ja_text", "zh_text", "emoji_zwj", "python_code", "json_data", "essay")
_LONG_TOKENS = (600, 700, 850, 1000)
_STRINGS = 500


def prompts(tok: Any) -> list[tuple[str, str, list[int]]]:
    texts = dict(_PROMPTS)
    out = [(name, texts[name], list(tok(texts[name]).input_ids)) for name in _SHORT]
    joined = "\n\n".join(text for _, text in _PROMPTS)
    ids = list(tok(joined).input_ids)  # <bos> first
    for n in _LONG_TOKENS:
        out.append((f"long_{n}", tok.decode(ids[1:n]), ids[:n]))
    return out


def strings(seed: int = 0) -> list[str]:
    """500 deterministic strings: pieces of every prompt, emoji, code, whitespace runs and
    the tokenizer's special tokens, mixed."""
    rng = random.Random(seed)
    pieces = [text for _, text in _PROMPTS]
    extra = ["😀", "👩‍💻", "🇯🇵", "❤️", "\t", "\n\n\n", "    ", "  \t \n", "<bos>", "<eos>",
             "<start_of_turn>", "<end_of_turn>", "<pad>", "<unk>", "ﬁ", "é", "e\u0301",
             "\u200b", "0x7fffffff", "1e-6", "naïve café", "a" * 40, " " * 17,
             "def f():\n\treturn 1"]
    out: list[str] = []
    while len(out) < _STRINGS:
        kind = rng.randrange(3)
        if kind == 0:  # a slice of a prompt
            text = rng.choice(pieces)
            i = rng.randrange(len(text))
            out.append(text[i:i + rng.randrange(1, 120)])
        elif kind == 1:  # a few extras glued
            out.append("".join(rng.choice(extra) for _ in range(rng.randrange(1, 5))))
        else:  # a slice with extras around it
            text = rng.choice(pieces)
            i = rng.randrange(len(text))
            out.append(rng.choice(extra) + text[i:i + 40] + rng.choice(extra))
    return out


def main() -> None:
    started = time.monotonic()
    gguf = gemma_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    print(f"oracle loaded in {time.monotonic() - started:.1f} s")
    lines = []
    for name, text, ids in prompts(tok):
        ref = hf_greedy(model, ids)
        ties = [i for i, m in enumerate(ref["margins"]) if m < NEAR_TIE]
        print(f"{name:12s} {len(ids):4d} prompt tokens  near ties at {ties}  "
              f"{tok.decode(ref['tokens'])!r:.60}")
        lines.append(_case_json(name, text, ids, ref))
    header = {
        "gguf": gguf.name,
        "gguf_sha256": file_sha256(gguf),
        "oracle": f"transformers {transformers.__version__} Gemma3ForCausalLM via gguf_file, "
                  f"float32, torch {torch.__version__}",
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    head = json.dumps(header, separators=(",", ":"))[:-1]
    REFERENCE.write_text(head + ',"cases":[\n' + ",\n".join(lines) + "\n]}\n")
    cases = [{"text": s, "ids": list(tok(s).input_ids)} for s in strings()]
    TOKENIZER.write_text(json.dumps({"tokenizer": header["oracle"], "cases": cases},
                                    ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {REFERENCE.name} and {TOKENIZER.name} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
