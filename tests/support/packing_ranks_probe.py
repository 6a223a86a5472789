"""Run on 2 ranks with torchrun's variables (gloo, tests/support/probe_ranks.py) by test_packing.py: every rank prepares its share of a
corpus through `packed_dataset`, which finds the ranks in the process group. argv: the tokenizer
folder, the corpus as a JSON list of texts, the cache folder, seq_len. Each rank checks that it
reads the same blocks, and that both count themselves as one node's ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import torch.distributed as dist
from transformers import AutoTokenizer

from toolkit.data.packing import Ranks, column, packed_dataset

tokenizer_dir, corpus, cache, seq_len = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
ranks = Ranks.of_process_group()
assert (ranks.rank, ranks.world, ranks.local_world) == (dist.get_rank(), 2, 2), ranks
docs = datasets.Dataset.from_dict({"text": json.loads(Path(corpus).read_text())})
blocks = packed_dataset(docs, AutoTokenizer.from_pretrained(tokenizer_dir), seq_len, cache, "probe")
ids = column(blocks, "input_ids")
every = [None] * dist.get_world_size()
dist.all_gather_object(every, ids)
assert all(np.array_equal(x, ids) for x in every), "the ranks read different blocks"
dist.destroy_process_group()
