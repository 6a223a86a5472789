"""Recipe configs: YAML + key=value overrides into dataclasses, every problem reported in one error.

The dataclasses here are throwaway ones built with `toolkit.config.load.field`, so these tests pin the
loader's rules (unknown keys, coercion, collected problems) and not any recipe's fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from toolkit.config.errors import ConfigError
from toolkit.config.load import field, load_config, parse_overrides


@dataclass
class Train:
    lr: float = field(1e-3, help="learning rate")
    max_steps: int = field(100, help="optimizer steps")
    compile: bool = field(False, help="torch.compile the model")
    schedule: Literal["cosine", "linear", "constant"] = field("cosine", help="learning-rate schedule")
    warmup: int | None = field(None, help="warmup steps; default: 5% of max_steps")

    def validate(self) -> list[str]:
        problems = []
        if self.max_steps < 1:
            problems.append(f"max_steps={self.max_steps} must be at least 1")
        return problems


@dataclass
class Data:
    path: str | None = field(None, help="where the text is")
    seq_len: int = field(256, help="tokens per block")
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"], help="trackers")

    def validate(self) -> list[str]:
        return [f"seq_len={self.seq_len} is too short"] if self.seq_len < 8 else []


@dataclass
class Recipe:
    output_dir: str = field("runs/x", help="run folder")
    seed: int = field(0, help="random seed")
    train: Train = field(default_factory=Train, help="training")
    data: Data = field(default_factory=Data, help="data")


@dataclass
class NeedsName:
    name: str = field(help="required: no default")
    size: int = field(1, help="size")


def write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def problems_of(excinfo) -> list[str]:
    return excinfo.value.problems


# parse_overrides


def test_parse_overrides_builds_a_nested_tree_of_yaml_scalars():
    tree = parse_overrides(
        [
            "train.lr=3e-4",
            "train.max_steps=200",
            "output_dir=runs/y",
            "train.compile=true",
            "data.trackers=[tensorboard, wandb]",
            "data.path=",
        ]
    )
    assert tree == {
        "train": {"lr": "3e-4", "max_steps": 200, "compile": True},  # YAML 1.1 reads 3e-4 as a string
        "output_dir": "runs/y",
        "data": {"trackers": ["tensorboard", "wandb"], "path": None},
    }


def test_parse_overrides_keeps_everything_after_the_first_equals():
    assert parse_overrides(["data.path=a=b"]) == {"data": {"path": "a=b"}}


def test_parse_overrides_rejects_an_argument_without_equals():
    with pytest.raises(ConfigError, match=r"override 'train\.lr' is not key=value"):
        parse_overrides(["train.lr"])


def test_parse_overrides_rejects_an_empty_key_and_reads_a_bare_tilde_as_home():
    """`=3` was "unknown key ;", `train..lr=1` "unknown key train."; `output_dir=~` was YAML's null ("must be a string,
    found None"), and `data.path=~` the embedded corpus, silently. `key=` stays null."""
    for arg in ("=3", "train..lr=1", "train.=1"):
        with pytest.raises(ConfigError, match=rf"^override '{re.escape(arg)}' has an empty name before a dot or its '='"):
            parse_overrides([arg])
    assert parse_overrides(["output_dir=~", "data.path="]) == {"output_dir": "~", "data": {"path": None}}


def test_parse_overrides_rejects_a_key_under_a_scalar():
    with pytest.raises(ConfigError, match=r"sets a key under 'seed', which is not a section"):
        parse_overrides(["seed=1", "seed.x=2"])



# load_config: files


def test_no_file_and_no_overrides_gives_the_defaults():
    assert load_config(Recipe, None) == Recipe()


def test_an_empty_file_gives_the_defaults_and_says_so(tmp_path):
    """An empty config is every default (a fine-tune of the default base is a real run); the log says so."""
    for text in ("", "# nothing yet\n", "---\n"):
        notes: list[str] = []
        path = write(tmp_path, text)
        assert load_config(Recipe, path, notes=notes) == Recipe()
        assert notes == [f"{path} holds no settings: every key takes its default"]


def test_yaml_values_and_overrides_merge_with_overrides_winning(tmp_path):
    path = write(tmp_path, "seed: 3\ntrain:\n  lr: 0.01\n  max_steps: 50\ndata:\n  seq_len: 64\n")
    cfg = load_config(Recipe, path, ["train.max_steps=7", "data.path=corpus.txt"])
    assert cfg.seed == 3
    assert cfg.train.lr == 0.01 and cfg.train.max_steps == 7  # the sibling from the file is kept
    assert cfg.data.seq_len == 64 and cfg.data.path == "corpus.txt"
    assert isinstance(cfg.train, Train) and isinstance(cfg.data, Data)


