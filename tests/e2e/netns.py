"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for multi-node
tests. Private addresses 10.231.N.1 and 10.231.N.2 on the pair only; nothing else is routed."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (no `ip`, not root, no netns support), else None."""
    probe = f"psprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` failed: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class TwoHosts:
    names: tuple[str, str]
    addresses: tuple[str, str]

    @classmethod
    def create(cls) -> "TwoHosts":
        tag = os.getpid() % 10000
        names = (f"ps{tag}a", f"ps{tag}b")
        subnet = 10 + os.getpid() % 240
        addresses = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")
        hosts = cls(names, addresses)
        try:
            for name in names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            _ip("link", "add", f"{names[0]}v", "type", "veth", "peer", "name", f"{names[1]}v")
            for name, address in zip(names, addresses):
                _ip("link", "set", f"{name}v", "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{name}v")
                _ip("-n", name, "link", "set", f"{name}v", "up")
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def command(self, host: int, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def listening(self, host: int) -> list[str]:
        """Local addresses of the tcp sockets listening in host's namespace."""
        out = subprocess.run(self.command(host, "ss", "-ltnH"), check=True, capture_output=True,
                             text=True, timeout=30).stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def remove(self) -> None:
        """Deleting a namespace deletes its end of the veth pair, and so the pair."""
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
