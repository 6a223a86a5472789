"""The strategy matrix: DDP, FSDP2 and ZeRO-1/2/3 by config file alone, with the same numbers.

Each strategy runs the real recipe on 2 CPU processes (gloo), fp32, 6 steps, gradient
accumulation 2 and full (non-reentrant) gradient checkpointing, and is compared with a plain
1-process run on the same global batches: so the strategy, accumulation and checkpointing
together change nothing.
"""

from __future__ import annotations

import re
import shutil
import sys

import pytest
import torch
from accelerate import Accelerator
from kill_relaunch import through_kills
from recipe_runner import MATRIX_RUN, ROOT, TINY, recipe_module, run_recipe
from safetensors.torch import load_file
from same_training import assert_same_weights, lr_sum
from saved_checkpoints import FIXTURES
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toolkit.checkpoint.conversion import cached_conversion
from toolkit.checkpoint.formats import Checkpoint
from toolkit.config.load import load_config
from toolkit.data.corpus import load_corpus, split_documents
from toolkit.data.packing import packed_dataset
from toolkit.run.folder import RunDir, converted_state
from toolkit.strategy.by_name import ConsolidatedState
from toolkit.training.evaluation import evaluate
from toolkit.training.metrics import read_metrics
from toolkit.training.recipe_config import PretrainConfig

sys.path.insert(0, str(ROOT / "bench"))
import kill_soak  # noqa: E402  (the hard-kill harness, bench/kill_soak.py)

pytestmark = pytest.mark.distributed

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
VOCAB = 512  # TINY's
SHARDED = {"fsdp", "zero3"}
BANNER = {
    "ddp": "strategy=DDP world_size=2",
    "fsdp": "strategy=FSDP2 world_size=2",
    "zero1": "strategy=DeepSpeed ZeRO-1 world_size=2",
    "zero2": "strategy=DeepSpeed ZeRO-2 world_size=2",
    "zero3": "strategy=DeepSpeed ZeRO-3 world_size=2",
}


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_curve_and_weights_match_one_process(strategy, strategy_runs, one_process_run):
    reference = one_process_run
    out, log = strategy_runs(strategy)
    assert BANNER[strategy] in log, "the run did not use the strategy its config file names"
    assert "gradient checkpointing full" in log
    ref, got = losses(reference), losses(out)
    assert sorted(got) == sorted(ref) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (strategy, step)

    digests = [r for r in read_metrics(out / "metrics.jsonl") if "parameter_digests" in r][-1]["parameter_digests"]
    if strategy in SHARDED:
        assert digests[0] != digests[1], "ranks hold identical parameters: nothing was sharded"
    else:
        assert digests[0] == digests[1], "replicas ended with different weights"
    # Adam divides by sqrt(v): near-zero gradients turn last-bit reduction-order differences into
    # lr-sized steps on a few coordinates (same_training.py derives the bound)
    a = load_file(out / "final" / "model.safetensors")
    b = load_file(reference / "final" / "model.safetensors")
    assert {t.dtype for t in [*a.values(), *b.values()]} == {torch.float32}
    assert_same_weights(a, b, lr_sum(reference), steps=6, longest_sum=VOCAB, what=(strategy,))


