"""The architecture, checked: imports point down the layers, and strategy facts live in one package.

    config               the validated config: loading, strict files, keys, values, paths as users write them,
                         and which settings train under which layouts (combinations, one table)
    run                  the run folder, its lock, what writes where (and a full disk), checksums, fault points
    parallel_layout      the strategy kind and parallel degrees of a run, as a checkpoint records them
    data                 corpus, tokenizer, packing, chat, batch schedule
    models               build from scratch, load a base, adapters, loss, gradient checkpointing
    launch               the launcher, what a rank knows from it, one error line and exit code per launch
    strategy             the Strategy object and every DDP/FSDP/DeepSpeed quirk
    planner              the per-GPU memory estimate behind recipes/plan.py
    checkpoint           save, resume, each strategy's files, the state by parameter name
    export               HF folder, consolidate, GGUF, quantize, report
    training             the trainer loop, step, optimizer, checkpoints, metrics, evaluation, samples

The tests read the source (ast), so they fail on the commit that breaks a rule, not on the run
that later trips over it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [{"config", "run", "parallel_layout"}, {"data"}, {"models"}, {"launch"}, {"strategy"},
          {"planner"}, {"checkpoint"}, {"export"}, {"training"}]
# the packages that may read the launcher's variables and import deepspeed (the planner reads an accelerate config)
KNOW_THE_LAUNCH = ("launch", "strategy", "planner", "checkpoint")


def layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def toolkit_imports(path: Path, modules: bool = False) -> set[str]:
    """The toolkit modules `path` imports, at the top or inside functions; with `modules`, `from toolkit.x import y`
    counts as an import of toolkit.x.y where y is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit."):
            found.add(node.module)
            if modules:
                found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("toolkit.")}
    return found


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if len(parts) > 1 and parts[-1] != "__init__":
            out[".".join(parts)] = path
    return out


def test_the_toolkit_root_holds_packages_and_at_most_four_modules():
    """A module at the root has no package to say what it belongs to: the run's go to toolkit/run/, the config's to
    toolkit/config/."""
    loose = sorted(p.name for p in (ROOT / "toolkit").glob("*.py"))
    assert len(loose) <= 4, loose


def test_the_tests_hold_tests_and_their_helpers_live_in_support():
    """Every Python file under tests/ is a test file, a conftest or a package marker, except in tests/support/
    (the helpers and the probes that run on ranks) and tests/fixtures/ (what an earlier commit saved)."""
    tests = ROOT / "tests"
    strays = [str(p.relative_to(ROOT)) for p in sorted(tests.rglob("*.py"))
              if not p.is_relative_to(tests / "support") and not p.is_relative_to(tests / "fixtures")
              and not p.name.startswith("test_") and p.name not in ("conftest.py", "__init__.py")]
    assert not strays, strays


def test_the_loop_reads_in_one_screen_and_asks_no_recipe_its_name():
    """Each function of the trainer holds one part of the loop (at most 60 lines: nanoGPT's whole loop is 80), and
    what a recipe does differently is declared by its config, not found by a branch on its name."""
    path = ROOT / "toolkit" / "training" / "trainer.py"
    tree = ast.parse(path.read_text())
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 60}
    assert not long, long
    named = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
             and any(isinstance(side, ast.Attribute) and side.attr == "name" for side in (n.left, *n.comparators))]
    assert not named, named


def test_every_module_sits_in_a_layer():
    for name in modules():
        layer(name)  # StopIteration names a module outside LAYERS


def test_imports_only_point_down_the_layers():
    upward = []
    for name, path in modules().items():
        for target in toolkit_imports(path):
            if layer(target) > layer(name):
                upward.append(f"{name} imports {target}")
    assert not upward, upward


def test_only_the_packages_of_the_launch_know_the_launcher_and_deepspeed():
    """Nothing outside KNOW_THE_LAUNCH reads WORLD_SIZE/RANK, imports deepspeed or branches on the distributed
    type: the rest asks the Strategy object."""
    banned = ("WORLD_SIZE", '"RANK"', "LOCAL_RANK", "import deepspeed", "from deepspeed", "DistributedType",
              "distributed_type")
    offenders = []
    for path in [*sorted((ROOT / "toolkit").rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]:
        if any(path.is_relative_to(ROOT / "toolkit" / package) for package in KNOW_THE_LAUNCH):
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {word}" for word in banned if word in text]
    assert not offenders, offenders


def test_no_import_circle_anywhere_in_the_toolkit():
    """Inside a package too, and counting imports inside functions: a circle hidden by a lazy import is
    still one (a module that cannot be understood, or moved, without the others)."""
    graph = {name: {t for t in toolkit_imports(path, modules=True) if t in modules() and t != name}
             for name, path in modules().items()}
    circles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circles.append(" -> ".join(path[path.index(name):] + [name]))
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, path + [name])
        done.add(name)

    for name in graph:
        visit(name, [])
    assert not circles, circles


def test_no_module_is_over_600_lines():
    """A module holds one job; past 600 lines it holds several (STYLE.md: ~400 at most)."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 600}
    assert not long, long


def test_every_module_is_named_in_the_architecture_doc():
    """docs/architecture.md's map of the layers names every toolkit module under its package's entry."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    entries, current = {}, None
    for line in block.splitlines():
        if line.startswith("toolkit/"):
            current = line.split()[0]
            entries[current] = line[len(current):]
        elif current and line.startswith(" " * 10):
            entries[current] += " " + line
        else:
            current = None
    missing = []
    for name, path in modules().items():
        parts = path.relative_to(ROOT / "toolkit").parts
        entry = f"toolkit/{parts[0]}" if len(parts) == 1 else f"toolkit/{parts[0]}/"
        if entry not in entries or (len(parts) > 1 and not re.search(rf"\b{path.stem}\b", entries[entry])):
            missing.append(name)
    assert not missing, missing


