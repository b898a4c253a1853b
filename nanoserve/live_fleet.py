"""`python -m nanoserve.live_fleet N [flags] [serve flags]` (`just fleet N ...`): N
`nanoserve serve` replicas behind SGLang's router, sglang-router 0.3.2 from PyPI (`just
router-setup` puts it in .venv/router, apart from nanoserve's packages), on one front URL.
(The modelled fleet of `sim capacity --replicas` is sim/capacity/fleet.py; this one runs
real processes.)

The order: every replica on a free port of 127.0.0.1 (flags this program does not know are
passed to each, `--model stub` ...), each polled until its `/health` answers 200; then the
router with `--worker-urls`, polled until its Prometheus exporter counts every replica
healthy and its `/health` answers; then one line on stdout, `fleet: URL (N replicas: ...)`,
with each child's PID; then it waits.
SIGINT, SIGTERM or SIGHUP stops the router first (no new work reaches the replicas), then
every replica (SIGTERM, so each drains as `nanoserve serve` does; SIGKILL after
`--stop-timeout`; a second signal skips the wait). The children run in sessions of their own,
so a terminal's Ctrl-C reaches this program alone and the order holds; on Linux each is
also told to take SIGTERM when this program dies, so a SIGKILL here leaves no orphan.

What the router does with a replica (probed at registration: `GET /health`, gRPC health
checks, which nanoserve's h2c answers 404 so the router settles on HTTP, `GET /server_info`
for `served_model_name`, `GET /model_info` then `/get_model_info`, which nanoserve does not
have and the router does without; after that `GET /health` every `--health-check-interval`
seconds): its retries are kept. A request the router could not deliver, whose replica
answered 408, 429, 500, 502, 503 or 504, or (unary) died before the whole answer was read,
is sent again, 5 attempts in all, to whichever replica the policy picks then; a stream
whose 200 has gone to the client cannot be. Its defaults are sized for big GPU fleets, and
three are changed:

- health checks every second, a replica out after 2 failed ones (not every 60 s and 3), and
  a first retry backoff of 400 ms (not 50; x1.5 each time, with 20% jitter), so that a
  request's 5 attempts span at least 2.6 s and the last ones come after a dead replica has
  left the rotation (within 2 s). With the router's own settings a unary request could
  spend all 5 attempts on the dead replica before anything noticed (a 500, in about one
  run in a dozen of tests/server/test_fleet.py's kill test);
- no circuit breaker (`--disable-circuit-breaker`). It counts every non-2xx answer as a
  failure, 4xx included: 20 requests in a row naming a model the fleet does not serve
  opened both replicas' circuits and the fleet answered 503 to everyone for 60 s (with 3
  failures, the lower threshold first tried here to drop dead replicas faster, it took 6).
  The health checks drop a dead replica, and nanoserve's `/health` turns 503 when its
  engine loop dies, which a breaker would have caught too.

So when a replica dies, its unary requests and whatever is routed to it before the router
notices are re-run on another (generation has no side effects; the client sees only the
delay), and the streams it was serving, whose bytes the client already has, end with a
broken body. `--router-arg=--disable-retries` makes every request on it fail instead.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

ROUTER_PYTHON = Path(sys.prefix) / "router" / "bin" / "python"  # .venv/router/bin/python
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
_POLL_S = 0.2


class Stopped(Exception):
    """A stop signal arrived (raised where a wait loop checks, never from the handler)."""


@dataclass(slots=True)
class Signals:
    """SIGINT, SIGTERM, SIGHUP: the first asks for a stop, the next hurries it."""

    stop: bool = False
    hurry: bool = False

    def install(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop:
            self.hurry = True
        self.stop = True

    def check(self) -> None:
        if self.stop:
            raise Stopped


@dataclass(slots=True)
class Child:
    name: str  # "replica 1", "router"
    url: str
    proc: subprocess.Popen[bytes]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nanoserve.live_fleet", allow_abbrev=False,
        description="N nanoserve replicas behind sglang-router; other flags go to every "
                    "`nanoserve serve`.")
    a = p.add_argument
    a("n", type=int, help="replicas")
    a("--host", default="127.0.0.1", help="the router's address")
    a("--port", type=int, default=0, help="the router's port (0: a free one)")
    a("--policy", choices=POLICIES, default="cache_aware", help="the router's [cache_aware]")
    a("--health-check-interval", type=int, default=1,
      help="seconds between the router's health checks (its own default: 60) [1]")
    a("--router-arg", action="append", default=[], metavar="ARG",
      help="passed to the router as it is, after this program's (repeat; e.g. "
           "--router-arg=--disable-retries)")
    a("--router-python", type=Path, default=ROUTER_PYTHON,
      help="the interpreter with sglang-router installed [.venv/router/bin/python]")
    a("--log-dir", type=Path, help="each child's output in DIR/replica-I.log and "
                                   "DIR/router.log (default: this program's stderr)")
    a("--startup-timeout", type=float, default=600.0,
      help="seconds for every replica to load (a first smollm2 run converts it) [600]")
    a("--stop-timeout", type=float, default=20.0,
      help="seconds a child has to exit on SIGTERM before SIGKILL [20]")
    return p


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free now (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(name: str, url: str, cmd: list[str], log_dir: Path | None) -> Child:
    out: IO[bytes] | int = sys.stderr.fileno()
    if log_dir is not None:
        out = (log_dir / f"{name.replace(' ', '-')}.log").open("ab")
    try:
        # Its own session: a terminal's Ctrl-C goes to the launcher only.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, preexec_fn=(
                                    _die_with_parent if sys.platform == "linux" else None))
    finally:
        if not isinstance(out, int):
            out.close()  # the child holds its own copy
    return Child(name, url, proc)


def _wait_until(probes: Sequence[tuple[Child, str]], children: Sequence[Child],
                timeout_s: float, sig: Signals) -> None:
    """Poll each (child, URL) until all answer as wanted; any child exiting first, or the
    deadline, is an error."""
    deadline = time.monotonic() + timeout_s
    pending = list(probes)
    with httpx.Client(timeout=5.0) as client:
        while pending:
            sig.check()
            for c in children:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} ({c.url}) exited with status "
                                       f"{c.proc.returncode} during start-up")
            pending = [(c, url) for c, url in pending if not _answers(client, c, url, children)]
            if pending and time.monotonic() > deadline:
                c = pending[0][0]
                raise RuntimeError(f"{c.name} ({c.url}) not ready after {timeout_s:.0f} s")
            if pending:
                time.sleep(_POLL_S)


def _answers(client: httpx.Client, c: Child, url: str, children: Sequence[Child]) -> bool:
    try:
        r = client.get(url)
    except httpx.HTTPError:
        return False  # not listening yet
    if not url.endswith("/metrics") or r.status_code != 200:
        return r.status_code == 200
    # The router registers its workers in the background: ready once its Prometheus
    # exporter (which, unlike /workers, needs no key when the router has --api-key) counts
    # every replica healthy.
    healthy = set(re.findall(r'^smg_worker_health\{worker="([^"]+)"\} 1$', r.text, re.M))
    return all(w.url in healthy for w in children if w.name != "router")


def _stop(children: Sequence[Child], timeout_s: float, sig: Signals) -> None:
    """SIGTERM, wait up to timeout_s (less after a second signal), SIGKILL, reap."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + timeout_s
    while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
        if sig.hurry:
            break
        time.sleep(_POLL_S / 2)
    for c in children:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()


