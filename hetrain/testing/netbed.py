"""A cluster of nodes on one machine: one network namespace per node, joined by shaped links.

Benchmarks and tests that are about links (a pipeline send over a slow inter-node link, the
gradient all-reduce of GPUs sharing one NIC) need the bytes to really cross a link of known
speed; on loopback every transfer is as fast as memory. ``NetBed`` builds that from kernel
parts, no user-space proxy in the path:

* a namespace per node (``hetrain-<tag>-<k>``) with loopback and one interface ``eth0``,
  address ``198.18.0.<k+1>/24`` (198.18.0.0/15 is reserved for network test beds, RFC 2544:
  it exists only inside the namespaces made here, so nothing else on the machine is reached);
* a bridge in a namespace of its own (``hetrain-<tag>-br``), so the host's own network is
  never touched; each node's veth pair runs from its ``eth0`` to a port of that bridge;
* a node's link shaped with ``tc ... tbf`` on both ends of its veth (this kernel has tbf, not
  netem): egress on ``eth0`` caps what the node sends, egress on the bridge port what it
  receives. One veth per node is one NIC per node: every process of the node shares it,
  as the GPUs of a node with one NIC do.

Processes run inside a node with ``bed.exec_argv(node, argv)`` (``ip netns exec``). Traffic
between processes of one node stays on that namespace (unshaped, as GPUs of a node talk over
NVLink or PCIe). Gloo must be told which interface carries inter-node traffic:
``bed.env(node)`` gives ``GLOO_SOCKET_IFNAME``.

``down()`` kills every process left in the namespaces and deletes them (the veths and the
bridge go with them); it runs on exit of the ``with`` block and when ``up()`` fails half
way. ``remove_stale()`` deletes namespaces that earlier beds of dead processes left behind.
Needs root and ``ip``/``tc`` (iproute2); ``available()`` says whether this machine allows it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "hetrain-"
SUBNET = "198.18.0"  # RFC 2544 benchmarking range: exists only inside the namespaces made here
INTERFACE = "eth0"  # each node's one NIC, inside its namespace
RENDEZVOUS_PORT = 29500  # free in a fresh namespace
TBF_LATENCY_MS = 50  # how long tbf may queue a packet: enough for bursts of a few MB at 100 Mbit/s


class NetBedError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetBedError(f"ip {' '.join(args)}: {_last_line(result)}")
    return result


def _last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr.strip() or result.stdout.strip() or "failed").splitlines()
    return lines[-1]


def available() -> tuple[bool, str]:
    """(whether network namespaces can be made here, why not)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"  # named like a bed's, so remove_stale finds it if this process dies
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {_last_line(made)}"
    _ip("netns", "delete", probe, check=False)
    return True, ""


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_namespace_processes(ns: str, grace_s: float = 3.0) -> None:
    """Stop every process in network namespace ``ns`` (SIGTERM, then SIGKILL after ``grace_s``); a node that is lost."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _ip("netns", "pids", ns, check=False).stdout.split():
            time.sleep(0.1)


def remove_stale() -> list[str]:
    """Delete namespaces left by beds whose process is gone (the tag names the pid); returns them."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        tag = ns[len(PREFIX):].split("-")[0]
        if tag.isdigit() and not os.path.exists(f"/proc/{tag}"):
            kill_namespace_processes(ns)
            _ip("netns", "delete", ns, check=False)
            removed.append(ns)
    return removed


@dataclass(frozen=True)
class BedNode:
    name: str  # the cluster's node name
    namespace: str
    address: str
    rate_mbit: float | None  # its link's cap, both directions; None: unshaped


