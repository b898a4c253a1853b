"""Native kernels are part of what the suite checks: a machine where they fail to build
fails the tests that need them, unless NANOSERVE_NATIVE=0 says to run without them."""

from __future__ import annotations

import os

import pytest

from nanoserve.model import native
from nanoserve.model.llama import LlamaModel


def require_native(model: LlamaModel | None = None) -> None:
    if os.environ.get("NANOSERVE_NATIVE") == "0":
        pytest.skip("NANOSERVE_NATIVE=0: native kernels off")
    assert native.available(), "nanoserve's CPU kernels did not build: see the log above"
    if model is not None:
        assert model.native_layers
        assert model.native_attention
