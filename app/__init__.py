"""The composition root: `builder.build_app` wires the deployments into the
application `serve_config.yaml` names, and `cli` is the `preempt-serve`
command.  Only entry points (the command, a benchmark that starts its own
server, tests) import it; `deployments/` and the packages below never do.
"""
