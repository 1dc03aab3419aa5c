"""Integrations with RL frameworks: each attaches a framework's own scheduling seam to the daemon
as an ordinary worker, through dynaresized.client. Optional extras; nothing in the daemon
imports them."""
