# Two commands matter (see README): `make up` runs the local stack, `make test` runs every test.
# Both create .venv and install the project with its extras on first use.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# constraints.txt pins the runtime dependencies to the versions the image installs.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

PROM_DIR := $(VENV)/tools/prometheus

.PHONY: install up test lint tools
install: $(STAMP)

# wrk drives the overhead and reject benchmarks (and their smoke tests, which skip without it).
# It is a Debian package, not a wheel: installed here when we are root with apt-get (CI is);
# elsewhere a note, and those tests skip.
tools:
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (timeout 120 apt-get update -qq -o Acquire::http::Timeout=10 -o Acquire::Retries=0 >/dev/null 2>&1 \
	      && DEBIAN_FRONTEND=noninteractive timeout 120 apt-get install -y -qq wrk >/dev/null 2>&1) \
	      || echo "note: apt-get could not install wrk; the wrk-driven bench tests will skip"; \
	  else echo "note: wrk is not installed (apt-get install wrk); the wrk-driven bench tests will skip"; fi; }
	@# Prometheus and promtool check the shipped alert rules, the compose stack's Prometheus config
	@# and the Grafana dashboard's queries against the real exporters (tests/deploy/test_prometheus.py).
	@# Debian's package, unpacked into the venv (nothing installed system-wide, no service
	@# started); where apt-get cannot fetch it, a note, and those tests skip.
	@test -x $(PROM_DIR)/usr/bin/promtool || { \
	  rm -rf $(PROM_DIR).tmp && mkdir -p $(PROM_DIR).tmp && cd $(PROM_DIR).tmp && \
	  { timeout 120 apt-get download -qq prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	    timeout 120 apt-get update -qq -o Acquire::http::Timeout=10 -o Acquire::Retries=0 >/dev/null 2>&1 && \
	    timeout 120 apt-get download -qq prometheus >/dev/null 2>&1; }; } && \
	  dpkg -x prometheus_*.deb unpacked && cd - >/dev/null && rm -rf $(PROM_DIR) && \
	  mv $(PROM_DIR).tmp/unpacked $(PROM_DIR) && rm -rf $(PROM_DIR).tmp; } \
	  || { rm -rf $(PROM_DIR).tmp; echo "note: could not fetch Debian's prometheus package (apt-get download prometheus); the Prometheus tests will skip"; }

up: $(STAMP)
	$(VENV)/bin/floodgate up $(ARGS)

# The components install as floodgate.extproc, floodgate.controller, ... (pyproject's
# package-dir); mypy cannot follow that mapping, so it checks a tree of symlinks shaped like the
# installed package.
MYPY_SRC := $(VENV)/mypy-src
COMPONENTS := extproc controller sim bench

# Two workers (pytest-xdist), each file's tests on one of them: the suite spends most of its
# time waiting on the processes it starts, so two run in about half the time on 2 cores.
test: lint tools
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf $(MYPY_SRC) && mkdir -p $(MYPY_SRC)/floodgate
	for f in floodgate/*.py; do ln -s "$(CURDIR)/$$f" $(MYPY_SRC)/floodgate/; done
	for d in $(COMPONENTS); do ln -s "$(CURDIR)/$$d" $(MYPY_SRC)/floodgate/$$d; done
	MYPYPATH=$(MYPY_SRC) $(VENV)/bin/mypy -p floodgate