def test_a_missing_config_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"--config {missing} does not exist"):
        load_config(Recipe, missing)
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, tmp_path / "pretrain_tiy.yaml")
    assert problems_of(excinfo) == [
        f"--config {tmp_path / 'pretrain_tiy.yaml'} does not exist; did you mean recipes/configs/pretrain_tiny.yaml?"
    ]


def test_an_empty_config_path_is_not_the_folder_the_command_runs_in(tmp_path, monkeypatch):
    """Path("") is ".": `--config ''` was "--config . is a folder"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, "")
    assert problems_of(excinfo) == [f"--config '' names no file; give a config file, e.g. "
                                    f"{Path(__file__).resolve().parents[3]}/recipes/configs/pretrain_tiny.yaml"]


def not_a_config(tmp_path, kind: str):
    """(the --config path, its one line) for a path that is not a config file."""
    path = tmp_path / "cfg.yaml"
    if kind == "a folder":
        (tmp_path / "configs").mkdir()
        (tmp_path / "configs" / "a.yaml").write_text("seed: 1\n")
        return tmp_path / "configs", f"--config {tmp_path / 'configs'} is a folder; give a config file, e.g. " \
            f"{tmp_path / 'configs' / 'a.yaml'} (it has 1)"
    if kind == "a list":
        path.write_text("- seed: 1\n- seed: 2\n")
        return path, f"{path} must hold a mapping of keys (key: value lines), found a list"
    if kind == "a scalar":
        path.write_text("42\n")
        return path, f"{path} must hold a mapping of keys (key: value lines), found a single number"
    if kind == "a binary file":
        path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
        return path, f"{path} is a binary file (it holds NUL bytes), not a config; give a YAML file"
    if kind == "latin-1 text":
        path.write_bytes("seed: 1\nname: caf\u00e9\n".encode("latin-1"))
        return path, f"{path} is not UTF-8 text (byte 0xe9 at line 2); re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
    if kind == "a device":
        return Path("/dev/zero"), "--config /dev/zero is not a regular file; give a YAML config file"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["a folder", "a list", "a scalar", "a binary file", "latin-1 text", "a device"])
def test_what_is_not_a_config_file_is_one_line(tmp_path, kind):
    """A folder used to be 'does not exist' (with recipes/configs/ before an absolute path), a binary or
    latin-1 file a UnicodeDecodeError traceback."""
    path, line = not_a_config(tmp_path, kind)
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, path)
    assert problems_of(excinfo) == [line]


@pytest.mark.parametrize("text, key, lines", [
    ("seed: 1234\ntrain:\n  lr: 0.1\nseed: 77\n", "seed", (1, 4)),
    ("train:\n  max_steps: 3\n  lr: 0.1\n  max_steps: 5\n", "train.max_steps", (2, 4)),
    ("data: {seq_len: 8, seq_len: 16}\n", "data.seq_len", (1, 1)),
    ("seed: 1\ntrain:\n  lr: 0.1\ntrain:\n  max_steps: 5\n", "train", (2, 4)),
], ids=["top-level key", "key in a section", "flow mapping", "section"])
def test_a_key_written_twice_is_refused_with_both_lines(tmp_path, text, key, lines):
    """PyYAML keeps the last of two equal keys with no word; YAML itself forbids them."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, path)
    assert problems_of(excinfo) == [f"{path} line {lines[1]}: {key} is written twice (lines {lines[0]} and "
                                    f"{lines[1]}); keep one"]


def test_yaml_that_nests_too_deep_or_aliases_exponentially(tmp_path):
    """5000 nested lists were a RecursionError traceback; a "billion laughs" file of aliases is read
    once per node (the key check walks each shared node once), not 9**9 times."""
    with pytest.raises(ConfigError, match=r"cfg.yaml nests deeper than a config can \(Python's recursion limit\)"):
        load_config(Recipe, write(tmp_path, "seed: " + "[" * 5000 + "]" * 5000 + "\n"))
    lines, previous = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]'], "l0"
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*{previous}"] * 9) + "]")
        previous = f"l{i}"
    with pytest.raises(ConfigError, match="unknown key l0"):
        load_config(Recipe, write(tmp_path, "\n".join(lines) + "\n"))


