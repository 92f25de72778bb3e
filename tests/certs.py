"""Throw-away X.509 material for the TLS tests: one CA, server and client certificates,
made with the `openssl` command line (present wherever Envoy's and Python's TLS run)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    ca_key: Path
    dir: Path

    def issue(self, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
              client: bool = False) -> Pair:
        key, csr, crt, ext = (self.dir / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        sans = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
        lines = ["basicConstraints=CA:FALSE",
                 f"extendedKeyUsage={'clientAuth' if client else 'serverAuth'}"]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key, "-CAcreateserial",
                 "-out", crt, "-days", "2", "-sha256", "-extfile", ext)
        return Pair(crt, key)


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, name: str = "ca") -> Pki:
    if shutil.which("openssl") is None:
        raise RuntimeError("the TLS tests need the openssl command line tool")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
             "-subj", f"/CN={name}", "-days", "2", "-sha256",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return Pki(ca, ca_key, directory)
