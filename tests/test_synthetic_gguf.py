"""scripts/make_synthetic_gguf.py on a tiny shape: the file it writes is a Llama GGUF that
gguf-py and nanoserve's own reader take, with every tensor where llama.cpp looks for it and
SmolLM2's tokenizer fields, so the big ones (minutes to write) load as this one does. Run in
F16 only: `--quantize` needs the llama.cpp build (minutes), which the bench itself checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest

from nanoserve.model.gguf import gguf_architecture, hf_config, open_gguf, read_gguf_weights

SCRIPT = Path(__file__).parent.parent / "scripts" / "make_synthetic_gguf.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_synthetic_gguf_reads_back_as_its_shape(script: ModuleType,
                                                       tmp_path: Path) -> None:
    shape = script.Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=256)
    path = script.write_synthetic(tmp_path / "tiny.gguf", shape, name="tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # the .tmp renamed

    reader = open_gguf(path)  # the header, checked whole by nanoserve
    assert gguf_architecture(reader, path) == "llama"
    tensors = {t.name: t for t in reader.tensors}
    # GGUF lists dimensions innermost first: numpy's [rows, columns] reversed
    assert {n: tuple(int(d) for d in t.shape[::-1]) for n, t in tensors.items()} == dict(
        shape.tensors())
    assert len(tensors) == 3 + 9 * 2
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.all(t.data == 1)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            assert 0.015 < float(np.std(t.data.astype(np.float32))) < 0.025
    # SmolLM2's tokenizer, every field (one read of its GGUF, cached by the script)
    copied = {key: value for key, value, _, _ in script._tokenizer_fields()}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
            "tokenizer.ggml.eos_token_id"} <= copied.keys()
    assert len(copied["tokenizer.ggml.tokens"]) == 49152
    for key, value in copied.items():
        assert reader.metadata[key] == value, key

    config = hf_config(reader, vocab_size=49152, hidden_size=64, tied=False)
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["head_dim"],
            config["eos_token_id"]) == (2, 4, 2, 256, 16, 2)
    weights = read_gguf_weights(path, keep=frozenset())
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == (64, 256)
    assert weights["lm_head.weight"].shape == (49152, 64)


def test_a_tied_shape_has_no_output_head(script: ModuleType) -> None:
    untied = script.Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=256)
    tied = untied._replace(tied=True)
    assert [n for n, _ in untied.tensors() if n not in dict(tied.tensors())] == [
        "output.weight"]
    assert untied.parameters() - tied.parameters() == 49152 * 64


def test_the_named_sizes_are_about_what_they_say(script: ModuleType) -> None:
    for name, billions in (("0.5b", 0.5), ("1b", 1.0), ("3b", 3.0)):
        shape = script.SIZES[name]
        assert 0.9 * billions < shape.parameters() / 1e9 < 1.2 * billions, name
        assert shape.ffn % 256 == 0  # every row whole K-quant superblocks
        assert shape.hidden % 256 == 0


def test_an_unknown_size_or_type_is_refused(script: ModuleType, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["2b"], ["1b", "--quantize", "Q3_X"]):
        with pytest.raises(SystemExit):
            script.main([*argv, "--out-dir", str(tmp_path)])
        assert "not among" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
