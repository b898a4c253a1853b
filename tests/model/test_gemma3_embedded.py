"""The second embedded model, Gemma 3 270M in Q4_K_M (`--model gemma3-270m`), against
transformers reading the same GGUF file (scripts/make_gemma_reference.py wrote the
fixtures): its tensors bit for bit, its tokenizer on 500 strings, and greedy tokens on 16
prompts, four of them past the 512-token sliding window, alone and batched with chunked
prefill, preemption and the prefix cache.

One model load for the module (about 20 s); the file's blocks run on the native kernels
(Q5_0, Q4_K, Q6_K and Q8_0: nothing is a float32 copy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.drain import drain, tokens
from support.reference import load_reference
from support.tiny_checkpoints import GREEDY, check_runs, run_alone

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import load
from nanoserve.model.loader import gemma_gguf_path
from nanoserve.model.quant import BLOCK_BYTES, QuantProj, QuantWeight

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
WINDOW = 512


@pytest.fixture(scope="module")
def gemma() -> tuple[Any, Any]:
    return load("gemma3-270m")


def test_every_tensor_dequantizes_bit_exactly_as_gguf_py_does() -> None:
    from gguf.quants import dequantize

    from nanoserve.model.gguf import open_gguf

    reader = open_gguf(gemma_gguf_path())
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        fmt = t.tensor_type.name.lower()
        kinds[fmt] = kinds.get(fmt, 0) + 1
        if fmt == "f32":
            continue  # read as it is
        data = np.array(t.data)  # [rows, row bytes]
        want = torch.from_numpy(np.array(dequantize(data, t.tensor_type), dtype=np.float32))
        got = QuantWeight(torch.from_numpy(data.view(np.uint8)), fmt, int(t.shape[0]))
        assert torch.equal(got.dequantize(), want), t.name
    assert kinds == {"f32": 109, "q5_0": 81, "q4_k": 27, "q8_0": 10, "q6_k": 9}


def test_the_tokenizer_from_the_file_gives_transformers_ids(gemma: tuple[Any, Any]) -> None:
    _, tok = gemma
    cases = json.loads((FIXTURES / "gemma3_tokenizer.json").read_text())["cases"]
    assert len(cases) == 500
    wrong = [(c["text"], tok.encode_prompt(c["text"]), c["ids"]) for c in cases
             if tok.encode_prompt(c["text"]) != c["ids"]]
    assert not wrong, wrong[:3]


def test_the_blocks_run_on_the_kernels_and_the_context_is_not_capped(
        gemma: tuple[Any, Any]) -> None:
    model, tok = gemma
    c = model.config
    assert (c.architecture, c.vocab_size, c.max_position_embeddings) == ("gemma3", 262144,
                                                                          32768)
    assert c.sliding_window == WINDOW
    assert c.window_layers == tuple(i for i in range(18) if (i + 1) % 6)
    projections = [p for ly in model.layers for p in (ly.qkv, ly.o, ly.gate_up, ly.down)]
    assert all(isinstance(p, QuantProj) for p in [*projections, model.lm_head])
    assert set(BLOCK_BYTES) >= {"q5_0", "q4_k", "q6_k", "q8_0"}
    assert tok.chat_template is None  # a base model


def test_greedy_equals_transformers_alone_and_batched(gemma: tuple[Any, Any]) -> None:
    model, tok = gemma
    cases = load_reference(FIXTURES / "reference_gemma3.json")
    assert len(cases) == 16
    assert sum(len(c.prompt_ids) > WINDOW for c in cases) == 4
    longest = max(len(c.prompt_ids) for c in cases) + len(cases[0].tokens)
    got = run_alone(model, tok, cases, EngineConfig(block_size=16, num_blocks=80,
                                                    max_model_len=1280, prefix_caching=False))
    assert check_runs(cases, got) >= 0.75 * 16 * 32
    # Chunks of 256 tokens, a pool of 100 blocks for 16 sequences of up to 1,032 tokens
    # (preemption), and the long prompts sharing their first 600 tokens (prefix cache hits
    # past the window).
    blocks = 100
    assert blocks * 16 >= longest
    batched = Engine(model, tok, EngineConfig(block_size=16, num_blocks=blocks,
                                              max_model_len=1280, max_num_batched_tokens=256))
    for case in cases:
        batched.add_request(list(case.prompt_ids), GREEDY, case.name)
    compared = check_runs(cases, tokens(drain(batched)))
    assert compared >= 0.75 * 16 * 32, compared
    stats = batched.statistics()
    assert stats.preemptions >= 1
    assert stats.prefix_hits >= 1
    assert batched.pool.num_free == blocks


def test_the_decode_stack_is_the_layer_loop_bit_for_bit(gemma: tuple[Any, Any]) -> None:
    """Gemma's decode steps run in the native stack: mixed-format projections, q and k
    norms, the norms of the attention and MLP outputs, the tanh-GELU gate, local RoPE on
    the sliding layers and a window that binds (two of the three prompts are past it).
    Its logprobs equal the layer loop's, bits."""
    from support.decode_stack import both_ways

    model, tok = gemma
    cases = load_reference(FIXTURES / "reference_gemma3.json")
    long = [list(c.prompt_ids) for c in cases if len(c.prompt_ids) > WINDOW][:2]
    prompts = [*long, list(cases[0].prompt_ids)]
    stacked, looped, calls = both_ways(model, tok, prompts, 6, EngineConfig(
        block_size=16, num_blocks=120, max_model_len=1280))
    assert stacked == looped
    assert [len(v) for v in stacked.values()] == [6, 6, 6]
    assert calls == 5
