# build.sh's stand-in for rust:<version>-bookworm, for machines with no container registry:
# the debootstrap base, the C tool chain and rdma-core headers the verbs backend needs (sideway
# runs cmake and bindgen), and the host's own rustup toolchain (bin/ and lib/ only), which
# build.sh puts in the context as toolchain/. Not for users with a registry: they build from
# rust:1.95-bookworm (Dockerfile's default RUST_IMAGE).
ARG BASE_IMAGE=dinomo-base:bookworm
FROM ${BASE_IMAGE}
USER root
RUN set -eu; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc libc6-dev make binutils pkg-config cmake libclang-dev \
        libibverbs-dev librdmacm-dev ca-certificates; \
    rm -rf /var/lib/apt/lists/*
COPY toolchain /usr/local/rust
# The same variables as the rust images: cargo's home (registry, git checkouts) is
# /usr/local/cargo, which build.sh replaces with a cached bind mount.
ENV CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN mkdir -p /usr/local/cargo && rustc --version && cargo --version
