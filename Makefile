# Two set-up commands (see README): `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.installed

.PHONY: demo test test-under-load ci-lane-a ci-lane-b test-local stress e2e-local e2e-celery lint typecheck unit process e2e bench bench-fleet bench-parse system-deps clean compat-airflow compat-common-ai

# Compile every installed module's bytecode at install time. Where PYTHONDONTWRITEBYTECODE is set
# (these machines set it), nothing is cached at run time, and every process compiles Airflow and
# pydantic-ai again from source: a task process's imports took 5.5 s, 4.0 s with the bytecode.
# The editable install leaves src/ out, so it is compiled too: the provider's 60 modules a task
# process imports took 178 ms of CPU from source, 132 ms from bytecode. A file edited later is
# compiled from source again (its bytecode is older), never run stale.
UV_COMPILE := --compile-bytecode

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv
	$(UV) pip install --quiet $(UV_COMPILE) --python $(PY) -e '.[dev]'
	$(PY) -m compileall -q src
	touch $(STAMP)

# Debian packages the tests use, as COMMAND:PACKAGE. bubblewrap gives sandbox commands their
# namespaces (namespace mode), util-linux's prlimit and setpriv the boundary profile's limits and
# uid (on every Debian/Ubuntu; listed for minimal images); chromium (headless) renders the Airflow UI's log page and connection
# form (tests/e2e/test_ui_browser.py); redis-server is the CeleryExecutor e2e's broker
# (tests/e2e/test_celery.py); dumb-init is PID 1 of the KubernetesExecutor pods (tests/e2e/test_pods.py);
# postgresql is the Celery e2e's and the fleet benchmark's metadata database (tests/e2e/postgres.py
# finds initdb/postgres under /usr/lib/postgresql/*/bin: Debian puts only postgresql-common's
# pg_ctlcluster on PATH, so that is what is checked).
# What is missing is installed in one apt-get run where we are root;
# elsewhere (and if that fails) the tests that need it skip and say why.
SYSTEM_DEPS := bwrap:bubblewrap prlimit:util-linux setpriv:util-linux chromium:chromium redis-server:redis-server dumb-init:dumb-init pg_ctlcluster:postgresql

RUNTIME_SECCOMP := .cache/runtime-seccomp.json

system-deps: $(RUNTIME_SECCOMP)
	@missing=""; for dep in $(SYSTEM_DEPS); do \
	  command -v $${dep%%:*} >/dev/null 2>&1 || missing="$$missing $${dep#*:}"; done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing) || \
	    echo "warning: could not install$$missing: the tests that need it skip and say why"; \
	else echo "note: not installed:$$missing: the tests that need it skip and say why"; fi

# A container runtime's default seccomp profile as it ships (an allowlist), which the restricted-pod
# harness loads (tests/process/restricted_pod.py): /usr/share/containers/seccomp.json of Debian's
# golang-github-containers-common (the profile of CRI-O and podman), unpacked, not installed
# (installing it would pull iptables and CNI plugins). Without it the harness says so and the
# restricted-pod test fails (RESTRICTED_POD_PROFILE=denylist runs the old denylist on purpose).
$(RUNTIME_SECCOMP):
	@mkdir -p $(dir $@); tmp=$$(mktemp -d); \
	( cd $$tmp && { apt-get download -qq golang-github-containers-common >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get download -qq golang-github-containers-common; }; } && \
	  dpkg-deb -x golang-github-containers-common_*.deb unpacked && \
	  cp unpacked/usr/share/containers/seccomp.json $(abspath $@) ) || \
	  echo "warning: could not fetch golang-github-containers-common: the restricted-pod tests fail and say why"; \
	rm -rf $$tmp

