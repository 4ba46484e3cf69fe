"""A cluster of real hosts on one machine: network namespaces, each with an address of
its own on a private subnet, joined by veth pairs (or by a delay wire, tests/delay_proxy.py)
to a bridge in the root namespace; a Ray node in each, joined to the head's address.

    with NetnsCluster(workdir) as c:
        head = c.add_host("head")
        verifier = c.add_host("verifier0")
        drafter = c.add_host("drafter0", delay_ms=0.0)   # through a settable delay
        c.start_ray(head, head=True)
        c.start_ray(verifier, resources={"verifier": 1})
        c.start_ray(drafter, resources={"drafter": 1})
        redis_url = c.start_redis(head)
        served = c.serve(head, config_text, redis_url)    # `specserve serve` on the head
        ...

Every namespace and link is named with PREFIX (and the cluster's tag), so that
`cleanup()` (`scripts/netns_cluster.py cleanup`) removes what a killed run left. Closing
the cluster kills every process in its namespaces (whatever started them: Ray's
daemons, workers, Redis), then removes the namespaces, the links and the bridge.

The root namespace holds the bridge's address (.1): it is the client host, from which
tests call the router. Traffic goes only to the addresses made here. Ray keeps its
session files under the cluster's own temp dir, so no `ray.init()` elsewhere on the
machine finds this cluster as "the current one".
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "ssn"  # every namespace, link and bridge these tools make starts with it
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # each cluster takes a free /24 of it
RAY_PORT = 6379
REDIS_PORT = 6380
GRPC_PORT = 50051
HTTP_PORT = 8000
START_TIMEOUT_S = 300
RAY_START_ATTEMPTS = 3
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


def missing_rights() -> str | None:
    """Why this machine cannot make the cluster (None: it can): no `ip`, no CAP_NET_ADMIN
    and CAP_SYS_ADMIN (root in the initial namespaces), or `ip netns add` refused."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    caps = _effective_caps()
    for cap, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not caps >> cap & 1:
            return f"making network namespaces needs root ({name} is missing)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def namespace_pids(netns: str) -> list[int]:
    done = ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_namespace(netns: str, grace_s: float = 0.0) -> list[int]:
    """Kill every process in `netns` (SIGTERM first, when `grace_s`, then SIGKILL); the pids."""
    pids = namespace_pids(netns)
    if grace_s and pids:
        _signal(pids, signal.SIGTERM)
        give_up = time.monotonic() + grace_s
        while time.monotonic() < give_up and namespace_pids(netns):
            time.sleep(0.1)
    for _ in range(50):  # a dying Ray parent may start a child meanwhile: until none is left
        left = namespace_pids(netns)
        if not left:
            break
        _signal(left, signal.SIGKILL)
        time.sleep(0.1)
    return pids


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace and link whose name starts with `prefix` (their processes
    killed first): what a run that could not close its cluster left. The names removed."""
    removed = []
    listed = ip("netns", "list", check=False).stdout.split("\n")
    for netns in (line.split()[0] for line in listed if line.strip()):
        if netns.startswith(prefix):
            kill_namespace(netns)
            ip("netns", "del", netns, check=False)
            removed.append(netns)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(prefix):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNETS no interface of the root namespace has an address in."""
    taken = set()
    for line in ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        match = re.search(r"inet (\S+)", line)
        if match:
            taken.add(ipaddress.ip_interface(match.group(1)).network)
    for subnet in SUBNETS.subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise RuntimeError(f"no free /24 in {SUBNETS}")


