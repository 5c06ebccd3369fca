"""Rendezvous stores bound to the node's own address.

torch's `TCPStore` master listens on every interface when it opens its own socket. The stores
raygraph hosts (a role's torch.distributed group, the weight-sync group) instead get a socket
bound here to the node's IP (the address Ray uses for the node), created before its address is
handed out, so no other process can take the port in between. Neither torch's store nor gloo
authenticates peers: what a cluster operator must firewall is in docs/guarantees.md.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["listening_socket", "master_store", "member_store"]


def listening_socket(ip: str) -> socket.socket:
    """A TCP socket listening on `ip` (not 0.0.0.0) at a port the OS picks."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))
    sock.listen(128)
    return sock


def master_store(sock: socket.socket, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The store's master on `sock` (from `listening_socket`); the store takes the socket over."""
    ip, port = sock.getsockname()[:2]
    return dist.TCPStore(ip, port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def member_store(ip: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store at `ip:port`."""
    return dist.TCPStore(ip, port, world_size, False, timedelta(seconds=timeout_s))