demo: $(STAMP) system-deps
	$(PY) -m cancellable_agents.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks example_dags
	$(VENV)/bin/ruff format --check src tests benchmarks example_dags

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# CI runs two lanes side by side (2 cores; an Airflow stack spends most of its time waiting on
# its own loops, so the lanes overlap its waits with the other lane's work):
#   lane A: the LocalExecutor end-to-end suite (with a triggerer and the pods) and the stress
#           test on Airflow 3.3, then the sub-agent, durable, MCP and sandbox process tests;
#   lane B: the other unit and process tests on Airflow 3.3, the supported floor (3.1 +
#           pydantic-ai 2.58), then common.ai and the 3.2 smoke;
# then, alone, the CeleryExecutor end-to-end suite. Its metadata database is PostgreSQL now (SQLite's
# "database is locked" ended components), but nine workers and six retries importing at once still
# starve a 2-core box beside a lane: beside other load (load average 9-10) one run passed in 108 s,
# in another three retries' DAG imports passed the 30 s DagBag timeout.
# Each lane's output is printed when it ends, with its slowest tests (to rebalance the lanes). The
# stress test runs 30 s here; `make stress` runs it for 5 minutes (or
# CANCELLABLE_AGENTS_STRESS_SECONDS).
test: $(STAMP) system-deps lint typecheck
	$(MAKE) --no-print-directory -j2 --output-sync=target ci-lane-a ci-lane-b
	$(MAKE) --no-print-directory e2e-celery

ci-lane-a: $(STAMP) system-deps
	$(MAKE) --no-print-directory e2e-local
	CANCELLABLE_AGENTS_STRESS_SECONDS=$${CANCELLABLE_AGENTS_STRESS_SECONDS:-30} $(MAKE) --no-print-directory stress
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=8 $(LANE_A_PROCESS)

ci-lane-b: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=8 tests/unit tests/process $(addprefix --ignore=,$(LANE_A_PROCESS))
	$(MAKE) --no-print-directory compat-airflow AIRFLOW_COMPAT_RUN=3.1
	$(MAKE) --no-print-directory compat-common-ai compat-airflow AIRFLOW_COMPAT_RUN=3.2

# The process tests lane A runs after its Airflow suites. Their task processes fork from a zygote
# that paid the imports and the in-process execution API once (tests/process/zygote.py). With all
# process tests in lane B (ci15): lane A 466 s (e2e-local 407 s with the pods in two waves, stress
# 59 s), lane B ~800 s (unit + process 489 s, the 3.1 floor 175 s, common.ai and the 3.2 smoke).
# The per-provider kills (10 task processes, ~60 s on a quiet machine) join lane A: lane B also
# runs the floor and common.ai.
LANE_A_PROCESS := tests/process/test_subagent_kill.py tests/process/test_durable_kill.py \
                  tests/process/test_mcp_kill.py tests/process/test_hooks_mcp.py \
                  tests/process/test_provider_kills.py $(sort $(wildcard tests/process/test_sandbox_*.py))

# The process suite and the pod e2e while one busy loop per core takes the machine, as another
# lane and its Airflow would (tests/busy.py): what CI's two lanes do to each other, made certain.
# About 15 minutes on 2 cores; on demand, not part of `make test`.
test-under-load: $(STAMP) system-deps
	$(PY) -m tests.busy -- $(VENV)/bin/pytest -q -p no:cacheprovider tests/process tests/e2e/test_pods.py

test-local: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit tests/process

stress: $(STAMP) system-deps
	CANCELLABLE_AGENTS_STRESS_SECONDS=$${CANCELLABLE_AGENTS_STRESS_SECONDS:-300} \
	  $(VENV)/bin/pytest -q -p no:cacheprovider tests/stress

unit: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit

process: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/process

e2e: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/e2e

e2e-local: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=8 tests/e2e --ignore=tests/e2e/test_celery.py

e2e-celery: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/e2e/test_celery.py

bench: $(STAMP) system-deps
	$(PY) -m benchmarks.run

