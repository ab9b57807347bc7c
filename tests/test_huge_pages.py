"""runtime/huge_pages.py: a written CPU tensor moved to huge pages, values kept; best effort elsewhere."""
import sys

import pytest
import torch

from megarl.runtime import huge_pages


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1: text.index("]")]


def _huge_kib_in(begin: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [begin, end)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < end and hi > begin
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() == "never" or _thp_mode() == "absent",
                    reason="needs Linux with transparent huge pages not set to 'never'")
def test_collapse_moves_a_written_tensor_to_huge_pages_and_keeps_its_values():
    t = torch.randn(6 << 20 >> 2, generator=torch.Generator().manual_seed(0))  # 6 MiB of fp32, written
    expected = t.clone()
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    done = huge_pages.collapse(t)
    if not done:
        pytest.skip("MADV_COLLAPSE refused here (a kernel before 6.1, or no huge page free)")
    assert torch.equal(t, expected)
    assert _huge_kib_in(begin, end) >= 2048  # at least one whole 2 MiB page inside the tensor
    assert huge_pages.collapse(t)  # again: already huge, still fine
    assert torch.equal(t, expected)


def test_collapse_is_best_effort_where_nothing_can_be_done(monkeypatch):
    small = torch.randn(1000)
    assert huge_pages.collapse(small) is False  # no whole 2 MiB page inside
    strided = torch.randn(2048, 2048)[:, ::2]
    assert huge_pages.collapse(strided) is False  # not contiguous
    assert huge_pages.collapse(torch.empty(8 << 20, device="meta")) is False  # not on the CPU
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)  # not Linux / no libc
    assert huge_pages.collapse(torch.randn(4 << 20)) is False


def test_collapse_advises_only_whole_huge_pages_inside_the_tensor(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: (lambda addr, n, advice: calls.append((addr, n, advice)) or 0))
    t = torch.randn(5 << 20 >> 2)  # 5 MiB
    assert huge_pages.collapse(t)
    begin, end = t.data_ptr(), t.data_ptr() + (5 << 20)
    assert [a for _, _, a in calls] == [huge_pages.MADV_HUGEPAGE, huge_pages.MADV_COLLAPSE]
    for addr, n, _ in calls:
        assert addr % huge_pages.HUGE_PAGE == 0 and n % huge_pages.HUGE_PAGE == 0 and n >= huge_pages.HUGE_PAGE
        assert begin <= addr and addr + n <= end
    calls.clear()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: (lambda addr, n, advice: -1))  # the kernel refuses
    assert huge_pages.collapse(t) is False
