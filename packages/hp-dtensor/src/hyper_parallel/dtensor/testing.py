"""Multi-rank test harness: run a function on N local ranks with a real process group.

``run_distributed(fn, world_size, *args, **kwargs)`` starts ``world_size`` processes on this
machine, initialises a real ``torch.distributed`` process group in each (gloo by default,
rendezvous over a free localhost port), calls ``fn(*args, **kwargs)`` on every rank and
returns the per-rank results as a list indexed by rank.

- A rank that raises makes the call raise :class:`RankFailure` in the caller, naming the rank
  and carrying its formatted traceback (and those of every other rank that failed).
- A run that does not finish within ``timeout`` seconds (a deadlock, a rank stuck in a
  collective) kills every rank and raises :class:`DistributedTimeout`.
- Each rank is limited to ``threads`` intra-op threads (1 by default) so N ranks do not
  oversubscribe a small machine.

- Inside a :func:`rank_pool` scope the ranks outlive the call: the next call with the same
  ``world_size``, ``backend`` and ``threads`` runs on the same processes (each call still in a
  process group of its own, initialised for it and destroyed after it, so no group, mesh or
  world-scoped cache outlives a call), and start-up, imports and torch's first-use
  initialisation are paid once per scope, not once per call (the pytest plugin
  :mod:`hyper_parallel.dtensor.pytest_plugin` opens one per test module; ``HP_TEST_POOL=0``
  turns it off). A call in which any rank failed or that timed out ends its pool: the next
  call starts fresh ranks. Between calls each rank restores its environment variables,
  default dtype, grad mode and thread count.

``fn`` must be importable by name (a module-level function); arguments and results must be
picklable. Inside ``fn`` use ``torch.distributed`` as usual: ``get_rank()``,
``get_world_size()``, collectives on the default group.

Example::

    import torch, torch.distributed as dist
    from hyper_parallel.dtensor.testing import run_distributed

    def _sum_ranks():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(_sum_ranks, 4) == [6.0] * 4
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedTimeout",
    "RankFailure",
    "assert_same_inconsistency",
    "compare_under_link",
    "caught_inconsistency",
    "free_port",
    "close_pools",
    "rank_pool",
    "run_distributed",
    "run_markdown_example",
    "strip_gloo_connected",
]

DEFAULT_TIMEOUT = 45.0
"""Seconds a whole run may take before every rank is killed."""

_GRACE = 2.0  # seconds to wait for sibling ranks' reports after the first failure


class RankFailure(RuntimeError):
    """One or more ranks raised. ``rank`` is the rank whose failure arrived first (usually the
    root cause: its peers then fail in collectives); ``failures`` maps each failing rank to its
    formatted traceback, in order of arrival."""

    def __init__(self, failures: dict[int, str], exc_types: dict[int, str]) -> None:
        self.failures = dict(failures)
        self.exc_types = exc_types
        self.rank = next(iter(self.failures))
        parts = [f"rank {r} raised {exc_types[r]}:\n{tb}" for r, tb in self.failures.items()]
        super().__init__(
            f"{len(self.failures)} rank(s) failed ({sorted(self.failures)}); first to fail: rank "
            f"{self.rank}\n" + "\n".join(parts)
        )


class DistributedTimeout(TimeoutError):
    """The run did not finish within its timeout; every rank was killed."""

    def __init__(self, timeout: float, pending: list[int]) -> None:
        self.timeout = timeout
        self.pending = pending
        super().__init__(
            f"distributed run did not finish within {timeout:.1f}s; ranks {pending} had not "
            "returned (deadlock or a rank stuck in a collective); all ranks were killed"
        )


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_setup(rank: int, world_size: int, port: int, threads: int, sys_path: list[str]) -> None:
    # The test module that defines ``fn`` may live on a path pytest added after the
    # process pool started, so extend the path before unpickling.
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    torch.set_num_threads(threads)
    _line_buffered_c_stdout()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    timeout: float,
    sys_path: list[str],
    payload: bytes,
    queue: Any,
) -> None:
    try:
        _rank_setup(rank, world_size, port, threads, sys_path)
        _call(rank, world_size, backend, timeout, payload, queue, 0)
    except BaseException as exc:
        queue.put((rank, 0, type(exc).__name__, traceback.format_exc()))


def _call(
    rank: int, world_size: int, backend: str, timeout: float, payload: bytes, queue: Any, call: int
) -> None:
    """One call on this rank: a process group for it, ``fn``, the report, the group's end."""
    import torch.distributed as dist

    fn, args, kwargs = pickle.loads(payload)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=max(timeout, 1.0)),
    )
    result = fn(*args, **kwargs)
    _flush_c_stdout()  # what C++ printed reaches the caller before the result does
    queue.put((rank, call, "ok", pickle.dumps(result)))
    # Rank 0 hosts the rendezvous store: nobody leaves (taking the store or a peer
    # connection with it) while a slower rank may still be creating groups.
    dist.barrier()
    dist.destroy_process_group()


