"""Which checkpoint a resume may trust (toolkit.checkpoint.integrity): every file a rank writes is named
when it is missing, before any load."""

from __future__ import annotations

import pytest

from toolkit.checkpoint.integrity import check_state_file
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.manifest import MANIFEST, crc32, write_manifest


def a_zero3_checkpoint(folder, missing: str | None = None):
    """The files a 2-process ZeRO-3 save leaves (empty: only their names are checked), less `missing`."""
    names = ["latest", "random_states_0.pkl", "random_states_1.pkl",
             *(f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim"))]
    for name in names:
        if name != missing:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("pytorch_model" if name == "latest" else "")
    TrainerState(step=4, layout=ParallelLayout("deepspeed", 2, zero_stage=3)).write(folder)
    return folder


@pytest.mark.parametrize("missing", ["pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "random_states_1.pkl",
                                     "manifest.json"])
def test_a_rank_file_missing_from_a_checkpoint_is_named_before_any_load(tmp_path, missing):
    """One rank's ZeRO-3 optimizer file deleted was DeepSpeed's ValueError traceback where no manifest
    lists it: a checkpoint older than manifests, or one whose manifest.json is gone (its state file
    names one, and the check was skipped)."""
    folder = a_zero3_checkpoint(tmp_path / "step-4", None if missing == "manifest.json" else missing)
    if missing == "manifest.json":
        write_manifest(folder)
        state = TrainerState.read(folder)
        state.manifest_crc32 = crc32(folder / MANIFEST)
        state.write(folder)
        assert check_state_file(folder) is None
        (folder / MANIFEST).unlink()
        expected = f"{folder / MANIFEST} is missing (its trainer_state.json names one), so its files cannot be checked"
    elif missing.endswith(".pt"):
        expected = (f"{folder}/pytorch_model/*zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (the optimizer "
                    "state of rank 1 of 2)")
    else:
        expected = f"{folder / missing} is missing (rank 1 of 2 writes it)"
    assert check_state_file(folder) == expected
    assert check_state_file(a_zero3_checkpoint(tmp_path / "whole")) is None
