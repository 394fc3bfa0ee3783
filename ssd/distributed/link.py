"""Links between the engine's processes: a target and its SSD draft worker
(ssd/speculative/link/protocol.py), a tensor-parallel model's ranks (engine/tensor_parallel.py).

Connecting: rank 0 hosts the rendezvous store on a socket it binds itself (127.0.0.1 for
processes it starts; the address the user names for ones started by hand), and gloo's own
sockets bind to that host too. Before the process group exists, every rank proves to rank 0
that it knows the run's secret, and rank 0 to it: HMAC-SHA256 over both sides' random nonces,
exchanged through the store. Blocking calls on a link run under a Watcher.
"""
import datetime
import hashlib
import hmac
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from ssd.errors import SSDError

TARGET, WORKER = 0, 1  # rank 0 (the target, or a tensor-parallel model's first rank) and an SSD worker
NO_TIMEOUT = datetime.timedelta(days=1)  # liveness is watched by rank 0, not by gloo
REFUSED = b"refused"  # rank 0's answer to a peer whose proof was wrong
T = TypeVar("T")


class LinkError(RuntimeError):
    """A linked process died, hung past its timeout, failed to authenticate or broke the protocol."""


# ---- messages ---------------------------------------------------------------------------------
def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on exactly host:port (port 0: any free port), for the store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(16)
    except OSError as e:
        s.close()
        raise SSDError(f"cannot listen at {host}:{port} for the draft worker: {e}") from e
    return s


def new_secret() -> str:
    return secrets.token_hex(32)


def _proof(secret: str, role: str, *nonces: bytes) -> bytes:
    return hmac.new(secret.encode(), role.encode() + b"".join(nonces), hashlib.sha256).digest()


def connect(host: str, port: int, rank: int, timeout: float, secret: str, *, backend: str | None = None,
            listener: socket.socket | None = None, world: int = 2, peers: str = "the draft worker"
            ) -> dist.ProcessGroup:
    """A group of `world` processes of its own (not the global default group, so several
    engines can live in one process): the target and a draft worker, or a tensor-parallel
    model's ranks. Rank 0 hosts the store on `listener` and chooses the backend; the others
    read it from there. Every rank authenticates with rank 0 before the group is made;
    `peers` names the other ranks in rank 0's error."""
    store = dist.TCPStore(host, port, world, rank == TARGET, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=None if listener is None else listener.fileno())
    if listener is not None:
        listener.detach()  # the store's server owns the socket now and closes it with the store
    mine = secrets.token_bytes(16)
    if rank == TARGET:
        store.set("ssd/nonce/target", mine)
        store.set("ssd/backend", backend or "gloo")
        for r in range(1, world):
            theirs = store.get(f"ssd/nonce/{r}")
            if not hmac.compare_digest(store.get(f"ssd/proof/{r}"), _proof(secret, f"rank {r}", mine, theirs)):
                store.set(f"ssd/proof/target/{r}", REFUSED)  # it fails now rather than at its timeout
                raise LinkError(f"{peers} did not prove it knows this run's secret"
                                + (f" (rank {r})" if world > 2 else ""))
            store.set(f"ssd/proof/target/{r}", _proof(secret, "target", theirs, mine))
    else:
        theirs = store.get("ssd/nonce/target")
        store.set(f"ssd/nonce/{rank}", mine)
        store.set(f"ssd/proof/{rank}", _proof(secret, f"rank {rank}", theirs, mine))
        proof = store.get(f"ssd/proof/target/{rank}")
        if proof == REFUSED:
            raise LinkError("rank 0 refused this process's secret")
        if not hmac.compare_digest(proof, _proof(secret, "target", mine, theirs)):
            raise LinkError("the target did not prove it knows this run's secret")
        backend = store.get("ssd/backend").decode()
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    options = dist.ProcessGroupGloo._Options()
    # gloo listens on the host given for the store (the loopback for a local worker), not on
    # whatever address this machine's hostname resolves to.
    local = host in ("127.0.0.1", "::1", "localhost")
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host if rank == TARGET or local else "")]
    options._timeout = NO_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, options)


class Watcher:
    """Runs blocking calls of the link (gloo's waits, connecting) in helper threads, watched: a
    call gives up when the peer process is gone or `timeout` seconds pass, and Ctrl-C
    interrupts it. gloo's waits block in C++ until done, and a timed-out gloo wait closes the
    link for good, so they cannot be sliced.

    A call given up on leaves its thread blocked in gloo until the peer dies or answers; gloo
    does not let it go otherwise (aborting the process group does not). The link's owner
    ends the peer, then `join`s those threads, before the process exits: one still inside
    gloo at exit kills the process ("terminate called without an active exception")."""

    def __init__(self, alive: Callable[[], bool], timeout: float, peer: str = "the draft worker"):
        self.alive, self.timeout, self.peer = alive, timeout, peer
        self._left: list[threading.Thread] = []

    def __call__(self, fn: Callable[[], T]) -> T:
        done, out, error = threading.Event(), [], []

        def run() -> None:
            try:
                out.append(fn())
            except Exception as e:  # the peer closed the connection, the store timed out, a bad proof, ...
                error.append(e)
            done.set()

        thread = threading.Thread(target=run, daemon=True, name="ssd-draft-wait")
        thread.start()
        deadline = time.monotonic() + self.timeout
        try:
            while not done.wait(0.05):
                if not self.alive():
                    raise LinkError(f"{self.peer} died")
                if time.monotonic() > deadline:
                    raise LinkError(f"{self.peer} did not answer within {self.timeout:.0f} s")
        except BaseException:  # given up on, or Ctrl-C: the thread is still in the call
            self._left.append(thread)
            raise
        if error:
            if isinstance(error[0], LinkError):
                raise error[0]
            # A dead worker shows up as a reset connection, often before the process is reaped.
            for _ in range(10):
                if not self.alive():
                    raise LinkError(f"{self.peer} died")
                time.sleep(0.05)
            raise LinkError(f"the link to {self.peer} broke: {error[0]}")
        return out[0]

    def wait(self, work: dist.Work) -> None:
        """Channel.wait, watched."""
        self(work.wait)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds in all for the threads of calls given up on (their peer
        ended or about to answer); whether none is left."""
        deadline = time.monotonic() + timeout
        for thread in self._left:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._left = [t for t in self._left if t.is_alive()]
        return not self._left


# ---- step messages ----------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SSDError(f"bad draft address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def die_with_parent(parent_pid: int | None) -> None:
    """A worker process (the draft's, a tensor-parallel rank): on Linux the kernel sends it
    SIGTERM when the parent dies, so none is left behind."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(0)
