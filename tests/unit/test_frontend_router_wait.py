"""`--router-wait-s`: how long a frontend request waits for a router replica; flag, variable, bounds."""

from __future__ import annotations

import pytest

from meshllm.config import ConfigError
from meshllm.frontend.config import FrontendConfig, frontend_arg_parser
from meshllm.frontend.upstream import DEFAULT_ROUTER_WAIT_S


def config(argv: list[str], env: dict[str, str] | None = None) -> FrontendConfig:
    return FrontendConfig.from_namespace(frontend_arg_parser(env=env or {}).parse_args(argv))


def test_the_wait_defaults_to_a_few_seconds_and_follows_flag_and_variable() -> None:
    assert config(["--router-address", "127.0.0.1:9000"]).router_wait_s == DEFAULT_ROUTER_WAIT_S == 5.0
    assert config(["--router-wait-s", "12.5"]).router_wait_s == 12.5
    assert config([], {"MESHLLM_ROUTER_WAIT_S": "0"}).router_wait_s == 0.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "4000"])
def test_a_wait_out_of_bounds_is_one_line_naming_the_flag(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(["--router-wait-s", value])
    assert err.value.message.startswith("--router-wait-s must be between 0 and 3600 seconds")
    assert "\n" not in err.value.message
