"""Write tests/fixtures/reference_smollm2.json: the reference oracle's greedy continuations.

The oracle is Hugging Face transformers' LlamaForCausalLM loaded through transformers' own
GGUF reader from the embedded file, never from our converted state dict, so a mistake in our
converter (the Q/K row permutation above all) cannot hide in both sides. Prompts are
tokenized with our converted tokenizer, no special tokens added.

    .venv/bin/python scripts/make_reference.py    # 1.5 to 2 minutes on 2 idle CPU cores
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import transformers  # noqa: E402
from support.reference import FIXTURE, MAX_NEW_TOKENS, NEAR_TIE, hf_greedy  # noqa: E402

from nanoserve.model.loader import (  # noqa: E402
    EMBEDDED_GGUF,
    embedded_gguf_path,
    file_sha256,
    resolve_model,
)
from nanoserve.tokenizer import Tokenizer  # noqa: E402

_PY = '''import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)


def run(jobs: list[Job]) -> list[str]:
    """Pop jobs in priority order; ties keep insertion order."""
    heap = list(jobs)
    heapq.heapify(heap)
    done = []
    while heap:
        job = heapq.heappop(heap)
        done.append(job.name)
    return done


if __name__ == "__main__":
    print(run([Job(2, "b"), Job(1, "a"), Job(3, "c")]))
'''

_RUST = '''fn fib(n: u64) -> u64 {
    let (mut a, mut b) = (0u64, 1u64);
    for _ in 0..n {
        (a, b) = (b, a + b);
    }
    a
}

fn main() {
    for i in 0..10 {
        println!("fib({i}) = {}", fib(i));
    }
}
'''

_ESSAY = (
    "Serving a language model is mostly a problem of memory, not of arithmetic. Each "
    "sequence keeps the keys and values of every token it has seen, and those caches grow "
    "one token at a time, at rates no scheduler can predict. Early servers reserved a "
    "contiguous slab for the longest sequence a request might reach, and most of that slab "
    "sat empty. Paged attention borrows the operating system's answer: cut the cache into "
    "fixed-size blocks, keep a table that maps each sequence's logical blocks to physical "
    "ones, and hand blocks out only when they are needed. Fragmentation falls to less than a "
    "block per sequence, and sequences that share a prefix can share its blocks too. The "
    "price is an indirection inside the attention kernel, which must gather each sequence's "
    "keys from wherever its blocks happen to live. Continuous batching completes the "
    "picture: instead of waiting for a whole batch to finish, the scheduler admits new "
    "requests at every step and retires finished ones, so the accelerator is never idle "
    "while work is waiting. Chunked prefill splits long prompts so that they do not stall "
    "the decoding of everyone else, and preemption frees memory when the pool runs dry."
)

# (name, text). Deterministic; lengths run from about 10 to 500 tokens.
_PROMPTS: list[tuple[str, str]] = [
    ("en_short", "The capital of France is Paris. The capital of Japan is"),
    ("en_story", "Once upon a time, in a small village by the sea, there lived an old "
                 "fisherman who"),
    ("en_question", "Question: Why is the sky blue? Explain it to a ten-year-old.\nAnswer:"),
    ("chat_haiku", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                   "by Hugging Face<|im_end|>\n<|im_start|>user\nWrite a haiku about autumn "
                   "leaves.<|im_end|>\n<|im_start|>assistant\n"),
    ("chat_math", "<|im_start|>user\nWhat is 17 times 23? Show your steps.<|im_end|>\n"
                  "<|im_start|>assistant\n"),
    ("fr_accents", "Le café de la gare était fermé, alors nous avons marché jusqu'à la place "
                   "où l'église sonnait midi. Là, un garçon naïf nous a expliqué que"),
    ("de_umlauts", "Die Straße war nass, und die Bäume rauschten im Wind. Jürgen öffnete die "
                   "Tür und sagte: „Über Nacht ist es kälter geworden, weil"),
    ("es_pt", "¿Dónde está la biblioteca? Não sei, mas a estação fica ao lado da praça. "
              "El niño pidió una canción y"),
    ("ru_cyrillic", "Москва — столица России. Зимой здесь идёт снег, а летом"),
    ("el_greek", "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας και"),
    ("ar_hi", "مرحبا بالعالم. नमस्ते दुनिया, आज मौसम"),
    ("ja_text", "日本語のテキストを少し書きます。東京は日本の首都で、"),
    ("zh_text", "东京和北京都是大城市。北京的秋天很美，因为"),
    ("ko_text", "한국어 문장도 있습니다. 서울은 한국의 수도이며"),
    ("emoji_zwj", "Emoji test: 😀 🎉 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🏳️‍🌈. My favourite one is"),
    ("emoji_text", "I ❤️ pizza 🍕 and coffee ☕, but my cat 🐈‍⬛ prefers"),
    ("python_code", _PY + "\n\ndef test_run() -> None:\n"),
    ("rust_code", _RUST + "\n// Now a function that sums a slice:\n"),
    ("json_data", '{"users": [{"id": 1, "name": "Ærøskøbing", "tags": ["a", "b"]}, '
                  '{"id": 2, "name": "Zoë", "tags": []}], "next": '),
    ("numbers", "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89,"),
    ("repeat", "red green blue red green blue red green blue red green"),
    ("essay", _ESSAY + "\n\nIn summary,"),
    ("essay_code", _ESSAY + "\n\nA toy scheduler in Python:\n\n" + _PY + "\n# Next, blocks:\n"),
    ("markdown", "| Model | Params | Layers |\n|---|---|---|\n| SmolLM2 | 135M | 30 |\n"
                 "| SmolLM2 | 360M | 32 |\n| SmolLM2 | 1.7B |"),
]
# One long prompt of every script at once, cut at a fixed token count below.
_MIXED_NAME, _MIXED_TOKENS = "long_mixed", 500


def prompts(tok: Tokenizer) -> list[tuple[str, str, list[int]]]:
    out = [(name, text, tok.encode(text)) for name, text in _PROMPTS]
    mixed = "\n\n".join(text for _, text in _PROMPTS)
    ids = tok.encode(mixed)[:_MIXED_TOKENS]
    out.append((_MIXED_NAME, tok.decode(ids, skip_special_tokens=False), ids))
    return out


def load_oracle() -> Any:
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def _case_json(name: str, text: str, ids: list[int], ref: dict[str, Any]) -> str:
    case = {
        "name": name,
        "text": text,
        "prompt_ids": ids,
        "tokens": ref["tokens"],
        "margins": [round(m, 6) for m in ref["margins"]],
        "top5": [[[i, round(v, 5)] for i, v in pos] for pos in ref["top5"]],
    }
    return json.dumps(case, ensure_ascii=False, separators=(",", ":"))


def main() -> None:
    tok = Tokenizer.from_folder(resolve_model("smollm2"))
    started = time.monotonic()
    model = load_oracle()
    print(f"oracle loaded in {time.monotonic() - started:.1f} s")
    lines = []
    for name, text, ids in prompts(tok):
        ref = hf_greedy(model, ids)
        ties = [i for i, m in enumerate(ref["margins"]) if m < NEAR_TIE]
        print(f"{name:12s} {len(ids):4d} prompt tokens  near ties at {ties}  "
              f"{tok.decode(ref['tokens'])!r:.60}")
        lines.append(_case_json(name, text, ids, ref))
    header = {
        "gguf": EMBEDDED_GGUF,
        "gguf_sha256": file_sha256(embedded_gguf_path()),
        "oracle": f"transformers {transformers.__version__} LlamaForCausalLM via gguf_file, "
                  f"float32, torch {torch.__version__}",
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    head = json.dumps(header, separators=(",", ":"))[:-1]
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(head + ',"cases":[\n' + ",\n".join(lines) + "\n]}\n")
    print(f"wrote {FIXTURE} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
