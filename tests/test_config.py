"""Settings that can never work: one line naming what to change, exit 2, before anything runs.

`nanoserve serve --model stub --num-blocks 256` used to bind its port, log "listening", then
die with a 40-line ExceptionGroup and exit 1 once the engine refused the pool. The check
was right and the delivery was not: the command lines now judge a configuration against the
model's metadata first (`EngineConfig.layout`, `nanoserve.model.kv_geometry`), and print
one line. The library raises the same message as ConfigError, with Python's names.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanoserve import LLM
from nanoserve.config import ConfigError, EngineConfig, KVLayout
from nanoserve.model import kv_geometry
from nanoserve.model.loader import load_model_config, resolve_model

POOL = ("the KV pool (num_blocks 128 x block_size 16 = 2048 tokens) cannot hold one sequence "
        "of max_model_len 8192 (the model's context): raise num_blocks or kv_cache_memory, or "
        "lower max_model_len")


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.parametrize(("argv", "line"), [
    # (a pool of 4,096 tokens or more would serve what it holds: EngineConfig.layout)
    (["-m", "nanoserve.cli", "serve", "--model", "stub", "--num-blocks", "128", "--port", "0"],
     "nanoserve serve: error: the KV pool (--num-blocks 128 x --block-size 16 = 2048 tokens) "
     "cannot hold one sequence of --max-model-len 8192 (the model's context): raise "
     "--num-blocks or --kv-cache-memory, or lower --max-model-len"),
    # SmolLM2: judged from the GGUF's metadata, 30 layers x 3 KV heads x 64 x K,V x 4 bytes.
    (["-m", "nanoserve.cli", "serve", "--kv-cache-memory", "10MiB", "--port", "0"],
     "nanoserve serve: error: the KV pool (--kv-cache-memory 10485760 B / 737280 B a block = "
     "14 blocks x --block-size 16 = 224 tokens) cannot hold one sequence of --max-model-len "
     "8192 (the model's context): raise --num-blocks or --kv-cache-memory, or lower "
     "--max-model-len"),
    (["-m", "nanoserve.cli", "serve", "--model", "stub", "--max-model-len", "9000", "--port", "0"],
     "nanoserve serve: error: --max-model-len 9000 exceeds the model's context of 8192 "
     "tokens: lower --max-model-len"),
    (["-m", "nanoserve.cli", "serve", "--model", "/no/such.gguf", "--port", "0"],
     "nanoserve serve: error: --model /no/such.gguf: model '/no/such.gguf' is none of "
     "'smollm2', 'gemma3-270m' (embedded), a .gguf file, or a folder with config.json, "
     "*.safetensors and tokenizer.json"),
    (["-m", "nanoserve.cli", "bench", "--model", "stub", "--max-num-seqs", "0"],
     "nanoserve bench: error: argument --max-num-seqs: must be an integer >= 1, got 0"),
    (["-m", "sim.commands", "capacity", "--load", "n=4,prompt=fixed:8,output=fixed:4",
      "--cost", "sim/costs/smollm2-cpu.json", "--engine", "num_blocks=4", "max_model_len=128"],
     "sim capacity: the KV pool (num_blocks 4 x block_size 16 = 64 tokens) cannot hold one "
     "sequence of max_model_len 128: raise num_blocks or kv_cache_memory, or lower "
     "max_model_len"),
])
def test_a_configuration_that_cannot_work_is_one_line_and_exit_2(
    argv: list[str], line: str
) -> None:
    got = run_cli(*argv)
    assert got.returncode == 2
    assert got.stderr == line + "\n"  # one line: no traceback, no "listening" log before it
    assert got.stdout == ""


def test_the_library_raises_the_same_text_with_python_names() -> None:
    with pytest.raises(ConfigError) as info:
        LLM("stub", num_blocks=128)
    assert str(info.value) == POOL


def test_layout_is_the_engines_own_check() -> None:
    cfg = EngineConfig(num_blocks=128)
    assert cfg.layout(2048, 0) == KVLayout(num_blocks=128, max_model_len=2048)
    with pytest.raises(ConfigError) as info:
        cfg.layout(8192, 0)
    assert str(info.value) == POOL
    assert EngineConfig(kv_cache_memory=1 << 20).layout(64, 4096).num_blocks == 256
    assert EngineConfig().layout(64, 0).num_blocks == EngineConfig().stub_num_blocks


def test_kv_geometry_reads_the_gguf_as_the_loaded_model_sees_it() -> None:
    # Read from the GGUF's metadata without converting it, and equal to the converted config.
    context, per_token = kv_geometry("smollm2")
    c = load_model_config(resolve_model("smollm2"))
    assert (context, per_token) == (c.max_position_embeddings, c.kv_bytes_per_token(4))
    assert kv_geometry("smollm2", "bfloat16") == (context, per_token // 2)
    assert kv_geometry("stub") == (8192, 0)


@pytest.mark.parametrize(("isa", "line"), [
    ("avx9", "nanoserve bench: error: NANOSERVE_ISA must be one of avx512, avx2, generic, "
             "got 'avx9'"),
])
def test_a_bad_nanoserve_isa_is_one_line_and_exit_2(isa: str, line: str) -> None:
    import os

    got = subprocess.run([sys.executable, "-m", "nanoserve.cli", "bench", "--model", "stub"],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "NANOSERVE_ISA": isa})
    assert got.returncode == 2
    assert got.stderr == line + "\n"
    assert got.stdout == ""


def test_an_unset_max_model_len_longer_than_the_pool_is_cut_to_it(
        caplog: pytest.LogCaptureFixture) -> None:
    # Gemma 3 270M: 32,768 tokens of context, 589,824 B of KV a 16-token block; the default
    # 1 GiB pool holds 1,820 blocks
    with caplog.at_level("WARNING", logger="nanoserve.config"):
        assert EngineConfig().layout(32768, 589824) == KVLayout(1820, 29120)
    assert ("the model's context of 32768 tokens is more than the KV pool holds; serving "
            "29120") in caplog.text
    with pytest.raises(ConfigError, match="cannot hold one sequence of max_model_len 32768:"):
        EngineConfig(max_model_len=32768).layout(32768, 589824)  # asked for: refused
    with pytest.raises(ConfigError, match=r"= 4080 tokens\) cannot hold"):  # under 4,096
        EngineConfig(num_blocks=255).layout(32768, 589824)
