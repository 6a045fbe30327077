"""Certificates and secrets for the secure compose stack (deploy/compose.yaml's `init` service).

    python deploy/init/secure_init.py --out /secrets --compose deploy/compose.yaml [--uid 10001]

Idempotent: what exists is kept, what is missing is created, so `docker compose up` can run it every time.
Writes under --out:
  certs/ca.pem, <service>.pem, <service>-key.pem   `meshllm certs` for every compose service
                  (the CA's key goes to --ca-dir when given, so the services' volume does not hold it)
  api-keys        `compose:KEY` (KEY from $MESHLLM_API_KEY, else random) and `prometheus:KEY2`; the frontend's
                  --api-keys-file (with keys set, /metrics needs one: Prometheus scrapes as tenant `prometheus`)
  prometheus-key  KEY2 alone, for prometheus.yml's `authorization: credentials_file`
  etcd-password   the etcd user `meshllm`'s password;  etcd-root-password  etcd's root user
  nats-token      the NATS token;  nats.conf  nats-server's configuration (TLS with client certificates + token)
Secrets and keys are 0600 and, when run as root, owned by --uid (the image's user); certificates are 0644.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

from meshllm.certs import CertsError, compose_services, make_dev_pki

SECRETS = ("etcd-password", "etcd-root-password", "nats-token")


def _write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def nats_conf(out: Path, *, listen: str = "0.0.0.0:4222", monitor_port: int = 8222) -> dict[str, object]:
    """nats-server's configuration (JSON is valid in its format): TLS requiring a mesh client certificate, and the token."""
    certs = out / "certs"
    return {
        "listen": listen,
        "http": f"127.0.0.1:{monitor_port}",  # monitoring only inside the container (its healthcheck)
        "tls": {
            "cert_file": str(certs / "nats.pem"),
            "key_file": str(certs / "nats-key.pem"),
            "ca_file": str(certs / "ca.pem"),
            "verify": True,
            "timeout": 5,
        },
        "authorization": {"token": (out / "nats-token").read_text().strip()},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="secure_init", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/secrets", help="directory for certs/ and the secrets (default /secrets)")
    parser.add_argument("--compose", default="deploy/compose.yaml", help="compose file whose services get certificates")
    parser.add_argument(
        "--ca-dir", default="", help="keep ca-key.pem here instead of beside the certificates (a volume only init mounts)"
    )
    parser.add_argument("--uid", type=int, default=10001, help="owner of keys and secrets when run as root")
    ns = parser.parse_args(argv)
    out = Path(ns.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        services = compose_services(ns.compose)
        certs = out / "certs"
        missing = [s for s in services if not (certs / f"{s}.pem").exists()]
        ca_key = Path(ns.ca_dir) / "ca-key.pem" if ns.ca_dir else None
        if missing:  # the CA is reused when it exists: new services chain to what the mesh trusts
            if ca_key and ca_key.exists():
                shutil.copy2(ca_key, certs / "ca-key.pem")
            make_dev_pki(certs, missing, hostnames={s: services[s] for s in missing})
        if ca_key and (certs / "ca-key.pem").exists():  # the services' volume never holds the CA's key
            ca_key.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(certs / "ca-key.pem", ca_key)
        for name in SECRETS:
            if not (out / name).exists():
                _write_secret(out / name, secrets.token_hex(24))
        if not (out / "api-keys").exists():
            _write_secret(out / "api-keys", "compose:" + (os.environ.get("MESHLLM_API_KEY") or secrets.token_hex(24)))
        if not (out / "prometheus-key").exists():  # its own key: Prometheus scrapes /metrics as tenant `prometheus`
            scrape_key = secrets.token_hex(24)
            entries = [ln for ln in (out / "api-keys").read_text().splitlines() if not ln.startswith("prometheus:")]
            (out / "api-keys").unlink()
            _write_secret(out / "api-keys", "\n".join([*entries, f"prometheus:{scrape_key}"]))
            _write_secret(out / "prometheus-key", scrape_key)
        conf = out / "nats.conf"
        conf.unlink(missing_ok=True)
        _write_secret(conf, json.dumps(nats_conf(out), indent=2))
        if os.geteuid() == 0:
            for path in [out, certs, *out.iterdir(), *certs.iterdir()]:
                os.chown(path, ns.uid, ns.uid)
        certs.chmod(0o755)
        out.chmod(0o755)
    except (CertsError, OSError) as exc:
        print(f"secure_init: error: {exc}", file=sys.stderr)
        return 2
    print(f"certificates in {certs} ({len(missing)} issued now); secrets in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
