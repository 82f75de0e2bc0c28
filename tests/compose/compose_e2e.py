"""``make test-compose``: the container image and docker-compose.yml, for real.

Builds the image (Dockerfile) on a base image made here with debootstrap (no registry is needed;
the base image is cached between runs on one machine): a minimal Debian with python3 and venv, what
the Dockerfile asks for, and without the user-management tools (``passwd``, ``adduser``) that some
minimal bases lack; checks that the image runs as uid/gid 10001; starts docker-compose.yml, sends streaming
and non-streaming OpenAI SDK requests through the published gateway port and checks, from the
simulator's ``x-sim-*`` headers, that each lands on a decode of its prefill's pdGroup; then
recreates the two pd-extproc replicas with ``PD_EXTPROC_AFFINITY_MODE=strict`` and each engine handoff
(``PD_EXTPROC_HANDOFF``), checks both replicas' ``/metrics`` (their decisions, and each holding the
other as its peer over the ``nats`` service); checks the stack's Prometheus (compose/prometheus/, its
image built here on the same base): every target up (both replicas and Envoy's admin), the chart's rule
groups loaded and evaluated, and its sum of the replicas' route decisions equal to their own
``/metrics``; then stops one replica (every request still routed by the other) and starts it again (it
takes its peer's state back), and ends with ``docker-compose down -v``.

Run as root it installs what it lacks (Debian's docker.io, docker-compose, debootstrap) and starts
``dockerd --storage-driver=vfs`` if no engine answers, stopping it again at the end. Not root: it
prints why it skips and exits 0. pip inside ``docker build`` uses the machine's own pip settings
(index, extra indexes, find-links, CA bundle, from ``pip config list`` and ``PIP_*``): local paths
and file:// indexes are served on 127.0.0.1 for the build (``--network host``), the CA bundle as
``PIP_CERT_URL``; none of it reaches the final image. Not collected by ``pytest`` (no ``test_``
file name).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import http.server
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "pdxcomposetest"
IMAGE = "pd-extproc:compose-test"
PROMETHEUS_IMAGE = "pd-extproc-prometheus:compose-test"
RULES = ROOT / "charts" / "pd-extproc" / "monitoring" / "pd-extproc-rules.yaml"
BASE_PACKAGES = ("python3", "python3-venv")
BASE_PURGED = ("adduser", "passwd")
"""Removed from the base (``dpkg --force-depends``: apt depends on adduser, nothing the image runs
does): no groupadd, useradd or adduser."""
USER_TOOLS = ("groupadd", "useradd", "adduser")
MODEL = "sim-llama-3-8b"
LONG_PROMPT = "Summarise the following notes. " + "the quick brown fox jumps over the lazy dog " * 150
"""About 1,400 estimated tokens: above routing.pd_threshold_tokens (512), so every request is
disaggregated and the simulator reports its prefill."""
PHASES = (
    ("prefer", "sidecar"),
    ("strict", "kv-transfer-params"),
    ("strict", "sglang-bootstrap"),
)
REQUESTS_PER_KIND = 6
BURST = 24
"""Concurrent streaming requests per strict phase: enough load to use both groups' prefills."""
PIP_SERVER_PORT = 38765


