"""The `pd-gateway` command line: every setting is a documented flag; --print-config; start-up failures."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from gateway import cli, config
from gateway.api.auth import ApiKeys, digest
from gateway.processes import free_port
from gateway.config import FILE_ONLY, Settings

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in msgspec.structs.fields(Settings) if f.name not in FILE_ONLY]     # no flag: no help


def test_every_setting_has_help():
    assert not [name for name in FIELDS if not cli.HELP.get(name)]


def test_serve_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in FIELDS:
        assert f"--{name.replace('_', '-')}" in text
        assert " ".join(cli.HELP[name].split()) in text
    assert "--print-config" in text and "--config" in text


def test_print_config_masks_secrets_and_round_trips(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PDGW_DECODE_IDLE_TIMEOUT_S", "33")
    cli.main(["serve", "--prefill", "http://p0:8100", "--decode", "http://d0:8200", "--admin-key", "k3y",
              "--redis-url", "redis://:pw@redis:6379/0", "--print-config"])
    out = capsys.readouterr().out
    assert "k3y" not in out and ":pw@" not in out
    shown = yaml.safe_load(out)
    assert shown["decode_idle_timeout_s"] == 33.0 and shown["prefill"] == ["http://p0:8100"]
    # What it prints is itself a valid settings file (secrets aside).
    path = tmp_path / "printed.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in shown.items() if k not in ("admin_key", "redis_url")}))
    assert config.build({}, str(path), {}).decode_idle_timeout_s == 33.0


@pytest.mark.parametrize(("argv", "words"), [
    (["serve", "--prefill-timeout-s", "-5"], ["pd-gateway serve", "prefill_timeout_s", "--prefill-timeout-s"]),
    (["serve", "--prefill", "p0", "--decode", "http://d0:1"], ["prefill", "not a valid URL"]),
    (["check", "--redis-url", "mysql://db"], ["pd-gateway check", "redis_url"]),
])
def test_invalid_configuration_fails_at_start_naming_the_setting(argv, words):
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    for word in words:
        assert word in str(caught.value)


def test_serve_without_engines_says_so():
    with pytest.raises(SystemExit, match="--prefill"):
        cli.main(["serve"])


@pytest.mark.parametrize("argv", [["-h"], ["--help"]])
def test_help_lists_every_command_and_exits_0(argv, capsys):
    cli.main(argv)                          # returns: exit status 0
    out = capsys.readouterr().out
    for command in ("serve", "check", "demo", "sim", "migrate", "hash-key"):
        assert f"\n  {command} " in out
    assert "--version" in out


def test_no_arguments_prints_usage_and_exits_2(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 2 and "usage: pd-gateway COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_help_is_help(command):
    """In a process, stdin holding a key: `hash-key --help` once printed the key's digest and exited 0."""
    done = subprocess.run([sys.executable, "-m", "gateway", command, "--help"], input="secret\n", text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: pd-gateway {command}") and digest("secret") not in done.stdout


@pytest.mark.parametrize("stdin", ["", "\n", "   \n"])
def test_hash_key_refuses_an_empty_key(stdin, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as caught:
        cli.main(["hash-key"])
    assert "no key" in str(caught.value) and capsys.readouterr().out == ""


def test_hash_key_prints_the_digest_and_refuses_arguments(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    cli.main(["hash-key"])
    assert capsys.readouterr().out.strip() == digest("s3cret")
    with pytest.raises(SystemExit) as caught:
        cli.main(["hash-key", "s3cret"])          # a key as an argument would show in ps: refused
    assert caught.value.code == 2


def test_serve_refuses_the_digest_of_an_empty_key():
    with pytest.raises(ValueError, match="empty key"):
        ApiKeys.from_settings(Settings(api_keys=[f"team:{digest('')}"]))


def test_version(capsys):
    cli.main(["--version"])
    assert capsys.readouterr().out.startswith("pd-gateway 0.")


def test_an_unknown_command_fails_with_the_list():
    with pytest.raises(SystemExit) as caught:
        cli.main(["serv"])
    assert "unknown command 'serv'" in str(caught.value) and "migrate" in str(caught.value)


def test_migrate_against_a_stopped_redis_is_one_line(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["migrate", "--redis-url", f"redis://:secret@127.0.0.1:{free_port()}/0"])
    message = str(caught.value)
    assert message.startswith("pd-gateway migrate: the store at redis://") and "start Redis" in message
    assert "\n" not in message and "secret" not in message
