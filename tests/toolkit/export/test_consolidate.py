"""What `recipes/export.py --from PATH [--checkpoint NAME]` points at, and the model it loads.

Folders are laid out by hand as training writes them: an HF folder (save_pretrained), a run with
final/, and DDP/single-process checkpoints (model.safetensors + trainer_state.json + model_files/).
Every wrong path must end in one UserError that says what is there and what to give instead.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from toolkit.config.errors import UserError
from toolkit.export.consolidate import load_model, resolve_source


@pytest.fixture(scope="module")
def model(tiny_model, tiny_tokenizer):
    return tiny_model("llama", seed=3, tokenizer=tiny_tokenizer)


def save_hf(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_checkpoint(
    model, tokenizer, folder: Path, step: int, complete: bool = True, eval_loss: float = 3.0
) -> Path:
    """What a DDP/one-process checkpoint holds: the weights, model_files/, and trainer_state.json last."""
    folder.mkdir(parents=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    model.config.save_pretrained(folder / "model_files")
    tokenizer.save_pretrained(folder / "model_files")
    if complete:
        state = {
            "step": step,
            "tokens_seen": 1000 * step,
            "last_eval": {"eval_loss": eval_loss, "eval_ppl": 20.0},
        }
        (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def perturbed(model, seed: int):
    """The same architecture with other weights, so that a test can tell which checkpoint loaded."""
    other = type(model)(model.config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return other


def assert_same_weights(loaded, expected):
    got, want = loaded.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name]), name


# Hugging Face folders and runs with final/


def test_an_hf_folder_loads_as_it_was_saved(model, tiny_tokenizer, tmp_path):
    folder = save_hf(model, tiny_tokenizer, tmp_path / "hf")
    source = resolve_source(folder)
    assert (source.kind, source.path, source.run_dir, source.step) == ("hf", folder, None, None)
    assert source.describe() == f"Hugging Face model folder {folder}"
    loaded, tokenizer, notes = load_model(source)
    assert not loaded.training
    assert_same_weights(loaded, model)
    assert tokenizer("def f(x):")["input_ids"] == tiny_tokenizer("def f(x):")["input_ids"]
    assert notes == [f"source: {source.describe()}"]


def test_a_run_folder_exports_its_final(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    save_hf(model, tiny_tokenizer, run / "final")
    summary = {"step": 40, "eval_loss": 2.5}
    (run / "final" / "training_summary.json").write_text(json.dumps(summary))
    # a complete checkpoint too: final/ is what a finished run delivers, so it wins
    save_checkpoint(perturbed(model, 1), tiny_tokenizer, run / "checkpoints" / "step-40", 40)
    source = resolve_source(run)
    assert (source.kind, source.path, source.run_dir) == ("hf", run / "final", run)
    assert source.facts == summary
    assert_same_weights(load_model(source)[0], model)


def test_a_config_without_weights(model, tmp_path):
    model.config.save_pretrained(tmp_path / "half")
    with pytest.raises(
        UserError, match=r"has a config.json but no weights \(\*.safetensors or pytorch_model\*.bin\)"
    ):
        resolve_source(tmp_path / "half")


def test_a_path_that_does_not_exist(tmp_path):
    with pytest.raises(
        UserError, match=rf"--from {tmp_path}/nope does not exist; give a run folder, a model folder"
    ):
        resolve_source(tmp_path / "nope")


def test_a_folder_that_is_nothing_exportable(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match=r"is not a model, run, checkpoint or adapter folder"):
        resolve_source(tmp_path)


def test_a_run_that_has_saved_nothing_yet(tmp_path):
    """A run still training before its first checkpoint (its lock held), or one stopped there: said as a run."""
    from toolkit.run.lock import OwnerLock

    run = tmp_path / "run"
    run.mkdir()  # kept when the lock is released
    lock = OwnerLock.take(run, "test")
    try:
        with pytest.raises(UserError, match=r"^--from .*run is a run with nothing saved yet: it is still training "
                                            r"\(pid \d+ on .*\) and it has neither final/ nor a checkpoint; wait "
                                            r"for its first checkpoint"):
            resolve_source(run)
    finally:
        lock.release()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"is a run with nothing saved yet: it has neither final/ nor a checkpoint"):
        resolve_source(run)


# checkpoints


def test_a_ddp_checkpoint_loads_identical_weights(model, tiny_tokenizer, tmp_path):
    folder = save_checkpoint(
        model, tiny_tokenizer, tmp_path / "run" / "checkpoints" / "step-20", 20, eval_loss=2.75
    )
    source = resolve_source(folder)
    assert (source.kind, source.path, source.step, source.run_dir) == ("ddp", folder, 20, tmp_path / "run")
    assert source.facts["step"] == 20 and source.facts["eval_loss"] == 2.75
    loaded, tokenizer, notes = load_model(source)
    assert not loaded.training and type(loaded) is type(model)
    assert_same_weights(loaded, model)
    assert tokenizer.eos_token_id == tiny_tokenizer.eos_token_id and len(tokenizer) == len(tiny_tokenizer)
    assert notes[0].startswith(f"source: {source.describe()}")
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7, 8]])
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=0
        )


def test_a_run_without_final_exports_its_newest_complete_checkpoint(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    save_checkpoint(perturbed(model, 1), tiny_tokenizer, run / "checkpoints" / "step-9", 9)
    # step-10 is the newest by number, though not by name
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-10", 10)
    save_checkpoint(perturbed(model, 2), tiny_tokenizer, run / "checkpoints" / "step-11", 11, complete=False)
    source = resolve_source(run)
    assert (source.kind, source.path, source.step, source.run_dir) == (
        "ddp",
        run / "checkpoints" / "step-10",
        10,
        run,
    )
    assert_same_weights(load_model(source)[0], model)
    assert resolve_source(run, checkpoint="latest").path == run / "checkpoints" / "step-10"


def test_a_checkpoint_chosen_by_name(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    old = perturbed(model, 1)
    save_checkpoint(old, tiny_tokenizer, run / "checkpoints" / "step-5", 5)
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-10", 10)
    source = resolve_source(run, checkpoint="step-5")
    assert (source.path, source.step, source.run_dir) == (run / "checkpoints" / "step-5", 5, run)
    assert_same_weights(load_model(source)[0], old)


def test_a_checkpoint_without_trainer_state_is_incomplete(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-5", 5)
    folder = save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-10", 10, complete=False)
    for args in [(folder,), (run, "step-10")]:
        with pytest.raises(UserError) as excinfo:
            resolve_source(*args)
        message = str(excinfo.value)
        assert message.startswith(f"{folder} is an incomplete checkpoint (no trainer_state.json")
        assert "export an earlier one" in message


def test_a_checkpoint_name_that_is_not_there_lists_what_is(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-10", 10)
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-2", 2)
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-30", 30, complete=False)
    with pytest.raises(UserError) as excinfo:
        resolve_source(run, checkpoint="step-99")
    # only complete checkpoints are offered, oldest first
    assert str(excinfo.value) == f"--checkpoint step-99 is not in {run}/checkpoints; it has step-2, step-10"


def test_a_run_with_no_complete_checkpoint(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-10", 10, complete=False)
    with pytest.raises(
        UserError, match=r"is a run with neither final/ nor a complete checkpoint; nothing to export"
    ):
        resolve_source(run)
    with pytest.raises(UserError, match=r"has no complete checkpoint for --checkpoint latest"):
        resolve_source(run, checkpoint="latest")
    with pytest.raises(UserError, match=r"it has none$"):
        resolve_source(run, checkpoint="step-3")


def test_a_checkpoint_of_an_unknown_save(tmp_path):
    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"step": 3}))
    (folder / "weights.npz").write_bytes(b"")
    with pytest.raises(
        UserError, match=r"is a checkpoint from an unknown save \(it holds trainer_state.json, weights.npz\)"
    ):
        resolve_source(folder)


def test_a_checkpoint_without_model_files_or_final(model, tiny_tokenizer, tmp_path):
    folder = save_checkpoint(model, tiny_tokenizer, tmp_path / "lone" / "step-4", 4)
    for f in (folder / "model_files").iterdir():
        f.unlink()
    (folder / "model_files").rmdir()
    source = resolve_source(folder)
    assert source.kind == "ddp" and source.run_dir is None
    with pytest.raises(UserError, match=r"has no model_files/ .* export the run's final/ instead"):
        load_model(source)


# LoRA adapters


def test_an_adapter_folder_merges_onto_the_given_base(model, tiny_tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    base_dir = save_hf(model, tiny_tokenizer, tmp_path / "base")
    base = type(model).from_pretrained(base_dir)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)  # B starts at zero: make the adapter change something
    peft_model.save_pretrained(tmp_path / "adapter")
    source = resolve_source(tmp_path / "adapter")
    assert (source.kind, source.path) == ("adapter", tmp_path / "adapter")

    with pytest.raises(UserError, match=r"is a LoRA adapter; export the merged model with --merge-lora"):
        load_model(source, base=str(base_dir), merge_lora=False)
    merged, _, notes = load_model(source, base=str(base_dir))
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
        assert (expected - model.eval()(input_ids=ids).logits).abs().max() > 1e-3
    assert notes == [f"source: {source.describe()} on base {base_dir}, merged"]


def test_an_adapter_on_a_base_of_another_shape_is_one_line(tiny_model, tiny_tokenizer, tmp_path):
    """--base naming another model than the adapter's (peft's "size mismatch" RuntimeError, a traceback before)."""
    from peft import LoraConfig, get_peft_model

    own = tiny_model("llama", seed=3, tokenizer=tiny_tokenizer)
    get_peft_model(own, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    wider = save_hf(tiny_model("llama", seed=3, tokenizer=tiny_tokenizer, hidden_size=2 * own.config.hidden_size),
                    tiny_tokenizer, tmp_path / "wider")
    with pytest.raises(UserError, match=r"^--from .*adapter is a LoRA adapter of another base than .*wider "
                                        r"\(size mismatch for .*q_proj.*\); give --base the model it was trained on"):
        load_model(resolve_source(tmp_path / "adapter"), str(wider))


def test_an_adapter_finds_its_base_by_name_or_asks_for_it(model, tiny_tokenizer, tmp_path):
    import shutil

    from peft import LoraConfig, get_peft_model

    base_dir = save_hf(model, tiny_tokenizer, tmp_path / "base")
    peft_model = get_peft_model(
        type(model).from_pretrained(base_dir), LoraConfig(r=2, target_modules=["q_proj"])
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    named = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str(base_dir)
    source = resolve_source(tmp_path / "adapter")
    merged, _, notes = load_model(source)  # the base peft recorded, still on disk
    assert notes == [f"source: {source.describe()} on base {base_dir}, merged"]
    assert_same_weights(merged, model)  # a fresh LoRA's B is zero: merging changes nothing

    shutil.rmtree(base_dir)
    with pytest.raises(
        UserError, match=rf"is a LoRA adapter whose base is unknown or absent \({base_dir}\); give --base"
    ):
        load_model(source)


# damaged sources (issue 26): one line that names the file and what to export instead


def with_manifest(folder: Path) -> Path:
    """As training writes a checkpoint: the manifest, then the state file naming its checksum."""
    from toolkit.run.manifest import crc32, write_manifest

    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").unlink()
    state["manifest_crc32"] = crc32(write_manifest(folder))
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_only_the_files_an_export_reads_must_be_intact(model, tiny_tokenizer, tmp_path):
    """A damaged optimizer state stops a resume, not an export of the intact weights beside it."""
    folder = save_checkpoint(model, tiny_tokenizer, tmp_path / "run" / "checkpoints" / "step-4", 4)
    (folder / "optimizer.bin").write_bytes(b"adam state")
    with_manifest(folder)
    (folder / "optimizer.bin").write_bytes(b"adam stat!")
    assert_same_weights(load_model(resolve_source(folder))[0], model)
    (folder / "model_files" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"model_files/tokenizer.json is missing; export an earlier checkpoint"):
        resolve_source(folder)


def test_a_state_file_that_names_a_lost_manifest(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-2", 2)
    folder = with_manifest(save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-4", 4))
    (folder / "manifest.json").unlink()
    with pytest.raises(UserError) as refused:
        resolve_source(run, "step-4")
    assert str(refused.value) == (
        f"DDP/single-process checkpoint {folder} (step 4) cannot be exported: {folder}/manifest.json is missing; "
        f"export an earlier checkpoint (--from {run} --checkpoint step-2)"
    )


def test_a_state_file_that_does_not_belong_or_does_not_read(model, tiny_tokenizer, tmp_path):
    run = tmp_path / "run"
    earlier = with_manifest(save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-2", 2))
    folder = with_manifest(save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-4", 4))
    (folder / "trainer_state.json").write_bytes((earlier / "trainer_state.json").read_bytes())
    with pytest.raises(UserError, match=r"step-4/trainer_state.json is of step 2, not 4: a state file from another "
                       r"checkpoint; export an earlier checkpoint \(--from .* --checkpoint step-2\)"):
        resolve_source(run, "step-4")
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "step": 4, "manifest_crc32": "0badf00d"}))
    with pytest.raises(UserError, match=r"step-4/trainer_state.json belongs to another checkpoint"):
        resolve_source(run, "step-4")
    (folder / "trainer_state.json").write_text("{nope")  # was a JSONDecodeError traceback
    with pytest.raises(UserError, match=r"step-4/trainer_state.json is not a readable trainer state \(not JSON: Expecting"):
        resolve_source(run, "step-4")


# what a folder without a manifest (an older run, any HF folder) lost -> the line that names it
DAMAGE = {
    "truncated weights": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:3000]),
                          "its weights are not readable safetensors (Error while deserializing header"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{nope"), "config.json is not JSON"),
    "config.json of no model": (lambda f: (f / "config.json").write_text("{}"), "does not load (Unrecognized model"),
    "a shard the index names": (lambda f: (f / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})),
        "model-00002-of-00002.safetensors is missing (model.safetensors.index.json names it)"),
    "tokenizer.json not JSON": (lambda f: (f / "tokenizer.json").write_text("{nope"), "its tokenizer in"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_model_folder_is_one_line(damage, model, tiny_tokenizer, tmp_path):
    folder = save_hf(model, tiny_tokenizer, tmp_path / "hf")
    spoil, expected = DAMAGE[damage]
    spoil(folder)
    with pytest.raises(UserError, match=re.escape(expected)) as refused:
        load_model(resolve_source(folder))
    assert str(refused.value).startswith(f"Hugging Face model folder {folder}")
    assert str(refused.value).endswith("restore the file from a copy, or export another folder")


def test_a_file_is_not_a_source(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"model.gguf is a file; give the folder that holds it"):
        resolve_source(tmp_path / "model.gguf")


def test_a_pipeline_checkpoint_loads_identical_weights(model, tiny_tokenizer, tmp_path):
    """It crashed on its own description (a KeyError) before any weight was read."""
    folder = save_checkpoint(model, tiny_tokenizer, tmp_path / "run" / "checkpoints" / "step-3", 3)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    save_file({k: state[k] for k in names[: len(names) // 2]}, str(folder / "pipeline_stage_0.safetensors"))
    save_file({k: state[k] for k in names[len(names) // 2:]}, str(folder / "pipeline_stage_1.safetensors"))
    (folder / "model.safetensors").unlink()
    source = resolve_source(folder)
    assert source.kind == "pipeline" and source.describe().startswith("pipeline-parallel checkpoint")
    assert_same_weights(load_model(source)[0], model)


class _Payload:
    def __reduce__(self):
        return (print, ("code ran while unpickling",))


def test_a_deepspeed_checkpoint_that_pickles_code_is_refused_before_its_weights_are_gathered(tmp_path, capsys):
    """DeepSpeed's zero_to_fp32 reads its files with torch.load(weights_only=False); the export gathers them
    through the weights-only unpickler all the same."""
    import shutil

    from toolkit.export.consolidate import gather_weights

    folder = shutil.copytree(Path(__file__).parents[2] / "fixtures/checkpoints/zero2@2/step-3", tmp_path / "step-3")
    source = resolve_source(folder)
    assert source.kind == "deepspeed"
    torch.save({"optimizer_state_dict": _Payload()}, folder / "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UserError, match=r"holds pickled objects beyond tensors and numbers \(print\)"):
        gather_weights(source, tmp_path / "full")
    assert "code ran" not in capsys.readouterr().out


@pytest.mark.parametrize("rotated_before", ["the tokenizer", "the weights"])
def test_a_checkpoint_that_rotation_deletes_while_it_is_read(rotated_before, model, tiny_tokenizer, tmp_path,
                                                             monkeypatch, capsys):
    """Export of a run still training: rotation (checkpoint.keep_last) renames the checkpoint away and
    deletes it mid-read. Was a tokenizer error ("Repo id must be in the form") or "weights from
    different models"; now the one line that says what happened and what to export instead."""
    import transformers
    from recipe_runner import recipe_module

    run = tmp_path / "run"
    folder = save_checkpoint(model, tiny_tokenizer, run / "checkpoints" / "step-4", 4)
    (run / "metrics.jsonl").write_text("{}\n")
    patched = transformers.AutoTokenizer if rotated_before == "the tokenizer" else transformers.AutoModelForCausalLM
    read = patched.from_pretrained.__func__

    def rotate_then_read(cls, *args, **kwargs):
        if folder.exists():  # as save_checkpoint's rotation does: out of rotation in one rename, then deleted
            shutil.rmtree(folder.rename(folder.with_name("step-4.deleting")))
        return read(cls, *args, **kwargs)

    monkeypatch.setattr(patched, "from_pretrained", classmethod(rotate_then_read))
    code = recipe_module("export").main(["--from", str(run), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: DDP/single-process checkpoint {folder} (step 4) changed or was removed while it "
                          "was being read: its run is still training"), err
    assert "--checkpoint latest" in err and not (tmp_path / "out").exists()