def _env(ray_token: Path | None = None) -> dict[str, str]:
    """The environment of every process started on a host: this checkout's code first (an
    installed specserve elsewhere would be what Ray's workers import), nothing that would
    join another cluster or store; with `ray_token`, Ray's token authentication on, with
    that file's token (the cluster's own, not the one in ~/.ray of this machine's user)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "SPECSERVE_REDIS_URL", "SPECSERVE_CLUSTER_SECRET", "RAY_AUTH_TOKEN")}
    if ray_token is not None:
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_token)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


@dataclass
class Host:
    """One namespace: a host with one address on the cluster's subnet."""

    name: str  # its role: head, verifier0, drafter0, outsider
    netns: str
    ip: str
    link: str  # the interface on the bridge's side
    env: dict = field(default_factory=_env, repr=False)  # of every process started on it
    wire: "object | None" = None  # the delay wire, when its link goes through one

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, *args: str, timeout: float = 120, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout,
                              env=env or self.env, cwd=ROOT)
        if check and done.returncode != 0:
            raise RuntimeError(f"on {self.name}: {' '.join(args)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def python(self, code: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run Python `code` in this namespace (with the checkout on the path)."""
        return self.run(sys.executable, "-c", code, timeout=timeout, check=check)

    def pids(self) -> list[int]:
        return namespace_pids(self.netns)

    def listening(self) -> list[tuple[str, int, str]]:
        """(local address, port, program) of every listening TCP socket in this namespace."""
        out = self.run("ss", "-ltnpH").stdout
        sockets = []
        for line in out.splitlines():
            fields = line.split()
            address, _, port = fields[3].rpartition(":")
            program = re.search(r'\(\("([^"]+)"', line)
            sockets.append((address.strip("[]"), int(port), program.group(1) if program else "?"))
        return sockets

    def kill(self) -> list[int]:
        """The whole node fails: every process in it killed at once (SIGKILL). The pids."""
        return kill_namespace(self.netns)


@dataclass
class Served:
    """`specserve serve` running on a host."""

    proc: subprocess.Popen
    grpc: str  # host:port of the router
    http: str  # http://host:port
    lines: list[str] = field(default_factory=list)


class NetnsCluster:
    """Namespaces on a bridge, and the processes started in them; `close()` (or leaving the
    `with` block) removes them all."""

    def __init__(self, workdir: Path, tag: str | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tag = tag or secrets.token_hex(2)
        self.prefix = f"{PREFIX}{self.tag}"
        self.bridge = f"{self.prefix}br"
        self.subnet = _free_subnet()
        self.gateway = str(self.subnet.network_address + 1)  # the root namespace's address: the client host
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self.ray_temp = self.workdir / "ray"
        self.head: Host | None = None
        self._up = False
        # Ray's token: the cluster's own (a Ray started elsewhere on this machine keeps its own)
        self.ray_token = self.workdir / "ray_auth_token"
        self.ray_token.touch(mode=0o600)
        self.ray_token.chmod(0o600)
        self.ray_token.write_text(secrets.token_hex(32))
        self.env = _env(self.ray_token)
        atexit.register(self.close)  # an interrupted run still removes what it made

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # -- hosts -----------------------------------------------------------------------
    def _bridge_up(self) -> None:
        if self._up:
            return
        ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_host(self, name: str, delay_ms: float | None = None) -> Host:
        """A namespace with the next address; its link to the bridge a veth pair, or with
        `delay_ms` a delay wire (tests/delay_proxy.py) whose delay `set_delay` changes."""
        self._bridge_up()
        index = len(self.hosts)
        host = Host(name, f"{self.prefix}-{name}", str(self.subnet.network_address + 2 + index),
                    f"{self.prefix}v{index}", self.env)
        ip("netns", "add", host.netns)
        self.hosts[name] = host
        inner = f"{self.prefix}i{index}"
        if delay_ms is None:
            ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
        else:
            from delay_proxy import DelayWire

            host.wire = DelayWire(host.link, inner, delay_ms, self.workdir / f"wire-{name}.log")
        ip("link", "set", inner, "netns", host.netns)
        ip("-n", host.netns, "link", "set", inner, "name", "eth0")
        ip("-n", host.netns, "addr", "add", f"{host.ip}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        ip("link", "set", host.link, "master", self.bridge)
        ip("link", "set", host.link, "up")
        return host

    def set_delay(self, host: Host, delay_ms: float) -> None:
        host.wire.set_delay(delay_ms)

    # -- processes -------------------------------------------------------------------
    def spawn(self, host: Host, args: list[str], log_name: str, env: dict | None = None,
              stdout=None) -> subprocess.Popen:
        log = open(self.workdir / f"{log_name}.log", "ab")
        proc = subprocess.Popen(host.cmd(*args), stdout=stdout or log, stderr=subprocess.STDOUT,
                                env=env or self.env, cwd=ROOT, start_new_session=True,
                                text=stdout is not None)
        self.procs.append(proc)
        return proc

    def start_ray(self, host: Host, head: bool = False, resources: dict | None = None,
                  num_cpus: int = 0) -> None:
        """A Ray node on `host` (`ray start` returns once it is up), offering `resources`;
        the first with `head` is the head the others join."""
        args = ["ray", "start", f"--node-ip-address={host.ip}", f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources or {})}", "--disable-usage-stats"]
        if head:
            self.head = host
            args += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false", f"--temp-dir={self.ray_temp}"]
        else:
            args += [f"--address={self.head.ip}:{RAY_PORT}"]
        # Ray gives a starting raylet 30 s to register (a constant in its code): on a busy machine
        # a start can miss it; what it left is killed and it starts again (cluster/ray_start.py)
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                host.run(*args, timeout=START_TIMEOUT_S)
                return
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if attempt == RAY_START_ATTEMPTS or "timed out during startup" not in str(e) and \
                        not isinstance(e, subprocess.TimeoutExpired):
                    raise
                kill_namespace(host.netns)
                time.sleep(5.0)

    def start_nodes(self, nodes: list[tuple[Host, dict]]) -> None:
        """Ray nodes on several hosts ((host, resources) each), joined to the head, one after
        another: every node of this machine writes into the head's session directory, and
        nodes starting at once can pick the same raylet socket and log names there (two
        raylets on `raylet.2`: the second dies, "bind: Address already in use")."""
        for host, resources in nodes:
            self.start_ray(host, resources=resources)

    @property
    def ray_address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def start_redis(self, host: Host, password: str | None = None) -> "Redis":
        redis = Redis(self, host, password or secrets.token_urlsafe(16))
        redis.start()
        return redis

    def serve(self, host: Host, config_text: str, redis_url: str | None, lines=None,
              timeout_s: float = START_TIMEOUT_S) -> Served:
        """`specserve serve --config` on `host`, joined to this cluster (RAY_ADDRESS) with its
        state in `redis_url`; returns once it says it serves."""
        config = self.workdir / "serve.toml"
        config.write_text(config_text)
        env = self.env | {"RAY_ADDRESS": self.ray_address}
        if redis_url:
            env["SPECSERVE_REDIS_URL"] = redis_url
        proc = self.spawn(host, [sys.executable, "-m", "commands.cli", "serve", "--config", str(config)], "serve",
                          env=env, stdout=subprocess.PIPE)
        import tomllib

        cfg = tomllib.loads(config_text)
        served = Served(proc, f"{cfg.get('host', host.ip)}:{cfg.get('port', GRPC_PORT)}",
                        f"http://{cfg.get('host', host.ip)}:{cfg.get('http', {}).get('port', HTTP_PORT)}")
        log = open(self.workdir / "serve.log", "a")

        def read() -> None:
            for line in iter(proc.stdout.readline, ""):
                served.lines.append(line)
                log.write(line)
                log.flush()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("specserve: serving on") for line in served.lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                time.sleep(0.5)
                raise RuntimeError("specserve serve did not start:\n" + "".join(served.lines[-60:]))
            time.sleep(0.2)
        return served

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in the cluster's namespaces, remove the namespaces, the links
        and the bridge (each step tried whatever failed before it)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for host in self.hosts.values():
            kill_namespace(host.netns)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        for host in self.hosts.values():
            if host.wire is not None:
                host.wire.close()
            ip("netns", "del", host.netns, check=False)
            ip("link", "del", host.link, check=False)
        if self._up:
            ip("link", "del", self.bridge, check=False)
        self.hosts.clear()
        self.procs.clear()
        self._up = False
        atexit.unregister(self.close)


class Redis:
    """redis-server on a host: its address only, a password, the append-only file on
    (`appendfsync always`), so that it can be killed and started again with its data."""

    def __init__(self, cluster: NetnsCluster, host: Host, password: str):
        self.cluster, self.host, self.password = cluster, host, password
        self.dir = cluster.workdir / "redis"
        self.dir.mkdir(exist_ok=True)
        self.url = f"redis://:{password}@{host.ip}:{REDIS_PORT}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; install it with scripts/install_redis.sh")
        self.proc = self.cluster.spawn(self.host, [
            binary, "--bind", self.host.ip, "--port", str(REDIS_PORT), "--requirepass", self.password,
            "--dir", str(self.dir), "--save", "", "--appendonly", "yes", "--appendfsync", "always"], "redis")
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)  # from the client host
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {self.host.name} did not start "
                                       f"(see {self.cluster.workdir / 'redis.log'})") from None
                time.sleep(0.05)
            finally:
                client.close()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def toml(tree: dict) -> str:
    """A config tree as TOML: top-level keys, then a [section] per dict (one level deep
    sections only, as specserve's config has)."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"{v!r} in a config")

    lines = [f"{k} = {value(v)}" for k, v in tree.items() if not isinstance(v, dict)]
    for section, table in tree.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def serve_config(head: Host, secret: str, **sections) -> dict:
    """The config of a cluster whose router, ingress (and Redis) are on `head`: the router
    listens on the head's address, the internal services on their nodes' (`internal_host =
    "node"`), every internal call carries `secret`; a small verifier (one thread) and one
    pool of the lookup drafters, which draft only on the pool (not on the verifier), so
    that every drafted round crosses the drafter link. `sections` are merged over it."""
    tree = {
        "host": head.ip, "port": GRPC_PORT,
        "http": {"port": HTTP_PORT},
        "security": {"cluster_secret": secret, "internal_host": "node",
                     "allow_open_access": True},  # the test subnet: no one else is on it
        "verifiers": {"count": 1, "threads": 1, "max_len": 1024},
        "drafter_pools": {"count": 1, "kinds": ["pld", "suffix"]},
        "router": {"default_drafter": "pld", "verifier_drafting": False, "service_wait_s": 120},
        "registry": {"heartbeat_s": 0.5, "service_ttl_s": 3.0},
        "autoscaling": {"graceful_shutdown_s": 2},
    }
    for name, table in sections.items():
        tree[name] = {**tree.get(name, {}), **table} if isinstance(table, dict) else table
    return tree
