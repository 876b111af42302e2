"""Nodes in network namespaces on shaped links, for the network-change tests and the benchmark.

The topology: two islands, A and B, each a Linux bridge in the root namespace, joined by one
veth pair that is THE inter-island link. Every node is a namespace with one veth into its
island's bridge; inside the namespace that interface is called `eth0` (so one
GLOO_SOCKET_IFNAME and one inventory NIC name serve every node). All addresses are on one /24;
the root namespace holds .1 on island A's bridge (the coordinator listens there; island B's
nodes reach it across the inter-island link, as a remote site reaches its control plane).

Links are shaped with `htb` (this kernel has htb and tbf, not netem): the inter-island link on
both of its ends (A->B on A's end, B->A on B's), a node's link on both of its ends. `shape_link`
and `shape_node` change a rate while a job runs (`tc class replace`). The control plane, every
packet to or from the coordinator's address, rides a class of its own that the shaping leaves
alone, as it rides a cluster's management network: a data link slowed to a few Mbit/s and
filled by the ranks' traffic slows the data, and never starves the agents' heartbeats (which a
750 ms lease would take for a lost node; the tests are about link rates, not lost nodes).

Every name starts with `mt<pid>` (interfaces are at most 15 characters), so parallel runs never
clash, and `sweep_stale` removes what a run that was killed left behind (its pid is gone).
`Net.close` removes every namespace, veth, bridge and qdisc the run made. Processes started in a
namespace (`Net.argv`) must be ended before `close` (a namespace with live processes lingers
until they exit; `close` kills what is left in them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PREFIX_RE = re.compile(r"^mt(\d+)")
# Processes a run started outside its namespaces (the coordinator), by the run's prefix: a later
# run's sweep ends them when the run that started them is gone.
PID_DIR = "/tmp/motley-netns"


def _run(*argv: str, check: bool = True, ns: Optional[str] = None) -> subprocess.CompletedProcess:
    if ns is not None:
        argv = ("ip", "netns", "exec", ns, *argv)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def requirements() -> Optional[str]:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "the network-change tests make network namespaces, veths, bridges and tc qdiscs: run them as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network-change tests need `{tool}` (iproute2) on PATH"
    return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not reaped, does not)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _started(pid: int) -> str:
    """When `pid` started (/proc/PID/stat's 22nd field, clock ticks since boot); "" if gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[19]
    except (OSError, IndexError):
        return ""


def _made_by(name: str, prefix: str) -> bool:
    """Whether a namespace or link is of the run with this prefix (`mt<pid>`): the pid whole,
    so run 123 never takes run 1234's (every name's tail begins with a letter or `-`)."""
    m = PREFIX_RE.match(name)
    return bool(m) and f"mt{m.group(1)}" == prefix


def _namespaces() -> List[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> List[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _kill_in(ns: str):
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for p in pids:
        try:
            os.kill(int(p), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _kill_recorded(prefix: str):
    path = os.path.join(PID_DIR, f"{prefix}.pids")
    try:
        lines = open(path).read().split()
    except OSError:
        return
    for line in lines:
        try:
            p, started = line.split(":", 1)
            # Only the process that was recorded: the same pid and start time (not a reused pid).
            if _started(int(p)) == started and started != "":
                os.killpg(int(p), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    try:
        os.unlink(path)
    except OSError:
        pass


def sweep_stale():
    """Remove the namespaces and links of runs whose process is gone (a test killed halfway),
    and end the processes they started outside their namespaces."""
    try:
        recorded = os.listdir(PID_DIR)
    except OSError:
        recorded = []
    for name in recorded:
        m = PREFIX_RE.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_recorded(name[: -len(".pids")])
    for ns in _namespaces():
        m = PREFIX_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_in(ns)
            _run("ip", "netns", "del", ns, check=False)
    for link in _links():
        m = PREFIX_RE.match(link)
        if m and not _alive(int(m.group(1))):
            _run("ip", "link", "del", link, check=False)


def _subnet() -> int:
    """A 10.213.N.0/24 no route of this machine uses yet."""
    routes = _run("ip", "-4", "route", "show", check=False).stdout + _run("ip", "-4", "addr", "show", check=False).stdout
    for n in list(range(os.getpid() % 200 + 20, 250)) + list(range(20, 250)):
        if f"10.213.{n}." not in routes:
            return n
    raise RuntimeError("no free 10.213.N.0/24 subnet")


def _shaped(dev: str, ns: Optional[str]) -> bool:
    """Whether `dev` already has this module's htb tree (a root htb with handle 1:)."""
    return "htb 1: root" in _run("tc", "qdisc", "show", "dev", dev, check=False, ns=ns).stdout


def _shape(dev: str, mbit: float, control_ip: str, ns: Optional[str] = None):
    """`dev`'s egress held to `mbit` Mbit/s, but for the control plane (packets to or from
    `control_ip`), which passes in a class of its own at up to 1 Gbit/s. The data class's queue
    holds 100 ms of its rate; its bucket is small, 1 ms of the rate and 4 KiB at least: a burst
    at line rate is what a short probe would read as a faster link (three buckets lie on a path
    between two nodes of different islands)."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(4 * 1024, int(rate_bytes * 0.001))
    if not _shaped(dev, ns):
        _run("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "2", ns=ns)
        _run("tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "1gbit",
             "quantum", "60000", ns=ns)
        for way in ("src", "dst"):
            _run("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", way, f"{control_ip}/32", "flowid", "1:1", ns=ns)
    _run("tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", f"{mbit}mbit",
         "ceil", f"{mbit}mbit", "burst", str(burst), "cburst", str(burst), "quantum", "1514", ns=ns)
    _run("tc", "qdisc", "replace", "dev", dev, "parent", "1:2", "handle", "20:", "bfifo", "limit",
         str(int(rate_bytes * 0.1) + burst), ns=ns)


def _unshape(dev: str, ns: Optional[str] = None):
    _run("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)


def mounts():
    """This process's mounts from /proc/self/mountinfo: (mount point, file system type, mount
    options as a list), in order."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point = left.split()[4]
            fstype, _, opts = (right.split() + ["", "", ""])[:3]
            yield point, fstype, opts.split(",")


def cpu_cgroup_root() -> tuple:
    """Where CPU cgroups are made here: (the root of the hierarchy with the cpu controller, is it
    cgroup v2): cgroup v1's cpu hierarchy where one is mounted, else the unified tree when cpu
    is among its root's subtree controllers."""
    for point, fstype, opts in mounts():
        if fstype == "cgroup" and "cpu" in opts:
            return Path(point), False
    v2 = Path("/sys/fs/cgroup")
    control = v2 / "cgroup.subtree_control"
    if control.exists() and "cpu" in control.read_text().split():
        return v2, True
    raise RuntimeError("no cgroup hierarchy with the cpu controller (cgroup v1's cpu, or cgroup v2 with cpu in "
                       "/sys/fs/cgroup/cgroup.subtree_control)")


def cgroup_mounts() -> str:
    """A shell command that mounts, in a namespace `ip netns exec` made, the cgroup hierarchies
    that hold the CPU controller where the root namespace has them. `ip netns exec` mounts a
    fresh sysfs over /sys, which hides /sys/fs/cgroup and everything mounted below it, so an
    agent inside would find no CPU controller and refuse to emulate. Mounting a v1 hierarchy
    with the same controllers attaches the existing hierarchy (the same cgroups, the same
    quotas), as mounting cgroup2 attaches the one unified tree."""
    cmds = []
    for point, fstype, opts in mounts():
        if not point.startswith("/sys/fs/cgroup"):
            continue
        if point == "/sys/fs/cgroup" and fstype == "tmpfs":
            cmds.insert(0, "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup")
        elif fstype == "cgroup2":
            cmds.append(f"mkdir -p {point} && mount -t cgroup2 cgroup2 {point}")
        elif fstype == "cgroup" and "cpu" in opts:
            controllers = ",".join(o for o in opts if o in ("cpu", "cpuacct"))
            cmds.append(f"mkdir -p {point} && mount -t cgroup -o {controllers} cgroup {point}")
    if not cmds:
        raise RuntimeError("no cgroup hierarchy with the cpu controller under /sys/fs/cgroup to mount in a namespace")
    return " && ".join(cmds)


class Net:
    """Two islands of nodes in namespaces (see the module's doc). `islands`: island name ->
    node names (island names are one letter). `node_mbit`: each node link's rate (None:
    unshaped); `link_mbit`: the inter-island link's (None: unshaped)."""

    def __init__(self, islands: Dict[str, List[str]], node_mbit: Optional[float] = None,
                 link_mbit: Optional[float] = None):
        why = requirements()
        if why:
            raise RuntimeError(why)
        if len(islands) != 2 or any(len(i) != 1 for i in islands):
            raise ValueError("two islands, each named by one letter")
        sweep_stale()
        self.prefix = f"mt{os.getpid()}"
        assert len(self.prefix) <= 10, self.prefix
        self.islands = {k: list(v) for k, v in islands.items()}
        self.island_of = {n: k for k, v in islands.items() for n in v}
        self.nodes = [n for v in islands.values() for n in v]
        self.ns: Dict[str, str] = {}
        self.ip: Dict[str, str] = {}
        self.host_if: Dict[str, str] = {}
        self.bridges: Dict[str, str] = {}
        self.made_links: List[str] = []
        self.link_mbit: Optional[float] = None
        self.closed = False
        try:
            self._build(node_mbit, link_mbit)
        except BaseException:
            self.close()
            raise

    def _name(self, tail: str) -> str:
        name = f"{self.prefix}{tail}"
        assert len(name) <= 15, name
        return name

    def _build(self, node_mbit, link_mbit):
        self.subnet = _subnet()
        self.gateway = f"10.213.{self.subnet}.1"
        (a, la), (b, lb) = list(self.islands.items())
        for isl in (a, b):
            br = self._name(f"b{isl}")
            _run("ip", "link", "add", br, "type", "bridge", "forward_delay", "0")
            self.made_links.append(br)
            self.bridges[isl] = br
        # THE inter-island link: x<A> in A's bridge, x<B> in B's.
        self.xa, self.xb = self._name(f"x{a}"), self._name(f"x{b}")
        _run("ip", "link", "add", self.xa, "type", "veth", "peer", "name", self.xb)
        self.made_links.append(self.xa)
        _run("ip", "link", "set", self.xa, "master", self.bridges[a], "up")
        _run("ip", "link", "set", self.xb, "master", self.bridges[b], "up")
        for br in self.bridges.values():
            _run("ip", "link", "set", br, "up")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridges[a])
        for i, node in enumerate(self.nodes):
            ns = self._name(f"-{node}")
            _run("ip", "netns", "add", ns)
            self.ns[node] = ns
            host, peer = self._name(f"h{i}"), self._name(f"p{i}")
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            self.made_links.append(host)
            self.host_if[node] = host
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
            ip = f"10.213.{self.subnet}.{10 + i}"
            self.ip[node] = ip
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "set", host, "master", self.bridges[self.island_of[node]], "up")
        if node_mbit:
            self.shape_nodes(node_mbit)
        if link_mbit:
            self.shape_link(link_mbit)

    # ---- shaping ---------------------------------------------------------------------------

    def shape_link(self, mbit: Optional[float]):
        """The inter-island link's rate, both ways (None: unshaped)."""
        for dev in (self.xa, self.xb):
            if mbit:
                _shape(dev, mbit, self.gateway)
            else:
                _unshape(dev)
        self.link_mbit = mbit

    def shape_node(self, node: str, mbit: Optional[float]):
        """`node`'s link's rate, both ways (None: unshaped)."""
        if mbit:
            _shape(self.host_if[node], mbit, self.gateway)
            _shape("eth0", mbit, self.gateway, ns=self.ns[node])
        else:
            _unshape(self.host_if[node])
            _unshape("eth0", ns=self.ns[node])

    def shape_nodes(self, mbit: Optional[float]):
        """Every node link's rate, both ways (None: unshaped)."""
        for node in self.nodes:
            self.shape_node(node, mbit)

    def qdiscs(self) -> str:
        """`tc qdisc show` of the inter-island link's ends (for messages)."""
        return "\n".join(_run("tc", "qdisc", "show", "dev", d, check=False).stdout.strip() for d in (self.xa, self.xb))

    # ---- running things inside ---------------------------------------------------------------

    def own(self, pid: int):
        """Record `pid` (a process group leader started outside the namespaces, e.g. the
        coordinator) as this run's: a later run's `sweep_stale` ends it if this run was killed."""
        os.makedirs(PID_DIR, exist_ok=True)
        with open(os.path.join(PID_DIR, f"{self.prefix}.pids"), "a") as f:
            f.write(f"{pid}:{_started(pid)}\n")

    def argv(self, node: str, argv: List[str], cgroups: bool = False) -> List[str]:
        """`argv` run inside `node`'s namespace. `cgroups`: with the root namespace's CPU
        controller hierarchies mounted where they are outside (`cgroup_mounts`), for an agent
        that confines its ranks to CPU shares (docs/emulation.md)."""
        if not cgroups:
            return ["ip", "netns", "exec", self.ns[node], *argv]
        return ["ip", "netns", "exec", self.ns[node], "sh", "-c", cgroup_mounts() + ' && exec "$@"', "sh", *argv]

    def transfer(self, src: str, dst: str, megabytes: float = 4.0, timeout: float = 60.0,
                 procs: Tuple[Optional[str], Optional[str]] = (None, None)) -> float:
        """Send `megabytes` over TCP from node `src` to node `dst` (a node name, or "root" for the
        root namespace at the gateway address): the receiver's MB/s. `procs`: the `cgroup.procs`
        files the sender and the receiver write themselves into first (an emulated node's CPU
        share: the kernel's network stack then runs in it, as it does for that node's ranks)."""
        dst_ip = self.gateway if dst == "root" else self.ip[dst]

        def enter(path: Optional[str]) -> str:
            return f"open({path!r}, 'w').write('0')\n" if path else ""

        # The kernel picks the port: a fixed one may be held by another socket in the namespace
        # (an agent's connection takes its local port from the same range).
        server = enter(procs[1]) + textwrap.dedent(f"""
            import socket, sys, time
            s = socket.socket()
            s.bind(({dst_ip!r}, 0)); s.listen(1); print("ready", s.getsockname()[1], flush=True)
            c, _ = s.accept(); n = 0; t0 = None
            while True:
                b = c.recv(1 << 16)
                if not b:
                    break
                if t0 is None:
                    t0 = time.monotonic()
                n += len(b)
            print(n / max(1e-9, time.monotonic() - t0) / 1e6, flush=True)
        """)
        client = enter(procs[0]) + textwrap.dedent(f"""
            import socket, sys
            c = socket.create_connection(({dst_ip!r}, int(sys.argv[1])), timeout=10)
            chunk, left = b"x" * (1 << 16), int({megabytes} * 1e6)
            while left > 0:
                c.sendall(chunk[:left]); left -= len(chunk)
            c.close()
        """)
        srv_argv = [sys.executable, "-c", server] if dst == "root" else self.argv(dst, [sys.executable, "-c", server],
                                                                                    cgroups=procs[1] is not None)
        srv = subprocess.Popen(srv_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = srv.stdout.readline().split()
            assert ready[:1] == ["ready"] and len(ready) == 2, srv.stderr.read()
            cli = [sys.executable, "-c", client, ready[1]]
            cli_argv = cli if src == "root" else self.argv(src, cli, cgroups=procs[0] is not None)
            subprocess.run(cli_argv, check=True, timeout=timeout, capture_output=True)
            out, err = srv.communicate(timeout=timeout)
            return float(out.strip())
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()

    # ---- cleanup -----------------------------------------------------------------------------

    def close(self):
        """Remove everything this Net made; safe to call twice, and after a partial build."""
        if self.closed:
            return
        self.closed = True
        _kill_recorded(self.prefix)
        for ns in self.ns.values():
            _kill_in(ns)
        time.sleep(0.1)
        for ns in self.ns.values():
            _kill_in(ns)
            _run("ip", "netns", "del", ns, check=False)
        for link in self.made_links:
            _run("ip", "link", "del", link, check=False)
        # Whatever else carries the prefix (a half-made veth).
        for ns in _namespaces():
            if _made_by(ns, self.prefix):
                _kill_in(ns)
                _run("ip", "netns", "del", ns, check=False)
        for link in _links():
            if _made_by(link, self.prefix):
                _run("ip", "link", "del", link, check=False)

    def leftovers(self) -> List[str]:
        """Namespaces and links of this Net that still exist (empty after `close`)."""
        return [n for n in _namespaces() if _made_by(n, self.prefix)] + \
               [n for n in _links() if _made_by(n, self.prefix)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
