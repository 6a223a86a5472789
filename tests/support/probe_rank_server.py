"""The server of tests/support/probe_ranks.py: imports torch, transformers, Accelerate and DeepSpeed once,
then forks the ranks of each probe it is asked for. One request per line on stdin (JSON: script,
args, each rank's whole environment, each rank's log or its stdout and stderr files); it answers
with the ranks' pids, then, once all have exited, with their exit codes and CPU time (the first
rank to fail ends the others, as torchrun's agent does). It ends when its stdin closes: its pytest worker is gone."""

import json
import os
import runpy
import signal
import sys
import traceback

# the repository, not tests/support/ (where tests/toolkit would stand for the toolkit); a probe's folder comes first in its rank
sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: each rank computes on one thread
answers = os.fdopen(os.dup(1), "w")
nowhere = os.open(os.devnull, os.O_WRONLY)  # the imports' notices (DeepSpeed's accelerator, torchao)
os.dup2(nowhere, 1)
os.dup2(nowhere, 2)

# Everything a recipe's rank imports, once here instead of in every forked rank: torch, transformers, Accelerate,
# DeepSpeed and the toolkit; the recipes' own imports; peft (transformers' schedules import it); and what DeepSpeed
# imports as it builds its engine (its optimizer check imports its Muon optimizer, which calls torch.compile at
# import: torch._dynamo and inductor, ~1.6 CPU-s a rank). A forked ZeRO-3 run of 6 tiny steps on 2 ranks cost
# 11.2 CPU-s with the engine's imports left to each rank, 7.0 without (measured alone).
import pydoc_data.topics  # noqa: E402, F401

import accelerate  # noqa: E402, F401
import deepspeed  # noqa: E402, F401
import deepspeed.ops.op_builder  # noqa: E402, F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402, F401
import deepspeed.runtime.zero.stage3  # noqa: E402, F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402, F401
import matplotlib.pyplot  # noqa: E402, F401  (rank 0's loss plot at a run's end: ~0.5 CPU-s a run)
import peft  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import transformers.optimization  # noqa: E402, F401
from transformers import AutoModelForCausalLM  # noqa: E402, F401
from transformers.models.llama import modeling_llama  # noqa: E402, F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402, F401
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402, F401

import toolkit.strategy.distributed  # noqa: E402, F401
import toolkit.strategy.sharding  # noqa: E402, F401

for recipe in ("pretrain", "finetune", "export"):  # their module-level imports; `__main__` runs nothing here
    runpy.run_path(os.path.join(sys.path[0], "recipes", f"{recipe}.py"), run_name=f"recipe_{recipe}")


def rank(script: str, args: list[str], env: dict[str, str], log: str | list[str]) -> None:
    """In the forked child: output to the log, the launcher's variables, the probe as __main__; never returns."""
    code = 1
    try:
        answers.close()
        sys.stdin.close()
        out, err = log if isinstance(log, list) else (log, log)  # stdout and stderr apart, or one log
        # both appending: one log's two descriptors would otherwise each write at an offset of its own, over the other's
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
        os.environ.clear()  # the caller's whole environment, as a subprocess would get it
        os.environ.update(env)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # what the interpreter does with sys.exit(x)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    pids = []
    for env, log in zip(request["envs"], request["logs"], strict=True):
        pid = os.fork()
        if pid == 0:
            rank(request["script"], request["args"], env, log)
        pids.append(pid)
    answers.write(json.dumps({"pids": pids}) + "\n")
    answers.flush()
    codes, first, cpu_s = {}, 0, 0.0
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, 0)
        codes[pid] = os.waitstatus_to_exitcode(status)
        cpu_s += usage.ru_utime + usage.ru_stime
        if codes[pid] != 0 and first == 0:
            first = codes[pid]
            for other in set(pids) - set(codes):
                os.kill(other, signal.SIGKILL)
    answers.write(json.dumps({"codes": [codes[pid] for pid in pids], "first": first, "cpu_s": cpu_s}) + "\n")
    answers.flush()
