"""Models by Hugging Face Hub id: `org/name`, `org/name:Q4_K_M`, `org/name@revision`.

A hub id is one more kind of model name (loader.resolve_model): a string with exactly one
`/` before any `@revision` or `:file`, that is not an existing local path. It resolves
through huggingface_hub itself, so its cache, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_TOKEN and download progress bars are the ones every Hugging Face tool shares: a model
another tool fetched is found, and nothing here keeps a cache of its own.

A repository is one of two kinds. A Hugging Face folder (config.json, tokenizer files,
*.safetensors) resolves to its snapshot folder, downloading only those files. A GGUF
repository resolves to one .gguf file, picked as llama.cpp's `-hf org/name:Q4_K_M` does: the
one file whose name holds the tag (case-insensitive), or the file named in full (`--gguf-file`),
or the only .gguf there is; the loader converts it as it converts any local GGUF.

The revision and the GGUF choice travel inside the name (`org/name@rev:Q4_K_M`, what
`--revision` and `--gguf-file` fold into), because the name is what every layer, and every
tensor-parallel rank, is handed; each resolves it to the same files.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# What a Hugging Face folder needs, and no more: a repository often also holds the same
# weights as .bin, .pth or .gguf, gigabytes a server never reads.
FOLDER_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "*.safetensors",
                   "*.safetensors.index.json")
# The tag llama.cpp's -hf picks when none is given and the repository has several files.
DEFAULT_QUANT = "Q4_K_M"

# org/name, then @revision, then :tag-or-file. The repository part has exactly one `/` and
# starts with a letter or digit, so "./x/y", "/x/y" and "~/x" never read as hub ids.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)"
                     r"(?:@(?P<revision>[^:@\s]+))?(?::(?P<gguf>[^:@\s]+))?")

Files = Literal["all", "config"]


class HubError(FileNotFoundError):
    """A hub id that cannot be resolved, in one line (the command line prints it as is)."""


@dataclass(frozen=True, slots=True)
class HubId:
    repo: str  # org/name
    revision: str | None  # a branch, tag or commit; None: the repository's default branch
    gguf: str | None  # a quant tag (Q4_K_M) or a file name ending .gguf

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}{rev}:{self.gguf}" if self.gguf else f"{self.repo}{rev}"


def parse_hub_id(name: str) -> HubId | None:
    """The hub id `name` spells, or None when it is something else: an existing local path
    (a folder named org/name beside the server wins, as vLLM's and transformers' rule is)
    or any string not of the form org/name[@revision][:tag]."""
    match = _HUB_ID.fullmatch(name)
    if match is None or Path(name).expanduser().exists():
        return None
    return HubId(match["repo"], match["revision"], match["gguf"])


def hub_name(model: str, revision: str | None, gguf_file: str | None) -> str:
    """`--model` with `--revision` and `--gguf-file` folded in: the one string every layer
    resolves. Raises ValueError (naming the flag) when a flag cannot apply."""
    if revision is None and gguf_file is None:
        return model
    hub = parse_hub_id(model)
    flag = "--revision" if revision is not None else "--gguf-file"
    if hub is None:
        raise ValueError(f"{flag} applies to a Hugging Face hub id (org/name), not {model!r}")
    if revision is not None and hub.revision not in (None, revision):
        raise ValueError(f"--revision {revision} and --model {model} name two revisions")
    if gguf_file is not None and hub.gguf not in (None, gguf_file):
        raise ValueError(f"--gguf-file {gguf_file} and --model {model} name two GGUF files")
    return str(HubId(hub.repo, revision or hub.revision, gguf_file or hub.gguf))


def resolve(hub: HubId, files: Files = "all", cache_dir: Path | None = None) -> Path:
    """The local path of `hub`: a snapshot folder, or one .gguf file. `files="config"` asks
    for a folder's config.json only (the preflight reads a model's shape before the server
    binds; the weights are fetched when they load). Memoized per process, cache and offline
    mode: a load resolves the same name several times, and each online resolve asks the Hub."""
    from huggingface_hub import constants

    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    return _resolve(hub, files, cache.expanduser().resolve(), bool(constants.HF_HUB_OFFLINE))


@functools.cache
def _resolve(hub: HubId, files: Files, cache: Path, offline: bool) -> Path:
    names, offline = _repo_files(hub, cache, offline)
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    is_folder = "config.json" in names and any(n.endswith(".safetensors") for n in names)
    if hub.gguf is None and is_folder:
        patterns = ["config.json"] if files == "config" else list(FOLDER_PATTERNS)
        return Path(_call(hub, cache, offline, "snapshot_download", allow_patterns=patterns))
    if not ggufs:
        what = ("no .gguf file" if hub.gguf
                else "neither config.json with *.safetensors nor a .gguf file")
        raise HubError(f"{_label(hub)}: the repository has {what} ({_listed(names)})")
    filename = pick_gguf(hub, ggufs)
    return Path(_call(hub, cache, offline, "hf_hub_download", filename=filename))


def pick_gguf(hub: HubId, ggufs: list[str]) -> str:
    """The .gguf file `hub` names among the repository's: by full name, by tag (case-insensitive,
    llama.cpp's rule), the only one, or the default tag's; otherwise a one-line error listing
    the candidates."""
    if hub.gguf is not None and hub.gguf.endswith(".gguf"):
        if hub.gguf in ggufs:
            return hub.gguf
        raise HubError(f"{_label(hub)}: no file {hub.gguf} (GGUF files: {', '.join(ggufs)})")
    if hub.gguf is None and len(ggufs) == 1:
        return ggufs[0]
    tag = hub.gguf or DEFAULT_QUANT
    found = [n for n in ggufs if tag.lower() in Path(n).name.lower()]
    if len(found) == 1:
        return found[0]
    if hub.gguf is None:
        why = (f"{len(ggufs)} GGUF files, and not one alone holds {DEFAULT_QUANT}: "
               "pick one with :TAG")
    elif found:
        why = f"{len(found)} GGUF files hold {tag}: name one with --gguf-file"
    else:
        why = f"no GGUF file holds {tag}"
    raise HubError(f"{_label(hub)}: {why} ({', '.join(found or ggufs)})")


def _repo_files(hub: HubId, cache: Path, offline: bool) -> tuple[list[str], bool]:
    """The repository's file names, and whether to stay offline: the Hub's listing when it can
    be reached, else the cached snapshot's (as huggingface_hub itself falls back)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    reason = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            # model_info, one request, as snapshot_download's own first look: list_repo_files
            # retries a refused connection for half a minute before the cache is tried.
            info = HfApi().model_info(hub.repo, revision=hub.revision)
            return [s.rfilename for s in info.siblings or ()], False
        except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise _hub_error(hub, cache, exc) from None
        except Exception as exc:  # no connection, a timeout, the Hub down: try the cache
            reason = f"the Hub could not be reached ({type(exc).__name__})"
    folder = Path(_call(hub, cache, True, "snapshot_download", allow_patterns=["config.json"],
                        offline_reason=reason))
    names = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    return names, True


