# syntax=docker/dockerfile:1

# Build: release binary only.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tokengate \
    && cp target/release/tokengate /tokengate

# Run: a minimal image with glibc and nothing else, as a non-root user. TLS roots are compiled in
# (webpki-roots), so no CA bundle is needed.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /tokengate /usr/local/bin/tokengate
COPY config/docker.toml /etc/tokengate/config.toml
USER nonroot:nonroot
EXPOSE 8080
# Mount your config over /etc/tokengate/config.toml.
ENTRYPOINT ["tokengate"]
CMD ["serve", "--config", "/etc/tokengate/config.toml"]
