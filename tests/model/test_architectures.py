"""Token identity with transformers for each architecture beside Llama 2's, on tiny
random-weight checkpoints from a Hugging Face folder (tests/support/tiny_checkpoints.py).

Each is saved with `save_pretrained` (safetensors) beside SmolLM2's tokenizer, loaded by
nanoserve's own `load`, and decoded greedily for 32 tokens on 8 prompts, alone and all in
one batch with chunked prefill and preemption; each must equal transformers' greedy run
under the reference test's near-tie rule (tests/support/reference.py), with most positions
compared rather than excused, and prompt logprobs within 1e-4 of transformers'.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.reference import MAX_NEW_TOKENS, RefCase
from support.tiny_checkpoints import (
    CASES,
    PROMPTS,
    SHAPE,
    check_alone_and_batched,
    prompt_logprobs,
    reference_cases,
    write_checkpoint,
)

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import load
from nanoserve.model.architectures import model_config, text_weights


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               smollm2_folder: Path) -> tuple[str, Path, list[RefCase]]:
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    hf = write_checkpoint(kind, folder, smollm2_folder)
    _, tok = load(str(folder))
    return kind, folder, reference_cases(kind, hf, tok)


def test_greedy_alone_and_batched_match_transformers(
        checkpoint: tuple[str, Path, list[RefCase]]) -> None:
    kind, folder, cases = checkpoint
    model, tok = load(str(folder))
    assert model.config.architecture == kind.split("-")[0].replace("llama3", "llama")
    compared = check_alone_and_batched(model, tok, cases)
    # most of the 8 x 32 positions are compared, not excused as near ties
    assert compared >= 0.75 * len(PROMPTS) * MAX_NEW_TOKENS, compared


def test_prompt_logprobs_match_transformers(
        checkpoint: tuple[str, Path, list[RefCase]]) -> None:
    import transformers

    _, folder, cases = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, tok = load(str(folder))
    engine = Engine(model, tok, EngineConfig(block_size=16, num_blocks=64, max_model_len=512))
    ids = list(cases[6].prompt_ids)  # the longest prompt
    got = prompt_logprobs(engine, ids)
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
                                         r"runs llama, mistral, qwen2, qwen3, gemma3"):
        model_config({**SHAPE, "model_type": "gpt2"}, "x")


def test_a_mistral_window_is_on_every_layer_and_caps_nothing() -> None:
    c = model_config({**SHAPE, "model_type": "mistral", "sliding_window": 128,
                      "layer_types": ["full_attention"] * 2}, "x")  # (ignored, as there)
    assert (c.max_position_embeddings, c.sliding_window, c.window_layers) == (512, 128, (0, 1))
    assert not c.plain_llama  # tensor parallelism's shards take no window
    # a window as long as the context never binds: no window, plain Llama
    long = model_config({**SHAPE, "model_type": "mistral", "sliding_window": 512}, "x")
    assert (long.sliding_window, long.window_layers, long.plain_llama) == (None, (), True)


def test_qwen_windows_as_transformers_places_them() -> None:
    qwen2 = {**SHAPE, "model_type": "qwen2", "sliding_window": 128}
    off = model_config({**qwen2, "use_sliding_window": False}, "x")
    assert (off.max_position_embeddings, off.sliding_window, off.window_layers) == (512, None,
                                                                                    ())
    assert off.qkv_bias
    # the layers from max_window_layers on (transformers' default 28: none of these two)
    on = {**qwen2, "use_sliding_window": True}
    assert model_config({**on, "max_window_layers": 1}, "x").window_layers == (1,)
    assert model_config(on, "x").sliding_window is None
    # or the config's own layer_types
    assert model_config({**on, "model_type": "qwen3", "layer_types": [
        "sliding_attention", "full_attention"]}, "x").window_layers == (0,)


GEMMA3 = {**SHAPE, "model_type": "gemma3_text", "query_pre_attn_scalar": 24,
          "layer_types": ["sliding_attention", "full_attention"]}


def test_a_gemma3_window_is_on_its_sliding_layers() -> None:
    c = model_config({**GEMMA3, "sliding_window": 128}, "x")
    assert c.max_position_embeddings == 512
    assert (c.sliding_window, c.window_layers) == (128, (0,))
    assert not c.plain_llama  # tensor parallelism refuses it
    assert c.local_layers == (0,)
    assert c.attention_scale == 24**-0.5
    # no sliding layer: no window
    none = model_config({**GEMMA3, "sliding_window": 128, "layer_types": ["full_attention"]},
                        "x")
    assert (none.sliding_window, none.window_layers) == (None, ())


def test_gemma3_configs_as_transformers_writes_them() -> None:
    # transformers 5: one rope_parameters entry per layer type
    c = model_config({**GEMMA3, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}},
        "x")
    assert (c.rope_theta, c.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert c.rope_linear_factor == 8.0
    # the text part of an image-text config, with Gemma3TextConfig's defaults for the rest
    # (every sixth layer global) and the top level's eos
    mm = model_config({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 12,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}, "x")
    assert (mm.rope_theta, mm.local_rope_theta, mm.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert (mm.hidden_size, mm.head_dim, mm.vocab_size) == (2560, 256, 262208)
    assert mm.local_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert mm.eos_token_ids == (1, 106)
    assert mm.max_position_embeddings == 131072  # the window (1024) caps nothing
    assert (mm.sliding_window, mm.window_layers) == (1024, mm.local_layers)
    with pytest.raises(ValueError, match=r"^x: gemma3 runs with gelu_pytorch_tanh, without "
                       r"softcapping or bidirectional attention; this config has "
                       r"final_logit_softcapping 30.0$"):
        model_config({**GEMMA3, "final_logit_softcapping": 30.0}, "x")


def test_an_image_text_checkpoint_keeps_its_language_model() -> None:
    t = torch.zeros(1)
    got = text_weights({"language_model.model.norm.weight": t,
                        "model.language_model.layers.0.mlp.up_proj.weight": t,
                        "vision_tower.x.weight": t, "multi_modal_projector.y": t})
    assert sorted(got) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    plain = {"model.norm.weight": t}
    assert text_weights(plain) is plain


def test_tensor_parallelism_refuses_what_it_does_not_shard() -> None:
    from nanoserve.model.parallel.shard import check_tp_size

    qwen3 = model_config({**SHAPE, "model_type": "qwen3"}, "x")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: qwen3's departures from "
                                         r"Llama .* are not sharded; this model runs at 1"):
        check_tp_size(qwen3, 2)
    check_tp_size(qwen3, 1)
    check_tp_size(model_config({**SHAPE, "model_type": "mistral"}, "x"), 2)
