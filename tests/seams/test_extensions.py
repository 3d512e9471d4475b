"""megatron_ext/seams/extensions.py: the C++ extension megatron-core would compile inside a run is built,
and does what megatron asks of it (an output recomputed in the backward handed to the storage its
views kept)."""
from __future__ import annotations

import torch


def test_share_storage_is_built_and_hands_the_recomputed_data_to_the_kept_storage():
    from megatron.core.tensor_parallel import random

    from megatron_ext.seams import extensions

    assert extensions.build() == ["share_storage_ext"]
    assert random._share_storage_ext is not None  # what a run's first recompute would have compiled
    kept = torch.empty(6)
    view = kept.view(2, 3)
    kept.untyped_storage().resize_(0)  # released after the forward, as megatron discards the output
    recomputed = torch.arange(6.0)
    random._get_share_storage()(kept, recomputed)
    assert torch.equal(view.flatten(), recomputed)  # the view sees the recomputed values
    assert view.untyped_storage().data_ptr() == recomputed.untyped_storage().data_ptr()  # no copy
