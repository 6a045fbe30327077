"""The docs' flag tables are made from the parsers (meshllm.flag_docs), and `--help` prints the same texts plain.

Locks: every marked table in the docs is what the parsers say now (run `python -m meshllm.flag_docs` after
changing a flag); a stale table is found and rewritten; a marker without a table, or a table without its marker,
is an error; a row joins a certificate and its key; a default its value cannot say comes from `doc_default`;
`--help` shows the help without Markdown, with its variable.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshllm import flag_docs
from meshllm.config import EnvArgumentParser, doc_default, terminal_help
from meshllm.flag_docs import Table, render, rewrite, table
from meshllm.plane.auth import add_security_args

ROOT = Path(__file__).resolve().parents[2]


async def test_every_flag_table_in_the_docs_is_what_the_parsers_say() -> None:
    stale = await rewrite(ROOT, check=True)
    assert not stale, f"{stale}: run `python -m meshllm.flag_docs` to rewrite the flag tables"


async def test_a_stale_table_is_found_and_rewritten(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    doc = tmp_path / "docs" / "operations.md"
    good = doc.read_text()
    row = "| `--router-ttl` | `MESHLLM_ROUTER_TTL` | `120.0` |"
    assert row in good
    doc.write_text(good.replace(row, row.replace("`120.0`", "`60`")))
    assert doc.read_text() != good
    assert await rewrite(tmp_path, check=True) == ["docs/operations.md"]
    assert await rewrite(tmp_path) == ["docs/operations.md"]
    assert doc.read_text() == good
    assert await rewrite(tmp_path, check=True) == []


async def test_a_doc_without_a_tables_marker_is_an_error(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    text = (ROOT / "docs" / "operations.md").read_text().replace("<!-- flags: sample -->", "")
    (tmp_path / "docs" / "operations.md").write_text(text)
    with pytest.raises(KeyError, match="sample"):
        await rewrite(tmp_path, check=True)


def test_a_marker_naming_no_table_is_an_error() -> None:
    with pytest.raises(KeyError, match="nosuch"):
        render("<!-- flags: nosuch -->\n<!-- /flags -->", {})


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="svc", env={})
    g = p.add_argument_group("svc")
    g.add_argument("--port", type=int, default=0, help="listen port (`0` = ephemeral; [ports](ports.md))")
    doc_default(g.add_argument("--instance-id", default="", help="instance id"), "random")
    g.add_argument("--verbose", action="store_true", help="say more; 100 %% of it")
    add_security_args(p, tls="TLS on svc")
    return p


async def test_a_table_has_a_row_per_flag_a_key_joins_its_certificate_and_defaults_are_said() -> None:
    spec = Table("docs/x.md", parser=lambda: None)  # type: ignore[arg-type, return-value]
    rows = table(spec, parser()).splitlines()
    assert rows[:2] == flag_docs.HEADER.splitlines()
    assert rows[2] == "| `--port` | `MESHLLM_PORT` | `0` | listen port (`0` = ephemeral; [ports](ports.md)) |"
    assert rows[3] == "| `--instance-id` | `MESHLLM_INSTANCE_ID` | random | instance id |"
    assert rows[4] == "| `--verbose` | `MESHLLM_VERBOSE` | off | say more; 100 % of it |"
    assert rows[5].startswith(
        "| `--tls-cert`, `--tls-key` | `MESHLLM_TLS_CERT`, `MESHLLM_TLS_KEY` | — | PEM certificate and key: TLS on svc;"
    )
    assert rows[7].startswith("| `--mesh-token`, `--mesh-token-file` | `MESHLLM_MESH_TOKEN`, `MESHLLM_MESH_TOKEN_FILE` |")
    assert len(rows) == 8


async def test_the_table_is_the_same_after_the_parser_has_parsed() -> None:
    spec = Table("docs/x.md", parser=lambda: None)  # type: ignore[arg-type, return-value]
    p = parser()
    before = table(spec, p)
    p.parse_args([])  # puts "[env VAR]" and plain text into each help
    assert table(spec, p) == before


def test_help_prints_the_text_plain_with_its_variable() -> None:
    text = " ".join(parser().format_help().split())
    assert "listen port (0 = ephemeral; ports) [env MESHLLM_PORT]" in text
    assert "`" not in text and "](" not in text
    assert terminal_help("a `b` [c](d.md#e) f") == "a b c f"
