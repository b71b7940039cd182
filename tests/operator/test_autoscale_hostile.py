"""Hostile sidecar metrics: what one pod's /metrics can do to the operator's status and autoscaler. Sums that
overflow, values and labels that are not finite or not sizes, an answer that is not HTTP, a trickle, a redirect and
a curve of thousands of sizes: each stays that pod's problem (absent figures, no scrape), never an exception out of
a tick or a reconcile, an Infinity in a status patch, or a wait on the operator-wide lock."""
from __future__ import annotations

import http.server
import json
import math
import socket
import threading
import time

import pytest

from promptcache.operator import autoscale, fleet, tuning
from promptcache.operator.builders import OperatorDefaults
from promptcache.operator.fleet import Counters, Observation, Tokens

from test_autoscale_tick import CFG, LOG, LOW, Gi, Mi, FakeKube, body, resizer, unscraped


def _json_strict(obj) -> str:
    return json.dumps(obj, allow_nan=False)   # what the API server takes: no Infinity, no NaN


# --- 1. sums that overflow -----------------------------------------------------------------------------------------
def test_parse_drops_totals_that_overflow_to_infinity():
    c = fleet.parse('promptcache_budget_bytes{tier="device",x="a"} 1e308\n'
                    'promptcache_budget_bytes{tier="device",x="b"} 1e308\n'
                    'promptcache_stored_bytes{tier="device",x="a"} -1e308\n'
                    'promptcache_stored_bytes{tier="device",x="b"} -1e308\n'
                    'promptcache_stored_bytes{tier="device",x="c"} -1e308\n'
                    'promptcache_hit_tokens_total{tier="device",x="a"} 1e308\n'
                    'promptcache_hit_tokens_total{tier="device",x="b"} 1e308\n'
                    'promptcache_missed_tokens_total 7\n')
    assert c.budget_bytes == 0.0 and c.stored_bytes == 0.0
    assert all(math.isfinite(getattr(c, f)) for f in ("capacity_evictions", "capacity_age_sum", "capacity_age_count",
                                                      "all_tiers_stored_bytes", "committed_bytes"))
    assert all(math.isfinite(x) for x in (c.tokens.memory_hits, c.tokens.any_tier_hits, c.tokens.lookups))


class InfBudgetSource:
    """pod-1 reports a budget that is not finite, pod-2 an honest one above the recorded memory."""

    def signal(self, obs: Observation):
        return None, {"pod-1": Counters(budget_bytes=math.inf), "pod-2": Counters(budget_bytes=8 * Gi)}


def test_a_pod_with_a_budget_that_is_not_finite_does_not_stop_the_others():
    LOG.clear()
    out = autoscale.tick(FakeKube(vpa=True), body(), unscraped(), CFG, OperatorDefaults(), resizer(),
                         source=InfBudgetSource())
    assert LOG == [f"resize 10.0.0.2:50051 {4 * Gi}"], out.errors


def test_one_pods_failure_in_the_budget_loop_does_not_stop_the_others():
    def flaky(target: str, budget: int, timeout: float):
        if target.startswith("10.0.0.1"):
            raise RuntimeError("boom")
        return resizer()(target, budget, timeout)

    class Source:
        def signal(self, obs):
            return None, {e.pod: Counters(budget_bytes=8 * Gi) for e in obs.ready}

    LOG.clear()
    out = autoscale.tick(FakeKube(vpa=True), body(), unscraped(), CFG, OperatorDefaults(), flaky, source=Source())
    assert LOG == [f"resize 10.0.0.2:50051 {4 * Gi}"]
    assert any("pod-1" in e for e in out.errors)


