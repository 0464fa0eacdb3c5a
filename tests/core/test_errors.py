"""The config check helpers: what passes, what raises, and that messages name field and constraint."""

import dataclasses

import numpy as np
import pytest

from jaxsys.core import errors as E


@dataclasses.dataclass
class _Cfg:
  a: object = 1
  b: object = 2
  c: object = 0


def test_check_positive():
  E.check_positive(_Cfg(), "a", "b", integer=True)
  with pytest.raises(E.ConfigError, match=r"^c=0 must be positive$"):
    E.check_positive(_Cfg(), "a", "c")
  with pytest.raises(E.ConfigError, match=r"^b=2.5 must be a positive int$"):
    E.check_positive(_Cfg(b=2.5), "a", "b", integer=True)
  with pytest.raises(E.ConfigError, match=r"a='x' must be positive"):
    E.check_positive(_Cfg(a="x"), "a")
  with pytest.raises(E.ConfigError, match="a=None"):
    E.check_positive(_Cfg(a=None), "a")
  with pytest.raises(E.InputError, match=r"^job 3: c=0 must be positive$"):
    E.check_positive(_Cfg(), "c", error=E.InputError, where="job 3: ")


def test_check_min():
  E.check_min(_Cfg(), 0, "a", "b", "c")
  E.check_min(_Cfg(a=np.int32(1)), 1, "a")
  with pytest.raises(E.ConfigError, match=r"^c=0 must be >= 1 \(why\)$"):
    E.check_min(_Cfg(), 1, "a", "c", note=" (why)")


def test_check_range():
  E.check_range("p", 0.0, 0, 1)
  E.check_range("p", 1.0, 0, 1)
  E.check_range("p", 5, lo=0)
  for value, kw, text in [(0.0, dict(lo_open=True), r"p=0.0 must be in \(0, 1\]"),
                          (1.0, dict(hi_open=True), r"p=1.0 must be in \[0, 1\)"),
                          (-1, {}, r"p=-1 must be in \[0, 1\]"),
                          (None, {}, r"p=None must be in \[0, 1\]")]:
    with pytest.raises(E.ConfigError, match=text):
      E.check_range("p", value, 0, 1, **kw)
  with pytest.raises(E.ConfigError, match=r"^p=-1 must be >= 0$"):
    E.check_range("p", -1, lo=0)
  with pytest.raises(E.ConfigError, match=r"^p=0 must be > 0$"):
    E.check_range("p", 0, lo=0, lo_open=True)
  with pytest.raises(E.ConfigError, match=r"^p=3 must be <= 2$"):
    E.check_range("p", 3, hi=2)


def test_check_one_of_divisible_rank():
  E.check_one_of("mode", "a", ("a", "b"))
  with pytest.raises(E.ConfigError, match=r"mode='c' must be one of \('a', 'b'\)"):
    E.check_one_of("mode", "c", ["a", "b"])
  E.check_divisible("h", 8, "kv", 4)
  with pytest.raises(E.ConfigError, match="h=6 must be divisible by kv=4"):
    E.check_divisible("h", 6, "kv", 4)
  with pytest.raises(E.ConfigError, match="kv=0"):
    E.check_divisible("h", 6, "kv", 0)
  E.check_rank("x", np.zeros((2, 3)), 2)
  with pytest.raises(E.ShapeError, match=r"x must have rank 3, got shape \(2, 3\)"):
    E.check_rank("x", np.zeros((2, 3)), 3)


def test_check_multiple():
  E.check_multiple("t", 16, "p", 8, positive=True)
  E.check_multiple("t", 0, "p", 8)
  with pytest.raises(E.ConfigError, match=r"^t=60 must be a positive multiple of p=8$"):
    E.check_multiple("t", 60, "p", 8, positive=True)
  with pytest.raises(E.ConfigError, match=r"^t=0 must be a positive multiple of p=8$"):
    E.check_multiple("t", 0, "p", 8, positive=True)
  with pytest.raises(E.ConfigError, match=r"^t=12 must be a multiple of p=8$"):
    E.check_multiple("t", 12, "p", 8)