class NetBed:
    """Nodes as network namespaces on one bridge; ``rate_mbit[node]`` caps a node's link (both ways)."""

    def __init__(self, nodes: list[str], rate_mbit: dict[str, float | None] | float | None = None) -> None:
        if not nodes:
            raise NetBedError("a test bed needs at least one node")
        if len(nodes) > 250:
            raise NetBedError(f"{len(nodes)} nodes: one /24 holds at most 250")
        self.tag = str(os.getpid()) + "-" + os.urandom(2).hex()
        rates = rate_mbit if isinstance(rate_mbit, dict) else {n: rate_mbit for n in nodes}
        self.nodes = {
            name: BedNode(name, f"{PREFIX}{self.tag}-{k}", f"{SUBNET}.{k + 1}", rates.get(name))
            for k, name in enumerate(nodes)
        }
        self.bridge_ns = f"{PREFIX}{self.tag}-br"
        self._made: list[str] = []
        self._relays: list[subprocess.Popen] = []  # host-side relays (those inside die with their namespace)

    # -- building
    def up(self) -> NetBed:
        remove_stale()
        try:
            self._add_ns(self.bridge_ns)
            self._in(self.bridge_ns, "link", "add", "br0", "type", "bridge")
            self._in(self.bridge_ns, "link", "set", "br0", "up")
            for k, node in enumerate(self.nodes.values()):
                self._add_node(k, node)
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        self._in(ns, "link", "set", "lo", "up")

    def _in(self, ns: str, *args: str) -> None:
        _ip("-n", ns, *args)

    def _add_node(self, k: int, node: BedNode) -> None:
        self._add_ns(node.namespace)
        port = f"p{k}"
        # made inside the node's namespace, the peer end moved to the bridge's: no name ever exists on the host
        self._in(node.namespace, "link", "add", INTERFACE, "type", "veth", "peer", "name", port,
                 "netns", self.bridge_ns)
        self._in(node.namespace, "addr", "add", f"{node.address}/24", "dev", INTERFACE)
        self._in(node.namespace, "link", "set", INTERFACE, "up")
        self._in(self.bridge_ns, "link", "set", port, "master", "br0")
        self._in(self.bridge_ns, "link", "set", port, "up")
        if node.rate_mbit is not None:
            self._shape(node.namespace, INTERFACE, node.rate_mbit)  # what the node sends
            self._shape(self.bridge_ns, port, node.rate_mbit)  # what it receives

    @staticmethod
    def _shape(ns: str, dev: str, rate_mbit: float) -> None:
        # burst: 10 ms at the rate (the kernel's timer granularity), at least a few packets. Not more:
        # a bucket lets that many bytes through at the veth's speed after the link idles, which no link of
        # this rate does (a 32-packet floor let gpt-small's 32-64 KB pipeline sends cross a 10 Mbit/s link
        # about 1.4x faster than its rate: bench/predict_vs_measure's small-slowlink group)
        burst = max(int(rate_mbit * 1e6 / 8 / 100), 4 * 1514)
        result = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                                 "rate", f"{rate_mbit:g}mbit", "burst", str(burst),
                                 "latency", f"{TBF_LATENCY_MS}ms"], capture_output=True, text=True)
        if result.returncode != 0:
            raise NetBedError(f"tc on {dev} in {ns}: {_last_line(result)}")

    def down(self) -> None:
        """Kill what runs inside the bed and delete every namespace it made (idempotent)."""
        for proc in self._relays:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._relays.clear()
        for ns in reversed(self._made):
            kill_namespace_processes(ns)
            _ip("netns", "delete", ns, check=False)
        self._made.clear()

    def __enter__(self) -> NetBed:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- using
    def address(self, node: str) -> str:
        return self.nodes[node].address

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]

    def env(self, node: str) -> dict[str, str]:
        """Environment for processes of ``node``: gloo (and NCCL's socket transport) on the node's NIC."""
        return {"GLOO_SOCKET_IFNAME": INTERFACE, "NCCL_SOCKET_IFNAME": INTERFACE}

    def launch_commands(self, layout, run_id: str, port: int = RENDEZVOUS_PORT):
        """For ``hetrain.runtime.launch.launch(commands=...)``: each node's agent inside its namespace.

        The rendezvous is on the first node's address, each agent advertises its own (the
        namespaces share the host's name, which resolves to nothing they can reach).
        """
        from hetrain.runtime.launch import NodeCommand, node_commands

        missing = [n for n in layout.nodes if n not in self.nodes]
        if missing:
            raise NetBedError(f"the plan's nodes {missing} are not in the bed ({list(self.nodes)})")
        first = next(iter(layout.nodes))

        def commands(config_path) -> list[NodeCommand]:
            cmds = node_commands(layout, str(config_path), self.address(first), port, run_id,
                                 local_addresses={n: self.address(n) for n in layout.nodes})
            return [NodeCommand(c.node, {**c.env, **self.env(c.node)}, self.exec_argv(c.node, c.argv)) for c in cmds]

        return commands


    def forward(self, node: str, port: int, sockets_dir: str) -> int:
        """A port on the host's loopback that reaches ``port`` on ``node`` (returns the host port).

        For the test's own control plane (the Prefect API of a server inside the bed): two
        ``hetrain.testing.relay`` processes joined by a unix socket in ``sockets_dir``, so the
        host gets no address on the bed's network.
        """
        from hetrain.runtime.launch import free_port

        host_port = free_port()
        self._relay_pair(node, os.path.join(sockets_dir, f"{node}-{port}.sock"), inside=f"tcp:127.0.0.1:{port}",
                         outside=f"tcp:127.0.0.1:{host_port}", listen_inside=False, what=f"to {node}:{port}")
        return host_port

    def reach_host(self, node: str, host_port: int, sockets_dir: str) -> int:
        """A port on ``node``'s loopback that reaches ``host_port`` on the host's (returns the node's port).

        For what is node-local on a real machine and lives in the test here: a cloud's metadata
        endpoint (169.254.169.254 answers each VM about itself). Relays as in ``forward``.
        """
        from hetrain.runtime.launch import free_port

        node_port = free_port()  # free on the host; the node's loopback has nothing on it either way
        self._relay_pair(node, os.path.join(sockets_dir, f"host-{host_port}-{node}.sock"),
                         inside=f"tcp:127.0.0.1:{node_port}", outside=f"tcp:127.0.0.1:{host_port}",
                         listen_inside=True, what=f"from {node} to the host's port {host_port}")
        return node_port

    def _relay_pair(self, node: str, sock: str, *, inside: str, outside: str, listen_inside: bool, what: str) -> None:
        """Two relays joined by ``sock``: one in ``node``'s namespace on ``inside``, one on the host on ``outside``.

        The listening side of the pair is the one clients connect to (``inside`` when
        ``listen_inside``); the side listening on the unix socket starts first.
        """
        import sys

        relay = [sys.executable, "-m", "hetrain.testing.relay"]
        in_node = self.exec_argv(node, [*relay, *((inside, f"unix:{sock}") if listen_inside else (f"unix:{sock}", inside))])
        on_host = [*relay, *((f"unix:{sock}", outside) if listen_inside else (outside, f"unix:{sock}"))]
        pair = ((on_host, True), (in_node, False)) if listen_inside else ((in_node, False), (on_host, True))
        for argv, track in pair:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            if track:  # those inside die with their namespace
                self._relays.append(proc)
            if proc.stdout.readline().strip() != "ready":
                raise NetBedError(f"the relay {what} did not start")