def log(message: str) -> None:
    print(f"[test-compose {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], *, check: bool = True, env: dict[str, str] | None = None, **kw) -> str:
    result = subprocess.run(
        cmd, check=False, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, **kw
    )
    if check and result.returncode != 0:
        raise SystemExit(f"FAILED ({result.returncode}): {shlex.join(cmd)}\n{result.stdout[-4000:]}")
    return result.stdout


# --- the engine -------------------------------------------------------------------------------


def ensure_tools() -> None:
    missing = [
        pkg
        for tool, pkg in (
            ("dockerd", "docker.io"),
            ("docker-compose", "docker-compose"),
            ("debootstrap", "debootstrap"),
        )
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()
    ]
    if not missing:
        return
    log(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(install, check=False, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        run(["apt-get", "update", "-q"], env=env)
        run(install, env=env)


@contextlib.contextmanager
def docker_engine() -> Iterator[None]:
    """A running Docker engine: the one already answering, else a ``dockerd`` started (and stopped) here."""
    if subprocess.run(["docker", "info"], check=False, capture_output=True).returncode == 0:
        yield
        return
    log_file = open(Path(tempfile.gettempdir()) / "pd-extproc-test-dockerd.log", "w")  # noqa: SIM115
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    proc = subprocess.Popen([dockerd, "--storage-driver=vfs"], stdout=log_file, stderr=subprocess.STDOUT)
    log(f"started dockerd (pid {proc.pid}, vfs storage driver, log {log_file.name})")
    try:
        deadline = time.monotonic() + 90
        while subprocess.run(["docker", "info"], check=False, capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"dockerd did not come up; see {log_file.name}")
            time.sleep(0.5)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()
        log(f"stopped dockerd (pid {proc.pid})")


# --- the base image -------------------------------------------------------------------------


def debian_mirror() -> tuple[str, str]:
    """The machine's configured Debian mirror and its release codename."""
    release = dict(
        line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
    )
    suite = release.get("VERSION_CODENAME", "bookworm").strip('"')
    uris: list[str] = []
    sources = Path("/etc/apt/sources.list.d")
    for path in [
        *sorted(sources.glob("*.sources")),
        Path("/etc/apt/sources.list"),
        *sorted(sources.glob("*.list")),
    ]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if line.startswith("URIs:"):
                uris += words[1:]
            elif words[:1] == ["deb"]:
                uris += [w for w in words[1:] if "://" in w][:1]
    for uri in uris:
        if uri.rstrip("/").endswith("/debian"):
            return uri, suite
    return "http://deb.debian.org/debian", suite


def base_image() -> str:
    """A minimal Debian with python3 and venv, without :data:`BASE_PURGED`, made with debootstrap and
    cached by its inputs."""
    mirror, suite = debian_mirror()
    inputs = f"{mirror} {suite} {' '.join(BASE_PACKAGES)} -{' -'.join(BASE_PURGED)}"
    key = hashlib.sha256(inputs.encode()).hexdigest()[:12]
    tag = f"pd-extproc-test-base:{suite}-{key}"
    if run(["docker", "images", "-q", tag]).strip():
        log(f"base image {tag} (cached)")
        return tag
    log(f"debootstrap {suite} from {mirror} (+ {', '.join(BASE_PACKAGES)})")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pd-extproc-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                suite,
                str(rootfs),
                mirror,
            ]
        )
        run(["chroot", str(rootfs), "dpkg", "--purge", "--force-depends", *BASE_PURGED])
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / junk).glob("*"):
                if item.is_file():
                    item.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "-c", 'CMD ["python3"]', "-", tag], stdin=tar.stdout)
        tar.wait()
    log(f"base image {tag} made in {time.monotonic() - started:.0f} s")
    return tag


# --- pip settings for the build -------------------------------------------------------------


def pip_settings() -> dict[str, str]:
    """index-url, extra-index-url, find-links and cert as the machine's pip sees them (env wins)."""
    settings: dict[str, str] = {}
    out = run([sys.executable, "-m", "pip", "config", "list"], check=False)
    for line in out.splitlines():
        if "=" not in line:
            continue
        name, value = line.split("=", 1)
        key = name.rsplit(".", 1)[-1]
        settings.setdefault(key, value.strip().strip("'\""))
        if name.startswith(":env:"):
            settings[key] = value.strip().strip("'\"")
    return {
        k: v for k, v in settings.items() if k in ("index-url", "extra-index-url", "find-links", "cert") and v
    }


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the build log readable
        pass


@contextlib.contextmanager
def pip_build_args() -> Iterator[list[str]]:
    """``--build-arg`` flags giving the build the machine's pip settings; local ones served on loopback."""
    settings = pip_settings()
    with tempfile.TemporaryDirectory(prefix="pd-extproc-pip-") as served:
        handler = functools.partial(_Quiet, directory=served)
        try:  # a fixed port keeps the build arguments, and so Docker's layer cache, the same
            server = http.server.ThreadingHTTPServer(("127.0.0.1", PIP_SERVER_PORT), handler)
        except OSError:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        links: list[Path] = []

        def serve(location: str, index: bool = False) -> str:
            parsed = urllib.parse.urlsplit(location)
            if parsed.scheme in ("http", "https"):
                return location
            path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else location)
            if not path.exists():
                return ""
            # An index's pages link to their files relatively (../../files/x.whl): serve its parent.
            target = path.parent if index else path
            link = Path(served) / f"d{len(links)}"
            link.symlink_to(target)
            links.append(link)
            url = f"{base}/{link.name}/{path.name}" if index else f"{base}/{link.name}"
            return f"{url}/" if path.is_dir() else url

        args: list[str] = []
        if settings.get("index-url"):
            args += ["--build-arg", f"PIP_INDEX_URL={serve(settings['index-url'], index=True)}"]
        for key, arg in (("extra-index-url", "PIP_EXTRA_INDEX_URL"), ("find-links", "PIP_FIND_LINKS")):
            values = [serve(v, index=key == "extra-index-url") for v in settings.get(key, "").split()]
            if any(values):
                args += ["--build-arg", f"{arg}={' '.join(v for v in values if v)}"]
        if settings.get("cert") and Path(settings["cert"]).is_file():
            args += ["--build-arg", f"PIP_CERT_URL={serve(settings['cert'])}"]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        log("pip in the build: " + (" ".join(a for a in args if a != "--build-arg") or "defaults"))
        try:
            yield args
        finally:
            server.shutdown()
            server.server_close()


