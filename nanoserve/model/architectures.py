"""The architectures nanoserve runs, and how a checkpoint's config.json names and shapes one.

Each is the Llama forward (model/llama.py) with a few switches in ModelConfig, as the
families really differ:

- `llama`: Llama 2 and 3.x; Llama 3.1's RoPE scaling (`rope_type: llama3`), tied or untied
  heads.
- `mistral`: Llama-shaped, with a sliding window on every layer (where its config sets one).
- `qwen2` (Qwen2, Qwen2.5): biases on the q, k and v projections.
- `qwen3`: an RMSNorm over each q and k head before RoPE, no biases.
- `gemma3` (`gemma3_text`, and the text part of a `gemma3` image-text config): Qwen3's head
  norms, RMSNorms that scale by (1 + w), a norm on the attention and on the MLP output
  before each residual add, gelu (tanh) on the gate, embeddings times sqrt(hidden), q.k
  scaled by query_pre_attn_scalar ** -0.5, and two RoPE bases: `rope_local_base_freq` on
  the sliding-window layers, `rope_theta` on the global ones.

Sliding windows are real (model/attention.py): on a windowed layer the query at position p
sees the key at j iff j <= p and p - j < window, as in transformers, and the context is
the model's whole max_position_embeddings. Which layers have the window is transformers'
rule: all of Mistral's (its modeling ignores layer_types); Gemma 3's `sliding_attention`
layers; Qwen2/3's only with `use_sliding_window`, then their `sliding_attention` layer_types,
else the layers from `max_window_layers` on.

The architecture is the config's `model_type`, else the first of `architectures` nanoserve
knows; anything else is refused with one message that names what nanoserve runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nanoserve.model.base import ModelConfig, RopeScaling

# model_type -> the transformers class names that mean it
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
}
# model_types that are another's text part under a name of their own
_TEXT_TYPES = {"gemma3_text": "gemma3"}


def architecture_of(cfg: dict[str, Any], where: str) -> str:
    """The architecture a config names, or a ValueError that lists the ones nanoserve has."""
    model_type = cfg.get("model_type")
    names = list(cfg.get("architectures") or [])
    if model_type in _TEXT_TYPES:
        return _TEXT_TYPES[str(model_type)]
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
    if arch == "gemma3":
        cfg = gemma3_text_config(cfg, where)
    act = cfg.get("hidden_act", "silu")
    if act != "silu" and arch != "gemma3":  # (Gemma's is checked with its text config)
        raise ValueError(f"{where}: hidden_act {act!r} is not supported for {arch} (silu is)")
    if cfg.get("mlp_bias") or (arch != "qwen2" and cfg.get("attention_bias")):
        raise ValueError(f"{where}: biases on the o projection or the MLP are not supported")
    # transformers 5 writes `rope_parameters`, older versions `rope_theta` + `rope_scaling`.
    rope = cfg.get("rope_parameters") or {}
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window, window_layers = _sliding_window(arch, cfg, max_pos)
    llama3, linear = _rope_scaling(cfg, where)
    config = ModelConfig(
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
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_scaling=llama3,
        rope_linear_factor=linear,
        sliding_window=window,
        window_layers=window_layers,
    )
    return _with_gemma3(config, cfg) if arch == "gemma3" else config


# Gemma3TextConfig's defaults: an image-text `gemma3` config.json writes only the text
# config's fields that differ from them (Gemma 3 4B: its sizes, RoPE scaling and window).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
    "eos_token_id": 1, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def gemma3_text_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """A Gemma 3 config's text part with every field it leaves to the defaults, and RoPE in
    the older flat names (transformers 5 writes one `rope_parameters` entry per layer type:
    `full_attention` is `rope_theta` and `rope_scaling`, `sliding_attention` the local base)."""
    top = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
           if k in cfg}
    text = {**GEMMA3_TEXT_DEFAULTS, **top, **(cfg.get("text_config") or cfg)}
    bad = [f"{k} {text[k]!r}" for k in ("attn_logit_softcapping", "final_logit_softcapping",
                                        "use_bidirectional_attention") if text.get(k)]
    if text["hidden_activation"] != "gelu_pytorch_tanh":
        bad.append(f"hidden_activation {text['hidden_activation']!r}")
    if bad:  # Gemma 2's softcapping, EmbeddingGemma's bidirectional attention
        raise ValueError(f"{where}: gemma3 runs with gelu_pytorch_tanh, without softcapping or "
                         f"bidirectional attention; this config has {', '.join(bad)}")
    rope = text.pop("rope_parameters", None) or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: RoPE scaling on gemma3's sliding-window layers is not "
                         "supported")
    if full:
        text["rope_theta"] = full.get("rope_theta", text["rope_theta"])
        text["rope_scaling"] = full
    text["rope_local_base_freq"] = local.get("rope_theta", text["rope_local_base_freq"])
    if not text.get("layer_types"):  # older configs: every pattern-th layer is global
        n = int(text["sliding_window_pattern"])
        text["layer_types"] = ["sliding_attention" if (i + 1) % n else "full_attention"
                               for i in range(int(text["num_hidden_layers"]))]
    if "sliding_attention" not in text["layer_types"]:
        text["sliding_window"] = None  # no layer has a window
    return text


def _with_gemma3(config: ModelConfig, text: dict[str, Any]) -> ModelConfig:
    """Gemma 3's switches on (see the module's docstring), from gemma3_text_config's dict."""
    return dataclasses.replace(
        config, norm_plus_one=True, sandwich_norms=True, gelu_mlp=True, embed_scale=True,
        query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
        local_rope_theta=float(text["rope_local_base_freq"]),
        local_layers=tuple(i for i, kind in enumerate(text["layer_types"])
                           if kind == "sliding_attention"))