def _pool_rank_main(
    rank: int,
    world_size: int,
    backend: str,
    threads: int,
    sys_path: list[str],
    inbox: Any,
    queue: Any,
) -> None:
    """A pooled rank: set up once, then run each ``(call, port, timeout, payload)`` from
    ``inbox`` in a process group of its own (initialised for the call and destroyed after it,
    as a rank of its own would), until ``None`` arrives. A call that raised ends the rank: its
    peers may be inside a collective, and the caller discards the pool."""
    try:
        _rank_setup(rank, world_size, 0, threads, sys_path)
        import torch
    except BaseException as exc:
        queue.put((rank, None, type(exc).__name__, traceback.format_exc()))
        return
    while True:
        message = inbox.get()
        if message is None:
            return
        call, port, timeout, payload = message
        environ, dtype, grad = dict(os.environ), torch.get_default_dtype(), torch.is_grad_enabled()
        try:
            os.environ["MASTER_PORT"] = str(port)
            _call(rank, world_size, backend, timeout, payload, queue, call)
        except BaseException as exc:
            queue.put((rank, call, type(exc).__name__, traceback.format_exc()))
            return
        finally:
            # what one call changed of the process must not reach the next call
            os.environ.clear()
            os.environ.update(environ)
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(grad)
            torch.set_num_threads(threads)


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None)


def _line_buffered_c_stdout() -> None:
    """Make the rank's C stdout line buffered. Libraries print from C++ through it (torch
    2.10's gloo prints a line per group it connects); into a pipe it is block buffered, so
    several ranks' output would arrive in arbitrary 4 KiB pieces, cut mid-line, and after the
    caller's own prints; unbuffered (Python sets it so under ``PYTHONUNBUFFERED``, as nox
    does) every ``<<`` is a write of its own and ranks' lines mix piece by piece. Line
    buffered, each line is one write (atomic on a pipe). The buffer is given explicitly: an
    unbuffered glibc stream would otherwise keep its one-byte buffer."""
    try:
        import ctypes

        libc = _libc()
        _C_STDOUT_BUFFER.append(ctypes.create_string_buffer(1 << 16))  # alive while we live
        stream = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.setvbuf(stream, _C_STDOUT_BUFFER[-1], 1, 1 << 16)  # 1: _IOLBF
    except (OSError, ValueError, AttributeError):  # not glibc-like: leave it as it is
        pass


_C_STDOUT_BUFFER: list[Any] = []


def _flush_c_stdout() -> None:
    try:
        _libc().fflush(None)
    except (OSError, AttributeError):
        pass


PRELOAD_ENV = "HP_TEST_PRELOAD"
"""Set by the harness while its fork server starts: JSON ``{"sys_path": [...], "modules":
[...]}``, the caller's import path and the modules to import before forking any rank."""


def _local_modules() -> list[str]:
    """Modules the caller has imported from outside the interpreter's installation (test
    modules, their helpers, editable sources) plus every ``hyper_parallel`` module: what a rank
    would otherwise import again when it unpickles ``fn``."""
    prefixes = tuple(
        os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}
    )
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name in ("__main__", "__mp_main__") or name.startswith(
            ("_pytest", "pytest", "conftest", "torch")
        ):
            continue
        if name.startswith("hyper_parallel.") or (
            path and not os.path.realpath(path).startswith(prefixes)
        ):
            names.append(name)
    return sorted(names)


