"""Tiny random-weight checkpoints of each architecture, built from transformers' own config
classes (no download), and the greedy reference runs of transformers on them.

Each switches its architecture's quirks on: Llama 3.1's RoPE scaling with an untied head,
Qwen2's q/k/v biases (tied and untied), Qwen3's q/k norms, Mistral's shape, Gemma 3's
norms, gelu, scales and two RoPE bases. The weights are drawn wider than transformers'
initializer (std 0.02 makes every logit nearly equal, and every divergence a near tie);
`check_runs` returns how many positions were compared, not excused, so a test can assert
the comparison had teeth.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from support.reference import MAX_NEW_TOKENS, RefCase, compare_greedy, hf_greedy

SHAPE = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", {"tie_word_embeddings": False, "rope_scaling": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2-untied": ("Qwen2Config", {"tie_word_embeddings": False}),
    # head_dim 128 beside hidden 64 / 4 heads: Qwen3 sets it apart (all its sizes use 128,
    # and transformers' GGUF reader assumes it)
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 128}),
    # a sliding layer and a global one, each with its own RoPE base, the global one scaled
    # linearly (as Gemma 3 4B's and up are); the attention scale set apart from head_dim; a
    # window as long as the context, which never binds (tests/model/test_sliding_window.py
    # runs windows shorter than the prompts)
    "gemma3": ("Gemma3TextConfig", {"query_pre_attn_scalar": 24, "sliding_window": 512,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 100.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land",
           "1, 2, 3, 4, 5,", "Les élèves ont écrit", "日本の首都は",
           "A long prompt that runs over several chunks of the step budget: " * 3,
           "Q: What is 17 times 3?\nA:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def write_checkpoint(kind: str, folder: Path, tokenizer_folder: Path,
                     overrides: dict[str, Any] | None = None, attn: str | None = None) -> Any:
    """The checkpoint `kind` in `folder` (its config's fields `overrides` changed), and its
    transformers model (float32, eval; `attn`: its attention implementation, if not the
    default)."""
    import transformers

    cls_name, extra = CASES[kind]
    config = getattr(transformers, cls_name)(**{**SHAPE, **extra, **(overrides or {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, **({} if attn is None else {"attn_implementation": attn}))
    g = torch.Generator().manual_seed(1)
    # Gemma multiplies its embeddings by sqrt(hidden): drawn that much narrower, its residual
    # stream starts as wide as the others' (wider, a tied head mostly repeats the last token)
    embed_std = 0.3 / config.hidden_size**0.5 if kind == "gemma3" else 0.3
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # matrices and biases, wide enough that greedy picks are rarely near ties
                std = embed_std if name.endswith("embed_tokens.weight") else 0.3
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return model


def reference_cases(kind: str, hf: Any, tok: Tokenizer) -> list[RefCase]:
    """transformers' greedy run of every prompt, as the reference oracle's cases."""
    cases = []
    for i, text in enumerate(PROMPTS):
        ids = tok.encode(text)
        ref = hf_greedy(hf, ids)
        cases.append(RefCase(f"{kind}/{i}", text, tuple(ids), tuple(ref["tokens"]),
                             tuple(ref["margins"]), tuple(tuple(p) for p in ref["top5"])))
    return cases


def check_runs(cases: Sequence[RefCase], got: dict[str, list[int]]) -> int:
    """Assert each run matches; return how many positions were compared before a tie."""
    problems: list[str] = []
    compared = 0
    for case in cases:
        bad, ties = compare_greedy(case, got[case.name])
        problems += bad
        compared += ties[0] if ties else len(case.tokens)
    assert not problems, "\n".join(problems)
    return compared


def run_alone(model: Any, tok: Tokenizer, cases: Sequence[RefCase], config: Any
              ) -> dict[str, list[int]]:
    """Each case's greedy tokens, run one at a time through one engine of `config`."""
    from nanoserve.engine.engine import Engine
    from support.drain import drain, tokens

    engine = Engine(model, tok, config)
    got: dict[str, list[int]] = {}
    for case in cases:
        engine.add_request(list(case.prompt_ids), GREEDY, case.name)
        got |= tokens(drain(engine))
    return got


def prompt_logprobs(engine: Any, ids: list[int]) -> list[Any]:
    """The engine's prompt logprobs of `ids` (one request, one output token)."""
    from support.drain import drain

    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       "p")
    return next(u.prompt_logprobs for r in drain(engine) for u in r.updates
                if u.prompt_logprobs is not None)


def check_alone_and_batched(model: Any, tok: Tokenizer, cases: Sequence[RefCase]) -> int:
    """Run every case alone, then all in one batch with chunked prefill (24 tokens a step)
    and preemption (24 blocks of 8 slots for sequences of ~50 tokens each), each checked
    against the reference; returns the positions compared in the runs alone."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from support.drain import drain, tokens

    compared = check_runs(cases, run_alone(model, tok, cases, EngineConfig(
        block_size=16, num_blocks=64, max_model_len=512, prefix_caching=False)))
    batched = Engine(model, tok, EngineConfig(block_size=8, num_blocks=24, max_model_len=128,
                                              max_num_batched_tokens=24))
    for case in cases:
        batched.add_request(list(case.prompt_ids), GREEDY, case.name)
    check_runs(cases, tokens(drain(batched)))
    assert batched.statistics().preemptions >= 1
    assert batched.pool.num_free == 24
    return compared