def test_a_merge_key_may_be_overridden(tmp_path):
    """`<<: *base` then a key of base is YAML's way to override, not a key written twice."""
    text = "base: &b {lr: 0.1, max_steps: 5}\n"
    path = write(tmp_path, text + "train:\n  <<: *b\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match="unknown key base"):  # not 'written twice'
        load_config(Recipe, path)


def test_a_json_config_is_read_as_json(tmp_path):
    """JSON indented with tabs is not YAML (PyYAML refused it); a key twice in an object is refused too."""
    path = tmp_path / "cfg.json"
    path.write_text('{\n\t"seed": 5,\n\t"train": {"max_steps": 7}\n}\n')
    cfg = load_config(Recipe, path)
    assert cfg.seed == 5 and cfg.train.max_steps == 7
    path.write_text('{"seed": 5, "train": {"max_steps": 7, "max_steps": 9}}')
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, path)
    assert problems_of(excinfo) == [f"{path}: the key 'max_steps' is written twice in one object; keep one"]


def test_invalid_yaml_names_line_and_column(tmp_path):
    path = write(tmp_path, "seed: 1\ntrain:\n  lr: 0.1\n max_steps: 2\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, path)
    (msg,) = problems_of(excinfo)
    assert msg.startswith(f"{path} is not valid YAML at line 4, column 2")


def test_invalid_yaml_flow_sequence_position(tmp_path):
    path = write(tmp_path, "data:\n  trackers: [tensorboard\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3, column 5: expected ',' or '\]'"):
        load_config(Recipe, path)




# load_config: keys


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, write(tmp_path, "sed: 3\n"))
    assert problems_of(excinfo) == ["unknown key sed; did you mean seed?"]


def test_unknown_nested_key_suggests_with_its_section():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train.max_step=10"])
    assert problems_of(excinfo) == ["unknown key train.max_step; did you mean train.max_steps?"]


def test_unknown_key_without_a_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["data.zzzzzz=1"])
    assert problems_of(excinfo) == ["unknown key data.zzzzzz; valid keys: path, seq_len, trackers"]


def test_a_missing_required_key_is_reported_with_its_help():
    with pytest.raises(ConfigError) as excinfo:
        load_config(NeedsName, None, ["size=2"])
    assert problems_of(excinfo) == ["missing required key name (required: no default)"]
    assert load_config(NeedsName, None, ["name=x"]) == NeedsName(name="x", size=1)


def test_a_section_given_a_scalar():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train=5"])
    assert problems_of(excinfo) == ["train must be a mapping of its keys (lr, max_steps, compile, …), found 5"]


def test_an_empty_section_takes_its_defaults(tmp_path):
    cfg = load_config(Recipe, write(tmp_path, "train:\ndata: {}\n"))
    assert cfg.train == Train() and cfg.data == Data()


# load_config: coercion


@pytest.mark.parametrize(
    "raw, expected", [("3e-4", 3e-4), ("1e-3", 1e-3), ("2", 2.0), ("0.5", 0.5), ("1.5E2", 150.0)]
)
def test_float_fields_accept_what_yaml_users_write(raw, expected):
    cfg = load_config(Recipe, None, [f"train.lr={raw}"])
    assert type(cfg.train.lr) is float and cfg.train.lr == expected


def test_float_written_without_a_dot_in_a_file(tmp_path):
    cfg = load_config(Recipe, write(tmp_path, "train:\n  lr: 3e-4\n"))
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)


def test_integral_float_becomes_int():
    cfg = load_config(Recipe, None, ["train.max_steps=200.0"])
    assert cfg.train.max_steps == 200 and type(cfg.train.max_steps) is int


def test_int_or_none():
    assert load_config(Recipe, None, ["train.warmup=10"]).train.warmup == 10
    assert load_config(Recipe, None, ["train.warmup=null"]).train.warmup is None


def test_str_field_takes_a_number_as_text():
    assert load_config(Recipe, None, ["output_dir=2024"]).output_dir == "2024"


def test_an_override_that_is_not_yaml_is_its_text():
    """`*.txt` is a YAML alias that does not parse (it was a ScannerError traceback): a glob, as written."""
    assert load_config(Recipe, None, ["data.path=*.txt"]).data.path == "*.txt"


@dataclass
class Source:
    name: str = field(help="what it is called")


@dataclass
class Mixture:
    sources: list[Source] = field(default_factory=list, help="sources")
    weights: dict = field(default_factory=dict, help="{name: weight}")

    def validate(self) -> list[str]:  # reads its items' fields, as data.sources' checks do
        return [f"{s.name} twice" for s in self.sources if [t.name for t in self.sources].count(s.name) > 1]


