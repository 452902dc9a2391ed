import pytest

from ds4.engine.page_allocator import PageAllocator


def test_pages_for_rounds_up_to_whole_pages():
    alloc = PageAllocator(num_pages=10, num_slots=2, page_size=16)
    assert [alloc.pages_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert alloc.capacity_tokens == 160


def test_grow_hands_out_distinct_pages_and_free_returns_them():
    alloc = PageAllocator(num_pages=6, num_slots=2, page_size=4)
    a, b = [], []
    alloc.grow(a, 5)
    alloc.grow(a, 8)  # still two pages
    alloc.grow(b, 13)
    assert len(a) == 2 and len(b) == 4
    assert len(set(a) | set(b)) == 6 and alloc.num_free_pages == 0
    assert not alloc.can_grow(a, 9) and alloc.can_grow(a, 8)
    with pytest.raises(RuntimeError, match="pages needed"):
        alloc.grow(a, 9)
    alloc.free_pages(b)
    assert b == [] and alloc.num_free_pages == 4
    alloc.grow(a, 24)
    assert len(a) == 6 and sorted(a) == list(range(6))


def test_slots_are_exclusive_until_freed():
    alloc = PageAllocator(num_pages=1, num_slots=2, page_size=4)
    s0, s1 = alloc.allocate_slot(), alloc.allocate_slot()
    assert {s0, s1} == {0, 1} and alloc.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free request slot"):
        alloc.allocate_slot()
    alloc.free_slot(s1)
    assert alloc.allocate_slot() == s1


def test_rejects_empty_pools():
    with pytest.raises(ValueError):
        PageAllocator(num_pages=0, num_slots=1, page_size=4)
