"""hack/eviction-bound.py (issue #13's learned-ranking bound) runs outside `make test` because it needs
scikit-learn; its features and labels are pure and checked here, so the figures in docs/eviction.md keep meaning
what they say."""
import importlib.util
from pathlib import Path

from promptcache_devtools.bench.traces import Request

SCRIPT = Path(__file__).resolve().parents[1] / "hack" / "eviction-bound.py"


def load():
    spec = importlib.util.spec_from_file_location("eviction_bound", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_features_are_what_an_online_policy_sees_at_that_moment():
    bound = load()
    history = [(0.0, 4), (10.0, 4), (100.0, 5)]
    assert bound.features(history[:1], 7.0) == [1, 7.0, -1.0, -1.0, 7.0, 4, 4]
    assert bound.features(history, 130.0) == [3, 30.0, 90.0, 50.0, 130.0, 5, 4]
    assert len(bound.FEATURES) == len(bound.features(history, 130.0))


def test_labels_say_whether_the_conversation_returns_within_the_horizon():
    bound = load()
    reqs = [Request(t * 1000, 1024, 1, [1, 2]) for t in (0, 10, 100)]
    X, y, group = bound.dataset(reqs, horizon=30.0, per_request=1)
    assert y.tolist() == [1, 0, 0]  # next request after 10 s, after 90 s, never
    assert X[:, 0].tolist() == [1, 2, 3] and group == [1, 1, 1]
    X, y, _ = bound.dataset(reqs, horizon=95.0, per_request=1)
    assert y.tolist() == [1, 1, 0]


def test_the_folds_split_conversations_deterministically():
    bound = load()
    # pinned: docs/eviction.md's 2-fold figures were measured with this split (splitmix64 of the root, not hash())
    assert [bound.fold_of(root) for root in range(16)] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1]
    assert 400 < sum(bound.fold_of(root) for root in range(1000)) < 600


def test_drift_counts_new_conversations_and_where_their_turns_fall():
    bound = load()
    # one long conversation starting at t=0 whose five later turns all come in the last tenth, then fillers
    reqs = [Request(0, 512, 1, [1])] + [Request((90 + i) * 1000, 512, 1, [1]) for i in range(5)]
    reqs += [Request((91 + i) * 1000, 512, 1, [100 + i]) for i in range(4)]
    reqs.sort(key=lambda r: r.timestamp)
    new, where = bound.drift(reqs)
    assert sum(new) == 5 and new[0] == 1
    assert 0.9 < where < 1.0
