"""One process (toolkit.strategy.single.family): what the Strategy asks of it, on a real one-process launch."""

from __future__ import annotations

import torch


def test_one_process_prepares_saves_the_fp32_weights_and_names_the_optimizers_parameters(single):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    decay, no_decay = [model[0].weight], [model[0].bias, *model[1].parameters()]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay}])
    model, optimizer = single.prepare(model, optimizer)
    assert single.family.name == "single" and single.family.optimizer_names(single) == [
        ["0.weight"], ["0.bias", "1.weight", "1.bias"]]
    weights = single.master_weights(model)
    assert weights.keys() == model.state_dict().keys() and all(v.dtype == torch.float32 for v in weights.values())
    assert single.model_to_save(model, weights) is single.accelerator.unwrap_model(model)
    assert len(single.check_replicas_in_sync(model)) == 1
    assert single.backward_scale(10) == single.accumulation / 10  # Accelerate's division by the accumulation undone
