"""The architectures nanoserve runs, and how a checkpoint's config.json names and shapes one.

Each is the Llama forward (model/llama.py) with a few switches in ModelConfig, as the
families really differ:

- `llama`: Llama 2 and 3.x; Llama 3.1's RoPE scaling (`rope_type: llama3`), tied or untied
  heads.
- `mistral`: Llama-shaped. Its sliding window is honoured by never letting it slide: the
  context is capped at the window, within which every token sees every earlier one (the
  mask's condition, query minus key position below the window, always holds).
- `qwen2` (Qwen2, Qwen2.5): biases on the q, k and v projections.
- `qwen3`: an RMSNorm over each q and k head before RoPE, no biases.

The architecture is the config's `model_type`, else the first of `architectures` nanoserve
knows; anything else is refused with one message that names what nanoserve runs.
"""

from __future__ import annotations

import logging
from typing import Any

from nanoserve.model.base import ModelConfig, RopeScaling

log = logging.getLogger(__name__)

# model_type -> the transformers class names that mean it
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
}


def architecture_of(cfg: dict[str, Any], where: str) -> str:
    """The architecture a config names, or a ValueError that lists the ones nanoserve has."""
    model_type = cfg.get("model_type")
    names = list(cfg.get("architectures") or [])
    if model_type in ARCHITECTURES:
        return str(model_type)
    for arch, classes in ARCHITECTURES.items():
        if any(n in classes for n in names):
            return arch
    if model_type is None and not names:
        return "llama"  # the oldest Llama configs name nothing
    raise ValueError(f"{where}: architecture {model_type or names[0]!r} is not supported; "
                     f"nanoserve runs {', '.join(ARCHITECTURES)}")


def model_config(cfg: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a transformers config.json's fields."""
    arch = architecture_of(cfg, where)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported for {arch} (silu is)")
    if cfg.get("mlp_bias") or (arch != "qwen2" and cfg.get("attention_bias")):
        raise ValueError(f"{where}: biases on the o projection or the MLP are not supported")
    # transformers 5 writes `rope_parameters`, older versions `rope_theta` + `rope_scaling`.
    rope = cfg.get("rope_parameters") or {}
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = _sliding_window(arch, cfg)
    if window is not None and window < max_pos:
        log.info("%s: %s's sliding window of %d tokens never slides here: the context is "
                 "capped at it (max_position_embeddings %d)", where, arch, window, max_pos)
        max_pos = window
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
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        architecture=arch,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_scaling=_rope_scaling(cfg, where),
    )


def _sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    """The attention window, where the config turns one on for any layer (capping the
    context at it is exact whichever layers it is on)."""
    window = cfg.get("sliding_window")
    if window is None or arch == "llama":
        return None
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        return None  # Qwen configs carry a window that is off unless asked for
    return int(window)


def _rope_scaling(cfg: dict[str, Any], where: str) -> RopeScaling | None:
    for scaling in (cfg.get("rope_scaling") or {}, cfg.get("rope_parameters") or {}):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            continue
        if kind != "llama3":
            raise ValueError(f"{where}: RoPE scaling {kind!r} is not supported (llama3 is)")
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(
                scaling["original_max_position_embeddings"]))
    return None
