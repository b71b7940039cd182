#!/usr/bin/env python3
"""A real single-node Kubernetes on this machine: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kubelet, kube-proxy (iptables mode), containerd + runc, the bridge CNI. Used by tests/cluster (make test-cluster);
runnable by hand:

    hack/cluster/node.py up      # prints KUBECONFIG=...; the node keeps running until `down` (or Ctrl-C)
    hack/cluster/node.py down    # stops what `up` started (by PID) and removes its bridge, rules, mounts, cgroups

Binaries from hack/tools/build.sh (cached in ~/.cache/promptcache-tools), images from hack/cluster/images.py
(imported into containerd's k8s.io namespace; containerd's root, and so the imported images, persist in
~/.cache/promptcache-cluster/containerd so a warm run imports nothing). Needs root (CI and this machine run as root).

Network: the node's IP is the gateway of its own bridge `pcbr0` (10.244.0.1/24, made here, no uplink); the API
server and the kubelet listen on that IP only, etcd and the other components' ports on 127.0.0.1. Nothing is
reachable from outside the machine and no traffic leaves it.

What this container needs (cgroup v1, no CAP_SYS_RESOURCE): containerd's CRI `restrict_oom_score_adj = true` (else
every sandbox fails with "can't get final child's PID from pipe: EOF"), the cgroupfs driver, a locally built pause
image; kubelet `failCgroupV1: false` and `cgroupDriver: cgroupfs`; the bridge CNI `isDefaultGateway: true` (pods
reach ClusterIPs through it); kube-apiserver `--kubelet-preferred-address-types=InternalIP`.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "devtools"))
import images  # noqa: E402
from promptcache_devtools.procs import free_port  # noqa: E402  (never the same port twice: etcd's two, ...)

CACHE = images.CACHE
BRIDGE = "pcbr0"
NODE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/24"
NODE_NAME = "pc-node"
STATE = CACHE / "running.json"      # what `up` started: `down` (or the next `up`) stops exactly that
CNI_BIN = next((p for p in ("/usr/lib/cni", "/opt/cni/bin") if Path(p, "bridge").exists()), "/usr/lib/cni")


def log(msg: str) -> None:
    print(f"cluster: {msg}", file=sys.stderr, flush=True)


def tools() -> dict[str, Path]:
    names = ["etcd", "kube-apiserver", "kubectl", "helm", "kubelet", "kube-proxy", "kube-scheduler",
             "kube-controller-manager", "pause"]
    build = ROOT / "hack" / "tools" / "build.sh"
    out = subprocess.run(["bash", str(build), "--print-dir", *names], check=True, capture_output=True,
                         text=True).stdout
    paths = {k: Path(v) for k, v in (line.split("=", 1) for line in out.split())}
    missing = [n for n, p in paths.items() if not p.exists()]
    if missing:
        log(f"building {' '.join(missing)} (hack/tools/build.sh; cold: ~15 CPU-minutes for the node binaries)")
        subprocess.run(["bash", str(build), *missing], check=True, stdout=sys.stderr)
    return paths


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


def openssl(d: Path, *args: str) -> None:
    sh("openssl", *args, cwd=d)


def make_pki(d: Path) -> None:
    openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=promptcache-cluster-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    (d / "server.ext").write_text(
        f"subjectAltName=IP:{NODE_IP},IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost\n"
        "extendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subj, ext in (("server", "/CN=kube-apiserver", "server.ext"),
                            ("admin", "/O=system:masters/CN=admin", "client.ext")):
        openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout", f"{name}.key", "-out",
                f"{name}.csr")
        openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", ext, "-out", f"{name}.crt")
    openssl(d, "genrsa", "-out", "sa.key", "2048")
    openssl(d, "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")


def kubeconfig(d: Path) -> Path:
    path = d / "admin.kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "pc",
        "clusters": [{"name": "pc", "cluster": {"server": f"https://{NODE_IP}:6443",
                                                "certificate-authority": str(d / "ca.crt")}}],
        "users": [{"name": "admin", "user": {"client-certificate": str(d / "admin.crt"),
                                             "client-key": str(d / "admin.key")}}],
        "contexts": [{"name": "pc", "context": {"cluster": "pc", "user": "admin"}}]}))
    return path


def containerd_config(w: Path) -> Path:
    root = CACHE / "containerd"
    cfg = f"""version = 2
