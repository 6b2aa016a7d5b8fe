"""What the GPU tests that run one launch per rank count share: the launch (once per rank count,
its results or its failure handed to every test that asks) and the recording of what a scenario
raised, so one failing scenario does not end the rank and hide the others."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from deep_ep.testing import launch

_RESULTS: dict[tuple[str, str, int], Any] = {}


def launch_once(fn: Callable[..., Any], num_ranks: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``launch(fn, num_ranks, *args, **kwargs)``, run once per (fn, rank count) in this pytest
    process; a failed launch is raised again to every test of that rank count."""
    key = (fn.__module__, fn.__qualname__, num_ranks)
    if key not in _RESULTS:
        try:
            _RESULTS[key] = launch(fn, num_ranks, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every test of this rank count reports it
            _RESULTS[key] = exc
    value = _RESULTS[key]
    if isinstance(value, Exception):
        raise value
    return value


def capture(fn: Callable[[], Any]) -> tuple[str | None, str]:
    """(exception type name, message) of what fn raised, or (None, '')."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None, ""


def guarded(results: dict, name: str, fn: Callable[[], Any]) -> None:
    """Run one scenario; an exception is recorded (with its traceback) instead of ending the rank.

    Only for scenarios that raise before or after, never in the middle of, a collective kernel."""
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - reported by the test that reads this scenario
        results[name] = {"exception": traceback.format_exc()}
