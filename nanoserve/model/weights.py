"""A Llama's weights by model name, before any model is built from them: float32 from the
converted folder, or with quantized projections (model/quant.py). One function, so that the
serving process and every tensor-parallel rank (model/parallel/) read the same tensors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from nanoserve.model.base import ModelConfig

DTYPES = ("float32", "bfloat16", "float16")


def check_choices(dtype: str, quantization: str) -> None:
    from nanoserve.model.quant import CHOICES

    if quantization not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)}, got "
                         f"{quantization!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")


def torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[dtype]


def llama_weights(name: str, *, device: str, dtype: str, quantization: str
                  ) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, weights by Hugging Face name) of `smollm2` or a Llama folder or GGUF path."""
    from nanoserve.model.llama import load_weights
    from nanoserve.model.loader import EMBEDDED, load_model_config, resolve_model

    folder = resolve_model(name) if name in EMBEDDED else resolve_model(str(Path(name)))
    weights = _quantized_weights(name, folder, quantization, device, dtype)
    return load_model_config(folder), weights if weights is not None else load_weights(folder)


def _quantized_weights(name: str, folder: Path, quantization: str, device: str, dtype: str
                       ) -> dict[str, Any] | None:
    """The weights with quantized projections, or None for the float32 folder as it is."""
    import torch

    from nanoserve.model import native
    from nanoserve.model.gguf import read_gguf_weights
    from nanoserve.model.llama import load_weights
    from nanoserve.model.loader import gguf_path
    from nanoserve.model.quant import BLOCK_BYTES, quant_pays, quantize

    if quantization == "none":
        return None
    if not (torch.device(device).type == "cpu" and dtype == "float32"
            and native.available()):
        logging.getLogger(__name__).warning(
            "--quantization %s: the quantized kernels run on the CPU in float32 with "
            "nanoserve's native kernels; using float32 weights", quantization)
        return None
    gguf = gguf_path(name)
    if quantization == "auto":
        if gguf is None:
            return None  # a float32 (or bf16) folder: nothing quantized to keep
        kernels = native.kernels()
        if kernels is not None and not quant_pays(kernels.isa):
            logging.getLogger(__name__).info(
                "--quantization auto: the %s kernels multiply quantized blocks more slowly "
                "than float32 weights; using float32 (--quantization q8_0, q4_0 or q4_1 "
                "quantizes anyway)", kernels.isa)
            return None
        return read_gguf_weights(gguf, keep=frozenset(BLOCK_BYTES))
    # One format for every matrix: from the file's values (dequantized), by gguf-py.
    weights: dict[str, Any] = (read_gguf_weights(gguf, keep=frozenset()) if gguf is not None
                               else load_weights(folder))
    return {k: quantize(v, quantization) if v.dim() == 2 else v for k, v in weights.items()}
