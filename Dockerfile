# One image for every Floodgate component: the `floodgate` CLI is the entry point, the
# command picks the component (`extproc`, `controller`, `sim`, `load`, ...).
#
#   docker build -t floodgate:local .
#   docker run --rm floodgate:local extproc --help
#
# Envoy and Redis are not in this image: compose.yaml runs their official images.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the distribution installs (see pyproject's package list; bench/ is left out on
# purpose: it is a development tool and `floodgate` runs without it).
COPY pyproject.toml README.md ./
COPY floodgate ./floodgate
COPY extproc ./extproc
COPY controller ./controller
COPY sim ./sim
RUN pip install . && rm -rf /src

RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin floodgate
USER 10001
WORKDIR /home/floodgate

# gRPC ext_proc, processor /metrics, emulated vLLM API.
EXPOSE 50051 9464 8000
ENTRYPOINT ["floodgate"]
CMD ["--help"]
