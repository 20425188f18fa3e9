"""ops/capture: the deferral of captured tables is scoped and refuses misuse (CPU side; the
captured path itself is tested in tests/gpu/test_verify_fused_gpu.py)."""
import pytest
import torch

from ssmspec.ops import capture


def test_device_table_needs_a_deferring_capture():
    with pytest.raises(RuntimeError, match="tables_written_after_capture"):
        capture.device_table(torch.zeros(2, 7, dtype=torch.int64), torch.device("cpu"))
    with capture.tables_written_after_capture():
        assert not capture.deferring()  # no capture under way (no CUDA here)
        with pytest.raises(RuntimeError):
            capture.device_table(torch.zeros(2, 7, dtype=torch.int64), torch.device("cpu"))


def test_scope_is_restored_after_an_error():
    with pytest.raises(ValueError), capture.tables_written_after_capture():
        assert capture._pending == []
        raise ValueError("capture failed")
    assert capture._pending is None
