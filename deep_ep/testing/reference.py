"""Pure-PyTorch reference model of a whole EP group: what dispatch delivers and combine returns.

GPU tests compare the kernels bitwise against these functions (valid LL rows only); the CPU
tests in tests/cpu prove them on hand-worked cases. Everything runs on CPU or GPU tensors and
needs every rank's inputs, which ``deep_ep.testing.data.make_group_inputs`` rebuilds from a seed.
Routing goes through ``sanitize_topk_idx`` (the library's rule for repeated and out-of-range expert
ids), so inputs the library reports as errors still have defined expected outputs.
"""

from deep_ep.testing.reference_ht import ht_combine, ht_dispatch
from deep_ep.testing.reference_inputs import sanitize_topk_idx
from deep_ep.testing.reference_ll import ll_combine, ll_dispatch, ll_valid_row_mask

__all__ = ["ht_dispatch", "ht_combine", "ll_dispatch", "ll_combine", "ll_valid_row_mask", "sanitize_topk_idx"]
