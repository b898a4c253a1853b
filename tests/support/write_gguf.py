"""A GGUF file written with gguf-py from a Hugging Face checkpoint's tensors, laid out as
llama.cpp's converter lays one out, for tests that read GGUF files of architectures the
embedded model is not: the metadata under the architecture's own key prefix, llama files'
Q/K rows permuted to llama.cpp's RoPE pairing (Qwen and Gemma files are not), Gemma's norms
stored as 1 + w under its own names, and the tokenizer's fields copied from SmolLM2's own
GGUF (a byte-level BPE vocabulary of 49,152 tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quantize

from nanoserve.model.gguf_file import read_gguf
from nanoserve.model.loader import embedded_gguf_path
from support.kquants import QK_K, QUANTIZERS

# Hugging Face per-layer names -> GGUF ones (after "model.layers.{i}." / "blk.{i}.").
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma 3's: the MLP's input norm is its ffn_norm, and a norm after the attention and the MLP
_GEMMA3 = {**_LAYER, "pre_feedforward_layernorm": "ffn_norm",
           "post_attention_layernorm": "post_attention_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                   "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's per-head Q/K row interleave (the inverse of the reader's)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    base, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA3 if arch == 'gemma3' else _LAYER)[base]}.{suffix}"


def write_gguf(path: Path, arch: str, config: Any, tensors: dict[str, torch.Tensor],
               quant: str = "F32") -> Path:
    """Write `tensors` (Hugging Face names, float32) as a GGUF of `arch` ("llama", "qwen2",
    "qwen3", "gemma3"); matrices in `quant` ("F32", a block format gguf-py quantizes:
    "Q8_0", "Q5_0", ..., or a K-quant, "Q4_K", "Q5_K", "Q6_K", by support/kquants.py),
    vectors (norms, biases) in F32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    rope = config.rope_parameters  # Gemma 3's: one entry per layer type
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(config.sliding_window)
    _copy_tokenizer(w, config.vocab_size)
    for name, t in tensors.items():
        a = t.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # llama.cpp's converter stores Gemma's 1 + w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (config.num_attention_heads if "q_proj" in name
                     else config.num_key_value_heads)
            a = permute_rope_rows(a, heads)
        if quant != "F32" and a.ndim == 2:
            blocks, qtype = _quantized(a, quant)
            w.add_tensor(gguf_name(name, arch), blocks, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name, arch), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quantized(a: np.ndarray, quant: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A matrix's blocks in `quant`, and the type they are in. A K-quant's rows are whole
    256-weight superblocks; a matrix whose rows are not is written in Q8_0 instead, as
    llama.cpp's quantizer writes such a tensor in a 32-weight format (Q5_0 for Q4_K, Q5_1
    for Q5_K, Q8_0 for Q6_K)."""
    if quant in QUANTIZERS:
        if a.shape[1] % QK_K == 0:
            return QUANTIZERS[quant](a), gguf.GGMLQuantizationType[quant]
        quant = "Q8_0"
    qtype = gguf.GGMLQuantizationType[quant]
    return quantize(a, qtype), qtype


def _copy_tokenizer(w: gguf.GGUFWriter, vocab_size: int) -> None:
    """SmolLM2's tokenizer fields, its vocabulary cut to the model's first `vocab_size`
    tokens: a BPE tokenizer still, as SmolLM2 numbers each merge's token by its rank (checked
    below), so the first merges make exactly the first tokens; every byte is among them."""
    header = read_gguf(embedded_gguf_path())
    fields = dict(header.metadata)
    tokens, merges = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.merges"]
    first_merged = len(tokens) - len(merges)
    kept = merges[:vocab_size - first_merged]
    assert all(tokens[first_merged + i] == m.replace(" ", "") for i, m in enumerate(kept))
    fields |= {"tokenizer.ggml.tokens": tokens[:vocab_size], "tokenizer.ggml.merges": kept,
               "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][:vocab_size]}
    for key in _TOKENIZER_KEYS:
        vtype, sub = header.types[key]
        w.add_key_value(key, fields[key], vtype, sub_type=sub)
