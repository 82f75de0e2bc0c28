"""Test certificates made with the ``openssl`` CLI: a CA, a server certificate and client certificates."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "pd-extproc"
"""The DNS name in the server certificate (Envoy's SNI and SAN check in the snippet of docs/operations.md)."""


@dataclass(frozen=True)
class Pair:
    """A PEM certificate and its private key."""

    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> Pair:
    """A self-signed CA ``name`` in ``folder``."""
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-days", "2", "-subj", f"/CN={name}", "-keyout", pair.key, "-out", pair.cert,
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
    )  # fmt: skip
    return pair


def issue(ca: Pair, folder: Path, name: str, server: bool) -> Pair:
    """A certificate ``name`` signed by ``ca``, for a server or a client.

    A server's carries SAN ``DNS:pd-extproc`` and ``IP:127.0.0.1``."""
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    request = folder / f"{name}.csr"
    extensions = folder / f"{name}.ext"
    usage = "serverAuth" if server else "clientAuth"
    san = f"subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1\n" if server else ""
    extensions.write_text(f"{san}extendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-subj", f"/CN={name}", "-keyout", pair.key, "-out", request,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", request, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-days", "2", "-extfile", extensions, "-out", pair.cert,
    )  # fmt: skip
    return pair


def self_signed(folder: Path, name: str = SERVER_NAME) -> Pair:
    """A self-signed server certificate ``name`` in ``folder``.

    SAN ``DNS:pd-extproc``, ``IP:127.0.0.1``: what the gateways that dial the picker without verifying
    it are given."""
    folder.mkdir(parents=True, exist_ok=True)
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-days", "2", "-subj", f"/CN={name}", "-keyout", pair.key, "-out", pair.cert,
        "-addext", f"subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1", "-addext", "extendedKeyUsage=serverAuth",
    )  # fmt: skip
    return pair


@dataclass(frozen=True)
class Certificates:
    """Everything a TLS test needs: two CAs, a server, a client and a stranger.

    ``ca`` signs ``server`` and ``client``; ``other_ca`` signs ``stranger``, a client pd-extproc must
    refuse."""

    ca: Pair
    server: Pair
    client: Pair
    other_ca: Pair
    stranger: Pair


def make_certificates(folder: Path) -> Certificates:
    """Generate a fresh set in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = make_ca(folder, "ca"), make_ca(folder, "other-ca")
    return Certificates(
        ca,
        issue(ca, folder, "server", server=True),
        issue(ca, folder, "client", server=False),
        other,
        issue(other, folder, "stranger", server=False),
    )
