"""Models behind one protocol (base.py): real Llama weights and the weightless stub.

    llama.py      the Llama forward over the paged KV cache; attention.py its attention
    quant.py      quantized weights (GGUF blocks) and their projections
    native.py     the build of csrc/, the CPU kernels (layers, attention, quantized, stack)
    ops.py        a layer's elementwise parts: one native kernel each, or stock PyTorch ops
    linear.py     a float weight multiply in the device's fastest form (MKL's packed sgemm)
    stub.py       the stub: logits from (seed, history), for simulation and tests
    loader.py     a model name or path -> a Hugging Face folder, converted once and cached
    gguf.py       reading a llama GGUF: tensors, metadata, tokenizer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    quantization: str = "auto",
) -> tuple[Model, Tokenizer]:
    """`smollm2` (the embedded model), `stub`, or a path to a Hugging Face Llama folder or a
    GGUF file. The stub uses SmolLM2's tokenizer, so its text behaves like the real model's.
    `quantization` (model/quant.py): `auto` keeps a GGUF's own block formats where kernels
    exist, `none` dequantizes to float32, `q8_0`/`q4_0`/`q4_1` quantize to that format."""
    import torch

    from nanoserve.model.loader import resolve_model
    from nanoserve.model.quant import CHOICES

    if quantization not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)}, got "
                         f"{quantization!r}")
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
    weights = _quantized_weights(name, folder, quantization, device, torch_dtype)
    if weights is None:
        return LlamaModel.from_folder(folder, device=device, dtype=torch_dtype), tok
    from nanoserve.model.loader import load_model_config

    return LlamaModel(load_model_config(folder), weights, device=device, dtype=torch_dtype), tok


def _quantized_weights(
    name: str, folder: Path, quantization: str, device: str, dtype: Any
) -> dict[str, Any] | None:
    """The weights with quantized projections, or None for the float32 folder as it is."""
    import logging

    import torch

    from nanoserve.model import native
    from nanoserve.model.gguf import read_gguf_weights
    from nanoserve.model.llama import load_weights
    from nanoserve.model.loader import gguf_path
    from nanoserve.model.quant import BLOCK_BYTES, quantize

    if quantization == "none":
        return None
    if not (torch.device(device).type == "cpu" and dtype == torch.float32
            and native.available()):
        logging.getLogger(__name__).warning(
            "--quantization %s: the quantized kernels run on the CPU in float32 with "
            "nanoserve's native kernels; using float32 weights", quantization)
        return None
    gguf = gguf_path(name)
    if quantization == "auto":
        if gguf is None:
            return None  # a float32 (or bf16) folder: nothing quantized to keep
        return read_gguf_weights(gguf, keep=frozenset(BLOCK_BYTES))
    # One format for every matrix: from the file's values (dequantized), by gguf-py.
    weights: dict[str, Any] = (read_gguf_weights(gguf, keep=frozenset()) if gguf is not None
                               else load_weights(folder))
    return {k: quantize(v, quantization) if v.dim() == 2 else v for k, v in weights.items()}


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
