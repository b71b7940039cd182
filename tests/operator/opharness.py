"""Test harness of the operator tests (imported by conftest.py): a real etcd + kube-apiserver on loopback, envtest style.

The binaries are built from source by hack/tools/build.sh (cached outside the checkout, keyed by version).
No kubelet, scheduler or controller-manager runs: Pods never start and no garbage collector deletes
children, so the tests check what the API server itself does (schema, CEL, defaults, admission, SSA).

Auth: a static token (--token-auth-file) for an admin in system:masters; RBAC authorization is on, so tests can
also act as the chart's ServiceAccount through the TokenRequest API.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import ssl
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from promptcache_devtools.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "hack" / "tools" / "build.sh"
CRD_FILE = ROOT / "crds" / "promptcache.io_promptcaches.yaml"
ADMIN_TOKEN = "promptcache-test-admin-token"


def tool_paths() -> dict[str, Path]:
    out = subprocess.run(["bash", str(BUILD), "--print-dir"], check=True, capture_output=True, text=True).stdout
    return {k: Path(v) for k, v in (line.split("=", 1) for line in out.split())}


def require_tools(*names: str) -> dict[str, Path]:
    paths = tool_paths()
    missing = [f"{n} ({paths[n]})" for n in names if not os.access(paths[n], os.X_OK)]
    if missing:
        pytest.fail("missing control-plane binaries: " + ", ".join(missing)
                    + f"\nbuild them first (about 15-25 min on 2 cores, cached afterwards):\n    bash {BUILD}",
                    pytrace=False)
    return paths


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the test process dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_for(fn: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last one
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f": {last_exc!r}" if last_exc else ""))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """CA, a serving certificate for 127.0.0.1/localhost, and the service-account signing key."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=promptcache-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n"
                               "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver", "-keyout", "server.key",
             "-out", "server.csr", cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.crt", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


