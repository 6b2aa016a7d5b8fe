"""Test and demo support: rank launcher, reference model, input generators."""

from deep_ep.testing.launcher import launch
from deep_ep.testing.rank_process import RankError
from deep_ep.testing.warm_up import warm_up_cuda_libraries

__all__ = ["RankError", "launch", "warm_up_cuda_libraries"]
