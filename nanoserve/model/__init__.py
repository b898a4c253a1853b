"""Models behind one protocol: real Llama weights (`llama`) and the weightless `stub`."""

from __future__ import annotations

from pathlib import Path

from nanoserve.model.base import ForwardBatch, Model, ModelConfig
from nanoserve.tokenizer import Tokenizer

__all__ = ["ForwardBatch", "Model", "ModelConfig", "load"]


def load(
    name: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    stub_eos_prob: float = 0.0,
) -> tuple[Model, Tokenizer]:
    """`smollm2` (the embedded model), `stub`, or a path to a Hugging Face Llama folder or a
    GGUF file. The stub uses SmolLM2's tokenizer, so its text behaves like the real model's."""
    import torch

    from nanoserve.model.loader import resolve_model

    if name == "stub":
        from nanoserve.model.stub import StubModel

        tok = Tokenizer.from_folder(resolve_model("smollm2"))
        return StubModel(tok, eos_prob=stub_eos_prob, device=device), tok
    from nanoserve.model.llama import LlamaModel

    folder = resolve_model(name) if name == "smollm2" else resolve_model(str(Path(name)))
    tok = Tokenizer.from_folder(folder)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return LlamaModel.from_folder(folder, device=device, dtype=torch_dtype), tok
