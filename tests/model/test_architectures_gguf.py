"""Token identity with transformers for GGUF files of each architecture nanoserve reads
from GGUF (llama, qwen2, qwen3, gemma3), written with gguf-py as llama.cpp's converter writes
them (tests/support/write_gguf.py), in F32, Q8_0, Q4_K or Q6_K. gguf-py has no K-quant
quantizer: the K-quant blocks are written by tests/support/kquants.py, whose byte layout
test_kquants_writer.py checks against gguf-py's reader.

nanoserve reads the file itself (metadata, tokenizer, tensors: block formats kept as blocks);
transformers reads the same file through its own GGUF loader (`gguf_file=`), which
dequantizes it through gguf-py. Both see the same values, so greedy 32 tokens on 8 prompts,
alone and batched with chunking and preemption, must be equal under the near-tie rule.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
from support.hf_gguf import hf_from_gguf
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
from nanoserve.model.llama import LlamaModel
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
# A K-quant's rows are 256-weight superblocks, and the tiny checkpoints' are 64 or 128 long
# (a writer falls back to Q8_0 for those): the K-quant files are of a wider checkpoint, so
# that every projection's rows, the embedding's and the head's are whole superblocks (hidden
# 256; intermediate 512; H * D 512 for qwen3's head_dim 128, 256 for llama's 4 heads of 64).
K_SHAPE = {"hidden_size": 256, "intermediate_size": 512}
K_OVERRIDES = {"qwen3": K_SHAPE, "llama": {**K_SHAPE, "head_dim": 64}}
# SmolLM2's first 8,192 tokens (support/write_gguf.py cuts its BPE there): a file's reading
# by gguf-py (three times a file: transformers' model and tokenizer, nanoserve's conversion)
# takes 0.4 s where the whole 49,152 took 3, its embedding and head are a sixth as long, and
# a file's setup 3-6 s where it was 22-27 s.
VOCAB = 8192


# Each architecture once (a file's setup costs seconds: transformers' GGUF reading,
# its greedy runs, nanoserve's load), each tensor type on one: F32 tensors become float32
# projections, block formats stay blocks (Q8_0; Q4_K's 6-bit scales and mins; Q6_K's int8
# scales over 6-bit quants). The llama file's q and k rows are permuted as llama.cpp's
# converter writes them. The block-format files decode in the native stack (csrc/stack.cpp:
# qwen2's biases, qwen3's head norms); Gemma's parts of it are held to the layer loop on the
# embedded Gemma 3 270M (test_gemma3_embedded.py).
@pytest.fixture(scope="module", params=[("qwen2", "Q8_0"), ("qwen3", "Q4_K"), ("gemma3", "F32"),
                                        ("llama", "Q6_K")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              smollm2_folder: Path) -> tuple[str, str, Path, list[RefCase]]:
    arch, quant = request.param
    folder = tmp_path_factory.mktemp(f"{arch}-{quant}")
    overrides = {"vocab_size": VOCAB, **OVERRIDES.get(arch, {}),
                 **(K_OVERRIDES[arch] if quant.endswith("_K") else {})}
    hf = write_checkpoint(KINDS[arch], folder, smollm2_folder, overrides)
    tensors = dict(hf.state_dict())
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    path = write_gguf(folder / f"tiny-{arch}.gguf", arch, hf.config, tensors, quant)
    ref = hf_from_gguf(path)
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
    assert isinstance(model, LlamaModel)  # every architecture's, on the CPU
    ly = model.layers[0]
    projs = (ly.qkv, ly.o, ly.gate_up, ly.down, model.lm_head)
    if quant == "F32":
        assert not any(isinstance(p, QuantProj) for p in projs)
    else:  # every matrix kept in the file's own blocks (none fell back to Q8_0)
        fmt = quant.lower()
        assert [p.weight.format for p in projs if isinstance(p, QuantProj)] == [fmt] * 5
        assert model.embed_q is not None
        assert model.embed_q.format == fmt
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
