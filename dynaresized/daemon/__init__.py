"""The daemon shell: sockets, timers, the event store and systemd around the sans-IO core."""
