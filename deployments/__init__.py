"""The Ray Serve deployments: wiring between the API, the scheduler and the engine."""

# How often a stopping replica looks again for requests still in flight.
# Serve's default (2 s) makes every delete or redeploy of an application
# wait that long even when nothing is in flight (3 s against 1 s for a
# Scheduler replica); the drain itself stays bounded by each deployment's
# graceful_shutdown_timeout_s.
STOP_POLL_S = 0.1
