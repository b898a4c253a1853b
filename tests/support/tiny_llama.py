"""A tiny Llama folder with random weights and SmolLM2's tokenizer, for tests of tensor
parallelism's processes (start-up, heartbeats, exits) rather than of its numbers.

The stub cannot be sharded (it has no weights), and SmolLM2 divides only by 3 and takes
seconds per rank to load on a busy machine; this model loads at once in every rank and
shards at 1, 2, 3 and 6 (6 heads, 6 KV heads, intermediate 96), so a test's start-up is
mostly each rank's interpreter importing torch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
          "hidden_size": 96, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 16,
          "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 512, "tie_word_embeddings": True,
          "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def write_tiny_llama(folder: Path, smollm2_folder: Path) -> Path:
    """Write the model into `folder` (created) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    hidden, inter, d = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["head_dim"])
    heads, kv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(int(c["vocab_size"]), hidden, scale=1.0),
         "model.norm.weight": torch.ones(hidden)}
    for i in range(int(c["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(hidden),
              p + "post_attention_layernorm.weight": torch.ones(hidden),
              p + "self_attn.q_proj.weight": r(heads * d, hidden),
              p + "self_attn.k_proj.weight": r(kv * d, hidden),
              p + "self_attn.v_proj.weight": r(kv * d, hidden),
              p + "self_attn.o_proj.weight": r(hidden, heads * d),
              p + "mlp.gate_proj.weight": r(inter, hidden),
              p + "mlp.up_proj.weight": r(inter, hidden),
              p + "mlp.down_proj.weight": r(hidden, inter)}
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder / name, folder / name)
    return folder
