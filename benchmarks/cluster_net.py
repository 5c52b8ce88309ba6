"""The emulated network of ``benchmarks/cluster.py``: one namespace per host, a switch namespace, rate-limited veths.

Topology (every name carries this process's pid, so parallel runs do not clash)::

    host namespace  sps<pid>h<i>            switch namespace  sps<pid>sw
      eth0 10.200.0.<i+1>/16 ---- veth ---- p<i>  --+
                                                     +-- bridge br0 (no address)
      ... one per worker and per shard host ...  ---+

Each host's link is limited in both directions with a token bucket
(``tc qdisc ... tbf``): on egress of the host end ``eth0`` (what the host
sends) and on egress of the switch end ``p<i>`` (what the host receives),
so every host has a full-duplex link of ``rate`` bits/s to a non-blocking
switch; an optional ``netem`` delay (one way, milliseconds) sits on the
switch end. Addresses come from 10.200.0.0/16 and exist only inside these
namespaces: nothing is routed anywhere else, and no address or route is
added to the root namespace.

Bytes per link are read from the switch ends' counters (``ip -s -j link``
in the switch namespace): ``rx_bytes`` of ``p<i>`` is what host ``i`` sent,
``tx_bytes`` what it received, Ethernet, IP and TCP headers included.

TCP's congestion control is a host's setting: every host namespace runs
the one a new namespace gets from this kernel (usually the root
namespace's, e.g. ``bbr`` or ``cubic``) unless ``congestion`` names another
(``net.ipv4.tcp_congestion_control`` set in each host namespace; one not in
the root namespace's ``net.ipv4.tcp_allowed_congestion_control`` is refused
by the kernel there).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

SUBNET_PREFIX = "10.200."
HOST_QDISCS = ("fifo", "fair")
MTU = 1500


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (no shell); raise with its stderr when ``check`` and it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def probe() -> str | None:
    """None if this process can make network namespaces, veths and tbf qdiscs; else the reason it cannot."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    name = f"spsprobe{os.getpid()}"
    made = run("ip", "netns", "add", name, check=False)
    if made.returncode != 0:
        return ("cannot create a network namespace (needs CAP_NET_ADMIN: run as root, or in a user namespace "
                f"that grants it where the kernel allows, e.g. `unshare -Urnm`): {made.stderr.strip()}")
    try:
        steps = [("ip", "-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0"),
                 ("ip", "-n", name, "link", "add", "br0", "type", "bridge"),
                 ("tc", "-n", name, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "100mbit", "burst", "32kb",
                  "latency", "100ms")]
        for step in steps:
            proc = run(*step, check=False)
            if proc.returncode != 0:
                return f"`{' '.join(step)}` failed: {proc.stderr.strip()}"
    finally:
        run("ip", "netns", "del", name, check=False)
    return None


def available_congestion_controls() -> list[str]:
    """The TCP congestion controls this kernel has loaded (``net.ipv4.tcp_available_congestion_control``)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def burst_bytes(rate_bit: float) -> int:
    """The bucket of a link at ``rate_bit`` bits/s: ~2 ms of its bytes, at least 32 KiB."""
    return max(32 << 10, int(rate_bit / 8 * 0.002))


def tbf_args(rate_bit: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``rate_bit`` bits/s: a burst of ``burst_bytes``, 100 ms of queue."""
    return ["tbf", "rate", f"{int(rate_bit)}bit", "burst", str(burst_bytes(rate_bit)), "latency", "100ms"]


