"""`meshllm completion bash|zsh` and `--help` defaults: what a new user's shell and terminal show.

Locks: the bash script is valid bash (`bash -n`) and, sourced into a real
bash, completes subcommands, a subcommand's options and an option's fixed
choices; the zsh script names every subcommand (and is valid zsh where zsh
is installed); a wrong shell is one line and exit 2; every subcommand's
`--help` shows option defaults.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshllm import cli
from meshllm.completion import bash_script, command_specs, zsh_script
from meshllm.config import EnvArgumentParser


@pytest.fixture(scope="module")
def bash_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "meshllm.bash"
    path.write_text(bash_script(command_specs()))
    return path


def complete(script: Path, *words: str) -> list[str]:
    """COMPREPLY of the sourced script for the command line `words` (the last one being completed)."""
    quoted = " ".join(f"'{w}'" for w in words)
    program = f'source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _meshllm; printf "%s\\n" "${{COMPREPLY[@]}}"'
    out = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=20, check=True)
    return [w for w in out.stdout.splitlines() if w]


def test_the_bash_script_is_valid_bash(bash_file: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(bash_file)], capture_output=True, text=True, timeout=20, check=False)
    assert proc.returncode == 0, proc.stderr


def test_bash_completes_commands_options_and_choices(bash_file: Path) -> None:
    assert complete(bash_file, "meshllm", "")[:3] == ["run", "frontend", "bench"]
    assert complete(bash_file, "meshllm", "co") == ["completion"]
    assert complete(bash_file, "meshllm", "run", "--http-p") == ["--http-port"]
    assert "--request-rate" in complete(bash_file, "meshllm", "bench", "--re")
    assert complete(bash_file, "meshllm", "run", "--router-mode", "round") == ["round-robin"]
    assert set(complete(bash_file, "meshllm", "worker", "--engine", "")) >= {"mocker", "llamacpp"}
    assert complete(bash_file, "meshllm", "completion", "") == ["bash", "zsh"]
    assert complete(bash_file, "meshllm", "run", "--model-path", "") == [], "a free value: left to file-name completion"


def test_the_zsh_script_names_every_command_and_is_valid_where_zsh_is_installed(tmp_path: Path) -> None:
    text = zsh_script(command_specs())
    assert text.startswith("#compdef meshllm\n")
    for name in cli.COMMANDS:
        assert f"    {name}) _arguments" in text
    assert "'--router-mode:value:(kv approximate round-robin random least-loaded)'" in text
    zsh = shutil.which("zsh")
    if zsh is None:
        return  # the structure checks above still ran
    path = tmp_path / "_meshllm"
    path.write_text(text)
    proc = subprocess.run([zsh, "-n", str(path)], capture_output=True, text=True, timeout=20, check=False)
    assert proc.returncode == 0, proc.stderr
    program = f'autoload -U compinit; compinit -u -D; source {path}; print "registered=${{_comps[meshllm]}}"'
    loaded = subprocess.run([zsh, "-f", "-c", program], capture_output=True, text=True, timeout=20, check=False, cwd=tmp_path)
    assert "registered=_meshllm" in loaded.stdout, loaded.stdout + loaded.stderr


def test_the_command_prints_a_script_and_refuses_an_unknown_shell_in_one_line() -> None:
    ok = subprocess.run([sys.executable, "-m", "meshllm", "completion", "bash"], capture_output=True, text=True, timeout=60,
                        check=False)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.startswith("# bash completion for meshllm") and ok.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "meshllm", "completion", "fish"], capture_output=True, text=True, timeout=60,
                         check=False)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr == "meshllm completion: error: name the shell: meshllm completion bash|zsh\n"


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    p = EnvArgumentParser(prog="x", env={"MESHLLM_PORT": "9"})
    p.add_argument("--port", type=int, default=8000, help="listen port")
    p.add_argument("--host", default=None, help="host")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--mode", default="kv", help="mode (default: the best one)")
    p.add_argument("--levels", default=[1, 8], help="levels")
    text = " ".join(p.format_help().split())
    assert "listen port [env MESHLLM_PORT] (default: 9)" in text, "the default a user gets, here from the environment"
    assert "host [env MESHLLM_HOST] --flag" in text and "a flag [env MESHLLM_FLAG] --mode" in text, "no '(default: None)'"
    assert "mode (default: the best one) [env MESHLLM_MODE] --levels" in text and "(default: 1,8)" in text
    for name, expect in (("run", "(default: 8000)"), ("bench", "(default: http://127.0.0.1:8000)"), ("router", "(default:")):
        with pytest.raises(SystemExit) as stop:
            cli.main([name, "--help"])
        assert stop.value.code == 0
        assert expect in " ".join(capsys.readouterr().out.split()), name