# --- 2. decide on any Signal, sizes that are not sizes ------------------------------------------------------------
BAD = [math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("field", ["hit_ratio", "lookup_tokens_per_s", "capacity_evictions_per_s", "eviction_age_s",
                                   "stored_bytes"])
@pytest.mark.parametrize("x", BAD)
def test_decide_takes_a_signal_with_figures_that_are_not_finite(field, x):
    for base in (LOW, tuning.Signal(hit_ratio=0.99, lookup_tokens_per_s=1e4, capacity_evictions_per_s=0,
                                    stored_bytes=1 * Gi)):
        sig = tuning.Signal(**{**base.__dict__, field: x})
        d = tuning.decide(sig, 4 * Gi, 2 * Gi, 16 * Gi, tuning.Policy(), None, 1000.0)
        assert 2 * Gi <= d.memory_bytes <= 16 * Gi
        s = tuning.sanitize(sig)
        assert all(v is None or math.isfinite(v) for v in (s.hit_ratio, s.lookup_tokens_per_s,
                                                           s.capacity_evictions_per_s, s.eviction_age_s,
                                                           s.stored_bytes))


def test_decide_takes_a_curve_with_sizes_and_ratios_that_are_not_finite():
    curve = ((10 ** 400, 0.99), (4 * Gi, math.nan), (8 * Gi, math.inf), (float("inf"), 0.9), (6 * Gi, 0.9))
    sig = tuning.Signal(**{**LOW.__dict__, "curve": curve})
    d = tuning.decide(sig, 4 * Gi, 2 * Gi, 16 * Gi, tuning.Policy(), None, 1000.0)
    assert 2 * Gi <= d.memory_bytes <= 16 * Gi
    assert tuning.sanitize(sig).curve == ((6 * Gi, 0.9),)


@pytest.mark.parametrize("label", ["9" * 401, "9" * 20, str(2 ** 63 + 1), "0", "\u0661\u0662", "\u00b2", "1e3", ""])
def test_parse_drops_curve_sizes_that_are_not_sizes(label):
    text = (f'promptcache_mrc_hit_tokens_total{{capacity_bytes="{label}"}} 5\n'
            f'promptcache_mrc_lookup_tokens_total{{capacity_bytes="{label}"}} 10\n'
            'promptcache_mrc_hit_tokens_total{capacity_bytes="1048576"} 5\n'
            'promptcache_mrc_lookup_tokens_total{capacity_bytes="1048576"} 10\n')
    c = fleet.parse(text)
    assert c.mrc_hit_tokens == ((1048576, 5.0),) and c.mrc_lookup_tokens == ((1048576, 10.0),)


def test_a_huge_capacity_label_gives_no_exception_out_of_decide():
    c0 = fleet.parse("")
    c = fleet.parse(f'promptcache_mrc_hit_tokens_total{{capacity_bytes="{"9" * 401}"}} 5\n'
                    f'promptcache_mrc_lookup_tokens_total{{capacity_bytes="{"9" * 401}"}} 10\n'
                    'promptcache_hit_tokens_total{tier="device"} 10\npromptcache_missed_tokens_total 1000\n'
                    'promptcache_evictions_total{tier="device",reason="capacity"} 100\n')
    sig = fleet.aggregate([fleet.rates(c0, c, 1.0)])
    tuning.decide(sig, 4 * Gi, 2 * Gi, 16 * Gi, tuning.Policy(), None, 1000.0)


# --- 3. status numbers --------------------------------------------------------------------------------------------
def test_status_usage_is_finite_and_ratios_within_0_1():
    hostile = [Counters(tokens=Tokens(math.inf, 1e308, 1e308), all_tiers_stored_bytes=1e308),
               Counters(tokens=Tokens(-5, -5, -6), all_tiers_stored_bytes=1e308)]
    usage = fleet.status_usage(hostile)
    _json_strict(usage)
    assert "memoryBytes" not in usage   # the sum is not finite: unknown
    assert all(0 <= usage[k] <= 1 for k in ("hitRatio", "anyTierHitRatio") if k in usage)
    assert fleet.status_usage([Counters(tokens=Tokens(-5, -5, -6))]) == {"memoryBytes": 0}   # no lookups
    assert fleet.hit_ratio(math.inf, 10) is None and fleet.hit_ratio(1, math.inf) is None
    assert fleet.hit_ratio(20, 10) == 1.0 and fleet.hit_ratio(-1, 10) == 0.0


class SignalSource:
    def __init__(self, sig):
        self.sig = sig

    def signal(self, obs):
        return self.sig, {e.pod: Counters(budget_bytes=4 * Gi - 512 * Mi) for e in obs.ready}


@pytest.mark.parametrize("x", BAD)
def test_the_last_decision_in_the_status_is_finite(x):
    kube = FakeKube(vpa=True)
    sig = tuning.Signal(hit_ratio=x, lookup_tokens_per_s=1e4, capacity_evictions_per_s=x, stored_bytes=x)
    LOG.clear()
    autoscale.tick(kube, body(), unscraped(), CFG, OperatorDefaults(), resizer(), source=SignalSource(sig))
    assert "autoscaling" in kube.status
    _json_strict(kube.status)


# --- 4. and 6. the scrape: not HTTP, trickles, redirects -----------------------------------------------------------
def _raw_server(handler):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)

    def loop():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return s


def _answer(raw: bytes, per_byte_s: float = 0.0):
    def handler(c):
        try:
            c.recv(65536)
            if per_byte_s:
                for i in range(len(raw)):
                    c.sendall(raw[i:i + 1])
                    time.sleep(per_byte_s)
            else:
                c.sendall(raw)
            time.sleep(0.2)
        except OSError:
            pass
        finally:
            c.close()
    return handler


