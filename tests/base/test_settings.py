"""The table of settings: each entry's config-file key exists in the file's schema, and each setting's flag,
variable and message come from its one entry."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from mpsagent.base.config import IGNORED_FLAG_KEYS, Flags, resolve_settings
from mpsagent.base.errors import UsageError
from mpsagent.base.settings import SETTINGS
from mpsagent.cli import build_parser

# `flags` keys of the NVIDIA plugin's that the agent reads itself (in check_config), not as settings.
NVIDIA_FILE_KEYS = {"migStrategy", "plugin"} | {key.removeprefix("flags.") for key in IGNORED_FLAG_KEYS.values()}


def test_every_flags_key_of_the_file_is_a_setting_or_an_nvidia_key() -> None:
    file_keys = {info.encode_name for info in msgspec.structs.fields(Flags)}
    setting_keys = {entry.key for entry in SETTINGS.values() if entry.key}
    assert sorted(setting_keys - file_keys) == [], "add these keys to config.Flags"
    assert sorted(file_keys - setting_keys - NVIDIA_FILE_KEYS) == [], "these Flags fields are no setting's"


def test_each_flag_variable_and_key_belongs_to_one_setting() -> None:
    entries = list(SETTINGS.values())
    for column in ("flag", "env", "key"):
        values = [getattr(entry, column) for entry in entries if getattr(entry, column)]
        assert len(values) == len(set(values)), column


def test_the_parser_offers_exactly_the_settings_and_the_mode_flags() -> None:
    offered = {option for action in build_parser()._actions for option in action.option_strings}
    modes = {"-h", "--help", "--once", "--status", "--daemon-host", "--output", "--version"}
    assert offered - modes == {entry.flag for entry in SETTINGS.values()}


def _config(tmp_path: Path, text: str = "") -> str:
    path = tmp_path / "config.yaml"
    resources = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
    path.write_text(resources + text)
    return str(path)


@pytest.mark.parametrize("name", [name for name, entry in SETTINGS.items() if entry.choices])
def test_a_choice_is_read_in_any_case_from_the_command_line(tmp_path: Path, name: str) -> None:
    entry = SETTINGS[name]
    choice = entry.choices[-1]
    args = build_parser().parse_args(["--config-file", _config(tmp_path), entry.flag, choice.upper()])
    assert getattr(resolve_settings(vars(args), environ={}), name) == choice


@pytest.mark.parametrize("name", [name for name, entry in SETTINGS.items() if entry.choices])
def test_a_bad_choice_on_the_command_line_lists_the_choices_as_written(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = SETTINGS[name]
    with pytest.raises(SystemExit):
        build_parser().parse_args([entry.flag, "nope"])
    listed = ", ".join(f"'{choice}'" for choice in entry.choices)
    assert f"argument {entry.flag}: invalid choice: 'nope' (choose from {listed})" in capsys.readouterr().err


@pytest.mark.parametrize("name", [name for name, entry in SETTINGS.items() if entry.choices])
def test_a_bad_choice_in_the_file_names_the_flag_the_variable_and_the_key(tmp_path: Path, name: str) -> None:
    entry = SETTINGS[name]
    with pytest.raises(UsageError) as info:
        resolve_settings({"config_file": _config(tmp_path, f"flags:\n  {entry.key}: nope\n")}, environ={})
    choices = ", ".join(entry.choices)
    assert (
        str(info.value)
        == f"{entry.flag} (env {entry.env}, config flags.{entry.key}) must be one of {choices}; not `nope`"
    )


@pytest.mark.parametrize(("written", "read"), [("on", "on"), ("off", "off"), ("'on'", "on"), ("true", "on")])
def test_a_switch_in_the_file_reads_as_yaml_writes_it(tmp_path: Path, written: str, read: str) -> None:
    """A bare `on` is YAML's boolean true: `flags.dra: on` must turn DRA on, not be refused as not text."""
    config = _config(tmp_path, f"flags:\n  dra: {written}\n")
    assert resolve_settings({"config_file": config}, environ={}).dra == read