# N concurrent durable agents on a real Airflow, on SQLite and on PostgreSQL (benchmarks/fleet.py):
# minutes per database; for a quiet machine, not CI.
bench-fleet: $(STAMP) system-deps
	$(PY) -m benchmarks.fleet

# CPU per parse of an agent DAG file in the dag-processor's own fork-per-parse machinery, beside a
# BashOperator DAG and common.ai's AgentOperator (benchmarks/parse_cost.py): about a minute.
bench-parse: $(STAMP)
	$(PY) -m benchmarks.parse_cost

# The supported floor: the provider on older Airflow, each in its own venv built with the main
# venv's uv. Real SIGTERMs go through that Airflow's own Task SDK handler (tests/process); the
# session refuses to start if the venv holds another Airflow than the one it is meant to test.
# The floor (first version) runs the full subset; later ones a smoke, to keep the run short.
# Process tests whose code imports neither Airflow nor pydantic-ai (the local sandbox, process
# trees, the reaper; tests/unit/test_ci_lanes.py holds that): the floor would run them exactly as
# the 3.3 lanes do, so it does not (~100 s of its ~310 s on 2 cores).
VERSION_FREE_PROCESS := tests/process/test_proc.py tests/process/test_reaper.py \
                  tests/process/test_sandbox_command.py tests/process/test_sandbox_confinement.py \
                  tests/process/test_sandbox_egress.py tests/process/test_sandbox_hardening.py \
                  tests/process/test_sandbox_kill.py tests/process/test_sandbox_local.py \
                  tests/process/test_sandbox_restricted_pod.py \
                  tests/process/test_sandbox_workdirs.py tests/process/test_sandbox_leftovers.py
# The floor's MCP stack is another generation (fastmcp 3, mcp 1.x): a stdio server closed in the
# protocol's order and a remote one cancelled prove the hooks hold there; the rest is the same code.
MCP_FLOOR_SMOKE := tests/process/test_mcp_kill.py::test_stdio_server_cleanup_on_cancel_finishes \
                  tests/process/test_mcp_kill.py::test_streamable_http_tool_sees_the_cancellation
# The per-provider kills on the floor: Bedrock's (our socket shutdown; pydantic-ai 2.58 does not
# close a started Bedrock stream itself). The others depend on what each SDK version does;
# pydantic-ai 2.58 cannot drive today's anthropic SDK ("Cannot instantiate typing.Union"), and has
# no get_wrapper_model hook (run/_open_streams.py: Gemini's stream cancelled between chunks).
PROVIDER_FLOOR_SMOKE := tests/process/test_provider_kills.py::test_each_providers_request_is_closed_by_the_kill[bedrock] \
                  tests/process/test_provider_kills.py::test_a_bedrock_request_blocked_in_its_thread_is_closed_by_the_kill
AIRFLOW_COMPAT := 3.1 3.2
COMPAT_TESTS   := tests/unit/test_airflow_compat.py tests/unit/test_mixin.py tests/unit/test_provider.py \
                  tests/unit/test_example_dags.py tests/unit/test_runner.py tests/unit/test_subagents.py \
                  tests/unit/test_scope.py tests/unit/test_journal.py tests/unit/test_durable_record.py \
                  tests/unit/test_fingerprint.py tests/unit/test_durable_stores.py tests/unit/test_usage.py \
                  tests/unit/test_durable_operator.py tests/unit/test_server_stop.py \
                  tests/unit/test_approval.py tests/unit/test_approval_operator.py tests/unit/test_dag_test_compat.py \
                  tests/unit/test_deferral.py tests/unit/test_cancellations_view.py \
                  tests/process $(addprefix --ignore=,$(VERSION_FREE_PROCESS)) \
                  --ignore=tests/process/test_mcp_kill.py $(MCP_FLOOR_SMOKE) \
                  --ignore=tests/process/test_provider_kills.py $(PROVIDER_FLOOR_SMOKE)
