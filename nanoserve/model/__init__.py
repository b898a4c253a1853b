"""Models behind one protocol: real Llama weights (`llama`) and the weightless `stub`."""

from __future__ import annotations

from pathlib import Path

from nanoserve.model.base import ForwardBatch, Model, ModelConfig
from nanoserve.tokenizer import Tokenizer

__all__ = ["ForwardBatch", "Model", "ModelConfig", "kv_geometry", "load"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def kv_geometry(name: str, dtype: str = "float32") -> tuple[int, int]:
    """(context length, KV-cache bytes per token) of the model `load(name, dtype=dtype)`
    would load, read from its metadata without loading or converting weights: what
    `EngineConfig.layout` needs to judge a configuration before a server binds its socket.
    Raises OSError or ValueError for a model that cannot be found or read."""
    if name == "stub":
        from nanoserve.model.stub import STUB_CONTEXT

        return STUB_CONTEXT, 0  # the stub keeps no KV
    from nanoserve.model.loader import peek_config

    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    config = peek_config(name)
    return config.max_position_embeddings, config.kv_bytes_per_token(_DTYPE_BYTES[dtype])
