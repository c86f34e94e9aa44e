"""Config: one validated structure from TOML + CLI overrides, documented key by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gossipgrad.peer.cli import build_parser, main, overrides_from_args
from gossipgrad.peer.config import (
    ConfigError,
    PeerConfig,
    build_config,
    iter_fields,
    load_config,
    markdown_reference,
)
from support import ROOT

pytestmark = pytest.mark.timeout(60)


def test_defaults_are_valid_and_documented() -> None:
    cfg = build_config({})
    assert isinstance(cfg, PeerConfig)
    assert cfg.gossip.algorithm == "choco"
    for key, _ann, desc, _default in iter_fields():
        assert desc, f"{key} has no description"


def test_toml_file_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "site.toml"
    f.write_text(
        '[peer]\nid = "site-a"\nbootstrap = ["10.0.0.1:7000"]\n'
        '[gossip]\ncodec = "int8"\ngamma = 0.3\n[train]\nsteps = 7\n'
    )
    cfg = load_config(f, {"gossip.gamma": "0.7", "train.steps": "9"})
    assert cfg.peer.id == "site-a"
    assert cfg.peer.bootstrap == ["10.0.0.1:7000"]
    assert cfg.gossip.codec == "int8"
    assert cfg.gossip.gamma == pytest.approx(0.7)
    assert cfg.train.steps == 9


@pytest.mark.parametrize(
    ("raw", "overrides", "fragment"),
    [
        ({"gossip": {"gama": 0.3}}, {}, "gossip.gama: unknown key"),
        ({}, {"gossip.gamma": "1.5"}, "gossip.gamma"),
        ({}, {"train.optimizer": "lbfgs"}, "train.optimizer"),
        ({}, {"gossip.codec": "topk:7"}, "gossip.codec"),
        ({}, {"gossip.topology": "moebius"}, "topology"),
        ({}, {"peer.listen": "nohost"}, "peer.listen"),
        ({}, {"peer.listen": "0.0.0.0:7070", "peer.relay_port": "7070"}, "relay_port"),
        ({}, {"train.shard_index": "4", "train.num_shards": "4"}, "shard_index"),
        ({}, {"membership.suspect_after": "100"}, "suspect_after"),
        ({"bogus": {}}, {}, "bogus: unknown key"),
    ],
)
def test_bad_keys_and_values_name_the_key(raw, overrides, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(raw, overrides)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[peer\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_every_key_is_a_cli_option() -> None:
    parser = build_parser()
    options = {a.dest for a in parser._actions}
    for key, *_ in iter_fields():
        assert key in options
    args = parser.parse_args(["--peer.bootstrap", "a:1,b:2", "--gossip.gamma", "0.25"])
    assert overrides_from_args(args) == {"peer.bootstrap": ["a:1", "b:2"], "gossip.gamma": "0.25"}


def test_set_key_value_sets_any_key_as_the_other_tools_do(capsys) -> None:
    args = build_parser().parse_args(
        ["--gossip.gamma", "0.5", "--set", "gossip.gamma=0.25", "--set", "peer.bootstrap=a:1,b:2"]
    )
    assert overrides_from_args(args) == {"peer.bootstrap": ["a:1", "b:2"], "gossip.gamma": "0.25"}
    assert main(["--set", "train.steps=7", "--print-config"]) == 0
    assert '"steps": 7' in capsys.readouterr().out
    for bad, says in [("train.stepz=7", "unknown key"), ("train.steps", "KEY=VALUE")]:
        assert main(["--set", bad, "--print-config"]) == 2
        assert says in capsys.readouterr().err


def test_print_config_redacts_the_swarm_token(capsys) -> None:
    """Issue 40: ``--print-config`` printed ``security.token`` in clear (its output ends up
    in logs and tickets). Redacted now; an unset token stays empty."""
    assert main(["--set", "security.token=hunter2-swarm-secret", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "hunter2-swarm-secret" not in out
    assert json.loads(out)["security"]["token"] == "<redacted>"
    assert main(["--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["security"]["token"] == ""


def test_cli_reports_config_errors_in_one_line(capsys) -> None:
    assert main(["--gossip.gamma", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gossipgrad-peer: config error: gossip.gamma")
    assert len(err.splitlines()) == 1


def test_docs_config_reference_is_current() -> None:
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == markdown_reference(), "regenerate: gossipgrad-peer --config-reference"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spelling", ["A,B", '["A", "B"]'])
def test_both_tools_take_both_list_spellings(spelling: str, capsys) -> None:
    """One list syntax across tools: ``--set KEY=A,B`` and a TOML array ``["A", "B"]`` mean
    the same to gossipgrad-peer and to gossipgrad-experiment."""

    from gossipgrad.experiment.cli import apply_overrides
    from gossipgrad.experiment.spec import parse_spec, tomllib

    boot = spelling.replace("A", "127.0.0.1:7001").replace("B", "127.0.0.1:7002")
    assert main(["--print-config", "--set", f"peer.bootstrap={boot}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["peer"]["bootstrap"] == ["127.0.0.1:7001", "127.0.0.1:7002"]

    spec_file = ROOT / "scripts" / "experiments" / "digits-small.toml"
    raw = tomllib.loads(spec_file.read_text())
    runs = spelling.replace("A", "ddp").replace("B", "powersgd")
    spec = parse_spec(apply_overrides(raw, [f"baselines.run={runs}"]), spec_file)
    assert list(spec.baselines.run) == ["ddp", "powersgd"]