@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_chunked_loss_gives_the_default_curve(strategy, strategy_runs, tmp_path, data_cache):
    """model.loss=chunked where the output head's weight is sharded: the loss is computed inside the
    head's forward, while ZeRO-3/FSDP2 hold it gathered. Same training and held-out losses as the
    default run; 50-token chunks do not divide a micro-batch's 128 tokens."""
    default, _ = strategy_runs(strategy)
    out = tmp_path / "chunked"
    run_recipe("pretrain", [*MATRIX_RUN, "model.loss=chunked", "model.loss_chunk_tokens=50", f"output_dir={out}"],
               nproc=2, cache=data_cache, accelerate_config=f"{strategy}.yaml")
    ref, got = losses(default), losses(out)
    assert sorted(got) == sorted(ref) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (strategy, step)
    # runs are bit-reproducible (test_resume_is_bit_exact): equal bits would mean the full path ran
    assert got != ref, "model.loss=chunked reproduced the default losses bit for bit: was it used?"
    evals = [{r["step"]: r["eval_loss"] for r in read_metrics(o / "metrics.jsonl") if "eval_loss" in r}
             for o in (default, out)]
    assert sorted(evals[1]) == sorted(evals[0]) == [3, 6]
    for step in evals[0]:
        assert evals[1][step] == pytest.approx(evals[0][step], rel=1e-4), (strategy, step)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_consolidated_final_model_reproduces_the_live_model(strategy, strategy_runs, data_cache, monkeypatch):
    """The held-out loss the sharded live model measured at the end is what the saved folder gives."""
    out, _ = strategy_runs(strategy)
    live = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r][-1]
    assert live["step"] == 6
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(data_cache))
    cfg = load_config(PretrainConfig, "recipes/configs/pretrain_tiny.yaml", MATRIX_RUN)
    corpus, source = load_corpus(cfg.data)
    _, val_docs = split_documents(corpus, cfg.data.val_fraction, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    val = packed_dataset(val_docs, tokenizer, cfg.data.seq_len, data_cache,
                         f"{source}-seed{cfg.seed}-val{cfg.data.val_fraction}-val").with_format("numpy")
    model = AutoModelForCausalLM.from_pretrained(out / "final", attn_implementation="sdpa").eval()
    reloaded = evaluate(Accelerator(cpu=True), model, val, 2, cfg.eval.blocks, "sdpa")
    assert reloaded["eval_loss"] == pytest.approx(live["eval_loss"], rel=1e-6)


def _files(folder) -> set[str]:
    """A checkpoint's file layout: its files' paths, rank and step numbers aside (and Python's caches of the
    scripts DeepSpeed writes into one, which a compileall of the tree adds)."""
    return {re.sub(r"\d+", "N", str(f.relative_to(folder))) for f in folder.rglob("*")
            if f.is_file() and "__pycache__" not in f.parts}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_a_fresh_checkpoint_has_the_files_of_the_saved_fixtures_and_converts(strategy, strategy_runs, tmp_path):
    """test_resume_elsewhere.py resumes checkpoints an earlier commit saved (tests/fixtures/checkpoints). This
    run's step-3 must still have their files, and convert by parameter name in one process (what every resume
    under another strategy starts with), every parameter with its Adam state: a change of format fails here,
    and the fixtures are then made again (tests/support/saved_checkpoints.py) beside the old ones'."""
    out, _ = strategy_runs(strategy)
    fresh = shutil.copytree(out / "checkpoints" / "step-3", tmp_path / "step-3")
    assert _files(fresh) == _files(FIXTURES / {"ddp": "ddp@3", "fsdp": "fsdp@2", "zero2": "zero2@2",
                                                "zero3": "zero3@2"}[strategy] / "step-3")
    converted, cached = cached_conversion(Checkpoint.read(fresh))
    state = ConsolidatedState(converted)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out / "final"))
    names = [n for n, _ in model.named_parameters()]
    assert not cached and state.trained == len(names)
    assert all(state.moments(n) is not None and state.step(n) == 3.0 for n in names)
    assert state.weight(names[:1]).shape == model.get_parameter(names[0]).shape


# Hard kills at 9 points (toolkit.run.faults): a kill inside a step before the update (forward) and after it
# (after_optimizer), in an evaluation, at each stage of a save, in a prune and in final/. The other kinds (backward,
# between_micro_batches, save.rank_files, save.manifest) are the same moments as far as a resume can tell, and
# bench/kill_soak.py draws every kind under every strategy. The steps: checkpoints at 2, 4 and 6 with keep_last=1
# (so pruning at 4 and 6), evaluations at 3 and 6. DDP and FSDP2 write theirs in the background (BACKGROUND): killed
# inside those writes too, they still come back to the blocking reference run's numbers, bit for bit.
KILLS = {
    "ddp": ["forward@1/1", "save.background@4/0", "prune@4/0"],
    "fsdp": ["save.background@4/1", "final/0"],
    "zero2": ["eval@3/1", "save.state_file@6/0"],
    "zero3": ["after_optimizer@3/0", "save.start@4/1"],
}
# Who brings the ranks back after a kill: for ZeRO-3, torchrun's elastic restarts (`--max_restarts`, one real launch
# whose ranks restart, each restart a new Python per rank: ~20 core-s); for the others the test, relaunching the
# same run with resume=auto on ranks forked from the rank server, as a scheduler's requeue would. What comes back,
# and from where, is the toolkit's either way: the newest complete checkpoint, never a partial one.
ELASTIC = "zero3"
BACKGROUND = {"ddp", "fsdp"}  # checkpoint.async_save=true


