"""`errors.Checker`: the one collector every config section reports through."""

import ml_collections as mlc
import pytest

from jaxrl_post.errors import Checker, ConfigError, DeviceCounts, is_int, is_num, nonneg, pos_int


def _cfg():
    c = mlc.ConfigDict()
    c.a = mlc.ConfigDict({"n": 3, "s": "x", "f": None})
    return c


def test_checker_lines_and_one_error():
    c = Checker(_cfg())
    assert c.check("a.n", pos_int, "must be a positive int") is True
    assert c.check("a.s", lambda v: v > 0, "must be > 0") is False  # a predicate that raises: the key's error
    assert c.check("a.missing", pos_int, "must be a positive int") is False
    c.err("a.f", "required")
    c.err("b.nope", "no such section")
    c.add("a.n=3 must be even")
    assert c.checked == ["a.n", "a.s", "a.missing"]
    assert c.errors == [
        "config.a.s='x': must be > 0",
        "config.a.missing: missing key",
        "config.a.f=None: required",
        "config.b.nope: no such section",
        "config.a.n=3 must be even",
    ]
    with pytest.raises(ConfigError) as e:
        c.raise_if_any("invalid SFT config")
    assert str(e.value) == "invalid SFT config:\n  " + "\n  ".join(c.errors)
    Checker(_cfg()).raise_if_any()  # nothing found: no error


def test_predicates_and_devices():
    assert [is_int(v) for v in (1, True, 1.0)] == [True, False, False]
    assert [is_num(v) for v in (1, 1.5, False, "1")] == [True, True, False, False]
    assert [pos_int(v) for v in (1, 0, 2.0)] == [True, False, False]
    assert [nonneg(v) for v in (0, -0.1, 0.0)] == [True, False, True]
    assert DeviceCounts(8, 2).train == 6 and DeviceCounts(4).processes == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_float_fails_every_check_and_says_so(bad):
    c = Checker(mlc.ConfigDict({"lr": bad}))
    # `nonneg` alone accepts inf, and nan failing `v >= 0` read as "must be >= 0", an odd reason
    assert c.check("lr", nonneg, "must be >= 0") is False
    assert c.errors == [f"config.lr={bad!r}: not a finite number; must be >= 0"]
