"""Host-side failure rules that need no GPU: how every rank's construction outcome becomes one
error, and what a device report of a bad routing entry says."""

from __future__ import annotations

import collections

import pytest

from deep_ep import PeerInputError
from deep_ep.buffer import _invalid_entry_message, _outcome, _raise_if_any_rank_failed


def test_no_failure_raises_nothing():
    _raise_if_any_rank_failed("settings check", [None, None, None])


def test_bad_arguments_on_some_ranks_raise_value_error_naming_each():
    errors = [None, ("ValueError", "num_topk must be a non-negative int, got -1"), None, ("ValueError", "bad")]
    with pytest.raises(ValueError) as info:
        _raise_if_any_rank_failed("settings check", errors)
    message = str(info.value)
    assert "settings check on rank(s) [1, 3]" in message
    assert "rank 1: ValueError: num_topk must be a non-negative int, got -1" in message
    assert "rank 3: ValueError: bad" in message


def test_mixed_or_runtime_failures_raise_runtime_error():
    with pytest.raises(RuntimeError, match=r"window allocation .* rank\(s\) \[0\]"):
        _raise_if_any_rank_failed("window allocation (ipc backend)", [("RuntimeError", "out of memory"), None])
    with pytest.raises(RuntimeError) as info:
        _raise_if_any_rank_failed("step", [("ValueError", "a"), ("TypeError", "b")])
    assert not isinstance(info.value, (ValueError, TypeError))


def test_type_errors_stay_type_errors():
    with pytest.raises(TypeError, match="rank 0: TypeError: x"):
        _raise_if_any_rank_failed("settings check", [("TypeError", "x"), None])


def test_outcome_captures_the_exception_type_and_message():
    assert _outcome(lambda: 5) == (5, None)

    def fail():
        raise KeyError("missing")

    assert _outcome(fail) == (None, ("KeyError", "'missing'"))


def test_invalid_entry_messages_name_the_id_and_the_row():
    record = {"invalid_expert": 300, "invalid_token": 7, "invalid_operation": "dispatch count exchange"}
    out_of_range = _invalid_entry_message({**record, "invalid_kind": "out_of_range", "num_experts": 256})
    assert "expert id 300 outside [-1, 256) at row 7" in out_of_range
    duplicate = _invalid_entry_message({**record, "invalid_expert": 5, "invalid_kind": "duplicate", "num_experts": 8})
    assert "row 7 selects expert 5 more than once" in duplicate and "first slot counted" in duplicate


def test_peer_input_error_is_a_value_error_naming_the_rank():
    error = PeerInputError("rank 2's input failed", rank=2, operation="combine")
    assert isinstance(error, ValueError)
    assert (error.rank, error.operation) == (2, "combine")


def _record(**overrides):
    record = {"rank": 1, "peer": 0, "operation": "combine", "phase": "barrier arrival", "expected": 3, "seen": 2}
    record.update(overrides)
    return record


def test_a_barrier_timeout_says_whether_the_peer_passed_the_barrier_by_its_own_count():
    from deep_ep.errors import timeout_message

    base = timeout_message(_record(peer_progress=-1), 20.0)
    assert base == (
        "rank 1: combine timed out after 20 s in phase 'barrier arrival' waiting for rank 0 (expected 3, saw 2); "
        "the buffer refuses further work until destroy()"
    )
    passed = timeout_message(_record(peer_progress=4), 20.0)
    assert "rank 0 had completed 4 barriers by its own count, so it passed this one" in passed
    behind = timeout_message(_record(peer_progress=2), 20.0)
    assert "rank 0 had completed 2 barriers by its own count;" in behind and "passed this one" not in behind
    own_grid = timeout_message(_record(peer=-1, phase="grid synchronisation", peer_progress=-1), 20.0)
    assert "waiting for the other CTAs of its own kernel" in own_grid


def test_a_timeout_names_the_call_its_kernel_belonged_to():
    from deep_ep.errors import timeout_message

    record = _record(peer_progress=-1, call_serial=7)
    assert timeout_message(record, 20.0).startswith("rank 1: combine (call #7) timed out")
    named = timeout_message(record, 20.0, {6: "dispatch", 7: "combine"})
    assert named.startswith("rank 1: combine (call #7, combine) timed out")
    assert timeout_message(_record(call_serial=0), 20.0).startswith("rank 1: combine timed out")


def test_a_timeout_report_lists_the_last_calls_of_the_rank_oldest_first():
    from deep_ep.errors import recent_calls_message

    assert recent_calls_message([], 5.0) == ""
    text = recent_calls_message([(41, "dispatch", 1.0), (42, "combine", 3.5)], 5.0)
    assert text == ". Calls this rank issued last: #41 dispatch (4.0 s ago), #42 combine (1.5 s ago)"


class _QuietRuntime:
    """The runtime calls of the per-call check, with nothing recorded; keeps the serial it is given."""

    serial = 0

    def begin_call(self, serial):
        self.serial = serial
        return self.has_fatal_error()

    def has_fatal_error(self):
        return False


class _FatalRuntime(_QuietRuntime):
    """A combine timeout recorded by a kernel of call #4."""

    def has_fatal_error(self):
        return True

    def error_record(self):
        return {**_record(), "peer_progress": -1, "call_serial": 4}


def test_every_call_is_logged_and_a_timeout_names_the_last_calls():
    from deep_ep.buffer import CALL_LOG_LENGTH, ElasticBuffer
    from deep_ep.errors import CommTimeoutError

    buffer = object.__new__(ElasticBuffer)  # no GPU: only the call log and the report are exercised
    buffer._calls = collections.deque(maxlen=CALL_LOG_LENGTH)
    buffer._num_calls = 0
    buffer.num_gpu_timeout_secs = 20.0
    buffer._runtime = _QuietRuntime()
    for index in range(CALL_LOG_LENGTH + 2):
        buffer._check_fatal_errors("dispatch" if index % 2 == 0 else "combine")
        assert buffer._runtime.serial == index + 1  # the kernels of call n carry serial n
    assert [serial for serial, _, _ in buffer._calls] == list(range(3, CALL_LOG_LENGTH + 3))
    buffer._runtime = _FatalRuntime()
    with pytest.raises(CommTimeoutError) as raised:
        buffer._check_fatal_errors("low_latency_dispatch")
    message = str(raised.value)
    # The kernel that timed out belonged to call #4, a combine still in the log.
    assert message.startswith("rank 1: combine (call #4, combine) timed out after 20 s")
    assert raised.value.call_serial == 4
    assert f"#{CALL_LOG_LENGTH + 3} low_latency_dispatch (" in message and "#3 dispatch (" not in message
    assert "#4 combine (" in message