@pytest.mark.parametrize("strategy", sorted(KILLS))
def test_hard_kills_come_back_bit_exact(strategy, strategy_runs, tmp_path, data_cache):
    """The soak harness (bench/kill_soak.py) in its small deterministic form: resume=auto, two or three SIGKILLs of
    one rank, each firing once. After each the ranks come back and resume from the newest complete checkpoint, and the
    run ends with the uninterrupted run's losses and final weights, bit for bit, nothing lost."""
    reference, _ = strategy_runs(strategy)
    overrides = [*MATRIX_RUN, *kill_soak.SAVES, "resume=auto", "train.collective_timeout_s=120",
                 *([kill_soak.ASYNC] if strategy in BACKGROUND else [])]
    out, log = tmp_path / "run", tmp_path / "kills.log"
    if strategy == ELASTIC:
        proc = kill_soak.launch(strategy, out, overrides, data_cache, KILLS[strategy], log, restarts=3)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:]
    else:
        output = through_kills("pretrain", [*overrides, f"output_dir={out}"], KILLS[strategy], log, data_cache,
                               accelerate_config=f"{strategy}.yaml")
    assert log.read_text().split() == KILLS[strategy], "each kill fires once, in order"
    expected = [kill_soak.expected_resume(kill, overrides) for kill in KILLS[strategy]]
    assert kill_soak.resumed_steps(output) == [step for step in expected if step], output[-6000:]
    assert kill_soak.compare(out, reference) == []
    assert kill_soak.audit(out, newest_saved=6) == []
    assert not list((out / "checkpoints").glob("*.deleting")), "an interrupted prune was not finished"


@pytest.mark.parametrize("strategy", ["zero1"])  # the other strategies: the hard-kill test above
def test_resume_is_bit_exact(strategy, strategy_runs, tmp_path, data_cache):
    straight, _ = strategy_runs(strategy)
    out = tmp_path / "resumed"
    proc = run_recipe("pretrain", [*MATRIX_RUN, f"output_dir={out}", f"resume={straight / 'checkpoints' / 'step-3'}"],
                      nproc=2, cache=data_cache, accelerate_config=f"{strategy}.yaml")
    assert "resumed from" in proc.stdout + proc.stderr
    ref, got = losses(straight), losses(out)
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == ref[step], (strategy, step)


@pytest.mark.cpu_adam
def test_zero3_offload_path_runs_on_cpu(tmp_path, data_cache, one_process_run):
    out = tmp_path / "offload"
    proc = run_recipe("pretrain", [*MATRIX_RUN, f"output_dir={out}"], nproc=2, cache=data_cache,
                      accelerate_config="zero3_offload.yaml")
    assert "strategy=DeepSpeed ZeRO-3 (offload optimizer+param)" in proc.stdout + proc.stderr
    ref, got = losses(one_process_run), losses(out)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None


def test_fsdp_final_evaluation_after_a_checkpoint_at_the_last_step(strategy_runs):
    """Regression: under FSDP2, an evaluation forward between save_state and gathering the final
    model left storage that could not be freed; the final evaluation now precedes the checkpoint.
    The matrix's FSDP2 run is that case: a checkpoint and an evaluation at its last step (6)."""
    out, _ = strategy_runs("fsdp")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    assert "step-6" in [p.name for p in RunDir(out).complete_checkpoints()]
    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None


