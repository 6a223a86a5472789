"""Every option of `accelerate launch` that recipes/launch.sh and llm-toolkit pass on: honoured (how) or refused (its
line), never dropped. Accelerate drops an option its launcher of the moment does not read, and the run trains as if
it had not been given: `--num_processes 2` without an accelerate config trained on one process, exit 0 (its
one-process launcher takes over unless a strategy is asked for). OPTIONS classifies each option of Accelerate's own
launch parser (tests/toolkit/launch/test_options.py walks that parser: an option Accelerate adds fails the test until
it is classified here); `honour` makes the launch do what the options say, `refusal` names the first that cannot
take effect in this launch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """How an option takes effect; what the launch must have for it to (`needs`, among the features `honour`
    returns: the strategy Accelerate launches, "torchrun", "one process" or "several processes", "several machines",
    "gpus", "parallelism_config", "fsdp2 on the command line"); the rest of the line that refuses it elsewhere,
    after the option's name. An option with no `how` is refused everywhere."""

    how: str
    needs: frozenset[str] = frozenset()
    refused: str = ""


def refused(line: str) -> Option:
    return Option("", refused=line)


def needs(*features: str) -> frozenset[str]:
    return frozenset(features)


ONE_PROCESS = ("is torchrun's, and this launch is one process (Accelerate's one-process launcher has no torchrun): "
               "leave it out, or launch several with --num_processes N")
NO_GPU = "chooses among GPUs, and this machine has none: leave it out (the ranks train on the CPU)"
DEEPSPEED = ("is DeepSpeed's, and this launch is not DeepSpeed's: add --use_deepspeed, or give a DeepSpeed "
             "accelerate config (e.g. --config_file accelerate_configs/zero3.yaml)")
DEEPSPEED_MACHINES = ("is DeepSpeed's multi-machine launcher's, and this launch is not DeepSpeed's over several "
                      "machines: leave it out, or give --num_machines N with a DeepSpeed accelerate config")
FSDP = ("is FSDP's, and this launch is not FSDP's: add --use_fsdp, or give an FSDP accelerate config "
        "(e.g. --config_file accelerate_configs/fsdp.yaml), or set it in that config's fsdp_config")
SIZES = ("is a parallelism_config size, and this launch has no parallelism_config: give an "
         "accelerate config with one (accelerate_configs/fsdp_tp.yaml, fsdp_cp, fsdp_sp, zero3_sp) and set the size there")
MEGATRON = ("is Megatron-LM's, which the toolkit does not launch: its tensor, sequence, context and pipeline "
            "parallel are accelerate_configs/fsdp_tp.yaml, fsdp_sp.yaml, fsdp_cp.yaml and train.pipeline_stages")
TPU = "is for TPUs, which the toolkit does not train on (CUDA GPUs or CPUs): leave it out"
FP8 = ("configures Accelerate's fp8, which the toolkit does not use: fp8 is train.mixed_precision=fp8 (torchao's "
       "float8 layers); leave it out")
DYNAMO = ("asks Accelerate to compile the model, which the toolkit does itself as model.compile says (layers, or "
          "the whole model with its loss): leave it out and set model.compile=layers or model.compile=model")
SAGEMAKER = "is for Amazon SageMaker launches, which the toolkit does not make: leave it out"
TOOLKIT_ATTENTION = ("configures Accelerate's own context or sequence parallel, which the toolkit replaces with its "
                     "own (toolkit.strategy.context_parallel, sequence_parallel: packed documents kept apart); only "
                     "the parallelism_config sizes are read: leave it out")
TORCHRUN = "torchrun's, passed on by Accelerate's multi-process launchers"

