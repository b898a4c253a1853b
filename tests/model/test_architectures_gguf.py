"""Token identity with transformers for GGUF files of each architecture nanoserve reads
from GGUF (llama, qwen2, qwen3, gemma3), written with gguf-py as llama.cpp's converter writes
them (tests/support/write_gguf.py), in F32 or Q8_0. (gguf-py has no K-quant quantizer: the
embedded Gemma 3 file's Q4_K, Q5_0 and Q6_K blocks are tested in test_gemma3_embedded.py.)

nanoserve reads the file itself (metadata, tokenizer, tensors: Q8_0 blocks kept as blocks);
transformers reads the same file through its own GGUF loader (`gguf_file=`), which
dequantizes it. Both see the same values, so greedy 32 tokens on 8 prompts, alone and
batched with chunking and preemption, must be equal under the near-tie rule.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.reference import MAX_NEW_TOKENS, RefCase
from support.tiny_checkpoints import (
    PROMPTS,
    check_alone_and_batched,
    reference_cases,
    write_checkpoint,
)
from support.write_gguf import write_gguf

from nanoserve.model import load
from nanoserve.model.gguf import gguf_architecture, open_gguf, read_gguf_weights
from nanoserve.model.quant import BLOCK_BYTES, QuantProj, QuantWeight

# GGUF architecture -> the tiny checkpoint it is written from (Mistral's shape is a llama
# file in llama.cpp: the converter writes it so).
KINDS = {"llama": "mistral", "qwen2": "qwen2-untied", "qwen3": "qwen3", "gemma3": "gemma3"}
# A Gemma 3 file holds only what transformers' GGUF reader maps; the rest is what llama.cpp
# hard-codes (one global layer in six, local RoPE base 10,000, query_pre_attn_scalar the
# head size, no RoPE scaling), so the checkpoint is made so. Its window is shorter than the
# prompts: the windowed layers slide.
OVERRIDES = {"gemma3": {"num_hidden_layers": 6, "head_dim": 256, "sliding_window": 16,
                        "layer_types": None, "rope_local_base_freq": 10000.0,
                        "query_pre_attn_scalar": 256, "rope_scaling": None}}


# Each architecture once (a file's setup costs transformers' GGUF reading twice), F32 and
# Q8_0 both covered: F32 tensors become float32 projections, Q8_0 stay blocks.
@pytest.fixture(scope="module", params=[("llama", "F32"), ("qwen2", "Q8_0"), ("qwen3", "Q8_0"),
                                        ("gemma3", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              smollm2_folder: Path) -> tuple[str, str, Path, list[RefCase]]:
    import transformers

    arch, quant = request.param
    folder = tmp_path_factory.mktemp(f"{arch}-{quant}")
    hf = write_checkpoint(KINDS[arch], folder, smollm2_folder, OVERRIDES.get(arch))
    tensors = dict(hf.state_dict())
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    path = write_gguf(folder / f"tiny-{arch}.gguf", arch, hf.config, tensors, quant)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=path.name, dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as mp:  # the conversion's cache, not the user's
        mp.setattr("nanoserve.model.loader.cache_root", lambda _=None: folder / "cache")
        _, tok = load(str(path))
        cases = reference_cases(arch, ref, tok)
    return arch, quant, path, cases


def test_greedy_from_the_gguf_matches_transformers_reading_it(
        gguf_file: tuple[str, str, Path, list[RefCase]], monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, quant, path, cases = gguf_file
    monkeypatch.setattr("nanoserve.model.loader.cache_root",
                        lambda _=None: path.parent / "cache")
    model, tok = load(str(path))
    assert model.config.architecture == arch
    assert isinstance(model.layers[0].qkv, QuantProj) == (quant == "Q8_0")
    compared = check_alone_and_batched(model, tok, cases)
    assert compared >= 0.75 * len(PROMPTS) * MAX_NEW_TOKENS, compared


def test_block_formats_without_a_kernel_run_as_float32_copies_with_a_warning(
        tmp_path: Path, smollm2_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf = write_checkpoint("qwen2-tied", tmp_path, smollm2_folder)
    tensors = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    # MXFP4 (gpt-oss's): gguf-py reads it, nanoserve has no kernel for it
    path = write_gguf(tmp_path / "mx.gguf", "qwen2", hf.config, tensors, "MXFP4")
    with caplog.at_level(logging.WARNING, logger="nanoserve.model.loader"):
        weights = read_gguf_weights(path, keep=frozenset(BLOCK_BYTES))
    assert not any(isinstance(w, QuantWeight) for w in weights.values())
    # the embedding and 7 matrices in each of 2 layers
    assert ("mx.gguf: 15 mxfp4 tensor(s) have no kernel here: dequantized to float32 at load"
            in caplog.text)


def test_a_tensor_type_nothing_here_reads_is_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "i8.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "i8.gguf"
    with pytest.raises(ValueError, match=r"i8\.gguf: tensor type\(s\) I8 cannot be read"):
        gguf_architecture(open_gguf(path), path)
