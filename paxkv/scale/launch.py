"""Starts one program as several JAX processes, each under a deadline.

On one machine (forced CPU devices, a free local port)::

    python -m paxkv.scale.launch --processes 2 --devices 4 -- experiments.multiprocess --steps 8
    python -m paxkv.scale.launch --processes 2 --devices 4 -- path/to/script.py --flag

starts processes 0..N-1 of ``python -m <module>`` (or ``python <script>.py``) with
``PAXKV_COORDINATOR=127.0.0.1:<port>``, ``PAXKV_NUM_PROCESSES``, ``PAXKV_PROCESS_ID`` and, with
``--devices``, ``JAX_NUM_CPU_DEVICES`` / ``JAX_PLATFORMS=cpu``; the program calls
:func:`paxkv.scale.distributed.initialize`, which reads them. Children start in the launcher's
directory with it on ``PYTHONPATH`` (a script elsewhere imports modules from here, as ``-m``
does) and, in a checkout, the checkout too (``experiments.*`` runs from any directory). Every
output line comes back prefixed
``[p<id>]``. If a process exits non-zero, or the deadline (``--timeout``) passes, the others
are killed and the launcher exits non-zero naming the culprit: a stuck collective (gloo waits
for a peer that died) cannot hang a CI job.

On a cluster, run the same command on every host, one process per host, with the
coordinator (host 0's address and a port open between hosts) and this host's id::

    python -m paxkv.scale.launch --processes 4 --coordinator host0:8476 --process-ids 2 -- \\
        experiments.multiprocess --steps 8

No ``--devices``: each process uses its host's accelerators. The program is unchanged.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from paxkv.scale import distributed

GRACE_S = 5.0  # between SIGTERM and SIGKILL of a process being stopped
# The folder holding the paxkv package the launcher runs from; a checkout (pyproject.toml
# beside it) also holds experiments/, which children can then import from any directory.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it; a small race remains)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(target: str, args: Sequence[str]) -> list[str]:
    """``python <target>.py args`` for a script path, ``python -m <target> args`` else."""
    if target.endswith(".py") or os.sep in target:
        return [sys.executable, target, *args]
    return [sys.executable, "-m", target, *args]


def environment(coordinator: str, processes: int, pid: int,
                devices: int | None) -> dict[str, str]:
    """Process ``pid``'s environment: this one's plus the variables
    :func:`paxkv.scale.distributed.initialize` reads (and forced CPU devices with ``devices``),
    with ``PYTHONPATH`` led by the current directory and ending with the checkout :data:`ROOT`
    (when it is one)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    checkout = [ROOT] if os.path.isfile(os.path.join(ROOT, "pyproject.toml")) else []
    paths = [os.getcwd(), *env.get("PYTHONPATH", "").split(os.pathsep), *checkout]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env.update({distributed.COORDINATOR: coordinator,
                distributed.NUM_PROCESSES: str(processes), distributed.PROCESS_ID: str(pid)})
    if devices is not None:
        env.update(JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    return env


def _relay(pid: int, stream: IO[str], out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"[p{pid}] {line}")
            out.flush()


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    """SIGTERM every process still running (its whole group), SIGKILL after a grace."""
    running = [p for p in procs.values() if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the group is the process and its children
    except ProcessLookupError:
        pass  # it ended meanwhile


def _wait(procs: dict[int, subprocess.Popen], timeout: float) -> tuple[int, int] | None:
    """Until every process ends or one fails: ``None`` when all exited 0, else ``(process id,
    exit code)`` of the first failure (124: still running at the deadline)."""
    deadline = time.monotonic() + timeout
    while None in [p.poll() for p in procs.values()]:  # poll() every one: it sets returncode
        failed = [(pid, p.returncode) for pid, p in procs.items() if p.returncode]
        if failed:
            return failed[0]
        if time.monotonic() > deadline:
            stuck = [pid for pid, p in procs.items() if p.returncode is None]
            print(f"paxkv.scale.launch: deadline of {timeout:.0f} s passed; still running: {stuck}",
                  file=sys.stderr)
            return stuck[0], 124
        time.sleep(0.1)
    return next(((pid, p.returncode) for pid, p in procs.items() if p.returncode), None)


def launch(argv: Sequence[str], *, processes: int, process_ids: Sequence[int] | None = None,
           devices: int | None = None, coordinator: str | None = None,
           timeout: float = 600.0, out: IO[str] = sys.stdout) -> int:
    """Runs ``argv`` (``[target, *args]``) as processes ``process_ids`` (default: all) of
    ``processes``; returns 0 when all exit 0, else the first failure's code (124 on the
    deadline), having killed the rest. A message on stderr says which process failed."""
    ids = list(range(processes)) if process_ids is None else list(process_ids)
    if not argv or not ids or any(not 0 <= i < processes for i in ids):
        raise ValueError(f"need a target and process ids in 0..{processes - 1}, got {argv!r}, "
                         f"{ids!r}")
    if coordinator is None and len(ids) < processes:
        raise ValueError("processes started on other hosts need --coordinator host:port")
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    lock, procs, relays = threading.Lock(), {}, []
    for pid in ids:
        procs[pid] = subprocess.Popen(
            command(argv[0], argv[1:]), env=environment(coordinator, processes, pid, devices),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        relays.append(threading.Thread(target=_relay, args=(pid, procs[pid].stdout, out, lock),
                                       daemon=True))
        relays[-1].start()
    try:
        failure = _wait(procs, timeout)
    finally:
        _stop(procs)
        for t in relays:
            t.join(timeout=GRACE_S)
    if failure is None:
        return 0
    pid, code = failure
    print(f"paxkv.scale.launch: process {pid} failed (exit {code}); stopped the others",
          file=sys.stderr)
    return code if code > 0 else 1  # a signal's negative code, too


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paxkv.scale.launch", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --processes N [--devices D] [--timeout S] -- TARGET [ARGS...]")
    parser.add_argument("--processes", type=int, required=True, help="processes in all")
    parser.add_argument("--devices", type=int, help="forced CPU devices per process")
    parser.add_argument("--coordinator", help="host:port of process 0 (default: a free "
                        "local port)")
    parser.add_argument("--process-ids", type=int, nargs="+",
                        help="which processes to start here (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all")
    parser.add_argument("target", nargs=argparse.REMAINDER,
                        help="-- then a module or a .py script, and its arguments")
    args = parser.parse_args(argv)
    target = args.target[1:] if args.target[:1] == ["--"] else args.target
    if not target:
        parser.error("name a module or script after --")
    return launch(target, processes=args.processes, process_ids=args.process_ids,
                  devices=args.devices, coordinator=args.coordinator, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
