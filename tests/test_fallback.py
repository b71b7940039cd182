"""The client's fallback policy (promptcache.client.fallback) and its transport chain (promptcache.client.transport),
without a sidecar: which failure leads where, how long a failed transport is left alone (on a fake clock), and
that Put and Get both go through the one chain. test_bulk.py, test_sidecar.py and test_shm_security.py check the
same paths against a real sidecar."""
from __future__ import annotations

import itertools

import pytest

from promptcache.client import errors
from promptcache.client.fallback import (BULK, FALL_BACK, GET, GRPC, HOLD_SECONDS, PUT, RAISE, RETRY, SHM, Action,
                                         FallbackPolicy, Refused, decide, first_usable, retry_delay)
from promptcache.client.transport import GetCall, PutCall, TransportChain
from promptcache.contract.shm import SharedBufferError
from promptcache.v1 import kvcache_pb2 as pb


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


ERRORS = {
    "unavailable": errors.Unavailable("UNAVAILABLE: x"),
    "exhausted": errors.ResourceExhausted("RESOURCE_EXHAUSTED: x"),
    "not_found": errors.NotFound("NOT_FOUND: x"),
    "deadline": errors.DeadlineExceeded("DEADLINE_EXCEEDED: x"),
    "corrupt": errors.CorruptChunk("DATA_LOSS: x"),
    "invalid": errors.InvalidArgument("INVALID_ARGUMENT: x"),
    "denied": errors.PermissionDenied("PERMISSION_DENIED: x"),
    "unauthenticated": errors.Unauthenticated("UNAUTHENTICATED: x"),
    "refused_exhausted": Refused(errors.ResourceExhausted("RESOURCE_EXHAUSTED: --shm-max-buffers")),
    "refused_file": Refused(SharedBufferError("not the buffer the sidecar created")),
    "other": RuntimeError("a bug"),
}

# transport, op, error -> decision on the first attempt. Everything not listed raises.
GOLDEN = {
    (BULK, PUT, "unavailable"): FALL_BACK,
    (BULK, GET, "unavailable"): FALL_BACK,
    (BULK, GET, "exhausted"): FALL_BACK,          # --max-large-requests: gRPC Get serves it
    (SHM, PUT, "not_found"): RETRY,               # the sidecar forgot the buffer: a new one, once
    (SHM, GET, "not_found"): RETRY,
    **{(t, op, e): FALL_BACK for t in (BULK, SHM, GRPC) for op in (PUT, GET)
       for e in ("refused_exhausted", "refused_file")},
}


@pytest.mark.parametrize("transport, op, error", list(itertools.product((BULK, SHM, GRPC), (PUT, GET), ERRORS)))
def test_which_failure_leads_where(transport, op, error):
    assert decide(transport, op, ERRORS[error], 0) == GOLDEN.get((transport, op, error), RAISE)


def test_a_bulk_put_refused_for_its_size_is_the_answer_not_a_fallback():
    """gRPC Put would refuse the same chunks: retrying them there only costs time (test_bulk.py checks it live)."""
    assert decide(BULK, PUT, ERRORS["exhausted"]) == RAISE


@pytest.mark.parametrize("op", [PUT, GET])
def test_a_forgotten_shared_buffer_is_replaced_only_once(op):
    assert decide(SHM, op, ERRORS["not_found"], attempt=0) == RETRY
    assert all(decide(SHM, op, ERRORS["not_found"], attempt=a) == RAISE for a in (1, 2, 5))
    assert decide(SHM, op, ERRORS["refused_exhausted"], attempt=1) == FALL_BACK  # no new buffer: stream


def test_the_grpc_stream_never_falls_back_or_retries_here():
    """Its retries are PromptCacheClient._call's, inside the deadline."""
    for op, (name, error) in itertools.product((PUT, GET), ERRORS.items()):
        if not isinstance(error, Refused):
            assert decide(GRPC, op, error, 0) == RAISE, name


def test_a_fall_back_holds_for_the_hold_time_and_nothing_else_does():
    assert FALL_BACK.hold_seconds == HOLD_SECONDS == 5.0
    assert RETRY.hold_seconds == RAISE.hold_seconds == 0.0


