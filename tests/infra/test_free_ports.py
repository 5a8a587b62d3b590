"""Ports handed out to servers come from below the kernel's ephemeral range, so no outgoing
connection can take one between its pick and its server binding it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import infra.ports
from infra.ports import free_ports
from infra.startup import check_port_free


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(50)
    assert len(set(ports)) == 50
    assert all(1024 <= port < low for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_is_not_handed_out_twice_before_its_server_binds_it() -> None:
    # Each pick is released at once, as before a service starts: later picks must still avoid it.
    picked = [port for _ in range(300) for port in free_ports(3)]
    assert len(set(picked)) == len(picked)


def test_a_port_checked_free_for_a_server_is_never_picked_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `laneway up` checks the user's HTTP port, then picks ports for NATS, etcd and every
    # service's metrics before the ingress binds it: none of those picks may be that port.
    with socket.socket() as sock:  # not from free_ports, which keeps its own picks clear
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    check_port_free("127.0.0.1", port, "HTTP", "--port")
    monkeypatch.setenv("LANEWAY_PORT_RANGE", f"{port}-{port}")
    assert port not in free_ports(4)


def test_ports_come_from_the_range_given(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = infra.ports.unephemeral_ports()
    assert ports is not None
    low = ports.start + 100
    monkeypatch.setenv("LANEWAY_PORT_RANGE", f"{low}-{low + 49}")
    picked = free_ports(20)
    assert all(low <= port <= low + 49 for port in picked), picked


@pytest.mark.parametrize("given", ["30000", "a-b", "80-90", "40000-70000", "5000-4000"])
def test_a_range_that_is_no_range_of_ports_is_refused(
    monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    monkeypatch.setenv("LANEWAY_PORT_RANGE", given)
    with pytest.raises(ValueError, match="LANEWAY_PORT_RANGE"):
        free_ports(1)
