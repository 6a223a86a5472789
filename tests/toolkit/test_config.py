"""Recipe configs: YAML + key=value overrides into dataclasses, every problem reported in one error.

The dataclasses here are throwaway ones built with `toolkit.config.field`, so these tests pin the
loader's rules (unknown keys, coercion, collected problems) and not any recipe's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from toolkit.config import ConfigError, UserError, field, load_config, parse_overrides


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


def test_parse_overrides_rejects_a_key_under_a_scalar():
    with pytest.raises(ConfigError, match=r"sets a key under 'seed', which is not a section"):
        parse_overrides(["seed=1", "seed.x=2"])


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)
    assert str(ConfigError(["only one"])) == "only one"
    assert str(ConfigError(["a", "b"])) == "2 problems in the config:\n  - a\n  - b"


# load_config: files


def test_no_file_and_no_overrides_gives_the_defaults():
    assert load_config(Recipe, None) == Recipe()


def test_an_empty_file_gives_the_defaults(tmp_path):
    assert load_config(Recipe, write(tmp_path, "")) == Recipe()


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


def test_a_folder_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Recipe, tmp_path)


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


def test_a_file_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"must hold a mapping of keys, found list"):
        load_config(Recipe, write(tmp_path, "- 1\n- 2\n"))


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
    assert problems_of(excinfo) == ["train must be a mapping, found 5"]


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
        ("data.trackers=tensorboard", "data.trackers must be a list, found 'tensorboard'"),
        ("data.trackers=[tensorboard, true]", "data.trackers[1] must be a string, found True"),
        ("output_dir=true", "output_dir must be a string, found True"),
        ("train.warmup=soon", "train.warmup must be an integer, found 'soon'"),
    ],
)
def test_type_errors_name_the_key_and_the_value(override, message):
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, [override])
    assert problems_of(excinfo) == [message]


def test_literal_error_lists_the_choices_and_suggests_one():
    with pytest.raises(ConfigError) as excinfo:
        load_config(Recipe, None, ["train.schedule=cosin"])
    assert problems_of(excinfo) == [
        "train.schedule='cosin' is not one of cosine, linear, constant; did you mean cosine?"
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
        load_config(Recipe, path, ["train.max_steps=0", "data.trackers=wandb", "train.schedule=cosin"])
    problems = problems_of(excinfo)
    assert sorted(problems) == sorted(
        [
            "unknown key sed; did you mean seed?",
            "train.lr must be a number, found 'fast'",
            "train.compile must be true or false, found 1",
            "train.schedule='cosin' is not one of cosine, linear, constant; did you mean cosine?",
            "data.trackers must be a list, found 'wandb'",
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
