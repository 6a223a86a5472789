"""Context parallel as a user launches it (accelerate_configs/fsdp_cp.yaml): every sequence split over
2 ranks, packed documents kept apart, the same curves as one process (fp32, rel 1e-4), a checkpoint
resumed bit for bit, final/ one HF folder with the reference's logits; dp_shard 2 x cp 2 on 4
processes; and what cannot work refused in one line."""

from __future__ import annotations

import pytest
import torch
from recipe_runner import TINY, run_recipe
from transformers import AutoModelForCausalLM

from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed

RUN = [*TINY, "train.max_steps=6", "checkpoint.every=3", "eval.every=3"]


def curves(out) -> dict[tuple[int, str], float]:
    rows = read_metrics(out / "metrics.jsonl")
    found = {(r["step"], "loss"): r["loss"] for r in rows if "loss" in r}
    found |= {(r["step"], "eval"): r["eval_loss"] for r in rows if "eval_loss" in r}
    found |= {(r["step"], "grad_norm"): r["grad_norm"] for r in rows if r.get("grad_norm") is not None}
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("cp") / "one"
    run_recipe("pretrain", [*RUN, f"output_dir={out}"], nproc=1, cache=data_cache)
    return out


def assert_same_curves(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-4), key


def logits(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_context_parallel_on_2_processes_equals_one_process_and_resumes_bit_exact(reference, tmp_path, data_cache):
    out = tmp_path / "cp"
    proc = run_recipe("pretrain", [*RUN, f"output_dir={out}"], nproc=2, cache=data_cache,
                      accelerate_config="fsdp_cp.yaml")
    assert "context_parallel=2 (data_parallel=1)" in proc.stdout + proc.stderr
    got = curves(out)
    assert_same_curves(got, curves(reference))

    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(out / "final", ids), logits(reference / "final", ids), rtol=1e-4, atol=1e-4)

    resumed = tmp_path / "resumed"
    run_recipe("pretrain", [*RUN, f"output_dir={resumed}", f"resume={out / 'checkpoints' / 'step-3'}"], nproc=2,
               cache=data_cache, accelerate_config="fsdp_cp.yaml")
    after = {k: v for k, v in got.items() if k[0] > 3}
    assert curves(resumed) == after


def test_dp_shard_2_by_cp_2_on_4_processes_equals_one_process(reference, tmp_path, data_cache):
    out = tmp_path / "2d"
    proc = run_recipe("pretrain", [*RUN, "train.max_steps=3", f"output_dir={out}"], nproc=4, cache=data_cache,
                      accelerate_config="fsdp_cp.yaml", launch_args=["--parallelism_config_dp_shard_size", "2"])
    assert "context_parallel=2 (data_parallel=2)" in proc.stdout + proc.stderr
    ref = {k: v for k, v in curves(reference).items() if k[0] <= 3}
    assert_same_curves(curves(out), ref)


@pytest.mark.parametrize(("extra", "launch_args", "says"), [
    (["data.seq_len=66"], [], "data.seq_len=66 is not divisible by 2 x parallelism_config_cp_size = 4"),
    (["model.model_type=qwen3_moe", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
      "model.config.moe_intermediate_size=64"], [], "context parallel with a mixture of experts"),
    ([], ["--parallelism_config_cp_size", "3"], "parallelism_config_dp_shard_size=1 x parallelism_config_cp_size=3 must equal the 2 processes"),
    ([], ["--parallelism_config_tp_size", "2"], "parallelism_config_tp_size=2 is not supported yet"),
])
def test_what_cannot_be_split_is_refused_in_one_line(tmp_path, data_cache, extra, launch_args, says):
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=2", f"output_dir={tmp_path / 'run'}", *extra], nproc=2,
                      cache=data_cache, accelerate_config="fsdp_cp.yaml", check=False, launch_args=launch_args)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr

