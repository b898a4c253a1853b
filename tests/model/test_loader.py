"""GGUF conversion and the model cache: row order for RoPE, config values, atomic reuse."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from nanoserve.model import loader
from nanoserve.model.gguf import unpermute_rope_rows
from nanoserve.model.loader import load_model_config, resolve_model
from nanoserve.model.ops import rotate_half
from nanoserve.tokenizer import Tokenizer


def _interleaved_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's default RoPE: rotate each adjacent pair (2i, 2i+1) by pos * theta^(-2i/d).

    x: [T, H, d], pos: [T]. Written from the definition, independently of the loader.
    """
    d = x.shape[-1]
    angle = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # [T, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _half_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """The Hugging Face layout our model uses: pair (i, i + d/2), via rotate_half."""
    d = x.shape[-1]
    angle = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)
    angle = torch.cat((angle, angle), dim=-1)[:, None, :]  # [T, 1, d]
    return x * angle.cos() + rotate_half(x) * angle.sin()


@pytest.mark.parametrize("n_heads", [1, 3])
def test_unpermuted_qk_give_the_attention_scores_llama_cpp_computes(n_heads: int) -> None:
    # GGUF weights under llama.cpp's interleaved RoPE must score every (query, key) pair
    # exactly as the unpermuted weights do under rotate_half RoPE.
    gen = torch.Generator().manual_seed(0)
    d, hidden, t, theta = 8, 12, 6, 100.0
    wq_gguf = torch.randn(n_heads * d, hidden, generator=gen, dtype=torch.float64)
    wk_gguf = torch.randn(n_heads * d, hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(t, hidden, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 1, 2, 5, 17, 40])

    def scores(wq: torch.Tensor, wk: torch.Tensor, rope: object) -> torch.Tensor:
        assert callable(rope)
        q = rope((x @ wq.T).view(t, n_heads, d), pos, theta)
        k = rope((x @ wk.T).view(t, n_heads, d), pos, theta)
        return torch.einsum("qhd,khd->hqk", q, k)

    want = scores(wq_gguf, wk_gguf, _interleaved_rope)
    wq = torch.from_numpy(unpermute_rope_rows(wq_gguf.numpy(), n_heads))
    wk = torch.from_numpy(unpermute_rope_rows(wk_gguf.numpy(), n_heads))
    torch.testing.assert_close(scores(wq, wk, _half_rope), want, rtol=0, atol=1e-9)
    # Teeth: without the unpermute the scores differ.
    assert not torch.allclose(scores(wq_gguf, wk_gguf, _half_rope), want, atol=1e-3)


def test_a_folder_is_returned_as_is(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_a_folder_missing_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json, \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_an_unknown_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is none of"):
        resolve_model(str(tmp_path / "nope"), cache_dir=tmp_path)


def test_a_concurrent_conversion_that_wins_the_race_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf")
    cache = tmp_path / "cache"
    final = cache / f"{loader.file_sha256(gguf)[:16]}-v{loader._FORMAT_VERSION}"

    def convert_while_another_process_finishes(src: Path, out: Path, *, sha256: str) -> None:
        final.mkdir(parents=True)
        (final / "config.json").write_text("theirs")  # the other process renames first
        (out / "config.json").write_text("ours")

    monkeypatch.setattr(loader, "convert_gguf", convert_while_another_process_finishes)
    assert resolve_model(str(gguf), cache_dir=cache) == final
    assert (final / "config.json").read_text() == "theirs"
    assert [p.name for p in cache.iterdir()] == [final.name]  # our temp dir is gone


def test_a_dead_conversions_temp_dir_is_removed_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf")
    cache = tmp_path / "cache"
    prefix = f".tmp-{loader.file_sha256(gguf)[:16]}-v{loader._FORMAT_VERSION}-"
    dead, live = cache / (prefix + "dead"), cache / (prefix + "live")
    dead.mkdir(parents=True)
    live.mkdir()
    os.utime(dead, (0, 0))  # last touched in 1970: long dead, without reading the clock
    monkeypatch.setattr(loader, "convert_gguf", lambda src, out, *, sha256: None)
    resolve_model(str(gguf), cache_dir=cache)
    assert not dead.exists()
    assert live.exists()


@pytest.mark.real
def test_smollm2_config(smollm2_folder: Path) -> None:
    cfg = load_model_config(smollm2_folder)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.rope_theta == 100000.0
    assert math.isclose(cfg.rms_norm_eps, 1e-5)
    assert cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    tok_cfg = json.loads((smollm2_folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    tok = Tokenizer.from_folder(smollm2_folder)
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>user") == [1, 4093]


@pytest.mark.real
def test_second_resolve_reuses_the_cache_without_rewriting(smollm2_folder: Path) -> None:
    def snapshot() -> dict[str, int]:
        root = smollm2_folder.parent
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}

    before = snapshot()
    assert resolve_model("smollm2") == smollm2_folder
    assert snapshot() == before  # same files, same mtimes, no temp dirs left behind


def test_a_gguf_converts_without_its_float32_weights_until_they_are_needed(
        tmp_path: Path, smollm2_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.tiny_checkpoints import write_checkpoint
    from support.write_gguf import write_gguf

    from nanoserve.model.llama import load_weights

    hf = write_checkpoint("qwen2-tied", tmp_path, smollm2_folder)
    tensors = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    gguf = write_gguf(tmp_path / "tiny.gguf", "qwen2", hf.config, tensors, "Q8_0")
    # (the tokenizer's conversion is tested elsewhere and takes most of a conversion's time)
    monkeypatch.setattr(loader, "write_tokenizer", lambda *_, **__: None)
    folder = resolve_model(str(gguf), cache_dir=tmp_path / "cache")
    assert not list(folder.glob("*.safetensors"))  # a server on the file's blocks never needs it
    weights = load_weights(folder)  # --quantization none: written now, once
    assert (folder / "model.safetensors").exists()
    assert set(weights) == set(tensors)
    assert not list(folder.glob(".model.safetensors.*"))  # no temp file left
    (folder / "model.safetensors").unlink()
    gguf.write_bytes(gguf.read_bytes()[:-1] + b"x")  # the file changed under the cache
    with pytest.raises(FileNotFoundError, match="is gone or changed; remove the folder"):
        load_weights(folder)


def test_a_gguf_beside_another_models_tokenizer_json_gets_its_own_tokenizer(
        tmp_path: Path, smollm2_folder: Path) -> None:
    """transformers, given the GGUF's folder, takes a tokenizer.json there over the file's
    own vocabulary (for a llama file; not for qwen2's), and a folder of downloads may hold
    another model's. Here the file's is SmolLM2's first 8,192 tokens (support/write_gguf.py)
    beside SmolLM2's whole 49,152."""
    from support.tiny_checkpoints import write_checkpoint
    from support.write_gguf import write_gguf

    hf = write_checkpoint("mistral", tmp_path, smollm2_folder, {"vocab_size": 8192})
    assert len(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]) == 49152
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama", hf.config, dict(hf.state_dict()), "Q8_0")
    tok = Tokenizer.from_folder(resolve_model(str(gguf), cache_dir=tmp_path / "cache"))
    text = "日本の首都は Tokyo, cherché"
    ids = tok.encode(text)
    assert max(ids) < 8192
    assert tok.decode(ids) == text
    assert tok.encode(" the") == Tokenizer.from_folder(smollm2_folder).encode(" the")