def router_command(a: argparse.Namespace, port: int, metrics_port: int,
                   urls: Sequence[str]) -> list[str]:
    return [str(a.router_python), "-m", "sglang_router.launch_router",
            "--host", a.host, "--port", str(port), "--worker-urls", *urls,
            "--policy", a.policy, "--health-check-interval-secs", str(a.health_check_interval),
            "--health-failure-threshold", "2", "--retry-initial-backoff-ms", "400",
            "--disable-circuit-breaker",
            # Its Prometheus exporter binds 29000 unless told otherwise, and the router
            # panics when that port is taken (a second fleet): a free port of its own.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", str(max(1, int(a.stop_timeout) - 1)),
            "--log-level", "warn", *a.router_arg]


def run(a: argparse.Namespace, serve_args: list[str]) -> int:
    if a.n < 1:
        raise ValueError(f"n must be at least 1, got {a.n}")
    if not a.router_python.exists():
        raise FileNotFoundError(f"{a.router_python} does not exist: run `just router-setup`")
    if a.log_dir is not None:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    sig = Signals()
    sig.install()
    children: list[Child] = []
    ports = free_ports(a.n + 2)
    rport = a.port or ports[a.n]
    front = f"http://{'127.0.0.1' if a.host in ('0.0.0.0', '::') else a.host}:{rport}"
    status = 0
    try:
        for i, port in enumerate(ports[:a.n], 1):
            cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--log-level", "warning",
                   *serve_args, "--host", "127.0.0.1", "--port", str(port)]
            children.append(_spawn(f"replica {i}", f"http://127.0.0.1:{port}", cmd, a.log_dir))
        _wait_until([(c, f"{c.url}/health") for c in children], children, a.startup_timeout,
                    sig)
        urls = [c.url for c in children]
        metrics = ports[a.n + 1]
        router = _spawn("router", front, router_command(a, rport, metrics, urls), a.log_dir)
        children.append(router)
        _wait_until([(router, f"http://127.0.0.1:{metrics}/metrics"), (router, f"{front}/health")],
                    children, 60.0, sig)
        reps = ", ".join(f"{c.url} pid {c.proc.pid}" for c in children[:-1])
        noun = "replica" if a.n == 1 else "replicas"
        print(f"fleet: {front} ({a.n} {noun}: {reps}; router pid {router.proc.pid}, "
              f"policy {a.policy})", flush=True)
        status = _watch(children, sig)
    except Stopped:
        pass
    except RuntimeError as exc:
        print(f"fleet: {exc}; stopping", file=sys.stderr, flush=True)
        status = 1
    finally:
        sig.stop = True  # from here a signal only hurries the stop
        # The router first, so that nothing new reaches a replica that is draining.
        _stop([c for c in children if c.name == "router"], a.stop_timeout, sig)
        _stop([c for c in children if c.name != "router"], a.stop_timeout, sig)
    return status


def _watch(children: Sequence[Child], sig: Signals) -> int:
    """Wait for a stop signal (Stopped). A replica that exits is reported once and left to
    the router to route around; the router exiting, or every replica, ends the fleet."""
    reported: set[str] = set()
    while True:
        sig.check()
        for c in children:
            code = c.proc.poll()
            if code is None or c.name in reported:
                continue
            reported.add(c.name)
            if c.name == "router":
                print(f"fleet: the router exited with status {code}; stopping",
                      file=sys.stderr, flush=True)
                return 1
            print(f"fleet: {c.name} ({c.url}, pid {c.proc.pid}) exited with status {code}; "
                  "the router routes around it", file=sys.stderr, flush=True)
        if all(c.name in reported for c in children if c.name != "router"):
            print("fleet: no replica left; stopping", file=sys.stderr, flush=True)
            return 1
        time.sleep(_POLL_S)


def main(argv: list[str] | None = None) -> int:
    a, serve_args = parser().parse_known_args(argv)
    try:
        return run(a, serve_args)
    except (ValueError, OSError) as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
