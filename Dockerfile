# syntax=docker/dockerfile:1

# Base images, pinned by exact tag. Neither digest could be confirmed from an authoritative
# source when this was written, and distroless publishes no versioned tags: to pin by digest,
# resolve each tag once (`docker buildx imagetools inspect IMAGE`) and build with
#   --build-arg BUILD_IMAGE=rust:1.95.0-slim-bookworm@sha256:... \
#   --build-arg RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot@sha256:...
ARG BUILD_IMAGE=rust:1.95.0-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

# Build: the binary only, in the `dist` profile (the release profile optimised as one unit).
FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked --bin tokengate \
    && cp target/dist/tokengate /tokengate

# Run: glibc and nothing else (no shell, no package manager), the binary only, as the numeric
# non-root user distroless calls "nonroot" (numeric, so Kubernetes' runAsNonRoot can verify it).
# TLS roots are compiled in (webpki-roots), so no CA bundle is needed. No config is baked in:
# mount yours at /etc/tokengate/config.toml (config/docker.toml to try it with the simulator).
FROM ${RUNTIME_IMAGE}
COPY --from=build /tokengate /usr/local/bin/tokengate
USER 65532:65532
EXPOSE 8080
# The image has no curl: the binary probes itself. Plain HTTP to the default listener; with
# another port or an admin listener, override it (docker run --health-cmd, compose healthcheck).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["/usr/local/bin/tokengate", "healthcheck", "--url", "http://127.0.0.1:8080/readyz"]
ENTRYPOINT ["/usr/local/bin/tokengate"]
CMD ["serve", "--config", "/etc/tokengate/config.toml"]
