import pytest

from kairos.core.cluster.recent import RecentIds


def test_remembers_the_last_capacity_ids_and_forgets_the_oldest_first():
    r = RecentIds(3)
    for x in "abcd":
        r.add(x)
    assert "a" not in r and all(x in r for x in "bcd") and len(r) == 3
    r.add("b")  # seen again: now the newest
    r.add("e")
    assert "c" not in r and "b" in r and "e" in r


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        RecentIds(0)
