# The course's two commands: `make book` builds the HTML book, `make test` proves everything in it.
# Both create the virtual environment .venv on first use. Python 3.11 or later.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BUILD_FLAGS := --warningiserror --keep-going
# the API page imports lib.attention from the checkout
export PYTHONPATH := $(CURDIR)

.PHONY: measure bench-gpu book test test-lib test-notebooks test-notebooks-other-cpu test-book test-browser lint notebooks colab
.PHONY: test-colab test-in-order test-beside test-grader
.PHONY: bench lock clean help models

help:
	@echo "make book       build the HTML book into _build/html"
	@echo "make test       lint, library tests, strict nbval over every chapter and the guide (twice: on this CPU's"
	@echo "                arithmetic and on another), the book build, the browser check (with axe-core from npm),"
	@echo "                test-colab, and test-grader"
	@echo "make test-grader the grader run whole on every chapter's solutions, right answers, mistakes and cheats"
	@echo "make test-colab every Colab edition run to its end on each package set in requirements/ (Colab's GPU and"
	@echo "                CPU runtimes, the course's floors), each in its own environment under .venv-sets/"
	@echo "make notebooks  re-run every chapter and the guide, storing their outputs (after changing one or the library)"
	@echo "make models     retrain the models chapters 11 and 13 load (lib/weights/), after changing a recipe in lib/trained.py"
	@echo "make colab      rewrite the Colab editions in colab/chapters and colab/guide (after make notebooks)"
	@echo "make student    rewrite the student editions in student/chapters and the graded-exercise table (after make colab)"
	@echo "make grade SUBMISSIONS=dir   run and score a folder of handed-in student notebooks"
	@echo "make measure    what a reader meets on each page of the built book (after make book)"
	@echo "make bench      speed and memory of the library against PyTorch's fused kernel"
	@echo "make bench-gpu  the GPU paths (flash_attention, attention, tiled_attention) against SDPA, on a CUDA GPU"

# torch's CPU build, about 190 MB, where PyPI has only the CUDA build (Linux x86-64: 2.6 GB, and a Triton pin that
# conflicts with ours). The index is added only where it answers: pip would retry an unreachable one for every package.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_OPTION = $$($(PYTHON) -c 'import urllib.request as r; r.urlopen("$(TORCH_CPU_INDEX)/torch/", timeout=10); \
	print("--extra-index-url $(TORCH_CPU_INDEX)")' 2>/dev/null)

$(STAMP): requirements.txt constraints.txt
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11 or later is needed")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -c constraints.txt $(TORCH_INDEX_OPTION)
	touch $@

book: $(STAMP)
	$(BIN)/jupyter-book build . $(BUILD_FLAGS)
	@echo "The book is at $(CURDIR)/_build/html/index.html"

# test-colab runs beside the rest (make -j2): its environments download and unpack while the library tests compute,
# and its notebooks run one at a time; then, on the same side, the grader's tests on whole chapters. The rest runs in
# order, as before.
test: $(STAMP)
	$(MAKE) -j2 --output-sync=line test-beside test-in-order

test-beside: $(STAMP)
	$(MAKE) -j1 test-colab test-grader

test-in-order: $(STAMP)
	$(MAKE) -j1 lint test-lib test-notebooks test-notebooks-other-cpu test-book test-browser

lint: $(STAMP)
	$(BIN)/ruff check lib tests tools benchmarks chapters guide

# loadfile: a file stays on one worker, so the compile report compiles each architecture once, not once per worker
test-lib: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not browser and not grader" tests

# each test grades a class of notebooks, two sandboxes at a time
test-grader: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -m grader tests

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -n 2 --dist loadfile --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg chapters guide

# The same notebooks again under another CPU arithmetic: torch's vector kernels off (ATEN_CPU_CAPABILITY=default),
# OpenBLAS on its AVX2 kernels where the CPU has AVX2, one thread. The committed outputs must not change: an output
# that does depends on the CPU that wrote it (a last-bit error printed, a model trained in the chapter; see
# lib/trained.py), and would fail on a learner's machine.
OTHER_CPU := ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
	$(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo OPENBLAS_CORETYPE=Haswell)

test-notebooks-other-cpu: $(STAMP)
	$(OTHER_CPU) $(BIN)/python -m pytest -p no:cacheprovider -n 2 --dist loadfile --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg chapters guide

test-book: $(STAMP)
	rm -rf _build/html
	$(BIN)/jupyter-book build . $(BUILD_FLAGS)

# The Colab editions as learners get them: each package set of requirements/ (Colab's GPU runtime, its CPU runtime
# without Triton, the course's floors) is installed into its own environment under .venv-sets/ (once, rebuilt when the
# set file changes: the only download), then every notebook in colab/ runs top to bottom in it, one at a time, and
# must reach its end with no error but its cells tagged raises-exception. Every set runs even if one fails.
PACKAGE_SETS := $(sort $(wildcard requirements/*.txt))

test-colab: $(STAMP)
	@status=0; for set in $(PACKAGE_SETS); do $(BIN)/python tools/package_sets.py run $$set || status=1; done; exit $$status

CHROMIUM := $(shell command -v chromium-headless-shell || command -v chromium)
# The browser check audits every page with axe-core, pinned in package.json and package-lock.json; npm ci installs
# it into node_modules (git-ignored). Without npm the audit is skipped, saying so.
NPM := $(shell command -v npm)
AXE := node_modules/axe-core/axe.min.js

$(AXE): package.json package-lock.json
ifeq ($(NPM),)
	@echo "SKIPPED installing axe-core: no npm here (apt-get install npm); the browser check skips its accessibility audit"
else
	$(NPM) ci --ignore-scripts --no-audit --no-fund
	touch $@
endif

test-browser: $(STAMP) $(AXE)
ifeq ($(CHROMIUM),)
	@echo "SKIPPED the browser check of the built book: no headless Chromium here (apt-get install chromium-headless-shell)"
else
	$(BIN)/python -m pytest -p no:cacheprovider -n 2 tests/test_book_browser.py
endif

measure: $(STAMP)
	$(BIN)/python tools/measure_book.py

models: $(STAMP)
	$(BIN)/python tools/train_models.py

notebooks: $(STAMP)
	$(BIN)/python tools/refresh_notebooks.py

colab: $(STAMP)
	$(BIN)/python tools/make_colab.py

# For instructors: the student editions in student/chapters (and the instructors' table of graded exercises), and the
# grader, which runs each handed-in notebook under SUBMISSIONS in a fresh kernel and prints a score table.
.PHONY: student grade
student: $(STAMP)
	$(BIN)/python tools/make_student.py

SUBMISSIONS ?=
grade: $(STAMP)
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder-of-handed-in-notebooks"; exit 2; }
	$(BIN)/python tools/grade.py "$(SUBMISSIONS)"

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_attention.py

# The GPU benchmark uses the machine's own Python: it needs PyTorch with CUDA and Triton (Colab's, say), which the
# CPU-only .venv does not have.
bench-gpu:
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_gpu.py --csv benchmarks/gpu_results.csv

lock: $(STAMP)
	@echo "# Exact versions of everything requirements.txt pulls in, so a fresh machine builds the book CI built." > constraints.txt
	@echo "# Regenerate with: make lock" >> constraints.txt
	$(BIN)/python -m pip freeze | sed 's/+cpu$$//' >> constraints.txt

clean:
	rm -rf _build node_modules