def _preload_in_fork_server() -> None:
    """Inside the fork server (``hyper_parallel.dtensor._preload``): import what the caller
    named in :data:`PRELOAD_ENV`, on the caller's path (the fork server does not get it from
    multiprocessing before Python 3.13); a module that fails here is imported by the rank."""
    import importlib
    import json

    spec = json.loads(os.environ.pop(PRELOAD_ENV, "{}"))
    for entry in reversed(spec.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if spec.get("main_path"):  # a script's ``fn``: each rank would run the script's top again
        from multiprocessing import process, spawn

        me = process.current_process()
        setattr(me, "_inheriting", True)  # noqa: B010 - as multiprocessing's own preload does
        try:
            spawn.import_main_path(spec["main_path"])
        except BaseException:
            pass
        finally:
            delattr(me, "_inheriting")
    for name in spec.get("modules", []):
        try:
            importlib.import_module(name)
        except BaseException:  # the rank imports it itself, and reports what fails
            pass


FORK_ENV = "HP_TEST_FORK"
"""Set by :func:`run_markdown_example` for its script: ranks are forked from the script itself
(see :func:`_context`)."""


def _context() -> Any:
    # A fork server that has already imported torch starts ranks in a fraction of the
    # time a fresh interpreter needs; it never runs torch ops itself, so forking it is safe.
    # It also imports the caller's modules (see _local_modules): a rank then unpickles ``fn``
    # without importing its test module, transformers and the layers again (seconds of CPU
    # per rank). The list is fixed when the fork server starts, at the first run: under pytest
    # that is after collection, when every test module is imported.
    # A README example (run_markdown_example) has only imported modules and defined functions
    # when it calls run_distributed: forking the script itself is safe there, and saves the fork
    # server's second interpreter, which would import torch and the script's own imports
    # (transformers: ~10 s of CPU) all over again.
    if os.environ.get(FORK_ENV) == "1" and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*_EAGER_IMPORTS, f"{__package__}._preload"])
        return ctx
    return mp.get_context("spawn")


# What every rank would otherwise import for itself, seconds of CPU each: torch, and torch's
# compiler front end (torch._dynamo), which torch imports lazily on the first DTensor op (its
# dispatch goes through a ``torch._dynamo.disable`` wrapper): ~3 s per rank on a CPU core.
_EAGER_IMPORTS = ("torch", "torch.distributed", "torch._dynamo")

_preload_spec: list[str] = []  # the JSON for the fork server, computed at the first start


def _start(procs: list[Any]) -> None:
    """Start the ranks. The first start launches the fork server, which reads the caller's
    path and modules from :data:`PRELOAD_ENV`, set only meanwhile (nothing else inherits it)."""
    import json

    if os.environ.get(FORK_ENV) == "1":  # forked from the caller: it imports for every rank
        for name in _EAGER_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:  # the rank imports it if it needs it, and reports what fails
                pass
        for p in procs:
            p.start()
        return
    if not _preload_spec:
        from multiprocessing import spawn

        # the script a rank would run as __mp_main__ (none under pytest: a module)
        main_path = spawn.get_preparation_data("rank").get("init_main_from_path")
        spec = {"sys_path": sys.path, "modules": _local_modules(), "main_path": main_path}
        _preload_spec.append(json.dumps(spec))
    os.environ[PRELOAD_ENV] = _preload_spec[0]
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop(PRELOAD_ENV, None)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return results by rank.

    Raises :class:`RankFailure` if any rank raised (with every failing rank's traceback) and
    :class:`DistributedTimeout` if the run exceeds ``timeout`` seconds.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    payload = pickle.dumps((fn, args, kwargs))
    for attempt in range(3):
        try:
            if _pool_scopes and os.environ.get(POOL_ENV, "1") != "0":
                return _run_pooled(payload, world_size, backend, timeout, threads)
            return _run_once(payload, world_size, backend, timeout, threads)
        except RankFailure as failure:
            # Another process may grab the free port between our probe and rank 0's bind.
            port_taken = any("ddress already in use" in tb for tb in failure.failures.values())
            if not port_taken or attempt == 2:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _run_once(
    payload: bytes, world_size: int, backend: str, timeout: float, threads: int
) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, port, backend, threads, timeout, list(sys.path), payload, queue),
            daemon=True,
            name=f"hp-rank-{r}",
        )
        for r in range(world_size)
    ]
    _start(procs)
    try:
        return _collect(procs, queue, 0, timeout)
    finally:
        _end(procs, queue)


