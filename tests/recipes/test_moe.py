"""A mixture of experts (Qwen3-MoE: 4 experts, 2 per token) pretrained under the existing strategies:
the loss and the routers' load-balancing loss logged, the router loss in the objective, and the
same curves as one process under DDP, ZeRO-3 and FSDP2 on 2 processes (fp32, accumulation 2,
full gradient checkpointing), with a ZeRO-3 checkpoint resumed bit for bit; under tensor parallel
(fsdp_tp.yaml) its experts spread over the tp ranks (expert parallel), with the same curves too."""

from __future__ import annotations

import pytest
from model_parallel import assert_same_logits
from recipe_runner import TINY, run_recipe
from transformers import AutoModelForCausalLM

from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed

MOE = [*TINY, "model.model_type=qwen3_moe", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
       "model.config.moe_intermediate_size=64", "model.config.decoder_sparse_step=1",
       "model.config.router_aux_loss_coef=0.05", "train.max_steps=6", "eval.every=0", "checkpoint.every=3"]


def curves(out) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["router_aux_loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("moe") / "run"
    run_recipe("pretrain", [*MOE, f"output_dir={out}"], nproc=1, cache=data_cache)
    return out


def test_a_moe_model_trains_with_its_router_loss_logged_and_in_the_objective(reference, tmp_path, data_cache):
    ref = curves(reference)
    assert sorted(ref) == list(range(1, 7))
    # 4 experts, 2 per token: perfectly balanced routing gives top_k = 2; the loss is near it
    assert all(1.9 < aux < 2.5 for _, aux in ref.values()), ref
    # without the router loss in the objective the run is another one
    out = tmp_path / "coef0"
    run_recipe("pretrain", [*MOE, "model.config.router_aux_loss_coef=0", f"output_dir={out}"], nproc=1,
               cache=data_cache)
    assert curves(out)[1] == ref[1], "the first loss is computed before any update"
    assert curves(out)[6][0] != ref[6][0], "router_aux_loss_coef changed nothing: the router loss is not trained"
    model = AutoModelForCausalLM.from_pretrained(reference / "final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_a_moe_model_gives_the_same_curves_under_each_strategy(strategy, reference, tmp_path, data_cache):
    out = tmp_path / "run"
    run_recipe("pretrain", [*MOE, "model.gradient_checkpointing=full", f"output_dir={out}"], nproc=2,
               cache=data_cache, accelerate_config=f"{strategy}.yaml")
    ref, got = curves(reference), curves(out)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step][0] == pytest.approx(ref[step][0], rel=1e-4), ("loss", strategy, step)
        assert got[step][1] == pytest.approx(ref[step][1], rel=1e-4), ("router loss", strategy, step)
    if strategy != "zero3":  # a resume is each strategy's (test_strategies.py); ZeRO-3 holds the experts sharded
        return
    resumed = tmp_path / "resumed"
    run_recipe("pretrain", [*MOE, "model.gradient_checkpointing=full", f"output_dir={resumed}",
                            f"resume={out / 'checkpoints' / 'step-3'}"], nproc=2, cache=data_cache,
               accelerate_config=f"{strategy}.yaml")
    assert {s: v for s, v in curves(resumed).items()} == {s: got[s] for s in (4, 5, 6)}


def test_a_moe_model_under_tensor_parallel_splits_its_experts_over_the_tp_ranks(reference, tmp_path, data_cache):
    """fsdp_tp.yaml on 2 processes: attention split by heads, 2 of the 4 experts on each rank, tokens sent
    to their experts' rank and back (all_to_all); the loss and router loss curves of one process (the
    router hooks still fire on the split model, and each tp rank's router loss counts once), a resume
    from step-3 equal to the bit, and final/ one HF folder with the reference's logits."""
    out = tmp_path / "run"
    proc = run_recipe("pretrain", [*MOE, f"output_dir={out}"], nproc=2, cache=data_cache,
                      accelerate_config="fsdp_tp.yaml")
    assert "tensor_parallel=2 expert_parallel=2 (data_parallel=1)" in proc.stdout + proc.stderr
    ref, got = curves(reference), curves(out)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step][0] == pytest.approx(ref[step][0], rel=1e-4), ("loss", step)
        assert got[step][1] == pytest.approx(ref[step][1], rel=1e-4), ("router loss", step)
    # the gradient norm too: a gradient summed once too often (Qwen3's q_norm/k_norm under accumulation)
    # moved it by 5e-4 at step 1 while the losses still agreed to 1e-7
    norms = {o: {r["step"]: r["grad_norm"] for r in read_metrics(o / "metrics.jsonl") if "loss" in r}
             for o in (out, reference)}
    assert norms[out] == pytest.approx(norms[reference], rel=1e-4)
    assert_same_logits(out / "final", reference / "final")

    resumed = tmp_path / "resumed"
    run_recipe("pretrain", [*MOE, f"output_dir={resumed}", f"resume={out / 'checkpoints' / 'step-3'}"], nproc=2,
               cache=data_cache, accelerate_config="fsdp_tp.yaml")
    assert curves(resumed) == {s: got[s] for s in (4, 5, 6)}