@pytest.mark.parametrize("chain", [[BULK, SHM, GRPC], [BULK, GRPC], [SHM, GRPC], [GRPC]])
def test_first_usable_skips_held_transports_but_never_the_last(chain):
    now = 100.0
    assert first_usable(chain, {}, now) == 0
    everything_held = {name: now + 1 for name in chain}
    assert first_usable(chain, everything_held, now) == len(chain) - 1
    for held in range(len(chain) - 1):  # hold the first `held + 1`
        until = {name: now + 1 for name in chain[:held + 1]}
        assert first_usable(chain, until, now) == held + 1
        assert first_usable(chain, until, now + 1) == 0  # the hold ends exactly at its time
    assert first_usable(chain, {}, now, start=len(chain) - 1) == len(chain) - 1


def test_policy_holds_the_failed_transport_on_its_clock_then_prefers_it_again():
    clock = Clock()
    policy = FallbackPolicy(clock)
    chain = [BULK, SHM, GRPC]
    assert policy.failed(BULK, GET, ERRORS["unavailable"]) == FALL_BACK
    assert policy.held_until(BULK) == 1000.0 + HOLD_SECONDS
    for dt in (0.0, 1.0, HOLD_SECONDS - 0.001):
        clock.t = 1000.0 + dt
        assert policy.first(chain) == 1
    clock.t = 1000.0 + HOLD_SECONDS
    assert policy.first(chain) == 0  # the preferred transport again
    # A second failure holds it again from then on; a failure that is the call's answer holds nothing.
    policy.failed(BULK, PUT, ERRORS["unavailable"])
    assert policy.held_until(BULK) == 1000.0 + 2 * HOLD_SECONDS
    assert policy.failed(SHM, PUT, ERRORS["deadline"]) == RAISE and policy.held_until(SHM) == 0.0
    assert policy.failed(SHM, PUT, ERRORS["not_found"]) == RETRY and policy.held_until(SHM) == 0.0


def test_both_held_leaves_the_stream():
    clock = Clock()
    policy = FallbackPolicy(clock)
    policy.failed(BULK, GET, ERRORS["exhausted"])
    clock.t += 2
    policy.failed(SHM, GET, ERRORS["refused_exhausted"])
    assert policy.first([BULK, SHM, GRPC]) == 2
    clock.t += HOLD_SECONDS - 2  # bulk's hold is over, shm's is not
    assert policy.first([BULK, SHM, GRPC]) == 0
    assert policy.first([BULK, SHM, GRPC], start=1) == 2
    clock.t += 2
    assert policy.first([BULK, SHM, GRPC], start=1) == 1


@pytest.mark.parametrize("attempt", [1, 2, 3, 6])
def test_retry_delay_is_exponential_jittered_and_inside_the_deadline(attempt):
    backoff = 0.05
    low, high = retry_delay(attempt, backoff, 60.0, 0.5), retry_delay(attempt, backoff, 60.0, 1.0)
    assert low == backoff * 2 ** attempt / 2 and high == backoff * 2 ** attempt
    assert retry_delay(attempt + 1, backoff, 60.0, 0.5) == high  # the next attempt's least is this one's most
    assert retry_delay(attempt, backoff, 0.01, 1.0) == min(high, 0.01)
    assert retry_delay(attempt, backoff, -1.0, 1.0) == 0.0  # the deadline passed: no wait


# --- the chain, with fake transports ---------------------------------------------------------------------------
class Fake:
    """A transport that answers from a script: each call takes the next item (an exception is raised)."""

    def __init__(self, name: str, script=(), sized: bool = True):
        self.name, self.what, self.sized = name, name, sized
        self.script = list(script)
        self.calls: list[str] = []
        self.resets = 0

    def _next(self, op: str):
        self.calls.append(op)
        item = self.script.pop(0) if self.script else f"{op} by {self.name}"
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, call):
        return self._next(PUT)

    def get(self, call):
        return self._next(GET)

    def reset(self):
        self.resets += 1


def put_call(chunks: int = 1) -> PutCall:
    return PutCall(None, [1, 2], {i: None for i in range(chunks)}, [], 0, 5.0)


def get_call(nbytes: int | None = 64) -> GetCall:
    return GetCall(pb.GetRequest(), 5.0, nbytes=nbytes)


def chain_of(*transports, clock=None) -> TransportChain:
    return TransportChain(transports, FallbackPolicy(clock or Clock()))


def test_a_chain_must_end_with_the_stream():
    with pytest.raises(ValueError):
        TransportChain([Fake(BULK)])
    with pytest.raises(ValueError):
        TransportChain([])


