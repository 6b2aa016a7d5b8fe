"""The host checks of HT zero-copy receive and combine refuse what the kernels cannot serve, naming
the rule, before anything is launched (GPU behaviour: tests/gpu/test_ht_zero_copy.py)."""

from __future__ import annotations

import types

import pytest
from buffer_settings import buffer_settings

from deep_ep.handle import EPHandle
from deep_ep.high_throughput import HighThroughputMixin


def _buffer(num_scaleout_ranks: int = 1):
    return types.SimpleNamespace(num_scaleout_ranks=num_scaleout_ranks)


def _handle(do_expand: bool = False, send_base: object = None) -> EPHandle:
    handle = EPHandle.__new__(EPHandle)
    handle.do_expand = do_expand
    handle.zero_copy_send_base = send_base
    return handle


def test_zero_copy_receive_refuses_hybrid_mode_expand_and_a_copy_handle():
    check = HighThroughputMixin._check_zero_copy_recv
    check(_buffer(), False, None)  # uncached, direct, non-expand
    check(_buffer(), False, _handle(send_base=object()))
    with pytest.raises(ValueError, match="direct mode only.*2 nodes"):
        check(_buffer(2), False, None)
    with pytest.raises(ValueError, match="non-expand rows only"):
        check(_buffer(), True, None)
    with pytest.raises(ValueError, match="without zero_copy_recv"):
        check(_buffer(), False, _handle())


def test_zero_copy_combine_refuses_hybrid_mode_expand_a_copy_handle_and_a_bad_hidden():
    check = HighThroughputMixin._zero_copy_combine_call
    with pytest.raises(ValueError, match="direct mode only"):
        check(_buffer(2), _handle(send_base=object()), 7168)
    with pytest.raises(ValueError, match="non-expand handle"):
        check(_buffer(), _handle(do_expand=True, send_base=object()), 7168)
    with pytest.raises(ValueError, match="zero_copy_recv=True dispatch"):
        check(_buffer(), _handle(), 7168)
    for hidden in (0, 7, "7168"):
        with pytest.raises(ValueError, match="hidden must be a positive multiple of 8"):
            check(_buffer(), _handle(send_base=object()), hidden)


def test_zero_copy_combine_is_a_setting_every_rank_must_agree_on():
    from deep_ep.buffer import ElasticBuffer

    settings = buffer_settings()
    # Part of the settings dict the ranks compare (the window size depends on it).
    assert ElasticBuffer._check_settings(**settings)["zero_copy_combine"] is False
    assert ElasticBuffer._check_settings(**settings, zero_copy_combine=True)["zero_copy_combine"] is True
    with pytest.raises(TypeError, match="zero_copy_combine must be a bool"):
        ElasticBuffer._check_settings(**settings, zero_copy_combine="yes")
