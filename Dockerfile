# One image for every Floodgate component: the `floodgate` CLI is the entry point, the
# command picks the component (`extproc`, `controller`, `sim`, `load`, ...).
#
#   docker build -t floodgate:local .
#   docker run --rm floodgate:local extproc --help
#
# Envoy and Redis are not in this image: compose.yaml runs their official images.
# Pinned (a patch release on a Debian release): rebuilding gets the same interpreter.
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Exactly what the distribution installs (pyproject's package-dir: every folder it maps), with
# the `k8s` extra because the controller's Kubernetes actuator and EndpointSlice discovery run
# from this image. tests/deploy/test_image.py repeats these COPY and pip lines in a clean
# virtualenv and runs every command compose.yaml and deploy/kubernetes run.
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY floodgate ./floodgate
COPY extproc ./extproc
COPY controller ./controller
COPY sim ./sim
COPY bench ./bench
COPY envoy ./envoy
# The dependency versions the test suite ran (constraints.txt), not the newest of the day.
RUN pip install -c constraints.txt '.[k8s]' && rm -rf /src

RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin floodgate
USER 10001
WORKDIR /home/floodgate

# gRPC ext_proc, processor /metrics, emulated vLLM API.
EXPOSE 50051 9464 8000
ENTRYPOINT ["floodgate"]
CMD ["--help"]