def _collect(procs: list[Any], queue: Any, call: int, timeout: float) -> list[Any]:
    """Every rank's report of ``call`` from ``queue``, by rank; :class:`RankFailure` or
    :class:`DistributedTimeout` otherwise. A report of no call (``None``) is a rank that failed
    before it could run one."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    exc_types: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, of, status, body = queue.get(timeout=min(0.2, deadline - now))
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in results and r not in failures:
                    failures[r] = f"process exited with code {p.exitcode} without a report"
                    exc_types[r] = "ProcessDied"
                    deadline = min(deadline, time.monotonic() + _GRACE)
            continue
        if of not in (call, None):  # pragma: no cover - a discarded pool's late report
            continue
        if status == "ok":
            results[rank] = pickle.loads(body)
        else:
            failures[rank] = body
            exc_types[rank] = status
            # Peers of a failed rank usually block in a collective: give them a short
            # grace period to report their own errors, then stop waiting.
            deadline = min(deadline, time.monotonic() + _GRACE)
    if failures:
        raise RankFailure(failures, exc_types)
    if len(results) < world_size:
        raise DistributedTimeout(timeout, [r for r in range(world_size) if r not in results])
    return [results[r] for r in range(world_size)]


def _end(procs: list[Any], queue: Any, wait: float = 0.0) -> None:
    """Stop ranks: those still alive after ``wait`` seconds are killed."""
    deadline = time.monotonic() + wait
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
    queue.close()


# ---- rank pools: ranks kept alive across calls inside a rank_pool() scope ----------------
POOL_ENV = "HP_TEST_POOL"
"""``0`` turns rank pools off: every call starts its own ranks, as outside a scope."""

_pool_scopes: list[int] = []  # one entry per open rank_pool() scope


class _Pool:
    """``world_size`` ranks waiting for calls (each call in a process group of its own)."""

    def __init__(self, world_size: int, backend: str, threads: int) -> None:
        ctx = _context()
        self.queue = ctx.Queue()
        self.inboxes = [ctx.SimpleQueue() for _ in range(world_size)]
        self.calls = 0
        self.procs = [
            ctx.Process(
                target=_pool_rank_main,
                args=(r, world_size, backend, threads, list(sys.path), inbox, self.queue),
                daemon=True,
                name=f"hp-pool-rank-{r}",
            )
            for r, inbox in enumerate(self.inboxes)
        ]
        _start(self.procs)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, payload: bytes, timeout: float) -> list[Any]:
        self.calls += 1
        port = free_port()
        for inbox in self.inboxes:
            inbox.put((self.calls, port, timeout, payload))
        return _collect(self.procs, self.queue, self.calls, timeout)

    def close(self, kill: bool = False) -> None:
        if not kill and self.alive():
            for inbox in self.inboxes:
                inbox.put(None)
        _end(self.procs, self.queue, wait=0.0 if kill else 10.0)


_pools: dict[tuple[int, str, int], _Pool] = {}


def _run_pooled(
    payload: bytes, world_size: int, backend: str, timeout: float, threads: int
) -> list[Any]:
    key = (world_size, backend, threads)
    pool = _pools.pop(key, None)
    if pool is not None and not pool.alive():
        pool.close(kill=True)
        pool = None
    if pool is None:
        pool = _Pool(world_size, backend, threads)
    try:
        results = pool.run(payload, timeout)
    except BaseException:
        pool.close(kill=True)  # a rank failed or hangs: its peers may be inside a collective
        raise
    _pools[key] = pool
    return results


def close_pools() -> None:
    """End every pooled rank."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


@contextmanager
def rank_pool() -> Iterator[None]:
    """Within this scope :func:`run_distributed` keeps each call's ranks alive for the next call
    with the same ``world_size``, ``backend`` and ``threads`` (see the module docstring); they
    end when the outermost scope closes."""
    _pool_scopes.append(1)
    try:
        yield
    finally:
        _pool_scopes.pop()
        if not _pool_scopes:
            close_pools()


# torch 2.10's gloo prints "[Gloo] Rank R is connected to K peer ranks. Expected number of
# connected peer ranks is : K" to stdout, once per rank and group, from C++: several ranks'
# copies may interleave with each other and with the example's own lines, so the message (and
# its two halves, when another write split it) is removed wherever it appears
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer "
    r"ranks is : \d+\n?"
)
_GLOO_HEAD = re.compile(r"\[Gloo\] Rank (?=\[Gloo\]|\d+ is connected|$)", re.M)
_GLOO_TAIL = re.compile(
    r"\d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+\n?"
)