def docker_build(context: Path, tag: str, base: str, *args: str) -> None:
    """``docker build`` of ``context`` on ``base`` (host network), logging the image's size and build time."""
    started = time.monotonic()
    run(
        [
            "docker",
            "build",
            "--network",
            "host",
            "--build-arg",
            f"BASE_IMAGE={base}",
            *args,
            "-t",
            tag,
            str(context),
        ]
    )
    size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", tag]).strip())
    log(f"image {tag}: {size / 1e6:.0f} MB, built in {time.monotonic() - started:.0f} s")


def build_image(base: str) -> None:
    """pd-extproc's image (checked to run as uid/gid 10001) and the compose stack's Prometheus."""
    with pip_build_args() as pip_args:
        docker_build(ROOT, IMAGE, base, *pip_args)
    probe = f"for tool in {' '.join(USER_TOOLS)}; do command -v $tool; done"
    tools = run(["docker", "run", "--rm", base, "sh", "-c", probe], check=False).split()
    assert tools == [], f"the base image has {tools}"
    whoami = "import os; print(os.getuid(), os.getgid())"
    ids = run(["docker", "run", "--rm", IMAGE, "python3", "-c", whoami]).split()
    assert ids == ["10001", "10001"], ids
    log(f"the image runs as uid/gid 10001, built on a base without {', '.join(USER_TOOLS)}")
    docker_build(ROOT / "compose" / "prometheus", PROMETHEUS_IMAGE, base)


# --- compose ----------------------------------------------------------------------------------


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise SystemExit("no free port")


class Compose:
    def __init__(self) -> None:
        self.gateway_port = free_port(8080)
        self.metrics_ports = (free_port(9090), free_port(9091))
        self.prometheus_port = free_port(9095)
        self.base_env = {
            **os.environ,
            "PD_EXTPROC_IMAGE": IMAGE,
            "PD_EXTPROC_GATEWAY_PORT": str(self.gateway_port),
            "PD_EXTPROC_METRICS_PORT": str(self.metrics_ports[0]),
            "PD_EXTPROC_METRICS_PORT_2": str(self.metrics_ports[1]),
            "PD_EXTPROC_PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
            "PD_EXTPROC_PROMETHEUS_PORT": str(self.prometheus_port),
            "COMPOSE_PROJECT_NAME": PROJECT,
            # Creating a container copies the whole image with the vfs storage driver: on a loaded
            # machine that outlasts docker-compose's default 60 s read timeout.
            "COMPOSE_HTTP_TIMEOUT": "600",
        }

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> str:
        return run(
            ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), *args],
            env={**self.base_env, **(env or {})},
            cwd=ROOT,
        )

    def containers(self) -> list[str]:
        out = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"])
        return out.split()

    def wait_ready(self, timeout: float = 120) -> None:
        """Every container healthy, and the gateway routing through pd-extproc."""
        deadline = time.monotonic() + timeout
        while True:
            ids = self.containers()
            states = run(["docker", "inspect", "-f", "{{.Name}} {{.State.Health.Status}}", *ids]).split("\n")
            unhealthy = [s for s in states if s.strip() and not s.endswith(" healthy")]
            if ids and not unhealthy and self.gateway_answers():
                return
            if time.monotonic() > deadline:
                print(self("logs", "--tail", "30"))
                raise SystemExit(f"compose stack not ready after {timeout:.0f} s: {unhealthy}")
            time.sleep(0.5)

    def gateway_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.gateway_port}/v1/models", timeout=3) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self, replica: int) -> str:
        """Replica ``replica``'s (0 or 1) ``/metrics``."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_ports[replica]}/metrics", timeout=5
        ) as r:
            return r.read().decode()

    def prometheus(self, path: str, **params: str) -> dict:
        """The ``data`` of Prometheus' HTTP API answer to ``path`` (``status`` must be ``success``)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prometheus_port}{path}{query}", timeout=5) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer["data"]


