"""Which linear layers gain from float8: each layer shape of a YAML's model, forward and backward compiled, in bf16
against torchao's Float8Linear (tensorwise and rowwise), at the YAML's tokens per micro-batch. One table: the time
of each and the speed-up, beside whether toolkit.models.float8's rules convert the layer.

    python bench/fp8_layers.py                                    # the 1B YAML on a GPU of compute capability 8.9+
    LLM_TOOLKIT_FP8_EMULATE=1 python bench/fp8_layers.py --model recipes/configs/pretrain_tiny.yaml --tokens 256 \\
        --repeat 2     # CPU smoke: the same code path, emulated casts (no speed to read)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.config.load import load_config  # noqa: E402
from toolkit.models import float8  # noqa: E402
from toolkit.training.recipe_config import PretrainConfig  # noqa: E402


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """Each distinct linear layer of the YAML's model by its short name: (in_features, out_features)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        config = AutoConfig.for_model(cfg.model.model_type, **{**cfg.model.config, "vocab_size": cfg.tokenizer.vocab_size})
        model = AutoModelForCausalLM.from_config(config)
    found = {}
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear):
            found.setdefault(float8._shape_of(name), (layer.in_features, layer.out_features))
    return found, model


def timed(layer: torch.nn.Module, x: torch.Tensor, repeat: int, device: torch.device) -> float:
    """Seconds per forward + backward of `layer` compiled, after two warm-up calls."""
    step = torch.compile(lambda: layer(x).sum().backward())
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="recipes/configs/pretrain_llama_1b.yaml")
    p.add_argument("--tokens", type=int, default=None, help="rows of the input (default: micro-batch x seq_len)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = load_config(PretrainConfig, args.model, [])
    tokens = args.tokens or cfg.train.micro_batch_size * cfg.data.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    found, meta = shapes(cfg)
    rules = {float8._shape_of(n): why for n, why in float8.plan(meta, "tensorwise", sizes=True).left.items()}
    rules_row = {float8._shape_of(n): why for n, why in float8.plan(meta, "rowwise", sizes=True).left.items()}
    lines = [f"`python bench/fp8_layers.py {' '.join(sys.argv[1:])}`", "",
             f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (emulated: no speed to read)'}; torch "
             f"{torch.__version__}; {tokens} tokens a micro-batch; forward + backward, compiled, ms", "",
             "| layer | in x out | bf16 | fp8 tensorwise | speed-up | converted | fp8 rowwise | speed-up | converted |",
             "|---|---|---:|---:|---:|---|---:|---:|---|"]
    for name, (k, n) in found.items():
        if rules.get(name) == "output head":  # never converted (toolkit.models.float8.RULES), and the largest compile
            continue
        torch.manual_seed(0)
        base = torch.nn.Linear(k, n, bias=False, device=device)
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        times = []
        for recipe in (None, "tensorwise", "rowwise"):
            layer = copy.deepcopy(base)
            if recipe is None:
                layer = layer.to(torch.bfloat16)
            else:
                config = Float8LinearConfig.from_recipe_name(recipe)
                if float8.emulated():
                    config = dataclasses.replace(config, emulate=True)
                holder = torch.nn.Sequential(layer.to(torch.bfloat16))
                convert_to_float8_training(holder, config=config)
                layer = holder[0]
            times.append(timed(layer, x, args.repeat, device) * 1e3)
            torch._dynamo.reset()
        lines.append(f"| {name} | {k} x {n} | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f}x | "
                     f"{'no: ' + rules[name] if name in rules else 'yes'} | {times[2]:.2f} | {times[0] / times[2]:.2f}x | "
                     f"{'no: ' + rules_row[name] if name in rules_row else 'yes'} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
