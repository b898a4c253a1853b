"""Shared fixtures. The real weights are loaded once per session, and only by tests that ask.

`smollm2_folder` converts the embedded GGUF on first use per machine (about 25 s, then
cached under NANOSERVE_CACHE or ~/.cache/nanoserve); `hf_reference` loads the oracle through
transformers' own GGUF reader (about 25 s) and only for tests that compare against it live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_gguf import hf_from_gguf

from nanoserve.model.llama import LlamaModel
from nanoserve.model.loader import embedded_gguf_path, resolve_model
from nanoserve.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_folder: Path) -> LlamaModel:
    return LlamaModel.from_folder(smollm2_folder, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_quantized() -> LlamaModel:
    """SmolLM2 on its GGUF's own Q4_1 and Q8_0 blocks (`--quantization auto`)."""
    from nanoserve.model import load

    model, _ = load("smollm2", quantization="auto")
    assert isinstance(model, LlamaModel)
    return model


@pytest.fixture(scope="session", params=["float32", "quantized"])
def smollm2_any(request: pytest.FixtureRequest) -> LlamaModel:
    """The float32 model, then the quantized one: for the tests both must pass."""
    name = "smollm2_model" if request.param == "float32" else "smollm2_quantized"
    model: LlamaModel = request.getfixturevalue(name)
    return model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder)


@pytest.fixture(scope="session")
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    """SmolLM2's tokenizer, which the stub model speaks: the stub tests' tokenizer."""
    return smollm2_tokenizer


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    """transformers' LlamaForCausalLM from the GGUF file itself, never from our state dict."""
    return hf_from_gguf(embedded_gguf_path())
