"""Native kernels are part of what the suite checks: a machine where they fail to build
fails the tests that need them, unless NANOSERVE_NATIVE=0 says to run without them.

`ISA_PARAMS` runs a test once per instruction set (model/native.py), each against its own
build; a set this CPU cannot run is skipped with that reason (an AVX2-only host skips
avx512), never run into an illegal instruction."""

from __future__ import annotations

import os

import pytest

from nanoserve.model import native
from nanoserve.model.llama import LlamaModel
from nanoserve.model.native import Kernels

ISA_PARAMS = [
    pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        isa not in native.supported(), reason=f"this CPU does not run {isa}"))
    for isa in native.ISAS
]


def require_native(model: LlamaModel | None = None) -> None:
    if os.environ.get("NANOSERVE_NATIVE") == "0":
        pytest.skip("NANOSERVE_NATIVE=0: native kernels off")
    assert native.available(), "nanoserve's CPU kernels did not build: see the log above"
    if model is not None:
        assert model.native_layers
        assert model.native_attention


def kernels_for(isa: str) -> Kernels:
    """`isa`'s kernels, built on first use (about 20 s, then cached)."""
    require_native()
    k = native.kernels(isa)
    assert k is not None, f"nanoserve's {isa} kernels did not build: see the log above"
    assert k.ops.isa() == isa
    return k