def sample(metrics: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a ``/metrics`` page (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_peers(compose: Compose, timeout: float = 30) -> None:
    """Until each replica is connected to NATS and holds the other as its one peer."""
    deadline = time.monotonic() + timeout
    while True:
        pages = [compose.metrics(r) for r in (0, 1)]
        if all(
            sample(p, "pd_extproc_shared_peers") == 1 and sample(p, "pd_extproc_shared_connected") == 1
            for p in pages
        ):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the replicas do not hold each other as peers after {timeout:.0f} s")
        time.sleep(0.5)


def check_requests(compose: Compose, mode: str, handoff: str) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{compose.gateway_port}/v1", api_key="unused", max_retries=0, timeout=60
    )
    seen: list[tuple[str, str, str]] = []
    for i in range(REQUESTS_PER_KIND):
        messages = [{"role": "user", "content": f"{i} {LONG_PROMPT}"}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=16)
        completion = raw.parse()
        assert completion.choices[0].message.content, completion
        assert completion.usage and completion.usage.completion_tokens == 16, completion.usage
        seen.append(("non-streaming", raw.headers.get("x-sim-group"), raw.headers.get("x-sim-prefill-group")))
        assert raw.headers.get("x-sim-kv-transfer") == "same_group", dict(raw.headers)

        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", None
        for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text and usage and usage.completion_tokens == 16, (text, usage)
        seen.append(("streaming", raw.headers.get("x-sim-group"), raw.headers.get("x-sim-prefill-group")))
        assert raw.headers.get("x-sim-kv-transfer") == "same_group", dict(raw.headers)
    if mode == "strict":

        def one(i: int) -> tuple[str, str, str]:
            messages = [{"role": "user", "content": f"burst {i} {LONG_PROMPT}"}]
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=64, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            return ("burst", raw.headers.get("x-sim-group"), raw.headers.get("x-sim-prefill-group"))

        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            seen += pool.map(one, range(BURST))
    wrong = [s for s in seen if s[1] is None or s[1] != s[2]]
    assert not wrong, f"requests not on a decode of their prefill's group: {wrong}"
    groups = sorted({s[2] for s in seen})
    log(
        f"{mode}/{handoff}: {len(seen)} requests (streaming and not) each on a decode of its prefill's "
        f"group (prefill groups used: {', '.join(groups)})"
    )

    pages = [compose.metrics(replica) for replica in (0, 1)]
    decisions = [
        line
        for page in pages
        for line in page.splitlines()
        if line.startswith("pd_extproc_route_decisions_total{")
    ]
    assert any(f'mode="{mode}"' in line and 'locality="same_group"' in line for line in decisions), decisions
    assert not any('locality="cross_group"' in line for line in decisions), decisions
    for replica, page in enumerate(pages):  # Envoy spreads the requests over both replicas
        assert any(line.startswith("pd_extproc_route_decisions_total{") for line in page.splitlines()), (
            replica
        )
        assert sample(page, "pd_extproc_shared_peers") == 1, (replica, "its peer")
    if handoff != "sidecar":
        legs = [
            line
            for page in pages
            for line in page.splitlines()
            if line.startswith("pd_extproc_prefill_leg_total{")
        ]
        ok = sum(float(line.rsplit(" ", 1)[1]) for line in legs if 'outcome="ok"' in line)
        assert ok >= 2 * REQUESTS_PER_KIND, legs
    log(f"/metrics on :{compose.metrics_ports}: {'; '.join(decisions)}")


def check_prometheus(compose: Compose, timeout: float = 60) -> None:
    """Prometheus scrapes both replicas and Envoy, has evaluated the chart's rules, and holds the
    replicas' route decisions: its sum equal to theirs (read from their ``/metrics`` each try)."""
    t0 = time.monotonic()
    targets = {
        ("pd-extproc", "127.0.0.1:9090"): "up",
        ("pd-extproc", "127.0.0.1:9091"): "up",
        ("envoy", "127.0.0.1:9901"): "up",
    }
    groups = {group["name"]: "ok" for group in yaml.safe_load(RULES.read_text())["groups"]}
    decisions = "sum(pd_extproc_route_decisions_total)"
    deadline = t0 + timeout
    while True:
        replicas = sum(
            float(line.rsplit(" ", 1)[1])
            for replica in (0, 1)
            for line in compose.metrics(replica).splitlines()
            if line.startswith("pd_extproc_route_decisions_total{")
        )
        scraped = {
            (t["labels"]["job"], t["labels"]["instance"]): t["health"]
            for t in compose.prometheus("/api/v1/targets", state="active")["activeTargets"]
        }
        loaded = {
            group["name"]: "ok" if all(r["health"] == "ok" for r in group["rules"]) else str(group["rules"])
            for group in compose.prometheus("/api/v1/rules")["groups"]
        }
        result = compose.prometheus("/api/v1/query", query=decisions)["result"]
        held = float(result[0]["value"][1]) if result else 0.0
        if scraped == targets and loaded == groups and held == replicas > 0:
            break
        if time.monotonic() > deadline:
            raise SystemExit(
                f"Prometheus after {timeout:.0f} s: targets {scraped}, rule groups {loaded}, "
                f"{decisions} = {held} (the replicas: {replicas})"
            )
        time.sleep(1)
    log(
        f"Prometheus on :{compose.prometheus_port}: targets {sorted(i for _, i in scraped)} up, rule groups "
        f"{sorted(loaded)} evaluated ok, {decisions} = {held:.0f} as the replicas' /metrics "
        f"({time.monotonic() - t0:.1f} s)"
    )


def check_failover(compose: Compose) -> None:
    """One replica stopped: every request is routed by the other; started again: it holds its peer."""
    t0 = time.monotonic()
    compose("stop", "pd-extproc-2")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{compose.gateway_port}/v1", api_key="unused", max_retries=0, timeout=60
    )
    time.sleep(3)  # Envoy's health check takes a stopped replica out within 2 s (two checks a second apart)
    for i in range(2 * REQUESTS_PER_KIND):
        messages = [{"role": "user", "content": f"failover {i} {LONG_PROMPT}"}]
        completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        assert completion.choices[0].message.content, completion
    log(
        f"pd-extproc-2 stopped: {2 * REQUESTS_PER_KIND} requests all routed by pd-extproc "
        f"({time.monotonic() - t0:.1f} s)"
    )
    t0 = time.monotonic()
    compose("start", "pd-extproc-2")
    compose.wait_ready()
    wait_for_peers(compose)
    log(f"pd-extproc-2 started again and holding its peer after {time.monotonic() - t0:.1f} s")