class Network:
    """The namespaces, veths and bridge of one run; :meth:`destroy` removes all of them (idempotent).

    Args:
        hosts: host names in order (``w0``, ``s0``, ...); host ``i`` gets 10.200.0.<i+1>.
        rates_bit: each host's link rate in bits/s, both directions.
        delay_ms: one-way delay added on the switch end of every link (``netem``), milliseconds; 0: none.
        host_qdisc: how a host's own egress queue is served: ``"fifo"`` (the token bucket's one queue, the
            default) or ``"fair"`` (the host's rate shared evenly among the hosts it sends to: HTB, one class
            per peer with an even guaranteed share and the whole rate as ceiling, classified by destination
            address; what ``fq``/``fq_codel`` do per flow on a real host, which this machine's kernel lacks).
            The switch ends stay FIFO, as a switch port is.
        congestion: the TCP congestion control of every host (``reno``, ``cubic``, ``bbr``: one of
            :func:`available_congestion_controls`); None: what a new namespace gets. :attr:`congestion_in_use`
            says which one ran, after :meth:`create`.

    Raises:
        ValueError: more than 250 hosts, an unknown ``host_qdisc``, or a ``congestion`` this kernel lacks
            (the message lists the ones it has).
    """

    def __init__(self, hosts: list[str], rates_bit: dict[str, float], delay_ms: float = 0.0,
                 host_qdisc: str = "fifo", congestion: str | None = None) -> None:
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts")
        if congestion is not None and congestion not in (have := available_congestion_controls()):
            raise ValueError(f"TCP congestion control {congestion!r} is not loaded in this kernel; it has {have} "
                             "(net.ipv4.tcp_available_congestion_control)")
        self.congestion = congestion
        self.congestion_in_use: str | None = None
        self.tag = f"sps{os.getpid()}"
        self.switch = f"{self.tag}sw"
        self.hosts = hosts
        self.rates_bit = dict(rates_bit)
        self.delay_ms = delay_ms
        if host_qdisc not in HOST_QDISCS:
            raise ValueError(f"host_qdisc must be one of {HOST_QDISCS}, not {host_qdisc!r}")
        self.host_qdisc = host_qdisc
        self.namespaces: list[str] = []  # created, in order
        self.ns = {h: f"{self.tag}h{i}" for i, h in enumerate(hosts)}
        self.address = {h: f"{SUBNET_PREFIX}0.{i + 1}" for i, h in enumerate(hosts)}
        self.port = {h: f"p{i}" for i, h in enumerate(hosts)}

    def _add_ns(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self.namespaces.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def create(self) -> "Network":
        """Make the switch, every host namespace, its veth, address and token buckets."""
        self._add_ns(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ns, port = self.ns[host], self.port[host]
            self._add_ns(ns)
            # both ends are created straight inside their namespaces: no name ever appears in the root namespace
            run("ip", "-n", self.switch, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            run("ip", "-n", self.switch, "link", "set", port, "up")
            run("ip", "-n", ns, "addr", "add", f"{self.address[host]}/16", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._set_congestion(ns)
            rate = self.rates_bit[host]
            if self.host_qdisc == "fair":
                self._fair_egress(host, rate)
            else:
                run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf_args(rate))
            if self.delay_ms > 0:
                run("tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", "handle", "1:", *tbf_args(rate))
                run("tc", "-n", self.switch, "qdisc", "add", "dev", port, "parent", "1:1", "handle", "10:", "netem",
                    "delay", f"{self.delay_ms}ms", "limit", "100000")
            else:
                run("tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *tbf_args(rate))
        return self

    def set_rate(self, host: str, rate_bit: float) -> None:
        """Change ``host``'s link to ``rate_bit`` bits/s in both directions, at once, connections kept (``tc qdisc
        change`` of both token buckets: a test slows one host's link down once its processes are up).

        Raises:
            ValueError: ``host_qdisc`` is ``"fair"`` (its classes are set at :meth:`create` only).
        """
        if self.host_qdisc != "fifo":
            raise ValueError("set_rate changes the links of host_qdisc 'fifo' only")
        ns, port = self.ns[host], self.port[host]
        run("tc", "-n", ns, "qdisc", "change", "dev", "eth0", "root", *tbf_args(rate_bit))
        handle = ["handle", "1:"] if self.delay_ms > 0 else []
        run("tc", "-n", self.switch, "qdisc", "change", "dev", port, "root", *handle, *tbf_args(rate_bit))
        self.rates_bit[host] = rate_bit

    def _set_congestion(self, ns: str) -> None:
        """Give namespace ``ns`` the congestion control asked for (if any) and record the one it runs."""
        key = "net.ipv4.tcp_congestion_control"
        if self.congestion is not None:
            proc = run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={self.congestion}", check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"cannot set {key}={self.congestion} in the host namespaces "
                                   f"({proc.stderr.strip()}): add it to the root namespace's "
                                   "net.ipv4.tcp_allowed_congestion_control, or pick an allowed one")
        self.congestion_in_use = run("ip", "netns", "exec", ns, "sysctl", "-n", key).stdout.strip()

    def _fair_egress(self, host: str, rate: float) -> None:
        """``host``'s egress at ``rate`` bits/s, shared evenly among the hosts it sends to (HTB, one class each)."""
        ns = self.ns[host]
        peers = [h for h in self.hosts if h != host]
        share = rate / len(peers)
        burst = str(burst_bytes(rate))
        # unclassified packets (ARP) go to the first peer's class, 1:a
        run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "a")
        run("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb",
            "rate", f"{int(rate)}bit", "ceil", f"{int(rate)}bit", "burst", burst, "cburst", burst)
        for k, peer in enumerate(peers):
            cls = f"1:{k + 10:x}"
            run("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:1", "classid", cls, "htb",
                "rate", f"{int(share)}bit", "ceil", f"{int(rate)}bit", "burst", burst, "cburst", burst,
                "quantum", str(MTU))
            run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "parent", cls, "pfifo", "limit", "1000")
            run("tc", "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "dst", f"{self.address[peer]}/32", "flowid", cls)

    def counters(self) -> dict[str, tuple[int, int]]:
        """``{host: (bytes the host sent, bytes it received)}`` so far, from the switch ends' counters."""
        out = json.loads(run("ip", "-n", self.switch, "-s", "-j", "link", "show").stdout)
        by_port = {link["ifname"]: link["stats64"] for link in out if "stats64" in link}
        return {h: (by_port[p]["rx"]["bytes"], by_port[p]["tx"]["bytes"]) for h, p in self.port.items()}

    def exec_args(self, host: str) -> list[str]:
        """The command prefix that runs a program inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns[host]]

    def destroy(self) -> None:
        """Kill whatever still runs in the namespaces (only this run's processes can be there), then delete them.

        Deleting a namespace deletes the veth ends in it, and with them their
        peers and the qdiscs; the bridge goes with the switch namespace.
        """
        for ns in reversed(self.namespaces):
            pids = run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.namespaces):
            run("ip", "netns", "del", ns, check=False)
        self.namespaces = []


def list_namespaces() -> set[str]:
    """Names of the network namespaces ``ip netns`` knows now."""
    return {line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()}
