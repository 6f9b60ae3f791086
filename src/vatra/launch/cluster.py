"""A real multi-host cluster on one machine: network namespaces, veth pairs, a bridge, shaped links.

Layout for ``--hosts N`` (nothing is added to the machine's own namespace)::

    <name>-sw   a "switch" namespace holding bridge br0 (10.213.0.254/24: services every host
                reaches, e.g. an S3 server for the checkpoint store) and the switch ends p0..pN-1
    <name>-hI   host I: lo and eth0 (10.213.0.(I+1)/24), whose peer pI sits on the bridge

Each link is shaped with ``tc tbf`` on both ends (tbf shapes egress only), so each host sends and
receives at ``--bandwidth``. ``--latency-ms L`` adds a netem delay of L/2 on both ends of every link
(host to host one way: L, a round trip: 2L) with tbf beneath it; a kernel without netem (these
machines) refuses it with one line before anything is built.
``run`` starts one command per host inside its namespace with ``GLOO_SOCKET_IFNAME=eth0``; for
``vatra train`` it adds the multi-node flags (c10d rendezvous on host 0, node rank, local address).
Hosts share the machine's filesystem unless ``run(private=[folder])`` gives each host its own copy
of a folder (a mount namespace per host): then they share no run folder, like separate machines.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from vatra.errors import ConfigError, VatraError
from vatra.launch.incidents import history_path, review

STATE_DIR = Path(os.environ.get("VATRA_CLUSTER_STATE", "/run/vatra-cluster"))
SUBNET = "10.213.0"  # private to the namespaces this module creates
SWITCH_ADDRESS = f"{SUBNET}.254"  # on the switch's bridge: where shared services listen
IFNAME = "eth0"
RDZV_PORT = 29400
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class ClusterError(VatraError):
    """The cluster could not be built, found or used."""


def parse_bandwidth(text: str) -> int:
    """``"100mbit"`` → 100_000_000 bits per second."""
    m = _RATE.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--bandwidth {text!r}: expected a rate such as 100mbit, 1gbit or 500kbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class Host:
    index: int
    netns: str
    address: str


@dataclass
class ClusterSpec:
    name: str = "vatra"
    hosts: int = 2
    bandwidth: str = "100mbit"
    procs_per_host: int = 1
    latency_ms: float = 0.0  # one way, host to host; half on each end of a link

    def validate(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"--name {self.name!r}: 1-8 lowercase letters/digits, starting with a letter")
        if not 1 <= self.hosts <= 64:
            raise ConfigError(f"--hosts {self.hosts}: must be between 1 and 64")
        if self.procs_per_host < 1:
            raise ConfigError(f"--procs-per-host {self.procs_per_host}: must be ≥ 1")
        if not 0 <= self.latency_ms <= 10_000:
            raise ConfigError(f"--latency-ms {self.latency_ms:g}: must be between 0 and 10000")
        parse_bandwidth(self.bandwidth)


def _check_netem(name: str, latency_ms: float) -> None:
    """Refuse ``--latency-ms`` on a kernel without the netem qdisc, in one line, before building."""
    probe = f"{name}-probe"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    _sh("ip", "netns", "add", probe)
    try:
        _sh("ip", "-n", probe, "link", "set", "lo", "up")
        proc = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True,
            text=True,
        )
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if proc.returncode:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[0]
        raise ClusterError(
            f"--latency-ms {latency_ms:g}: this kernel has no netem qdisc (tc: {said}), so latency "
            "cannot be added here; only bandwidth is shaped (tbf). Drop --latency-ms, or use a "
            "kernel with sch_netem"
        )


def _check_privileges() -> None:
    if os.geteuid() != 0:
        raise ClusterError(
            "the test cluster needs root (network namespaces and tc); run as root or with sudo"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"the test cluster needs the '{tool}' command (package iproute2)")


def _sh(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise ClusterError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.strip()]


class Cluster:
    """A cluster that is up (created by :meth:`up` or found by :meth:`load`)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.switch = f"{spec.name}-sw"
        self.hosts = [Host(i, f"{spec.name}-h{i}", f"{SUBNET}.{i + 1}") for i in range(spec.hosts)]

    # ------------------------------------------------------------ lifecycle
    @staticmethod
    def state_file(name: str) -> Path:
        return STATE_DIR / f"{name}.json"

    @classmethod
    def up(cls, spec: ClusterSpec) -> Cluster:
        """Create namespaces, links and shaping; on any failure remove what was made and raise."""
        spec.validate()
        _check_privileges()
        if cls.state_file(spec.name).exists() or any(n.startswith(f"{spec.name}-") for n in _netns_list()):
            raise ClusterError(f"cluster {spec.name!r} is already up; run 'vatra cluster down' first")
        if spec.latency_ms:
            _check_netem(spec.name, spec.latency_ms)
        cluster = cls(spec)
        try:
            cluster._build()
        except BaseException:
            cls.down(spec.name)
            raise
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        cls.state_file(spec.name).write_text(json.dumps(asdict(spec)))
        return cluster

    def _build(self) -> None:
        rate = parse_bandwidth(self.spec.bandwidth)
        # tbf needs a bucket of at least one timer tick of traffic; 64 KiB covers ≤ 100 Mbit/s.
        burst = max(64 * 1024, rate // 8 // 250)
        shape = ["root", "tbf", "rate", str(rate), "burst", str(burst), "latency", "100ms"]
        sw = self.switch
        _sh("ip", "netns", "add", sw)
        _sh("ip", "-n", sw, "link", "set", "lo", "up")
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        _sh("ip", "-n", sw, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0")
        for h in self.hosts:
            port = f"p{h.index}"
            _sh("ip", "netns", "add", h.netns)
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            _sh("ip", "link", "add", "name", IFNAME, "netns", h.netns, "type", "veth",
                "peer", "name", port, "netns", sw)  # fmt: skip
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", port, "up")
            _sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", IFNAME)
            _sh("ip", "-n", h.netns, "link", "set", IFNAME, "up")
            for ns, dev in ((h.netns, IFNAME), (sw, port)):  # host → switch, switch → host
                self._shape(ns, dev, shape)

    def _shape(self, netns: str, dev: str, tbf: list[str]) -> None:
        """tbf at the root; with a latency, netem's delay at the root and tbf beneath it."""
        if not self.spec.latency_ms:
            _sh("tc", "-n", netns, "qdisc", "add", "dev", dev, *tbf)
            return
        delay = f"{self.spec.latency_ms / 2:g}ms"
        _sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay)
        _sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf[1:])

    @classmethod
    def load(cls, name: str = "vatra") -> Cluster:
        _check_privileges()
        path = cls.state_file(name)
        if not path.exists():
            raise ClusterError(f"no cluster {name!r} is up; start one with 'vatra cluster up --hosts 2'")
        cluster = cls(ClusterSpec(**json.loads(path.read_text())))
        missing = [h.netns for h in cluster.hosts if h.netns not in _netns_list()]
        if missing:
            raise ClusterError(
                f"cluster {name!r} is broken (missing {', '.join(missing)}); run 'vatra cluster down'"
            )
        return cluster

    @classmethod
    def down(cls, name: str = "vatra") -> list[str]:
        """Stop processes left in the cluster's namespaces, delete the namespaces (their veths and
        bridge go with them) and the state file. Returns the namespaces removed."""
        _check_privileges()
        ours = [n for n in _netns_list() if n == f"{name}-sw" or re.fullmatch(rf"{name}-h\d+", n)]
        for ns in ours:
            for pid in _sh("ip", "netns", "pids", ns).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # started by 'vatra cluster run' in our namespace
                except ProcessLookupError:
                    continue
        for ns in ours:
            _sh("ip", "netns", "del", ns)
        cls.state_file(name).unlink(missing_ok=True)
        return ours

    # ------------------------------------------------------------ use
    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each host's eth0 has sent and received so far (kernel counters, all headers included)."""
        out = {}
        for h in self.hosts:
            stats = _sh("ip", "netns", "exec", h.netns, "cat",
                        f"/sys/class/net/{IFNAME}/statistics/tx_bytes",
                        f"/sys/class/net/{IFNAME}/statistics/rx_bytes").split()  # fmt: skip
            out[h.netns] = {"tx_bytes": int(stats[0]), "rx_bytes": int(stats[1])}
        return out

    def host_command(
        self,
        host: Host,
        argv: list[str],
        run_id: str,
        private: list[Path] | None = None,
        hosts: list[Host] | None = None,
    ) -> list[str]:
        """``argv`` for one host: ``vatra train``, ``vatra run`` and ``vatra profile`` get the multi-node
        flags they do not already have (before a script's ``--``); with ``private``, it runs where
        those folders are this host's own copies. ``hosts``: the hosts of this launch (default: all;
        fewer when the incident history excluded some), numbered in order, the first hosting the
        rendezvous."""
        hosts = hosts or self.hosts
        if argv[:1] == ["vatra"]:
            argv = [sys.executable, "-m", "vatra", *argv[1:]]
        if argv[1:4] in (["-m", "vatra", "train"], ["-m", "vatra", "run"], ["-m", "vatra", "profile"]):
            cut = argv.index("--") if "--" in argv else len(argv)
            given = set(argv[:cut])
            flags = {
                "--nnodes": str(len(hosts)),
                "--node-rank": str(hosts.index(host)),
                "--rdzv-endpoint": f"{hosts[0].address}:{RDZV_PORT}",
                "--rdzv-id": run_id,
                "--local-addr": host.address,
                "--nproc": str(self.spec.procs_per_host),
            }
            argv = argv[:cut] + [a for k, v in flags.items() if k not in given for a in (k, v)] + argv[cut:]
        return ["ip", "netns", "exec", host.netns, *self._privately(host, private or [], argv)]

    @staticmethod
    def private_folder(folder: Path, host: Host) -> Path:
        """What host ``host`` sees at ``folder`` under ``run(private=[folder])``: ``<folder>.h<I>``."""
        return folder.with_name(f"{folder.name}.h{host.index}")

    def _privately(self, host: Host, private: list[Path], argv: list[str]) -> list[str]:
        """``argv`` in a mount namespace of its own where each folder of ``private`` is this host's
        copy (bind-mounted over it): no other host sees what it writes there."""
        if not private:
            return argv
        if shutil.which("unshare") is None:
            raise ClusterError("--private-dir needs the 'unshare' command (package util-linux)")
        binds = " && ".join(
            f"mount --bind {shlex.quote(str(self.private_folder(p, host)))} {shlex.quote(str(p))}"
            for p in private
        )
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{binds} && exec "$@"',
            "sh",
            *argv,
        ]

    def run(
        self,
        argv: list[str],
        timeout: float | None = None,
        log: Path | None = None,
        private: list[Path] | None = None,
    ) -> int:
        """Run ``argv`` on every host at once, output prefixed ``[hI]`` (to ``log`` when given, else
        stdout); returns the worst exit code.

        ``private``: folders each host gets its own copy of (host I's is ``<folder>.h<I>``, created
        when missing and kept between runs), so that no run folder is shared, as between machines.
        When a host fails, the others get 10 s to notice (their rendezvous breaks) and are then
        killed, so one failure never leaves the cluster running.
        """
        if not argv:
            raise ConfigError("nothing to run: vatra cluster run -- vatra train CONFIG ...")
        private = [p.resolve() for p in private or []]
        for folder in private:
            folder.mkdir(parents=True, exist_ok=True)  # the mount point; empty outside the hosts
            for h in self.hosts:
                self.private_folder(folder, h).mkdir(exist_ok=True)
        run_id = f"cluster-{uuid.uuid4().hex[:8]}"
        hosts = self._admitted()
        total = len(hosts) * self.spec.procs_per_host
        threads = str(max(1, (os.cpu_count() or 1) // total))
        procs: list[subprocess.Popen[str]] = []
        pumps: list[threading.Thread] = []
        sink: TextIO = log.open("a", encoding="utf-8") if log is not None else sys.stdout
        lock = threading.Lock()
        for h in hosts:
            env = {
                **os.environ,
                "GLOO_SOCKET_IFNAME": IFNAME,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
                "PYTHONUNBUFFERED": "1",
                "VATRA_CLUSTER": self.spec.name,
                "VATRA_CLUSTER_HOST": str(h.index),
                "VATRA_CLUSTER_HOSTS": str(len(hosts)),
                "VATRA_CLUSTER_ADDRESSES": ",".join(x.address for x in hosts),
            }
            proc = subprocess.Popen(
                self.host_command(h, argv, run_id, private, hosts),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc, f"[h{h.index}] ", sink, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        try:
            codes = _wait_all(procs, timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            for pump in pumps:
                pump.join(timeout=5)
            if sink is not sys.stdout:
                sink.close()
        if any(c == 2 for c in codes):
            return 2
        return max((abs(c) for c in codes), default=0)

    def _admitted(self) -> list[Host]:
        """The hosts this launch runs on: all but those the incident history excludes (a host that
        failed twice in the last hour, :mod:`vatra.launch.incidents`), each exclusion said in one line."""
        decisions = review([h.address for h in self.hosts], history_path(self.spec.name))
        for decision in decisions:
            print(f"vatra: {decision.line()}", flush=True)
        excluded = {d.host for d in decisions if d.excluded}
        return [h for h in self.hosts if h.address not in excluded]


def _pump(proc: subprocess.Popen[str], prefix: str, sink: TextIO, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:  # whole lines: hosts' output interleaves by line, never inside one
            sink.write(prefix + line)
            sink.flush()


def _wait_all(procs: list[subprocess.Popen[str]], timeout: float | None) -> list[int]:
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if (failed_at is not None and now - failed_at > 10) or (deadline is not None and now > deadline):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            time.sleep(2)
            if deadline is not None and now > deadline:
                raise ClusterError(f"cluster run timed out after {timeout:.0f} s; all hosts were stopped")
            return [p.poll() if p.poll() is not None else 1 for p in procs]  # type: ignore[misc]
        time.sleep(0.2)
