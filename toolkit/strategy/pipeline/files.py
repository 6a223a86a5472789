"""A pipeline of stages (train.pipeline_stages): Accelerate saves nothing of its stages, so each stage's
first replica writes its weights by their whole-model names and its optimizer's state with the names of its
parameters. Read back whole (every stage's weights in one file) and by parameter name, and loaded into a
pipeline's stage, of the same cut as it is or of any other strategy by name."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.by_name import MOMENTS, ConsolidatedState, check_moments, load_whole, step_value
from toolkit.strategy.family import Part, Strategy
from toolkit.strategy.unpickling import load

STAGE = "pipeline_stage_{}.safetensors"  # a pipeline stage's weights, by their whole-model names
OPTIMIZER = "pipeline_stage_{}_optimizer.pt"  # its optimizer state and the names of its parameters


# what its save writes (the parts every family's checkpoint holds: toolkit.checkpoint.contents)
PARTS = (
    Part("stage weights", ("pipeline_stage_*.safetensors",), "save_stage: each stage's weights by whole-model name",
         "load_stage (the same cut); full_weights", weights=True),
    Part("stage optimizers", ("pipeline_stage_*_optimizer.pt",), "save_stage: each stage's optimizer state",
         "load_stage; moments"),
)

def stage_files(folder: Path) -> list[Path]:
    """A pipeline checkpoint's stage weight files, stage 0 first."""
    files, stage = [], 0
    while (folder / STAGE.format(stage)).is_file():
        files.append(folder / STAGE.format(stage))
        stage += 1
    return files


def is_mine(folder: Path) -> bool:
    return (folder / STAGE.format(0)).is_file()


def layout_from(folder: Path, world: int) -> ParallelLayout:
    return ParallelLayout("ddp", world, pp=len(stage_files(folder)))


def full_weights(folder: Path, into: Path) -> None:
    """Each stage's weights under their whole-model names: one file of them all."""
    from safetensors.torch import load_file, save_file

    whole = {}
    for f in stage_files(folder):
        whole.update(load_file(str(f)))
    save_file({k: v.float().contiguous() for k, v in whole.items()}, into / "model.safetensors", metadata={"format": "pt"})


def moments(folder: Path, scratch: Path) -> tuple[dict, dict]:
    """Each stage's optimizer state, by the whole-model names saved beside it."""
    moments, steps = {}, {}
    for stage in range(len(stage_files(folder))):
        saved = load(folder / OPTIMIZER.format(stage))
        optimizer = saved["optimizer"]
        for group, names in zip(optimizer["param_groups"], saved["parameter_names"], strict=True):
            for index, name in zip(group["params"], names, strict=True):
                state = optimizer["state"].get(index)
                if state:
                    moments[name] = {key: state[key] for key in MOMENTS}
                    steps[name] = step_value(state["step"])
    return moments, steps


def save_stage(pipeline, folder: Path, optimizer: torch.optim.Optimizer) -> None:
    """A pipeline stage's weights (by their whole-model names) and its optimizer's state, written by
    the first replica's rank of each stage; the other replicas hold the same."""
    if pipeline.replica != 0:
        return
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    weights, state = folder / STAGE.format(pipeline.index), folder / OPTIMIZER.format(pipeline.index)
    folder.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in pipeline.named_parameters()}
    # the optimizer numbers its parameters: their names beside it, to move the state elsewhere
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    try:
        save_file({n: p.detach().contiguous().cpu() for n, p in pipeline.named_parameters()}, str(weights))
    except SafetensorError as exc:  # a full disk, as the checkpoint's other writes report it
        raise OSError(f"{weights}: {exc}") from exc
    torch.save({"optimizer": optimizer.state_dict(), "parameter_names": groups}, state)


def save_beside(strategy: Strategy, folder: Path) -> None:
    """What the checkpoint manager writes beside Accelerate's files: this rank's stage, which Accelerate does not hold."""
    save_stage(strategy.pipeline, folder, strategy.pipeline.optimizer)


def load_beside(strategy: Strategy, folder: Path) -> None:
    """save_beside's files, read back after Accelerate's, in a resume of the same pipeline."""
    load_stage(strategy.pipeline, folder, strategy.pipeline.optimizer)


def load_stage(pipeline, folder: Path, optimizer: torch.optim.Optimizer) -> None:
    """This rank's stage's weights and optimizer state from a checkpoint of the same pipeline."""
    from safetensors.torch import load_file

    weights, state = folder / STAGE.format(pipeline.index), folder / OPTIMIZER.format(pipeline.index)
    if not weights.exists() or not state.exists():
        raise UserError(f"checkpoint {folder} has no {weights.name}: it was not written by a pipeline of "
                        f"{pipeline.stages} stages; resume it with the train.pipeline_stages it was trained with")
    saved = load_file(str(weights))
    mine = dict(pipeline.named_parameters())
    if sorted(saved) != sorted(mine):
        raise UserError(f"checkpoint {folder}: {weights.name} holds other weights than this stage "
                        "(another model or another cut); resume with the config it was trained with")
    with torch.no_grad():
        for name, p in mine.items():
            p.copy_(saved[name])
    optimizer.load_state_dict(load(state, map_location=p.device)["optimizer"])


def load_into(strategy: Strategy, state: ConsolidatedState) -> None:
    """A pipeline stage (toolkit.strategy.pipeline.stages): its weights and their Adam state, found
    by their names in the whole model (a tied head's copy by the embedding's name where the saving
    strategy kept only that one)."""
    pipeline = strategy.pipeline
    optimizer = pipeline.optimizer
    names = {id(p): pipeline.aliases.get(n, [n]) for n, p in pipeline.named_parameters()}
    check_moments(state, pipeline.module, names)
    load_whole(list(pipeline.parameters()), names, optimizer, state)