# -------------------------------------------------------------- final/ under mixed precision
# DDP and FSDP2 train fp32 parameters under bf16 autocast; DeepSpeed turns the parameters into
# bf16 copies and keeps fp32 masters in its optimizer. final/ must not depend on that.
BF16 = [*TINY, "train.max_steps=3", "train.mixed_precision=bf16", "eval.every=0", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def bf16_finals(tmp_path_factory, data_cache):
    finals = {}
    # DDP's bf16 copy of the weights is made once per step (model.cast_weights=auto); "ddp-autocast" leaves it to
    # autocast at every forward
    for strategy in ("ddp", "fsdp", "zero2", "zero3", "ddp-autocast"):
        out = tmp_path_factory.mktemp(f"bf16-{strategy}") / "run"
        cast = ["model.cast_weights=per_forward"] if strategy == "ddp-autocast" else []
        proc = run_recipe("pretrain", [*BF16, *cast, f"output_dir={out}"], nproc=2, cache=data_cache,
                          accelerate_config=f"{strategy.split('-')[0]}.yaml")
        assert "precision=bf16" in proc.stdout + proc.stderr
        finals[strategy] = out / "final"
    return finals


def test_final_folder_has_one_dtype_and_the_same_tensors_under_every_strategy(bf16_finals):
    import json

    from transformers import AutoConfig

    from toolkit.models.scratch import build_model

    weights = {s: load_file(str(f / "model.safetensors")) for s, f in bf16_finals.items()}
    for strategy, tensors in weights.items():
        assert {t.dtype for t in tensors.values()} == {torch.float32}, strategy
        assert json.loads((bf16_finals[strategy] / "config.json").read_text())["dtype"] == "float32", strategy
        assert "float32, cast from the fp32 master weights" in (bf16_finals[strategy] / "README.md").read_text()
    # the weights every run started from (the recipe seeds the init identically everywhere)
    cfg = load_config(PretrainConfig, str(ROOT / "recipes/configs/pretrain_tiny.yaml"), BF16)
    init = build_model(cfg.model, AutoConfig.from_pretrained(bf16_finals["ddp"]), cfg.seed).state_dict()
    ref = weights["ddp"]
    moved = sum(((ref[k] - init[k]) ** 2).sum() for k in ref).sqrt()
    for strategy, tensors in weights.items():
        assert tensors.keys() == ref.keys(), strategy
        # bf16 compute rounds differently per strategy (autocast on fp32 parameters vs bf16
        # parameters with fp32 masters): the same weights up to that rounding, i.e. a small
        # fraction of what training changed; a 16-bit final/ or another run would be far off
        ratio = float(sum(((tensors[k] - ref[k]) ** 2).sum() for k in ref).sqrt() / moved)
        print(f"final/ under {strategy}: distance to DDP's = {ratio:.4f} x the distance DDP's moved from the init")
        assert ratio < 0.15, (strategy, ratio)
    # the copy once per step is autocast's arithmetic: bit-equal weights after 3 steps of 2 ranks
    assert all(torch.equal(weights["ddp"][k], weights["ddp-autocast"][k]) for k in ref)
    # Within one family the numerics are the same. ZeRO-2 and ZeRO-3 both reduce bf16 gradients of 2
    # ranks (a 2-term sum is the same in either order) into fp32 masters; only the gradient norm is summed
    # over other partitions, off by ~8 u sqrt(N) of itself (u = 2^-24), and a clip coefficient off by that
    # much scales g, m and sqrt(v) alike, which Adam's update cancels but for eps: each step is then off by
    # at most lr * 8 u sqrt(N). Measured: 0 apart (bit-equal).
    apart = max((weights["zero2"][k] - weights["zero3"][k]).abs().max().item() for k in ref)
    n = sum(t.numel() for t in ref.values())
    print(f"final/ under zero2 and zero3: at most {apart:.3g} apart")
    assert apart <= lr_sum(bf16_finals["zero2"].parent) * 8 * 2.0**-24 * n**0.5


# -------------------------------------------------------------- fp8 (issue 46): the matrix's fp8 column
# torchao's float8 casts and scales, its matmuls emulated (LLM_TOOLKIT_FP8_EMULATE=1: CPU, every linear layer but the
# head, no compile); the same 3 steps as BF16's runs, on one process and on 2 under each strategy
FP8 = [*BF16, "train.mixed_precision=fp8"]
EMULATED = {"LLM_TOOLKIT_FP8_EMULATE": "1"}


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory, data_cache):
    runs = {}
    for strategy in ("one process", "ddp", "fsdp", "zero1", "zero2", "zero3"):
        out = tmp_path_factory.mktemp(f"fp8-{strategy.replace(' ', '-')}") / "run"
        # FSDP2's run saves step 2 too: its resume must give this run's step 3 and final/ bit for bit
        every = ["checkpoint.every=2"] if strategy == "fsdp" else []
        proc = run_recipe("pretrain", [*FP8, *every, f"output_dir={out}"], nproc=1 if strategy == "one process" else 2,
                          cache=data_cache, accelerate_config="ddp.yaml" if strategy == "one process" else f"{strategy}.yaml",
                          env=EMULATED)
        runs[strategy] = (out, proc.stdout + proc.stderr)
    return runs


def test_fp8_trains_under_every_strategy_as_on_one_process(fp8_runs, bf16_finals):
    one, _ = fp8_runs["one process"]
    ref = losses(one)
    for strategy, (out, log) in fp8_runs.items():
        assert "precision=fp8 (float8 linear layers, bf16 elsewhere)" in log, strategy
        # TINY's 2 layers x 7 projections; the head stays in bf16
        assert "fp8: 14 of 15 linear layers in float8 (tensorwise scaling, emulated" in log, strategy
        assert ("gathered in float8 by FSDP2" in log) == (strategy == "fsdp"), strategy
        got = losses(out)
        assert sorted(got) == [1, 2, 3]
        for step in got:
            print(f"fp8 {strategy} step {step}: {got[step]:.6f} (one process {ref[step]:.6f})")
            if strategy == "ddp":  # the same micro-batches, so the same per-tensor scales, as the one process's
                assert got[step] == ref[step], step
            else:  # ZeRO holds bf16 weights: float8 casts from other roundings (measured 3.5e-5). FSDP2 gathers
                # float8 cast from its fp32 shards, the same casts as gathering fp32 (CPU: no param_dtype) and casting
                # after, to the bit: 3.1e-5 (a bf16 run's FSDP2 is 1.7e-5 away); with 13 of its 14 float8 weights
                # lost to the optimizer (Accelerate's mapping by data_ptr, fsdp.py's prepare) it was 8.9e-4
                assert got[step] == pytest.approx(ref[step], rel=1e-4), (strategy, step)
        final = load_file(out / "final" / "model.safetensors")
        bf16 = load_file(bf16_finals["ddp"] / "model.safetensors")
        # the same parameters as a bf16 run's final/, fp32 masters, loadable by plain transformers
        assert final.keys() == bf16.keys() and {t.dtype for t in final.values()} == {torch.float32}, strategy
    assert AutoModelForCausalLM.from_pretrained(one / "final") is not None