class ControlPlane:
    def __init__(self, workdir: Path, tools: dict[str, Path]):
        self.dir = workdir
        self.tools = tools
        self.procs: list[subprocess.Popen] = []
        self.etcd_port = free_port()
        self.peer_port = free_port()
        self.port = free_port()
        self.host = f"https://127.0.0.1:{self.port}"
        self.ca = workdir / "ca.crt"
        self.kubeconfig = workdir / "kubeconfig"
        self.logs: dict[str, Path] = {}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        p = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def start(self) -> "ControlPlane":
        d = self.dir
        make_pki(d)
        (d / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')
        self._spawn("etcd", [
            str(self.tools["etcd"]), "--data-dir", str(d / "etcd"), "--name", "test",
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn", "--quota-backend-bytes", str(2 << 30),
        ])
        self._spawn("kube-apiserver", [
            str(self.tools["kube-apiserver"]),
            "--etcd-servers", f"http://127.0.0.1:{self.etcd_port}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
            "--tls-cert-file", str(d / "server.crt"), "--tls-private-key-file", str(d / "server.key"),
            "--client-ca-file", str(d / "ca.crt"),
            "--token-auth-file", str(d / "tokens.csv"),
            "--authorization-mode", "RBAC",
            "--service-cluster-ip-range", "10.96.0.0/16",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(d / "sa.pub"),
            "--service-account-signing-key-file", str(d / "sa.key"),
            "--allow-privileged=true",
            "--disable-admission-plugins", "ServiceAccount",
            "--enable-priority-and-fairness=false",
            "--event-ttl", "10m",
            "-v", "1",
        ])
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.host, "certificate-authority": str(self.ca)}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin", "namespace": "default"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig))
        try:
            wait_for(self._ready, timeout=90, interval=0.2, what="kube-apiserver /readyz")
        except AssertionError:
            self.stop()
            tail = {n: p.read_text(errors="replace")[-3000:] for n, p in self.logs.items()}
            raise AssertionError(f"control plane did not become ready; logs: {json.dumps(tail, indent=1)}")
        return self

    def _ready(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: "
                                   + self.logs[Path(p.args[0]).name].read_text(errors="replace")[-3000:])
        ctx = ssl.create_default_context(cafile=str(self.ca))
        req = urllib.request.Request(f"{self.host}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):
    tools = require_tools("etcd", "kube-apiserver")
    # Short path: etcd's unix sockets dislike long paths.
    d = Path(tempfile.mkdtemp(prefix="pc-cp-"))
    cp = ControlPlane(d, tools).start()
    yield cp
    cp.stop()
    if os.environ.get("PROMPTCACHE_KEEP_CONTROL_PLANE_DIR"):
        print(f"control plane dir kept: {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane):
    from promptcache.operator.kube import Kube, configuration_from_environment

    return Kube(configuration_from_environment(str(control_plane.kubeconfig)), crd_cache_seconds=0.5)


def apply_crd(kube, doc: dict[str, Any], timeout: float = 20) -> None:
    kube.request("PATCH", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{doc['metadata']['name']}",
                 body=doc, content_type="application/apply-patch+yaml",
                 query=[("fieldManager", "tests"), ("force", "true")])

    wait_for(lambda: crd_established(kube, doc["metadata"]["name"]), timeout=timeout,
             what=f"CRD {doc['metadata']['name']} Established")


def crd_established(kube, name: str) -> bool:
    crd = kube.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in crd.get("status", {}).get("conditions", []))


def wait_served(kube, api_version: str, plural: str, timeout: float = 20) -> None:
    """After Established, discovery and the REST handler can lag a moment."""
    wait_for(lambda: any(r["name"] == plural for r in kube.request("GET", f"/apis/{api_version}")["resources"]),
             timeout=timeout, what=f"{api_version}/{plural} served")


@pytest.fixture(scope="session")
def crd(helm_release, kube):
    """The PromptCache CRD as a user gets it: installed by `helm install` of the chart (see helm_release)."""
    doc = yaml.safe_load(CRD_FILE.read_text())
    wait_for(lambda: crd_established(kube, doc["metadata"]["name"]), timeout=30, what="PromptCache CRD Established")
    wait_served(kube, "promptcache.io/v1alpha1", "promptcaches")
    return doc


_ns_counter = [0]


@pytest.fixture
def namespace(kube, request):
    """A fresh namespace per test (nothing deletes its contents: no namespace controller runs)."""
    _ns_counter[0] += 1
    name = f"t{_ns_counter[0]}-{request.node.name.lower().replace('_', '-')[:40].strip('-')}"
    name = "".join(c for c in name if c.isalnum() or c == "-").strip("-")[:63]
    kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": name}})
    yield name
    # Keep later tests' operators (which watch all namespaces) from resuming this test's PromptCaches.
    try:
        kube.request("DELETE", f"/apis/promptcache.io/v1alpha1/namespaces/{name}/promptcaches")
    except Exception:  # noqa: BLE001 - the CRD may not be installed in this session
        pass


class OperatorProcess:
    """`python -m promptcache.operator` as a subprocess against the test API server."""

    def __init__(self, kubeconfig: Path, log: Path, *args: str, env: dict[str, str] | None = None,
                 wrap: tuple[str, ...] = (), unset: tuple[str, ...] = ()):
        full_env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                    "PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "2", **(env or {})}
        for name in unset:
            full_env.pop(name, None)
        self.log = log
        self.metrics_port = free_port()
        self.proc = subprocess.Popen([*wrap, sys.executable, "-m", "promptcache.operator", "--liveness", "",
                                      "--metrics-port", str(self.metrics_port), "--log-format", "plain", *args],
                                     stdout=log.open("ab"), stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True, cwd=str(ROOT), preexec_fn=_die_with_parent)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def start_operator(operator_kubeconfig, control_plane, request):
    """Start `python -m promptcache.operator` subprocesses authenticated as the chart's ServiceAccount.
    Logs go to <control plane dir>/operator-logs/ (kept with PROMPTCACHE_KEEP_CONTROL_PLANE_DIR=1) and their
    tails are printed when the test fails."""
    started: list[OperatorProcess] = []
    logs = control_plane.dir / "operator-logs"
    logs.mkdir(exist_ok=True)

    def start(*args: str, env: dict[str, str] | None = None, name: str = "operator", wrap: tuple[str, ...] = (),
              unset: tuple[str, ...] = ()) -> OperatorProcess:
        """wrap: argv prefix (e.g. setpriv to run as another uid); unset: environment variables to drop."""
        op = OperatorProcess(operator_kubeconfig, logs / f"{request.node.name}-{name}-{len(started)}.log", *args,
                             env=env, wrap=wrap, unset=unset)
        started.append(op)
        return op

    yield start
    for op in started:
        op.kill(signal.SIGTERM)
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for op in started:
            print(f"===== {op.log} (exit {op.proc.returncode}) =====\n{op.output()[-6000:]}")


CHART = ROOT / "charts" / "promptcache-operator"
RELEASE = "promptcache"
RELEASE_NS = "promptcache-system"


class Helm:
    def __init__(self, binary: Path, home: Path, kubeconfig: Path | None):
        self.binary = binary
        self.env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}
        if kubeconfig:
            self.env["KUBECONFIG"] = str(kubeconfig)

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([str(self.binary), *args], env=self.env, capture_output=True, text=True, timeout=300)
        if check and p.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p


@pytest.fixture(scope="session")
def helm_offline(tmp_path_factory) -> Helm:
    """helm for lint/template (no API server)."""
    tools = require_tools("helm")
    return Helm(tools["helm"], tmp_path_factory.mktemp("helm"), None)


@pytest.fixture(scope="session")
def helm(control_plane, tmp_path_factory) -> Helm:
    tools = require_tools("helm")
    return Helm(tools["helm"], tmp_path_factory.mktemp("helm"), control_plane.kubeconfig)


@pytest.fixture(scope="session")
def helm_release(helm, kube):
    """The chart installed once per session (CRDs, peering object, PriorityClass, RBAC, Deployment)."""
    start = time.monotonic()
    out = helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
               "--set", "replicaCount=2")
    return {"release": RELEASE, "namespace": RELEASE_NS, "seconds": time.monotonic() - start,
            "stdout": out.stdout}


@pytest.fixture(scope="session")
def operator_kubeconfig(helm_release, kube, control_plane) -> Path:
    """A kubeconfig with a token of the chart's ServiceAccount: the operator runs with exactly the chart's RBAC."""
    sa = f"{RELEASE}-promptcache-operator"
    tr = kube.request("POST", f"/api/v1/namespaces/{RELEASE_NS}/serviceaccounts/{sa}/token",
                      body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                            "spec": {"expirationSeconds": 7200}})
    token = tr["status"]["token"]
    cfg = yaml.safe_load(control_plane.kubeconfig.read_text())
    cfg["users"] = [{"name": "admin", "user": {"token": token}}]
    path = control_plane.dir / "operator-kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path
