"""The simulator: the daemon's core and policies over a virtual cluster in virtual time."""