def test_a_checkpoint_moves_between_fp8_and_bf16_and_exports(fp8_runs, bf16_finals, data_cache, tmp_path):
    """fp8 is bf16 with float8 matmuls over the same parameters and optimizer state: a checkpoint of either resumes
    in the other, said in the resume's line, under another strategy too (DDP's fp8 checkpoint under FSDP2 in bf16);
    an fp8 ZeRO-3 checkpoint exports."""
    fp8_ddp = fp8_runs["ddp"][0] / "checkpoints" / "step-3"
    out = tmp_path / "to-bf16"
    proc = run_recipe("pretrain", [*BF16, "train.max_steps=4", f"output_dir={out}", f"resume={fp8_ddp}"], nproc=2,
                      cache=data_cache, accelerate_config="fsdp.yaml")
    said = proc.stdout + proc.stderr
    assert "resumed with changed settings, taken from step 4 on: train.mixed_precision fp8 -> bf16" in said
    assert sorted(losses(out)) == [4]
    bf16_zero3 = bf16_finals["zero3"].parent / "checkpoints" / "step-3"
    out = tmp_path / "to-fp8"
    proc = run_recipe("pretrain", [*FP8, "train.max_steps=4", f"output_dir={out}", f"resume={bf16_zero3}"], nproc=2,
                      cache=data_cache, accelerate_config="zero3.yaml", env=EMULATED)
    assert "train.mixed_precision bf16 -> fp8" in proc.stdout + proc.stderr and sorted(losses(out)) == [4]
    # FSDP2's fp8 checkpoint (its weights gathered in float8) under FSDP2 in fp8 again, bit for bit: the float8
    # gather's scales are of the resumed weights, and every weight has its Adam state
    fsdp_run = fp8_runs["fsdp"][0]
    out = tmp_path / "fsdp-to-fsdp"
    proc = run_recipe("pretrain", [*FP8, f"output_dir={out}", f"resume={fsdp_run / 'checkpoints' / 'step-2'}"],
                      nproc=2, cache=data_cache, accelerate_config="fsdp.yaml", env=EMULATED)
    assert "resumed from" in proc.stdout + proc.stderr and losses(out) == {3: losses(fsdp_run)[3]}
    whole, again = load_file(fsdp_run / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert again.keys() == whole.keys() and all(torch.equal(again[k], whole[k]) for k in whole)
    # and converted for DDP in bf16, with Adam's state of every parameter, each stepped 3 times (an optimizer
    # holding one float8 weight in place of all of them counted 42 for it, and nothing for the 13 others)
    fsdp_fp8 = fsdp_run / "checkpoints" / "step-3"
    out = tmp_path / "fsdp-to-ddp"
    proc = run_recipe("pretrain", [*BF16, "train.max_steps=4", f"output_dir={out}", f"resume={fsdp_fp8}"],
                      nproc=2, cache=data_cache, accelerate_config="ddp.yaml", env=EMULATED)
    assert "resumed from" in proc.stdout + proc.stderr and sorted(losses(out)) == [4]
    converted = ConsolidatedState(converted_state(fsdp_fp8))
    assert converted.meta["steps"] == dict.fromkeys(whole, 3.0)
    # the fp8 ZeRO-3 run's own checkpoint, consolidated into one Hugging Face folder
    exported = tmp_path / "exported"
    code = recipe_module("export").main(["--from", str(fp8_runs["zero3"][0]), "--checkpoint", "step-3", "--format", "hf",
                                         "--output", str(exported)])
    assert code == 0
    final = load_file(fp8_runs["zero3"][0] / "final" / "model.safetensors")
    again = load_file(exported / "model.safetensors")
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)