def main() -> int:
    if os.geteuid() != 0:
        print(
            "make test-compose: SKIPPED: needs root to install Docker (docker.io, docker-compose, "
            "debootstrap) and to start dockerd; run it as root (CI does)."
        )
        return 0
    started = time.monotonic()
    ensure_tools()
    with docker_engine():
        compose = Compose()
        try:
            build_image(base_image())
            compose("down", "-v", "--remove-orphans")
            t0 = time.monotonic()
            compose("up", "-d", "--no-build")
            up_returned = time.monotonic() - t0
            compose.wait_ready()
            wait_for_peers(compose)
            log(
                f"cold `docker-compose up -d`: returned in {up_returned:.1f} s, every service healthy, "
                f"the gateway routing and the two replicas peers after {time.monotonic() - t0:.1f} s"
            )
            for mode, handoff in PHASES:
                env = {"PD_EXTPROC_AFFINITY_MODE": mode, "PD_EXTPROC_HANDOFF": handoff}
                if (mode, handoff) != PHASES[0]:
                    t0 = time.monotonic()
                    out = compose("up", "-d", "--no-build", env=env)
                    assert "Recreating" in out and "pd-extproc" in out, out
                    compose.wait_ready()
                    wait_for_peers(compose)
                    log(f"pd-extproc recreated with {env} in {time.monotonic() - t0:.1f} s")
                check_requests(compose, mode, handoff)
            check_prometheus(compose)
            check_failover(compose)
        finally:
            compose("down", "-v", "--remove-orphans")
            left = compose.containers()
            log("docker-compose down -v: " + (f"LEFT {left}" if left else "no container left"))
    log(f"PASSED in {time.monotonic() - started:.0f} s")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
