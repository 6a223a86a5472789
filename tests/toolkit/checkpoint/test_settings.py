"""What a resume may change since its checkpoint (toolkit.checkpoint.settings)."""

from __future__ import annotations

import pytest

from toolkit.checkpoint.settings import check_same_data_order
from toolkit.config import UserError
from toolkit.run_dir import TrainerState


def test_a_resume_with_another_seed_or_global_batch_is_refused_and_anything_else_is_not(tmp_path):
    """The batch order is a function of (seed, step, global batch): changing either would feed the
    resumed run other sequences. A checkpoint older than the global-batch field is not refused."""
    TrainerState(step=3, seed=7, global_batch_size=12).write(tmp_path)
    check_same_data_order(tmp_path, seed=7, global_batch_size=12)
    with pytest.raises(UserError, match=r"train.global_batch_size=12 and this run has train.global_batch_size=16: "
                                        r"the data position would not carry over; resume with train.global_batch_size=12"):
        check_same_data_order(tmp_path, seed=7, global_batch_size=16)
    with pytest.raises(UserError, match=r"seed=7 and this run has seed=8"):
        check_same_data_order(tmp_path, seed=8, global_batch_size=12)
    TrainerState(step=3, seed=7).write(tmp_path)  # written before the field existed: 0
    check_same_data_order(tmp_path, seed=7, global_batch_size=16)