@pytest.mark.parametrize(("override", "message"), [
    ("sources=[{name: a}, {name: b}", "override sources is not valid YAML at line 1, column 22: expected ',' or ']', "
                                      "but got '<stream end>' (sources must be a list)"),
    ("sources=[{name: a} {name: b}]", "override sources is not valid YAML at line 1, column 12: expected ',' or ']', "
                                      "but got '{' (sources must be a list)"),
    ("sources={name: a}", "sources must be a list, found {'name': 'a'}"),
    ("weights={a: 1", "override weights is not valid YAML at line 1, column 6: expected ',' or '}', but got "
                      "'<stream end>' (weights must be a mapping)"),
])
def test_an_override_that_is_not_yaml_where_a_list_is_wanted_says_its_yaml_error(override, message):
    """A bracket left open in data.sources was an AttributeError traceback from the mixture's checks, which read the
    text as written as if it were the list."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(Mixture, None, [override])
    assert problems_of(excinfo) == [message]


def test_a_list_item_that_is_no_section_is_reported_and_the_others_range_checked():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Mixture, None, ["sources=[{name: a}, x.txt, {nme: b}, {name: a}]"])
    assert problems_of(excinfo) == [
        "sources[1] must be a mapping of its keys (name), found 'x.txt'", "unknown key sources[2].nme; did you mean sources[2].name?",
        "missing required key sources[2].name (what it is called)", "a twice"]


BEYOND = "beyond what any setting takes (at most 9,223,372,036,854,775,807)"
TOO_LARGE = {
    "5000-digit max_steps": ("train.max_steps=" + "9" * 5000, f"train.max_steps is a 5000-digit number, {BEYOND}"),
    "30-digit seed": ("seed=" + "9" * 30, f"seed is a 30-digit number, {BEYOND}"),
    "2**63 seed": ("seed=9223372036854775808", f"seed is 9223372036854775808, {BEYOND}"),
    "1e30 max_steps": ("train.max_steps=1e30", f"train.max_steps=1e+30 is {BEYOND}"),
    "5000-digit int or None": ("train.warmup=" + "9" * 5000, f"train.warmup is a 5000-digit number, {BEYOND}"),
    "400-digit lr": ("train.lr=" + "9" * 400, "train.lr must be a finite number, found a 400-digit number"),
    "5000-digit lr": ("train.lr=" + "9" * 5000, "train.lr must be a finite number, found a 5000-digit number"),
    "lr 1e400": ("train.lr=1e400", "train.lr must be a finite number, found '1e400'"),
}


@pytest.mark.parametrize("name", TOO_LARGE)
def test_numbers_too_large_for_any_setting_are_one_line(name):
    """A 5000-digit max_steps was a ValueError traceback from Python's int() (over 4,300 digits); an int
    over 64 bits fails inside torch or numpy; a float over 1e308 overflows float()."""
    override, message = TOO_LARGE[name]
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, [override])
    assert problems_of(excinfo) == [message]


def test_numbers_too_large_in_a_file(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, write(tmp_path, "train:\n  max_steps: " + "9" * 5000 + "\n"))
    assert problems_of(excinfo) == [f"train.max_steps is a 5000-digit number, {BEYOND}"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=2.5", "train.max_steps must be an integer, found 2.5"),
        ("train.max_steps=lots", "train.max_steps must be an integer, found 'lots'"),
        ("train.max_steps=true", "train.max_steps must be an integer, found True"),
        ("seed=[1]", "seed must be an integer, found [1]"),
        ("train.lr=fast", "train.lr must be a number, found 'fast'"),
        ("train.lr=false", "train.lr must be a number, found False"),
        ("train.lr=nan", "train.lr must be a finite number, found 'nan'"),
        ("train.lr=inf", "train.lr must be a finite number, found 'inf'"),
        ("train.lr=.inf", "train.lr must be a finite number, found inf"),
        ("train.lr=-1e999", "train.lr must be a finite number, found '-1e999'"),
        ("train.compile=1", "train.compile must be true or false, found 1"),
        ("train.compile=maybe", "train.compile must be true or false, found 'maybe'"),
        ("output_dir=true", "output_dir must be a string, found True"),
        ("train.warmup=soon", "train.warmup must be an integer, found 'soon'"),
    ],
)
def test_type_errors_name_the_key_and_the_value(override, message):
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, [override])
    assert problems_of(excinfo) == [message]


def test_one_string_where_a_list_of_strings_is_wanted_is_a_list_of_one(tmp_path):
    """`data.trackers=tensorboard` was "must be a list"; a list item of another type is still refused (in a file:
    on the command line a list of strings takes its entries as text, toolkit.config.text_lists)."""
    assert load_config(Recipe, None, ["data.trackers=tensorboard"]).data.trackers == ["tensorboard"]
    assert load_config(Recipe, write(tmp_path, "data:\n  trackers: wandb\n")).data.trackers == ["wandb"]
    assert load_config(Recipe, None, ["data.trackers=[tensorboard, true]"]).data.trackers == ["tensorboard", "true"]
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, write(tmp_path, "data:\n  trackers: [tensorboard, true]\n"))
    assert problems_of(excinfo) == ["data.trackers[1] must be a string, found True"]
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["seed=5", "data.trackers=[a", "train.max_steps=2"])
    assert problems_of(excinfo) == ["override data.trackers=[a does not read as a list of strings: it starts with [ and "
                                    "does not end with ]; write each entry in double quotes and the whole override in "
                                    "single quotes, e.g. 'data.trackers=[\"a\"]'"]


def test_literal_error_lists_the_choices_and_suggests_one():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train.schedule=cosin"])
    assert problems_of(excinfo) == [
        "train.schedule='cosin' is not one of cosine, linear, constant; did you mean cosine?"
    ]


def test_literal_error_suggests_the_choice_written_in_other_case():
    """adapter.method=LoRA listed the choices without the hint: difflib finds 'LoRA' and 'lora' too far apart."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train.schedule=COSINE"])
    assert problems_of(excinfo) == [
        "train.schedule='COSINE' is not one of cosine, linear, constant; did you mean cosine?"
    ]


