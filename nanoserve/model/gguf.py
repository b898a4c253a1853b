"""Reading a GGUF file (llama, qwen2, qwen3 or gemma3): its tensors under Hugging Face names,
its metadata as a Hugging Face config, and its tokenizer.

The one subtle step is the Q/K row order of a llama file. llama.cpp's default RoPE rotates
*adjacent* pairs of a head's dimensions, (2i, 2i+1), by angle pos * theta_i, while the
Hugging Face layout (`rotate_half`) rotates the pair (i, i + d/2) by that same angle.
llama.cpp's converter therefore permutes the rows of each head's Q and K projection so that
GGUF row 2i is HF row i and GGUF row 2i+1 is HF row i + d/2: per head, the d rows are
viewed as [2, d/2] and transposed to [d/2, 2]. We undo it by viewing them as [d/2, 2] and
transposing back. Only Q and K are permuted (V and O do not see RoPE), and K uses the KV
head count. Qwen and Gemma files are not permuted: llama.cpp runs their RoPE in the Hugging Face
(NEOX) pairing.

Gemma 3 files differ in two more ways. llama.cpp's converter stores each RMSNorm weight
as 1 + w (Gemma scales by 1 + w; ggml's norm by w), so the reader takes the 1 away again,
in float32, as transformers' GGUF loader does; the model adds it back at load
(model/placement.py), the same two roundings transformers makes. And the file leaves out
what llama.cpp hard-codes for the architecture: the local RoPE base (10,000), one global
layer in six, and query_pre_attn_scalar (the head size; n_embd / n_head for the 27B, the
one size with 62 layers).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.model.gguf_file import GGUFFile, read_gguf

log = logging.getLogger("nanoserve.model.loader")

# The GGUF architectures nanoserve reads (general.architecture); each is its own metadata
# key prefix and model_type.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# GGUF per-layer tensor name -> Hugging Face Llama name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's four norms a layer: its ffn_norm is the MLP's input norm, and two more follow
# the attention and the MLP.
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def open_gguf(path: Path) -> GGUFFile:
    """The file's header (gguf_file.py), or a ValueError that says the file is not a whole
    GGUF (a download cut short, a file of another kind)."""
    try:
        return read_gguf(path)
    except (ValueError, OSError) as exc:  # the reader's checks, a bad enum, no such file
        raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                         ) from None


def gguf_architecture(reader: GGUFFile, where: Path) -> str:
    """The file's architecture, or a ValueError naming those nanoserve reads; and any
    RoPE scaling it declares other than linear, refused (Llama 3.1's comes as a rope_freqs
    tensor)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported; nanoserve "
                         f"reads {', '.join(GGUF_ARCHITECTURES)}")
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear") or any(t.name == "rope_freqs.weight"
                                                      for t in reader.tensors):
        raise ValueError(f"{where}: RoPE scaling {scaling or 'llama3'!r} in a GGUF file is not "
                         "supported (linear is; a Hugging Face folder's llama3 rope_scaling "
                         "is)")
    _check_tensor_types(reader, where)
    return str(arch)