OPTIONS: dict[str, Option] = {
    # what runs
    "config_file": Option("read first by the launcher (toolkit.launch.launcher: missing, unreadable, too many "
                          "ranks), then by Accelerate: its strategy, counts and precision"),
    "quiet": Option("Accelerate's: its launchers' own start-up lines left out"),
    "module": Option("Accelerate's: the script run as python -m"),
    "no_python": Option("Accelerate's: the script run as a command, without python"),
    "debug": Option("Accelerate's ACCELERATE_DEBUG_MODE: each collective's shapes checked across ranks first"),
    # where and how many
    "cpu": Option("ACCELERATE_USE_CPU: the one process trains on the CPU (toolkit.launch.environment)",
                  needs("one process"),
                  "makes Accelerate launch one process, and this launch asks for several: leave --cpu out (without a "
                  "GPU the ranks train on the CPU; with GPUs, hide them with CUDA_VISIBLE_DEVICES=)"),
    "multi_gpu": Option("torchrun starts the ranks (gloo without a GPU)", needs("several processes"),
                        "needs 2 or more processes: give --num_processes N"),
    "tpu": refused(TPU),
    "mixed_precision": Option("ACCELERATE_MIXED_PRECISION, taken or refused on each rank against train.mixed_precision "
                              "(toolkit.strategy.accelerator.resolve_mixed_precision)"),
    "num_processes": Option("the ranks torchrun or DeepSpeed starts; above 1 without a strategy, the launcher adds "
                            "--multi_gpu (Accelerate's one-process launcher would start one: honour)"),
    "num_machines": Option(f"{TORCHRUN} (--nnodes); its count of ranks a machine checked first (ranks_per_machine)",
                           needs("torchrun"), ONE_PROCESS),
    "num_cpu_threads_per_process": Option("OMP_NUM_THREADS on each rank (on DeepSpeed's too: the launcher sets it)"),
    "enable_cpu_affinity": Option("Accelerate pins each rank to its GPU's NUMA node", needs("gpus"), NO_GPU),
    "dynamo_backend": refused(DYNAMO),
    "dynamo_mode": refused(DYNAMO),
    "dynamo_use_fullgraph": refused(DYNAMO),
    "dynamo_use_dynamic": refused(DYNAMO),
    "dynamo_use_regional_compilation": refused(DYNAMO),
    # the strategy
    "use_deepspeed": Option("ACCELERATE_USE_DEEPSPEED: DeepSpeed's family (toolkit.strategy.deepspeed)"),
    "use_fsdp": Option("ACCELERATE_USE_FSDP: FSDP's family (toolkit.strategy.fsdp)"),
    "use_parallelism_config": Option(
        "the parallelism_config sizes read by each rank (toolkit.strategy.parallelism.launched_sizes)",
        needs("fsdp2 on the command line"),
        "is taken by Accelerate only beside --use_fsdp --fsdp_version 2: give the sizes in an accelerate config's "
        "parallelism_config instead (accelerate_configs/fsdp_tp.yaml, fsdp_cp, fsdp_sp, zero3_sp)"),
    "use_megatron_lm": refused(MEGATRON),
    # torchrun's
    "gpu_ids": Option("CUDA_VISIBLE_DEVICES on each rank", needs("gpus"), NO_GPU),
    **{name: Option(TORCHRUN, needs("torchrun"), ONE_PROCESS) for name in (
        "same_network", "machine_rank", "main_process_ip", "main_process_port", "tee", "log_dir", "role",
        "rdzv_backend", "rdzv_conf", "max_restarts", "monitor_interval")},
    # TPU
    **{name: refused(TPU) for name in (
        "tpu_use_cluster", "tpu_use_sudo", "vm", "env", "main_training_function", "downcast_bf16")},
    # DeepSpeed's: its plugin built from them; a value the recipe contradicts refused on the rank (configure_deepspeed),
    # one a DeepSpeed JSON decides refused there too (ignored_beside_deepspeed_json)
    **{name: Option("ACCELERATE_DEEPSPEED_* on each rank: Accelerate's DeepSpeed plugin",
                    needs("deepspeed"), DEEPSPEED) for name in (
        "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
        "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
        "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_moe_layer_cls_names")},
    **{name: Option("DeepSpeed's multi-machine launcher",
                    needs("deepspeed", "several machines"), DEEPSPEED_MACHINES)
       for name in ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                    "deepspeed_multinode_launcher")},
    # FSDP's: FSDP_* on each rank, Accelerate's FSDP plugin (a layer class the model lacks refused: check_layers)
    **{name: Option("FSDP_* on each rank: Accelerate's FSDP plugin", needs("fsdp"), FSDP)
       for name in (
        "fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_forward_prefetch", "fsdp_use_orig_params",
        "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_activation_checkpointing",
        "fsdp_activation_checkpointing_offload")},
    **{name: refused(MEGATRON) for name in (
        "megatron_lm_tp_degree", "megatron_lm_use_custom_fsdp", "megatron_lm_no_load_optim",
        "megatron_lm_eod_mask_loss", "megatron_lm_overlap_cpu_optimizer_d2h_h2d", "megatron_lm_no_save_optim",
        "megatron_lm_optimizer_cpu_offload", "megatron_lm_use_precision_aware_optimizer",
        "megatron_lm_decoder_last_pipeline_num_layers", "megatron_lm_pp_degree", "megatron_lm_num_micro_batches",
        "megatron_lm_sequence_parallelism", "megatron_lm_recompute_activations",
        "megatron_lm_use_distributed_optimizer", "megatron_lm_gradient_clipping", "megatron_lm_recompute_granularity",
        "megatron_lm_recompute_method", "megatron_lm_recompute_num_layers", "megatron_lm_attention_backend",
        "megatron_lm_expert_model_parallel_size", "megatron_lm_context_parallel_size", "megatron_lm_attention_dropout",
        "megatron_lm_hidden_dropout", "megatron_lm_attention_softmax_in_fp32",
        "megatron_lm_expert_tensor_parallel_size", "megatron_lm_calculate_per_token_loss",
        "megatron_lm_use_rotary_position_embeddings")},
    **{name: refused(FP8) for name in (
        "fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
        "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_override_linear_precision", "fp8_opt_level",
        "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim")},
    "aws_access_key_id": refused(SAGEMAKER),
    "aws_secret_access_key": refused(SAGEMAKER),
    "mpirun_hostfile": refused("starts the ranks with mpirun, whose ranks the toolkit does not read (torchrun's "
                               "RANK and WORLD_SIZE): launch each machine with --num_machines N --machine_rank R "
                               "--main_process_ip IP"),
    **{f"parallelism_config_{axis}_size": Option(
        "PARALLELISM_CONFIG_*_SIZE on each rank (toolkit.strategy.parallelism.launched_sizes)",
        needs("parallelism_config"), SIZES)
       for axis in ("dp_replicate", "dp_shard", "tp", "cp", "sp")},
    **{name: refused(TOOLKIT_ATTENTION) for name in (
        "parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy", "parallelism_config_sp_backend",
        "parallelism_config_sp_seq_length", "parallelism_config_sp_seq_length_is_variable",
        "parallelism_config_sp_attn_implementation")},
}

