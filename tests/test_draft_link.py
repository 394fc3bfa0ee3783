"""The link between the target and an SSD draft worker (ssd/speculative/link/protocol.py): messages
bounded before anything is allocated, both sides proving the run's secret, and sockets that
listen on the loopback only."""
import ipaddress
import os
import subprocess
import sys
import threading

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.distributed.link import TARGET, WORKER, LinkError, Watcher, connect, listen_socket
from ssd.speculative.link.protocol import Channel

# A worker side that sends one good message, then headers announcing ~1 TiB of JSON and
# ~4 TiB of floats (neither body follows), and stays connected until its stdin closes.
OVERSIZED = """
import sys, torch
from ssd.distributed.link import TARGET, WORKER, connect
from ssd.speculative.link.protocol import Channel
pg = connect("127.0.0.1", int(sys.argv[1]), WORKER, 30, sys.argv[2])
Channel(pg, TARGET, torch.device("cpu")).send({"type": "ping"})
for header in ([2**40, 0], [16, 2**40]):
    pg.send([torch.tensor(header)], TARGET, 0).wait()
sys.stdin.read()
"""


def test_recv_refuses_a_header_beyond_the_limits_before_allocating():
    listener = listen_socket("127.0.0.1")
    peer = subprocess.Popen([sys.executable, "-c", OVERSIZED, str(listener.getsockname()[1]), "s3cret"],
                            stdin=subprocess.PIPE)
    try:
        pg = connect("127.0.0.1", listener.getsockname()[1], TARGET, 30, "s3cret", listener=listener)
        channel = Channel(pg, WORKER, torch.device("cpu"))
        # Watched: a receive that waited for a body that never comes fails on the deadline,
        # and an allocation of 1 TiB that failed is a different LinkError ("the link ... broke").
        recv = lambda: Watcher(lambda: peer.poll() is None, 20)(channel.recv)  # noqa: E731
        assert recv() == ({"type": "ping"}, None)
        for size, floats in ((2**40, 0), (16, 2**40)):
            with pytest.raises(LinkError, match=f"a message header of {size} bytes and {floats} floats, "
                                                "beyond what this link allows"):
                recv()
    finally:
        peer.stdin.close()
        try:
            peer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()


def test_a_worker_with_the_wrong_secret_is_refused():
    listener = listen_socket("127.0.0.1")
    port, worker_errors = listener.getsockname()[1], []

    def worker() -> None:
        try:
            connect("127.0.0.1", port, WORKER, 5, "b")
        except Exception as e:  # the target hung up (or the store timed out): no process group
            worker_errors.append(e)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    # Watched: a target that took the worker would wait for it in gloo's set-up for good.
    with pytest.raises(LinkError, match="the draft worker did not prove it knows this run's secret"):
        Watcher(lambda: True, 20)(lambda: connect("127.0.0.1", port, TARGET, 5, "a", listener=listener))
    thread.join(timeout=30)
    assert not thread.is_alive() and len(worker_errors) == 1


def _ip(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} write it: hex, each 32-bit word in host byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def listening(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket that process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    address, port = cols[1].split(":")
                    found.append((_ip(address), int(port, 16)))
    return found


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                              and ip.ipv4_mapped.is_loopback)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_target_and_its_worker_listen_on_the_loopback_only(smollm_dir, truncated_draft):
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd") as llm:
        llm.generate("Hello", SamplingParams.greedy(max_tokens=8, ignore_eos=True))
        assert llm.draft_failures == 0
        sockets = {"target": listening(os.getpid()), "worker": listening(llm.engine.source.proc.pid)}
    assert sockets["target"] and sockets["worker"], sockets  # the rendezvous store's and gloo's
    assert all(_loopback(ip) for found in sockets.values() for ip, _ in found), sockets