def _check_tensor_types(reader: GGUFFile, where: Path) -> None:
    """Every tensor's type is one nanoserve can read: float, or a block format that gguf-py
    dequantizes (those without a native kernel here run as float32 copies: logged at load)."""
    # gguf-py keeps its dequantizers in this registry (no public list of them)
    from gguf.quants import GGMLQuantizationType, _type_traits

    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if bad:
        raise ValueError(f"{where}: tensor type(s) {', '.join(bad)} cannot be read "
                         "(neither a kernel here nor gguf-py's dequantizers have them)")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row interleave (see the module docstring).

    w: [n_heads * d, in] in GGUF row order -> same shape in Hugging Face row order.
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_weights(gguf: Path, *, keep: frozenset[str]) -> dict[str, Any]:
    """The GGUF's tensors under Hugging Face names, without a float32 copy of those whose
    format is in `keep` (nanoserve.model.quant.BLOCK_BYTES): those come as QuantWeights of
    the file's own blocks (Q/K rows put back in Hugging Face order, which moves whole rows);
    every other tensor is dequantized to float32, exactly as `convert_gguf` does."""
    import torch
    from gguf.quants import dequantize

    from nanoserve.model.quant import FORMATS, QuantWeight

    reader = open_gguf(gguf)
    arch = gguf_architecture(reader, gguf)
    n_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    permuted = arch == "llama"
    out: dict[str, Any] = {}
    copied: dict[str, int] = {}  # block formats with no kernel here: dequantized to float32
    for t in reader.tensors:
        fmt = t.tensor_type.name.lower()
        # (an F16 norm is a vector, and an F16 row of a length no kernel block divides:
        # float32)
        kept = (fmt in keep and len(t.shape) == 2
                and int(t.shape[0]) % FORMATS[fmt].weights == 0)
        if not kept and keep and fmt not in ("f32", "f16", "bf16"):
            copied[fmt] = copied.get(fmt, 0) + 1
        # Kept rows as their bytes [rows, row bytes] (F16 and BF16 rows too), copied out of
        # the file's read-only map; anything else dequantized to [rows, cols].
        w = (np.array(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1) if kept
             else np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        name, kind = hf_name(gguf, t.name, arch)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the converter's 1 + w (module docstring)
        if permuted and kind == "attn_q":
            w = unpermute_rope_rows(w, n_heads)
        elif permuted and kind == "attn_k":
            w = unpermute_rope_rows(w, n_kv)
        tensor = torch.from_numpy(np.ascontiguousarray(w))
        out[name] = QuantWeight(tensor, fmt, int(t.shape[0])) if kept else tensor
    if copied:
        log.warning("%s: %s have no kernel here: dequantized to float32 at load (more memory, "
                    "slower than their blocks would be)", gguf.name,
                    ", ".join(f"{n} {fmt} tensor(s)" for fmt, n in sorted(copied.items())))
    return out


def hf_name(gguf: Path, name: str, arch: str = "llama") -> tuple[str, str | None]:
    """A GGUF tensor name -> (Hugging Face name, the GGUF layer tensor kind or None)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], None
    names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    blk, layer, kind, suffix = name.split(".")
    if blk != "blk" or kind not in names or suffix not in ("weight", "bias"):
        raise ValueError(f"{gguf}: unexpected tensor {name}")
    return f"model.layers.{layer}.{names[kind]}.{suffix}", kind


def hf_config(reader: GGUFFile, *, vocab_size: int, hidden_size: int, tied: bool
              ) -> dict[str, Any]:
    arch = str(gguf_field(reader, "general.architecture"))

    def field(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    n_heads = int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", field("rope.dimension_count",
                                                        hidden_size // n_heads)))
    eos = [int(gguf_field(reader, "tokenizer.ggml.eos_token_id"))]
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    # GGUF stores eps as float32 (9.9999997e-06); its 7 significant digits are all it means.
    eps = float(f"{float(field('attention.layer_norm_rms_epsilon')):.7g}")
    scaling = None
    if field("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(field("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": int(field("context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        layers = cfg["num_hidden_layers"]
        cfg |= {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": field("attention.sliding_window"),
                "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": hidden_size // n_heads if layers == 62 else head_dim}
        del cfg["hidden_act"]
    return cfg


def write_tokenizer(gguf_path: Path, out: Path, *, context_length: int) -> None:
    """transformers' own GGUF tokenizer conversion, run once, so tokenizer.json is exact.

    It reads the file from a folder of its own (a link to it): given the GGUF's folder,
    transformers takes a tokenizer.json beside the file over the file's own vocabulary, and a
    folder of downloads may hold another model's."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="nanoserve-gguf-") as alone:
        link = Path(alone) / gguf_path.name
        try:
            link.symlink_to(gguf_path.resolve())
        except OSError:  # a file system without links: the file itself
            shutil.copyfile(gguf_path, link)
        tok = AutoTokenizer.from_pretrained(alone, gguf_file=link.name)
    tok.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja; we keep a single source of
    # truth in tokenizer_config.json, where older readers look for it.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        cfg["chat_template"] = jinja.read_text()
        jinja.unlink()
    cfg["model_max_length"] = context_length
    for key in ("is_local", "local_files_only"):  # facts about this run, not the tokenizer
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    log.info("tokenizer written")