# one parametrized spec per behaviour over the families: a module it names needs no test file of its own
SPECS = (ROOT / "tests" / "toolkit" / "strategy" / "test_families.py",)


def test_tests_mirror_the_toolkit_layout():
    """Each toolkit module has its test file at the mirrored path (tests/toolkit/<package>/test_<module>.py), or a
    parametrized spec over the families (SPECS) that names it."""
    specs = " ".join(path.read_text() for path in SPECS)
    missing = []
    for name, path in modules().items():
        rel = path.relative_to(ROOT / "toolkit")
        test = ROOT / "tests" / "toolkit" / rel.parent / f"test_{rel.name}"
        if not test.is_file() and name not in specs:
            missing.append(str(test.relative_to(ROOT)))
    assert not missing, missing


# Where the toolkit and the recipes still read a strategy's family outside the family's own modules and the two rule
# tables: every condition (an if, a comparison, a comprehension's filter) that reads the layout's kind, files or
# pipeline stages, a ZeRO stage, Accelerate's DistributedType, a checkpoint format, a pipeline's presence or a
# family's tensors by duck typing (ds_id, ds_tensor, to_local), one per line. Each file's count and why it is there;
# a new condition fails test_family_conditions_are_counted until a family's module takes it or it is counted here.
# At most 12 (issue 62); FAMILY_BUDGET only goes down.
FAMILY_CONDITIONS = {
    "toolkit/models/weight_cast.py": (1, "auto leaves a whole model compiled under multi-rank DDP to autocast"),
    "toolkit/planner/estimate.py": (1, "a pipeline stage's own memory: the row names its stage"),
    "toolkit/planner/facts.py": (2, "a pipeline's stages divide the world; its last stage computes the full loss"),
    "toolkit/planner/search.py": (2, "the pipeline rows and their lines"),
    "toolkit/strategy/distributed.py": (1, "generation needs whole weights: a ZeRO-3 partition or FSDP2 shard refused"),
    "toolkit/training/evaluation.py": (1, "the held-out loss through a pipeline's schedule or the whole model"),
    "toolkit/training/trainer.py": (1, "a pipeline's own step"),
}
FAMILY_BUDGET = 9
# each family's folder (its runtime, files, launch and memory), and the two rule tables
FAMILY_MODULES = (*(f"toolkit/strategy/{family}/" for family in ("single", "ddp", "fsdp", "deepspeed", "pipeline")),
                  "toolkit/config/combinations.py", "toolkit/parallel_layout.py")
FAMILY_ATTRIBUTES = {"zero_stage", "pp", "pipeline", "pipeline_stages", "distributed_type", "ds_id", "ds_owned",
                     "deepspeed_engine_wrapped", "ds_tensor", "ds_numel"}
FAMILY_NAMES = {"DistributedType", "pipeline", "pipeline_stages", "zero_stage"}
NAMING = {"kind", "files", "format", "name", "family"}  # what a family's name is compared with
FAMILIES = {"single", "ddp", "fsdp", "fsdp2", "deepspeed", "pipeline", "DEEPSPEED", "FSDP", "MULTI_GPU", "MULTI_CPU"}
DUCKS = {"ds_id", "to_local", "ds_tensor", "ds_numel"}


def reads_the_family(node: ast.AST) -> bool:
    def strings(n):
        return {s.value for s in ast.walk(n) if isinstance(s, ast.Constant) and isinstance(s.value, str)}

    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in FAMILY_ATTRIBUTES or isinstance(n, ast.Name) and n.id in FAMILY_NAMES:
            return True
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("hasattr", "getattr") and strings(n) & DUCKS:
            return True
        if isinstance(n, ast.Compare) and strings(n) & FAMILIES and any(
                getattr(side, "attr", getattr(side, "id", None)) in NAMING for side in (n.left, *n.comparators)):
            return True
    return False


def family_conditions(path: Path) -> dict[int, str]:
    """The lines of `path` that hold a condition reading the family, with the condition."""
    tree, found = ast.parse(path.read_text()), {}
    for n in ast.walk(tree):
        tests = ([n.test] if isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)) else n.ifs
                 if isinstance(n, ast.comprehension) else [n] if isinstance(n, (ast.Compare, ast.BoolOp)) else [])
        for test in tests:
            if test.lineno not in found and reads_the_family(test):
                found[test.lineno] = ast.unparse(test)
    return found


def test_family_conditions_are_counted():
    found = {}
    for path in [*sorted((ROOT / "toolkit").rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]:
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(FAMILY_MODULES) and (lines := family_conditions(path)):
            found[rel] = len(lines)
    assert found == {path: count for path, (count, _) in FAMILY_CONDITIONS.items()}
    assert sum(found.values()) <= FAMILY_BUDGET


def test_the_family_ruler_sees_every_spelling():
    """The conditions the ruler must see, one of each kind, and two it must not (a data format, an export's kind)."""
    seen = ["layout.kind == 'deepspeed'", "saved.files != 'fsdp2'", "layout.zero_stage == 3", "layout.pp > 1",
            "self.strategy.pipeline is not None", "pipeline is None", "acc.distributed_type == DistributedType.FSDP",
            "hasattr(p, 'ds_id')", "getattr(t, 'ds_tensor', None) is not None", "backend.format == 'deepspeed'",
            "kind in ('ddp', 'fsdp')", "[p for p in params if hasattr(p, 'to_local')]"]
    unseen = ["data.format == 'chat'", "source.kind == 'adapter'"]
    assert all(reads_the_family(ast.parse(text, mode="eval").body) for text in seen)
    assert not any(reads_the_family(ast.parse(text, mode="eval").body) for text in unseen)
