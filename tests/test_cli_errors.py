"""Every command's bad invocations: one line on stderr naming the flag, exit status 2, and
nothing started (issue 26, item 14).

Each row used to print a traceback (a port past 65535, a host that does not resolve, a
binary trace, an empty prompt range, a device torch does not know) or was accepted silently
(a NaN timeout, a negative queue, a 1 TiB KV pool, a template that does not parse, a seed
past 64 bits). The rows run through each command line's `main(argv)` in this process (the
same code path as the installed scripts, without a torch import per row); a few run as real
subprocesses, where a stray log line or traceback would show. Whatever would do the
command's work (serve, load weights, plan, replay) is replaced by `Reached`, so a check that
is missing fails its row instead of starting a server.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nanoserve import cli as nanoserve_cli
from nanoserve.model.loader import embedded_gguf_path
from sim import commands as sim_cli

MAINS: dict[str, Callable[[list[str]], int]] = {"nanoserve": nanoserve_cli.main,
                                                "sim": sim_cli.main}
# What each command would do once its flags pass: reaching any of these is a failed row.
WORK = ["trio.run", "nanoserve.bench._load", "nanoserve.llm.LLM", "nanoserve.model.load",
        "sim.capacity.capacity_commands.plan_capacity", "sim.capacity.validate.run_validate",
        "sim.replay.replay_command.replay", "sim.commands.write_trace"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
NOT_A_FILE_INLINE = "(a template given inline holds {{ or {%)"
LOAD = "n=4,prompt=fixed:8,output=fixed:8"  # a load spec that passes, so the row's flag is judged


class Reached(Exception):  # noqa: N818  (a row that reaches the work has failed)
    pass


def _serve(*argv: str) -> list[str]:
    return ["serve", "--model", "stub", *argv]


def _bench(*argv: str) -> list[str]:
    return ["bench", "--model", "stub", *argv]


S = "nanoserve serve: error: "
B = "nanoserve bench: error: "
G = "nanoserve generate: error: "
CASES: list[Any] = [
    # serve: argparse's types and ranges
    ("nanoserve", _serve("--port", "70000"),
     S + "argument --port: must be a port number from 0 to 65535, got 70000"),
    ("nanoserve", _serve("--port", "-1"),
     S + "argument --port: must be a port number from 0 to 65535, got -1"),
    ("nanoserve", _serve("--body-timeout", "-1"),
     S + "argument --body-timeout: must be > 0, got -1"),
    ("nanoserve", _serve("--body-timeout", "nan"),
     S + "argument --body-timeout: must be a finite number, got 'nan'"),
    ("nanoserve", _serve("--shutdown-grace", "-0.5"),
     S + "argument --shutdown-grace: must be >= 0, got -0.5"),
    ("nanoserve", _serve("--shutdown-grace", "NaN"),
     S + "argument --shutdown-grace: must be a finite number, got 'NaN'"),
    ("nanoserve", _serve("--max-queue", "-1"),
     S + "argument --max-queue: must be an integer >= 0, got -1"),
    ("nanoserve", _serve("--max-body-bytes", "0"),
     S + "argument --max-body-bytes: must be a size > 0, got '0'"),
    ("nanoserve", _serve("--kv-cache-memory", "0MiB"),
     S + "argument --kv-cache-memory: must be a size > 0, got '0MiB'"),
    ("nanoserve", _serve("--served-model-name", ""),
     S + "argument --served-model-name: must not be empty"),
    ("nanoserve", _serve("--api-key", " "), S + "argument --api-key: must not be empty"),
    ("nanoserve", _serve("--seed", str(INT64_MAX + 1)),
     S + f"argument --seed: must be a seed: an integer from 0 to {INT64_MAX}, "
     f"got {INT64_MAX + 1}"),
    # issue 42: -1 is "random" to llama.cpp; here it would be a fixed seed, silently
    ("nanoserve", _serve("--seed", "-1"),
     S + f"argument --seed: must be a seed: an integer from 0 to {INT64_MAX}, got -1"),
    ("nanoserve", _serve("--speculative-config", '{"method": "eagle"}'),
     S + "argument --speculative-config: speculative_config.method must be one of ngram, "
     "draft_model, got 'eagle'"),
    ("nanoserve", _serve("--speculative-config", '{"num_speculative_tokens": 4,'),
     S + "argument --speculative-config: speculative_config is not valid JSON: Expecting "
     "property name enclosed in double quotes: line 1 column 30 (char 29)"),
    ("nanoserve", ["generate", "hi", "--model", "stub", "--seed", "-1"],
     G + f"argument --seed: must be a seed: an integer from 0 to {INT64_MAX}, got -1"),
    ("nanoserve", _serve("--quantization", "q4_0"),
     S + "--quantization q4_0: the stub has no weights to quantize (auto or none)"),
    ("nanoserve", _serve("-tp", "0"),
     S + "argument --tensor-parallel-size/-tp: must be an integer >= 1, got 0"),
    ("nanoserve", _serve("--num-blocks", "0"),
     S + "argument --num-blocks: must be an integer >= 1, got 0"),
    ("nanoserve", _serve("--max-model-len", "-5"),
     S + "argument --max-model-len: must be an integer >= 1, got -5"),
    ("nanoserve", _serve("--record", "/no/such/folder/t.jsonl"),
     S + "argument --record: no such folder: /no/such/folder"),
    ("nanoserve", _serve("--record", "{tmp}"),
     S + "argument --record: {tmp} is a folder, not a file"),
    ("nanoserve", _serve("--allowed-origins", "*"),
     S + "argument --allowed-origins: must be a JSON list of strings, e.g. '[\"*\"]', got '*'"),
    ("nanoserve", _serve("--allowed-headers", '["x", 1]'),
     S + "argument --allowed-headers: must be a JSON list of strings, e.g. '[\"*\"]', got "
     "'[\"x\", 1]'"),
    # serve: the checks before the bind, and the bind
    ("nanoserve", ["serve", "--model", "{tmp}/cut.gguf"],
     re.compile(re.escape(S + "--model ") + "(.+)/cut\\.gguf: \\1/cut\\.gguf: " + re.escape(
         "not a readable GGUF file, truncated or corrupt (") + ".+\\)")),
    ("nanoserve", ["serve", "--model", "{tmp}/text.gguf"],
     S + "--model {tmp}/text.gguf: {tmp}/text.gguf: not a readable GGUF file, truncated or "
     "corrupt (GGUF magic invalid)"),
    ("nanoserve", ["serve", "--model", "{tmp}/gpt2"],
     S + "--model {tmp}/gpt2: {tmp}/gpt2: architecture 'gpt2' is not supported; nanoserve "
     "runs llama, mistral, qwen2, qwen3, gemma3"),
    ("nanoserve", _serve("--host", "256.1.1.1"),
     re.compile(re.escape(S + "--host 256.1.1.1: not an address or a name that resolves (") +
                ".+\\)")),
    ("nanoserve", _serve("--host", "no-such-host.invalid"),
     re.compile(re.escape(S + "--host no-such-host.invalid: not an address or a name that "
                          "resolves (") + ".+\\)")),
    ("nanoserve", _serve("--block-size", "1000000000"),
     S + "--block-size 1000000000 exceeds --max-model-len 8192: a block holds tokens of one "
     "sequence; lower --block-size"),
    ("nanoserve", _serve("--kv-cache-memory", "1TiB"),
     S + f"the KV pool takes {1 << 40} B, more than this machine's memory ({MEMORY} B): lower "
     "--kv-cache-memory"),
    ("nanoserve", ["serve", "--num-blocks", "4000000000"],
     S + f"the KV pool takes {4_000_000_000 * 737280} B, more than this machine's memory "
     f"({MEMORY} B): lower --num-blocks"),
    ("nanoserve", _serve("--chat-template", "/no/such/template.jinja"),
     S + f"--chat-template /no/such/template.jinja: no such file {NOT_A_FILE_INLINE}"),
    ("nanoserve", _serve("--chat-template", "{% if %}hi{% endif %}"),
     S + "--chat-template: not a valid Jinja template: Expected an expression, got 'end of "
     "statement block' (line 1)"),
    ("nanoserve", _serve("--chat-template", "{tmp}/bad.jinja"),
     S + "--chat-template: not a valid Jinja template: Unexpected end of template. Jinja was "
     "looking for the following tags: 'endfor' or 'else'. The innermost block that needs to "
     "be closed is 'for'. (line 2)"),
    ("nanoserve", _serve("--device", "foo"),
     S + "--device foo: not a device (cpu, cuda or cuda:N)"),
    ("nanoserve", _serve("--device", "meta"),
     S + "--device meta: nanoserve runs on cpu or cuda, not meta"),
    pytest.param("nanoserve", _serve("--device", "cuda"),
                 re.compile(re.escape(S + "--device cuda: CUDA is not available here (torch ")
                            + ".+\\)"),
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
                 id="nanoserve serve --device cuda (no CUDA)"),
    ("nanoserve", _serve("--record-redact"),
     S + "--record-redact redacts what --record writes: give --record FILE"),
    ("nanoserve", _serve("--int8-activations"),
     S + "--int8-activations: --model stub has no weights"),
    ("nanoserve", ["serve", "--int8-activations", "-tp", "3"],
     S + "--int8-activations: --tensor-parallel-size 3: it runs in one process"),
    ("nanoserve", ["serve", "-tp", "2"],
     S + "--tensor-parallel-size 2 does not divide 9 attention heads; 3 KV heads (N must divide "
     "them or be a multiple of them); this model shards at 1, 3"),
    ("nanoserve", ["serve", "-tp", "3", "--distributed-backend", "nccl"],
     S + "--distributed-backend nccl needs a CUDA --device, not cpu (gloo runs on the CPU)"),
    # bench
    ("nanoserve", _bench("--prompt-min", "10", "--prompt-max", "5"),
     B + "--prompt-min 10 is more than --prompt-max 5"),
    ("nanoserve", _bench("--int8-activations"),
     B + "--int8-activations: --model stub has no weights"),
    ("nanoserve", _bench("--out-min", "64", "--out-max", "32"),
     B + "--out-min 64 is more than --out-max 32"),
    ("nanoserve", _bench("--prompt-min", "0"),
     B + "argument --prompt-min: must be an integer >= 1, got 0"),
    ("nanoserve", _bench("--out-max", "0"),
     B + "argument --out-max: must be an integer >= 1, got 0"),
    ("nanoserve", _bench("--n", "0"), B + "argument --n: must be an integer >= 1, got 0"),
    ("nanoserve", _bench("--prompt-max", "9000"),
     B + "--prompt-max 9000 + --out-max 128 = 9128 tokens: more than the model's context of "
     "8192"),
    ("nanoserve", ["bench", "--single-tokens", "8190"],
     B + "the batch-1 prompt 32 + --single-tokens 8190 = 8222 tokens: more than the model's "
     "context of 8192"),
    ("nanoserve", _bench("--dtype", "foo"),
     B + "argument --dtype: invalid choice: 'foo' (choose from 'float32', 'bfloat16', "
     "'float16')"),
    ("nanoserve", _bench("--device", "foo"),
     B + "--device foo: not a device (cpu, cuda or cuda:N)"),
    ("nanoserve", ["bench", "--model", "/no/such/model"],
     B + "--model /no/such/model: model '/no/such/model' is none of 'smollm2', "
     "'gemma3-270m' (embedded), a .gguf file, or a folder with config.json, *.safetensors "
     "and tokenizer.json"),
    ("nanoserve", _bench("-tp", "0"),
     B + "argument --tensor-parallel-size/-tp: must be an integer >= 1, got 0"),
    ("nanoserve", ["bench", "-tp", "2"],
     B + "--tensor-parallel-size 2 does not divide 9 attention heads; 3 KV heads (N must divide "
     "them or be a multiple of them); this model shards at 1, 3"),
    ("nanoserve", _bench("--max-num-seqs", "0"),
     B + "argument --max-num-seqs: must be an integer >= 1, got 0"),
    # generate
    ("nanoserve", ["generate", "hi", "--model", "stub", "--max-tokens", "0"],
     G + "argument --max-tokens: must be an integer >= 1, got 0"),
    ("nanoserve", ["generate", "hi", "--model", "stub", "--temperature", "nan"],
     G + "argument --temperature: must be a finite number, got 'nan'"),
    ("nanoserve", ["generate", "hi", "--model", "stub", "--device", "foo"],
     G + "--device foo: not a device (cpu, cuda or cuda:N)"),
    ("nanoserve", ["generate", "hi", "--model", "/no/such/model"],
     G + "--model /no/such/model: model '/no/such/model' is none of 'smollm2', "
     "'gemma3-270m' (embedded), a .gguf file, or a folder with config.json, *.safetensors "
     "and tokenizer.json"),
    # sim
    ("sim", ["replay", "{tmp}/binary.jsonl"],
     "sim replay: {tmp}/binary.jsonl: line 1: not UTF-8 text (byte 0xff at column 1); a trace "
     "is JSON Lines in UTF-8"),
    ("sim", ["replay", "{tmp}/latin1.jsonl"],
     "sim replay: {tmp}/latin1.jsonl: line 2: not UTF-8 text (byte 0xe9 at column 51); a trace "
     "is JSON Lines in UTF-8"),
    ("sim", ["replay", "traces/n3.jsonl", "-tp", "0"],
     "sim replay: error: argument --tensor-parallel-size/-tp: must be an integer >= 1, got 0"),
    ("sim", ["replay", "traces/n3.jsonl", "--cost", "/no/such/cost.json"],
     "sim replay: error: argument --cost: no such file: /no/such/cost.json"),
    ("sim", ["capacity", "--load", "n=4", "--cost", "/"],
     "sim capacity: error: argument --cost: / is not a file"),
    ("sim", ["capacity", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--seeds", "0"],
     "sim capacity: error: argument --seeds: must be an integer >= 1, got 0"),
    ("sim", ["capacity", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--warmup",
             "1.5"],
     "sim capacity: error: argument --warmup: must be >= 0 and < 1, got 1.5"),
    ("sim", ["capacity", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--max-queue",
             "-1"],
     "sim capacity: error: argument --max-queue: must be an integer >= 0, got -1"),
    # issue 42: a TypeError traceback, then values that planned nothing and exited 0
    ("sim", ["capacity", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--engine",
             "kv_cache_memory=abc"],
     "sim capacity: --engine kv_cache_memory: not a size: 'abc' (try 2GiB, 512MiB, 1000000)"),
    ("sim", ["validate", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--engine",
             "kv_cache_memory=abc"],
     "sim validate: --engine kv_cache_memory: not a size: 'abc' (try 2GiB, 512MiB, 1000000)"),
    ("sim", ["validate", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--engine",
             "kv_cache_memory=[1]"],
     "sim validate: kv_cache_memory must be a number of bytes > 0, got [1]"),
    ("sim", ["capacity", "--load", LOAD, "--cost", "sim/costs/smollm2-cpu.json", "--sweep",
             "rate=1,inf"],
     "sim capacity: --sweep rate: needs finite values > 0, got '1,inf'"),
    ("sim", ["capacity", "--load", LOAD, "--cost", "sim/costs/smollm2-cpu.json", "--sweep",
             "rate=nan"],
     "sim capacity: --sweep rate: needs finite values > 0, got 'nan'"),
    ("sim", ["capacity", "--load", LOAD, "--cost", "sim/costs/smollm2-cpu.json", "--slo",
             "ttft_p99=0s"],
     "sim capacity: --slo ttft: must be a duration > 0, got '0s'"),
    ("sim", ["validate", "--load", "n=4", "--cost", "sim/costs/smollm2-cpu.json", "--runs", "0"],
     "sim validate: error: argument --runs: must be an integer >= 1, got 0"),
    ("sim", ["profile", "--reps", "0"], "sim profile: error: argument --reps: must be an integer "
     ">= 1, got 0"),
    ("sim", ["profile", "--out", "/no/such/folder/cost.json"],
     "sim profile: error: argument --out: no such folder: /no/such/folder"),
    ("sim", ["soak", "--clients", "0"],
     "sim soak: error: argument --clients: must be an integer >= 1, got 0"),
    ("sim", ["soak", "--timeout", "inf"],
     "sim soak: error: argument --timeout: must be a finite number, got 'inf'"),
    ("sim", ["bench", "--concurrency", "0"],
     "sim bench: error: argument --concurrency: must be an integer >= 1, got 0"),
    ("sim", ["load", "--out", "/no/such/folder/t.jsonl", "--n", "4"],
     "sim load: error: argument --out: no such folder: /no/such/folder"),
    ("sim", ["convert", "/no/such.csv", "--out", "{tmp}/t.jsonl"],
     "sim convert: error: argument CSV: no such file: /no/such.csv"),
]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x01 not text")
    (tmp_path / "latin1.jsonl").write_bytes(
        b'{"nanoserve_trace": 1, "clock": "step", "model": "stub"}\n'
        b'{"id": "r1", "at_step": 0, "body": {"prompt": "caf\xe9"}}\n')
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m.content }}\n")
    gpt2 = tmp_path / "gpt2"  # a folder of an architecture nanoserve does not have
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257,
        "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12}))
    for name in ("tokenizer.json", "model.safetensors"):
        (gpt2 / name).write_text("")
    # a download cut short: SmolLM2's GGUF, its first 2 MB; and a file that is no GGUF at all
    with embedded_gguf_path().open("rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(2_000_000))
    (tmp_path / "text.gguf").write_text("not a model\n")
    return tmp_path


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    for target in WORK:
        def reached(*args: Any, _target: str = target, **kwargs: Any) -> Any:
            raise Reached(f"{_target} was called: the bad flag got through")

        monkeypatch.setattr(target, reached)


def _ids(cases: list[Any]) -> list[Any]:
    """Each row named by its command line."""
    return [pytest.param(*c, id=f"{c[0]} {' '.join(c[1])}") if type(c) is tuple else c
            for c in cases]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(("prog", "argv", "line"), _ids(CASES))
def test_a_bad_invocation_is_one_line_and_exit_2(
    prog: str, argv: list[str], line: str | re.Pattern[str], tmp: Path,
    capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [arg.replace("{tmp}", str(tmp)) for arg in argv]
    try:
        code = MAINS[prog](argv)
    except SystemExit as exc:  # argparse's own errors exit
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1, err  # one line: no usage block, no traceback
    assert err.endswith("\n"), err
    if isinstance(line, str):
        assert err[:-1] == line.replace("{tmp}", str(tmp))
    else:
        assert line.fullmatch(err[:-1]), err


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=300, check=False)


def test_serve_on_a_port_in_use_is_one_line_from_the_real_command() -> None:
    # A real process: what a user sees, log lines and all (none come before the bind).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        got = run_cli("nanoserve.cli", "serve", "--model", "stub", "--port", str(port))
    assert (got.returncode, got.stdout) == (2, "")
    assert got.stderr == (f"nanoserve serve: error: --port {port}: 127.0.0.1:{port} is in use "
                          "by another program (Address already in use)\n")


@pytest.mark.parametrize(("argv", "line"), [
    (["nanoserve.cli", "serve", "--model", "stub", "--shutdown-grace", "nan"],
     "nanoserve serve: error: argument --shutdown-grace: must be a finite number, got 'nan'"),
    (["nanoserve.cli", "bench", "--model", "stub", "--prompt-min", "10", "--prompt-max", "5"],
     "nanoserve bench: error: --prompt-min 10 is more than --prompt-max 5"),
    (["sim.commands", "replay", "{tmp}/latin1.jsonl"],
     "sim replay: {tmp}/latin1.jsonl: line 2: not UTF-8 text (byte 0xe9 at column 51); a trace "
     "is JSON Lines in UTF-8"),
])
def test_real_commands_print_the_same_one_line(argv: list[str], line: str, tmp: Path) -> None:
    got = run_cli(*[arg.replace("{tmp}", str(tmp)) for arg in argv])
    assert (got.returncode, got.stdout) == (2, "")
    assert got.stderr == line.replace("{tmp}", str(tmp)) + "\n"


@pytest.mark.parametrize(("main", "argv", "where", "prefix"), [
    (nanoserve_cli.main, ["bench", "--model", "stub"], "nanoserve.bench.run",
     "nanoserve bench: error: "),
    (sim_cli.main, ["replay", "traces/burst16.jsonl"], "sim.replay.replay_command.replay",
     "sim replay: traces/burst16.jsonl: "),
])
def test_tensor_parallel_ranks_that_never_start_are_one_line_from_bench_and_replay(
    main: Callable[[list[str]], int], argv: list[str], where: str, prefix: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """serve reports a ModelStartError in one line (tests/server/test_server_tp.py); bench
    and replay load the model the same way, and printed the error's traceback."""
    from nanoserve.model.base import ModelStartError

    why = "rank 2 (pid 7) was starting when the distributed timeout of 600 s ran out"

    def fail(*_: object, **__: object) -> None:
        raise ModelStartError(why)

    monkeypatch.setattr(where, fail)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", prefix + why + "\n")
