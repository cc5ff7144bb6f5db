# syntax=docker/dockerfile:1
#
# The scheduler as a static binary on a distroless base (no shell, runs as
# the nonroot user). Build:
#
#   docker build --build-arg VERSION=$(git describe --always --dirty) -t deferq/scheduler .
#
# compose.yaml builds it for the local stack. The image's default command is
# `run`; `docker run ... deferq/scheduler migrate` applies the migrations.

# The builder's Go must be at least go.mod's (a test compares them).
FROM golang:1.26 AS build
WORKDIR /src

# Modules first, in their own layer: it is rebuilt only when go.mod or go.sum
# change, not on every source edit.
COPY go.mod go.sum ./
RUN go mod download && go mod verify

COPY . .
ARG VERSION=dev
RUN --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /scheduler ./cmd/scheduler

# static-debian12 holds CA certificates (for KAFKA_TLS with the system roots)
# and time zone data, nothing else.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /scheduler /scheduler
USER nonroot:nonroot
# HTTP_ADDR's default: /healthz, /readyz and /metrics.
EXPOSE 8080
ENTRYPOINT ["/scheduler"]
CMD ["run"]
