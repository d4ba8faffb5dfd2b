# Entry points for people and CI: set-up is part of every target, so a fresh machine needs only `make`.
PYTHON ?= python3
APT_PACKAGES := mosquitto dataset-fashion-mnist chromium chromium-driver
STAMP := .make-stamps

.PHONY: demo camera-demo test lint docs install system-deps python-deps arm64-check arm64-deps clean

demo: install
	$(PYTHON) -m bench simulate --devices 4 --partition type1 --strategy avefl --rounds 10 \
		--acquisitions-per-round 1 --labels-per-acquisition 400 --epochs 5 --sampler margin \
		--mc-passes 10 --init-samples 100 --pool-size 12000 --seed 0

# The field loop on a camera fleet: 4 devices of rendered scenes, EfficientNet-Lite0 (ImageNet, head-only) on the Pi
# Zero 2 W profile, predicting with the serving model; the guide's pooled head and sampler
# (typical-then-balanced-margin); the bench's person answers their queries on the coordinator's labelling page (its
# HTTP API, the dashboard's token); 5 rounds of 20 labels, each promoted only if it is no worse; prints each round's
# gate decision, the serving version, predictions per device and the report's path.
camera-demo: install
	$(PYTHON) benchmarks/camera_bench.py --backbones efficientnet-lite0 --samplers typical-then-balanced-margin \
		--seeds 0 --loop \
		--out runs/camera-demo-$$(date +%Y%m%d-%H%M%S)

# Two workers on the 2-core machine (most integration tests wait on processes and deadlines), then the tests that
# time a process against the wall clock, by themselves.
test: install
	$(PYTHON) -m pytest -q -n 2 -m "not alone"
	$(PYTHON) -m pytest -q -m alone

# The guides as a static site in site/ (mkdocs.yml: strict, so a broken link or a page outside the nav fails).
docs: python-deps
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

lint: python-deps
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

install: system-deps python-deps

# The device install on emulated arm64 boards (run as root; see docs/deployment.md): Debian bookworm and trixie roots
# (cached in /var/cache/edge-fal-arm64) on qemu's Cortex-A53 and A72, the same selections as the host, one field round
# accepted, and onnxruntime 1.21.0 forced in seen dying with SIGILL (the check's test of itself); skips in one line
# where binfmt_misc is unavailable.
arm64-check: install arm64-deps
	$(PYTHON) .ci/arm64_check.py

arm64-deps:
	@if ! command -v qemu-aarch64-static >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap; \
	fi

system-deps: $(STAMP)/system
$(STAMP)/system:
	@mkdir -p $(STAMP)
	@if ! command -v mosquitto >/dev/null 2>&1 || ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1 \
		|| [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
	fi
	@touch $@

python-deps: $(STAMP)/python
$(STAMP)/python: pyproject.toml
	@mkdir -p $(STAMP)
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[coordinator,test]'
	@touch $@

clean:
	rm -rf $(STAMP) runs site .pytest_cache
