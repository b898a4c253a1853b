"""Models by hub id (model/hub.py): resolved from a Hugging Face cache that the tests lay out
in tmp_path, offline (no test touches the network).

The cache is written in huggingface_hub's documented layout (models--org--name/{blobs,
snapshots/<commit>, refs/<branch>}), and `_cache_repo` proves each one is huggingface_hub's
own by asking the library: `scan_cache_dir` finds it whole and `snapshot_download(...,
local_files_only=True)` returns its snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

from nanoserve import cli
from nanoserve.model import loader
from nanoserve.model.hub import HubError, HubId, hub_name, parse_hub_id
from nanoserve.model.loader import gguf_path, load_model_config, peek_config, resolve_model
from nanoserve.model.weights import llama_weights

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
# A tiny Llama: two heads of 8, one layer, a vocabulary of 32.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
          "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _tiny_llama(folder: Path, config: dict[str, object] = CONFIG) -> Path:
    """A Hugging Face Llama folder of random weights (and a stand-in tokenizer: the loader
    copies tokenizer files, it does not read them)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}')
    (folder / "tokenizer_config.json").write_text("{}")
    gen = torch.Generator().manual_seed(0)
    h, kv, inter, vocab = 16, 8, 32, 32

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    p = "model.layers.0."
    save_file({"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": w(h),
               "lm_head.weight": w(vocab, h), p + "input_layernorm.weight": w(h),
               p + "post_attention_layernorm.weight": w(h),
               p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
               p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
               p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
               p + "mlp.down_proj.weight": w(h, inter)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _cache_repo(cache: Path, repo: str, files: dict[str, bytes], commit: str = COMMIT_A,
                refs: tuple[str, ...] = ("main",)) -> Path:
    """`files` as commit `commit` of model repo `repo` in the Hugging Face cache `cache`, with
    `refs` pointing at it: each file a blob named by its hash, linked from the snapshot."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    # The proof that this is huggingface_hub's layout: the library itself reads it back.
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    assert commit in {r.commit_hash for c in info.repos if c.repo_id == repo for r in c.revisions}
    found = huggingface_hub.snapshot_download(repo, revision=refs[0] if refs else commit,
                                              cache_dir=cache, local_files_only=True)
    assert Path(found) == snapshot.resolve()
    return snapshot


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_CACHE=tmp_path/hub and HF_HUB_OFFLINE=1, as huggingface_hub reads them (into its
    constants, at import: the subprocess test below sets the environment itself)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_what_the_same_folder_loads(tmp_path: Path, hf_cache: Path) -> None:
    folder = _tiny_llama(tmp_path / "tiny")
    files = _folder_files(folder)
    snapshot = _cache_repo(hf_cache, "org/tiny", {**files, "pytorch_model.bin": b"unused"})

    resolved = resolve_model("org/tiny")
    assert resolved == snapshot.resolve()
    assert {n: (resolved / n).read_bytes() for n in files} == files
    assert load_model_config(resolved) == load_model_config(folder)
    assert peek_config("org/tiny") == peek_config(str(folder))
    assert gguf_path("org/tiny") is None  # a folder: no GGUF blocks to keep
    by_id, weights_by_id = llama_weights("org/tiny", device="cpu", dtype="float32",
                                         quantization="none")
    by_path, weights_by_path = llama_weights(str(folder), device="cpu", dtype="float32",
                                             quantization="none")
    assert by_id == by_path
    assert weights_by_id.keys() == weights_by_path.keys()
    for name, tensor in weights_by_path.items():
        torch.testing.assert_close(weights_by_id[name], tensor, rtol=0, atol=0)


GGUFS = {"tiny-Q4_K_M.gguf": b"q4km", "tiny-Q8_0.gguf": b"q8", "tiny-q4_k_s.gguf": b"q4ks",
         "README.md": b"# tiny"}


@pytest.mark.parametrize(("name", "picked"), [
    ("org/tiny-GGUF:Q4_K_M", "tiny-Q4_K_M.gguf"),
    ("org/tiny-GGUF:q8_0", "tiny-Q8_0.gguf"),  # case-insensitive, as llama.cpp's -hf
    ("org/tiny-GGUF:Q4_K_S", "tiny-q4_k_s.gguf"),
    ("org/tiny-GGUF", "tiny-Q4_K_M.gguf"),  # no tag: llama.cpp's default, Q4_K_M
    ("org/tiny-GGUF:tiny-Q8_0.gguf", "tiny-Q8_0.gguf"),  # --gguf-file's form
])
def test_a_quant_tag_picks_its_gguf(hf_cache: Path, name: str, picked: str) -> None:
    snapshot = _cache_repo(hf_cache, "org/tiny-GGUF", GGUFS)
    assert gguf_path(name) == snapshot.resolve() / picked
    assert (gguf_path(name) or Path()).read_bytes() == GGUFS[picked]


@pytest.mark.parametrize(("tag", "listed"), [
    ("Q4_K", "tiny-Q4_K_M.gguf, tiny-q4_k_s.gguf)"),  # two hold it
    ("Q5_K_M", "tiny-Q4_K_M.gguf, tiny-Q8_0.gguf, tiny-q4_k_s.gguf)"),  # none does
])
def test_an_ambiguous_or_absent_tag_lists_the_candidates(hf_cache: Path, tag: str,
                                                         listed: str) -> None:
    _cache_repo(hf_cache, "org/tiny-GGUF", GGUFS)
    with pytest.raises(HubError) as err:
        resolve_model(f"org/tiny-GGUF:{tag}")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"model org/tiny-GGUF:{tag}: ")
    assert str(err.value).endswith(f"({listed}")


def test_the_picked_gguf_is_converted_as_a_local_one_is(
    tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _cache_repo(hf_cache, "org/tiny-GGUF", GGUFS)
    converted: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf",
                        lambda src, out, *, sha256: converted.append(src))
    folder = resolve_model("org/tiny-GGUF:Q8_0", cache_dir=tmp_path / "nanoserve")
    assert converted == [snapshot.resolve() / "tiny-Q8_0.gguf"]
    assert folder.name.startswith(loader.file_sha256(converted[0])[:16])


def test_a_revision_resolves_to_its_snapshot(tmp_path: Path, hf_cache: Path) -> None:
    old = _folder_files(_tiny_llama(tmp_path / "old"))
    new = _folder_files(_tiny_llama(tmp_path / "new", {**CONFIG, "max_position_embeddings": 128}))
    _cache_repo(hf_cache, "org/tiny", old, COMMIT_A, refs=("main",))
    _cache_repo(hf_cache, "org/tiny", new, COMMIT_B, refs=("v2",))
    assert peek_config("org/tiny").max_position_embeddings == 64
    assert peek_config("org/tiny@v2").max_position_embeddings == 128
    assert peek_config(f"org/tiny@{COMMIT_B}").max_position_embeddings == 128  # a commit
    assert resolve_model(hub_name("org/tiny", "v2", None)).name == COMMIT_B  # --revision v2
    with pytest.raises(HubError, match=r"^model org/tiny@v3 is not in the Hugging Face cache"):
        resolve_model("org/tiny@v3")


def test_a_missing_model_offline_is_one_line_naming_it_and_the_cache(hf_cache: Path) -> None:
    with pytest.raises(HubError) as err:
        resolve_model("org/missing")
    assert str(err.value) == (f"model org/missing is not in the Hugging Face cache "
                              f"{hf_cache.resolve()} and HF_HUB_OFFLINE is set")


def test_the_cli_refuses_a_missing_model_offline_in_one_line(tmp_path: Path) -> None:
    # A process of its own: huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE at import.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "nanoserve.cli", "generate", "hi", "--model",
                          "org/missing", "--revision", "v1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr == (f"nanoserve generate: error: --model org/missing@v1: model "
                          f"org/missing@v1 is not in the Hugging Face cache {tmp_path.resolve()} "
                          "and HF_HUB_OFFLINE is set\n")


def test_the_online_path_fetches_only_the_files_a_folder_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Hub stood in for: its listing, and a snapshot_download that records what it is asked.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    listing = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin",
               "tiny.Q4_K_M.gguf"]
    info = huggingface_hub.hf_api.ModelInfo(
        id="org/online", siblings=[{"rfilename": name} for name in listing])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, repo, *, revision: info)
    asked: list[dict[str, object]] = []

    def snapshot_download(repo: str, **kwargs: object) -> str:
        asked.append({"repo": repo, **kwargs})
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert loader.resolve(HubId("org/online", "v1", None)) == tmp_path
    (patterns,) = [a["allow_patterns"] for a in asked]
    assert isinstance(patterns, list)
    assert {"*.safetensors", "config.json", "tokenizer.json"} <= set(patterns)
    assert not [p for p in patterns if p.endswith((".bin", ".gguf", "*"))]  # no other weights
    assert (asked[0]["revision"], asked[0]["local_files_only"]) == ("v1", False)


@pytest.mark.parametrize(("name", "is_hub"), [
    ("org/name", True), ("org/name:Q4_K_M", True), ("org/name@v2:x.gguf", True),
    ("smollm2", False), ("/abs/path", False), ("a/b/c", False), ("./rel", False),
    ("model.gguf", False), ("~/x", False),
])
def test_what_reads_as_a_hub_id(name: str, is_hub: bool) -> None:
    assert (parse_hub_id(name) is not None) == is_hub


def test_a_local_folder_named_like_a_hub_id_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id("org/name") is None


def test_the_flags_fold_into_the_hub_id() -> None:
    assert hub_name("org/x", "v2", "f.gguf") == "org/x@v2:f.gguf"
    assert hub_name("org/x@v2", "v2", None) == "org/x@v2"
    assert hub_name("./local", None, None) == "./local"
    with pytest.raises(ValueError, match="--revision applies to a Hugging Face hub id"):
        hub_name("smollm2", "v2", None)
    with pytest.raises(ValueError, match="name two revisions"):
        hub_name("org/x@v1", "v2", None)


def test_the_cli_keeps_the_served_name_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str | None]] = []

    def run(a: object) -> int:
        seen.append((getattr(a, "model", ""), getattr(a, "served_model_name", None)))
        return 0

    monkeypatch.setattr("nanoserve.server.main.run", run)
    assert cli.main(["serve", "--model", "org/x", "--revision", "v2"]) == 0
    assert seen == [("org/x@v2", "org/x")]


def test_an_unreachable_hub_falls_back_to_the_cache(
    tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No network without HF_HUB_OFFLINE: the Hub's address refuses (port 9, discard), so the
    # listing fails at once, and the cache answers as huggingface_hub's own downloads do.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    snapshot = _cache_repo(hf_cache, "org/tiny", _folder_files(_tiny_llama(tmp_path / "t")))
    assert resolve_model("org/tiny") == snapshot.resolve()
    with pytest.raises(HubError) as err:
        resolve_model("org/missing")
    assert str(err.value).startswith(f"model org/missing is not in the Hugging Face cache "
                                     f"{hf_cache.resolve()} and the Hub could not be reached (")
    assert "\n" not in str(err.value)