COMPAT_SMOKE   := tests/unit/test_airflow_compat.py tests/unit/test_provider.py \
                  tests/process/test_kill_paths.py::test_streaming_request_is_closed \
                  tests/process/test_kill_paths.py::test_sigterm_burst_cancels_once \
                  tests/process/test_kill_paths.py::test_kill_before_the_run_is_remembered \
                  tests/process/test_kill_paths.py::test_on_kill_after_sigalrm_records_timeout_and_releases
# Airflow 3.2 does not bound fastapi, and current fastapi breaks its execution API (the import
# fails, so does every dag.test()); Airflow's constraints files pin it, and 3.3 requires <0.137.
AIRFLOW_COMPAT_PINS_3.2 := 'fastapi<0.137'
# The floor venv also holds pydantic-ai's floor (pyproject: >=2.58), so the lowest versions we
# claim are the ones tested.
# With the model SDK extras in dev (bedrock, google, groq, mistral), uv's resolver backtracks to
# Airflow 3.1.0 (whose logging fails on today's structlog: "cannot import name 'Styles'") rather
# than 3.1.8 with the same packages otherwise; the floor is 3.1's latest patch, as it was before.
AIRFLOW_COMPAT_PINS_3.1 := 'pydantic-ai-slim[openai,anthropic]==2.58.*' 'apache-airflow>=3.1.8'

.venv-airflow-%/.installed: pyproject.toml Makefile $(STAMP)
	test -x .venv-airflow-$*/bin/python || $(UV) venv --quiet --python $(PY) .venv-airflow-$*
	$(UV) pip install --quiet $(UV_COMPILE) --python .venv-airflow-$*/bin/python -e '.[dev]' \
	  "apache-airflow>=$*,<$$(echo $* | awk -F. '{print $$1 "." $$2 + 1}')" $(AIRFLOW_COMPAT_PINS_$*)
	touch $@

# Which compat venvs `make compat-airflow` runs (all by default; a CI lane runs one each).
AIRFLOW_COMPAT_RUN ?= $(AIRFLOW_COMPAT)

compat-airflow: $(foreach v,$(AIRFLOW_COMPAT_RUN),.venv-airflow-$(v)/.installed) system-deps
	@set -e; for v in $(AIRFLOW_COMPAT_RUN); do \
	  if [ "$$v" = "$(firstword $(AIRFLOW_COMPAT))" ]; then tests="$(COMPAT_TESTS)"; else tests="$(COMPAT_SMOKE)"; fi; \
	  echo "== Airflow $$v: $$tests"; \
	  CANCELLABLE_AGENTS_EXPECT_AIRFLOW=$$v .venv-airflow-$$v/bin/pytest -q -p no:cacheprovider $$tests; \
	done

# common.ai's model-backed retry policies, wrapped: a cancellation must make zero model calls; and
# common.ai's own operators through cancellable_agents.common_ai, killed with real SIGTERMs (one
# task process runs all kill scenarios, one more the durable retry: ~60 s on 2 cores).
# common.ai registers @task.llm/@task.agent too, so it gets a venv of its own.
.venv-common-ai/.installed: pyproject.toml $(STAMP)
	test -x .venv-common-ai/bin/python || $(UV) venv --quiet --python $(PY) .venv-common-ai
	$(UV) pip install --quiet $(UV_COMPILE) --python .venv-common-ai/bin/python -e '.[dev,common-ai]'
	touch $@

compat-common-ai: .venv-common-ai/.installed
	CANCELLABLE_AGENTS_EXPECT_COMMON_AI=1 .venv-common-ai/bin/pytest -q -p no:cacheprovider \
	  tests/unit/test_retry_common_ai.py tests/unit/test_decorator_names.py tests/unit/test_provider.py \
	  tests/unit/test_common_ai_operators.py tests/process/test_common_ai_kills.py

clean:
	rm -rf $(VENV) .venv-airflow-* .venv-common-ai .pytest_cache .mypy_cache .ruff_cache site