# the options that each choose Accelerate's launcher; it refuses two of them in a traceback
STRATEGY_OPTIONS = ("multi_gpu", "cpu", "tpu", "use_deepspeed", "use_fsdp")
# an accelerate config's distributed_type -> the family it launches (the others: one process)
KINDS = {"MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}


def given(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """The options `argv` gives (their dests), each with the flag it was given by, in the order of the parser: a
    parse with every default suppressed holds only those."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    said = vars(parser.parse_args(argv))
    flags: dict[str, str] = {}
    for action in parser._actions:
        if action.option_strings and action.dest in said:
            flags.setdefault(action.dest, action.option_strings[0])
    return flags


def repeated(parser: argparse.ArgumentParser, argv: list[str], script: str | None) -> str | None:
    """The line for an option given twice before the recipe (`script`): argparse keeps the last in silence, and
    `--config_file ddp.yaml --config_file zero2.yaml` launched zero2's 8 processes without a word."""
    flags = {flag: action for action in parser._actions for flag in action.option_strings}
    end = argv.index(script) if script in argv else len(argv)
    seen: dict[str, list[str]] = {}
    for i, token in enumerate(argv[:end]):
        name, eq, value = token.partition("=")
        action = flags.get(name)
        if action is None or not name.startswith("--"):
            continue
        if not eq and action.nargs != 0 and i + 1 < end:
            value = argv[i + 1]
        said = seen.setdefault(action.dest, [])
        said.append(value)
        if len(said) == 2:
            values = f" ({', '.join(said)})" if any(said) else ""
            return f"{action.option_strings[0]} is given twice{values}; give it once"
    return None


def honour(args: argparse.Namespace, config: dict, gpus: int) -> frozenset[str]:
    """`args` made to launch what they ask for; the features of the launch they then make (Option.needs).

    Without an accelerate config Accelerate takes its one-process launcher unless a strategy is asked for, whatever
    --num_processes says: above 1 it is given --multi_gpu (torchrun's ranks, gloo without a GPU: a DDP launch, as
    accelerate_configs/ddp.yaml's). The values Accelerate would fill with its defaults under a box of "were not
    passed" lines are filled here with the same values (one process a GPU, one machine, the recipe's precision)."""
    strategy = ("deepspeed" if args.use_deepspeed else "fsdp" if args.use_fsdp else "ddp" if args.multi_gpu
                else None if args.cpu or args.tpu else KINDS.get(str(config.get("distributed_type"))))
    if not config:
        args.num_processes = args.num_processes or max(gpus, 1)
        args.num_machines = args.num_machines or 1
        args.mixed_precision = args.mixed_precision or "no"
        args.dynamo_backend = args.dynamo_backend or "no"
    processes = int(args.num_processes or config.get("num_processes") or 1)
    if strategy is None and processes > 1 and not (args.cpu or args.tpu):
        args.multi_gpu, strategy = True, "ddp"
    machines = int(args.num_machines or config.get("num_machines") or 1)
    features = {
        strategy or "one-process launcher", "torchrun" if strategy else "no torchrun",
        "several processes" if processes > 1 else "one process", "several machines" if machines > 1 else "one machine",
        "gpus" if gpus else "no gpu",
    }
    if config.get("parallelism_config") or args.use_parallelism_config:
        features.add("parallelism_config")
    if args.use_fsdp and str(args.fsdp_version) == "2":
        features.add("fsdp2 on the command line")
    return frozenset(features)


def refusal(said: dict[str, str], launch: frozenset[str]) -> str | None:
    """The line for the first given option (`said`: dest -> flag) that cannot take effect in a launch of these
    features (`honour`'s); None if each does."""
    strategies = [said[name] for name in STRATEGY_OPTIONS if name in said]
    if len(strategies) > 1:
        return f"{' and '.join(strategies)} each choose the launch's strategy: give one"
    for dest, flag in said.items():
        option = OPTIONS[dest]
        if not option.how or not option.needs <= launch:
            return f"{flag} {option.refused}"
    return None
