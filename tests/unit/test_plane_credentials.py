"""etcd and NATS credentials from flags and MESHLLM_* variables: validation at startup, secrets never shown."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from meshllm.certs import CertFiles, make_dev_pki
from meshllm.config import ConfigError, DiscoveryKind, EnvArgumentParser, EventsKind, PlaneConfig, add_plane_args
from meshllm.credentials import EtcdCredentials, NatsCredentials


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    _, issued = make_dev_pki(tmp_path_factory.mktemp("pki"), ["mesh"])
    return issued["mesh"]


def parse(argv: list[str], env: dict[str, str] | None = None) -> PlaneConfig:
    parser = EnvArgumentParser(prog="meshllm test", env=env or {})
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    return PlaneConfig.from_namespace(parser.parse_args(argv))


def test_flags_variables_and_files_build_the_credentials(files: CertFiles, tmp_path: Path) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("from-a-file\n")
    config = parse(
        ["--etcd-ca", str(files.ca), "--etcd-cert", str(files.cert), "--etcd-key", str(files.key), "--etcd-user", "mesh"],
        env={
            "MESHLLM_ETCD_PASSWORD_FILE": str(password_file),
            "MESHLLM_NATS_CA": str(files.ca),
            "MESHLLM_NATS_TOKEN": "tok-secret",
        },
    )
    etcd, nats = config.etcd_credentials, config.nats_credentials
    assert (etcd.user, etcd.password, etcd.tls) == ("mesh", "from-a-file", True)
    assert (nats.token, nats.tls, nats.cert) == ("tok-secret", True, "")
    assert "from-a-file" not in repr(config) and "tok-secret" not in repr(config)
    assert "from-a-file" not in etcd.describe() and "tok-secret" not in nats.describe()
    options = nats.connect_options()
    assert isinstance(options["tls"], ssl.SSLContext) and options["token"] == "tok-secret"
    assert config.events is EventsKind.NATS


def test_without_flags_nothing_is_secured() -> None:
    config = parse([])
    assert not config.etcd_credentials.tls and not config.etcd_credentials.user
    assert config.nats_credentials.connect_options() == {}


def test_each_nats_method_maps_to_nats_py(files: CertFiles, tmp_path: Path) -> None:
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert NatsCredentials(creds=str(creds)).connect_options() == {"user_credentials": str(creds)}
    assert NatsCredentials(nkey=str(creds)).connect_options() == {"nkeys_seed": str(creds)}
    assert NatsCredentials(user="u", password="p").connect_options() == {"user": "u", "password": "p"}


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--etcd-cert", "{cert}"], {}, "--etcd-cert and --etcd-key go together"),
        (["--etcd-ca", "/nonexistent/ca.pem"], {}, "--etcd-ca /nonexistent/ca.pem: no such file"),
        (["--etcd-user", "mesh"], {}, "--etcd-user needs a password"),
        ([], {"MESHLLM_ETCD_PASSWORD": "pw"}, "--etcd-user needs a password"),
        (["--etcd-password", "a", "--etcd-password-file", "{cert}"], {}, "--etcd-password and --etcd-password-file"),
        (["--etcd-password-file", "{empty}", "--etcd-user", "u"], {}, "is empty"),
        (["--nats-token", "t", "--nats-user", "u", "--nats-password", "p"], {}, "--nats-token and --nats-user are both set"),
        (["--nats-nkey", "/nonexistent/seed"], {}, "--nats-nkey /nonexistent/seed: no such file"),
        (["--nats-key", "{key}"], {}, "--nats-cert and --nats-key go together"),
        (["--etcd-endpoints", "http://127.0.0.1:2379", "--etcd-ca", "{ca}"], {}, "is http:// but --etcd-ca"),
        (["--etcd-endpoints", "ftp://127.0.0.1:2379"], {}, "scheme must be http:// or https://"),
    ],
)
def test_inconsistent_credentials_are_one_line_config_errors(
    files: CertFiles, tmp_path: Path, argv: list[str], env: dict[str, str], message: str
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    subst = {"{cert}": str(files.cert), "{key}": str(files.key), "{ca}": str(files.ca), "{empty}": str(empty)}
    with pytest.raises(ConfigError) as info:
        parse([subst.get(a, a) for a in argv], env)
    assert message in info.value.message and "\n" not in info.value.message


def test_https_endpoints_are_accepted() -> None:
    config = parse(["--etcd-endpoints", "https://etcd-0:2379,https://etcd-1:2379"])
    assert config.etcd_endpoints == ("https://etcd-0:2379", "https://etcd-1:2379")


def test_credentials_are_part_of_every_service_parser() -> None:
    from meshllm.engine.worker_config import worker_arg_parser
    from meshllm.frontend.config import frontend_arg_parser
    from meshllm.router.config import router_arg_parser

    for parser in (worker_arg_parser("mocker", env={}), router_arg_parser(env={}), frontend_arg_parser(env={})):
        longs = {o for a in parser._actions for o in a.option_strings}
        assert {"--etcd-ca", "--etcd-user", "--etcd-password-file", "--nats-ca", "--nats-token", "--nats-creds"} <= longs


def test_unreadable_tls_files_fail_when_the_context_is_built(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(ConfigError, match="NATS TLS files"):
        NatsCredentials(ca=str(bogus)).ssl_context()
    assert EtcdCredentials(ca=str(bogus)).tls
