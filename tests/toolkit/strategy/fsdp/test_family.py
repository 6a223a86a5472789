"""FSDP2 (toolkit.strategy.fsdp.family): a config naming a layer class the model lacks is one line before prepare."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from toolkit.config.errors import UserError
from toolkit.strategy.fsdp.family import FAMILY as fsdp


def test_a_layer_class_the_model_lacks_is_refused_and_the_model_may_be_built_on_demand(tiny_model):
    def launch(names):
        plugin = SimpleNamespace(transformer_cls_names_to_wrap=names)
        return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))

    with pytest.raises(UserError, match=r"^the FSDP config wraps GPT2Block, which this LlamaForCausalLM does not have; "
                                        r"its decoder layer class is LlamaDecoderLayer"):
        fsdp.check_layers(launch(["GPT2Block"]), lambda: tiny_model("llama"))
    fsdp.check_layers(launch(["LlamaDecoderLayer"]), tiny_model("llama"))
    fsdp.check_layers(launch(None), tiny_model("llama"))  # none named: Accelerate finds them
