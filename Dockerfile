# The operator image: the controller and the step runner are the same binary
# (`agentrun controller`, `agentrun step`; step Jobs run this image too), plus
# the kubectl plugin. Build and load into kind:
#
#   docker build -t agentrun:dev .
#   kind load docker-image agentrun:dev
#
# tests/packaging.rs checks this file without a container engine: the build
# context holds every file the two binaries are compiled from, the binaries
# copied below are the ones the build stage produces, the final user is not root.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Cargo.toml declares every target (also the e2e node, the stand-ins and the
# benchmark), so their sources are part of the context; only the two shipped
# binaries are built.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY e2e/node ./e2e/node
COPY e2e/standins ./e2e/standins
COPY benches ./benches
ENV CARGO_PROFILE_RELEASE_STRIP=symbols
# cargo's target directory is a build cache (BuildKit's and buildah's
# `--mount=type=cache`): a rebuild after a source change compiles only this
# crate, not every dependency again. The binaries are copied out of it into
# the layer.
RUN --mount=type=cache,target=/cargo-target,sharing=locked \
    CARGO_TARGET_DIR=/cargo-target cargo build --release --locked --bin agentrun --bin kubectl-agentrun \
    && mkdir -p target/release \
    && cp /cargo-target/release/agentrun /cargo-target/release/kubectl-agentrun target/release/

FROM debian:bookworm-slim
# Roots for TLS to model providers and tools (rustls reads the system bundle).
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /src/target/release/agentrun /usr/local/bin/agentrun
COPY --from=build /src/target/release/kubectl-agentrun /usr/local/bin/kubectl-agentrun
# The uid the chart and the step Jobs run as (runAsNonRoot needs a numeric user).
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/agentrun"]
