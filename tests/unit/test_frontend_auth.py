"""API keys of the frontend (frontend/http/auth.py) and their flags: parsing, checking, never showing a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.config import ConfigError
from meshllm.frontend.config import FrontendConfig, frontend_arg_parser
from meshllm.frontend.http.auth import ApiKeys, AuthFailure, bearer_token, exposure_warning, fingerprint, unauthorized_body
from meshllm.frontend.main import main as frontend_main
from meshllm.run import parse_run_args

K1 = "sk-one-0123456789abcdef"
K2 = "sk-two-0123456789abcdef:with-colon"


def test_a_keys_file_takes_comments_ids_and_plain_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n\nalice:{K1}\n  bob:{K2}  \n{'sk-' + 'z' * 20}\n")
    keys = ApiKeys.load("", str(path))
    assert keys.ids == ("alice", "bob", fingerprint(b"sk-" + b"z" * 20))
    assert keys.check(f"Bearer {K1}") == "alice" and keys.check(f"bearer  {K2} ".encode()) == "bob"
    assert keys.check("Bearer sk-" + "z" * 20) == keys.ids[2]


def test_keys_never_show_in_a_repr_a_config_or_an_error(tmp_path: Path) -> None:
    keys = ApiKeys.parse([K1, f"ops:{K2}"], source="--api-keys")
    config = FrontendConfig(api_keys=keys)
    for text in (repr(keys), repr(config), str(list(keys))):
        assert "0123456789abcdef" not in text
    assert fingerprint(K1.encode()) in repr(keys) and "ops" in repr(keys)
    with pytest.raises(ConfigError) as info:
        ApiKeys.parse(["short-secret"], source="--api-keys")
    assert "short-secret" not in info.value.message and "at least 16" in info.value.message


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, AuthFailure.MISSING),
        ("", AuthFailure.MISSING),
        (f"Basic {K1}", AuthFailure.MISSING),
        ("Bearer", AuthFailure.MISSING),
        ("Bearer sk-one-0123456789abcdeX", AuthFailure.INVALID),
        (f"Bearer {K1}x", AuthFailure.INVALID),
        (f"Bearer {K1[:-1]}", AuthFailure.INVALID),
        (f"BEARER {K1}", "k1"),
    ],
)
def test_check_names_the_key_or_says_why_not(header: str | None, expected: object) -> None:
    assert ApiKeys.parse([f"k1:{K1}"], source="t").check(header) == expected


def test_bearer_token_and_the_401_body() -> None:
    assert bearer_token(b"Bearer  abc ") == b"abc" and bearer_token("Token abc") is None
    body = unauthorized_body(AuthFailure.INVALID)["error"]
    assert body == {
        "message": "Incorrect API key provided.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


@pytest.mark.parametrize(
    ("entries", "needle"),
    [
        ([f"bad id:{K1}"], "key id before ':'"),
        ([f"a:{K1}", f"a:{K2}"], "given twice"),
        ([K1, K1], "given twice"),
        (["sk-with space-0123456789"], "visible ASCII"),
        (["sk-ünïcode-0123456789"], "visible ASCII"),
    ],
)
def test_bad_entries_are_refused_with_one_line(entries: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        ApiKeys.parse(entries, source="--api-keys")
    assert needle in info.value.message and "\n" not in info.value.message


def test_a_missing_or_empty_keys_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        ApiKeys.load("", str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="lists no key"):
        ApiKeys.load("", str(tmp_path / "empty"))


def test_flags_and_variables_build_the_frontend_config(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(f"filed:{K2}\n")
    env = {"MESHLLM_API_KEYS": f"env:{K1}", "MESHLLM_API_KEYS_FILE": str(tmp_path / "keys"), "MESHLLM_OPEN_METRICS": "1"}
    ns = frontend_arg_parser(env=env).parse_args(["--http-header-timeout", "5", "--http-body-timeout", "7"])
    config = FrontendConfig.from_namespace(ns)
    assert config.api_keys.ids == ("env", "filed") and config.open_metrics
    assert (config.header_timeout_s, config.body_timeout_s) == (5.0, 7.0)
    assert not FrontendConfig.from_namespace(frontend_arg_parser(env={}).parse_args([])).open_metrics  # closed by default
    with pytest.raises(ConfigError, match="--http-body-timeout"):
        FrontendConfig(body_timeout_s=0)
    run = parse_run_args(["--api-keys", f"run:{K1}"])
    assert run.frontend_config().api_keys.ids == ("run",)


def test_a_bad_key_stops_meshllm_frontend_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert frontend_main(["--discovery", "memory", "--api-keys", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least 16 characters" in err and "tiny" not in err


def test_serving_every_interface_without_keys_is_one_warning_line() -> None:
    listeners = [("HTTP", "0.0.0.0", 8000), ("gRPC", "127.0.0.1", 9000)]
    line = exposure_warning(listeners, ApiKeys())
    assert line is not None and "HTTP on 0.0.0.0:8000" in line and "gRPC" not in line and "\n" not in line
    assert exposure_warning([("gRPC", "::", 9000)], ApiKeys()) is not None
    assert exposure_warning(listeners, ApiKeys.parse([K1], source="t")) is None
    assert exposure_warning([("HTTP", "127.0.0.1", 8000)], ApiKeys()) is None