NOT_HTTP = {
    "garbage status line": b"hello\r\n\r\n",
    "bad chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "header line too long": b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
    "too many headers": b"HTTP/1.1 200 OK\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(101)) + b"\r\n",
}


@pytest.mark.parametrize("name", sorted(NOT_HTTP))
def test_an_answer_that_is_not_http_is_a_failed_scrape(name):
    s = _raw_server(_answer(NOT_HTTP[name]))
    try:
        assert fleet.scrape(f"http://127.0.0.1:{s.getsockname()[1]}/metrics", timeout=2) is None
    finally:
        s.close()


def test_a_raising_scrape_is_that_pods_failure_only():
    def scrape(url, timeout):
        if "10.0.0.1" in url:
            raise RuntimeError("boom")
        return Counters(budget_bytes=1.0)

    obs = fleet.Fleet(scrape=scrape).observe(FakeKube(vpa=True), autoscale.Owner("c", "ns", "u"))
    assert set(obs.counters) == {"pod-2"}


def test_the_deadline_covers_the_status_line_and_headers():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Padding: " + b"a" * 60 + b"\r\n\r\n"
    s = _raw_server(_answer(head, per_byte_s=0.05))   # about 4 s of headers
    try:
        t = time.monotonic()
        assert fleet.scrape(f"http://127.0.0.1:{s.getsockname()[1]}/metrics", timeout=1.0) is None
        assert time.monotonic() - t < 2.0
    finally:
        s.close()


def test_a_redirect_is_not_followed():
    hits: list[str] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path == "/metrics":
                self.send_response(302)
                self.send_header("Location", "/internal/admin")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                b = b'promptcache_hit_tokens_total{tier="device"} 1\n'
                self.send_response(200)
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert fleet.scrape(f"http://127.0.0.1:{srv.server_address[1]}/metrics", timeout=2) is None
        assert hits == ["/metrics"]
        assert fleet.scrape(f"http://127.0.0.1:{srv.server_address[1]}/ok", timeout=2).tokens.memory_hits == 1
    finally:
        srv.shutdown()
        srv.server_close()


# --- 5. curves of many sizes ---------------------------------------------------------------------------------------
def _curve_text(n: int, scale: int = 1) -> str:
    return "".join(f'promptcache_mrc_hit_tokens_total{{capacity_bytes="{s}"}} {s * scale % 7}\n'
                   f'promptcache_mrc_lookup_tokens_total{{capacity_bytes="{s}"}} {10 * scale}\n'
                   for s in range(1, n + 1))


def test_a_curve_of_more_than_max_mrc_sizes_is_no_curve():
    assert len(fleet.parse(_curve_text(fleet.MAX_MRC_SIZES)).mrc_hit_tokens) == fleet.MAX_MRC_SIZES
    c = fleet.parse(_curve_text(fleet.MAX_MRC_SIZES + 1))
    assert c.mrc_hit_tokens == () and c.mrc_lookup_tokens == ()


def test_rates_and_curve_are_linear_in_the_sizes():
    n = 20000   # past parse's cap: built directly, as from any source
    pts = tuple((s, float(s)) for s in range(1, n + 1))
    c0 = Counters(mrc_hit_tokens=pts, mrc_lookup_tokens=pts)
    c = Counters(mrc_hit_tokens=tuple((s, 2.0 * s) for s, _ in pts),
                 mrc_lookup_tokens=tuple((s, 4.0 * s) for s, _ in pts))
    t = time.monotonic()
    r = fleet.rates(c0, c, 1.0)
    sig = fleet.aggregate([r, r])
    assert time.monotonic() - t < 1.0   # quadratic: minutes
    assert sig.curve is not None and len(sig.curve) == n


def test_rates_are_computed_outside_the_fleet_lock():
    fl = fleet.Fleet(window_s=10)
    pts = tuple((s, 1.0) for s in range(1, 11))
    c = Counters(mrc_hit_tokens=pts, mrc_lookup_tokens=pts)
    key = ("ns", "c", "pod-1")
    fl._history[key] = __import__("collections").deque([(0.0, c)])
    obs = Observation("ns", "c", 10.0, (), {"pod-1": c})
    held = []
    real = fleet.rates

    def spy(*a):
        held.append(fl._lock.locked())
        return real(*a)

    fleet.rates = spy
    try:
        fl.signal(obs)
    finally:
        fleet.rates = real
    assert held == [False]