# Where an image-text checkpoint keeps its language model: Google's Gemma 3 files, and what
# transformers 5 saves
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}


def text_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's tensors under the text model's names: an image-text one's language
    model renamed, its vision tower and projector left out; any other as it is."""
    if not any(k.startswith(tuple(_TEXT_PREFIXES)) for k in weights):
        return weights
    return {new + k[len(old):]: t for k, t in weights.items()
            for old, new in _TEXT_PREFIXES.items() if k.startswith(old)}


def _sliding_window(arch: str, cfg: dict[str, Any], max_pos: int
                    ) -> tuple[int | None, tuple[int, ...]]:
    """(the attention window, the layers it is on), as transformers decides them; (None, ())
    where no layer has one, or where it is no shorter than the context: such a window never
    binds, and leaving it out keeps the model plain Llama (the decode stack, tensor parallelism).

    KV blocks are never freed as a window passes them: Gemma 3's global layers read the
    whole context anyway. A model whose every layer is windowed (Mistral) could free the
    blocks behind every row's window; that is not built."""
    window = cfg.get("sliding_window")
    n = int(cfg["num_hidden_layers"])
    if window is None or arch == "llama" or int(window) >= max_pos:
        return None, ()
    if arch == "mistral":  # one mask for every layer; a layer_types entry is ignored
        return int(window), tuple(range(n))
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        return None, ()  # Qwen configs carry a window that is off unless asked for
    # Gemma 3's layer_types are always filled in (gemma3_text_config); Qwen's default: the
    # layers from max_window_layers on (transformers' Qwen2Config/Qwen3Config).
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
        for i in range(n)]
    layers = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return (int(window), layers) if layers else (None, ())


def _rope_scaling(cfg: dict[str, Any], where: str) -> tuple[RopeScaling | None, float | None]:
    """(Llama 3.1's scaling, the linear factor) the config's RoPE scaling asks for, read in
    one pass over both places transformers writes it; other kinds are refused."""
    for scaling in (cfg.get("rope_scaling") or {}, cfg.get("rope_parameters") or {}):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            continue
        if kind == "linear":  # every frequency divided by the factor
            return None, float(scaling["factor"])
        if kind != "llama3":
            raise ValueError(f"{where}: RoPE scaling {kind!r} is not supported (llama3 and "
                             "linear are)")
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(
                scaling["original_max_position_embeddings"])), None
    return None, None
