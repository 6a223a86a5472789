"""The state a checkpoint carries: its one writer and its one reader (toolkit.checkpoint.trainer_state)."""

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.run.folder import STATE_FILE


def test_one_reader_and_one_writer_for_the_trainer_state(tmp_path):
    state = TrainerState(step=7, tokens_seen=3584, seed=1, last_eval={"eval_loss": 2.5, "eval_ppl": 12.18},
                         eval_before={"eval_loss": 3.0, "eval_ppl": 20.08}, samples_before=["a", "b"])
    state.write(tmp_path)
    assert not (tmp_path / (STATE_FILE + ".tmp")).exists()  # renamed into place
    assert TrainerState.read(tmp_path) == state
    # a state written before the typed contract (pretraining had no eval_before / samples_before) still reads
    (tmp_path / STATE_FILE).write_text('{"step": 4, "tokens_seen": 10, "last_eval": {}, "seed": 3, "extra": 1}')
    assert TrainerState.read(tmp_path) == TrainerState(step=4, tokens_seen=10, seed=3)
