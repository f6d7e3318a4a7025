"""bench/ffd_floor.py's skeletons read exactly the bytes their timings stand for (Triton interpreter)."""
import pytest
import torch

from bench import ffd_floor


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; on the GPU the bench checks every row itself")
def test_skeleton_checksums_match_torch():
    assert ffd_floor.smoke() == {"scan": True, "attend": True, "fused": True, "merge": True, "fused_merge": True}


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check")
def test_checksum_sees_a_skipped_block(monkeypatch):
    """A scan skeleton that leaves one block out must fail its check (the check can fail)."""
    real_scan = ffd_floor.Skeletons.scan

    def short_scan(self, programs_per_row, warps, work=True, stages=4):
        self.nblk -= 1
        try:
            return real_scan(self, programs_per_row, warps, work, stages)
        finally:
            self.nblk += 1

    monkeypatch.setattr(ffd_floor.Skeletons, "scan", short_scan)
    checks = ffd_floor.smoke()
    assert not checks["scan"] and checks["attend"]
