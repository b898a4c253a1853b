"""transformers reading a GGUF file (`from_pretrained(..., gguf_file=...)`), the tests'
oracle for what a file means, with two costs of its loader taken out.

Its loader parses the file's header twice, once for the config and once for the weights,
each time building gguf-py's numpy views of every vocabulary string; and it builds gguf-py's
tensor-name map (a pure function of the architecture and the layer count) once for every
module of the model: 397 times for SmolLM2. Inside `hf_from_gguf` the second parse of a file
is the first's reader and each map is built once. Neither changes a byte of what is read:
SmolLM2's load took 31 s alone, now 11 s; the suite's `hf_reference` fixture 27.5 s, now 9.4.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch


def hf_from_gguf(path: Path) -> Any:
    """transformers' causal LM read from the GGUF at `path`, float32, in eval mode."""
    import gguf
    from transformers import AutoModelForCausalLM

    reader_class = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}  # this load's only: a file may be rewritten

    def one_reader(file: Any, mode: str = "r") -> Any:
        key = (str(file), mode)
        if key not in readers:
            readers[key] = reader_class(file, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", one_reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    return model.eval()
