# The operator image: the controller and the step runner are the same binary
# (`agentrun controller`, `agentrun step`; step Jobs run this image too), plus
# the kubectl plugin. Build and load into kind:
#
#   docker build -t agentrun:dev .
#   kind load docker-image agentrun:dev
#
# e2e/suites/tests/packaging.rs checks this file without a container engine:
# the build context holds every file the two binaries are compiled from, the
# binaries copied below are the ones the build stage produces (release by
# default), the final user is not root.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# The operator's package, and the manifests of the workspace's other members
# (the test fixtures and the suites), which cargo reads to build any of it:
# their targets name their paths, so only what is built needs its sources.
# Only the two shipped binaries are built.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY e2e/node/Cargo.toml ./e2e/node/
COPY e2e/standins/Cargo.toml ./e2e/standins/
COPY e2e/suites/Cargo.toml ./e2e/suites/
ENV CARGO_PROFILE_RELEASE_STRIP=symbols
# The cargo profile: release, the image users run. `--build-arg PROFILE=dev`
# builds the same stages unoptimised, minutes faster (the e2e tests' real
# node does, see e2e/realnode/build-operator-image.sh).
ARG PROFILE=release
# cargo's target directory is a build cache (BuildKit's and buildah's
# `--mount=type=cache`): a rebuild after a source change compiles only this
# crate, not every dependency again. The binaries are copied out of it into
# the layer, to /src/bin.
RUN --mount=type=cache,target=/cargo-target,sharing=locked \
    CARGO_TARGET_DIR=/cargo-target cargo build --profile "$PROFILE" --locked --bin agentrun --bin kubectl-agentrun \
    && out=$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE") \
    && mkdir -p bin \
    && cp "/cargo-target/$out/agentrun" "/cargo-target/$out/kubectl-agentrun" bin/

FROM debian:bookworm-slim
# Roots for TLS to model providers and tools (rustls reads the system bundle).
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /src/bin/agentrun /usr/local/bin/agentrun
COPY --from=build /src/bin/kubectl-agentrun /usr/local/bin/kubectl-agentrun
# The uid the chart and the step Jobs run as (runAsNonRoot needs a numeric user).
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/agentrun"]