root = "{root}"
state = "{w}/containerd-state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{w}/containerd.sock"
[ttrpc]
  address = "{w}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{images.PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{w}/cni"
"""
    (w / "cni").mkdir(exist_ok=True)
    (w / "cni" / "10-pcbr.conflist").write_text(json.dumps({
        "cniVersion": "0.4.0", "name": "pc", "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "isDefaultGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP,
                                                         "rangeStart": "10.244.0.10"}]],
                      "dataDir": f"{w}/cni-ipam"}},
            {"type": "loopback"}]}))
    path = w / "containerd.toml"
    path.write_text(cfg)
    return path


class Node:
    def __init__(self, workdir: Path | None = None):
        self.w = Path(workdir) if workdir else Path(f"/tmp/pcc-{os.getpid()}")
        self.procs: dict[str, int] = {}
        self.kubeconfig = self.w / "admin.kubeconfig"
        self.timings: dict[str, float] = {}

    # -- processes --------------------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        logf = (self.w / "logs" / f"{name}.log").open("ab")
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, **(env or {})})
        self.procs[name] = p.pid
        self.save()
        return p

    def save(self) -> None:
        STATE.write_text(json.dumps({"workdir": str(self.w), "procs": self.procs}))

    def logtail(self, name: str, n: int = 3000) -> str:
        f = self.w / "logs" / f"{name}.log"
        return f.read_text(errors="replace")[-n:] if f.exists() else ""

    def wait(self, what: str, fn, timeout: float, proc: str | None = None) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if fn():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if proc and not _alive(self.procs.get(proc)):
                raise RuntimeError(f"{proc} exited while waiting for {what}:\n{self.logtail(proc)}")
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}" +
                           (f":\n{self.logtail(proc)}" if proc else ""))

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120):
        return subprocess.run([str(self.tools["kubectl"]), "--kubeconfig", str(self.kubeconfig), *args],
                              check=check, capture_output=True, text=True, input=input, timeout=timeout)

    # -- up ---------------------------------------------------------------------------------------------------
    def up(self) -> "Node":
        if os.geteuid() != 0:
            raise RuntimeError("the test cluster needs root (containerd, runc, the bridge, iptables)")
        CACHE.mkdir(parents=True, exist_ok=True)
        self._lock = open(CACHE / "cluster.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another test cluster runs on this machine ({CACHE}/cluster.lock)") from None
        if STATE.exists():  # a previous run that was not torn down (killed): clean it first
            log("cleaning up a previous cluster that was not torn down")
            down_from_state()
        t0 = time.monotonic()
        subprocess.run(["bash", str(HERE / "deps.sh")], check=True, stdout=sys.stderr)
        self.tools = tools()
        self.timings["tools"] = time.monotonic() - t0
        for d in ("logs", "pki", "etcd", "kubelet", "containerd-state", "containerd-opt"):
            (self.w / d).mkdir(parents=True, exist_ok=True)
        self.save()
        pki = self.w / "pki"
        make_pki(pki)
        kubeconfig(pki)
        shutil.copy(pki / "admin.kubeconfig", self.kubeconfig)
        self.kubeconfig.write_text((pki / "admin.kubeconfig").read_text())
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")

        # containerd first: the image import overlaps the control plane's start.
        self.spawn("containerd", ["containerd", "--config", str(containerd_config(self.w))])
        sock = self.w / "containerd.sock"
        self.wait("containerd", lambda: sh("ctr", "-a", str(sock), "version").returncode == 0, 30, "containerd")
        t1 = time.monotonic()
        self.import_images(sock)
        self.timings["images"] = time.monotonic() - t1

        etcd_port, etcd_peer = free_port(), free_port()
        self.spawn("etcd", [str(self.tools["etcd"]), "--data-dir", str(self.w / "etcd"),
                            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
                            "--unsafe-no-fsync", "--quota-backend-bytes", str(1 << 30)])
        self.spawn("kube-apiserver", [
            str(self.tools["kube-apiserver"]), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={NODE_IP}", "--secure-port=6443", f"--advertise-address={NODE_IP}",
            f"--tls-cert-file={pki}/server.crt", f"--tls-private-key-file={pki}/server.key",
            f"--client-ca-file={pki}/ca.crt", f"--service-account-key-file={pki}/sa.pub",
            f"--service-account-signing-key-file={pki}/sa.key",
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC", f"--kubelet-client-certificate={pki}/admin.crt",
            f"--kubelet-client-key={pki}/admin.key", "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true", "--profiling=false", "--enable-priority-and-fairness=false"])
        self.wait("kube-apiserver /readyz", lambda: self.kubectl("get", "--raw", "/readyz", timeout=5).returncode == 0,
                  90, "kube-apiserver")
        admin = str(self.kubeconfig)
        self.spawn("kube-controller-manager", [
            str(self.tools["kube-controller-manager"]), f"--kubeconfig={admin}", f"--authentication-kubeconfig={admin}",
            f"--authorization-kubeconfig={admin}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}", f"--service-account-private-key-file={pki}/sa.key",
            f"--root-ca-file={pki}/ca.crt", "--use-service-account-credentials=false",
            f"--cluster-cidr={POD_CIDR}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
            "--concurrent-daemonset-syncs=2", "--node-monitor-grace-period=40s"])
        self.spawn("kube-scheduler", [str(self.tools["kube-scheduler"]), f"--kubeconfig={admin}",
                                      f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
                                      "--leader-elect=false", "--bind-address=127.0.0.1",
                                      f"--secure-port={free_port()}"])
        (self.w / "resolv.conf").write_text("")  # no cluster DNS: pods get no nameserver (Services by ClusterIP)
        kcfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": f"unix://{sock}", "address": NODE_IP, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"}, "failSwapOn": False,
            "resolvConf": str(self.w / "resolv.conf"),
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%", "imagefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "maxPods": 40, "syncFrequency": "5s",
            "fileCheckFrequency": "5s", "nodeStatusUpdateFrequency": "5s", "shutdownGracePeriod": "0s",
            "cpuManagerReconcilePeriod": "5s", "volumeStatsAggPeriod": "10s",
        }
        (self.w / "kubelet.yaml").write_text(json.dumps(kcfg))
        self.spawn("kubelet", [str(self.tools["kubelet"]), f"--config={self.w}/kubelet.yaml",
                               f"--kubeconfig={admin}", f"--root-dir={self.w}/kubelet",
                               f"--cert-dir={self.w}/kubelet/pki", f"--hostname-override={NODE_NAME}",
                               f"--node-ip={NODE_IP}"])
        pcfg = {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
                "mode": "iptables", "clientConnection": {"kubeconfig": admin}, "clusterCIDR": POD_CIDR,
                "hostnameOverride": NODE_NAME, "bindAddress": "127.0.0.1",
                "healthzBindAddress": f"127.0.0.1:{free_port()}", "metricsBindAddress": f"127.0.0.1:{free_port()}",
                "nodePortAddresses": [f"{NODE_IP}/32"],
                "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
                "iptables": {"localhostNodePorts": False, "syncPeriod": "5s", "minSyncPeriod": "0s"}}
        (self.w / "kube-proxy.yaml").write_text(json.dumps(pcfg))
        self.spawn("kube-proxy", [str(self.tools["kube-proxy"]), f"--config={self.w}/kube-proxy.yaml"])
        self.wait("node Ready", self._node_ready, 120, "kubelet")
        self.wait("the default ServiceAccount", lambda: self.kubectl(
            "get", "serviceaccount", "default", "-n", "default", timeout=5).returncode == 0, 60,
            "kube-controller-manager")
        self.timings["up"] = time.monotonic() - t0
        log(f"node Ready in {self.timings['up']:.0f}s (tools {self.timings['tools']:.0f}s, "
            f"images {self.timings['images']:.0f}s); KUBECONFIG={self.kubeconfig}")
        return self

    def _node_ready(self) -> bool:
        out = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False, timeout=5)
        if out.returncode:
            return False
        conds = {c["type"]: c["status"] for c in json.loads(out.stdout)["status"].get("conditions", [])}
        return conds.get("Ready") == "True"

    def import_images(self, sock: Path) -> None:
        key = images.layers_key()
        stamp = CACHE / "containerd" / "promptcache-images.key"
        have = sh("ctr", "-a", str(sock), "-n", "k8s.io", "images", "ls", "-q", check=False).stdout.split()
        wanted = [images.PAUSE_IMAGE, images.OPERATOR_IMAGE, images.SIDECAR_IMAGE]
        if stamp.exists() and stamp.read_text() == key and all(w in have for w in wanted):
            log("images already imported (containerd root persists in the cache)")
            return
        log("importing images into containerd (k8s.io namespace)")
        for attempt in (1, 2):
            p = subprocess.Popen(["ctr", "-a", str(sock), "-n", "k8s.io", "images", "import", "-"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                images.build_archive(p.stdin)
                p.stdin.close()
            except BrokenPipeError:  # ctr stopped reading: what it said is the reason
                pass
            out = p.stdout.read().decode(errors="replace")
            if not p.wait():
                break
            # An image replaced under the same name (a rebuilt layer) leaves its old snapshots to containerd's
            # garbage collector, which can remove a parent while the new one is unpacked onto it ("parent snapshot
            # ... does not exist"): seen once in a `make test` after the operator's layer changed. Once more.
            if attempt == 2 or "does not exist" not in out:
                raise RuntimeError(f"ctr images import failed (exit {p.returncode}):\n{out[-3000:]}")
            log(f"ctr images import failed ({out.strip().splitlines()[-1][:200] if out.strip() else 'no output'}); "
                "importing again")
        have = sh("ctr", "-a", str(sock), "-n", "k8s.io", "images", "ls", "-q").stdout.split()
        missing = [w for w in wanted if w not in have]
        if missing:
            raise RuntimeError(f"images missing after import: {missing}\n{out[-2000:]}")
        # Keep only the unpacked snapshots of the big layers: their blobs (the site layer is ~5 GB) would double the
        # disk used; the cached layer tars can re-import them.
        for layer in (images.site_layer(), images.base_layer()):
            d = images.digests([layer])[0]
            sh("ctr", "-a", str(sock), "-n", "k8s.io", "content", "rm", f"sha256:{d}", check=False)
        stamp.write_text(key)

    # -- down -------------------------------------------------------------------------------------------------
    def down(self) -> None:
        down_from_state()


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stop(name: str, pid: int, timeout: float = 15) -> None:
    if not _alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end and _alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    if _alive(pid):
        log(f"{name} ({pid}) ignored SIGTERM: SIGKILL")
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions `text` (the shims of our containerd carry its socket path)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().split(")")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def down_from_state() -> None:
    """Stop everything `up` recorded, by PID, then remove the containers, mounts, cgroups, bridge and rules."""
    if not STATE.exists():
        return
    st = json.loads(STATE.read_text())
    w = Path(st["workdir"])
    procs: dict[str, int] = st["procs"]
    kubectl = shutil.which("kubectl") or str(images.ROOT)  # placeholder, replaced below
    kubeconfig = w / "admin.kubeconfig"
    sock = w / "containerd.sock"
    try:
        kubectl = str(tools_quiet().get("kubectl", ""))
    except Exception:  # noqa: BLE001
        kubectl = ""
    # 1. No controller recreates pods; the kubelet tears the sandboxes down (CNI DEL, netns) while it still runs.
    for name in ("kube-controller-manager", "kube-scheduler"):
        if name in procs:
            _stop(name, procs[name])
    if kubectl and _alive(procs.get("kube-apiserver")) and _alive(procs.get("kubelet")):
        subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), "delete", "pods", "--all", "--all-namespaces",
                        "--grace-period=0", "--force", "--wait=false"], capture_output=True, timeout=60)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            r = subprocess.run(["ctr", "-a", str(sock), "-n", "k8s.io", "tasks", "ls", "-q"], capture_output=True,
                               text=True)
            if r.returncode or not r.stdout.split():
                break
            time.sleep(0.5)
    for name in ("kube-proxy", "kubelet", "kube-apiserver", "etcd"):
        if name in procs:
            _stop(name, procs[name])
    # 2. Containers the kubelet left: kill their tasks and delete them, then containerd, then its shims.
    if _alive(procs.get("containerd")):
        ctr = ["ctr", "-a", str(sock), "-n", "k8s.io"]
        for tid in subprocess.run(ctr + ["tasks", "ls", "-q"], capture_output=True, text=True).stdout.split():
            subprocess.run(ctr + ["tasks", "kill", "-s", "SIGKILL", tid], capture_output=True)
            subprocess.run(ctr + ["tasks", "delete", "-f", tid], capture_output=True)
        for cid in subprocess.run(ctr + ["containers", "ls", "-q"], capture_output=True, text=True).stdout.split():
            subprocess.run(ctr + ["containers", "delete", cid], capture_output=True)
        _stop("containerd", procs["containerd"])
    for pid in _pids_mentioning(str(sock)):  # containerd-shim-runc-v2 -address <sock>: and what runs under it
        for k in [pid, *_descendants(pid)]:
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # 3. Mounts under the work dir and containerd's root (overlay rootfs, netns, volumes), deepest first.
    prefixes = (str(w) + "/", str(CACHE / "containerd") + "/", "/run/netns/cni-", "/var/run/netns/cni-")
    for _ in range(3):
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        mine = sorted({m for m in mounts if m.startswith(prefixes)}, key=len, reverse=True)
        if not mine:
            break
        for m in mine:
            subprocess.run(["umount", "-l", m], capture_output=True)
    for d in ("/run/netns", "/var/run/netns"):
        for f in Path(d).glob("cni-*") if Path(d).exists() else []:
            try:
                f.unlink()
            except OSError:
                pass
    # 4. The pod cgroups the kubelet made (cgroupfs driver, cgroup v1: kubepods under each controller).
    for ctl in Path("/sys/fs/cgroup").iterdir():
        top = ctl / "kubepods"
        if top.is_dir():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                try:
                    d.rmdir()
                except OSError:
                    pass
            try:
                top.rmdir()
            except OSError:
                pass
    # 5. kube-proxy's rules (its own --cleanup), then the bridge (its veths went with the netns).
    kp = tools_quiet().get("kube-proxy")
    if kp and kp.exists():
        subprocess.run([str(kp), "--cleanup"], capture_output=True, timeout=60)
    _remove_kube_chains()
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    STATE.unlink(missing_ok=True)
    if os.environ.get("PROMPTCACHE_KEEP_CLUSTER_DIR") != "1":
        shutil.rmtree(w, ignore_errors=True)
    log(f"torn down ({w})")


def _remove_kube_chains() -> None:
    """The kubelet's own chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT) and any kube-proxy left:
    the jumps to them from the built-in chains, then the chains, in every table, IPv4 and IPv6."""
    for save, cmd in (("iptables-save", "iptables"), ("ip6tables-save", "ip6tables")):
        if not shutil.which(save):
            continue
        for table in ("filter", "nat", "mangle", "raw"):
            out = subprocess.run([save, "-t", table], capture_output=True, text=True).stdout
            chains = [ln[1:].split()[0] for ln in out.splitlines() if ln.startswith(":KUBE-")]
            for ln in out.splitlines():
                parts = ln.split()
                if ln.startswith("-A ") and "KUBE-" in ln and not parts[1].startswith("KUBE-"):
                    subprocess.run([cmd, "-t", table, "-D", *parts[1:]], capture_output=True)
            for c in chains:
                subprocess.run([cmd, "-t", table, "-F", c], capture_output=True)
            for c in chains:
                subprocess.run([cmd, "-t", table, "-X", c], capture_output=True)


def tools_quiet() -> dict[str, Path]:
    build = ROOT / "hack" / "tools" / "build.sh"
    out = subprocess.run(["bash", str(build), "--print-dir", "kubectl", "kube-proxy"], capture_output=True,
                         text=True).stdout
    return {k: Path(v) for k, v in (line.split("=", 1) for line in out.split())}


def leftovers() -> list[str]:
    """What of a torn-down cluster is still there (tests/cluster asserts this is empty)."""
    out = []
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        out.append(f"bridge {BRIDGE}")
    for save in ("iptables-save", "ip6tables-save"):
        rules = subprocess.run([save], capture_output=True, text=True).stdout if shutil.which(save) else ""
        out += [f"{save}: {line}" for line in rules.splitlines() if "KUBE-" in line or "CNI-" in line][:5]
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    out += [f"mount {m}" for m in mounts if m.startswith(str(CACHE / "containerd") + "/") or "/pcc-" in m]
    out += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/kubepods")]
    out += [f"process {pid}" for pid in _pids_mentioning("/containerd.sock") if pid != os.getpid()
            and "pcc-" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["up", "down", "leftovers"])
    a = p.parse_args(argv)
    if a.cmd == "down":
        down_from_state()
        return 0
    if a.cmd == "leftovers":
        left = leftovers()
        print("\n".join(left) or "nothing left")
        return 1 if left else 0
    node = Node()
    try:
        node.up()
    except Exception as exc:  # noqa: BLE001
        log(f"cannot start: {exc}")
        down_from_state()
        return 1
    print(f"KUBECONFIG={node.kubeconfig}")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    down_from_state()
    return 0


if __name__ == "__main__":
    sys.exit(main())
