"""Hosts a test makes of network namespaces, each linked to the test's own host by a veth pair.

Only addresses in 10.231.0.0/16 on the veth pairs created here are used, and
traffic goes only to them: each host is a /30, the database's side ``.1``,
the host's side ``.2``. Cutting a host's link (``cut``) is pulling its cable:
no packet passes, no connection is reset, both ends find out only by their
timeouts. ``remove`` deletes the namespace and the pair; call it in a finally.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import suppress

import pytest

NETWORK = "10.231"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def require() -> None:
    """Skip unless this process may make namespaces (root, iproute2, a kernel that allows it)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    probe = f"k2bprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"cannot create a network namespace here: {str(detail).strip()}")
    finally:
        with suppress(subprocess.CalledProcessError, OSError):
            _ip("netns", "delete", probe)


class Host:
    """Namespace ``k2b<pid>h<n>``; its link ``k2b<pid>v<n>`` here, ``k2b<pid>p<n>`` there."""

    def __init__(self, index: int) -> None:
        tag = f"k2b{os.getpid() % 100000}"
        self.ns = f"{tag}h{index}"
        self.link = f"{tag}v{index}"
        peer = f"{tag}p{index}"
        # One /30 per host, distinct between concurrent test processes.
        third = (os.getpid() % 60) * 4 + index
        self.server_address = f"{NETWORK}.{third}.1"
        self.address = f"{NETWORK}.{third}.2"
        self.created = False
        try:
            _ip("netns", "add", self.ns)
            self.created = True
            _ip("link", "add", self.link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", self.ns)
            _ip("addr", "add", f"{self.server_address}/30", "dev", self.link)
            _ip("link", "set", self.link, "up")
            _ip("-n", self.ns, "addr", "add", f"{self.address}/30", "dev", peer)
            _ip("-n", self.ns, "link", "set", peer, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    def prefix(self) -> list[str]:
        """Run a command on this host: ``[*host.prefix(), cmd, ...]``."""
        return ["ip", "netns", "exec", self.ns]

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def mend(self) -> None:
        _ip("link", "set", self.link, "up")

    def remove(self) -> None:
        # Deleting one end of a veth pair deletes the other; the namespace goes with its end.
        with suppress(subprocess.CalledProcessError, OSError):
            _ip("link", "delete", self.link)
        if self.created:
            with suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "delete", self.ns)
