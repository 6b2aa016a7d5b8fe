"""Test and demo support: rank launcher, reference model, input generators."""

from deep_ep.testing.launcher import RankError, launch

__all__ = ["RankError", "launch"]
