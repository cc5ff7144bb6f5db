# The two commands: `make demo` runs the service end to end on embedded
# defaults; `make test` runs every check CI runs (.ci/run calls it).

GO       ?= go
PKGS     := ./...
VERSION  ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS  := -X main.version=$(VERSION)

# staticcheck, pinned: `make test` runs it, and a new version is a change of
# its own (go run fetches it through the module proxy and caches the build).
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

# The Kubernetes manifests' tests are a module of their own, so that the
# Kubernetes libraries stay out of go.mod; ./... above does not reach them.
K8S_DIR := deploy/kubernetes

.PHONY: demo test build run migrate fmt-check vet lint fuzz bench chaos clean

## demo: run the whole pipeline on a throwaway Postgres and an in-process Kafka broker
# (scripts/install-postgres.sh installs PostgreSQL's server binaries when they
# are missing; with DATABASE_URL set the demo uses that server instead;
# DEMO_FLAGS='--console 127.0.0.1:8081' also serves the operator console)
demo:
	@[ -n "$$DATABASE_URL" ] || scripts/install-postgres.sh
	$(GO) run ./cmd/demo $(DEMO_FLAGS)

## test: gofmt, go vet, staticcheck, and every test with the race detector (real Postgres, in-process broker, kcat), and the offline checks of the Kubernetes manifests
test: fmt-check vet lint
	cd $(K8S_DIR) && $(GO) test -count=1 ./...
	$(GO) test -race -count=1 -timeout 30m $(PKGS)

## build: build bin/scheduler
build:
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/scheduler ./cmd/scheduler

## run: build and run against DATABASE_URL and KAFKA_BROKERS from the environment
run: build
	./bin/scheduler run --migrate

## migrate: apply migrations to DATABASE_URL
migrate: build
	./bin/scheduler migrate

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet $(PKGS)
	cd $(K8S_DIR) && $(GO) vet ./...

lint:
	$(GO) run $(STATICCHECK) $(PKGS)
	cd $(K8S_DIR) && $(GO) run $(STATICCHECK) ./...

## fuzz: fuzz the protocol parser, record signing, the policy grammar, the error-class patterns and the configuration, FUZZTIME each (default 1m)
# go test -fuzz keeps what it generates in its cache and writes a failing
# input to the package's testdata/fuzz only on failure, where it then runs
# as a regression case in every `make test`; a failure exits non-zero and so
# stops make (and CI).
FUZZTIME ?= 1m
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./internal/defer/protocol
	$(GO) test -run '^$$' -fuzz '^FuzzSign$$' -fuzztime $(FUZZTIME) ./internal/defer/protocol
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./internal/policy
	$(GO) test -run '^$$' -fuzz '^FuzzClassifier$$' -fuzztime $(FUZZTIME) ./internal/policy
	$(GO) test -run '^$$' -fuzz '^FuzzConfig$$' -fuzztime $(FUZZTIME) ./internal/config

## bench: measure the service against the DB ceiling, the broker and River (BENCH_QUICK=1: about 4 minutes; see docs/benchmarks.md)
bench:
	@[ -n "$$DATABASE_URL" ] || scripts/install-postgres.sh
	$(GO) run ./cmd/bench

## chaos: three schedulers under SIGKILLs, a PostgreSQL restart and broker faults; checks no loss, per-key order, bounded duplicates (CHAOS_SHORT=1: the short run `make test` includes; see docs/chaos.md)
chaos:
	scripts/install-postgres.sh
	$(GO) run ./cmd/chaos

clean:
	rm -rf bin