def strip_gloo_connected(text: str) -> str:
    """``text`` less the connection messages torch 2.10's gloo writes to stdout (see above);
    lines left empty by the removal are dropped."""
    text = _GLOO_TAIL.sub("", _GLOO_HEAD.sub("", _GLOO_CONNECTED.sub("", text)))
    return "".join(line for line in text.splitlines(keepends=True) if line.strip("\n") != "")


def run_markdown_example(path: str | os.PathLike[str], index: int = 0, timeout: float = 300) -> str:
    """Run the ``index``-th ```python block of a Markdown file as a script; return its stdout
    (less the connection lines torch 2.10's gloo prints, which are not the example's output).

    Documentation examples are part of the contract: each package's tests run its README
    example this way. Raises ``RuntimeError`` carrying the script's stderr if it fails."""
    text = open(path, encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    if len(blocks) <= index:
        raise ValueError(f"{path} has {len(blocks)} python block(s); asked for #{index}")
    with tempfile.TemporaryDirectory() as tmp:
        # a real file, so rank processes can import the example's functions from __main__
        script = os.path.join(tmp, "readme_example.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(blocks[index])
        done = subprocess.run(
            [sys.executable, script],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp,
            env={**os.environ, FORK_ENV: "1"},
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"README example {path}#{index} exited with {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return strip_gloo_connected(done.stdout)


# ---- consistency-mode test helpers (used by every layer's consistency tests) ---------------
def caught_inconsistency(fn: Callable[[], Any]) -> tuple[str, str] | None:
    """Inside a rank: run ``fn``; ``(field, message)`` of the
    :class:`~hyper_parallel.dtensor.InconsistentRanksError` it raised (after checking that the
    default group still works, i.e. no rank was left inside a collective), ``None`` if it
    returned. Any other exception propagates."""
    import torch
    import torch.distributed as dist

    from hyper_parallel.dtensor.consistency import InconsistentRanksError

    try:
        fn()
    except InconsistentRanksError as exc:
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size(), "the group is broken after the error"
        return exc.field, str(exc)
    return None


def assert_same_inconsistency(
    results: list[dict[str, Any]], expected: dict[str, tuple[str, str]]
) -> None:
    """In the caller: for each ``case -> (field, call)`` of ``expected``, every rank's
    ``results[rank][case]`` (a :func:`caught_inconsistency` result) is the same error, naming
    ``field``, starting with ``call``, and placing every rank in one of its ``ranks [...]``
    groups."""
    for case, (field, what) in expected.items():
        got = [r[case] for r in results]
        assert got[0] is not None, f"{case}: no error"
        assert all(g == got[0] for g in got), f"{case}: the ranks raised different errors {got}"
        assert got[0][0] == field, (case, got[0])
        msg = got[0][1]
        assert msg.startswith(what) and f"disagree on {field!r}" in msg, (case, msg)
        named = {int(r) for grp in re.findall(r"ranks \[([0-9, ]+)\]", msg) for r in grp.split(",")}
        assert named == set(range(len(results))), (case, msg)


def compare_under_link(
    cases: dict[str, Callable[[], Any]], latency_s: float, bytes_per_s: float = 1e9
) -> dict[str, dict[str, Any]]:
    """Inside a rank: run each case (returning a sequence of tensors: outputs, gradients) once
    plainly and once under :func:`~hyper_parallel.dtensor.simlink.simulated_link`; per case,
    ``equal`` (bitwise, per tensor), ``count`` (tensors compared), ``collectives`` and
    ``modeled_s`` (what the link carried, so a case that bypassed it is visible)."""
    import torch

    from hyper_parallel.dtensor.simlink import simulated_link

    res: dict[str, dict[str, Any]] = {}
    for name, fn in cases.items():
        plain = fn()
        with simulated_link(latency_s, bytes_per_s) as stats:
            linked = fn()
        res[name] = {
            "equal": [torch.equal(a, b) for a, b in zip(plain, linked)],
            "count": len(plain),
            "collectives": stats.collectives,
            "modeled_s": stats.modeled_s,
        }
    return res
