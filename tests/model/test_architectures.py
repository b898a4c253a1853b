"""Token identity with transformers for each architecture beside Llama 2's, on tiny
random-weight checkpoints built from transformers' own config classes (no download).

Each checkpoint switches its architecture's quirks on: Llama 3.1's RoPE scaling with an
untied head, Qwen2's q/k/v biases (tied and untied), Qwen3's q/k norms, Mistral's shape. It
is saved with `save_pretrained` (safetensors) beside SmolLM2's tokenizer, loaded by
nanoserve's own `load`, and decoded greedily for 32 tokens on 8 prompts, alone and all in
one batch with chunked prefill and preemption; each must equal transformers' greedy run
under the reference test's near-tie rule (tests/support/reference.py), with prompt
logprobs within 1e-4 of transformers' log-softmax.

The weights are drawn wider than transformers' initializer (std 0.02 makes every logit
nearly equal, and every divergence a near tie): the test also asserts that most positions
were compared, not excused.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.drain import drain, tokens
from support.reference import MAX_NEW_TOKENS, RefCase, compare_greedy, hf_greedy

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import load
from nanoserve.model.architectures import model_config
from nanoserve.sampling.params import SamplingParams

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
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land",
           "1, 2, 3, 4, 5,", "Les élèves ont écrit", "日本の首都は",
           "A long prompt that runs over several chunks of the step budget: " * 3,
           "Q: What is 17 times 3?\nA:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _write(kind: str, folder: Path, tokenizer_folder: Path) -> Any:
    """The checkpoint `kind` in `folder`, and its transformers model (float32, eval)."""
    import transformers

    cls_name, extra = CASES[kind]
    config = getattr(transformers, cls_name)(**SHAPE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # matrices and biases, wide enough that greedy picks are rarely near ties
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               smollm2_folder: Path) -> tuple[str, Path, list[RefCase]]:
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    hf = _write(kind, folder, smollm2_folder)
    _, tok = load(str(folder))
    cases = []
    for i, text in enumerate(PROMPTS):
        ids = tok.encode(text)
        ref = hf_greedy(hf, ids)
        cases.append(RefCase(f"{kind}/{i}", text, tuple(ids), tuple(ref["tokens"]),
                             tuple(ref["margins"]), tuple(tuple(p) for p in ref["top5"])))
    return kind, folder, cases


def _check(cases: list[RefCase], got: dict[str, list[int]]) -> int:
    """Assert each run matches; return how many positions were compared before a tie."""
    problems: list[str] = []
    compared = 0
    for case in cases:
        bad, ties = compare_greedy(case, got[case.name])
        problems += bad
        compared += ties[0] if ties else len(case.tokens)
    assert not problems, "\n".join(problems)
    return compared


def test_greedy_alone_and_batched_match_transformers(
        checkpoint: tuple[str, Path, list[RefCase]]) -> None:
    kind, folder, cases = checkpoint
    model, tok = load(str(folder))
    assert model.config.architecture == kind.split("-")[0].replace("llama3", "llama")
    alone = Engine(model, tok, EngineConfig(block_size=16, num_blocks=64, max_model_len=512,
                                            prefix_caching=False))
    got: dict[str, list[int]] = {}
    for case in cases:
        alone.add_request(list(case.prompt_ids), GREEDY, case.name)
        got |= tokens(drain(alone))
    compared = _check(cases, got)
    # most of the 8 x 32 positions are compared, not excused as near ties
    assert compared >= 0.75 * len(cases) * MAX_NEW_TOKENS, compared
    # 24 blocks of 8 slots for 8 sequences that need ~50 tokens each; 24 tokens a step
    batched = Engine(model, tok, EngineConfig(block_size=8, num_blocks=24, max_model_len=128,
                                              max_num_batched_tokens=24))
    for case in cases:
        batched.add_request(list(case.prompt_ids), GREEDY, case.name)
    _check(cases, tokens(drain(batched)))
    assert batched.statistics().preemptions >= 1
    assert batched.pool.num_free == 24


def test_prompt_logprobs_match_transformers(
        checkpoint: tuple[str, Path, list[RefCase]]) -> None:
    _, folder, cases = checkpoint
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, tok = load(str(folder))
    engine = Engine(model, tok, EngineConfig(block_size=16, num_blocks=64, max_model_len=512))
    ids = list(cases[6].prompt_ids)  # the longest prompt
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       "p")
    got = next(u.prompt_logprobs for r in drain(engine) for u in r.updates
               if u.prompt_logprobs is not None)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    assert got[0] is None
    assert len(got) == len(ids)
    diffs = [abs(e.logprob - float(want[i, ids[i + 1]])) for i, e in enumerate(got[1:])
             if e is not None]
    assert len(diffs) == len(ids) - 1
    assert max(diffs) < 1e-4, max(diffs)


def test_unknown_architecture_is_refused_naming_those_there_are() -> None:
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; nanoserve "
                                         r"runs llama, mistral, qwen2, qwen3"):
        model_config({**SHAPE, "model_type": "gpt2"}, "x")


def test_a_mistral_window_caps_the_context() -> None:
    c = model_config({**SHAPE, "model_type": "mistral", "sliding_window": 128}, "x")
    assert c.max_position_embeddings == 128
    off = model_config({**SHAPE, "model_type": "qwen2", "sliding_window": 128,
                        "use_sliding_window": False}, "x")
    assert off.max_position_embeddings == 512
    assert off.qkv_bias