def test_literal_error_without_a_close_choice():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train.schedule=xyz"])
    assert problems_of(excinfo) == ["train.schedule='xyz' is not one of cosine, linear, constant"]


def test_literal_accepts_each_choice():
    for choice in ("cosine", "linear", "constant"):
        assert load_config(Recipe, None, [f"train.schedule={choice}"]).train.schedule == choice


# load_config: all problems together


def test_every_problem_is_reported_in_one_error(tmp_path):
    path = write(tmp_path, "sed: 1\ntrain:\n  lr: fast\n  compile: 1\ndata:\n  seq_len: 4\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, path, ["train.max_steps=0", "output_dir=true", "train.schedule=cosin"])
    problems = problems_of(excinfo)
    assert sorted(problems) == sorted(
        [
            "unknown key sed; did you mean seed?",
            "train.lr must be a number, found 'fast'",
            "train.compile must be true or false, found 1",
            "train.schedule='cosin' is not one of cosine, linear, constant; did you mean cosine?",
            "output_dir must be a string, found True",
            "train.max_steps=0 must be at least 1",  # from Train.validate, named with its section
            "data.seq_len=4 is too short",  # from Data.validate
        ]
    )
    message = str(excinfo.value)
    assert message.startswith("7 problems in the config:\n  - ")
    assert all(p in message for p in problems)


def test_validate_runs_even_when_only_range_checks_fail():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train.max_steps=-3", "data.seq_len=2"])
    assert problems_of(excinfo) == ["train.max_steps=-3 must be at least 1", "data.seq_len=2 is too short"]


@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_every_choice_key_reads_yamls_booleans_as_written(recipe):
    """YAML 1.1 reads yes/on/true and no/off/false as booleans: a choice key takes the choice they spell (no, none,
    off, ...) or refuses them as the user wrote them (was `train.canary=True is not one of ...`)."""
    import typing

    from toolkit.config.keys import dotted_keys, value_at
    from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

    cls = PretrainConfig if recipe == "pretrain" else FinetuneConfig
    choices = {k: typing.get_args(h) for k, h in dotted_keys(cls).items() if typing.get_origin(h) is Literal}
    assert "train.canary" in choices and "model.loss" in choices
    for key, args in choices.items():
        for written, meaning in (("yes", True), ("no", False)):
            said = ("yes", "on", "true") if meaning else ("no", "off", "false", "none")
            spelled = [a for a in args if str(a).lower() in said]
            try:
                cfg = load_config(cls, None, [f"{key}={written}"])
            except ConfigError as exc:
                assert not spelled, (key, written, exc.problems)
                assert any(p.startswith(f"{key}={'/'.join(said[:3])} (YAML's {str(meaning).lower()}) is not one of ")
                           for p in exc.problems), (key, exc.problems)
                continue
            assert value_at(cfg, key) == spelled[0], key
