# Two commands for a new machine (see README):
#   make demo   set everything up, then predict the largest batch of ResNet-50 on an RTX 3090
#   make test   set everything up, then run the test suite (all of it: what CI runs)
#   make test-fast   the edit-test loop: the tests not marked slow
#   make docs   build the docs site, failing on a broken link or reference
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned first so pip never resolves a plain `torch` (a multi-GB download);
# the package itself only asks for torch>=2.4.
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.PHONY: setup demo test test-fast docs bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]' $(TORCH_PIN)
	$(PY) -m compileall -q src  # as a wheel install does (an editable one does not)
	@# the browser tests drive Debian's chromium (playwright's own browser download is not used)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "note: no chromium: the browser tests will be skipped (apt-get install chromium)"
	touch $@

demo: setup
	$(VENV)/bin/batchfit max timm:resnet50 --gpu "RTX 3090" --precision amp-fp16

test: setup
	$(PY) -m pytest -q

# slow: real processes (the real-device search, gloo ranks, fresh interpreters, browsers,
# long sweeps, the docs build); see the marker in pyproject.toml
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) benchmarks/accuracy_cpu.py