def _call(hub: HubId, cache: Path, offline: bool, what: str, *, offline_reason: str = "",
          **kwargs: object) -> str:
    """huggingface_hub's `what` on `hub`, its errors turned into one line naming the model and
    the cache. Its own progress bars show a download."""
    import huggingface_hub
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    fn = getattr(huggingface_hub, what)
    try:
        path: str = fn(hub.repo, revision=hub.revision, cache_dir=cache,
                       local_files_only=offline, **kwargs)
    except LocalEntryNotFoundError as exc:
        reason = offline_reason or "downloads are off (HF_HUB_OFFLINE)"
        # A snapshot cut off midway says so (huggingface_hub >= 1.x keeps its file list).
        partial = (" (its cached snapshot is partial)"
                   if type(exc).__name__ == "IncompleteSnapshotError" else "")
        raise HubError(f"{_label(hub)} is not in the Hugging Face cache {cache}{partial} and "
                       f"{reason}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise _hub_error(hub, cache, exc) from None
    return path


def _hub_error(hub: HubId, cache: Path, exc: Exception) -> HubError:
    from huggingface_hub.errors import RevisionNotFoundError

    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{_label(hub)}: the Hub has no revision {hub.revision} of {hub.repo}")
    return HubError(f"{_label(hub)}: no such model on the Hugging Face Hub, or it is private "
                    f"or gated (set HF_TOKEN); nothing cached under {cache}")


def _label(hub: HubId) -> str:
    return f"model {hub}"


def _listed(names: list[str]) -> str:
    shown = sorted(names)[:8]
    more = f", and {len(names) - 8} more" if len(names) > 8 else ""
    return f"files: {', '.join(shown)}{more}" if shown else "no files"
