# syntax=docker/dockerfile:1
# trainctl in a container: the binary and nothing else it does not need.
#
#   docker build -t trainctl .                          # CPU image (debian:bookworm-slim)
#   docker build -t trainctl:cuda \
#     --build-arg RUNTIME_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu22.04 .   # CUDA variant
#
# The CUDA variant only changes the runtime base (CUDA libraries for GPU nodes); this build of
# trainctl trains on the CPU until a GPU backend lands (see ARCHITECTURE.md, "Device").

ARG RUST_VERSION=1.95
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p trainctl \
 && cp target/release/trainctl /usr/local/bin/trainctl

FROM ${RUNTIME_IMAGE}
# ca-certificates: the data job downloads over HTTPS, and S3 is HTTPS. The pods run as
# uid/gid 1000 (the manifests' securityContext); CUDA images based on Ubuntu 24.04 already have
# a user 1000.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && (getent passwd 1000 >/dev/null || (groupadd -g 1000 trainctl && useradd -u 1000 -g 1000 -m -s /usr/sbin/nologin trainctl))
COPY --from=build /usr/local/bin/trainctl /usr/local/bin/trainctl
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["trainctl"]
CMD ["--help"]