def test_put_and_get_fall_back_in_order_and_share_the_hold():
    clock = Clock()
    bulk = Fake(BULK, [errors.Unavailable("UNAVAILABLE: no bulk channel")])
    shm, stream = Fake(SHM), Fake(GRPC, sized=False)
    chain = chain_of(bulk, shm, stream, clock=clock)
    assert chain.put(put_call()) == "put by shm"
    assert chain.get(get_call()) == "get by shm"  # the bulk channel failed a put: held for gets too
    assert bulk.calls == [PUT] and shm.calls == [PUT, GET] and stream.calls == []
    clock.t += HOLD_SECONDS
    assert chain.get(get_call()) == "get by bulk"


def test_a_refused_buffer_streams_and_holds_shm():
    clock = Clock()
    shm = Fake(SHM, [Refused(errors.ResourceExhausted("RESOURCE_EXHAUSTED: --shm-max-buffers"))])
    stream = Fake(GRPC, sized=False)
    chain = chain_of(shm, stream, clock=clock)
    for _ in range(3):
        assert chain.get(get_call()) == "get by grpc"
    assert shm.calls == [GET] and stream.calls == [GET] * 3
    clock.t += HOLD_SECONDS
    assert chain.put(put_call()) == "put by shm"


def test_a_forgotten_buffer_is_reset_and_tried_once_more_then_raised():
    shm = Fake(SHM, [errors.NotFound("NOT_FOUND: buffer"), "again"])
    chain = chain_of(shm, Fake(GRPC, sized=False))
    assert chain.put(put_call()) == "again" and shm.resets == 1
    shm.script = [errors.NotFound("NOT_FOUND: buffer")] * 2
    with pytest.raises(errors.NotFound):
        chain.get(get_call())
    assert shm.resets == 2
    # Forgotten, then no new buffer granted: streamed.
    shm.script = [errors.NotFound("NOT_FOUND: buffer"), Refused(SharedBufferError("gone"))]
    assert chain.get(get_call()) == "get by grpc"


def test_after_a_fall_back_the_next_transport_retries_from_its_first_attempt():
    """bulk falls back to shm, whose forgotten buffer is still replaced once."""
    bulk = Fake(BULK, [errors.Unavailable("UNAVAILABLE")])
    shm = Fake(SHM, [errors.NotFound("NOT_FOUND"), "shm, second try"])
    assert chain_of(bulk, shm, Fake(GRPC, sized=False)).get(get_call()) == "shm, second try"


@pytest.mark.parametrize("error", ["deadline", "corrupt", "invalid", "exhausted", "other"])
def test_the_calls_own_answer_is_raised_as_it_is_and_holds_nothing(error):
    clock = Clock()
    exc = ERRORS[error]
    bulk, stream = Fake(BULK, [exc] * 2), Fake(GRPC, sized=False)
    chain = chain_of(bulk, stream, clock=clock)
    with pytest.raises(type(exc)) as raised:
        chain.put(put_call())
    assert raised.value is exc and stream.calls == []
    if error != "exhausted":  # (a get refused for its size falls back)
        with pytest.raises(type(exc)):
            chain.get(get_call())
    assert chain.policy.held_until(BULK) == 0.0


def test_the_stream_raises_whatever_it_gets():
    stream = Fake(GRPC, [errors.Unavailable("UNAVAILABLE: down")], sized=False)
    with pytest.raises(errors.Unavailable):
        chain_of(Fake(BULK, [errors.Unavailable("UNAVAILABLE: down")]), stream).put(put_call())


def test_nothing_to_carry_takes_no_fast_transport():
    bulk, shm, stream = Fake(BULK), Fake(SHM), Fake(GRPC, sized=False)
    chain = chain_of(bulk, shm, stream)
    assert chain.put(put_call(chunks=0)) == "put by grpc"  # the Put header alone, on the stream
    assert chain.get(get_call(nbytes=0)) == ([], True)     # no whole chunk asked for: no call at all
    assert bulk.calls == shm.calls == [] and stream.calls == [PUT]
    assert chain.sized and not chain_of(Fake(GRPC, sized=False)).sized
    only_stream = Fake(GRPC, sized=False)
    assert chain_of(only_stream).get(get_call(nbytes=None)) == "get by grpc"  # unsized: the stream is asked


def test_policy_decisions_are_pure():
    """The same failure always leads to the same place, whatever came before."""
    for args in [(BULK, GET, ERRORS["unavailable"], 0), (SHM, PUT, ERRORS["not_found"], 0)]:
        assert len({decide(*args) for _ in range(5)}) == 1
    assert {d.action for d in (RAISE, RETRY, FALL_BACK)} == set(Action)
