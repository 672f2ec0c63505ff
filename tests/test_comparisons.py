"""mmrl.testing's two comparisons (bit-identical for one code path, float32 tolerance across paths) and a check that
the suite compares runs through them (docs/development.md, "Comparing floats in tests")."""

import math
import re
from pathlib import Path

import pytest
import torch

from mmrl.testing import FLOAT32_ATOL, FLOAT32_RTOL, assert_close_across_paths, assert_same_path, environment_report

TESTS = Path(__file__).resolve().parent


def test_same_path_is_bitwise_on_nested_rows_and_tensors():
    row = {"step": 1, "reward/mean": 0.1 + 0.2, "policy/loss": None, "name": "x", "w": torch.tensor([1.0, math.nan])}
    assert_same_path([row], [dict(row, w=row["w"].clone())], why="a copy")
    with pytest.raises(AssertionError, match=r"bit-identical expected \(a copy\): \[0\]\['reward/mean'\]: "
                                             r"0.30000000000000004 vs 0.3"):
        assert_same_path([row], [dict(row, **{"reward/mean": 0.3})], why="a copy")
    one_ulp = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(AssertionError, match=r"\['w'\]"):
        assert_same_path(row, dict(row, w=torch.tensor([one_ulp.item(), math.nan])), why="a copy")
    with pytest.raises(AssertionError, match="keys in only one side"):
        assert_same_path(row, {**row, "extra": 1}, why="a copy")
    with pytest.raises(ValueError, match="why"):
        assert_same_path(1.0, 1.0, why=" ")


def test_close_across_paths_tolerates_rounding_only():
    # the NFT losses of issue "make test green on any CPU": two formulas, equal in exact arithmetic
    assert_close_across_paths(1.64724662899971, 1.6472465991973877)
    assert_close_across_paths({"a": [torch.tensor([1.0, 2.0])], "n": 3}, {"a": [torch.tensor([1.0 + 1e-7, 2.0])], "n": 3})
    assert_close_across_paths(0.0, 5e-7)  # absolute tolerance near zero
    with pytest.raises(AssertionError, match=r"\(two forwards\): value: 1.0 vs 1.001"):
        assert_close_across_paths(1.0, 1.001, what="two forwards")
    with pytest.raises(AssertionError, match="3 != 4"):  # integers (counts, steps) stay exact
        assert_close_across_paths({"n": 3}, {"n": 4})
    with pytest.raises(AssertionError, match="shape/dtype"):
        assert_close_across_paths(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError):
        assert_close_across_paths(math.inf, 1e308)
    assert_close_across_paths(math.nan, math.nan)
    assert FLOAT32_RTOL <= 1e-5 and FLOAT32_ATOL <= 1e-6  # far below what a bug changes in the suite (>= 1e-3)


# A run's metrics rows compared with `==`, or tensors with assert_close(rtol=0, atol=0), skip the choice between
# "same path, bit-identical" and "different paths, tolerance": the suite must make it explicitly.
FORBIDDEN = [
    (re.compile(r"without_time\(.*\)\s*==|==\s*\[?without_time\("), "metrics rows compared with =="),
    (re.compile(r"(rtol=0(\.0)?,\s*atol=0(\.0)?\b|atol=0(\.0)?,\s*rtol=0(\.0)?\b)"), "assert_close with rtol=0, atol=0"),
]


def test_suite_compares_runs_through_the_helpers():
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in FORBIDDEN:
                if pattern.search(line):
                    bad.append(f"{path.relative_to(TESTS)}:{n}: {what}: {line.strip()}")
    assert not bad, ("use mmrl.testing.assert_same_path(a, b, why=...) for one code path or "
                     "assert_close_across_paths(a, b) for two:\n" + "\n".join(bad))


def test_ci_prints_the_environment_before_the_tests():
    """`.ci/run` installs, prints `environment_report()` (CPU model and kernel flags, torch's CPU capability,
    package versions), then runs `make test`."""
    import diffusers
    import peft
    import transformers

    report = environment_report()
    assert report.startswith("cpu: ") and "cpu kernel flags: " in report and "torch cpu capability: " in report
    for name, mod in (("torch", torch), ("diffusers", diffusers), ("transformers", transformers), ("peft", peft)):
        assert f"{name} {mod.__version__}" in report, name
    script = (TESTS.parent / ".ci" / "run").read_text()
    steps = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert steps.index("make install") < next(i for i, s in enumerate(steps) if "environment_report()" in s) \
        < steps.index("make test")
