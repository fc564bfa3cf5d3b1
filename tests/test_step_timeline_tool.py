"""benchmarks/tools/step_timeline.py's host time in the GPU's idle gaps: the bisection gives the
brute-force overlap of every span with every gap."""
import collections
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "tools"))
import step_timeline  # noqa: E402


def brute_force(spans, gaps):
    host = collections.Counter()
    for g0, g1 in gaps:
        for name, s, e in spans:
            overlap = min(e, g1) - max(s, g0)
            if overlap > 0:
                host[name] += overlap
    return host


def test_host_time_in_gaps_matches_every_span_against_every_gap():
    rng = random.Random(1)
    for _ in range(200):
        gaps, t = [], 0.0
        for _ in range(rng.randint(0, 30)):
            t += rng.uniform(0, 50)
            start = t
            t += rng.uniform(0, 50)
            gaps.append((start, t))
        spans = []
        for _ in range(rng.randint(0, 100)):
            s = rng.uniform(-10, t + 20)
            spans.append((rng.choice("abcde"), s, s + rng.uniform(0, 80)))  # nested and long spans too
        ref, got = brute_force(spans, gaps), step_timeline.host_time_in_gaps(spans, gaps)
        assert set(ref) == set(got)
        assert all(abs(ref[k] - got[k]) < 1e-9 for k in ref), (ref, got)


def test_a_span_across_several_gaps_counts_each_overlap():
    got = step_timeline.host_time_in_gaps([("op", 5.0, 45.0)], [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0)])
    assert got == {"op": 5.0 + 10.0 + 5.0}
