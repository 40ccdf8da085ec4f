# The operator image: the controller and the step runner are the same binary
# (`agentrun controller`, `agentrun step`), plus the kubectl plugin.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY e2e/node ./e2e/node
COPY crds ./crds
RUN cargo build --locked --release --bin agentrun --bin kubectl-agentrun

FROM debian:bookworm-slim
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin agentrun
COPY --from=build /src/target/release/agentrun /usr/local/bin/agentrun
COPY --from=build /src/target/release/kubectl-agentrun /usr/local/bin/kubectl-agentrun
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/agentrun"]
