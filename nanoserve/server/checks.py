"""`nanoserve serve`'s settings that argparse cannot judge flag by flag, judged before the
socket is bound, and the bind itself, done before the server starts.

main.run calls these in order after argparse (nanoserve.flags) and the model's checks
(nanoserve.model.preflight): each refuses with ConfigError, which the command line prints as
one line naming the flag, exit status 2. The bind comes last and outside Trio: a port in
use or a host that does not resolve is then that line too, not an ExceptionGroup out of
Hypercorn's nursery after the app has started.
"""

from __future__ import annotations

import argparse
import errno
import socket
from pathlib import Path

import hypercorn.config
import jinja2
import jinja2.sandbox

from nanoserve.config import ConfigError
from nanoserve.model.preflight import check_int8_activations

# vLLM's rule for --chat-template: a value holding one of these is a template, else a path.
_JINJA_CHARS = "{}\n"
# Templates nanoserve ships, by name, each the files joined (server/templates/): ChatML that
# renders tools, and the same with SmolLM2's default system turn (serve's default for it).
_TEMPLATES = Path(__file__).parent / "templates"
BUILTIN_TEMPLATES = {"chatml-tools": ("chatml_tools.jinja",),
                     "smollm2-tools": ("smollm2_system.jinja", "chatml_tools.jinja")}


def check_flags(a: argparse.Namespace) -> None:
    """Flags that mean something only with another."""
    if a.record_redact and a.record is None:
        raise ConfigError("--record-redact redacts what --record writes: give --record FILE")
    if a.int8_activations:
        check_int8_activations(a.model, a.tensor_parallel_size, a.device)
    if a.model == "stub" and a.quantization not in ("auto", "none"):
        raise ConfigError(f"--quantization {a.quantization}: the stub has no weights to "
                          "quantize (auto or none)")


def _is_file(path: Path) -> bool:
    """Whether `path` names a file; False where it cannot be a path at all (a template
    given inline, as a recorded trace holds it, is longer than a file name may be)."""
    try:
        return path.is_file()
    except OSError:
        return False


def chat_template(value: str | None) -> str | None:
    """The template `--chat-template` names: a built-in one (BUILTIN_TEMPLATES), a file
    holding one, or the template itself,
    compiled once here so that a syntax error is refused at start-up, not at the first chat
    request. A value that looks like a path (no braces, one line) must be a file."""
    if value is None:
        return None
    if value in BUILTIN_TEMPLATES:
        return "".join((_TEMPLATES / name).read_text(encoding="utf-8")
                       for name in BUILTIN_TEMPLATES[value])
    path = Path(value)
    inline = any(c in value for c in _JINJA_CHARS)
    if not inline or _is_file(path):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"--chat-template {value}: no such file (a template given "
                              "inline holds {{ or {%)") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--chat-template {value}: not UTF-8 text") from None
        except OSError as exc:
            raise ConfigError(f"--chat-template {value}: {exc.strerror or exc}") from None
    else:
        text = value
    try:  # the syntax does not depend on the whitespace options tokenizer.py renders with
        jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template: not a valid Jinja template: {exc.message} (line "
                          f"{exc.lineno})") from None
    return text


def listen(config: hypercorn.config.Config, host: str, port: int) -> hypercorn.config.Sockets:
    """Hypercorn's sockets for `config.bind`, bound and listening (hypercorn_fixes.serve
    takes them). Refuses what the operating system refuses, naming the flag at fault."""
    try:
        sockets = config.create_sockets()
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address or a name that resolves "
                          f"({exc.strerror})") from None
    except OSError as exc:
        raise ConfigError(_bind_error(exc, host, port)) from None
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
    return sockets


def close(sockets: hypercorn.config.Sockets) -> None:
    for sock in [*sockets.secure_sockets, *sockets.insecure_sockets, *sockets.quic_sockets]:
        sock.close()


def _bind_error(exc: OSError, host: str, port: int) -> str:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is in use by another program ({reason})"
    if exc.errno == errno.EACCES:
        return f"--port {port}: not allowed to listen there ({reason}; ports below 1024 " \
            "need privileges)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine ({reason})"
    return f"--host {host} --port {port}: cannot listen there ({reason})"