def measure_link_mb_s(bed: NetBed, sender: str, receiver: str, num_bytes: int = 32 << 20) -> float:
    """MB/s of one TCP stream from ``sender`` to ``receiver``, both ends inside the bed.

    Timed by the receiver, from the connection to the last byte: the sender's process start (a
    second on a loaded machine, against a third of a second of transfer) is not the link's.
    """
    import sys

    port = 5201
    server = subprocess.Popen(bed.exec_argv(receiver, [sys.executable, "-c", (
        f"import socket,time;s=socket.socket();s.bind(('0.0.0.0',{port}));s.listen();print('up',flush=True);"
        "c,_=s.accept();t=time.perf_counter();n=0\n"
        "while (d:=c.recv(1<<20)): n+=len(d)\n"
        "print(n,time.perf_counter()-t)")]), stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "up":
            raise NetBedError(f"the receiver in {receiver} did not start")
        subprocess.run(bed.exec_argv(sender, [sys.executable, "-c", (
            f"import socket;s=socket.create_connection(('{bed.address(receiver)}',{port}));"
            f"s.sendall(b'x'*{num_bytes});s.close()")]), check=True, timeout=300)
        count, seconds = server.communicate(timeout=300)[0].split()
        received, elapsed = int(count), float(seconds)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if received != num_bytes:
        raise NetBedError(f"sent {num_bytes} bytes, {received} arrived")
    return received / elapsed / 1e6


if __name__ == "__main__":  # python -m hetrain.testing.netbed [MBIT]: build a 2-node bed, measure its link, remove it
    import sys

    ok, why = available()
    if not ok:
        sys.exit(f"netbed: {why}")
    rate = float(sys.argv[1]) if len(sys.argv) > 1 else 800.0
    with NetBed(["a", "b"], rate_mbit=rate) as bed:
        mb_s = measure_link_mb_s(bed, "a", "b")
        print(f"{mb_s:.1f} MB/s over a {rate:g} Mbit/s link ({rate / 8:g} MB/s)")
