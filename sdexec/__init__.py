"""sdexec: run processes as transient systemd units (Flux sdexec, standalone)."""
