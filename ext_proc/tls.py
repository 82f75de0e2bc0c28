"""TLS on the gRPC port: the ``tls`` section and its check.

A leaf (no gRPC): :mod:`ext_proc.config` reads it; :func:`ext_proc.server.server_credentials` turns
it into the server's credentials.
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.checks import ConfigError


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the gRPC port (``listen``; docs/operations.md "TLS between Envoy and pd-extproc").

    ``cert_file`` and ``key_file`` (PEM; both or neither): pd-extproc's certificate chain and key;
    ``""`` serves plaintext. ``client_ca_file`` (PEM): with it, every client must present a
    certificate signed by one of its CAs (mutual TLS). Relative paths resolve like ``eds_files``.
    """

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    def check(self) -> None:
        """Raise :class:`ConfigError` unless the files make plaintext, TLS or mutual TLS."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls.cert_file and tls.key_file: set both (TLS) or neither (plaintext)")
        if self.client_ca_file and not self.cert_file:
            raise ConfigError("tls.client_ca_file: needs tls.cert_file and tls.key_file (mutual TLS is TLS)")


def tls_mode(tls: TlsConfig) -> str:
    """How the gRPC port is served, for the start-up log line."""
    if not tls.cert_file:
        return "plaintext"
    return "mutual TLS" if tls.client_ca_file else "TLS"
